"""The optimizer step on DTensor parameters, run on their local tensors where that is exactly the same step.

Why: a DTensor is a Python tensor subclass, so every op on one enters Python (DTensor's dispatch): 9-20 us per op
on the CPU, against ~2 us on a plain tensor, whatever the tensor's size. Torch's default optimizers on the CPU
are the single-tensor loops, which issue about 8 ops per parameter and step (AdamW): on the 52 parameters of a
small GPT, 8-11 ms a step, measured, that DDP's plain parameters do not pay. A replicated parameter's local tensor
*is* the global tensor, element for element, so any optimizer computes bitwise the same step on the local tensors
as on the DTensors, with none of the dispatch; a sharded parameter's local tensor is its shard, on which an
optimizer that treats every element alone (torch's SGD, Adam, AdamW, ...) computes the shard of the same step.

The contract: `install()` (idempotent; `ParallelModule` calls it) registers one global optimizer step pre-hook
and post-hook (`torch.optim.optimizer.register_optimizer_step_pre_hook`); `register(params)` marks parameters
(`ParallelModule` marks its own). A step runs on the local tensors when all of these hold, and exactly as torch
runs it otherwise:
- every parameter of every group of the optimizer is a marked DTensor, and either
  - its placements are all `Replicate` and its gradient, where it has one, is a DTensor replicated on the same
    mesh (any optimizer), or
  - its placements are `Replicate` or `Shard`, its gradient has the same placements and shape, and the
    optimizer's type is one of torch's elementwise ones (`_ELEMENTWISE`, exact type; `Partial` and expert-owned
    placements never);
- every parameter already has optimizer state (its first step, which creates the state, runs on the DTensors,
  so the state is made as torch makes it: DTensors where torch makes DTensors), or has neither state nor a
  gradient (torch's optimizers pass over it: another pipeline stage's parameter on this rank); an optimizer that keeps no
  state (plain SGD) stays on the DTensors (one op per parameter: little to gain);
- no group is `differentiable`, the step is not given a closure (a closure, as LBFGS's, re-evaluates the
  model and writes the DTensors' gradients, which the local tensors would not see), and it is not being
  compiled (`torch.compile` traces the DTensor ops itself).
For the step, each group's `params` holds the parameters' local tensors (`p._local_tensor`, the same storage), each
local tensor's `.grad` the gradient's local tensor, and the optimizer's state is keyed by the local tensors with
every DTensor in it replaced by its local tensor. After the step (the global post-hook, which runs after the
optimizer's own post-hooks) the groups, the state keys and the gradients are as before; a state tensor the
step replaced (instead of updating it in place, as torch's optimizers do) is wrapped back as the DTensor it
replaced was (replicated: whole on every rank; a new entry with the parameter's shape likewise, as the
parameter). The optimizer's own hooks (`opt.register_step_pre_hook`, `..._post_hook`) run inside the swap and
see the local tensors. If the step raises, the next step, `state_dict()` or `load_state_dict()` of that
optimizer first puts everything back. `enabled(False)` turns the swap off for a block (process-wide; the tests
and `benchmarks/dp_vs_ddp.py --dtensor-step` use it).

Sharded steps (ZeRO-1, `autopar.forms.zero`): `shard_step(p, mesh_dims, dim)` marks a replicated parameter whose
step runs on this rank's chunk of it alone: chunk r of n on tensor dim `dim` (`torch.chunk`'s where the dim does not
divide: shorter or empty on the last ranks, padded to the longest in the all-gather), n the product of the sizes of the
data mesh dims `mesh_dims`, r this rank's index over them (outermost major, as DTensor nests `Shard(dim)` over
several mesh dims). An optimizer holding such a parameter is always swapped (its first step too, so that its state
is created at the chunk's size), and must be one of torch's elementwise optimizers, stepped without a closure,
outside `torch.compile`, with the swap enabled: anything else raises (stepping the whole would silently keep whole
state). The optimizer sees the chunk (a view of the parameter's local tensor) and the same chunk of its (replicated,
all-reduced) gradient; state it creates with the chunk's shape is wrapped back as a DTensor `Shard(dim)` on those mesh
dims (the parameter's placements elsewhere), so `state_dict` and DCP see sharded state of the full shape. After the
step (the post-hook) the chunks are all-gathered into the parameters, one all-gather per data mesh dim (innermost
first) of one flat buffer per mesh, mesh dims and dtype (`record_comms`: pass "step").
"""

from __future__ import annotations

