"""`autopar.tune`: measure the best candidate plans on the real mesh, keep the fastest, and calibrate the cost model.

Run under `torchrun` (every rank calls it with the same model, mesh and example inputs, as `parallelize`):

1. **Candidates** (`candidates`, planned on rank 0 and broadcast): the ILP's `top_k` best distinct plans (each
   solved again with the assignments found so far excluded, `autopar.solver.no_good`, so they differ in some
   structure's form) and the named hand plans (`autopar.planner.PLANS`); a plan found twice is measured once,
   under both names (so is a plan's mirror image, step 2). Each is priced by the cost model as loaded
   (`predicted_s`: compute + communication + the optimizer step, the sum a calibration scales linearly, not the
   plan estimate's overlapped timeline) and broken into the parts a calibration scales (`components`: compute per
   op kind, the optimizer step, critical-path collectives and parameter synchronisation per mesh axis, the rest).
2. **Measurement**: each candidate is lowered (as `autopar.parallelize` lowers a given plan), given an optimizer (AdamW on
   its parameters, or `optimizer(params)`), warmed up `warmup` steps and timed for `steps` training steps
   (forward, backward, optimizer step). Steps are interleaved: round r runs one step of every live candidate
   (the order rotated each round), so drift on the machine hits all alike. Each step's time is the slowest
   rank's; a candidate's time is the median of its steps. The 3 fastest and the fastest hand plan are then
   timed again, max(2 * steps, 8) fresh rounds interleaved among themselves, and the fastest of those rounds wins
   (one set of rounds decides a near-tie by noise). A plan and its mirror image (`mirror`: the same forms with two
   mesh axes of the same size swapped, axes the cost model prices alike: `_interchangeable`) run alike and are
   measured once, under both names. Peak memory per rank: the candidate's resident state
   (parameters, gradients, optimizer state) plus the most allocated above it during a step (CUDA
   `max_memory_allocated`; on a CPU host the resident set's high-water mark, reset before each step).
3. **Isolation**: after every phase (lowering, each step) the ranks agree (one all-gather of each rank's status,
   time and memory): a candidate that raised on any rank, ran out of memory, or needed more than `memory_limit`
   per rank is skipped on every rank with the first failing rank's reason, and the others go on. A failure
   between collectives (lowering, the optimizer, a rank-local check) is isolated this way; a rank failing inside
   a collective sequence while the others wait in it is only ended by the process group's timeout.
4. **Calibration** (`fit_calibration`): factors per op kind of compute, for the optimizer step, and per mesh axis
   for its critical-path collectives and for its parameter synchronisation (which the timeline hides behind
   compute, a CPU host does not), and per mesh axis a fixed latency per collective (`Calibration.latency`), fitted
   by non-negative least squares on the relative error of the measured candidates (factors pulled towards one
   global factor where the measurements do not tell the parts apart, the latency towards none), saved beside the
   cluster profile
   (`cost_model.hardware.calibration_path`) with the measurements of every model tuned on this machine and mesh,
   refitted on all of them, so later plans of other models are priced with it (`load_cluster`). The cost model
   applies the compute and per-axis factors and the latency per collective (`Link.call_s`); the synchronisation
   and optimizer factors are applied by tune's calibrated predictions (`apply_calibration`) only, as the plan
   estimate neither separates an axis' synchronisation nor prices the optimizer step.
5. **Cache**: the result is saved under `$XDG_CACHE_HOME/autopar/tune/<key>.json`, the key a digest of the
   captured graph (`Captured.fingerprint`), the mesh, the cluster and the parameter and input dtypes; a second
   call (and `parallelize(..., plan="tuned")`) returns it without measuring.

6. **Pipeline candidates**. On a mesh with an axis named like a pipeline axis (`autopar.pipeline_estimate.
   PIPELINE_AXIS_NAMES`: "pp", ...), the `top_k` pipelines the stage model ranks best among those that fit
   (`autopar.pipeline_estimate.auto_pipeline` with `runnable=True`, the search `parallelize(plan="auto")` runs
   restricted as `autopar.api._auto_runnable` restricts it: 'dp' inside the stages, no checkpoint level, no 'zbv'
   for tied weights; each a schedule x microbatch count, `microbatches=` fixing the count), planned on rank 0.
   `pipelines=(("1f1b@pp", 4), ...)` measures the given (pipeline override, microbatches) pairs instead (plan 'dp'
   inside the stages, `autopar.pipeline_estimate.plan_pipeline`), `pipelines=()` none. Each is built as
   `parallelize(plan="dp", overrides={"pipeline": ...}, microbatches=m)` builds it
   (`autopar.pipeline_runtime.parallelize_pipeline`), its PipelinePlan then the one that runs (the runtime's cut),
   and timed in the same interleaved rounds (forward, backward and optimizer step; the slowest rank's time),
   named 'pipeline 1f1b@pp m=4' ('... m=4 v=2' for interleaved 1F1B) in the table. Their prediction is the
   pipeline estimate's step (its bubble and overlap do not decompose into the parts a calibration scales), so
   they are measured and compared but left out of the calibration fit. A pipelined winner, cached or saved
   (`TuneResult.plan.save(path)`), runs through `parallelize(..., plan="tuned")` or `plan=path`
   (`parallelize_given_pipeline`): the same schedule, microbatches, stages per rank and cut.

`TuneResult.plan` is the fastest measured plan, `.table()` prints every candidate's prediction before and after
calibration against its measurement, `.candidates` holds them.
"""

from __future__ import annotations

import dataclasses
import hashlib
import itertools
import json
import math
import os
import re
import statistics
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import numpy as np
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor
from torch.utils import _pytree as pytree

from autopar.forms import Candidate
from autopar.plan import GATHER_KEEP, DirectiveKind, Plan
from cost_model.analytical import KINDS
from cost_model.hardware import Calibration, Cluster, axis_link, calibration_path, load_cluster, profile_of

__all__ = ["tune", "tuned_plan", "TuneResult", "TuneCandidate", "fit_calibration", "candidates", "cache_key", "mirror",
           "ranked_pipelines", "parallelize_given_pipeline"]

_STREAMS = itertools.count()  # dropout streams of the candidates' programs
REST = "rest"  # the part of a prediction no calibration factor scales
_MAX_FITS = 400  # measurements kept beside a profile (the oldest dropped)
_PARTS = 3  # what `components` splits a prediction into (saved fits split otherwise are not refitted)
CALLS = "calls"  # 'calls:<axis>': a count of collectives, not seconds (`components`)
_PROBE_S = 1e-3  # the per-collective latency `components` prices a plan with to count its collectives


# ----------------------------------------------------------------------------- results

@dataclass(frozen=True, kw_only=True)
class TuneCandidate:
    """One plan tried: its prediction (as loaded, and after this run's calibration), the parts a calibration
    scales, and what was measured (None with `skipped` saying why)."""

    name: str  # 'auto#1' (the ILP's best), 'auto#2', ..., or a hand plan's name; 'auto#2=megatron' when both;
    # 'pipeline 1f1b@pp m=4' a pipeline (module docstring, 6)
    plan: Plan
    predicted_s: float
    components: tuple[tuple[str, float], ...] = ()  # 'compute:<kind>', 'axis:<index>', ..., 'rest' -> seconds;
    # 'calls:<index>' -> collectives (`components`)
    calibrated_s: float = math.nan
    measured_s: float | None = None
    step_times_s: tuple[float, ...] = ()  # the slowest rank's time of each timed step
    peak_bytes: tuple[int, ...] = ()  # per rank
    skipped: str = ""

    @property
    def forms(self) -> str:
        """The forms the plan gives, per kind: 'attention heads@tp; mlp tp@tp; loss vocab@tp'."""
        by: dict[str, dict[str, int]] = {}
        for st in self.plan.strategies:
            by.setdefault(st.kind, {}).setdefault(st.label, 0)
            by[st.kind][st.label] += 1
        from autopar.spec import Shard, placements_from_str
        names = [n for n, _ in self.plan.mesh]
        data = sorted({names[i] for _, p in self.plan.inputs for i, x in enumerate(placements_from_str(p))
                       if x == Shard(0)}, key=names.index)
        gathers = [d for d in self.plan.directives if d.kind is DirectiveKind.GATHER]
        fsdp = ""
        if gathers:  # FSDP-sharded parameters: plans alike in forms differ here (ZeRO-3, or kept gathered: ZeRO-2)
            params = {d.node for d in gathers}
            kept = {d.node for d in gathers if d.value == GATHER_KEEP}
            axes = sorted({d.axis for d in gathers}, key=names.index)
            fsdp = (f"; fsdp@{'+'.join(axes)} {len(params)} params"
                    + (f", {len(kept)} kept gathered" if kept else ""))
        pp = self.plan.pipeline
        piped = (f"pipeline {pp.label}, {pp.microbatches} microbatches, {pp.stages_per_rank} stage(s) per rank, cut "
                 f"{list(pp.cut)}; in the stages: " if pp is not None else "")
        return (piped + f"batch over {'+'.join(data) or '-'}; "
                + "; ".join(f"{k} {'/'.join(v)}" for k, v in by.items()) + fsdp)

    def to_dict(self) -> dict:
        d = dataclasses.asdict(self)
        d["plan"] = self.plan.to_json()
        return d

    @classmethod
    def from_dict(cls, d: dict) -> "TuneCandidate":
        d = dict(d)
        d["plan"] = Plan.from_json(d["plan"])
        d["components"] = tuple(tuple(c) for c in d["components"])
        d["step_times_s"] = tuple(d["step_times_s"])
        d["peak_bytes"] = tuple(d["peak_bytes"])
        return cls(**d)


