"""Sharding rules: one small function per op, registered by decorator in a table keyed by op.

A rule sees one mesh axis at a time: the placements of the node's tensor inputs on that axis
and the axis size, and returns `(required input placements, output placement)` (a list of output
placements for ops with several outputs). Rules never mutate the graph; the lowering inserts the
collectives that turn each input's placement into the required one, and wraps an input that must
be `R` in `grad_all_reduce` when the output is not `R` (its gradient is then partial).

An op without a rule is replicated: every input is made `R` and the output is `R`; the lowering
reports it ("replicated: no sharding rule for aten.X"). Never a guess.
"""

from __future__ import annotations

import operator
from typing import Callable

import torch
from torch import fx

import autopar.runtime.moe  # noqa: F401  (registers autopar::moe_experts)
from autopar.spec import P, R, Placement, Partial, Replicate, Shard, _StridedShard, is_shard, with_dim

aten = torch.ops.aten
Decision = tuple[list[Placement], "Placement | list[Placement]"]
Rule = Callable[[fx.Node, list[fx.Node], list[Placement], int], Decision]
RULES: dict[object, Rule] = {}


def register(*targets) -> Callable[[Rule], Rule]:
    """Register `fn` as the rule of `targets`; an op registers once (a second rule for it is an error)."""
    def deco(fn: Rule) -> Rule:
        for t in targets:
            if t in RULES:
                raise ValueError(f"a sharding rule for {t} is registered twice ({RULES[t].__name__}, {fn.__name__})")
            RULES[t] = fn
        return fn
    return deco


def shape(n) -> tuple[int, ...]:
    v = n.meta.get("val")
    return tuple(int(s) for s in v.shape)


def ndim(n) -> int:
    return len(shape(n))


def arg(node: fx.Node, i: int, name: str, default=None):
    if len(node.args) > i:
        return node.args[i]
    return node.kwargs.get(name, default)


def _norm(d: int, nd: int) -> int:
    return d + nd if d < 0 else d


def all_r(tin, ins) -> Decision:
    return [R] * len(ins), R


def replicate_rule(node, tin, ins, n) -> Decision:
    outs = node.meta.get("val")
    if isinstance(outs, (list, tuple)):
        return [R] * len(ins), [R] * len(outs)
    return [R] * len(ins), R


def _divisible(size: int, n: int, p: Placement) -> bool:
    k = p.split_factor if isinstance(p, _StridedShard) else 1
    return size % (n * k) == 0


# ----------------------------------------------------------------------------- elementwise

ADDITIVE = {aten.add.Tensor, aten.sub.Tensor}


def t_is_additive(node) -> bool:
    return node.target in ADDITIVE

ELEMENTWISE = [
    aten.add.Tensor, aten.sub.Tensor, aten.mul.Tensor, aten.div.Tensor, aten.add.Scalar, aten.sub.Scalar,
    aten.mul.Scalar, aten.div.Scalar, aten.rsub.Scalar, aten.neg.default, aten.pow.Tensor_Scalar,
    aten.pow.Tensor_Tensor, aten.rsqrt.default, aten.sqrt.default, aten.exp.default, aten.log.default,
    aten.silu.default, aten.gelu.default, aten.relu.default, aten.tanh.default, aten.sigmoid.default,
    aten.cos.default, aten.sin.default, aten.abs.default, aten.erf.default, aten.reciprocal.default,
    aten.clone.default, aten.alias.default, aten.contiguous.default, aten.detach.default,
    aten.to.dtype, aten.to.dtype_layout, aten.to.device, aten._to_copy.default, aten.type_as.default,
    aten.dropout.default, aten.masked_fill.Scalar, aten.masked_fill.Tensor, aten.where.self,
    aten.eq.Tensor, aten.eq.Scalar, aten.ne.Tensor, aten.ne.Scalar, aten.lt.Tensor, aten.lt.Scalar,
    aten.le.Tensor, aten.le.Scalar, aten.gt.Tensor, aten.gt.Scalar, aten.ge.Tensor, aten.ge.Scalar,
    aten.__and__.Tensor, aten.__or__.Tensor, aten.bitwise_and.Tensor, aten.bitwise_or.Tensor,
    aten.logical_not.default, aten.logical_and.default, aten.bitwise_not.default,
    aten.zeros_like.default, aten.ones_like.default, aten.full_like.default, aten.minimum.default,
    aten.maximum.default, aten.clamp.default, aten.float_power.Tensor_Scalar, aten.square.default,
    aten.softplus.default, aten.log1p.default, aten.expm1.default, aten.mish.default,
    aten.leaky_relu.default, aten.elu.default, aten.hardtanh.default, aten.relu6.default,
    aten.div_.Tensor, aten.mul_.Tensor, aten.add_.Tensor, aten.sub_.Tensor, aten.div_.Scalar, aten.mul_.Scalar,
]


