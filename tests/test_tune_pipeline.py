"""`autopar.tune` measures pipeline candidates (issue #23, deliverable 4), 2 gloo ranks, a tiny Llama on a ("pp",)
mesh: tune includes the pipelines the stage model ranks best (what `parallelize(plan="auto")` would run), measures
them in the same rounds as the flat plans, picks the MEASURED fastest (a fake clock slows every other candidate, so
the predicted best loses), caches it, and `plan="tuned"` (and the saved plan's path, the same Plan) runs the same
pipeline (schedule, microbatches, cut), trained exactly against one device (fp64: loss, every gradient, params
after AdamW, the p2p sends counted). The clear errors: microbatches that do not split the batch, or with given
pairs; a bad pair or axis; a saved pipelined plan run with other microbatches or overrides."""

from __future__ import annotations

import pytest
import torch

from dist_harness import gloo_pool
from pipeline_helpers import TOL, Count, llama, reference_and_batch, train_steps

WINNER = "pipeline 1f1b@pp m=4"  # the stage model prices it over the ILP's flat plan; the fake clock makes it fastest


def _tune_pipelines(cache_dir: str):
    import copy
    import os
    import sys

    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    import autopar
    from autopar.pipeline_runtime import PipelineModule
    T = sys.modules["autopar.tune"]

    old_cache, old_step, old_candidates = os.environ.get("XDG_CACHE_HOME"), T._step, T.candidates
    torch.set_default_dtype(torch.float64)
    os.environ["XDG_CACHE_HOME"] = cache_dir
    try:
        ref, model, tokens, labels = reference_and_batch(llama, 4, 16)
        batch = (tokens, labels)
        mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("pp",))
        with pytest.raises(ValueError, match=r"microbatches=3 does not split the batch of 4 rows.*Fix"):
            autopar.tune(model, mesh, batch, microbatches=3)
        with pytest.raises(ValueError, match=r"each given pair names its own microbatch count"):
            autopar.tune(model, mesh, batch, microbatches=2, pipelines=(("1f1b@pp", 2),))
        with pytest.raises(ValueError, match="axis"):
            autopar.tune(model, mesh, batch, pipelines=(("1f1b@tp", 2),))
        with pytest.raises(ValueError, match="pairs"):
            autopar.tune(model, mesh, batch, pipelines=(("1f1b@pp",),))

        def slowed(lv, *args):  # the fake clock: every candidate but WINNER measures 1 s more per step
            seconds, peak = old_step(lv, *args)
            return seconds + (0.0 if lv.cand.name == WINNER else 1.0), peak
        T._step = slowed
        # of the flat plans only the ILP's best (the predicted fastest; the hand plans' lowering is tests/test_tune.py's)
        T.candidates = lambda *a, **k: old_candidates(*a, **k)[:1]
        res = autopar.tune(copy.deepcopy(ref), mesh, batch, top_k=1, steps=1, warmup=0, calibrate=False,
                           progress=False, microbatches=4)
        T._step, T.candidates = old_step, old_candidates
        pipes = [c for c in res.candidates if c.plan.pipeline is not None]
        flat = [c for c in res.candidates if c.plan.pipeline is None]
        assert [c.name for c in pipes] == [WINNER], [c.name for c in res.candidates]
        assert all(c.measured_s is not None and not c.skipped for c in res.candidates), res.table()
        assert min(res.candidates, key=lambda c: c.predicted_s).name != WINNER  # not the predicted winner
        assert res.fastest.name == WINNER and all(c.measured_s > 1.0 for c in res.candidates if c.name != WINNER)
        assert [c.name for c in flat] == ["auto#1"]  # measured alongside the flat plan
        for c in pipes:
            assert c.predicted_s == c.plan.estimate.step_time_s > 0 and len(c.peak_bytes) == 2
            assert c.calibrated_s != c.calibrated_s  # NaN: left out of the calibration (its bubble is not a part)
            assert c.plan.pipeline.cut == (0, 1, 2) and c.plan.pipeline.form == "1f1b"
        table = res.table()
        row = next(line for line in table.splitlines() if line.startswith(WINNER))
        assert "fastest" in row and "pipeline 1f1b@pp, 4 microbatches" in row
        assert f"{pipes[0].predicted_s * 1e3:.2f}" in row  # predicted and measured, side by side

        # the cached winner: plan="tuned" measures nothing (a step now raises) and runs the same pipeline; the saved
        # plan's path names the same Plan, run by the same code (`autopar.tune.parallelize_given_pipeline`)
        def no_step(lv, *args):
            raise AssertionError(f"plan='tuned' measured {lv.cand.name} again instead of reading the cache")
        T._step = no_step
        pm = autopar.parallelize(model, mesh, batch, plan="tuned", microbatches=4)
        T._step = old_step
        assert isinstance(pm, PipelineModule) and pm.pipeline_plan == res.plan.pipeline
        assert pm.pipeline_plan.microbatches == 4 and pm.pipeline_plan.label == "1f1b@pp"
        assert pm.plan.name == res.plan.name and pm.plan.pipeline == res.plan.pipeline
        path = os.path.join(cache_dir, f"plan{dist.get_rank()}.json")
        res.plan.save(path)
        assert T.given_pipeline(path) == res.plan and T.given_pipeline(res.plan) == res.plan
        with pytest.raises(ValueError, match=r"microbatches=2, but plan .* microbatches=4\. Fix"):
            autopar.parallelize(copy.deepcopy(ref), mesh, batch, plan=path, microbatches=2)
        with pytest.raises(ValueError, match=r"overrides=.* a given Plan holds its pipeline"):
            autopar.parallelize(copy.deepcopy(ref), mesh, batch, plan=path, overrides={"mlp": "tp"})
        errs, sends = {}, []
        for _, counter, mine in train_steps(ref, pm, batch, errs, steps=1, counter=Count):
            sends = counter.p2p
        return {"errs": errs, "mine": mine, "all": sorted(dict(ref.named_parameters())), "rank": dist.get_rank(),
                "sends": sends, "winner": res.fastest.measured_s}
    finally:
        T._step, T.candidates = old_step, old_candidates
        torch.set_default_dtype(torch.float32)
        if old_cache is None:
            os.environ.pop("XDG_CACHE_HOME", None)
        else:
            os.environ["XDG_CACHE_HOME"] = old_cache


