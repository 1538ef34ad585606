"""Linear layers: recognition.

Recognised: `aten.linear(x, W, b)` and `aten.addmm(b, x, W)` / `aten.mm(x, W)` / `aten.matmul(x, W)`
where W is a parameter, possibly transposed in the graph (`W.t()`, `W.T`, `transpose(W, 0, 1)`):
Hugging Face GPT-2's `Conv1D` stores W as (in, out), Falcon writes `x @ W.T`. A site records
which weight dim holds the output features, and whether the output is split into equal fused parts
(QKV, gate-up: `parts`) or viewed per head and split inside each head (`head_interleaved`: GPT-NeoX's
`view(b, s, heads, 3·d)` then `chunk(3, -1)`, Bloom's `view(b, s, heads, 3, d)` then `select` on the 3; a
plain row shard of the weight then gives every rank whole heads). Its forms (`colwise`, `rowwise`) live in
`autopar.forms`.
"""

from __future__ import annotations

import torch
from torch import fx

from autopar.sites import LinearSite, PassContext, module_path

aten = torch.ops.aten
_TRANSPOSES = (aten.t.default, aten.transpose.int, aten.permute.default, aten.numpy_T.default)
_VIEWS = (aten.view.default, aten.reshape.default, aten._unsafe_view.default)
_SPLITS = (aten.split.Tensor, aten.split_with_sizes.default, aten.chunk.default)


def _param_of(node, params) -> tuple[str | None, bool]:
    """(parameter placeholder, transposed) for a weight argument."""
    if isinstance(node, fx.Node) and node.op == "placeholder" and node.name in params:
        return node.name, False
    if isinstance(node, fx.Node) and node.op == "call_function" and node.target in _TRANSPOSES:
        inner = node.args[0]
        if node.target is aten.permute.default and [d % 2 for d in node.args[1]] != [1, 0]:
            return None, False
        if isinstance(inner, fx.Node) and inner.op == "placeholder" and inner.name in params \
                and len(inner.meta["val"].shape) == 2:
            return inner.name, True
    return None, False


def _past_flat_views(node: fx.Node, out_features: int) -> fx.Node:
    """The value after views that keep the features last, e.g. GPT-2's Conv1D: addmm on (b*s, h) viewed back to
    (b, s, 3h)."""
    users = list(node.users)
    while len(users) == 1 and users[0].target in _VIEWS and int(users[0].meta["val"].shape[-1]) == out_features:
        node = users[0]
        users = list(node.users)
    return node


def _split_dim(u: fx.Node) -> int:
    dim = u.args[2] if len(u.args) > 2 else u.kwargs.get("dim", 0)
    nd = len(u.args[0].meta["val"].shape)
    return dim + nd if dim < 0 else dim


def fused_parts(node: fx.Node, out_features: int) -> int:
    """k when the output is split into k equal feature blocks (fused QKV / gate-up), else 1."""
    node = _past_flat_views(node, out_features)
    for u in node.users:
        if u.target in _SPLITS and _split_dim(u) == len(node.meta["val"].shape) - 1:
            sizes = [int(v.shape[-1]) for v in u.meta["val"]]
            if len(set(sizes)) == 1 and len(sizes) > 1:
                return len(sizes)
    return 1


def head_interleaved(node: fx.Node, out_features: int) -> int:
    """d when the output is viewed per head and split inside each head into equal parts of d: `(..., heads, k·d)`
    (through transposes) chunked into k on that last dim (GPT-NeoX), or `(..., heads, k, d)` whose every use
    selects one of the k (Bloom); else 0."""
    node = _past_flat_views(node, out_features)
    users = list(node.users)
    if len(users) != 1 or users[0].target not in _VIEWS:
        return 0
    view = users[0]
    lead, shape = tuple(node.meta["val"].shape[:-1]), tuple(int(d) for d in view.meta["val"].shape)
    if shape[:len(lead)] != lead or len(shape) - len(lead) not in (2, 3) or shape[len(lead)] < 2:
        return 0
    if len(shape) - len(lead) == 3:  # (..., heads, k, d): q, k, v selected on the k dim
        k_dim = len(shape) - 2
        picks = {u.args[2] % shape[k_dim] for u in view.users
                 if u.target is aten.select.int and u.args[1] % len(shape) == k_dim}
        return shape[-1] if len(view.users) == shape[k_dim] == len(picks) > 1 else 0
    n, pos = view, len(shape) - 1  # (..., heads, k*d): follow the per-head dim through transposes
    while len(n.users) == 1 and next(iter(n.users)).target in (aten.transpose.int, aten.permute.default):
        u = next(iter(n.users))
        nd = len(u.meta["val"].shape)
        if u.target is aten.permute.default:
            pos = [d % nd for d in u.args[1]].index(pos)
        else:
            d0, d1 = u.args[1] % nd, u.args[2] % nd
            pos = d1 if pos == d0 else d0 if pos == d1 else pos
        n = u
    users = list(n.users)  # the split is the only use (RoPE's rotate_half may chunk a plain q's head dim too)
    if len(users) == 1 and users[0].target in _SPLITS and _split_dim(users[0]) == pos:
        sizes = [int(v.shape[pos]) for v in users[0].meta["val"]]
        if len(set(sizes)) == 1 and len(sizes) > 1:
            return sizes[0]
    return 0


def recognise_linear_pass(gm: fx.GraphModule, ctx: PassContext) -> fx.GraphModule:
    params = ctx.captured.param_fqns
    for node in gm.graph.nodes:
        if node.op != "call_function":
            continue
        t = node.target
        if t is aten.linear.default:
            x, w_arg = node.args[0], node.args[1]
            bias = node.args[2] if len(node.args) > 2 else None
            out_dim = 0
        elif t is aten.addmm.default:
            bias, x, w_arg = node.args[:3]
            out_dim = 1
        elif t in (aten.mm.default, aten.matmul.default):
            x, w_arg, bias = node.args[0], node.args[1], None
            out_dim = 1
        else:
            continue
        w, transposed = _param_of(w_arg, params)
        if w is None or len(w_arg.meta["val"].shape) != 2:
            continue
        if transposed:
            out_dim = 1 - out_dim
        shape = tuple(w_arg.meta["val"].shape)
        wshape = tuple(reversed(shape)) if transposed else shape
        roles = [("weight", w)]
        b, _ = _param_of(bias, params) if bias is not None else (None, False)
        if b is not None:
            roles.append(("bias", b))
        out_features = int(node.meta["val"].shape[-1])
        ctx.add(LinearSite(key=module_path(node) or node.name, node=node, params=tuple(roles), out_dim=out_dim,
                           out_features=out_features, in_features=int(x.meta["val"].shape[-1]),
                           parts=fused_parts(node, out_features),
                           head_interleaved=head_interleaved(node, out_features), weight_shape=wshape))
    return gm
