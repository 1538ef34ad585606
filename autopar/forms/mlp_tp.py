"""`tp` of an MLP: Megatron's column -> row pair over a model axis.

The feeding linears (gate and up, or one fused gate-up projection per half) column-parallel, the
consuming one row-parallel: each rank computes 1/t of the hidden features; one all-reduce forward
(the row-parallel output) and one backward (the input's gradient), `blocks.tensor_parallel`.
Precondition: hidden features % t == 0.
"""

from __future__ import annotations

from autopar.forms import blocks
from autopar.forms.base import Form, Role, register
from autopar.forms.colwise import colwise_placements
from autopar.forms.rowwise import rowwise_placements
from autopar.sites import Kind, MlpSite


@register
class MlpTensorParallel(Form):
    name = "tp"
    kinds = (Kind.MLP,)
    roles = (frozenset({Role.MODEL}),)
    tensor_parallel = True
    hand_plans = frozenset({"megatron"})
    partial_output = True  # the row-parallel layer's

    def precondition(self, site: MlpSite, sizes):
        (t,) = sizes
        if site.features % t:
            return (f"its {site.features} hidden features do not divide over {t} ranks. Fix: 'replicate' or "
                    "another axis")
        return None

    def placements(self, site: MlpSite, axes, sizes):
        (ax,) = axes
        out: dict = {}
        for lin in site.col:
            out.update({ph: {ax: p} for ph, p in colwise_placements(lin).items()})
        for lin in site.row:
            out.update({ph: {ax: p} for ph, p in rowwise_placements(lin).items()})
        return out

    def row_linears(self, site: MlpSite):
        return list(site.row)

    def cost(self, site, st, cand, mc):
        return blocks.tensor_parallel(st, cand, mc, site.col)