@dataclass
class TuneResult:
    candidates: list[TuneCandidate]
    key: str  # the cache key (`cache_key`)
    measured: bool  # False: read from the cache
    calibration: Calibration | None = None
    cache_path: str = ""
    calibration_path: str = ""

    @property
    def fastest(self) -> TuneCandidate:
        done = [c for c in self.candidates if c.measured_s is not None]
        if not done:
            raise RuntimeError("autopar.tune: every candidate was skipped, so there is no tuned plan:\n"
                               + "\n".join(f"  {c.name}: {c.skipped}" for c in self.candidates)
                               + "\nFix: the reasons above (more memory per rank, fewer ranks per axis, ...).")
        return min(done, key=lambda c: c.measured_s)

    @property
    def plan(self) -> Plan:
        """The fastest measured plan."""
        return self.fastest.plan

    def table(self) -> str:
        head = ("candidate", "forms", "predicted", "calibrated", "measured", "error", "calibrated error",
                "peak memory/rank", "")
        rows = [head]
        best = self.fastest.name if any(c.measured_s is not None for c in self.candidates) else None
        for c in self.candidates:
            m = c.measured_s
            err = lambda p: f"{(p - m) / m:+.0%}" if m and math.isfinite(p) else "-"  # noqa: E731
            spread = (f" ({min(c.step_times_s) * 1e3:.1f}-{max(c.step_times_s) * 1e3:.1f})"
                      if len(c.step_times_s) > 1 else "")
            rows.append((c.name, c.forms, _ms(c.predicted_s), _ms(c.calibrated_s),
                         (_ms(m) + spread) if m is not None else "skipped", err(c.predicted_s), err(c.calibrated_s),
                         _mib(max(c.peak_bytes)) if c.peak_bytes else "-",
                         "fastest" if c.name == best else c.skipped))
        widths = [max(len(r[i]) for r in rows) for i in range(len(head) - 1)]
        lines = ["  ".join(v.ljust(w) for v, w in zip(r, widths)) + ("  " + r[-1] if r[-1] else "") for r in rows]
        note = "measured now" if self.measured else f"from the cache ({self.cache_path})"
        cal = (f"; calibration of {self.calibration.samples} measurements: "
               + ", ".join(f"{k} x{v:.2f}" for k, v in sorted(self.calibration.compute.items()))
               + "".join(f", axis {i} x{a:.2f}" for i, a in enumerate(self.calibration.axes))
               + "".join(f", axis {i} sync x{a:.2f}" for i, a in enumerate(self.calibration.sync))
               + "".join(f", axis {i} +{s * 1e3:.2f} ms per collective" for i, s in enumerate(self.calibration.latency))
               if self.calibration is not None else "")
        return "\n".join(lines) + f"\n(step times in ms, slowest rank, median of the timed steps; {note}{cal})"


def _ms(s: float | None) -> str:
    return f"{s * 1e3:.2f}" if s is not None and math.isfinite(s) else "-"


def _mib(b: float) -> str:
    return f"{b / 2**20:.1f} MiB"


# ----------------------------------------------------------------------------- the entry point

def tune(model: nn.Module, mesh: DeviceMesh, example_inputs, *, top_k: int = 8, steps: int = 10, warmup: int = 3,
         optimizer: Callable | None = None, cache: bool = True, progress: bool = True, cluster=None,
         memory_limit: float | None = None, calibrate: bool = True, pipelines=None,
         microbatches: int | None = None) -> TuneResult:
    """Measure the ILP's `top_k` best distinct plans and the hand plans on `mesh`; see the module docstring.

    `optimizer(params) -> torch.optim.Optimizer` (default AdamW); `cluster` as in `parallelize` (the profile to
    calibrate; a preset name is used as published and not calibrated on disk); `memory_limit` (bytes per rank): a
    candidate that measures more is skipped; `calibrate=False` leaves the calibration on disk alone; `pipelines`:
    None (default) the `top_k` pipelines the estimate ranks best on a mesh with a pipeline axis, or the
    (pipeline override, microbatches) pairs to measure, () none; `microbatches`: the pipelines' microbatch count
    (default: each count the estimate tries) (module docstring, 6)."""
    _check(model, mesh, top_k, steps, warmup, optimizer)
    pipelines = _check_pipelines(pipelines, mesh)
    _check_microbatches(microbatches, pipelines, mesh, example_inputs)
    info, captured, ctx = _prepare(model, mesh, example_inputs)
    loaded = load_cluster(cluster, info.sizes)
    base = dataclasses.replace(loaded, calibration=None)
    key = cache_key(captured, info, base, model, example_inputs)
    if pipelines:  # other candidates, another result
        key += "-pp" + hashlib.sha256(repr(pipelines).encode()).hexdigest()[:8]
    elif pipelines is None and microbatches is not None:
        key += f"-m{microbatches}"
    where = _cache_dir() / f"{key}.json"
    if cache:
        hit = _on_rank0(lambda: where.read_text() if where.is_file() else None, mesh)
        if hit is not None:
            result = _from_cache(hit, key, str(where))
            return result
    rows = _on_rank0(lambda: [c.to_dict() for c in candidates(model, ctx, info, captured, loaded, top_k)
                              + (ranked_pipelines(model, info, example_inputs, cluster, top_k, microbatches)
                                 if pipelines is None else
                                 pipeline_candidates(model, info, example_inputs, cluster, pipelines))], mesh)
    cands = [TuneCandidate.from_dict(r) for r in rows]
    cands = _measure(model, mesh, example_inputs, cands, steps=steps, warmup=warmup, optimizer=optimizer,
                     cluster=cluster, memory_limit=memory_limit, progress=progress and _rank() == 0)
    fits = [(dict(c.components), c.measured_s) for c in cands if c.measured_s is not None and c.plan.pipeline is None]
    cal, cal_path = None, ""
    if fits:
        profile = _calibration_home(cluster, info.sizes)
        cal = _on_rank0(lambda: _update_calibration(profile, base, info.sizes, captured.fingerprint(), fits,
                                                    save=calibrate and profile is not None), mesh)
        cal_path = str(calibration_path(profile)) if profile is not None and calibrate else ""
        cands = [dataclasses.replace(c, calibrated_s=apply_calibration(dict(c.components), cal))
                 if c.plan.pipeline is None else c for c in cands]  # a pipeline's prediction is not calibrated
    result = TuneResult(candidates=cands, key=key, measured=True, calibration=cal, cache_path=str(where),
                        calibration_path=cal_path)
    if cache and any(c.measured_s is not None for c in cands) and _rank() == 0:
        where.parent.mkdir(parents=True, exist_ok=True)
        tmp = where.with_suffix(f".tmp{os.getpid()}")
        tmp.write_text(json.dumps({"key": key, "candidates": [c.to_dict() for c in cands],
                                   "calibration": json.loads(cal.to_json()) if cal else None}))
        tmp.replace(where)
    return result


