"""`heads`: attention split by heads over a model axis (Megatron tensor parallelism).

On an axis of size t: the q/k/v projections column-parallel (a fused QKV projection per q/k/v part,
`_StridedShard`), the output projection row-parallel, the attention itself local on heads/t heads.
KV heads fewer than t (GQA/MQA with t % kv == 0) stay replicated and each rank picks the KV heads its
query heads use (`autopar.runtime.ops.gqa_kv_heads`). Collectives: the block's all-reduce forward
(row-parallel output) and backward (column-parallel input gradient), `blocks.tensor_parallel`.
Preconditions: heads % t == 0; KV heads % t == 0 or t % KV heads == 0; recognised q and output
projections; a fused QKV projection with as many KV as query heads per rank.
"""

from __future__ import annotations

from autopar.forms import blocks
from autopar.forms.base import Form, Role, register
from autopar.forms.colwise import colwise_placements
from autopar.forms.rowwise import rowwise_placements
from autopar.sites import AttentionSite, Kind


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
    fused = [s for s in site.q if s in site.k]
    if fused and fused[0].parts == 1 and not fused[0].head_interleaved:
        return (f"its fused QKV projection {fused[0].key} lays out q, k and v as blocks of unequal size on its "
                f"{fused[0].out_features} output features ({h} query heads, {kv} KV heads of {site.head_dim} each), "
                "and no one placement of its weight gives every rank whole heads of each block (a strided shard "
                "splits equal blocks only). Fix: 'replicate' for this attention, or separate q/k/v projections")
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

    def precondition(self, site: AttentionSite, sizes):
        return heads_precondition(site, sizes[0])

    def placements(self, site: AttentionSite, axes, sizes):
        (ax,), (t,) = axes, sizes
        out: dict = {}
        kv_sharded = site.kv_heads % t == 0
        for lin in site.q + (site.k + site.v if kv_sharded else ()):
            for ph, p in colwise_placements(lin).items():
                out[ph] = {ax: p}
        for lin in site.out:
            for ph, p in rowwise_placements(lin).items():
                out[ph] = {ax: p}
        return out

    def row_linears(self, site: AttentionSite):
        return list(site.out)

    def cost(self, site, st, cand, mc):
        return blocks.tensor_parallel(st, cand, mc)
