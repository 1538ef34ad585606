"""What decided each structure's form: the `Decision`s a Plan records for `Plan.explain`.

Every structure (identical layers once, as the ILP solves them) lists every form of its kind on every
tuple of axes, priced per device by the same cost model the solver uses, or left out with the reason
(`autopar.solver.all_candidates`: not offered, a precondition, an axis role the plan lacks). What decided
the choice, in this order:

- `override`: the user's overrides forced it;
- a named plan: the form that plan gives the kind (and, where it could not, the precondition that stopped it);
- the ILP (`auto`): `cheapest` when no possible candidate costs less time (the ILP's objective,
  `autopar.timeline.overlapped_s`); else `memory limit binding` when
  the ILP's plan without the memory limit takes a cheaper one (and needs more memory than the limit); else
  the coupling that rules the cheaper ones out: a tied weight (an embedding and its LM head take the same
  axes) or a form's constraint (`Form.add_constraints`, e.g. sequence-parallel norms need tensor-parallel
  blocks).

The mesh axes' roles are one more decision, '(axis roles)', whose rows are the role assignments tried.

`site_estimates` breaks the estimate down per structure for the report (`autopar.report`): compute,
communication per mesh axis, memory by part.
"""

from __future__ import annotations

import dataclasses

from autopar.estimate import Cost, MeshCosting, gather_stats, mesh_costing
from autopar.forms import Candidate
from autopar.mesh import MeshInfo
from autopar.plan import CandidateRow, Decision, SiteEstimate, _fmt_bytes
from cost_model.hardware import Link
from autopar.sites import Kind, PassContext, Site
from autopar.timeline import overlapped_s

ROLES_KEY = "(axis roles)"
_EPS = 1e-12


def _row(c: Candidate, cost: Cost | None, why: str) -> CandidateRow:
    if cost is None:
        return CandidateRow(label=c.label, excluded=why or "not priced")
    return CandidateRow(label=c.label, compute_s=cost.compute_s, comm_s=cost.comm_s,
                        memory_bytes=int(cost.memory_bytes), time_s=overlapped_s(cost))


def _cheapest_text(rows, chosen: Candidate) -> str:
    possible = [(c, cost) for c, cost, why in rows if cost is not None and not why]
    t = next(overlapped_s(cost) for c, cost in possible if c == chosen)
    ties = [c.label for c, cost in possible if c != chosen and abs(overlapped_s(cost) - t) <= _EPS]
    return (f"cheapest: the least estimated time of {_n(len(possible), 'possible candidate')}"
            + (f" (as cheap as {', '.join(ties)}: ties break by candidate order)" if ties else ""))


def auto_decisions(solution, forced: dict[str, Candidate], limit: float, *, unsplit: tuple[str, ...] = ()
                   ) -> tuple[Decision, ...]:
    """The ILP's decisions from `solution.priced` (`autopar.solver.Priced`). `unsplit`: the ops without a sharding
    rule that are not batch-local (`estimate.SiteStats.unsplit_ops`), which every data role prices whole."""
    pr = solution.priced
    out = [_roles_decision(solution, pr.roles, unsplit)]
    for cls, rows in zip(pr.classes, pr.rows):
        key = cls[0].key
        chosen = forced.get(key) or solution.choices[key]
        t = overlapped_s(solution.per_site[key])
        cheaper = [(c, cost) for c, cost, why in rows if cost is not None and not why and overlapped_s(cost) < t - _EPS]
        if key in forced:
            by = f"override: forced to {forced[key].label}"
        elif not cheaper:
            by = _cheapest_text(rows, chosen)
        elif pr.free is not None and _time_of(rows, pr.free[key]) < t - _EPS:
            free = pr.free[key]
            by = (f"memory limit binding: {free.label} is faster for this structure, but the fastest plan on these "
                  f"axis roles without the limit needs {_fmt_bytes(pr.free_memory_bytes)} per device, over the limit "
                  f"of {_fmt_bytes(limit)}")
        else:
            by = _coupling(key, cls, pr, solution, cheaper)
        out.append(Decision(keys=tuple(s.key for s in cls), kind=cls[0].kind.value, chosen=chosen.label,
                            decided_by=by, candidates=tuple(_row(*r) for r in rows)))
    return tuple(out)


def _n(count: int, noun: str) -> str:
    return f"{count} {noun}" + ("" if count == 1 else "s")


def _time_of(rows, cand: Candidate) -> float:
    return next(overlapped_s(cost) for c, cost, why in rows if c == cand and cost is not None)


def _coupling(key: str, cls, pr, solution, cheaper) -> str:
    names = {s.key for s in cls}
    tied = [b.key if a.key in names else a.key for a, b in pr.pairs if a.key in names or b.key in names]
    whys = sorted(solution.site_whys.get(key, ()))
    parts = [f"a tied weight with {', '.join(tied)}: both take the same axes and FSDP choice"] if tied else []
    parts += whys
    if not parts:  # site costs are independent; only constraints tie them: say what we know
        parts = ["the plan's constraints"]
    return f"coupling: cheaper {', '.join(c.label for c, _ in cheaper)} ruled out: " + "; ".join(parts)


