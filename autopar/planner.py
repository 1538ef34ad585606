"""Plans: which form each recognised structure takes on which mesh axes, and the `Plan` that says so.

Named plans:
- `megatron`: tensor parallel on the last mesh axis (the last one no override takes as a sequence or
  data axis) — every structure takes the form that declares
  itself megatron's for its kind (`Form.hand_plans`: attention by heads, MLPs column -> row, MoE
  experts feature-split, vocab-parallel embedding and cross-entropy) — data parallel on the others.
- `dp`: every parameter replicated, the batch sharded over all axes.
- `fsdp`: the batch sharded over all axes and every parameter sharded over them (ZeRO-3 / FSDP2),
  gathered before use.
- `zero1`, `zero2`: the batch sharded over all axes, the optimizer state (zero2: and the gradients) sharded over
  them, the parameters whole for compute, all-gathered after each step (`autopar.forms.zero`).
- `auto`: the ILP (`autopar.solver`) over every form's candidates and every role of the axes, with each layer
  class's checkpoint level and FSDP keep-or-reshard; its best few distinct solutions and the hand plans that fit
  (`megatron`, `fsdp` at each checkpoint level) re-ranked by the plan's own estimate, the step's timeline
  (`_reranked`): the fastest is the plan, and its notes and '(re-ranked)' decision say which and by how much.

A form whose precondition fails is not chosen by a named plan (the structure stays replicated and the
plan notes why); forcing it through `overrides` raises a ValueError that says what to change. Where
several override keys name one structure, the most specific wins whatever the dict's order (an exact
module path beats a glob, which beats a kind; among globs, more literal characters win); equally
specific keys that disagree raise. A batch that does not divide over the plan's data axes keeps the
input replicated and the plan notes it; `check_batch` refuses to run such a plan (`parallelize` calls
it on every rank), and `check_memory_limit` a plan over a user's `memory_limit`.
Everything is read off the registry of forms (`autopar.forms`); no form is named here. The plan
carries what lowering needs (`assemble`): parameter and input placements and the forms' directives.
"""

from __future__ import annotations

import dataclasses
import fnmatch
import itertools
import math
import re

from torch import nn

from autopar.forms import Candidate, Role, form_names, form_of, forms_for
from autopar.forms import checkpoint as ckpt
from autopar.forms import fsdp as fsdp_form
from autopar.forms import zero as zero_form
from autopar.forms.replicate import Replicate
from autopar.mesh import MeshInfo
from autopar.decide import auto_decisions, hand_decisions, site_estimates, unsplit_ops
from autopar.estimate import gather_stats
from autopar.layers import find_layers
from autopar.plan import GATHER_KEEP, Decision, Directive, DirectiveKind, Estimate, Plan, Strategy
from autopar.sites import Kind, PassContext, Site
from autopar.spec import R, Placement, Shard, fmt_placements, placements_from_str
from autopar.units import fmt_bytes

PLANS = ("auto", "megatron", "dp", "fsdp", "zero1", "zero2")
_SHARDED = ("fsdp", "zero2")  # named plans whose parameters are FSDP-sharded (zero2: gathered copies persist)
_DATA_ONLY = ("dp", "fsdp", "zero1", "zero2")  # named plans that take every mesh axis as a data axis
REPLICATE = Candidate(form=Replicate.name)


# ----------------------------------------------------------------------------- overrides

def _parse_value(value, mesh: MeshInfo, default_axis: str) -> Candidate:
    """'heads', 'heads@tp' or 'heads@tp+ring@cp' -> a candidate (form name, axes)."""
    if not isinstance(value, str) or not value:
        raise ValueError(f"override values are form names like 'colwise', 'colwise@tp' or 'heads@tp+ring@cp', "
                         f"got {value!r}")
    names, axes = [], []
    for part in value.split("+"):
        form, _, axis = part.partition("@")
        names.append(form)
        axes.append(axis or default_axis)
    for a in axes:
        mesh.axis(a)  # validates
    name = "+".join(names)
    if name == Replicate.name:
        return REPLICATE
    if len(set(axes)) != len(axes):
        raise ValueError(f"override value {value!r} names mesh axis {axes[0]!r} twice; a combined form takes "
                         "distinct axes, e.g. 'heads@tp+ring@cp'")
    return Candidate(form=name, axes=tuple(axes))


def _match(ctx: PassContext, key: str) -> list[Site]:
    if key in {k.value for k in Kind}:
        return ctx.of_kind(Kind(key))
    return [s for s in ctx.sites if fnmatch.fnmatchcase(s.key, key)]


def specificity(key: str) -> tuple[int, int]:
    """How specific an override key is: a kind < a glob < an exact module path; among globs (and paths), the one
    with more literal characters (fewer wildcards) is more specific. `h.0.attn` beats `h.*.attn` beats `attention`."""
    if key in {k.value for k in Kind}:
        return (0, 0)
    wild = sum(key.count(c) for c in "*?[")
    return (1 if wild else 2, len(key) - wild)


