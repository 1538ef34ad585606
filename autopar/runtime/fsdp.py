"""FSDP's per-layer gathers at run time: one all-gather per group of parameters, prefetched, resharded after use.

A *group* is the FSDP-sharded parameters of one layer (`autopar.layers`), or those outside the layers used
between two of them (embeddings before the first, final norm and head after the last), as FSDP2 groups a
`fully_shard` unit. Groups outside the layers are kept gathered (FSDP2's root is not resharded after forward). The lowering (`passes.lower.group_fsdp_gathers_pass`) emits per group, in graph order:

    pending = fsdp_prefetch(shards, axes, param_dtype)        # the group's all-gather issued, not waited
    fulls = fsdp_gather(shards, pending, axes, dims, label, keep, param_dtype, reduce_dtype)

`fsdp_gather` sits right before the group's first use; the next group's `fsdp_prefetch` right after it, before
this group's compute, so that gather overlaps it. The first group has no prefetch (`pending` None: gathered
at its first use).

Per group the local shards are copied into one flat buffer (cast to `param_dtype` when given), all-gathered
once per data axis (innermost first: the result is rank-major, outermost axis leading), and copied out into
one buffer holding every full parameter (views of it are the outputs). Backward copies the full gradients
into one flat buffer (in `reduce_dtype` when given), reduce-scatters it once per data axis (outermost first;
on a real process group asynchronously, waited for at the end of the backward, as `_GradSyncBucket` does) and
returns views of the result (cast back to the shards' dtype).

Uneven shards (`pad`: a parameter whose dim does not divide over the data ranks, `autopar.forms.fsdp.shard_dim`):
each rank holds `torch.chunk`'s chunk (DTensor's `Shard`, nested over the axes: `autopar.spec.shard_layout`), and
travels padded with zeros to the longest; the gathered rows are taken by index (`_uneven`), the padding dropped; the
full gradient is scattered into the padded layout (zeros in the padding), reduce-scattered, and each rank keeps its
own rows, as FSDP2's `_fsdp_param` pads dim 0.

`keep=False` (ZeRO-3, the default): the full parameters are not kept for backward. While `fsdp_step()` is
active (`ParallelModule.forward` enters it around the program), a `saved_tensors_hooks` pair replaces every
saved tensor that is (a view of) a group's gathered buffer by a small handle; in backward the first unpack of
a group gathers it again (one more all-gather per axis), and issues the previous group's re-gather (backward
prefetch); the gathered buffer is dropped when the group's gradients are reduced. Any other saved tensor goes
to the hooks that were active outside (so an outer counter of saved tensors still sees them). `keep=True`
(ZeRO-2-like): autograd keeps the full parameters from forward to backward; no re-gather.

`persist=True` (ZeRO-2, `autopar.forms.zero`; implies `keep`): the gathered buffer outlives the call. It is cached
per group (`_PERSISTED`, keyed by the group's first shard, weakly), with the version counters of the shards' storages
(`Tensor._version`, bumped by every in-place write: the optimizer's step on the shards, a `load_state_dict`, DCP's
load; of the local shard and of its DTensor, `persist_versions`, as an in-place op on a DTensor bumps only the
DTensor's); a later forward whose shards have the same versions reads the cached buffer and issues no all-gather (nor
its prefetch); after a step the next forward gathers each group once, prefetched as above, so the gather after the
step overlaps that forward. Every rank steps and loads its shards alike, so every rank finds the same groups
changed (a rank that writes its shards alone would wait for a gather the others do not issue).

`record_comms` sees one all-gather per group and axis forward (under persist: in the forwards after a change), one per group and axis backward under reshard,
one reduce-scatter per group and axis backward.
"""

from __future__ import annotations

import contextlib
import math
import weakref
from dataclasses import dataclass

import torch
import torch.distributed._functional_collectives as funcol
from torch.distributed._local_tensor import local_tensor_mode

from autopar.mesh import AxisRef, resolve_axis
from autopar.spec import padded_index
from autopar.runtime import collectives as C


