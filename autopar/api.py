"""Public entry points: `parallelize(model, mesh, example_inputs) -> ParallelModule` and `plan(...) -> Plan`.

capture -> recognise -> plan -> lower -> run (DESIGN.md §2):

| step      | where                                                      |
|-----------|------------------------------------------------------------|
| capture   | `autopar.capture` (torch.export, opaque submodules, MoE)    |
| recognise | `passes.pipeline.RECOGNISE` (typed sites, `autopar.sites`) |
| plan      | `autopar.planner` (named plans, overrides; the ILP in `autopar.solver`; forms in `autopar.forms`) |
| agree     | `autopar.agree` (one fingerprint all-gather; rank 0 plans; errors raised on every rank) |
| lower     | `passes.lower.LOWER` (from the plan alone)                  |
| run       | `autopar.module.ParallelModule`                             |
"""

from __future__ import annotations

import dataclasses
import difflib
import itertools
import os
import time
import warnings

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.utils import _pytree as pytree

from autopar.agree import agree_on, agreed_seed, check_input_values, fingerprints, solve_on_rank0
from autopar.capture import split_example_inputs
from autopar.inputs import (batch_dims, check_mode, data_axes, data_degree, data_groups, local_arrivals)
from autopar.checks import check_given_plan, check_model, check_options
from autopar.dtensors import mesh_device
from autopar.mesh import MeshInfo, mesh_info
from autopar.module import ParallelModule
from autopar.plan import Plan
from autopar.precision import Precision, check_plan_precision, precision_of
from autopar.prepare import _prepare
from autopar.planner import PLANS, build_plan, check_batch, check_memory_limit, tie_placements
from autopar.relower import meta_to_device
from autopar.runtime.ops import new_rng_stream
from autopar.weights import is_meta_model
from passes import meta as M
from passes.lower import comm_rows, lower_context, lower_pass

__all__ = ["parallelize", "plan", "ParallelModule"]


def plan(model: nn.Module, mesh, example_inputs, *, plan="auto", cluster=None, memory_limit=None,
         overrides=None, lower=False, progress=None, mp_policy=None, microbatches=None, float8=None) -> Plan:
    """Plan without running anything: `mesh` may be a DeviceMesh or axis sizes such as {"dp": 8, "tp": 8},
    and the model may live on the meta device. Returns the Plan with its cost estimate; `lower=True` also
    lowers it (on fake tensors, no process group) so that it lists its collectives (`Plan.comms`) as
    `parallelize` would. `progress(stage, seconds)` is called after each stage (capture, recognise, solve,
    lower). `mp_policy`: a `torch.distributed.fsdp.MixedPrecisionPolicy` (`autopar.precision`), as in `parallelize`.
    `float8`: None, "tensorwise", "rowwise" or "auto": which linears run their GEMMs in fp8 (`autopar.float8`)."""
    check_model(model)
    model, float8, torchao_notes = _from_torchao(model, float8, plan)  # a torchao-converted model: plain linears
    chosen = _plan(model, mesh, example_inputs, plan=plan, cluster=cluster, memory_limit=memory_limit,
                   overrides=overrides, lower=lower, progress=progress, mp_policy=mp_policy, microbatches=microbatches,
                   float8=float8)
    return dataclasses.replace(chosen, notes=chosen.notes + torchao_notes) if torchao_notes else chosen


def _plan(model, mesh, example_inputs, *, plan, cluster, memory_limit, overrides, lower, progress, mp_policy,
          microbatches, float8) -> Plan:
    memory_limit = check_options(plan, cluster, memory_limit)
    precision = precision_of(mp_policy)
    check_float8(float8, plan, overrides)
    if isinstance(overrides, dict) and "pipeline" in overrides:
        return _plan_pipeline(model, mesh, example_inputs, plan=plan, cluster=cluster, memory_limit=memory_limit,
                              overrides=overrides, lower=lower, precision=precision, microbatches=microbatches)
    if plan == "auto" and not lower:
        return _auto_maybe_pipelined(model, mesh, example_inputs, cluster=cluster, memory_limit=memory_limit,
                                     overrides=overrides, progress=progress, mp_policy=mp_policy,
                                     precision=precision, microbatches=microbatches, float8=float8)
    if microbatches is not None:
        raise ValueError(f"microbatches={microbatches!r} splits the batch of a pipelined plan, but no axis is "
                         "pipelined. Fix: add overrides={'pipeline': 'FORM@axis'} (e.g. '1f1b@pp'), or drop "
                         "microbatches")
    return _plan_unpipelined(model, mesh, example_inputs, plan=plan, cluster=cluster, memory_limit=memory_limit,
                             overrides=overrides, lower=lower, progress=progress, precision=precision, float8=float8)


