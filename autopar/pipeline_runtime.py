"""Pipeline parallelism at run time (issue #23): the captured graph cut into stages, run on torch's schedules.

`parallelize(model, mesh, inputs, plan="dp", overrides={"pipeline": "1f1b@pp"}, microbatches=4)` comes here
(`parallelize_pipeline`). The contract it keeps (DESIGN.md §1, issue #23):

- **Stages from the captured graph.** The model is captured (`autopar.capture`) on one *microbatch*'s shapes and
  its repeated layers found (`autopar.layers.find_layers`); `balanced_cut` cuts them into `p * v` stages by their
  forward FLOPs (torch's own `flop_counter` formulas, run per node on meta tensors), the nodes before the first
  layer (embedding) going with stage 0 and those after the last (final norm, head, loss) with the last stage.
  Why the graph and not the `nn.Module`: what runs between the layers lives only in the model's `forward` code
  (Llama's rotary tables, GPT's position embedding, the loss), so a module cannot be cut without rewriting that
  code, while the captured graph has every op, each tagged with its module path; and unlike
  `torch.distributed.pipelining.pipeline()` it does not trace the model a second time (that tracer has open
  failures on HF models, notes/pipeline-zero-fp8.md §7). Each stage is an `fx.GraphModule` of its nodes, run by one
  `torch.distributed.pipelining.PipelineStage`; torch's schedules (`ScheduleGPipe`, `Schedule1F1B`,
  `ScheduleInterleaved1F1B`, `ScheduleZBVZeroBubble`) run them. Values that cross a stage boundary and depend on
  no parameter (rotary tables, masks, positions: computed from inputs, buffers and constants only, no random op)
  are recomputed in the stage that uses them rather than sent; every stage gets the microbatch's user inputs (the
  schedule's kwargs), so the p2p traffic is the activations that carry gradients: per microbatch and boundary,
  one send of each forward (`b_mb * s * h` for a transformer) and one of its gradient backward.
- **The loss and `backward()`.** A call in train mode with grad enabled runs the whole schedule, forward and
  backward of every microbatch, inside the call (that is how pipelining overlaps them); the gradients it leaves
  are taken off the stage's parameters, summed over the stage's data-parallel ranks (one all-reduce of one flat
  bucket per data axis), and held by the returned loss's autograd node. `loss.backward()` *releases* them: the
  node's backward returns `grad_output * gradient` for each of this rank's parameters, so autograd accumulates them
  into `.grad` as for any leaf: `(c * loss).backward()` gives c times the gradient, two calls then two backwards
  accumulate, and a loss never backpropagated leaves no gradient (the computed ones are dropped with it). The
  returned loss is the **global** loss on every rank (the last stage's microbatch losses summed, then one
  all-reduce over the pipeline axis and one per data axis; other ranks add zero). Under `torch.no_grad()` or
  `pm.eval()` the schedule runs forward only (`schedule.eval`).
- **Microbatch losses combine exactly.** The loss at the graph's output is rewritten to its sum form (a mean
  `cross_entropy` or `mse_loss` becomes `reduction="sum"`) and each microbatch's sum is multiplied by
  1 / (the global count the mean divides by): for cross-entropy the valid (not `ignore_index`) targets of the whole
  batch (under class weights, the sum of their targets' weights: ATen's weighted mean), counted before the step from
  the targets' own subgraph (which depends on the inputs only), so ignored labels spread unevenly over microbatches
  and data ranks weigh exactly as on one device; label smoothing's sum form adds up over microbatches as is.
  Probability targets and class weights computed from parameters raise `NotImplementedError`. Other outputs raise
  `NotImplementedError` (a model that returns logits, several outputs, an auxiliary loss added to the loss).
- **Parameters** keep their names on every rank (`pm.named_parameters()` matches the model's). Each is a `DTensor`
  on the sub-mesh of the ranks that run its stage (replicated over their data axes), as an owned expert weight is
  (`autopar.dtensors.owned_tensor`): whole there, empty elsewhere, so `torch.optim` (which skips a parameter
  without a gradient, as every other stage's is here), `state_dict`, `load_state_dict` of the single-device
  model's full tensors (`_full_to_placed`) and `full_tensor()` on the owning ranks work. Gradient clipping is
  `pm.clip_grad_norm_`: torch's `clip_grad_norm_` on `pm.parameters()` would see only this rank's stages.
  The stage's program runs on plain leaves that share the DTensors' local storage. A weight used by stages on
  several ranks (GPT-2's embedding tied to its head) is whole on each of them (a DTensor on the sub-mesh of those
  ranks, `_shared_mesh`); each computes its stages' part of the gradient and one all-reduce over them sums the
  parts, so every holder has the single-device gradient and steps alike.
- **Forms inside a stage** (`STAGE_PLANS`, on the mesh axes besides the pipeline axis: the stage's sub-mesh).
  `plan="dp"`: the stage's parameters replicated there, its gradients summed in one bucket per data axis after the
  schedule (above). `plan="fsdp"` (one data axis): torch's FSDP2 `fully_shard` on each stage module over its
  sub-mesh, with `reshard_after_forward=False` as torchtitan (Llama 3) runs PP with FSDP — the simplest sound
  alternative to re-planning each stage with autopar's own lowering, reusing what torch's pipelining already
  composes with (`PipelineStage` turns gradient sync off for every backward but the last). Per stage and step:
  one all-gather of its parameters at the first microbatch's forward, kept gathered across the microbatches, the
  gradients accumulated unsharded and reduce-scattered (summed: `set_gradient_divide_factor(1.0)`) once after the
  last backward; the pm's parameters are FSDP's `Shard(0)` DTensors on the sub-mesh (`_shard_stage`), and a
  forward-only call reshards after itself, so the next call gathers the stepped shards. Refused under `fsdp`: a
  weight used by two stages (`_refuse_weights_across_stages`), several data axes (HSDP). Every stage's metadata is
  static (`PipelineStage(input_args=, output_args=)`, meta tensors of the shapes the capture gives: `_examples`),
  so torch's schedules run no metadata inference (which was one real microbatch forward and backward, gradients
  dropped, on the first call and on each switch between forward-only and training calls: under FSDP one more
  all-gather, and a computation outside the stage's guard).
  `plan="megatron"` (a (pp, tp) or (pp, dp, tp) mesh): each stage's sub-graph planned and lowered by autopar's own
  planner and lowering on the stage's tp sub-mesh and run as a `ParallelModule` of its own (`autopar.pipeline_tp`:
  boundary values replicated over tp, so p2p carries plain whole activations; parameters DTensors with megatron's
  placements on the stage's sub-mesh, empty on other stages' ranks; the returned loss summed over the pipeline
  and data axes, each tp rank holding it whole). On (pp, dp, tp) each stage program runs on the tp line of this
  rank's (pp, dp) coordinate over its own rows, the parameters are DTensors on the stage's (dp, tp) sub-mesh
  ([Replicate(), megatron's placement], `pipeline_tp.outer_parameter`) and the gradients are summed over dp
  (`_sum_over_data`). With `norm: sequence` in the overrides (pp x tp, pp x dp x tp): Megatron sequence parallelism in every
  stage, the boundary activations crossing as each tp rank's sequence shard (`pipeline_tp.boundary_placements`).
  `mp_policy` (plan='fsdp' only) is FSDP2's own on each stage module (`fully_shard(..., mp_policy=)`): the graph is
  captured as `autopar.precision` captures it (param_dtype parameters, the layers' input casts), so the stages
  compute, gather and send activations in `param_dtype`, reduce-scatter in `reduce_dtype` (a plain SUM,
  `set_force_sum_reduction_for_comms`), and the masters and their gradients keep the model's dtype.

Errors reach every rank: building checks everything it can before its first collective and agrees on failure
(one all-gather; `autopar.agree`); each call checks out-of-range ids and labels and that the ranks pass the same
batch before any stage runs (`PipelineModule._check_call`). An exception raised inside one stage's computation (a
forward or backward that raises on one rank, a NaN check, an OOM) is raised on every rank right after the schedule,
not after the process group's timeout (torch's schedules have no cross-rank error path): each stage is a
`PipelineStage` subclass (`_guarded_stage`), and the schedule's loss function a wrapper, that record the exception
and go on with zeros in its place (the outputs' shapes, or zero input gradients), so the static schedule still posts every send and receive its peers
wait for and every rank runs it to its end; the failing rank adds NaN to the call's loss all-reduce, so every rank
of it sees a NaN loss; a NaN loss (only then) makes the ranks exchange what they recorded (`all_gather_object` over
the summed axes), and each raises the first failure by time, the failing rank its own exception, the others a copy
of its type and message, noting the rank, stage and microbatch (`PipelineModule._raise_failure`). The call's
gradients are dropped and the model stays usable for the next call. The normal path pays a try block per stage
computation and one read of the summed loss (a device-to-host sync on GPU). Why not abort the p2p group: on gloo
a timed-out wait cannot be retried, `Work` has no abort, and a destroyed group's connections stayed open inside
torch's schedule (issue #23's findings). Under plan='fsdp' a data rank whose every microbatch raised still meets
its peers in FSDP's reduce-scatter (the stand-ins give each parameter a zero gradient). Under plan='megatron' the
failing rank also issues the rest of its stage program's collectives on NaN (`_GuardedStage._finish`: the sequence
recorded from the stage's last complete run of that computation, `collectives.tracking` / `replay`), so its tp
peers never wait in an all-reduce it left, and the loss and the failure are summed over one group of the whole
mesh (the tp ranks but the first add zero). Before a stage's first real run the sequence comes from a dry run at
build (`_GuardedStage.learn_collectives`: the program's forward with and without grad and its backward as the
schedule splits it, on zeros, every collective a local stand-in of its result's shape, `collectives.dry_run`: no
communication, so nothing there can leave a peer waiting; the tests check it equals the real runs'), so a raise
in a stage's very first forward or backward is covered too. `zbv`'s forward-only walk (`_forward_only`) runs each
stage through the same guard (`_GuardedStage._forward`: stand-ins, replay). Not covered: expert-parallel stages
(`autopar.pipeline_ep`) before their first complete run: their all-to-all splits follow the routing, which a dry
run on zeros would not reproduce, so none is taken and a raise in their very first computation leaves the
peers waiting, as before.

`zbv` runs torch's `ScheduleZBVZeroBubble` (two stages per rank, V-shaped), refused for a model that uses a weight
twice (`_refuse_shared_weights`). Not implemented here (each raises `NotImplementedError` saying so): `dualpipev`;
the planner's other forms inside a stage (`plan` other than `STAGE_PLANS` and `megatron`);
`inputs="local"`; `mp_policy` under plan='dp'; calls whose shapes differ from the example's.

`pm.plan` is a `Plan` (`autopar.plan`): `pm.plan.pipeline` the `PipelinePlan` run (form, axis, microbatches, the
runtime's own cut; also `pm.pipeline_plan`), `pm.plan.estimate` the cost model's (`autopar.pipeline_estimate`) for
that cut, the stage plan ('dp' or 'fsdp') in the stages, as `autopar.plan` with the same override prices it; priced on first use.
`microbatches=None`: the cost model's choice (the least estimated step that fits among the counts that split over
the data-parallel ranks; one per stage, with a note, where it cannot price the model). `parallelize(plan="auto")`
on a mesh with a pipeline axis ("pp") comes here when `autopar.plan`'s auto, restricted to what this runtime runs,
chooses a pipeline (`autopar.api._auto_runnable`).
"""

from __future__ import annotations

import functools

import torch
import torch.distributed as dist
from torch import fx, nn
from torch.distributed.device_mesh import DeviceMesh
from torch.utils import _pytree as pytree

from autopar.pipeline_plan import IMPLEMENTED, PipelinePlan, balanced_cut, check_form, parse_pipeline

STAGE_PLANS = ("dp", "fsdp")  # what runs inside a stage, on the mesh axes besides the pipeline axis
aten = torch.ops.aten
_MEAN, _SUM = 1, 2  # ATen's reduction enum


# ----------------------------------------------------------------------------- entry point