@register(*ELEMENTWISE)
def elementwise_rule(node, tin, ins, n) -> Decision:
    out = shape(node)
    nd = len(out)
    # a non-broadcast sharded input decides the output's shard dim
    choice: Placement | None = None
    for t, p in zip(tin, ins):
        if is_shard(p):
            s = shape(t)
            od = p.dim + nd - len(s)
            if s[p.dim] == out[od]:
                choice = with_dim(p, od)
                break
    if choice is not None:
        req = []
        for t, p in zip(tin, ins):
            s = shape(t)
            d = choice.dim - (nd - len(s))
            if d >= 0 and s[d] == out[choice.dim] and s[d] != 1:
                req.append(with_dim(choice, d))
            else:
                req.append(R)
        return req, choice
    # Partial inputs are reduced at their first consumer (the lowering caches the all-reduce per value,
    # so every consumer shares it); only a sum of partials stays partial: both operands tensors, both
    # partial (a constant added to a partial would be added once per rank).
    operands = node.args[:2]
    if ins and t_is_additive(node) and len(tin) == 2 and all(isinstance(a, fx.Node) for a in operands) \
            and all(isinstance(p, Partial) for p in ins):
        return list(ins), P
    return [R] * len(ins), R


# ----------------------------------------------------------------------------- views

def view_groups(a: tuple[int, ...], b: tuple[int, ...]) -> list[tuple[list[int], list[int]]]:
    """Group dims of two shapes with equal element counts into runs of equal products."""
    groups, i, j = [], 0, 0
    while i < len(a) or j < len(b):
        I, O, pa, pb = [], [], 1, 1
        if i < len(a):
            I.append(i); pa = a[i]; i += 1
        if j < len(b):
            O.append(j); pb = b[j]; j += 1
        while pa != pb:
            if pa < pb and i < len(a):
                I.append(i); pa *= a[i]; i += 1
            elif j < len(b):
                O.append(j); pb *= b[j]; j += 1
            else:
                break
        groups.append((I, O))
    return groups


def map_view_dim(a, b, d: int, n: int, p: Placement) -> Placement | None:
    """The placement carrying input dim d's shard through a view a -> b, or None (the view needs a gather).

    - the shard on the outermost dim of a group of dims: a plain shard of the group's outermost
      output dim (merges `(b, s) -> b*s` with b sharded, splits `h -> (heads, d)` with heads % n == 0);
    - a shard on an inner dim of a merge (`(b, s) -> b*s` with s sharded): each rank holds one piece
      of every outer block, i.e. `_StridedShard(out, split_factor=prod(outer sizes))`;
    - the inverse split of such a strided shard (`b*s -> (b, s)`): a plain shard again.
    """
    k = p.split_factor if isinstance(p, _StridedShard) else 1
    for I, O in view_groups(a, b):
        if d not in I:
            continue
        nz_in = [i for i in I if a[i] != 1]
        nz_out = [o for o in O if b[o] != 1]
        if not nz_out:
            return None
        if nz_in and nz_in[0] == d:
            if k == 1:
                return Shard(nz_out[0]) if b[nz_out[0]] % n == 0 else None
            if len(nz_in) == 1 and len(nz_out) == 1:
                return _StridedShard(nz_out[0], split_factor=k) if b[nz_out[0]] % (n * k) == 0 else None
            # b*s -> (b, s): the outer out dims whose product is the split factor absorb the blocks
            if len(nz_in) == 1:
                prod = 1
                for j, o in enumerate(nz_out):
                    if prod == k:
                        return Shard(o) if b[o] % n == 0 else None
                    prod *= b[o]
            return None
        if k == 1 and len(nz_out) == 1 and a[d] % n == 0:  # (b, s) -> b*s with s sharded
            outer = 1
            for i in nz_in:
                if i == d:
                    break
                outer *= a[i]
            return _StridedShard(nz_out[0], split_factor=outer)
        return None
    return None


