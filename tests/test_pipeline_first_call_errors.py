"""A raise in a pipeline stage's very first forward or backward, and in zbv's forward-only walk, is raised on every
rank within moments, naming the failing rank, stage and microbatch (issue #23). Before, torch's schedules ran their
metadata inference (one real forward and backward outside the guarded stage methods) on the first call and on each
switch between forward-only and training calls, and a megatron stage's first computation had no recorded collectives
to replay, so its tp peer waited in an all-reduce for the process group's timeout. Now every stage's metadata is
static (`PipelineStage(input_args=, output_args=)`: no inference runs) and a tensor-parallel stage learns its
program's collectives at build by a dry run (`_GuardedStage.learn_collectives`, local stand-ins for the
collectives), checked here against the real runs'.

One pool of 4 gloo ranks whose process-group timeout is 15 s (a hang fails fast, with another error than the one
injected), fp64, tiny models; each failing call must raise on every rank within 10 s.
- plan 'dp' and 'fsdp' on a (pp 2, dp 2) mesh, stage 0 on ranks 0-1, stage 1 on 2-3, 1f1b, 2 microbatches: the
  first call raises in stage 1's forward of microbatch 0 on rank 2 (its data peer, rank 3, does not); on a second
  model the first call raises in stage 0's first backward on rank 1; then each model's first forward-only call
  raises in stage 1 on rank 3; under zbv (stages 0 and 3 on ranks 0-1) the first call is forward-only and raises in
  stage 1 on rank 2. After them each model trains one step exactly: loss, every gradient, every parameter after
  AdamW against one device.
- plan 'megatron' on (pp 2, tp 2): 1f1b, a 2-layer Llama: the first call raises mid-backward of microbatch 0 on
  rank 1 (before its 8th tp all-reduce: the second of its first backward), then the first forward-only call
  raises mid-forward on rank 3; zbv, a 4-layer Llama: the first call, forward-only, raises mid-forward of stage 0
  on rank 1. Each failing call issues on every rank the tp all-reduces of a normal call (counted), leaves no
  gradient; then a step is exact.
"""
from __future__ import annotations

import torch

from dist_harness import gloo_pool
from pipeline_helpers import exact_step

TOL = 1e-10
PG_TIMEOUT_S = 15


def _error(call):
    """(the error's type name, message, notes, seconds) of `call()`, or None for the error if it did not raise."""
    import time
    t0, error = time.perf_counter(), None
    try:
        call()
    except Exception as e:  # noqa: BLE001 - recorded
        error = (type(e).__name__, str(e), "\n".join(getattr(e, "__notes__", [])))
    return error, time.perf_counter() - t0


def _raise_on(pm, rank: int, stage: int, kind: str):
    """A hook raising ValueError on `rank`'s stage program, in its first forward or backward; returns its remover."""
    import torch.distributed as dist
    from test_pipeline_errors import _on_output_grad
    if dist.get_rank() != rank:
        return lambda: None
    calls = []

    def boom(*_):
        calls.append(1)
        if len(calls) == 1:
            raise ValueError(f"stage {stage} saw a NaN in its {kind}")
    gm = pm._stage_modules[stage].gm
    handle = gm.register_forward_pre_hook(boom) if kind == "forward" else gm.register_forward_hook(
        _on_output_grad(boom))
    return handle.remove


def _data_stages(plan: str):
    """Per model: its failing first calls ((stage, kind, rank, forward only), each on its first call of that kind),
    their errors; then an exact step."""
    import copy
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    import autopar
    from test_pipeline_errors import Blocks

    torch.set_default_dtype(torch.float64)
    try:
        torch.manual_seed(0)
        ref = Blocks()
        x, y = torch.randn(8, 8), torch.randn(8, 8)
        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("pp", "dp"))
        out = {"rank": dist.get_rank(), "failures": [], "errs": {}, "mine": []}
        runs = [("1f1b", [(1, "forward", 2, False), (1, "forward", 3, True)]),
                ("1f1b", [(0, "backward", 1, False)]),
                ("zbv", [(1, "forward", 2, True)])]
        for form, injections in runs:
            model = copy.deepcopy(ref)
            pm = autopar.parallelize(model, mesh, (x, y), plan=plan, overrides={"pipeline": f"{form}@pp"},
                                     microbatches=2, stages_per_rank=2 if form == "zbv" else None)
            for stage, kind, rank, forward_only in injections:
                remove = _raise_on(pm, rank, stage, kind)
                with torch.set_grad_enabled(not forward_only):
                    error, elapsed = _error(lambda: pm(x, y))
                remove()
                out["failures"].append({"form": form, "stage": stage, "kind": kind, "rank": rank, "error": error,
                                        "elapsed": elapsed,
                                        "grads": [n for n, p in pm.named_parameters() if p.grad is not None]})
            one = copy.deepcopy(ref)
            errs, mine = exact_step(one, pm, (x, y))
            out["errs"].update({f"{form} {k}": v for k, v in errs.items()})
            out["mine"] = sorted(set(out["mine"]) | set(mine))
        return out
    finally:
        torch.set_default_dtype(torch.float32)


