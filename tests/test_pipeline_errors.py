"""An error inside one pipeline stage's computation is raised on every rank within moments (issue #23), naming the
failing rank, its stage and microbatch, and the original exception; the pipelined model stays usable
(`autopar.pipeline_runtime._guarded_stage`, `PipelineModule._raise_failure`).

On 2 gloo ranks (the shared pool), pp2 under `1f1b`, `gpipe` and `zbv` (stages 0 and 3 on rank 0, 1 and 2 on
rank 1, its backward split in input and weight parts), 4 microbatches: stage 1's forward raises on its
2nd microbatch, then stage 0's does, then each one's backward does, then the last stage's loss function (each
injected into the stage's program by a hook, as a NaN check or an OOM would raise there). Without the guard the other rank waits in p2p for the process
group's timeout (60 s in the pool). Each failing step still runs the schedule's every p2p op (counted: the same as
a normal step's), and leaves no gradient; a NaN loss without an error is returned as is. After them both ranks train one step exactly (fp64): the loss, every
gradient and every parameter after an AdamW step against the single-device model. On 4 ranks, pp2 x dp2 under
`plan="fsdp"`: one data rank of stage 0 raises on every microbatch, its peer does not; FSDP's reduce-scatter after
the last microbatch still meets on both (the stand-ins give every parameter a zero gradient).
"""
from __future__ import annotations

import pytest
import torch

from dist_harness import gloo_pool
from pipeline_helpers import exact_step

TOL = 1e-10


class Blocks(torch.nn.Module):
    def __init__(self, layers: int = 4, dim: int = 8):
        super().__init__()
        self.blocks = torch.nn.ModuleList(torch.nn.Linear(dim, dim) for _ in range(layers))

    def forward(self, x, y):
        for b in self.blocks:
            x = x + torch.tanh(b(x))
        return torch.nn.functional.mse_loss(x, y)


def _pp2(last: int):
    """(stage, what raises, on its nth call (0: every call), the rank it is injected on); `last`: the last stage
    (on rank 1, or on rank 0 under zbv's V)."""
    return ((2,), ("pp",), "dp", [(1, "forward", 2, 1), (0, "forward", 2, 0), (1, "backward", 2, 1),
                                  (0, "backward", 2, 0), (last, "loss", 2, 1 if last == 1 else 0)])
# pp2 x dp2 under FSDP: rank 1 (stage 0, data rank 1) raises on every microbatch; rank 0, its data-parallel peer,
# has gradients to reduce-scatter, rank 1 its zero stand-ins' (a parameter with none would be left out there)
FSDP = ((2, 2), ("pp", "dp"), "fsdp", [(0, "forward", 0, 1)])


def _on_output_grad(raise_on_nth):
    """A forward hook whose hook on the stage output's gradient raises (a module's full backward hook would make
    the outputs views, which zbv's split backward cannot detach in place)."""
    def hook(module, args, out):
        (out if isinstance(out, torch.Tensor) else out[0]).register_hook(raise_on_nth)
    return hook


class _RaisingLoss:
    """The schedule's loss function (`autopar.pipeline_runtime._weigh`, a microbatch's loss sum times its weight)
    raising on its nth call, until removed."""

    def __init__(self, raise_on_nth):
        import autopar.pipeline_runtime as R
        self._orig, self._raise = R._weigh, raise_on_nth

        def weigh(*a):
            raise_on_nth()
            return self._orig(*a)
        R._weigh = weigh

    def remove(self):
        import autopar.pipeline_runtime as R
        R._weigh = self._orig


