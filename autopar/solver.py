"""The ILP that chooses the plan (`plan="auto"`). The only OR-Tools import in autopar.

Sets
  K   site classes: recognised structures (attention, MLP, embedding, loss, lone linear) grouped by
      a Weisfeiler-Lehman hash of their subgraph (op and shape labels), so the L identical layers of
      a transformer are one class with multiplicity n_k and are solved once.   `_classes`
  C_k candidates of class k: every registered form of its kind (`autopar.forms`) on every tuple of
      mesh axes whose roles the form accepts and where its precondition holds, each with or
      without FSDP sharding of its parameters over the data axes (each on the dim
      `fsdp.shard_dim` gives, as the plan places it; one with none stays whole). `candidates`
  D   the roles of the axes: each axis of size > 1 is a data axis (the batch is split over it), a
      model axis (forms split structures over it) or the sequence axis (at most one; then every
      attention takes a sequence form on it). Every assignment the batch admits is tried (at most
      27 for a 3-D mesh), one ILP each, and the best is kept.                    `_role_options`
  G   layer groups (`autopar.forms.checkpoint.groups`): the model's layers (`autopar.layers`) by class (and by the
      level an override forces), each taking one activation checkpointing level l in L_g (none, selective,
      full; the forced one only). `_checkpoint_terms`
Variables
  x[k,c] in {0,1}: class k takes candidate c.
  y[g,l] in {0,1}: layer group g takes checkpoint level l.
  kept[g] in {0,1}: layer group g's FSDP groups keep their gathered weights from forward to backward (ZeRO-2-like;
      else resharded after forward and gathered again in backward, ZeRO-3). `_keep_terms`, `_keep_vars`
  u[k,g], v[k,g] >= 0: the time class k's sites in g's layers save by keeping (no backward re-gather), the bytes they
      hold by keeping (their gathered weights).
  w[k,g] >= 0: the forward collectives class k's sites in g's layers issue again (re-issued by recomputation).
  T >= 0: the recompute transient (one layer's recomputed tensors in its backward), the largest.
Constraints
  sum_c x[k,c] = 1 for every k                                                 (one-hot)
  tied parameters (an embedding and its LM head) take matching forms and FSDP  (`_tie`)
  each form's own constraints (`Form.add_constraints`, stated through `ConstraintView`), e.g.
      a norm is sequence-parallel on an axis only if every attention / MLP class is tensor parallel
      there; an embedding added to an earlier one (a position embedding) is vocab-parallel on an
      axis only if the earlier one is (their sum is all-reduced once)
  sum_l y[g,l] = 1 for every g                                                 (one level per group)
  w[k,g] >= sum_c fwd[k,c] x[k,c] - M_k (1 - sum_{l recomputes} y[g,l])        (Alpa-style x * y)
  T >= transient[g,l] y[g,l]
  z[g] >= inputs[g,c] x[norm_g,c] - M (1 - recomputes[g]); r[k,g] <= sum_c act[k,c] x[k,c], r[k,g] <= M recomputes[g]
      (`_saved_vars`: a recomputing level frees what g's structures save and keeps the layers' inputs, divided as
      the norms' form divides the residual stream, and its kept outputs)
  u[k,g] <= sum_c saved[k,c] x[k,c], u[k,g] <= M kept[g]; v[k,g] >= sum_c held[k,c] x[k,c] - M (1 - kept[g])
  held + peak <= memory limit, the step's peak per device (`autopar.estimate.peak_bytes`):   (`_solve_one`)
      held = sum_k n_k sum_c held[k,c] x[k,c] + held_other (parameters, optimizer state, FSDP gathers)
             + sum_k,g n_kg v[k,g] (gathered weights kept),
      peak >= sum_k n_k sum_c act[k,c] x[k,c] + act_other + momentary
                + sum_g,l kept[g,l] y[g,l] + sum_g z[g] - sum_k,g n_kg r[k,g] + T        (start of backward),
      (under a pipeline, `solve(in_flight=f)`: the activation and saved-bytes terms times f, the microbatches a
      stage holds at once; T and momentary once)
      peak >= sum_k n_k sum_c grad[k,c] x[k,c] + grad_other + min(GRAD_BUCKET_BYTES, bucketed gradients)
                + reducing                                                (end of backward; a boolean picks the min),
      momentary >= buf[k,c] where x[k,c], and >= buf_other (the largest momentary buffer: the loss' logit gradients)
      reducing >= sum_c red[k,c] x[k,c] for every k, and >= red_other (FSDP's largest group reduction:
      `Cost.reduce_transient_bytes`; linear under the one-hot, no indicator)                    (`_reducing_var`)
Objective
  minimise sum_k n_k sum_c time[k,c] x[k,c] + sum_g,l recompute[g,l] y[g,l] + sum_k,g n_kg w[k,g]
           - sum_k,g n_kg u[k,g] + time_other:
  estimated step time, in integer nanoseconds for CP-SAT. time[k,c] = `timeline.overlapped_s`: compute +
  critical communication (tensor-parallel collectives, exposed) + the part of the parameters' synchronisation
  (FSDP gathers, gradient reductions) the structure's own forward / backward does not cover (each form's `cost`,
  `site_cost`; the rest `other_cost`); the levels' recompute and re-issued collectives (`ckpt.cost`; fwd[k,c] =
  half the candidate's critical communication, its forward collectives, not its gradients' data-axis reduction).
  kept[g,l]: what level l keeps beyond the layers' inputs (selective: matmul and attention outputs), per device.
  The plan's estimate simulates the chosen plan's whole step (`autopar.timeline`).
Resharding edges: every form of this release takes and returns activations replicated on its model
axis, so consecutive structures never reshard between them and edges cost nothing; forms that
keep activations sharded on the sequence (issue #4) add edge variables with Alpa's linearisation
(e[u,v,c,c'] >= x[u,c] + x[v,c'] - 1).

Re-ranking (`solve(top=, rank=)`, `_ranked`): the objective sums each structure's overlapped time, while the
plan's estimate is the step's timeline, which pools the data stream's slack across structures; so the ILP's `top`
best distinct solutions (the best of each role assignment, and the next best of the two best by no-good cuts) are
priced by `rank` (the timeline) and the least wins (`autopar.planner` adds the hand plans).

Determinism: CP-SAT runs single-threaded with a fixed seed; ties break by candidate order. A time
limit bounds each solve; the gap between the best bound and the objective is reported.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
import time
import warnings
from dataclasses import dataclass, field
from typing import Callable

import networkx as nx
import torch
from torch import fx

from autopar.estimate import Cost, MeshCosting, SiteStats, _row_linears, block_nodes, compute_s, gather_stats, \
    mesh_costing, optimizer_step_s, peak_bytes, float8_members, with_float8
from autopar.forms import Candidate, Form, Role, form_of, forms_for
from autopar.forms import checkpoint as ckpt
from autopar.forms import dp as dp_form
from autopar.forms import fsdp as fsdp_form
from autopar.forms.replicate import Replicate
from autopar.mesh import MeshInfo
from autopar.runtime.collectives import GRAD_BUCKET_BYTES
from autopar.sites import Kind, PassContext, Site
from autopar.timeline import ends_s, overlapped_s, steady_s
from autopar.units import fmt_bytes
from cost_model.hardware import Cluster


class InfeasibleError(ValueError):
    """No plan fits the memory limit: `limit_bytes`, and `least_bytes`, the least memory any plan needs."""

    def __init__(self, message: str, *, limit_bytes: float = math.nan, least_bytes: float = math.nan):
        super().__init__(message)
        self.limit_bytes, self.least_bytes = limit_bytes, least_bytes


class _Conflict(Exception):
    def __init__(self, whys: list[str]):
        self.whys = whys


@dataclass
class Solution:
    data_axes: tuple[str, ...]
    choices: dict[str, Candidate]  # site key -> candidate
    time_s: float
    compute_s: float
    comm_s: float
    memory_bytes: float
    comm_bytes: float
    gap: float  # relative: (objective - bound) / objective
    status: str
    solve_s: float
    classes: int
    per_site: dict[str, Cost] = field(default_factory=dict)
    seq_axes: tuple[str, ...] = ()
    site_whys: dict[str, set[str]] = field(default_factory=dict)  # the form constraints that tie each site
    priced: "Priced | None" = None  # every candidate of the chosen role assignment, for Plan.explain
    other: Cost | None = None  # what no structure holds (`other_cost`)
    objective_s: float = 0.0  # what the ILP minimises: the sum of `timeline.overlapped_s` (time_s: nothing overlapped)
    checkpoint: dict[str, str] = field(default_factory=dict)  # layer path -> activation checkpointing level
    checkpoint_cost: Cost | None = None  # what the levels add (recompute, re-issued collectives, saved bytes)
    checkpoint_terms: "CheckpointTerms | None" = None  # evaluate: the given levels priced (explain)
    keep_gathered: frozenset[str] = frozenset()  # layer paths whose FSDP gathered weights are kept for backward
    # re-ranked (`solve(top=, rank=)`): per ILP solution in the ILP's order, (its objective, its rank, its solution),
    # and the index of the one that won
    ranking: list = field(default_factory=list)
    ranked_index: int = 0
    # `float8="auto"` (`float8_offer`): per class with linears offered in fp8, what its choice gains (`_float8_classes`)
    float8_classes: list["Float8Class"] = field(default_factory=list)


@dataclass
class Priced:
    """What `Plan.explain` needs from a solve (`autopar.decide`): every candidate of every class on the chosen
    role assignment with its cost (None where it was left out, with why), the choices the ILP makes without the
    memory limit (only when some class did not take its cheapest candidate), and every role assignment tried."""

    classes: list[list[Site]]
    rows: list[list[tuple[Candidate, Cost | None, str]]]
    pairs: list[tuple[Site, Site]]
    free: dict[str, Candidate] | None = None
    free_memory_bytes: float = 0.0
    roles: list[tuple[tuple[str, ...], tuple[str, ...], "Solution | None", str]] = field(default_factory=list)
    checkpoint: "CheckpointTerms | None" = None  # the layers' levels priced on the chosen role assignment
    keep: "KeepTerms | None" = None  # FSDP's gathered weights kept per layer group, priced on it


# ----------------------------------------------------------------------------- pricing

def site_cost(site: Site, st: SiteStats, cand: Candidate, mc: MeshCosting) -> Cost:
    """What `cand` costs for `site`: the form's own cost model (with FSDP, on the parameters it shards)."""
    form = form_of(site.kind, cand.form)
    if cand.float8:  # its linears in fp8 (`autopar.float8`: the ILP's per-class choice)
        st = with_float8(st, cand.float8, cand.float8_recipe)
    if cand.zero:  # this class's ZeRO stage, whatever the plan's (`autopar.forms.zero`: dp / fsdp priced with it)
        mc = dataclasses.replace(mc, zero=cand.zero)
    if cand.fsdp:
        model = model_placements(site, form, cand.axes, mc.names, [mc.size(a) for a in cand.axes])
        st = fsdp_form.priced_stats(st, _data_sizes(mc), model)
    return step_terms(form.cost(site, st, cand, mc), mc)