@register(aten.view.default, aten.reshape.default, aten._unsafe_view.default, aten.flatten.using_ints,
          aten.unflatten.int, aten.unsqueeze.default, aten.squeeze.dim, aten.squeeze.default, aten.squeeze.dims,
          aten.view_as.default, aten.reshape_as.default)
def view_rule(node, tin, ins, n) -> Decision:
    p = ins[0]
    req = [R] * len(ins)
    if not is_shard(p):
        return req, R
    out = map_view_dim(shape(tin[0]), shape(node), p.dim, n, p)
    if out is None:
        return req, R
    if node.target in (aten.view_as.default, aten.reshape_as.default):  # the shape comes from `other`: its local
        return [p, out], out  # shape is the output's if it is placed like the output
    return [p] + req[1:], out


@register(aten.expand.default)
def expand_rule(node, tin, ins, n) -> Decision:
    p = ins[0]
    if not is_shard(p):
        return [R], R
    s, out = shape(tin[0]), shape(node)
    od = p.dim + len(out) - len(s)
    if s[p.dim] != out[od]:
        return [R], R
    return [p], with_dim(p, od)


@register(aten.transpose.int, aten.permute.default, aten.t.default, aten.swapaxes.default, aten.numpy_T.default)
def permute_rule(node, tin, ins, n) -> Decision:
    p = ins[0]
    if not is_shard(p):
        return [p], p
    nd = ndim(tin[0])
    if node.target is aten.permute.default:
        perm = [_norm(d, nd) for d in node.args[1]]
    elif node.target is aten.numpy_T.default:  # x.T: every dim reversed
        perm = list(reversed(range(nd)))
    else:
        d0, d1 = (0, 1) if node.target is aten.t.default else (_norm(node.args[1], nd), _norm(node.args[2], nd))
        perm = list(range(nd))
        perm[d0], perm[d1] = perm[d1], perm[d0]
    return [p], with_dim(p, perm.index(p.dim))


@register(aten.select.int)
def select_rule(node, tin, ins, n) -> Decision:
    p = ins[0]
    dim = _norm(node.args[1], ndim(tin[0]))
    if not is_shard(p):
        return [R], R
    if p.dim == dim:
        return [R], R
    return [p], with_dim(p, p.dim - (p.dim > dim))


@register(aten.slice.Tensor)
def slice_rule(node, tin, ins, n) -> Decision:
    p = ins[0]
    if not is_shard(p):
        return [R], R
    s = shape(tin[0])
    dim = _norm(arg(node, 1, "dim", 0), len(s))
    if dim != p.dim:
        return [p], p
    start, end, step = arg(node, 2, "start", None), arg(node, 3, "end", None), arg(node, 4, "step", 1)
    if (start in (None, 0)) and (end is None or end >= s[dim]) and step == 1:
        return [p], p
    return [R], R


@register(aten.index.Tensor)
def index_rule(node, tin, ins, n) -> Decision:
    """x[..., idx, ...] with integer index tensors on adjacent dims (Falcon's `qkv[:, :, [-2]]`): a shard of x on a
    dim that is not indexed carries to the output (dims after the indexed block shift by the index's ndim less
    the dims it indexes); the index tensors are replicated. A shard of an indexed dim, or of an index: replicated."""
    p = ins[0]
    idx = [i for i, t in enumerate(node.args[1]) if t is not None]
    vals = [node.args[1][i].meta["val"] for i in idx]
    if not is_shard(p) or not idx or any(v.dtype == torch.bool for v in vals) \
            or idx != list(range(idx[0], idx[-1] + 1)) or p.dim in idx:
        return [R] * len(ins), R
    shift = max(v.dim() for v in vals) - len(idx) if p.dim > idx[-1] else 0
    return [p] + [R] * (len(ins) - 1), with_dim(p, p.dim + shift)