def parse_overrides(ctx: PassContext, mesh: MeshInfo, overrides: dict | None) -> list[tuple[Site, Candidate]]:
    """[(site, candidate)] for every site an override names, validated (forms exist for the kind). Where several
    keys name one site, the most specific key wins (`specificity`), whatever the dict's order; two keys of equal
    specificity that give one site different forms raise."""
    if overrides is not None and not isinstance(overrides, dict):
        raise TypeError(f"overrides must be a dict {{key: form}}, got {type(overrides).__name__}")
    kinds = [k.value for k in Kind]
    winner: dict[tuple, tuple[str, Site, Candidate]] = {}  # (kind, site key) -> (override key, site, candidate)
    for key, value in (overrides or {}).items():
        if not isinstance(key, str):
            raise TypeError(f"override keys are a kind ({', '.join(kinds)}) or a module-path glob such as "
                            f"'h.*.attn', got {type(key).__name__} {key!r}")
        if key == "pipeline":
            from autopar.pipeline_plan import IMPLEMENTED, check_form, parse_pipeline
            form, axis = parse_pipeline(value, tuple(mesh.names))
            check_form(form, value)
            # autopar.parallelize runs the implemented forms (autopar.pipeline_runtime) before planning; here a
            # pipeline would have to be planned and priced (autopar.plan, autopar.tune), which is not written yet
            raise NotImplementedError(
                f"override 'pipeline': {value!r} is not taken on this path (autopar.tune, or a plan lowered "
                f"without the pipeline runtime; issue #23). autopar.parallelize runs the forms "
                f"{', '.join(IMPLEMENTED)} with plan='dp', and autopar.plan(model, mesh_sizes, inputs, "
                f"overrides={{'pipeline': {value!r}}}, microbatches=m) plans and prices it offline. Fix: use one of "
                f"those, or drop the override and give axis {axis!r} another role.")
        cand = _parse_value(value, mesh, mesh.names[-1])
        kind = Kind(key) if key in kinds else None
        if kind is not None and cand.form not in form_names(kind):
            raise ValueError(f"override {key!r}: unknown form {cand.form!r}; valid forms for {kind}: "
                             f"{', '.join(form_names(kind))}")
        sites = _match(ctx, key)
        if not sites:
            found = sorted({s.key for s in ctx.sites})
            why = [n for n in ctx.captured.notes if n.startswith("MoE ") and "left as written" in n]
            raise ValueError(f"override {key!r} matches no recognised structure; keys are a kind "
                             f"({', '.join(kinds)}) or a module-path glob over: {', '.join(found) or '(none)'}"
                             + (f". MoE blocks found but not recognised: {'; '.join(why)}" if why else ""))
        for s in sites:
            if cand.form not in form_names(s.kind):
                raise ValueError(f"override {key!r}: {s.kind} {s.key} has no form {cand.form!r}; valid: "
                                 f"{', '.join(form_names(s.kind))}")
            prev = winner.get((s.kind, s.key))
            if prev is None or specificity(key) > specificity(prev[0]):
                winner[(s.kind, s.key)] = (key, s, cand)
            elif specificity(key) == specificity(prev[0]) and cand != prev[2]:
                raise ValueError(
                    f"overrides {prev[0]!r}: {overrides[prev[0]]!r} and {key!r}: {value!r} both name {s.kind} {s.key} "
                    "and are equally specific, so neither wins. Fix: drop one, or name the structure by its exact "
                    f"module path ({s.key!r}: ...), which beats a glob, which beats a kind.")
    order = {(s.kind, s.key): i for i, s in enumerate(ctx.sites)}
    return [(s, c) for _, s, c in sorted(winner.values(), key=lambda w: order[(w[1].kind, w[1].key)])]


def check_forced(site: Site, cand: Candidate, mesh: MeshInfo) -> None:
    """Raise (what, got, why, fix) when a forced form's precondition fails on its axes."""
    form = form_of(site.kind, cand.form)
    if len(cand.axes) != len(form.roles):
        raise ValueError(f"{site.kind} {site.key}: form {cand.form!r} takes {len(form.roles)} mesh axes, got "
                         f"{cand.axes}; e.g. " + "+".join(f"{p}@<axis>" for p in cand.form.split("+")))
    sizes = tuple(mesh.axis(a).size for a in cand.axes)
    why = form.precondition(site, sizes)
    if why:
        where = ", ".join(f"{a!r} (size {s})" for a, s in zip(cand.axes, sizes))
        raise ValueError(f"{site.kind} {site.key}: form {cand.form!r} on mesh axis {where} is not possible: {why} "
                         f"(mesh {mesh.describe()})")


# ----------------------------------------------------------------------------- named plans

def _tensor_axis(mesh: MeshInfo, forced: list[tuple[Site, Candidate]]) -> str | None:
    """megatron's model axis: the last mesh axis that no override uses in a sequence or data role."""
    taken = {a for s, c in forced for a, ok in _roles_used(s, c) if Role.MODEL not in ok}
    return next((n for n in reversed(mesh.names) if n not in taken), None)


def _hand_choice(site: Site, plan: str, mesh: MeshInfo, tp: str | None, notes: list[str]) -> Candidate:
    """The form a named plan gives a structure: its kind's form for that plan on axis `tp`, if possible."""
    t = mesh.axis(tp).size if tp else 1
    if plan != "megatron" or t == 1:
        return REPLICATE
    for form in forms_for(site.kind):
        if plan in form.hand_plans and form.name != Replicate.name and len(form.roles) == 1 \
                and Role.MODEL in form.roles[0]:
            why = form.precondition(site, (t,))
            if why is None:
                return Candidate(form=form.name, axes=(tp,))
            notes.append(f"{site.kind} {site.key} replicated, not {form.name}@{tp}: {why}")
    return REPLICATE


# ----------------------------------------------------------------------------- placements

class _Placements:
    """Parameter placements as forms assign them, refusing two different shardings of one axis."""

    def __init__(self, ctx: PassContext, mesh: MeshInfo):
        self.ctx, self.mesh = ctx, mesh
        self.pls: dict[str, list[Placement]] = {p: [R] * len(mesh.sizes) for p in ctx.captured.param_fqns}
        self.owner: dict[tuple[str, int], str] = {}

    def of(self, site: Site, cand: Candidate) -> dict[str, dict[int, Placement]]:
        if not cand.axes:
            return {}
        idx = tuple(self.mesh.names.index(a) for a in cand.axes)
        return form_of(site.kind, cand.form).placements(site, idx, tuple(self.mesh.sizes[i] for i in idx))

    def assign(self, site: Site, cand: Candidate) -> None:
        who = f"{site.kind} {site.key} ({cand.label})"
        for ph, per_axis in self.of(site, cand).items():
            for ax, p in per_axis.items():
                old = self.pls[ph][ax]
                if old != R and old != p:
                    raise ValueError(
                        f"parameter {self.ctx.captured.param_fqns[ph]} would need two placements on axis "
                        f"{self.mesh.names[ax]!r}: {old} for {self.owner[(ph, ax)]} and {p} for {who} (tied "
                        "weights?). Fix: give both structures compatible forms through overrides, e.g. the "
                        "embedding 'vocab' with the loss 'vocab', or both 'replicate'.")
                if p != R:
                    self.pls[ph][ax] = p
                    self.owner[(ph, ax)] = who

    def reset(self, site: Site) -> None:
        for ph in site.all_params():
            self.pls[ph] = [R] * len(self.mesh.sizes)

    def shard_step(self, axes: list[str], notes: list[str], phs=None) -> list[Directive]:
        """ZeRO-1: each parameter's (of `phs`; None: every one) optimizer step sharded over the data axes on its
        `fsdp.shard_dim` (the parameter itself stays as placed)."""
        sizes = [self.mesh.axis(a).size for a in axes]
        out = []
        for ph, fqn in self.ctx.captured.param_fqns.items():
            if phs is not None and ph not in phs:
                continue
            shape = tuple(self.ctx.captured.placeholder(ph).meta["val"].shape)
            dim = fsdp_form.shard_dim(shape, self.pls[ph], sizes)
            if dim is None or any(self.pls[ph][self.mesh.names.index(a)] != R for a in axes):
                notes.append(f"parameter {fqn} {shape}: its optimizer state is not sharded (ZeRO-1): no dim (0 or 1) "
                             f"that tensor parallelism leaves whole ({math.prod(sizes)} ranks)")
                continue
            if shape[dim] % math.prod(sizes):
                notes.append(f"parameter {fqn} {shape}: its optimizer step is sharded unevenly (ZeRO-1) on dim {dim} "
                             f"over {math.prod(sizes)} ranks: at most {fsdp_form.padded_rows(shape[dim], sizes)} of its "
                             f"{shape[dim]} rows per rank")
            out += zero_form.shard_step_directives(fqn, axes, dim)
        return out

    def shard_fsdp(self, phs, axes: list[str], notes: list[str]) -> list[Directive]:
        """FSDP: shard each parameter over the data axes on its `fsdp.shard_dim` (the solver prices the same)."""
        sizes = [self.mesh.axis(a).size for a in axes]
        size = math.prod(sizes)
        out = []
        for ph in [p for p in self.ctx.captured.param_fqns if p in phs]:
            fqn = self.ctx.captured.param_fqns[ph]
            shape = tuple(self.ctx.captured.placeholder(ph).meta["val"].shape)
            dim = fsdp_form.shard_dim(shape, self.pls[ph], sizes)
            if dim is None:
                notes.append(f"parameter {fqn} {shape} is not FSDP-sharded: no dim (0 or 1) that tensor parallelism "
                             f"leaves whole ({size} ranks)")
                continue
            if shape[dim] % size:
                rows = fsdp_form.padded_rows(shape[dim], sizes)
                notes.append(f"parameter {fqn} {shape} is FSDP-sharded unevenly on dim {dim} over {size} ranks: at most "
                             f"{rows} of its {shape[dim]} rows per rank, padded to {rows} in its group's collectives")
            for a in axes:
                self.pls[ph][self.mesh.names.index(a)] = Shard(dim)
            out += fsdp_form.gather_directives(fqn, axes)
        return out