def _from_torchao(model, float8, plan) -> tuple:
    """(model, float8, notes): a model converted with torchao (`autopar.torchao_float8`) as plain linears, with its
    float8 choice ((module path, recipe), ...) as `float8` (which the user must leave None); a given or saved Plan
    already holds its float8 choice, which must be the model's. Otherwise as given, no notes."""
    from autopar.torchao_float8 import check_float8_option, unconvert
    got = unconvert(model)
    if got is None:
        return model, float8, ()
    plain, choice, notes = got
    check_float8_option(float8, choice)
    if isinstance(plan, str) and plan in PLANS:
        return plain, choice, notes
    given = plan if isinstance(plan, Plan) else Plan.load(os.fspath(plan))
    if tuple(sorted(given.float8)) != choice:
        raise ValueError(f"plan {given.name!r} runs {len(given.float8)} linear(s) in float8 "
                         f"({given.float8_summary() or 'none'}), but the model's torchao Float8Linear modules are "
                         f"{len(choice)} ({', '.join(f'{p} {r}' for p, r in choice[:3])}{', ...' if len(choice) > 3 else ''}). "
                         "Fix: re-plan the converted model (a plan name), or pass the model the plan was made for")
    return plain, None, notes


def _shown(float8) -> str:
    """`float8` as an error names it: a given choice (tuple) is a torchao-converted model's."""
    return "a torchao-converted model's float8 linears" if isinstance(float8, tuple) else f"float8={float8!r}"


def check_float8(float8, plan, overrides) -> None:
    """`float8=` is one of `autopar.forms.float8.OPTIONS`, on a named plan, without a pipeline."""
    from autopar.forms.float8 import check_option
    check_option(float8)
    if float8 is None:
        return
    if not (isinstance(plan, str) and plan in PLANS):
        raise ValueError(f"float8={float8!r} with a given or saved Plan: the float8 choice is part of the Plan "
                         "(`Plan.float8`). Fix: plan with a plan name and float8=..., or drop float8")
    if isinstance(overrides, dict) and "pipeline" in overrides:
        raise NotImplementedError(f"{_shown(float8)} with a 'pipeline' override: the stage model "
                                  "(autopar.pipeline_estimate) does not price float8 linears yet. Fix: drop float8, "
                                  "or plan without a pipeline")


def _auto_maybe_pipelined(model, mesh, example_inputs, *, cluster, memory_limit, overrides, progress, mp_policy,
                          precision, microbatches, runnable: bool = False, float8=None) -> Plan:
    """`auto` offline: the ILP's plan on the whole mesh, weighed against pipelining an axis named like a pipeline
    axis (`pipeline_estimate.PIPELINE_AXIS_NAMES`: "pp", ...) or, when no plan fits, any axis
    (`pipeline_estimate.auto_pipeline`: schedule, microbatches, checkpoint level and cut, the ILP inside each stage);
    the least estimated step that fits wins and its '(pipeline)' decision says what decided it (`Plan.explain`).
    `runnable` (`parallelize(plan='auto')`, `_auto_runnable`): only the pipelines the stage runtime runs."""
    from autopar import pipeline_estimate as pe
    from autopar.solver import InfeasibleError
    info = mesh_info(mesh)
    sizes = dict(zip(info.names, info.sizes))
    unpipelined, err = None, None
    try:
        unpipelined = _plan_unpipelined(model, mesh, example_inputs, plan="auto", cluster=cluster,
                                        memory_limit=memory_limit, overrides=overrides, lower=False,
                                        progress=progress, precision=precision, float8=float8)
    except InfeasibleError as e:
        err = e
    # no plan fits: any axis, but only where dividing the least plan's memory by the axis' size could fit (a
    # pipeline over p ranks holds at least about 1/p of it per device), each at its most microbatches only
    limit = err.limit_bytes if err is not None else None
    axes = [a for a in info.names if a in pe.PIPELINE_AXIS_NAMES and sizes[a] > 1] if err is None else \
        [a for a in info.names if sizes[a] > 1 and not err.least_bytes / sizes[a] > limit]
    if float8 is not None and axes:
        if err is not None:
            raise err
        return dataclasses.replace(unpipelined, notes=unpipelined.notes + (
            f"{_shown(float8)}: pipelines over {', '.join(map(repr, axes))} not weighed (the stage model does not "
            "price float8 linears yet)",))
    if not axes:
        if err is not None:
            raise err
        if microbatches is not None:
            raise ValueError(f"microbatches={microbatches!r} splits the batch of a pipelined plan, but auto pipelines "
                             f"only an axis named {' or '.join(map(repr, pe.PIPELINE_AXIS_NAMES))} (the mesh has "
                             f"{', '.join(info.names)}). Fix: name the axis 'pp', give overrides={{'pipeline': "
                             "'FORM@axis'}, or drop microbatches")
        return unpipelined
    tried, skipped = [], []
    for axis in axes:
        # the least step that fits so far (the whole mesh's plan, an axis pipelined before): a pipeline bounded
        # above it is not fitted (`auto_pipeline`)
        best_s = min([t.step_s for t in tried if t.fits] + ([unpipelined.estimate.step_time_s] if unpipelined
                                                             is not None and unpipelined.estimate.fits else []),
                     default=None)
        try:
            tried += pe.auto_pipeline(model, sizes, example_inputs, axis, cluster=cluster, memory_limit=memory_limit,
                                      overrides=overrides, precision=precision, microbatches=microbatches,
                                      quick=err is not None, runnable=runnable, best_s=best_s)
        except (ValueError, NotImplementedError) as e:  # noqa: PERF203 - a pipeline this model cannot take
            skipped.append(f"pipeline over {axis!r}: {e}")
    if not tried:
        if err is not None:
            raise err
        return dataclasses.replace(unpipelined, notes=unpipelined.notes + tuple(skipped))
    why = "" if err is None else f"no plan fits ({err})"
    winner, decided, rows = pe.choose(tried, unpipelined, why)
    if err is not None and not winner.fits:
        raise err
    if isinstance(winner, Plan):  # no pipeline: the plan as it was, with why the pipelines lost
        from autopar.plan import Decision
        d = Decision(keys=(pe.DECISION_KEY,), kind=pe.PIPELINE_KEY, chosen="no pipeline", decided_by=f"auto: {decided}",
                     candidates=rows)
        return dataclasses.replace(winner, decisions=winner.decisions + (d,), notes=winner.notes + tuple(skipped))
    return pe.build_chosen(winner, decided, rows, sizes)