def tuned_plan(model: nn.Module, mesh: DeviceMesh, example_inputs, *, cluster=None, microbatches=None) -> Plan:
    """`parallelize(..., plan="tuned")`: the cached tuned plan for this model, mesh, cluster and dtypes, or, when
    there is none, the plan `tune` finds (measured now, then cached). `microbatches`: as `tune`'s (the pipeline
    candidates' count; another cache entry)."""
    return tune(model, mesh, example_inputs, cluster=cluster, progress=_rank() == 0, microbatches=microbatches).plan


def _prepare(model, mesh, example_inputs):
    """Capture and recognise (as `autopar.api` does; `parallelize(plan="tuned")` calls tune, so tune lowers its
    candidates itself, `_lower`)."""
    from autopar.agree import _local_tensor_off
    from autopar.capture import capture, split_example_inputs
    from autopar.mesh import mesh_info
    from autopar.relower import plain_inputs
    from autopar.sites import PassContext
    from passes.pipeline import RECOGNISE, run_passes

    args, kwargs = plain_inputs(*split_example_inputs(example_inputs))
    with _local_tensor_off():
        captured = capture(model, args, kwargs)
    ctx = PassContext(captured)
    run_passes(captured.gm, ctx, RECOGNISE)
    return mesh_info(mesh), captured, ctx


def _lower(model, mesh, example_inputs, plan: Plan, stream: str):
    """The candidate `plan` (planned on rank 0, the same on every rank) as a ParallelModule, as `parallelize` makes
    it from a given Plan."""
    from autopar.agree import agreed_seed
    from autopar.checks import check_given_plan
    from autopar.module import ParallelModule
    from autopar.runtime.ops import new_rng_stream
    from passes.lower import lower_context, lower_pass

    info, captured, _ = _prepare(model, mesh, example_inputs)
    check_given_plan(plan, f"candidate {plan.name!r}", info, captured)
    new_rng_stream(stream, agreed_seed(mesh))
    gm = lower_pass(captured.gm, lower_context(plan, captured, info, rng_stream=stream))
    return ParallelModule(model, mesh, captured, plan, gm, stream, example_inputs=example_inputs)


def _check_pipelines(pipelines, mesh) -> tuple[tuple[str, int], ...] | None:
    """None (the estimate's best pipelines) as is; otherwise the (override, microbatches) pairs, checked."""
    from autopar.pipeline_plan import parse_pipeline
    if pipelines is None:
        return None
    if isinstance(pipelines, str) or not isinstance(pipelines, (tuple, list)):
        raise ValueError(f"autopar.tune: pipelines takes None (the pipelines the estimate ranks best) or "
                         f"(pipeline override, microbatches) pairs such as (('1f1b@pp', 4),), got {pipelines!r}")
    out = []
    for item in pipelines:
        if not (isinstance(item, (tuple, list)) and len(item) == 2 and isinstance(item[0], str)
                and isinstance(item[1], int) and not isinstance(item[1], bool) and item[1] >= 1):
            raise ValueError(f"autopar.tune: pipelines takes (pipeline override, microbatches) pairs such as "
                             f"('1f1b@pp', 4), got {item!r}")
        parse_pipeline(item[0], tuple(mesh.mesh_dim_names or ()))  # a clear error for a bad form or axis
        out.append((item[0], item[1]))
    return tuple(out)


def pipeline_axes(info) -> list[str]:
    """The mesh axes tune offers the pipeline role: named like a pipeline axis ("pp", ...), of size > 1 (as
    `parallelize(plan="auto")` does)."""
    from autopar.pipeline_estimate import PIPELINE_AXIS_NAMES
    return [a for a, n in zip(info.names, info.sizes) if a in PIPELINE_AXIS_NAMES and n > 1]


def _check_microbatches(microbatches, pipelines, mesh, example_inputs) -> None:
    """`microbatches=` sets the count of the estimate's pipelines: a positive int splitting the batch over every
    pipeline axis' data-parallel ranks, on a mesh with a pipeline axis; with given pairs each pair has its own."""
    if microbatches is None:
        return
    from autopar.mesh import mesh_info
    from autopar.pipeline_estimate import PIPELINE_AXIS_NAMES, _batch_of
    if not isinstance(microbatches, int) or isinstance(microbatches, bool) or microbatches < 1:
        raise ValueError(f"autopar.tune: microbatches must be a positive int (the pipeline candidates' microbatch "
                         f"count), got {microbatches!r}")
    if pipelines is not None:
        raise ValueError(f"autopar.tune: microbatches={microbatches} with pipelines={pipelines!r}: each given pair "
                         "names its own microbatch count. Fix: drop microbatches, or drop pipelines (the estimate's "
                         "best pipelines, with that count)")
    info = mesh_info(mesh)
    axes = pipeline_axes(info)
    if not axes:
        raise ValueError(f"autopar.tune: microbatches={microbatches} splits the batch of a pipelined candidate, but "
                         f"the mesh ({', '.join(f'{a}={n}' for a, n in zip(info.names, info.sizes))}) has no axis "
                         f"of size > 1 named {' or '.join(map(repr, PIPELINE_AXIS_NAMES))}, so tune measures no "
                         "pipeline. Fix: name the axis to pipeline 'pp', or drop microbatches")
    batch = _batch_of(example_inputs)
    for axis in axes:
        degree = math.prod(n for a, n in zip(info.names, info.sizes) if a != axis)
        if batch % (degree * microbatches):
            raise ValueError(f"autopar.tune: microbatches={microbatches} does not split the batch of {batch} rows "
                             f"over the {degree} data-parallel rank(s) beside pipeline axis {axis!r} ({degree} x "
                             f"{microbatches} must divide {batch}). Fix: microbatches dividing {batch // degree}"
                             if batch % degree == 0 else f"autopar.tune: the batch of {batch} rows does not split "
                             f"over the {degree} data-parallel rank(s) beside pipeline axis {axis!r}. Fix: a batch "
                             f"that is a multiple of {degree}")


def _pipeline_name(pp) -> str:
    """'pipeline 1f1b@pp m=4' ('... m=4 v=2' for interleaved 1F1B, whose stages per rank vary)."""
    return f"pipeline {pp.label} m={pp.microbatches}" + (f" v={pp.stages_per_rank}"
                                                         if pp.form == "interleaved-1f1b" else "")


def ranked_pipelines(model: nn.Module, info, example_inputs, cluster, top_k: int, microbatches=None
                     ) -> list[TuneCandidate]:
    """The `top_k` pipelines the stage model ranks best over each pipeline axis (`pipeline_axes`), among those that
    fit, as `parallelize(plan="auto")` weighs them (`auto_pipeline(runnable=True)`: what the stage runtime runs);
    a model the pipeline cannot take is one skipped candidate saying why."""
    from autopar import pipeline_estimate as pe
    sizes = dict(zip(info.names, info.sizes))
    out: list[TuneCandidate] = []
    for axis in pipeline_axes(info):
        try:
            tried = pe.auto_pipeline(model, sizes, example_inputs, axis, cluster=cluster, microbatches=microbatches,
                                     runnable=True)
        except (ValueError, NotImplementedError) as e:
            out.append(TuneCandidate(name=f"pipeline over {axis}", plan=Plan(name="dp", mesh=tuple(sizes.items())),
                                     predicted_s=math.nan, skipped=f"not run: {type(e).__name__}: {e}"))
            continue
        fits = sorted((t for t in tried if t.fits), key=lambda t: t.step_s)[:top_k]
        if top_k and not fits:  # said in the table, not dropped silently
            why = (f"none of the {len(tried)} pipelines priced fits the memory limit ("
                   + ", ".join(f"{t.label}: {t.memory_bytes / 2**20:.1f} MiB" for t in tried) + ")" if tried else
                   f"the stage runtime runs no schedule of {', '.join(f for f, _ in pe.AUTO_FORMS)} on {sizes[axis]} "
                   f"ranks of {axis!r} for this model and batch"
                   + (f" with microbatches={microbatches}" if microbatches else "")
                   + " (1F1B needs at least as many microbatches as ranks; interleaved 1F1B and ZB-V two layers "
                     "per rank; the microbatches must split the batch over the data-parallel ranks)")
            out.append(TuneCandidate(name=f"pipeline over {axis}", plan=Plan(name="dp", mesh=tuple(sizes.items())),
                                     predicted_s=math.nan, skipped=f"not run: {why}"))
            continue
        _, _, rows = pe.choose(tried, None)
        for i, t in enumerate(fits):
            why = (f"autopar.tune: the stage model's #{i + 1} of {len(tried)} pipelines over {axis!r} "
                   f"({t.label}, estimated {t.step_s * 1e3:.2f} ms: bubble {t.bubble_s * 1e3:.2f} ms, p2p "
                   f"{t.p2p_s * 1e3:.2f} ms), measured against the other candidates")
            plan = pe.build_chosen(t, why, rows, sizes)
            out.append(TuneCandidate(name=_pipeline_name(plan.pipeline), plan=plan,
                                     predicted_s=plan.estimate.step_time_s,
                                     components=((REST, plan.estimate.step_time_s),)))
    return out