def parallelize_pipeline(model: nn.Module, mesh: DeviceMesh, example_inputs, *, value: str, microbatches,
                         stages_per_rank, plan, overrides: dict, inputs: str, mp_policy,
                         auto=None) -> "PipelineModule":
    """`autopar.parallelize` with a `pipeline` override; see the module docstring. Every check runs on every rank;
    an error on one rank is raised on every rank (`autopar.agree`)."""
    from torch.distributed._local_tensor import local_tensor_mode
    names = tuple(mesh.mesh_dim_names or (f"axis{i}" for i in range(mesh.ndim)))
    form, axis = parse_pipeline(value, names)
    check_form(form, value)
    if local_tensor_mode() is not None:
        raise NotImplementedError(
            f"override 'pipeline': {value!r} under LocalTensorMode (simulated ranks): a pipeline sends activations "
            "point to point between processes, which simulated ranks do not have. Fix: run on real processes "
            "(torchrun, or gloo workers).")
    error, built = None, None
    try:
        built = _build(model, mesh, example_inputs, form, axis, names, microbatches, stages_per_rank, plan,
                       overrides, inputs, mp_policy, auto)
    except Exception as e:  # noqa: BLE001 - raised on every rank below
        error = e
    _agree(error, mesh)
    return built


def _agree(error: BaseException | None, mesh: DeviceMesh) -> None:
    """One all-gather of a flag: if any rank failed, every rank raises the first failing rank's error."""
    from autopar.agree import _raise_everywhere
    from autopar.dtensors import mesh_device
    flag = torch.tensor([1 if error is not None else 0], dtype=torch.int64, device=mesh_device(mesh))
    flags = [torch.empty_like(flag) for _ in range(dist.get_world_size())]
    dist.all_gather(flags, flag)
    failed = [r for r, f in enumerate(flags) if int(f)]
    if failed:
        _raise_everywhere(error, failed, len(flags), "while building the pipeline")


def _build(model, mesh, example_inputs, form, axis, names, microbatches, stages_per_rank, plan, overrides,
           inputs, mp_policy, auto=None):
    from autopar.capture import capture, split_example_inputs
    from autopar.inputs import batch_dims
    from autopar.layers import find_layers

    from autopar.pipeline_tp import TP_STAGE_PLANS, check_tp_stage
    value = f"{form}@{axis}"
    if not isinstance(plan, str) or plan not in STAGE_PLANS + TP_STAGE_PLANS:
        raise NotImplementedError(
            f"override 'pipeline': {value!r} with plan={plan!r}: inside a pipeline stage only "
            f"{STAGE_PLANS + TP_STAGE_PLANS} are implemented yet (issue #23: data parallelism or FSDP on the "
            "remaining mesh axes, or megatron's tensor parallelism on a (pp, tp) or (pp, dp, tp) mesh), not the "
            "planner's other forms (auto's per-stage choice, ring or ulysses attention, "
            "expert parallelism in a stage). Fix: plan='dp', 'fsdp' or 'megatron'.")
    tp = plan in TP_STAGE_PLANS
    stage_overrides = {}  # what the stage plans take besides the pipeline: megatron's `norm: sequence`
    if tp:
        from autopar.pipeline_tp import sp_overrides
        check_tp_stage(value, plan, names, axis, form)
        stage_overrides = sp_overrides(value, plan, overrides, names, axis)
    from autopar.pipeline_ep import ep_stage_axis
    rest = {k: v for k, v in (overrides or {}).items() if k not in stage_overrides}
    ep = ep_stage_axis(value, plan, rest, names, axis, form)  # moe=expert@AXIS in the stages, or None
    if inputs != "global":
        raise NotImplementedError(f"inputs={inputs!r} with a 'pipeline' override is not implemented yet: every rank "
                                  "passes the whole batch. Fix: inputs='global'.")
    if mp_policy is not None and plan != "fsdp":
        raise NotImplementedError(
            f"mp_policy with a 'pipeline' override and plan={plan!r} is not implemented yet (under plan='fsdp' it is "
            "FSDP2's own, per stage). Fix: plan='fsdp' on a (pipeline, data) mesh, or drop mp_policy.")
    p = mesh.size(names.index(axis))
    if stages_per_rank is None:
        stages_per_rank = 2 if form in ("interleaved-1f1b", "zbv") else 1
    data = [n for n in names if n != axis]
    if tp:  # megatron: tensor parallel on the last axis the pipeline leaves, data parallel on the others
        data = data[:-1]
    if plan == "fsdp" and len(data) != 1:
        raise NotImplementedError(
            f"override 'pipeline': {value!r} with plan='fsdp' on mesh axes {names}: FSDP inside a stage shards over "
            f"exactly one data axis (the one axis besides {axis!r}), got {len(data)} ({data or 'none'}); several "
            "data axes (HSDP) are not implemented yet. Fix: a 2-D mesh (pipeline axis, data axis), or plan='dp'.")
    degree = 1
    for n in data:
        degree *= mesh.size(names.index(n))
    priced = chosen_note = None
    if microbatches is None:  # the planner's choice: the cost model's least step among the counts that split
        microbatches, priced, chosen_note = _choose_microbatches(model, mesh, names, example_inputs, value,
                                                                 stages_per_rank, degree, plan, stage_overrides)
    if not isinstance(microbatches, int) or isinstance(microbatches, bool) or microbatches < 1:
        raise ValueError(f"microbatches must be a positive int, got {microbatches!r}")

    args, kwargs = split_example_inputs(example_inputs)
    flat, spec = pytree.tree_flatten((args, kwargs))
    if not all(isinstance(a, torch.Tensor) for a in flat):
        raise NotImplementedError("a 'pipeline' override with non-tensor inputs is not implemented yet; got "
                                  f"{[type(a).__name__ for a in flat]}. Fix: pass tensors only.")
    sizes = batch_dims([tuple(a.shape) for a in flat])
    batch = next((b for b in sizes if b), 0)
    if not batch or batch % (degree * microbatches):
        raise ValueError(
            f"override 'pipeline': {value!r}: the batch of {batch} rows does not split into {microbatches} "
            f"microbatches on each of the {degree} data-parallel rank(s) of mesh axes {data or '()'} "
            f"({degree} x {microbatches} = {degree * microbatches} must divide it). Fix: choose microbatches "
            f"dividing {batch // degree if batch % degree == 0 else batch} (the batch per data-parallel rank), or a "
            "batch that is a multiple of data-parallel degree x microbatches.")
    rows = batch // (degree * microbatches)
    mb_flat = [a[:rows] if b else a for a, b in zip(flat, sizes)]
    mb_args, mb_kwargs = pytree.tree_unflatten(mb_flat, spec)
    from autopar.precision import capture_dtypes, cast_inputs, mark_captured, precision_of
    precision = precision_of(mp_policy)
    mb_args, mb_kwargs = cast_inputs(precision, tuple(mb_args), dict(mb_kwargs))
    with capture_dtypes(model, precision):  # the program that runs: param_dtype parameters, layers' input casts
        captured = capture(model, tuple(mb_args), dict(mb_kwargs))
    mark_captured(captured, model, precision)
    state = set(captured.param_fqns) | set(captured.buffer_fqns)
    layers = find_layers(captured.gm, state)
    n_stages = p * stages_per_rank
    if len(layers) < n_stages:
        raise ValueError(
            f"override 'pipeline': {value!r} runs {n_stages} stages ({p} ranks on axis {axis!r} x {stages_per_rank} "
            f"per rank) but {type(model).__name__} has {len(layers)} repeated layer(s) "
            f"({', '.join(l.path for l in layers) or 'none found'}) and each stage needs at least one. Fix: "
            + (f"pipeline over an axis of at most {len(layers)} ranks, or fewer stages per rank." if layers else
               "this model has no repeated layers to cut between (autopar.layers.find_layers found none: e.g. one "
               "nn.LSTM holding all its layers): drop the 'pipeline' override and use a plan without a pipeline "
               "(dp, fsdp, megatron, auto), or pipeline a model built from a list of layers."))
    cut, checkpoint = None, []
    if auto is not None:  # parallelize(plan='auto'): the cut and per-layer levels it priced (`pipeline_auto_run`)
        cut, checkpoint = _auto_cut_and_levels(auto, layers, n_stages, value)
    split = _Split(captured, layers, n_stages, cut=cut)
    if form == "zbv":  # before any collective of the construction: every rank refuses alike
        _refuse_shared_weights(model, captured)
    if plan == "fsdp":
        _refuse_weights_across_stages(model, captured, split, plan)
    if ep is not None:
        _refuse_weights_across_stages(model, captured, split, f"dp with moe=expert@{ep}")
    pplan = PipelinePlan(form=form, axis=axis, microbatches=microbatches, stages_per_rank=stages_per_rank,
                         cut=split.cut)
    stage_plans = None
    if tp:  # every stage planned on every rank (offline, the same everywhere): every parameter's placements known
        stage_plans = _plan_tp_stages(model, mesh, captured, split, names.index(axis), plan, pplan, stage_overrides,
                                      checkpoint, priced=auto)
    if ep is not None:
        stage_plans = _plan_ep_stages(model, mesh, captured, split, names.index(axis), overrides,
                                      (mb_args, mb_kwargs), degree)
    pm = PipelineModule(model, mesh, captured, split, pplan, flat_spec=spec,
                        shapes=[tuple(a.shape) for a in flat], batched=[bool(b) for b in sizes],
                        data_axes=tuple(data), fsdp=plan == "fsdp", mp_policy=mp_policy, tp=stage_plans, ep_axis=ep,
                        checkpoint=checkpoint)
    pm._priced = (model, example_inputs, priced, chosen_note, auto, plan, stage_overrides)
    return pm


def _auto_cut_and_levels(auto, layers, n_stages: int, value: str) -> tuple[tuple, list]:
    """(the cut, [(layer path, level, its node names)] of the layers it recomputes) of the auto Plan `auto`, checked
    against this capture's layers (`autopar.pipeline_auto_run`)."""
    from autopar.pipeline_auto_run import checkpoint_levels
    cut = tuple(auto.pipeline.cut)
    paths = [la.path for la in layers]
    levels = checkpoint_levels(auto)
    unknown = sorted(set(levels) - set(paths))
    if len(cut) != n_stages + 1 or cut[-1] != len(layers) or unknown:
        raise ValueError(f"plan {auto.name!r} ({value}) was priced for a cut {list(cut)} of its layers and "
                         f"checkpoint levels on {sorted(levels)}, but this capture has {len(layers)} layers "
                         f"({', '.join(paths[:4])}{', ...' if len(paths) > 4 else ''}) in {n_stages} stages: the plan "
                         "was made for another model or mesh. Fix: re-plan with parallelize(plan='auto') on this model")
    return cut, [(la.path, levels[la.path], la.nodes) for la in layers if la.path in levels]


def _stage_levels(checkpoint: list, split, k: int) -> list:
    """The checkpointed layers (`_auto_cut_and_levels`) that stage k holds."""
    names = {n.name for n, s in split.stage.items() if s == k}
    return [c for c in checkpoint if names & set(c[2])]


def _checkpoint_stage(gm: fx.GraphModule, levels: list) -> fx.GraphModule:
    """Stage k's graph (`_Split.stage_graph`) with its checkpointed layers outlined into `Checkpointed` regions
    (`passes.checkpoint.checkpoint_layers_pass`, as lowering outlines a flat plan's): recomputed in backward at
    their level."""
    import types
    from passes.checkpoint import checkpoint_layers_pass
    if not levels:
        return gm
    return checkpoint_layers_pass(gm, types.SimpleNamespace(checkpoint=levels))


def _check_priced(priced, stage_plan, k: int) -> None:
    """Stage k's plan takes every structure's form as the auto Plan `priced` did (what runs is what was priced)."""
    want = {s.key: (s.form, tuple(s.axes)) for s in priced.strategies}
    got = {s.key: (s.form, tuple(s.axes)) for s in stage_plan.strategies}
    from autopar.forms import checkpoint as ckpt
    differ = sorted(key for key in got if key in want and want[key] != got[key])
    levels = dict(priced.checkpoint)  # a layer it names not: no level
    differ += [f"checkpoint {p}" for p, lv in stage_plan.checkpoint if levels.get(p, ckpt.DEFAULT.name) != lv]
    if differ:
        raise AssertionError(f"stage {k}'s plan differs from the priced plan {priced.name!r} at {', '.join(differ)}: "
                             f"{[(x, got.get(x), want.get(x)) for x in differ[:3]]}")