def _plan_unpipelined(model, mesh, example_inputs, *, plan, cluster, memory_limit, overrides, lower, progress,
                      precision, float8=None) -> Plan:
    # offline planning: identical layers captured once and copied (autopar.repeated; parallelize captures all)
    info, captured, ctx = _prepare(model, mesh, example_inputs, progress=progress, precision=precision,
                                   reuse_layers=True)
    t0 = time.perf_counter()
    with _local_tensor_off():
        if float8 is None:
            chosen = _resolve_plan(plan, ctx, info, overrides, captured, cluster, memory_limit, _names(model))
        else:
            chosen = _plan_float8(plan, ctx, info, overrides, captured, cluster, memory_limit, float8)
    if progress:
        progress("solve", time.perf_counter() - t0)
    chosen = tie_placements(chosen, model, from_user=not (isinstance(plan, str) and plan in PLANS))
    if not lower:
        return chosen.with_comms((), captured.notes)
    t0 = time.perf_counter()
    with _local_tensor_off():
        lctx = lower_context(chosen, captured, info, rng_stream="plan")
        gm = lower_pass(captured.gm, lctx)
    if progress:
        progress("lower", time.perf_counter() - t0)
    return _with_work(chosen.with_comms(comm_rows(gm, info), captured.notes + lctx.notes), gm, info, warn=False)


