"""Explicit attention -> one fused attention node.

`softmax(q @ k.T * scale [+ mask | masked_fill(causal, -inf)]) [dropout] @ v`, written out with
matmuls, becomes `aten.scaled_dot_product_attention(q, k, v, attn_mask, dropout_p, is_causal, scale)`:
its memory is then that of a flash/memory-efficient kernel (no materialised b·h·s² score matrix on
GPUs), and every attention form (heads, Ulysses, ring) applies to it. A chain with any op this pass
does not understand is left alone (the attention is still recognised and sharded by heads), and its
second matmul records why in `node.meta[passes.meta.UNFUSED]`: soft-capped scores (Gemma 2's
`tanh(s / cap) * cap`), scores computed per (batch·head) with `bmm`/`baddbmm` (Bloom's ALiBi), a
narrowing cast, or another op the fusion does not understand.
"""

from __future__ import annotations


import torch
from torch import fx

from autopar.sites import PassContext
from passes import meta as M
from passes.attention import attention_start, explicit_attention

aten = torch.ops.aten
_CASTS = {aten.to.dtype, aten._to_copy.default, aten.type_as.default, aten.to.dtype_layout}


def _is_causal_mask(m: fx.Node, s_q: int, s_k: int) -> bool:
    """triu(ones(s, s), diagonal=1), possibly cast to bool: True above the diagonal (masked)."""
    while isinstance(m, fx.Node) and m.op == "call_function" and m.target in _CASTS:
        m = m.args[0]
    if not (isinstance(m, fx.Node) and m.target is aten.triu.default):
        return False
    diagonal = m.args[1] if len(m.args) > 1 else m.kwargs.get("diagonal", 0)
    base = m.args[0]
    return (diagonal == 1 and s_q == s_k and isinstance(base, fx.Node)
            and base.target in (aten.ones.default, aten.full.default)
            and tuple(base.meta["val"].shape) == (s_q, s_k))


def _plan_fusion(m1: fx.Node, m2: fx.Node):
    """(scale, is_causal, additive mask node, bool keep-mask node, dropout_p), or why it is not fusable (a str)."""
    q, kt = m1.args[0], m1.args[1]
    s_q, s_k = q.meta["val"].shape[-2], kt.meta["val"].shape[-1]
    scale, causal, add_mask, fill_mask, dropout = 1.0, False, None, None, 0.0
    n = m1
    saw_softmax = False
    while True:
        u = next(iter(n.users))
        if u is m2:
            break
        t = u.target
        other = u.args[1] if len(u.args) > 1 else None
        if t in (aten.div.Tensor, aten.div.Scalar) and isinstance(other, (int, float)) and not saw_softmax:
            scale /= other
        elif t in (aten.mul.Tensor, aten.mul.Scalar) and isinstance(other, (int, float)) and not saw_softmax:
            scale *= other
        elif t in (aten.masked_fill.Scalar,) and not saw_softmax and u.args[2] == float("-inf"):
            if _is_causal_mask(other, s_q, s_k) and not causal:
                causal = True
            elif fill_mask is None and add_mask is None:
                fill_mask = other
            else:
                return "its scores take more than one mask"
        elif t is aten.add.Tensor and isinstance(other, fx.Node) and not saw_softmax and add_mask is None \
                and fill_mask is None:
            add_mask = other
        elif t in _CASTS:
            # an upcast is what SDPA does internally; a downcast changes the numbers: leave the chain alone
            if u.meta["val"].element_size() < q.meta["val"].element_size():
                return f"it rounds the scores to {u.meta['val'].dtype}, which a fused attention would not"
        elif t in (aten.softmax.int, aten._softmax.default) and not saw_softmax:
            dim = u.args[1]
            if dim not in (-1, len(u.meta["val"].shape) - 1):
                return f"its softmax runs over dim {dim}, not the keys"
            if u.meta["val"].element_size() < q.meta["val"].element_size():  # softmax(..., dtype=float32)
                return f"it rounds the scores to {u.meta['val'].dtype} in its softmax, which a fused attention would not"
            saw_softmax = True
        elif t is aten.dropout.default and saw_softmax:
            dropout = float(u.args[1]) if u.args[2] else 0.0
        elif t is aten.tanh.default:
            return ("its scores are soft-capped (tanh(scores / cap) * cap), which a fused attention (SDPA) cannot "
                    "compute")
        else:
            return f"its score chain has {t} {'after' if saw_softmax else 'before'} the softmax, which the fusion " \
                   "does not understand"
        n = u
    return scale, causal, add_mask, fill_mask, dropout


def fuse_attention_pass(gm: fx.GraphModule, ctx: PassContext) -> fx.GraphModule:
    g = gm.graph
    fused = 0
    for m1 in list(g.nodes):
        if attention_start(m1) is None:
            continue
        m2 = explicit_attention(m1)
        if m2 is None:
            continue
        if len(m1.meta["val"].shape) != 4:
            m2.meta[M.UNFUSED] = ("its scores are computed per (batch x head) with bmm/baddbmm on (b*heads, s, d) "
                                  "tensors (e.g. Bloom's ALiBi bias), which autopar does not fuse into a fused "
                                  "attention (SDPA) yet")
            continue
        plan = _plan_fusion(m1, m2)
        if isinstance(plan, str):
            m2.meta[M.UNFUSED] = plan
            continue
        scale, causal, add_mask, fill_mask, dropout = plan
        q, kt, v = m1.args[0], m1.args[1], m2.args[1]
        with g.inserting_before(m2):
            if kt.op == "call_function" and kt.target is aten.transpose.int and sorted(
                    d % 4 for d in kt.args[1:3]) == [2, 3]:
                k = kt.args[0]
            else:
                k = g.call_function(aten.transpose.int, (kt, -2, -1))
                k.meta["val"] = kt.meta["val"].transpose(-2, -1)
            mask = add_mask
            if fill_mask is not None:
                mask = g.call_function(aten.logical_not.default, (fill_mask,))
                mask.meta["val"] = fill_mask.meta["val"].logical_not()
            attn = g.call_function(aten.scaled_dot_product_attention.default, (q, k, v, mask, dropout, causal),
                                   {"scale": scale})
        attn.meta.update(m2.meta)
        attn.meta["val"] = m2.meta["val"]
        m2.replace_all_uses_with(attn)
        g.erase_node(m2)
        fused += 1
    if fused:
        g.eliminate_dead_code()
        gm.recompile()
    return gm
