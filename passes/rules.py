"""Sharding rules: a table keyed by ATen op, most entries derived from PyTorch's DTensor, the rest autopar's own.

A rule sees one mesh axis at a time: the placements of the node's tensor inputs on that axis and the axis size,
and returns `(required input placements, output placement)` (a list of output placements for ops with several
outputs). Rules never mutate the graph; the lowering inserts the collectives that turn each input's placement
into the required one, and wraps an input that must be `R` in `grad_all_reduce` when the output is not `R` (its
gradient is then partial).

Where the rules come from (one lookup, `rule_for(op)`, which the lowering asks):
- **autopar's own rules** (`OWN_RULES`, registered below by `register`), where DTensor has no strategy or its
  answer cannot be used, each with its reason: fused-QKV splits, squeeze, device moves, dropout,
  `view_as`/`reshape_as`, linear/addmm, one_hot, bincount, embedding, attention, losses, `broadcast_tensors`, MoE
  experts, factories.
- **DTensor** (`DERIVED`: `passes.dtensor_rules.dtensor_rule`) for every op of DTensor's strategy registry that a
  captured forward graph can hold (`passes.dtensor_rules.candidate_ops`), and the composite ops models keep whole
  (`layer_norm`, `matmul`, `softmax`...), **whose derived rule passed the rule check**: `passes.checked_ops.CHECKED`,
  written by `tests/rule_sweep.py` (samples generated from torch's OpInfo database, and the hand-written ones of
  `tests/rule_samples.py`), re-checked in `make test` (`tests/test_rule_sweep_*.py`). An op of the registry that the
  check finds wrong (`REFUSED`) or cannot sample gets no rule: never trusted unchecked. The decision is DTensor's
  own strategy for the op, translated into what the lowering realises (see that module: what falls back to
  replication and why). One policy is autopar's: a `Partial` input is reduced at its first consumer (the lowering
  shares that reduction between consumers) except where two partials are added, so DTensor is asked with the
  partial inputs replicated.

Both kinds are checked the same way, op by op: `tests/rule_check.py` lowers the op under combinations of input
placements (R, S(d), `_StridedShard`, P; scalars and broadcasting) on simulated ranks and compares the output and
every input gradient with the op on full inputs, fp64.

An op without a rule is decomposed at capture into ops with rules where it has a decomposition
(`passes.decompose`: `rms_norm`, `group_norm`, `instance_norm`...). One left without runs on each rank's rows of the
batch when capture found it batch-local (`passes.batch_local`: its rows independent, checked numerically); otherwise
it is replicated: every input is made `R` and the output is `R`; the lowering notes it ("replicated ... no sharding
rule ..., its sharded inputs are gathered"). Never a guess. Every op in the graphs of the test models (the Hugging
Face zoo, `autopar.models`) has a rule or is in `REPLICATED_ON_PURPOSE`, with why (`tests/test_model_ops.py`).
"""

from __future__ import annotations

from typing import Callable

import torch
from torch import fx

import autopar.runtime.moe  # noqa: F401  (registers autopar::moe_experts)
import autopar.runtime.opaque  # noqa: F401  (registers autopar::opaque)
from autopar.spec import P, R, Placement, Partial, Shard, _StridedShard, is_shard, with_dim
from passes.dtensor_rules import dtensor_rule

aten = torch.ops.aten
Decision = tuple[list[Placement], "Placement | list[Placement]"]
Rule = Callable[[fx.Node, list[fx.Node], list[Placement], int], Decision]
RULES: dict[object, Rule] = {}  # every op's rule: autopar's own (OWN_RULES) and the derived ones
OWN_RULES: dict[object, Rule] = {}


def register(*targets) -> Callable[[Rule], Rule]:
    """Register `fn` as autopar's own rule of `targets`; an op registers once (a second rule, own or derived, is an
    error: own rules are registered before the derived ones, which skip the ops that have one)."""
    def deco(fn: Rule) -> Rule:
        for t in targets:
            if t in RULES:
                raise ValueError(f"a sharding rule for {t} is registered twice ({RULES[t].__name__}, {fn.__name__})")
            OWN_RULES[t] = RULES[t] = fn
        return fn
    return deco