def _split_outputs(node) -> int:
    return len(node.meta["val"])


@register(aten.split.Tensor, aten.split_with_sizes.default, aten.chunk.default, aten.unbind.int)
def split_rule(node, tin, ins, n) -> Decision:
    p = ins[0]
    k = _split_outputs(node)
    s = shape(tin[0])
    if node.target is aten.unbind.int:
        dim = _norm(arg(node, 1, "dim", 0), len(s))
    else:
        dim = _norm(arg(node, 2, "dim", 0), len(s))
    if not is_shard(p):
        return [R], [R] * k
    if p.dim != dim:
        od = p.dim - (node.target is aten.unbind.int and p.dim > dim)
        return [p], [with_dim(p, od)] * k
    sizes = [int(v.shape[dim]) for v in node.meta["val"]]
    if isinstance(p, _StridedShard) and p.split_factor == k and len(set(sizes)) == 1 and sizes[0] % n == 0:
        return [p], [Shard(dim)] * k
    return [R], [R] * k


@register(aten.cat.default)
def cat_rule(node, tin, ins, n) -> Decision:
    out = shape(node)
    dim = _norm(arg(node, 1, "dim", 0), len(out))
    shards = [p for p in ins if is_shard(p)]
    if shards and not isinstance(shards[0], _StridedShard) and shards[0].dim != dim:
        p = shards[0]
        return [p] * len(ins), p
    return [R] * len(ins), R


# ----------------------------------------------------------------------------- matmuls

def _linear_like(x_p, w_p, x_nd, w_in_dim: int, bias: bool) -> tuple[Placement, Placement, Placement]:
    """x (..., k) against a weight with `in` on dim w_in_dim; returns (x required, w required, out)."""
    w_out_dim = 1 - w_in_dim
    last = x_nd - 1
    if is_shard(w_p) and w_p.dim == w_out_dim:  # column-parallel
        return R, w_p, with_dim(w_p, last)
    if is_shard(w_p) and w_p.dim == w_in_dim:  # row-parallel: x sharded on features -> partial sums
        assert not bias, "row-parallel bias must be added after the reduction (decompose_bias)"
        return Shard(last), w_p, P
    # replicated weight
    if is_shard(x_p) and x_p.dim < last:
        return x_p, R, x_p
    return R, R, R


@register(aten.linear.default)
def linear_rule(node, tin, ins, n) -> Decision:
    bias = len(tin) > 2
    xr, wr, out = _linear_like(ins[0], ins[1], ndim(tin[0]), 1, bias)
    req = [xr, wr]
    if bias:
        req.append(with_dim(wr, 0) if is_shard(wr) else R)
    return req, out


@register(aten.mm.default)
def mm_rule(node, tin, ins, n) -> Decision:
    a, b = ins
    if is_shard(b) and b.dim == 1:
        return [R, b], with_dim(b, 1)
    if is_shard(b) and b.dim == 0:
        return [Shard(1), b], P
    if is_shard(a) and a.dim == 0:
        return [a, R], a
    return [R, R], R


@register(aten.addmm.default)
def addmm_rule(node, tin, ins, n) -> Decision:
    req, out = mm_rule(node, tin[1:], ins[1:], n)
    assert not isinstance(out, Partial), "row-parallel addmm bias must be added after the reduction"
    bias_p = R
    if is_shard(out) and out.dim == 1 and ndim(tin[0]) >= 1 and shape(tin[0])[-1] != 1:
        bias_p = with_dim(out, ndim(tin[0]) - 1)
    return [bias_p] + req, out


