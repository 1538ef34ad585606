"""Lowering: propagate placements through the graph and emit the local SPMD program.

Contract (what `lower_pass` guarantees for the rewritten graph):
- Placeholders: parameters and buffers arrive as local shards with the placements the plan gave
  them; user inputs arrive global (the same on every rank), or as `ctx.arrivals` says (inputs="local": the
  batch already split over the data axes), and are sliced in the graph by `split` nodes to the plan's input
  placements (e.g. the batch over data-parallel axes).
- Every node gets `meta[PLACEMENTS]` (one placement per mesh axis) from its op's rule
  (`passes.rules`). Where an input's placement differs from what the rule requires, one explicit
  collective node per mesh axis is inserted (`autopar.runtime.collectives`, each a fixed
  forward/backward pair); where the rule consumes an `R` input into a sharded or partial output,
  the input is wrapped in `grad_all_reduce` (its gradient is partial). An all-gather followed by
  `grad_all_reduce` is fused into `all_gather_rs` (backward reduce-scatter); linears consuming such a gathered
  activation become one `regather_linears` node with it, which saves the shard and all-gathers it again in
  backward, and linears consuming an activation's `grad_all_reduce` one `grad_all_reduce_linears` node: both
  overlap the input gradient's reduction with the weight gradients (Megatron's async communication).
- Shape literals are rewritten to local shapes (`view(b, s, heads, d)` -> `view(b, s, heads/t, d)`)
  and ops whose sharded form differs are replaced by their parallel form
  (`autopar.runtime.ops`: vocab-parallel embedding and cross-entropy, global-count means, GQA).
- Every graph output is replicated (`R` on every axis): `pm(*inputs)` returns on every rank what
  the model returns (unless `ctx.keep_outputs`: a pipeline stage's outputs keep their placements).
- `meta["val"]` keeps the *global* fake value; local shapes follow from it and the placements.
- Under a plan's mixed precision (`Plan.precision`, `autopar.precision`) the graph was captured with the parameters
  at param_dtype while they arrive in the master dtype: `mixed_precision_pass` casts them (inside their first
  collective, with reductions in reduce_dtype, or by one `_to_copy`).

The lowering is the ordered list of passes `LOWER`, run by `passes.pipeline.run_passes` (which lints
the graph after each and names the pass on failure). What it lowers to is read off the plan alone
(`lower_context`: parameter and input placements, and the forms' directives, keyed by graph names):
a saved plan lowers on its own, and a directive naming a node this graph lacks is an error. Ops whose
local program differs from the op on local shards are a registry (`passes.local_forms`, `@local_form(op)`),
like the sharding rules; an op registers once.
"""

from __future__ import annotations

import dataclasses
import math
import operator
from dataclasses import dataclass, field

import torch
from torch import fx
from torch.utils import _pytree as pytree

from autopar.captured import Captured
from autopar.mesh import MeshInfo
from autopar.plan import GATHER_KEEP, GATHER_PERSIST, AttentionMode, DirectiveKind, Plan
from autopar.runtime import collectives as C
from autopar.runtime import fsdp as F
from autopar.spec import (P, R, Partial, Placement, Replicate, Shard, _StridedShard, fmt, fmt_placements, is_owned,
                          is_shard, placement_from_str, with_dim)
from cost_model.analytical import send_bytes
from passes import meta as M
from passes.batch_local import (batch_local, batch_local_rule, gathered_why, gathers, on_batch_dims,
                                record_work_pass)
from passes.checkpoint import checkpoint_layers_pass, walk
from passes.local_forms import LOCAL_FORMS, local_shape
from passes.patterns import parameters_only, repeat_kv_source, tensor_bytes
from passes.rules import REPLICATED_ON_PURPOSE, arg, replicate_rule, rule_for, shape

aten = torch.ops.aten


@dataclass(frozen=True)
class CommInfo:
    """One inserted collective: what it moves forward and backward, on which axis, for which module."""

    fn: str
    forward: str
    backward: str
    axis: str
    axis_size: int
    bytes_forward: int
    bytes_backward: int
    module: str


@dataclass
class LowerContext:
    mesh: MeshInfo
    placements: dict[str, tuple[Placement, ...]]  # placeholder name -> placements
    user_inputs: set[str]
    rng_stream: str = "default"  # key of the dropout RNG stream (autopar.runtime.ops)
    gathers: dict = field(default_factory=dict)  # parameter placeholder -> axis indices it is gathered on (FSDP)
    keep_gathered: set = field(default_factory=set)  # FSDP parameter placeholders kept gathered for backward
    # ZeRO-2 parameter placeholders whose gathered copies persist between steps (`autopar.forms.zero`)
    persist_gathered: set = field(default_factory=set)
    hints: dict = field(default_factory=dict)  # node name (or "row:" + linear node name) -> {axis index: placement}
    # hinted node names whose hint holds only where no other axis already splits the hinted dim (`soft_spec`)
    soft_hints: set = field(default_factory=set)
    attention_modes: dict = field(default_factory=dict)  # sdpa node name -> {axis index: AttentionMode}
    zigzag_axes: tuple[int, ...] = ()  # context-parallel axes: shards there use the zigzag layout
    causal_masks: set = field(default_factory=set)  # sdpa node names whose mask is the causal mask (recognised)
    moe_axes: dict = field(default_factory=dict)  # moe_experts node name -> expert-parallel axis index
    # fused projection node name -> (axis index, [(taker node name, first feature, end feature, heads)]): `PARTS`
    parts: dict = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)
    arrivals: dict = field(default_factory=dict)  # user input placeholder -> placements it is passed in (else all R)
    # user input placeholders whose gradient flows back to the caller (a pipeline stage's received activations,
    # `autopar.pipeline_tp.TPStage`): differentiated as a parameter's value is, so an R input consumed into
    # sharded work is wrapped in `grad_all_reduce` (Megatron's f) and its gradient leaves whole, not partial
    grad_inputs: set = field(default_factory=set)
    # outputs leave as propagated, not replicated (a pipeline stage's rows and partial loss, `autopar.pipeline_ep`)
    keep_outputs: bool = False
    # per graph output, the placements it leaves in (a pipeline stage's activations in the next stage's boundary
    # placements, `autopar.pipeline_tp.boundary_placements`), redistributed to them; None: replicated
    output_placements: tuple | None = None
    precision: object = None  # `autopar.precision.Precision` of the plan, or None (`mixed_precision_pass`)
    # checkpointed layers: (module path, level, captured node names), outlined by `passes.checkpoint`
    checkpoint: list = field(default_factory=list)
    # linear node name -> (float8 recipe, its weight's placeholder) (`float8_linears_pass`)
    float8: dict = field(default_factory=dict)


def lower_context(plan: Plan, captured: Captured, info: MeshInfo, rng_stream: str = "default",
                  arrivals: dict | None = None) -> LowerContext:
    """Everything lowering needs, from the plan alone (its placements and directives). `arrivals`: user inputs
    each rank passes already split (inputs="local": the batch over the data axes), by placeholder."""
    if plan.graph and plan.graph != captured.fingerprint():
        raise ValueError(
            f"plan {plan.name!r} was made for another graph (fingerprint {plan.graph}, this model on these inputs "
            f"captures as {captured.fingerprint()}): a plan lowers only the model and input shapes it was made for. "
            "Fix: re-plan for this model and inputs (autopar.plan(...) or plan='auto').")
    fqn_pls = plan.param_placements()
    placements: dict[str, tuple] = {}
    for ph, fqn in captured.param_fqns.items():  # an owned expert is, in the graph, S(0) of the stacked experts
        placements[ph] = tuple(Shard(0) if is_owned(p) else p for p in fqn_pls[fqn])
    placements.update(plan.input_placements())
    by_name = {n.name: n for n in captured.gm.graph.nodes}
    nodes = set(by_name)
    by_fqn = {fqn: ph for ph, fqn in captured.param_fqns.items()}
    ctx = LowerContext(info, placements, set(captured.user_inputs), rng_stream=rng_stream,
                       arrivals=dict(arrivals or {}), precision=_plan_precision(plan, captured))
    zigzag = set()
    for d in plan.directives:
        ax = info.names.index(info.axis(d.axis).name)
        if d.kind is DirectiveKind.ZIGZAG:
            zigzag.add(ax)
            continue
        if d.kind is DirectiveKind.GATHER:
            if d.node not in by_fqn:
                raise ValueError(f"plan {plan.name!r} gathers parameter {d.node!r}, which this model does not have; "
                                 "re-plan for this model")
            ctx.gathers.setdefault(by_fqn[d.node], set()).add(ax)
            if d.value == GATHER_KEEP:
                ctx.keep_gathered.add(by_fqn[d.node])
            elif d.value == GATHER_PERSIST:
                ctx.persist_gathered.add(by_fqn[d.node])
            elif d.value:
                raise ValueError(f"plan {plan.name!r}: its gather directive for {d.node!r} has the value {d.value!r}; "
                                 f"expected '' (reshard after forward), {GATHER_KEEP!r} or {GATHER_PERSIST!r}. "
                                 "Fix: re-plan.")
            continue
        if d.kind is DirectiveKind.SHARD_STEP:  # the optimizer step's, not the program's (`autopar.module`)
            if d.node not in by_fqn:
                raise ValueError(f"plan {plan.name!r} shards the optimizer step of parameter {d.node!r}, which this "
                                 "model does not have; re-plan for this model")
            continue
        if d.node not in nodes:
            raise ValueError(f"plan {plan.name!r} has a {d.kind.value} directive for graph node {d.node!r}, which "
                             "this model's graph does not have: the plan was made for another model or input "
                             "shapes. Fix: re-plan for this model and inputs.")
        if d.kind is DirectiveKind.HINT:
            ctx.hints.setdefault(d.node, {})[ax] = _directive_value(plan, d, placement_from_str)
        elif d.kind is DirectiveKind.ROW_OUTPUT:
            ctx.hints.setdefault("row:" + d.node, {})[ax] = _directive_value(plan, d, placement_from_str)
        elif d.kind is DirectiveKind.ATTENTION:
            ctx.attention_modes.setdefault(d.node, {})[ax] = _directive_value(plan, d, AttentionMode)
        elif d.kind is DirectiveKind.CAUSAL_MASK:
            ctx.causal_masks.add(d.node)
        elif d.kind is DirectiveKind.EXPERTS:
            if str(by_name[d.node].target) != "autopar.moe_experts.default":
                raise ValueError(f"plan {plan.name!r} has an experts directive for graph node {d.node!r}, which is not "
                                 "a MoE experts node: the plan was made for another model or input shapes. Fix: "
                                 "re-plan for this model and inputs.")
            ctx.moe_axes[d.node] = ax
        elif d.kind is DirectiveKind.PARTS:
            blocks = _directive_value(plan, d, _parts)
            if any(name not in nodes for name, *_ in blocks):
                raise ValueError(f"plan {plan.name!r} takes the fused projection {d.node!r} apart at nodes "
                                 f"{[name for name, *_ in blocks]}, which this model's graph does not all have: the "
                                 "plan was made for another model or input shapes. Fix: re-plan for this model.")
            ctx.parts[d.node] = (ax, blocks)
    ctx.zigzag_axes = tuple(sorted(zigzag))
    ctx.checkpoint = _checkpointed_layers(plan, captured)
    ctx.float8 = _float8_nodes(plan, captured)
    kv_before_repeat_hints(ctx, by_name, info)
    return ctx


def _float8_nodes(plan: Plan, captured: Captured) -> dict[str, str]:
    """{linear node name: (recipe, weight placeholder)} for the plan's float8 linears (`Plan.float8`: by module
    path)."""
    from autopar.sites import module_path
    if not plan.float8:
        return {}
    linears = {}
    for n in captured.gm.graph.nodes:
        if n.op == "call_function" and n.target is aten.linear.default:
            linears.setdefault(module_path(n), (n.name, n.args[1].name))
    out = {}
    for path, recipe in plan.float8:
        if path not in linears:
            raise ValueError(f"plan {plan.name!r} runs {path!r} in float8 ({recipe}), but this model's graph has no "
                             "aten.linear at that module path: the plan was made for another model, or the layer "
                             "is not an nn.Linear (a Conv1D-style addmm is not run in fp8). Fix: re-plan")
        name, weight = linears[path]
        out[name] = (recipe, weight)
    return out