def float8_offer(ctx: PassContext) -> dict[str, str]:
    """{linear key: recipe} the ILP may run in fp8 (`autopar.float8.set_offer`; {} : none)."""
    return getattr(ctx, "float8_offer", None) or {}


def float8_variants(site: Site, st: SiteStats, cand: Candidate, cost: Cost, mc: MeshCosting,
                    offer: dict[str, str]) -> list[tuple[Candidate, Cost]]:
    """The fp8 variant of `cand` (priced `cost`) the ILP is offered beside it, per recipe `offer` gives the site's
    linears: those of its offered linears whose fp8 alone makes the structure's time (`timeline.overlapped_s`, the
    ILP's) less under this form, together; none where no linear pays. The form decides it: a linear whose fp8 pays
    under dp (its K, N whole) can lose under tensor parallelism (skinny rowwise shares, whole casts, tp amaxes).
    One variant, not every subset: a linear's fp8 changes its own GEMMs, casts and amaxes, so the structure's time is
    (nearly) additive over its linears and the paying ones together are the best subset (the exhaustive test,
    tests/test_float8_ilp.py, checks it against every subset). Memory sees fp8 only where FSDP keeps a tensorwise
    weight gathered for backward (held in 1 byte), and a variant that saves time saves those bytes too; a linear whose
    fp8 would save held bytes but no time is not offered (open: it matters only where the memory limit binds)."""
    if cand.float8 or not st.float8_facts:
        return []
    members = float8_members(site)
    by_recipe: dict[str, list[int]] = {}
    for i in sorted(st.float8_facts):
        if members[i].key in offer:
            by_recipe.setdefault(offer[members[i].key], []).append(i)
    out = []
    t = overlapped_s(cost)
    for recipe, idx in by_recipe.items():
        singles = [(i, site_cost(site, st, dataclasses.replace(cand, float8=(i,), float8_recipe=recipe), mc))
                   for i in idx]
        paying = [(i, k) for i, k in singles if overlapped_s(k) < t - 1e-15]
        if len(paying) == 1:
            out.append((dataclasses.replace(cand, float8=(paying[0][0],), float8_recipe=recipe), paying[0][1]))
        elif paying:
            c = dataclasses.replace(cand, float8=tuple(i for i, _ in paying), float8_recipe=recipe)
            k = site_cost(site, st, c, mc)
            out.append((c, k))
    return [(c, k) for c, k in out if overlapped_s(k) < t - 1e-15]


@dataclass(frozen=True)
class Float8Class:
    """One class's float8 choice (`Plan.explain`'s (float8) decision): its sites, the candidate chosen, its linears
    offered (names within the structure) and those chosen, and the time per structure fp8 saves under the chosen form
    (its fp8 variant's against the candidate without; None where no linear pays under it)."""

    keys: tuple[str, ...]
    chosen: str
    offered: tuple[str, ...]
    fp8: tuple[str, ...]
    gain_s: float | None


def _float8_classes(best: Solution, classes, stats, offer: dict[str, str]) -> list[Float8Class]:
    mc, cands, costs = best.priced[:3]
    out = []
    for cls, cs, cost in zip(classes, cands, costs):
        site = cls[0]
        members = float8_members(site)
        offered = tuple(i for i in sorted(stats[site.key].float8_facts) if members[i].key in offer)
        if not offered:
            continue
        chosen = best.choices[site.key]
        known = dict(zip(cs, cost))
        bf16 = chosen.without_float8()
        variants = [c for c in cs if c.float8 and c.without_float8() == bf16]
        gain = None
        if variants:
            v = variants[0]
            gain = overlapped_s(known[bf16]) - overlapped_s(known[v]) if bf16 in known else None
        name = lambda i: members[i].key.removeprefix(site.key + ".")  # noqa: E731
        out.append(Float8Class(keys=tuple(s.key for s in cls), chosen=bf16.label,
                               offered=tuple(name(i) for i in offered),
                               fp8=tuple(name(i) for i in chosen.float8), gain_s=gain))
    return out


def step_terms(cost: Cost, mc: MeshCosting) -> Cost:
    """`cost` with what the step's timeline adds to it (`autopar.timeline`): its share of the optimizer step (linear in
    the state it holds: `estimate.optimizer_step_s`) and the cluster's slowdown of compute under overlapped
    communication (`Cluster.overlap_slowdown`), which `timeline.overlapped_s` prices for the ILP."""
    return dataclasses.replace(cost, optimizer_s=optimizer_step_s([cost], mc.optimizer, mc.cluster),
                               overlap_slowdown=mc.cluster.overlap_slowdown)


def model_placements(site: Site, form: Form, axes: tuple[str, ...], names, sizes) -> dict:
    """What `form` on mesh `axes` (of `sizes`) places on the structure's parameters (FSDP takes other dims)."""
    return form.placements(site, tuple(names.index(a) for a in axes), tuple(sizes)) if axes else {}


def _data_sizes(mc: MeshCosting) -> tuple[int, ...]:
    return tuple(mc.size(a) for a in mc.data_axes)


def _unsplit_cost(st: SiteStats, mc: MeshCosting) -> tuple[tuple[float, float], float]:
    """((compute s, communication s), bytes sent) of the nodes without a rule that are not batch-local
    (`SiteStats.unsplit`): their work whole on every rank, their batch-dependent inputs all-gathered on each data
    axis forward and the gradient of the output they split again all-gathered backward (about as many bytes)."""
    if st.unsplit is None:
        return (0.0, 0.0), 0.0
    compute, comm_s, comm_b = compute_s(st.unsplit, 1, mc.cluster), 0.0, 0.0
    for a in mc.data_axes:
        for nbytes in st.unsplit_gather_bytes:
            t, b = mc.collective("all_gather", nbytes, a)
            comm_s, comm_b = comm_s + 2 * t, comm_b + 2 * b
    return (compute, comm_s), comm_b


def other_cost(st: SiteStats, mc: MeshCosting, *, fsdp: bool = False) -> Cost:
    """Nodes and parameters outside every site (data parallel only), the gradient buckets' fixed cost, and
    the reductions of gradients at batch boundaries. `fsdp`: its parameters are FSDP-sharded too (then no
    bucket is left to pay for: every site is FSDP in the plans that set it)."""
    compute = compute_s(st, mc.dp, mc.cluster)
    transient = 0.0
    unsplit_s, unsplit_b = _unsplit_cost(st, mc)
    if fsdp:
        st = fsdp_form.priced_stats(st, _data_sizes(mc), {})
        comm_s, comm_b, state, transient = fsdp_form.params_cost(mc, st, 1, 2 * compute / 3)
        gather = min(comm_s, fsdp_form.gather_s(mc, st, 1))
        regather = min(comm_s - gather, fsdp_form.regather_s(mc, st, 1))
        compute += fsdp_form.copy_s(mc, st, 1)
    reducing = mc.data_axes + mc.seq_axes
    # a boundary one axis reduces, computed from parameters alone: the lowering reduces those parameters in the
    # buckets instead (`passes.lower.replicated_reductions_to_parameters_pass`; not under FSDP, whose parameters are
    # gathered there, nor where the sequence axis splits it)
    # (on a mesh of that one axis: elsewhere a tensor-parallel form may shard its parameters, as a vocab-parallel
    # position embedding's, which the pass then leaves)
    one_axis = [n for n, s in zip(mc.names, mc.sizes) if s > 1] == list(reducing)
    moved = [m is not None and not fsdp and one_axis and len(reducing) == 1 and not (on_seq and reducing[0] in mc.seq_axes)
             for m, on_seq in zip(st.boundary_moved_bytes or [None] * len(st.boundary_grad_bytes),
                                  st.boundary_on_sequence, strict=True)]
    if not fsdp:
        moved_bytes = sum(m for m, mv in zip(st.boundary_moved_bytes or [], moved) if mv)
        comm_s, comm_b = dp_form.grad_sync(mc, st.synced_param_bytes + moved_bytes)
        comm_s += dp_form.bucket_fixed_s(mc)
        state = dp_form.state_bytes(mc, st.param_bytes)
        gather = regather = 0.0
    sync_s = comm_s  # the parameters' synchronisation (overlappable, `autopar.timeline`); the rest is critical
    step_t = 0.0
    if not fsdp:  # zero1's gather after the step (`Cost.step_gather_s`)
        step_t, step_b = dp_form.step_gather(mc, st.param_bytes)
        comm_s, comm_b = comm_s + step_t, comm_b + step_b
    compute, comm_s, comm_b = compute + unsplit_s[0], comm_s + unsplit_s[1], comm_b + unsplit_b
    seq = math.prod(mc.size(a) for a in mc.seq_axes)
    for a in reducing:
        reduce_bytes = st.boundary_reduce_bytes or st.boundary_grad_bytes
        for nbytes, rbytes, on_seq, mv in zip(st.boundary_grad_bytes, reduce_bytes, st.boundary_on_sequence, moved,
                                              strict=True):
            if mv:
                continue
            # a value holding the sequence is split on a sequence axis: its gradient is all-gathered backward (in its
            # own dtype); on a data axis, its shard of the sequence is all-reduced (the lowering splits the sequence
            # first; under mixed precision in reduce_dtype: `rbytes`)
            if on_seq and a in mc.seq_axes:
                t, b = mc.collective("all_gather", nbytes, a)
            else:
                t, b = mc.collective("all_reduce", rbytes / seq if on_seq else rbytes, a)
            comm_s, comm_b = comm_s + t, comm_b + b
    # saved activations: split over the data and sequence axes with the batch; those that do not depend on it only
    # over the sequence axes, where they hold the sequence (`attribute_saved`)
    act = (st.saved_bytes / mc.dp + st.saved_unbatched_seq_bytes / seq
           + st.saved_unbatched_bytes - st.saved_unbatched_seq_bytes)
    return step_terms(Cost(compute_s=compute, comm_s=comm_s, comm_bytes=comm_b, memory_bytes=state + act,
                           act_bytes=act, transient_bytes=transient, peak_bytes=st.peak_bytes / mc.dp,
                           bucket_bytes=0.0 if fsdp else dp_form.bucket_bytes(mc, st.param_bytes), gather_s=gather,
                           reduce_s=sync_s - gather - regather, regather_s=regather, step_gather_s=step_t,
                           reduce_transient_bytes=fsdp_form.reduce_transient_bytes(mc, st, 1) if fsdp else 0.0), mc)


