"""Plans: what was chosen for every recognised structure and parameter, as readable data.

A `Plan` is frozen, round-trips through JSON, is keyed by names a person can read (module paths,
parameter FQNs, input names), prints as a table and diffs against another plan. After lowering,
`ParallelModule.plan` also lists every collective inserted with the bytes it moves per step.

`explain(key)` prints, from the `Decision`s recorded at planning time (`autopar.decide`), every form a
structure could take, priced per device, the one chosen and what decided it:

    layers.0.attn (attention; also layers.1.attn: identical, solved once)
      chosen heads@tp: cheapest: the least estimated time of 4 possible candidates
        candidate       compute     comm        time        memory/device
        replicate       0.635 ms    0.015 ms    0.650 ms    696.0 MiB
      * heads@tp        0.159 ms    0.251 ms    0.410 ms    198.0 MiB
        ring            excluded: it takes a sequence axis; this plan has none (roles: dp data, tp model)

`to_html(path)` writes the report (`autopar.report`).
"""

from __future__ import annotations

import dataclasses
import enum
import json
from collections import defaultdict
from dataclasses import asdict, dataclass, replace

from autopar.pipeline_plan import PipelinePlan
from autopar.spec import placements_from_str
from autopar.units import fmt_bytes as _fmt_bytes


class DirectiveKind(str, enum.Enum):
    """What a lowering directive asks for (`Directive`)."""

    HINT = "hint"  # the value of `node` takes placement `value` on `axis` (every use reads it so)
    ROW_OUTPUT = "row_output"  # the row-parallel linear `node`'s output (before its bias) takes `value` on `axis`
    ATTENTION = "attention"  # attention `node` runs in mode `value` (an AttentionMode) over `axis`
    EXPERTS = "experts"  # MoE experts `node` has its experts sharded over `axis`
    # parameter `node` (its fqn) is all-gathered on `axis` before use (FSDP); `value` GATHER_KEEP: kept gathered
    # from forward to backward, else ("") released after forward and gathered again in backward
    GATHER = "gather"
    ZIGZAG = "zigzag"  # shards of a dim over `axis` use the zigzag layout (context parallelism)
    CAUSAL_MASK = "causal_mask"  # attention `node`'s mask is the causal mask: ring over `axis` drops it, is_causal
    # the fused projection `node` runs as one projection per feature block, on row blocks of its (replicated)
    # weight; `value` lists the blocks as `taker:first:end:heads,...` (the node taking each block of the output):
    # a block whose heads divide over `axis` is split over it, the others stay replicated
    PARTS = "parts"
    # ZeRO-1 (`autopar.forms.zero`): the optimizer steps parameter `node`'s shard over the data axis `axis`, on
    # tensor dim `value`, and the parameter is all-gathered after the step (`autopar.runtime.local_step`)
    SHARD_STEP = "shard_step"


GATHER_KEEP = "keep"
# ZeRO-2 (`autopar.forms.zero`): the gathered parameters persist from one step to the next, gathered again only after
# the shards change (an optimizer step, a load), before the next forward (`autopar.runtime.fsdp`)
GATHER_PERSIST = "persist"


class AttentionMode(str, enum.Enum):
    ALL_TO_ALL = "all_to_all"  # Ulysses: heads-sharded attention between sequence<->heads all-to-alls
    RING = "kv_ring"  # K/V circulate over the axis in p-1 steps, zigzag layout


@dataclass(frozen=True, kw_only=True)
class Directive:
    """One thing lowering must do beyond placing parameters and inputs, keyed by graph names (node names of
    the captured graph, parameter fqns), so that a saved plan lowers on its own."""

    kind: DirectiveKind
    node: str
    axis: str
    value: str = ""

    def __post_init__(self):
        object.__setattr__(self, "kind", DirectiveKind(self.kind))


def form_label(form: str, axes: tuple[str, ...]) -> str:
    """How plans print a form on its axes: 'replicate', 'heads@tp', 'heads@tp+ring@cp'."""
    parts = form.split("+")
    if len(parts) == len(axes) > 1:
        return "+".join(f"{f}@{a}" for f, a in zip(parts, axes))
    return form + (f"@{axes[0]}" if axes else "")