def _tied_choices(ctx: PassContext, mesh: MeshInfo, choices: dict[str, Candidate], forced: set[str],
                  notes: list[str]) -> None:
    """Structures that share a parameter (an embedding tied to its LM head) take compatible forms: the side an
    override forced leads (the other takes its kind's form that places the weight alike); when neither is
    forced and they disagree, the weight stays replicated on both."""
    from autopar.solver import _tied_pairs
    probe = _Placements(ctx, mesh)
    for a, b in _tied_pairs(ctx.planning_sites()):
        shared = a.all_params() & b.all_params()
        pa = {ph: v for ph, v in probe.of(a, choices[a.key]).items() if ph in shared}
        pb = {ph: v for ph, v in probe.of(b, choices[b.key]).items() if ph in shared}
        if pa == pb:
            continue
        if a.key in forced and b.key in forced:
            raise ValueError(f"{a.kind} {a.key} ({choices[a.key].label}) and {b.kind} {b.key} "
                             f"({choices[b.key].label}) share a tied weight, which has one placement: force forms "
                             "that place it alike (e.g. both 'vocab' on one axis) or both 'replicate'")
        leader, follower = (a, b) if a.key in forced else (b, a) if b.key in forced else (None, None)
        if leader is None:
            choices[a.key] = choices[b.key] = REPLICATE
            notes.append(f"{a.kind} {a.key} and {b.kind} {b.key} share a tied weight: both replicate")
            continue
        want = pa if leader is a else pb
        cand = REPLICATE
        if want:
            for form in forms_for(follower.kind):
                c = Candidate(form=form.name, axes=choices[leader.key].axes)
                if len(form.roles) == len(c.axes) and form.precondition(
                        follower, tuple(mesh.axis(x).size for x in c.axes)) is None \
                        and {ph: v for ph, v in probe.of(follower, c).items() if ph in shared} == want:
                    cand = c
                    break
            else:
                raise ValueError(f"{leader.kind} {leader.key} is forced to {choices[leader.key].label}, but "
                                 f"{follower.kind} {follower.key} shares its weight and has no form that places it "
                                 "alike. Fix: force compatible forms for both, or 'replicate'")
        choices[follower.key] = cand
        notes.append(f"{a.kind} {a.key} and {b.kind} {b.key} share a tied weight: both {cand.label}"
                     if cand.axes else f"{a.kind} {a.key} and {b.kind} {b.key} share a tied weight: both replicate")


def _roles_used(site: Site, cand: Candidate) -> list[tuple[str, frozenset[Role]]]:
    form = form_of(site.kind, cand.form)
    return list(zip(cand.axes, form.roles))


# ----------------------------------------------------------------------------- the plan

def build_plan(ctx: PassContext, mesh: MeshInfo, name: str, overrides: dict | None,
               input_batch: dict[str, int], *, cluster=None, memory_limit: float | None = None,
               optimizer: str = "adam", input_shapes: dict[str, tuple] | None = None,
               data_axes: tuple[str, ...] | None = None, exclude=(), rerank: bool = True) -> Plan:
    """The plan `name` for the recognised sites, with overrides applied and its cost estimated.

    "auto" asks the ILP (`autopar.solver`); the named plans take each kind's form for that plan and are then
    priced by the same cost model, so they can be compared (and may not fit). `data_axes` (named plans only)
    fixes the axes the batch is sharded over instead of the plan's own choice (re-lowering a plan for new
    shapes keeps its data axes, `autopar.relower`). `exclude` ("auto" only): assignments the ILP's plan must
    differ from (`autopar.solver.no_good`; `autopar.tune` asks for the k best distinct plans).

    "auto" with `rerank` (`_reranked`): the ILP's objective sums each structure's overlapped time
    (`timeline.overlapped_s`), the plan's estimate is the step's timeline; so the ILP's `RERANK_TOP` best distinct
    solutions and the hand plans that fit (`megatron`, `fsdp`, `zero1`, `zero2` at each checkpoint level) are priced
    by that one estimate and the fastest is the plan: auto is never slower than a fitting hand plan by its own
    estimate. This is how auto chooses ZeRO-1/2: whole-plan (every data-parallel parameter alike), not per layer
    class (the ILP's candidates carry fsdp or not, not a ZeRO stage).
    """
    if name not in PLANS:
        raise ValueError(f"plan must be one of {', '.join(map(repr, PLANS))}, a Plan or a path to a saved plan; "
                         f"got {name!r}")
    kw = dict(cluster=cluster, memory_limit=memory_limit, optimizer=optimizer, input_shapes=input_shapes)
    if name == "auto" and rerank:
        return _reranked(ctx, mesh, overrides, input_batch, exclude, kw)
    return _build(ctx, mesh, name, overrides, input_batch, data_axes=data_axes, exclude=exclude, **kw)[0]