def float8_linears_pass(gm: fx.GraphModule, ctx: LowerContext) -> fx.GraphModule:
    """The plan's float8 linears (`ctx.float8`) -> `autopar.runtime.float8.float8_linear` on the same local operands,
    with the mesh axes that split its tokens (the data axes: its output's placements), its out features (a
    column-parallel weight, S(0)) and its in features (a row-parallel one, S(1)); FSDP's gathered weights are whole.
    Its amaxes are all-reduced there, so every rank scales as the single device does. A tensorwise linear's FSDP
    weight (`_fp8_gathered_weights`: one plain gather, out of the flat groups) is cast on its shard and gathered in fp8
    (`float8_linear_gathered`: torchao's fp8 all-gather, 1 byte per element) unless mixed precision casts it in the
    gather. The fusions of a
    column-parallel input's collective with its linears (`async_column_linears_pass`, `regather_linear_inputs_pass`)
    leave float8 linears out (their collective stays a node of its own)."""
    if not ctx.float8:
        return gm
    from autopar.runtime.float8 import float8_linear, float8_linear_gathered
    info = ctx.mesh
    found = set()
    graph = gm.graph
    fp8 = _fp8_gathered_weights(gm, ctx)
    for n in list(gm.graph.nodes):
        if n.name not in ctx.float8 or n.op != "call_function" or n.target is not aten.linear.default:
            continue
        x, w = n.args[0], n.args[1]
        bias = n.args[2] if len(n.args) > 2 else None
        recipe, weight = ctx.float8[n.name]
        k_axes, n_axes = [], []
        for i, pw in enumerate(ctx.placements[weight]):  # nn.Linear's weight is (N, K)
            if isinstance(pw, Replicate) or i in ctx.gathers.get(weight, ()) or info.sizes[i] == 1:
                continue  # whole on this rank (FSDP gathers it)
            if not isinstance(pw, Shard) or pw.dim not in (0, 1):
                raise NotImplementedError(f"float8 linear {n.name!r}: its weight is {fmt(pw)} on mesh axis "
                                          f"{info.names[i]!r}; the fp8 runtime splits weights on their rows "
                                          "(column-parallel) or columns (row-parallel) only. Fix: float8=None")
            (n_axes if pw.dim == 0 else k_axes).append(info.axes[i].key)
        op = n.meta.get(M.PLACEMENTS)
        op = x.meta.get(M.PLACEMENTS) if op is None or isinstance(op, list) else op  # the tokens' split: the same
        if op is None or isinstance(op, list):
            raise NotImplementedError(f"float8 linear {n.name!r}: its tokens' placements are not recorded; autopar "
                                      "cannot tell which ranks hold its other rows. Fix: float8=None")
        ndim = len(n.meta["val"].shape)
        m_axes = tuple(info.axes[i].key for i, po in enumerate(op)
                       if isinstance(po, Shard) and po.dim % ndim != ndim - 1 and info.sizes[i] > 1)
        mp = w.args[4] if w.op == "call_function" and len(w.args) > 4 else None
        if w.op == "call_function" and w.target is C.all_gather_rs and isinstance(w.args[0], fx.Node) \
                and w.args[0].name in fp8 and mp is None:  # FSDP's gather in fp8, 1 byte
            shard, g_dim, g_axis = w.args[0], w.args[1], w.args[2]
            n.target, n.kwargs = float8_linear_gathered, {}
            keep = shard.name in ctx.keep_gathered or shard.name in ctx.persist_gathered or not _in_layer(gm, n)
            n.args = (x, shard, bias, g_axis, g_dim, m_axes, tuple(k_axes), tuple(n_axes), keep)
            graph.erase_node(w)
        else:
            n.target, n.kwargs = float8_linear, {}
            n.args = (x, w, bias, recipe, m_axes, tuple(k_axes), tuple(n_axes))
        found.add(n.name)
    missing = sorted(set(ctx.float8) - found)
    assert not missing, f"float8 linears {missing} were rewritten by an earlier pass"
    gm.recompile()
    return gm


def kv_before_repeat_hints(ctx: LowerContext, by_name: dict, info: MeshInfo) -> None:
    """Ulysses on K/V expanded by `repeat_kv` (`passes.patterns.repeat_kv_source`): where the KV heads divide over
    the axis, a hint sends the grouped K/V sequence -> heads, (b, kv, s/u, d) -> (b, kv/u, s, d), and the expansion
    runs on each rank's KV heads (its heads shard is the query heads' shard: local head i uses local KV head
    i // n), so the all-to-all moves kv/h of the expanded K/V's bytes."""
    for name, modes in ctx.attention_modes.items():
        node = by_name[name]
        if node.target is not torch.ops.aten.scaled_dot_product_attention.default:
            continue
        for ax, mode in modes.items():
            if mode is not AttentionMode.ALL_TO_ALL:
                continue
            grouped = [repeat_kv_source(node.args[i]) for i in (1, 2)]
            if any(x is None or x.meta["val"].shape[1] % info.sizes[ax] for x in grouped):
                continue
            for x in grouped:
                if x.name in ctx.hints and x.name not in ctx.soft_hints:
                    continue
                ctx.hints.setdefault(x.name, {})[ax] = Shard(1)
                ctx.soft_hints.add(x.name)  # heads split on another axis too (heads x ulysses): sent expanded


def soft_spec(spec: dict, placements: tuple) -> dict:
    """A soft hint's axes, less those whose shard dim another axis already splits in `placements` (the KV heads
    of `kv_before_repeat_hints`, split by a heads axis: the hint would nest a second split in them)."""
    return {ax: p for ax, p in spec.items()
            if not any(is_shard(q) and q.dim == p.dim for bx, q in enumerate(placements) if bx != ax)}


def _plan_precision(plan: Plan, captured: Captured):
    """The plan's mixed precision, which the capture must have been made under (its parameters at param_dtype)."""
    from autopar.precision import Precision
    precision = Precision.parse(plan.precision)
    if precision != captured.precision:
        raise ValueError(
            f"plan {plan.name!r} was made for mixed precision {plan.precision or 'none'}, but the program was captured "
            f"for {captured.precision.spec() if captured.precision else 'none'}. Fix: pass the plan's mp_policy "
            "(autopar.parallelize(..., mp_policy=...)), or re-plan for this one.")
    return precision


def _checkpointed_layers(plan: Plan, captured: Captured) -> list:
    """(path, level, node names) of every layer the plan checkpoints; a layer this graph lacks is an error."""
    from autopar.forms import checkpoint as ckpt
    from autopar.layers import find_layers
    wanted = {path: ckpt.level(name, f"plan {plan.name!r}: checkpoint level of layer {path!r}")
              for path, name in plan.checkpoint}
    if not any(lv.recomputes for lv in wanted.values()):
        return []
    layers = {la.path: la for la in find_layers(captured.gm, set(captured.param_fqns) | set(captured.buffer_fqns))}
    missing = [p for p, lv in wanted.items() if lv.recomputes and p not in layers]
    if missing:
        raise ValueError(f"plan {plan.name!r} checkpoints layer {missing[0]!r}, which this model's graph does not "
                         f"have (layers: {', '.join(layers) or 'none'}): the plan was made for another model. Fix: "
                         "re-plan for this model and inputs.")
    return [(p, lv.name, layers[p].nodes) for p, lv in wanted.items() if lv.recomputes]


def _directive_value(plan: Plan, d, parse):
    """parse(d.value), or a ValueError naming the directive (a hand-edited or corrupted plan)."""
    try:
        return parse(d.value)
    except (ValueError, TypeError, IndexError) as e:
        raise ValueError(f"plan {plan.name!r}: its {d.kind.value} directive for {d.node!r} on axis {d.axis!r} has "
                         f"the value {d.value!r}, which lowering cannot use: {e}. Fix: re-plan for this model and "
                         "inputs (autopar.plan(...)).") from None


def _parts(value: str) -> list[tuple]:
    """`taker:first:end:heads,...` -> [(taker, first, end, heads)] (`DirectiveKind.PARTS`)."""
    blocks = [b.split(":") for b in value.split(",")]
    if any(len(b) != 4 for b in blocks):
        raise ValueError("expected blocks 'taker:first:end:heads' separated by commas")
    return [(name, int(first), int(end), int(heads)) for name, first, end, heads in blocks]


def module_path(node: fx.Node) -> str:
    stack = node.meta.get("nn_module_stack")
    if not stack:
        return ""
    return list(stack.values())[-1][0]


def _is_tensor_node(a) -> bool:
    return isinstance(a, fx.Node) and isinstance(a.meta.get("val"), torch.Tensor)


def _writes_into_a_view(node: fx.Node) -> bool:
    """An in-place op (`copy_`, `fill_`, `add_`...) whose destination is a view of another value (a slice of a
    buffer): its write is seen through the viewed value, so the destination cannot be redistributed."""
    schema = getattr(node.target, "_schema", None)
    if schema is None or not schema.arguments or schema.arguments[0].alias_info is None \
            or not schema.arguments[0].alias_info.is_write:
        return False
    dst = node.args[0]
    if isinstance(dst, fx.Node) and dst.target is operator.getitem:
        dst = dst.args[0]
    view = getattr(getattr(dst, "target", None), "_schema", None)
    return view is not None and bool(view.returns) and view.returns[0].alias_info is not None


def _local_numel(node: fx.Node, pls, sizes) -> int:
    shp = list(shape(node))
    numel = math.prod(shp)
    for p, n in zip(pls, sizes):
        if is_shard(p):
            numel //= n
    return numel


def _comm_elems(fn, m: int, p: int) -> tuple[float, float]:
    """Elements each rank sends (forward, backward) for collective fn on a local input of m elements
    (`cost_model.analytical.send_bytes`, the one formula the estimate and the runtime recorder use too)."""
    ar, gather, scatter = send_bytes("all_reduce", m, p), send_bytes("all_gather", m * p, p), \
        send_bytes("reduce_scatter", m, p)
    return {C.all_reduce: (ar, 0), C.grad_all_reduce: (0, ar), C.all_gather: (gather, 0),
            C.all_gather_rs: (gather, gather), C.split: (0, send_bytes("all_gather", m, p)),
            C.reduce_scatter: (scatter, send_bytes("all_gather", m, p)),
            C.all_to_all: (send_bytes("all_to_all", m, p),) * 2}[fn]


