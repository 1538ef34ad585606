"""Linear layers: recognition.

Recognised: `aten.linear(x, W, b)` and `aten.addmm(b, x, W)` / `aten.mm(x, W)` / `aten.matmul(x, W)`
where W is a parameter, possibly transposed in the graph (`W.t()`, `W.T`, `transpose(W, 0, 1)`):
Hugging Face GPT-2's `Conv1D` stores W as (in, out), Falcon writes `x @ W.T`. A site records
which weight dim holds the output features, and whether the output is split into equal fused parts
(QKV, gate-up: `parts`) or viewed per head and split inside each head (`head_interleaved`: GPT-NeoX's
`view(b, s, heads, 3·d)` then `chunk(3, -1)`, Bloom's `view(b, s, heads, 3, d)` then `select` on the 3; a
plain row shard of the weight then gives every rank whole heads), or taken apart in contiguous feature blocks
of unequal sizes (`part_slices`: GQA/MQA fused QKV, Phi-3's `slice`s of the features, Falcon's `view(b, s,
heads + 2, d)` sliced and indexed, or split, on the heads). Its forms (`colwise`, `rowwise`) live in `autopar.forms`.
"""

from __future__ import annotations

import operator

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


def _slice_range(n: fx.Node, size: int) -> tuple[int, int] | None:
    """[start, end) of `slice(x, dim, start, end)` with step 1 on a dim of `size`, or None."""
    start, end = (n.args[2] if len(n.args) > 2 else 0) or 0, n.args[3] if len(n.args) > 3 else None
    if (n.args[4] if len(n.args) > 4 else 1) != 1:
        return None
    start = start + size if start < 0 else start
    end = size if end is None or end >= size else end + size if end < 0 else end
    return (start, end) if 0 <= start < end else None


def _constant(n, constants: dict[str, torch.Tensor]) -> torch.Tensor | None:
    """The value of a lifted constant (possibly through `lift_fresh_copy`), or None."""
    while isinstance(n, fx.Node) and n.op == "call_function" and n.target is aten.lift_fresh_copy.default:
        n = n.args[0]
    return constants.get(n.name) if isinstance(n, fx.Node) and n.op == "placeholder" else None


def _head_block(u: fx.Node, heads_dim: int, heads: int, constants) -> tuple[int, int] | None:
    """[first, end) heads that `u` takes from a per-head view: a slice, or an index by consecutive constants."""
    nd = heads_dim + 2
    if u.target is aten.slice.Tensor and u.args[1] % nd == heads_dim:
        return _slice_range(u, heads)
    if u.target is aten.index.Tensor:
        idx = list(u.args[1])
        if len(idx) != heads_dim + 1 or any(i is not None for i in idx[:-1]):
            return None
        c = _constant(idx[-1], constants)
        if c is None or c.dim() != 1 or c.numel() == 0 or c.dtype.is_floating_point:
            return None
        rows = [int(i) % heads for i in c.tolist()]
        if rows != list(range(rows[0], rows[0] + len(rows))):
            return None
        return rows[0], rows[-1] + 1
    return None


def part_slices(node: fx.Node, out_features: int, constants: dict[str, torch.Tensor]) -> tuple:
    """The contiguous feature blocks the output is taken apart in, when they tile it and are not all equal splits:
    slices (or a split) of the features, or slices/indexes (or one split) of a per-head view `(..., features / d, d)`
    on its heads dim (Falcon: `[:, :, :-2]`, `[:, :, [-2]]`, `[:, :, [-1]]` up to transformers 5.24, `split([heads, 1,
    1], dim=-2)` from 5.25). `((node taking the block, first feature, end feature), ...)` in feature order, else ()."""
    y = _past_flat_views(node, out_features)
    users, nd = list(y.users), len(y.meta["val"].shape)
    found = []
    if users and all(u.target is aten.slice.Tensor and u.args[1] % nd == nd - 1 for u in users):
        found = [(u, _slice_range(u, out_features)) for u in users]
    elif len(users) == 1 and users[0].target is aten.split_with_sizes.default and _split_dim(users[0]) == nd - 1:
        split, bounds = users[0], [0]
        for size in split.args[1]:
            bounds.append(bounds[-1] + size)
        gets = {u.args[1]: u for u in split.users if u.target is operator.getitem}
        found = [(gets[i], (bounds[i], bounds[i + 1])) for i in range(len(split.args[1])) if i in gets]
    elif len(users) == 1 and users[0].target in _VIEWS:
        view = users[0]
        shape = tuple(int(d) for d in view.meta["val"].shape)
        if shape[:nd - 1] != tuple(y.meta["val"].shape[:-1]) or len(shape) != nd + 1:
            return ()
        heads, d = shape[-2], shape[-1]
        takers = list(view.users)
        if len(takers) == 1 and takers[0].target is aten.split_with_sizes.default \
                and _split_dim(takers[0]) == nd - 1:  # transformers >= 5.25's Falcon: split([heads, 1, 1], dim=-2)
            split, first = takers[0], 0
            gets = {u.args[1]: u for u in split.users if u.target is operator.getitem}
            for i, size in enumerate(split.args[1]):
                if i in gets:
                    found.append((gets[i], (first * d, (first + size) * d)))
                first += size
        else:
            for u in takers:
                block = _head_block(u, nd - 1, heads, constants)
                found.append((u, None if block is None else (block[0] * d, block[1] * d)))
    if len(found) < 2 or any(r is None for _, r in found):
        return ()
    found.sort(key=lambda f: f[1])
    ends = [0] + [r[1] for _, r in found]
    if [r[0] for _, r in found] != ends[:-1] or ends[-1] != out_features:
        return ()
    return tuple((u, a, b) for u, (a, b) in found)


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
        parts, per_head = fused_parts(node, out_features), head_interleaved(node, out_features)
        blocks = part_slices(node, out_features, ctx.captured.constants) if parts == 1 and not per_head else ()
        ctx.add(LinearSite(key=module_path(node) or node.name, node=node, params=tuple(roles), out_dim=out_dim,
                           out_features=out_features, in_features=int(x.meta["val"].shape[-1]), parts=parts,
                           head_interleaved=per_head, part_slices=blocks, weight_shape=wshape))
    return gm
