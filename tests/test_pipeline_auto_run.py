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
    check(results)  # loss, every gradient, every parameter after one AdamW step: one device's, <= 1e-10
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