# ----------------------------------------------------------------------------- classes and candidates

def _signature(site: Site) -> str:
    """A Weisfeiler-Lehman hash of the site's subgraph (op and shape labels), kept in its anchor node's meta (for
    this graph as it is: planning asks for it once per plan)."""
    graph = site.node.graph
    key = (site.kind.value, site.key, id(graph), len(graph.nodes))
    memo = site.node.meta.setdefault("autopar_signature", {})
    if key not in memo:
        memo[key] = _wl_hash(site)
    return memo[key]


def _wl_hash(site: Site) -> str:
    nodes = block_nodes(site)
    g = nx.DiGraph()
    for n in nodes:
        val = n.meta.get("val")
        shape = tuple(val.shape) if hasattr(val, "shape") else ()
        g.add_node(n.name, label=f"{n.target}:{shape}")
    names = {n.name for n in nodes}
    for n in nodes:
        for a in n.all_input_nodes:
            if a.name in names:
                g.add_edge(a.name, n.name)
    with warnings.catch_warnings():  # networkx notes that directed-graph hashes changed in 3.5: ours are per run
        warnings.simplefilter("ignore", UserWarning)
        return site.kind.value + ":" + nx.weisfeiler_lehman_graph_hash(g, node_attr="label", iterations=3)


def _classes(sites: list[Site], tied: set[str], stats=None) -> list[list[Site]]:
    """Sites priced alike: the same graph, and their parameters in FSDP groups of the same bytes and resharding (a
    parameter pays its share of its group's collective: a layer's norm and the final norm differ)."""
    groups: dict[str, list[Site]] = {}
    for s in sites:
        key = s.key if s.key in tied else _signature(s)
        if stats is not None and s.key in stats:
            key += repr(sorted(stats[s.key].fsdp_groups.values()))
        groups.setdefault(key, []).append(s)
    return list(groups.values())


def axis_roles(mesh: MeshInfo, data_axes, seq_axes) -> dict[str, Role]:
    """The role of every mesh axis of size > 1."""
    return {n: Role.DATA if n in data_axes else Role.SEQUENCE if n in seq_axes else Role.MODEL
            for n, s in zip(mesh.names, mesh.sizes) if s > 1}


def form_axes(form: Form, roles: dict[str, Role]) -> list[tuple[str, ...]]:
    """The tuples of distinct axes whose roles `form` accepts, one per axis it takes."""
    return [axes for axes in itertools.permutations(roles, len(form.roles))
            if all(roles[a] in ok for a, ok in zip(axes, form.roles))]


def candidates(site: Site, st: SiteStats, mesh: MeshInfo, data_axes, forced: Candidate | None,
               seq_axes=()) -> list[Candidate]:
    """Every form of the site's kind on every admissible tuple of axes, with and without FSDP."""
    out = [c for c, why in all_candidates(site, st, mesh, data_axes, forced, seq_axes) if not why]
    if forced is not None:
        keep = [c for c in out if c.form == forced.form and (not forced.axes or c.axes == forced.axes)]
        if not keep:
            raise ValueError(f"{site.kind} {site.key}: the forced form {forced.label} is not possible with data axes "
                             f"{data_axes} on mesh {mesh.describe()}")
        out = keep
    return out


def all_candidates(site: Site, st: SiteStats, mesh: MeshInfo, data_axes, forced: Candidate | None = None,
                   seq_axes=()) -> list[tuple[Candidate, str]]:
    """`candidates` with the ones left out and why ('' for those offered), in the solver's order (for
    `Plan.explain`): a form the solver does not offer, a sequence split that attention must follow, a form
    whose axes' roles no axis of this plan has, a precondition, FSDP's precondition."""
    roles = axis_roles(mesh, data_axes, seq_axes)
    size = lambda a: mesh.sizes[mesh.names.index(a)]  # noqa: E731
    data_sizes = tuple(size(a) for a in data_axes)
    dp = math.prod(data_sizes)
    out = []
    for form in forms_for(site.kind):
        if not (form.offered or (forced is not None and form.name == forced.form)):
            out.append((Candidate(form=form.name), "not offered by the solver (a layer's form for overrides)"))
            continue
        if seq_axes and site.kind is Kind.ATTENTION and not form.sequence:
            out.append((Candidate(form=form.name), f"the sequence is split on {', '.join(seq_axes)}: attention "
                                                   "must take a sequence form"))
            continue
        tuples = form_axes(form, roles)
        if not tuples:
            want = " and ".join("/".join(sorted(r.value for r in ok)) for ok in form.roles)
            out.append((Candidate(form=form.name), f"it takes a {want} axis; this plan has none "
                                                   f"(roles: {_roles_text(roles)})"))
        for axes in tuples:
            sizes = tuple(size(a) for a in axes)
            why = form.precondition(site, sizes)
            if why is not None:
                out.append((Candidate(form=form.name, axes=axes), why))
                continue
            # FSDP shards each parameter on a dim this form leaves whole, as the plan will (`fsdp.shard_dim`)
            model = model_placements(site, form, axes, mesh.names, sizes)
            fsdp_why = fsdp_form.precondition(site, st, data_sizes, model)
            out.append((Candidate(form=form.name, axes=axes), ""))
            if dp > 1:  # without a data axis there is nothing to shard over: no row
                out.append((Candidate(form=form.name, axes=axes, fsdp=True), f"FSDP: {fsdp_why}" if fsdp_why else ""))
                # ZeRO-1 / ZeRO-2 of this class's parameters (`autopar.forms.zero`): the same dims as FSDP's. Not yet
                # for a class whose form an override forces (its dp / fsdp choice, and FSDP's keep, as before)
                if forced is not None:
                    continue
                out.append((Candidate(form=form.name, axes=axes, zero=1), f"ZeRO-1: {fsdp_why}" if fsdp_why else ""))
                out.append((Candidate(form=form.name, axes=axes, fsdp=True, zero=2),
                            f"ZeRO-2: {fsdp_why}" if fsdp_why else ""))
    return out


def _roles_text(roles: dict[str, Role]) -> str:
    return ", ".join(f"{a} {r.value}" for a, r in roles.items()) or "every axis of size 1"


def _tied_pairs(sites: list[Site]) -> list[tuple[Site, Site]]:
    """The pairs of sites (in `sites` order) that share a parameter (a tied embedding and LM head)."""
    by_param: dict[str, list[int]] = {}
    for i, s in enumerate(sites):
        for p in s.all_params():
            by_param.setdefault(p, []).append(i)
    pairs = {pair for idx in by_param.values() for pair in itertools.combinations(idx, 2)}
    return [(sites[i], sites[j]) for i, j in sorted(pairs)]


def _role_options(ctx: PassContext, mesh: MeshInfo, batch: int, data_axes_options):
    """(data axes, sequence axes) pairs: every split of the axes into data / model / (at most one) sequence
    axis that the batch and the model admit."""
    axes = [n for n, s in zip(mesh.names, mesh.sizes) if s > 1]
    has_attention = bool(ctx.of_kind(Kind.ATTENTION))
    out = []
    for roles in itertools.product((Role.DATA, Role.MODEL, Role.SEQUENCE), repeat=len(axes)):
        data = tuple(a for a, r in zip(axes, roles) if r is Role.DATA)
        seq = tuple(a for a, r in zip(axes, roles) if r is Role.SEQUENCE)
        if len(seq) > 1 or (seq and not has_attention):
            continue
        if data_axes_options is not None and data not in data_axes_options:
            continue
        size = math.prod(mesh.sizes[mesh.names.index(a)] for a in data)
        if batch and batch % size:
            continue
        out.append((data, seq))
    return out


# ----------------------------------------------------------------------------- the ILP

class ConstraintView:
    """What a form may say about the ILP (`Form.add_constraints`) without importing OR-Tools: implications
    from one candidate's variable to choices of other structures."""

    def __init__(self, model, classes, cands, x, stats):
        self._model, self._classes, self._cands, self._x, self._stats = model, classes, cands, x, stats
        self._index = {s.key: k for k, cls in enumerate(classes) for s in cls}
        self.whys: dict[str, str] = {}  # site key -> what its forms' constraints require (reported on a conflict)
        self.current = ""  # the site whose candidate's constraints are being added
        self.site_whys: dict[str, set[str]] = {}  # site key -> the constraints that tie it to others (explain)

    def stats(self, site: Site) -> SiteStats:
        return self._stats[site.key]

    def require_site(self, var, key: str, pred: Callable[[Candidate], bool], why: str = "") -> None:
        """var <= sum of the variables of structure `key`'s candidates that satisfy `pred`."""
        k = self._index[key]
        self._model.Add(var <= sum(v for v, c in zip(self._x[k], self._cands[k]) if pred(c)))
        self._note(why, (key,))

    def require_every(self, var, kinds, pred: Callable[[Candidate, Form], bool], why: str = "") -> None:
        """For every structure of `kinds`: var <= sum of its candidates' variables that satisfy `pred`."""
        for k, cls in enumerate(self._classes):
            if cls[0].kind in kinds:
                self._model.Add(var <= sum(v for v, c in zip(self._x[k], self._cands[k])
                                           if pred(c, form_of(cls[0].kind, c.form))))
        self._note(why, [cls[0].key for cls in self._classes if cls[0].kind in kinds])

    def _note(self, why: str, keys) -> None:
        if why:
            self.whys.setdefault(why, why)
            for k in (self.current, *keys):
                self.site_whys.setdefault(k, set()).add(why)


