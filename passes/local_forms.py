"""Local forms: ops whose local program on sharded inputs is not the op itself on local shards.

A registry like the sharding rules (`passes.rules`): `@local_form(op)` registers `fn(lw, node, reqs, outs)`,
which rewrites the node in place once the lowering (`passes.lower`, the `lw` it passes: axes, sizes, the
graph, the placements so far) has placed its inputs as the rule required (`reqs`: per tensor input, one
placement per mesh axis) and knows its output placements (`outs`). An op registers once.

| op                              | local program                                                             |
|---------------------------------|---------------------------------------------------------------------------|
| view, reshape, unflatten, expand| shape literals rewritten to local sizes                                   |
| new_empty/zeros/ones/full       | size literal rewritten to the local size (sharded like its input)         |
| split, split_with_sizes         | split sizes divided by the shards of the split dim                       |
| embedding (rows sharded)        | `vocab_parallel_embedding`: masked lookup of this rank's rows, padding_idx |
| dropout (train)                 | `parallel_dropout`: one mask per shard, the same on replicas              |
| cross_entropy_loss              | vocab-parallel (logits sharded on classes) or batch-sharded (global count)|
| moe_experts                     | `moe_experts` in mode local / partial / a2a                               |
| opaque                          | `run_opaque`: the module's own forward under autograd (no recompute), on  |
|                                 | the local rows when batch-local (`passes.batch_local`), else the batch    |
| embedding_bag_rows (2-D bags)   | `F.embedding_bag` itself under autograd, on the rows it gets              |
| mse_loss, mean over shards      | local sum divided by the global count                                     |
| scaled_dot_product_attention    | ring attention; GQA KV heads picked per rank; K/V before repeat_kv         |
"""

from __future__ import annotations

import math

import torch
from torch import fx

from autopar.plan import AttentionMode
from autopar.runtime import ops as O
from autopar.runtime.embedding_bag import embedding_bag_local
from autopar.sites import module_path
from autopar.spec import Partial, Replicate, _StridedShard, is_shard
from passes.patterns import repeat_kv_source
from passes.rules import arg, shape

aten = torch.ops.aten
_VIEWS = {aten.view.default, aten.reshape.default, aten._unsafe_view.default, aten.flatten.using_ints}


def local_shape(global_shape, pls, sizes) -> list[int]:
    out = list(global_shape)
    for p, n in zip(pls, sizes):
        if is_shard(p):
            if out[p.dim] % n:
                raise NotImplementedError(
                    f"dim {p.dim} of size {out[p.dim]} does not divide over a mesh axis of size {n}: "
                    "uneven shards are not supported yet")
            out[p.dim] //= n
    return out


LOCAL_FORMS: dict[object, object] = {}


def local_form(*targets):
    """Register the local program of ops (`fn(lowerer, node, required input placements, output placements)`,
    rewriting the node in place). An op registers once."""
    def deco(fn):
        for t in targets:
            if t in LOCAL_FORMS:
                raise ValueError(f"a local form for {t} is registered twice ({LOCAL_FORMS[t].__name__}, {fn.__name__})")
            LOCAL_FORMS[t] = fn
        return fn
    return deco


@local_form(aten.view.default, aten.reshape.default, aten._unsafe_view.default, aten.unflatten.int, aten.expand.default)
def _local_shape(lw, node: fx.Node, reqs, outs) -> None:
    """Shape literals become local shapes: view(b, s, heads, d) -> view(b, s, heads/t, d)."""
    out = outs[0]
    if lw._sharded_axes(out):
        node.target = aten.expand.default if node.target is aten.expand.default else aten.reshape.default
        node.args = (node.args[0], local_shape(shape(node), out, lw.sizes))
        node.kwargs = {}


@local_form(aten.new_empty.default, aten.new_zeros.default, aten.new_ones.default, aten.new_full.default)
def _local_new_factory(lw, node: fx.Node, reqs, outs) -> None:
    """A sharded `x.new_*(size)` (`passes.rules.new_factory_rule`): its size literal becomes the local size."""
    out = outs[0]
    if lw._sharded_axes(out):
        node.args = (node.args[0], local_shape(shape(node), out, lw.sizes)) + tuple(node.args[2:])