def _plan_float8(plan, ctx, info: MeshInfo, overrides, captured, cluster, memory_limit, float8) -> Plan:
    """The named plan with float8 linears (`autopar.float8`): under the recipe given, or under each recipe and none
    ("auto"), the least estimated step that fits winning; the `(float8)` decision lists what was weighed."""
    from autopar import float8 as f8plan
    from autopar.plan import CandidateRow, Decision
    from autopar.solver import InfeasibleError
    import autopar.forms.float8 as f8
    from cost_model.hardware import load_cluster
    clus = load_cluster(cluster, info.sizes)
    unpriced = not f8.has_rates(clus)
    if unpriced and float8 == "auto":
        raise ValueError(f"float8='auto' on cluster {clus.name!r}: it has no `_scaled_mm` rates "
                         f"({', '.join(f8.RATE_KEY.values())} in peak_flops), so auto cannot weigh fp8. Fix: a preset "
                         "with FP8 tensor cores (cluster='h100', 'h100_hbm2e', 'h200'), a named recipe, or float8=None")
    # auto on auto: fp8 a binary per linear class in the ILP, under each recipe (`autopar.float8.set_offer`); on a
    # named plan: torchao's rule per linear, under each recipe and none; a torchao-converted model: its linears given
    given = isinstance(float8, tuple)  # a torchao-converted model's linears (autopar.torchao_float8)
    in_ilp = float8 == "auto" and plan == "auto"
    world = f8plan.world_size(info.sizes)
    if given:
        options = [("torchao", f8plan.given(ctx, float8))]
    elif in_ilp:
        options = [(r, None) for r in f8.RECIPES]
    else:
        options = [(r, f8plan.linears(ctx, r, clus, world, rule=float8 == "auto") if r else {})
                   for r in ((None, *f8.RECIPES) if float8 == "auto" else (float8,))]
    tried, err = [], None
    for recipe, choice in options:
        if in_ilp:
            f8plan.set_choice(ctx, {})
            f8plan.set_offer(ctx, f8plan.linears(ctx, recipe, clus, world, rule=False))
        else:
            f8plan.set_choice(ctx, choice)
        try:
            p = _resolve_plan(plan, ctx, info, overrides, captured, cluster, memory_limit)
        except InfeasibleError as e:  # noqa: PERF203 - a recipe under which no plan fits
            err = e
            continue
        finally:
            f8plan.set_offer(ctx, {})
        tried.append((recipe, dict(p.float8) if in_ilp else dict(ctx.float8), p))
    if not tried:
        raise err
    fits = [t for t in tried if t[2].estimate.fits] or tried
    recipe, choice, best = min(fits, key=lambda t: t[2].estimate.step_time_s)
    recipe = recipe if choice else None
    f8plan.set_choice(ctx, choice)  # what lowering and any later pricing of this ctx see
    rows = tuple(CandidateRow(label=f"{r or 'none'} ({len(c)} linears)", compute_s=p.estimate.compute_time_s,
                              comm_s=p.estimate.comm_time_s, memory_bytes=p.estimate.memory_bytes_per_device,
                              time_s=p.estimate.step_time_s,
                              excluded="" if p.estimate.fits else "does not fit the memory limit")
                 for r, c, p in tried)
    how = (f"auto: {f8plan.IN_ILP}" if in_ilp else
           "auto: each recipe on the linears where torchao's rule says it pays, the plan solved under each recipe "
           "(the ILP weighs that recipe's GEMM rates, casts and amax all-reduces with the forms), the least estimated "
           f"step that fits among the recipes; {f8plan.SEPARABLE}" if float8 == "auto"
           else "the model's torchao Float8Linear modules, each under the recipe its Float8LinearConfig names "
                "(autopar.torchao_float8)" if given
           else f"float8={float8!r}: on every nn.Linear")
    skipped = len(f8plan.heads(ctx))
    kept_head = "" if given else f"; the output head ({skipped} linear(s)) kept in high precision"
    per_class = [d for d in best.decisions if d.kind == "float8-classes"]  # the ILP's per class (`planner`)
    d = Decision(keys=(f8plan.DECISION_KEY,), kind="float8", chosen=recipe or "none",
                 decided_by=f"{how}{kept_head}",
                 candidates=rows + tuple(r for pc in per_class for r in pc.candidates))
    notes = (f"{_shown(float8)} on cluster {clus.name!r}, which has no `_scaled_mm` rates: its fp8 GEMMs are priced "
             "at the high-precision fallback rate, plus the casts",) if unpriced else ()
    kept = tuple(x for x in best.decisions if x.kind != "float8-classes")
    return dataclasses.replace(best, float8=tuple(sorted(choice.items())), decisions=kept + (d,),
                               notes=best.notes + notes)


def _plan_pipeline(model, mesh, example_inputs, *, plan, cluster, memory_limit, overrides, lower, precision,
                   microbatches) -> Plan:
    """`plan` with a 'pipeline' override: planned and priced offline by the stage model
    (`autopar.pipeline_estimate`); `autopar.parallelize` runs it (`autopar.pipeline_runtime`); `lower=True` is refused."""
    from autopar.pipeline_estimate import plan_pipeline
    info = mesh_info(mesh)
    sizes = dict(zip(info.names, info.sizes))
    if lower:
        raise NotImplementedError(
            "autopar.plan(..., lower=True) with a 'pipeline' override: a pipelined plan is not lowered offline; the "
            "stage runtime of issue #23 lowers each stage on its own capture inside autopar.parallelize. Fix: plan "
            "with lower=False (the plan and its estimate), or autopar.parallelize(model, mesh, inputs, plan='dp', "
            "overrides={'pipeline': ...}, microbatches=m) to run it")
    rest = {k: v for k, v in overrides.items() if k != "pipeline"} or None
    return plan_pipeline(model, sizes, example_inputs, pipeline=overrides["pipeline"], microbatches=microbatches,
                         plan=plan, cluster=cluster, memory_limit=memory_limit, overrides=rest, precision=precision)


