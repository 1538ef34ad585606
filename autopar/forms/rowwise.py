"""`rowwise`: a row-parallel linear (Megatron's g): W sharded on its input features.

On a mesh axis of size t: W `Shard(in dim)`, the input sharded on features, the output Partial and
all-reduced forward (identity backward) before the bias, which stays replicated and is added once
(the lowering splits it from the matmul). Under sequence parallelism the partial output is
reduce-scattered onto the sequence instead. Precondition: in features % t == 0.

It is the form of the output layers of attention (`heads`) and MLPs (`tp`); a lone linear takes it
only through an override, and is priced replicated.
"""

from __future__ import annotations

from autopar.estimate import Cost, MeshCosting, SiteStats
from autopar.forms import blocks
from autopar.forms.base import Candidate, Form, Role, register
from autopar.sites import Kind, LinearSite
from autopar.spec import Placement, Replicate, Shard


def rowwise_placements(site: LinearSite) -> dict[str, Placement]:
    out = {site.param["weight"]: Shard(1 - site.out_dim)}
    if "bias" in site.param:
        out[site.param["bias"]] = Replicate()
    return out


@register
class Rowwise(Form):
    name = "rowwise"
    kinds = (Kind.LINEAR,)
    roles = (frozenset({Role.MODEL}),)
    offered = False

    def precondition(self, site: LinearSite, sizes):
        (t,) = sizes
        if site.in_features % t:
            return (f"its {site.in_features} input features do not divide over {t} ranks. Fix: use 'replicate' "
                    "or 'colwise'")
        return None

    def placements(self, site: LinearSite, axes, sizes):
        (ax,) = axes
        return {ph: {ax: p} for ph, p in rowwise_placements(site).items()}

    def cost(self, site, st: SiteStats, cand: Candidate, mc: MeshCosting) -> Cost:
        return blocks.replicated(st, cand, mc)  # a lone linear: priced replicated (module docstring)