@dataclass(frozen=True, eq=False)
class _Spec:
    axes: tuple[AxisRef, ...]  # innermost first
    dims: tuple[int, ...]  # each parameter's shard dim
    label: str
    keep: bool
    param_dtype: torch.dtype | None
    reduce_dtype: torch.dtype | None
    persist: bool = False
    # per parameter: None, or (dim, full length) where its shards are uneven (`autopar.forms.fsdp.shard_dim`)
    pad: tuple = ()

    def padding(self, i: int) -> tuple[int, int] | None:
        return self.pad[i] if self.pad else None


# ZeRO-2's gathered groups kept between steps: id of the first shard's storage tensor -> (every shard's storage
# tensor, weakly, their versions, the gathered buffer); an entry leaves with its first shard (`_persist`)
_PERSISTED: dict[int, tuple] = {}


_OUTER_VERSIONS: list[dict[int, int]] = []  # `persist_versions`: id(local tensor) -> its DTensor's version


@contextlib.contextmanager
def persist_versions(versions: dict[int, int]):
    """Around one run of a lowered program: the version counters of the DTensors whose local tensors the program
    reads (id of the local tensor -> the DTensor's `_version`). An in-place op on a DTensor (torch.optim's step on the
    DTensors, a `copy_` of a load) runs on its local tensor below autograd, where the local tensor's own counter is
    not bumped: ZeRO-2's persisted groups (`_persisted`) check both."""
    _OUTER_VERSIONS.append(versions)
    try:
        yield
    finally:
        _OUTER_VERSIONS.pop()


def _base(t: torch.Tensor) -> torch.Tensor:
    return t._base if t._base is not None else t


def _versions(shards) -> tuple:
    outer = _OUTER_VERSIONS[-1] if _OUTER_VERSIONS else {}
    return tuple((s._version, outer.get(id(_base(s)), -1)) for s in shards)


def _persisted(shards) -> torch.Tensor | None:
    """The cached gathered buffer of this group, if its shards are unchanged since it was gathered."""
    hit = _PERSISTED.get(id(_base(shards[0])))
    if hit is None:
        return None
    refs, versions, buf = hit
    if len(refs) != len(shards) or any(r() is not _base(s) for r, s in zip(refs, shards)):
        return None
    if versions != _versions(shards) or not _OUTER_VERSIONS:  # (a run outside a ParallelModule: gathered anew)
        return None
    return buf


def _persist(shards, buf: torch.Tensor) -> None:
    key = id(_base(shards[0]))

    def drop(ref):  # the first shard is gone: its entry (not one a new tensor of the same id made since)
        if _PERSISTED.get(key, ((None,),))[0][0] is ref:
            del _PERSISTED[key]

    refs = (weakref.ref(_base(shards[0]), drop), *(weakref.ref(_base(s)) for s in shards[1:]))
    _PERSISTED[key] = (refs, _versions(shards), buf)


def _uneven(length: int, ns: tuple[int, ...]) -> tuple[int, torch.Tensor]:
    """An uneven dim of `length` over ranks `ns` (outermost first): (the padded rows every shard travels as, the
    indices in the rank-major padded dim (world x padded) of the full dim's rows, in order): `padded_index`."""
    return padded_index(length, tuple(ns))


def _ns(axes) -> tuple[int, ...]:
    return tuple(a.size for a in reversed(axes))  # outermost first


def _padded_shape(shape, i: int, spec: "_Spec") -> tuple[int, ...]:
    """Parameter i's shard shape as it travels: padded on its dim to the longest shard where uneven."""
    pad = spec.padding(i)
    if pad is None:
        return tuple(shape)
    d, length = pad
    out = list(shape)
    out[d] = _uneven(length, _ns(spec.axes))[0]
    return tuple(out)


def _full_shape(shape, i: int, spec: "_Spec") -> list[int]:
    pad = spec.padding(i)
    out = list(shape)
    d = spec.dims[i]
    # a list, not a generator: dynamo cannot trace a generator into `math.prod` from here (it breaks the graph and,
    # inside `_finish`'s own generator below, runs the whole gather's copy-out eagerly: every call, recompiled)
    out[d] = pad[1] if pad is not None else out[d] * math.prod([a.size for a in spec.axes])
    return out