def solve(ctx: PassContext, mesh: MeshInfo, cluster: Cluster, *, memory_limit: float | None = None,
          forced: dict[str, Candidate] | None = None, optimizer: str = "adam",
          time_limit_s: float = 10.0, data_axes_options=None, batch: int = 0, layers=(),
          checkpoint_forced: dict | None = None, exclude=(), top: int = 1,
          rank: Callable[[Solution], float] | None = None, in_flight: int = 1) -> Solution:
    """The best plan under the cost model; raises InfeasibleError (with the least memory any plan needs).
    `layers` (`autopar.layers.find_layers`) take an activation checkpointing level each, per layer class
    (`checkpoint_forced`: layer path -> the level an override forces), and FSDP's gathered weights kept or resharded
    per layer class (`_keep_terms`). `exclude`: assignments ({site key: Candidate}) the plan must differ from in some
    structure's form (`no_good`). `top` > 1 with `rank` (a solution's full estimate, e.g. its timeline's step): the
    ILP's `top` best distinct solutions (`_alternatives`) are ranked by `rank` and the least wins (ties: the ILP's
    order); `Solution.ranking` records them. `in_flight`: the microbatches whose saved activations the device holds at
    once (a pipeline stage's, `autopar.pipeline_estimate.auto_pipeline`): the start-of-backward peak counts the
    activations and the levels' saved bytes that many times (the recompute transient and momentary buffers once)."""
    if not isinstance(in_flight, int) or in_flight < 1:
        raise ValueError(f"in_flight must be a positive integer (microbatches held at once), got {in_flight!r}")
    t0 = time.perf_counter()
    limit = memory_limit if memory_limit is not None else cluster.device_memory_bytes
    stats, other, _ = gather_stats(ctx)
    offer = float8_offer(ctx)
    sites = ctx.planning_sites()
    pairs = _tied_pairs(sites)
    tied = {s.key for p in pairs for s in p}
    classes = _classes(sites, tied, stats)
    forced = forced or {}
    groups = ckpt.groups(ctx.captured.gm, list(layers), checkpoint_forced or {})
    options = _role_options(ctx, mesh, batch, data_axes_options)
    best: Solution | None = None
    least_memory = math.inf
    conflicts: set[str] = set()
    tried = []  # (data axes, seq axes, solution or None, why not), and the ILP's inputs of each solution
    for data_axes, seq_axes in options:
        mc = mesh_costing(ctx, stats, other, mesh.names, mesh.sizes, data_axes, cluster, optimizer=optimizer,
                          seq_axes=seq_axes)
        try:
            cands = [candidates(cls[0], stats[cls[0].key], mesh, data_axes, forced.get(cls[0].key), seq_axes)
                     for cls in classes]
        except ValueError as e:
            tried.append((data_axes, seq_axes, None, str(e)))
            continue
        if any(not cs for cs in cands):
            continue
        costs = [[site_cost(cls[0], stats[cls[0].key], c, mc) for c in cs] for cls, cs in zip(classes, cands)]
        if offer:  # each candidate's fp8 variant beside it (`float8_variants`)
            for cls, cs, cost in zip(classes, cands, costs):
                extra = [v for c, k in zip(list(cs), list(cost))
                         for v in float8_variants(cls[0], stats[cls[0].key], c, k, mc, offer)]
                cs += [c for c, _ in extra]
                cost += [k for _, k in extra]
        base = other_cost(other, mc)
        ck = _checkpoint_terms(groups, classes, cands, costs, mc, mesh, data_axes, seq_axes, stats)
        kp = _keep_terms(ck, classes, cands, costs, stats, mc)
        try:
            sol, mem_min = _solve_one(classes, cands, costs, base, pairs, limit, time_limit_s, stats, ck, exclude,
                                      grad_share=mc.grad_share(), kp=kp, in_flight=in_flight)
        except _Conflict as c:
            conflicts.update(c.whys)
            tried.append((data_axes, seq_axes, None, "the forms' constraints conflict: " + "; ".join(c.whys)))
            continue
        least_memory = min(least_memory, mem_min)
        if sol is None:  # priced without the limit, to say what the limit costs (Plan.explain)
            free, _ = _solve_one(classes, cands, costs, base, pairs, 2.0**62, time_limit_s, stats, ck,
                                  grad_share=mc.grad_share(), kp=kp, in_flight=in_flight)
            fastest = f"the fastest needs {free.memory_bytes / 2**30:.2f} GiB per device, " if free is not None else ""
            tried.append((data_axes, seq_axes, free, f"no plan fits the limit: {fastest}the least "
                                                     f"memory {mem_min / 2**30:.2f} GiB"))
            continue
        sol.data_axes = tuple(data_axes)
        sol.seq_axes = tuple(seq_axes)
        sol.priced = (mc, cands, costs, base, ck, kp)  # replaced by a Priced for the best solution below
        tried.append((data_axes, seq_axes, sol, ""))
        if best is None or sol.objective_s < best.objective_s - 1e-12:
            best = sol
    if best is None and math.isinf(least_memory):
        forced_labels = ", ".join(f"{k}: {c.label}" for k, c in forced.items()) or "none"
        raise ValueError(
            f"no plan satisfies the forced forms ({forced_labels}) on mesh {mesh.describe()}, whatever the memory: "
            + ("; ".join(sorted(conflicts)) if conflicts else "no role of the mesh axes admits them")
            + ". Fix: change the overrides so that they agree (or drop one).")
    if best is None:
        raise InfeasibleError(
            f"no plan fits {fmt_bytes(limit)} per device on mesh {mesh.describe()}: the least memory any plan "
            f"needs is {fmt_bytes(least_memory)} per device (parameters, gradients, {optimizer} state and "
            "activations). Fix: raise memory_limit, use more devices, a smaller batch, or an optimizer with less "
            "state.",
            limit_bytes=limit, least_bytes=least_memory)
    if top > 1 and rank is not None:
        best = _ranked(best, tried, classes, pairs, stats, limit, time_limit_s, exclude, top, rank)
    if offer:
        best.float8_classes = _float8_classes(best, classes, stats, offer)
    best.priced = _priced(best, classes, pairs, stats, mesh, forced, limit, time_limit_s, tried)
    best.solve_s = time.perf_counter() - t0
    best.classes = len(classes)
    return best


def _priced(best: Solution, classes, pairs, stats, mesh: MeshInfo, forced, limit, time_limit_s, tried) -> Priced:
    """Every candidate of the best role assignment priced (those the ILP left out too), and, when some class did
    not take its cheapest candidate, the ILP's choices without the memory limit (to tell memory from coupling)."""
    mc, cands, costs, base, ck, kp = best.priced
    for _, _, sol, _ in tried:
        if sol is not None and sol is not best:
            sol.priced = None
    rows = []
    for cls, cs, cost in zip(classes, cands, costs):
        st = stats[cls[0].key]
        known = dict(zip(cs, cost))
        rows.append([(c, None if why else known.get(c) or site_cost(cls[0], st, c, mc), why)
                     for c, why in all_candidates(cls[0], st, mesh, best.data_axes, forced.get(cls[0].key),
                                                  best.seq_axes)]
                    + [(c, k, "") for c, k in zip(cs, cost) if c.float8])  # the fp8 variants (`float8_variants`)
    out = Priced(classes=classes, rows=rows, pairs=pairs,
                 roles=[(d, q, sol, why) for d, q, sol, why in tried])
    cheapest = [min(overlapped_s(c) for c in cost) for cost in costs]
    if any(overlapped_s(best.per_site[cls[0].key]) > t + 1e-12 for cls, t in zip(classes, cheapest)):
        free, _ = _solve_one(classes, cands, costs, base, pairs, 2.0**62, time_limit_s, stats, ck,
                             grad_share=mc.grad_share(), kp=kp)
        if free is not None:  # None: the solve without the limit ran out of time (Plan.explain then omits it)
            out.free, out.free_memory_bytes = free.choices, free.memory_bytes
    out.checkpoint, out.keep = ck, kp
    return out


