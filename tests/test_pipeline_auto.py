"""The planner and the pipeline runtime joined (issue #23, deliverable 4): `pm.plan` of a pipelined module is a `Plan`
(its `pipeline` the runtime's own PipelinePlan and cut, its estimate the cost model's, as `autopar.plan` prices the
same override), `microbatches=` defaults to the cost model's choice, and `parallelize(plan="auto")` on a mesh with a
"pp" axis weighs a pipeline and, when one wins, runs it. Real gloo processes, fp64: loss, every gradient and every
parameter after an AdamW step against one device."""

from __future__ import annotations

import pytest
import torch

from dist_harness import gloo_pool
from pipeline_helpers import check

TOL = 1e-10


def _llama():
    from autopar.models import Llama, LlamaConfig
    return Llama(LlamaConfig(num_layers=4, num_heads=4, num_kv_heads=2))


def _batch(batch: int = 8):
    g = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, 128, (batch, 16), generator=g)
    labels = torch.randint(0, 128, (batch, 16), generator=g)
    labels[0, :11] = -100  # ignored labels spread unevenly over the microbatches
    labels[batch - 1, :2] = -100
    return tokens, labels


def _offline(kind: str, memory_limit=None):
    """What `autopar.plan` says, offline, for the same model, batch and axis sizes (fp64, as the workers)."""
    import autopar
    torch.set_default_dtype(torch.float64)
    try:
        torch.manual_seed(0)
        model = _llama()
        if kind == "override":
            return autopar.plan(model, {"pp": 2}, _batch(), plan="dp", overrides={"pipeline": "1f1b@pp"})
        return autopar.plan(model, {"pp": 2}, _batch(), plan="auto", memory_limit=memory_limit)
    finally:
        torch.set_default_dtype(torch.float32)


def _train(kwargs: dict, steps: int = 1, shape=(2,), names=("pp",)):
    """`steps` AdamW steps of `parallelize(model, ("pp",) mesh of 2, **kwargs)` next to one device: the errors of
    every loss, gradient and parameter after each step; whether the later steps ran on the local tensors
    (`autopar.runtime.local_step`); and what `pm.plan` says."""
    import copy
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    import autopar
    from autopar.pipeline_runtime import PipelineModule
    from autopar.runtime import local_step

    torch.manual_seed(0)
    torch.set_default_dtype(torch.float64)
    try:
        ref = _llama()
        model = copy.deepcopy(ref)
        tokens, labels = _batch()
        mesh = init_device_mesh("cpu", shape, mesh_dim_names=names)
        pm = autopar.parallelize(model, mesh, (tokens, labels), **kwargs)
        opt_ref = torch.optim.AdamW(ref.parameters(), lr=0.01)
        opt = torch.optim.AdamW(pm.parameters(), lr=0.01)
        refs = dict(ref.named_parameters())
        errs, mine, local = {}, [], []
        for step in range(steps):
            ref_loss = ref(tokens, labels)
            ref_loss.backward()
            loss = pm(tokens, labels)
            loss.backward()
            errs[f"loss {step}"] = abs(float(loss) - float(ref_loss))
            mine = []
            for n, p in pm.named_parameters():
                if p.grad is None:
                    continue
                mine.append(n)
                g = p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad
                errs[f"grad {n} {step}"] = float((g - refs[n].grad).abs().max())
            local.append(local_step._eligible(opt, (opt,), {}))
            opt_ref.step()
            opt.step()
            opt_ref.zero_grad(set_to_none=True)
            opt.zero_grad(set_to_none=True)
            for n, p in pm.named_parameters():
                if n in mine:
                    full = p.full_tensor() if hasattr(p, "full_tensor") else p
                    errs[f"param {n} {step}"] = float((full - refs[n].detach()).abs().max())
        plan = pm.plan
        return {"errs": errs, "mine": mine, "all": sorted(refs), "rank": dist.get_rank(), "local": local,
                "pipelined": isinstance(pm, PipelineModule), "plan": plan.to_json(), "text": str(plan),
                "explain": plan.explain()}
    finally:
        torch.set_default_dtype(torch.float32)


def test_pm_plan_is_the_priced_plan_and_microbatches_default_to_the_cost_models_choice():
    from autopar.plan import Plan
    offline = _offline("override")  # microbatches=None offline too: the planner's choice, said in explain()
    (decision,) = [d for d in offline.decisions if d.kind == "pipeline"]
    assert "microbatches: the planner's choice" in decision.decided_by
    steps = {int(r.label.split(", ")[1].split()[0]): r.time_s for r in decision.candidates}
    assert len(steps) >= 2 and offline.pipeline.microbatches == min(steps, key=steps.get)
    results = gloo_pool(2).run(_train, dict(plan="dp", overrides={"pipeline": "1f1b@pp"}), 3)
    check(results)
    # the first step makes AdamW's state on the DTensors; the later ones run on the local tensors (the other stage's
    # parameters, without gradient or state, passed over), and still match one device exactly
    assert [r["local"] for r in results] == [[False, True, True]] * 2
    plans = [Plan.from_json(r["plan"]) for r in results]
    assert plans[0] == plans[1]  # every rank holds the same plan
    run = plans[0]
    assert all(r["pipelined"] for r in results)
    assert run.pipeline.microbatches == offline.pipeline.microbatches
    assert run.pipeline.cut == (0, 2, 4) and run.pipeline.label == "1f1b@pp"
    # the estimate is the cost model's for the run's cut: what autopar.plan gives with the same cut
    assert run.pipeline.cut == offline.pipeline.cut
    assert run.estimate.step_time_s == pytest.approx(offline.estimate.step_time_s, rel=1e-9)
    assert run.estimate.memory_bytes_per_device == offline.estimate.memory_bytes_per_device
    assert len(run.estimate.stages) == 2 and run.estimate.bubble_s > 0
    assert "pipeline: 1f1b@pp" in results[0]["text"]
    assert "microbatches: the planner's choice" in results[0]["explain"]