def _plan_tp_stages(model, mesh, captured, split, ax: int, plan: str, pplan: PipelinePlan,
                    overrides: dict | None = None, checkpoint: list = (), priced=None) -> dict:
    """Stage k -> (its Captured, MeshInfo, Plan, user inputs, tp mesh, sub-mesh, (its received activations'
    boundary placements, its outputs' placements)) on the sub-mesh of the ranks that run it
    (`autopar.pipeline_tp`), planned with `overrides` (`pipeline_tp.sp_overrides`: sequence parallelism).
    Refuses a weight used at two places of one stage (tied weights: one tensor, two placeholders), and a weight
    shared by several stages that their plans place differently (`pipeline_tp.check_shared_placements`)."""
    from autopar.pipeline_tp import (boundary_placements, check_shared_placements, plan_stage, stage_captured,
                                     stage_meshes)
    for names_, phs in _param_groups(model, captured):
        used = [ph for ph in phs if captured.placeholder(ph).users]
        if len(used) > 1:
            raise NotImplementedError(
                f"override 'pipeline' with plan={plan!r}: parameter {names_[0]!r} is one tensor under several names "
                f"used at several places ({', '.join(used)}); tied weights inside a tensor-parallel stage are not "
                "implemented yet. Fix: plan='dp', or untie the weight.")
    subs, lines = stage_meshes(mesh, ax)  # collective: every rank builds every stage's meshes, in coordinate order
    p = mesh.size(ax)
    out = {}
    for k in range(split.n_stages):
        gm, acts, user, st = split.stage_graph(k)
        cap = stage_captured(captured, gm, acts, user, st)
        rank = pplan.stage_rank(k, p)
        # the stage's layers at the levels auto priced for them: `checkpoint:<layer>` overrides of its plan
        levels = {f"checkpoint:{path}": lv for path, lv, _ in _stage_levels(list(checkpoint), split, k)}
        out[k] = (cap, *plan_stage(cap, lines[rank], plan, {**(overrides or {}), **levels} or None), user,
                  lines[rank], subs[rank])
    check_shared_placements(_param_groups(model, captured), captured, split, out, plan)
    if priced is not None:
        for k in out:
            _check_priced(priced, out[k][2], k)
    # the boundaries: each stage's received activations arrive as its plan places them, and the stage before
    # leaves its outputs so (p2p then carries each tp rank's own shard: 1/tp of the bytes under sequence
    # parallelism); the last stage's loss leaves replicated
    arrive = {k: boundary_placements(out[k][0], out[k][1], out[k][2], [u.name for u in split.acts[k]])
              if overrides and k > 0 else {} for k in out}
    for k in out:
        nxt = [u.name for u in split.acts[k + 1]] if k + 1 < split.n_stages else []
        leave = [arrive[k + 1].get(n) for n in nxt]
        out[k] = (*out[k], (arrive[k], leave if any(pls is not None for pls in leave) else None))
    return out


def _plan_ep_stages(model, mesh, captured, split, ax: int, overrides: dict, mb_inputs, ep: int) -> dict:
    """Stage k -> (its Captured, MeshInfo, Plan, user inputs, ep mesh, ep mesh) under expert parallelism in the
    stages (`autopar.pipeline_ep`): the model captured once more on the ep line's microbatch (`ep` x this rank's
    rows), cut where `split` is cut, each stage planned there with plan='dp' and the `moe` override."""
    from autopar.capture import capture
    from autopar.inputs import batch_dims
    from autopar.layers import find_layers
    from autopar.pipeline_ep import plan_ep_stage
    from autopar.pipeline_tp import stage_captured
    from autopar.dtensors import owner_meshes
    args, kwargs = mb_inputs
    flat, spec = pytree.tree_flatten((tuple(args), dict(kwargs)))
    dims = batch_dims([tuple(a.shape) for a in flat])
    flat = [a.repeat(ep, *[1] * (a.dim() - 1)) if d else a for a, d in zip(flat, dims)]
    g_args, g_kwargs = pytree.tree_unflatten(flat, spec)
    group = capture(model, tuple(g_args), dict(g_kwargs))
    state = set(group.param_fqns) | set(group.buffer_fqns)
    g_split = _Split(group, find_layers(group.gm, state), split.n_stages, cut=split.cut)
    subs = owner_meshes(mesh, ax)  # collective: every rank builds every stage's sub-mesh, in coordinate order
    p = mesh.size(ax)
    out = {}
    for k in range(split.n_stages):
        gm, acts, user, st = g_split.stage_graph(k)
        mine = split.stage_graph(k)[1:]
        assert (acts, user, st) == tuple(mine), (k, (acts, user, st), mine)  # the two captures cut alike
        cap = stage_captured(group, gm, acts, user, st)
        rank = k % p  # zbv (V-shaped) is refused here: stage k runs on k % p
        out[k] = (cap, *plan_ep_stage(cap, subs[rank], overrides), user, subs[rank], subs[rank])
    return out


def _choose_microbatches(model, mesh, names, example_inputs, value, v, degree, stage_plan="dp", overrides=None):
    """(m, the priced Plan, None) by the cost model (`pipeline_estimate.plan_pipeline` with microbatches=None, the stage
    plan in the stages, counts splitting over the data-parallel degree); where the cost model cannot price this model,
    (the number of stages, None, a note saying why)."""
    from autopar.pipeline_estimate import plan_pipeline
    sizes = {n: mesh.size(i) for i, n in enumerate(names)}
    try:
        priced = plan_pipeline(model, sizes, example_inputs, pipeline=value, microbatches=None, stages_per_rank=v,
                               plan=stage_plan, divides=degree, overrides=overrides or None)
    except (ValueError, NotImplementedError) as e:
        m = sizes[value.split("@", 1)[1]] * v
        return m, None, (f"microbatches: {m} (one per stage), not the cost model's choice: it could not price this "
                         f"model ({type(e).__name__}: {e})")
    return priced.pipeline.microbatches, priced, None


# ----------------------------------------------------------------------------- the cut

def _meta(v):
    if isinstance(v, torch.Tensor):
        return torch.empty(v.shape, dtype=v.dtype, device="meta")
    return v


def _node_flops(node: fx.Node) -> int:
    """Forward FLOPs of one node by torch's `flop_counter` formulas, run on meta tensors (composite ops such as
    `aten.linear` counted through their decomposition); 0 for ops without a formula or that do not run on meta
    (the count only balances the cut, it never changes what runs)."""
    from torch.utils.flop_counter import FlopCounterMode
    if node.op != "call_function" or not isinstance(node.target, torch._ops.OpOverload):
        return 0
    a, k = fx.node.map_arg((node.args, node.kwargs), lambda n: _meta(n.meta.get("val")))
    try:
        with FlopCounterMode(display=False) as counter:
            node.target(*a, **k)
    except Exception:  # noqa: BLE001 - see above
        return 0
    return counter.get_total_flops()


def _is_random(node: fx.Node) -> bool:
    return node.op == "call_function" and isinstance(node.target, torch._ops.OpOverload) and \
        torch.Tag.nondeterministic_seeded in node.target.tags


