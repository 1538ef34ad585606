"""Parameters as DTensors with a plan's placements.

- `shard_tensor`: rank 0's full tensor (broadcast) sliced to this rank's shard, so `_StridedShard` (a fused
  QKV weight per part) has the same layout on real process groups and under LocalTensorMode.
- `owned_tensor`: a ModuleList expert under expert parallelism (`Owned` on one axis) lives whole on the ranks
  that own it: a DTensor on their sub-mesh, empty elsewhere.
- `to_locals`: many DTensors' local tensors through one autograd node (how a step feeds the parameters).
"""

from __future__ import annotations

import copy

import torch
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, distribute_tensor
from torch.distributed.tensor._api import _normalize_placements_for_grad
from torch.distributed.tensor._dtensor_spec import DTensorSpec, TensorMeta
from torch.distributed.tensor._utils import compute_global_tensor_info

from autopar.spec import is_owned


def shard_tensor(full: torch.Tensor, mesh: DeviceMesh, placements, broadcast: bool = True) -> DTensor:
    """A DTensor of `full` (rank 0's copy, broadcast) with `placements`, sliced locally (no scatter).

    Slicing here rather than in `distribute_tensor` gives `_StridedShard` the same layout on real
    process groups and under LocalTensorMode.
    """
    from autopar.runtime.collectives import _take_chunk
    from autopar.spec import is_shard

    if broadcast:
        # a copy: the broadcast writes into its input, and a replicated parameter must not share the model's storage
        # (parallelize leaves the model as it was; training the parallel module must not train the model)
        local = distribute_tensor(full.detach().clone(), mesh, [Replicate()] * mesh.ndim).to_local()
    else:
        local = full
    for ax, p in enumerate(placements):
        if is_shard(p):
            k = getattr(p, "split_factor", 1)
            local = _take_chunk(local, p.dim, mesh.size(ax), mesh.get_local_rank(ax), k).clone()
    from torch.distributed._local_tensor import LocalTensor, enabled_local_tensor_mode
    lm = enabled_local_tensor_mode()
    if lm is not None and not isinstance(local, LocalTensor):
        # simulated ranks each own their copy (an in-place optimizer step must not run once per rank on one tensor)
        local = lm.rank_map(lambda r: local.detach().clone())
    return DTensor.from_local(local, mesh, placements, run_check=False, shape=full.shape, stride=full.stride())


def _owner_mesh(mesh: DeviceMesh, ax: int, owner: int) -> DeviceMesh:
    """The ranks whose coordinate on axis `ax` is `owner`, as a mesh over the other axes. Collective: every rank
    asks for every owner's mesh, in the same order (see `autopar.mesh.collective_cached`)."""
    from autopar.mesh import collective_cached, layout_key

    def build() -> DeviceMesh:
        ranks = mesh.mesh.narrow(ax, owner, 1)
        names = list(mesh.mesh_dim_names or [f"axis{i}" for i in range(mesh.ndim)])
        if mesh.ndim > 1:
            ranks, names = ranks.squeeze(ax), names[:ax] + names[ax + 1:]
        else:
            names = [f"{names[0]}_owner"]
        return DeviceMesh(mesh.device_type, ranks, mesh_dim_names=tuple(names))

    return collective_cached(("owner", layout_key(mesh), ax, owner), build)


def owner_meshes(mesh: DeviceMesh, ax: int) -> list[DeviceMesh]:
    """Every coordinate's `_owner_mesh` on axis `ax`, built on every rank in coordinate order (collective)."""
    return [_owner_mesh(mesh, ax, o) for o in range(mesh.size(ax))]


def owned_tensor(full: torch.Tensor, mesh: DeviceMesh, placements, broadcast: bool = True) -> DTensor:
    """A parameter that lives whole on the ranks owning it (`Owned` on one axis): a DTensor on their
    sub-mesh (replicated there), empty on every other rank, which therefore holds 1/ep of the experts.
    `broadcast`: rank 0's copy (as at construction), else this rank's own (loading a full state dict)."""
    from torch.distributed._local_tensor import local_tensor_mode
    if local_tensor_mode() is not None:
        from autopar.runtime.moe import OWNED_NEEDS_PROCESSES
        raise NotImplementedError(OWNED_NEEDS_PROCESSES)
    (ax,) = [i for i, p in enumerate(placements) if is_owned(p)]
    owner = placements[ax].owner
    # rank 0's everywhere (a copy: the broadcast writes into its input), or this rank's own when loading
    local = distribute_tensor(full.detach().clone(), mesh, [Replicate()] * mesh.ndim).to_local() if broadcast else full
    sub = _owner_mesh(mesh, ax, owner)
    rest = [p for i, p in enumerate(placements) if i != ax] or [Replicate()]
    if any(not isinstance(p, Replicate) for p in rest):
        raise NotImplementedError(f"an owned expert weight must be replicated on the other mesh axes, got {placements}")
    if mesh.get_local_rank(ax) != owner:
        local = local.new_empty(0)
    return DTensor.from_local(local.clone(), sub, rest, run_check=False, shape=full.shape, stride=full.stride())


def mesh_device(mesh: DeviceMesh) -> torch.device:
    """This rank's device on `mesh` (`cpu`, or the current accelerator)."""
    if mesh.device_type == "cpu":
        return torch.device("cpu")
    return torch.device(mesh.device_type, torch.get_device_module(mesh.device_type).current_device())