@local_form(aten.split.Tensor, aten.split_with_sizes.default)
def _local_split(lw, node: fx.Node, reqs, outs) -> None:
    dim = arg(node, 2, "dim", 0)
    nd = len(shape(node.args[0]))
    dim = dim + nd if dim < 0 else dim
    factor = math.prod(lw.sizes[ax] for ax in lw._sharded_axes(reqs[0], [dim]))
    if factor > 1:
        sizes = node.args[1]
        sizes = [s // factor for s in sizes] if isinstance(sizes, (list, tuple)) else sizes // factor
        node.args = (node.args[0], sizes) + tuple(node.args[2:])


@local_form(aten.embedding.default)
def _local_embedding(lw, node: fx.Node, reqs, outs) -> None:
    """Vocab-sharded table: masked lookup of this rank's rows (padding_idx kept), partial output."""
    vocab_axes = [ax for ax, p in enumerate(reqs[0]) if is_shard(p) and p.dim == 0]
    if vocab_axes:
        padding_idx = arg(node, 2, "padding_idx", -1)
        node.target = O.vocab_parallel_embedding
        node.args, node.kwargs = (node.args[0], node.args[1], lw.axes[vocab_axes[0]].key, padding_idx), {}


@local_form(aten.dropout.default)
def _local_dropout(lw, node: fx.Node, reqs, outs) -> None:
    p, train = node.args[1], node.args[2]
    if train and p > 0:
        sharded = tuple(lw.axes[ax].key for ax in lw._sharded_axes(outs[0]))
        node.target = O.parallel_dropout
        node.args = (node.args[0], p, train, lw.ctx.rng_stream, lw._dropout_count, sharded)
        lw._dropout_count += 1


@local_form(aten.cross_entropy_loss.default)
def _local_cross_entropy(lw, node: fx.Node, reqs, outs) -> None:
    x, target = node.args[0], node.args[1]
    reduction = arg(node, 3, "reduction", 1)
    ignore_index = arg(node, 4, "ignore_index", -100)
    smoothing = arg(node, 5, "label_smoothing", 0.0)
    vocab = [ax for ax, p in enumerate(reqs[0]) if is_shard(p) and p.dim == 1]
    batch = tuple(lw.axes[ax].key for ax, p in enumerate(reqs[1]) if is_shard(p) and p.dim == 0)
    if vocab:
        node.target = O.vocab_parallel_cross_entropy_loss
        node.args = (x, target, lw.axes[vocab[0]].key, reduction, ignore_index, batch)
        node.kwargs = {}
    elif batch and reduction != 0:
        node.target = O.cross_entropy_sharded_batch
        node.args = (x, target, reduction, ignore_index, smoothing, batch)
        node.kwargs = {}


@local_form(torch.ops.autopar.moe_experts.default)
def _local_moe(lw, node: fx.Node, reqs, outs) -> None:
    from autopar.runtime.moe import moe_experts, spec_of
    key, x, idx, w, params = node.args
    ep = lw.ctx.moe_axes.get(node.name)
    mode, axis = "local", None
    if ep is not None:
        axis = lw.axes[ep].key
        mode = "partial" if isinstance(outs[0][ep], Partial) else "a2a"
    token_axes = tuple(lw.axes[ax].key for ax in lw._sharded_axes(reqs[0], [0]))
    if spec_of(key).capacity_factor is not None and any(isinstance(p, _StridedShard) for p in reqs[0]):
        raise NotImplementedError(
            f"MoE {spec_of(key).path} with a capacity factor: its tokens are sharded on the sequence here, so "
            "a rank's tokens are not one contiguous range of the global order that capacity is counted in. "
            "Fix: shard only the batch (no sequence form on the expert's token axes), or make it dropless.")
    node.target = moe_experts
    node.args = (x, idx, w, list(params), key, axis, mode, token_axes, shape(node)[0])
    node.kwargs = {}


@local_form(torch.ops.autopar.opaque.default)
def _local_opaque(lw, node: fx.Node, reqs, outs) -> None:
    from autopar.runtime.opaque import run_opaque
    node.target = run_opaque


@local_form(torch.ops.autopar.embedding_bag_rows.default)
def _local_embedding_bag_rows(lw, node: fx.Node, reqs, outs) -> None:
    node.target = embedding_bag_local


@local_form(aten.mse_loss.default)
def _local_mse(lw, node: fx.Node, reqs, outs) -> None:
    if lw._sharded_axes(reqs[0]):
        reduction = arg(node, 2, "reduction", 1)
        node.target = O.mse_loss_sharded
        node.args, node.kwargs = (node.args[0], node.args[1], reduction, math.prod(shape(node.args[0]))), {}


@local_form(aten.mean.dim, aten.mean.default)
def _local_mean(lw, node: fx.Node, reqs, outs) -> None:
    """A mean over sharded dims: local sum / global count (the output is Partial)."""
    if any(isinstance(p, Partial) for p in outs[0]) and lw._sharded_axes(reqs[0]):
        x = node.args[0]
        nd = len(shape(x))
        dims = None if node.target is aten.mean.default else arg(node, 1, "dim", None)
        red = range(nd) if not dims else [d + nd if d < 0 else d for d in dims]
        count = math.prod(shape(x)[d] for d in red)
        keepdim = False if node.target is aten.mean.default else bool(arg(node, 2, "keepdim", False))
        node.target = O.sum_div
        node.args, node.kwargs = (x, None if dims is None else list(red), keepdim, count), {}


@local_form(aten.scaled_dot_product_attention.default)
def _local_attention(lw, node: fx.Node, reqs, outs) -> None:
    _pick_kv_heads(lw, node, reqs)
    modes = lw.ctx.attention_modes.get(node.name, {})
    ring = [ax for ax, m in modes.items() if m is AttentionMode.RING]
    if ring:  # q, k, v on their zigzag sequence shards (and on heads over a heads axis): K/V circulate
        from autopar.runtime.ring_attention import ring_attention
        a = node.args
        causal = bool(a[5]) if len(a) > 5 else bool(node.kwargs.get("is_causal", False))
        scale = a[6] if len(a) > 6 else node.kwargs.get("scale")
        mask = a[3] if len(a) > 3 else node.kwargs.get("attn_mask")
        if mask is not None:  # recognition proved it the causal mask (`passes.masks`); it is dead after this
            if node.name not in lw.ctx.causal_masks:
                raise ValueError(f"attention {node.name} ({module_path(node)}) runs as ring attention but takes a mask "
                                 "the plan does not say is causal: ring attention supports is_causal or no mask. "
                                 "Fix: re-plan (ring is offered only where the mask is the causal mask)")
            causal = True
        k, v = _kv_before_repeat(lw, a[1]), _kv_before_repeat(lw, a[2])
        if k is None or v is None:  # ring attention takes grouped K/V itself: circulate the KV heads only
            k, v = a[1], a[2]
        node.target = ring_attention
        node.args = (a[0], k, v, lw.axes[ring[0]].key)
        node.kwargs = {"causal": causal, "scale": scale}


def _pick_kv_heads(lw, node: fx.Node, reqs) -> None:
    """Fewer KV heads than the ranks of an axis splitting the query heads: K/V stay replicated there and each
    rank picks the KV heads its query heads use (`gqa_kv_heads`)."""
    q_heads = shape(node.args[0])[1]
    picks = [ax for ax, (rq, rk) in enumerate(zip(reqs[0], reqs[1]))
             if is_shard(rq) and rq.dim == 1 and isinstance(rk, Replicate)]
    if len(picks) > 1 or (picks and sum(is_shard(p) and p.dim == 1 for p in reqs[0]) > 1):
        raise NotImplementedError(
            f"attention {node.name} ({module_path(node)}): its query heads are split over mesh axes "
            f"{[lw.axes[ax].name for ax, p in enumerate(reqs[0]) if is_shard(p) and p.dim == 1]} and its "
            f"{shape(node.args[1])[1]} KV heads are fewer than the ranks of {[lw.axes[ax].name for ax in picks]}: "
            "picking KV heads under heads split over two axes is not supported. Fix: axes whose sizes multiply to "
            "a divisor of the KV heads, or one axis for the heads")
    for ax in picks:
        args = list(node.args)
        with lw.graph.inserting_before(node):
            for i in (1, 2):
                if shape(args[i])[1] == q_heads:
                    continue
                sel = lw.graph.call_function(O.gqa_kv_heads, (args[i], lw.axes[ax].key, q_heads))
                sel.meta["val"] = args[i].meta["val"]
                args[i] = sel
        node.args = tuple(args)


def _kv_before_repeat(lw, kv: fx.Node) -> fx.Node | None:
    """The grouped K or V behind a `repeat_kv` expansion (`passes.patterns.repeat_kv_source`), if it is placed as
    the expansion is, so that local query head i still uses local KV head i // n; else None."""
    x = repeat_kv_source(kv)
    return x if x is not None and lw.pl.get(x) == lw.pl.get(kv) else None