def test_tune_measures_the_ranked_pipelines_and_the_tuned_pipeline_trains_exactly(tmp_path):
    results = gloo_pool(2).run(_tune_pipelines, str(tmp_path))
    for r in results:
        bad = {k: v for k, v in r["errs"].items() if not v <= TOL}
        assert not bad, f"rank {r['rank']}: {bad}"
    assert set(results[0]["mine"]) | set(results[1]["mine"]) == set(results[0]["all"])
    assert results[0]["winner"] == results[1]["winner"]  # the slowest rank's time, agreed
    # 1F1B, 4 microbatches of 1 row x 16 tokens x hidden 32 in fp64: stage 0 sends each forward activation and
    # receives each gradient, stage 1 the reverse: 8 p2p ops per rank, 4096 bytes each
    for r in results:
        assert sorted(r["sends"]) == sorted([("isend", 4096)] * 4 + [("irecv", 4096)] * 4), r["sends"]


def test_the_ranked_pipelines_are_autos_runnable_ones_in_the_estimates_order():
    """Offline: the top-k of what `parallelize(plan="auto")` weighs on pp2 (`auto_pipeline(runnable=True)`: 2 layers
    leave 1F1B only, over the microbatch counts 2 and 4), best estimated first, priced with 'dp' stages; and a given
    (override, microbatches) pair priced the same way."""
    from autopar.mesh import mesh_info
    from autopar.tune import pipeline_candidates, ranked_pipelines, stage_plan_of
    _, model, tokens, labels = reference_and_batch(llama, 4, 16)
    info = mesh_info({"pp": 2})
    ranked = ranked_pipelines(model, info, (tokens, labels), None, top_k=2)
    assert [c.name for c in ranked] == ["pipeline 1f1b@pp m=2", "pipeline 1f1b@pp m=4"], [c.name for c in ranked]
    assert ranked[0].predicted_s < ranked[1].predicted_s
    for c in ranked:
        assert stage_plan_of(c.plan) == "dp" and c.predicted_s == c.plan.estimate.step_time_s > 0
        assert "autopar.tune: the stage model's" in c.plan.explain()
    (none,) = ranked_pipelines(model, info, (tokens, labels), None, top_k=2, microbatches=1)  # 1F1B needs m >= p
    assert none.skipped.startswith("not run: the stage runtime runs no schedule") and "microbatches=1" in none.skipped
    (c,) = pipeline_candidates(model, info, (tokens, labels), None, (("1f1b@pp", 2),))
    assert c.name == "pipeline 1f1b@pp m=2" and c.plan.pipeline == ranked[0].plan.pipeline
    assert c.predicted_s == pytest.approx(ranked[0].predicted_s, rel=1e-9)



def _cli_factory():
    return llama(), (torch.zeros(4, 16, dtype=torch.long), torch.zeros(4, 16, dtype=torch.long))


def test_cli_passes_microbatches_to_tune(monkeypatch):
    """`python -m autopar tune --microbatches 4` reaches `autopar.tune(microbatches=4)`: the world, the mesh and tune
    stubbed (no process group in the pytest process; the recorder raises a ValueError, which the CLI turns into an
    exit saying it)."""
    import argparse
    import contextlib
    import sys

    import torch.distributed as dist
    import torch.distributed.device_mesh as dm

    from autopar import cli_tune, cli_verify
    seen = {}

    def recorder(model, mesh, inputs, **kw):
        seen.update(kw, mesh=mesh)
        raise ValueError("recorded")
    monkeypatch.setattr(sys.modules["autopar.tune"], "tune", recorder)
    monkeypatch.setattr(cli_verify, "world", contextlib.nullcontext)
    monkeypatch.setattr(dist, "get_world_size", lambda *a: 1)
    monkeypatch.setattr(dm, "init_device_mesh", lambda device, shape, mesh_dim_names: (device, shape, mesh_dim_names))
    parser = argparse.ArgumentParser()
    cli_tune.add_parser(parser.add_subparsers())
    args = parser.parse_args(["tune", "--model", "test_tune_pipeline:_cli_factory", "--mesh-names", "pp",
                              "--microbatches", "4", "--quiet", "--no-cache"])
    with pytest.raises(SystemExit, match="python -m autopar tune: recorded"):
        args.run(args)
    assert seen["microbatches"] == 4 and seen["cache"] is False and seen["mesh"] == ("cpu", (1,), ("pp",))
