"""Sharding rules derived from the strategies PyTorch's DTensor registers for ATen ops.

`dtensor_rule(node, tin, ins, n)` has the signature and return type of the rules in `passes.rules`
(one mesh axis at a time: the placements of the node's tensor inputs on that axis, the axis size;
returns the required input placements and the output placement, a list for multi-output ops).

How a decision is derived (`derive`):
1. the node's arguments become an `OpSchema`: every tensor input a `DTensorSpec` on a 1-D mesh of n
   ranks built without a process group (`DeviceMesh(..., _init_backend=False)`), with the input's
   *global* shape and dtype (`meta["val"]`), contiguous strides (placements do not depend on the layout, and
   DTensor's decomposition of a composite op such as `matmul` fails on some non-contiguous inputs, e.g. the
   transposed q of an explicit attention), and its placement on this axis; every other
   argument as it is (an fx node that is not a tensor, e.g. a SymInt, as its `meta["val"]`);
2. DTensor's sharding propagator picks its cheapest strategy for those placements
   (`propagate_op_sharding_non_cached`): the placements it wants the inputs in (`redistribute_schema`,
   None: as they are) and the placements of the outputs. Ops without a registered strategy go through
   DTensor's decomposition-based propagation (composite ops: `linear`, `matmul`, `softmax.int`,
   `scaled_dot_product_attention`, `cross_entropy_loss`...), which only answers when the
   decomposition runs on local shards without any redistribution inside it;
3. the answer is translated into autopar's placements, which are torch's own (`autopar.spec`):
   `Replicate`, `Shard`, `_StridedShard` and `Partial("sum")` carry over as they are.

Two choices are autopar's, not DTensor's:
- a `Partial` input is reduced at its first consumer, except in a sum of two partials (`PARTIAL_SUMS`):
  DTensor is asked with the partial inputs replicated. (DTensor keeps a partial through `mul`, `div`,
  views and casts; the lowering shares one reduction of a value among its consumers, so a partial kept
  past a consumer that reduced it is reduced twice: RMSNorm's `x * rsqrt(mean(x^2))` after a
  row-parallel output would all-reduce `x` for the mean and the product again.)
- some ops are asked in another spelling of the same computation (`ASKED_AS`): `reshape` as `view`
  (DTensor's reshape strategy does not merge an inner shard into a `_StridedShard`), `where` with a
  python scalar as `where.self` with a 0-d replicated tensor (no strategy for the scalar overloads).

What autopar's lowering cannot realise is replicated instead (every input `R`, outputs `R`, as an op
without a rule), and `derive(...).reason` says why:
- a `Partial` whose reduce op is not sum (`avg`, `max`, `min`, a norm's `_NormPartial`): the lowering
  reduces by summing. One case is realised: `aten.mean` over a sharded dim, whose local form the
  lowering already rewrites into `sum / global count` (`autopar.runtime.ops.sum_div`), which is
  DTensor's `Partial(avg)` of local means divided by the axis size, a `Partial(sum)`;
- `_MaskPartial` (a masked lookup: indices outside this rank's rows contribute zeros), except
  `aten.embedding` with its weight sharded on rows, which the lowering swaps for the same masked
  lookup (`autopar.runtime.ops.vocab_parallel_embedding`); the ids then stay `R`;
- a required input placement no collective of the lowering produces: `R` or `S(d)` -> `P`
  (DTensor makes a replicated value partial by dividing it by the axis size on every rank);
- a shard that does not divide (DTensor shards unevenly, the lowering does not);
- local shape arguments that DTensor rewrites (`view`'s sizes, factories' sizes) where the lowering
  does not rewrite them (it does for view, reshape, _unsafe_view, unflatten, expand and split sizes);
- the lowering swaps the op for a parallel form that computes something else for that decision
  (`LOCAL_FORM_CONFLICTS`: `view_as`/`reshape_as`/`expand_as` take their shape from a tensor the
  lowering leaves global, the sharded cross-entropy forms take class indices only);
- DTensor has no strategy for the op (neither registered nor through its decomposition), or raised.

Decisions are cached by (op, input placements, axis size, input shapes/dtypes, other arguments): a
model's repeated layers ask once. `passes.rules` registers `dtensor_rule` for the ops the rule check passed
(`passes.checked_ops`, from the ops of `candidate_ops`).
DTensor's own rules have bugs: `tests/rule_sweep.py` checks every derived entry numerically, `test_rule_check.py`
every entry with hand-written samples; an op the sweep finds wrong is left without a rule (`checked_ops.REFUSED`);
`DENY` lists the ops whose DTensor answer it finds wrong (replicated, with
why) and `DIM_ARG` the ops asked with a normalised dim because DTensor mishandles a negative one.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from dataclasses import dataclass

import torch
from torch import fx
from torch.distributed.tensor.placement_types import _MaskPartial
from torch.utils import _pytree as pytree

from autopar.spec import P, R, Partial, Placement, Replicate, Shard, _StridedShard, fmt

aten = torch.ops.aten

# ops whose shape arguments the lowering rewrites to local sizes (passes.lower._Lowerer._localize)
LOCALISED_SHAPE_ARGS = {aten.view.default, aten.reshape.default, aten._unsafe_view.default, aten.unflatten.int,
                        aten.expand.default, aten.split.Tensor, aten.split_with_sizes.default}
MEAN_OPS = {aten.mean.dim, aten.mean.default}

# Ops whose DTensor answer the rule check (tests/test_rule_check.py) finds wrong: replicated, with why.
DENY: dict[object, str] = {
    aten.broadcast_tensors.default: (
        "derived from the decomposition (one expand per input, whose sizes DTensor localises), but the "
        "composite op run on local shards broadcasts the local shapes: a replicated input is broadcast to "
        "the sharded input's local size"),
}


def _shape_from_tensor(node, req, out) -> str | None:
    if any(not isinstance(p, Replicate) for p in list(req) + _as_list(out)):
        return ("the op takes its output shape from a tensor argument, which the lowering leaves global "
                "(it localises shape lists only)")
    return None


def _soft_targets(node, req, out) -> str | None:
    target = node.args[1].meta["val"]
    if target.dtype.is_floating_point and any(not isinstance(p, Replicate) for p in list(req) + _as_list(out)):
        return ("probability targets: the lowering's sharded cross-entropy forms (vocab-parallel, batch-sharded mean "
                "over the count of class-index targets) take class indices only")
    return None


# Where DTensor's answer is right for DTensor but the lowering's local form for that decision computes
# something else (passes.lower._Lowerer._localize swaps ops by the decision): replicated, with why.
LOCAL_FORM_CONFLICTS = {
    aten.view_as.default: _shape_from_tensor,
    aten.reshape_as.default: _shape_from_tensor,
    aten.expand_as.default: _shape_from_tensor,
    aten.cross_entropy_loss.default: _soft_targets,
}


def _as_list(out) -> list:
    return list(out) if isinstance(out, (list, tuple)) else [out]


@dataclass(frozen=True)
class Derived:
    """One decision: the required input placements, the output placement(s), and why it is not
    DTensor's answer as is (None when it is)."""

    req: tuple[Placement, ...]
    out: Placement | tuple[Placement, ...]
    reason: str | None = None
    dtensor: str = ""  # DTensor's own answer, printed