def _failing_steps(form: str, mesh_shape, names, plan, injections):
    """Per injection (`_pp2`): one failing call, after two normal ones; then one exact step."""
    import copy
    import time
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    import autopar
    from test_pipeline_runtime import _P2P

    torch.manual_seed(0)
    torch.set_default_dtype(torch.float64)
    try:
        ref = Blocks()
        model = copy.deepcopy(ref)
        x, y = torch.randn(8, 8), torch.randn(8, 8)
        mesh = init_device_mesh("cpu", mesh_shape, mesh_dim_names=names)
        pm = autopar.parallelize(model, mesh, (x, y), plan=plan, overrides={"pipeline": f"{form}@pp"},
                                 microbatches=4, stages_per_rank=2 if form == "zbv" else None)
        with _P2P() as normal:
            t0 = time.perf_counter()
            pm(x, y)  # no backward: no gradient
            first_s = time.perf_counter() - t0
        with _P2P() as normal:
            t0 = time.perf_counter()
            pm(x, y)
            step_s = time.perf_counter() - t0
        out = {"rank": dist.get_rank(), "failures": [], "step_s": step_s, "first_s": first_s}
        for stage, kind, nth, only in injections:
            sub = pm._stage_modules.get(stage)
            calls = []

            def raise_on_nth(*_):
                calls.append(1)
                if len(calls) == nth or nth == 0:
                    raise ValueError(f"stage {stage} saw a NaN in its {kind}")
            handle = None
            if only == dist.get_rank():
                handle = (sub.gm.register_forward_pre_hook(raise_on_nth) if kind == "forward" else
                          sub.gm.register_forward_hook(_on_output_grad(raise_on_nth)) if kind == "backward" else
                          _RaisingLoss(raise_on_nth))
            t0 = time.perf_counter()
            error = None
            with _P2P() as rec:
                try:
                    pm(x, y)
                except Exception as e:  # noqa: BLE001 - recorded
                    error = (type(e).__name__, str(e), "\n".join(getattr(e, "__notes__", [])))
            elapsed = time.perf_counter() - t0
            if handle is not None:
                handle.remove()
            grads = [n for n, p in pm.named_parameters() if p.grad is not None]
            out["failures"].append({"stage": stage, "kind": kind, "rank": only,
                                    "mb": nth - 1 if nth else 0, "error": error, "elapsed": elapsed,
                                    "same p2p": sorted(rec.ops) == sorted(normal.ops), "grads": grads})
        # a NaN loss with no failure (a NaN in the batch): the ranks find no error to raise; the loss is NaN
        out["nan loss"] = float(pm(torch.full_like(x, float("nan")), y))
        # the model stays usable: the next step is exact
        errs, mine = exact_step(ref, pm, (x, y), nonempty=True)
        out.update(errs=errs, mine=mine)
        return out
    finally:
        torch.set_default_dtype(torch.float32)


@pytest.mark.parametrize("form", ["1f1b", "gpipe", "zbv"])  # zbv: 4 stages, V-shaped, split backward
def test_an_error_on_one_stage_is_raised_on_every_rank(form):
    _check(gloo_pool(2).run(_failing_steps, form, *_pp2(3 if form == "zbv" else 1)), form)


def test_an_error_on_one_data_rank_of_an_fsdp_stage():
    _check(gloo_pool(4).run(_failing_steps, "1f1b", *FSDP), "1f1b")


def _check(results, form):
    for r in results:
        for f in r["failures"]:
            assert f["error"] is not None, (r["rank"], f)
            kind, message, notes = f["error"]
            stage = f["stage"]
            assert kind == "ValueError" and f"stage {stage} saw a NaN in its {f['kind']}" in message, f
            if f["kind"] == "loss":
                assert f"rank {f['rank']} raised this in the loss function on pipeline stage {stage}'s forward of " \
                       "microbatch 1 " in notes, notes
            else:  # zbv's first stage runs its whole backward in the weight step
                what = "weight backward" if (form, stage, f["kind"]) == ("zbv", 0, "backward") else f["kind"]
                assert f"rank {f['rank']} raised this in pipeline stage {stage}'s {what} of microbatch {f['mb']} " \
                    in notes, notes
            assert "raised on every rank" in notes and "stays usable" in notes, notes
            assert f["elapsed"] < 10.0, f  # not the process group's timeout (60 s)
            assert f["same p2p"], f  # the schedule ran to its end on both ranks
            assert f["grads"] == [], f  # a failed call leaves no gradient
        assert r["nan loss"] != r["nan loss"], r["nan loss"]
        bad = {k: v for k, v in r["errs"].items() if not v <= TOL}
        assert not bad, (r["rank"], bad)
    assert {n for r in results for n in r["mine"]} == {n for n, _ in Blocks().named_parameters()}