def _copy_in(shards, dtype, spec: "_Spec | None" = None) -> torch.Tensor:
    flat = []
    for i, s in enumerate(shards):
        if spec is not None and spec.padding(i) is not None:  # an uneven shard: zeros after its rows
            padded = s.new_zeros(_padded_shape(s.shape, i, spec), dtype=dtype or s.dtype)
            padded.narrow(spec.dims[i], 0, s.shape[spec.dims[i]]).copy_(s)
            s = padded
        flat.append(s.reshape(-1).to(dtype) if dtype is not None else s.reshape(-1))
    return torch.cat(flat)


def _issue(shards, axes: tuple[AxisRef, ...], dtype, backward: bool,
           spec: "_Spec | None" = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The flat buffer of `shards` copied in, its all-gather on the innermost axis issued (not waited): (the gather
    in flight, the buffer it sends). The sent buffer travels with the pending gather until `_finish` has waited for
    it. Under `torch.compile` the prefetch is issued in one compiled graph and waited for in another (a graph break
    falls at `fsdp_gather`), and inductor keeps a collective's input from being reused only up to a wait in the
    same graph: without the buffer among the issuing graph's outputs, inductor reuses its memory for the next
    layer's activations while the all-gather still reads it, and the ranks receive those instead of the shards."""
    with torch.no_grad():
        sent = _copy_in(shards, dtype, spec)
        return C._issue_all_gather(sent, 0, axes[0], backward), sent


def _finish(pending: tuple[torch.Tensor, torch.Tensor], shards, spec: _Spec, backward: bool) -> torch.Tensor:
    """Wait for the innermost gather (`pending`: `_issue`'s pair), gather on the other axes, copy out: one buffer of
    every full parameter."""
    with torch.no_grad():
        flat = C._wait(pending[0])
        for axis in spec.axes[1:]:
            flat = C._wait(C._issue_all_gather(flat, 0, axis, backward))
        ns = [a.size for a in reversed(spec.axes)]  # outermost first, as the gathered buffer is laid out
        world = math.prod(ns)
        shapes = [_padded_shape(s.shape, i, spec) for i, s in enumerate(shards)]
        total = sum([math.prod(p) for p in shapes])
        rows = flat.view(world, total)
        out = torch.empty(sum([math.prod(_full_shape(s.shape, i, spec)) for i, s in enumerate(shards)]),
                          dtype=flat.dtype, device=flat.device)
        off = foff = 0
        for i, (shape, d) in enumerate(zip(shapes, spec.dims)):
            k = math.prod(shape)
            g = rows[:, off:off + k].view(*ns, *shape).movedim(tuple(range(len(ns))), tuple(range(d, d + len(ns))))
            full = _full_shape(shards[i].shape, i, spec)
            dst = out[foff:foff + math.prod(full)]
            pad = spec.padding(i)
            if pad is None:
                dst.view(*shape[:d], *ns, *shape[d:]).copy_(g)
            else:  # (..., world x padded rows, ...) -> the full dim's rows: each rank's own, its padding dropped
                padded = g.reshape(*shape[:d], world * shape[d], *shape[d + 1:])
                dst.view(full).copy_(padded.index_select(d, _uneven(pad[1], tuple(ns))[1].to(flat.device)))
            off, foff = off + k, foff + math.prod(full)
        return out


def _full_views(buf: torch.Tensor, shards, spec: _Spec) -> list[torch.Tensor]:
    out, off = [], 0
    for i, s in enumerate(shards):
        shape = _full_shape(s.shape, i, spec)
        out.append(buf[off:off + math.prod(shape)].view(shape))
        off += math.prod(shape)
    return out


def _reduce_scatter(grads, shards: list[tuple[torch.Size, torch.dtype]], spec: _Spec) -> list[torch.Tensor]:
    """The full gradients reduce-scattered over every data axis as one flat buffer: the gradients of the shards
    (`shards`: their shapes and dtypes)."""
    ns = [a.size for a in reversed(spec.axes)]
    world = math.prod(ns)
    padded = [_padded_shape(shape, i, spec) for i, (shape, _) in enumerate(shards)]
    total = sum([math.prod(shape) for shape in padded])
    like = next(g for g in grads if g is not None)
    flat = like.new_empty((world, total), dtype=spec.reduce_dtype or like.dtype)
    off = 0
    for i, (g, shape, d) in enumerate(zip(grads, padded, spec.dims)):
        k = math.prod(shape)
        dst = flat[:, off:off + k]
        pad = spec.padding(i)
        if g is None or pad is not None:
            dst.zero_()  # an uneven parameter's padding rows reduce as zeros
        if g is not None and pad is not None:  # the full dim's rows -> (..., world x padded rows, ...)
            full = g.new_zeros((*shape[:d], world * shape[d], *shape[d + 1:]))
            g = full.index_copy_(d, _uneven(pad[1], tuple(ns))[1].to(g.device), g)
        if g is not None:
            src = g.reshape(*shape[:d], *ns, *shape[d:]).movedim(tuple(range(d, d + len(ns))), tuple(range(len(ns))))
            dst.view(*ns, *shape).copy_(src)
        off += k
    flat = flat.view(-1)
    real = local_tensor_mode() is None and type(flat) is torch.Tensor
    for axis in reversed(spec.axes):  # outermost first
        C._record("reduce_scatter", axis, flat, flat.numel(), True)
        if real:
            flat = funcol.reduce_scatter_single(flat, "sum", 0, axis.group_name)
        else:
            flat = C._wait(C._c10d.reduce_scatter_tensor(flat, "sum", axis.size, axis.group_name))
    if isinstance(flat, funcol.AsyncCollectiveTensor):
        torch.autograd.Variable._execution_engine.queue_callback(flat.wait)
        torch.autograd.Variable._execution_engine.queue_callback(C._after_backward)
    out, off = [], 0
    for i, ((shape, dtype), travelled) in enumerate(zip(shards, padded)):
        g = flat[off:off + math.prod(travelled)].view(travelled)
        if spec.padding(i) is not None:  # this rank's own rows of its padded shard
            g = g.narrow(spec.dims[i], 0, shape[spec.dims[i]])
        out.append(g if g.dtype == dtype else g.to(dtype))
        off += math.prod(travelled)
    return out


class _Group:
    """One group's gather in one step, for the backward's re-gather (reshard only)."""

    def __init__(self, shards, spec: _Spec, prev: "_Group | None"):
        self.shards, self.spec, self.prev = shards, spec, prev
        self.buffer: torch.Tensor | None = None  # gathered again in backward, dropped once its gradients are reduced
        # the backward prefetch (`_issue`'s pair), issued by the next group's first unpack
        self.pending: tuple | None = None
        self.packed = 0

    def regathered(self) -> torch.Tensor:
        if self.buffer is None:
            pending = self.pending if self.pending is not None else _issue(self.shards, self.spec.axes,
                                                                             self.spec.param_dtype, True, self.spec)
            self.pending = None
            self.buffer = _finish(pending, self.shards, self.spec, True)
            p = self.prev
            if p is not None and p.packed and p.buffer is None and p.pending is None:  # backward prefetch
                p.pending = _issue(p.shards, p.spec.axes, p.spec.param_dtype, True, p.spec)
        return self.buffer


class _Step:
    """The groups gathered in one forward under `fsdp_step`: their buffers, by identity, for the pack hook."""

    def __init__(self):
        self.buffers: dict[int, tuple[weakref.ref, _Group]] = {}
        self.last: _Group | None = None

    def add(self, buf: torch.Tensor, shards, spec: _Spec) -> None:
        group = _Group(shards, spec, self.last)
        self.last = group
        self.buffers[id(buf)] = (weakref.ref(buf), group)

    def group_of(self, t: torch.Tensor) -> _Group | None:
        base = t._base if t._base is not None else t
        hit = self.buffers.get(id(base))
        if hit is None or hit[0]() is not base:
            return None
        return hit[1]


@dataclass(frozen=True)
class _Handle:
    group: _Group
    size: tuple
    stride: tuple
    offset: int


_STEPS: list[_Step] = []


@contextlib.contextmanager
def fsdp_step(gm: torch.fx.GraphModule):
    """Around one run of a lowered program: the saved-tensor hooks that let resharded groups (`keep=False`) drop
    their gathered parameters after forward (module docstring). No-op for a program without them."""
    if not torch.is_grad_enabled() or not _reshards(gm):
        yield
        return
    step = _Step()
    outer = torch._C._autograd._top_saved_tensors_default_hooks(False)
    outer_pack, outer_unpack = outer if outer is not None else (None, None)

    def pack(t):
        group = step.group_of(t)
        if group is None:
            return (None, outer_pack(t)) if outer_pack is not None else (None, t)
        group.packed += 1
        return (_Handle(group, tuple(t.shape), tuple(t.stride()), t.storage_offset()), None)

    def unpack(saved):
        handle, value = saved
        if handle is None:
            return outer_unpack(value) if outer_unpack is not None else value
        buf = handle.group.regathered()
        return buf.as_strided(handle.size, handle.stride, handle.offset)

    _STEPS.append(step)
    try:
        with torch.autograd.graph.saved_tensors_hooks(pack, unpack):
            yield
    finally:
        _STEPS.remove(step)


_RESHARDS: "weakref.WeakKeyDictionary[torch.fx.GraphModule, bool]" = weakref.WeakKeyDictionary()


def _reshards(gm) -> bool:
    if gm not in _RESHARDS:
        _RESHARDS[gm] = any(n.op == "call_function" and n.target is fsdp_gather and not n.args[5]
                            for n in gm.graph.nodes)
    return _RESHARDS[gm]


class _Gather(torch.autograd.Function):
    @staticmethod
    def forward(ctx, pending, spec: _Spec, *shards):
        buf = _persisted(shards) if spec.persist else None
        if buf is None:
            if pending is None:
                pending = _issue(shards, spec.axes, spec.param_dtype, False, spec)
            buf = _finish(pending, shards, spec, False)
            if spec.persist:
                _persist(shards, buf)
        else:
            assert pending is None, "a persisted group's prefetch was issued although its shards are unchanged"
        ctx.spec = spec
        ctx.shards = [(s.shape, s.dtype) for s in shards]
        ctx.group = None
        if not spec.keep and _STEPS and any(s.requires_grad for s in shards):
            detached = tuple(s.detach() for s in shards)
            _STEPS[-1].add(buf, detached, spec)
            ctx.group = _STEPS[-1].last
        return tuple(_full_views(buf, shards, spec))

    @staticmethod
    def backward(ctx, *grads):
        if ctx.group is not None:
            ctx.group.buffer = ctx.group.pending = None
        return (None, None, *_reduce_scatter(grads, ctx.shards, ctx.spec))


def fsdp_prefetch(shards: tuple, axes: tuple, param_dtype=None, *, persist: bool = False, pad: tuple = ()):
    """Issue the all-gather of a group's flat buffer of shards on the innermost data axis; `fsdp_gather` waits.
    Returns the gather in flight and the buffer it sends (`_issue`: kept until the wait); None for a persisted group
    whose shards are unchanged (nothing to gather). `pad`: as `fsdp_gather`'s."""
    if persist and _persisted(shards) is not None:
        return None
    refs = tuple(resolve_axis(a) for a in axes)
    spec = _Spec(refs, tuple(p[0] if p else 0 for p in pad), "", False, param_dtype, None, persist, tuple(pad))
    return _issue(shards, refs, param_dtype, False, spec if pad else None)


def fsdp_gather(shards: tuple, pending, axes: tuple, dims: tuple, label: str, keep: bool, param_dtype=None,
                reduce_dtype=None, *, persist: bool = False, pad: tuple = ()) -> tuple:
    """The full parameters of one FSDP group (module docstring): all-gathered as one flat buffer (waiting for
    `pending`, its prefetch, when given); backward reduce-scatters their gradients as one flat buffer. `persist`
    (ZeRO-2): the gathered buffer is kept for later calls until the shards change. `pad`: per parameter None, or
    (dim, full length) of one sharded unevenly: its shard travels padded to the longest (`_uneven`), as FSDP2's."""
    spec = _Spec(tuple(resolve_axis(a) for a in axes), tuple(dims), label, keep or persist, param_dtype, reduce_dtype,
                 persist, tuple(pad))
    return _Gather.apply(pending, spec, *shards)


C.COLLECTIVES[fsdp_gather] = ("all_gather", "reduce_scatter")

__all__ = ["fsdp_gather", "fsdp_prefetch", "fsdp_step", "persist_versions"]
