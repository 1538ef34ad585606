"""The ILP that chooses the plan (`plan="auto"`). The only OR-Tools import in autopar.

Sets
  K   site classes: recognised structures (attention, MLP, embedding, loss, lone linear) grouped by
      a Weisfeiler-Lehman hash of their subgraph (op and shape labels), so the L identical layers of
      a transformer are one class with multiplicity n_k and are solved once.   `_classes`
  C_k candidates of class k: replicate, or the class's form on a model axis (`heads`, `tp`,
      `vocab`) where its preconditions hold, each with or without FSDP sharding of its
      parameters over the data axes.                                          `_candidates`
  D   the data axes: the batch is split over them, forms use the other axes. Every subset of the
      mesh axes is tried (at most 8 for a 3-D mesh), one ILP each, and the best is kept.
Variables
  x[k,c] in {0,1}: class k takes candidate c.
Constraints
  sum_c x[k,c] = 1 for every k                                                 (one-hot)
  tied parameters (an embedding and its LM head) take matching forms and FSDP  (`_tie`)
  a norm is sequence-parallel on an axis only if every attention / MLP class is tensor parallel there
  an embedding added to an earlier one (a position embedding) is vocab-parallel on an axis only if
      the earlier one is: x[e2, vocab@a] <= x[e1, vocab@a] (their sum is all-reduced once)
  sum_k n_k sum_c mem[k,c] x[k,c] + mem_other <= memory limit                  (per-device memory)
Objective
  minimise sum_k n_k sum_c time[k,c] x[k,c] + time_other: estimated step time (compute + communication,
  `autopar.estimate`), in integer nanoseconds for CP-SAT.
Resharding edges: every form of this release takes and returns activations replicated on its model
axis, so consecutive structures never reshard between them and edges cost nothing; forms that
keep activations sharded on the sequence (issue #4) add edge variables with Alpa's linearisation
(e[u,v,c,c'] >= x[u,c] + x[v,c'] - 1).

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

import networkx as nx
from ortools.sat.python import cp_model

from autopar.estimate import Candidate, Cost, SiteStats, _between, gather_stats, mesh_costing, other_cost, site_cost, \
    site_nodes
from autopar.mesh import MeshInfo
from autopar.planner import _attention_ok
from cost_model.hardware import Cluster
from passes.context import PassContext, Site


class InfeasibleError(ValueError):
    """No plan fits the memory limit."""


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


def sites_for_planning(ctx: PassContext) -> list[Site]:
    composite = [s for s in ctx.sites if s.kind != "linear"]
    covered = {m.key for s in composite for m in s.members()}
    return composite + [s for s in ctx.of_kind("linear") if s.key not in covered]


def _signature(site: Site) -> str:
    nodes = list(dict.fromkeys(_between(site) + site_nodes(site)))
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
        return site.kind + ":" + nx.weisfeiler_lehman_graph_hash(g, node_attr="label", iterations=3)


def _classes(sites: list[Site], tied: set[str]) -> list[list[Site]]:
    groups: dict[str, list[Site]] = {}
    for s in sites:
        key = s.key if s.key in tied else _signature(s)
        groups.setdefault(key, []).append(s)
    return list(groups.values())


def _form_ok(site: Site, form: str, t: int) -> bool:
    info = site.info
    if form == "heads":
        return _attention_ok(site, t) is None
    if form == "tp":
        return info["features"] % t == 0
    if form == "vocab" and site.kind == "embedding":
        return info["vocab"] % t == 0
    if form == "vocab" and site.kind == "loss":
        return bool(info["vocab_ok"] and info["head"] and info["vocab"] % t == 0)
    if form == "sequence":
        return info["seq_len"] % t == 0
    return False


FORM_OF = {"attention": "heads", "mlp": "tp", "embedding": "vocab", "loss": "vocab", "norm": "sequence"}


def _candidates(site: Site, st: SiteStats, mesh: MeshInfo, data_axes, forced: Candidate | None,
                seq_axes=()) -> list[Candidate]:
    model_axes = [n for n, s in zip(mesh.names, mesh.sizes) if n not in data_axes and n not in seq_axes and s > 1]
    dp = math.prod(mesh.sizes[mesh.names.index(a)] for a in data_axes)
    forms = [("replicate", None)]
    form = FORM_OF.get(site.kind)
    if form:
        forms += [(form, a) for a in model_axes if _form_ok(site, form, mesh.sizes[mesh.names.index(a)])]
    if seq_axes and site.kind == "attention":  # the sequence is split: attention must be a sequence form
        from autopar.planner import _ring_ok, _ulysses_ok
        (q,) = seq_axes
        u = mesh.sizes[mesh.names.index(q)]
        forms = [(f, q) for f, ok in (("ulysses", _ulysses_ok), ("ring", _ring_ok)) if ok(site, u) is None]
    if site.kind == "moe":  # experts shard over any axis: a data axis dispatches by all-to-all (EP within DP)
        forms = [("replicate", None)] + [("expert", a) for a, s in zip(mesh.names, mesh.sizes)
                                         if s > 1 and site.info["num_experts"] % s == 0]
        F = site.info.get("ffn_features")
        forms += [("tp", a) for a in model_axes if F and F % mesh.sizes[mesh.names.index(a)] == 0]
    out = []
    for f, a in forms:
        t = mesh.sizes[mesh.names.index(a)] if a else 1
        fsdp_ok = dp > 1 and st.param_dim0 and all(d % (dp * t) == 0 for d in st.param_dim0) and site.kind != "moe"
        for fsdp in ((False, True) if fsdp_ok else (False,)):
            out.append(Candidate(form=f, axis=a, fsdp=fsdp))
    if forced is not None:
        keep = [c for c in out if c.form == forced.form and (forced.axis is None or c.axis == forced.axis)]
        if not keep:
            raise ValueError(f"{site.kind} {site.key}: the forced form {forced.label} is not possible with data axes "
                             f"{data_axes} on mesh {mesh.describe()}")
        out = keep
    return out


def _tied_pairs(ctx: PassContext, sites: list[Site]) -> list[tuple[Site, Site]]:
    from autopar.estimate import _params
    pairs = []
    for a, b in itertools.combinations(sites, 2):
        if _params(a) & _params(b):
            pairs.append((a, b))
    return pairs


def _role_options(ctx: PassContext, mesh: MeshInfo, batch: int, data_axes_options):
    """(data axes, sequence axes) pairs: every split of the axes into data / model / (at most one) sequence
    axis that the batch and the model admit."""
    axes = [n for n, s in zip(mesh.names, mesh.sizes) if s > 1]
    has_attention = bool(ctx.of_kind("attention"))
    out = []
    for roles in itertools.product(("data", "model", "seq"), repeat=len(axes)):
        data = tuple(a for a, r in zip(axes, roles) if r == "data")
        seq = tuple(a for a, r in zip(axes, roles) if r == "seq")
        if len(seq) > 1 or (seq and not has_attention):
            continue
        if data_axes_options is not None and data not in data_axes_options:
            continue
        size = math.prod(mesh.sizes[mesh.names.index(a)] for a in data)
        if batch and batch % size:
            continue
        out.append((data, seq))
    return out


def solve(ctx: PassContext, mesh: MeshInfo, cluster: Cluster, *, memory_limit: float | None = None,
          forced: dict[str, Candidate] | None = None, optimizer: str = "adam",
          time_limit_s: float = 10.0, data_axes_options=None, batch: int = 0) -> Solution:
    """The best plan under the cost model; raises InfeasibleError (with the least memory any plan needs)."""
    t0 = time.perf_counter()
    limit = memory_limit if memory_limit is not None else cluster.device_memory_bytes
    stats, other, _ = gather_stats(ctx)
    sites = sites_for_planning(ctx)
    pairs = _tied_pairs(ctx, sites)
    tied = {s.key for p in pairs for s in p}
    classes = _classes(sites, tied)
    forced = forced or {}
    options = _role_options(ctx, mesh, batch, data_axes_options)
    best: Solution | None = None
    least_memory = math.inf
    for data_axes, seq_axes in options:
        mc = mesh_costing(ctx, stats, other, mesh.names, mesh.sizes, data_axes, cluster, optimizer=optimizer,
                          seq_axes=seq_axes)
        try:
            cands = [_candidates(cls[0], stats[cls[0].key], mesh, data_axes, forced.get(cls[0].key), seq_axes)
                     for cls in classes]
        except ValueError:
            continue
        if any(not cs for cs in cands):
            continue
        costs = [[site_cost(cls[0], stats[cls[0].key], c, mc) for c in cs] for cls, cs in zip(classes, cands)]
        base = other_cost(other, mc)
        sol, mem_min = _solve_one(classes, cands, costs, base, pairs, limit, time_limit_s, stats)
        least_memory = min(least_memory, mem_min)
        if sol is None:
            continue
        sol.data_axes = tuple(data_axes)
        sol.seq_axes = tuple(seq_axes)
        if best is None or sol.time_s < best.time_s - 1e-12:
            best = sol
    if best is None:
        raise InfeasibleError(
            f"no plan fits {limit / 2**30:.2f} GiB per device on mesh {mesh.describe()}: the least memory any plan "
            f"needs is {least_memory / 2**30:.2f} GiB per device (parameters, gradients, {optimizer} state and "
            "activations). Fix: raise memory_limit, use more devices, a smaller batch, or an optimizer with less state.")
    best.solve_s = time.perf_counter() - t0
    best.classes = len(classes)
    return best


def _solve_one(classes, cands, costs, base: Cost, pairs, limit: float, time_limit_s: float, stats):
    model = cp_model.CpModel()
    x = [[model.NewBoolVar(f"x{k}_{i}") for i in range(len(cs))] for k, cs in enumerate(cands)]
    for xs in x:
        model.AddExactlyOne(xs)
    index = {s.key: k for k, cls in enumerate(classes) for s in cls}
    for a, b in pairs:  # tied parameters: the same vocab axis (or none) and the same FSDP choice
        ka, kb = index[a.key], index[b.key]
        for axis in {c.axis for c in cands[ka]} | {c.axis for c in cands[kb]}:
            model.Add(sum(v for v, c in zip(x[ka], cands[ka]) if c.axis == axis) ==
                      sum(v for v, c in zip(x[kb], cands[kb]) if c.axis == axis))
        model.Add(sum(v for v, c in zip(x[ka], cands[ka]) if c.fsdp) ==
                  sum(v for v, c in zip(x[kb], cands[kb]) if c.fsdp))
    # Megatron SP: a norm is sequence-parallel on an axis only if every block there is tensor parallel on it
    # (x[norm, sequence@a] <= x[block, heads|tp@a] for every attention / MLP class)
    for kn, (cls_n, cs_n) in enumerate(zip(classes, cands)):
        if cls_n[0].kind != "norm":
            continue
        for i, c in enumerate(cs_n):
            if c.form != "sequence":
                continue
            for kb, (cls_b, cs_b) in enumerate(zip(classes, cands)):
                if cls_b[0].kind in ("attention", "mlp"):
                    model.Add(x[kn][i] <= sum(v for v, cb in zip(x[kb], cs_b)
                                              if cb.form in ("heads", "tp") and cb.axis == c.axis))
    # an embedding added to an earlier one shares its all-reduce (estimate.summed_embeddings): it may be
    # vocab-parallel on an axis only where the earlier one is (x[e2, vocab@a] <= x[e1, vocab@a])
    for k2, (cls, cs) in enumerate(zip(classes, cands)):
        leader = stats[cls[0].key].summed_into
        if leader is None:
            continue
        k1 = index[leader]
        for i, c in enumerate(cs):
            if c.form == "vocab":
                model.Add(x[k2][i] <= sum(v for v, c1 in zip(x[k1], cands[k1]) if c1.form == "vocab"
                                          and c1.axis == c.axis))
    kib = lambda b: int(math.ceil(b / 1024))  # noqa: E731
    ns = lambda s: int(round(s * 1e9))  # noqa: E731
    mem = sum(len(cls) * kib(c.memory_bytes) * v for cls, cs, xs in zip(classes, costs, x) for c, v in zip(cs, xs))
    # the least memory any plan of this family needs (reported when nothing fits)
    mem_min = kib(base.memory_bytes) + sum(len(cls) * min(kib(c.memory_bytes) for c in cs)
                                           for cls, cs in zip(classes, costs))
    model.Add(mem + kib(base.memory_bytes) <= int(limit // 1024))
    model.Minimize(sum(len(cls) * ns(c.time_s) * v for cls, cs, xs in zip(classes, costs, x) for c, v in zip(cs, xs)))
    solver = cp_model.CpSolver()
    solver.parameters.num_workers = 1
    solver.parameters.random_seed = 0
    solver.parameters.max_time_in_seconds = time_limit_s
    status = solver.Solve(model)
    if status not in (cp_model.OPTIMAL, cp_model.FEASIBLE):
        return None, mem_min * 1024
    choices, per_site = {}, {}
    for cls, cs, cost, xs in zip(classes, cands, costs, x):
        i = next(i for i, v in enumerate(xs) if solver.Value(v))
        for s in cls:
            choices[s.key] = cs[i]
            per_site[s.key] = cost[i]
    obj, bound = solver.ObjectiveValue(), solver.BestObjectiveBound()
    gap = 0.0 if obj == 0 else max(0.0, (obj - bound) / obj)
    name = "optimal" if status == cp_model.OPTIMAL else "feasible (time limit)"
    return _total((), choices, per_site, base, gap, name), mem_min * 1024


def _total(data_axes, choices, per_site: dict[str, Cost], base: Cost, gap: float, status: str) -> Solution:
    costs = list(per_site.values()) + [base]
    return Solution(tuple(data_axes), dict(choices), sum(c.time_s for c in costs), sum(c.compute_s for c in costs),
                    sum(c.comm_s for c in costs), sum(c.memory_bytes for c in costs),
                    sum(c.comm_bytes for c in costs), gap, status, 0.0, 0, dict(per_site))


def evaluate(ctx: PassContext, mesh: MeshInfo, cluster: Cluster, choices: dict[str, Candidate],
             data_axes: tuple[str, ...], optimizer: str = "adam", seq_axes: tuple[str, ...] = (), *,
             other_fsdp: bool = False) -> Solution:
    """The cost of a given assignment (a hand plan) under the same model the ILP optimises; `other_fsdp`:
    the parameters outside every site are FSDP-sharded too (the fsdp plan)."""
    stats, other, _ = gather_stats(ctx)
    mc = mesh_costing(ctx, stats, other, mesh.names, mesh.sizes, data_axes, cluster, optimizer=optimizer,
                      seq_axes=seq_axes)
    base = other_cost(other, mc, fsdp=other_fsdp and bool(data_axes))
    per_site = {}
    for site in sites_for_planning(ctx):
        cand = choices.get(site.key, Candidate(form="replicate", axis=None))
        st = stats[site.key]
        leader = choices.get(st.summed_into) if st.summed_into else None
        if st.summed_into and (leader is None or (leader.form, leader.axis) != ("vocab", cand.axis)):
            st = dataclasses.replace(st, summed_into=None)  # the earlier embedding's sum is not reduced with it
        per_site[site.key] = site_cost(site, st, cand, mc)
    return _total(data_axes, choices, per_site, base, 0.0, "evaluated")