class _Split:
    """The captured graph's nodes assigned to stages, and what crosses each boundary.

    `stage[node]`: the stage of each call_function node (its layer's; a node outside the layers goes with the
    layer before it, or stage 0 before the first). `free`: nodes computed from inputs, buffers and constants only
    (no parameter, no random op): recomputed where used. `acts[t]`: for t >= 1, the values stage t receives from
    stage t-1, in graph order (the non-free values made before stage t and used at or after it)."""

    def __init__(self, captured, layers, n_stages: int, cut: tuple | None = None):
        gm = captured.gm
        self.captured, self.n_stages = captured, n_stages
        flops = {n.name: _node_flops(n) for n in gm.graph.nodes}
        layer_of = {name: i for i, l in enumerate(layers) for name in l.nodes}
        costs = [float(sum(flops[n] for n in l.nodes)) for l in layers]
        nodes = list(gm.graph.nodes)
        first_layer = min(i for i, n in enumerate(nodes) if n.name in layer_of)
        pre = post = 0.0
        current = None
        for i, n in enumerate(nodes):
            if n.name in layer_of:
                current = layer_of[n.name]
            elif current is None:
                pre += flops[n.name]
            elif current == len(layers) - 1:
                post += flops[n.name]
        # `cut`: another capture's (the same model on other shapes, `_plan_ep_stages`), else balanced here
        self.cut = tuple(cut) if cut is not None else balanced_cut(costs, n_stages, first=pre, last=post)
        stage_of_layer = {i: k for k in range(n_stages) for i in range(self.cut[k], self.cut[k + 1])}
        self.order = {n: i for i, n in enumerate(nodes)}
        self.stage: dict[fx.Node, int] = {}
        self.free: set[fx.Node] = set()
        kinds = {name: kind for name, kind, _ in captured.input_kinds}
        current = 0
        for i, n in enumerate(nodes):
            if n.op == "placeholder":
                if kinds[n.name] != "param":
                    self.free.add(n)
                continue
            if n.op == "output":
                continue
            if n.op != "call_function":
                raise NotImplementedError(f"pipeline stages of a graph with a {n.op!r} node ({n.name}) are not "
                                          "implemented")
            if n.name in layer_of:
                current = stage_of_layer[layer_of[n.name]]
            self.stage[n] = current
            if not _is_random(n) and all(u in self.free for u in n.all_input_nodes):
                self.free.add(n)
        for n, s in self.stage.items():
            for u in n.all_input_nodes:
                if u in self.stage and u not in self.free and self.stage[u] > s:
                    raise NotImplementedError(
                        f"pipeline stages: node {n.name} (stage {s}) uses {u.name} of the later stage "
                        f"{self.stage[u]}: the model's layers do not run one after another, which a pipeline needs")
        (out,) = [n for n in nodes if n.op == "output"]
        self.output = out
        uses: dict[fx.Node, set[int]] = {}
        for n, s in self.stage.items():
            for u in n.all_input_nodes:
                uses.setdefault(u, set()).add(s)
        # parameter placeholder -> the stages that use it (one, or several: a weight tied across stages); an
        # unused parameter goes with stage 0
        self.stages_of: dict[str, tuple[int, ...]] = {
            ph: tuple(sorted(uses.get(captured.placeholder(ph), ()))) or (0,) for ph in captured.param_fqns}
        self.acts: dict[int, list[fx.Node]] = {t: [] for t in range(n_stages)}
        for u, used in uses.items():
            if u not in self.stage or u in self.free:
                continue
            for t in range(self.stage[u] + 1, max(used) + 1):
                self.acts[t].append(u)
        for t in self.acts:
            self.acts[t].sort(key=self.order.__getitem__)
            for u in self.acts[t]:
                if not isinstance(u.meta.get("val"), torch.Tensor):
                    raise NotImplementedError(
                        f"pipeline stages: {u.name} ({u.target}) crosses from stage {t - 1} to stage {t} but is a "
                        f"{type(u.meta.get('val')).__name__}, not a tensor; only tensors are sent between stages")
        self.loss = self._loss_node()
        # the values that carry a gradient: floating point and computed from a parameter (what crosses a boundary
        # is not free, so it depends on a parameter or a random op; a random mask carries none)
        self.with_grad: set[fx.Node] = set()
        for n in nodes:
            if n.op == "placeholder" and kinds[n.name] == "param" or n.op == "call_function" and \
                    n.target is not aten.detach.default and any(u in self.with_grad for u in n.all_input_nodes):
                self.with_grad.add(n)

    def carries_grad(self, node: fx.Node) -> bool:
        val = node.meta.get("val")
        return node in self.with_grad and isinstance(val, torch.Tensor) and val.dtype.is_floating_point

    def _loss_node(self) -> fx.Node:
        """The loss at the graph's single output: cross-entropy or MSE, which the stage rewrites to a sum."""
        outs = pytree.tree_leaves(self.output.args)
        cap = self.captured
        if cap.num_user_outputs != 1 or len(outs) != 1 or not isinstance(outs[0], fx.Node) or \
                tuple(outs[0].meta["val"].shape) != ():
            raise NotImplementedError(
                "a 'pipeline' override needs a model whose forward returns its scalar loss (the last stage computes "
                f"it per microbatch); this one returns {cap.num_user_outputs} output(s). Fix: return the loss, e.g. "
                "F.cross_entropy(logits, labels), from forward.")
        loss = outs[0]
        if loss.target is aten.cross_entropy_loss.default:
            a = self._ce_args(loss)
            if loss.args[1].meta["val"].dtype.is_floating_point:
                raise NotImplementedError(
                    "a pipelined cross-entropy with probability (soft) targets is not implemented yet: its exact "
                    "combination over microbatches is not written. Fix: class-index targets (ignore_index, class "
                    "weights and label smoothing are fine).")
            w = a.get("weight")
            if isinstance(w, fx.Node) and w not in self.free:
                raise NotImplementedError(
                    f"a pipelined cross-entropy whose class weights ({w.name}) are computed from parameters: the "
                    "global weighted count its mean divides by must be known before the pipeline runs. Fix: class "
                    "weights from a buffer or a constant.")
            return loss
        if loss.target is aten.mse_loss.default:
            return loss
        raise NotImplementedError(
            f"the model's loss is computed by {loss.target} ({loss.name}): a pipeline combines the microbatch "
            "losses exactly for a loss returned straight from cross_entropy or mse_loss only (not e.g. a sum of a "
            "loss and an auxiliary loss) yet. Fix: return F.cross_entropy(...) or F.mse_loss(...) from forward.")

    @staticmethod
    def _ce_args(loss: fx.Node) -> dict:
        a = dict(zip(("input", "target", "weight", "reduction", "ignore_index", "label_smoothing"), loss.args))
        a.update(loss.kwargs)
        return a

    def reduction(self) -> int:
        loss = self.loss
        if loss.target is aten.cross_entropy_loss.default:
            return loss.args[3] if len(loss.args) > 3 else loss.kwargs.get("reduction", _MEAN)
        return loss.args[2] if len(loss.args) > 2 else loss.kwargs.get("reduction", _MEAN)

    def count(self, env: dict[str, torch.Tensor]) -> torch.Tensor:
        """What one microbatch's mean divides by: its valid targets (cross-entropy), their class weights' sum under
        class weights (ATen's weighted mean, with or without label smoothing: both its NLL and its smoothing term
        divide by that sum, and without weights by the valid count), its elements (MSE), computed from the inputs,
        buffers and constants in `env` (by placeholder name). Label smoothing needs nothing more: ATen's sum form
        is the per-token terms summed, so the microbatch sums add up to the batch's."""
        loss = self.loss
        if loss.target is aten.mse_loss.default:
            return torch.tensor(float(loss.args[0].meta["val"].numel()))  # moved with the sum below
        a = self._ce_args(loss)
        target, weight = a["target"], a.get("weight")
        if target not in self.free:
            raise NotImplementedError("a cross-entropy whose targets are computed from parameters cannot be counted "
                                      "before the pipeline runs")
        roots = [target] + ([weight] if isinstance(weight, fx.Node) else [])
        values: dict[fx.Node, object] = {}
        for n in sorted(self._ancestors(roots), key=self.order.__getitem__):
            if n.op == "placeholder":
                values[n] = env[n.name]
            else:
                args, kwargs = fx.node.map_arg((n.args, n.kwargs), values.__getitem__)
                values[n] = n.target(*args, **kwargs)
        ignore = a.get("ignore_index", -100)
        t = values[target]
        valid = t != ignore
        if isinstance(weight, fx.Node):
            return values[weight][t[valid]].sum()
        return valid.sum()

    def _ancestors(self, roots) -> set[fx.Node]:
        seen, todo = set(), list(roots)
        while todo:
            n = todo.pop()
            if n in seen:
                continue
            seen.add(n)
            todo.extend(n.all_input_nodes)
        return seen

    def stage_graph(self, k: int) -> tuple[fx.GraphModule, list[str], list[str], list[str]]:
        """Stage k's program: (graph module, its received activations' names, the user inputs it reads, the state
        (parameter, buffer, constant placeholders) it reads). Its placeholders are in that order; it returns the
        activations of stage k+1 (a tuple), or, on the last stage, the loss in its sum form."""
        gm = self.captured.gm
        own = [n for n, s in self.stage.items() if s == k]
        received = set(self.acts[k])
        # what the stage computes: its nodes, and the free values it uses from earlier stages (recomputed)
        todo, body = list(own), set(own)
        while todo:
            n = todo.pop()
            for u in n.all_input_nodes:
                if u.op == "placeholder" or u in body or u in received:
                    continue
                assert u in self.free, f"{u.name} crosses into stage {k} without being sent"
                body.add(u)
                todo.append(u)
        outs = self.acts[k + 1] if k + 1 < self.n_stages else [self.loss]
        for u in outs:
            if u not in body and u not in received:
                assert u in self.free or u.op == "placeholder", u
        phs = {u for n in body for u in n.all_input_nodes if u.op == "placeholder"}
        kinds = {name: kind for name, kind, _ in self.captured.input_kinds}
        user = sorted((u for u in phs if kinds[u.name] == "input"), key=self.order.__getitem__)
        st = sorted((u for u in phs if kinds[u.name] != "input"), key=self.order.__getitem__)
        g = fx.Graph()
        env: dict[fx.Node, fx.Node] = {}
        for u in [*self.acts[k], *user, *st]:
            env[u] = g.placeholder(u.name)
            env[u].meta = dict(u.meta)
        for n in sorted(body, key=self.order.__getitem__):
            new = g.node_copy(n, env.__getitem__)
            if n is self.loss and self.reduction() == _MEAN:  # the microbatch's sum; the schedule's loss_fn weighs it
                i = 3 if n.target is aten.cross_entropy_loss.default else 2
                new.args = (*new.args[:i], _SUM, *new.args[i + 1:]) if len(new.args) > i else new.args
                if len(n.args) <= i:
                    new.kwargs = {**new.kwargs, "reduction": _SUM}
            env[n] = new
        if k + 1 < self.n_stages:
            g.output(tuple(env[u] for u in outs))
        else:
            g.output(env[self.loss])
        g.lint()
        return fx.GraphModule(gm, g), [u.name for u in self.acts[k]], [u.name for u in user], [u.name for u in st]


# ----------------------------------------------------------------------------- the module

class _StageModule(nn.Module):
    """One stage as `PipelineStage` runs it: `forward(*received, **user_inputs)`. Its parameters are plain leaves
    sharing the storage of the ParallelModule's DTensors (the schedule accumulates their gradients)."""

    def __init__(self, gm: fx.GraphModule, acts: list[str], user: list[str], state_names: list[str],
                 state: dict[str, torch.Tensor], leaves: dict[str, nn.Parameter]):
        super().__init__()
        self.gm, self.acts, self.user = gm, acts, user
        self.state_names = state_names  # the graph's state placeholders, in order: parameters (leaves) and the rest
        self._state = state  # buffers and constants: read-only, not registered (they are the pm's)
        for name, leaf in leaves.items():
            self.register_parameter(name, leaf)

    def forward(self, *received, **inputs):
        values = [self._parameters[n] if n in self._parameters else self._state[n] for n in self.state_names]
        received = [_ContiguousGrad.apply(r) if isinstance(r, torch.Tensor) and r.requires_grad else r
                    for r in received]
        out = self.gm(*received, *(inputs[n] for n in self.user), *values)
        # what crosses a boundary is sent as a dense buffer and checked against the receiver's contiguous metadata
        # (a U-Net's skip connection is a channel slice of a concatenation: strided)
        if isinstance(out, tuple):
            return tuple(o.contiguous() if isinstance(o, torch.Tensor) else o for o in out)
        return out.contiguous() if isinstance(out, torch.Tensor) else out


class _ContiguousGrad(torch.autograd.Function):
    """Identity whose backward makes the gradient contiguous: a received activation's gradient is sent back to the
    stage before, whose buffers (and `PipelineStage`'s stride check) are contiguous; autograd may produce a strided
    one (the backward of a concatenation is a slice of the incoming gradient)."""

    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g):
        return g.contiguous()


class _ReleaseGrads(torch.autograd.Function):
    """The pipelined loss: forward returns the global loss; backward returns grad_output x the gradients the
    schedule already computed, for this rank's parameters (DTensors), so autograd accumulates them into `.grad`."""

    @staticmethod
    def forward(ctx, loss, grads, *params):
        ctx.grads = grads
        ctx.specs = [q._spec for q in params]
        return loss.clone()

    @staticmethod
    def backward(ctx, grad_output):
        from autopar.dtensors import _grad_dtensor
        out = [None if g is None else _grad_dtensor(g * grad_output.to(g.dtype), spec)
               for g, spec in zip(ctx.grads, ctx.specs)]
        return (None, None, *out)


# ----------------------------------------------------------------------------- an error inside a stage

class _StepFailure:
    """The exceptions raised inside this rank's stages during one call (`_GuardedStage`), each with where: the
    first one is raised on every rank after the schedule (`PipelineModule._raise_failure`)."""

    def __init__(self):
        self.errors: list[tuple[float, str, BaseException]] = []  # (time.time(), where, the exception)
        self.stood_in: set[tuple[int, int | None]] = set()  # (stage, microbatch) whose forward raised this call

    def record(self, error: BaseException, where: str) -> None:
        import time
        self.errors.append((time.time(), where, error))

    def clear(self) -> None:
        self.errors.clear()
        self.stood_in.clear()


class _StandIn(torch.autograd.Function):
    """What a stage whose computation raised passes on instead of its outputs: zeros of the outputs' shapes and
    dtypes, connected to the stage's inputs so that the schedule's backward runs through it (its backward sends
    zeros back for each input that needs a gradient), to the stage's parameters (each gets a zero gradient, so
    FSDP's reduce-scatter after the last microbatch runs on every rank of the stage even where every microbatch
    raised: a parameter without a gradient would be left out on this rank only) and to `anchor`, a fresh leaf that
    makes the outputs need a gradient as the real ones do (a first stage's, or the loss, whose inputs need none)."""

    @staticmethod
    def forward(ctx, metas, anchor, *inputs):
        ctx.inputs = inputs
        return tuple(torch.zeros(shape, dtype=dtype, device=anchor.device) for shape, dtype in metas)

    @staticmethod
    def backward(ctx, *grads):
        return (None, None, *(torch.zeros_like(i) for i in ctx.inputs))


def _stand_in(metas, last: bool, device, args, params=()):
    """`_StandIn` for a stage's call with positional inputs `args` and parameters `params` (the module's at the
    time: FSDP's unsharded ones in its forward): the loss (a tensor) for the last stage, else the tuple of its
    outputs."""
    anchor = torch.zeros((), device=device, requires_grad=torch.is_grad_enabled())
    inputs = [a for a in (*args, *params) if isinstance(a, torch.Tensor) and a.requires_grad]
    out = _StandIn.apply(metas, anchor, *inputs)
    return out[0] if last else out


def _examples(metas, grads) -> tuple[torch.Tensor, ...]:
    """Meta tensors of the (shape, dtype) `metas`, each requiring a gradient where `grads` says: a stage's inputs
    or outputs as `PipelineStage(input_args=, output_args=)` takes them, so torch's schedules know every stage's
    metadata statically and skip their runtime inference (a real forward and backward of one microbatch, on the
    first call and on each switch between forward-only and training calls)."""
    return tuple(torch.empty(shape, dtype=dtype, device="meta").requires_grad_(bool(g) and dtype.is_floating_point)
                 for (shape, dtype), g in zip(metas, grads, strict=True))


def _original(e: BaseException) -> BaseException:
    """The user's exception under torch's wrappers ('failed to run forward', 'Failed to run stage backward')."""
    while isinstance(e, RuntimeError) and e.__cause__ is not None and (
            "failed to run" in str(e).lower() or "stage backward" in str(e).lower()):
        e = e.__cause__
    return e