import contextlib
import math
import weakref

import torch
from torch.distributed._local_tensor import maybe_run_for_local_tensor
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor._dtensor_spec import DTensorSpec, TensorMeta
from torch.distributed.tensor.placement_types import _StridedShard
from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook

from autopar.spec import padded_index, shard_layout

_MARK = "_autopar_local_step"  # the attribute that marks a parameter a step may run on locally
_SHARD = "_autopar_shard_step"  # (data mesh dims, tensor dim): the step runs on this rank's chunk (ZeRO-1)
_SWAPS: "weakref.WeakKeyDictionary[torch.optim.Optimizer, _Swap]" = weakref.WeakKeyDictionary()
_STATE: dict = {"installed": False, "enabled": True}
_GUARDED: "weakref.WeakSet[torch.optim.Optimizer]" = weakref.WeakSet()  # optimizers with the state_dict hooks


def install() -> None:
    """Registers the global step hooks, once per process."""
    if not _STATE["installed"]:
        register_optimizer_step_pre_hook(_pre_step)
        register_optimizer_step_post_hook(_post_step)
        _STATE["installed"] = True


def register(params) -> None:
    """Marks `params` (DTensor parameters) as ones an optimizer step may run on locally when they are replicated."""
    for p in params:
        if isinstance(p, DTensor):
            setattr(p, _MARK, True)


def shard_step(p: DTensor, mesh_dims: tuple[int, ...], dim: int) -> None:
    """Marks the replicated parameter `p`: optimizers step its chunk over `mesh_dims` on tensor `dim` (module
    docstring)."""
    if type(p) is not DTensor or any(not p._spec.placements[i].is_replicate() for i in mesh_dims):
        raise ValueError(f"a sharded step needs a parameter replicated on mesh dims {mesh_dims}, got "
                         f"{type(p).__name__} {getattr(p, 'placements', '')}")
    if p._local_tensor.dim() <= dim:
        raise ValueError(f"a sharded step on dim {dim} of a parameter of local shape {tuple(p._local_tensor.shape)}: "
                         "it has no such dim")
    setattr(p, _SHARD, (tuple(sorted(mesh_dims)), dim))


def _chunk_index(p: DTensor, mesh_dims: tuple[int, ...]) -> tuple[int, int]:
    """(this rank's index over `mesh_dims`, outermost major; their number of ranks)."""
    mesh = p.device_mesh
    coord = mesh.get_coordinate()
    r = 0
    for i in mesh_dims:
        r = r * mesh.size(i) + coord[i]
    return r, math.prod(mesh.size(i) for i in mesh_dims)


def _chunk(t: torch.Tensor, p: DTensor) -> torch.Tensor:
    """This rank's chunk of `t` (a local tensor of `p`'s shape) for `p`'s sharded step: a view."""
    mesh_dims, dim = getattr(p, _SHARD)
    r, n = _chunk_index(p, mesh_dims)
    if t.shape[dim] % n == 0:
        k = t.shape[dim] // n
        return t.narrow(dim, r * k, k)
    # uneven: torch.chunk's chunk, nested over the mesh dims as DTensor's `Shard(dim)` (the last ranks' shorter or empty)
    length, sizes = t.shape[dim], _sizes(p, mesh_dims)
    return t.narrow(dim, _layout_at(length, sizes, r, 0), _layout_at(length, sizes, r, 1))


@maybe_run_for_local_tensor
def _layout_at(length: int, sizes: tuple[int, ...], r: int, i: int) -> int:
    """The offset (i=0) or length (i=1) of rank `r`'s uneven chunk; per simulated rank under LocalTensorMode, where
    `r` is a per-rank int (the even case's `narrow` takes those as they are)."""
    return shard_layout(length, sizes)[r][i]


def _sizes(p: DTensor, mesh_dims) -> tuple[int, ...]:
    return tuple(p.device_mesh.size(i) for i in mesh_dims)


@contextlib.contextmanager
def enabled(on: bool):
    """Within the block optimizer steps run on the local tensors where they may (`on`) or always on the DTensors."""
    before = _STATE["enabled"]
    _STATE["enabled"] = on
    try:
        yield
    finally:
        _STATE["enabled"] = before


def _replicated(t) -> bool:
    return type(t) is DTensor and all(p.is_replicate() for p in t._spec.placements)