def local_indices(shape, mesh: DeviceMesh, placements) -> list[torch.Tensor]:
    """Per dim of a tensor of global `shape`, the ascending global indices this rank's shard holds: the slicing of
    `shard_tensor` applied to index ranges (`_StridedShard` gives one block per part; an `Owned` parameter is
    whole on its owners and empty elsewhere)."""
    from autopar.runtime.collectives import _take_chunk
    from autopar.spec import is_shard

    index = [torch.arange(n) for n in shape]
    for ax, p in enumerate(placements):
        if is_owned(p):
            if mesh.get_local_rank(ax) != p.owner:
                return [torch.arange(0)] + index[1:]
        elif is_shard(p):
            k = getattr(p, "split_factor", 1)
            index[p.dim] = _take_chunk(index[p.dim], 0, mesh.size(ax), mesh.get_local_rank(ax), k)
    return index


def empty_like_placed(meta: torch.Tensor, mesh: DeviceMesh, placements) -> DTensor:
    """A DTensor shaped like `meta` (a meta-device parameter) with `placements`, of which only this rank's shard
    is allocated, uninitialised, on the mesh's device: nothing of the full tensor is ever materialised."""
    from torch.distributed._local_tensor import local_tensor_mode
    if local_tensor_mode() is not None:
        raise NotImplementedError(
            "parallelising a meta-device model under LocalTensorMode (simulated ranks) is not supported: each "
            "simulated rank would need its own shard shape. Fix: run on real processes (torchrun / gloo), or build "
            "the model on the CPU for a simulation.")
    shape = [len(i) for i in local_indices(meta.shape, mesh, placements)]
    if any(map(is_owned, placements)):
        (ax,) = [i for i, p in enumerate(placements) if is_owned(p)]
        if mesh.get_local_rank(ax) != placements[ax].owner:
            shape = [0]  # as `owned_tensor`: nothing on the ranks that do not own it
        rest = [p for i, p in enumerate(placements) if i != ax] or [Replicate()]
        if any(not isinstance(p, Replicate) for p in rest):
            raise NotImplementedError(f"an owned expert weight must be replicated on the other mesh axes, got {placements}")
        local = torch.empty(shape, dtype=meta.dtype, device=mesh_device(mesh))
        return DTensor.from_local(local, _owner_mesh(mesh, ax, placements[ax].owner), rest, run_check=False,
                                  shape=meta.shape, stride=meta.stride())
    local = torch.empty(shape, dtype=meta.dtype, device=mesh_device(mesh))
    return DTensor.from_local(local, mesh, placements, run_check=False, shape=meta.shape, stride=meta.stride())


class _ToLocals(torch.autograd.Function):
    """`DTensor.to_local()` of many DTensors as one autograd node (`to_locals`)."""

    @staticmethod
    def forward(ctx, *dts):
        ctx.specs = [d._spec for d in dts]
        ctx.set_materialize_grads(False)
        outs = []
        for d in dts:
            local = d._local_tensor.view_as(d._local_tensor)  # a fresh tensor object, as `to_local` returns
            if getattr(d, "_is_param", False):
                local._is_param = True  # as `to_local` marks a Parameter's local tensor
            outs.append(local)
        return tuple(outs)

    @staticmethod
    def backward(ctx, *grads):
        return tuple(None if g is None else _grad_dtensor(g, spec) for g, spec in zip(grads, ctx.specs))


def _grad_dtensor(g: torch.Tensor, spec: DTensorSpec) -> DTensor:
    """The gradient `DTensor.to_local()`'s backward makes of a local gradient `g` (torch's `_ToTorchTensor`):
    the input's placements (a Partial one as Replicate), its global shape, the global stride of `g`'s layout.
    Built directly rather than through `DTensor.from_local`, an autograd function of its own, except where that
    matters: a backward that builds a graph (`create_graph=True`) or a mesh without this rank."""
    mesh, meta = spec.mesh, spec.tensor_meta
    placements = _normalize_placements_for_grad(spec.placements)
    _, stride = compute_global_tensor_info(g, mesh, placements)
    stride = tuple(stride)
    if torch.is_grad_enabled() or not mesh._is_current_rank_part_of_mesh():
        return DTensor.from_local(g, mesh, placements, shape=meta.shape, stride=stride)
    if stride == meta.stride and placements == spec.placements:
        grad_spec = copy.copy(spec)
    else:
        grad_spec = DTensorSpec(mesh, placements, tensor_meta=TensorMeta(meta.shape, stride, meta.dtype))
    return DTensor(g.view_as(g), grad_spec, requires_grad=g.requires_grad)


def to_locals(dts: list[DTensor]) -> tuple[torch.Tensor, ...]:
    """`tuple(d.to_local() for d in dts)`, the same tensors and gradients, with one autograd node for all of them
    instead of one per DTensor: a step feeds every parameter to the program this way, and on a CPU host each
    node's Python (`to_local` forward, `from_local` backward) cost tens of microseconds per parameter and step."""
    if not torch.is_grad_enabled():
        return tuple(d.to_local() for d in dts)
    return _ToLocals.apply(*dts)
