"""Attention: recognition (SDPA and explicit matmul-softmax-matmul, with GQA).

The site records heads, KV heads (those of the K projection, before any repeat_kv expansion), the
sequence, the mask, and the q/k/v/output projections. Its forms (heads, ulysses, ring, and their
two-axis combinations) live in `autopar.forms`.
"""

from __future__ import annotations

import torch
from torch import fx

from autopar.sites import AttentionSite, Kind, PassContext, module_path
from passes.patterns import linears_after, linears_behind

aten = torch.ops.aten
_SCORE_OPS = {aten.div.Tensor, aten.mul.Tensor, aten.div.Scalar, aten.mul.Scalar, aten.masked_fill.Scalar,
              aten.masked_fill.Tensor, aten.add.Tensor, aten.to.dtype, aten._to_copy.default, aten.softmax.int,
              aten._softmax.default, aten.dropout.default, aten.type_as.default, aten.where.self}


def explicit_attention(m1: fx.Node) -> fx.Node | None:
    """The second matmul of matmul(q, kT) -> [scale, mask, softmax] -> matmul(., v), if m1 starts one."""
    n, saw_softmax = m1, False
    for _ in range(10):
        users = list(n.users)
        if len(users) != 1:
            return None
        u = users[0]
        if u.target in (aten.matmul.default, aten.bmm.default) and u.args[0] is n:
            return u if saw_softmax else None
        if u.target not in _SCORE_OPS:
            return None
        saw_softmax |= u.target in (aten.softmax.int, aten._softmax.default)
        n = u
    return None


def recognise_attention_pass(gm: fx.GraphModule, ctx: PassContext) -> fx.GraphModule:
    linear_nodes = {s.node: s for s in ctx.of_kind(Kind.LINEAR)}
    for node in gm.graph.nodes:
        if node.op != "call_function":
            continue
        if node.target is aten.scaled_dot_product_attention.default:
            q, k, v = node.args[:3]
            out = node
            spelling = "sdpa"
        elif node.target is aten.matmul.default and len(node.meta["val"].shape) == 4:
            m2 = explicit_attention(node)
            if m2 is None:
                continue
            q, k, v, out = node.args[0], node.args[1], m2.args[1], m2
            spelling = "explicit"
        else:
            continue
        qs = tuple(q.meta["val"].shape)
        if len(qs) != 4:
            continue
        heads, head_dim = qs[1], qs[3]
        k_lin = linears_behind(k, linear_nodes)
        kv_heads = int(k.meta["val"].shape[1])
        if k_lin:  # heads of the K projection, before any repeat_kv expansion
            feats = k_lin[0].out_features // k_lin[0].parts
            if feats % head_dim == 0:
                kv_heads = feats // head_dim
        fields = {}
        if spelling == "sdpa":
            a = node.args
            fields = dict(has_mask=len(a) > 3 and a[3] is not None,
                          dropout=float(a[4]) if len(a) > 4 else float(node.kwargs.get("dropout_p", 0.0)),
                          causal=bool(a[5]) if len(a) > 5 else bool(node.kwargs.get("is_causal", False)))
        ctx.add(AttentionSite(key=module_path(node) or node.name, node=node, spelling=spelling, heads=heads,
                              kv_heads=kv_heads, head_dim=head_dim, seq_len=qs[2],
                              q=tuple(linears_behind(q, linear_nodes)), k=tuple(k_lin),
                              v=tuple(linears_behind(v, linear_nodes)), out=tuple(linears_after(out, linear_nodes)),
                              **fields))
    return gm