def rule_for(op) -> Rule | None:
    """The op's sharding rule: autopar's own if it has one, else DTensor's derived rule if the rule check passed it
    (`passes.checked_ops`), else None (no rule: the lowering replicates the op; capture decomposes it first where
    its decomposition has rules, `passes.decompose`)."""
    return RULES.get(op)


def op_named(name: str):
    """The op of its printed name ("aten.add.Tensor"), or None where this torch has no such op."""
    ns, packet, overload = name.split(".")
    try:
        return getattr(getattr(getattr(torch.ops, ns), packet), overload)
    except AttributeError:
        return None


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


def replicate_rule(node, tin, ins, n) -> Decision:
    outs = node.meta.get("val")
    if isinstance(outs, (list, tuple)):
        return [R] * len(ins), [R] * len(outs)
    return [R] * len(ins), R


# ----------------------------------------------------------------------------- derived from DTensor

# Elementwise ops: also the ops an MLP region may hold (passes.mlp). All but `OWN_POINTWISE` have DTensor's rule.
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
OWN_POINTWISE = {aten.to.device, aten.to.dtype_layout, aten.dropout.default}

# ----------------------------------------------------------------------------- autopar's own: pointwise

@register(*OWN_POINTWISE)
def unary_rule(node, tin, ins, n) -> Decision:
    """A shard passes through; partials are reduced first. `to.device`/`to.dtype_layout`: DTensor has no strategy
    for them; dropout: train mode is the lowering's `parallel_dropout` (per-shard random streams), which DTensor's
    answer (derived from a decomposition through random ops) does not know."""
    p = ins[0]
    return ([p], p) if is_shard(p) else ([R], R)


# ----------------------------------------------------------------------------- autopar's own: views

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


@register(aten.squeeze.dim, aten.squeeze.default, aten.squeeze.dims, aten.view_as.default, aten.reshape_as.default)
def view_rule(node, tin, ins, n) -> Decision:
    """squeeze: DTensor rewrites its arguments for the local shards, which the lowering does not; view_as/reshape_as:
    the shape comes from `other`, which DTensor leaves as it is (its local shape is then not the output's); here
    `other` is placed like the output."""
    p = ins[0]
    req = [R] * len(ins)
    if not is_shard(p):
        return req, R
    out = map_view_dim(shape(tin[0]), shape(node), p.dim, n, p)
    if out is None:
        return req, R
    if node.target in (aten.view_as.default, aten.reshape_as.default):
        return [p, out], out
    return [p] + req[1:], out


def _split_outputs(node) -> int:
    return len(node.meta["val"])


@register(aten.split.Tensor, aten.split_with_sizes.default, aten.chunk.default)
def split_rule(node, tin, ins, n) -> Decision:
    """A fused QKV projection's output `_StridedShard(d, k)` split into its k equal blocks gives each block
    `Shard(d)` (every rank holds its heads of q, of k and of v); DTensor replicates that split."""
    p = ins[0]
    k = _split_outputs(node)
    s = shape(tin[0])
    dim = _norm(arg(node, 2, "dim", 0), len(s))
    if not is_shard(p):
        return [R], [R] * k
    if p.dim != dim:
        return [p], [p] * k
    sizes = [int(v.shape[dim]) for v in node.meta["val"]]
    if isinstance(p, _StridedShard) and p.split_factor == k and len(set(sizes)) == 1 and sizes[0] % n == 0:
        return [p], [Shard(dim)] * k
    return [R], [R] * k


# ----------------------------------------------------------------------------- autopar's own: linear layers

def _linear_like(x_p, w_p, x_nd, w_in_dim: int, bias: bool) -> tuple[Placement, Placement, Placement]:
    """x (..., k) against a weight with `in` on dim w_in_dim; returns (x required, w required, out)."""
    w_out_dim = 1 - w_in_dim
    last = x_nd - 1
    if is_shard(w_p) and w_p.dim == w_out_dim:  # column-parallel
        return R, w_p, with_dim(w_p, last)
    if is_shard(w_p) and w_p.dim == w_in_dim:  # row-parallel: x sharded alike on features -> partial sums
        if bias:  # the bias joins after the reduction: decompose_row_bias_pass splits it off a parameter weight;
            return R, R, R  # a row-sharded weight computed in the graph is gathered instead
        return with_dim(w_p, last), w_p, P
    # replicated weight
    if is_shard(x_p) and x_p.dim < last:
        return x_p, R, x_p
    return R, R, R


