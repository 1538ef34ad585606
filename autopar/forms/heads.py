"""`heads`: attention split by heads over a model axis (Megatron tensor parallelism).

On an axis of size t: the q/k/v projections column-parallel, the output projection row-parallel, the
attention itself local on heads/t heads. A fused QKV projection is sharded per part: equal q/k/v blocks
(`[q | k | v]`, `LinearSite.parts`) by `_StridedShard`; per-head interleaved blocks (GPT-NeoX, Bloom:
`LinearSite.head_interleaved`) by a plain row shard, which gives every rank whole heads. Unequal blocks (GQA/MQA
fused QKV: Phi-3, Falcon; `LinearSite.part_slices`) have no placement of their weight that gives every rank
whole heads of each block: the weight stays replicated, and the lowering runs the projection as one
projection per block on row blocks of it (a `PARTS` directive), each block's rows split over the axis
(forward: a local slice; backward: the block's weight gradient all-gathered, so the replicated weight's
gradient is whole on every rank). KV heads fewer than t (GQA/MQA with t % kv == 0) stay replicated and each
rank picks the KV heads its query heads use (`autopar.runtime.ops.gqa_kv_heads`). Collectives: the block's
all-reduce forward (row-parallel output) and backward (column-parallel input gradient),
`blocks.tensor_parallel`; with KV heads fewer than t, their gradients' all-reduces; with unequal fused blocks,
the weight gradient's all-gathers. Preconditions: heads % t == 0; KV heads % t == 0 or t % KV heads == 0;
recognised q and output projections; a fused QKV projection split equally, per head, or in contiguous
blocks of whole heads, with as many KV as query heads per rank when its blocks are equal.
"""

from __future__ import annotations

import dataclasses

from autopar.forms import blocks
from autopar.forms.base import Form, Role, register
from autopar.forms.colwise import colwise_placements
from autopar.forms.rowwise import rowwise_placements
from autopar.plan import Directive, DirectiveKind
from autopar.sites import AttentionSite, Kind, LinearSite


def _fused(site: AttentionSite) -> list[LinearSite]:
    """The q projection(s) that also project k (a fused QKV projection)."""
    return [s for s in site.q if s in site.k]


def _block_heads(lin: LinearSite, head_dim: int) -> list[int] | None:
    """Heads in each of a fused projection's unequal blocks, or None when a block is not whole heads."""
    sizes = [end - first for _, first, end in lin.part_slices]
    return None if any(f % head_dim for f in sizes) else [f // head_dim for f in sizes]


def heads_precondition(site: AttentionSite, t: int) -> str | None:
    h, kv = site.heads, site.kv_heads
    if h % t:
        return (f"{h} heads do not divide over {t} ranks. Fix: use an axis whose size divides the head count, "
                "or 'replicate' for this attention")
    if kv % t and t % kv:
        return (f"{kv} KV heads neither divide over nor into {t} ranks. Fix: use an axis whose size divides the "
                "KV head count (or is a multiple of it), or 'replicate'")
    if not site.q or not site.out:
        return "its q or output projection is not a recognised linear. Fix: 'replicate' for this attention"
    fused = _fused(site)
    if fused and fused[0].parts == 1 and not fused[0].head_interleaved:
        lin = fused[0]
        heads = _block_heads(lin, site.head_dim) if lin.part_slices else None
        if heads is None or any(n not in (h, kv) for n in heads):
            return (f"its fused QKV projection {lin.key} is taken apart in a way autopar does not recognise (not "
                    f"equal splits, not per head, not contiguous blocks of whole heads of {site.head_dim}). Fix: "
                    "'replicate' for this attention")
        return None
    if fused and kv % t:
        return (f"its fused QKV projection has {kv} KV heads, fewer than the {t} ranks. Fix: an axis of at most "
                f"{kv} ranks, or 'replicate'")
    return None


@register
class Heads(Form):
    name = "heads"
    kinds = (Kind.ATTENTION,)
    roles = (frozenset({Role.MODEL}),)
    tensor_parallel = True
    hand_plans = frozenset({"megatron"})
    partial_output = True  # the row-parallel output projection's

    def precondition(self, site: AttentionSite, sizes):
        return heads_precondition(site, sizes[0])

    def placements(self, site: AttentionSite, axes, sizes):
        (ax,), (t,) = axes, sizes
        out: dict = {}
        kv_sharded = site.kv_heads % t == 0
        blocks = [lin for lin in _fused(site) if lin.part_slices]  # their weight stays replicated (PARTS)
        for lin in site.q + (site.k + site.v if kv_sharded else ()):
            if lin in blocks:
                continue
            for ph, p in colwise_placements(lin).items():
                out[ph] = {ax: p}
        for lin in site.out:
            for ph, p in rowwise_placements(lin).items():
                out[ph] = {ax: p}
        return out

    def directives(self, site: AttentionSite, axes):
        (axis,) = axes
        return [Directive(kind=DirectiveKind.PARTS, node=lin.node.name, axis=axis,
                          value=",".join(f"{n.name}:{first}:{end}:{(end - first) // site.head_dim}"
                                         for n, first, end in lin.part_slices))
                for lin in _fused(site) if lin.part_slices]

    def notes(self, site: AttentionSite, axes):
        return [f"attention {site.key} heads@{axes[0]}: its fused QKV projection {lin.key} lays out q, k and v as "
                f"blocks of unequal size ({'/'.join(str(e - f) for _, f, e in lin.part_slices)} of its "
                f"{lin.out_features} output features), which no one placement of its weight splits into whole heads "
                "(a strided shard splits equal blocks only): its weight stays replicated (held whole), each block is "
                "projected on its own rows, split by heads where they divide over the axis (else replicated), and "
                "the split rows' gradients are all-gathered. Fix: separate q/k/v projections shard with no all-gather"
                for lin in _fused(site) if lin.part_slices]

    def row_linears(self, site: AttentionSite):
        return list(site.out)

    def cost(self, site, st, cand, mc):
        cost = blocks.tensor_parallel(st, cand, mc, site.q + site.k + site.v)
        t = mc.size(cand.axis)
        for lin in _fused(site):
            if not lin.part_slices:
                continue
            # its weight is whole on every rank, not 1/t; the split blocks' weight gradients are all-gathered
            row_bytes = lin.node.meta["val"].element_size() * lin.in_features
            split_rows = sum(end - first for _, first, end in lin.part_slices
                             if (end - first) // site.head_dim % t == 0)
            ag_s, ag_bytes = mc.collective("all_gather", split_rows * row_bytes, cand.axis)
            cost = dataclasses.replace(
                cost, comm_s=cost.comm_s + ag_s, comm_bytes=cost.comm_bytes + ag_bytes,
                memory_bytes=cost.memory_bytes + lin.out_features * row_bytes * (1 - 1 / t) * mc.state_factor())
        return cost