class _Lowerer:
    def __init__(self, gm: fx.GraphModule, ctx: LowerContext):
        self.gm, self.graph, self.ctx = gm, gm.graph, ctx
        self.axes = tuple(dataclasses.replace(a, zigzag=True) if i in ctx.zigzag_axes else a
                          for i, a in enumerate(ctx.mesh.axes))
        self.sizes = ctx.mesh.sizes
        self.all_r = (R,) * len(self.axes)
        # the sequence axes (ring, Ulysses): the tokens are split there first (the inputs), so a dim nested over
        # one of them and another axis (sequence-parallel norms on a model axis) holds the sequence shard's split
        seq_axes = set(ctx.zigzag_axes) | {ax for modes in ctx.attention_modes.values() for ax in modes}
        self.nesting = sorted(range(len(self.axes)), key=lambda ax: (ax not in seq_axes, ax))  # outer first
        self.pl: dict[fx.Node, object] = {}
        self.cache: dict[tuple, fx.Node] = {}
        self._dropout_count = 0
        # the data axes: where some user input is split on its batch dim (`autopar.inputs.data_axes`)
        self.data_axes = {ax for name, pls in {**ctx.placements, **ctx.arrivals}.items() if name in ctx.user_inputs
                          and isinstance(pls, tuple) for ax, p in enumerate(pls) if p == Shard(0)}

    # ------------------------------------------------------------------ collectives
    def _emit(self, fn, x: fx.Node, args: tuple, new_pls: tuple, before: fx.Node, ax: int) -> fx.Node:
        numel = _local_numel(x, self.pl[x], self.sizes)
        with self.graph.inserting_before(before):
            node = self.graph.call_function(fn, (x,) + args)
        node.meta["val"] = x.meta["val"]
        node.meta[M.PLACEMENTS] = new_pls
        node.meta["nn_module_stack"] = before.meta.get("nn_module_stack", {})
        if x in self.needs_grad:
            self.needs_grad.add(node)
        fwd, bwd = C.COLLECTIVES[fn]
        p = self.sizes[ax]
        fwd_elems, bwd_elems = _comm_elems(fn, numel, p)
        if x not in self.needs_grad:  # no gradient flows back through it: its backward never runs
            bwd, bwd_elems = "-", 0
        itemsize = x.meta["val"].element_size()
        # a reduction belongs to the module that produced the partial sums, the rest to the consumer
        module = self._partial_origin(self._origin, ax) if fn in (C.all_reduce, C.reduce_scatter) else None
        node.meta[M.COMM] = CommInfo(fn.__name__, fwd, bwd, self.axes[ax].name, p, round(fwd_elems * itemsize),
                                     round(bwd_elems * itemsize), module if module is not None else module_path(before))
        self.pl[node] = new_pls
        return node

    def _partial_origin(self, node: fx.Node, ax: int) -> str:
        """The module that produced a partial value; for a sum of partials (x + y), the first addend's."""
        seen = 0
        while not module_path(node) and seen < 16:
            parts = [a for a in node.all_input_nodes if isinstance(self.pl.get(a), tuple)
                     and isinstance(self.pl[a][ax], Partial)]
            if not parts:
                return ""
            node, seen = parts[0], seen + 1
        return module_path(node)

    def redistribute(self, src: fx.Node, req: tuple, f_axes: tuple[int, ...], before: fx.Node) -> fx.Node:
        cur = self.pl[src]
        if tuple(cur) == tuple(req) and not f_axes:
            return src
        key = (src, tuple(req), f_axes)
        if key in self.cache:
            return self.cache[key]
        x = self._expand_split(src, req, before) or src
        pls = list(self.pl[x])
        self._origin = src
        # Nested shards of one dim (S(1) on two axes) were split outer axis first (`self.nesting`: sequence
        # axes, then the others in axis order): gather the inner axis first, then split outer first.
        unshard = [ax for ax in reversed(self.nesting) if is_shard(pls[ax]) and pls[ax] != req[ax]]
        rest = [ax for ax in self.nesting if ax not in unshard]
        for ax in unshard + rest:
            axis = self.axes[ax]
            c, r = pls[ax], req[ax]
            if c == r:
                if ax in f_axes:
                    x = self._emit(C.grad_all_reduce, x, (axis.key,), tuple(pls), before, ax)
                continue
            for fn, args, new in self._transition(c, r, ax in f_axes, axis.key):
                pls[ax] = new
                x = self._emit(fn, x, args, tuple(pls), before, ax)
        self.cache[key] = x
        return x

    def _expand_split(self, src: fx.Node, req: tuple, before: fx.Node) -> fx.Node | None:
        """A replicated `expand` wanted split on a dim it broadcasts (DeepSeek-V3's shared rope key, expanded over
        the heads, copied into heads-split keys): expanded on each rank to its shard's size, its input's gradient
        all-reduced backward (a sum over the ranks' shares of the broadcast dim), instead of a split whose
        backward all-gathers the whole expanded gradient. The new expand, placed as `req` on those axes, or None."""
        if src.op != "call_function" or src.target is not aten.expand.default:
            return None
        x, out_shape = src.args[0], shape(src)
        lead = len(out_shape) - len(shape(x))
        cur, xpl = self.pl[src], self.pl.get(x)
        if not isinstance(xpl, tuple):
            return None
        axes = [ax for ax, (c, r) in enumerate(zip(cur, req))
                if isinstance(c, Replicate) and isinstance(xpl[ax], Replicate) and is_shard(r)
                and not isinstance(r, _StridedShard) and (r.dim < lead or shape(x)[r.dim - lead] == 1)
                and out_shape[r.dim] > 1]
        if not axes:
            return None
        for ax in axes:
            if x in self.needs_grad:
                x = self._emit(C.grad_all_reduce, x, (self.axes[ax].key,), xpl, before, ax)
        new_pls = tuple(req[ax] if ax in axes else p for ax, p in enumerate(cur))
        with self.graph.inserting_before(before):
            node = self.graph.call_function(aten.expand.default, (x, local_shape(out_shape, new_pls, self.sizes)))
        node.meta.update({k: v for k, v in src.meta.items() if k in ("val", "nn_module_stack", "stack_trace")})
        node.meta[M.PLACEMENTS] = new_pls
        if x in self.needs_grad:
            self.needs_grad.add(node)
        self.pl[node] = new_pls
        return node

    def _transition(self, c: Placement, r: Placement, want_f: bool, axis):
        """The collectives taking one axis from placement c to r: [(fn, args after x, placement after)]."""
        sf = lambda p: p.split_factor if isinstance(p, _StridedShard) else 1  # noqa: E731
        if isinstance(c, Partial) and isinstance(r, Replicate):
            steps = [(C.all_reduce, (axis,), R)]
            return steps + ([(C.grad_all_reduce, (axis,), R)] if want_f else [])
        if isinstance(c, Partial) and is_shard(r):
            return [(C.reduce_scatter, (r.dim, axis, sf(r)), r)]
        if is_shard(c) and isinstance(r, Replicate):
            return [((C.all_gather_rs if want_f else C.all_gather), (c.dim, axis, sf(c)), R)]
        if isinstance(c, Replicate) and is_shard(r):
            return [(C.split, (r.dim, axis, sf(r)), r)]
        if is_shard(c) and is_shard(r):
            if sf(c) == 1 and sf(r) == 1:
                return [(C.all_to_all, (r.dim, c.dim, axis), r)]
            return [(C.all_gather, (c.dim, axis, sf(c)), R), (C.split, (r.dim, axis, sf(r)), r)]
        raise AssertionError(f"no collective turns {c} into {r}")

    # ------------------------------------------------------------------ nodes
    def run(self) -> None:
        g = self.graph
        self.needs_grad = self._needs_grad()
        for node in list(g.nodes):
            if node.op == "placeholder":
                self._placeholder(node)
            elif node.op == "call_function":
                self._call(node)
            elif node.op == "output":
                self._output(node)

    def _needs_grad(self) -> set[fx.Node]:
        return _depends_on_parameters(self.graph, self.ctx)

    def _placeholder(self, node: fx.Node) -> None:
        want = self.ctx.placements.get(node.name, self.all_r)
        if node.name not in self.ctx.user_inputs:
            self.pl[node] = tuple(want)
            gather = sorted(self.ctx.gathers.get(node.name, ()))
            if gather and node.users:
                # FSDP: all-gather the parameter forward; its gradient is reduce-scattered backward
                req = tuple(R if ax in gather else p for ax, p in enumerate(want))
                users = list(node.users)
                first = next(n for n in self.graph.nodes if n.op != "placeholder")
                full = self.redistribute(node, req, (), first)
                for u in users:
                    u.replace_input_with(node, full)
            return
        self.pl[node] = tuple(self.ctx.arrivals.get(node.name, self.all_r))
        if tuple(want) != self.pl[node] and _is_tensor_node(node):
            users = list(node.users)
            first = next(n for n in self.graph.nodes if n.op != "placeholder")
            sliced = self.redistribute(node, tuple(want), (), first)
            for u in users:
                u.replace_input_with(node, sliced)

    def _tensor_inputs(self, node: fx.Node) -> list[fx.Node]:
        flat, _ = pytree.tree_flatten((node.args, node.kwargs))
        return [a for a in flat if _is_tensor_node(a)]

    def _call(self, node: fx.Node) -> None:
        if node.target is operator.getitem:
            parent = self.pl.get(node.args[0])
            if isinstance(parent, list):
                self.pl[node] = parent[node.args[1]]
            elif parent is not None:
                self.pl[node] = parent
            return
        tin = self._tensor_inputs(node)
        val = node.meta.get("val")
        multi = isinstance(val, (list, tuple))
        if not tin and not isinstance(val, torch.Tensor) and not multi:
            return
        rule = rule_for(node.target)
        if node.target is placement_hint:
            spec = node.meta["autopar_hint"]
            if node.meta.get("autopar_soft_hint"):
                spec = soft_spec(spec, self.pl[tin[0]])
            rule = lambda node, tin, ins, n, ax: ([spec.get(ax, ins[0])], spec.get(ax, ins[0]))  # noqa: E731
            rule.wants_axis = True
        elif node.name in self.ctx.attention_modes:
            rule = _ulysses_rule(self.ctx.attention_modes[node.name])
        elif node.name in self.ctx.moe_axes:
            rule = _moe_rule(self.ctx.moe_axes[node.name])
        elif getattr(node.target, "__name__", "") == "local_expert_stack":
            rule = _local_stack_rule
        # a rule capture found gathering the batch (`passes.batch_local.rule_gathers_batch`): on an axis where it
        # would gather an input split on its batch dim, a batch-local node runs on the local shard instead
        rows_checked = rule is not None and rule is rule_for(node.target) and M.ROWS in node.meta
        if rule is None:  # batch-local (capture found its rows independent: `passes.batch_local`), else replicated
            rule = batch_local_rule if batch_local(node) is not None else replicate_rule
            gathered = [ax for ax in range(len(self.axes)) if any(is_shard(self.pl[t][ax]) for t in tin) and (
                rule is replicate_rule or not on_batch_dims(node.meta[M.ROWS], [self.pl[t][ax] for t in tin]))]
            if gathered:
                node.meta[M.GATHERED] = (str(node.target), tuple(self.axes[ax].name for ax in gathered))
            if (gathered or (rule is replicate_rule and any(p != R for t in tin for p in self.pl[t]))) and \
                    (node.target not in REPLICATED_ON_PURPOSE or batch_local(node) is not None):
                node.meta[M.REPLICATED] = gathered_why(node)
                self.ctx.notes.append(f"replicated {node.name} ({node.target}) in {module_path(node) or '<top>'}: "
                                      f"{node.meta[M.REPLICATED]}, its sharded inputs are gathered")
        n_out = len(val) if multi else 1
        reqs = [[None] * len(self.axes) for _ in tin]
        outs = [[None] * len(self.axes) for _ in range(n_out)]
        decisions = []
        for ax, size in enumerate(self.sizes):
            in_p = [self.pl[t][ax] for t in tin]
            req, out = rule(node, tin, in_p, size, ax) if getattr(rule, "wants_axis", False) else \
                rule(node, tin, in_p, size)
            if node.target in _VIEWS and tin:
                req, out = self._unflatten_strided(node, tin, in_p, ax, rule) or (req, out)
            decisions.append((req, out))
        ruled_gathered = self._batch_local_over_rule(node, tin, decisions) if rows_checked else []
        for ax, (req, out) in enumerate(decisions):
            for i, p in enumerate(req):
                reqs[i][ax] = p
            out_list = out if isinstance(out, list) else [out]
            for j, p in enumerate(out_list):
                outs[j][ax] = p
        if ruled_gathered:  # the batch gathered on a data axis by a rule: said as for an op without one
            node.meta[M.GATHERED] = (str(node.target), tuple(self.axes[ax].name for ax in ruled_gathered))
            node.meta[M.REPLICATED] = gathered_why(node, ruled=True)
            self.ctx.notes.append(f"replicated {node.name} ({node.target}) in {module_path(node) or '<top>'}: "
                                  f"{node.meta[M.REPLICATED]}, its sharded inputs are gathered")
        if node.target in _VIEWS and tin:
            outs[0] = self._local_split_factors(tin[0], reqs[0], outs[0], node)
        outs_t = [tuple(o) for o in outs]
        if tin and tuple(reqs[0]) != tuple(self.pl[tin[0]]) and _writes_into_a_view(node):
            raise NotImplementedError(
                f"{node.name} ({node.target}) in {module_path(node) or '<top>'} writes in place into "
                f"{tin[0].name}, a view of another tensor, which its sharding rule needs as "
                f"{fmt_placements(reqs[0])} but is {fmt_placements(self.pl[tin[0]])} (mesh axes {self.ctx.mesh.names}): "
                "the write would land in a redistributed copy, not in the viewed tensor. Fix: keep that module "
                "replicated (plan overrides), or write the op out of place in the model.")
        # emit redistributions, one per tensor input position
        new_inputs = []
        for t, req in zip(tin, reqs):
            f_axes = tuple(ax for ax in range(len(self.axes))
                           if isinstance(req[ax], Replicate) and any(not isinstance(o[ax], Replicate) for o in outs_t)
                           and t in self.needs_grad)
            new_inputs.append(self.redistribute(t, tuple(req), f_axes, node))
        it = iter(new_inputs)
        flat, spec = pytree.tree_flatten((node.args, node.kwargs))
        flat = [next(it) if _is_tensor_node(a) else a for a in flat]
        node.args, node.kwargs = pytree.tree_unflatten(flat, spec)
        self.pl[node] = outs_t if multi else outs_t[0]
        node.meta[M.PLACEMENTS] = self.pl[node]
        self._localize(node, [tuple(r) for r in reqs], outs_t)

    def _batch_local_over_rule(self, node: fx.Node, tin, decisions: list) -> list[int]:
        """A node with a rule that capture found gathering the batch (`passes.batch_local.rule_gathers_batch`): on
        each axis where its rule gathers an input that arrives split on its batch dim, a batch-local node takes
        `batch_local_rule` instead (in `decisions`, in place), where the rule's decisions on the other axes hold
        no partial value: a shard there is the op on slices of its inputs, equal to the slice of its output (the
        rule), so its rows are those of the whole op's, independent (the check); a partial output is a sum of
        per-rank terms whose rows the check did not see. The data axes where the batch stays gathered."""
        def whole_values(req, out) -> bool:
            return not any(isinstance(p, Partial) for p in list(req) + (out if isinstance(out, list) else [out]))

        gathering = [ax for ax, (req, _) in enumerate(decisions) if gathers([self.pl[t][ax] for t in tin], req)]
        rows = batch_local(node)
        local = [ax for ax in gathering if rows is not None and on_batch_dims(rows, [self.pl[t][ax] for t in tin])]
        if local and all(whole_values(*decisions[ax]) for ax in range(len(decisions))
                         if ax not in gathering and self.sizes[ax] > 1):
            for ax in local:
                decisions[ax] = batch_local_rule(node, tin, [self.pl[t][ax] for t in tin], self.sizes[ax])
            gathering = [ax for ax in gathering if ax not in local]
        return [ax for ax in gathering if ax in self.data_axes]

    def _unflatten_strided(self, node: fx.Node, tin, in_p, ax: int, rule):
        """A strided shard's blocks are those of the local tensor: with its dim also sharded on other axes (the
        batch of `(b*heads, s, d)` on a data axis, the heads strided on the model axis), the view rule, which
        sees global shapes, must count the blocks of the global tensor to split it back to `(b, heads, s, d)`
        (with one local block, `split_factor=1`, it would read the shard as one of the outer dim). The (required
        input, plain-shard output) of that, or None."""
        p = in_p[0]
        others = math.prod(self.sizes[bx] for bx, q in enumerate(self.pl[tin[0]])
                           if bx != ax and is_shard(q) and q.dim == getattr(p, "dim", None))
        if not isinstance(p, _StridedShard) or others == 1:
            return None
        wide = _StridedShard(p.dim, split_factor=p.split_factor * others)
        req, out = rule(node, tin, [wide] + in_p[1:], self.sizes[ax])
        if req[0] != wide or not is_shard(out) or isinstance(out, _StridedShard):
            return None
        return [p] + list(req[1:]), out

    def _local_split_factors(self, src: fx.Node, in_pls, out_pls, node: fx.Node):
        """A merge `(b, s) -> b*s` with s sharded on one axis gives `_StridedShard(split_factor=blocks)`;
        the blocks are those of the *local* tensor, so outer dims sharded on other axes divide them."""
        from passes.rules import view_groups
        a, b = shape(src), shape(node)
        out = list(out_pls)
        for ax, p in enumerate(out_pls):
            if not isinstance(p, _StridedShard) or not is_shard(in_pls[ax]) or isinstance(in_pls[ax], _StridedShard):
                continue  # only a merge that turns a plain shard strided
            d = in_pls[ax].dim
            group = next((I for I, O in view_groups(a, b) if d in I), [])
            local_outer = 1
            for i in group:
                if i == d:
                    break
                others = math.prod(self.sizes[bx] for bx, q in enumerate(in_pls) if bx != ax and is_shard(q)
                                   and q.dim == i)
                local_outer *= a[i] // others
            if local_outer != p.split_factor:
                out[ax] = _StridedShard(p.dim, split_factor=local_outer)
        return out

    def _output(self, node: fx.Node) -> None:
        if self.ctx.keep_outputs:
            return
        flat, spec = pytree.tree_flatten(node.args)
        want = self.ctx.output_placements or (self.all_r,) * len(flat)
        assert len(want) == len(flat), (len(want), len(flat))
        flat = [self.redistribute(a, tuple(w), (), node) if _is_tensor_node(a) and a in self.pl else a
                for a, w in zip(flat, want)]
        node.args = pytree.tree_unflatten(flat, spec)

    def _sharded_axes(self, pls, dims=None):
        return [ax for ax, p in enumerate(pls) if is_shard(p) and (dims is None or p.dim in dims)]

    def _localize(self, node: fx.Node, reqs, outs) -> None:
        """Swap the op for its local program where that is not the op on local shards (`LOCAL_FORMS`)."""
        fn = LOCAL_FORMS.get(node.target)
        if fn is not None:
            fn(self, node, [tuple(r) for r in reqs], outs)


