"""DTensor pointwise ops whose other arguments are Python numbers, run directly on the local shard.

Why: torch 2.13's DTensor dispatch has a C++ fast path with a sharding cache, but a Python number passed where
the schema says `Tensor` (`p.mul_(0.9)`, `p.add_(1e-8)`, `p / 2.0`: aten's `.Tensor` overloads get a wrapped
0-dim tensor) makes it bail out to Python, which builds a replicated spec for the number and an `OpSchema` on
every call: 80-170 us against 5 us on a plain tensor. A number in a `Scalar` slot that changes every call
(`lerp_(g, w)` under a schedule, `aten.mul_.Scalar(p, lr)`) misses the cache and re-runs sharding propagation:
milliseconds. Single-tensor optimizers (torch's default on CPU) issue several such ops per parameter and step.

The contract: `install()` (idempotent; `ParallelModule` calls it) registers one handler in DTensor's own
custom-op table for every pointwise ATen op (`torch.Tag.pointwise`, no out= variant, no random op, one tensor
returned) that takes an argument besides `self`. The handler runs the op on the local tensors and re-wraps the
result with the input's spec when all of these hold, and otherwise hands the call back to DTensor's own dispatch
unchanged:
- the first argument is a DTensor; every other tensor argument is a DTensor of the same layout (mesh,
  placements, shape and strides: the elements are partitioned alike, nothing broadcasts); no keyword is a tensor,
  no argument a container;
- every placement is `Replicate` or a `Shard` (an elementwise op commutes with any partition of the
  elements). `Partial` is refused: `add(Partial, 1)` would add 1 on every rank;
- an out-of-place result has the local input's shape and strides (then its global meta is the input's, dtype
  aside);
- no tracing (`torch.compile`, fake tensors) and no `DebugMode` is active.
Same-layout DTensor arguments pay about what DTensor's C++ fast path costs (+1-3 us, measured); the Python
numbers are what the handler is for.
The numbers are the ones the slow path computes: both end in the same ATen kernel on the same local tensors
(tested bitwise, `tests/test_scalar_ops.py`). `fast_path(False)` turns the handler off for a block
(process-wide; the tests and `benchmarks/dp_vs_ddp.py --slow-scalars` use it).
The table is process-wide, so the fast path applies to every DTensor in the process, not only autopar's.
"""

from __future__ import annotations

import contextlib

import torch
from torch.distributed._functional_collectives import _are_we_tracing
from torch.distributed.tensor import DTensor
from torch.distributed.tensor._dtensor_spec import DTensorSpec, TensorMeta
from torch.utils._debug_mode import get_active_debug_mode

_PYTHON_DISPATCHER = torch._C.DispatchKey.PythonDispatcher
_OPS: dict | None = None  # op -> whether it writes its first argument (in place)


def _handled_ops() -> dict:
    """Every pointwise ATen overload the handler is registered for, and whether it is in place (computed once)."""
    global _OPS
    if _OPS is None:
        random = DTensor._op_dispatcher._random_ops
        ops = {}
        for name in torch.ops.aten:
            packet = getattr(torch.ops.aten, name)
            for overload in packet.overloads():
                op = getattr(packet, overload)
                schema = op._schema
                if (torch.Tag.pointwise in op.tags and op not in random and "out" not in schema.overload_name
                        and not any(a.is_out for a in schema.arguments) and len(schema.arguments) > 1
                        and len(schema.returns) == 1 and str(schema.returns[0].type) == "Tensor"
                        and not any(a.alias_info is not None and a.alias_info.is_write
                                    for a in schema.arguments[1:])):
                    alias = schema.arguments[0].alias_info
                    ops[op] = alias is not None and alias.is_write
        _OPS = ops
    return _OPS


def install() -> None:
    """Registers the handler in DTensor's custom-op table for every op of `_handled_ops()` (idempotent; an op
    that already has a handler, DTensor's own or another library's, keeps it)."""
    table = DTensor._op_dispatcher._custom_op_handlers
    for op in _handled_ops():
        table.setdefault(op, _handler)


@contextlib.contextmanager
def fast_path(enabled: bool):
    """Within the block the handler is in DTensor's table (enabled) or out of it (every call dispatched exactly as
    torch does); process-wide. The table is as before afterwards."""
    table = DTensor._op_dispatcher._custom_op_handlers
    before = {op for op in _handled_ops() if table.get(op) is _handler}
    if enabled:
        install()
    else:
        for op in before:
            del table[op]
    try:
        yield
    finally:
        for op in _handled_ops():
            if op in before:
                table.setdefault(op, _handler)
            elif table.get(op) is _handler:
                del table[op]


def _local_result(op, args: tuple, kwargs: dict):
    """The op run on the local shards and re-wrapped, or None where the fast path does not apply."""
    self = args[0]
    if type(self) is not DTensor:
        return None
    spec = self._spec
    meta = spec.tensor_meta
    local_args = [self._local_tensor]
    for a in args[1:]:
        if isinstance(a, DTensor) and _same_layout(a._spec, spec):
            local_args.append(a._local_tensor)
        elif isinstance(a, (torch.Tensor, list, tuple, dict)):
            return None
        else:
            local_args.append(a)
    for a in kwargs.values():
        if isinstance(a, (torch.Tensor, list, tuple, dict)):
            return None
    for p in spec.placements:
        if not (p.is_replicate() or p.is_shard()):
            return None
    if (torch._C._len_torch_dispatch_stack() or torch._C._dispatch_tls_is_dispatch_key_included(_PYTHON_DISPATCHER)
            or torch.compiler.is_compiling()) and (_are_we_tracing() or get_active_debug_mode() is not None):
        return None  # the cheap tests first: _are_we_tracing alone costs more than the rest of this function
    out = op._op(*local_args, **kwargs)
    if _OPS[op]:  # in place: the placements and meta are unchanged
        return self
    local = self._local_tensor
    if not isinstance(out, torch.Tensor) or out.shape != local.shape or out.stride() != local.stride():
        raise _Mismatch(out)
    if out.dtype != meta.dtype:
        spec = DTensorSpec(spec.mesh, spec.placements, TensorMeta(meta.shape, meta.stride, out.dtype),
                           shard_order=spec.shard_order)
    return DTensor(out, spec, requires_grad=out.requires_grad)


def _same_layout(a: DTensorSpec, b: DTensorSpec) -> bool:
    """Two DTensors whose elements are partitioned alike: the same mesh, placements, shape and strides (the
    dtypes may differ)."""
    if a is b:
        return True
    ma, mb = a.tensor_meta, b.tensor_meta
    return a.mesh is b.mesh and a.placements == b.placements and ma.shape == mb.shape and ma.stride == mb.stride


class _Mismatch(Exception):
    """An out-of-place result whose layout the input's spec does not describe: recomputed by DTensor."""


def _handler(op, args: tuple, kwargs: dict):
    try:
        out = _local_result(op, args, kwargs)
    except _Mismatch:
        out = None  # out-of-place, nothing was written: safe to recompute
    if out is not None:
        return out
    return _dispatch_without_handler(op, args, kwargs)


def _dispatch_without_handler(op, args: tuple, kwargs: dict):
    """DTensor's own dispatch of the call: the handler leaves the table for the duration of the call (DTensor's
    C++ dispatch looks the table up on every call; there is no Python entry point to its fast path)."""
    table = DTensor._op_dispatcher._custom_op_handlers
    mine = table.get(op) is _handler
    if mine:
        del table[op]
    try:
        return op(*args, **kwargs)
    finally:
        if mine:
            table.setdefault(op, _handler)