def _guarded_stage(submod: nn.Module, k: int, n: int, device, *, group, failure: _StepFailure, metas,
                   microbatches: int, static):
    """`PipelineStage` for stage k whose computation cannot leave the peers waiting: an exception raised by its
    forward or backward (a forward raising on one rank, a NaN check, an OOM) is recorded in `failure` and the stage
    goes on with `_StandIn` outputs (zeros) or zero input gradients, so the schedule still posts every send and
    receive its peers expect; the schedule is static, so each rank runs it to its end and the call raises after it
    on every rank (`PipelineModule._raise_failure`). Later microbatches run for real (each guarded again): a stage's
    own collectives (FSDP's gather) stay in step. Where torch lets a subclass compute: the forward
    (`forward_maybe_with_nosync`) and the backward (`backward_maybe_with_nosync`). `static`: (input_args,
    output_args) as `PipelineStage` takes them (`_examples`), so torch runs no metadata inference (a real forward
    and backward outside these two, on the first call and on each switch between forward-only and training)."""
    return _guarded_stage_class()(submod, k, n, device, group=group, failure=failure, metas=metas,
                                  microbatches=microbatches, static=static)


@functools.cache
def _guarded_stage_class():
    """The class, made on first use: `torch.distributed.pipelining` is imported only when a pipeline is built."""
    from torch.distributed.pipelining import PipelineStage

    class _GuardedStage(PipelineStage):
        def __init__(self, submod, k, n, device, *, group, failure, metas, microbatches, static):
            super().__init__(submod, k, n, device, input_args=static[0], output_args=static[1], group=group)
            self._failure, self._metas, self._m = failure, metas, microbatches
            self._chunk: tuple[str, int | None] = ("forward", None)
            # what -> the collectives of the stage program's last complete run of it (`collectives.tracking`):
            # "forward" (training, grad enabled), ("backward", torch's backward type); before the first real run,
            # the dry run's (`learn_collectives`)
            self._comms: dict = {}
            self._dry: dict = {}  # the dry run's, as learned (compared with the real runs' by the tests)

        def learn_collectives(self, kwargs: dict, split_backward: bool) -> None:
            """The stage program's collectives for each computation a call can run, learned before its first real
            run by running it once on zeros with local stand-ins for the collectives (`collectives.dry_run`: no
            communication, so no peer waits whatever happens here): its forward with and without grad, and its
            backward as torch's schedule runs it ("full"; under a zero-bubble schedule also "input" then "weight",
            but on the first stage, whose whole backward runs as "full"). Gradients it leaves are dropped. With them
            a raise in the stage's very first real computation still replays the rest (`_finish`). `kwargs`: the
            user inputs of one microbatch (zeros of their shapes)."""
            from autopar.runtime.collectives import dry_run, tracking
            from autopar.runtime.ops import _RNG_STREAMS
            streams = {k: list(v) for k, v in _RNG_STREAMS.items()}  # dropout's steps: put back after

            def forward(grad: bool):
                args = tuple(torch.zeros(m.shape, dtype=m.dtype, device=self.device).requires_grad_(
                    m.requires_grad and grad) for m in self._user_meta.inputs)
                log: list = []
                with torch.set_grad_enabled(grad), tracking(log):
                    out = self.submod(*args, **kwargs)
                self._comms[("forward", self.submod.training, grad)] = log
                return out, [*args, *(v for v in kwargs.values() if isinstance(v, torch.Tensor))]

            def backward(kind: str, bwd: dict):
                log: list = []
                with tracking(log):
                    out = PipelineStage.backward_maybe_with_nosync(self, kind, bwd)  # torch's, unguarded
                self._comms[("backward", kind)] = log
                return out

            with dry_run(), torch.random.fork_rng(devices=[]):
                forward(False)
                kinds = ["full"] + (["input"] if split_backward and not self.is_first else [])
                for kind in kinds:
                    out, inputs = forward(True)
                    if self.is_last:
                        bwd = {"stage_output": out if kind == "full" else (out,), "output_grads": None}
                    else:
                        bwd = {"stage_output": out, "output_grads": tuple(
                            torch.ones_like(o) if o.requires_grad else None for o in out)}
                    bwd["input_values"] = inputs
                    _, groups = backward(kind, bwd)
                    if kind == "input":
                        backward("weight", {"stage_output": bwd["stage_output"], "param_groups": groups})
            for q in self.submod.parameters():
                q.grad = None
            for k, v in streams.items():
                _RNG_STREAMS[k][:] = v
            self._dry = dict(self._comms)

        def _finish(self, what, log: list, failed: bool) -> None:
            """After one computation of the stage program (`what`) that issued the collectives `log`: a complete
            run's (nothing raised, and not the backward of a microbatch whose forward raised) is kept as the
            program's; a run that raised, or ran on stand-ins, issues the rest of the program's collectives on NaN
            (`collectives.replay`), so the peers of this rank's tensor-parallel group, which run the whole program,
            meet every collective they wait in, and see NaN. Nothing to replay when the program issues none (plan
            'dp'). Known before the stage's first real run from its dry run (`learn_collectives`, tensor-parallel
            stages), so its very first computation is covered too."""
            from autopar.runtime.collectives import replay
            known = self._comms.get(what)
            if not failed:
                self._comms[what] = log
                return
            if known is not None and len(log) < len(known):
                replay(known[len(log):])

        def _stood_in(self) -> bool:
            return (self.stage_index, self._chunk[1]) in self._failure.stood_in

        def _where(self, doing: str) -> str:
            what, i = self._chunk
            mb = "" if i is None else f" of microbatch {i} (0-based, of {self._m})"
            return f"pipeline stage {self.stage_index}'s {what}{mb}{doing}"

        def _forward(self, compute, args, doing=""):
            from autopar.runtime.collectives import tracking
            log: list = []
            what = ("forward", self.submod.training, torch.is_grad_enabled())  # eval and no_grad: other programs
            try:
                with tracking(log):
                    out = compute()
            except Exception as e:  # noqa: BLE001 - raised on every rank after the schedule
                self._failure.record(_original(e), self._where(doing))
                self._failure.stood_in.add((self.stage_index, self._chunk[1]))
                self._finish(what, log, True)
                return _stand_in(self._metas, self.is_last, self.device, args, self.submod.parameters())
            self._finish(what, log, False)
            return out

        def forward_one_chunk(self, fwd_chunk_id, *args, **kwargs):
            self._chunk = ("forward", fwd_chunk_id)
            return super().forward_one_chunk(fwd_chunk_id, *args, **kwargs)

        def backward_one_chunk(self, bwd_chunk_id, *args, **kwargs):
            self._chunk = ("backward", bwd_chunk_id)
            return super().backward_one_chunk(bwd_chunk_id, *args, **kwargs)

        def backward_weight_one_chunk(self, bwd_chunk_id, *args, **kwargs):
            self._chunk = ("weight backward", bwd_chunk_id)
            return super().backward_weight_one_chunk(bwd_chunk_id, *args, **kwargs)

        def forward_maybe_with_nosync(self, *args, **kwargs):
            return self._forward(lambda: super(_GuardedStage, self).forward_maybe_with_nosync(*args, **kwargs), args)

        def backward_maybe_with_nosync(self, backward_type, bwd_kwargs, last_backward=False):
            from autopar.runtime.collectives import tracking
            log: list = []
            what = ("backward", backward_type)
            try:
                with tracking(log):
                    out = super().backward_maybe_with_nosync(backward_type, bwd_kwargs, last_backward=last_backward)
            except Exception as e:  # noqa: BLE001 - raised on every rank after the schedule
                self._failure.record(_original(e), self._where(""))
                self._finish(what, log, True)
                values = bwd_kwargs.get("input_values") or ()
                return tuple(torch.zeros_like(v) if isinstance(v, torch.Tensor) and v.requires_grad else None
                             for v in values), None
            self._finish(what, log, self._stood_in())
            return out

    return _GuardedStage