def dtensor_rule(node: fx.Node, tin: list[fx.Node], ins: list[Placement], n: int):
    """A rule of `passes.rules`' kind whose decision comes from DTensor's strategy for the op."""
    d = derive(node, tin, ins, n)
    return list(d.req), (list(d.out) if isinstance(d.out, tuple) else d.out)


# ----------------------------------------------------------------------------- schema

@functools.lru_cache(maxsize=None)
def _mesh(n: int):
    from torch.distributed._local_tensor import maybe_disable_local_tensor_mode
    from torch.distributed.device_mesh import DeviceMesh

    with maybe_disable_local_tensor_mode():
        return DeviceMesh("cpu", torch.arange(n), _init_backend=False, _rank=0)


def _freeze(a):
    if isinstance(a, (list, tuple)):
        return tuple(_freeze(x) for x in a)
    if isinstance(a, dict):
        return tuple(sorted((k, _freeze(v)) for k, v in a.items()))
    if isinstance(a, fx.Node):
        v = a.meta.get("val")
        if isinstance(v, torch.Tensor):
            return ("tensor", tuple(v.shape), v.dtype)
        return ("node", _freeze(v) if isinstance(v, (int, float, bool)) else str(v))
    if isinstance(a, float) and math.isnan(a):
        return "nan"
    try:
        hash(a)
        return a
    except TypeError:
        return repr(a)


