"""`expert`: expert parallelism of an MoE block over one mesh axis (GShard / Switch / Megatron EP).

The experts are split over the axis (`E % ep == 0`): stacked expert weights `S(0)`; a ModuleList
expert's weights live whole on the ranks that own it (`O(owner)`: a DTensor on their sub-mesh, empty
elsewhere), and in the graph the stack of this rank's experts is `S(0)`. The experts node runs in one
of two modes (`EXPERTS` directive; `autopar.runtime.moe`): on an axis where the tokens are sharded
(a data axis: EP within DP, the usual case) tokens go to their experts' ranks by `all_to_all_single`
with this step's uneven splits and come back the same way (dropless, or capacity counted in global
token order); on an axis where they are replicated each rank runs its own experts on every token and
the output is summed. Expert gradients are reduced over the other data axes only. Volume per MoE
layer on a data axis: 4 all-to-alls of `k·T·h·(ep-1)/ep` (`layer_volume_bytes`).
"""

from __future__ import annotations

from autopar.forms import blocks
from autopar.forms.base import Form, Role, register
from autopar.plan import Directive, DirectiveKind
from autopar.sites import Kind, MoeSite
from autopar.spec import Owned, Shard
from cost_model.analytical import send_bytes


def layer_volume_bytes(tokens: int, k: int, h: int, ep: int, itemsize: int, *, capacity_factor: float | None = None,
                       backward: bool = True) -> float:
    """Bytes each rank sends per MoE layer: dispatch + combine all-to-alls of the k·T·h routed rows (x cf when
    capacity-padded), forward (and backward)."""
    per_a2a = send_bytes("all_to_all", (capacity_factor or 1.0) * k * tokens * h, ep) * itemsize
    return (4 if backward else 2) * per_a2a


@register
class Expert(Form):
    name = "expert"
    kinds = (Kind.MOE,)
    roles = (frozenset({Role.DATA, Role.MODEL, Role.SEQUENCE}),)

    def precondition(self, site: MoeSite, sizes):
        (ep,) = sizes
        if site.num_experts % ep:
            return (f"{site.num_experts} experts do not divide over {ep} ranks. Fix: use an axis whose size divides "
                    "the expert count, or 'replicate'")
        return None

    def placements(self, site: MoeSite, axes, sizes):
        (ax,), (ep,) = axes, sizes
        per_rank = site.num_experts // ep
        if site.stacked:  # (E, ...) weights: this rank's experts are a dim-0 shard
            return {ph: {ax: Shard(0)} for _, ph in site.params}
        # ModuleList: expert i's weights live whole on the rank that owns it
        return {ph: {ax: Owned(int(role.split(".")[0]) // per_rank)} for role, ph in site.params}

    def directives(self, site: MoeSite, axes):
        (axis,) = axes
        return [Directive(kind=DirectiveKind.EXPERTS, node=site.node.name, axis=axis)]

    def cost(self, site, st, cand, mc):
        return blocks.moe(site, st, cand, mc, split=mc.size(cand.axis),
                          on_data=cand.axis in mc.data_axes + mc.seq_axes)