@dataclass(frozen=True, kw_only=True)
class Strategy:
    key: str  # module path of the structure, e.g. "h.0.attn"
    kind: str  # linear | embedding | attention | mlp | loss | norm | moe
    form: str  # a registered form's name (autopar.forms)
    axes: tuple[str, ...] = ()  # mesh axes the form uses (two for heads+ring)
    params: tuple[tuple[str, str], ...] = ()  # (parameter fqn, placements) of the structure's own parameters
    members: tuple[str, ...] = ()  # module paths of the layers it covers (collectives there are its own)
    note: str = ""

    @property
    def axis(self) -> str | None:
        return self.axes[0] if self.axes else None

    @property
    def label(self) -> str:
        return form_label(self.form, self.axes)


@dataclass(frozen=True, kw_only=True)
class CommRow:
    module: str
    fn: str
    axis: str
    forward: str
    backward: str
    bytes_forward: int
    bytes_backward: int


@dataclass(frozen=True, kw_only=True)
class SiteEstimate:
    """One structure's share of the estimated step and of device memory ('(other)': what no structure holds)."""

    key: str
    compute_s: float
    comm_s: float
    # seconds of comm_s spent on each mesh axis: comm_s less the same with that axis' links free (what remains is
    # local copies around the collectives)
    comm_axes: tuple[tuple[str, float], ...] = ()
    parameters_bytes: int = 0
    gradients_bytes: int = 0
    optimizer_bytes: int = 0
    activations_bytes: int = 0  # saved for backward
    transient_bytes: int = 0  # FSDP's gathered copy of the parameters
    momentary_bytes: int = 0  # alive only while it runs (the loss' logit gradients); the peak adds the largest


@dataclass(frozen=True, kw_only=True)
class StageEstimate:
    """One rank of a pipeline (`Plan.pipeline`): the stages it runs, per microbatch their time and saved
    activations, the microbatches it holds in flight, its share of the step's tail and its peak memory
    (`autopar.pipeline_estimate`, `cost_model.pipeline`)."""

    key: str  # "pp=0": the rank's coordinate on the pipeline axis
    stages: tuple[int, ...]  # the stage indices it runs (`PipelinePlan.stage_rank`)
    layers: int  # layers it holds (of the model's repeated layers)
    compute_s: float  # per microbatch: forward + backward of its stages (the checkpoint level's recompute included)
    p2p_s: float  # per microbatch: the activations it sends forward and the gradients it sends back
    tail_s: float  # after its last microbatch: exposed gradient reduction and gathers, and its optimizer step
    exposed_s: float = 0.0  # per microbatch: its stages' model-axis collectives no compute hides
    optimizer_s: float = 0.0  # of tail_s: its optimizer step
    sync_s: float = 0.0  # its parameters' synchronisation over the data axes, once per step (of it, tail_s exposes some)
    parameters_bytes: int = 0
    gradients_bytes: int = 0
    optimizer_bytes: int = 0
    activations_bytes: int = 0  # saved for backward by one microbatch through its stages (checkpoint levels applied)
    in_flight: float = 0.0  # microbatches whose activations it holds at its peak (`cost_model.pipeline.in_flight`)
    peak_bytes: int = 0  # its peak memory per device