def _megatron_stages():
    """megatron on (pp 2, tp 2): 1f1b's first call raising mid-backward, its first forward-only call mid-forward;
    zbv's first call (forward only) mid-forward; the tp all-reduces each issued against a normal call's."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    import autopar
    from pipeline_helpers import Count, llama, reference_and_batch
    from test_pipeline_tp_errors import _RaiseBefore

    torch.set_default_dtype(torch.float64)
    try:
        out = {"rank": dist.get_rank(), "failures": [], "errs": {}, "mine": [], "dry": []}
        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("pp", "tp"))
        # (form, layers, [(rank, before its nth all-reduce, what it is in, forward only)])
        runs = [("1f1b", 2, [(1, 8, "backward", False), (3, 2, "forward", True)]),
                ("zbv", 4, [(1, 2, "forward", True)])]
        for form, layers, injections in runs:
            ref, model, tokens, labels = reference_and_batch(lambda: llama(num_layers=layers), 4, 16, ignored=False)
            pm = autopar.parallelize(model, mesh, (tokens, labels), plan="megatron",
                                     overrides={"pipeline": f"{form}@pp"}, microbatches=2)
            dry = {st.stage_index: dict(st._dry) for st in pm._stages}
            for rank, nth, kind, forward_only in injections:
                inject = _RaiseBefore(rank, nth)
                try:
                    with torch.set_grad_enabled(not forward_only), Count() as failing:
                        error, elapsed = _error(lambda: pm(tokens, labels))
                finally:
                    inject.remove()
                with torch.set_grad_enabled(not forward_only), Count() as normal:
                    loss = pm(tokens, labels)  # a normal call of the same kind (its gradients never released)
                del loss
                out["failures"].append({
                    "form": form, "rank": rank, "nth": nth, "kind": kind, "error": error, "elapsed": elapsed,
                    "same reduces": sorted(failing.reduces) == sorted(normal.reduces) and bool(normal.reduces),
                    "grads": [n for n, p in pm.named_parameters() if p.grad is not None]})
            errs, mine = exact_step(ref, pm, (tokens, labels))
            out["errs"].update({f"{form} {k}": v for k, v in errs.items()})
            out["mine"].append(sorted(mine))
            # the dry run's collectives are the real runs' (each computation's last complete run)
            real = {st.stage_index: dict(st._comms) for st in pm._stages}
            out["dry"].append({k: {w: [c[:3] for c in v] for w, v in d.items()} for k, d in dry.items()} ==
                              {k: {w: [c[:3] for c in v] for w, v in d.items()} for k, d in real.items()})
        return out
    finally:
        torch.set_default_dtype(torch.float32)


def _check(results, stage_of):
    for r in results:
        for f in r["failures"]:
            assert f["error"] is not None, (r["rank"], f)
            kind, message, notes = f["error"]
            stage = stage_of(f)
            assert kind == "ValueError", (r["rank"], f)
            assert f"rank {f['rank']} raised this in pipeline stage {stage}'s {f['kind']} of microbatch 0 " in notes, \
                (r["rank"], notes)
            assert "raised on every rank" in notes and "stays usable" in notes, notes
            assert f["elapsed"] < 10.0, f  # not the process group's timeout
            assert f["grads"] == [], f
        bad = {k: v for k, v in r["errs"].items() if not v <= TOL}
        assert not bad, (r["rank"], bad)


def test_first_call_errors_in_dp_and_fsdp_stages_reach_every_rank():
    from test_pipeline_errors import Blocks
    pool = gloo_pool(4, pg_timeout_s=PG_TIMEOUT_S)
    for plan in ("dp", "fsdp"):
        results = pool.run(_data_stages, plan)
        _check(results, lambda f: f["stage"])
        for r in results:
            for f in r["failures"]:
                assert f"stage {f['stage']} saw a NaN in its {f['kind']}" in f["error"][1], f
        assert {n for r in results for n in r["mine"]} == {n for n, _ in Blocks().named_parameters()}


def test_first_call_errors_in_megatron_stages_reach_every_rank():
    from pipeline_helpers import llama
    results = gloo_pool(4, pg_timeout_s=PG_TIMEOUT_S).run(_megatron_stages)
    _check(results, lambda f: 0 if f["rank"] < 2 else 1)
    for r in results:
        for f in r["failures"]:
            assert f"rank {f['rank']} saw a NaN before its all-reduce {f['nth']}" in f["error"][1], f
            assert f["same reduces"], f  # every tp all-reduce of a normal call, on every rank
        assert r["dry"] == [True, True], r["dry"]
    for i, layers in enumerate((2, 4)):
        assert {n for r in results for n in r["mine"][i]} == {n for n, _ in llama(num_layers=layers).named_parameters()}
