"""Composite ops without a sharding rule, decomposed at capture into ops that have one.

Contract of `decompose_unruled_pass(gm, ctx=None) -> gm`: every `call_function` node whose ATen op has no sharding
rule (`passes.rules.rule_for`: autopar's own or DTensor's checked one) and is not left whole on purpose (`LEFT_WHOLE`,
random ops) is replaced by the op's decomposition, when it has one and every op of it has a rule; otherwise the node
stays as it is (the lowering then replicates it, or a later fallback handles it). The computation is the op's own:
its CompositeImplicitAutograd kernel (what autograd differentiates anyway: `rms_norm`,
`instance_norm`, eval-mode `batch_norm`, the losses written in ATen, ...), traced on the node's fake values
(`make_fx`; an in-place op on one of its own temporaries kept, out-of-place where that op has a rule; an in-place
op on an input or a view refuses the decomposition), down to ops with rules: an inner composite op is traced
through, an inner op with a rule is kept (`instance_norm` gives `native_batch_norm`), except where that op's rule
cannot shard what its decomposition can (`DECOMPOSED_FURTHER`, by torch._decomp's table: `native_group_norm`
called as such gives `var_mean` per group); ops without a rule and without a CompositeImplicit kernel
decompose by that table too where it is checked (`DECOMPOSED_FURTHER`: `hardswish`, `glu`, `pixel_shuffle`,
`smooth_l1_loss`, `huber_loss`, `binary_cross_entropy_with_logits`, `log_sigmoid`, `prelu`); each of the table's
decompositions used here gives the op's outputs and input gradients (fp64, `tests/test_decompose.py`).

Each new node takes the replaced node's meta (`nn_module_stack`, `stack_trace`, ... : the recognisers and the
layer/FLOP accounting see the same module) with its own traced `val`. An RMSNorm decomposes into
`pow(x, 2) -> mean(-1, keepdim) -> add eps -> rsqrt -> mul`, the form `passes.norm` recognises.

Left whole: ops with a rule (`linear`, `scaled_dot_product_attention`, `cross_entropy_loss`, `embedding`,
`layer_norm`... : the recognisers need them whole), recurrent ops (`LEFT_WHOLE`: their decomposition unrolls the
time loop; they are a batch-local computation, handled as one), `group_norm` (`LEFT_WHOLE`: batch-local, its fused
kernel runs on each rank's rows; decomposed, it does several times the element work), random ops (their stream is
the lowering's), decompositions of more than `MAX_NODES` ops, decompositions holding a constant tensor.

One rewrite keeps decompositions free of `as_strided`, which has no rule (it addresses storage, not a shard):
`as_strided(x, size, stride)` of a contiguous x at offset 0, to the contiguous strides of `size` with x's element
count, is `view(x, size)` (`native_group_norm`'s CPU decomposition spells a reshape so).
"""

from __future__ import annotations

import math

import torch
from torch import fx
from torch.utils import _pytree as pytree

aten = torch.ops.aten
MAX_NODES = 64
LEFT_WHOLE = {
    aten.lstm.input, aten.lstm.data, aten.gru.input, aten.gru.data, aten.rnn_tanh.input, aten.rnn_tanh.data,
    aten.rnn_relu.input, aten.rnn_relu.data, aten.lstm_cell.default, aten.gru_cell.default,
    aten.rnn_tanh_cell.default, aten.rnn_relu_cell.default,
    # batch-local (checked at capture), so it runs on the local shard whole: torch's fused kernel, where the
    # decomposition (var_mean per group, pointwise ops) does 3.4x its element work on CPU; one level down,
    # `native_group_norm` takes the batch size as an int, which the lowering does not rewrite to the local one
    aten.group_norm.default,
}
_TRACED_META = ("val", "tensor_meta", "example_value")
# Ops decomposed by torch._decomp's table (CompositeExplicit: their own kernel and derivative formula), with why.
# The table's decompositions are written for tracing below autograd, so each one used here is checked to give the
# op's outputs and input gradients (fp64, OpInfo samples: `tests/test_decompose.py`), not trusted.
DECOMPOSED_FURTHER = {
    aten.native_group_norm.default: (
        "takes the batch size N, channels C and HxW as ints, which DTensor rewrites to local sizes and the lowering "
        "does not: its rule replicates a sharded batch; its decomposition (var_mean over each group) shards it"),
    **{op: "no rule; its decomposition is pointwise math, reductions and views, which have rules" for op in (
        aten.hardswish.default, aten.log_sigmoid_forward.default, aten.glu.default, aten.smooth_l1_loss.default,
        aten.huber_loss.default, aten.binary_cross_entropy_with_logits.default, aten.pixel_shuffle.default,
        aten._prelu_kernel.default)},
}