@dataclass(frozen=True, kw_only=True)
class Estimate:
    """What the cost model predicts for one training step, per device."""

    step_time_s: float
    compute_time_s: float
    comm_time_s: float
    memory_bytes_per_device: int
    comm_bytes_per_step: int
    fits: bool
    memory_limit_bytes: int
    cluster: str
    per_site: tuple[tuple[str, float, int], ...] = ()  # (structure key, time s, memory bytes)
    solver: str = ""  # how the plan was found: status, gap, time
    sites: tuple[SiteEstimate, ...] = ()  # per structure, in plan order: time and memory broken down
    # of comm_time_s, what the step's timeline leaves uncovered by compute (`autopar.timeline`): step = compute + this
    exposed_comm_s: float | None = None
    # of compute_time_s, beyond the structures' compute (`sites`): the optimizer step, and the slowdown of compute that
    # communication overlaps (`autopar.timeline`)
    optimizer_s: float = 0.0
    contention_s: float = 0.0
    # what the activation checkpointing levels change of the structures' saved activations per device (`sites`:
    # at level none), negative: the bytes a recomputing layer no longer keeps for backward
    checkpoint_saved_bytes: float = 0.0
    # per-rank forward FLOPs over one device's, counted on the lowered program's local shapes (`passes.batch_local`:
    # `Work.fraction`); None until the plan is lowered (`parallelize`, `autopar.plan(..., lower=True)`)
    flop_fraction: float | None = None
    # ops that gather the batch (no sharding rule, or a rule that gathers it) and are not batch-local
    # (`passes.batch_local.gathers_batch`): they run whole on every rank of the data axes, and the cost model prices
    # them so (their compute undivided, their inputs gathered)
    unsplit_ops: tuple[str, ...] = ()
    unsplit_compute_s: float = 0.0  # of compute_time_s: theirs, whole on every rank
    unsplit_comm_s: float = 0.0  # of comm_time_s: the all-gathers of their inputs and of their outputs' gradients
    # a pipelined plan (`Plan.pipeline`): the slowest rank's idle time in the schedule, the bytes one rank sends per
    # microbatch per stage boundary (the boundary activation, forward; its gradient backward as many), and per rank
    # its stages' time and memory (memory_bytes_per_device: the largest rank's peak)
    bubble_s: float = 0.0
    p2p_bytes_per_microbatch: int = 0
    stages: tuple[StageEstimate, ...] = ()

    def summary(self) -> str:
        exposed = "" if self.exposed_comm_s is None else f", {self.exposed_comm_s * 1e3:.3f} ms of it exposed"
        flops = "" if self.flop_fraction is None else \
            f", each rank runs {self.flop_fraction:.3f} of one device's FLOPs"
        return (f"cost model ({self.cluster}): {self.step_time_s * 1e3:.3f} ms/step "
                f"(compute {self.compute_time_s * 1e3:.3f} ms, communication {self.comm_time_s * 1e3:.3f} ms{exposed}), "
                f"{_fmt_bytes(self.memory_bytes_per_device)} per device of {_fmt_bytes(self.memory_limit_bytes)}"
                f" ({'fits' if self.fits else 'DOES NOT FIT'}), {_fmt_bytes(self.comm_bytes_per_step)} sent per step (estimated)"
                + flops + (f"; {self.solver}" if self.solver else ""))


@dataclass(frozen=True, kw_only=True)
class CandidateRow:
    """One form a structure could take, priced per device by the cost model (`excluded`: why it could not, then
    no price)."""

    label: str  # e.g. 'heads@tp', 'tp@tp+fsdp'
    compute_s: float = 0.0
    comm_s: float = 0.0
    memory_bytes: int = 0
    excluded: str = ""
    # what it adds to the step as the planner weighs it (communication overlapped, its share of the optimizer step:
    # `autopar.timeline.overlapped_s`); 0.0: compute_s + comm_s
    time_s: float = 0.0

    @property
    def step_s(self) -> float:
        return self.time_s or self.compute_s + self.comm_s


@dataclass(frozen=True, kw_only=True)
class Decision:
    """Why structures took their form (`Plan.explain`): every candidate, the one chosen, what decided it.
    `keys`: the structures it covers (identical layers are solved once); '(axis roles)' for the mesh axes'
    roles, whose rows are the role assignments tried."""

    keys: tuple[str, ...]
    kind: str
    chosen: str
    decided_by: str
    candidates: tuple[CandidateRow, ...] = ()