def pipeline_candidates(model: nn.Module, info, example_inputs, cluster, pipelines) -> list[TuneCandidate]:
    """Each (pipeline override, microbatches) as a candidate, priced offline with plan 'dp' inside the stages."""
    from autopar.pipeline_estimate import plan_pipeline
    out = []
    for override, m in pipelines:
        plan = plan_pipeline(model, dict(zip(info.names, info.sizes)), example_inputs, pipeline=override,
                             microbatches=m, plan="dp", cluster=cluster)
        step_s = plan.estimate.step_time_s
        out.append(TuneCandidate(name=f"pipeline {override} m={m}", plan=plan, predicted_s=step_s,
                                 components=((REST, step_s),)))
    return out


# ----------------------------------------------------------------------------- a pipelined Plan, run again

def given_pipeline(plan) -> Plan | None:
    """The Plan `plan` names (a Plan, or the path of a saved one) when it pipelines an axis, else None (a plan name,
    an unpipelined plan, or a path that is not a plan: `autopar.api` says what is wrong with it)."""
    from autopar.planner import PLANS
    if isinstance(plan, Plan):
        return plan if plan.pipeline is not None else None
    if isinstance(plan, (str, os.PathLike)) and os.fspath(plan) not in PLANS + ("tuned",) \
            and os.path.isfile(plan):
        try:
            loaded = Plan.load(os.fspath(plan))
        except (OSError, ValueError, TypeError, KeyError):
            return None
        return loaded if loaded.pipeline is not None else None
    return None


def stage_plan_of(plan: Plan) -> str:
    """What runs inside the stages of a pipelined Plan: its name when it names a stage plan the runtime runs
    ('dp', 'fsdp', 'megatron'); a plan of another name (auto's, tune's) whose parameters are all replicated on the
    sub-mesh and which checkpoints no layer runs as 'dp' (what `auto_pipeline(runnable=True)` plans)."""
    from autopar.pipeline_runtime import STAGE_PLANS
    from autopar.pipeline_tp import TP_STAGE_PLANS
    if plan.name in STAGE_PLANS + TP_STAGE_PLANS:
        return plan.name
    sharded = [f for f, pls in plan.params if "S(" in pls]
    levels = sorted({lv for _, lv in plan.checkpoint} - {"none"})
    if not sharded and not levels:
        return "dp"
    raise NotImplementedError(
        f"plan {plan.name!r} pipelines {plan.pipeline.label} with its own forms inside the stages ("
        + (f"{len(sharded)} parameters sharded, e.g. {sharded[0]!r}" if sharded else "")
        + ("; " if sharded and levels else "") + (f"checkpoint levels {levels}" if levels else "")
        + "): the stage runtime runs 'dp', 'fsdp' or 'megatron' inside a stage, not a plan's per-stage forms "
        "(autopar.plan's auto plans those offline only). Fix: run parallelize(plan='auto') or name the stage plan: "
        f"plan='fsdp', overrides={{'pipeline': {plan.pipeline.label!r}}}, microbatches={plan.pipeline.microbatches}")


def parallelize_given_pipeline(model: nn.Module, mesh: DeviceMesh, example_inputs, plan: Plan, *, overrides,
                               microbatches, stages_per_rank, inputs, mp_policy):
    """`parallelize(..., plan=P)` for a pipelined Plan P (tune's winner, `plan="tuned"`, or a saved one): the
    pipeline P names (form, axis, microbatches, stages per rank) run by `autopar.pipeline_runtime` with P's stage
    plan (`stage_plan_of`); the module's PipelinePlan must be P's, cut included (the runtime cuts the captured graph
    itself), else a ValueError on every rank (each computes the same cut). `pm.plan` keeps P's name and decision."""
    from autopar.pipeline_runtime import parallelize_pipeline
    pp = plan.pipeline
    mesh_axes = tuple((n, mesh.size(i)) for i, n in enumerate(mesh.mesh_dim_names or ()))
    if tuple(tuple(x) for x in plan.mesh) != mesh_axes:
        raise ValueError(f"plan {plan.name!r} pipelines {pp.label} on mesh {dict(plan.mesh)}, but this mesh is "
                         f"{dict(mesh_axes)}. Fix: the mesh the plan was made for, or re-plan on this one")
    if overrides:
        raise ValueError(f"overrides={overrides!r} with the pipelined plan {plan.name!r} ({pp.label}): a given Plan "
                         "holds its pipeline and forms. Fix: drop overrides, or plan by name with them")
    for what, got, want in (("microbatches", microbatches, pp.microbatches),
                            ("stages_per_rank", stages_per_rank, pp.stages_per_rank)):
        if got is not None and got != want:
            raise ValueError(f"{what}={got!r}, but plan {plan.name!r} pipelines {pp.label} with {what}={want}. Fix: "
                             f"drop {what} (the plan's is used), or plan again with {what}={got}")
    stage_plan = stage_plan_of(plan)
    pm = parallelize_pipeline(model, mesh, example_inputs, value=pp.label, microbatches=pp.microbatches,
                              stages_per_rank=pp.stages_per_rank, plan=stage_plan,
                              overrides={"pipeline": pp.label}, inputs=inputs, mp_policy=mp_policy,
                              auto=plan if plan.name != stage_plan else None)
    run = pm.pipeline_plan
    if pp.cut and run.cut != pp.cut:
        raise ValueError(f"plan {plan.name!r} pipelines {pp.label} with the stage cut {list(pp.cut)}, but the "
                         f"runtime cuts this model {list(run.cut)} (it balances the captured layers' FLOPs): the "
                         "model or its example inputs differ from those the plan was made for. Fix: the same model "
                         "and inputs, or re-plan (autopar.tune again, or plan='auto')")
    return pm


def _check(model, mesh, top_k, steps, warmup, optimizer) -> None:
    from torch.distributed._local_tensor import local_tensor_mode
    if not isinstance(mesh, DeviceMesh):
        raise TypeError(f"autopar.tune measures plans on a DeviceMesh, got {type(mesh).__name__}; build one with "
                        "init_device_mesh under torchrun (autopar.plan prices plans on axis sizes without running)")
    if local_tensor_mode() is not None or (dist.is_initialized() and dist.get_backend() == "fake"):
        raise ValueError("autopar.tune times real ranks, but it runs under LocalTensorMode or the fake process "
                         "group, where every rank is simulated in one process and times mean nothing. Fix: run it "
                         "under torchrun with one process per rank.")
    for name, v, least in (("top_k", top_k, 0), ("steps", steps, 1), ("warmup", warmup, 0)):
        if not isinstance(v, int) or isinstance(v, bool) or v < least:
            raise ValueError(f"autopar.tune: {name} must be an int >= {least}, got {v!r}")
    if optimizer is not None and not callable(optimizer):
        raise TypeError(f"autopar.tune: optimizer must be a factory params -> torch.optim.Optimizer (e.g. "
                        f"lambda ps: torch.optim.SGD(ps, lr=0.1)), got {type(optimizer).__name__}")
    if not isinstance(model, nn.Module):
        raise TypeError(f"autopar.tune needs an nn.Module, got {type(model).__name__}")


# ----------------------------------------------------------------------------- candidates