_VIEWS = {aten.view.default, aten.reshape.default, aten._unsafe_view.default, aten.flatten.using_ints}


def placement_hint(x: torch.Tensor, spec: dict) -> torch.Tensor:
    """Identity at run time; in the graph it marks where a value takes the placements in `spec`
    (mesh axis -> placement), e.g. the sequence-sharded residual stream of Megatron SP."""
    return x


def _ulysses_rule(modes: dict[int, AttentionMode]):
    """SDPA in Ulysses mode on the given axes: queries, keys and values sharded on heads (an all-to-all
    from the sequence shard), the output on heads (sent back to the sequence by a hint after it)."""
    from passes.rules import RULES as _R, shape as _shape

    def rule(node, tin, ins, n, ax):
        if ax not in modes:
            return _R[node.target](node, tin, ins, n)
        if modes[ax] is AttentionMode.RING:  # q, k, v stay on their (zigzag) sequence shards; K/V circulate
            return [Shard(2), Shard(2), Shard(2)] + [R] * (len(tin) - 3), Shard(2)
        kv_heads = _shape(tin[1])[1]
        kv = Shard(1) if kv_heads % n == 0 else R  # fewer KV heads than ranks: gathered, picked per rank
        req = [Shard(1), kv, kv] + [R] * (len(tin) - 3)
        return req, Shard(1)

    rule.wants_axis = True
    return rule


def _local_stack_rule(node, tin, ins, n):
    """Owned experts (S(0)-marked on their axis) stack into this rank's S(0) slice; elsewhere R."""
    if ins and all(is_shard(p) and p.dim == 0 for p in ins):
        return list(ins), Shard(0)
    return [R] * len(ins), R


def _moe_rule(ep: int):
    """MoE experts with experts sharded on mesh axis `ep` (S(0) of every stacked parameter): tokens
    sharded there are dispatched by all-to-all (output sharded like them); replicated tokens run on
    this rank's experts only (output Partial)."""
    from passes.rules import RULES as _R

    def rule(node, tin, ins, n, ax):
        if ax != ep:
            return _R[node.target](node, tin, ins, n)
        x = ins[0]
        experts = [Shard(0)] * (len(tin) - 3)
        if is_shard(x) and x.dim == 0:
            return [x, x, x] + experts, x
        return [R, R, R] + experts, P

    rule.wants_axis = True
    return rule


def fuse_gather_grad_reduce_pass(gm: fx.GraphModule, ctx: LowerContext) -> fx.GraphModule:
    """all_gather whose every user is grad_all_reduce on the same axis -> all_gather_rs (SP's g, FSDP).

    The gradient of the gathered value is then partial on every rank; reduce-scattering it moves
    half the bytes of all-reducing it and taking a chunk.
    """
    for g in list(gm.graph.nodes):
        if g.op != "call_function" or g.target is not C.all_gather:
            continue
        axis = g.args[2]
        users = list(g.users)
        if not users or any(u.target is not C.grad_all_reduce or u.args[1] != axis for u in users):
            continue
        g.target = C.all_gather_rs
        info = g.meta[M.COMM]
        g.meta[M.COMM] = CommInfo("all_gather_rs", "all_gather", "reduce_scatter", info.axis, info.axis_size,
                                  info.bytes_forward, info.bytes_forward, info.module)
        for u in users:
            u.replace_all_uses_with(g)
            gm.graph.erase_node(u)
    return gm


