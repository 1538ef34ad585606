"""Capture and recognise, the first two stages of every entry point (`autopar.api.parallelize`/`plan`, the pipeline's
one-layer stage model in `autopar.pipeline_estimate`): kept apart from `autopar.api` so that the modules `api` imports
can use it without an import cycle."""

from __future__ import annotations

import time

from autopar.agree import _local_tensor_off
from autopar.capture import Captured, capture, split_example_inputs
from autopar.inputs import global_example
from autopar.mesh import MeshInfo, mesh_info
from autopar.precision import capture_dtypes, cast_inputs, mark_captured
from autopar.relower import plain_inputs
from autopar.repeated import capture_repeated
from autopar.sites import PassContext
from passes.pipeline import RECOGNISE, run_passes


def check_not_torchao_float8(model) -> None:
    """A model still holding torchao `Float8Linear` modules here (recognised by class path, torchao not imported) came
    through an entry point that does not map them (`autopar.torchao_float8.unconvert`, which `autopar.plan` and
    `autopar.parallelize` call first): refused, with what to do, rather than failing inside torch.export on their
    weight subclasses and autograd function ("Unable to cast NotImplemented to Tensor")."""
    from autopar.torchao_float8 import is_float8_linear
    found = [(name, type(m)) for name, m in model.named_modules() if is_float8_linear(m)]
    if found:
        names = ", ".join(repr(n) for n, _ in found[:3]) + (f" and {len(found) - 3} more" if len(found) > 3 else "")
        raise NotImplementedError(
            f"the model holds {len(found)} torchao Float8Linear module(s) ({names}: "
            f"{found[0][1].__module__}.{found[0][1].__name__}), and this entry point (autopar.tune, a pipeline's "
            "stages) does not map them to autopar's fp8 linears: torch.export fails on their float8 weight "
            "subclasses and autograd functions. Fix: autopar.plan / autopar.parallelize without a pipeline (they map "
            "a converted model), or pass the unconverted model (plain nn.Linear) with float8='tensorwise', "
            "'rowwise' or 'auto'")


def _prepare(model, mesh, example_inputs, overrides=None, *, copies: int = 1, progress=None, precision=None,
             reuse_layers: bool = False) -> tuple[MeshInfo, Captured, PassContext]:
    """Capture and recognise: the mesh's axes, the captured program, and its recognised sites. `copies` > 1
    (inputs="local"): captured on that many copies of each batched input (`autopar.inputs.global_example`).
    `precision` (`autopar.precision`): captured with the parameters (and floating inputs) at its param_dtype.
    `reuse_layers` (offline planning only): a list of identical layers is captured as two and copied
    (`autopar.repeated`; the whole model when its layers differ)."""
    check_not_torchao_float8(model)
    info = mesh_info(mesh)
    args, kwargs = split_example_inputs(example_inputs)
    args, kwargs = cast_inputs(precision, *plain_inputs(args, kwargs))
    t0 = time.perf_counter()
    with _local_tensor_off(), capture_dtypes(model, precision):  # tracing runs on fake tensors, not simulated ranks
        args, kwargs = global_example(args, kwargs, copies)
        captured = capture_repeated(model, args, kwargs, capture) if reuse_layers else None
        if captured is None:
            captured = capture(model, args, kwargs)
    mark_captured(captured, model, precision)
    t1 = time.perf_counter()
    if progress:
        progress("capture", t1 - t0)
    ctx = PassContext(captured)
    run_passes(captured.gm, ctx, RECOGNISE)
    if progress:
        progress("recognise", time.perf_counter() - t1)
    return info, captured, ctx


__all__ = ["_prepare"]