@dataclass
class CheckpointTerms:
    """The activation checkpointing levels on one role assignment: per group of layers (`ckpt.Group`) its levels
    and their costs (`ckpt.cost`), and per (site class k, group g, n) the n sites of class k in g's layers, whose
    forward collectives a recomputing level issues again."""

    groups: list
    costs: list[list[Cost]]
    reissue: list[tuple[int, int, int]]
    reissue_s: list[list[float]]  # per class and candidate: its forward collectives' time (what a recompute re-issues)
    split: float = 1.0  # what saved bytes are divided by (`ckpt.cost`)
    # the saved bytes per device a recomputing level leaves (`saved_under`): per class and candidate, what one site
    # saves without recompute (its form's `Cost.act_bytes`: freed); per group and level, the kept tensors beyond the
    # layers' inputs (matmul and attention outputs, divided as `ckpt.cost` divides them); per group, the class of its
    # norms (None: none) and per candidate of it the layers' inputs per device (the residual stream: divided by the
    # model axes only where the norms' form splits it, sequence parallelism)
    act: list[list[float]] = field(default_factory=list)
    kept: list[list[float]] = field(default_factory=list)
    inputs: list[tuple[int | None, list[float]]] = field(default_factory=list)  # (norm class, per device per byte)
    stream: list[list[float]] = field(default_factory=list)  # per group and level: kept stream bytes, global
    cands: list[list[Candidate]] = field(default_factory=list)  # per class, as `reissue` and `act` index them
    keys: list[str] = field(default_factory=list)  # per class, one site's key
    kinds: list[Kind] = field(default_factory=list)  # per class
    # per (class, group): what `selective` keeps of one site's op that the class' form recomputes whole
    # (`Form.recomputed_whole`: ring attention's output and log-sum-exp), global bytes
    whole: dict[tuple[int, int], float] = field(default_factory=dict)
    # per group: the classes whose forms must leave partial sums (`Form.partial_output`) for the layers' residual
    # stream to be carried as partial sums, and the stream bytes per layer the region then reads twice (global)
    carried: list[tuple[frozenset, float]] = field(default_factory=list)
    dp: float = 1.0  # the ranks the batch is split over (`MeshCosting.dp`)
    # per group: the tables its layers read that a recomputing level keeps whole beside what the plan saves without
    # recompute (global bytes, once per program: the first group reading one has it)
    tables: list[float] = field(default_factory=list)

    def kept_effect(self, g: int, kp: "KeepTerms", choices: dict[str, Candidate]) -> tuple[float, float] | None:
        """What keeping group g's FSDP gathers for backward does under `choices`: (time saved per step, bytes held
        more per device); None where the chosen forms gather nothing in g that is re-gathered."""
        choice = self.choice(choices)
        rows = [(k, n) for k, gi, n in self.reissue if gi == g and kp.kept[k][choice[k]] is not None]
        if not rows:
            return None
        return (sum(n * kp.saved_s[k][choice[k]] for k, n in rows), sum(n * kp.held_bytes[k][choice[k]] for k, n in rows))

    def choice(self, choices: dict[str, Candidate]) -> dict[int, int]:
        """The candidate index of every class under `choices` (site key -> Candidate)."""
        return {k: cs.index(choices[key]) for k, (cs, key) in enumerate(zip(self.cands, self.keys))}

    def saved_bytes(self, g: int, level, choices: dict[str, Candidate]) -> float:
        """What group g's layers save per device at `level` (without recompute: their structures' saved bytes)."""
        choice = self.choice(choices)
        return (sum(n * self.act[k][choice[k]] for k, gi, n in self.reissue if gi == g)
                + self.saved_under(g, level, choice))

    def saved_under(self, g: int, level, choice: dict[int, int]) -> float:
        """What group g's layers save per device at `level` less what they save without recompute (negative: freed),
        given the candidate index of every class (`choice`)."""
        if not level.recomputes:
            return 0.0
        norm, factor = self.inputs[g]
        f = factor[choice[norm] if norm is not None else 0]
        i = self.groups[g].levels.index(level)
        out = self.kept[g][i] + self.stream[g][i] * f + (self.tables[g] if self.tables else 0.0)
        if level.saves_matmuls:  # nothing inside a structure its form recomputes whole is kept
            out -= sum(n * self.whole.get((k, g), 0.0) / self.split for k, gi, n in self.reissue
                       if gi == g and self._form(k, choice).recomputed_whole)
        need, twice = self.carried[g] if self.carried else (frozenset(), 0.0)
        if twice and all(self._form(k, choice).partial_output for k in need) and f * self.dp >= 1:
            # the layers' inputs are partial sums carried through the residual adds (a tensor-parallel block's
            # row-parallel output added to a partial stream), and their all-reduced copy feeds the norms: the
            # region reads, and keeps, both (where the norms' form splits the stream, sequence parallelism, the
            # partial sums are reduce-scattered onto it instead)
            out += len(self.groups[g].layers) * twice * f
        return out - sum(n * self.act[k][choice[k]] for k, gi, n in self.reissue if gi == g)

    def _form(self, k: int, choice: dict[int, int]) -> Form:
        return form_of(self.kinds[k], self.cands[k][choice[k]].form)


def _checkpoint_terms(groups, classes, cands, costs, mc: MeshCosting, mesh: MeshInfo, data_axes,
                      seq_axes, stats=None) -> CheckpointTerms:
    model = math.prod(s for n, s in zip(mesh.names, mesh.sizes) if n not in data_axes and n not in seq_axes)
    ck_costs = [[ckpt.cost(g, lv, mc, model) for lv in g.levels] for g in groups]
    reissue = []
    where = _group_index(groups, [s for cls in classes for s in cls])
    for k, cls in enumerate(classes):
        counts: dict[int, int] = {}
        for s in cls:
            if s.key in where:
                counts[where[s.key]] = counts.get(where[s.key], 0) + 1
        reissue += [(k, gi, n) for gi, n in sorted(counts.items())]
    # forward and backward collectives mirror each other in the forms (all-reduce / all-reduce, all-gather /
    # reduce-scatter, all-to-all / all-to-all, ring steps): the forward half of a candidate's own collectives
    # (`Cost.critical_s`: its communication less the parameters' synchronisation over the data axes) is re-issued;
    # the gradients' reduction over the data axes is not (the recompute runs the forward only), whether the
    # candidate is replicated or tensor-parallel beside a data axis; FSDP's gathers are issued before the layers'
    # regions (`passes.checkpoint`: the recompute reads the full parameters through the backward re-gather the FSDP
    # form prices with or without checkpointing): an FSDP candidate re-issues what its candidate without FSDP does
    # (an fp8 variant, `Candidate.float8`: its own twin without FSDP, else the bf16 one's)
    own = [{(cand.form, cand.axes, cand.float8): c.critical_s / 2 if cand.axes else 0.0
            for cand, c in zip(cs, cost) if not cand.fsdp} for cs, cost in zip(cands, costs)]
    reissue_s = [[mine.get((cand.form, cand.axes, cand.float8), mine.get((cand.form, cand.axes, ()),
                                                                          c.critical_s / 2 if cand.axes else 0.0))
                  for cand, c in zip(cs, cost)] for cs, cost, mine in zip(cands, costs, own)]
    # saved bytes under recompute (`CheckpointTerms.saved_under`): each structure's own saved bytes are freed, the
    # level keeps the layers' inputs and (selective) some outputs
    act = [[c.act_bytes for c in cost] for cost in costs]
    # what a level keeps on the residual stream: the layers' inputs and the row-parallel outputs it saves (their
    # all-reduced sums: whole on the model axes, as the stream, `estimate.attribute_saved`); the rest of what it keeps
    # (column-parallel and attention outputs) divided by the model axes
    # (row-parallel outputs are partial sums, or reduce-scattered after the level keeps them: whole on the model
    # axes even where sequence parallelism splits the stream)
    rows = {lin.node for cls in classes for site in cls for lin in _row_linears(site)}
    kept, inputs, stream = [], [], []
    for gi, g in enumerate(groups):
        n = len(g.layers)
        every = g.price.recomputed[ckpt.FULL.name]
        on_stream, on_rows = [], []
        for lv in g.levels:
            again = set(g.price.recomputed[lv.name])
            row_bytes = sum(ckpt._bytes(x) for x in every if x in rows and x not in again) if lv.recomputes else 0.0
            on_stream.append(n * g.price.saved[ckpt.FULL.name] if lv.recomputes else 0.0)
            on_rows.append(n * row_bytes)
        stream.append(on_stream)
        kept.append([max(0.0, n * g.price.saved[lv.name] - s_ - r) / (mc.dp * model) + r / mc.dp
                     if lv.recomputes else 0.0 for lv, s_, r in zip(g.levels, on_stream, on_rows)])
        norm = next((k for k, gk, _ in reissue if gk == gi and classes[k][0].kind is Kind.NORM), None)
        if norm is None or stats is None:
            inputs.append((None, [1 / mc.dp]))
            continue
        site = classes[norm][0]
        whole = site_cost(site, stats[site.key], Candidate(form=Replicate.name), mc).act_bytes
        inputs.append((norm, [(min(1.0, a / whole) if whole > 0 else 1.0) / mc.dp for a in act[norm]]))
    whole = {}
    for k, gi, _ in reissue:  # the class' site's op, at its place in the group's priced layer (`ckpt.groups`: the
        g = groups[gi]  # first; the layers of a group are alike)
        for la in g.layers:
            site = next((s for s in classes[k] if s.key.startswith(la.path + ".")), None)
            if site is not None and site.kind is Kind.ATTENTION and site.node.name in la.nodes:
                i, first = la.nodes.index(site.node.name), g.layers[0].nodes
                if len(first) == len(la.nodes):  # a layer unlike the priced one (T5's first block): not priced
                    whole[k, gi] = g.price.kept.get(first[i], 0.0)
                break
    return CheckpointTerms(groups, ck_costs, reissue, reissue_s, mc.dp * model, act, kept, inputs, stream, cands,
                           [cls[0].key for cls in classes], [cls[0].kind for cls in classes], whole,
                           _carried(groups, classes), mc.dp, _tables(groups, seq_axes))


def _tables(groups, seq_axes) -> list[float]:
    """Per group (`CheckpointTerms.tables`): a layer's inputs without a gradient (RoPE's tables, masks) are the
    region's inputs, kept whole once for every layer reading them. Without recompute the plan counts them where an
    op saves them (outside the layers' structures, which no level frees): whole, so the level adds nothing, unless a
    sequence axis splits them (the lowering slices them in the layer: the slices are saved, the level keeps the
    whole table too); one no op saves, the level adds."""
    seen, out = set(), []
    for g in groups:
        extra = 0.0
        for name, (nbytes, saved) in g.price.tables.items():
            if name not in seen:
                seen.add(name)
                extra += nbytes if (not saved or seq_axes) else 0.0
        out.append(extra)
    return out