def build_priced(ctx: PassContext, mesh: MeshInfo, name: str, overrides: dict | None, input_batch: dict[str, int],
                 **kw):
    """(the plan `name`, the solution its estimate priced: per-structure `Cost`s): what the pipeline's stage model
    composes (`autopar.pipeline_estimate`). "auto" here is the ILP's best solution, not re-ranked against the hand
    plans (each stage's plan is the ILP's)."""
    if name not in PLANS:
        raise ValueError(f"plan must be one of {', '.join(map(repr, PLANS))}, got {name!r}")
    return _build(ctx, mesh, name, overrides, input_batch, **kw)


RERANK_TOP = 3  # the ILP's best distinct solutions `auto` prices on the timeline (`solver.solve(top=)`)
RERANKED_KEY = "(re-ranked)"  # the decision that says which candidate `auto` took


def _hand_variants(overrides: dict | None) -> list[tuple[str, str, dict]]:
    """The hand plans `auto` is ranked against: (label, plan name, overrides). Without form overrides, `megatron`,
    `fsdp`, `zero1` and `zero2` at every checkpoint level (the user's level where an override gives one); with form overrides, none (a
    hand plan with forced forms is the ILP's with those forms)."""
    overrides = dict(overrides or {})
    if any(not ckpt.is_key(k) for k in overrides):
        return []
    named = [n for n in PLANS if n in ("megatron", "fsdp", "zero1", "zero2")]
    if overrides:
        return [(f"{n} (checkpoint as overridden)", n, overrides) for n in named]
    return [(f"{n} + checkpoint {lv}", n, {ckpt.KEY: lv}) for n in named for lv in ckpt.LEVELS]


def _unfit(plan: Plan) -> str:
    """Why a hand plan cannot be `auto`'s: over the memory limit, or its batch does not divide (its estimate would
    price a split its input does not have)."""
    est = plan.estimate
    if not est.fits:
        return f"does not fit: {fmt_bytes(est.memory_bytes_per_device)} over {fmt_bytes(est.memory_limit_bytes)}"
    if any(BATCH_NOTE_RE.match(n) for n in plan.notes):
        return "its batch does not divide over its data axes"
    return ""


def _reranked(ctx: PassContext, mesh: MeshInfo, overrides, input_batch, exclude, kw) -> Plan:
    """`auto`: the ILP's best distinct solutions re-ranked on the step's timeline (`solver.solve(top=, rank=)`),
    then the fitting hand plans: the least estimated step wins (ties: the ILP's). Every candidate is priced by the
    plan's own estimate (`_estimate`), deterministically (no wall clock decides), so every rank plans alike; rank 0
    plans and broadcasts anyway (`autopar.agree.solve_on_rank0`). The plan's notes and its '(re-ranked)' decision
    (`Plan.explain`) say which won and by how much."""
    from autopar.plan import CandidateRow
    plan, sol = _build(ctx, mesh, "auto", overrides, input_batch, exclude=exclude, top=RERANK_TOP, **kw)
    rows = [(f"ILP solution {i + 1}", s.compute_s, t, s.memory_bytes, "")
            for i, (_, t, s) in enumerate(sol.ranking or [(sol.objective_s, plan.estimate.step_time_s, sol)])]
    first = rows[0][2]
    ilp_label = rows[sol.ranked_index][0]
    best, best_t = None, plan.estimate.step_time_s
    for label, hand, hov in ([] if exclude else _hand_variants(overrides)):
        try:
            h = _build(ctx, mesh, hand, hov, input_batch, explain=False, **kw)[0]
        except ValueError as e:  # noqa: PERF203 - a hand plan this model cannot take is no candidate
            rows.append((label, 0.0, 0.0, 0.0, f"not possible: {e}"))
            continue
        why = _unfit(h)
        e = h.estimate
        rows.append((label, e.compute_time_s, e.step_time_s, e.memory_bytes_per_device, why))
        if not why and e.step_time_s < best_t * (1 - 1e-9):
            best, best_t = (label, hand, hov), e.step_time_s
    chosen = best[0] if best else ilp_label
    others = [(t, label) for label, _, t, _, why in rows if not why and label != chosen]
    if chosen != rows[0][0]:
        by = f"{first / best_t - 1:.2%} faster than ILP solution 1 ({best_t * 1e3:.3f} vs {first * 1e3:.3f} ms)"
    elif others:
        t, label = min(others)
        by = (f"ILP solution 1 stays: {t / best_t - 1:.2%} faster than the next, {label} ({best_t * 1e3:.3f} vs "
              f"{t * 1e3:.3f} ms)")
    else:
        by = "ILP solution 1 stays: the only candidate"
    fit = len(rows) - sum(bool(r[4]) for r in rows)
    text = (f"auto: {chosen} re-ranked on the step's timeline ({by}) among {fit} candidates that fit: the ILP's "
            f"{len(sol.ranking) or 1} best distinct solutions and the hand plans megatron, fsdp, zero1, zero2 at each "
            "checkpoint level")
    if best is not None:  # a hand plan is the plan: built as itself, explained as such
        plan = _build(ctx, mesh, best[1], best[2], input_batch, **kw)[0]
        plan = dataclasses.replace(plan, name="auto", estimate=dataclasses.replace(
            plan.estimate, solver=f"{plan.estimate.solver or ''}{'; ' if plan.estimate.solver else ''}"
                                  f"ILP {sol.status}, data axes {_data_axes_of(plan, mesh) or '()'}; {text}"))
    else:
        plan = dataclasses.replace(plan, estimate=dataclasses.replace(plan.estimate,
                                                                      solver=f"{plan.estimate.solver}; {text}"))
    cands = tuple(CandidateRow(label=label, compute_s=c, comm_s=max(0.0, t - c), memory_bytes=int(m), excluded=why,
                               time_s=t)
                  for label, c, t, m, why in rows)
    decision = Decision(keys=(RERANKED_KEY,), kind="plan", chosen=chosen,
                        decided_by=f"the least estimated step (the timeline): {by}", candidates=cands)
    return dataclasses.replace(plan, notes=plan.notes + (text,), decisions=plan.decisions + (decision,))


def _data_axes_of(plan: Plan, mesh: MeshInfo) -> tuple[str, ...]:
    """The axes a plan splits its batch over (dim 0 of its inputs)."""
    axes = {a for _, pls in plan.inputs for a, p in zip(mesh.names, placements_from_str(pls)) if p == Shard(0)}
    return tuple(a for a in mesh.names if a in axes)