def _contiguous(shape) -> tuple[int, ...]:
    strides, step = [], 1
    for size in reversed(shape):
        strides.append(step)
        step *= max(int(size), 1)
    return tuple(reversed(strides))


def _is_tensor_node(a) -> bool:
    return isinstance(a, fx.Node) and isinstance(a.meta.get("val"), torch.Tensor)


def _schema(node: fx.Node, ins: list[Placement], n: int):
    """The node as DTensor's dispatcher would see it, and the positions (among its tensor specs) of the specs
    that stand for python scalars (`SCALAR_AS_TENSOR`)."""
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor._dtensor_spec import DTensorSpec, TensorMeta
    from torch.distributed.tensor._op_schema import OpSchema, RuntimeSchemaInfo

    mesh = _mesh(n)
    it = iter(ins)

    def spec(a):
        if _is_tensor_node(a):
            v = a.meta["val"]
            return DTensorSpec(mesh, (next(it),), TensorMeta(v.shape, _contiguous(v.shape), v.dtype))
        if isinstance(a, fx.Node):
            return a.meta.get("val")
        return a

    target, scalar = ASKED_AS.get(node.target, (node.target, None))
    flat, tree = pytree.tree_flatten((_canonical_args(node), node.kwargs))
    flat = [spec(a) for a in flat]
    args, kwargs = pytree.tree_unflatten(flat, tree)
    fake = None
    if scalar is not None:  # the python scalar as the 0-d replicated tensor the composite op makes of it
        fake = DTensorSpec(mesh, (R,), TensorMeta(torch.Size([]), (), node.meta["val"].dtype))
        args = args[:scalar] + (fake,) + args[scalar + 1:]
    # as DTensor's dispatcher does: the op's runtime schema info, with pytree flattening where a list
    # argument holds tensors (cat, stack), so that DTensor sees the specs inside the list
    prop = DTensor._op_dispatcher.sharding_propagator
    info = prop.op_to_schema_info.get(target) or prop.op_to_schema_info_for_single_dim_strategy.get(target)
    if any(isinstance(a, (list, tuple)) and any(_is_tensor_node(x) for x in a) for a in node.args):
        info = dataclasses.replace(info, needs_pytree=True) if info is not None else RuntimeSchemaInfo(needs_pytree=True)
    schema = OpSchema(target, tuple(args), dict(kwargs), schema_info=info)
    return schema, [i for i, x in enumerate(_specs_of(schema)) if x is fake]


# Ops asked as another spelling of the same computation: (op asked, position of a python scalar asked as the 0-d
# replicated tensor of the output's dtype that the composite op makes of it, or None).
# - reshape as view: DTensor's reshape strategy does not turn a merge of an inner shard ((b, heads, s, d) ->
#   (b*heads, s, d) with heads sharded: Bloom) into a `_StridedShard` (a reshape may copy), its view strategy does;
#   the lowering's local reshape is the same for both;
# - `where(c, x, 0.0)`: DTensor has no strategy for the scalar overloads, the composite op is `where.self`.
ASKED_AS = {aten.reshape.default: (aten.view.default, None), aten.where.ScalarOther: (aten.where.self, 2),
            aten.where.ScalarSelf: (aten.where.self, 1)}
# Ops through which a partial input stays partial (a sum of partials): every other op gets its partial inputs
# reduced first (asked with them replicated), the lowering sharing one reduction per value among its consumers.
PARTIAL_SUMS = {aten.add.Tensor, aten.sub.Tensor, aten.add_.Tensor, aten.sub_.Tensor}


# DTensor's scan strategy (cumsum, cumprod, logcumsumexp) compares the scanned dim with shard dims without
# normalising it: `cumsum(x, -1)` with x sharded on its last dim would stay sharded, each rank scanning its
# own shard (torch 2.13, _ops/_math_ops.py scan_strategy). Asking with the dim normalised avoids it.
DIM_ARG = {aten.cumsum.default: 1, aten.cumprod.default: 1, aten.logcumsumexp.default: 1}


def _canonical_args(node: fx.Node) -> tuple:
    i = DIM_ARG.get(node.target)
    args = tuple(node.args)
    if i is None or len(args) <= i or not isinstance(args[i], int) or args[i] >= 0:
        return args
    nd = node.args[0].meta["val"].dim()
    return args[:i] + (args[i] + nd,) + args[i + 1:]