def _wanted(node: fx.Node) -> bool:
    from passes.rules import REPLICATED_ON_PURPOSE, rule_for

    op = node.target
    return (node.op == "call_function" and isinstance(op, torch._ops.OpOverload) and rule_for(op) is None
            and op not in REPLICATED_ON_PURPOSE and op not in LEFT_WHOLE and not _random(op))


def _random(op) -> bool:
    return torch.Tag.nondeterministic_seeded in op.tags


def _val(a):
    return a.meta.get("val") if isinstance(a, fx.Node) else a


def _trace(node: fx.Node) -> fx.GraphModule | None:
    """The op's decomposition traced on the node's fake values, or None where it cannot be traced."""
    from torch._guards import detect_fake_mode
    from torch.fx.experimental.proxy_tensor import make_fx

    flat, spec = pytree.tree_flatten((node.args, node.kwargs))
    vals = [_val(a) for a in flat]
    where = [i for i, (a, v) in enumerate(zip(flat, vals)) if isinstance(a, fx.Node) and isinstance(v, torch.Tensor)]
    if any(isinstance(a, fx.Node) and i not in where for i, a in enumerate(flat)):
        return None  # a symbolic or non-tensor node argument
    fake = detect_fake_mode([vals[i] for i in where])
    if fake is None:
        return None

    def call(*tensors):
        args = list(vals)
        for i, t in zip(where, tensors):
            args[i] = t
        a, k = pytree.tree_unflatten(args, spec)
        return node.target(*a, **k)

    from torch._decomp import decomposition_table

    further = {op: decomposition_table[op] for op in DECOMPOSED_FURTHER}
    try:
        with fake:
            return make_fx(call, decomposition_table=further)(*[vals[i] for i in where])
    except Exception:  # noqa: BLE001  (no decomposition that traces here: the node stays whole)
        return None


def _contiguous_strides(size) -> list[int]:
    strides, step = [], 1
    for s in reversed(size):
        strides.append(step)
        step *= max(int(s), 1)
    return list(reversed(strides))


def _as_strided_to_view(sub: fx.GraphModule) -> None:
    for n in list(sub.graph.nodes):
        if n.target is not aten.as_strided.default:
            continue
        x, size, stride = n.args[:3]
        offset = n.args[3] if len(n.args) > 3 else n.kwargs.get("storage_offset", 0)
        v = x.meta.get("val")
        if (isinstance(v, torch.Tensor) and v.is_contiguous() and v.storage_offset() == 0 and not offset
                and list(stride) == _contiguous_strides(size) and math.prod(size) == v.numel()):
            with sub.graph.inserting_before(n):
                view = sub.graph.call_function(aten.view.default, (x, list(size)))
            view.meta.update(n.meta)
            n.replace_all_uses_with(view)
            sub.graph.erase_node(n)


def _out_of_place(op):
    name = op._schema.name.split("::")[1]
    if not name.endswith("_") or name.startswith("_"):
        return None
    packet = getattr(aten, name[:-1], None)
    return getattr(packet, op._overloadname, None) if packet is not None else None