def _build(ctx: PassContext, mesh: MeshInfo, name: str, overrides: dict | None, input_batch: dict[str, int], *,
           cluster=None, memory_limit: float | None = None, optimizer: str = "adam",
           input_shapes: dict[str, tuple] | None = None, data_axes: tuple[str, ...] | None = None, exclude=(),
           top: int = 1, explain: bool = True, in_flight: int = 1, data_axes_only: tuple | None = None):
    """`build_plan` without re-ranking: (the plan, the ILP's solution or None). `top` ("auto"): the ILP's best
    distinct solutions re-ranked on the timeline (`solver.solve`); `explain=False`: without the decisions and the
    per-structure breakdown (a candidate `_reranked` only compares). The solution returned is the one the estimate
    priced: the ILP's for "auto", the hand plan's evaluation (`solver.evaluate`) otherwise (its `per_site` costs are
    what `autopar.pipeline_estimate` composes into stages). `in_flight` ("auto"): the microbatches a pipeline stage
    holds at once, its activations counted that many times against `memory_limit` (`solver.solve`)."""
    from autopar import solver as ilp
    from cost_model.hardware import load_cluster

    clus = load_cluster(cluster, mesh.sizes)
    notes: list[str] = []
    layers = _layers(ctx)
    ck_forced: dict[str, ckpt.Level] = {}
    if isinstance(overrides, dict):  # activation checkpointing: the `checkpoint` keys (autopar.forms.checkpoint)
        ck_forced = ckpt.parse_overrides(overrides, layers, specificity)
        overrides = {k: v for k, v in overrides.items() if not ckpt.is_key(k)}
    parsed = parse_overrides(ctx, mesh, overrides)
    for site, cand in parsed:  # a forced form whose precondition fails raises here, saying why
        if cand.axes:
            check_forced(site, cand, mesh)
    planning = {s.key: s for s in ctx.planning_sites()}
    forced = {s.key: c for s, c in parsed if s.key in planning}
    forced_linears = [(s, c) for s, c in parsed if s.key not in planning]  # layers inside a structure
    solution = None
    if name == "auto":
        model_axes = {a for s, c in parsed for a, ok in _roles_used(s, c) if Role.DATA not in ok}
        options = [tuple(c) for r in range(len(mesh.names) + 1) for c in itertools.combinations(mesh.names, r)
                   if not model_axes & set(c)]
        if data_axes_only is not None:  # a pipeline stage's memory-fit plan: the unconstrained plan's data axes
            options = [o for o in options if o == tuple(data_axes_only)]
        batch = max(input_batch.values(), default=0)
        # lone linears are priced replicated whatever their form: the ILP plans the rest, their overrides apply after
        rank = lambda sol: step_timeline(ctx, sol, sol.choices, sol.data_axes, sol.seq_axes, clus,  # noqa: E731
                                          optimizer).makespan_s
        solution = ilp.solve(ctx, mesh, clus, memory_limit=memory_limit,
                             forced={k: c for k, c in forced.items() if planning[k].kind is not Kind.LINEAR},
                             optimizer=optimizer, data_axes_options=options, batch=batch, layers=layers,
                             checkpoint_forced=ck_forced, exclude=exclude, top=top, rank=rank,
                             in_flight=in_flight)
        choices = {s.key: solution.choices[s.key] for s in ctx.planning_sites()}
        levels = {la.path: ckpt.LEVELS[solution.checkpoint[la.path]] for la in layers}
        choices.update({k: c for k, c in forced.items() if planning[k].kind is Kind.LINEAR})
        data_axes, seq_axes = list(solution.data_axes), list(solution.seq_axes)
    else:
        tp = _tensor_axis(mesh, parsed)
        choices = {s.key: _hand_choice(s, name, mesh, tp, notes) for s in ctx.planning_sites()}
        choices.update(forced)
        _tied_choices(ctx, mesh, choices, set(forced), notes)
        default_axes = [n for n in mesh.names if name in _DATA_ONLY or n != tp]
        used = {a for s, c in [(s, choices[s.key]) for s in ctx.planning_sites()] + forced_linears
                for a, ok in _roles_used(s, c) if Role.DATA not in ok}
        data_axes = [a for a in default_axes if a not in used] if data_axes is None else list(data_axes)
        seq_axes = sorted({a for s in ctx.planning_sites() for a, ok in _roles_used(s, choices[s.key])
                           if ok == frozenset({Role.SEQUENCE})})
        if name in _SHARDED:
            choices = {k: Candidate(form=c.form, axes=c.axes, fsdp=True) for k, c in choices.items()}
        levels = {la.path: ck_forced.get(la.path, ckpt.DEFAULT) for la in layers}
    sites = {s.key: s for s in ctx.planning_sites()}
    chosen = [(sites[k], form_of(sites[k].kind, c.form), c) for k, c in choices.items()]
    # parameters
    pls = _Placements(ctx, mesh)
    for site, _, cand in chosen:
        pls.assign(site, cand)
    for site, cand in forced_linears:  # an override of a layer inside a structure replaces its placements
        pls.reset(site)
        pls.assign(site, cand)
    directives: list[Directive] = []
    fsdp_phs = {ph for site, _, cand in chosen if cand.fsdp for ph in site.all_params()}
    if name in _SHARDED:
        owned = {ph for s in ctx.sites for ph in s.all_params()}
        fsdp_phs |= set(ctx.captured.param_fqns) - owned
    if fsdp_phs and data_axes:
        directives += pls.shard_fsdp(fsdp_phs, data_axes, notes)
    if name == "zero2":
        directives = zero_form.persist_directives(directives)
    if name == "zero1" and data_axes:
        directives += pls.shard_step(data_axes, notes)
    if solution is not None and solution.keep_gathered:  # the ILP keeps these layers' gathered weights (ZeRO-2-like)
        directives = _keep_gathered(ctx, layers, solution.keep_gathered, directives, notes)
    # `auto`: the ZeRO stage the ILP gave each class (`Candidate.zero`), per parameter
    zero2_fqns = {ctx.captured.param_fqns[ph] for site, _, cand in chosen if cand.zero == 2 for ph in site.all_params()}
    if zero2_fqns:
        directives = [d for d in directives if d.kind is not DirectiveKind.GATHER or d.node not in zero2_fqns] + \
            zero_form.persist_directives([d for d in directives if d.kind is DirectiveKind.GATHER and d.node in zero2_fqns])
    zero1_phs = {ph for site, _, cand in chosen if cand.zero == 1 for ph in site.all_params()}
    if zero1_phs and data_axes and name != "zero1":
        directives += pls.shard_step(data_axes, notes, zero1_phs)
    # lowering directives
    for site, form, cand in chosen:
        directives += form.directives(site, cand.axes)
        directives += form.plan_directives(site, cand.axes, chosen)
        notes += form.notes(site, cand.axes)
    directives = list(dict.fromkeys(directives))
    strategies = _strategies(ctx, chosen, forced_linears, pls)
    inputs = _input_placements(ctx, mesh, chosen, data_axes, seq_axes, input_batch, input_shapes or {}, notes)
    estimate, priced = _estimate(ctx, mesh, clus, name, choices, solution, data_axes, seq_axes, inputs, optimizer,
                                 memory_limit, layers, levels, explain=explain)
    decisions: tuple = ()
    if not explain:
        pass
    elif solution is not None:
        decisions = auto_decisions(solution, forced, estimate.memory_limit_bytes,
                                   unsplit=gather_stats(ctx)[1].unsplit_ops)
    else:
        decisions = hand_decisions(ctx, mesh, clus, name, choices, data_axes, seq_axes, optimizer, forced, notes)
    if explain:
        decisions += tuple(Decision(keys=(s.key,), kind=s.kind.value, chosen=c.label, decided_by=f"override: forced "
                                    f"to {c.label} (a layer inside a structure: not priced on its own)")
                           for s, c in forced_linears)
        decisions += _checkpoint_decisions(layers, levels, ck_forced, solution, priced)
        decisions += _keep_decisions(solution)
    fqn_pls = {fqn: fmt_placements(pls.pls[ph]) for ph, fqn in ctx.captured.param_fqns.items()}
    float8 = _float8_chosen(ctx, priced)
    if float8 is not None and explain:
        decisions += (_float8_classes_decision(priced),)
    return Plan(float8=float8 or (),name=name, mesh=tuple(zip(mesh.names, mesh.sizes)), strategies=tuple(strategies),
                params=tuple(fqn_pls.items()), inputs=tuple(inputs.items()), directives=tuple(directives),
                graph=ctx.captured.fingerprint() if explain else "", notes=tuple(notes), estimate=estimate,
                decisions=decisions,
                checkpoint=tuple((la.path, levels[la.path].name) for la in layers)), priced


