"""Placements per mesh axis, in PyTorch's own vocabulary.

A value's layout is a tuple with one `torch.distributed.tensor` placement per mesh axis:
`Shard(d)` (dim d split over the axis), `Replicate()`, `Partial()` (each rank holds a summand) or
`_StridedShard(d, split_factor=k)` (dim d seen as k equal blocks, each block split over the axis:
the layout of a fused QKV weight sharded per head). Printed compactly as `S(0)R`, `P`, `SS(0,3)`.

Gradient convention (what makes every inserted collective's backward right): the gradient of a
value placed `R` is itself replicated and complete on every rank. A rule that consumes an `R`
input while producing a sharded or partial output therefore receives a partial gradient for that
input, and the lowering wraps the input in `grad_all_reduce` (identity forward, all-reduce
backward), Megatron's `f`.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

from torch.distributed.tensor import Partial, Replicate, Shard
from torch.distributed.tensor.placement_types import Placement, _StridedShard

__all__ = [
    "Placement", "Partial", "Replicate", "Shard", "_StridedShard", "R", "P",
    "is_shard", "shard_dim", "shard_layout", "padded_index", "fmt", "fmt_placements", "placement_from_str", "Owned", "is_owned",
]

R = Replicate()
P = Partial()


@dataclass(frozen=True)
class Owned:
    """A whole parameter that lives only on the ranks whose coordinate on this axis is `owner`: an
    expert of a `ModuleList` MoE under expert parallelism (`O(1)`). Not a DTensor placement: the
    parameter is a DTensor on the owners' sub-mesh, empty on the other ranks; in the graph the
    stacked local experts are `S(0)` on the axis."""

    owner: int


def is_owned(p) -> bool:
    return isinstance(p, Owned)


def is_shard(p: Placement | None) -> bool:
    return isinstance(p, (Shard, _StridedShard))


def shard_layout(length: int, sizes: tuple[int, ...]) -> tuple[tuple[int, int], ...]:
    """(offset, length) in a dim of `length` of each rank's shard over mesh axes of `sizes` (outermost first, each
    `Shard` of that dim: the outer axis chunks first, as DTensor nests them), ranks outermost-major."""
    out = [(0, length)]
    for n in sizes:
        out = [(off + o, k) for off, size in out
               for o, k in (Shard.local_shard_size_and_offset(size, n, r)[::-1] for r in range(n))]
    return tuple(out)


@functools.lru_cache(maxsize=None)
def padded_index(length: int, sizes: tuple[int, ...]):
    """An uneven dim of `length` over mesh axes of `sizes` (outermost first) as its shards travel, each padded to the
    longest (FSDP's and ZeRO-1's all-gathers): (the padded rows per rank, the indices in the rank-major padded dim,
    ranks x padded rows, of the full dim's rows, in order). Shared: not to be written to."""
    import torch
    layout = shard_layout(length, sizes)
    rows = max(k for _, k in layout)
    return rows, torch.cat([torch.arange(r * rows, r * rows + k) for r, (_, k) in enumerate(layout)])


def shard_dim(p: Placement) -> int:
    assert is_shard(p), p
    return p.dim


def is_strided(p: Placement | None) -> bool:
    return isinstance(p, _StridedShard)


def with_dim(p: Placement, dim: int) -> Placement:
    """The same kind of shard on another tensor dim."""
    if isinstance(p, _StridedShard):
        return _StridedShard(dim, split_factor=p.split_factor)
    return Shard(dim)


def fmt(p: Placement) -> str:
    if isinstance(p, Owned):
        return f"O({p.owner})"
    if isinstance(p, _StridedShard):
        return f"SS({p.dim},{p.split_factor})"
    if isinstance(p, Shard):
        return f"S({p.dim})"
    if isinstance(p, Partial):
        return "P" if p.reduce_op == "sum" else f"P({p.reduce_op})"
    return "R"


def fmt_placements(pls) -> str:
    return "".join(fmt(p) for p in pls)


def placement_from_str(text: str) -> Placement:
    text = text.strip()
    if text == "R":
        return Replicate()
    if text == "P":
        return Partial()
    if text.startswith("SS(") and text.endswith(")"):
        dim, factor = text[3:-1].split(",")
        return _StridedShard(int(dim), split_factor=int(factor))
    if text.startswith("S(") and text.endswith(")"):
        return Shard(int(text[2:-1]))
    if text.startswith("O(") and text.endswith(")"):
        return Owned(int(text[2:-1]))
    raise ValueError(f"cannot parse placement {text!r}: expected R, P, S(d), SS(d,k) or O(owner)")


def placements_from_str(text: str) -> tuple[Placement, ...]:
    """'S(0)R' -> (Shard(0), Replicate()): one placement per mesh axis, as `fmt_placements` prints them."""
    out, i = [], 0
    try:
        while i < len(text):
            if text[i] in "RP" and not text.startswith("SS", i):
                out.append(placement_from_str(text[i]))
                i += 1
            else:
                j = text.index(")", i) + 1
                out.append(placement_from_str(text[i:j]))
                i = j
    except (ValueError, TypeError):
        raise ValueError(f"cannot parse placements {text!r}: expected one placement per mesh axis, each R, P, S(d), "
                         "SS(d,k) or O(owner), e.g. 'S(0)R'") from None
    return tuple(out)
