"""Mesh axes as the rewriter sees them.

`AxisRef` names one axis of a `DeviceMesh` inside a rewritten graph: hashable, printable
(`tp[4]`), and resolvable at run time to the axis' process group and this rank's coordinate.
Graph nodes carry `AxisRef`s rather than process-group names so that a graph never bakes in a
group name from another process group (a fake-PG plan stays valid on the real mesh).
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

_MESHES: dict[int, DeviceMesh] = {}
_COLLECTIVE_CACHE: dict[tuple, tuple[object, object]] = {}


def layout_key(mesh: DeviceMesh) -> tuple:
    """A mesh by its layout (device type, shape, ranks, axis names): the same on every rank. Never `id(mesh)`,
    which CPython reuses differently in each rank's process once a mesh is freed."""
    return (mesh.device_type, tuple(mesh.mesh.shape), tuple(mesh.mesh.flatten().tolist()),
            tuple(mesh.mesh_dim_names or ()))


def collective_cached(key: tuple, build):
    """`build()` once per `key` and default process group: for process groups and meshes autopar creates itself
    (creating one is collective: every rank of the world calls `new_group` for it, in the same order). The key must
    be the same on every rank (a layout, never an `id()`) and every rank must ask for the same keys in the same
    order, members of the new group or not; otherwise the ranks' group counters drift apart and a later
    `new_group` waits forever for peers registering under another name. A re-initialised default group (a new
    `dist.group.WORLD`) invalidates every entry on every rank alike."""
    world = dist.group.WORLD
    hit = _COLLECTIVE_CACHE.get(key)
    if hit is None or hit[0] is not world:
        hit = _COLLECTIVE_CACHE[key] = (world, build())
    return hit[1]
_AXES: dict[str, "AxisRef"] = {}
_NEXT_ID = itertools.count()


@dataclass(frozen=True)
class AxisRef:
    mesh_id: int
    index: int
    name: str
    size: int
    zigzag: bool = False  # a context-parallel axis: a shard of a dim is chunks r and 2p-1-r of 2p (causal balance)

    def __repr__(self) -> str:
        return f"{self.name}[{self.size}]"

    @property
    def key(self) -> str:
        """How graphs name the axis: a plain string (graph code must be printable Python)."""
        key = f"{self.name}@mesh{self.mesh_id}" + ("~zigzag" if self.zigzag else "")
        _AXES[key] = self
        return key

    @property
    def mesh(self) -> DeviceMesh:
        return _MESHES[self.mesh_id]

    @property
    def group(self) -> dist.ProcessGroup:
        return self.mesh.get_group(self.index)

    @property
    def group_name(self) -> str:
        return self.group.group_name

    def local_rank(self):
        """This rank's coordinate on the axis (a per-rank SymInt under LocalTensorMode)."""
        return self.mesh.get_local_rank(self.index)


@dataclass(frozen=True)
class MeshInfo:
    """The axes of one DeviceMesh, named (unnamed axes become `axis0`, `axis1`, ...)."""

    mesh_id: int
    names: tuple[str, ...]
    sizes: tuple[int, ...]
    device_type: str

    @property
    def axes(self) -> tuple[AxisRef, ...]:
        return tuple(AxisRef(self.mesh_id, i, n, s) for i, (n, s) in enumerate(zip(self.names, self.sizes)))

    @property
    def mesh(self) -> DeviceMesh:
        return _MESHES[self.mesh_id]

    def axis(self, name: str) -> AxisRef:
        if name not in self.names:
            raise ValueError(
                f"mesh axis {name!r} does not exist: the mesh has axes {self.names} with sizes {self.sizes}; "
                f"name one of those (e.g. '@{self.names[-1]}') or build the mesh with mesh_dim_names")
        return self.axes[self.names.index(name)]

    def describe(self) -> str:
        return "(" + ", ".join(f"{n}={s}" for n, s in zip(self.names, self.sizes)) + ")"


def mesh_info(mesh: "DeviceMesh | dict[str, int]", *, part: bool = False) -> MeshInfo:
    """The mesh's axes. `part`: a mesh over some of the world's ranks (a pipeline stage's sub-mesh,
    `autopar.pipeline_tp`), which only those ranks run on; otherwise every rank must be in the mesh (unless the
    mesh was registered as such a part before)."""
    if isinstance(mesh, dict):  # planning without processes: {"dp": 8, "tp": 8}
        if not mesh or not all(isinstance(k, str) and isinstance(v, int) and v >= 1 for k, v in mesh.items()):
            raise ValueError(f"a mesh given as a dict maps axis names to sizes, e.g. {{'dp': 8, 'tp': 8}}; got {mesh!r}")
        if not 1 <= len(mesh) <= 3:
            raise ValueError(f"autopar supports 1-D to 3-D meshes, got {len(mesh)} axes: {mesh}")
        return MeshInfo(-1, tuple(mesh), tuple(mesh.values()), "meta")
    if not isinstance(mesh, DeviceMesh):
        raise TypeError(
            f"mesh must be a torch.distributed.device_mesh.DeviceMesh, got {type(mesh).__name__}; "
            "build one with init_device_mesh('cpu' or 'cuda', (sizes...), mesh_dim_names=(...))")
    if not 1 <= mesh.ndim <= 3:
        raise ValueError(f"autopar supports 1-D to 3-D meshes, got a {mesh.ndim}-D mesh of shape {tuple(mesh.shape)}")
    names = tuple(mesh.mesh_dim_names or (f"axis{i}" for i in range(mesh.ndim)))
    for mid, m in _MESHES.items():  # a mesh seen before (a stage's sub-mesh registered with `part`) as it was
        if m is mesh:
            return MeshInfo(mid, names, tuple(mesh.shape), mesh.device_type)
    if not part and dist.is_initialized() and mesh.size() != dist.get_world_size():
        raise ValueError(
            f"the mesh has {mesh.size()} devices (shape {tuple(mesh.shape)}) but the world has "
            f"{dist.get_world_size()} ranks: every rank must be in the mesh; build the mesh with "
            f"init_device_mesh(device, shape) where the product of shape equals the world size")
    names = tuple(mesh.mesh_dim_names or (f"axis{i}" for i in range(mesh.ndim)))
    for mid, m in _MESHES.items():
        if m is mesh:
            return MeshInfo(mid, names, tuple(mesh.shape), mesh.device_type)
    mid = next(_NEXT_ID)
    _MESHES[mid] = mesh
    return MeshInfo(mid, names, tuple(mesh.shape), mesh.device_type)


def resolve_axis(axis: "AxisRef | str") -> AxisRef:
    """An axis named in a graph (its `key`) -> the AxisRef."""
    if isinstance(axis, AxisRef):
        return axis
    try:
        return _AXES[axis]
    except KeyError:
        raise ValueError(f"unknown mesh axis {axis!r}: the graph was built for a mesh that is not registered "
                         "in this process; call autopar.parallelize again here") from None