def _functional(sub: fx.GraphModule) -> bool:
    """In-place ops only on the decomposition's own temporaries (`mean.add_(eps)`): the written tensor computed in
    the decomposition, no view, the in-place op its only use; made out-of-place where that op has a rule. False
    where an in-place op writes into an input or a view (the decomposition is then refused)."""
    from passes.rules import rule_for

    for n in list(sub.graph.nodes):
        op = n.target
        if n.op != "call_function" or not isinstance(op, torch._ops.OpOverload) or not op._schema.is_mutable:
            continue
        x = n.args[0]
        if (not isinstance(x, fx.Node) or x.op != "call_function" or len(x.users) != 1
                or not isinstance(x.target, torch._ops.OpOverload) or x.target.is_view):
            return False
        functional = _out_of_place(n.target)
        if functional is not None and rule_for(functional) is not None:
            n.target = functional
    return True


def decomposition(node: fx.Node) -> fx.GraphModule | None:
    """The node's op decomposed into ops that all have a rule, or None."""
    from passes.rules import rule_for

    sub = _trace(node)
    if sub is None:
        return None
    _as_strided_to_view(sub)
    sub.graph.eliminate_dead_code()
    if not _functional(sub):
        return None
    ops = [n for n in sub.graph.nodes if n.op not in ("placeholder", "output")]
    if len(ops) > MAX_NODES:
        return None
    for n in ops:
        if n.op != "call_function":
            return None  # a constant tensor (get_attr)
        if n.target.__name__ == "getitem":
            continue
        if not isinstance(n.target, torch._ops.OpOverload) or rule_for(n.target) is None or _random(n.target):
            return None
    return sub


def _inline(gm: fx.GraphModule, node: fx.Node, sub: fx.GraphModule) -> None:
    flat, _ = pytree.tree_flatten((node.args, node.kwargs))
    tensors = iter([a for a in flat if isinstance(a, fx.Node)])
    keep = {k: v for k, v in node.meta.items() if k not in _TRACED_META}
    env: dict[fx.Node, fx.Node] = {}
    result = None
    with gm.graph.inserting_before(node):
        for n in sub.graph.nodes:
            if n.op == "placeholder":
                env[n] = next(tensors)
            elif n.op == "output":
                result = n.args[0]
            else:
                new = gm.graph.call_function(n.target, fx.map_arg(n.args, env.__getitem__),
                                             fx.map_arg(n.kwargs, env.__getitem__))
                new.meta.update(keep)
                new.meta["val"] = n.meta.get("val")
                env[n] = new
    if isinstance(result, (list, tuple)):
        outs = [env[r] if isinstance(r, fx.Node) else r for r in result]
        for user in list(node.users):
            if user.target.__name__ != "getitem":
                raise AssertionError(f"{node.name} ({node.target}): a multi-output node used other than by getitem")
            user.replace_all_uses_with(outs[user.args[1]])
            gm.graph.erase_node(user)
    else:
        node.replace_all_uses_with(env[result])
    gm.graph.erase_node(node)


def _signature(node: fx.Node) -> str:
    """The node's op and arguments with tensors as their shape, dtype and device: a model's repeated layers (nine
    RMSNorms of one shape) trace their decomposition once."""
    def one(a):
        v = _val(a)
        if isinstance(v, torch.Tensor):
            return ("T", tuple(v.shape), v.dtype, str(v.device), v.requires_grad)
        return repr(v) if isinstance(a, fx.Node) else a
    return repr((node.target, pytree.tree_map(one, (node.args, node.kwargs))))


def decompose_unruled_pass(gm: fx.GraphModule, ctx=None) -> fx.GraphModule:
    changed = False
    traced: dict[str, fx.GraphModule | None] = {}
    for node in list(gm.graph.nodes):
        if not _wanted(node):
            continue
        key = _signature(node)
        if key not in traced:
            traced[key] = decomposition(node)
        sub = traced[key]
        if sub is not None:
            _inline(gm, node, sub)
            changed = True
    if changed:
        gm.graph.lint()
        gm.recompile()
    return gm