def _float8_chosen(ctx: PassContext, solution) -> tuple[tuple[str, str], ...] | None:
    """`float8="auto"` (`autopar.float8.set_offer`): the (linear, recipe) pairs the priced candidates run in fp8
    (`Candidate.float8`, the ILP's per-class choice or a hand plan's variant where it pays); None without an offer."""
    from autopar.estimate import float8_members
    from autopar.solver import float8_offer
    if not float8_offer(ctx) or solution is None:
        return None
    sites = {s.key: s for s in ctx.planning_sites()}
    return tuple(sorted((float8_members(sites[k])[i].key, c.float8_recipe)
                        for k, c in solution.choices.items() if k in sites for i in c.float8))


def _float8_classes_decision(solution) -> Decision:
    """Which linears each class runs in fp8 and what that gains under its form (`solver.Float8Class`), for the
    `(float8)` decision (`autopar.api._plan_float8` completes it)."""
    from autopar.float8 import DECISION_KEY
    from autopar.plan import CandidateRow
    rows = []
    for fc in getattr(solution, "float8_classes", ()):
        where = fc.keys[0] if len(fc.keys) == 1 else f"{fc.keys[0]} (x{len(fc.keys)})"
        if fc.fp8:
            label = (f"{where} under {fc.chosen}: fp8 on {', '.join(fc.fp8)} of {', '.join(fc.offered)}, saving "
                     f"{(fc.gain_s or 0.0) * 1e3:.4f} ms per structure")
            why = ""
        else:
            label = f"{where} under {fc.chosen}: bf16, fp8 offered on {', '.join(fc.offered)}"
            why = "fp8 pays on none of its linears under this form"
        rows.append(CandidateRow(label=label, excluded=why))
    return Decision(keys=(DECISION_KEY,), kind="float8-classes", chosen="per class", decided_by="the ILP",
                    candidates=tuple(rows))


def _layers(ctx: PassContext):
    """`find_layers` of the captured graph (cached on `ctx` for the graph as it is: `auto` builds several plans)."""
    gm = ctx.captured.gm
    key = (id(gm), len(gm.graph.nodes))
    cached = getattr(ctx, "_layers", None)
    if cached is None or cached[0] != key:
        cached = (key, find_layers(gm, set(ctx.captured.param_fqns) | set(ctx.captured.buffer_fqns)))
        ctx._layers = cached
    return cached[1]


def _keep_gathered(ctx: PassContext, layers, kept: frozenset[str], directives: list[Directive], notes: list[str]
                   ) -> list[Directive]:
    """The gather directives of the parameters of the `kept` layers marked kept gathered from forward to backward
    (`fsdp.keep_gathered`: lowering keeps a layer's group when all its parameters say so), with a note."""
    fqns = {ctx.captured.param_fqns[p] for la in layers if la.path in kept for p in la.params
            if p in ctx.captured.param_fqns}
    out = [dataclasses.replace(d, value=GATHER_KEEP) if d.kind is DirectiveKind.GATHER and d.node in fqns else d
           for d in directives]
    if out != directives:
        paths = [la.path for la in layers if la.path in kept]
        notes.append(f"FSDP keeps the gathered weights of {len(paths)} layer(s) ({paths[0]}"
                     f"{', ...' if len(paths) > 1 else ''}) from forward to backward (ZeRO-2-like): the ILP found the "
                     "backward re-gather it saves worth the memory it holds")
    return out


def _keep_decisions(solution) -> tuple[Decision, ...]:
    """`auto`: per layer group whose FSDP gathers the ILP could keep for backward, whether it kept them, with what
    keeping saves (the backward re-gather's time on the step) and what it holds (gathered weights per device)."""
    from autopar.plan import CandidateRow, fmt_time
    terms = getattr(solution.priced, "checkpoint", None) if solution is not None else None
    kp = getattr(solution.priced, "keep", None) if solution is not None else None
    if terms is None or kp is None:
        return ()
    out = []
    for g, group in enumerate(terms.groups):
        effect = terms.kept_effect(g, kp, solution.choices)
        if effect is None:
            continue
        saved_s, held = effect
        paths = tuple(la.path for la in group.layers)
        kept = paths[0] in solution.keep_gathered
        if kept:
            by = (f"the ILP: keeping saves {fmt_time(saved_s)} of backward re-gathers per step for "
                  f"{fmt_bytes(held)} more held per device, and the plan fits the memory limit with it")
        elif saved_s <= 0:
            by = "the ILP: the backward re-gathers are hidden behind compute, so keeping would only hold memory"
        else:
            by = (f"the ILP, memory limit binding: keeping would save {fmt_time(saved_s)} per step but hold "
                  f"{fmt_bytes(held)} more per device, which the plan's other choices need")
        rows = (CandidateRow(label="reshard after forward", comm_s=saved_s),
                CandidateRow(label="keep gathered for backward", memory_bytes=int(held)))
        out.append(Decision(keys=paths, kind="FSDP gathers", chosen=rows[kept].label, decided_by=by,
                            candidates=rows))
    return tuple(out)


