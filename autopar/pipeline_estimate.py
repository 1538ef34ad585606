"""Offline planning and pricing of a pipelined plan (issue #23, deliverables 2 and 3): `autopar.plan(model, {"pp": 16,
"dp": 128, "tp": 8}, inputs, overrides={"pipeline": "1f1b@pp"}, microbatches=32)`.

The stage-level model. A pipeline cuts the model's repeated layers (`autopar.layers`: one `ModuleList` of layers of
one class) into stages; every stage runs on the sub-mesh the pipeline axis leaves (here dp x tp) and takes, on it,
the forms of the named plan (or of the ILP for "auto") for ONE microbatch (the global batch / m). Identical layers
take identical forms, so the sub-mesh plan is made for the model cut down to its first layer and to its first two
(`_truncated`: captured, recognised and solved in about a second each, whatever the model's depth): the difference
of the two is one layer's cost (`Cost`: its compute, its model-axis collectives, its gradient reduction, its
parameters, gradients, optimizer state and saved activations, what no structure holds between layers included), and
the one-layer model less that layer is what comes before the layers (the embedding: stage 0) and after them (final
norm, head, loss: the last stage), split by where each structure sits in the graph (what no structure holds outside
the layers goes with the side holding more of the structures' compute). The checkpoint level of the layers is the
sub-plan's: its recompute and the bytes it frees per layer scale with the layers of a stage.

Per microbatch a stage takes its layers' forward + backward and the model-axis collectives nothing hides
(`Cost.critical_s - hidden_s`, as `autopar.timeline` exposes them) plus its p2p: the boundary layer's output
activation (the compute dtype, the microbatch's share of this rank: divided over the data and sequence axes, and over
the tensor axis where the norms are sequence-parallel, Megatron's scatter-gather) sent to the next stage and its
gradient back, each `cost_model.analytical.collective_time_s("p2p", ...)` on the pipeline axis' link. The cut is
`balanced_cut` of those per-layer times with the embedding on the first stage and the head and loss on the last. The
step, the bubble, the tail (gradient reduction after the last microbatch, the optimizer) and every rank's peak memory
(its parameters, gradients, optimizer state, plus its in-flight microbatches' activations) are `cost_model.pipeline`'s
closed forms; each rank's peak reuses `estimate.peak_bytes` on its stages' costs with the activations multiplied by
its in-flight count.

The plan this returns is for planning and estimating: its strategies, parameter placements and checkpoint levels are
the one-layer plan's repeated over every layer (the pipeline axis replicated: a stage's parameters live on its
sub-mesh), its `pipeline` says the form, microbatches and cut, and it has no graph fingerprint (the runtime re-plans
on its own capture). `parallelize` with the same override runs the pipeline on its own capture
(`autopar.pipeline_runtime`, plan='dp' inside the stages so far); `autopar.plan(..., lower=True)` does not lower it.

Under the multi-stage schedules (interleaved 1F1B, ZB-V) a rank's peak is walked in torch's own action order
(`cost_model.pipeline.torch_order` / `backward_states`, `_schedule_peak`): the chunks each stage holds at every
backward, ZB-V's microbatches between their input- and weight-gradient passes, and the boundary tensors torch's
runtime keeps alive until the step ends (it waits for its sends after the last action). FSDP inside a stage
(plan='fsdp', as the runtime runs it: reshard_after_forward=False, as torchtitan and Llama 3 run FSDP under
pipelining) holds the stage's parameters gathered and its gradients unsharded for the whole step
(`_gathered_bytes`); measured / predicted per stage, benchmarks/memory_fidelity.py --pipeline: 0.94-1.08.

Not modelled: FSDP's gathers are paid once per step and no re-gather per microbatch (the time of it is the
sub-plan's); a weight tied across the first and last stage (GPT's embedding and head) is held and reduced once, on the
first stage (Megatron keeps a copy on the last stage and all-reduces their gradients between the two); the slowdown of
compute under overlapped communication (`Cluster.overlap_slowdown`) is not applied inside the pipeline; the ranks do
not finish at once (1F1B's last stage drains first), the step ends with the largest tail; `comm_bytes_per_step`
counts the p2p bytes only (a stage's collectives are in its structures' costs).
"""

from __future__ import annotations

import copy
import dataclasses
import math

import torch
from torch import nn

from autopar.estimate import Cost, gather_stats, mesh_costing, optimizer_step_s, peak_bytes
from autopar.layers import find_layers, layer_modules
from autopar.pipeline_plan import PipelinePlan, balanced_cut, bubble_fraction, parse_pipeline
from autopar.plan import CandidateRow, Decision, Plan, StageEstimate
from autopar.spec import R, fmt_placements, placements_from_str
from autopar.units import fmt_bytes
from cost_model import pipeline as pipe_cost

PIPELINE_KEY = "pipeline"
DECISION_KEY = "(pipeline)"

_SUMMED = ("compute_s", "comm_s", "comm_bytes", "memory_bytes", "act_bytes", "transient_bytes", "bucket_bytes",
           "gather_s", "reduce_s", "regather_s", "optimizer_s", "overlap_slowdown", "hidden_s", "step_gather_s")
_LARGEST = ("peak_bytes", "reduce_transient_bytes")  # momentary: the largest counts, not the sum


def _combine(costs, signs=None) -> Cost:
    """The field-wise sum (times `signs`) of costs; a momentary buffer is the largest of theirs."""
    costs = list(costs)
    signs = signs or [1.0] * len(costs)
    kw = {f: sum(s * getattr(c, f) for c, s in zip(costs, signs)) for f in _SUMMED}
    kw.update({f: max((getattr(c, f) for c in costs), default=0.0) for f in _LARGEST})
    return Cost(**kw)


def _scaled(c: Cost, n: float) -> Cost:
    return dataclasses.replace(c, **{f: getattr(c, f) * n for f in _SUMMED})


def _with_activations(c: Cost, factor: float) -> Cost:
    """c with its saved activations held `factor` times (microbatches in flight)."""
    return dataclasses.replace(c, act_bytes=c.act_bytes * factor,
                               memory_bytes=c.memory_bytes - c.act_bytes + c.act_bytes * factor)


def _accumulating_bytes(costs, grad_share: float, start_bytes: float) -> float:
    """Live bytes at the start of a microbatch's backward after the first: what is held all step, every gradient
    (accumulated since the first backward), the activations in flight and the largest momentary buffer
    (`estimate.peak_bytes`' start of the backward, with the gradients added; `cost_model.pipeline.in_flight_later`)."""
    held = act = grads = momentary = 0.0
    for c in costs:
        h, a, g = c.live_parts(grad_share)
        held, act, grads, momentary = held + h, act + a, grads + g, max(momentary, c.peak_bytes)
    return held + grads + act + momentary + start_bytes


def _schedule_peak(order, costs: dict, cks: dict, lc, rank_of: list[int]) -> float:
    """A rank's peak under a multi-stage schedule, walked in torch's order (`cost_model.pipeline.backward_states`):
    the larger of the end of the backward (`estimate.peak_bytes` with no activation) and, at the start of each
    backward pass, what is held all step, the gradients once a backward has run, the saved activations of every
    microbatch each stage holds (its layers' and its checkpoint level's), for a stage that sends its output held
    with them and the received output gradient, the largest momentary buffer; and under the zero-bubble split, per
    microbatch whose W pass is still to come, the gradients at its weights' ops, priced as its saved activations
    (each weight op saves its input, of about its output gradient's size)."""
    act = {k: c.act_bytes + (cks[k].act_bytes if cks.get(k) is not None else 0.0) for k, c in costs.items()}
    transient = max((c.transient_bytes for c in cks.values() if c is not None), default=0.0)
    hold = grads = momentary = 0.0
    for c in costs.values():
        h, _, g = c.live_parts(lc.grad_share)
        hold, grads, momentary = hold + h, grads + g, max(momentary, c.peak_bytes)
    peak = peak_bytes([_with_activations(c, 0.0) for c in costs.values()], lc.grad_share)
    for held, pending, accumulated, boundary in pipe_cost.backward_states(order, rank_of):
        live = hold + (grads if accumulated else 0.0) + momentary + transient
        live += sum(n * act[k] for k, n in held.items()) + sum(n * act[k] for k, n in pending.items())
        live += lc.boundary_bytes * (boundary + 1)  # + the output gradient received for this backward
        peak = max(peak, live)
    return peak