def parallelize(model: nn.Module, mesh: DeviceMesh, example_inputs, *, plan="auto", overrides=None, cluster=None,
                memory_limit=None, inputs="global", mp_policy=None, microbatches=None,
                stages_per_rank=None, float8=None) -> ParallelModule:
    """Turn a single-device model into a distributed program on `mesh`; see DESIGN.md §1.

    Every rank calls it with the same model, mesh and options (`autopar.agree` checks a fingerprint of them with
    one all-gather and raises on every rank, naming the ranks and what differs; an error on one rank is raised on
    every rank, never a hang). `inputs` says what each rank passes, here and when calling the result:

    - "global" (default): every rank passes the same whole batch; autopar splits it. The example inputs must be
      the same on every rank (checked).
    - "local": each data-parallel rank passes its own shard of the batch (the DDP habit, e.g. a
      `DistributedSampler`); it is used as given. The data axes are the mesh axes the plan splits the batch over
      (`plan.inputs`: `Shard(0)`); ranks that differ only on the other (tensor, sequence, expert) axes pass the same
      data (checked). Batched inputs (dim 0 the size of the first input's) are the local shard; other inputs are
      the same on every rank (checked). The plan is made for the global batch, local batch x data-parallel degree.

    `plan="tuned"`: the plan `autopar.tune` measured fastest for this model, mesh, cluster and dtypes (its cache), or,
    when it has not been tuned yet, `autopar.tune` runs now (every rank measures the candidates) and caches it.
    A pipelined winner (on a mesh with a "pp" axis tune measures pipelines too), like any given or saved Plan whose
    `pipeline` is set, runs its pipeline again (`autopar.tune.parallelize_given_pipeline`: its schedule,
    microbatches, stages per rank and cut); `microbatches=` with "tuned" is tune's (the pipelines' count).

    `overrides` ({key: form}): where several keys name one structure, the most specific wins whatever the dict's
    order (an exact module path beats a glob, which beats a kind: `{"h.0.attn": "heads", "attention":
    "replicate"}` gives h.0.attn heads); equally specific keys that disagree raise. Requests that cannot be
    honoured raise rather than run otherwise: a plan whose estimate exceeds an explicit `memory_limit`
    (`InfeasibleError`), a batch that does not divide over the plan's data axes, tied parameters that a given
    Plan places differently.

    A model on the meta device is captured and planned on shapes and each rank allocates only its shards: fill
    them with `autopar.load(pm, path)` or `pm.init_weights()` (`autopar.weights`).

    `mp_policy`: a `torch.distributed.fsdp.MixedPrecisionPolicy`, run as FSDP2 runs it whatever the plan
    (`autopar.precision`): the parameters stay in their dtype (the optimizer's masters), compute and FSDP gathers in
    `param_dtype`, gradient reductions in `reduce_dtype`, gradients in the parameters' dtype. None: the model's dtypes.

    `overrides={"pipeline": "FORM@axis"}` pipelines the model's layers over that mesh axis (issue #23; forms
    `autopar.pipeline_runtime.IMPLEMENTED`), the batch cut into `microbatches` (default: the cost model's choice,
    `autopar.pipeline_estimate.plan_pipeline`) and `stages_per_rank` stages per rank (interleaved-1f1b: default 2);
    the other axes are data parallel inside each stage, replicated (`plan="dp"`) or FSDP-sharded (`plan="fsdp"`,
    `autopar.pipeline_runtime.STAGE_PLANS`). The result is an `autopar.pipeline_runtime.PipelineModule`: its
    call contract is in that module's docstring; `pm.plan` is the priced `Plan` with `pipeline` set.
    `plan="auto"` on a mesh with an axis named like a pipeline axis ("pp", "pipe", "pipeline") weighs pipelining it
    as `autopar.plan`'s auto does, restricted to the pipelines the runtime runs ('dp' inside the stages, no
    checkpoint level, no 'zbv' for tied weights: `_auto_runnable`), and runs the winner: a pipeline, or the
    unpipelined plan with the '(pipeline)' decision saying why in `pm.plan.explain()`.

    `float8` ("tensorwise", "rowwise", "auto"; `autopar.float8`), or a given Plan whose `float8` names linears: those
    linears run `autopar.runtime.float8.float8_linear` (`passes.lower.float8_linears_pass`; under dp, fsdp and
    tensor parallelism, each rank scaling as the single device does). Not with a pipeline (NotImplementedError).
    """
    if isinstance(mesh, dict):
        raise TypeError("parallelize needs a DeviceMesh (it runs the model); use autopar.plan(...) to plan for a "
                        "mesh given as axis sizes")
    if isinstance(plan, str) and plan == "tuned":  # the cached winner of `autopar.tune`, or tune now
        from autopar.tune import tuned_plan
        if inputs != "global":
            raise NotImplementedError(
                f"plan='tuned' with inputs={inputs!r}: autopar.tune measures plans on the global batch every rank "
                "passes, so it cannot tune for local shards yet. Fix: inputs='global', or tune once with the global "
                "batch and pass the saved plan (TuneResult.plan.save(path); plan=path).")
        plan = tuned_plan(model, mesh, example_inputs, cluster=cluster, microbatches=microbatches)
        if plan.pipeline is None:  # microbatches only set the pipeline candidates' count; a flat plan won
            microbatches = None
    from autopar.tune import given_pipeline, parallelize_given_pipeline
    piped = given_pipeline(plan)  # a pipelined Plan (tune's winner, a saved one): its pipeline runs again
    if piped is not None:
        if float8 is not None:
            raise NotImplementedError(f"parallelize(..., float8={float8!r}) with the pipelined plan {piped.name!r}: "
                                      "the stage runtime does not handle float8 linears. Fix: float8=None")
        return parallelize_given_pipeline(model, mesh, example_inputs, piped, overrides=overrides,
                                          microbatches=microbatches, stages_per_rank=stages_per_rank, inputs=inputs,
                                          mp_policy=mp_policy)
    check_model(model)
    model, float8, torchao_notes = _from_torchao(model, float8, plan)
    from autopar.forms.float8 import check_option
    check_option(float8)
    if float8 is not None and ((isinstance(overrides, dict) and "pipeline" in overrides)
                               or (isinstance(plan, str) and plan == "auto" and _pipeline_axes(mesh))):
        raise NotImplementedError(f"parallelize(..., {_shown(float8)}) on a pipelined plan (or one auto may "
                                  "pipeline): neither the stage model nor the stage runtime handles float8 linears. "
                                  "Fix: float8=None")
    if isinstance(overrides, dict) and "pipeline" in overrides:
        from autopar.pipeline_runtime import parallelize_pipeline
        return parallelize_pipeline(model, mesh, example_inputs, value=overrides["pipeline"],
                                    microbatches=microbatches, stages_per_rank=stages_per_rank, plan=plan,
                                    overrides=overrides, inputs=inputs, mp_policy=mp_policy)
    auto_note = None
    if isinstance(plan, str) and plan == "auto" and _pipeline_axes(mesh):
        if stages_per_rank is not None:
            raise ValueError(f"stages_per_rank={stages_per_rank!r} with plan='auto': auto chooses the schedule and "
                             "its stages per rank itself. Fix: drop stages_per_rank, or name the pipeline: "
                             "overrides={'pipeline': 'interleaved-1f1b@pp'}, plan='dp'")
        chosen = _auto_runnable(model, mesh, example_inputs, overrides=overrides, cluster=cluster,
                                memory_limit=memory_limit, mp_policy=mp_policy, inputs=inputs,
                                microbatches=microbatches)
        if chosen.pipeline is not None:
            from autopar.pipeline_auto_run import stage_plan_of
            from autopar.pipeline_runtime import parallelize_pipeline
            pp = chosen.pipeline
            # the plan auto priced: its stage plan, cut, microbatches and per-layer checkpoint levels (`auto=`)
            return parallelize_pipeline(model, mesh, example_inputs, value=pp.label, microbatches=pp.microbatches,
                                        stages_per_rank=pp.stages_per_rank, plan=stage_plan_of(chosen),
                                        overrides={"pipeline": pp.label}, inputs=inputs, mp_policy=mp_policy,
                                        auto=chosen)
        auto_note = next((d for d in chosen.decisions if d.kind == "pipeline"), None)
    elif microbatches is not None or stages_per_rank is not None:
        raise ValueError(f"microbatches={microbatches!r} / stages_per_rank={stages_per_rank!r} apply to a pipelined "
                         "model only: pass overrides={'pipeline': 'FORM@axis'} too, or drop them")
    _refuse_meta_moe(model)
    memory_limit = check_options(plan, cluster, memory_limit)
    precision = precision_of(mp_policy)
    arguments = dict(plan=plan, overrides=overrides, memory_limit=memory_limit, cluster=cluster, inputs=inputs,
                     mp_policy=precision.spec() if precision else None, float8=float8)
    # inputs="local": guess every rank holds its own shard; the plan settles the data-parallel degree below
    copies = mesh.size() if inputs == "local" and isinstance(mesh, DeviceMesh) else 1
    info, captured, ctx, agreement = _agreed_prepare(model, mesh, example_inputs, arguments, copies)
    if inputs == "global":
        check_input_values(agreement)
    if float8 is not None:
        check_float8(float8, plan, overrides)
        solve = lambda: _plan_float8(plan, ctx, info, overrides, captured, cluster, memory_limit,  # noqa: E731
                                     float8)
    else:
        solve = lambda: _resolve_plan(plan, ctx, info, overrides, captured, cluster, memory_limit,  # noqa: E731
                                      _names(model))
    chosen = solve_on_rank0(solve)
    if torchao_notes:
        chosen = dataclasses.replace(chosen, notes=chosen.notes + torchao_notes)
    if auto_note is not None:  # auto weighed a pipeline and kept this plan: say why in explain()
        chosen = dataclasses.replace(chosen, decisions=chosen.decisions + (auto_note,))
    arrivals, call_shapes = {}, None
    if inputs == "local":
        axes = data_axes(chosen, info)
        if data_degree(axes, info) != copies:  # the plan splits the batch over fewer axes: plan for that batch
            info, captured, ctx, _ = _agreed_prepare(model, mesh, example_inputs, arguments, data_degree(axes, info))
            chosen = solve_on_rank0(solve)
            if data_axes(chosen, info) != axes:
                raise ValueError(
                    f"inputs='local': on the global batch of {copies} local batches plan {chosen.name!r} splits the "
                    f"batch over {axes}, but on that batch over {data_axes(chosen, info)}; autopar cannot tell the "
                    "data-parallel degree. Fix: choose the data axes, e.g. plan='dp', 'fsdp' or 'megatron', "
                    "overrides, or a saved Plan; or pass inputs='global'.")
        check_input_values(agreement, data_groups(mesh, axes, info.names))
        arrivals, call_shapes = local_arrivals(chosen, captured, info, axes)
    chosen = tie_placements(chosen, model, from_user=not (isinstance(plan, str) and plan in PLANS))
    check_batch(chosen)  # on every rank, after rank 0's plan is shared: every rank raises alike
    check_memory_limit(chosen, memory_limit)
    stream = f"pm{next(_STREAMS)}"
    new_rng_stream(stream, agreed_seed(mesh))
    lctx = lower_context(chosen, captured, info, rng_stream=stream, arrivals=arrivals)
    gm = lower_pass(captured.gm, lctx)
    if is_meta_model(model):
        meta_to_device(gm, mesh_device(mesh), captured)
    chosen = _with_work(chosen.with_comms(comm_rows(gm, info), captured.notes + lctx.notes), gm, info, warn=True)
    return ParallelModule(model, mesh, captured, chosen, gm, stream, example_inputs=example_inputs,
                          local=(axes, call_shapes) if inputs == "local" else None)