def _checkpoint_decisions(layers, levels: dict, forced: dict, solution, priced) -> tuple[Decision, ...]:
    """One decision per layer class and level: the override that forced it, the named plan's default, or the ILP
    (`auto`: every level priced: recompute time and the bytes kept per device; a named plan: its level's)."""
    from autopar.plan import CandidateRow
    terms = solution.priced.checkpoint if solution is not None else priced.checkpoint_terms
    choices = solution.choices if solution is not None else priced.choices
    out: dict[tuple, list[str]] = {}
    for la in layers:
        out.setdefault((la.cls, levels[la.path].name, la.path in forced), []).append(la.path)
    decisions = []
    for (cls, chosen, was_forced), paths in out.items():
        rows: tuple = ()
        if was_forced:
            by = f"override: forced to {chosen}"
        elif solution is None:
            by = f"the named plan's default (no '{ckpt.KEY}' override names these layers)"
        elif not ckpt.LEVELS[chosen].recomputes:
            by = "the ILP: cheapest (recomputing costs time) and the plan fits the memory limit without it"
        else:
            by = (f"the ILP, memory limit binding: {ckpt.NONE.name} takes less time (no recompute), but with the "
                  "structures' forms this plan chose it does not fit the memory limit")
        group = next((g for g in (terms.groups if terms else []) if paths[0] in {la.path for la in g.layers}), None)
        if group is not None:  # each level's recompute time and what the layers save per device under it
            gi = terms.groups.index(group)
            rows = tuple(CandidateRow(label=lv.name, compute_s=c.compute_s,
                                      memory_bytes=int(terms.saved_bytes(gi, lv, choices)))
                         for lv, c in zip(group.levels, terms.costs[gi]))
        decisions.append(Decision(keys=tuple(paths), kind=f"{ckpt.KEY} ({cls})", chosen=chosen, decided_by=by,
                                  candidates=rows))
    return tuple(decisions)


def _strategies(ctx: PassContext, chosen, forced_linears, pls: _Placements) -> list[Strategy]:
    fqns = ctx.captured.param_fqns
    out = []
    for site, _, cand in chosen:
        own = [ph for _, ph in site.params] + [ph for m in site.members() for _, ph in m.params]
        params = tuple((fqns[p], fmt_placements(pls.pls[p])) for p in dict.fromkeys(own))
        out.append(Strategy(key=site.key, kind=site.kind.value, form=cand.form, axes=cand.axes, params=params,
                            members=tuple(m.key for m in site.members())))
    listed = {s.key for s in out}
    for site, cand in forced_linears:  # layers inside a structure that an override gave their own form
        if site.key not in listed:
            params = tuple((fqns[p], fmt_placements(pls.pls[p])) for _, p in site.params)
            out.append(Strategy(key=site.key, kind=site.kind.value, form=cand.form, axes=cand.axes, params=params))
    return out


_BATCH_NOTE = "input {ph} replicated: batch {batch} does not divide over {dp} data-parallel ranks (axes {axes})"
BATCH_NOTE_RE = re.compile(r"^input (\S+) replicated: batch (\d+) does not divide over (\d+) data-parallel ranks "
                            r"\(axes (.*)\)$")


def _input_placements(ctx, mesh: MeshInfo, chosen, data_axes, seq_axes, input_batch, input_shapes, notes):
    """The batch dim of every batched input over the data axes; token-indexed inputs over the sequence axes. A batch
    that does not divide over the data axes leaves the input replicated and the plan notes it (`_BATCH_NOTE`);
    `check_batch` refuses to run such a plan."""
    dp_size = math.prod(mesh.axis(n).size for n in data_axes)
    seq_len = next((site.seq_len for site, form, _ in chosen if form.sequence), None)
    inputs = {}
    for ph, batch in input_batch.items():
        p = [R] * len(mesh.sizes)
        if batch and batch % dp_size == 0 and dp_size > 1:
            for n in data_axes:
                p[mesh.names.index(n)] = Shard(0)
        elif dp_size > 1 and batch:
            notes.append(_BATCH_NOTE.format(ph=ph, batch=batch, dp=dp_size, axes=tuple(data_axes)))
        dims = input_shapes.get(ph) or ()
        if seq_axes and len(dims) >= 2 and dims[1] == seq_len:
            for n in seq_axes:  # sequence forms: every token-indexed input is split on the sequence
                p[mesh.names.index(n)] = Shard(1)
        inputs[ph] = fmt_placements(p)
    return inputs


def _estimate(ctx, mesh: MeshInfo, clus, name, choices, solution, data_axes, seq_axes, inputs, optimizer,
              memory_limit, layers=(), levels=None, *, explain: bool = True):
    from autopar import solver as ilp
    priced = solution.choices if solution is not None else {}
    if solution is None:
        for s in ctx.planning_sites():  # lone linears are priced replicated
            c = choices[s.key]
            priced[s.key] = Candidate(form=Replicate.name, fsdp=c.fsdp) if s.kind is Kind.LINEAR else c
        batched = any(Shard(0) in placements_from_str(p) for p in inputs.values())
        data_axes = tuple(data_axes) if batched else ()
        solution = ilp.evaluate(ctx, mesh, clus, priced, data_axes, optimizer, tuple(seq_axes),
                                other_fsdp=name in _SHARDED, layers=layers, checkpoint=levels,
                                zero=zero_form.PLANS.get(name, 0))
        priced = {**priced, **{k: c for k, c in solution.choices.items() if c.float8}}  # float8="auto"'s variants
    else:
        data_axes, seq_axes = solution.data_axes, solution.seq_axes
    limit = memory_limit if memory_limit is not None else clus.device_memory_bytes
    solver_note = ""
    if name == "auto":
        solver_note = (f"ILP {solution.status}, gap {solution.gap:.2%}, {solution.classes} site classes, "
                       f"data axes {solution.data_axes or '()'}, solved in {solution.solve_s:.2f} s")
    per_site = tuple((k, c.time_s, int(c.memory_bytes)) for k, c in solution.per_site.items())
    schedule = step_timeline(ctx, solution, priced, data_axes, seq_axes, clus, optimizer)
    optimizer_s = schedule.end["optimizer"] - schedule.start["optimizer"] if "optimizer" in schedule.end else 0.0
    estimate = Estimate(step_time_s=schedule.makespan_s, exposed_comm_s=schedule.exposed_comm_s,
                        compute_time_s=schedule.compute_s, comm_time_s=solution.comm_s, optimizer_s=optimizer_s,
                        contention_s=max(0.0, schedule.compute_s - optimizer_s - solution.compute_s),
                        checkpoint_saved_bytes=solution.checkpoint_cost.act_bytes if solution.checkpoint_cost else 0.0,
                        memory_bytes_per_device=int(solution.memory_bytes), comm_bytes_per_step=int(solution.comm_bytes),
                        fits=solution.memory_bytes <= limit, memory_limit_bytes=int(limit), cluster=clus.name,
                        per_site=per_site, solver=solver_note,
                        **unsplit_ops(ctx, mesh, clus, data_axes, seq_axes, optimizer),
                        sites=site_estimates(ctx, mesh, clus, solution, priced, data_axes, seq_axes, optimizer,
                                             other_fsdp=name in _SHARDED, zero=zero_form.PLANS.get(name, 0))
                        if explain else ())
    return estimate, solution  # the solution: what explain reads of the checkpoint levels