def _elementwise_optimizers() -> frozenset:
    """Torch's optimizers whose step treats every element alone (no norm, no factorisation across elements, no
    closure): on a sharded parameter, the step on each shard is the step on the whole. Matched by exact type (a
    subclass may do anything)."""
    names = ("SGD", "Adam", "AdamW", "Adamax", "NAdam", "RAdam", "Adagrad", "Adadelta", "RMSprop", "Rprop", "ASGD")
    return frozenset(getattr(torch.optim, n) for n in names if hasattr(torch.optim, n))


_ELEMENTWISE = _elementwise_optimizers()


def _same_mesh(a: DTensor, b: DTensor) -> bool:
    # DTensor's sharding cache may hand back an equal mesh, not the same object
    return a._spec.mesh is b._spec.mesh or a._spec.mesh == b._spec.mesh


def _exact_locally(p, elementwise: bool) -> bool:
    """Whether the step on `p`'s (and its gradient's) local tensors is the step on `p`: replicated (any optimizer),
    or sharded like its gradient under an elementwise optimizer (`Partial` and owned placements never)."""
    if type(p) is not DTensor or not getattr(p, _MARK, False):
        return False
    g = p.grad
    if _replicated(p):
        return g is None or (_replicated(g) and _same_mesh(g, p))
    if not elementwise or not all(pl.is_replicate() or pl.is_shard() or isinstance(pl, _StridedShard)
                                  for pl in p._spec.placements):  # (a fused QKV weight's strided shard too)
        return False
    return g is None or (type(g) is DTensor and g._spec.placements == p._spec.placements and g.shape == p.shape
                         and _same_mesh(g, p))


class _Swap:
    """What a step swapped: each group's DTensor parameters, and per parameter its local tensor and its state."""

    __slots__ = ("groups", "pairs", "sharded")

    def __init__(self, groups: list, pairs: list, sharded: list):
        self.groups = groups  # [(group dict, original params list)]
        self.pairs = pairs  # [(param DTensor, local tensor, state before {key: value}, gradient DTensor or None)]
        self.sharded = sharded  # the parameters stepped on their chunk (`shard_step`), to gather after the step


def _sharded_step(opt: torch.optim.Optimizer) -> bool:
    return any(getattr(p, _SHARD, None) is not None for g in opt.param_groups for p in g["params"])


def _refuse(opt: torch.optim.Optimizer, why: str) -> None:
    raise RuntimeError(
        f"{type(opt).__name__} holds parameters whose optimizer state the plan shards (ZeRO-1, plan 'zero1'), but "
        f"this step cannot run on their shards: {why}. Stepping them whole would keep the whole state on every rank. "
        "Fix: step them with one of torch's elementwise optimizers (SGD, Adam, AdamW, ...) without a closure, "
        "outside torch.compile and local_step.enabled(False); or use plan='dp' (replicated state) or 'zero2'/'fsdp' "
        "(sharded parameters).")


def _eligible(opt: torch.optim.Optimizer, args: tuple, kwargs: dict) -> bool:
    if _sharded_step(opt):
        _check_sharded(opt, args, kwargs)
        return True
    if not _STATE["enabled"] or (len(args) > 1 and args[1] is not None) or kwargs.get("closure") is not None:
        return False
    if torch.compiler.is_compiling():  # a compiled step traces the DTensor ops itself
        return False
    state = opt.state
    elementwise = type(opt) in _ELEMENTWISE
    for group in opt.param_groups:
        if group.get("differentiable"):
            return False
        for p in group["params"]:
            # a parameter without a gradient and without state (another pipeline stage's, or one this step does not
            # update) is passed over by torch's optimizers, on its local tensor as on the DTensor
            if (not state.get(p) and p.grad is not None) or not _exact_locally(p, elementwise):
                return False
    return True


def _check_sharded(opt: torch.optim.Optimizer, args: tuple, kwargs: dict) -> None:
    """An optimizer with sharded-step parameters: the step must run swapped (first step included), or raise."""
    if not _STATE["enabled"]:
        _refuse(opt, "the local step is disabled (local_step.enabled(False))")
    if (len(args) > 1 and args[1] is not None) or kwargs.get("closure") is not None:
        _refuse(opt, "the step was given a closure")
    if torch.compiler.is_compiling():
        _refuse(opt, "the step is being compiled")
    if type(opt) not in _ELEMENTWISE:
        _refuse(opt, f"{type(opt).__name__} is not one of torch's elementwise optimizers "
                     f"({', '.join(sorted(o.__name__ for o in _ELEMENTWISE))}): its step on a chunk may differ")
    for group in opt.param_groups:
        if group.get("differentiable"):
            _refuse(opt, "a parameter group is differentiable")
        for p in group["params"]:
            if not _exact_locally(p, True):
                _refuse(opt, f"a parameter of shape {tuple(p.shape)} ({type(p).__name__}"
                             f"{' ' + str(p.placements) if isinstance(p, DTensor) else ''}, gradient "
                             f"{getattr(p.grad, 'placements', type(p.grad).__name__)}) is not one autopar placed")