def group_fsdp_gathers_pass(gm: fx.GraphModule, ctx: LowerContext) -> fx.GraphModule:
    """FSDP parameters gathered per layer (`autopar.runtime.fsdp`): each FSDP parameter's chain of per-axis
    all-gathers (and the data-axis gradient all-reduces that `propagate_pass` put after a plain all-gather) is
    taken out; the parameters are grouped by the unit (`autopar.layers.fsdp_units`: a layer, or a recurrent module
    outside the layers, as FSDP2 users wrap them) whose nodes alone use them, the others
    by the layers they are used between (embeddings before the first, final norm and head after the last). Per
    group, in order of first use: one `fsdp_gather` right before the group's first use (one all-gather per data
    axis of a flat buffer of its shards, one reduce-scatter of its gradients backward), and the next group's
    `fsdp_prefetch` right after it, so that gather overlaps this group's compute. A layer's group keeps its gathered
    parameters for backward when every parameter's directive says so (`ctx.keep_gathered`), else re-gathers them
    there; groups outside the layers keep them (as FSDP2 does not reshard its root after forward). A parameter whose chain is not that plain shape (split blocks, a gradient not reduced on every gathered
    axis) keeps its own gathers."""
    from autopar.layers import fsdp_units
    graph = gm.graph
    keys = {i: a.key for i, a in enumerate(ctx.mesh.axes)}
    chains = []  # (placeholder, chain nodes, axis keys innermost first, dim)
    fp8 = _fp8_gathered_weights(gm, ctx)
    for ph in graph.find_nodes(op="placeholder"):
        if ph.name not in ctx.gathers or len(ph.users) != 1 or ph.name in fp8:
            continue
        nodes, x = [], ph
        while len(x.users) == 1:
            (u,) = x.users
            if u.op != "call_function" or u.target not in (C.all_gather, C.all_gather_rs) or u.args[0] is not x \
                    or u.args[3] != 1:
                break
            nodes.append(u)
            x = u
        axes = [n.args[2] for n in nodes]
        if not nodes or sorted(axes) != sorted(keys[i] for i in ctx.gathers[ph.name]) \
                or len({n.args[1] for n in nodes}) != 1:
            continue
        plain = [n.args[2] for n in nodes if n.target is C.all_gather]
        absorbed, full = [], nodes[-1]
        while plain:  # the gradient of a plain gather's value must be all-reduced on its axis by every user
            users = list(full.users)
            if not users or any(u.target is not C.grad_all_reduce or u.args[1] != users[0].args[1] for u in users) \
                    or users[0].args[1] not in plain:
                break
            plain.remove(users[0].args[1])
            absorbed += users
        if plain:
            continue
        for u in absorbed:
            u.replace_all_uses_with(full)
            graph.erase_node(u)
        chains.append((ph, nodes, tuple(axes), nodes[0].args[1]))
    grouped = {ph.name for ph, *_ in chains}
    for ph in graph.find_nodes(op="placeholder"):
        if ph.name in ctx.gathers and ph.name not in grouped and _fsdp_pad(ph, ctx) is not None:
            raise NotImplementedError(
                f"FSDP parameter placeholder {ph.name} {tuple(ph.meta['val'].shape)} is sharded unevenly over "
                f"{_fsdp_world(ph, ctx)} ranks, and its gathers are not the plain chain an FSDP group takes (its "
                "gradient is not reduced on every gathered axis, or it is split in blocks): only an FSDP group pads "
                "uneven shards. Fix: make the dim divide over the data ranks, or plan it replicated (plan='dp').")
    if not chains:
        return gm
    order = {n: i for i, n in enumerate(graph.nodes)}
    layers = fsdp_units(gm)  # the layers, and the recurrent modules outside them
    layer_of = {name: i for i, layer in enumerate(layers) for name in layer.nodes}
    starts = [min(order[n] for n in graph.nodes if n.name in set(layer.nodes)) for layer in layers]
    groups: dict[tuple, list] = {}
    for ph, nodes, axes, dim in chains:
        full = nodes[-1]
        first = min(full.users, key=order.__getitem__)
        owners = {layer_of.get(u.name) for u in full.users}
        if len(owners) == 1 and None not in owners:
            label = layers[owners.pop()].path
        else:
            k = sum(s <= order[first] for s in starts)
            label = ("(model)" if not layers else f"(before {layers[0].path})" if k == 0 else
                     f"(after {layers[k - 1].path})")
        key = (label, axes, ph.meta["val"].dtype)
        groups.setdefault(key, []).append((ph, nodes, dim, first))
    ordered = sorted(groups.items(), key=lambda kv: min(order[f] for *_, f in kv[1]))
    previous = None
    for (label, axes, _), members in ordered:
        first = min((f for *_, f in members), key=order.__getitem__)
        # outside the layers (embeddings, final norm, head: FSDP2's root) kept, as FSDP2 keeps its root: the head's
        # weights are used last in forward and first in backward
        # ZeRO-2: a group every one of whose parameters persists is gathered once per change of its shards and kept
        persist = all(ph.name in ctx.persist_gathered for ph, *_ in members)
        keep = persist or label.startswith("(") or all(ph.name in ctx.keep_gathered for ph, *_ in members)
        fulls = [nodes[-1] for _, nodes, _, _ in members]
        shards = tuple(ph for ph, *_ in members)
        extra = {"persist": True} if persist else {}
        pads = tuple(_fsdp_pad(ph, ctx) for ph, *_ in members)
        if any(p is not None for p in pads):  # uneven shards: padded to the longest in the collectives
            extra["pad"] = pads
        with graph.inserting_before(first):
            gather = graph.call_function(F.fsdp_gather, (shards, None, axes, tuple(d for _, _, d, _ in members), label,
                                                         keep), extra)
        gather.meta["val"] = tuple(f.meta["val"] for f in fulls)
        gather.meta[M.PLACEMENTS] = [f.meta[M.PLACEMENTS] for f in fulls]
        gather.meta["nn_module_stack"] = first.meta.get("nn_module_stack", {})
        gather.meta[M.COMM] = _group_comm(fulls, axes, keep, label, ctx.mesh.sizes, pads)
        cursor = gather
        for i, f in enumerate(fulls):
            with graph.inserting_after(cursor):
                item = graph.call_function(operator.getitem, (gather, i))
            item.meta.update({k: v for k, v in f.meta.items() if k != M.COMM})
            cursor = item
            f.replace_all_uses_with(item)
        for _, nodes, _, _ in members:
            for n in reversed(nodes):
                graph.erase_node(n)
        if previous is not None:  # issued right after the previous group's gather, before that group's compute
            with graph.inserting_after(previous):
                pending = graph.call_function(F.fsdp_prefetch, (shards, axes), dict(gather.kwargs))
            pending.meta["nn_module_stack"] = gather.meta["nn_module_stack"]
            gather.args = (shards, pending, *gather.args[2:])
        previous = cursor
    return gm


def _fsdp_world(ph: fx.Node, ctx) -> int:
    return math.prod(ctx.mesh.axes[ax].size for ax in ctx.gathers[ph.name])


def _fsdp_pad(ph: fx.Node, ctx) -> tuple[int, int] | None:
    """(dim, full length) of an FSDP parameter sharded unevenly over its data axes (`autopar.forms.fsdp.shard_dim`);
    None where its dim divides."""
    pls = ctx.placements.get(ph.name, ())
    dims = {p.dim for ax, p in enumerate(pls) if ax in ctx.gathers[ph.name] and is_shard(p)}
    if len(dims) != 1:
        return None
    (d,) = dims
    length = int(ph.meta["val"].shape[d])
    return (d, length) if length % _fsdp_world(ph, ctx) else None


def _in_layer(gm: fx.GraphModule, n: fx.Node) -> bool:
    """Whether `n` is inside one of the layers FSDP reshards after forward (`autopar.layers.fsdp_units`); outside
    them FSDP keeps its root gathered (`group_fsdp_gathers_pass`)."""
    from autopar.layers import fsdp_units
    return any(n.name in set(layer.nodes) for layer in fsdp_units(gm))


def _fp8_gathered_weights(gm: fx.GraphModule, ctx: LowerContext) -> set[str]:
    """The FSDP weights gathered in fp8 (`float8_linears_pass`, `autopar.runtime.float8.float8_linear_gathered`): a
    tensorwise float8 linear's weight whose only use is that linear, through one plain FSDP all-gather
    (`all_gather_rs`) on one data axis, sharded evenly, without mixed precision. They stay out of the flat FSDP groups."""
    if ctx.precision is not None:  # mixed precision casts the shard in its gather: gathered in param_dtype
        return set()
    tensorwise = {w: name for name, (recipe, w) in (ctx.float8 or {}).items() if recipe == "tensorwise"}
    out = set()
    for ph in gm.graph.find_nodes(op="placeholder"):
        if ph.name not in tensorwise or len(ph.users) != 1:
            continue
        (g,) = ph.users
        if g.op == "call_function" and g.target is C.all_gather_rs and g.args[3] == 1 and len(g.users) == 1 \
                and next(iter(g.users)).name == tensorwise[ph.name] and len(ctx.gathers.get(ph.name, ())) == 1 \
                and _fsdp_pad(ph, ctx) is None:  # an uneven shard is gathered padded, in its dtype
            out.add(ph.name)
    return out


def _group_comm(fulls: list[fx.Node], axes: tuple, keep: bool, label: str, sizes, pads=()) -> CommInfo:
    """What one FSDP group's gather moves: per data axis (innermost first) an all-gather forward, and backward the
    reduce-scatter (and, resharded, the all-gather again); an uneven parameter's shards padded to the longest."""
    from autopar.forms.fsdp import padded_rows
    from autopar.mesh import resolve_axis
    refs = [resolve_axis(a) for a in axes]
    itemsize = fulls[0].meta["val"].element_size()
    ns = [a.size for a in reversed(refs)]
    numel = 0
    for f, pad in zip(fulls, pads or [None] * len(fulls)):  # local on the other axes, full on these
        k = _local_numel(f, f.meta[M.PLACEMENTS], sizes)
        numel += k if pad is None else k // pad[1] * padded_rows(pad[1], ns) * math.prod(ns)
    gathered = reduced = 0.0
    n = numel // math.prod(a.size for a in refs)
    for a in refs:  # innermost first: each gather's output is the next one's input
        n *= a.size
        gathered += send_bytes("all_gather", n * itemsize, a.size)
        reduced += send_bytes("reduce_scatter", n * itemsize, a.size)
    backward = "reduce_scatter" if keep else "all_gather+reduce_scatter"
    return CommInfo("fsdp_gather", "all_gather", backward, ",".join(a.name for a in refs),
                    math.prod(a.size for a in refs), round(gathered), round(reduced + (0 if keep else gathered)), label)


def regather_linear_inputs_pass(gm: fx.GraphModule, ctx: LowerContext) -> fx.GraphModule:
    """An activation's `all_gather_rs` whose every user is a linear (`linear`, `addmm`, `mm`) taking it as input
    (the sequence-sharded input of a column-parallel layer under Megatron SP) -> the gather and those linears become
    one `regather_linears` node: it keeps the shard for backward and all-gathers it again there for the weight
    gradients, where each linear would keep the gathered copy (Korthikanti et al. 2205.05198 §4.2.2), and
    overlaps the reduce-scatter of the input gradient with the weight gradients (Megatron's async communication).
    Per such gather: one more all-gather backward, and (t-1)/t of the gathered input fewer bytes saved for backward."""
    def fuse(graph, gather, users, weights, biases, in_out):
        shard, dim, axis, split_factor = gather.args
        info = gather.meta[M.COMM]
        fused = graph.call_function(C.regather_linears, (shard, dim, axis, split_factor, weights, biases, in_out))
        fused.meta[M.COMM] = CommInfo("regather_linears", "all_gather", "reduce_scatter+all_gather", info.axis,
                                      info.axis_size, info.bytes_forward, info.bytes_backward + info.bytes_forward,
                                      info.module)
        return fused
    return _fuse_input_collective(gm, ctx, C.all_gather_rs, fuse)


def async_column_linears_pass(gm: fx.GraphModule, ctx: LowerContext) -> fx.GraphModule:
    """An activation's `grad_all_reduce` (Megatron's f: a replicated input of column-parallel work) whose every user
    is a linear taking it as input (q/k/v, gate/up) -> one `grad_all_reduce_linears` node: backward sums the
    linears' input gradients, issues their one all-reduce, and computes the weight gradients while it runs (Megatron's
    async communication)."""
    def fuse(graph, f, users, weights, biases, in_out):
        x, axis = f.args
        fused = graph.call_function(C.grad_all_reduce_linears, (x, axis, weights, biases, in_out))
        info = f.meta[M.COMM]
        fused.meta[M.COMM] = dataclasses.replace(info, fn="grad_all_reduce_linears")
        return fused
    return _fuse_input_collective(gm, ctx, C.grad_all_reduce, fuse)


def _fuse_input_collective(gm: fx.GraphModule, ctx: LowerContext, target, fuse) -> fx.GraphModule:
    """Each `target` node of an activation whose every user is a linear taking it as input, with some weight
    gradient to compute and every weight made before the first linear: `fuse(graph, node, users, weights, biases,
    in_out)` makes one node (inserted before the first linear) returning the linears' outputs, which replace them."""
    graph = gm.graph
    needs = _depends_on_parameters(graph, ctx)
    for coll in list(graph.nodes):
        if coll.op != "call_function" or coll.target is not target or coll.kwargs:
            continue
        users = list(coll.users)
        if coll.args[0].op == "placeholder" or not users or not all(_takes_as_input(u, coll) for u in users) \
                or not any(a in needs for u in users for a in u.args if a is not coll):
            continue  # a parameter (FSDP), another consumer, or no weight gradient to compute
        if any(u.name in ctx.float8 for u in users):
            continue  # a float8 linear runs on its own kernel (`float8_linears_pass`)
        order = {n: i for i, n in enumerate(graph.nodes)}
        first = min(users, key=order.__getitem__)
        in_out = tuple(u.target is not aten.linear.default for u in users)  # addmm / mm: w is (in, out)
        weights = tuple(u.args[2] if u.target is aten.addmm.default else u.args[1] for u in users)
        biases = tuple((u.args[0] if u.target is aten.addmm.default else None) if t else
                       (u.args[2] if len(u.args) > 2 else None) for u, t in zip(users, in_out))
        if any(a is not None and order[a] > order[first] for a in weights + biases):
            continue  # a weight made after the first linear (`fused_parts_pass`' row blocks): kept as it is
        with graph.inserting_before(first):
            fused = fuse(graph, coll, users, weights, biases, in_out)
        fused.meta["val"] = tuple(u.meta["val"] for u in users)
        fused.meta[M.PLACEMENTS] = [u.meta[M.PLACEMENTS] for u in users]
        fused.meta["nn_module_stack"] = first.meta.get("nn_module_stack", {})
        cursor = fused
        for i, u in enumerate(users):
            with graph.inserting_after(cursor):
                item = graph.call_function(operator.getitem, (fused, i))
            item.meta.update(u.meta)
            cursor = item
            u.replace_all_uses_with(item)
            graph.erase_node(u)
        graph.erase_node(coll)
    return gm