def _carried(groups, classes) -> list[tuple[frozenset, float]]:
    """Per group (`CheckpointTerms.carried`): the lowering keeps a sum of partial sums partial (`passes.rules`: add
    of two partials) and all-reduces a copy where a consumer needs it whole. A layer input that is a partial sum
    (an embedding's or a row-parallel linear's output, or residual adds of them) and that the layer adds to its
    own row-parallel output is read by the layer's region in both forms. The classes whose forms make those
    values partial, and the bytes of such inputs per layer (global)."""
    of_class = {s.key: k for k, cls in enumerate(classes) for s in cls}
    source = {s.node: s.key for cls in classes for s in cls if s.kind is Kind.EMBEDDING}
    source.update({lin.node: s.key for cls in classes for s in cls for lin in _row_linears(s)})
    memo: dict[fx.Node, frozenset | None] = {}

    def partial(x: fx.Node) -> frozenset | None:  # the sites that must leave partial sums for x to be one
        order = []
        stack = [x]
        while stack:  # the residual adds back to the embedding, iteratively (a deep model's stream is long)
            n = stack.pop()
            if n in memo or n in order:
                continue
            order.append(n)
            if n not in source and n.target is torch.ops.aten.add.Tensor and len(n.args) >= 2:
                stack.extend(a for a in n.args[:2] if isinstance(a, fx.Node))
        for n in reversed(order):
            if n in source:
                memo[n] = frozenset({source[n]})
            elif n.target is torch.ops.aten.add.Tensor and len(n.args) >= 2 and all(
                    isinstance(a, fx.Node) for a in n.args[:2]):
                a, b = (memo.get(v) for v in n.args[:2])
                memo[n] = a | b if a is not None and b is not None else None
            else:
                memo[n] = None
        return memo[x]

    out = []
    for g in groups:
        inside = set(g.layers[0].nodes)
        need, twice = set(), 0.0
        for x in g.price.inputs:
            px = partial(x)
            if px is None:
                continue
            for u in x.users:
                if u.name in inside and u.target is torch.ops.aten.add.Tensor:
                    other = next((a for a in u.args[:2] if isinstance(a, fx.Node) and a is not x), None)
                    po = partial(other) if other is not None else None
                    if po is not None:
                        need |= px | po
                        twice += ckpt._bytes(x)
                        break
        if not all(key in of_class for key in need):  # a site no class plans: not known to be partial
            need, twice = set(), 0.0
        out.append((frozenset(of_class[key] for key in need), twice))
    return out


def _group_index(groups, sites) -> dict[str, int]:
    """Site key -> the layer group holding it (`ckpt.Group.holds`: the site is a layer or inside one), by path."""
    paths = {la.path: gi for gi, g in enumerate(groups) for la in g.layers}
    out = {}
    for s in sites:
        parts = s.key.split(".")
        gi = next((paths[p] for p in (".".join(parts[:i]) for i in range(1, len(parts) + 1)) if p in paths), None)
        if gi is not None:
            out[s.key] = gi
    return out


def _checkpoint_vars(model, ck: CheckpointTerms | None, x, kib, ns):
    """The levels' variables (one-hot per group), and their time and memory terms (linear expressions, integer
    nanoseconds and KiB): the levels' own costs, the collectives re-issued (w[k,g] >= forward collectives of class
    k's choice less M * y[g, none]: Alpa-style linearisation of x * (1 - y)), and the recompute transient, the
    largest over the recomputing groups (T >= transient[g, l] * y[g, l])."""
    if ck is None or not ck.groups:
        return [], 0, 0, 0, 0
    y = [[model.NewBoolVar(f"ck{g}_{i}") for i in range(len(lvs))] for g, lvs in enumerate(ck.costs)]
    for ys in y:
        model.AddExactlyOne(ys)
    time = sum(ns(c.compute_s) * v for cs, ys in zip(ck.costs, y) for c, v in zip(cs, ys))
    mem, mem_min = _saved_vars(model, ck, x, y, kib)
    for k, g, n in ck.reissue:
        per = [ns(t) for t in ck.reissue_s[k]]
        top = max(per, default=0)
        if top == 0:
            continue
        recomputing = sum(v for lv, v in zip(ck.groups[g].levels, y[g]) if lv.recomputes)
        w = model.NewIntVar(0, top, f"reissue{k}_{g}")
        model.Add(w >= sum(p * v for p, v in zip(per, x[k])) - top * (1 - recomputing))
        time += n * w
    top_t = max((kib(c.transient_bytes) for cs in ck.costs for c in cs), default=0)
    transient = model.NewIntVar(0, top_t, "ck_transient")
    for cs, ys in zip(ck.costs, y):
        for c, v in zip(cs, ys):
            if c.transient_bytes:
                model.Add(transient >= kib(c.transient_bytes) * v)
    return y, time, mem, transient, mem_min


def _saved_vars(model, ck: CheckpointTerms, x, y, kib):
    """The saved bytes the levels change (`CheckpointTerms.saved_under`), linear in KiB: per group, the kept bytes of
    its recomputing level, z[g] >= the layers' inputs under the norms' candidate - M (1 - recomputes[g]), less
    r[k,g] <= sum_c act[k,c] x[k,c], r[k,g] <= M recomputes[g] per class with sites in the group (what they no longer
    save); the tables the level keeps, and the stream a partial residual stream makes it read twice (`carried`).
    Selective's saving inside a form recomputed whole (`whole`) is left out: the ILP's bytes are an upper bound
    there. And a lower bound of it for any choice (the least memory any plan needs)."""
    mem, least = 0, 0
    for g, (group, ys) in enumerate(zip(ck.groups, y)):
        recomputing = sum(v for lv, v in zip(group.levels, ys) if lv.recomputes)
        if not any(lv.recomputes for lv in group.levels):
            continue
        mem += sum(kib(b) * v for b, v in zip(ck.kept[g], ys))
        norm, factor = ck.inputs[g]
        top = max(kib(b * f) for b in ck.stream[g] for f in factor)
        z = model.NewIntVar(0, top, f"ck_inputs{g}")
        for lv, b, v in zip(group.levels, ck.stream[g], ys):  # the stream the level keeps, as the norms divide it
            if lv.recomputes:
                picked = sum(kib(b * f) * u for f, u in zip(factor, x[norm])) if norm is not None else kib(b * factor[0])
                model.Add(z >= picked - top * (1 - v))
        mem += z + kib(ck.tables[g]) * recomputing if ck.tables else z
        need, twice = ck.carried[g] if ck.carried else (frozenset(), 0.0)
        both = kib(len(group.layers) * twice / ck.dp)
        if need and both > 0:  # the stream read twice: d[g] >= M (every class in `need` partial, the norms' form
            # leaving the stream whole, recomputing; all 1) as a sum less its count
            partial = [sum(v for c, v in zip(ck.cands[k], x[k]) if form_of(ck.kinds[k], c.form).partial_output)
                       for k in need]
            whole = (sum(v for f, v in zip(factor, x[norm]) if f * ck.dp >= 1) if norm is not None else 1)
            d = model.NewIntVar(0, both, f"ck_twice{g}")
            model.Add(d >= both * (sum(partial) + whole + recomputing - len(need) - 1))
            mem += d
        freed = 0
        for k, gi, n in ck.reissue:
            if gi != g:
                continue
            per = [kib(a) for a in ck.act[k]]
            if max(per, default=0) <= 0:
                continue
            r = model.NewIntVar(0, max(per), f"ck_freed{k}_{g}")
            model.Add(r <= sum(a * v for a, v in zip(per, x[k])))
            model.Add(r <= max(per) * recomputing)
            mem -= n * r
            freed += n * max(per)
        least += min(0, min(kib(b) for b in ck.kept[g]) + min(kib(b * min(factor)) for b in ck.stream[g]) - freed)
    return mem, least


@dataclass
class KeepTerms:
    """FSDP's gathered weights kept from forward to backward per layer group (`ckpt.Group`, as the checkpoint levels):
    ZeRO-2-like, saving the backward re-gather (`fsdp.regather_time_s`) and holding the gathered weights
    (`fsdp.held_gathered_bytes`). Per class and candidate: its cost with its layer groups kept (`kept`: None where
    keeping changes nothing: not FSDP, or no resharded group), the time that saves (`saved_s`, on the ILP's
    objective, `timeline.overlapped_s`) and the bytes it holds more (`held_bytes`); `group_of`: site key -> its
    layer group."""

    kept: list[list[Cost | None]]
    saved_s: list[list[float]]
    held_bytes: list[list[float]]
    group_of: dict[str, int]


def _keep_terms(ck: CheckpointTerms | None, classes, cands, costs, stats, mc: MeshCosting) -> KeepTerms | None:
    if ck is None or not ck.groups:
        return None
    group_of = _group_index(ck.groups, [s for cls in classes for s in cls])
    kept, saved, held = [], [], []
    for cls, cs, cost in zip(classes, cands, costs):
        site = cls[0]
        st = stats[site.key]
        again = any(a for _, a in st.fsdp_groups.values())
        keep_st = dataclasses.replace(st, fsdp_groups={p: (b, False) for p, (b, _) in st.fsdp_groups.items()})
        row = [site_cost(site, keep_st, c, mc) if c.fsdp and not c.zero and again and site.key in group_of else None for c in cs]
        kept.append(row)
        saved.append([max(0.0, overlapped_s(c) - overlapped_s(k)) if k is not None else 0.0 for c, k in zip(cost, row)])
        held.append([max(0.0, k.memory_bytes - c.memory_bytes) if k is not None else 0.0 for c, k in zip(cost, row)])
    if not any(k is not None for row in kept for k in row):
        return None
    return KeepTerms(kept, saved, held, group_of)


def _keep_vars(model, ck: CheckpointTerms | None, kp: KeepTerms | None, x, kib, ns):
    """One boolean per layer group, kept[g]: its FSDP groups keep their gathered weights for backward. Linearised as
    the re-issued collectives (`_checkpoint_vars`): u[k,g] <= sum_c saved[k,c] x[k,c], u[k,g] <= M kept[g] (the time
    saved, subtracted); v[k,g] >= sum_c held[k,c] x[k,c] - M (1 - kept[g]) (the bytes held, added to what the step
    holds). A kept group with nothing to keep costs 1 ns, so it is chosen only where it saves time."""
    if kp is None:
        return [], 0, 0
    kept = [model.NewBoolVar(f"keep{g}") for g in range(len(ck.groups))]
    time, held = sum(kept), 0
    for k, g, n in ck.reissue:
        saved = [ns(t) for t in kp.saved_s[k]]
        nbytes = [kib(b) for b in kp.held_bytes[k]]
        if max(saved, default=0) > 0:
            u = model.NewIntVar(0, max(saved), f"keep_saved{k}_{g}")
            model.Add(u <= sum(t * v for t, v in zip(saved, x[k])))
            model.Add(u <= max(saved) * kept[g])
            time -= n * u
        if max(nbytes, default=0) > 0:
            v_ = model.NewIntVar(0, max(nbytes), f"keep_held{k}_{g}")
            model.Add(v_ >= sum(b * v for b, v in zip(nbytes, x[k])) - max(nbytes) * (1 - kept[g]))
            held += n * v_
    return kept, time, held