class PipelineModule(nn.Module):
    """The pipelined model: `pm(*inputs)` returns the global loss on every rank (see the module docstring).
    `check_inputs` (True): the ranks check at each call that they pass the same batch (`_check_call`)."""

    check_inputs = True

    def __init__(self, model: nn.Module, mesh: DeviceMesh, captured, split: _Split, pplan: PipelinePlan, *,
                 flat_spec, shapes, batched, data_axes, fsdp: bool = False, mp_policy=None, tp: dict | None = None,
                 ep_axis: str | None = None, checkpoint: list = ()):
        super().__init__()
        from torch.distributed.pipelining.microbatch import TensorChunkSpec, _Replicate
        from torch.distributed.tensor import DTensor, Replicate, Shard
        from autopar.dtensors import mesh_device, owned_tensor
        from autopar.module import _non_persistent
        from autopar.spec import Owned

        names = tuple(mesh.mesh_dim_names)
        self._mesh, self._plan, self._split = mesh, pplan, split
        self._spec, self._shapes, self._batched, self._data_axes = flat_spec, shapes, batched, data_axes
        self._user_inputs = list(captured.user_inputs)
        ax = names.index(pplan.axis)
        p = mesh.size(ax)
        me = mesh.get_local_rank(ax)
        self._local_stages = [k for k in range(pplan.n_stages(p)) if pplan.stage_rank(k, p) == me]
        device = mesh_device(mesh)
        tensors = dict(model.named_parameters(remove_duplicate=False))
        self._owned: dict[str, nn.Parameter] = {}  # representative placeholder -> this rank's DTensor parameter
        self._leaf_of: dict[str, str] = {}  # every parameter placeholder -> its tensor's representative placeholder
        self._shared: dict[str, DeviceMesh] = {}  # representative -> the mesh of the ranks whose stages share it
        self._first_holder: dict[str, int] = {}  # representative of a shared weight -> its first holder on the axis
        self._names_of: dict[str, list[str]] = {}  # representative placeholder -> the parameter's names
        self._fsdp, self._mp_policy = fsdp, mp_policy
        self._tp = tp  # stage -> (Captured, MeshInfo, Plan, user inputs, tp mesh, sub-mesh) under tensor parallelism
        self._ep_axis = ep_axis  # expert parallelism in the stages (`autopar.pipeline_ep`): `tp` holds their plans
        for names, phs in _param_groups(model, captured):
            used = [ph for ph in phs if captured.placeholder(ph).users]
            stages = sorted({k for ph in used for k in split.stages_of[ph]}) or [0]
            rep = (used or phs)[0]
            owners = sorted({pplan.stage_rank(k, p) for k in stages})
            value = tensors[names[0]].detach().to(device)
            if len(owners) == 1:
                placements = [Owned(owners[0]) if i == ax else Replicate() for i in range(mesh.ndim)]
                dt = owned_tensor(value, mesh, placements)
            else:
                self._shared[rep] = _shared_mesh(mesh, ax, tuple(owners))
                self._first_holder[rep] = owners[0]
                dt = _shared_tensor(value, mesh, self._shared[rep], me in owners)
            if fsdp and me not in owners:  # FSDP's placement on the stage's sub-mesh, empty here (see below)
                dt = DTensor.from_local(dt.to_local(), dt.device_mesh, [Shard(0)], run_check=False, shape=dt.shape,
                                        stride=dt.stride())
            if tp is not None and me not in owners:  # the owning stage plan's placements on its sub-mesh, empty here
                placed = tp[stages[0]][2].param_placements()[captured.param_fqns[rep]]
                placed = [Replicate()] * (dt.device_mesh.ndim - len(placed)) + list(placed)  # dp: replicated
                dt = DTensor.from_local(dt.to_local(), dt.device_mesh, placed, run_check=False,
                                        shape=dt.shape, stride=dt.stride())
            param = nn.Parameter(dt, requires_grad=True)
            self._names_of[rep] = names
            for ph in phs:
                self._leaf_of[ph] = rep
            if any(k in self._local_stages for k in stages):
                self._owned[rep] = param
            for name in names:
                self._register(name, param)
        buffers = dict(model.named_buffers())
        state: dict[str, torch.Tensor] = {}
        for ph, fqn in captured.buffer_fqns.items():
            buf = buffers[fqn].detach().clone().to(device)
            persistent = fqn.rsplit(".", 1)[-1] not in _non_persistent(model, fqn)
            self._register(fqn, buf, buffer=True, persistent=persistent)
            state[ph] = buf
        for ph, t in captured.constants.items():
            state[ph] = t.to(device)
        self._leaves: dict[str, nn.Parameter] = {}
        for ph, param in self._owned.items():
            leaf = nn.Parameter(param._local_tensor)
            assert leaf.data_ptr() == param._local_tensor.data_ptr()
            self._leaves[ph] = leaf
        group = self._p2p_group = _p2p_group(mesh, ax)
        self._failure = _StepFailure()  # what this rank's stages raised during the current call
        n_stages = pplan.n_stages(p)

        def stage(sub, k):
            outs = split.acts[k + 1] if k + 1 < n_stages else [split.loss]
            metas = [(tuple(u.meta["val"].shape), u.meta["val"].dtype) for u in outs]
            metas = getattr(sub, "out_metas", None) or metas  # a tensor-parallel stage's: its local shards
            ins = getattr(sub, "in_metas", None) or [(tuple(u.meta["val"].shape), u.meta["val"].dtype)
                                                     for u in split.acts[k]]
            static = (_examples(ins, [split.carries_grad(u) for u in split.acts[k]]),
                      _examples(metas, [split.carries_grad(u) for u in outs]))
            return _guarded_stage(sub, k, n_stages, device, group=group, failure=self._failure, metas=metas,
                                  microbatches=pplan.microbatches, static=static)
        self._stages = []
        self._stage_modules: dict[int, _StageModule] = {}  # not registered: the stages hold the leaves
        if tp is not None:
            self._whole_group = _whole_group(mesh)  # collective, on every rank
            self._tp_holder: dict[str, int] = {}  # representative placeholder -> the local stage holding it
            from autopar.agree import agreed_seed
            seed = agreed_seed(mesh)  # collective, on every rank: one dropout seed for every stage's program
        for k in self._local_stages:
            if tp is not None:
                sub = self._tp_stage(k, tp[k], tensors, buffers, device, seed)
                self._stages.append(stage(sub, k))
                self._stage_modules[k] = sub
                continue
            gm, acts, user, st = split.stage_graph(k)
            gm = _checkpoint_stage(gm, _stage_levels(list(checkpoint), split, k))
            leaves = {n: self._leaves[self._leaf_of[n]] for n in st if self._leaf_of.get(n) in self._leaves}
            sub = _StageModule(gm, acts, user, st, {n: state[n] for n in st if n not in leaves}, leaves)
            if fsdp:
                self._shard_stage(sub, mesh, ax, me, leaves)
            self._stages.append(stage(sub, k))
            self._stage_modules[k] = sub
        if tp is not None and ep_axis is None:  # each stage program's collectives, before its first real run
            zeros = {n: torch.zeros(captured.placeholder(n).meta["val"].shape,
                                    dtype=captured.placeholder(n).meta["val"].dtype, device=device)
                     for n in self._user_inputs}
            for st in self._stages:
                st.learn_collectives(zeros, split_backward=pplan.form == "zbv")
        chunk = {n: TensorChunkSpec(0) if b else _Replicate for n, b in zip(self._user_inputs, batched)}
        failure, loss_dtype = self._failure, split.loss.meta["val"].dtype

        def loss_fn(output, weight):  # the schedule's, on the last stage; guarded as the stages are
            try:
                return _weigh(output, weight)
            except Exception as e:  # noqa: BLE001 - raised on every rank after the schedule
                last = next(st for st in self._stages if st.is_last)
                failure.record(e, f"the loss function on {last._where('')}")
                return _stand_in([((), loss_dtype)], True, device, [output])
        if pplan.form in ("gpipe", "1f1b"):
            from torch.distributed.pipelining import Schedule1F1B, ScheduleGPipe
            cls = ScheduleGPipe if pplan.form == "gpipe" else Schedule1F1B
            self._schedule = cls(self._stages[0], pplan.microbatches, loss_fn=loss_fn, kwargs_chunk_spec=chunk,
                                 scale_grads=False)
        else:
            from torch.distributed.pipelining import ScheduleInterleaved1F1B, ScheduleZBVZeroBubble
            cls = ScheduleInterleaved1F1B if pplan.form == "interleaved-1f1b" else ScheduleZBVZeroBubble
            self._schedule = cls(self._stages, pplan.microbatches, loss_fn=loss_fn, kwargs_chunk_spec=chunk,
                                 scale_grads=False)
        self._is_last = pplan.n_stages(p) - 1 in self._local_stages
        self._loss_dtype = split.loss.meta["val"].dtype
        self._state = state
        self._device = device
        self._captured = captured
        self._register_load_state_dict_pre_hook(_full_to_placed, with_module=True)
        from autopar.runtime import local_step  # an optimizer step on these DTensors runs on their local tensors
        local_step.install()
        local_step.register(list(self.parameters()))

    def _tp_stage(self, k: int, planned, tensors, buffers, device, seed: int):
        """Stage k under tensor parallelism (`autopar.pipeline_tp.TPStage`): the stage's ParallelModule on its
        sub-mesh; its DTensor parameters become the pm's under their names (the optimizer steps them)."""
        from autopar.pipeline_tp import TPStage, outer_parameter
        from autopar.runtime.ops import new_rng_stream
        cap, info, plan, user, sub_mesh, stage_mesh, *boundary = planned
        from autopar.pipeline_ep import EPStage
        stream = f"pp{id(self)}-stage{k}"
        new_rng_stream(stream, seed + k)
        if self._ep_axis is not None:
            sub = EPStage(cap, info, plan, sub_mesh, user, tensors, buffers, device, stream)
        else:
            arrivals, leaves = boundary[0]
            sub = TPStage(cap, info, plan, sub_mesh, user, tensors, buffers, device, stream, arrivals=arrivals,
                          leaves=leaves)
        for ph, fqn in cap.param_fqns.items():
            rep = self._leaf_of[ph]
            inner = sub.pm.get_parameter(fqn)  # the leaf the stage's backward accumulates into
            held = self._tp_holder.setdefault(rep, k)
            if held != k:
                raise NotImplementedError(
                    f"override 'pipeline' with plan='megatron': parameter {self._names_of[rep][0]!r} is used by "
                    f"stages {held} and {k}, both on this rank; "
                    "each tensor-parallel stage program holds its own copy of its weights, so a weight shared by "
                    "two stages of one rank would step one copy only. Fix: a schedule placing those stages on "
                    "different ranks ('1f1b', 'interleaved-1f1b'), or untie the weight.")
            # what the optimizer steps (the same storage): on the stage's sub-mesh, or for a weight stages on
            # several ranks share (tied embedding and head) on their sharing mesh, replicated over its first dim
            outer = outer_parameter(inner, self._shared.get(rep, stage_mesh))
            self._leaves[rep], self._owned[rep] = inner, outer
            for name in self._names_of[rep]:
                self._register(name, outer, replace=True)
        return sub

    def _shard_stage(self, sub: _StageModule, mesh: DeviceMesh, ax: int, me: int, leaves: dict) -> None:
        """FSDP2 inside a stage: torch's `fully_shard` on the stage module over the stage's sub-mesh (the data axis of
        the ranks at this pipeline coordinate), `reshard_after_forward=False` as torchtitan runs PP with FSDP: each
        stage's weights are all-gathered once, at its first microbatch's forward, and stay gathered across the
        microbatches; `PipelineStage` turns gradient sync off for every backward but the last, so the gradients
        accumulate unsharded and are reduce-scattered once after the last microbatch (`_post_backward`), after
        which the weights are resharded. The reduce-scatter sums (`set_gradient_divide_factor(1.0)`): each
        microbatch loss is already weighed by the global count. FSDP's sharded DTensors (`Shard(0)` on the
        sub-mesh) become the pm's parameters under their names: the optimizer steps FSDP's own shards."""
        from torch.distributed.fsdp import fully_shard
        from autopar.dtensors import owner_meshes
        sub_mesh = owner_meshes(mesh, ax)[me]  # every rank builds every stage's sub-mesh: creating one is collective
        kw = {} if self._mp_policy is None else {"mp_policy": self._mp_policy}
        fully_shard(sub, mesh=sub_mesh, reshard_after_forward=False, **kw)
        sub.set_gradient_divide_factor(1.0)
        sub.set_force_sum_reduction_for_comms(True)  # a plain SUM: gloo has no PREMUL_SUM (and the factor is 1)
        for name in leaves:
            rep = self._leaf_of[name]
            sharded = sub._parameters[name]
            if self._leaves[rep] is sharded:  # a weight used twice in this stage: one leaf, registered once
                continue
            self._leaves[rep] = self._owned[rep] = sharded
            for fqn in self._names_of[rep]:
                self._register(fqn, sharded, replace=True)

    def _register(self, fqn: str, value, buffer: bool = False, persistent: bool = True, replace: bool = False) -> None:
        from autopar.module import register_at
        register_at(self, fqn, value, buffer=buffer, persistent=persistent, replace=replace)

    @property
    def plan(self):
        """The `Plan` run (`autopar.plan.Plan`): `plan.pipeline` is the `PipelinePlan` this module runs (form, axis,
        microbatches, its actual cut), `plan.estimate` the cost model's for that cut (`autopar.pipeline_estimate`,
        'dp' in the stages, as `autopar.plan` with the same override and microbatches prices it), so `print(pm.plan)`
        and `pm.plan.explain()` work as for any plan. Priced on first use (offline, no collective); where the cost
        model cannot price this model the Plan has no estimate and a note says why."""
        if getattr(self, "_full_plan", None) is None:
            self._full_plan = _runtime_plan(self._mesh, self._plan, *self._priced)
        return self._full_plan

    @property
    def pipeline_plan(self) -> PipelinePlan:
        """The `PipelinePlan` run (also `pm.plan.pipeline`)."""
        return self._plan

    @property
    def mesh(self) -> DeviceMesh:
        return self._mesh

    @property
    def local_stages(self) -> list[int]:
        return list(self._local_stages)

    def _local_batch(self, flat: list[torch.Tensor]) -> list[torch.Tensor]:
        """This rank's rows of the global batch: its coordinate over the data axes (row-major) picks a slice."""
        names = tuple(self._mesh.mesh_dim_names)
        index, degree = 0, 1
        for n in self._data_axes:
            i = names.index(n)
            index = index * self._mesh.size(i) + self._mesh.get_local_rank(i)
            degree *= self._mesh.size(i)
        return [a.chunk(degree)[index] if b else a for a, b in zip(flat, self._batched)]

    def _weight(self, flat: list[torch.Tensor]) -> torch.Tensor:
        """1 / the global count a mean divides by (1 for a sum): the same on every rank (every rank has the whole
        batch), counted per microbatch of the whole batch on its own shapes."""
        if self._split.reduction() != _MEAN:
            return torch.tensor(1.0, dtype=self._loss_dtype, device=self._device)
        total = 0
        for mb in self._microbatches(flat):
            total = total + self._split.count({**mb, **self._state})
        return 1.0 / torch.as_tensor(total, dtype=self._loss_dtype, device=self._device)

    def _rows(self, flat) -> int:
        """Rows of one microbatch."""
        n = next(len(a) for a, b in zip(flat, self._batched) if b)
        degree = 1
        names = tuple(self._mesh.mesh_dim_names)
        for a in self._data_axes:
            degree *= self._mesh.size(names.index(a))
        return n // (degree * self._plan.microbatches)

    def forward(self, *args, **kwargs):
        flat, spec = pytree.tree_flatten((args, kwargs))
        shapes = [tuple(a.shape) if isinstance(a, torch.Tensor) else None for a in flat]
        if spec != self._spec or shapes != self._shapes:
            raise NotImplementedError(
                f"a pipelined model called with inputs of shapes {shapes}, not the example's {self._shapes}: "
                "re-cutting the stages for new shapes is not implemented yet (issue #23). Fix: call it with the "
                "example's shapes, or parallelize again for these.")
        flat = [a.to(self._device) for a in flat]  # the mesh's device (the user's batch may be on the host)
        self._check_call(flat, shapes)
        local = self._local_batch(flat)
        weight = self._weight(flat)
        w = weight.reshape(1).expand(self._plan.microbatches).contiguous()
        mb_kwargs = dict(zip(self._user_inputs, local))
        losses: list[torch.Tensor] = []
        train = self.training and torch.is_grad_enabled()
        # under FSDP the stages' parameters are the pm's own: the gradients a user's earlier backward left are put
        # aside while the schedule runs (it accumulates into .grad)
        held = [leaf.grad for leaf in self._leaves.values()] if self._fsdp or self._tp is not None else None
        self._failure.clear()
        if train:
            for leaf in self._leaves.values():
                leaf.grad = None
            self._schedule.step(target=w, losses=losses, return_outputs=False, **mb_kwargs)
        else:
            with torch.no_grad():
                if self._plan.form == "zbv":
                    losses = self._forward_only(local, weight)
                else:
                    self._schedule.eval(target=w, losses=losses, return_outputs=False, **mb_kwargs)
        total = torch.stack([l.detach() for l in losses]).sum() if self._is_last and losses else \
            torch.zeros((), dtype=self._loss_dtype, device=self._device)
        if self._failure.errors:  # the loss all-reduce carries it: every rank's sum is NaN (`_raise_failure`)
            total = torch.full((), float("nan"), dtype=self._loss_dtype, device=self._device)
        elif self._tp is not None and self._ep_axis is None and self._mesh.get_local_rank(self._tp_axis()) != 0:
            # each tp rank holds the same loss: counted once (`_sum_over_mesh`); an expert-parallel line's ranks
            # hold different rows, each its own part of the loss
            total = torch.zeros_like(total)
        total = self._sum_over_mesh(total.to(self._loss_dtype))
        if torch.isnan(total):
            self._raise_failure(held if held is not None else [None] * len(self._leaves))
        if self._mp_policy is not None and self._mp_policy.output_dtype is not None:  # FSDP2's output cast
            total = total.to(self._mp_policy.output_dtype)
        grads = [leaf.grad for leaf in self._leaves.values()]
        if held is not None:
            for leaf, g in zip(self._leaves.values(), held):
                leaf.grad = g
        elif train:
            for leaf in self._leaves.values():
                leaf.grad = None
        if not train:
            self._reshard()
            return total
        if self._fsdp:  # FSDP's reduce-scatter already summed them over the data axis: this rank's shards
            self._reshard()
            grads = [None if g is None else g.to_local() for g in grads]
        elif self._tp is not None:  # the stage programs' DTensor gradients: this rank's tensor-parallel shards
            # (expert parallelism: this rank's rows' part of a replicated weight's, summed over ep here; an
            # expert's whole on its owner)
            grads = self._sum_over_data([None if g is None else g.to_local() for g in grads],
                                        [self._replicated_on_data(q) for q in self._owned.values()])
            grads = self._sum_over_sharing_stages(grads)
        else:
            grads = self._sum_over_data(grads)
            grads = self._sum_over_sharing_stages(grads)
        return _ReleaseGrads.apply(total, grads, *self._owned.values())

    def _raise_failure(self, grads: list) -> None:
        """After the schedule, where the loss summed over the mesh is NaN: a NaN loss, or a stage's computation
        raised on some rank (`_guarded_stage`; that rank's contribution is NaN, so every rank of the sum sees it).
        Which: the ranks exchange what they recorded (`all_gather_object` over each summed axis, as the loss was
        summed: only here, so a step without a NaN pays nothing). No failure: return, the loss is NaN. Else every
        rank puts back the gradients it held before the call (none under plan='dp'), resets the FSDP stages, and
        raises the first failure (by time): the failing rank its own exception, the others a copy (same type and
        message), each with a note naming the rank, the stage and microbatch, and the other failures. The schedule
        ran to its end on every rank, so the model is usable for the next call."""
        from autopar.agree import _portable
        mine = [(t, dist.get_rank(), where, _portable(e)) for t, where, e in self._failure.errors]
        found = mine
        for group in self._summed_groups():
            box: list = [None] * dist.get_world_size(group)
            dist.all_gather_object(box, found, group=group)
            found = [f for part in box for f in part]
        if not found:
            return
        for leaf, g in zip(self._leaves.values(), grads):
            leaf.grad = g
        self._reshard()
        found.sort(key=lambda f: (f[0], f[1]))
        _, rank, where, err = found[0]
        others = "; ".join(f"rank {r}: {type(e).__name__} in {w}" for _, r, w, e in found[1:])
        note = (f"autopar: rank {rank} raised this in {where}, inside the pipeline schedule; it is raised on every "
                "rank, so none waits for the others (the other ranks ran the schedule to its end on zeros in its "
                "place); this call's loss and gradients are dropped and the model stays usable for the next call"
                + (f". Raised after it (e.g. on those zeros): {others}" if others else ""))
        self._failure.errors, own = [], self._failure.errors
        if rank == dist.get_rank() and own:
            first = min(own, key=lambda f: f[0])[2]
            first.add_note(note)
            raise first
        err.add_note(note)
        raise err

    def _reshard(self) -> None:
        """FSDP stages back to their shards after a call: a forward-only call (no backward reshards them) would
        otherwise leave gathered weights that the next call would use instead of the optimizer's updated shards."""
        if self._fsdp:
            for sub in self._stage_modules.values():
                sub.reshard()

    def _forward_only(self, local: list[torch.Tensor], weight: torch.Tensor) -> list[torch.Tensor]:
        """The microbatches' weighted losses (on the rank of the last stage), forward only: microbatch after
        microbatch, stage after stage in stage order, blocking p2p where consecutive stages sit on different ranks
        (every rank walks the same order, so each send meets its receive). For `zbv`, whose torch schedule cannot
        run forward only (torch 2.13: `ScheduleZBVZeroBubble.eval` asserts "can't steal_bwd_input if this stage
        doesn't have backward")."""
        names = tuple(self._mesh.mesh_dim_names)
        ax = names.index(self._plan.axis)
        p, me, group = self._mesh.size(ax), self._mesh.get_local_rank(ax), self._p2p_group
        n = self._plan.n_stages(p)
        where = [self._plan.stage_rank(k, p) for k in range(n)]
        m = self._plan.microbatches
        rows = next(len(a) for a, b in zip(local, self._batched) if b) // m
        losses = []
        for i in range(m):
            inputs = {name: (a[i * rows:(i + 1) * rows] if b else a)
                      for name, a, b in zip(self._user_inputs, local, self._batched)}
            carried: tuple = ()
            for k in range(n):
                if where[k] == me:
                    # guarded as in the schedule (`_GuardedStage._forward`): a raise is recorded, stood in for,
                    # and the rest of a tensor-parallel program's collectives replayed, so its tp peers go on
                    st, sub = self._stages[self._local_stages.index(k)], self._stage_modules[k]
                    st._chunk = ("forward", i)
                    out = st._forward(lambda: sub(*carried, **inputs), carried)
                    if k == n - 1:
                        losses.append(_weigh(out, weight))
                        continue
                    carried = tuple(out)
                    if where[k + 1] != me:
                        for t in carried:
                            dist.send(t.contiguous(), dst=dist.get_global_rank(group, where[k + 1]), group=group)
                        carried = ()
                elif k + 1 < n and where[k + 1] == me:  # stage k's outputs are stage k+1's inputs
                    metas = getattr(self._stage_modules[k + 1], "in_metas", None) or [
                        (u.meta["val"].shape, u.meta["val"].dtype) for u in self._split.acts[k + 1]]
                    carried = tuple(torch.empty(shape, dtype=dtype, device=self._device) for shape, dtype in metas)
                    for t in carried:
                        dist.recv(t, src=dist.get_global_rank(group, where[k]), group=group)
        return losses

    def _microbatches(self, flat: list[torch.Tensor]) -> list[dict[str, torch.Tensor]]:
        """The whole batch's microbatches (over every data-parallel rank), by placeholder name."""
        n, rows = next(len(a) for a, b in zip(flat, self._batched) if b), self._rows(flat)
        return [{name: (a[start:start + rows] if b else a) for name, a, b in zip(self._user_inputs, flat,
                                                                                  self._batched)}
                for start in range(0, n, rows)]

    def _check_call(self, flat: list[torch.Tensor], shapes) -> None:
        """Before any stage runs: an out-of-range token id or label raises one device's IndexError on every rank
        (`autopar.index_checks`, on every microbatch: every rank has the whole batch), and the ranks agree that
        they pass the same batch (`autopar.agree.agree_on_call`: one all-reduce of digests), so neither a bad id
        seen by one stage nor different batches leave the other stages waiting for p2p that never comes."""
        from autopar.agree import agree_on_call
        checks = self._captured.index_checks
        if checks is not None:
            for mb in self._microbatches(flat):
                error = checks(mb)
                if error is not None:
                    raise IndexError(error)
        if self.check_inputs:
            agree_on_call(("pipeline", f"inputs of shapes {shapes}"), self._mesh, None,
                          values=dict(zip(self._user_inputs, flat)))

    def _sum_over_mesh(self, t: torch.Tensor) -> torch.Tensor:
        """Summed over the pipeline axis and the data axes (not a tensor-parallel axis: each of its ranks holds
        the same loss)."""
        for group in self._summed_groups():
            dist.all_reduce(t, group=group)
        return t

    def _summed_groups(self) -> list:
        """The groups the call's loss (and a failure) is summed over: the pipeline axis and the data axes; under
        tensor parallelism one group of the whole mesh instead (the tp ranks other than the first add zero, or NaN
        where one failed: a tp rank whose program raised must reach its tp peers' pipeline lines too, and this is
        the one collective every rank of the call meets)."""
        if self._tp is not None:
            return [self._whole_group]
        names = tuple(self._mesh.mesh_dim_names)
        summed = {names.index(self._plan.axis), *(names.index(a) for a in self._data_axes)}
        return [self._mesh.get_group(i) for i in sorted(summed) if self._mesh.size(i) > 1]

    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0, error_if_nonfinite: bool = False):
        """`torch.nn.utils.clip_grad_norm_` over the whole pipelined model; returns the total norm (a plain tensor,
        the same on every rank). Call this one: torch's own on `pm.parameters()` sees only this rank's stages'
        gradients (each stage's DTensors live on their own sub-mesh, which no DTensor reduction spans), so it
        would clip by this rank's part of the norm. Each weight counts once: a data-parallel replica's gradient
        is the same (summed) gradient, and a weight tied across stages is counted by its first holder; one
        all-reduce over the pipeline axis."""
        names = tuple(self._mesh.mesh_dim_names)
        ax = names.index(self._plan.axis)
        me = self._mesh.get_local_rank(ax)
        grads = [q.grad.to_local() for q in self._owned.values() if q.grad is not None]
        counted = [q.grad.to_local() for rep, q in self._owned.items()
                   if q.grad is not None and self._first_holder.get(rep, me) == me and self._counts_here(q)]
        norm_type = float(norm_type)
        dtype = grads[0].dtype if grads else self._loss_dtype
        if counted:
            part = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g, norm_type) for g in counted]),
                                            norm_type).to(dtype)
        else:
            part = torch.zeros((), dtype=dtype, device=self._device)
        # under FSDP each data rank holds a different shard: its part is summed over the data axis too
        axes = [ax] + ([names.index(a) for a in self._data_axes] if self._fsdp else [])
        if self._tp is not None:  # tensor-parallel shards differ over the tp axis: their parts are summed there too
            axes.append(names.index(self._tp_axis()))
        if norm_type == float("inf"):
            for i in axes:
                dist.all_reduce(part, op=dist.ReduceOp.MAX, group=self._mesh.get_group(i))
            total = part
        else:
            part = part ** norm_type
            for i in axes:
                dist.all_reduce(part, group=self._mesh.get_group(i))
            total = part ** (1.0 / norm_type)
        if error_if_nonfinite and not torch.isfinite(total):
            raise RuntimeError(f"the total norm of order {norm_type} of the pipelined model's gradients is "
                               "non-finite, so it cannot be clipped (error_if_nonfinite=True)")
        scale = torch.clamp(max_norm / (total + 1e-6), max=1.0)
        for g in grads:
            g.mul_(scale.to(g.dtype))
        return total

    def _tp_axis(self) -> str:
        """The tensor-parallel axis inside the stages (megatron: the last axis the pipeline leaves; under expert
        parallelism the expert axis: its weights' parts are counted as tensor-parallel shards are)."""
        if self._ep_axis is not None:
            return self._ep_axis
        return [n for n in self._mesh.mesh_dim_names if n != self._plan.axis and n not in self._data_axes][-1]

    def _counts_here(self, q) -> bool:
        """Under tensor parallelism a gradient replicated over the tp axis counts once, on its first tp rank; a
        sharded one on every tp rank (each holds its shard)."""
        from torch.distributed.tensor import Replicate
        if self._tp is None:
            return True
        sub = q.device_mesh
        tp = list(sub.mesh_dim_names).index(self._tp_axis())
        return not isinstance(q.placements[tp], Replicate) or sub.get_local_rank(tp) == 0

    def _sum_over_sharing_stages(self, grads: list[torch.Tensor | None]) -> list[torch.Tensor | None]:
        """A weight used by stages on several ranks (tied embedding and head): each rank's gradient is its stages'
        part; summed over those ranks (one all-reduce per such weight, on its sharing mesh's pipeline dim), every
        holder has the whole gradient and steps alike. Every rank builds the same list (all such weights, in the
        same order); the ranks outside a weight's sharing mesh skip it."""
        out = list(grads)
        index = {ph: i for i, ph in enumerate(self._leaves)}
        for ph, sub in self._shared.items():
            if ph not in index:
                continue
            i = index[ph]
            leaf = self._leaves[ph]
            g = out[i] if out[i] is not None else torch.zeros_like(getattr(leaf, "_local_tensor", leaf))
            dist.all_reduce(g, group=sub.get_group(0))
            out[i] = g
        return out

    def _sum_over_data(self, grads: list[torch.Tensor | None], summed: list[bool] | None = None
                       ) -> list[torch.Tensor | None]:
        """The stage's gradients summed over its data-parallel ranks: one all-reduce of one flat bucket per data
        axis (the loss is already weighed by the global count, so a sum is the gradient). `summed`: which of them
        (default all; under expert parallelism not the experts', sharded over the data axis)."""
        names = tuple(self._mesh.mesh_dim_names)
        axes = [names.index(a) for a in self._data_axes if self._mesh.size(names.index(a)) > 1]
        summed = summed if summed is not None else [True] * len(grads)
        present = [g for g, s in zip(grads, summed) if g is not None and s]
        if not axes or not present:
            return grads
        flat = torch.cat([g.reshape(-1) for g in present])
        for i in axes:
            dist.all_reduce(flat, group=self._mesh.get_group(i))
        out, offset = [], 0
        for g, s in zip(grads, summed):
            if g is None or not s:
                out.append(g)
                continue
            out.append(flat[offset:offset + g.numel()].view_as(g))
            offset += g.numel()
        return out

    def _replicated_on_data(self, q) -> bool:
        """Whether parameter `q` (a DTensor on its stage's sub-mesh) is replicated over the stage's data axes
        (its gradient is summed there), not sharded over them (an expert under expert parallelism)."""
        from torch.distributed.tensor import Replicate
        sub = list(q.device_mesh.mesh_dim_names or ())
        return all(isinstance(q.placements[sub.index(a)], Replicate) for a in self._data_axes if a in sub)