def _pipeline_axes(mesh) -> list[str]:
    """The mesh axes `auto` offers the pipeline role (named like a pipeline axis, size > 1)."""
    from autopar.pipeline_estimate import PIPELINE_AXIS_NAMES
    if not isinstance(mesh, DeviceMesh):  # refused below, with the reason
        return []
    names = tuple(mesh.mesh_dim_names or ())
    return [a for i, a in enumerate(names) if a in PIPELINE_AXIS_NAMES and mesh.size(i) > 1]


def _auto_runnable(model, mesh, example_inputs, *, overrides, cluster, memory_limit, mp_policy, inputs,
                   microbatches) -> Plan:
    """`parallelize(plan='auto')` on a mesh with a pipeline axis: `autopar.plan`'s auto (the ILP's plan on the whole
    mesh weighed against pipelining that axis, `_auto_maybe_pipelined`), its pipelined candidates restricted to what
    the stage runtime runs (`runnable=True`, `autopar.pipeline_auto_run`: the named stage plans 'dp', 'fsdp',
    'megatron' where the mesh takes them, each rank at its own checkpoint level; no 'zbv' for a model with tied
    weights, nor with a checkpoint level), solved on rank 0 and shared. Returns the chosen Plan: `pipeline` set when
    a pipeline won; the runtime then runs exactly it (its stage plan, cut, microbatches and levels)."""
    from autopar.agree import solve_on_rank0
    if inputs != "global" or mp_policy is not None:
        raise NotImplementedError(
            f"plan='auto' on a mesh with a pipeline axis ({', '.join(_pipeline_axes(mesh))}) with "
            f"inputs={inputs!r} / mp_policy={mp_policy!r}: auto weighs a pipeline there and the pipeline runtime takes "
            "neither yet. Fix: inputs='global' and no mp_policy, or name the plan (e.g. plan='dp') so that no axis "
            "is pipelined, or rename the axis.")
    check_model(model)
    limit = check_options("auto", cluster, memory_limit)

    def solve():
        from autopar.pipeline_auto_run import with_search_note
        chosen = _auto_maybe_pipelined(model, mesh, example_inputs, cluster=cluster, memory_limit=limit,
                                       overrides=overrides, progress=None, mp_policy=None, precision=None,
                                       microbatches=microbatches, runnable=True)
        sizes = dict(zip(mesh.mesh_dim_names, mesh.shape))
        return with_search_note(chosen, model, sizes, _pipeline_axes(mesh)[0])
    return solve_on_rank0(solve)