def _ranked(best: Solution, tried, classes, pairs, stats, limit, time_limit_s, exclude, top: int,
            rank: Callable[[Solution], float]) -> Solution:
    """The ILP's `top` best distinct solutions, in the ILP's order (its objective), re-ranked by `rank` (the full
    estimate): the least wins, ties to the ILP's order. The candidates: the best solution of every role assignment
    that fits, and the next best of the best role assignments (`no_good` cuts: they differ in some structure's form),
    each solved on its role assignment's prices."""
    found = [sol for _, _, sol, why in tried if sol is not None and not why]
    found.sort(key=lambda s: s.objective_s)
    plain = []  # the same search without ZeRO-1/2 classes (`Candidate.zero`), as before they were offered
    for first in list(found[:2]):  # the next best of the two best role assignments
        mc, cands, costs, base, ck, kp = first.priced
        for no_zero, out in ((False, found), (True, plain)):
            if no_zero and not any(c.zero for cs in cands for c in cs):
                continue
            seen = [] if no_zero else [first.choices]
            for _ in range(top if no_zero else top - 1):
                try:
                    sol, _ = _solve_one(classes, cands, costs, base, pairs, limit, time_limit_s, stats, ck,
                                        list(exclude) + seen, grad_share=mc.grad_share(), kp=kp, no_zero=no_zero)
                except _Conflict:  # every assignment of this role assignment has been found
                    break
                if sol is None:
                    break
                sol.data_axes, sol.seq_axes, sol.priced = first.data_axes, first.seq_axes, first.priced
                seen.append(sol.choices)
                out.append(sol)
    found.sort(key=lambda s: s.objective_s)  # stable: the role assignments' order breaks ties
    # and the best plans without ZeRO classes: the ILP's k best can be one plan's zero1/zero2 variants (near-equal in
    # its objective) that the timeline (`rank`) ranks below the next distinct plans (the gpt golden on h100: 3.423
    # against 3.392 ms); re-ranked beside them, auto is never worse than it was without ZeRO classes
    plain.sort(key=lambda s: s.objective_s)
    found = found[:top] + [s for s in plain[:top] if all(s.choices != f.choices for f in found[:top])]
    scores = [rank(s) for s in found]
    i = min(range(len(found)), key=lambda j: (scores[j], j))
    winner = found[i]
    winner.ranking = [(s.objective_s, t, s) for s, t in zip(found, scores)]
    winner.ranked_index = i
    return winner