def candidates(model: nn.Module, ctx, info, captured, cluster: Cluster, top_k: int) -> list[TuneCandidate]:
    """The ILP's `top_k` best distinct plans, then the hand plans not among them, priced on `cluster`.
    Fewer ILP plans when fewer exist."""
    from autopar.inputs import batch_dims
    from autopar.planner import PLANS, build_plan, check_batch, tie_placements
    from autopar.solver import InfeasibleError

    shapes = captured.example_shapes
    batch = dict(zip(captured.user_inputs, batch_dims(shapes)))
    build = lambda name, exclude=(): build_plan(ctx, info, name, None, batch, cluster=cluster,  # noqa: E731
                                                input_shapes=dict(zip(captured.user_inputs, shapes)),
                                                exclude=exclude, rerank=False)
    found: list[tuple[str, Plan | None, str]] = []
    exclude: list[dict[str, Candidate]] = []
    for i in range(top_k):
        try:
            plan = build("auto", exclude)
        except (InfeasibleError, ValueError) as e:
            if not exclude:
                raise
            if "no plan" not in str(e):
                raise
            break  # every assignment that fits has been found
        choices = plan_choices(plan)[0]
        assert choices not in exclude, "the ILP returned an excluded assignment"
        exclude.append(choices)
        found.append((f"auto#{i + 1}", plan, ""))
    for name in PLANS:
        if name in ("auto", "zero1", "zero2"):  # the ZeRO plans are not measured by tune yet (issue #24)
            continue
        plan = build(name)
        try:
            check_batch(plan)
        except ValueError as e:
            found.append((name, plan, f"not run: {e}"))
            continue
        found.append((name, plan, ""))
    out: list[TuneCandidate] = []
    seen: dict[tuple, int] = {}
    swaps = _interchangeable(info, cluster)
    for name, plan, why in found:
        plan = tie_placements(plan, model)
        same = next((seen[sig] for sig in _signatures(plan, swaps) if sig in seen), None)
        if same is not None and not why:
            out[same] = dataclasses.replace(out[same], name=f"{out[same].name}={name}")
            continue
        if not why:
            seen[_signature(plan)] = len(out)
        # priced as the sum of its parts (compute, communication, the optimizer step; nothing overlapped:
        # `solver.evaluate().time_s` + `optimizer_s`), the quantity a calibration scales linearly; the plan's own
        # estimate is the overlapped timeline
        parts = components(ctx, info, cluster, plan, model)
        out.append(TuneCandidate(name=name, plan=plan, components=parts, skipped=why,
                                 predicted_s=_evaluate(ctx, info, cluster, plan)
                                 + apply_calibration({OPTIMIZER: dict(parts).get(OPTIMIZER, 0.0)},
                                                     cluster.calibration)))
    return out


def _interchangeable(info, cluster: Cluster) -> list[dict[str, str]]:
    """The renamings of mesh axes that leave the step's cost alone: swaps of two axes of the same size that the cost
    model prices alike, on the same link (`cost_model.hardware.axis_link`: on a preset, both within one node) with
    the same calibration (collective factor, latency, synchronisation factor). A plan and its mirror image (the same
    forms with such axes swapped) are then priced alike and run alike (on gloo within one host, groups {0,1},{2,3}
    and {0,2},{1,3} run an all-reduce alike); measured apart, they differ only by noise. Axes a profile measured
    apart (`Cluster.axis_links`) or a calibration scales apart are priced apart, so their mirror images are measured
    apart too: one measurement would be fitted against two predictions."""
    sizes = tuple(info.sizes)
    cal = cluster.calibration

    def priced(i: int):
        return axis_link(cluster, sizes, i), cal.sync_factor(sizes, i) if cal is not None else None

    return [{a: b, b: a} for (i, a), (j, b) in itertools.combinations(enumerate(info.names), 2)
            if sizes[i] == sizes[j] and priced(i) == priced(j)]


def _signatures(plan: Plan, swaps: list[dict[str, str]]) -> list[tuple]:
    """The plan's signature and those of its mirror images under `swaps` (`_interchangeable`)."""
    return [_signature(plan)] + [_signature(mirror(plan, swap)) for swap in swaps]


def mirror(plan: Plan, swap: dict[str, str]) -> Plan:
    """`plan` with mesh axes renamed by `swap` ({"dp": "tp", "tp": "dp"}; an axis not named keeps its name), on the
    same mesh: what a structure did on one axis it does on the other. Placements move with their axis, directives,
    strategies, decisions (labels, axis roles) and `comms` name the other axis; the estimate is kept as it was
    priced, which is right only where the cost model prices the swapped axes alike (`_interchangeable`)."""
    names = [n for n, _ in plan.mesh]
    sizes = dict(plan.mesh)
    if set(swap) - set(names) or set(swap.values()) != set(swap) or any(sizes[a] != sizes[b] for a, b in swap.items()):
        raise ValueError(f"mirror: {swap} is not a swap of mesh axes of equal size of the plan's mesh {plan.mesh}. "
                         "Fix: map axes of the same size onto each other, e.g. {'dp': 'tp', 'tp': 'dp'}")
    from autopar.spec import fmt_placements, placements_from_str
    order = [names.index(swap.get(n, n)) for n in names]
    move = lambda pls: fmt_placements([placements_from_str(pls)[i] for i in order])  # noqa: E731
    axis = lambda a: swap.get(a, a)  # noqa: E731

    def text(label: str) -> str:  # a decision's label ('tp@tp+fsdp') or axis roles ('data dp+tp, sequence -, ...')
        roles = _ROLES.match(label)
        if roles:
            data, seq = ("+".join(map(axis, g.split("+"))) for g in roles.groups())
            return f"data {data}, sequence {seq}, the rest model"
        return re.sub(r"@([^+]+)", lambda m: "@" + axis(m.group(1)), label)

    return dataclasses.replace(
        plan,
        params=tuple((k, move(v)) for k, v in plan.params),
        inputs=tuple((k, move(v)) for k, v in plan.inputs),
        directives=tuple(dataclasses.replace(d, axis="+".join(map(axis, d.axis.split("+")))) for d in plan.directives),
        strategies=tuple(dataclasses.replace(s, axes=tuple(map(axis, s.axes)),
                                             params=tuple((k, move(v)) for k, v in s.params)) for s in plan.strategies),
        decisions=tuple(dataclasses.replace(d, chosen=text(d.chosen), candidates=tuple(
            dataclasses.replace(c, label=text(c.label)) for c in d.candidates)) for d in plan.decisions),
        comms=tuple(dataclasses.replace(c, axis="+".join(map(axis, c.axis.split("+")))) for c in plan.comms))


def _signature(plan: Plan) -> tuple:
    """What makes two plans run alike: placements of parameters and inputs, and the lowering directives."""
    return (plan.params, plan.inputs, tuple(sorted(map(repr, plan.directives))))


_ROLES = re.compile(r"^data (.*), sequence (.*), the rest model$")


def plan_choices(plan: Plan) -> tuple[dict[str, Candidate], tuple[str, ...], tuple[str, ...]]:
    """The assignment the plan's estimate priced ({site key: Candidate}), its data and sequence axes, read off its
    decisions (`autopar.decide`: each structure's chosen label, the axis roles)."""
    from autopar.decide import ROLES_KEY
    from autopar.planner import REPLICATE
    from autopar.sites import Kind

    choices, data, seq = {}, (), ()
    for d in plan.decisions:
        if d.keys == (ROLES_KEY,):
            m = _ROLES.match(d.chosen)
            assert m, d.chosen
            data, seq = (tuple(a for a in g.split("+") if a != "-") for g in m.groups())
            continue
        label, zero = d.chosen, 0  # `Candidate.label`: '+zero1' / '+zero2' / '+fsdp' last, or nothing
        for z in (1, 2):
            if label.endswith(f"+zero{z}"):
                label, zero = label.removesuffix(f"+zero{z}"), z
        fsdp = zero == 2 or label.endswith("+fsdp")
        label = label.removesuffix("+fsdp")
        forms, axes = zip(*(part.partition("@")[::2] for part in label.split("+")))
        cand = Candidate(form="+".join(forms), axes=tuple(a for a in axes if a), fsdp=fsdp, zero=zero)
        for k in d.keys:
            if plan.name != "auto" and d.kind == Kind.LINEAR.value:  # named plans price lone linears replicated
                cand = dataclasses.replace(REPLICATE, fsdp=fsdp)
            choices[k] = cand
    if plan.name != "auto" and not any("S(0)" in p for _, p in plan.inputs):
        data = ()  # the batch is not split: priced without data axes (`planner._estimate`)
    return choices, data, seq


