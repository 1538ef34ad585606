"""Attention on two axes: heads over a model axis, and a sequence form over the sequence axis within them.

The base of `heads+ring` (`autopar.forms.heads_ring`) and `heads+ulysses` (`autopar.forms.heads_ulysses`):
the attention is split by heads over the first axis exactly as `heads` splits it (its q/k/v projections
column-parallel, its output projection row-parallel, `heads.placements`, the block's all-reduces forward
and backward on that axis) and, within each rank's heads/t heads, by the sequence form over the second
axis exactly as that form runs alone (its directives on that axis, its collectives for the local heads).
Nothing here re-states either form: preconditions, placements, directives and costs are theirs,
composed. Roles (MODEL, SEQUENCE); `sequence` (the solver offers it when an axis takes the sequence
role, and the inputs are split on the sequence there); `tensor_parallel` on the heads axis (activations
replicated on it in and out, the row-parallel output partial), so Megatron sequence parallelism
(norm: `sequence`) applies on that axis as it does with `heads`.
"""

from __future__ import annotations

import dataclasses
from typing import ClassVar

from autopar.forms import blocks
from autopar.forms.base import Form, Role
from autopar.forms.heads import Heads
from autopar.sites import AttentionSite, Kind


class HeadsAndSequence(Form):
    """Heads over `axes[0]`, the sequence form `within` over `axes[1]`. Subclasses set `name`, `within`, and
    `within_precondition` / `add_within_comms` for the sequence form on the heads of one rank."""

    kinds = (Kind.ATTENTION,)
    roles = (frozenset({Role.MODEL}), frozenset({Role.SEQUENCE}))
    tensor_parallel = True
    sequence = True
    heads: ClassVar[Form] = Heads()
    within: ClassVar[Form]

    def within_precondition(self, site: AttentionSite, t: int, p: int) -> str | None:
        raise NotImplementedError

    def add_within_comms(self, comms: blocks.Comms, site: AttentionSite, st, mc, axis: str, t: int) -> float:
        """Add the sequence form's collectives on `axis` for the heads of one rank; return the bytes of the buffers
        it holds while it runs (`Cost.peak_bytes`)."""
        raise NotImplementedError

    def precondition(self, site: AttentionSite, sizes):
        t, p = sizes
        why = self.heads.precondition(site, (t,))
        if why:
            return f"on its heads axis (size {t}): {why}"
        why = self.within_precondition(site, t, p)
        return f"on its sequence axis (size {p}): {why}" if why else None

    def placements(self, site: AttentionSite, axes, sizes):
        out: dict = {}
        for part, ax, size in ((self.heads, axes[0], sizes[0]), (self.within, axes[1], sizes[1])):
            for ph, per_axis in part.placements(site, (ax,), (size,)).items():
                out.setdefault(ph, {}).update(per_axis)
        return out

    def directives(self, site: AttentionSite, axes):
        return self.heads.directives(site, axes[:1]) + self.within.directives(site, axes[1:])

    def notes(self, site: AttentionSite, axes):
        return self.heads.notes(site, axes[:1]) + self.within.notes(site, axes[1:])

    def row_linears(self, site: AttentionSite):
        return self.heads.row_linears(site)

    def cost(self, site: AttentionSite, st, cand, mc):
        """`heads` on the model axis (its tokens already split over the sequence axis: `mc.dp` counts it), plus
        the sequence form's collectives for the heads of one rank."""
        tp, seq = cand.axes
        cost = self.heads.cost(site, st, dataclasses.replace(cand, form=self.heads.name, axes=(tp,)), mc)
        comms = blocks.Comms(mc, seq)
        peak = self.add_within_comms(comms, site, st, mc, seq, mc.size(tp))
        # the sequence form's copy of the attention output, saved by the output projection (`ring`, `ulysses`)
        act = st.attn_out_bytes / mc.dp / mc.size(tp)
        return dataclasses.replace(cost, comm_s=cost.comm_s + comms.time_s, comm_bytes=cost.comm_bytes + comms.bytes,
                                   memory_bytes=cost.memory_bytes + act, act_bytes=cost.act_bytes + act,
                                   peak_bytes=max(cost.peak_bytes, peak))
