"""`tp` of MoE experts: every expert's FFN features split over a model axis (Megatron within each expert).

Expert weights are sharded on their FFN dim: stacked ones (Hugging Face's `gate_up_proj` as two strided
blocks, gate and up) and a ModuleList expert's own weights alike (its first-layer weights (F, H) on dim 0,
its last (H, F) on dim 1, checked on the example to give the expert's output as the sum of the two halves'
outputs: `passes/moe.py`). Each rank runs its share of every expert on every token and the partial outputs
are summed (one all-reduce forward, one of the input's gradient backward). This is Megatron-LM's default
expert tensor parallelism, and `megatron`'s form for MoE blocks.
Precondition: experts with known FFN dims, FFN features % t == 0.
"""

from __future__ import annotations

from autopar.forms import blocks
from autopar.forms.base import Form, Role, register
from autopar.sites import Kind, MoeSite
from autopar.spec import Shard, _StridedShard


@register
class MoeTensorParallel(Form):
    name = "tp"
    kinds = (Kind.MOE,)
    roles = (frozenset({Role.MODEL}),)
    hand_plans = frozenset({"megatron"})

    def precondition(self, site: MoeSite, sizes):
        (t,) = sizes
        if not site.ffn_dims or not site.ffn_features:
            return (f"its experts ({site.spelling}) cannot be split on their FFN features: "
                    f"{site.ffn_why or 'their layout is not known'}. Fix: 'expert' (expert parallel) or 'replicate'")
        if site.ffn_features % t:
            return (f"its {site.ffn_features} expert features do not divide over {t} ranks. Fix: 'expert' "
                    "(expert parallel) or 'replicate'")
        return None

    def placements(self, site: MoeSite, axes, sizes):
        (ax,) = axes
        return {ph: {ax: Shard(d) if k == 1 else _StridedShard(d, split_factor=k)}
                for (d, k), (_, ph) in zip(site.ffn_dims, site.params)}

    def cost(self, site, st, cand, mc):
        return blocks.moe(site, st, cand, mc, split=mc.size(cand.axis), on_data=False)