def _specs_of(schema) -> list:
    """The DTensorSpecs of a schema in the order of the node's tensor inputs (args, then kwargs)."""
    from torch.distributed.tensor._dtensor_spec import DTensorSpec

    flat, _ = pytree.tree_flatten((tuple(schema.args_schema), dict(schema.kwargs_schema)))
    return [a for a in flat if isinstance(a, DTensorSpec)]


# ----------------------------------------------------------------------------- derivation

def derive(node: fx.Node, tin: list[fx.Node], ins: list[Placement], n: int) -> Derived:
    key = (node.target, tuple(ins), n, _freeze(node.args), _freeze(node.kwargs))
    hit = _CACHE.get(key)
    if hit is None:
        hit = _CACHE[key] = _derive(node, tin, ins, n)
    return hit


_CACHE: dict[tuple, Derived] = {}


def _n_outputs(node: fx.Node) -> int | None:
    v = node.meta.get("val")
    return len(v) if isinstance(v, (list, tuple)) else None


def _replicated(node, ins, reason: str, dtensor: str = "") -> Derived:
    k = _n_outputs(node)
    return Derived((R,) * len(ins), (R,) * k if k is not None else R, reason, dtensor)


def _divides(v: torch.Tensor, p: Placement, n: int) -> bool:
    if not isinstance(p, (Shard, _StridedShard)):
        return True
    k = p.split_factor if isinstance(p, _StridedShard) else 1
    return p.dim < v.dim() and v.shape[p.dim] % (n * k) == 0


def _show(pls) -> str:
    return ",".join(fmt(p) if isinstance(p, (Shard, Replicate, _StridedShard)) or type(p) is Partial
                    else str(p) for p in pls)


def _derive(node: fx.Node, tin: list[fx.Node], ins: list[Placement], n: int) -> Derived:
    from torch.distributed._local_tensor import maybe_disable_local_tensor_mode
    from torch.distributed.tensor import DTensor

    if not tin:
        return _replicated(node, ins, "no tensor inputs: nothing to shard")
    denied = DENY.get(node.target)
    if denied:
        return _replicated(node, ins, f"DTensor's answer is wrong here: {denied}")
    if any(isinstance(p, Partial) for p in ins) and not (
            node.target in PARTIAL_SUMS and len(tin) == 2 and all(isinstance(p, Partial) for p in ins)):
        d = derive(node, tin, [R if isinstance(p, Partial) else p for p in ins], n)
        return dataclasses.replace(d, reason=d.reason or "partial inputs reduced first")
    prop = DTensor._op_dispatcher.sharding_propagator
    try:
        with maybe_disable_local_tensor_mode():
            schema, scalars = _schema(node, ins, n)
            out = prop.propagate_op_sharding_non_cached(schema)
    except Exception as e:  # noqa: BLE001  (no strategy, or DTensor failed: replicate, say why)
        return _replicated(node, ins, f"DTensor has no answer: {type(e).__name__}: {str(e).splitlines()[0][:160]}")
    specs = _specs_of(out.redistribute_schema) if out.redistribute_schema is not None else None
    want = [s.placements[0] for i, s in enumerate(specs) if i not in scalars] if specs is not None else list(ins)
    outs = out.output_spec
    multi = isinstance(outs, (list, tuple))
    out_pls = [s.placements[0] if s is not None else R for s in (outs if multi else [outs])] if outs is not None \
        else [R]
    shown = f"{_show(ins)} -> req {_show(want)} -> out {_show(out_pls)}"
    if len(want) != len(ins):
        return _replicated(node, ins, f"DTensor's answer names {len(want)} inputs, the node has {len(ins)}", shown)
    if out.redistribute_schema is not None and getattr(out, "use_val_from_redistribute_schema", False) \
            and node.target not in LOCALISED_SHAPE_ARGS:
        return _replicated(node, ins, "DTensor rewrites shape arguments to local sizes; the lowering does not "
                                      "for this op", shown)
    req: list[Placement] = []
    for t, have, p in zip(tin, ins, want):
        if isinstance(p, _MaskPartial) and node.target is aten.embedding.default:
            p = R  # the ids of a vocab-parallel embedding: the lowering masks them itself
        elif isinstance(p, Partial):
            if not (type(p) is Partial and p.reduce_op == "sum"):
                return _replicated(node, ins, f"requires input placement {p}: the lowering sums partials only",
                                   shown)
            if not isinstance(have, Partial):
                return _replicated(node, ins, f"requires {fmt(have)} -> P: no collective of the lowering "
                                              "makes a value partial", shown)
        if not _divides(t.meta["val"], p, n):
            return _replicated(node, ins, f"requires {fmt(p)} of a dim that does not divide over {n}", shown)
        req.append(p)
    vals = node.meta.get("val")
    vals = list(vals) if multi and isinstance(vals, (list, tuple)) else [vals]
    if len(vals) != len(out_pls):
        return _replicated(node, ins, f"DTensor names {len(out_pls)} outputs, the node has {len(vals)}", shown)
    result: list[Placement] = []
    for p, v in zip(out_pls, vals):
        if isinstance(p, _MaskPartial):
            if node.target is aten.embedding.default and isinstance(req[0], Shard) and req[0].dim == 0:
                p = P  # realised by vocab_parallel_embedding
            else:
                return _replicated(node, ins, f"output {p}: a masked partial the lowering has no form for", shown)
        elif isinstance(p, Partial) and not (type(p) is Partial and p.reduce_op == "sum"):
            if node.target in MEAN_OPS and type(p) is Partial and p.reduce_op == "avg" \
                    and isinstance(req[0], (Shard, _StridedShard)):
                p = P  # the lowering's sum_div: local sum / global count
            else:
                return _replicated(node, ins, f"output {p}: the lowering sums partials only", shown)
        if isinstance(v, torch.Tensor) and not _divides(v, p, n):
            return _replicated(node, ins, f"output {fmt(p)} of a dim that does not divide over {n}", shown)
        result.append(p)
    conflict = LOCAL_FORM_CONFLICTS.get(node.target)
    why = conflict(node, req, result) if conflict is not None else None
    if why:
        return _replicated(node, ins, why, shown)
    translated = tuple(result) != tuple(out_pls) or tuple(req) != tuple(want)
    return Derived(tuple(req), tuple(result) if multi else result[0],
                   "translated to the lowering's local form" if translated else None, shown)