@dataclass(frozen=True, kw_only=True)
class Plan:
    name: str
    mesh: tuple[tuple[str, int], ...]
    strategies: tuple[Strategy, ...] = ()
    params: tuple[tuple[str, str], ...] = ()  # every parameter fqn -> placements, e.g. ("h.0.fc.weight", "RS(0)")
    inputs: tuple[tuple[str, str], ...] = ()  # user input name -> placements
    directives: tuple[Directive, ...] = ()  # what lowering does beyond placements
    graph: str = ""  # fingerprint of the captured graph the plan was made for (Captured.fingerprint)
    comms: tuple[CommRow, ...] = ()
    notes: tuple[str, ...] = ()
    estimate: Estimate | None = None
    decisions: tuple[Decision, ...] = ()  # recorded at planning time, for explain()
    # mixed precision it was made for (`autopar.precision.Precision.spec()`); "" : the model's dtypes
    precision: str = ""
    # (layer module path, activation checkpointing level) for every layer (`autopar.forms.checkpoint`)
    checkpoint: tuple[tuple[str, str], ...] = ()
    # the pipeline over one mesh axis (`autopar.pipeline_plan`), or None: no axis is pipelined
    pipeline: PipelinePlan | None = None
    # (linear module path, float8 recipe) of every linear whose GEMMs run in fp8 (`autopar.float8`); () : none
    float8: tuple[tuple[str, str], ...] = ()

    def __post_init__(self):
        if self.precision:
            from autopar.precision import Precision
            Precision.parse(self.precision)
        for fqn, pls in self.params + self.inputs:
            try:
                got = placements_from_str(pls)
            except ValueError as e:
                raise ValueError(f"plan entry {fqn!r}: {e}") from None
            if len(got) != len(self.mesh):
                raise ValueError(f"plan entry {fqn!r} has placements {pls!r} for {len(got)} axes, "
                                 f"but the plan's mesh {self.mesh} has {len(self.mesh)}")

    # ------------------------------------------------------------------ data
    def param_placements(self) -> dict[str, tuple]:
        return {k: placements_from_str(v) for k, v in self.params}

    def input_placements(self) -> dict[str, tuple]:
        return {k: placements_from_str(v) for k, v in self.inputs}

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=1)

    @classmethod
    def from_json(cls, text: str) -> "Plan":
        """The Plan `to_json` wrote; a ValueError naming the field (and the parameter or structure) that is not."""
        try:
            d = json.loads(text)
        except json.JSONDecodeError as e:
            raise ValueError(f"not valid JSON: {e.msg} at line {e.lineno}, column {e.colno} (a truncated or "
                             "hand-edited file?)") from None
        return _from_dict(cls, d, "")

    def save(self, path: str) -> None:
        with open(path, "w") as f:
            f.write(self.to_json())

    @classmethod
    def load(cls, path: str) -> "Plan":
        with open(path) as f:
            text = f.read()
        try:
            return cls.from_json(text)
        except ValueError as e:
            raise ValueError(f"plan file {str(path)!r} is not a valid autopar plan: {e}. Fix: re-plan "
                             "(autopar.plan(model, mesh, inputs, plan=...)) and save that Plan with "
                             ".save(path).") from None

    def with_estimate(self, estimate: "Estimate") -> "Plan":
        return replace(self, estimate=estimate)

    def with_comms(self, comms, notes=()) -> "Plan":
        return replace(self, comms=tuple(comms), notes=tuple(self.notes) + tuple(notes))

    # ------------------------------------------------------------------ reading
    def comm_bytes_per_step(self) -> int:
        return sum(c.bytes_forward + c.bytes_backward for c in self.comms)

    def comm_counts(self) -> dict[str, int]:
        """Collectives executed per step, by kind and pass, e.g. {'all_reduce.forward': 4}."""
        out: dict[str, int] = defaultdict(int)
        for c in self.comms:
            for kinds, pass_ in ((c.forward, "forward"), (c.backward, "backward")):
                for kind in kinds.split("+"):  # a fused row, e.g. "reduce_scatter+all_gather"
                    if kind != "-":
                        out[f"{kind}.{pass_}"] += 1
        return dict(out)

    def table(self, full: bool = False) -> str:
        """The plan as a table: one row per structure, identical layers folded into one row
        (`model.layers.{0..79}.self_attn  ×80`, `autopar.layer_rows`); `full=True`: every structure's row."""
        rows = self.table_rows(full=full)
        widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
        lines = [f"Plan {self.name!r} on mesh " + "(" + ", ".join(f"{n}={s}" for n, s in self.mesh) + ")"]
        for i, r in enumerate(rows):
            lines.append("  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip())
            if i == 0:
                lines.append("  ".join("-" * w for w in widths))
        if not full and len(rows) < len(self.table_rows(full=True)):
            lines.append("(a row ×N stands for N identical structures, one per layer: its numbers are each one's; "
                         "plan.table(full=True) or --full lists every row)")
        if self.inputs:
            lines.append("inputs: " + ", ".join(f"{k}={v}" for k, v in self.inputs))
        if self.precision:
            lines.append(f"mixed precision: {self.precision}")
        if self.pipeline is not None:
            pp = self.pipeline
            lines.append(f"pipeline: {pp.label}, {pp.microbatches} microbatches, {pp.stages_per_rank} stage(s) per "
                         f"rank, layer cut {list(pp.cut)}")
        if self.checkpoint:
            lines.append("activation checkpointing: " + self.checkpoint_summary())
        if self.float8:
            lines.append("float8: " + self.float8_summary())
        if self.comms:
            lines.append(f"total: {len(self.comms)} collective nodes, {_fmt_bytes(self.comm_bytes_per_step())} "
                         "sent per rank per step (forward + backward)")
        if self.estimate:
            lines.append(self.estimate.summary())
        lines += [f"note: {n}" for n in self.notes]
        return "\n".join(lines)

    def table_rows(self, full: bool = True) -> list[tuple[str, ...]]:
        """The table's header and one row per structure (and '(other)' for collectives outside them); `full=False`:
        identical layers folded into one row (`autopar.layer_rows.group_rows`)."""
        rows = self._structure_rows()
        if full:
            return rows
        from autopar.layer_rows import group_rows
        return rows[:1] + [row for row, _, _ in group_rows(rows[1:])]

    def _structure_rows(self) -> list[tuple[str, ...]]:
        by_module: dict[str, list[CommRow]] = defaultdict(list)
        for c in self.comms:
            by_module[c.module].append(c)
        rows = [("module", "kind", "form", "placements", "collectives (fwd/bwd)", "bytes/step", "est. time",
                 "est. memory")]
        est = {k: (t, m) for k, t, m in self.estimate.per_site} if self.estimate else {}
        if self.checkpoint:  # the activation checkpointing level of the layer holding each structure
            rows[0] += ("checkpoint",)
        shown = set()
        for s in self.strategies:
            scopes = (s.key,) + s.members
            comms = [c for m, cs in by_module.items() for c in cs if id(c) not in shown
                     and any(m == k or m.startswith(k + ".") for k in scopes)]
            shown.update(id(c) for c in comms)
            pls = _params_cell(s)
            t_m = est.get(s.key)
            rows.append((s.key, s.kind, s.label, pls, _comm_summary(comms),
                         _fmt_bytes(sum(c.bytes_forward + c.bytes_backward for c in comms)),
                         f"{t_m[0] * 1e3:.3f} ms" if t_m else "-", _fmt_bytes(t_m[1]) if t_m else "-")
                        + ((self.layer_level(s.key),) if self.checkpoint else ()))
        rest = [c for c in self.comms if id(c) not in shown]
        if rest or "(other)" in est:
            t_m = est.get("(other)")
            rows.append(("(other)", "", "", "", _comm_summary(rest),
                         _fmt_bytes(sum(c.bytes_forward + c.bytes_backward for c in rest)),
                         f"{t_m[0] * 1e3:.3f} ms" if t_m else "-", _fmt_bytes(t_m[1]) if t_m else "-")
                        + (("-",) if self.checkpoint else ()))
        return rows

    def layer_level(self, key: str) -> str:
        """The checkpoint level of the layer holding structure `key` ('-': in no layer)."""
        return next((level for path, level in self.checkpoint if key == path or key.startswith(path + ".")), "-")

    def float8_summary(self) -> str:
        """'tensorwise on 96 linears (layers.{0..31}.attention.wq, ...)': each recipe with its linears folded."""
        from autopar.layer_rows import group_rows
        by: dict[str, list[str]] = defaultdict(list)
        for key, recipe in self.float8:
            by[recipe].append(key)
        folded = {r: [row[0] for row, _, _ in group_rows([(k,) for k in keys])] for r, keys in by.items()}
        return "; ".join(f"{r} on {len(by[r])} linears ({', '.join(keys)})" for r, keys in folded.items())

    def checkpoint_summary(self) -> str:
        """The level per layer, layers of one level listed together: 'h.0, h.1: full; h.2: none'."""
        by_level: dict[str, list[str]] = defaultdict(list)
        for path, level in self.checkpoint:
            by_level[level].append(path)
        return "; ".join(f"{_keys_list(paths)}: {level}" for level, paths in by_level.items())

    def __str__(self) -> str:
        return self.table()

    def to_html(self, path: str) -> None:
        """Write a self-contained HTML report (`autopar.report`): the table, memory, the step, the collectives."""
        from autopar.report import write_report
        write_report(path, self)

    def explanations(self) -> list[str]:
        """`explain()` in parts: one per decision, each once (a layer's checkpoint and FSDP-gather decisions name
        the same keys: `explain(key)` gives both), then the batch-gathered ops' if any."""
        if not self.decisions:
            return []
        unsplit = _explain_unsplit(self).strip()
        return [_explain_one(d, None) for d in self.decisions] + ([unsplit] if unsplit else [])

    def explain(self, key: str | None = None) -> str:
        """For each structure (or the one `key` names), every form it could take with its estimated compute,
        communication and memory per device, the one chosen and what decided it."""
        return _explain(self, key)

    def diff(self, other: "Plan") -> str:
        """Lines that differ between two plans: strategies by key, parameters by fqn, inputs by name."""
        out = []
        a = {s.key: s for s in self.strategies}
        b = {s.key: s for s in other.strategies}
        for k in sorted(set(a) | set(b)):
            fa = a[k].label if k in a else "-"
            fb = b[k].label if k in b else "-"
            if fa != fb:
                out.append(f"{k}: {fa} -> {fb}")
        for label, x, y in (("checkpoint", dict(self.checkpoint), dict(other.checkpoint)),
                            ("param", dict(self.params), dict(other.params)),
                            ("input", dict(self.inputs), dict(other.inputs))):
            for k in sorted(set(x) | set(y)):
                if x.get(k) != y.get(k):
                    out.append(f"{label} {k}: {x.get(k, '-')} -> {y.get(k, '-')}")
        return "\n".join(out) if out else "(plans are identical)"


def _short(fqn: str, key: str) -> str:
    base = key.split(".{")[0] if key.endswith("}") else key  # 'h.0.{fc,out}': the members of module h.0
    return fqn[len(base) + 1:] if fqn.startswith(base + ".") else fqn


def _comm_summary(comms: list[CommRow]) -> str:
    comms = [c for c in comms if c.forward != "-" or c.backward != "-"]
    if not comms:
        return "-"
    counts: dict[str, int] = defaultdict(int)
    for c in comms:
        if c.forward != "-" or c.backward != "-":  # a split of a value without gradient moves nothing
            counts[f"{c.forward}/{c.backward}@{c.axis}"] += 1
    return ", ".join(f"{n}x {k}" for k, n in sorted(counts.items()))


def _params_cell(s: Strategy) -> str:
    """`name=placement, ...`; many parameters (ModuleList experts) are counted per placement instead."""
    if len(s.params) <= 8:
        return ", ".join(f"{_short(k, s.key)}={v}" for k, v in s.params) or "-"
    counts: dict[str, int] = {}
    for _, v in s.params:
        counts[v] = counts.get(v, 0) + 1
    return f"{len(s.params)} params: " + ", ".join(f"{n}x {v}" for v, n in counts.items())


# ----------------------------------------------------------------------------- explain

def _explain(plan: "Plan", key: str | None) -> str:
    if not plan.decisions:
        raise ValueError(f"plan {plan.name!r} records no candidates to explain (it was saved by an autopar without "
                         "explain, or built by hand). Fix: plan again with autopar.plan(...) or python -m autopar plan")
    if key is None:
        chosen = list(plan.decisions)
    else:
        chosen = [d for d in plan.decisions if key in d.keys]
        if not chosen:
            keys = [k for d in plan.decisions for k in d.keys]
            raise ValueError(f"explain({key!r}): no structure {key!r} in plan {plan.name!r}; keys: {', '.join(keys)}")
    text = "\n\n".join(_explain_one(d, key) for d in chosen)
    return text + _explain_unsplit(plan) if key is None else text


def _explain_unsplit(plan: "Plan") -> str:
    """What the data axes leave whole (`Estimate.unsplit_ops`): the ops that gather the batch, not batch-local,
    and how the cost model priced them."""
    est = plan.estimate
    if est is None or not est.unsplit_ops:
        return ""
    return (f"\n\n(batch gathered) {len(est.unsplit_ops)} op(s) that gather the batch (no sharding rule, or a rule "
            f"that gathers it) are not batch-local (rows "
            f"of the batch mix, or could not be checked: the plan's notes say which): {', '.join(est.unsplit_ops)}. "
            f"They run whole on every rank of the data axes, their inputs gathered; the cost model prices that: "
            f"{est.unsplit_compute_s * 1e3:.3f} ms of compute not divided, {est.unsplit_comm_s * 1e3:.3f} ms of "
            "all-gathers per step (auto weighs it against plans that split the batch less).")


def _explain_one(d: Decision, key: str | None) -> str:
    head = key if key is not None else d.keys[0]
    others = [k for k in d.keys if k != head]
    lines = [f"{head} ({d.kind}" + (f"; also {_keys_list(others)}: identical, solved once" if others else "") + ")",
             f"  chosen {d.chosen}: {d.decided_by}"]
    if not d.candidates:
        return "\n".join(lines)
    width = max(len("candidate"), *(len(r.label) for r in d.candidates))
    lines.append("    " + "candidate".ljust(width) + "  " + "  ".join(h.ljust(10) for h in
                                                                      ("compute", "comm", "time", "memory/device")))
    for r in d.candidates:
        mark = "  * " if r.label == d.chosen else "    "
        priced = not r.excluded or r.compute_s or r.comm_s or r.memory_bytes  # a role assignment over the limit
        cells = (fmt_time(r.compute_s), fmt_time(r.comm_s), fmt_time(r.step_s),
                 _fmt_bytes(r.memory_bytes)) if priced else ()
        line = mark + r.label.ljust(width) + "".join("  " + c.ljust(10) for c in cells)
        lines.append((line + ("  excluded: " + r.excluded if r.excluded else "")).rstrip())
    return "\n".join(lines)


def fmt_time(s: float) -> str:
    return f"{s * 1e3:.3f} ms" if s == 0 or s >= 1e-4 else f"{s * 1e6:.3f} us"


def _keys_list(keys: list[str]) -> str:
    """'a, b', or for many keys their layers as ranges ('layers.{0..79}  ×80'), else the first three and the count."""
    if len(keys) <= 4:
        return ", ".join(keys)
    from autopar.layer_rows import group_rows
    groups = [row[0] for row, _, _ in group_rows([(k,) for k in keys])]
    return ", ".join(groups) if len(groups) <= 3 else f"{', '.join(keys[:3])}, ... ({len(keys)} in all)"


# ----------------------------------------------------------------------------- reading JSON

_SCALARS = {"str": (str,), "int": (int,), "float": (int, float), "bool": (bool,)}


def _from_dict(cls, d, where: str):
    """cls(**d) for a dict read from JSON: every field without a default present, no unknown field, scalars of
    their annotated type, the rest read by `_READERS` (lists become tuples); errors name the field's path."""
    fields = {f.name: f for f in dataclasses.fields(cls)}
    what = f"field {where!r}" if where else "the plan"
    if not isinstance(d, dict):
        raise ValueError(f"{what} must be a JSON object with the fields {', '.join(fields)}, got {_show(d)}")
    unknown = [k for k in d if k not in fields]
    if unknown:
        raise ValueError(f"{what} has the unknown field {unknown[0]!r} (fields: {', '.join(fields)}; saved by "
                         "another version of autopar?)")
    kw = {}
    for name, f in fields.items():
        path = f"{where}.{name}" if where else name
        if name not in d:
            defaulted = f.default is not dataclasses.MISSING or f.default_factory is not dataclasses.MISSING
            if (cls, name) in _REQUIRED or not defaulted:
                raise ValueError(f"field {path!r} is missing")
            continue
        v, types = d[name], _SCALARS.get(f.type)
        if (cls, name) in _READERS:
            kw[name] = _READERS[cls, name](v, path)
        elif types is not None:
            if not isinstance(v, types) or isinstance(v, bool) and bool not in types:
                raise ValueError(f"field {path!r} must be a {f.type}, got {_show(v)}")
            kw[name] = v
        else:
            kw[name] = _tuples(v)
    try:
        return cls(**kw)
    except ValueError as e:
        raise ValueError(f"field {where!r}: {e}" if where else str(e)) from None


def _show(v) -> str:
    text = json.dumps(v) if not isinstance(v, str) else repr(v)
    return f"{type(v).__name__} {text[:60] + '...' if len(text) > 60 else text}"


def _tuples(v):
    return tuple(_tuples(x) for x in v) if isinstance(v, list) else v


def _list(v, path: str) -> list:
    if not isinstance(v, list):
        raise ValueError(f"field {path!r} must be a list, got {_show(v)}")
    return v


def _items(cls):
    """A list of cls objects; each named by its index and its key, node or module."""
    def read(v, path):
        out = []
        for i, x in enumerate(_list(v, path)):
            name = next((x[k] for k in ("key", "node", "module") if isinstance(x, dict) and isinstance(x.get(k), str)),
                        None)
            out.append(_from_dict(cls, x, f"{path}[{i}]" + (f" ({name})" if name else "")))
        return tuple(out)
    return read


def _strs(v, path: str) -> tuple[str, ...]:
    for i, x in enumerate(_list(v, path)):
        if not isinstance(x, str):
            raise ValueError(f"field {path}[{i}] must be a str, got {_show(x)}")
    return tuple(v)


def _rows(*types, what: str):
    """A list of fixed-length rows, e.g. [fqn, placements] pairs; a bad row is named by its first item."""
    def read(v, path):
        for i, x in enumerate(_list(v, path)):
            ok = isinstance(x, list) and len(x) == len(types) and all(
                isinstance(a, t) and not (isinstance(a, bool) and t is not bool) for a, t in zip(x, types))
            if not ok:
                raise ValueError(f"{path}[{i}] must be {what}, got {_show(x)}")
        return tuple(tuple(x) for x in v)
    return read


def _directive_kind(v, path: str) -> DirectiveKind:
    try:
        return DirectiveKind(v)
    except ValueError:
        raise ValueError(f"field {path!r} is {_show(v)}, not a directive kind "
                         f"({', '.join(k.value for k in DirectiveKind)})") from None


def _estimate(v, path: str):
    return None if v is None else _from_dict(Estimate, v, path)


def _pipeline(v, path: str):
    return None if v is None else _from_dict(PipelinePlan, v, path)


_REQUIRED = {(Plan, "params"), (Plan, "inputs")}  # defaulted in Python, but a saved plan without them lost them
_PAIRS = _rows(str, str, what="a [name, placements] pair such as [\"h.0.fc.weight\", \"S(0)R\"]")
_READERS = {
    (Plan, "mesh"): _rows(str, int, what="an [axis name, size] pair such as [\"tp\", 2]"),
    (Plan, "strategies"): _items(Strategy),
    (Plan, "params"): _PAIRS,
    (Plan, "inputs"): _PAIRS,
    (Plan, "directives"): _items(Directive),
    (Plan, "comms"): _items(CommRow),
    (Plan, "notes"): _strs,
    (Plan, "estimate"): _estimate,
    (Plan, "pipeline"): _pipeline,
    (PipelinePlan, "cut"): lambda v, path: tuple(_list(v, path)),
    (Strategy, "axes"): _strs,
    (Strategy, "params"): _PAIRS,
    (Strategy, "members"): _strs,
    (Directive, "kind"): _directive_kind,
    (Estimate, "per_site"): _rows(str, (int, float), int, what="a [structure, time s, memory bytes] row"),
    (Estimate, "sites"): _items(SiteEstimate),
    (Estimate, "stages"): _items(StageEstimate),
    (StageEstimate, "stages"): lambda v, path: tuple(_list(v, path)),
    (Estimate, "unsplit_ops"): _strs,
    (SiteEstimate, "comm_axes"): _rows(str, (int, float), what="an [axis name, seconds] pair such as [\"tp\", 0.001]"),
    (Plan, "decisions"): _items(Decision),
    (Plan, "checkpoint"): _rows(str, str, what="a [layer path, checkpoint level] pair such as [\"layers.0\", \"full\"]"),
    (Plan, "float8"): _rows(str, str, what="a [linear path, float8 recipe] pair such as [\"layers.0.mlp.w1\", \"tensorwise\"]"),
    (Decision, "keys"): _strs,
    (Decision, "candidates"): _items(CandidateRow),
}
