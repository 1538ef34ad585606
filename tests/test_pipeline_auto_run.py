"""`parallelize(plan="auto")` on a mesh with a pipeline axis runs the plan auto priced (issue #23, deliverable 4):
its schedule, microbatches, cut and each rank's stage plan with its checkpoint level (`autopar.pipeline_auto_run`).
Under a memory limit no unpipelined plan fits and the first stage of 1F1B (holding two microbatches) must
recompute while the last need not: the run checkpoints exactly the layers `pm.plan.checkpoint` names (their regions
recompute once per microbatch), matches one device in fp64 (loss, every gradient, every parameter after AdamW) and
sends exactly one activation forward and one gradient back per microbatch. Real gloo processes."""

from __future__ import annotations

import torch

from dist_harness import gloo_pool
from pipeline_helpers import check, reference_and_batch, train_steps

LIMIT = 600_000  # bytes per device: no unpipelined plan fits (asserted), 1F1B fits with stage 0 recomputing
BATCH, SEQ, HIDDEN = 8, 16, 32


def _llama():
    from autopar.models import Llama, LlamaConfig
    return Llama(LlamaConfig(num_layers=2, num_heads=4, num_kv_heads=2, hidden=HIDDEN))


def _run(limit: int, microbatches: int | None):
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    import autopar
    from autopar.pipeline_runtime import PipelineModule
    from autopar.runtime.checkpoint import Checkpointed
    torch.set_default_dtype(torch.float64)
    try:
        ref, model, tokens, labels = reference_and_batch(_llama, BATCH, SEQ)
        mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("pp",))
        pm = autopar.parallelize(model, mesh, (tokens, labels), plan="auto", memory_limit=limit,
                                 microbatches=microbatches)
        assert isinstance(pm, PipelineModule)
        regions = [m for k in pm.local_stages for m in pm._stage_modules[k].modules() if isinstance(m, Checkpointed)]
        errs: dict = {}
        for _, c, mine in train_steps(ref, pm, (tokens, labels), errs, steps=1):
            p2p, reduces = c.p2p, c.reduces
        plan = pm.plan
        return {"errs": errs, "mine": mine, "all": sorted(dict(ref.named_parameters())), "rank": dist.get_rank(),
                "regions": sorted((m.path, m.level, m.recomputes) for m in regions), "p2p": p2p, "reduces": reduces,
                "plan": plan.to_json(), "explain": plan.explain()}
    finally:
        torch.set_default_dtype(torch.float32)


def test_auto_runs_the_priced_pipeline_with_its_stage_checkpoint_levels_exactly():
    from autopar.plan import Plan
    # microbatches given (one row each) to keep the search short: auto still chooses the schedule, the cut and
    # every rank's stage plan and level
    results = gloo_pool(2).run(_run, LIMIT, BATCH)
    check(results)  # loss, every gradient, every parameter after one AdamW step: one device's
    assert max(v for r in results for v in r["errs"].values()) <= 1e-12
    run = Plan.from_json(results[0]["plan"])
    assert run == Plan.from_json(results[1]["plan"])
    # the premise, from the plan's own decision: no plan without a pipeline fits, the pipeline chosen fits
    (d,) = [d for d in run.decisions if d.kind == "pipeline"]
    assert "without a pipeline: no plan fits" in d.decided_by and run.estimate.fits
    assert run.estimate.memory_bytes_per_device <= LIMIT
    pp = run.pipeline
    assert pp.label == "1f1b@pp" and pp.cut == (0, 1, 2) and pp.microbatches == BATCH
    m = pp.microbatches
    # what ran is what was priced: stage 0 (two microbatches in flight) recomputes its layers, stage 1 does not
    levels = dict(run.checkpoint)
    assert levels == {"layers.0": "selective", "layers.1": "none"}, levels
    assert results[0]["regions"] == [("layers.0", "selective", m)]  # recomputed once per microbatch
    assert results[1]["regions"] == []
    # explain() names each rank's stage plan
    for words in ("pp=0: plan 'dp'", "checkpoint selective", "pp=1: plan 'dp'", "checkpoint none",
                  "weighs only the stage plans the pipeline runtime runs: 'dp'", "not weighed: the ILP's free"):
        assert words in results[0]["explain"], words
    # the collectives: one activation per microbatch forward, its gradient back; no collective inside the
    # stages (the sub-mesh of a (pp,) mesh is one device)
    mb_bytes = BATCH // m * SEQ * HIDDEN * 8
    assert sorted(results[0]["p2p"]) == sorted([("isend", mb_bytes)] * m + [("irecv", mb_bytes)] * m)
    assert sorted(results[1]["p2p"]) == sorted([("irecv", mb_bytes)] * m + [("isend", mb_bytes)] * m)
    assert results[0]["reduces"] == results[1]["reduces"] == []


TP_LIMIT = 330_000  # bytes per device on pp2 x tp2: megatron stages fit with stage 0 recomputing (asserted)