def _evaluate(ctx, info, cluster: Cluster, plan: Plan) -> float:
    from autopar.solver import evaluate
    choices, data, seq = plan_choices(plan)
    return evaluate(ctx, info, cluster, choices, data, seq_axes=seq, other_fsdp=plan.name == "fsdp").time_s


def components(ctx, info, cluster: Cluster, plan: Plan, model: nn.Module | None = None
               ) -> tuple[tuple[str, float], ...]:
    """The plan's predicted step on `cluster` (without calibration) split into the parts a `Calibration` scales:
    each op kind's compute ('compute:<kind>'); each mesh axis' collectives on the critical path ('axis:<i>') and
    its parameter synchronisation ('sync:<i>': FSDP's gathers and the gradient reductions, which the timeline
    overlaps with compute, so a calibration learns how much of them a machine really hides: none where the
    collectives' threads share the cores with compute, most on a GPU); the optimizer step ('optimizer',
    `optimizer_s`, given the model); and the rest. Each part is the prediction with that factor at 2 less the
    prediction with every factor at 1 (the prediction is linear in each factor). Beside the seconds, 'calls:<i>'
    counts the collectives on axis i the prediction sums (a collective a structure shares with others, as FSDP's
    group gathers, counts by its share): the prediction with `_PROBE_S` of latency per collective on the axis
    (`Calibration.latency`) less the one without, over `_PROBE_S`."""
    from autopar.solver import evaluate
    base = dataclasses.replace(cluster, calibration=None)
    one = lambda **kw: dataclasses.replace(base, calibration=Calibration(  # noqa: E731
        mesh_shape=info.sizes, axes=kw.get("axes", (1.0,) * len(info.sizes)), compute=kw.get("compute", {}),
        latency=kw.get("latency", ()), of=base.name))
    choices, data, seq = plan_choices(plan)
    run = lambda c: evaluate(ctx, info, c, choices, data, seq_axes=seq, other_fsdp=plan.name == "fsdp")  # noqa: E731
    sync = lambda sol: sum(c.gather_s + c.reduce_s for c in [*sol.per_site.values(), sol.other])  # noqa: E731
    sol1 = run(one())
    t1, s1 = sol1.time_s, sync(sol1)
    parts = {f"compute:{k}": run(one(compute={k: 2.0})).time_s - t1 for k in KINDS}
    for i, size in enumerate(info.sizes):
        if size > 1:
            sol = run(one(axes=tuple(2.0 if j == i else 1.0 for j in range(len(info.sizes)))))
            parts[f"sync:{i}"] = sync(sol) - s1
            parts[f"axis:{i}"] = sol.time_s - t1 - parts[f"sync:{i}"]
    parts = {k: v for k, v in parts.items() if abs(v) > 1e-15}
    parts[REST] = t1 - sum(parts.values())
    if model is not None:
        parts[OPTIMIZER] = optimizer_s(model, plan, info.sizes, base)
    for i, size in enumerate(info.sizes):
        if size > 1:
            calls = (run(one(latency=tuple(_PROBE_S if j == i else 0.0 for j in range(len(info.sizes))))).time_s
                     - t1) / _PROBE_S
            if calls > 1e-9:
                parts[f"{CALLS}:{i}"] = calls
    return tuple(parts.items())


OPTIMIZER = "optimizer"
# AdamW per parameter element: reads and writes of the parameter, its gradient, two moments and the temporaries of
# the update (torch's single-tensor step: 8 elementwise ops), in element sizes; and ops per parameter tensor
_OPT_PASSES, _OPT_OPS = 20, 8


def optimizer_s(model: nn.Module, plan: Plan, sizes, cluster: Cluster) -> float:
    """The optimizer step's time on one rank under `plan` (left out of the plan's estimate): AdamW's elementwise
    passes over this rank's part of every parameter at the memory rate, and its ops per parameter tensor at the
    framework's per-op overhead. A calibration scales it (`Calibration.compute["optimizer"]`)."""
    from autopar.spec import Shard, placements_from_str
    where = dict(plan.params)
    rate = cluster.memory_bytes_per_s * cluster.memory_efficiency
    seconds = 0.0
    for name, p in model.named_parameters():
        pls = placements_from_str(where[name]) if name in where else ()
        ranks = math.prod(n for n, pl in zip(sizes, pls) if isinstance(pl, Shard))
        seconds += _OPT_PASSES * p.numel() * p.element_size() / ranks / rate + _OPT_OPS * (cluster.op_overhead_s or 0.0)
    return seconds


# ----------------------------------------------------------------------------- calibration

def apply_calibration(parts: dict[str, float], cal: Calibration | None) -> float:
    """The prediction `parts` (`components`) under `cal` (None: the seconds as priced, no latency per collective)."""
    return sum(v * _factor(k, cal) for k, v in parts.items())


def _factor(part: str, cal: Calibration | None) -> float:
    """What multiplies the part: a factor for seconds, the seconds per collective for a count of collectives."""
    what, _, name = part.partition(":")
    if what == CALLS:
        return cal.latency_s(cal.mesh_shape, int(name)) if cal is not None else 0.0
    if cal is None:
        return 1.0
    if what == "compute":
        return cal.compute.get(name, 1.0)
    if what == "axis":
        return cal.axes[int(name)] if cal.axes else 1.0
    if what == "sync":
        return cal.sync_factor(cal.mesh_shape, int(name))
    if what == OPTIMIZER:
        return cal.compute.get(OPTIMIZER, 1.0)
    return 1.0


def fit_calibration(fits: list[tuple[dict[str, float], float]], mesh_shape: tuple[int, ...], *, of: str,
                    ridge: float = 0.1, latency_ridge: float = 10.0, source: str = "") -> Calibration:
    """Factors per op kind (and the optimizer step), per mesh axis for its critical-path collectives and for its
    parameter synchronisation, and per mesh axis the seconds each collective adds (`components`), such that the
    calibrated predictions of `fits` ([(components, measured seconds)]) best match the measurements in relative
    error: predicted = sum_k c_k compute_k + c_opt optimizer + sum_i (a_i axis_i + b_i sync_i + l_i calls_i) + rest,
    every factor and latency >= 0 (non-negative least squares, `_nnls`, with ridge rows).

    Every factor is pulled towards the one global factor that fits best (weight `ridge`), so parts the
    measurements cannot tell apart (always in the same proportion) share it; factors stay within 1/20 and 20 times
    that global factor. The latency (the fixed cost of a blocking collective that no message size explains, beyond
    what the profile measured: waking every rank's threads on contended CPU cores) is pulled towards none (weight
    `latency_ridge`, in units of the step's seconds per collective), so it is charged only where the measurements
    clearly ask for it: plans with more collectives slower than their seconds explain."""
    if not fits:
        raise ValueError("fit_calibration needs at least one (components, measured seconds) pair")
    names = sorted({k for parts, _ in fits for k, v in parts.items() if k != REST and abs(v) > 0})
    a = np.array([[parts.get(k, 0.0) / m for k in names] for parts, m in fits]).reshape(len(fits), len(names))
    target = 1.0 - np.array([parts.get(REST, 0.0) / m for parts, m in fits])  # relative: each row / measured
    latency = np.array([k.startswith(f"{CALLS}:") for k in names], dtype=bool)
    seconds = a[:, ~latency].sum(axis=1)
    glob = float(seconds @ target / (seconds @ seconds)) if seconds @ seconds > 0 else 1.0
    glob = glob if glob > 0 else 1.0
    calls = a[:, latency].sum()
    unit = np.where(latency, glob * seconds.sum() / calls if calls > 0 else 1.0, glob)  # solved in these units
    weight = np.sqrt(np.where(latency, latency_ridge, ridge))
    prior = np.where(latency, 0.0, 1.0)
    theta = _nnls(np.vstack([a * unit, np.diag(weight)]), np.concatenate([target, weight * prior])) * unit
    theta[~latency] = np.clip(theta[~latency], glob / 20, glob * 20)
    factors = dict(zip(names, map(float, theta)))
    compute = {k.partition(":")[2]: f for k, f in factors.items() if k.startswith("compute:")}
    if OPTIMIZER in factors:
        compute[OPTIMIZER] = factors[OPTIMIZER]
    axes = tuple(factors.get(f"axis:{i}", glob) for i in range(len(mesh_shape)))
    sync = tuple(factors.get(f"sync:{i}", a) for i, a in enumerate(axes))
    lat = tuple(factors.get(f"{CALLS}:{i}", 0.0) for i in range(len(mesh_shape)))
    return Calibration(compute=compute, axes=axes, sync=sync, latency=lat if any(lat) else (),
                       mesh_shape=tuple(mesh_shape), of=of, samples=len(fits),
                       source=source or f"autopar.tune: {len(fits)} measured steps fitted")


