"""`replicate`: the structure runs whole on every rank, on that rank's share of the batch.

No collective of its own; its parameters are replicated over the model axes and synchronised over the
data axes like every structure's (`dp` bucket or `fsdp`). Applies to every kind; the fallback when
another form's precondition fails (the plan notes why).
"""

from __future__ import annotations

from autopar.estimate import Cost, MeshCosting, SiteStats
from autopar.forms import blocks
from autopar.forms.base import Candidate, Form, register
from autopar.sites import Kind, Site


@register
class Replicate(Form):
    name = "replicate"
    kinds = tuple(Kind)
    hand_plans = frozenset({"megatron", "dp", "fsdp"})

    def cost(self, site: Site, st: SiteStats, cand: Candidate, mc: MeshCosting) -> Cost:
        if site.kind is Kind.MOE:
            return blocks.moe(site, st, cand, mc, split=1, on_data=False)
        return blocks.replicated(st, cand, mc)