@register(aten.matmul.default, aten.bmm.default)
def matmul_rule(node, tin, ins, n) -> Decision:
    a, b = ins
    sa, sb, out = shape(tin[0]), shape(tin[1]), shape(node)
    if len(sa) < 2 or len(sb) < 2:
        return [R, R], R
    nd = len(out)
    if len(sb) == 2:  # x @ W
        if is_shard(b) and b.dim == 1:
            return [R, b], with_dim(b, nd - 1)
        if is_shard(b) and b.dim == 0:
            return [Shard(len(sa) - 1), b], P
        if is_shard(a) and a.dim < len(sa) - 1:
            return [a, R], with_dim(a, a.dim + nd - len(sa))
        return [R, R], R
    # batched: (..., m, k) @ (..., k, n)
    oa, ob = nd - len(sa), nd - len(sb)
    for p, s, off, other_s, other_off, first in ((a, sa, oa, sb, ob, True), (b, sb, ob, sa, oa, False)):
        if not is_shard(p):
            continue
        od = p.dim + off
        if od < nd - 2 and s[p.dim] == out[od]:  # batch dim: batches are independent, so a strided shard too
            d_other = od - other_off
            other_req = with_dim(p, d_other) if d_other >= 0 and other_s[d_other] != 1 else R
            return ([p, other_req] if first else [other_req, p]), with_dim(p, od)
        if isinstance(p, _StridedShard):
            continue
        if first and p.dim == len(s) - 2:  # m
            return [p, R], Shard(nd - 2)
        if not first and p.dim == len(s) - 1:  # n
            return [R, p], Shard(nd - 1)
        if first and p.dim == len(s) - 1:  # k: contract both
            return [p, Shard(len(sb) - 2)], P
        if not first and p.dim == len(s) - 2:
            return [Shard(len(sa) - 1), p], P
    return [R, R], R


@register(aten.baddbmm.default)
def baddbmm_rule(node, tin, ins, n) -> Decision:
    """beta·self + alpha·(batch1 @ batch2) (Bloom's ALiBi scores): the product sharded as `bmm` shards it (batch,
    m or n), self (broadcast to the output) sharded alike; a sharded contraction would leave partial products
    that self cannot join (it would be added once per rank): replicated then."""
    req, out = matmul_rule(node, tin[1:], ins[1:], n)
    if not is_shard(out):
        return [R] * len(ins), R
    s_self, s_out = shape(tin[0]), shape(node)
    d = out.dim - (len(s_out) - len(s_self))
    return [with_dim(out, d) if d >= 0 and s_self[d] != 1 else R] + req, out


@register(aten.outer.default)
def outer_rule(node, tin, ins, n) -> Decision:
    a, b = ins
    if is_shard(a):
        return [a, R], Shard(0)
    if is_shard(b):
        return [R, b], Shard(1)
    return [R, R], R


# ----------------------------------------------------------------------------- reductions

def _reduced_dims(node, nd) -> tuple[list[int], bool]:
    if node.target in (aten.sum.default, aten.mean.default):
        return list(range(nd)), False
    dims = arg(node, 1, "dim", None)
    keepdim = bool(arg(node, 2, "keepdim", False))
    if dims is None or (isinstance(dims, (list, tuple)) and len(dims) == 0):
        return list(range(nd)), keepdim
    if isinstance(dims, int):
        dims = [dims]
    return sorted(_norm(d, nd) for d in dims), keepdim


@register(aten.sum.dim_IntList, aten.mean.dim, aten.sum.default, aten.mean.default)
def sum_rule(node, tin, ins, n) -> Decision:
    p = ins[0]
    if not is_shard(p):
        return [R], R
    dims, keepdim = _reduced_dims(node, ndim(tin[0]))
    if p.dim in dims:
        return [p], P
    return [p], with_dim(p, p.dim if keepdim else p.dim - sum(d < p.dim for d in dims))


@register(aten.amax.default, aten.amin.default)
def amax_rule(node, tin, ins, n) -> Decision:
    p = ins[0]
    if not is_shard(p):
        return [R], R
    dims, keepdim = _reduced_dims(node, ndim(tin[0]))
    if p.dim in dims:
        return [R], R
    return [p], with_dim(p, p.dim if keepdim else p.dim - sum(d < p.dim for d in dims))


@register(aten.logsumexp.default)
def logsumexp_rule(node, tin, ins, n) -> Decision:
    """Per-row reduction (`torch.logsumexp(x, dims)`): a shard on a kept dim passes; a reduced one gathers."""
    return amax_rule(node, tin, ins, n)