def _gathered_bytes(held, lc) -> float:
    """FSDP inside a stage, as the runtime runs it (`reshard_after_forward=False`, gradient sync on the last
    microbatch only): the stage's parameters gathered whole for the step next to their shards, and its gradients
    accumulated unsharded (the shards' gradients priced, `gather_degree - 1` times more); the per-layer gathered
    copies the sub-plan prices as transient (`Cost.transient_bytes`) are these, counted once."""
    state = sum(c.memory_bytes - c.act_bytes - c.transient_bytes for c in held)
    copies = sum(c.transient_bytes for c in held)
    return max(0.0, state * lc.param_share * lc.gather_degree - copies) + \
        state * lc.grad_share * (lc.gather_degree - 1)


def exposed_s(c: Cost) -> float:
    """Per microbatch: compute and the model-axis collectives no compute hides (`autopar.timeline`'s critical path)."""
    return c.compute_s + max(0.0, c.critical_s - c.hidden_s)


# ----------------------------------------------------------------------------- the model cut to its first layers

def repeated_layers(model: nn.Module) -> tuple[str, list[nn.Module]]:
    """(the path of the container holding the model's layers, the layers): one ModuleList/Sequential of layers of
    one class, or a NotImplementedError / ValueError saying why the stage model cannot plan this model."""
    found = layer_modules(model)
    if not found:
        raise ValueError(f"a pipeline cuts a model's repeated layers into stages, but {type(model).__name__} has "
                         "none (no module in a ModuleList/Sequential, e.g. model.layers.0). Fix: drop the "
                         "'pipeline' override, or hold the blocks in an nn.ModuleList")
    parents = {path.rsplit(".", 1)[0] if "." in path else "" for path, _ in found}
    classes = {type(m).__name__ for _, m in found}
    if len(parents) != 1 or len(classes) != 1:
        raise NotImplementedError(
            f"pipeline planning prices every stage from one layer's plan, so the layers must be one list of one "
            f"class; {type(model).__name__} has layers in {sorted(parents)} of classes {sorted(classes)}. Not "
            "implemented yet: stages of mixed layers (issue #23)")
    return parents.pop(), [m for _, m in found]


def _truncated(model: nn.Module, parent: str, k: int) -> nn.Module:
    """A shallow copy of `model` whose layer container `parent` holds only its first k layers; every other module
    (and every parameter) is shared, nothing is allocated."""
    root = copy.copy(model)
    root._modules = dict(model._modules)
    holder, names = root, parent.split(".") if parent else []
    for name in names[:-1]:
        child = copy.copy(holder._modules[name])
        child._modules = dict(child._modules)
        holder._modules[name] = child
        holder = child
    container = holder._modules[names[-1]] if names else root
    short = type(container)(*list(container)[:k]) if isinstance(container, nn.Sequential) else \
        nn.ModuleList(list(container)[:k])
    if names:
        holder._modules[names[-1]] = short
    return root