@register(aten.linear.default)
def linear_rule(node, tin, ins, n) -> Decision:
    """Column- and row-parallel linear layers. DTensor derives linear from its decomposition, which cannot add a
    row-parallel product's bias after the reduction (it asks for the bias as a partial, which no collective of the
    lowering makes, or has no answer); here the bias is added once, after it (`decompose_row_bias_pass`)."""
    bias = len(tin) > 2
    xr, wr, out = _linear_like(ins[0], ins[1], ndim(tin[0]), 1, bias)
    req = [xr, wr]
    if bias:
        req.append(with_dim(wr, 0) if is_shard(wr) else R)
    return req, out


@register(aten.addmm.default)
def addmm_rule(node, tin, ins, n) -> Decision:
    """GPT-2's Conv1D (`bias + x @ W`): as linear with the weight transposed. Row-parallel, the bias is added after
    the reduction (`decompose_row_bias_pass` turns the node into mm + add first)."""
    bias_nd = ndim(tin[0])
    xr, wr, out = _linear_like(ins[1], ins[2], ndim(tin[1]), 0, True)
    bias_p = R
    if is_shard(out):  # the bias broadcast to the (m, n) output: sharded like it where it has that dim
        d = out.dim - (2 - bias_nd)
        if d >= 0 and shape(tin[0])[d] != 1:
            bias_p = with_dim(out, d)
    return [bias_p, xr, wr], out


@register(aten.one_hot.default)
def one_hot_rule(node, tin, ins, n) -> Decision:
    """One-hot rows (a new last dim of classes): the input's shard passes through. DTensor has no strategy (its
    decomposition does not run on shards)."""
    p = ins[0]
    if is_shard(p) and arg(node, 1, "num_classes", -1) > 0:  # -1: classes = max + 1, data-dependent
        return [p], p
    return [R], R


@register(aten.bincount.default)
def bincount_rule(node, tin, ins, n) -> Decision:
    """Counts over a sharded input are the sum of the shards' counts, when every shard counts into the same bins
    (`minlength` at least the global output length); else (the length depends on each shard's max) replicated.
    DTensor has no strategy (data-dependent output shape)."""
    if ins and is_shard(ins[0]) and len(ins) == 1 and arg(node, 2, "minlength", 0) >= shape(node)[0]:
        return [ins[0]], P
    return [R] * len(ins), R


# ----------------------------------------------------------------------------- embedding, attention, losses

@register(aten.embedding.default)
def embedding_rule(node, tin, ins, n) -> Decision:
    """Vocab-parallel (rows sharded: the lowering's masked lookup, padding_idx kept), hidden-sharded, or ids
    sharded. DTensor gathers a row-sharded table whose ids are sharded on the same axis, undoing the plan's
    vocab-parallel form; here the ids are gathered (they are small)."""
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
    """Batch- or heads-parallel attention, GQA's fewer KV heads picked per rank (`gqa_kv_heads`); Ulysses, ring and
    zigzag come from the plan's directives (`passes.lower._ulysses_rule`). DTensor answers only through the math
    decomposition, without GQA's KV-head selection (with fewer KV heads than ranks it gathers the queries)."""
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
    """Vocab-parallel cross-entropy (logits sharded on classes) and batch-sharded means over the global count of
    valid targets. DTensor's batch-sharded mean is a `Partial(avg)` of per-rank means, wrong with ignore_index.
    Probability targets (floating) are replicated: the sharded forms take class indices."""
    x, t = ins[0], ins[1]
    reduction = arg(node, 3, "reduction", 1)
    smoothing = arg(node, 5, "label_smoothing", 0.0)
    weighted = len(tin) > 2
    nd = ndim(tin[0])
    if weighted or any(isinstance(p, Partial) for p in ins) or tin[1].meta["val"].dtype.is_floating_point:
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
    """Sharded inputs: the lowering's `mse_loss_sharded` divides by the global count. DTensor's mean is a
    `Partial(avg)`, which the lowering does not carry."""
    a, b = ins
    reduction = arg(node, 2, "reduction", 1)
    p = a if is_shard(a) else b if is_shard(b) else None
    if p is None or isinstance(p, _StridedShard) or shape(tin[0]) != shape(tin[1]):
        return [R, R], R
    return [p, p], (p if reduction == 0 else P)