# ----------------------------------------------------------------------------- steps

def _with_work(chosen: Plan, gm, info: MeshInfo, *, warn: bool) -> Plan:
    """The plan with its estimate's per-rank FLOP fraction, counted on the lowered program (`passes.batch_local`);
    `warn`: one UserWarning when ops run whole on every rank of a data axis (the batch gathered for them)."""
    work = gm.meta.get(M.WORK)
    if work is None:
        return chosen
    axes = data_axes(chosen, info)
    found, share = work.redundant(axes)
    if warn and found:
        ops = ", ".join(f"{name} ({op}{' in ' + path if path else ''})" for name, op, path, _, _ in found[:8])
        more = f" and {len(found) - 8} more" if len(found) > 8 else ""
        warnings.warn(
            f"autopar: plan {chosen.name!r} leaves data axes {', '.join(axes)} not parallel for {len(found)} op(s) "
            f"that gather the batch (no sharding rule, or a rule that gathers it) and are not batch-local: "
            f"{ops}{more}. Their batch-split inputs are gathered "
            f"and they run whole on every rank: {share:.1%} of the model's FLOPs run redundantly; each rank runs "
            f"{work.fraction:.3f} of one device's FLOPs. Why, per op: the plan's notes ('replicated ...'). Fix: "
            "write the computation so that each row of the batch is computed from that row alone (then it runs on "
            "each rank's rows), or give the op a sharding rule that splits the batch (passes.rules).",
            UserWarning, stacklevel=3)
    if chosen.estimate is not None:
        chosen = chosen.with_estimate(dataclasses.replace(chosen.estimate, flop_fraction=work.fraction))
    return chosen