def step_timeline(ctx, solution, priced, data_axes, seq_axes, cluster=None, optimizer="adam") -> "timeline.Schedule":
    """The step's timeline (`autopar.timeline`): the structures in forward order (their anchors' graph order), what
    no structure holds ("other": norms, residuals between them) spread evenly over them; parameter synchronisation
    on the data axes' stream, each structure's own collectives on its axes' stream; then the optimizer step
    (`estimate.optimizer_step_s`), and compute slowed where communication overlaps it (`Cluster.overlap_slowdown`)
    when `cluster` is given (its compute busy time is the estimate's compute time)."""
    from autopar import timeline
    from autopar.estimate import optimizer_step_s
    order = {n: i for i, n in enumerate(ctx.captured.gm.graph.nodes)}
    sites = sorted((s for s in ctx.planning_sites() if s.key in solution.per_site), key=lambda s: order.get(s.node, 0))
    other = solution.other
    # spread evenly over the structures: what no structure holds, and the checkpoint levels' recompute and re-issued
    # collectives (priced per layer class, `solution.checkpoint_cost`)
    spread = [c for c in (other, solution.checkpoint_cost) if c is not None]
    n = max(1, len(sites))
    share = (lambda c, attr: getattr(c, attr) + sum(getattr(o, attr) for o in spread) / n)  # noqa: E731
    sync = "+".join(tuple(data_axes) + tuple(seq_axes)) or "data"
    pieces = []
    for s in sites:
        c, cand = solution.per_site[s.key], priced.get(s.key)
        pieces.append(timeline.Piece(
            key=s.key, compute_s=share(c, "compute_s"), critical_s=share(c, "critical_s"),
            gather_s=share(c, "gather_s"), reduce_s=share(c, "reduce_s"), regather_s=share(c, "regather_s"),
            hidden_s=c.hidden_s, step_gather_s=share(c, "step_gather_s"), sync_stream=sync,
            critical_stream="+".join(cand.axes) if cand is not None and cand.axes else "model"))
    if not pieces and other is not None:
        pieces.append(timeline.piece("(other)", other, sync))
    if cluster is None:
        return timeline.step_schedule(pieces)
    held = [*solution.per_site.values(), *([other] if other is not None else [])]
    return timeline.step_schedule(pieces, optimizer_step_s(held, optimizer, cluster), cluster.overlap_slowdown)


def tie_placements(plan: Plan, model: nn.Module, from_user: bool = False) -> Plan:
    """Tied parameters (one tensor, several names) share one placement: the one the graph uses (a built plan
    places the name the graph reads; the others follow). A Plan the user gave must place them alike already."""
    groups: dict[int, list[str]] = {}
    for fqn, p in model.named_parameters(remove_duplicate=False):
        groups.setdefault(id(p), []).append(fqn)
    pls = dict(plan.params)
    replicated = "R" * len(plan.mesh)
    for names in groups.values():
        given = {n: pls[n] for n in names if n in pls}
        if from_user and len(set(given.values())) > 1:
            raise ValueError(
                f"tied parameters {names} (one tensor under several names) were given different placements "
                f"{given} by the plan; one tensor has one placement. Fix: give every name the same placement in "
                "the Plan (e.g. the one the graph uses, as autopar.plan(...) returns it), or re-plan.")
        chosen = {p for p in given.values() if p != replicated}
        if len(chosen) > 1:
            raise ValueError(f"tied parameters {names} were given different placements {sorted(chosen)}; "
                             "give the structures that share them compatible forms")
        if chosen:
            for n in names:
                pls[n] = next(iter(chosen))
    return dataclasses.replace(plan, params=tuple(pls.items()))


def check_batch(plan: Plan) -> None:
    """Raise when the plan kept an input replicated because its batch does not divide over the data axes: the
    plan would run, but not data parallel as asked."""
    for note in plan.notes:
        m = BATCH_NOTE_RE.match(note)
        if m:
            ph, batch, dp, axes = m.group(1), int(m.group(2)), int(m.group(3)), m.group(4)
            raise ValueError(
                f"input {ph} has batch {batch}, which does not divide over the {dp} data-parallel ranks of mesh axes "
                f"{axes} (mesh {dict(plan.mesh)}): plan {plan.name!r} splits the batch over them. Fix: a batch size "
                f"divisible by {dp} (e.g. {-(-batch // dp) * dp}), or a plan without data parallelism on those axes "
                "(a mesh whose other axes are model-parallel, or plan='auto', which only splits the batch over axes "
                "it divides).")


def check_memory_limit(plan: Plan, memory_limit: float | None) -> None:
    """Raise `InfeasibleError` when the user gave a `memory_limit` and the plan's estimate exceeds it (the ILP
    only returns plans that fit; a hand plan or a given Plan is checked here)."""
    from autopar.solver import InfeasibleError
    est = plan.estimate
    if memory_limit is None or est is None or est.memory_bytes_per_device <= memory_limit:
        return
    raise InfeasibleError(
        f"plan {plan.name!r} needs an estimated {fmt_bytes(est.memory_bytes_per_device)} per device "
        f"(parameters, gradients, optimizer state and activations; cost model {est.cluster}), over the "
        f"memory_limit of {fmt_bytes(memory_limit)} on mesh {dict(plan.mesh)}. Fix: plan='auto' (plans within "
        "the limit, or says the least memory any plan needs), a plan that shards more (e.g. 'fsdp'), more "
        "devices, a smaller batch, or a larger memory_limit.")


__all__ = ["PLANS", "build_plan", "parse_overrides", "check_forced", "check_batch", "check_memory_limit",
           "specificity", "tie_placements"]
