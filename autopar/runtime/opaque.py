"""Opaque submodules: a submodule that cannot be traced runs as one graph node, on each rank's rows when batch-local.

`torch.export` cannot trace data-dependent Python control flow (branching on tensor values, loops
over `nonzero()`). Rather than fail the whole model, capture replaces such a submodule's forward,
for the duration of the trace, with a call of the custom op `autopar::opaque(key, inputs, params)`:
its parameters stay graph inputs (so they keep their names and become DTensors), its output
shapes come from one eager run on the example inputs. The op has no sharding rule; capture checks
numerically whether its rows are independent (`passes.batch_local`: each row of its outputs, and of
its inputs' gradients, from the same row alone). If so it is *batch-local*: on a data axis each rank
runs it on its own rows of the batch, its parameters replicated (their gradients partial, reduced by data
parallelism), and its fake kernel gives the outputs the rows its inputs have (`_out_shapes`: `out_meta`
holds the example's, global shapes). Otherwise (it mixes rows: a batch mean, BatchNorm in training; or
it draws random numbers, so it could not be checked) the node is replicated: inputs gathered, computed
redundantly on every rank, output replicated. Either way its local form (`passes.local_forms`) makes the
node call `run_opaque`, the module's own forward on the tensors it gets (local rows or gathered batch)
with the local parameters under autograd, so backward is the module's own backward on what its forward
saved: the forward runs once per step (the custom op's autograd, for a graph run unlowered, runs it under
no_grad and recomputes it in backward: twice the forward's FLOPs, and a second draw of any dropout).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn
from torch.func import functional_call
from torch.utils import _pytree as pytree


@dataclass
class OpaqueModule:
    path: str
    module: nn.Module
    param_names: list[str]
    out_spec: pytree.TreeSpec
    out_meta: list[tuple[tuple[int, ...], torch.dtype]]  # of the example (global) inputs
    reason: str
    # batch-local (`passes.batch_local`): (the example's batch size, the batch dim of each input (params after the
    # inputs; None: unbatched), of each output); None: not batch-local, or not checked
    rows: tuple | None = None
    # why its rows can never be split, whatever a numerical check would find (`autopar.canonical_losses`: CTC
    # targets concatenated in one 1-D tensor); None: checked as usual
    not_rows: str | None = None


_OPAQUE: dict[str, OpaqueModule] = {}


def _run(key: str, inputs: list[torch.Tensor], params: list[torch.Tensor]) -> list[torch.Tensor]:
    entry = _OPAQUE[key]
    out = functional_call(entry.module, dict(zip(entry.param_names, params)), tuple(inputs))
    flat, _ = pytree.tree_flatten(out)
    return [t for t in flat if isinstance(t, torch.Tensor)]


def run_opaque(key: str, inputs: list[torch.Tensor], params: list[torch.Tensor]) -> list[torch.Tensor]:
    """The lowered opaque node: the module's forward under autograd (see the module docstring)."""
    return _run(key, list(inputs), list(params))


@torch.library.custom_op("autopar::opaque", mutates_args=())
def opaque(key: str, inputs: list[torch.Tensor], params: list[torch.Tensor]) -> list[torch.Tensor]:
    with torch.no_grad():
        return [t.clone() for t in _run(key, inputs, params)]


@opaque.register_fake
def _(key: str, inputs: list[torch.Tensor], params: list[torch.Tensor]) -> list[torch.Tensor]:
    entry = _OPAQUE[key]
    device = inputs[0].device if inputs else params[0].device
    return [torch.empty(shape, dtype=dtype, device=device) for shape, dtype in _out_shapes(entry, inputs)]


def _out_shapes(entry: OpaqueModule, inputs: list[torch.Tensor]) -> list[tuple[tuple[int, ...], torch.dtype]]:
    """The output shapes for these inputs: the example's, with a batch-local module's batch dims at the rows its
    inputs have (the local shard's rows, on a rank of a data axis)."""
    if entry.rows is None:
        return entry.out_meta
    batch, in_dims, out_dims = entry.rows
    rows = next((x.shape[d] for x, d in zip(inputs, in_dims) if d is not None), batch)
    return [(tuple(rows if i == d else s for i, s in enumerate(shape)), dtype)
            for (shape, dtype), d in zip(entry.out_meta, out_dims)]


def _setup(ctx, inputs, output):
    key, xs, params = inputs
    ctx.key = key
    ctx.save_for_backward(*xs, *params)
    ctx.num_inputs = len(xs)


def _backward(ctx, grads):
    saved = ctx.saved_tensors
    xs = [t.detach().requires_grad_(t.is_floating_point()) for t in saved[: ctx.num_inputs]]
    params = [t.detach().requires_grad_(t.is_floating_point()) for t in saved[ctx.num_inputs:]]
    with torch.enable_grad():
        outs = _run(ctx.key, xs, params)
    pairs = [(o, g) for o, g in zip(outs, grads) if g is not None and o.requires_grad]
    wrt = [t for t in xs + params if t.requires_grad]
    got = torch.autograd.grad([o for o, _ in pairs], wrt, [g for _, g in pairs], allow_unused=True) if pairs else \
        [None] * len(wrt)
    it = iter(got)
    res = [next(it) if t.requires_grad else None for t in xs + params]
    return None, res[: ctx.num_inputs], res[ctx.num_inputs:]


opaque.register_autograd(_backward, setup_context=_setup)


def make_opaque_forward(key: str):
    entry = _OPAQUE[key]

    def forward(*args, **kwargs):
        if kwargs or not all(isinstance(a, torch.Tensor) for a in args):
            raise TypeError(f"opaque submodule {entry.path} must be called with tensor positional arguments only")
        params = [p for _, p in entry.module.named_parameters()]
        outs = torch.ops.autopar.opaque(key, list(args), params)
        return pytree.tree_unflatten(list(outs), entry.out_spec)

    return forward


def register(path: str, module: nn.Module, example_out, reason: str) -> str:
    flat, spec = pytree.tree_flatten(example_out)
    if not all(isinstance(t, torch.Tensor) for t in flat):
        raise TypeError(f"opaque submodule {path} returns non-tensor values; only tensor outputs are supported")
    key = f"{path}#{id(module)}"
    _OPAQUE[key] = OpaqueModule(path, module, [n for n, _ in module.named_parameters()], spec,
                                [(tuple(t.shape), t.dtype) for t in flat], reason)
    return key


def describe(key: str) -> OpaqueModule:
    return _OPAQUE[key]