def test_auto_on_a_pp_mesh_runs_the_pipeline_it_chooses_and_trains_exactly():
    from autopar.plan import Plan
    from autopar.solver import InfeasibleError
    # the premise, computed: a memory limit under which no plan without a pipeline fits (the least any needs, from
    # the ILP's own error) while a pipeline does (its stages hold half the layers each). Without a limit this small
    # Llama runs fastest unpipelined on 2 ranks (its dp step's one fused loss all-reduce is cheap)
    with pytest.raises(InfeasibleError) as no_fit:
        _offline("auto", memory_limit=1)
    least = no_fit.value.least_bytes
    (free,) = [d for d in _offline("auto").decisions if d.kind == "pipeline"]
    piped = [r.memory_bytes for r in free.candidates if "@pp" in r.label]
    assert piped and min(piped) < least, (piped, least)
    limit = (min(piped) + least) // 2
    offline = _offline("auto", memory_limit=limit)  # what autopar.plan(plan="auto") chooses on {"pp": 2}, and why
    assert offline.pipeline is not None and offline.estimate.memory_bytes_per_device <= limit
    results = gloo_pool(2).run(_train, dict(plan="auto", memory_limit=limit))
    check(results)
    assert all(r["pipelined"] for r in results)
    run = Plan.from_json(results[0]["plan"])
    assert run == Plan.from_json(results[1]["plan"])
    # the sub-mesh of a ("pp",) mesh is one device, so the runtime's restriction ('dp' in the stages, no
    # checkpoint level) leaves the same candidates: the same schedule and microbatches as autopar.plan
    assert run.name == "auto" and run.pipeline.label == offline.pipeline.label
    assert run.pipeline.microbatches == offline.pipeline.microbatches
    assert run.pipeline.stages_per_rank == offline.pipeline.stages_per_rank
    (d,) = [d for d in run.decisions if d.kind == "pipeline"]
    assert d.decided_by.startswith("auto: the least estimated step") and "no pipeline" in results[0]["explain"]
    assert run.estimate.step_time_s == pytest.approx(offline.estimate.step_time_s, rel=1e-9)



def _stages_per_rank_with_auto():
    from torch.distributed.device_mesh import init_device_mesh
    import autopar
    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("pp",))
    with pytest.raises(ValueError, match=r"stages_per_rank=2 with plan='auto': auto chooses the schedule.*Fix"):
        autopar.parallelize(_llama(), mesh, _batch(), plan="auto", stages_per_rank=2)
    return True


def test_auto_refuses_stages_per_rank_on_every_rank():
    assert gloo_pool(2).run(_stages_per_rank_with_auto) == [True, True]


def test_pp2_x_dp2_default_microbatches_split_over_the_data_ranks():
    """pp x dp: the cost model's count is one whose microbatch splits over the 2 data-parallel ranks (the runtime's
    'dp' stages), the same as offline with that restriction; training matches one device."""
    from autopar.pipeline_estimate import plan_pipeline
    from autopar.plan import Plan
    torch.set_default_dtype(torch.float64)
    try:
        torch.manual_seed(0)
        offline = plan_pipeline(_llama(), {"pp": 2, "dp": 2}, _batch(), pipeline="1f1b@pp", microbatches=None,
                                plan="dp", divides=2)
    finally:
        torch.set_default_dtype(torch.float32)
    (d,) = [d for d in offline.decisions if d.kind == "pipeline"]
    tried = [int(r.label.split(", ")[1].split()[0]) for r in d.candidates]
    assert tried == [2, 4]  # 8 microbatches of one row cannot split over 2 data ranks
    results = gloo_pool(4).run(_train, dict(plan="dp", overrides={"pipeline": "1f1b@pp"}), 1, (2, 2), ("pp", "dp"))
    check(results)
    run = Plan.from_json(results[0]["plan"])
    assert run.pipeline.microbatches == offline.pipeline.microbatches
    # the estimate is for the run's cut (by FLOPs), which may differ from the cost model's own balanced cut
    torch.set_default_dtype(torch.float64)
    try:
        torch.manual_seed(0)
        same = plan_pipeline(_llama(), {"pp": 2, "dp": 2}, _batch(), pipeline="1f1b@pp",
                             microbatches=run.pipeline.microbatches, plan="dp", cut=run.pipeline.cut)
    finally:
        torch.set_default_dtype(torch.float32)
    assert run.estimate.step_time_s == pytest.approx(same.estimate.step_time_s, rel=1e-9)
    assert run.estimate.memory_bytes_per_device == same.estimate.memory_bytes_per_device