@register(aten.argmax.default, aten.argmin.default)
def argmax_rule(node, tin, ins, n) -> Decision:
    """Index of the max along one dim: rows sharded on another dim keep their shard (no dim: a flat index, R)."""
    p = ins[0]
    dim = arg(node, 1, "dim", None)
    if not is_shard(p) or dim is None:
        return [R], R
    nd = ndim(tin[0])
    dim = _norm(dim, nd)
    if p.dim == dim:
        return [R], R
    keepdim = bool(arg(node, 2, "keepdim", False))
    return [p], with_dim(p, p.dim if keepdim or p.dim < dim else p.dim - 1)


@register(aten.one_hot.default)
def one_hot_rule(node, tin, ins, n) -> Decision:
    """One-hot rows (a new last dim of classes): the input's shard passes through."""
    p = ins[0]
    if is_shard(p) and arg(node, 1, "num_classes", -1) > 0:  # -1: classes = max + 1, data-dependent
        return [p], p
    return [R], R


@register(aten.gather.default)
def gather_rule(node, tin, ins, n) -> Decision:
    """`x.gather(d, index)`: input and index sharded alike on another dim than d (rows picked per row) keep it."""
    x, index = ins[0], ins[1]
    nd = ndim(tin[0])
    dim = _norm(arg(node, 1, "dim"), nd)
    p = x if is_shard(x) else index if is_shard(index) else None
    if p is None or p.dim == dim or shape(tin[0])[p.dim] != shape(tin[1])[p.dim]:
        return [R, R], R
    return [p, p], p


@register(aten.softmax.int, aten._softmax.default, aten.log_softmax.int, aten._log_softmax.default,
          aten.cumsum.default, aten.diff.default)
def along_dim_rule(node, tin, ins, n) -> Decision:
    p = ins[0]
    if not is_shard(p):
        return [R] * len(ins), R
    nd = ndim(tin[0])
    dim = _norm(arg(node, 1, "dim", -1), nd)
    if p.dim == dim:
        return [R] * len(ins), R
    return [p] + [R] * (len(ins) - 1), p


@register(aten.layer_norm.default)
def layer_norm_rule(node, tin, ins, n) -> Decision:
    p = ins[0]
    nd = ndim(tin[0])
    normalized = len(node.args[1])
    if is_shard(p) and not isinstance(p, _StridedShard) and p.dim < nd - normalized:
        return [p] + [R] * (len(ins) - 1), p
    return [R] * len(ins), R


@register(aten.pad.default, aten.constant_pad_nd.default)
def pad_rule(node, tin, ins, n) -> Decision:
    p = ins[0]
    nd = ndim(tin[0])
    padded = len(node.args[1]) // 2
    if is_shard(p) and p.dim < nd - padded:
        return [p], p
    return [R], R


# ----------------------------------------------------------------------------- embedding, attention, losses

@register(aten.embedding.default)
def embedding_rule(node, tin, ins, n) -> Decision:
    w, ids = ins
    out_nd = ndim(node)
    if is_shard(w) and w.dim == 0 and not isinstance(w, _StridedShard):
        return [w, R], P  # vocab-parallel: masked lookup, partial sums
    if is_shard(w) and w.dim == 1:
        return [w, R], with_dim(w, out_nd - 1)
    if is_shard(ids):
        return [R, ids], ids
    return [R, R], R


@register(aten.scaled_dot_product_attention.default)
def sdpa_rule(node, tin, ins, n) -> Decision:
    q = ins[0]
    has_mask = len(tin) > 3
    sq, sk = shape(tin[0]), shape(tin[1])
    if not is_shard(q) or isinstance(q, _StridedShard) or q.dim >= 2:
        return [R] * len(ins), R
    req = [q]
    if q.dim == 0:
        req += [q, q]
    else:  # heads
        if sk[1] == sq[1] or sk[1] % n == 0:
            req += [Shard(1), Shard(1)]
        else:  # fewer KV heads than ranks: keep them replicated, pick per rank (gqa_kv_heads)
            req += [R, R]
    if has_mask:
        sm = shape(tin[3])
        md = q.dim + len(sm) - 4
        req.append(Shard(md) if md >= 0 and sm[md] != 1 else R)
    return req, q


