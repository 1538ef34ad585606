"""One tensor-parallel rank raising inside a megatron stage's program is raised on every rank within moments (issue
#23, `autopar.pipeline_runtime._guarded_stage`: the failing rank issues the rest of its program's collectives on NaN,
`autopar.runtime.collectives.replay`; the failure rides on the call's loss all-reduce over the whole mesh).

pp2 x tp2 under `1f1b`, 2 microbatches, a 2-layer Llama (fp64, the shared 4-rank pool). Mesh ranks [[0, 1], [2, 3]]:
stage 0 on ranks 0 and 1, stage 1 on 2 and 3. Injected by raising before the nth tp all-reduce of a call on one rank
(as a NaN check or an OOM between two collectives would): rank 1 mid-forward of microbatch 0 (before stage 0's
second forward all-reduce; its tp peer, rank 0, waits in that all-reduce), rank 1 mid-backward of microbatch 0
(before its second backward all-reduce), rank 3 mid-forward of microbatch 0 on the last stage. Without the replay
the peer waits for the process group's timeout (60 s in the pool). Each failing call issues on every rank exactly
the tp all-reduces and p2p of a normal call (counted), leaves no gradient, and raises on every rank the failing
rank's ValueError with a note naming it; after them a step is exact (loss, every gradient, every parameter after
AdamW against one device).
"""
from __future__ import annotations

import torch

from dist_harness import gloo_pool
from pipeline_helpers import Count, exact_step, llama, reference_and_batch

B, S, M = 4, 16, 2
TOL = 1e-10
# (the rank that raises, before its nth tp all-reduce of the call, what it is in)
INJECTIONS = [(1, 2, "forward"), (1, 8, "backward"), (3, 3, "forward")]


class _RaiseBefore:
    """Raises on `rank` before its nth all-reduce looked up through autopar's runtime (`collectives._c10d`)."""

    def __init__(self, rank: int, nth: int):
        import torch.distributed as dist
        from autopar.runtime import collectives as C
        self._C, self._orig, calls = C, C._Functional.__getattr__, []
        orig = self._orig

        def lookup(obj, name):
            if name == "all_reduce" and dist.get_rank() == rank:
                calls.append(1)
                if len(calls) == nth:
                    raise ValueError(f"rank {rank} saw a NaN before its all-reduce {nth}")
            return orig(obj, name)
        C._Functional.__getattr__ = lookup

    def remove(self):
        self._C._Functional.__getattr__ = self._orig


def _failing_tp_steps():
    import time
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    import autopar

    torch.set_default_dtype(torch.float64)
    try:
        ref, model, tokens, labels = reference_and_batch(llama, B, S, ignored=False)
        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("pp", "tp"))
        pm = autopar.parallelize(model, mesh, (tokens, labels), plan="megatron",
                                 overrides={"pipeline": "1f1b@pp"}, microbatches=M)
        pm(tokens, labels)  # no backward: no gradient
        with Count() as normal:
            pm(tokens, labels)
        out = {"rank": dist.get_rank(), "failures": []}
        for rank, nth, kind in INJECTIONS:
            inject = _RaiseBefore(rank, nth)
            t0, error = time.perf_counter(), None
            try:
                with Count() as c:
                    pm(tokens, labels)
            except Exception as e:  # noqa: BLE001 - recorded
                error = (type(e).__name__, str(e), "\n".join(getattr(e, "__notes__", [])))
            finally:
                inject.remove()
            out["failures"].append({
                "rank": rank, "nth": nth, "kind": kind, "error": error, "elapsed": time.perf_counter() - t0,
                "same reduces": sorted(c.reduces) == sorted(normal.reduces), "same p2p": sorted(c.p2p) == sorted(
                    normal.p2p), "grads": [n for n, p in pm.named_parameters() if p.grad is not None]})
        errs, mine = exact_step(ref, pm, (tokens, labels))
        out.update(errs=errs, mine=mine, normal=len(normal.reduces))
        return out
    finally:
        torch.set_default_dtype(torch.float32)


def test_one_tp_rank_raising_inside_a_megatron_stage_is_raised_on_every_rank():
    results = gloo_pool(4).run(_failing_tp_steps)
    for r in results:
        assert r["normal"] == (2 * 5 if r["rank"] < 2 else 2 * 8), r["normal"]  # the tp all-reduces of a call
        for f in r["failures"]:
            assert f["error"] is not None, (r["rank"], f)
            kind, message, notes = f["error"]
            assert kind == "ValueError" and f"rank {f['rank']} saw a NaN before its all-reduce {f['nth']}" in message
            stage = 0 if f["rank"] < 2 else 1
            assert f"rank {f['rank']} raised this in pipeline stage {stage}'s {f['kind']} of microbatch 0 " in notes, \
                notes
            assert "raised on every rank" in notes, notes
            assert f["elapsed"] < 10.0, f  # not the process group's timeout (60 s)
            assert f["same reduces"] and f["same p2p"], f  # every collective of a normal call, on every rank
            assert f["grads"] == [], f
        bad = {k: v for k, v in r["errs"].items() if not v <= TOL}
        assert not bad, (r["rank"], bad)
    assert {n for r in results for n in r["mine"]} == {n for n, _ in llama().named_parameters()}