def _nnls(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """argmin |a x - b| over x >= 0 (Lawson and Hanson's active set method)."""
    n = a.shape[1]
    x, free = np.zeros(n), np.zeros(n, dtype=bool)
    tol = 1e-12 * max(1.0, float(np.abs(a).max(initial=0.0)))
    for _ in range(3 * n + 10):
        grad = a.T @ (b - a @ x)
        if free.all() or grad[~free].max() <= tol:
            break
        free[int(np.argmax(np.where(free, -np.inf, grad)))] = True
        while True:
            z = np.zeros(n)
            z[free] = np.linalg.lstsq(a[:, free], b, rcond=None)[0]
            if (z[free] > 0).all():
                x = z
                break
            bad = free & (z <= 0)
            step = float(np.min(x[bad] / (x[bad] - z[bad])))
            x = x + step * (z - x)
            free &= x > tol
    return x


def _calibration_home(cluster, mesh_shape) -> Path | None:
    """The profile whose calibration this run updates: the given profile path, or this machine's (the cached
    profile, or where it would be); None for a preset named or a Cluster given (nothing on disk to correct)."""
    from cost_model.hardware import PRESETS
    if cluster is None:
        return profile_of(mesh_shape)
    if isinstance(cluster, str) and cluster.lower() in PRESETS:
        return None
    return Path(cluster) if isinstance(cluster, (str, os.PathLike)) else None


def _update_calibration(profile: Path | None, base: Cluster, mesh_shape, graph: str, fits, *, save: bool
                        ) -> Calibration:
    """Refit on this run's measurements and those saved beside `profile` for other models (same cluster and mesh
    shape); save when asked. Runs on rank 0."""
    kept = []
    path = calibration_path(profile) if profile is not None else None
    if path is not None and path.is_file():
        try:
            old = json.loads(path.read_text())
            if old.get("of") == base.name and tuple(old.get("mesh_shape", ())) == tuple(mesh_shape):
                kept = [f for f in old.get("fits", []) if f["graph"] != graph and f.get("parts") == _PARTS]
        except (OSError, ValueError):
            kept = []
    mine = [{"graph": graph, "components": parts, "measured_s": m, "parts": _PARTS} for parts, m in fits]
    every = (kept + mine)[-_MAX_FITS:]
    cal = fit_calibration([(f["components"], f["measured_s"]) for f in every], tuple(mesh_shape), of=base.name,
                          source=f"autopar.tune on {len({f['graph'] for f in every})} model(s), "
                                 f"{len(every)} measured plans")
    if save and path is not None:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".tmp{os.getpid()}")
        tmp.write_text(json.dumps({**json.loads(cal.to_json()), "fits": every}, indent=1))
        tmp.replace(path)
    return cal


# ----------------------------------------------------------------------------- the cache

def _cache_dir() -> Path:
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "autopar" / "tune"


def cache_key(captured, info, cluster: Cluster, model: nn.Module, example_inputs) -> str:
    """A digest of what the measured winner depends on: the captured graph, the mesh, the cluster (uncalibrated)
    and the dtypes of the parameters and inputs."""
    leaves = pytree.tree_leaves(example_inputs)
    text = json.dumps({
        "graph": captured.fingerprint(),
        "mesh": [list(info.names), list(info.sizes)],
        "cluster": hashlib.sha256(dataclasses.replace(cluster, calibration=None).to_json().encode()).hexdigest(),
        "params": sorted({str(p.dtype) for p in model.parameters()}),
        "inputs": [str(a.dtype) if isinstance(a, torch.Tensor) else type(a).__name__ for a in leaves],
    }, sort_keys=True)
    return hashlib.sha256(text.encode()).hexdigest()[:20]


def _from_cache(text: str, key: str, where: str) -> TuneResult:
    data = json.loads(text)
    cal = data.get("calibration")
    return TuneResult(candidates=[TuneCandidate.from_dict(c) for c in data["candidates"]], key=key, measured=False,
                      calibration=Calibration(**{k: v for k, v in cal.items() if k != "format"}) if cal else None,
                      cache_path=where)


# ----------------------------------------------------------------------------- measuring

@dataclass
class _Live:
    cand: TuneCandidate
    pm: nn.Module | None = None
    opt: object = None
    times: list[float] = field(default_factory=list)
    first: list[float] = field(default_factory=list)  # a contender's times in the first rounds
    peaks: list[int] | None = None
    done: int = 0


def _measure(model, mesh, example_inputs, cands: list[TuneCandidate], *, steps, warmup, optimizer, cluster,
             memory_limit, progress) -> list[TuneCandidate]:
    live = [_Live(c) for c in cands if not c.skipped]
    bars = _Bars([c.name for c in cands], warmup + steps, progress)
    for c in cands:
        if c.skipped:
            bars.finish(c.name, c.skipped)
    args, kwargs = _split(example_inputs)
    make_opt = optimizer or (lambda ps: torch.optim.AdamW(ps, lr=1e-4))

    def build(lv: _Live):
        pp = lv.cand.plan.pipeline
        if pp is not None:  # run as parallelize runs the override (module docstring, 6)
            from autopar.pipeline_runtime import parallelize_pipeline
            lv.pm = parallelize_pipeline(model, mesh, example_inputs, value=pp.label, microbatches=pp.microbatches,
                                         stages_per_rank=pp.stages_per_rank, plan=stage_plan_of(lv.cand.plan),
                                         overrides={"pipeline": pp.label}, inputs="global", mp_policy=None)
            run = lv.pm.pipeline_plan  # the runtime's cut (the same on every rank): what a saved plan runs again
            if run != pp:
                plan = lv.cand.plan
                lv.cand = dataclasses.replace(lv.cand, plan=dataclasses.replace(plan, pipeline=run, notes=plan.notes + (
                    f"autopar.tune: the estimate priced the cut {list(pp.cut)}; the runtime runs {list(run.cut)}",)))
        else:
            lv.pm = _lower(model, mesh, example_inputs, lv.cand.plan, f"tune{next(_STREAMS)}")
        lv.opt = make_opt(list(lv.pm.parameters()))

    for lv in live:
        _phase(lv, lambda lv=lv: build(lv), mesh, memory_limit, timed=False)
        if lv.cand.skipped:
            bars.finish(lv.cand.name, lv.cand.skipped)
    def rounds(group: list[_Live], count: int, first_timed: int) -> None:
        for r in range(count):
            alive = [lv for lv in group if not lv.cand.skipped]
            k = r % max(1, len(alive))
            for lv in alive[k:] + alive[:k]:  # each round starts with another candidate
                _phase(lv, lambda lv=lv: _step(lv, args, kwargs, mesh), mesh, memory_limit, timed=r >= first_timed)
                lv.done += 1
                if lv.cand.skipped:
                    lv.pm = lv.opt = None
                    bars.finish(lv.cand.name, lv.cand.skipped)
                else:
                    bars.update(lv.cand.name, lv.done)

    rounds(live, warmup + steps, warmup)
    final = _contenders(live)
    for lv in final:  # the contenders are measured again, in fresh rounds among themselves
        lv.first, lv.times = lv.times, []
    rounds(final, max(2 * steps, 8), 0)
    out = []
    for c in cands:
        lv = next((lv for lv in live if lv.cand.name == c.name), None)
        if lv is None or lv.cand.skipped:
            out.append(lv.cand if lv is not None else c)
            continue
        out.append(dataclasses.replace(lv.cand, measured_s=statistics.median(lv.times),
                                       step_times_s=tuple(lv.first + lv.times), peak_bytes=tuple(lv.peaks or ())))
    bars.close()
    return out