def _pre_step(opt: torch.optim.Optimizer, args: tuple, kwargs: dict) -> None:
    restore(opt)  # a step that raised left its swap in place
    if not _eligible(opt, args, kwargs):
        return None
    state = opt.state
    groups, pairs, sharded = [], [], []
    for group in opt.param_groups:
        params = group["params"]
        locals_ = []
        for p in params:
            local = p._local_tensor
            g = p.grad
            g_local = None if g is None else g._local_tensor
            if getattr(p, _SHARD, None) is not None:  # ZeRO-1: this rank's chunk of the parameter and its gradient
                local = _chunk(local, p)
                g_local = None if g_local is None else _chunk(g_local, p)
                sharded.append(p)
            local.grad = g_local
            before = state.pop(p, None)
            if before is not None:
                state[local] = {k: (v._local_tensor if type(v) is DTensor else v) for k, v in before.items()}
            pairs.append((p, local, before, g))
            locals_.append(local)
        groups.append((group, params))
        group["params"] = locals_
    _SWAPS[opt] = _Swap(groups, pairs, sharded)
    _guard(opt)
    return None


def _post_step(opt: torch.optim.Optimizer, args: tuple, kwargs: dict) -> None:
    swap = _SWAPS.get(opt)
    restore(opt)
    if swap is not None and swap.sharded:
        _gather_chunks(swap.sharded)


def _gather_chunks(params: list) -> None:
    """ZeRO-1 after the step: every rank's updated chunks all-gathered into the parameters, one flat buffer per mesh,
    data mesh dims and dtype, one all-gather per mesh dim (innermost first: the gathered rows come out outermost
    major, as `_chunk_index` numbers them)."""
    from autopar.mesh import layout_key, mesh_info
    from autopar.runtime import collectives as C
    buckets: dict[tuple, list] = {}
    for p in dict.fromkeys(params):  # tied parameters once
        mesh_dims, dim = getattr(p, _SHARD)
        # the mesh by its layout: equal meshes built twice (a plan's cached sub-mesh, the user's) are one bucket
        key = (layout_key(p.device_mesh), mesh_dims, p._local_tensor.dtype, p._local_tensor.device)
        buckets.setdefault(key, []).append(p)
    with torch.no_grad(), C.stepping():
        for (_, mesh_dims, _, _), ps in buckets.items():
            chunks = [_chunk(p._local_tensor, p) for p in ps]
            # uneven chunks travel padded with zeros to the longest (`padded_index`)
            sent = [_padded(c, p) for c, p in zip(chunks, ps)]
            flat = torch.cat([c.reshape(-1) for c in sent])
            axes = [mesh_info(ps[0].device_mesh).axes[i] for i in mesh_dims]
            for axis in reversed(axes):
                flat = C._wait(C._issue_all_gather(flat, 0, axis))
            world = math.prod(a.size for a in axes)
            rows = flat.view(world, -1)
            off = 0
            for p, c in zip(ps, sent):
                dim = getattr(p, _SHARD)[1]
                full = p._local_tensor
                k = c.numel()
                src = rows[:, off:off + k].reshape(world, *c.shape).movedim(0, dim)  # (..., world, chunk, ...)
                if full.shape[dim] % world == 0:
                    full.view(*full.shape[:dim], world, c.shape[dim], *full.shape[dim + 1:]).copy_(src)
                else:  # (..., world x padded rows, ...) -> the full dim's rows, the padding dropped
                    src = src.reshape(*full.shape[:dim], world * c.shape[dim], *full.shape[dim + 1:])
                    idx = padded_index(full.shape[dim], _sizes(p, mesh_dims))[1].to(src.device)
                    full.copy_(src.index_select(dim, idx))
                off += k