def _takes_as_input(u: fx.Node, x: fx.Node) -> bool:
    """u is `linear(x, w[, b])`, `addmm(b, x, w)` (beta = alpha = 1) or `mm(x, w)` with a 2-D weight, x only its
    input."""
    if u.op != "call_function" or u.kwargs:
        return False
    if u.target is aten.linear.default:
        pos, w, ndim = 0, u.args[1], len(shape(x)) >= 2
    elif u.target is aten.addmm.default and len(u.args) == 3:
        pos, w, ndim = 1, u.args[2], len(shape(x)) == 2
    elif u.target is aten.mm.default:
        pos, w, ndim = 0, u.args[1], len(shape(x)) == 2
    else:
        return False
    return (ndim and u.args[pos] is x and sum(a is x for a in u.args) == 1 and isinstance(w, fx.Node)
            and len(shape(w)) == 2)


def _depends_on_parameters(graph: fx.Graph, ctx: LowerContext) -> set[fx.Node]:
    """Values that depend on a floating parameter (or on an input the caller differentiates, `ctx.grad_inputs`):
    only their gradients flow (and need reducing)."""
    out: set[fx.Node] = set()
    for node in graph.nodes:
        if node.op == "placeholder":
            v = node.meta.get("val")
            if isinstance(v, torch.Tensor) and v.dtype.is_floating_point and (
                    node.name in ctx.grad_inputs
                    or (node.name not in ctx.user_inputs and node.name in ctx.placements)):
                out.add(node)
        elif any(a in out for a in node.all_input_nodes):
            out.add(node)
    return out


def replicated_reductions_to_parameters_pass(gm: fx.GraphModule, ctx: LowerContext) -> fx.GraphModule:
    """An activation's `grad_all_reduce` whose value is computed from parameters alone, every step of it replicated
    (a position embedding `wpe(arange(s))` added to batch-sharded tokens) -> the reduction moves onto those
    parameters, where `bucket_gradients_pass` buckets it with the other gradients.

    Why: the activation's reduction is blocking, in the middle of the backward (here at its very end, where the
    position embedding's backward waits for it, and so for every bucket issued before it: gloo and NCCL run a
    group's collectives in order); a parameter's joins an asynchronous bucket. Exact: every rank computes the
    replicated subgraph from the same values, so its Jacobian J is the same on every rank, and the sum over ranks
    of J^T g_r (each rank's parameter gradient, reduced by the bucket) is J^T of the summed g_r (the activation's
    reduction). Only where it moves no more bytes (the parameters' elements at most the activation's), where the
    subgraph is aten ops without randomness or collectives on replicated values, where neither its parameters
    nor its intermediate values are used outside it (their gradients would mix reduced and unreduced parts), and
    on a mesh of one axis (the estimate prices it so: `autopar.solver.other_cost`; on more, a tensor-parallel form
    may shard those parameters, and a value reduced over two axes is a chain, both left as they are)."""
    graph = gm.graph
    if sum(s > 1 for s in ctx.mesh.sizes) != 1:
        return gm  # one axis only (as the estimate prices it: `autopar.solver.other_cost`)
    # ... and it splits the batch: a boundary with the data (a tensor-parallel form prices its own reductions)
    (axis,) = [i for i, s in enumerate(ctx.mesh.sizes) if s > 1]
    if not any(isinstance(pls, tuple) and len(pls) > axis and is_shard(pls[axis])
               for name, pls in ({**ctx.placements, **ctx.arrivals}).items() if name in ctx.user_inputs):
        return gm
    def kind(v: fx.Node) -> str | None:  # a replicated parameter or constant (`parameters_only`)
        pls, val = ctx.placements.get(v.name), v.meta.get("val")
        if v.name in ctx.user_inputs or pls is None or not all(isinstance(p, Replicate) for p in pls) \
                or not isinstance(val, torch.Tensor):
            return None
        return "param" if val.dtype.is_floating_point else "const"

    def replicated(v: fx.Node) -> bool:
        pls = v.meta.get(M.PLACEMENTS)
        return isinstance(pls, tuple) and all(isinstance(p, Replicate) for p in pls)

    for n in list(graph.nodes):
        if n.op != "call_function" or n.target is not C.grad_all_reduce or len(n.args) != 2 or n.kwargs:
            continue
        x, axis_key = n.args
        if x.op == "placeholder" or len(x.users) != 1 or any(u.target is C.grad_all_reduce for u in n.users):
            continue  # (reduced over several axes, a chain: left as it is, as the estimate prices it)
        params = parameters_only(x, kind, replicated)
        if params is None or sum(map(tensor_bytes, params)) > tensor_bytes(x):
            continue
        info = n.meta[M.COMM]
        n.replace_all_uses_with(x)
        graph.erase_node(n)
        order = {v: i for i, v in enumerate(graph.nodes)}
        for p in params:
            first = min(p.users, key=order.__getitem__)
            with graph.inserting_before(first):
                r = graph.call_function(C.grad_all_reduce, (p, axis_key))
            r.meta["val"] = p.meta["val"]
            r.meta[M.PLACEMENTS] = ctx.placements[p.name]
            r.meta["nn_module_stack"] = first.meta.get("nn_module_stack", {})
            r.meta[M.COMM] = dataclasses.replace(info, module=module_path(first), bytes_backward=round(
                info.bytes_backward * tensor_bytes(p) / tensor_bytes(x)))
            p.replace_all_uses_with(r, delete_user_cb=lambda u: u is not r)
    graph.lint()
    gm.recompile()
    return gm


def fuse_loss_count_pass(gm: fx.GraphModule, ctx: LowerContext) -> fx.GraphModule:
    """A mean cross-entropy on a batch split over one axis whose partial loss is all-reduced right after
    (`cross_entropy_sharded_batch` -> `all_reduce`) -> one all-reduce of this rank's (loss sum, valid count), then
    the division (`ops.cross_entropy_sum_count`, `ops.sum_over_count`).

    Why: before, the count was all-reduced inside the loss op and the loss's partial value again after it: two
    small all-reduces in every forward, each a synchronisation of the ranks (on gloo issuing one waits for the
    others to issue it), where DDP has none. Exact: the same sum and count, divided once after the reduction
    (single-device `F.cross_entropy`'s sum / count) rather than each rank's sum divided by the global count and then
    summed. Left as it was: a loss split over several axes (a chain of reductions), one used other than by its
    all-reduce, reduction 'sum' or 'none', the vocab-parallel loss."""
    from autopar.runtime import ops as O
    graph, changed = gm.graph, False
    for n in list(graph.nodes):
        if n.op != "call_function" or n.target is not O.cross_entropy_sharded_batch or n.kwargs:
            continue
        x, target, reduction, ignore_index, smoothing, axes = n.args
        if reduction != 1 or len(axes) != 1 or len(n.users) != 1:
            continue
        (ar,) = n.users
        if ar.target is not C.all_reduce or ar.args != (n, axes[0]) or ar.kwargs:
            continue
        val = n.meta["val"]
        n.target, n.args = O.cross_entropy_sum_count, (x, target, ignore_index, smoothing)
        n.meta["val"] = val.new_empty((2,))
        ar.meta["val"] = val.new_empty((2,))
        if M.COMM in ar.meta:
            info = ar.meta[M.COMM]
            ar.meta[M.COMM] = dataclasses.replace(info, bytes_forward=2 * info.bytes_forward)
        with graph.inserting_after(ar):
            mean = graph.call_function(O.sum_over_count, (ar, val.dtype))
        mean.meta.update({k: v for k, v in ar.meta.items() if k != M.COMM})
        mean.meta["val"] = val.new_empty(())
        ar.replace_all_uses_with(mean, delete_user_cb=lambda u: u is not mean)
        changed = True
    if changed:
        graph.lint()
        gm.recompile()
    return gm


def bucket_gradients_pass(gm: fx.GraphModule, ctx: LowerContext) -> fx.GraphModule:
    """Every `grad_all_reduce` of a parameter on one axis (data parallelism) joins a bucketed all-reduce of
    several gradients (per axis and dtype), as DDP buckets them (`_grad_buckets`): parameters in reverse order of
    first use, the first bucket closed once it holds `C.FIRST_GRAD_BUCKET_BYTES`, each holding at most
    `C.GRAD_BUCKET_BYTES` of gradient (a larger parameter alone). Each bucket goes right
    before the first use of any of its parameters, so autograd runs its backward (an asynchronous all-reduce) as soon
    as their gradients are ready, while the backward of earlier layers still runs. A bucket that alone consumes its
    inputs is marked `exclusive=True`: its reduction is waited for only where the gradients flow on (for parameters,
    at the end of the backward), not inside its own backward. An axis and dtype with a single reduction keeps its
    `grad_all_reduce`.

    A parameter reduced over several data axes is a chain `grad_all_reduce(grad_all_reduce(w, a0), a1)`
    (its gradient flows through a1's reduction first, then a0's). Bucketing runs in rounds: the first
    catches reductions of parameters, each later one the reductions of the previous round's bucketed
    values, so every axis of the chain gets its buckets (a later round's bucket holds the items of one earlier
    bucket and comes after them: in backward it runs first, as the chain's outer reduction did)."""
    bucketed = {n for n in gm.graph.nodes if n.op == "placeholder"}  # values a bucketable reduction reduces
    while True:
        order = {n: i for i, n in enumerate(gm.graph.nodes)}
        groups: dict[tuple, list[fx.Node]] = {}
        for n in gm.graph.nodes:
            if n.op == "call_function" and n.target is C.grad_all_reduce and n.args[0] in bucketed:
                # a later round's bucket holds items of one earlier bucket only: all defined before its first use
                source = n.args[0].args[0] if n.args[0].op == "call_function" else None
                groups.setdefault((n.args[1], n.args[0].meta["val"].dtype, source), []).append(n)
        groups = {k: nodes for k, nodes in groups.items() if len(nodes) >= 2}
        if not groups:
            return gm
        bucketed = set()
        for (axis, _, _), nodes in groups.items():
            for bucket_nodes in _grad_buckets(nodes, order):
                bucketed.update(_bucket(gm, axis, bucket_nodes, order))


def _first_use(n: fx.Node, order: dict[fx.Node, int]) -> int:
    """Position of the reduction's input's first use (the reduction itself when it is the only user)."""
    return min(order[u] for u in n.args[0].users)


def _grad_buckets(nodes: list[fx.Node], order: dict[fx.Node, int]) -> list[list[fx.Node]]:
    """The reductions of one axis and dtype split into buckets, last used first (the gradients ready first first), as
    DDP assigns them (`compute_bucket_assignment_by_size` in torch's reducer.cpp): the first bucket closes once it
    holds `C.FIRST_GRAD_BUCKET_BYTES`, with the gradient that crossed that size in it, so a large gradient that is
    ready early (an output projection, a classifier head, the last convolution) is reduced while the rest of the
    backward runs rather than waiting in the next bucket for the whole backward; every bucket holds at most
    `C.GRAD_BUCKET_BYTES` (a larger gradient alone)."""
    first_cap = min(C.GRAD_BUCKET_BYTES, C.FIRST_GRAD_BUCKET_BYTES)
    buckets: list[list[fx.Node]] = []
    size, closed = 0, True
    for n in sorted(nodes, key=lambda n: -_first_use(n, order)):
        val = n.args[0].meta["val"]
        nbytes = val.numel() * val.element_size()
        if closed or size + nbytes > C.GRAD_BUCKET_BYTES:
            buckets.append([])
            size = 0
        buckets[-1].append(n)
        size += nbytes
        closed = len(buckets) == 1 and size >= first_cap
    return buckets