def _param_groups(model: nn.Module, captured) -> list[tuple[list[str], list[str]]]:
    """Per parameter tensor of the model, in its order: (every name it has, every placeholder the capture gave it).
    Tied weights are one tensor under several names, which export may lift as several placeholders (GPT's
    `wte.weight` unused and `lm_head.weight` used by both the lookup and the head)."""
    ph_of = {fqn: ph for ph, fqn in captured.param_fqns.items()}
    groups: dict[int, tuple[list[str], list[str]]] = {}
    for name, q in model.named_parameters(remove_duplicate=False):
        names, phs = groups.setdefault(id(q), ([], []))
        names.append(name)
        if name in ph_of:
            phs.append(ph_of[name])
    return [g for g in groups.values() if g[1]]


def _p2p_group(mesh: DeviceMesh, ax: int) -> dist.ProcessGroup:
    """This rank's line along the pipeline axis as a process group of its own, for the stages' p2p only: a group
    on which ranks send different numbers of messages (a middle stage twice an end one) must not carry
    collectives too (gloo's DETAIL debug wrapper, for one, checks every collective's sequence number per group).
    Every rank creates every line's group, in the same order (`new_group` is collective)."""
    from autopar.mesh import collective_cached, layout_key

    def build() -> dist.ProcessGroup:
        lines = mesh.mesh.movedim(ax, -1).reshape(-1, mesh.size(ax))
        me, mine = dist.get_rank(), None
        for line in lines.tolist():
            g = dist.new_group(line)
            if me in line:
                mine = g
        return mine

    return collective_cached(("p2p", layout_key(mesh), ax), build)