def _padded(chunk: torch.Tensor, p: DTensor) -> torch.Tensor:
    """`chunk` of `p` as it travels: padded with zeros on its dim to the longest chunk where the dim is uneven."""
    mesh_dims, dim = getattr(p, _SHARD)
    length = p._local_tensor.shape[dim]
    if length % math.prod(_sizes(p, mesh_dims)) == 0:
        return chunk
    rows = padded_index(length, _sizes(p, mesh_dims))[0]
    if chunk.shape[dim] == rows:
        return chunk
    out = chunk.new_zeros((*chunk.shape[:dim], rows, *chunk.shape[dim + 1:]))
    out.narrow(dim, 0, chunk.shape[dim]).copy_(chunk)
    return out


def restore(opt: torch.optim.Optimizer) -> None:
    """Puts back what the last step of `opt` swapped (nothing if it swapped nothing or was put back)."""
    swap = _SWAPS.pop(opt, None)
    if swap is None:
        return
    for group, params in swap.groups:
        group["params"] = params
    state = opt.state
    for p, local, before, g in swap.pairs:
        local.grad = None
        after = state.pop(local, None)
        if after is None:
            if before is not None:
                state[p] = before
            continue
        before = before or {}
        new = {}
        for k, v in after.items():
            old = before.get(k)
            if type(old) is DTensor and v is old._local_tensor:
                new[k] = old  # updated in place (the usual case): the same DTensor
            elif isinstance(v, torch.Tensor) and type(v) is not DTensor and getattr(p, _SHARD, None) is not None and (
                    type(old) is DTensor or (old is None and v.shape == local.shape and v.dim() > 0)):
                new[k] = _chunk_state(v, p)  # ZeRO-1: state of the chunk's shape is the chunk of the state
            elif isinstance(v, torch.Tensor) and type(v) is not DTensor and (
                    type(old) is DTensor or (old is None and v.shape == local.shape and v.dim() > 0)):
                new[k] = _rewrap(v, old if type(old) is DTensor else p, k, opt)
            else:
                new[k] = v
        state[p] = new


def _chunk_state(t: torch.Tensor, p: DTensor) -> DTensor:
    """A state tensor of `p`'s chunk as the DTensor of `p`'s global shape it is a shard of: `Shard(dim)` on the
    sharded step's mesh dims, `p`'s placements on the others."""
    mesh_dims, dim = getattr(p, _SHARD)
    spec = p._spec
    placements = tuple(Shard(dim) if i in mesh_dims else pl for i, pl in enumerate(spec.placements))
    shape = spec.tensor_meta.shape
    meta = TensorMeta(shape, _contiguous_stride(shape), t.dtype)
    return DTensor(t, DTensorSpec(spec.mesh, placements, meta), requires_grad=t.requires_grad)


def _contiguous_stride(shape) -> tuple[int, ...]:
    stride, acc = [], 1
    for s in reversed(tuple(shape)):
        stride.append(acc)
        acc *= s
    return tuple(reversed(stride))


def _rewrap(t: torch.Tensor, like: DTensor, key: str, opt) -> DTensor:
    """A state tensor the step made anew, as the DTensor `like` (the state it replaced, or the parameter) is: whole
    on every rank if `like` is replicated, else `like`'s shard (only torch's elementwise optimizers run sharded
    parameters locally, and they update their state in place: this is a guard)."""
    spec = like._spec
    if _replicated(like):
        meta = TensorMeta(t.shape, t.stride(), t.dtype)
        return DTensor(t, DTensorSpec(spec.mesh, (Replicate(),) * spec.mesh.ndim, meta), requires_grad=t.requires_grad)
    if t.shape != like._local_tensor.shape:
        raise RuntimeError(
            f"{type(opt).__name__}'s step replaced its state {key!r} of a sharded parameter with a tensor of local shape "
            f"{tuple(t.shape)}, where the shard is {tuple(like._local_tensor.shape)}: autopar cannot tell which DTensor "
            "it is. Fix: run this optimizer's steps on the DTensors, under autopar.runtime.local_step.enabled(False).")
    meta = TensorMeta(spec.tensor_meta.shape, spec.tensor_meta.stride, t.dtype)
    return DTensor(t, DTensorSpec(spec.mesh, spec.placements, meta, shard_order=spec.shard_order),
                   requires_grad=t.requires_grad)


def _guard(opt: torch.optim.Optimizer) -> None:
    """`state_dict()` and `load_state_dict()` of `opt` put back a swap its last step left (it raised) first."""
    if opt in _GUARDED:
        return
    _GUARDED.add(opt)
    opt.register_state_dict_pre_hook(restore)
    opt.register_load_state_dict_pre_hook(lambda o, sd: restore(o))