def _bucket(gm: fx.GraphModule, axis, nodes: list[fx.Node], order: dict[fx.Node, int]) -> list[fx.Node]:
    """Replace the reductions `nodes` by one `grad_sync_bucket` placed before their inputs' first use; its items."""
    first = min((u for n in nodes for u in n.args[0].users), key=order.__getitem__)
    # the bucket alone consumes its inputs: its reduction need not be waited for before their gradients flow on
    exclusive = all(len(n.args[0].users) == 1 for n in nodes)
    with gm.graph.inserting_before(first):
        bucket = gm.graph.call_function(C.grad_sync_bucket, (tuple(n.args[0] for n in nodes), axis),
                                        {"exclusive": True} if exclusive else {})
        infos = [n.meta[M.COMM] for n in nodes]
        bucket.meta[M.COMM] = CommInfo("grad_sync_bucket", "-", "all_reduce", infos[0].axis, infos[0].axis_size,
                                       0, sum(i.bytes_backward for i in infos), "(gradient bucket)")
        bucket.meta["val"] = tuple(n.meta["val"] for n in nodes)
        items = []
        for i, n in enumerate(nodes):
            item = gm.graph.call_function(operator.getitem, (bucket, i))
            item.meta.update({k: v for k, v in n.meta.items() if k != M.COMM})
            items.append(item)
    for n, item in zip(nodes, items):
        n.replace_all_uses_with(item)
        gm.graph.erase_node(n)
    order.clear()
    order.update((n, i) for i, n in enumerate(gm.graph.nodes))
    return items


# the collectives a parameter meets before its compute: under mixed precision each casts (`C.all_gather_rs` & co, `mp=`)
_PARAMETER_SIDE = (C.all_gather, C.all_gather_rs, C.grad_all_reduce, C.grad_sync_bucket, F.fsdp_gather, F.fsdp_prefetch)


def mixed_precision_pass(gm: fx.GraphModule, ctx: LowerContext) -> fx.GraphModule:
    """Mixed precision (`autopar.precision`): the program was captured with the parameters at param_dtype, and runs
    on the master (e.g. fp32) parameters. A parameter's uses other than collectives read one cast copy
    (`aten._to_copy`, right after its placeholder). Every gradient collective of a value computed from parameters
    alone (not from the batch: FSDP's all-gathers, data-parallel buckets and gradient all-reduces, a positional
    embedding's reduction at the batch boundary) gets `mp=(param_dtype, reduce_dtype)`: forward it casts its input to
    param_dtype (an FSDP shard before its gather: the gather moves param_dtype bytes), backward it reduces the gradient
    in reduce_dtype and returns it in its input's dtype. That is the master dtype for a parameter; a collective whose
    users are collectives again (gathered on one axis, its gradient reduced on another) keeps the master dtype
    (`mp=(.., .., True)`: a gather moves param_dtype bytes, exact) so that the last one casts, and a value computed
    by lookups and views from parameters is computed from the masters (`_in_master_dtype`); a reduction of any other
    value computed from the cast copies returns param_dtype (its sum rounded once). Backward bytes are re-priced at
    reduce_dtype (an FSDP group's reduce-scatter; its backward re-gather stays at param_dtype). The casts of the
    model's and each layer's floating inputs are not this pass's: they are in the captured graph already
    (`autopar.precision.layer_input_casts`)."""
    if ctx.precision is None:
        return gm
    param_dtype, reduce_dtype = ctx.precision.collective_dtypes
    mp = (param_dtype, reduce_dtype)
    graph = gm.graph
    params = [n for n in graph.nodes if n.op == "placeholder" and n.name in ctx.placements
              and n.name not in ctx.user_inputs and isinstance(n.meta.get("val"), torch.Tensor)
              and n.meta["val"].dtype.is_floating_point]
    for ph in params:
        direct = [u for u in ph.users if u.target not in _PARAMETER_SIDE]
        if not direct or param_dtype is None:
            continue
        with graph.inserting_after(ph):
            cast = graph.call_function(aten._to_copy.default, (ph,), {"dtype": param_dtype})
        cast.meta.update({"val": ph.meta["val"], M.PLACEMENTS: ph.meta.get(M.PLACEMENTS),
                          "nn_module_stack": direct[0].meta.get("nn_module_stack", {})})
        for u in direct:
            u.replace_input_with(ph, cast)
    batch: set[fx.Node] = set()  # values computed from the user's inputs
    for n in graph.nodes:
        if n.name in ctx.user_inputs or any(a in batch for a in n.all_input_nodes):
            batch.add(n)
    casts = {n for n in graph.nodes if n.target is aten._to_copy.default and n.args[0] in params}
    for n in graph.nodes:
        if n.op == "call_function" and n.target in (F.fsdp_gather, F.fsdp_prefetch):  # FSDP groups: dtypes as args
            n.args = (*n.args[:6], *mp) if n.target is F.fsdp_gather else (*n.args[:2], param_dtype)
            info = n.meta.get(M.COMM)
            if info is not None and reduce_dtype is not None:  # the reduce-scatter in reduce_dtype, a re-gather not
                regather = info.bytes_forward if "all_gather" in info.backward else 0
                ratio = torch.empty((), dtype=reduce_dtype).element_size() / n.args[0][0].meta["val"].element_size()
                n.meta[M.COMM] = dataclasses.replace(
                    info, bytes_backward=regather + round((info.bytes_backward - regather) * ratio))
            continue
        if n.op != "call_function" or n.target not in _PARAMETER_SIDE or n in batch:
            continue
        if n.target is not C.grad_sync_bucket:
            _in_master_dtype(n, casts, mp)
        # a collective followed by collectives only (gathered on one axis, reduced on another): the last one casts
        chained = n.target is not C.grad_sync_bucket and all(
            u.target in _PARAMETER_SIDE and u not in batch for u in n.users)
        n.kwargs = {**n.kwargs, "mp": (*mp, True) if chained else n.kwargs.get("mp", mp)}
        info = n.meta.get(M.COMM)
        held = (n.args[0][0] if n.target is C.grad_sync_bucket else n.args[0]).meta["val"].element_size()
        if info is not None and reduce_dtype is not None:
            size = torch.empty((), dtype=reduce_dtype).element_size()
            n.meta[M.COMM] = dataclasses.replace(info, bytes_backward=round(info.bytes_backward * size / held))
    return gm


# ops whose result cast to another dtype is the op on its inputs cast (lookups, views): their parameter-only inputs
# can be computed in the master dtype and cast once after them
_CAST_COMMUTES = {aten.embedding.default, aten.t.default, aten.view.default, aten.reshape.default,
                  aten._unsafe_view.default, aten.transpose.int, aten.permute.default, aten.contiguous.default,
                  aten.clone.default, aten.alias.default, aten.flatten.using_ints, aten.unflatten.int,
                  aten.unsqueeze.default, aten.squeeze.dim, aten.expand.default, aten.slice.Tensor, operator.getitem}


def _in_master_dtype(n: fx.Node, casts: set[fx.Node], mp: tuple) -> None:
    """A gradient collective `n` of a value computed from parameters by lookups and views only (a positional
    embedding `wpe[arange(s)]` reduced where it meets the batch): that value is computed from the master parameters
    instead of their cast copies (an FSDP gather on the way gathers param_dtype bytes and returns them in the master
    dtype: `mp=(param_dtype, reduce_dtype, True)`), so `n` casts it (exactly: the ops commute with the cast) and its
    reduced gradient reaches the parameter in the master dtype, never rounded to param_dtype. Left as it is where a
    value on the way has another use."""
    region, gathers, stack = set(), set(), list(n.all_input_nodes)
    while stack:
        x = stack.pop()
        if x in region or x in casts or not _is_tensor_node(x) or not x.meta["val"].dtype.is_floating_point:
            continue  # integer indices (arange) stay as they are
        if x.target in (C.all_gather, C.all_gather_rs):  # of parameters (all above `n` is parameters only)
            gathers.add(x)
            continue
        if x.op != "call_function" or x.target not in _CAST_COMMUTES:
            return
        region.add(x)
        stack.extend(x.all_input_nodes)
    if not region or any(u is not n and u not in region for x in region | gathers for u in x.users):
        return
    for g in gathers:
        g.kwargs = {**g.kwargs, "mp": (*mp, True)}
    for x in region:
        for a in x.all_input_nodes:
            if a in casts:
                x.replace_input_with(a, a.args[0])


def erase_asserts_pass(gm: fx.GraphModule, ctx: LowerContext) -> fx.GraphModule:
    """Drop the trace's dtype/device asserts: they are not part of the computation."""
    for node in list(gm.graph.nodes):
        if node.op == "call_function" and node.target is aten._assert_tensor_metadata.default:
            gm.graph.erase_node(node)
    return gm


def decompose_row_bias_pass(gm: fx.GraphModule, ctx: LowerContext) -> fx.GraphModule:
    """A row-parallel linear's bias is added once, after the reduction: split it from the matmul."""
    for node in list(gm.graph.nodes):
        if node.op != "call_function":
            continue
        if node.target is aten.linear.default and len(node.args) > 2 and node.args[2] is not None:
            x, w, b = node.args[:3]
            wpl = _weight_placements(w, ctx)
            if any(is_shard(p) and p.dim == 1 for p in wpl):
                with gm.graph.inserting_before(node):
                    mm = gm.graph.call_function(aten.linear.default, (x, w))
                    mm.meta.update(node.meta)
                    mm.meta["autopar_row_of"] = node.name
                    node.target, node.args = aten.add.Tensor, (mm, b)
        elif node.target is aten.addmm.default:
            b, x, w = node.args[:3]
            beta, alpha = arg(node, 3, "beta", 1), arg(node, 4, "alpha", 1)
            wpl = ctx.placements.get(getattr(w, "name", None), ())
            if any(is_shard(p) and p.dim == 0 for p in wpl):
                with gm.graph.inserting_before(node):
                    mm = gm.graph.call_function(aten.mm.default, (x, w))
                    mm.meta.update(node.meta)
                    mm.meta["autopar_row_of"] = node.name
                    # beta * bias + alpha * (x @ w)
                    prod = mm if alpha == 1 else _scaled(gm.graph, mm, alpha, node)
                    b = b if beta == 1 else _scaled(gm.graph, b, beta, node)
                    node.target, node.args, node.kwargs = aten.add.Tensor, (prod, b), {}
    return gm


def _weight_placements(w, ctx: LowerContext) -> tuple:
    """A linear weight's placements: a parameter's, or those of a parameter used transposed (`enc.weight.t()`,
    a tied weight read as another layer's), its dims swapped."""
    if getattr(w, "target", None) is aten.t.default and w.args[0].name in ctx.placements:
        return tuple(with_dim(p, 1 - p.dim) if is_shard(p) else p for p in ctx.placements[w.args[0].name])
    return ctx.placements.get(getattr(w, "name", None), ())


def _scaled(g: fx.Graph, x: fx.Node, factor, like: fx.Node) -> fx.Node:
    y = g.call_function(aten.mul.Tensor, (x, factor))
    y.meta.update({"val": x.meta["val"], "nn_module_stack": like.meta.get("nn_module_stack", {})})
    return y