def registered(op) -> str:
    """How DTensor knows the op: "strategy" (registered), "decomposition" (derived by tracing its
    decomposition), or "none"."""
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor._decompositions import DecompShardingStrategy

    prop = DTensor._op_dispatcher.sharding_propagator
    if op in prop.op_strategy_funcs or op in prop.op_single_dim_strategy_funcs or op in prop.op_to_rules:
        return "strategy"
    if isinstance(op, torch._ops.OpOverload) and DecompShardingStrategy.has_decomp(op):
        return "decomposition"
    return "none"


def _returns_tensors(op) -> bool:
    rets = op._schema.returns
    return bool(rets) and all(str(r.type) in ("Tensor", "List[Tensor]", "Tensor[]") for r in rets)


def candidate_ops() -> list:
    """The ops of DTensor's strategy registry a captured forward graph can hold, in a stable order: functional or
    in-place overloads (no `out=` variants), returning tensors; not the optimizer's `_foreach_*`, `_fused_adam*`,
    `_fused_sgd*` ops,
    not backward ops (autograd derives the backward of the forward ops), not random ops (the lowering has its own
    per-shard streams for dropout; DTensor's random ops need its RNG tracker). These are the ops whose DTensor
    answer the rule check (`tests/rule_sweep.py`) is asked to check; those it passes are `passes.checked_ops`."""
    from torch.distributed.tensor import DTensor

    prop = DTensor._op_dispatcher.sharding_propagator
    ops = set(prop.op_strategy_funcs) | set(prop.op_single_dim_strategy_funcs) | set(prop.op_to_rules)
    keep = []
    for op in ops:
        if not isinstance(op, torch._ops.OpOverload) or op.namespace != "aten":  # prims: not in captured graphs
            continue
        name, s = op.name(), op._schema
        if "out" in op._overloadname or any(a.is_out for a in s.arguments):
            continue
        if any(k in name for k in ("_foreach_", "_fused_adam", "_fused_sgd", "_amp_", "backward")):
            continue
        if torch.Tag.nondeterministic_seeded in op.tags or not _returns_tensors(op):
            continue
        keep.append(op)
    return sorted(keep, key=str)
