"""Parameters as DTensors with a plan's placements.

- `shard_tensor`: rank 0's full tensor (broadcast) sliced to this rank's shard, so `_StridedShard` (a fused
  QKV weight per part) has the same layout on real process groups and under LocalTensorMode.
- `owned_tensor`: a ModuleList expert under expert parallelism (`Owned` on one axis) lives whole on the ranks
  that own it: a DTensor on their sub-mesh, empty elsewhere.
"""

from __future__ import annotations

import torch
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, distribute_tensor

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


_OWNER_MESHES: dict[tuple, DeviceMesh] = {}


def _owner_mesh(mesh: DeviceMesh, ax: int, owner: int) -> DeviceMesh:
    """The ranks whose coordinate on axis `ax` is `owner`, as a mesh over the other axes (every rank
    builds every such mesh, in the same order: creating a process group is collective)."""
    key = (id(mesh), ax, owner)
    if key not in _OWNER_MESHES:
        ranks = mesh.mesh.narrow(ax, owner, 1)
        names = list(mesh.mesh_dim_names or [f"axis{i}" for i in range(mesh.ndim)])
        if mesh.ndim > 1:
            ranks, names = ranks.squeeze(ax), names[:ax] + names[ax + 1:]
        else:
            names = [f"{names[0]}_owner"]
        _OWNER_MESHES[key] = DeviceMesh(mesh.device_type, ranks, mesh_dim_names=tuple(names))
    return _OWNER_MESHES[key]


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
    return DTensor.from_local(local, sub, rest, run_check=False, shape=full.shape, stride=full.stride())