def _solve_one(classes, cands, costs, base: Cost, pairs, limit: float, time_limit_s: float, stats,
               ck: CheckpointTerms | None = None, exclude=(), *, grad_share: float, kp: "KeepTerms | None" = None,
               no_zero: bool = False, in_flight: int = 1):
    from ortools.sat.python import cp_model  # here, not at import: it costs ~1 s (it imports pandas)

    model = cp_model.CpModel()
    x = [[model.NewBoolVar(f"x{k}_{i}") for i in range(len(cs))] for k, cs in enumerate(cands)]
    for xs in x:
        model.AddExactlyOne(xs)
    no_good(model, classes, cands, x, exclude)
    if no_zero:  # `_ranked`: the plans without ZeRO-1/2 classes
        for cs, xs in zip(cands, x):
            for c, v in zip(cs, xs):
                if c.zero:
                    model.Add(v == 0)
    index = {s.key: k for k, cls in enumerate(classes) for s in cls}
    for a, b in pairs:  # tied parameters: the same axes (or none) and the same FSDP choice
        ka, kb = index[a.key], index[b.key]
        for axes in {c.axes for c in cands[ka]} | {c.axes for c in cands[kb]}:
            model.Add(sum(v for v, c in zip(x[ka], cands[ka]) if c.axes == axes) ==
                      sum(v for v, c in zip(x[kb], cands[kb]) if c.axes == axes))
        for zero in (1, 2):  # and the same ZeRO stage
            model.Add(sum(v for v, c in zip(x[ka], cands[ka]) if c.zero == zero) ==
                      sum(v for v, c in zip(x[kb], cands[kb]) if c.zero == zero))
        model.Add(sum(v for v, c in zip(x[ka], cands[ka]) if c.fsdp) ==
                  sum(v for v, c in zip(x[kb], cands[kb]) if c.fsdp))
    view = ConstraintView(model, classes, cands, x, stats)
    for cls, cs, xs in zip(classes, cands, x):
        view.current = cls[0].key
        for c, v in zip(cs, xs):
            form_of(cls[0].kind, c.form).add_constraints(view, cls[0], c, v)
    kib = lambda b: int(math.ceil(b / 1024))  # noqa: E731
    ns = lambda s: int(round(s * 1e9))  # noqa: E731
    # the step's peak (`autopar.estimate.peak_bytes`): held + max(activations + the largest momentary buffer,
    # gradients); `peak` (the max of the two ends) and `momentary` (the max of the chosen buffers) are variables
    # bounded below, which the limit then caps
    parts = [[[kib(p) for p in c.live_parts(grad_share)] + [kib(c.peak_bytes)] for c in cs] for cs in costs]
    bparts = [kib(p) for p in base.live_parts(grad_share)] + [kib(base.peak_bytes)]

    def total(i):  # part i (0 held, 1 activations, 2 gradients) of the chosen candidates, and of the rest
        return bparts[i] + sum(len(cls) * ps[i] * v for cls, pcs, xs in zip(classes, parts, x) for ps, v in zip(pcs, xs))

    top = int(limit // 1024) if limit < 2.0**61 else 2**62 // 1024
    momentary = model.NewIntVar(0, max([bparts[3]] + [ps[3] for pcs in parts for ps in pcs]), "momentary")
    model.Add(momentary >= bparts[3])
    for pcs, xs in zip(parts, x):
        for ps, v in zip(pcs, xs):
            if ps[3] > bparts[3]:
                model.Add(momentary >= ps[3]).OnlyEnforceIf(v)
    peak = model.NewIntVar(0, 2**62 // 1024, "peak")
    y, ck_time, ck_saved, ck_transient, ck_mem_min = _checkpoint_vars(model, ck, x, kib, ns)
    kept, keep_time, keep_held = _keep_vars(model, ck, kp, x, kib, ns)
    # checkpoint levels: saved bytes they change (per microbatch in flight), the recompute transient (once)
    model.Add(peak >= in_flight * (total(1) + ck_saved) + momentary + ck_transient)
    # a gradient bucket being reduced: its flat copy, min(GRAD_BUCKET_BYTES, the bucketed gradients); `small`: they are
    # fewer
    bucketed = kib(base.bucket_bytes) + sum(len(cls) * kib(c.bucket_bytes) * v for cls, cs, xs in zip(classes, costs, x)
                                            for c, v in zip(cs, xs))
    small = model.NewBoolVar("bucket_small")
    reducing, reducing_min = _reducing_var(model, costs, base, x, kib)
    model.Add(peak >= total(2) + bucketed + reducing).OnlyEnforceIf(small)
    model.Add(peak >= total(2) + kib(GRAD_BUCKET_BYTES) + reducing).OnlyEnforceIf(small.Not())
    # the least memory any plan of this family needs (reported when nothing fits): each part at its least
    least = [bparts[i] + sum(len(cls) * min(ps[i] for ps in pcs) for cls, pcs in zip(classes, parts)) for i in range(3)]
    mem_min = least[0] + max(in_flight * (least[1] + ck_mem_min) + max([bparts[3]] + [min(ps[3] for ps in pcs) for pcs in parts]),
                             least[2] + reducing_min)
    memory_on = model.NewBoolVar("memory_limit")  # an assumption: dropped to tell a conflict from a lack of memory
    model.Add(total(0) + keep_held + peak <= top).OnlyEnforceIf(memory_on)
    model.AddAssumptions([memory_on])
    # step time with each structure's parameter synchronisation overlapped with its compute (`timeline.overlapped_s`),
    # and the step's ends: the first and last structure's gathers and reductions no neighbour hides (`timeline.ends_s`)
    first, last = _ends(classes)
    ends = [[ns(ends_s(c, first=k == first[0], last=k == last[0] and first[1] is last[1]))
             + (ns(ends_s(c, first=False, last=True)) if k == last[0] and first[1] is not last[1] else 0)
             for c in cs] for k, cs in enumerate(costs)]
    model.Minimize(sum((len(cls) * ns(overlapped_s(c)) + e) * v for cls, cs, es, xs in zip(classes, costs, ends, x)
                       for c, e, v in zip(cs, es, xs)) + ck_time + keep_time)
    solver = cp_model.CpSolver()
    solver.parameters.num_workers = 1
    solver.parameters.random_seed = 0
    solver.parameters.max_time_in_seconds = time_limit_s
    status = solver.Solve(model)
    if status not in (cp_model.OPTIMAL, cp_model.FEASIBLE):
        model.ClearAssumptions()  # without the memory limit: is it the forms' own constraints that conflict?
        if solver.Solve(model) not in (cp_model.OPTIMAL, cp_model.FEASIBLE):
            raise _Conflict(sorted(view.whys))
        # the least memory any plan needs, as the ILP prices it (the parts' separate minima are only a lower bound,
        # which could name a size that no plan fits); a time-limited solve keeps its proven bound
        model.Minimize(total(0) + keep_held + peak)
        solver.parameters.max_time_in_seconds = min(time_limit_s, 2.0)
        if solver.Solve(model) in (cp_model.OPTIMAL, cp_model.FEASIBLE):
            mem_min = max(mem_min, solver.BestObjectiveBound())
        return None, mem_min * 1024
    choices, per_site = {}, {}
    keep = [bool(solver.Value(v)) for v in kept]  # per layer group: FSDP's gathered weights kept for backward
    for k, (cls, cs, cost, xs) in enumerate(zip(classes, cands, costs, x)):
        i = next(i for i, v in enumerate(xs) if solver.Value(v))
        for s in cls:
            choices[s.key] = cs[i]
            g = kp.group_of.get(s.key) if kp is not None else None
            per_site[s.key] = kp.kept[k][i] if g is not None and keep[g] and kp.kept[k][i] is not None else cost[i]
    obj, bound = solver.ObjectiveValue(), solver.BestObjectiveBound()
    gap = 0.0 if obj == 0 else max(0.0, (obj - bound) / obj)
    name = "optimal" if status == cp_model.OPTIMAL else "feasible (time limit)"
    levels = {}
    if y:
        for g, ys in zip(ck.groups, y):
            levels[g] = next(lv for lv, v in zip(g.levels, ys) if solver.Value(v))
    extra = checkpoint_cost(levels, {k: c for k, c in choices.items()}, ck, classes, cands) if ck else None
    sol = _total((), choices, per_site, base, gap, name, grad_share, extra,
                 order=[s.key for s in _forward_order([s for cls in classes for s in cls])])
    sol.checkpoint = {la.path: lv.name for g, lv in levels.items() for la in g.layers}
    sol.keep_gathered = frozenset(la.path for g, on in zip(ck.groups if kept else [], keep) if on for la in g.layers)
    sol.site_whys = view.site_whys
    return sol, mem_min * 1024


def _reducing_var(model, costs, base: Cost, x, kib) -> tuple:
    """FSDP's largest group reduction at the end of the backward (`Cost.reduce_transient_bytes`, the max over the
    chosen candidates): reducing >= sum_c r[k,c] x[k,c] for every class k with an FSDP candidate (exact under the
    one-hot), and >= the rest's; no indicator constraint. A constant 0 without FSDP candidates. Also the least it
    can be (for the least memory any plan needs). Priced as resharded even where the layer group keeps its gathered
    weights (`_keep_vars`; kept, no re-gather is prefetched: the plan's estimate charges 2x, not 3 + 1/dp): the ILP
    errs on the safe side there, rather than linearising a product with kept[g]."""
    rs = [[kib(c.reduce_transient_bytes) for c in cs] for cs in costs]
    floor = kib(base.reduce_transient_bytes)
    least = max([floor] + [min(r) for r in rs])
    if max([floor] + [max(r) for r in rs]) == 0:
        return 0, 0
    reducing = model.NewIntVar(0, max([floor] + [max(r) for r in rs]), "reducing")
    model.Add(reducing >= floor)
    for r, xs in zip(rs, x):
        if max(r) > floor:
            model.Add(reducing >= sum(b * v for b, v in zip(r, xs)))
    return reducing, least


def checkpoint_cost(levels: dict, choices: dict[str, Candidate], ck: CheckpointTerms, classes, cands) -> Cost | None:
    """What the chosen levels (group -> level) add to the step: their costs, the collectives they re-issue, and
    the recompute transient (the largest), as one Cost (memory_bytes includes the transient)."""
    if not levels:
        return None
    compute = comm = act = transient = 0.0
    choice = ck.choice(choices)
    for gi, g in enumerate(ck.groups):
        lv = levels[g]
        c = ck.costs[gi][g.levels.index(lv)]
        compute, transient = compute + c.compute_s, max(transient, c.transient_bytes)
        act += ck.saved_under(gi, lv, choice)
    for k, gi, n in ck.reissue:
        if levels[ck.groups[gi]].recomputes:
            i = cands[k].index(choices[classes[k][0].key])
            comm += n * ck.reissue_s[k][i]
    return Cost(compute_s=compute, comm_s=comm, comm_bytes=0.0, memory_bytes=act + transient, act_bytes=act,
                transient_bytes=transient)


def no_good(model, classes, cands, x, exclude) -> None:
    """A no-good cut per excluded assignment: sum_k x[k, c_k] <= |K| - 1, where c_k is the candidate the
    assignment gives class k, so the ILP's plan differs from it in at least one structure's form (`autopar.tune`'s
    k best distinct plans). An assignment that takes a candidate this role assignment does not offer cannot be
    chosen anyway: no cut."""
    for choices in exclude:
        chosen = [next((v for v, c in zip(xs, cs) if c == choices.get(cls[0].key)), None)
                  for cls, cs, xs in zip(classes, cands, x)]
        if all(v is not None for v in chosen):
            model.Add(sum(chosen) <= len(chosen) - 1)


def _forward_order(sites: list[Site]) -> list[Site]:
    """`sites` in forward order (their anchors' graph order), as `autopar.planner.step_timeline` lays them out."""
    if not sites:
        return []
    order = {nd: i for i, nd in enumerate(sites[0].node.graph.nodes)}
    return sorted(sites, key=lambda s: order.get(s.node, 0))


def _ends(classes: list[list[Site]]) -> tuple[tuple[int, Site | None], tuple[int, Site | None]]:
    """(class index, site) of the first and of the last structure in forward order (`timeline.ends_s`)."""
    ordered = _forward_order([s for cls in classes for s in cls])
    if not ordered:
        return (-1, None), (-1, None)
    index = {s.key: k for k, cls in enumerate(classes) for s in cls}
    return (index[ordered[0].key], ordered[0]), (index[ordered[-1].key], ordered[-1])


def _total(data_axes, choices, per_site: dict[str, Cost], base: Cost, gap: float, status: str, grad_share: float,
           checkpoint: Cost | None = None, *, order: list[str]) -> Solution:
    """The solution's totals; `order`: the structures' keys in forward order (the objective's ends,
    `timeline.steady_s`)."""
    costs = list(per_site.values()) + [base] + ([checkpoint] if checkpoint is not None else [])
    ordered = [k for k in order if k in per_site]
    ordered += [k for k in per_site if k not in set(ordered)]
    # the peak: the checkpoint levels change the start of the backward (saved bytes, recompute transient)
    memory = peak_bytes(costs[:len(per_site) + 1], grad_share, checkpoint.memory_bytes if checkpoint else 0.0)
    return Solution(tuple(data_axes), dict(choices), sum(c.time_s for c in costs), sum(c.compute_s for c in costs),
                    sum(c.comm_s for c in costs), memory,
                    sum(c.comm_bytes for c in costs), gap, status, 0.0, 0, dict(per_site), other=base,
                    objective_s=steady_s([per_site[k] for k in ordered]) + sum(overlapped_s(c) for c in costs[len(per_site):]),
                    checkpoint_cost=checkpoint)


def evaluate(ctx: PassContext, mesh: MeshInfo, cluster: Cluster, choices: dict[str, Candidate],
             data_axes: tuple[str, ...], optimizer: str = "adam", seq_axes: tuple[str, ...] = (), *,
             other_fsdp: bool = False, layers=(), checkpoint: dict | None = None, zero: int = 0) -> Solution:
    """The cost of a given assignment (a hand plan) under the same model the ILP optimises; `other_fsdp`:
    the parameters outside every site are FSDP-sharded too (the fsdp plan); `checkpoint`: layer path -> level
    (`autopar.forms.checkpoint.Level`) of the `layers`; `zero`: the plan's ZeRO stage (`autopar.forms.zero`)."""
    stats, other, _ = gather_stats(ctx)
    mc = mesh_costing(ctx, stats, other, mesh.names, mesh.sizes, data_axes, cluster, optimizer=optimizer,
                      seq_axes=seq_axes, zero=zero)
    base = other_cost(other, mc, fsdp=other_fsdp and bool(data_axes))
    per_site = {}
    sites = ctx.planning_sites()
    tied = {s.key for p in _tied_pairs(sites) for s in p}
    memo: dict[tuple, Cost] = {}

    def price(site, st, cand):  # sites of one class (`_classes`) cost alike: priced once
        key = (site.key if site.key in tied else _signature(site), repr(sorted(st.fsdp_groups.values())),
               st.summed_into, cand)
        if key not in memo:
            memo[key] = site_cost(site, st, cand, mc)
        return memo[key]

    offer = float8_offer(ctx)
    choices = dict(choices)
    for site in sites:
        cand = choices.get(site.key, Candidate(form=Replicate.name))
        st = stats[site.key]
        leader = choices.get(st.summed_into) if st.summed_into else None
        if st.summed_into and (leader is None or (leader.form, leader.axes) != (cand.form, cand.axes)):
            st = dataclasses.replace(st, summed_into=None)  # the earlier embedding's sum is not reduced with it
        per_site[site.key] = price(site, st, cand)
        if offer and not cand.float8:  # a hand plan under float8="auto": each structure's fp8 variant where it pays
            key = (site.key if site.key in tied else _signature(site), repr(sorted(st.fsdp_groups.values())),
                   st.summed_into, cand, "float8")
            if key not in memo:
                memo[key] = min(float8_variants(site, st, cand, per_site[site.key], mc, offer),
                                key=lambda v: overlapped_s(v[1]), default=None)
            if memo[key] is not None:
                choices[site.key], per_site[site.key] = memo[key]
    extra = ck = None
    if checkpoint:
        groups = ckpt.groups(ctx.captured.gm, list(layers), checkpoint)
        sites = ctx.planning_sites()
        classes = [[s] for s in sites]
        cands = [[choices.get(s.key, Candidate(form=Replicate.name))] for s in sites]
        costs = [[per_site[s.key]] for s in sites]
        for s, cs, cost in zip(sites, cands, costs):  # an FSDP choice re-issues what it does without FSDP
            if cs[0].fsdp:
                cs.append(dataclasses.replace(cs[0], fsdp=False, zero=0))
                cost.append(price(s, stats[s.key], cs[1]))
        ck = _checkpoint_terms(groups, classes, cands, costs, mc, mesh, data_axes, seq_axes, stats)
        extra = checkpoint_cost({g: g.forced for g in groups}, {s.key: c[0] for s, c in zip(sites, cands)}, ck,
                                classes, cands)
    sol = _total(data_axes, choices, per_site, base, 0.0, "evaluated", mc.grad_share(), extra,
                 order=[s.key for s in _forward_order(ctx.planning_sites())])
    sol.checkpoint = {path: lv.name for path, lv in (checkpoint or {}).items()}
    sol.checkpoint_terms = ck
    return sol
