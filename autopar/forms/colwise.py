"""`colwise`: a column-parallel linear (Megatron's f): W sharded on its output features.

On a mesh axis of size t: W `Shard(out_dim)`, bias `Shard(0)`; the input replicated (its gradient is
partial: `grad_all_reduce`, identity forward / all-reduce backward), the output sharded on features.
A fused projection whose output is split into k equal parts (QKV, gate-up) is sharded per part:
`_StridedShard(out_dim, split_factor=k)`, so every rank holds its slice of each part.
Precondition: out features % (t · parts) == 0.

It is the form of the column layers of attention (`heads`), MLPs (`tp`) and LM heads (`vocab` loss);
a lone linear takes it only through an override, and is priced replicated.
"""

from __future__ import annotations

from autopar.estimate import Cost, MeshCosting, SiteStats
from autopar.forms import blocks
from autopar.forms.base import Candidate, Form, Role, register
from autopar.sites import Kind, LinearSite
from autopar.spec import Placement, Shard, _StridedShard


def colwise_placements(site: LinearSite) -> dict[str, Placement]:
    k = site.parts
    out = {site.param["weight"]: _StridedShard(site.out_dim, split_factor=k) if k > 1 else Shard(site.out_dim)}
    if "bias" in site.param:
        out[site.param["bias"]] = _StridedShard(0, split_factor=k) if k > 1 else Shard(0)
    return out


@register
class Colwise(Form):
    name = "colwise"
    kinds = (Kind.LINEAR,)
    roles = (frozenset({Role.MODEL}),)
    offered = False

    def precondition(self, site: LinearSite, sizes):
        (t,) = sizes
        if site.out_features % (t * site.parts):
            parts = f" times its {site.parts} fused parts" if site.parts > 1 else ""
            return (f"its {site.out_features} output features do not divide over {t} ranks{parts}. Fix: use "
                    "'replicate' for this layer or a mesh axis that divides them")
        return None

    def placements(self, site: LinearSite, axes, sizes):
        (ax,) = axes
        return {ph: {ax: p} for ph, p in colwise_placements(site).items()}

    def cost(self, site, st: SiteStats, cand: Candidate, mc: MeshCosting) -> Cost:
        return blocks.replicated(st, cand, mc)  # a lone linear: priced replicated (module docstring)