def _priced_megatron():
    """The plan parallelize(plan='auto')'s search builds on pp2 x tp2 for its megatron stages (runnable=True): on
    every rank alike (offline, deterministic)."""
    from autopar import pipeline_estimate as pe
    from autopar.pipeline_auto_run import with_search_note
    _, model, tokens, labels = reference_and_batch(_llama, BATCH, SEQ)
    sizes = {"pp": 2, "tp": 2}
    tried = pe.auto_pipeline(model, sizes, (tokens, labels), "pp", memory_limit=TP_LIMIT, runnable=True,
                             microbatches=BATCH)
    (t,) = [t for t in tried if t.fits and "'megatron' stages" in t.label and t.label.startswith("1f1b")]
    return with_search_note(pe.build_chosen(t, "auto: the test's", (), sizes), model, sizes, "pp")


def _run_megatron():
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from autopar.pipeline_runtime import parallelize_pipeline
    from autopar.runtime import collectives as C
    from autopar.runtime.checkpoint import Checkpointed
    from passes.checkpoint import walk
    torch.set_default_dtype(torch.float64)
    try:
        priced = _priced_megatron()
        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("pp", "tp"))
        ref, model, tokens, labels = reference_and_batch(_llama, BATCH, SEQ)
        pp = priced.pipeline
        # what parallelize(plan='auto') calls with the plan it chose (autopar.api)
        pm = parallelize_pipeline(model, mesh, (tokens, labels), value=pp.label, microbatches=pp.microbatches,
                                  stages_per_rank=pp.stages_per_rank, plan="megatron",
                                  overrides={"pipeline": pp.label}, inputs="global", mp_policy=None, auto=priced)
        gms = [pm._stage_modules[k].pm.graph_module for k in pm.local_stages]
        regions = [m for gm in gms for m in gm.modules() if isinstance(m, Checkpointed)]
        errs: dict = {}
        with C.record_comms() as records:
            for _, c, mine in train_steps(ref, pm, (tokens, labels), errs, steps=1):
                p2p = c.p2p
        return {"rank": dist.get_rank(), "errs": errs, "mine": mine, "all": sorted(dict(ref.named_parameters())),
                "checkpoint": priced.checkpoint, "plan is priced": pm.plan == priced, "p2p": p2p,
                "regions": sorted((m.path, m.level, m.recomputes) for m in regions),
                # the forward all-reduces of the stage program (megatron's row-parallel outputs), those in regions
                "forward all-reduces": sum(1 for gm in gms for n in walk(gm) if n.target is C.all_reduce),
                "in regions": sum(1 for m in regions for n in m.body.graph.nodes if n.target is C.all_reduce),
                "records": sorted({(r.kind, r.axis, r.pass_): 0 for r in records}.keys()),
                "counts": {p: sum(1 for r in records if r.pass_ == p) for p in ("forward", "backward", "recompute")},
                "forms": sorted({(s.key.split(".", 2)[-1], s.form, s.axes) for k in pm.local_stages
                                 for s in pm._stage_modules[k].pm.plan.strategies})}
    finally:
        torch.set_default_dtype(torch.float32)


def test_auto_megatron_stage_plans_run_their_forms_and_levels_on_pp2_x_tp2():
    results = gloo_pool(4).run(_run_megatron)
    check(results)  # loss, every gradient, every parameter after AdamW: one device's
    assert max(v for r in results for v in r["errs"].values()) <= 1e-12
    levels = dict(results[0]["checkpoint"])
    assert levels == {"layers.0": "selective", "layers.1": "none"}, levels  # the premise: stage 0 recomputes
    m = BATCH
    # the build's dry run of a tp stage (pipeline_runtime `learn_collectives`, in parallelize_pipeline: before the
    # steps' `record_comms`, collectives as local stand-ins) runs the program without grad, then with grad and its
    # backward once per backward kind: "full" only under 1f1b (no split backward), so 1 backward, 1 recompute of
    # each region, which `recomputes` counts; none of its (stand-in) collectives is in the steps' records
    dry_backwards = 1
    for r in results:
        assert r["plan is priced"]
        stage0 = r["rank"] in (0, 1)  # mesh (pp, tp): ranks 0, 1 run stage 0
        assert r["regions"] == ([("layers.0", "selective", m + dry_backwards)] if stage0 else [])
        # megatron's forms on tp in every stage program (checked against the priced plan when built)
        assert any(form != "replicate" and axes == ("tp",) for _, form, axes in r["forms"]), r["forms"]
        # every collective is megatron's all-reduce on tp; the recompute re-issues the checkpointed layer's forward
        # all-reduces once per microbatch (and nothing else); stage 0's forward issues its program's all-reduces once
        # per microbatch (no metadata-inference run: the dry run gives torch the stage's output metadata)
        assert {(kind, axis) for kind, axis, _ in r["records"]} == {("all_reduce", "tp")}
        assert r["counts"]["recompute"] == m * r["in regions"] and (r["in regions"] > 0) == stage0
        if stage0:
            assert r["in regions"] == 2
            assert r["counts"]["forward"] == m * r["forward all-reduces"], r["counts"]
        assert len(r["p2p"]) == 2 * m  # one send and one receive per microbatch
