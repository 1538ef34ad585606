"""What each rank passes: `parallelize(..., inputs="global" | "local")`.

- "global" (default): every rank passes the same, whole batch; the lowered program takes each rank's part of it
  (the plan's input placements: `Shard(0)` on the data axes). `autopar.agree` checks that the example inputs
  are the same on every rank.
- "local" (the DDP habit, e.g. a `DistributedSampler` per rank): each data-parallel rank passes its own shard of
  the batch, which the program takes as given (never sliced again). The data axes are the mesh axes the plan
  splits the batch over (its input placements' `Shard(0)`); ranks that differ only on the other axes (tensor,
  sequence, expert) form one data-parallel rank and pass the same data.

Under "local" the model is captured and planned on the global batch: each batched input (the rule of
`batch_dims`) repeated `copies` times along dim 0, `copies` being the data-parallel degree. The degree is the
plan's, so `autopar.api.parallelize` first guesses the whole mesh and, when the plan splits the batch over fewer
axes, captures and plans once more for that degree (`data_axes`).
"""

from __future__ import annotations

import math

import torch
from torch.distributed.tensor import Replicate, Shard
from torch.utils import _pytree as pytree

from autopar.captured import Captured
from autopar.mesh import MeshInfo
from autopar.plan import Plan

INPUT_MODES = ("global", "local")


def check_mode(inputs) -> None:
    if inputs not in INPUT_MODES:
        raise ValueError(
            f"inputs must be 'global' (every rank passes the same whole batch; autopar splits it) or 'local' (each "
            f"data-parallel rank passes its own shard, e.g. from a DistributedSampler); got {inputs!r}")


def batch_dims(shapes: list[tuple | None]) -> list[int]:
    """Per flattened input: its batch size (dim 0), or 0 when it has none. The batch is dim 0 of the first input
    with a shape; every input whose dim 0 has that size is batched."""
    first = next((s for s in shapes if s), None)
    return [s[0] if s and first and s[0] == first[0] else 0 for s in shapes]


def global_example(args: tuple, kwargs: dict, copies: int) -> tuple[tuple, dict]:
    """inputs="local": the global batch the program is planned for, each batched input repeated `copies` times
    along dim 0 (the values only feed capture; the plan depends on shapes)."""
    if copies == 1:
        return args, kwargs
    flat, spec = pytree.tree_flatten((args, kwargs))
    dims = batch_dims([tuple(a.shape) if isinstance(a, torch.Tensor) else None for a in flat])
    flat = [a.repeat(copies, *[1] * (a.dim() - 1)) if d else a for a, d in zip(flat, dims)]
    return pytree.tree_unflatten(flat, spec)


def data_axes(plan: Plan, info: MeshInfo) -> tuple[str, ...]:
    """The mesh axes the plan splits the batch over: where some user input is `Shard(0)`."""
    placed = plan.input_placements().values()
    return tuple(n for i, n in enumerate(info.names) if any(p[i] == Shard(0) for p in placed))


def data_degree(axes: tuple[str, ...], info: MeshInfo) -> int:
    return math.prod(info.sizes[info.names.index(a)] for a in axes)


def data_groups(mesh, axes: tuple[str, ...], names: tuple[str, ...]) -> list[list[int]]:
    """The data-parallel ranks: lists of global ranks that differ only on the non-data axes (same data)."""
    layout = mesh.mesh
    data = [names.index(a) for a in axes]
    rest = [i for i in range(layout.dim()) if i not in data]
    rows = layout.permute(*data, *rest).reshape(math.prod(layout.shape[i] for i in data), -1)
    return [sorted(int(r) for r in row) for row in rows]


def local_arrivals(plan: Plan, captured: Captured, info: MeshInfo, axes: tuple[str, ...]
                   ) -> tuple[dict[str, tuple], list[tuple | None]]:
    """inputs="local": how each user input arrives (its batch already split over the data axes) and the shapes
    each rank passes. Raises if the plan does not split every batched input, and only those, over the data axes."""
    degree = data_degree(axes, info)
    placements = plan.input_placements()
    arrivals, shapes = {}, []
    for ph, s, b in zip(captured.user_inputs, captured.example_shapes, batch_dims(captured.example_shapes)):
        pls = placements.get(ph, (Replicate(),) * len(info.names))
        split = tuple(n for i, n in enumerate(info.names) if pls[i] == Shard(0))
        if (split != axes and b) or (split and not b):
            raise ValueError(
                f"inputs='local': plan {plan.name!r} places input {ph} as {pls} but splits the batch of the other "
                f"inputs over the data axes {axes}: with local inputs every batched input (dim 0 = the batch) must be "
                "split over the same data axes and no other input may be. Fix: re-plan (plan='auto' or a named "
                "plan), or pass inputs='global'.")
        if b and axes:
            arrivals[ph] = tuple(Shard(0) if n in axes else Replicate() for n in info.names)
            shapes.append((s[0] // degree, *s[1:]))
        else:
            shapes.append(s)
    return arrivals, shapes
