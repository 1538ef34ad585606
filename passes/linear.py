"""Linear layers: recognition.

Recognised: `aten.linear(x, W, b)` and `aten.addmm(b, x, W)` / `aten.mm(x, W)` / `aten.matmul(x, W)`
where W is a parameter, possibly transposed in the graph (`W.t()`, `W.T`, `transpose(W, 0, 1)`):
Hugging Face GPT-2's `Conv1D` stores W as (in, out), Falcon writes `x @ W.T`. A site records
which weight dim holds the output features, and whether the output is split into equal fused parts
(QKV, gate-up). Its forms (`colwise`, `rowwise`) live in `autopar.forms`.
"""

from __future__ import annotations

import torch
from torch import fx

from autopar.sites import LinearSite, PassContext, module_path

aten = torch.ops.aten
_TRANSPOSES = (aten.t.default, aten.transpose.int, aten.permute.default, aten.numpy_T.default)


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


def fused_parts(node: fx.Node, out_features: int) -> int:
    """k when the output is split into k equal feature blocks (fused QKV / gate-up), else 1."""
    users = list(node.users)
    while len(users) == 1 and users[0].target in (aten.view.default, aten.reshape.default, aten._unsafe_view.default) \
            and int(users[0].meta["val"].shape[-1]) == out_features:
        node = users[0]  # e.g. GPT-2's Conv1D: addmm on (b*s, h) viewed back to (b, s, 3h)
        users = list(node.users)
    for u in users:
        if u.target in (aten.split.Tensor, aten.split_with_sizes.default, aten.chunk.default):
            dim = u.args[2] if len(u.args) > 2 else u.kwargs.get("dim", 0)
            nd = len(node.meta["val"].shape)
            if (dim + nd if dim < 0 else dim) == nd - 1:
                sizes = [int(v.shape[-1]) for v in u.meta["val"]]
                if len(set(sizes)) == 1 and len(sizes) > 1:
                    return len(sizes)
    return 1


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
                           parts=fused_parts(node, out_features), weight_shape=wshape))
    return gm
