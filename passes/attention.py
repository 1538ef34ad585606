"""Attention: recognition (SDPA and explicit matmul-softmax-matmul, with GQA) and the heads form.

Heads form on an axis of size t (Megatron): q/k/v projections colwise (a fused QKV projection per
head block), the output projection rowwise, the attention itself local on heads/t heads. KV heads
fewer than t (GQA/MQA) stay replicated and each rank picks the KV heads its query heads use.
Preconditions: heads % t == 0; KV heads % t == 0 or t % KV heads == 0.
Sequence forms (`ulysses`, `ring`) are issue #4's.
"""

from __future__ import annotations

import torch
from torch import fx

from passes.context import TRANSPARENT, PassContext, Site, module_path

aten = torch.ops.aten
FORMS = ("replicate", "heads", "ulysses", "ring")
_SCORE_OPS = {aten.div.Tensor, aten.mul.Tensor, aten.div.Scalar, aten.mul.Scalar, aten.masked_fill.Scalar,
              aten.masked_fill.Tensor, aten.add.Tensor, aten.to.dtype, aten._to_copy.default, aten.softmax.int,
              aten._softmax.default, aten.dropout.default, aten.type_as.default, aten.where.self}
_BACK_THROUGH = TRANSPARENT | {aten.mul.Tensor, aten.add.Tensor, aten.sub.Tensor, aten.neg.default, aten.cat.default,
                               aten.chunk.default, aten.split.Tensor, aten.split_with_sizes.default}


def _linears_behind(node: fx.Node, linear_nodes: dict[fx.Node, Site]) -> list[Site]:
    import operator
    found, seen, stack = [], set(), [node]
    while stack:
        n = stack.pop()
        if n in seen or not isinstance(n, fx.Node):
            continue
        seen.add(n)
        if n in linear_nodes:
            found.append(linear_nodes[n])
            continue
        if n.op != "call_function" or not (n.target in _BACK_THROUGH or n.target is operator.getitem):
            continue
        for a in n.all_input_nodes:
            if isinstance(a.meta.get("val"), (torch.Tensor, list, tuple)):
                stack.append(a)
    return found


def _linears_after(node: fx.Node, linear_nodes: dict[fx.Node, Site]) -> list[Site]:
    found, seen, stack = [], set(), [node]
    while stack:
        n = stack.pop()
        if n in seen:
            continue
        seen.add(n)
        for u in n.users:
            if u in linear_nodes and linear_nodes[u].node.args[0 if u.target is not aten.addmm.default else 1] is n:
                found.append(linear_nodes[u])
            elif u.op == "call_function" and u.target in TRANSPARENT:
                stack.append(u)
    return found


def _explicit_attention(m1: fx.Node) -> fx.Node | None:
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
    linear_nodes = {s.node: s for s in ctx.of_kind("linear")}
    for node in gm.graph.nodes:
        if node.op != "call_function":
            continue
        if node.target is aten.scaled_dot_product_attention.default:
            q, k, v = node.args[:3]
            out = node
            spelling = "sdpa"
        elif node.target is aten.matmul.default and len(node.meta["val"].shape) == 4:
            m2 = _explicit_attention(node)
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
        k_lin = _linears_behind(k, linear_nodes)
        kv_heads = int(k.meta["val"].shape[1])
        if k_lin:  # heads of the K projection, before any repeat_kv expansion
            feats = k_lin[0].info["out_features"] // k_lin[0].info["parts"]
            if feats % head_dim == 0:
                kv_heads = feats // head_dim
        site = Site("attention", module_path(node) or node.name, node)
        if spelling == "sdpa":
            a = node.args
            site.info.update(has_mask=len(a) > 3 and a[3] is not None,
                             dropout=float(a[4]) if len(a) > 4 else float(node.kwargs.get("dropout_p", 0.0)),
                             causal=bool(a[5]) if len(a) > 5 else bool(node.kwargs.get("is_causal", False)),
                             scale=a[6] if len(a) > 6 else node.kwargs.get("scale"))
        site.info.update(spelling=spelling, heads=heads, kv_heads=kv_heads, head_dim=head_dim, seq_len=qs[2],
                         q=_linears_behind(q, linear_nodes), k=k_lin, v=_linears_behind(v, linear_nodes),
                         out=_linears_after(out, linear_nodes))
        ctx.add(site)
    return gm
