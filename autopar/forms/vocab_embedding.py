"""`vocab` of an embedding: the table sharded on its rows (the vocabulary) over a model axis.

Each rank looks up the ids in its rows and zeroes the rest (`autopar.runtime.ops.vocab_parallel_embedding`,
which keeps `padding_idx`: the pad row's gradient stays zero as on one device); the partial outputs
are all-reduced forward (a reduce-scatter under sequence parallelism), nothing backward. A tied LM head
uses the same row shard (column-parallel logits). An embedding added to an earlier one (GPT's position
embedding into the token embedding) shares that one's all-reduce: it may be vocab-parallel on an axis
only where the earlier one is (a solver constraint), and then pays no collective of its own.
Preconditions: vocab % t == 0 (uneven row shards are not supported); no `max_norm` (renormalising
rows in place needs every row's norm) and no `scale_grad_by_freq` (the frequency is over all ids).
"""

from __future__ import annotations

from autopar.estimate import compute_s
from autopar.forms import blocks
from autopar.forms.base import Form, Role, register
from autopar.sites import EmbeddingSite, Kind
from autopar.spec import Shard
from cost_model.analytical import send_bytes


def volume_bytes(output_bytes: float, t: int, *, sequence_parallel: bool = False) -> float:
    """Bytes each rank sends per step: the forward all-reduce of the output (a reduce-scatter under SP)."""
    return send_bytes("reduce_scatter" if sequence_parallel else "all_reduce", output_bytes, t)


@register
class VocabEmbedding(Form):
    name = "vocab"
    kinds = (Kind.EMBEDDING,)
    roles = (frozenset({Role.MODEL}),)
    hand_plans = frozenset({"megatron"})
    partial_output = True  # each rank's rows' lookups

    def precondition(self, site: EmbeddingSite, sizes):
        (t,) = sizes
        if site.vocab % t:
            return (f"vocab {site.vocab} does not divide over {t} ranks; uneven vocab shards are not supported "
                    "yet. Fix: pad the vocabulary to a multiple of the axis size, or 'replicate'")
        if site.max_norm is not None:
            return "it renormalises rows (max_norm), which needs every row. Fix: 'replicate'"
        if site.scale_grad_by_freq:
            return "it scales gradients by id frequency over the whole vocabulary. Fix: 'replicate'"
        return None

    def placements(self, site: EmbeddingSite, axes, sizes):
        (ax,) = axes
        return {site.param["weight"]: {ax: Shard(0)}}

    def cost(self, site, st, cand, mc):
        t = mc.size(cand.axis)
        compute = compute_s(st, mc.dp * t, mc.cluster)
        comms = blocks.Comms(mc, cand.axis)
        if st.summed_into is None:  # else reduced with the embedding it is added to
            comms.add("all_reduce", st.act_bytes / mc.dp, compute / 3)
        # saved beyond the graph's: the 1-byte mask of the ids outside this rank's rows (`vocab_parallel_embedding`)
        act = (st.saved_bytes + st.index_numel) / mc.dp
        return blocks.finish(st, cand, mc, compute=compute, comms=comms, act=act, param_split=t)

    def add_constraints(self, view, site, cand, var):
        leader = view.stats(site).summed_into
        if leader is not None:
            view.require_site(var, leader, lambda c: c.form == self.name and c.axis == cand.axis,
                              why=f"an embedding added to {leader} is vocab-parallel only where {leader} is")