def local_expert_stacks_pass(gm: fx.GraphModule, ctx: LowerContext) -> fx.GraphModule:
    """ModuleList experts owned per rank (their placeholders marked S(0) on the expert axis): the graph's
    stack of all experts becomes a stack of this rank's, S(0) on that axis."""
    from autopar.runtime.moe import local_expert_stack
    axes = ctx.mesh.axes
    for node in list(gm.graph.nodes):
        ax = ctx.moe_axes.get(node.name)
        if ax is None:
            continue
        for p in node.args[4]:
            if p.target is not aten.stack.default or not all(
                    q.op == "placeholder" and is_shard(ctx.placements.get(q.name, (R,) * len(axes))[ax])
                    for q in p.args[0]):
                continue
            per_rank = len(p.args[0]) // ctx.mesh.sizes[ax]
            p.target, p.args, p.kwargs = local_expert_stack, (list(p.args[0]), axes[ax].key, per_rank), {}
    return gm


def _narrow(g: fx.Graph, x: fx.Node, dim: int, first: int, end: int, stack: dict) -> fx.Node:
    n = g.call_function(aten.slice.Tensor, (x, dim, first, end))
    n.meta.update({"val": x.meta["val"].narrow(dim, first, end - first), "nn_module_stack": stack})
    return n


def _hint(g: fx.Graph, x: fx.Node, spec: dict[int, Placement], names) -> fx.Node:
    h = g.call_function(placement_hint, (x, {names[a]: fmt(p) for a, p in spec.items()}))
    h.meta.update({"val": x.meta["val"], "nn_module_stack": x.meta["nn_module_stack"], "autopar_hint": spec})
    return h


def fused_parts_pass(gm: fx.GraphModule, ctx: LowerContext) -> fx.GraphModule:
    """A fused projection with a `PARTS` directive (unequal q/k/v blocks: `autopar.forms.heads`) becomes one
    projection per block of its output features, on the block's rows of its replicated weight (and bias); a
    block whose heads divide over the axis has those rows split there (a `placement_hint`: forward a local
    slice, backward the rows' gradient all-gathered, so the weight's gradient is whole on every rank). Every use
    of the node that took a block apart reads the block's projection, viewed to that node's shape."""
    g = gm.graph
    by_name = {n.name: n for n in g.nodes}
    for name, (ax, blocks) in ctx.parts.items():
        node = by_name[name]
        if node.target is aten.linear.default:
            x, w, b, w_dim = node.args[0], node.args[1], (node.args[2] if len(node.args) > 2 else None), 0
        elif node.target is aten.addmm.default:
            b, x, w, w_dim = node.args[0], node.args[1], node.args[2], 1
        elif node.target in (aten.mm.default, aten.matmul.default):
            x, w, b, w_dim = node.args[0], node.args[1], None, 1
        else:
            raise ValueError(f"PARTS directive for {name} ({node.target}): not a linear projection; the plan was "
                             "made for another graph. Fix: re-plan for this model.")
        split = ctx.mesh.sizes[ax]
        takers = []
        for taker_name, first, end, heads in blocks:
            taker = by_name[taker_name]
            with g.inserting_before(node):
                stack = node.meta.get("nn_module_stack", {})  # collectives of the blocks belong to the projection
                w_i = _narrow(g, w, w_dim, first, end, stack)
                b_i = None if b is None else _narrow(g, b, len(shape(b)) - 1, first, end, stack)
                if heads % split == 0:  # whole heads per rank; else (fewer KV heads than ranks) replicated
                    w_i = _hint(g, w_i, {ax: Shard(w_dim)}, ctx.mesh.names)
                    b_i = None if b_i is None else _hint(g, b_i, {ax: Shard(len(shape(b)) - 1)}, ctx.mesh.names)
                if node.target is aten.addmm.default:
                    args = (b_i, x, w_i)
                else:
                    args = (x, w_i) if b_i is None else (x, w_i, b_i)
                y = g.call_function(node.target, args)
                y.meta.update({"val": node.meta["val"].narrow(-1, first, end - first), "nn_module_stack": stack})
                out = g.call_function(aten.reshape.default, (y, list(shape(taker))))
                out.meta.update({"val": taker.meta["val"], "nn_module_stack": taker.meta.get("nn_module_stack", {})})
            taker.replace_all_uses_with(out)
            takers.append(taker)
        while takers:  # the takers, and what fed only them (back to the fused projection), are dead now
            n = takers.pop()
            if n.op == "call_function" and not n.users and not n.is_impure():
                takers.extend(n.all_input_nodes)
                g.erase_node(n)
    return gm


def insert_hints_pass(gm: fx.GraphModule, ctx: LowerContext) -> fx.GraphModule:
    """A `placement_hint` node after each hinted value (a `HINT` directive, or the row-parallel output of a
    `ROW_OUTPUT` one, before its bias); every use of the value reads the hint."""
    names = ctx.mesh.names
    decomposed = {n.meta["autopar_row_of"] for n in gm.graph.nodes if "autopar_row_of" in n.meta}
    for node in list(gm.graph.nodes):
        spec = dict(ctx.hints.get(node.name, {}))
        row = node.meta.get("autopar_row_of") or (node.name if node.name not in decomposed else None)
        if row is not None:
            spec.update(ctx.hints.get("row:" + row, {}))
        if not spec:
            continue
        users = list(node.users)
        with gm.graph.inserting_after(node):
            h = gm.graph.call_function(placement_hint, (node, {names[a]: fmt(p) for a, p in spec.items()}))
        h.meta["val"] = node.meta["val"]
        h.meta["nn_module_stack"] = node.meta.get("nn_module_stack", {})
        h.meta["autopar_hint"] = spec
        h.meta["autopar_soft_hint"] = node.name in ctx.soft_hints
        for u in users:
            u.replace_input_with(node, h)
    return gm


def propagate_pass(gm: fx.GraphModule, ctx: LowerContext) -> fx.GraphModule:
    """Placements node by node from the sharding rules; the collectives between them; local shapes and forms."""
    _Lowerer(gm, ctx).run()
    return gm


def dead_code_pass(gm: fx.GraphModule, ctx: LowerContext) -> fx.GraphModule:
    gm.graph.eliminate_dead_code()
    gm.recompile()
    return gm


# the lowering, in order (run by passes.pipeline.run_passes, which lints after each pass)
LOWER = [
    erase_asserts_pass,
    decompose_row_bias_pass,
    local_expert_stacks_pass,
    fused_parts_pass,
    insert_hints_pass,
    propagate_pass,
    record_work_pass,
    fuse_gather_grad_reduce_pass,
    group_fsdp_gathers_pass,
    regather_linear_inputs_pass,
    async_column_linears_pass,
    replicated_reductions_to_parameters_pass,
    bucket_gradients_pass,
    mixed_precision_pass,
    float8_linears_pass,
    fuse_loss_count_pass,
    dead_code_pass,
    checkpoint_layers_pass,
]


def lower_pass(gm: fx.GraphModule, ctx: LowerContext) -> fx.GraphModule:
    """The whole lowering (`LOWER`)."""
    from passes.pipeline import run_passes
    return run_passes(gm, ctx, LOWER)


def collective_nodes(gm: fx.GraphModule) -> list[fx.Node]:
    """Every collective node, those inside checkpointed layers too."""
    return [n for n in walk(gm) if n.op == "call_function" and n.target in C.COLLECTIVES]


def comm_rows(gm: fx.GraphModule, info: MeshInfo) -> list:
    """The plan's collective rows: every collective node of the lowered graph, and the all-to-alls inside
    expert-parallel MoE nodes (issued at run time with this step's splits: tokens out and back, forward and
    backward, priced for uniform routing, k*T*h*(ep-1)/ep each)."""
    from autopar.mesh import resolve_axis
    from autopar.plan import CommRow
    from autopar.runtime.moe import moe_experts, spec_of
    rows = []
    for n in collective_nodes(gm):
        c = n.meta[M.COMM]
        rows.append(CommRow(module=c.module, fn=c.fn, axis=c.axis, forward=c.forward, backward=c.backward,
                            bytes_forward=c.bytes_forward, bytes_backward=c.bytes_backward))
    rows += _float8_amax_rows(gm)
    for n in walk(gm):
        if n.op != "call_function" or n.target is not moe_experts or n.args[6] != "a2a":
            continue
        x, idx, key, axis = n.args[0], n.args[1], n.args[4], resolve_axis(n.args[5])
        t, h = x.meta["val"].shape
        local_t = t // math.prod(info.sizes[i] for i, a in enumerate(info.axes) if a.key in n.args[7])
        k = idx.meta["val"].shape[-1]
        b = round(2 * send_bytes("all_to_all", k * local_t * h * x.meta["val"].element_size(), axis.size))
        rows.append(CommRow(module=spec_of(key).path, fn="moe_all_to_all", axis=axis.name,
                            forward="all_to_all x2 (+counts)", backward="all_to_all x2", bytes_forward=b,
                            bytes_backward=b))
    return rows


def _float8_amax_rows(gm: fx.GraphModule) -> list:
    """A row per float8 linear and mesh axis: the amax all-reduces (MAX) `autopar.runtime.float8` issues inside it
    (`autopar.forms.float8.CASTS`: those whose reduced dims the axis splits), forward and backward bytes."""
    from autopar.forms.float8 import CASTS
    from autopar.mesh import resolve_axis
    from autopar.plan import CommRow
    from autopar.runtime.float8 import float8_linear, float8_linear_gathered
    from autopar.sites import module_path
    rows = []
    for n in walk(gm):
        if n.op != "call_function" or n.target not in (float8_linear, float8_linear_gathered):
            continue
        if n.target is float8_linear_gathered:  # FSDP's gather in fp8: its row, and its weight's amax on that axis
            x, w, _, g_axis, _, m_axes, k_axes, n_axes, keep = n.args
            recipe, g = "tensorwise", resolve_axis(g_axis)
            numel, item = w.meta["val"].numel(), w.meta["val"].element_size()
            gathered = round(send_bytes("all_gather", numel, g.size))  # 1 byte per element
            reduced = round(send_bytes("reduce_scatter", numel * item, g.size))
            rows.append(CommRow(module=module_path(n), fn="fsdp_gather_fp8", axis=g.name, forward="all_gather",
                                backward="reduce_scatter" if keep else "all_gather+reduce_scatter",
                                bytes_forward=gathered, bytes_backward=reduced + (0 if keep else gathered)))
            rows.append(CommRow(module=module_path(n), fn="float8_amax", axis=g.name, forward="all_reduce(max) x1",
                                backward="all_reduce(max) x0",
                                bytes_forward=round(send_bytes("all_reduce", 4, g.size)), bytes_backward=0))
        else:
            x, w, _, recipe, m_axes, k_axes, n_axes = n.args
        out_f, in_f = w.meta["val"].shape  # global: (N, K)
        tokens = x.meta["val"].numel() // x.meta["val"].shape[-1]
        split = {"m": m_axes, "k": k_axes, "n": n_axes}
        size = lambda keys: math.prod(resolve_axis(a).size for a in keys)  # noqa: E731
        local = {"m": tokens / size(m_axes), "k": in_f / size(k_axes), "n": out_f / size(n_axes)}
        for dim, keys in split.items():
            for key in keys:
                axis = resolve_axis(key)
                fwd = bwd = 0
                counts = [0, 0]
                for j, (reduced, kept) in enumerate(CASTS[recipe]):
                    if dim in reduced:
                        b = round(send_bytes("all_reduce", 4 * (1 if kept is None else local[kept]), axis.size))
                        fwd, bwd = (fwd + b, bwd) if j < 2 else (fwd, bwd + b)
                        counts[j >= 2] += 1
                rows.append(CommRow(module=module_path(n), fn="float8_amax", axis=axis.name,
                                    forward=f"all_reduce(max) x{counts[0]}", backward=f"all_reduce(max) x{counts[1]}",
                                    bytes_forward=fwd, bytes_backward=bwd))
    return rows


def placements_str(node: fx.Node) -> str:
    pls = node.meta.get(M.PLACEMENTS)
    if pls is None:
        return "-"
    if isinstance(pls, list):
        return ",".join(fmt_placements(p) for p in pls)
    return fmt_placements(pls)