_STREAMS = itertools.count()




def _local_tensor_off():
    from torch.distributed._local_tensor import maybe_disable_local_tensor_mode
    return maybe_disable_local_tensor_mode()


def _agreed_prepare(model, mesh, example_inputs, arguments: dict, copies: int):
    """`_prepare` on every rank (inputs="local": on the global batch, `copies` local batches), then agree: the same
    error on every rank if one failed, `RankMismatchError` if the fingerprints differ."""
    def step():
        check_mode(arguments["inputs"])
        return _prepare(model, mesh, example_inputs, copies=copies, precision=Precision.parse(arguments["mp_policy"]))

    def describe(prepared, ranks):
        args, kwargs = split_example_inputs(example_inputs)
        flat = pytree.tree_leaves((args, kwargs))
        batched = batch_dims([tuple(a.shape) if isinstance(a, torch.Tensor) else None for a in flat])
        return fingerprints(model, mesh, args, kwargs, prepared[1], arguments, batched, ranks)

    (info, captured, ctx), agreement = agree_on(step, describe, mesh)
    return info, captured, ctx, agreement


def _refuse_meta_moe(model: nn.Module) -> None:
    """A meta-device model is parallelised without running it. A Hugging Face experts module (Mixtral, Qwen-MoE,
    DeepSeek-V3) is verified on a shrunken copy built with the same code and config (`passes.moe_shrunken`); a
    user's own MoE block (a router and a ModuleList or GroupedExperts) has no config to build a smaller copy from,
    and its canonical form is checked by running it on real weights, so it cannot be parallelised on meta yet."""
    if not is_meta_model(model):
        return
    from passes.moe import find_moe_modules
    found = [f for f in find_moe_modules(model) if f.level != "experts"]
    if found:
        raise NotImplementedError(
            f"{type(model).__name__} is on the meta device and has MoE blocks of its own ({found[0].path}, "
            f"{found[0].spelling}, ...): autopar verifies its rewrite of such a block by running it on real weights, "
            "which a meta model does not have, and can build a smaller copy to verify instead only for a Hugging "
            "Face experts module (built from its config), so parallelising it on meta is not supported yet. Fix: "
            "build the model on the CPU (or its device) and parallelise that; autopar.plan(...) plans the meta "
            "model.")


def _names(model) -> set[str]:
    """Every name of the model's parameters (tied ones under each of theirs): what a given plan may place."""
    return {n for n, _ in model.named_parameters(remove_duplicate=False)}


def _resolve_plan(plan, ctx, info: MeshInfo, overrides, captured, cluster=None, memory_limit=None,
                  names: set[str] | None = None) -> Plan:
    """A named plan built for these sites, or a given / saved Plan checked against this model (`names`: its
    parameters' names) and mesh."""
    if isinstance(plan, str) and plan in PLANS:
        flat_shapes = captured.example_shapes
        batch = dict(zip(captured.user_inputs, batch_dims(flat_shapes)))
        shapes = dict(zip(captured.user_inputs, flat_shapes))
        made = build_plan(ctx, info, plan, overrides, batch, cluster=cluster, memory_limit=memory_limit,
                          input_shapes=shapes)
        return dataclasses.replace(made, precision=captured.precision.spec() if captured.precision else "")
    source = "the given Plan"
    if isinstance(plan, (str, os.PathLike)):
        if not os.path.isfile(plan):
            near = difflib.get_close_matches(str(plan).lower(), PLANS, n=1)
            raise ValueError(f"plan {str(plan)!r} is neither a plan name ({', '.join(map(repr, PLANS))}) nor an "
                             "existing file. Fix: give one of the names"
                             + (f" (did you mean {near[0]!r}?)" if near else "")
                             + ", a Plan, or the path of a plan saved with Plan.save (the file must exist).")
        source = f"plan file {str(plan)!r}"
        plan = Plan.load(plan)
    if overrides:
        raise ValueError(f"overrides apply to the named plans {PLANS}; edit a saved Plan directly")
    check_plan_precision(plan.precision, captured.precision, source)
    check_given_plan(plan, source, info, captured, names)
    return plan
