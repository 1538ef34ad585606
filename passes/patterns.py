"""Graph patterns recognition passes share: ops that only move data, and walks to the linears behind or
after a value."""

from __future__ import annotations

import operator

import torch
from torch import fx

from autopar.sites import LinearSite

aten = torch.ops.aten

# ops that move or rename data without mixing features across positions: recognisers see through them
TRANSPARENT = {
    aten.view.default, aten.reshape.default, aten._unsafe_view.default, aten.transpose.int, aten.permute.default,
    aten.contiguous.default, aten.clone.default, aten.to.dtype, aten.to.dtype_layout, aten._to_copy.default,
    aten.alias.default, aten.flatten.using_ints, aten.unflatten.int, aten.unsqueeze.default, aten.expand.default,
    aten.slice.Tensor, aten.dropout.default, aten.squeeze.dim,
}
# what the walk back from q/k/v (and from logits) to their projections crosses: RoPE's mul/add/neg/cat, fused-QKV
# splits (Bloom selects q/k/v out of a per-head (heads, 3, d) view, Falcon indexes its one KV head), the casts of q/k norms (Gemma 3's
# `type_as`), and the elementwise scaling or soft-capping of logits (Granite's `div` by logits_scaling, Cohere's
# `mul` by logit_scale, Gemma 2's `tanh(x / cap) * cap`)
_BACK_THROUGH = TRANSPARENT | {aten.mul.Tensor, aten.add.Tensor, aten.sub.Tensor, aten.neg.default, aten.cat.default,
                               aten.chunk.default, aten.split.Tensor, aten.split_with_sizes.default, aten.select.int,
                               aten.index.Tensor, aten.type_as.default, aten.div.Tensor, aten.tanh.default}


def linears_behind(node: fx.Node, linear_nodes: dict[fx.Node, LinearSite]) -> list[LinearSite]:
    """The linears whose outputs reach `node` through data movement, RoPE arithmetic and splits."""
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


def linears_after(node: fx.Node, linear_nodes: dict[fx.Node, LinearSite]) -> list[LinearSite]:
    """The linears that take `node` (through data movement only) as their input."""
    found, seen, stack = [], set(), [node]
    while stack:
        n = stack.pop()
        if n in seen:
            continue
        seen.add(n)
        for u in n.users:
            if u in linear_nodes and linear_nodes[u].input is n:
                found.append(linear_nodes[u])
            elif u.op == "call_function" and u.target in TRANSPARENT:
                stack.append(u)
    return found


def parameters_only(x: fx.Node, kind, node_ok=lambda n: True) -> list[fx.Node] | None:
    """The parameters `x` is computed from, where it is computed from parameters alone and is their only way out:
    every placeholder reached going back from `x` is a parameter or a constant (`kind(placeholder)`: "param",
    "const", or None for anything else, e.g. a user input); every other node an aten op without randomness that
    `node_ok` accepts; and no node of that subgraph but `x` used outside it. None otherwise (or without parameters).

    The rule under which a replicated value's gradient reduction may move onto its parameters
    (`passes.lower.replicated_reductions_to_parameters_pass`, priced by `autopar.estimate`)."""
    inside, params, todo = {x}, [], [x]
    while todo:
        v = todo.pop()
        if v.op == "placeholder":
            k = kind(v)
            if k is None:
                return None
            if k == "param":
                params.append(v)
            continue
        if v.op != "call_function" or not isinstance(v.target, torch._ops.OpOverload) \
                or torch.Tag.nondeterministic_seeded in v.target.tags or not node_ok(v):
            return None
        for a in v.all_input_nodes:
            if a not in inside:
                inside.add(a)
                todo.append(a)
    if not params or any(u not in inside for v in inside - {x} for u in v.users):
        return None
    return params


_VIEWS = (aten.view.default, aten.reshape.default, aten._unsafe_view.default)


def repeat_kv_source(kv: fx.Node) -> fx.Node | None:
    """The grouped K or V (b, kv_heads, s, d) behind a `repeat_kv` expansion (Hugging Face's
    `x[:, :, None].expand(b, kv, n, s, d).reshape(b, kv * n, s, d)`: head i of the result is head i // n of x),
    else None."""
    if not isinstance(kv, fx.Node) or kv.target not in _VIEWS or len(kv.meta["val"].shape) != 4:
        return None
    ex = kv.args[0]
    if not isinstance(ex, fx.Node) or ex.target is not aten.expand.default or len(ex.users) != 1:
        return None
    un = ex.args[0]
    if not isinstance(un, fx.Node) or un.target is not aten.unsqueeze.default or un.args[1] != 2:
        return None
    x = un.args[0]
    (b, h, s, d), (b2, h_kv, n, s2, d2) = kv.meta["val"].shape, ex.meta["val"].shape
    if (b2, h_kv * n, s2, d2) != (b, h, s, d) or tuple(x.meta["val"].shape) != (b, h_kv, s, d):
        return None
    return x


def tensor_bytes(n: fx.Node) -> int:
    v = n.meta.get("val")
    return v.numel() * v.element_size() if isinstance(v, torch.Tensor) else 0