@register(aten.broadcast_tensors.default)
def broadcast_tensors_rule(node, tin, ins, n) -> Decision:
    """Inputs of one shape keep a common shard. DTensor's answer (from a decomposition into expands) is wrong on
    local shards (`passes.dtensor_rules.DENY`)."""
    outs = node.meta["val"]
    if len(set(shape(t) for t in tin)) == 1:
        shards = [p for p in ins if is_shard(p)]
        if shards:
            return [shards[0]] * len(ins), [shards[0]] * len(outs)
    return [R] * len(ins), [R] * len(outs)


@register(torch.ops.autopar.moe_experts.default)
def moe_experts_rule(node, tin, ins, n) -> Decision:
    """MoE experts without an expert axis here (autopar's own op): per token, so tokens sharded on dim 0 (data
    parallel) stay so with experts replicated; experts sharded on their FFN dims (tensor parallel: each parameter
    on its own FFN dim, `ExpertsSpec.ffn_dims`) take every token and give partial sums. The expert-parallel rule is
    `passes.lower._moe_rule`."""
    x, params = ins[0], ins[3:]
    ffn = _ffn_placements(node)
    if ffn is not None and list(params) == ffn:
        return [R, R, R] + list(params), P  # tensor-parallel experts: every token, partial sums
    if is_shard(x) and x.dim == 0:
        return [x, x, x] + [R] * (len(ins) - 3), x
    return [R] * len(ins), R


def _ffn_placements(node) -> list[Placement] | None:
    """Each expert parameter of the op split on its FFN features (`ExpertsSpec.ffn_dims`: the dim of a stacked
    parameter, or of one ModuleList expert's own parameter, stacked in the graph on a new dim 0), or None."""
    from autopar.runtime.moe import spec_of
    spec = spec_of(node.args[0])
    if not spec.ffn_dims or len(spec.ffn_dims) != len(node.args[4]):
        return None
    shift = 1 if spec.spelling == "modulelist" else 0
    return [Shard(d + shift) if k == 1 else _StridedShard(d + shift, split_factor=k) for d, k in spec.ffn_dims]


# Factories: no tensor input to follow, so replicated; DTensor rewrites their size arguments to local sizes, which
# the lowering does not.
FACTORIES = [aten.arange.default, aten.arange.start, aten.arange.start_step, aten.ones.default, aten.zeros.default,
             aten.full.default, aten.empty.memory_format, aten.scalar_tensor.default, aten.lift_fresh_copy.default]
register(*FACTORIES)(replicate_rule)


@register(aten.new_ones.default, aten.new_zeros.default, aten.new_full.default, aten.new_empty.default)
def new_factory_rule(node, tin, ins, n) -> Decision:
    """`x.new_zeros(size)`...: x gives only its dtype and device, so it stays as it is (gathering it would move a
    sharded batch for nothing); no gradient flows to x. A tensor of x's own shape is placed as x is where x is
    sharded (its values are one constant, or unset: every shard of it is right), its size made local
    (`passes.local_forms`): a buffer built to hold x's like, as DeepSeek-V3's MLA builds its keys
    (`new_empty` of the (b, heads, s, d) values, then the key parts copied in), stays split on the heads, not
    gathered to fill it. Any other size: a replicated tensor of the global size."""
    x = ins[0]
    if is_shard(x) and list(shape(node)) == list(shape(tin[0])):
        return list(ins), x
    return list(ins), R

# Ops without a rule on purpose (the lowering gathers their sharded inputs), each with why; the lowering does not
# note them again where their replication is noted elsewhere.
REPLICATED_ON_PURPOSE: dict[object, str] = {
    torch.ops.autopar.opaque.default: (
        "a submodule torch.export cannot trace (data-dependent control flow), or a custom autograd.Function kept "
        "with its own backward, run whole on every rank unless batch-local (passes.batch_local: then on each rank's "
        "rows); capture notes which ('captured as one opaque node')"),
}


# ----------------------------------------------------------------------------- derived from DTensor

def _derived() -> list:
    """The ops of `passes.checked_ops.CHECKED` (DTensor's rule passed the rule check) without an own rule."""
    from passes.checked_ops import CHECKED

    ops = [op_named(name) for name in CHECKED]
    return [op for op in ops if op is not None and op not in OWN_RULES]


DERIVED = _derived()
RULES.update({op: dtensor_rule for op in DERIVED})