def _microbatch(example_inputs, batch: int, m: int):
    """The example inputs of one microbatch: every tensor whose dim 0 is the batch cut to batch / m."""
    def cut(x):
        return x[: batch // m] if isinstance(x, torch.Tensor) and x.dim() and x.shape[0] == batch else x
    if isinstance(example_inputs, dict):
        return {k: cut(v) for k, v in example_inputs.items()}
    if isinstance(example_inputs, torch.Tensor):
        return cut(example_inputs)
    return tuple(cut(x) for x in example_inputs)


def _batch_of(example_inputs) -> int:
    xs = example_inputs.values() if isinstance(example_inputs, dict) else \
        (example_inputs,) if isinstance(example_inputs, torch.Tensor) else example_inputs
    for x in xs:
        if isinstance(x, torch.Tensor) and x.dim():
            return int(x.shape[0])
    raise ValueError("a pipeline splits the batch into microbatches, but no example input is a batched tensor")


# ----------------------------------------------------------------------------- one layer's cost, and the rest

@dataclasses.dataclass(frozen=True)
class LayerCosts:
    """What the stage model composes (per microbatch, per device of the sub-mesh)."""

    layer: Cost  # one layer (what no structure holds between layers included)
    first: Cost  # before the layers (embedding)
    last: Cost  # after them (final norm, head, loss)
    checkpoint: Cost | None  # one layer's checkpoint level: recompute, bytes it frees (negative), its transient
    boundary_bytes: float  # one layer's output per rank (the p2p message), bytes
    grad_share: float
    param_share: float
    sub_plan: Plan  # the one-layer model's plan on the sub-mesh
    gather_degree: int = 1  # plan 'fsdp': the ranks a stage's parameters are sharded over, gathered for the step
    between: Cost = dataclasses.field(default_factory=lambda: _combine([]))  # what no structure holds, per layer
    data_axes: tuple[str, ...] | None = None  # the sub-plan's data axes (its memory-fit variants keep them)


def _sub_plan(model, sub_sizes, inputs, plan, cluster, overrides, precision, optimizer="adam", cache=None, key=None,
              memory_limit=None, in_flight=1, data_axes_only=None):
    from autopar.agree import _local_tensor_off
    from autopar.prepare import _prepare
    from autopar.inputs import batch_dims
    from autopar.planner import build_priced
    if cache is not None and key in cache:  # captured once per (layers, microbatch): the search re-plans it
        info, captured, ctx = cache[key]
    else:
        info, captured, ctx = _prepare(model, sub_sizes, inputs, precision=precision)
        if cache is not None:
            cache[key] = (info, captured, ctx)
    batch = dict(zip(captured.user_inputs, batch_dims(captured.example_shapes)))
    shapes = dict(zip(captured.user_inputs, captured.example_shapes))
    with _local_tensor_off():
        kw = dict(memory_limit=memory_limit, in_flight=in_flight, data_axes_only=data_axes_only) \
            if memory_limit is not None else {}
        made, sol = build_priced(ctx, info, plan, overrides, batch, cluster=cluster, optimizer=optimizer,
                                 input_shapes=shapes, **kw)
    return info, ctx, made, sol


def _split(ctx, sol) -> tuple[list[Cost], list[Cost], list[list[Cost]]]:
    """The sites' costs before the layers, after them, and per layer (graph order)."""
    gm = ctx.captured.gm
    layers = find_layers(gm, set(ctx.captured.param_fqns) | set(ctx.captured.buffer_fqns))
    order = {n: i for i, n in enumerate(gm.graph.nodes)}
    by_name = {n.name: n for n in gm.graph.nodes}
    first_node = min((order[by_name[x]] for la in layers for x in la.nodes), default=0)
    pre, post, per_layer = [], [], [[] for _ in layers]
    for s in ctx.planning_sites():
        if s.key not in sol.per_site:
            continue
        c = sol.per_site[s.key]
        idx = next((i for i, la in enumerate(layers) if s.key == la.path or s.key.startswith(la.path + ".")), None)
        if idx is not None:
            per_layer[idx].append(c)
        elif order.get(s.node, 0) < first_node:
            pre.append(c)
        else:
            post.append(c)
    return pre, post, per_layer


def _boundary_bytes(ctx, sol, sub_plan: Plan, info) -> float:
    """The first layer's output activation, per rank of the sub-mesh: global microbatch bytes over the data and
    sequence axes, and over an axis the norms are sequence-parallel on (the residual stream is split there)."""
    gm = ctx.captured.gm
    layers = find_layers(gm, set(ctx.captured.param_fqns) | set(ctx.captured.buffer_fqns))
    if not layers:
        return 0.0
    inside = set(layers[0].nodes)
    outs = [n for n in gm.graph.nodes if n.name in inside and any(u.name not in inside for u in n.users)]
    val = outs[-1].meta.get("val") if outs else None
    nbytes = float(val.numel() * val.element_size()) if isinstance(val, torch.Tensor) else 0.0
    split = {*sol.data_axes, *sol.seq_axes}
    from autopar.forms.sequence_norm import SequenceNorm
    split |= {a for s in sub_plan.strategies if s.kind == "norm" and SequenceNorm.name in s.form for a in s.axes}
    return nbytes / math.prod(info.sizes[info.names.index(a)] for a in split if a in info.names)


def layer_costs(model, sub_sizes: dict, mb_inputs, *, plan="megatron", cluster=None, overrides=None,
                precision=None, optimizer="adam", cache: dict | None = None) -> LayerCosts:
    """One layer's cost and the rest's, from the model cut to one and to two layers (module docstring). `cache`: the
    captures by (layers, microbatch batch), kept across calls for one model and sub-mesh (the `auto` search)."""
    parent, layers = repeated_layers(model)
    one = _truncated(model, parent, 1)
    mb = _batch_of(mb_inputs)
    info, ctx1, plan1, sol1 = _sub_plan(one, sub_sizes, mb_inputs, plan, cluster, overrides, precision, optimizer,
                                        cache, (1, mb))
    pre, post, per1 = _split(ctx1, sol1)
    other1 = sol1.other or _combine([])
    if len(layers) >= 2:
        _, ctx2, _, sol2 = _sub_plan(_truncated(model, parent, 2), sub_sizes, mb_inputs, plan, cluster, overrides,
                                     precision, optimizer, cache, (2, mb))
        _, _, per2 = _split(ctx2, sol2)
        other2 = sol2.other or _combine([])
        between = _combine([other2, other1], [1.0, -1.0])  # what no structure holds, per layer
        between = dataclasses.replace(between, peak_bytes=0.0, reduce_transient_bytes=0.0)
        layer = _combine(per2[-1] + [between])
        ck2, ck1 = sol2.checkpoint_cost, sol1.checkpoint_cost
        ck = None if ck2 is None else dataclasses.replace(
            _combine([ck2, ck1] if ck1 is not None else [ck2], [1.0, -1.0] if ck1 is not None else [1.0]),
            transient_bytes=ck2.transient_bytes)
    else:
        between = _combine([])
        layer, ck = _combine(per1[0]), sol1.checkpoint_cost
    fixed_other = _combine([other1, between], [1.0, -1.0])
    pre_c, post_c = _combine(pre), _combine(post)
    # what no structure holds outside the layers: with the side holding more of the structures' compute
    if pre_c.compute_s > post_c.compute_s:
        pre_c = _combine([pre_c, fixed_other])
    else:
        post_c = _combine([post_c, fixed_other])
    stats, other, _ = gather_stats(ctx1)
    from cost_model.hardware import load_cluster
    mc = mesh_costing(ctx1, stats, other, info.names, info.sizes, sol1.data_axes, load_cluster(cluster, info.sizes),
                      optimizer=optimizer, seq_axes=sol1.seq_axes)
    if ck is not None:  # the level's transient is one layer's, its recompute and freed bytes scale with layers
        ck = dataclasses.replace(ck, memory_bytes=ck.act_bytes + ck.transient_bytes)
    return LayerCosts(layer=layer, first=pre_c, last=post_c, checkpoint=ck,
                      boundary_bytes=_boundary_bytes(ctx1, sol1, plan1, info), grad_share=mc.grad_share(),
                      param_share=mc.param_share(), sub_plan=plan1, between=between,
                      data_axes=tuple(sol1.data_axes) if plan == "auto" else None,
                      gather_degree=math.prod(info.sizes[info.names.index(a)] for a in sol1.data_axes)
                      if plan == "fsdp" else 1)


def _without_layer(plan: Plan, parent: str, i: int) -> Plan:
    """`plan` less layer i's strategies, placements and checkpoint level (a two-layer plan as a one-layer one)."""
    path = f"{parent}.{i}" if parent else str(i)
    inside = lambda t: t == path or t.startswith(path + ".")  # noqa: E731
    return dataclasses.replace(plan, strategies=tuple(s for s in plan.strategies if not inside(s.key)),
                               params=tuple(x for x in plan.params if not inside(x[0])),
                               checkpoint=tuple(x for x in plan.checkpoint if not inside(x[0])))


def stage_variant(model, sub_sizes: dict, mb_inputs, base: LayerCosts, *, memory_limit: float, in_flight: int,
                  cluster=None, overrides=None, precision=None, optimizer="adam", cache: dict | None = None):
    """The layer costs of the ILP's forms and checkpoint levels for a stage that holds `in_flight` microbatches at
    once within `memory_limit` (the two-layer model's budget, `auto_pipeline`), or None when no plan fits it: the
    ILP (`solver.solve(in_flight=)`) on the two-layer model of one microbatch, its second layer the per-layer cost
    (what no structure holds between layers as `base`'s, the unconstrained plan's), its levels' recompute and saved
    bytes half the two layers'."""
    from autopar.solver import InfeasibleError
    parent, layers = repeated_layers(model)
    if len(layers) < 2:
        return None
    mb = _batch_of(mb_inputs)
    try:
        info, ctx2, plan2, sol2 = _sub_plan(_truncated(model, parent, 2), sub_sizes, mb_inputs, "auto", cluster,
                                            overrides, precision, optimizer, cache, (2, mb),
                                            memory_limit=memory_limit, in_flight=in_flight,
                                            data_axes_only=base.data_axes)
    except InfeasibleError:
        return None
    pre, post, per2 = _split(ctx2, sol2)
    other2 = sol2.other or _combine([])
    stats, other, _ = gather_stats(ctx2)
    from cost_model.hardware import load_cluster
    mc = mesh_costing(ctx2, stats, other, info.names, info.sizes, sol2.data_axes, load_cluster(cluster, info.sizes),
                      optimizer=optimizer, seq_axes=sol2.seq_axes)
    layer = _combine(per2[-1] + [base.between])
    fixed_other = _combine([other2, base.between, base.between], [1.0, -1.0, -1.0])
    pre_c, post_c = _combine(pre), _combine(post)
    if pre_c.compute_s > post_c.compute_s:
        pre_c = _combine([pre_c, fixed_other])
    else:
        post_c = _combine([post_c, fixed_other])
    ck2 = sol2.checkpoint_cost
    ck = None if ck2 is None else dataclasses.replace(_scaled(ck2, 0.5), transient_bytes=ck2.transient_bytes)
    if ck is not None:
        ck = dataclasses.replace(ck, memory_bytes=ck.act_bytes + ck.transient_bytes)
    return LayerCosts(layer=layer, first=pre_c, last=post_c, checkpoint=ck,
                      boundary_bytes=_boundary_bytes(ctx2, sol2, plan2, info), grad_share=mc.grad_share(),
                      param_share=mc.param_share(), sub_plan=_without_layer(plan2, parent, 1), between=base.between)


# ----------------------------------------------------------------------------- the pipeline priced

def layer_time_s(lc: LayerCosts) -> float:
    """One layer's time per microbatch under `lc`'s forms and checkpoint level (what the cut balances)."""
    ck = lc.checkpoint
    return exposed_s(lc.layer) + (exposed_s(ck) if ck is not None else 0.0)


def price_pipeline(lc: LayerCosts, *, form: str, axis: str, p: int, m: int, v: int, num_layers: int, cluster,
                   full_sizes: tuple[int, ...], full_names: tuple[str, ...], optimizer: str = "adam",
                   memory_limit: float | None = None, cut: tuple[int, ...] | None = None,
                   rank_lcs: list[LayerCosts] | None = None):
    """(PipelinePlan, Estimate fields) of `num_layers` layers on p ranks x v stages, m microbatches. `rank_lcs`: per
    rank of the pipeline axis, the layer costs of its stages' own forms and checkpoint level (`auto_pipeline` plans
    each rank's stages for the microbatches it holds in flight); default `lc` for every rank. The cut (unless given)
    balances the per-layer times of each stage's own costs."""
    from cost_model.analytical import collective_time_s
    from cost_model.hardware import axis_link, load_cluster
    clus = load_cluster(cluster, full_sizes)
    n = p * v
    rank_lcs = list(rank_lcs) if rank_lcs is not None else [lc] * p
    if len(rank_lcs) != p:
        raise ValueError(f"rank_lcs holds {len(rank_lcs)} ranks' layer costs, the pipeline axis {p}")
    rank_of = [PipelinePlan(form, axis, m, v).stage_rank(k, p) for k in range(n)]
    lcs = [rank_lcs[rank_of[k]] for k in range(n)]  # per stage
    if cut is None and all(x is lcs[0] for x in lcs):
        cut = balanced_cut([layer_time_s(lcs[0])] * num_layers, n, exposed_s(lcs[0].first), exposed_s(lcs[0].last))
    elif cut is None:
        cut = balanced_cut([1.0] * num_layers, n, exposed_s(lcs[0].first), exposed_s(lcs[-1].last),
                           stage_layer_s=[layer_time_s(x) for x in lcs])
    pplan = PipelinePlan(form, axis, m, v, tuple(cut))
    link = axis_link(clus, full_sizes, full_names.index(axis))

    def p2p(nbytes):
        return collective_time_s("p2p", int(nbytes), 2, link) if p > 1 else 0.0
    stage_cost, stage_ck, chunk_s, stage_p2p, stage_compute = [], [], [], [], []
    for k in range(n):
        lk, layers = lcs[k], cut[k + 1] - cut[k]
        ck = lk.checkpoint
        layer_s = layer_time_s(lk)
        layer_c = lk.layer.compute_s + (ck.compute_s if ck is not None else 0.0)
        parts = [_scaled(lk.layer, layers)] + ([lk.first] if k == 0 else []) + ([lk.last] if k == n - 1 else [])
        c = _combine(parts)
        stage_cost.append(c)
        stage_ck.append(None if ck is None else dataclasses.replace(_scaled(ck, layers),
                                                                    transient_bytes=ck.transient_bytes))
        # its activation to the next stage, its input's gradient (of the previous stage's output) to the previous
        # one: over the link unless that stage is on the same rank (the turn of a V-shaped schedule)
        stage_p2p.append((p2p(lk.boundary_bytes) if k < n - 1 and rank_of[k + 1] != rank_of[k] else 0.0)
                         + (p2p(lcs[k - 1].boundary_bytes) if k > 0 and rank_of[k - 1] != rank_of[k] else 0.0))
        chunk_s.append(layers * layer_s + (exposed_s(lk.first) if k == 0 else 0.0)
                       + (exposed_s(lk.last) if k == n - 1 else 0.0) + stage_p2p[-1])
        stage_compute.append(layers * layer_c + (lk.first.compute_s if k == 0 else 0.0)
                             + (lk.last.compute_s if k == n - 1 else 0.0))
    pipe_s, bubble_s = pipe_cost.pipeline_time(form, p, m, chunk_s, rank_of)
    ranks = []
    for r in range(p):
        lc = rank_lcs[r]
        ks = [k for k in range(n) if rank_of[k] == r]
        held = [stage_cost[k] for k in ks]
        f = pipe_cost.in_flight(form, p, m, v, r)
        cks = [stage_ck[k] for k in ks if stage_ck[k] is not None]
        start = sum(c.act_bytes for c in cks) * f + max((c.transient_bytes for c in cks), default=0.0)
        # torch's schedule keeps each in-flight microbatch's stage output for its backward (`PipelineStage`'s
        # forward cache: autograd saves no layer's own output), and a stage receives its output's gradient into a
        # buffer of that size: on each stage that sends to a next one
        sending = sum(1 for k in ks if k < n - 1)
        boundary = lc.boundary_bytes * sending
        start += boundary * (f + 1)
        peak = peak_bytes([_with_activations(c, f) for c in held], lc.grad_share, start)
        later = pipe_cost.in_flight_later(form, p, m, v, r)
        if later > 0:  # a later microbatch's backward: every gradient accumulated, `later` microbatches in flight
            start_later = sum(c.act_bytes for c in cks) * later + max((c.transient_bytes for c in cks), default=0.0)
            start_later += boundary * (later + 1)
            peak = max(peak, _accumulating_bytes([_with_activations(c, later) for c in held], lc.grad_share,
                                                 start_later))
        order = pipe_cost.torch_order(form, p, m, v, r)
        if order is not None:  # the multi-stage schedules: the chunks held at each backward, from torch's own order
            peak = _schedule_peak(order, {k: stage_cost[k] for k in ks}, {k: stage_ck[k] for k in ks},
                                  lc, rank_of)
        if lc.gather_degree > 1:  # FSDP kept gathered through the step (module docstring)
            peak += _gathered_bytes(held, lc)
        rank_cost = _combine(held)
        compute = sum(stage_compute[k] for k in ks)
        exposed = sum(chunk_s[k] - stage_p2p[k] - stage_compute[k] for k in ks)
        opt_s = optimizer_step_s(held, optimizer, clus)
        # ZeRO-1's gather after the step (`Cost.step_gather_s`): once per step, after the optimizer
        tail = pipe_cost.tail_s(rank_cost.reduce_s, rank_cost.gather_s, opt_s, compute + exposed) \
            + rank_cost.step_gather_s
        state = rank_cost.memory_bytes - rank_cost.act_bytes - rank_cost.transient_bytes
        act = rank_cost.act_bytes + sum(c.act_bytes for c in cks)
        ranks.append(StageEstimate(
            key=f"{axis}={r}", stages=tuple(ks), layers=sum(cut[k + 1] - cut[k] for k in ks), compute_s=compute,
            p2p_s=sum(stage_p2p[k] for k in ks), tail_s=tail, exposed_s=exposed, optimizer_s=opt_s,
            sync_s=rank_cost.gather_s + rank_cost.reduce_s, parameters_bytes=int(state * lc.param_share),
            gradients_bytes=int(state * lc.grad_share),
            optimizer_bytes=int(state * (1 - lc.param_share - lc.grad_share)), activations_bytes=int(act),
            in_flight=f, peak_bytes=int(peak)))
    last = max(ranks, key=lambda s: s.tail_s)  # the rank that ends the step
    slow = max(ranks, key=lambda s: s.compute_s + s.exposed_s + s.p2p_s)  # the rank that sets the steady state
    step = pipe_s + last.tail_s
    memory = max(s.peak_bytes for s in ranks)
    limit = memory_limit if memory_limit is not None else clus.device_memory_bytes
    # step = compute + exposed communication + bubble, exactly: the slowest rank's microbatches, the last rank's tail
    compute_total = m * slow.compute_s + last.optimizer_s
    exposed_total = m * (slow.exposed_s + slow.p2p_s) + last.tail_s - last.optimizer_s
    # communication, hidden or not: the slowest rank's model-axis collectives and p2p per microbatch (the checkpoint
    # level's re-issued ones included), and the last rank's synchronisation of its parameters
    comm_total = m * sum(stage_cost[k].critical_s + (stage_ck[k].comm_s if stage_ck[k] is not None else 0.0)
                         + stage_p2p[k] for k in slow.stages) + last.sync_s
    fields = dict(step_time_s=step, compute_time_s=compute_total, comm_time_s=comm_total,
                  exposed_comm_s=exposed_total,
                  memory_bytes_per_device=int(memory), fits=memory <= limit, memory_limit_bytes=int(limit),
                  cluster=clus.name, bubble_s=bubble_s,
                  p2p_bytes_per_microbatch=int(max(x.boundary_bytes for x in lcs[:-1] or lcs)),
                  stages=tuple(ranks),
                  comm_bytes_per_step=int(m * 2 * sum(x.boundary_bytes for x in lcs[:-1]) / p))
    return pplan, fields, dict(pipe_s=pipe_s, bubble_fraction=bubble_fraction(form, p, m, v), chunk_s=chunk_s)


# ----------------------------------------------------------------------------- the plan

def default_stages_per_rank(form: str) -> int:
    return 2 if form in ("interleaved-1f1b", "zbv", "dualpipev") else 1


def torch_schedule_takes(form: str, p: int, m: int) -> bool:
    """Whether torch's schedule class for `form` accepts m microbatches on p ranks (its constructors' checks: 1F1B
    needs m >= p; interleaved 1F1B m a multiple of its rounds, max(1, m // p))."""
    if form == "1f1b":
        return m >= p
    if form == "interleaved-1f1b":
        return m % max(1, m // p) == 0
    return True


def plan_pipeline(model: nn.Module, mesh: dict, example_inputs, *, pipeline: str, microbatches: int | None,
                  stages_per_rank: int | None = None, plan="megatron", cluster=None, memory_limit=None,
                  overrides=None, precision=None, optimizer: str = "adam", cut: tuple[int, ...] | None = None,
                  divides: int = 1) -> Plan:
    """The priced pipelined plan of `model` on `mesh` (axis sizes), offline (module docstring). `microbatches=None`:
    the planner's choice, the least estimated step that fits among `microbatch_candidates` (those whose
    microbatch splits into `divides` equal parts: the runtime's data-parallel degree), said in the plan's
    '(pipeline)' decision. `cut`: price this stage cut (the runtime's) instead of the balanced one."""
    names = tuple(mesh)
    form, axis = parse_pipeline(pipeline, names)
    if not isinstance(plan, str) or plan not in ("auto", "megatron", "dp", "fsdp"):
        raise ValueError(f"a pipeline override plans its stages with a named plan ('auto', 'megatron', 'dp', "
                         f"'fsdp'), got plan={plan!r}")
    p = mesh[axis]
    v = default_stages_per_rank(form) if stages_per_rank is None else stages_per_rank
    parent, layers = repeated_layers(model)
    batch = _batch_of(example_inputs)
    if microbatches is not None and (not isinstance(microbatches, int) or isinstance(microbatches, bool)
                                     or microbatches < 1 or batch % microbatches):
        raise ValueError(f"pipeline {pipeline!r}: microbatches={microbatches!r} must be a positive integer dividing "
                         f"the batch ({batch}) so that every microbatch is alike. Fix: pick a divisor of {batch}")
    if p * v > len(layers):
        raise ValueError(f"pipeline {pipeline!r}: {p} ranks x {v} stages per rank = {p * v} stages, but "
                         f"{type(model).__name__} has {len(layers)} layers ({parent}) and each stage needs one. Fix: "
                         "fewer stages per rank, a smaller pipeline axis, or '1f1b'")
    PipelinePlan(form, axis, microbatches or 1, v)  # validates the form's stages per rank
    if cut is not None and (len(cut) != p * v + 1 or cut[-1] != len(layers)):
        raise ValueError(f"pipeline {pipeline!r}: the cut {list(cut)} is not one of {len(layers)} layers "
                         f"({parent}) into {p * v} stages")
    sub = {a: s for a, s in mesh.items() if a != axis} or {axis: 1}
    if microbatches is None:
        ms = [m for m in microbatch_candidates(batch // divides if batch % divides == 0 else batch, p * v)
              if batch % (m * divides) == 0 and torch_schedule_takes(form, p, m)]
        if not ms:
            raise ValueError(f"pipeline {pipeline!r}: no microbatch count splits the batch of {batch} rows over "
                             f"{divides} data-parallel rank(s). Fix: a batch that is a multiple of {divides}")
    else:
        ms = [microbatches]
    priced = []
    for m in ms:
        lc = layer_costs(model, sub, _microbatch(example_inputs, batch, m), plan=plan, cluster=cluster,
                         overrides=overrides, precision=precision, optimizer=optimizer)
        pplan, fields, extra = price_pipeline(lc, form=form, axis=axis, p=p, m=m, v=v, num_layers=len(layers),
                                              cluster=cluster, full_sizes=tuple(mesh.values()), full_names=names,
                                              optimizer=optimizer, memory_limit=memory_limit, cut=cut)
        priced.append((lc, pplan, fields, extra))
    decided_by, rows = None, ()
    if microbatches is None:
        fit = [x for x in priced if x[2]["fits"]]
        best = min(fit, key=lambda x: x[2]["step_time_s"]) if fit else \
            min(priced, key=lambda x: x[2]["memory_bytes_per_device"])
        tried = ", ".join(f"{x[1].microbatches}: {x[2]['step_time_s'] * 1e3:.1f} ms"
                          + ("" if x[2]["fits"] else " (does not fit)") for x in priced)
        decided_by = (f"override: {form}@{axis}; microbatches: the planner's choice, {best[1].microbatches}, the "
                      + ("least estimated step that fits" if fit else "least memory (none fits)")
                      + f" among the counts tried ({tried})")
        rows = tuple(CandidateRow(label=f"{form}@{axis}, {x[1].microbatches} microbatches",
                                  compute_s=x[2]["compute_time_s"], comm_s=x[2]["exposed_comm_s"],
                                  memory_bytes=x[2]["memory_bytes_per_device"], time_s=x[2]["step_time_s"],
                                  excluded="" if x[2]["fits"] else "does not fit") for x in priced)
    else:
        best = priced[0]
    lc, pplan, fields, extra = best
    return _full_plan(lc.sub_plan, pplan, fields, extra, mesh, sub, parent, len(layers), decided_by=decided_by,
                      rows=rows)


def _widen(pls: str, sub: dict, mesh: dict) -> str:
    """Placements on the sub-mesh -> on the whole mesh: replicated over the pipeline axis (a stage's parameters
    live on its stage's sub-mesh; inputs go whole to the stages that read them)."""
    if tuple(sub) == tuple(mesh):
        return pls
    got = dict(zip(sub, placements_from_str(pls)))
    return fmt_placements([got.get(a, R) for a in mesh])


def _relabel(text: str, parent: str, i: int) -> str:
    first = f"{parent}.0" if parent else "0"
    if text == first or text.startswith(first + "."):
        return (f"{parent}.{i}" if parent else str(i)) + text[len(first):]
    return text


def _full_plan(sub_plan: Plan, pplan: PipelinePlan, fields: dict, extra: dict, mesh: dict, sub: dict, parent: str,
               num_layers: int, decided_by: str | None = None, rows: tuple = (), name: str | None = None,
               layer_plans: list[Plan] | None = None) -> Plan:
    """The one-layer sub-plan's choices over every layer and the whole mesh, with the pipeline and its estimate.
    `layer_plans`: per layer, the sub-plan of its stage (`auto_pipeline`'s per-rank plans); the structures outside
    the layers take `sub_plan`'s (the first stage's)."""
    first = f"{parent}.0" if parent else "0"
    in_layer = lambda t: t == first or t.startswith(first + ".")  # noqa: E731
    layer_plans = layer_plans or [sub_plan] * num_layers
    by_key = [{x.key: x for x in lp.strategies} for lp in layer_plans]
    by_fqn = [dict(lp.params) for lp in layer_plans]
    strategies, params = [], []
    for s in sub_plan.strategies:  # the one-layer plan's order, each layer structure copied over every layer
        for i in (range(num_layers) if in_layer(s.key) else [None]):
            x = s if i is None else by_key[i].get(s.key, s)
            i = 0 if i is None else i
            strategies.append(dataclasses.replace(
                x, key=_relabel(x.key, parent, i), members=tuple(_relabel(y, parent, i) for y in x.members),
                params=tuple((_relabel(f, parent, i), _widen(pl, sub, mesh)) for f, pl in x.params)))
    for fqn, pl in sub_plan.params:
        for i in (range(num_layers) if in_layer(fqn) else [None]):
            got = pl if i is None else by_fqn[i].get(fqn, pl)
            params.append((_relabel(fqn, parent, 0 if i is None else i), _widen(got, sub, mesh)))

    def level_of(lp):
        (level,) = {lv for _, lv in lp.checkpoint} or {"none"}
        return level
    checkpoint = tuple((f"{parent}.{i}" if parent else str(i), level_of(lp)) for i, lp in enumerate(layer_plans))
    ranks = fields["stages"]
    worst = max(ranks, key=lambda s: s.peak_bytes)
    label = pplan.label
    est = sub_plan.estimate
    text = (f"pipeline {label}: {num_layers} layers cut {list(pplan.cut)} into {len(pplan.cut) - 1} stages "
            f"({pplan.stages_per_rank} per rank), {pplan.microbatches} microbatches; bubble "
            f"{fields['bubble_s'] * 1e3:.1f} ms of the {extra['pipe_s'] * 1e3:.1f} ms schedule (closed form "
            f"{extra['bubble_fraction']:.1%} on equal stages), p2p {fmt_bytes(fields['p2p_bytes_per_microbatch'])} "
            f"per microbatch per boundary, peak memory {fmt_bytes(worst.peak_bytes)} on {worst.key} "
            f"({worst.in_flight:g} microbatches in flight); every stage plans its layers as the one-layer "
            f"{sub_plan.name!r} plan on the sub-mesh {sub}")
    ranks_rows = tuple(CandidateRow(label=f"{s.key}: stages {list(s.stages)}, {s.layers} layers, {s.in_flight:g} in flight",
                              compute_s=s.compute_s * pplan.microbatches,
                              comm_s=s.p2p_s * pplan.microbatches + s.tail_s, memory_bytes=s.peak_bytes)
                 for s in ranks)
    decision = Decision(keys=(DECISION_KEY,), kind=PIPELINE_KEY, chosen=label,
                        decided_by=decided_by or (f"override: {label}, microbatches={pplan.microbatches}; the cut "
                                                  "balances the per-layer estimated time (embedding on the first "
                                                  f"stage, head and loss on the last): {text}"),
                        candidates=tuple(rows) or ranks_rows)
    from autopar.plan import Estimate
    estimate = Estimate(**fields, solver=f"pipeline over {pplan.axis}" + (f"; sub-mesh plan: {est.solver}"
                                                                          if est.solver else ""))
    notes = tuple(sub_plan.notes) + (text, "planned offline for estimating: autopar.parallelize runs the pipeline on its "
                                     "own capture (autopar.pipeline_runtime)")
    return Plan(name=name or sub_plan.name, mesh=tuple(mesh.items()), strategies=tuple(strategies), params=tuple(params),
                inputs=tuple((k, _widen(v, sub, mesh)) for k, v in sub_plan.inputs), directives=(), graph="",
                notes=notes, estimate=estimate, decisions=sub_plan.decisions + (decision,),
                precision=sub_plan.precision, checkpoint=checkpoint, pipeline=pplan)


# ----------------------------------------------------------------------------- plan="auto": the pipeline role chosen

# the schedules `auto` tries (form, stages per rank); DualPipeV is priced as ZB-V and left to an override
AUTO_FORMS = (("1f1b", 1), ("interleaved-1f1b", 2), ("zbv", 2))
PIPELINE_AXIS_NAMES = ("pp", "pipe", "pipeline")  # an axis so named is offered the pipeline role whatever fits


def microbatch_candidates(batch: int, p: int, most: int = 3) -> list[int]:
    """The microbatch counts `auto` tries: the smallest divisors of the batch at or above p, 2p and 4p (at least p
    microbatches fill the pipeline; more shrink the bubble and each microbatch's matmuls)."""
    divisors = [d for d in range(1, batch + 1) if batch % d == 0]
    out = []
    for target in (p, 2 * p, 4 * p):
        d = next((d for d in divisors if d >= target), None)
        if d is not None and d not in out:
            out.append(d)
    return out[:most] or [batch]


@dataclasses.dataclass
class Tried:
    label: str
    step_s: float
    bubble_s: float
    p2p_s: float
    memory_bytes: float
    fits: bool
    build: object = None  # () -> Plan
    pruned: str = ""  # why it was not fitted (`auto_pipeline`'s bound): priced with the unconstrained stage plan only


def auto_pipeline(model: nn.Module, mesh: dict, example_inputs, axis: str, *, cluster=None, memory_limit=None,
                  overrides=None, precision=None, microbatches: int | None = None, optimizer: str = "adam",
                  quick: bool = False, runnable: bool = False, best_s: float | None = None) -> list[Tried]:
    """Every pipeline over `axis` that `auto` weighs, priced: the outer search of Alpa's stage DP (Zheng et al.
    2022, `alpa/pipeline_parallel/stage_construction.py`) with the ILP inside. Per microbatch count, the ILP plans
    one microbatch of the one- and two-layer model on the sub-mesh (`layer_costs`, plan "auto", no memory limit:
    the fastest forms); every schedule is priced from those costs (`price_pipeline`). A rank whose peak (its
    layers, its in-flight microbatches under that schedule) is over the limit gets its own stage plan: the ILP on
    the two-layer model again with its in-flight count (`solver.solve(in_flight=)`: the activations and the levels'
    saved bytes counted that many times) and the rank's budget scaled to two layers (`stage_variant`), so the ILP
    itself trades FSDP, ZeRO, tensor parallelism and checkpoint levels for that rank; each rank then takes the
    fastest stage plan that fits it, and the cut is re-balanced on the ranks' own per-layer times (`_fit_ranks`).
    Stage plans are cached by (microbatch, in-flight count, budget): identical stages solve once, and a budget whose
    answer follows from one in hand is not solved (`_known`). The (schedule, microbatches) pairs are fitted in the
    order of a lower bound on their step, their pipeline time with the unconstrained stage plan on every rank (no
    memory-fit plan is faster, `_bound_ok`); a pair whose bound is no less than a fitting step in hand (`best_s`,
    e.g. the whole mesh's plan) cannot win and is not fitted: it is listed, `Tried.pruned` saying why.
    An outer search rather than one ILP: the microbatch count changes the shapes the ILP prices, and the bubble
    and the in-flight activations multiply the stage time and memory by functions of m, p and v that are not
    linear in the ILP's variables; identical layers make the ILP's classes one per layer kind whatever a stage's
    layer count, so one solve per (microbatch, in-flight count, budget) serves every stage.
    `quick`: only the most microbatches (the least activation memory: the search for a plan that fits at all).
    `runnable`: only what `autopar.pipeline_runtime` runs (for `parallelize(plan='auto')`,
    `autopar.pipeline_auto_run`): the named stage plans it lowers ('dp', 'fsdp', 'megatron' where the mesh takes
    them, not the ILP's free forms), each rank at the fastest checkpoint level that fits it (none under 'zbv'),
    microbatches that split over the stage plan's data-parallel degree, and no 'zbv' for a model with tied weights
    (the runtime refuses it there)."""
    p = mesh[axis]
    parent, layers = repeated_layers(model)
    batch = _batch_of(example_inputs)
    ms = [microbatches] if microbatches else microbatch_candidates(batch, p)[-1:] if quick else \
        microbatch_candidates(batch, p)
    sub = {a: s for a, s in mesh.items() if a != axis} or {axis: 1}
    plans, forms = [("auto", 1)], AUTO_FORMS
    if runnable:  # the named stage plans the runtime runs, at each checkpoint level (`autopar.pipeline_auto_run`)
        from autopar.pipeline_auto_run import stage_plans
        plans = stage_plans(model, mesh, axis)
        tied = len({id(q) for q in model.parameters()}) < len(list(model.named_parameters(remove_duplicate=False)))
        forms = tuple(f for f in AUTO_FORMS if not (tied and f[0] == "zbv"))
    cache: dict = {}
    runs = []  # per (microbatch count, schedule): what pricing it needs, and its bound
    for m in ms:
        if batch % m:
            continue
        mb = _microbatch(example_inputs, batch, m)
        for stage_plan, degree in plans:
            if batch % (m * degree):  # the runtime splits each microbatch over the data-parallel ranks
                continue
            lc = layer_costs(model, sub, mb, plan=stage_plan, cluster=cluster, overrides=overrides,
                             precision=precision, optimizer=optimizer, cache=cache)
            variants = {(): lc}  # stage plans by (in-flight count, two-layer budget); () the unconstrained one
            solved: dict[int, list] = {}  # per in-flight count: (budget, the ILP's answer) as solved, for `_known`

            def make(f, budget, mb=mb, lc=lc, variants=variants, solved=solved):
                key = (f, budget)
                if key not in variants:
                    known = _known(lc, f, budget, solved.get(f, ()))
                    if known is not None:
                        variants[key] = known[0]
                    else:
                        variants[key] = stage_variant(model, sub, mb, lc, memory_limit=budget, in_flight=f,
                                                      cluster=cluster, overrides=overrides, precision=precision,
                                                      optimizer=optimizer, cache=cache)
                        solved.setdefault(f, []).append((budget, variants[key]))
                return variants[key]
            if runnable:  # checkpoint levels only, each no faster than `lc` (no level): the bound below holds
                make = level_variants(model, sub, mb, stage_plan, lc, cluster=cluster, overrides=overrides,
                                      precision=precision, optimizer=optimizer, cache=cache)
            for form, v in forms:
                if p * v > len(layers) or (runnable and not torch_schedule_takes(form, p, m)):
                    continue
                kw = dict(form=form, axis=axis, p=p, m=m, v=v, num_layers=len(layers), cluster=cluster,
                          full_sizes=tuple(mesh.values()), full_names=tuple(mesh), optimizer=optimizer,
                          memory_limit=memory_limit)
                priced = price_pipeline(lc, **kw)
                runs.append(dict(m=m, form=form, lc=lc, kw=kw, make=make, variants=variants, priced=priced,
                                 bound=priced[2]["pipe_s"], stage_plan=stage_plan))
    # the least bound first; a schedule whose bound is no less than a fitting step in hand cannot win (`_bound_ok`)
    best = best_s if best_s is not None else math.inf
    out: dict[int, Tried] = {}
    for i in sorted(range(len(runs)), key=lambda i: runs[i]["bound"]):
        r = runs[i]
        m, form, lc, kw = r["m"], r["form"], r["lc"], r["kw"]
        named = f", {r['stage_plan']!r} stages" if runnable else ""
        if r["bound"] >= best and not r["priced"][1]["fits"] and _bound_ok(r["variants"], lc):
            fields = r["priced"][1]
            out[i] = Tried(f"{form}@{axis}, {m} microbatches{named}", fields["step_time_s"], fields["bubble_s"], 0.0,
                           fields["memory_bytes_per_device"], False,
                           pruned=f"not fitted: its pipeline with the fastest stage plan on every rank takes "
                                  f"{r['bound'] * 1e3:.1f} ms, no less than a step that fits, {best * 1e3:.1f} ms")
            continue
        # zbv under parallelize: no checkpoint level (`autopar.pipeline_auto_run`)
        rank_lcs, (pplan, fields, extra) = _fit_ranks(lc, kw, None if runnable and form == "zbv" else r["make"],
                                                      priced=r["priced"])
        slow = max(fields["stages"], key=lambda s: s.compute_s + s.p2p_s)
        label = f"{form}@{axis}, {m} microbatches{named}" + _stage_plans_text(rank_lcs, lc, axis)
        out[i] = Tried(label, fields["step_time_s"], fields["bubble_s"], m * slow.p2p_s,
                       fields["memory_bytes_per_device"], fields["fits"],
                       (lc, pplan, fields, extra, sub, parent, len(layers), rank_lcs))
        if fields["fits"]:
            best = min(best, fields["step_time_s"])
    return [out[i] for i in range(len(runs))]


def _bound_ok(variants: dict, lc: LayerCosts) -> bool:
    """Whether the pipeline time priced with `lc` on every rank bounds this microbatch count's steps from below: the
    memory-fit stage plans (`stage_variant`) trade speed for memory, so each layer is no faster than under the
    unconstrained plan (the ILP's fastest) and every chunk, the bubble and the schedule's time no shorter (the tail
    aside: the bound leaves it out). Checked on the stage plans solved so far: one faster than `lc` voids it."""
    return all(x is None or layer_time_s(x) >= layer_time_s(lc) * (1 - 1e-9) for x in variants.values())


def _two_layer_bytes(lc: LayerCosts, f: int) -> float:
    """The two-layer model's peak with f microbatches in flight under `lc` (what `solver.solve(in_flight=f)` caps)."""
    ck = lc.checkpoint
    parts = [_with_activations(c, f) for c in (lc.first, lc.layer, lc.layer, lc.last)]
    start = (2 * f * ck.act_bytes + ck.transient_bytes) if ck is not None else 0.0
    return peak_bytes(parts, lc.grad_share, start)


def _known(lc: LayerCosts, f: int, budget: float, solved) -> tuple[LayerCosts | None] | None:
    """The ILP's answer for f microbatches in flight within `budget` (two-layer bytes) when it follows from answers
    already in hand, else None (solve it): (the answer,). The ILP minimises the step under a memory cap, so its
    optimum under a cap stays optimal under any smaller cap it still fits: the unconstrained plan `lc` (solved
    without a limit: the fastest) when its two-layer peak with f in flight is within the budget, or an answer x solved
    under a larger budget B0 that its own peak fits (peak(x) <= budget <= B0); and no plan fits a budget at or below
    one no plan fitted. The peak is the stage model's (`_two_layer_bytes`, what `_fit_ranks` budgets by)."""
    if _two_layer_bytes(lc, f) <= budget:
        return (lc,)
    for b0, x in solved:
        if x is None and budget <= b0:
            return (None,)
        if x is not None and _two_layer_bytes(x, f) <= budget <= b0:
            return (x,)
    return None


def level_variants(model, sub: dict, mb_inputs, stage_plan: str, base: LayerCosts, *, cluster, overrides, precision,
                   optimizer, cache):
    """`make(in_flight, budget)` for `_fit_ranks` under `auto_pipeline(runnable=True)`: the layer costs of the named
    `stage_plan` at the fastest checkpoint level whose two-layer peak with that many microbatches in flight is
    within `budget`, else the leanest (the rank's own peak decides whether it fits). `base`: its costs at no level."""
    from autopar.forms import checkpoint as ckpt
    variants = {ckpt.DEFAULT.name: base}

    def at(level: str) -> LayerCosts:
        if level not in variants:
            variants[level] = layer_costs(model, sub, mb_inputs, plan=stage_plan, cluster=cluster,
                                          overrides={**(overrides or {}), ckpt.KEY: level}, precision=precision,
                                          optimizer=optimizer, cache=cache)
        return variants[level]

    def make(f: int, budget: float) -> LayerCosts:
        every = [at(lv) for lv in ckpt.LEVELS]
        fits = [x for x in every if _two_layer_bytes(x, f) <= budget]
        if fits:
            return min(fits, key=layer_time_s)
        return min(every, key=lambda x: _two_layer_bytes(x, f))
    return make


def _fit_ranks(lc: LayerCosts, kw: dict, make, rounds: int = 3, priced=None):
    """(per rank its layer costs, `price_pipeline` of them): every rank the fastest stage plan that fits it. For a
    rank the unconstrained plan `lc` does not fit, `make(in_flight, budget)` gives the ILP's plan for its in-flight
    count within a budget for the two-layer model: `lc`'s two-layer peak less what the rank is over, scaled from
    its L layers to two (the ILP's choices change every layer alike); over again: the budget shrunk by what is still
    over; fitting with room: grown by the room once (a faster plan may fit), `rounds` tries in all. The cut is then
    re-balanced on the chosen plans' per-layer times, until it no longer moves. `make` None: `lc` everywhere."""
    p, limit = kw["p"], kw["memory_limit"]
    priced = price_pipeline(lc, **kw) if priced is None else priced
    if make is None:
        return [lc] * p, priced
    limit = priced[1]["memory_limit_bytes"] if limit is None else limit
    pool = [lc]
    rank_lcs = [lc] * p

    def key(budget):  # rounded down to an 8th of a power of two: near budgets share a solve (`make`'s cache)
        return 2.0 ** (math.floor(math.log2(budget) * 8) / 8) if budget > 0 else 0.0
    for _ in range(rounds):
        cut = priced[0].cut
        peaks = {id(x): [s.peak_bytes for s in price_pipeline(x, **kw, cut=cut)[1]["stages"]] for x in pool}

        def add(x):
            if all(y is not x for y in pool):
                pool.append(x)
                peaks[id(x)] = [s.peak_bytes for s in price_pipeline(x, **kw, cut=cut)[1]["stages"]]
        for r, st in enumerate(priced[1]["stages"]):
            if peaks[id(lc)][r] > limit:
                # the in-flight count rounded up to a power of two (counting more activations than held: on the
                # safe side), so that ranks of near counts share a solve
                f = 2 ** math.ceil(math.log2(max(1.0, pipe_cost.in_flight(kw["form"], p, kw["m"], kw["v"], r))))
                per = 2.0 / max(1, st.layers)  # the two-layer model's bytes per byte of this rank's layers
                budget = _two_layer_bytes(lc, f) - (peaks[id(lc)][r] - limit) * per
                grown = False
                for _ in range(rounds):
                    x = make(f, key(budget)) if key(budget) > 0 else None
                    if x is None:
                        break
                    add(x)
                    over = peaks[id(x)][r] - limit
                    if over > 0:
                        budget = _two_layer_bytes(x, f) - over * per * 1.02
                    elif -over > 0.05 * limit and not grown:
                        budget, grown = _two_layer_bytes(x, f) - over * per * 0.98, True
                    else:
                        break
            fits = [x for x in pool if peaks[id(x)][r] <= limit]
            rank_lcs[r] = min(fits, key=layer_time_s) if fits else lc
        priced = price_pipeline(lc, **kw, rank_lcs=rank_lcs)
        if priced[0].cut == cut:
            break
    return rank_lcs, priced


def _stage_plan_text(x: LayerCosts) -> str:
    """A stage plan in a few words: its layer's forms, the share of its parameters sharded, its checkpoint level."""
    parts = sorted({f"{s.kind} {s.label}" for s in x.sub_plan.strategies if _layer_index_of(s.key)})
    params = [pl for fqn, pl in x.sub_plan.params if _layer_index_of(fqn)]
    sharded = sum(1 for pl in params if "S(" in pl)
    (level,) = {lv for _, lv in x.sub_plan.checkpoint} or {"none"}
    return (f"plan {x.sub_plan.name!r}: {', '.join(parts)}; {sharded}/{len(params)} layer parameters sharded; "
            f"checkpoint {level}")


def _layer_index_of(key: str) -> bool:
    return any(part.isdigit() for part in key.split("."))


def _stage_plans_text(rank_lcs: list[LayerCosts], lc: LayerCosts, axis: str) -> str:
    if all(x is lc for x in rank_lcs):
        return ""
    own = [f"{axis}={r}" for r, x in enumerate(rank_lcs) if x is not lc]
    return f" (memory-fit stage plans on {', '.join(own)})"


def choose(tried: list[Tried], unpipelined: Plan | None, unpipelined_why: str = "") -> tuple[object, str, tuple]:
    """(the winner: a Tried or the unpipelined Plan, what decided it, the rows for `Plan.explain`): the least
    estimated step among those that fit; when none fits, the pipeline needing the least memory (it says so)."""
    rows = [CandidateRow(label=t.label, compute_s=t.step_s - t.bubble_s - t.p2p_s, comm_s=t.p2p_s,
                         memory_bytes=int(t.memory_bytes), time_s=t.step_s,
                         excluded=t.pruned or ("" if t.fits else f"does not fit: {fmt_bytes(t.memory_bytes)} per device"))
            for t in tried]
    cands: list[tuple[float, str, object, float, float]] = [(t.step_s, t.label, t, t.bubble_s, t.p2p_s)
                                                            for t in tried if t.fits]
    if unpipelined is not None:
        e = unpipelined.estimate
        rows.append(CandidateRow(label="no pipeline (auto on the whole mesh)", compute_s=e.compute_time_s,
                                 comm_s=e.exposed_comm_s or 0.0, memory_bytes=e.memory_bytes_per_device,
                                 time_s=e.step_time_s, excluded="" if e.fits else "does not fit"))
        if e.fits:
            cands.append((e.step_time_s, "no pipeline", unpipelined, 0.0, 0.0))
    elif unpipelined_why:
        rows.append(CandidateRow(label="no pipeline (auto on the whole mesh)", excluded=unpipelined_why))
    if not cands:
        best = min(tried, key=lambda t: t.memory_bytes)
        return best, (f"no candidate fits the memory limit; {best.label} needs the least "
                      f"({fmt_bytes(best.memory_bytes)} per device)"), tuple(rows)
    cands.sort(key=lambda c: c[0])
    step, label, winner, bubble, p2p = cands[0]
    why = f"the least estimated step among {len(cands)} that fit: {label} {step * 1e3:.1f} ms"
    if isinstance(winner, Tried):
        mem = winner.memory_bytes
        why += f" (bubble {bubble * 1e3:.1f} ms, p2p {p2p * 1e3:.1f} ms, peak {fmt_bytes(mem)} per device)"
    if len(cands) > 1:
        s2, l2, w2, b2, _ = cands[1]
        why += f"; the next, {l2}, {s2 * 1e3:.1f} ms ({s2 / step - 1:+.1%})"
        if isinstance(winner, Tried) and isinstance(w2, Tried) and abs(b2 - bubble) > 1e-12:
            why += f", bubble {b2 * 1e3:.1f} ms"
    if unpipelined is None and unpipelined_why:
        why += f"; without a pipeline: {unpipelined_why}"
    elif unpipelined is not None and not unpipelined.estimate.fits:
        why += "; without a pipeline the plan does not fit the memory limit"
    return winner, why, tuple(rows)


def build_chosen(t: Tried, why: str, rows: tuple, mesh: dict) -> Plan:
    lc, pplan, fields, extra, sub, parent, n, rank_lcs = t.build
    p = mesh[pplan.axis]
    cut = pplan.cut
    layer_plans = [rank_lcs[pplan.stage_rank(k, p)].sub_plan for k in range(len(cut) - 1)
                   for _ in range(cut[k], cut[k + 1])]
    stage_lcs = [rank_lcs[pplan.stage_rank(k, p)] for k in range(len(cut) - 1)]
    plans = "; ".join(f"{pplan.axis}={r}: {_stage_plan_text(x)}" for r, x in enumerate(rank_lcs))
    if any(x is not lc for x in rank_lcs):
        why += f"; every rank's stage plan (the ILP's for its in-flight microbatches and memory): {plans}"
    else:
        why += f"; every rank's stage plan (the same on each): {plans}"
    from autopar.pipeline_auto_run import STAGE_PLAN_NOTE
    made = _full_plan(stage_lcs[0].sub_plan, pplan, fields, extra, mesh, sub, parent, n, decided_by=f"auto: {why}",
                      rows=rows, name="auto", layer_plans=layer_plans)
    return dataclasses.replace(made, notes=made.notes + (STAGE_PLAN_NOTE + lc.sub_plan.name,))