@register(aten.cross_entropy_loss.default)
def cross_entropy_rule(node, tin, ins, n) -> Decision:
    x, t = ins[0], ins[1]
    reduction = arg(node, 3, "reduction", 1)
    smoothing = arg(node, 5, "label_smoothing", 0.0)
    weighted = len(tin) > 2
    nd = ndim(tin[0])
    if weighted or any(isinstance(p, Partial) for p in ins):
        return [R] * len(ins), R
    if is_shard(x) and x.dim == 1 and nd == 2 and smoothing == 0.0 and not isinstance(x, _StridedShard):
        return [x, R], R  # vocab-parallel cross-entropy
    if is_shard(x) and x.dim == 0:  # batch (or flattened batch x sequence: strided) sharded
        return [x, x], (x if reduction == 0 else P)
    if is_shard(t) and t.dim == 0 and not is_shard(x):
        return [t, t], (t if reduction == 0 else P)
    return [R] * len(ins), R


@register(aten.mse_loss.default)
def mse_rule(node, tin, ins, n) -> Decision:
    a, b = ins
    reduction = arg(node, 2, "reduction", 1)
    p = a if is_shard(a) else b if is_shard(b) else None
    if p is None or isinstance(p, _StridedShard) or shape(tin[0]) != shape(tin[1]):
        return [R, R], R
    return [p, p], (p if reduction == 0 else P)


@register(aten.broadcast_tensors.default)
def broadcast_tensors_rule(node, tin, ins, n) -> Decision:
    outs = node.meta["val"]
    if len(set(shape(t) for t in tin)) == 1:
        shards = [p for p in ins if is_shard(p)]
        if shards:
            return [shards[0]] * len(ins), [shards[0]] * len(outs)
    return [R] * len(ins), [R] * len(outs)


@register(aten.topk.default, aten.sort.default, aten.sort.stable)
def topk_rule(node, tin, ins, n) -> Decision:
    """Top-k (or sort) along a dim: per row, so a shard on another dim passes to values and indices."""
    p = ins[0]
    nd = ndim(tin[0])
    dim = _norm(arg(node, 2, "dim", -1) if node.target is aten.topk.default else arg(node, 1, "dim", -1), nd)
    if is_shard(p) and p.dim != dim:
        return [p], [p, p]
    return [R], [R, R]


@register(aten.histc.default, aten.bincount.default)
def histc_rule(node, tin, ins, n) -> Decision:
    """Counts over a sharded input are the sum of the shards' counts."""
    if ins and is_shard(ins[0]) and (node.target is aten.histc.default or len(ins) == 1):
        return [ins[0]] + [R] * (len(ins) - 1), P
    return [R] * len(ins), R


@register(aten.stack.default)
def stack_rule(node, tin, ins, n) -> Decision:
    out_nd = ndim(node)
    dim = _norm(arg(node, 1, "dim", 0), out_nd)
    shards = [p for p in ins if is_shard(p)]
    if shards and all(p == shards[0] for p in ins) and not isinstance(shards[0], _StridedShard):
        p = shards[0]
        return list(ins), with_dim(p, p.dim + (p.dim >= dim))
    return [R] * len(ins), R


@register(torch.ops.autopar.moe_experts.default)
def moe_experts_rule(node, tin, ins, n) -> Decision:
    """MoE experts without an expert axis here: per token, so tokens sharded on dim 0 (data parallel)
    stay so with experts replicated; experts sharded on their FFN dims (tensor parallel) take every
    token and give partial sums. The expert-parallel rule is `passes.lower._moe_rule`."""
    x, params = ins[0], ins[3:]
    if any(is_shard(p) and p.dim >= 1 for p in params):  # tensor-parallel experts: every token, partial sums
        return [R, R, R] + list(params), P
    if is_shard(x) and x.dim == 0:
        return [x, x, x] + [R] * (len(ins) - 3), x
    return [R] * len(ins), R


FACTORIES = [aten.arange.default, aten.arange.start, aten.arange.start_step, aten.ones.default, aten.zeros.default,
             aten.full.default, aten.empty.memory_format, aten.scalar_tensor.default, aten.new_ones.default,
             aten.new_zeros.default, aten.new_full.default, aten.new_empty.default, aten.tril.default,
             aten.triu.default, aten.lift_fresh_copy.default]
register(*[t for t in FACTORIES if t not in RULES])(replicate_rule)
