"""Attention: recognition (SDPA and explicit matmul-softmax-matmul, with GQA).

Explicit attention is found from its first matmul: a 4-D `matmul(q, k^T)` on (b, heads, s, d), or a 3-D
`bmm(q, k^T)` / `baddbmm(bias, q, k^T)` on (b·heads, s, d) (Bloom: `baddbmm(alibi, q, k^T)`), then score ops
(scale, mask, soft-capping, casts, views) and a softmax up to `matmul`/`bmm(probs, v)`. For the 3-D spelling the
heads are read off the (b, heads, s, d) tensor that q, k and v are flattened from.

The site records heads, KV heads (those of the K projection, before any repeat_kv expansion), the
sequence, the mask, the q/k/v/output projections, and for explicit attention the reason it was not fused
into SDPA (`passes.fuse_attention`, node meta `passes.meta.UNFUSED`). Its forms (heads, ulysses, ring, and
their two-axis combinations) live in `autopar.forms`.
"""

from __future__ import annotations

import torch
from torch import fx

from autopar.sites import AttentionSite, Kind, PassContext, module_path
from passes import meta as M
from passes.patterns import linears_after, linears_behind

aten = torch.ops.aten
_SCORE_OPS = {aten.div.Tensor, aten.mul.Tensor, aten.div.Scalar, aten.mul.Scalar, aten.masked_fill.Scalar,
              aten.masked_fill.Tensor, aten.add.Tensor, aten.to.dtype, aten._to_copy.default, aten.softmax.int,
              aten._softmax.default, aten.dropout.default, aten.type_as.default, aten.where.self,
              aten.tanh.default,  # soft-capping (Gemma 2): tanh(s / cap) * cap
              aten.view.default, aten.reshape.default, aten._unsafe_view.default}  # (b·heads, s, s) <-> (b, heads, s, s)
_SECOND = (aten.matmul.default, aten.bmm.default)
_FLAT_VIEWS = (aten.view.default, aten.reshape.default, aten._unsafe_view.default, aten.clone.default,
               aten.contiguous.default)


def attention_start(node: fx.Node) -> tuple[fx.Node, fx.Node] | None:
    """(q, k^T) when `node` may be the first matmul of an explicit attention: 4-D matmul, 3-D bmm or baddbmm."""
    if node.op != "call_function":
        return None
    nd = len(node.meta["val"].shape) if isinstance(node.meta.get("val"), torch.Tensor) else 0
    if node.target is aten.matmul.default and nd == 4:
        return node.args[0], node.args[1]
    if node.target is aten.bmm.default and nd == 3:
        return node.args[0], node.args[1]
    if node.target is aten.baddbmm.default and nd == 3:
        return node.args[1], node.args[2]
    return None


def explicit_attention(m1: fx.Node) -> fx.Node | None:
    """The second matmul of matmul(q, kT) -> [scale, mask, softmax] -> matmul(., v), if m1 starts one."""
    n, saw_softmax = m1, False
    for _ in range(12):
        users = list(n.users)
        if len(users) != 1:
            return None
        u = users[0]
        if u.target in _SECOND and u.args[0] is n:
            return u if saw_softmax else None
        if u.target not in _SCORE_OPS:
            return None
        saw_softmax |= u.target in (aten.softmax.int, aten._softmax.default)
        n = u
    return None


def _per_head(n: fx.Node) -> fx.Node | None:
    """The (b, heads, s, d) tensor a (b·heads, s, d) operand is flattened from, or None."""
    flat = tuple(n.meta["val"].shape)
    while n.op == "call_function" and n.target in _FLAT_VIEWS:
        src = n.args[0]
        s = tuple(src.meta["val"].shape)
        if len(s) == 4 and s[0] * s[1] == flat[0] and s[2:] == flat[1:]:
            return src
        n = src
    return None


def _untransposed(kt: fx.Node) -> fx.Node | None:
    """k of k^T = transpose(k, -2, -1) (3-D), else None."""
    if kt.op == "call_function" and kt.target is aten.transpose.int and sorted(d % 3 for d in kt.args[1:3]) == [1, 2]:
        return kt.args[0]
    return None


_REPEAT_KV = (aten.view.default, aten.reshape.default, aten._unsafe_view.default, aten.expand.default,
              aten.unsqueeze.default, aten.clone.default, aten.contiguous.default, aten.alias.default)


def _unexpanded_heads(k: fx.Node) -> int:
    """Heads of k (b, heads, s, d) before a repeat_kv expansion (unsqueeze, expand, reshape)."""
    heads = int(k.meta["val"].shape[1])
    while k.op == "call_function" and k.target in _REPEAT_KV:
        k = k.args[0]
        s = k.meta["val"].shape
        if len(s) == 4:
            heads = min(heads, int(s[1]))
    return heads


def _operands(node: fx.Node):
    """(q, k, v, out, spelling) of an attention anchored at `node` (q, k, v as (b, heads, s, d)), or None."""
    if node.target is aten.scaled_dot_product_attention.default:
        return node.args[0], node.args[1], node.args[2], node, "sdpa"
    start = attention_start(node)
    if start is None:
        return None
    m2 = explicit_attention(node)
    if m2 is None:
        return None
    q, kt = start
    v = m2.args[1]
    if len(node.meta["val"].shape) == 4:
        return q, kt, v, m2, "explicit"
    k3 = _untransposed(kt)
    q, k, v = _per_head(q), k3 is not None and _per_head(k3), _per_head(v)
    if q is None or not k or v is None:
        return None
    return q, k, v, m2, "explicit"


def recognise_attention_pass(gm: fx.GraphModule, ctx: PassContext) -> fx.GraphModule:
    linear_nodes = {s.node: s for s in ctx.of_kind(Kind.LINEAR)}
    for node in gm.graph.nodes:
        if node.op != "call_function":
            continue
        found = _operands(node)
        if found is None:
            continue
        q, k, v, out, spelling = found
        qs = tuple(q.meta["val"].shape)
        if len(qs) != 4:
            continue
        heads, head_dim = qs[1], qs[3]
        q_lin, k_lin = linears_behind(q, linear_nodes), linears_behind(k, linear_nodes)
        kv_heads = _unexpanded_heads(k)
        if k_lin and k_lin[0] not in q_lin:  # heads of the K projection, before any repeat_kv expansion
            feats = k_lin[0].out_features // k_lin[0].parts
            if feats % head_dim == 0:
                kv_heads = feats // head_dim
        fields = {}
        if spelling == "sdpa":
            a = node.args
            fields = dict(has_mask=len(a) > 3 and a[3] is not None,
                          dropout=float(a[4]) if len(a) > 4 else float(node.kwargs.get("dropout_p", 0.0)),
                          causal=bool(a[5]) if len(a) > 5 else bool(node.kwargs.get("is_causal", False)))
        else:
            fields = dict(unfused_why=out.meta.get(M.UNFUSED, "it was not fused into a fused attention (SDPA)"))
        ctx.add(AttentionSite(key=module_path(node) or node.name, node=node, spelling=spelling, heads=heads,
                              kv_heads=kv_heads, head_dim=head_dim, seq_len=qs[2],
                              q=tuple(q_lin), k=tuple(k_lin),
                              v=tuple(linears_behind(v, linear_nodes)), out=tuple(linears_after(out, linear_nodes)),
                              **fields))
    return gm
