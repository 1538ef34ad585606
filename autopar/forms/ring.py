"""`ring`: ring attention (context parallelism) over the sequence axis.

Everything holds s/p tokens in the zigzag layout (rank r holds chunks r and 2p-1-r of 2p, so causal
work is balanced: a `ZIGZAG` directive on the axis); K/V circulate in p-1 steps while each block is
computed, with the online-softmax merge in fp32 (`autopar.runtime.ring_attention`, an `ATTENTION`
directive, mode ring). An explicit mask that recognition proved causal (`passes.masks`: built from
positions only, as Hugging Face models pass one) is dropped and the ring runs is_causal (a
`CAUSAL_MASK` directive). Grouped K/V behind a `repeat_kv` expansion circulate unexpanded. Backward
circulates K/V again and the dK/dV accumulators (in the accumulation dtype: fp32 for half precision),
p-1 steps each. Volume per layer (`layer_volume_bytes`): forward
`2·b·s·h_kv·(p-1)/p` elements, backward the same plus the accumulators. Preconditions: SDPA (or
explicit attention fused to it); no attention mask other than causal (a mask built from positions
only and proved causal counts as causal); no attention dropout; sequence % 2p == 0.
"""

from __future__ import annotations

import torch

from autopar.estimate import compute_s
from autopar.forms import blocks
from autopar.forms.base import Form, Role, register
from autopar.plan import AttentionMode, Directive, DirectiveKind
from autopar.sites import AttentionSite, Kind


def ring_precondition(site: AttentionSite, p: int) -> str | None:
    if site.spelling != "sdpa":
        return (f"it is explicit matmul-softmax-matmul attention, not fused into SDPA: {site.unfused_why}. "
                "Fix: 'heads' or 'replicate'")
    if site.has_mask and not site.mask_causal:
        why = site.mask_note or "it takes an explicit attention mask that is not a causal mask built from positions"
        return f"{why}; ring attention supports is_causal or no mask. Fix: 'ulysses', 'heads' or 'replicate'"
    if site.dropout:
        return "attention dropout is not supported by ring attention. Fix: 'ulysses', 'heads' or 'replicate'"
    if site.seq_len % (2 * p):
        return (f"sequence {site.seq_len} does not split into 2x{p} zigzag chunks. Fix: pad the sequence to a "
                f"multiple of {2 * p}, or 'ulysses'/'heads'/'replicate'")
    return None


def accumulator_itemsize(dtype: torch.dtype) -> int:
    """dK/dV accumulate in fp32 for half precision, in the input dtype otherwise (`block_attention.acc_dtype`)."""
    return max(4, torch.empty((), dtype=dtype).element_size())


def layer_volume_bytes(b: int, s: int, h_kv: int, p: int, itemsize: int, acc_itemsize: int | None = None, *,
                       backward: bool = True) -> float:
    """Bytes each rank sends per layer: p-1 steps of its K,V block (2·b·(s/p)·h_kv) forward; backward K,V again
    and the dK,dV accumulators (`acc_itemsize`, default the input's)."""
    steps, block = p - 1, 2 * b * s / p * h_kv
    fwd = steps * block * itemsize
    bwd = steps * block * (itemsize + (acc_itemsize or itemsize))
    return fwd + bwd if backward else fwd


@register
class Ring(Form):
    name = "ring"
    kinds = (Kind.ATTENTION,)
    roles = (frozenset({Role.SEQUENCE}),)
    sequence = True
    recomputed_whole = True  # `autopar.runtime.checkpoint.whole`: its blocks' score matrices would be kept

    def precondition(self, site: AttentionSite, sizes):
        return ring_precondition(site, sizes[0])

    def directives(self, site: AttentionSite, axes):
        (axis,) = axes
        out = [Directive(kind=DirectiveKind.ATTENTION, node=site.node.name, axis=axis, value=AttentionMode.RING),
               Directive(kind=DirectiveKind.ZIGZAG, node="", axis=axis)]
        if site.has_mask:  # the precondition admits only a mask proved causal: run is_causal, drop the mask
            out.append(Directive(kind=DirectiveKind.CAUSAL_MASK, node=site.node.name, axis=axis))
        return out

    def cost(self, site: AttentionSite, st, cand, mc):
        comms = blocks.Comms(mc, cand.axis)
        buffers = add_ring_comms(comms, site, st, mc, cand.axis)  # alive only while the attention runs
        # saved beyond what the graph says: ring attention returns its output contiguous as (b, heads, s, d), so the
        # reshape to (b, s, h) before the output projection copies it, and the projection saves that copy beside
        # the attention's own saved output
        return blocks.finish(st, cand, mc, compute=compute_s(st, mc.dp, mc.cluster), comms=comms,
                             act=(st.saved_bytes + st.attn_out_bytes) / mc.dp, peak=buffers)


def add_ring_comms(comms: blocks.Comms, site: AttentionSite, st, mc, axis: str, heads_split: int = 1) -> float:
    """Add the ring's p-1 K/V transfers forward and p-1 K/V + p-1 dK/dV transfers backward on `axis` to `comms`
    (K/V of this rank's tokens, their KV heads split `heads_split` ways by a heads axis); return the bytes of
    the K/V double buffer it holds."""
    p = mc.size(axis)
    dtype = site.node.args[0].meta["val"].dtype
    ratio = accumulator_itemsize(dtype) / torch.empty((), dtype=dtype).element_size()
    # a heads axis splits the KV heads, or (fewer than its ranks) leaves each rank the one its query heads use
    kv_heads = site.kv_heads // heads_split if site.kv_heads % heads_split == 0 else 1
    block = 2 * st.io_bytes / mc.dp * kv_heads / site.heads  # this rank's K,V block
    for nbytes in [block] * (p - 1) + [block, ratio * block] * (p - 1):
        comms.add("p2p", nbytes, axis=axis)
    return 2 * block