def _roles_decision(solution, roles, unsplit: tuple[str, ...] = ()) -> Decision:
    rows, fits, faster = [], 0, []
    for data, seq, sol, why in roles:
        label = _roles_label(data, seq)
        if sol is None:
            rows.append(CandidateRow(label=label, excluded=why))
            continue
        rows.append(CandidateRow(label=label, compute_s=sol.compute_s, comm_s=sol.comm_s,
                                 memory_bytes=int(sol.memory_bytes), excluded=why))
        fits += not why
        if why and sol.objective_s < solution.objective_s - _EPS:  # priced without the limit (`solver.solve`)
            faster.append(label)
    chosen = _roles_label(solution.data_axes, solution.seq_axes)
    by = (f"the fastest of {_n(fits, 'role assignment')} whose best plan fits the memory limit"
          + (f" ({len(rows) - fits} had none)" if len(rows) > fits else ""))
    if faster:
        by = f"memory limit binding: {'; '.join(faster)} would be faster but no plan of it fits; " + by
    if unsplit:  # `solver._unsplit_cost`
        by += (f"; each assignment with data axes runs {_n(len(unsplit), 'op')} that "
               f"{'gathers' if len(unsplit) == 1 else 'gather'} the batch (no sharding rule, or a rule that gathers "
               f"it) and {'is' if len(unsplit) == 1 else 'are'} not batch-local ({', '.join(unsplit)}) whole on every "
               "data rank, priced so: its compute not divided, its inputs and output gradients all-gathered")
    return Decision(keys=(ROLES_KEY,), kind="mesh", chosen=chosen, decided_by=by, candidates=tuple(rows))


def _roles_label(data, seq) -> str:
    return f"data {'+'.join(data) or '-'}, sequence {'+'.join(seq) or '-'}, the rest model"


def hand_decisions(ctx: PassContext, mesh: MeshInfo, cluster, name: str, choices: dict[str, Candidate],
                   data_axes, seq_axes, optimizer: str, forced: dict[str, Candidate], notes: list[str]
                   ) -> tuple[Decision, ...]:
    """A named plan's decisions: every candidate priced on the plan's axis roles (and its ZeRO stage), and the plan's
    rule."""
    from autopar.forms.zero import PLANS as ZERO_PLANS
    from autopar.solver import _classes, _tied_pairs, all_candidates, site_cost

    stats, other, _ = gather_stats(ctx)
    mc = mesh_costing(ctx, stats, other, mesh.names, mesh.sizes, data_axes, cluster, optimizer=optimizer,
                      seq_axes=seq_axes, zero=ZERO_PLANS.get(name, 0))
    sites = ctx.planning_sites()
    classes = _classes(sites, {s.key for p in _tied_pairs(sites) for s in p})
    groups: dict[tuple, list[Site]] = {}
    priced: dict[int, list] = {}
    for k, cls in enumerate(classes):
        for s in cls:
            by = _hand_rule(s, name, choices[s.key], forced, notes)
            groups.setdefault((k, choices[s.key].label, by), []).append(s)
    out = [Decision(keys=(ROLES_KEY,), kind="mesh", chosen=_roles_label(tuple(data_axes), tuple(seq_axes)),
                    decided_by=f"the {name} plan's rule")]
    for (k, label, by), members in groups.items():
        if k not in priced:
            site = classes[k][0]
            st = stats[site.key]
            priced[k] = [_row(c, None if why else site_cost(site, st, c, mc), why)
                         for c, why in all_candidates(site, st, mesh, data_axes, None, seq_axes)]
        out.append(Decision(keys=tuple(s.key for s in members), kind=members[0].kind.value, chosen=label,
                            decided_by=by, candidates=tuple(priced[k])))
    return tuple(out)


def _hand_rule(site: Site, name: str, cand: Candidate, forced: dict[str, Candidate], notes: list[str]) -> str:
    if site.key in forced:
        return f"override: forced to {forced[site.key].label}"
    said = [n for n in notes if f" {site.key} " in f" {n} " or f" {site.key}," in n]
    rule = {"dp": "the dp plan replicates every structure and splits the batch over all axes",
            "fsdp": "the fsdp plan replicates every structure's form and FSDP-shards its parameters over all axes",
            }.get(name, f"hand plan {name}: picks {cand.label} for every {site.kind.value}"
                        + (" it can take" if cand.axes else ""))
    if name == "megatron" and site.kind is Kind.LINEAR and not cand.axes:
        rule = "hand plan megatron: a lone linear (not in a recognised block) stays replicated"
    return rule + ("; " + "; ".join(said) if said else "")


# ----------------------------------------------------------------------------- the estimate broken down