def _whole_group(mesh: DeviceMesh) -> dist.ProcessGroup:
    """Every rank of the mesh as one process group (the loss and failure sum under tensor parallelism); created on
    every rank, once per mesh layout."""
    from autopar.mesh import collective_cached, layout_key
    return collective_cached(("whole", layout_key(mesh)), lambda: dist.new_group(sorted(mesh.mesh.flatten().tolist())))


def _shared_mesh(mesh: DeviceMesh, ax: int, owners: tuple[int, ...]) -> DeviceMesh:
    """The ranks whose coordinate on the pipeline axis `ax` is one of `owners`, as a mesh whose first dim runs over
    those owners (named `<axis>_shared`) and whose other dims are the other axes. Every rank builds every such mesh,
    in the same order (creating its process groups is collective)."""
    from autopar.mesh import collective_cached, layout_key

    def build() -> DeviceMesh:
        ranks = mesh.mesh.index_select(ax, torch.tensor(owners)).movedim(ax, 0)
        names = list(mesh.mesh_dim_names)
        names = [f"{names[ax]}_shared"] + names[:ax] + names[ax + 1:]
        return DeviceMesh(mesh.device_type, ranks, mesh_dim_names=tuple(names))

    return collective_cached(("shared", layout_key(mesh), ax, owners), build)


def _shared_tensor(full: torch.Tensor, mesh: DeviceMesh, sub: DeviceMesh, holder: bool):
    """A parameter that stages on several ranks use: rank 0's value (broadcast over the whole mesh, as
    `owned_tensor`), whole on the ranks of `sub` (replicated there), empty elsewhere."""
    from torch.distributed.tensor import DTensor, Replicate, distribute_tensor
    local = distribute_tensor(full.detach().clone(), mesh, [Replicate()] * mesh.ndim).to_local()
    if not holder:
        local = local.new_empty(0)
    return DTensor.from_local(local.clone(), sub, [Replicate()] * sub.ndim, run_check=False, shape=full.shape,
                              stride=full.stride())


def _refuse_shared_weights(model: nn.Module, captured) -> None:
    """Zero-bubble schedules split each backward into the input gradient and, later, the weight gradient
    (`torch.distributed.pipelining._backward.stage_backward_weight`); that split is known to be wrong for a weight
    used twice (issue #23), so a model whose program uses a parameter (under any of its tied names) at two places is
    refused under `zbv`."""
    for names, phs in _param_groups(model, captured):
        users = [u.name for ph in phs for u in captured.placeholder(ph).users]
        if len(users) > 1:
            raise NotImplementedError(
                f"pipeline form 'zbv': parameter {names[0]!r} is used {len(users)} times ({', '.join(users)}); "
                "torch's zero-bubble split of the backward into input and weight gradients is known to be wrong for "
                "a weight used twice, so autopar does not run it. Fix: use '1f1b' or 'interleaved-1f1b' for this "
                "model.")


def _refuse_weights_across_stages(model: nn.Module, captured, split: "_Split", plan: str = "fsdp") -> None:
    """FSDP inside stages shards each stage module's parameters on its own (`fully_shard` per stage), so a weight
    that two stages use (GPT-2's embedding tied to its head) would be two sharded copies with no gradient sum
    between them: refused under plan='fsdp'."""
    for names, phs in _param_groups(model, captured):
        stages = sorted({k for ph in phs if captured.placeholder(ph).users for k in split.stages_of[ph]})
        if len(stages) > 1:
            raise NotImplementedError(
                f"override 'pipeline' with plan={plan!r}: parameter {names[0]!r} is used by stages {stages}; a "
                f"weight shared by several stages under {plan} inside the stages is not implemented yet (each stage "
                "shards its own parameters). Fix: plan='dp' (whose tied weights are summed across their stages), or "
                "untie the weight.")


def _full_to_placed(module, state_dict, prefix, *_):
    """`load_state_dict` pre-hook: a plain full tensor (the single-device model's `state_dict()`) becomes this rank's
    part of the parameter's DTensor (whole where its stage runs, empty elsewhere), copied in place into the storage
    the stages' leaves share (under FSDP, this rank's shard of it, cut locally: every rank has the full tensor)."""
    from torch.distributed.tensor import DTensor, Replicate, distribute_tensor
    for name, param in module.named_parameters(remove_duplicate=False):
        key = prefix + name
        value = state_dict.get(key)
        if not isinstance(param, DTensor) or not isinstance(value, torch.Tensor) or isinstance(value, DTensor) or \
                tuple(value.shape) != tuple(param.shape):
            continue  # a DTensor loads as it is; a size mismatch is load_state_dict's to report
        local = value.detach().to(dtype=param.dtype, device=param.to_local().device)
        if param.device_mesh.get_coordinate() is None:
            local = local.new_empty(0)
        elif any(not isinstance(q, Replicate) for q in param.placements):  # FSDP's Shard(0): this rank's chunk
            local = distribute_tensor(local, param.device_mesh, param.placements, src_data_rank=None).to_local()
        state_dict[key] = DTensor.from_local(local, param.device_mesh, param.placements, run_check=False,
                                             shape=param.shape, stride=param.stride())


def _weigh(loss_sum: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """The schedule's loss_fn: one microbatch's loss sum x 1 / the global count (its `target` chunk, shape (1,))."""
    return loss_sum * weight.reshape(())


__all__ = ["IMPLEMENTED", "PipelineModule", "check_form", "parallelize_pipeline"]


def _runtime_plan(mesh: DeviceMesh, pplan: PipelinePlan, model, example_inputs, priced, chosen_note, auto,
                  stage_plan="dp", overrides=None):
    """`PipelineModule.plan`: the cost model's Plan for the pipeline this module runs (its cut, microbatches and
    stages per rank; 'dp' inside the stages, as run), with `pipeline` the runtime's own PipelinePlan. `priced`: the
    plan the microbatch count was chosen with (its decision kept); `auto`: the `plan='auto'` Plan that chose this
    pipeline (its name and '(pipeline)' decision kept). Offline: no collective, the same on every rank."""
    import dataclasses
    from autopar.pipeline_estimate import DECISION_KEY, plan_pipeline
    from autopar.plan import Plan
    names = tuple(mesh.mesh_dim_names or (f"axis{i}" for i in range(mesh.ndim)))
    sizes = {n: mesh.size(i) for i, n in enumerate(names)}
    notes = [chosen_note] if chosen_note else []
    if auto is not None and auto.pipeline == pplan:  # parallelize(plan='auto') ran what it priced: that plan
        return auto
    kw = dict(pipeline=pplan.label, microbatches=pplan.microbatches, stages_per_rank=pplan.stages_per_rank,
              plan=stage_plan, overrides=overrides or None)
    try:
        try:
            made = plan_pipeline(model, sizes, example_inputs, cut=pplan.cut, **kw)
        except ValueError as e:  # the cost model sees other layers than the runtime's cut: price its own cut
            made = plan_pipeline(model, sizes, example_inputs, **kw)
            notes.append(f"the estimate is for the cost model's cut {list(made.pipeline.cut)}, not the run one "
                         f"{list(pplan.cut)} ({e})")
    except (ValueError, NotImplementedError) as e:
        return Plan(name=stage_plan, mesh=tuple(sizes.items()), pipeline=pplan, notes=tuple(notes) + (
            f"no estimate: the pipeline cost model (autopar.pipeline_estimate) could not price this model "
            f"({type(e).__name__}: {e}); the pipeline runs {pplan.label}, cut {list(pplan.cut)}",))
    decisions = made.decisions
    chooser = auto if auto is not None else priced
    if chooser is not None:
        mine = tuple(d for d in chooser.decisions if DECISION_KEY in d.keys)
        decisions = tuple(d for d in decisions if DECISION_KEY not in d.keys) + mine
    return dataclasses.replace(made, name=auto.name if auto is not None else made.name, pipeline=pplan,
                               decisions=decisions, notes=made.notes + tuple(notes))
