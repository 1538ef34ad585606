"""`vocab` of a cross-entropy loss: vocab-parallel cross-entropy over a model axis (Megatron).

The LM head is column-parallel and its logits stay sharded on the vocabulary; the loss is computed
with 3 all-reduces of b·s fp32 values (max, target logit, sum of exps) instead of gathering the b·s·V
logits (`autopar.runtime.ops.vocab_parallel_cross_entropy`); backward needs none of its own (the
head's input gradient is all-reduced, as any column-parallel input's). Whatever the form, a mean over
a sharded batch divides by the global count of valid tokens. Preconditions: 2-D logits, no class
weights, no label smoothing, vocab % t == 0, logits from a recognised linear (the LM head).
"""

from __future__ import annotations

from autopar.estimate import compute_s
from autopar.forms import blocks
from autopar.forms.base import Form, Role, register
from autopar.forms.colwise import colwise_placements
from autopar.sites import Kind, LossSite
from cost_model.analytical import compute_time_s, has_kernel_rates, kernel_time_s, send_bytes

# Passes over the local logits (N, V/t), in units of their fp32 bytes, that the vocab-parallel cross-entropy of
# autopar.runtime.ops (_VocabParallelCrossEntropy) makes forward and backward: amax 1, subtract the max 2, exp 2,
# sum 1, normalise in place 2; backward: scale by the incoming gradient 2, zeros for the one-hot 1, the one-hot
# term 2, the difference 3. (aten's fused cross_entropy_loss moves about 9 of the full logits: node_cost.)
VOCAB_CE_PASSES = 16
# Logit-sized fp32 buffers its backward holds besides the saved softmax: the scaled softmax, the one-hot, its scaled
# copy, their difference (`_VocabParallelCrossEntropy.backward`); at the step's peak when the logits dominate.
VOCAB_CE_BACKWARD_BUFFERS = 4


def volume_bytes(tokens: int, t: int) -> float:
    """Bytes each rank sends per step for the loss itself: 3 all-reduces of one fp32 per token (the LM head's
    input gradient is its column-parallel all-reduce)."""
    return 3 * send_bytes("all_reduce", 4 * tokens, t)


def extra_bytes(st) -> float:
    """What the vocab-parallel cross-entropy moves beyond 3x the fused op it replaces (global, fp32)."""
    return max(0.0, VOCAB_CE_PASSES * st.ce_logits_fp32_bytes - 3 * st.ce_fused_bytes)


@register
class VocabLoss(Form):
    name = "vocab"
    kinds = (Kind.LOSS,)
    roles = (frozenset({Role.MODEL}),)
    hand_plans = frozenset({"megatron"})

    def precondition(self, site: LossSite, sizes):
        (t,) = sizes
        if site.vocab_why:
            return f"{site.vocab_why}. Fix: use 'replicate' for the loss"
        if site.vocab % t:
            return f"vocab {site.vocab} does not divide over {t} ranks. Fix: pad the vocabulary, or 'replicate'"
        if not site.head:
            return "the logits do not come from a recognised linear (the LM head). Fix: use 'replicate' for the loss"
        return None

    def placements(self, site: LossSite, axes, sizes):
        (ax,) = axes
        return {ph: {ax: p} for lin in site.head for ph, p in colwise_placements(lin).items()}

    def cost(self, site, st, cand, mc):
        t = mc.size(cand.axis)
        compute = compute_s(st, mc.dp * t, mc.cluster)
        fwd_s, bwd_s = compute / 3, 2 * compute / 3
        extra = extra_bytes(st) / mc.dp / t
        compute += kernel_time_s("vector", 0, extra, "float32", mc.cluster) if has_kernel_rates(mc.cluster) \
            else compute_time_s(0, extra, "float32", mc.cluster)
        comms = blocks.Comms(mc, cand.axis)
        comms.add("all_reduce", st.io_bytes / mc.dp, bwd_s)  # the LM head input's gradient, under its weight gradient
        hidden = blocks.weight_grad_cover_s(st, site.head, compute, comms.time_s)
        for _ in range(3):  # max, target logit, sum of exps: they split the forward between them
            comms.add("all_reduce", st.tokens / mc.dp * 4, fwd_s / 3)
        if st.logits_out:  # the model also returns its logits: gathered
            comms.add("all_gather", st.logits_bytes / mc.dp)
        # what it saves (log-probabilities) and its momentary logit gradients are split on the vocabulary; it also
        # saves two 1-byte masks per token (targets outside this rank's columns, ignored targets) and its local
        # targets in place of the targets the graph's cross-entropy saves (`_VocabParallelCrossEntropy`)
        act = st.saved_bytes / mc.dp / t + 2 * st.tokens / mc.dp
        return blocks.finish(st, cand, mc, compute=compute, comms=comms, act=act, param_split=t,
                             backward_s=bwd_s, peak=VOCAB_CE_BACKWARD_BUFFERS * st.ce_logits_fp32_bytes / mc.dp / t,
                             hidden=hidden)