def _contenders(live: list[_Live]) -> list[_Live]:
    """The candidates timed again before the winner is chosen: the 3 fastest so far and the fastest hand plan (a
    near-tie is otherwise decided by the noise of one set of rounds). They run max(2 * steps, 8) fresh rounds among
    themselves, and their measured time is the median of those alone."""
    from autopar.planner import PLANS
    alive = sorted((lv for lv in live if not lv.cand.skipped), key=lambda lv: statistics.median(lv.times))
    hand = [lv for lv in alive if set(lv.cand.name.split("=")) & set(PLANS)]
    out = alive[:3] + [lv for lv in hand[:1] if lv not in alive[:3]]
    return out if len(out) > 1 else []


def _split(example_inputs):
    from autopar.capture import split_example_inputs
    return split_example_inputs(example_inputs)


def _step(lv: _Live, args, kwargs, mesh) -> tuple[float, int]:
    """One training step: (seconds, peak bytes on this rank above its resident state)."""
    cuda = mesh.device_type == "cuda"
    lv.opt.zero_grad(set_to_none=True)
    resident = _state_bytes(lv.pm, lv.opt)  # what the step allocates anew (the first step's optimizer state) is in
    mark = _memory_mark(cuda)  # the peak above this mark
    t0 = time.perf_counter()
    loss = _loss_of(lv.pm(*args, **kwargs))
    loss.backward()
    lv.opt.step()
    if cuda:
        torch.cuda.synchronize()
    seconds = time.perf_counter() - t0
    return seconds, resident + _memory_peak(mark, cuda)


def _loss_of(out) -> torch.Tensor:
    """The scalar a training step differentiates: the output if it is one, a `.loss`, else the first tensor's
    sum (the output's gradient then is ones, as a loss over it would give)."""
    if isinstance(out, torch.Tensor) and out.dim() == 0:
        return out
    loss = getattr(out, "loss", None)
    if isinstance(loss, torch.Tensor):
        return loss
    first = next((t for t in pytree.tree_leaves(out) if isinstance(t, torch.Tensor) and t.requires_grad), None)
    if first is None:
        raise ValueError(f"autopar.tune: the model's output ({type(out).__name__}) holds no tensor that requires "
                         "grad, so there is no training step to time. Fix: return the loss from forward (wrap the "
                         "model with its loss), as for training.")
    return first.sum()


def _state_bytes(pm, opt) -> int:
    """Bytes this rank holds of the parameters, their gradients and the optimizer's state."""
    def local(t):
        if isinstance(t, DTensor):
            t = t.to_local()
        return t.numel() * t.element_size() if isinstance(t, torch.Tensor) else 0
    n = sum(local(p) + local(p.grad) for p in pm.parameters())
    for st in getattr(opt, "state", {}).values():
        n += sum(local(v) for v in st.values() if isinstance(v, torch.Tensor) and v.dim() > 0)
    return n


def _memory_mark(cuda: bool) -> int:
    if cuda:
        torch.cuda.reset_peak_memory_stats()
        return torch.cuda.memory_allocated()
    rss = _status("VmRSS")
    try:  # reset the high-water mark of the resident set to what is resident now (Linux >= 4.0)
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        return -1
    return rss


def _memory_peak(mark: int, cuda: bool) -> int:
    """Bytes allocated at the step's peak above what was allocated before it (0 where it cannot be told)."""
    if cuda:
        return max(0, torch.cuda.max_memory_allocated() - mark)
    if mark < 0:
        return 0
    return max(0, _status("VmHWM") - mark)


def _status(field_name: str) -> int:
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(field_name + ":"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def _phase(lv: _Live, fn, mesh, memory_limit, *, timed: bool) -> None:
    """Run `fn` on this rank, then agree with every rank: skip the candidate on all of them if any failed or
    exceeded `memory_limit`; record the slowest rank's time (`timed`) and each rank's peak memory."""
    error, seconds, peak = None, 0.0, 0
    try:
        got = fn()
        if got is not None:
            seconds, peak = got
    except Exception as e:  # noqa: BLE001 - agreed with every rank below
        error = e
        if isinstance(e, torch.OutOfMemoryError) and torch.cuda.is_available():
            lv.pm = lv.opt = None
            torch.cuda.empty_cache()
    rows = _gather([1.0 if error is not None else 0.0, seconds, float(peak)], mesh)
    failed = [r for r, row in enumerate(rows) if row[0]]
    if failed:
        texts = _gather_objects(None if error is None else _describe(error), mesh)
        first = failed[0]
        lv.cand = dataclasses.replace(lv.cand, skipped=f"rank {first}: {texts[first]}"
                                      + (f" (and ranks {failed[1:]})" if len(failed) > 1 else ""))
        return
    peaks = [int(row[2]) for row in rows]
    if any(peaks):
        lv.peaks = peaks if lv.peaks is None else [max(a, b) for a, b in zip(lv.peaks, peaks)]
    if memory_limit is not None and lv.peaks and max(lv.peaks) > memory_limit:
        r = max(range(len(lv.peaks)), key=lambda i: lv.peaks[i])
        lv.cand = dataclasses.replace(lv.cand, skipped=f"exceeds the memory limit: rank {r} peaked at "
                                      f"{_mib(lv.peaks[r])}, over {_mib(memory_limit)} per rank")
        return
    if timed:
        lv.times.append(max(row[1] for row in rows))


def _describe(e: BaseException) -> str:
    kind = "out of memory" if isinstance(e, torch.OutOfMemoryError) else type(e).__name__
    return f"{kind}: {str(e).strip().splitlines()[0] if str(e).strip() else ''}"[:300]


def _world() -> int:
    return dist.get_world_size() if dist.is_initialized() else 1


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def _gather(values: list[float], mesh) -> list[list[float]]:
    if _world() == 1:
        return [values]
    from autopar.agree import _device
    t = torch.tensor(values, dtype=torch.float64, device=_device(mesh))
    out = [torch.empty_like(t) for _ in range(_world())]
    dist.all_gather(out, t)
    return [o.tolist() for o in out]


def _gather_objects(obj, mesh) -> list:
    if _world() == 1:
        return [obj]
    out: list = [None] * _world()
    dist.all_gather_object(out, obj)
    return out


def _on_rank0(fn, mesh):
    """`fn()` on rank 0, its (picklable) result on every rank; rank 0's error raised on every rank."""
    if _world() == 1:
        return fn()
    from autopar.agree import _portable
    box = [None]
    if _rank() == 0:
        try:
            box = [("ok", fn())]
        except Exception as e:  # noqa: BLE001 - raised on every rank below
            box = [("error", _portable(e))]
    dist.broadcast_object_list(box, src=0)
    kind, value = box[0]
    if kind == "error":
        value.add_note("autopar.tune: rank 0 raised this (it plans and keeps the cache); raised on every rank")
        raise value
    return value


class _Bars:
    """Rank 0: one progress bar per candidate on stderr (redrawn in place on a terminal; elsewhere a line when a
    candidate finishes)."""

    def __init__(self, names: list[str], total: int, enabled: bool):
        self.names, self.total, self.enabled = names, total, enabled
        self.state = {n: (0, "") for n in names}
        self.tty = enabled and sys.stderr.isatty()
        self.drawn = False

    def _line(self, name: str) -> str:
        done, note = self.state[name]
        width = 24
        filled = min(width, width * done // max(1, self.total))
        return f"autopar tune {name:<16} [{'#' * filled}{'.' * (width - filled)}] {done}/{self.total} {note}"[:150]

    def _draw(self) -> None:
        if self.drawn:
            sys.stderr.write(f"\x1b[{len(self.names)}F")
        sys.stderr.write("".join(self._line(n).ljust(100) + "\n" for n in self.names))
        sys.stderr.flush()
        self.drawn = True

    def update(self, name: str, done: int) -> None:
        if not self.enabled:
            return
        self.state[name] = (done, "")
        if self.tty:
            self._draw()
        elif done == self.total:  # (contenders' extra steps are not printed again off a terminal)
            self.state[name] = (done, "done")
            print(self._line(name), file=sys.stderr, flush=True)

    def finish(self, name: str, why: str) -> None:
        if not self.enabled:
            return
        self.state[name] = (self.state[name][0], f"skipped: {why}")
        if self.tty:
            self._draw()
        else:
            print(self._line(name), file=sys.stderr, flush=True)

    def close(self) -> None:
        pass