def site_estimates(ctx: PassContext, mesh: MeshInfo, cluster, solution, priced: dict[str, Candidate], data_axes,
                   seq_axes, optimizer: str, *, other_fsdp: bool = False, zero: int = 0) -> tuple[SiteEstimate, ...]:
    """Each structure's estimated compute and communication (split by mesh axis: the communication time less
    the same priced with that axis' links free) and its memory by part (`Cost.act_bytes`, `transient_bytes`;
    the rest is parameters, gradients and optimizer state, 1 : 1 : the optimizer's states, or as ZeRO `zero` divides
    them: `autopar.forms.zero.state_parts`)."""
    from autopar.solver import _signature, other_cost, site_cost

    stats, other, _ = gather_stats(ctx)
    mc = mesh_costing(ctx, stats, other, mesh.names, mesh.sizes, data_axes, cluster, optimizer=optimizer,
                      seq_axes=seq_axes, zero=zero)
    free = {a: _FreeAxis(**{f.name: getattr(mc, f.name) for f in dataclasses.fields(mc)}, free=a)
            for a, s in zip(mesh.names, mesh.sizes) if s > 1}
    sites = {s.key: s for s in ctx.planning_sites()}
    kept = getattr(solution, "keep_gathered", frozenset())  # layers whose FSDP gathers are kept (`solver.KeepTerms`)
    out = []
    done: dict[tuple, tuple] = {}  # structures priced alike (one class, one candidate, one cost) split alike
    for key, cost in solution.per_site.items():
        site, cand, st = sites[key], priced[key], stats[key]
        if st.summed_into and (priced.get(st.summed_into) or cand).axes != cand.axes:
            st = dataclasses.replace(st, summed_into=None)  # as `solver.evaluate` prices it
        if kept and any(key.startswith(p + ".") for p in kept):
            st = dataclasses.replace(st, fsdp_groups={p: (b, False) for p, (b, _) in st.fsdp_groups.items()})
        same = (_signature(site), cand, cost, st.summed_into, repr(sorted(st.fsdp_groups.values())))
        if same not in done:
            full = site_cost(site, st, cand, mc).comm_s
            done[same] = tuple((a, max(0.0, full - site_cost(site, st, cand, m).comm_s)) for a, m in free.items())
        out.append(_site_estimate(key, cost, done[same], mc))
    if solution.other is not None:
        full = other_cost(other, mc, fsdp=other_fsdp).comm_s
        axes = tuple((a, max(0.0, full - other_cost(other, m, fsdp=other_fsdp).comm_s)) for a, m in free.items())
        out.append(_site_estimate("(other)", solution.other, axes, mc))
    return tuple(out)


def unsplit_ops(ctx: PassContext, mesh: MeshInfo, cluster, data_axes, seq_axes, optimizer: str) -> dict:
    """`Estimate` fields for the ops that gather the batch (no sharding rule, or a rule that gathers it) and are not
    batch-local (`passes.batch_local.gathers_batch`): which
    (`unsplit_ops`), and what the cost model charges for running them whole on every rank of the data axes
    (`solver._unsplit_cost`): their compute, not divided (`unsplit_compute_s`), and the all-gathers of their inputs
    and of their outputs' gradients (`unsplit_comm_s`). Nothing without data axes."""
    from autopar.solver import _unsplit_cost

    stats, other, _ = gather_stats(ctx)
    if not data_axes or other.unsplit is None:
        return {}
    mc = mesh_costing(ctx, stats, other, mesh.names, mesh.sizes, data_axes, cluster, optimizer=optimizer,
                      seq_axes=seq_axes)
    (compute, comm), _ = _unsplit_cost(other, mc)
    return dict(unsplit_ops=other.unsplit_ops, unsplit_compute_s=compute, unsplit_comm_s=comm)


def _site_estimate(key: str, cost: Cost, axes, mc) -> SiteEstimate:
    state = max(0.0, cost.memory_bytes - cost.act_bytes - cost.transient_bytes)
    params, grads = state * mc.param_share(), state * mc.grad_share()  # any precision (`state_bytes_per_element`)
    if mc.zero in (1, 2) and mc.dp > 1:
        from autopar.forms.zero import state_parts
        p, g, o = state_parts(mc, mc.zero)
        params, grads = state * p / (p + g + o), state * g / (p + g + o)
    return SiteEstimate(key=key, compute_s=cost.compute_s, comm_s=cost.comm_s, comm_axes=axes,
                        parameters_bytes=int(params), gradients_bytes=int(grads),
                        optimizer_bytes=int(state - params - grads),
                        activations_bytes=int(cost.act_bytes), transient_bytes=int(cost.transient_bytes),
                        momentary_bytes=int(cost.peak_bytes))


@dataclasses.dataclass(frozen=True, kw_only=True)
class _FreeAxis(MeshCosting):
    """The same mesh with the links of axis `free` costing nothing (to tell what a structure spends on it)."""

    free: str = ""

    def link(self, axis: str):
        if axis == self.free:
            return Link(alpha_s=0.0, bytes_per_s=1e30)
        return super().link(axis)
