"""Linear layers: recognition and the column-/row-parallel forms.

Recognised: `aten.linear(x, W, b)` and `aten.addmm(b, x, W)` / `aten.mm(x, W)` / `aten.matmul(x, W)`
where W is a parameter (Hugging Face GPT-2's `Conv1D` stores W as (in, out)), so a site records
which weight dim holds the output features.

Forms on a mesh axis of size t (DESIGN.md §3):
- colwise: W sharded on its output dim, bias sharded; input replicated (its gradient all-reduced:
  `grad_all_reduce`), output sharded on features. A fused projection whose output is split into
  k equal parts (QKV) is sharded per part: `_StridedShard(out_dim, split_factor=k)`.
- rowwise: W sharded on its input dim; input sharded on features; output Partial, all-reduced
  (forward) before the bias, which is added once.
- replicate.
"""

from __future__ import annotations

import torch
from torch import fx

from autopar.spec import Placement, Replicate, Shard, _StridedShard
from passes.context import PassContext, Site, module_path

aten = torch.ops.aten
FORMS = ("replicate", "colwise", "rowwise")


def _param_of(node, params) -> tuple[str | None, bool]:
    """(parameter placeholder, transposed) for a weight argument."""
    if isinstance(node, fx.Node) and node.op == "placeholder" and node.name in params:
        return node.name, False
    if isinstance(node, fx.Node) and node.op == "call_function" and node.target in (aten.t.default, aten.transpose.int):
        inner = node.args[0]
        if isinstance(inner, fx.Node) and inner.op == "placeholder" and inner.name in params:
            return inner.name, True
    return None, False


def _fused_parts(node: fx.Node, out_features: int) -> int:
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
        wshape = tuple(w_arg.meta["val"].shape) if not transposed else tuple(reversed(w_arg.meta["val"].shape))
        site = Site("linear", module_path(node) or node.name, node, {"weight": w})
        b, _ = _param_of(bias, params) if bias is not None else (None, False)
        if b is not None:
            site.params["bias"] = b
        out_features = int(node.meta["val"].shape[-1])
        site.info.update(out_dim=out_dim, out_features=out_features, in_features=int(x.meta["val"].shape[-1]),
                         parts=_fused_parts(node, out_features), weight_shape=wshape)
        ctx.add(site)
    return gm


def linear_placements(site: Site, form: str, axis: int, num_axes: int, axis_size: int) -> dict[str, Placement]:
    """Per parameter placeholder: its placement on `axis` for the given form (others: Replicate)."""
    info = site.info
    if form == "replicate":
        return {p: Replicate() for p in site.params.values()}
    if form == "colwise":
        if info["out_features"] % (axis_size * info["parts"]):
            raise ValueError(
                f"linear {site.key}: colwise needs out features divisible by the axis size"
                f"{' times the ' + str(info['parts']) + ' fused parts' if info['parts'] > 1 else ''}; "
                f"got {info['out_features']} out features on an axis of size {axis_size}. "
                "Fix: use 'replicate' for this layer or a mesh axis that divides it.")
        d = info["out_dim"]
        k = info["parts"]
        wp = _StridedShard(d, split_factor=k) if k > 1 else Shard(d)
        out = {site.params["weight"]: wp}
        if "bias" in site.params:
            out[site.params["bias"]] = _StridedShard(0, split_factor=k) if k > 1 else Shard(0)
        return out
    if form == "rowwise":
        if info["in_features"] % axis_size:
            raise ValueError(
                f"linear {site.key}: rowwise needs in features divisible by the axis size; got "
                f"{info['in_features']} on an axis of size {axis_size}. Fix: use 'replicate' or 'colwise'.")
        out = {site.params["weight"]: Shard(1 - info["out_dim"])}
        if "bias" in site.params:
            out[site.params["bias"]] = Replicate()
        return out
    raise ValueError(f"linear {site.key}: unknown form {form!r}; valid forms: {', '.join(FORMS)}")
