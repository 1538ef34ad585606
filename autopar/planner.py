"""Hand plans and overrides: which form each recognised structure takes on which mesh axis.

- `megatron`: tensor parallel on the last mesh axis (attention by heads, MLPs colwise -> rowwise,
  vocab-parallel embedding, LM head and cross-entropy), data parallel on the other axes.
- `dp`: every parameter replicated, the batch sharded over all axes.
- `fsdp`: the batch sharded over all axes and every parameter sharded on dim 0 over them (ZeRO-3 /
  FSDP2): gathered before use (all-gather forward, reduce-scatter of the gradient backward).
- `auto`: until the ILP planner lands (issue #3), the megatron heuristic, which parallelises every
  mesh axis (tensor parallel where the model's structure allows it, data parallel elsewhere).

A form whose precondition fails is not chosen by a heuristic (the structure stays replicated and
the plan notes why); forcing it through `overrides` raises a ValueError that says what to change.
"""

from __future__ import annotations

import fnmatch
import itertools

from autopar.mesh import MeshInfo
from autopar.plan import Plan, Strategy
from autopar.spec import Owned, R, Placement, Shard, _StridedShard, fmt_placements, placements_from_str
from passes import attention as attention_form
from passes import embedding as embedding_form
from passes import linear as linear_form
from passes import loss as loss_form
from passes.context import PassContext, Site

KIND_FORMS = {
    "linear": linear_form.FORMS,
    "embedding": embedding_form.FORMS,
    "attention": attention_form.FORMS,
    "loss": loss_form.FORMS,
    "mlp": ("replicate", "tp"),
    "moe": ("replicate", "expert", "tp"),
    "norm": ("replicate", "sequence"),
}
NOT_YET: dict[tuple[str, str], str] = {}


def _ulysses_ok(site: Site, u: int) -> str | None:
    h, kv = site.info["heads"], site.info["kv_heads"]
    if site.info["spelling"] != "sdpa":
        return "explicit matmul-softmax-matmul attention is not lowered to a fused attention yet"
    if h % u:
        return f"{h} heads do not divide over {u} ranks"
    if kv % u and u % kv:
        return f"{kv} KV heads neither divide over nor into {u} ranks"
    if site.info["seq_len"] % u:
        return f"sequence {site.info['seq_len']} does not divide over {u} ranks"
    return None


def _ring_ok(site: Site, p: int) -> str | None:
    info = site.info
    if info["spelling"] != "sdpa":
        return "explicit matmul-softmax-matmul attention is not lowered to a fused attention yet"
    if info.get("has_mask"):
        return "it takes an explicit attention mask (only is_causal or no mask is supported by ring attention)"
    if info.get("dropout"):
        return "attention dropout is not supported by ring attention"
    if info["seq_len"] % (2 * p):
        return f"sequence {info['seq_len']} does not split into 2x{p} zigzag chunks"
    return None


def _attention_ok(site: Site, t: int) -> str | None:
    h, kv = site.info["heads"], site.info["kv_heads"]
    if h % t:
        return f"{h} heads do not divide over {t} ranks"
    if kv % t and t % kv:
        return f"{kv} KV heads neither divide over nor into {t} ranks"
    if not site.info["q"] or not site.info["out"]:
        return "its q or output projection is not a recognised linear"
    fused = [s for s in site.info["q"] if s in site.info["k"]]
    if fused and fused[0].info["parts"] == 1:
        return "its fused QKV projection splits into unequal parts (GQA): not sharded yet"
    if fused and kv % t:
        return "its fused QKV projection has fewer KV heads than ranks: not sharded yet"
    return None


class _Planner:
    def __init__(self, ctx: PassContext, mesh: MeshInfo):
        self.ctx, self.mesh = ctx, mesh
        self.linear: dict[str, tuple[str, str | None]] = {}  # linear key -> (form, axis)
        self.site_form: dict[str, tuple[str, str | None]] = {}
        self.emb: dict[str, tuple[str, str | None]] = {}
        self.notes: list[str] = []

    # ------------------------------------------------------------------ forms of composite sites
    def set_attention(self, site: Site, form: str, axis: str | None, forced: bool) -> None:
        if form == "heads":
            t = self.mesh.axis(axis).size
            why = _attention_ok(site, t)
            if why:
                if forced:
                    raise ValueError(
                        f"attention {site.key}: form 'heads' on mesh axis {axis!r} (size {t}) is not possible: {why} "
                        f"(the model has {site.info['heads']} heads, {site.info['kv_heads']} KV heads; mesh "
                        f"{self.mesh.describe()}). Fix: use an axis whose size divides the head count, or "
                        f"'replicate' for this attention.")
                self.notes.append(f"attention {site.key} replicated: {why}")
                form = "replicate"
        if form == "ulysses":
            u = self.mesh.axis(axis).size
            why = _ulysses_ok(site, u)
            if why:
                if forced:
                    raise ValueError(
                        f"attention {site.key}: form 'ulysses' on mesh axis {axis!r} (size {u}) is not possible: {why}. "
                        "Fix: use an axis whose size divides heads and sequence, or 'heads'/'replicate'.")
                self.notes.append(f"attention {site.key} not ulysses: {why}")
                form = "replicate"
        if form == "ring":
            r = self.mesh.axis(axis).size
            why = _ring_ok(site, r)
            if why:
                if forced:
                    raise ValueError(
                        f"attention {site.key}: form 'ring' on mesh axis {axis!r} (size {r}) is not possible: {why}. "
                        "Fix: pad the sequence to a multiple of 2x the axis size, or use 'ulysses'/'heads'/'replicate'.")
                self.notes.append(f"attention {site.key} not ring: {why}")
                form = "replicate"
        self.site_form[site.key] = (form, axis if form != "replicate" else None)
        kv_sharded = form == "heads" and site.info["kv_heads"] % self.mesh.axis(axis).size == 0
        if form in ("ulysses", "ring"):  # sequence forms: the projections stay replicated on that axis
            for s in site.info["q"] + site.info["k"] + site.info["v"] + site.info["out"]:
                self.linear[s.key] = ("replicate", None)
            return
        for s in site.info["q"]:
            self.linear[s.key] = ("colwise", axis) if form == "heads" else ("replicate", None)
        for s in site.info["k"] + site.info["v"]:
            if s in site.info["q"]:
                continue
            self.linear[s.key] = ("colwise", axis) if kv_sharded else ("replicate", None)
        for s in site.info["out"]:
            self.linear[s.key] = ("rowwise", axis) if form == "heads" else ("replicate", None)

    def set_norm(self, site: Site, form: str, axis: str | None, forced: bool) -> None:
        if form == "sequence":
            t = self.mesh.axis(axis).size
            if site.info["seq_len"] % t:
                if forced:
                    raise ValueError(f"norm {site.key}: form 'sequence' on axis {axis!r} needs the sequence "
                                     f"({site.info['seq_len']}) to divide over {t} ranks. Fix: pad the sequence or "
                                     "'replicate'.")
                self.notes.append(f"norm {site.key} not sequence-parallel: {site.info['seq_len']} % {t} != 0")
                form = "replicate"
        self.site_form[site.key] = (form, axis if form != "replicate" else None)

    def set_moe(self, site: Site, form: str, axis: str | None, forced: bool) -> None:
        if form == "expert":
            ep, E = self.mesh.axis(axis).size, site.info["num_experts"]
            if E % ep:
                if forced:
                    raise ValueError(f"moe {site.key}: form 'expert' on mesh axis {axis!r} (size {ep}) is not possible: "
                                     f"{E} experts do not divide over {ep} ranks. Fix: use an axis whose size divides "
                                     f"the expert count, or 'replicate'.")
                self.notes.append(f"moe {site.key} replicated: {E} experts % {ep} != 0")
                form = "replicate"
        if form == "tp":
            t, F = self.mesh.axis(axis).size, site.info.get("ffn_features")
            why = None if F and F % t == 0 else (
                f"its {F} expert features do not divide over {t} ranks" if F else
                f"its experts ({site.info['spelling']}) are not stacked weights with known FFN dims")
            if why:
                if forced:
                    raise ValueError(f"moe {site.key}: form 'tp' on mesh axis {axis!r} is not possible: {why}. Fix: "
                                     "'expert' (expert parallel) or 'replicate'.")
                self.notes.append(f"moe {site.key} not tensor-parallel: {why}")
                form = "replicate"
        self.site_form[site.key] = (form, axis if form != "replicate" else None)

    def set_mlp(self, site: Site, form: str, axis: str | None, forced: bool) -> None:
        if form == "tp":
            t = self.mesh.axis(axis).size
            if site.info["features"] % t:
                if forced:
                    raise ValueError(f"mlp {site.key}: {site.info['features']} hidden features do not divide over "
                                     f"axis {axis!r} of size {t}. Fix: 'replicate' or another axis.")
                self.notes.append(f"mlp {site.key} replicated: {site.info['features']} features % {t} != 0")
                form = "replicate"
        self.site_form[site.key] = (form, axis if form != "replicate" else None)
        for s in site.info["col"]:
            self.linear[s.key] = ("colwise", axis) if form == "tp" else ("replicate", None)
        for s in site.info["row"]:
            self.linear[s.key] = ("rowwise", axis) if form == "tp" else ("replicate", None)

    def set_loss(self, site: Site, form: str, axis: str | None, forced: bool) -> None:
        if form == "vocab":
            t = self.mesh.axis(axis).size
            why = None
            if not site.info["vocab_ok"]:
                why = "vocab-parallel cross-entropy needs 2-D logits, no class weights and no label smoothing"
            elif site.info["vocab"] % t:
                why = f"vocab {site.info['vocab']} does not divide over {t} ranks"
            elif not site.info["head"]:
                why = "the logits do not come from a recognised linear"
            if why:
                if forced:
                    raise ValueError(f"loss {site.key}: form 'vocab' on axis {axis!r} is not possible: {why}. "
                                     "Fix: use 'replicate' for the loss.")
                self.notes.append(f"loss {site.key} not vocab-parallel: {why}")
                form = "replicate"
        self.site_form[site.key] = (form, axis if form != "replicate" else None)
        for s in site.info["head"]:
            self.linear[s.key] = ("colwise", axis) if form == "vocab" else ("replicate", None)

    def set_embedding(self, site: Site, form: str, axis: str | None, forced: bool) -> None:
        if form == "vocab":
            t = self.mesh.axis(axis).size
            if site.info["vocab"] % t:
                if forced:
                    raise ValueError(f"embedding {site.key}: vocab {site.info['vocab']} does not divide over axis "
                                     f"{axis!r} of size {t}; uneven vocab shards are not supported yet. "
                                     "Fix: pad the vocabulary to a multiple of the axis size, or 'replicate'.")
                self.notes.append(f"embedding {site.key} replicated: vocab {site.info['vocab']} % {t} != 0")
                form = "replicate"
        self.emb[site.key] = (form, axis if form != "replicate" else None)
        self.site_form[site.key] = self.emb[site.key]

    def set_form(self, site: Site, form: str, axis: str | None, forced: bool) -> None:
        if site.kind == "linear":
            if form not in linear_form.FORMS:
                raise ValueError(f"linear {site.key}: unknown form {form!r}; valid: {', '.join(linear_form.FORMS)}")
            self.linear[site.key] = (form, axis if form != "replicate" else None)
        else:
            getattr(self, f"set_{site.kind}")(site, form, axis, forced)

    # ------------------------------------------------------------------ placements
    def tie_embeddings(self, forced_keys: set[str]) -> None:
        """An embedding and the LM head it is tied to take one placement: vocab-parallel both, or
        replicated both. The side an override forced (or, by default, the one that cannot shard)
        decides, and the plan notes it."""
        from autopar.estimate import _params
        for emb in self.ctx.of_kind("embedding"):
            for loss in self.ctx.of_kind("loss"):
                if not (_params(emb) & _params(loss)):
                    continue
                e, l_ = self.emb.get(emb.key, ("replicate", None)), self.site_form.get(loss.key, ("replicate", None))
                if (e[0] == "vocab") == (l_[0] == "vocab") and e[1] == l_[1]:
                    continue
                if emb.key in forced_keys and loss.key in forced_keys:
                    raise ValueError(
                        f"embedding {emb.key} ({e[0]}) and loss {loss.key} ({l_[0]}) share a tied weight, which has one "
                        "placement: force both 'vocab' (on one axis) or both 'replicate'")
                if emb.key in forced_keys:
                    leader = e
                elif loss.key in forced_keys:
                    leader = l_
                else:
                    leader = ("replicate", None)  # heuristics disagree: the weight stays replicated
                vocab = leader[0] == "vocab"
                self.set_embedding(emb, "vocab" if vocab else "replicate", leader[1], True)
                self.set_loss(loss, "vocab" if vocab else "replicate", leader[1], True)
                self.notes.append(f"embedding {emb.key} and loss {loss.key} share a tied weight: both "
                                  f"{'vocab@' + str(leader[1]) if vocab else 'replicate'}")

    def placements(self) -> dict[str, list[Placement]]:
        ctx, mesh = self.ctx, self.mesh
        pls: dict[str, list[Placement]] = {p: [R] * len(mesh.sizes) for p in ctx.captured.param_fqns}
        owner: dict[tuple[str, int], str] = {}

        def assign(placeholder: str, axis: str, p: Placement, who: str) -> None:
            ax = mesh.names.index(axis)
            old = pls[placeholder][ax]
            if old != R and old != p:
                raise ValueError(
                    f"parameter {ctx.captured.param_fqns[placeholder]} would need two placements on axis "
                    f"{axis!r}: {old} for {owner[(placeholder, ax)]} and {p} for {who} (tied weights?). "
                    "Fix: give both structures compatible forms through overrides, e.g. the embedding "
                    "'vocab' with the LM head 'colwise', or both 'replicate'.")
            pls[placeholder][ax] = p
            owner[(placeholder, ax)] = who

        for site in ctx.of_kind("linear"):
            form, axis = self.linear.get(site.key, ("replicate", None))
            if form == "replicate":
                continue
            for ph, p in linear_form.linear_placements(site, form, 0, 1, mesh.axis(axis).size).items():
                if p != R:
                    assign(ph, axis, p, f"linear {site.key} ({form})")
        for site in ctx.of_kind("embedding"):
            form, axis = self.emb.get(site.key, ("replicate", None))
            w = site.params["weight"]
            if form == "vocab":
                assign(w, axis, Shard(0), f"embedding {site.key} (vocab)")
        for site in ctx.of_kind("moe"):
            form, axis = self.site_form.get(site.key, ("replicate", None))
            if form == "tp":  # each expert's FFN features split over the axis (Megatron within every expert)
                from autopar.runtime.moe import spec_of
                for (d, k), ph in zip(spec_of(site.info["key"]).ffn_dims, site.params.values()):
                    assign(ph, axis, Shard(d) if k == 1 else _StridedShard(d, split_factor=k), f"moe {site.key} (tp)")
                continue
            if form != "expert":
                continue
            per_rank = site.info["num_experts"] // mesh.axis(axis).size
            for role, ph in site.params.items():
                if site.info["stacked"]:  # (E, ...) weights: this rank's experts are a dim-0 shard
                    assign(ph, axis, Shard(0), f"moe {site.key} (expert)")
                else:  # ModuleList: expert i's weights live whole on the rank that owns it
                    assign(ph, axis, Owned(int(role.split(".")[0]) // per_rank), f"moe {site.key} (expert)")
        return pls

    def strategies(self, pls) -> list[Strategy]:
        fqns = self.ctx.captured.param_fqns
        covered = set()
        out = []
        for site in self.ctx.sites:
            if site.kind == "linear":
                continue
            form, axis = self.site_form.get(site.key, ("replicate", None))
            members = site.members()
            own = dict(site.params)
            for m in members:
                covered.add(m.key)
                own.update({f"{m.key}.{r}": p for r, p in m.params.items()})
            params = tuple((fqns[p], fmt_placements(pls[p])) for p in dict.fromkeys(own.values()))
            out.append(Strategy(key=site.key, kind=site.kind, form=form, axis=axis, params=params,
                                members=tuple(m.key for m in members)))
        for site in self.ctx.of_kind("linear"):
            if site.key in covered:
                continue
            form, axis = self.linear.get(site.key, ("replicate", None))
            params = tuple((fqns[p], fmt_placements(pls[p])) for p in site.params.values())
            out.append(Strategy(key=site.key, kind="linear", form=form, axis=axis, params=params))
        return out


PLANS = ("auto", "megatron", "dp", "fsdp")


def _shard_parameters(ctx: PassContext, mesh: MeshInfo, pls, axes: list[str], notes: list[str],
                      only: set[str] | None = None) -> set[str]:
    """FSDP: shard each parameter over the data axes on a dim tensor parallelism leaves whole (dim 0 if
    it can, else dim 1); returns the placeholders sharded."""
    size = 1
    for n in axes:
        size *= mesh.axis(n).size
    done = set()
    for ph, fqn in ctx.captured.param_fqns.items():
        if only is not None and ph not in only:
            continue
        nodes = ctx.captured.gm.graph.find_nodes(op="placeholder", target=ph)
        shape = tuple(nodes[0].meta["val"].shape) if nodes else ()
        taken = {p.dim for p in pls[ph] if getattr(p, "dim", None) is not None}
        dim = next((d for d in range(min(2, len(shape))) if d not in taken and shape[d] % size == 0), None)
        if dim is None:
            notes.append(f"parameter {fqn} {shape} is not FSDP-sharded: no dim divides over {size} ranks")
            continue
        for n in axes:
            pls[ph][mesh.names.index(n)] = Shard(dim)
        done.add(ph)
    return done


def _parse_form(value: str, mesh: MeshInfo, default_axis: str) -> tuple[str, str]:
    if not isinstance(value, str):
        raise ValueError(f"override values are form names like 'colwise' or 'colwise@tp', got {value!r}")
    form, _, axis = value.partition("@")
    axis = axis or default_axis
    mesh.axis(axis)  # validates
    return form, axis


def _match(ctx: PassContext, key: str) -> list[Site]:
    if key in KIND_FORMS:
        return [s for s in ctx.sites if s.kind == key]
    return [s for s in ctx.sites if fnmatch.fnmatchcase(s.key, key)]


def build_plan(ctx: PassContext, mesh: MeshInfo, name: str, overrides: dict | None,
               input_batch: dict[str, int], *, cluster=None, memory_limit: float | None = None,
               optimizer: str = "adam", input_shapes: dict[str, tuple] | None = None) -> Plan:
    """The plan `name` for the recognised sites, with overrides applied and its cost estimated.

    "auto" asks the ILP (`autopar.solver`); the hand plans are built by the rules in this module's
    docstring and then priced by the same cost model, so they can be compared (and may not fit).
    """
    from autopar import solver as ilp
    from autopar.estimate import Candidate
    from cost_model.hardware import load_cluster

    input_shapes = input_shapes or {}

    if name not in PLANS:
        raise ValueError(f"plan must be one of {', '.join(map(repr, PLANS))}, a Plan or a path to a saved plan; "
                         f"got {name!r}")
    clus = load_cluster(cluster, mesh.sizes)
    tp = mesh.names[-1]
    planner = _Planner(ctx, mesh)
    parsed = _parse_overrides(ctx, mesh, overrides, tp)
    fsdp_sites: set[str] = set()
    solution = None
    if name == "auto":
        forced = {s.key: Candidate(form=form, axis=axis) for s, form, axis in parsed if s.kind != "linear"}
        check = _Planner(ctx, mesh)
        for site, form, axis in parsed:  # a forced form whose precondition fails raises here, saying why
            check.set_form(site, form, axis, True)
        model_axes = {c.axis for c in forced.values() if c.axis and c.form != "expert"}
        options = [tuple(c) for r in range(len(mesh.names) + 1) for c in itertools.combinations(mesh.names, r)
                   if not model_axes & set(c)]
        batch = max(input_batch.values(), default=0)
        solution = ilp.solve(ctx, mesh, clus, memory_limit=memory_limit, forced=forced, optimizer=optimizer,
                             data_axes_options=options, batch=batch)
        for site in ilp.sites_for_planning(ctx):
            cand = solution.choices[site.key]
            planner.set_form(site, cand.form, cand.axis, True)
            if cand.fsdp:
                fsdp_sites.add(site.key)
        dp_axes = list(solution.data_axes)
        for site, form, axis in parsed:
            if site.kind == "linear":
                planner.set_form(site, form, axis, True)
        planner.tie_embeddings(set())
    else:
        tp_on = name == "megatron" and mesh.sizes[-1] > 1
        dp_axes = [n for n, s in zip(mesh.names, mesh.sizes) if name in ("dp", "fsdp") or n != tp]
        for site in ctx.sites:
            if site.kind == "attention":
                planner.set_attention(site, "heads" if tp_on else "replicate", tp, False)
        for site in ctx.sites:
            if site.kind == "mlp":
                planner.set_mlp(site, "tp" if tp_on else "replicate", tp, False)
            elif site.kind == "loss":
                planner.set_loss(site, "vocab" if tp_on and site.info["vocab"] else "replicate", tp, False)
        for site in ctx.of_kind("embedding"):
            planner.set_embedding(site, "vocab" if tp_on else "replicate", tp, False)
        for site, form, axis in parsed:
            planner.set_form(site, form, axis, True)
        planner.tie_embeddings({s.key for s, _, _ in parsed})
        # an expert axis stays a data axis: tokens sharded there are dispatched by all-to-all (EP within DP)
        used = {a for f, a in planner.site_form.values() if a and f != "expert"} | \
            {a for f, a in planner.linear.values() if a}
        dp_axes = [a for a in dp_axes if a not in used]
        if name == "fsdp":
            fsdp_sites = {s.key for s in ctx.sites} | {"(other)"}
    pls = planner.placements()
    if fsdp_sites:
        from autopar.estimate import _params
        owned = {p for s in ctx.sites for p in _params(s)}
        phs = {p for s in ctx.sites if s.key in fsdp_sites for p in _params(s)}
        if "(other)" in fsdp_sites:
            phs |= set(ctx.captured.param_fqns) - owned
        _shard_parameters(ctx, mesh, pls, dp_axes, planner.notes, only=phs)
    strategies = planner.strategies(pls)
    fqn_pls = {fqn: fmt_placements(pls[ph]) for ph, fqn in ctx.captured.param_fqns.items()}
    inputs = {}
    dp_size = 1
    for n in dp_axes:
        dp_size *= mesh.axis(n).size
    seq_axes = sorted({a for k, (f, a) in planner.site_form.items() if f in ("ulysses", "ring")})
    seq_len = next((s.info["seq_len"] for s in ctx.of_kind("attention") if planner.site_form.get(s.key, ("",))[0]
                    in ("ulysses", "ring")), None)
    for ph, batch in input_batch.items():
        p = [R] * len(mesh.sizes)
        if batch and batch % dp_size == 0 and dp_size > 1:
            for n in dp_axes:
                p[mesh.names.index(n)] = Shard(0)
        elif dp_size > 1 and batch:
            planner.notes.append(f"input {ph} replicated: batch {batch} does not divide over {dp_size} data-parallel ranks")
        dims = input_shapes.get(ph) or ()
        if seq_axes and len(dims) >= 2 and dims[1] == seq_len:
            for n in seq_axes:  # Ulysses: every token-indexed input is split on the sequence
                p[mesh.names.index(n)] = Shard(1)
        inputs[ph] = fmt_placements(p)
    if solution is None:
        choices = {}
        for s in ilp.sites_for_planning(ctx):
            form, axis = (planner.linear.get(s.key, ("replicate", None)) if s.kind == "linear"
                          else planner.site_form.get(s.key, ("replicate", None)))
            if s.kind == "linear":
                form, axis = "replicate", None  # lone linears are priced replicated
            choices[s.key] = Candidate(form=form, axis=axis, fsdp=s.key in fsdp_sites)
        batched = any(set(placements_from_str(p)) & {Shard(0)} for p in inputs.values())
        solution = ilp.evaluate(ctx, mesh, clus, choices, tuple(dp_axes) if batched else (), optimizer,
                                tuple(seq_axes), other_fsdp="(other)" in fsdp_sites)
    limit = memory_limit if memory_limit is not None else clus.device_memory_bytes
    solver_note = ""
    if name == "auto":
        solver_note = (f"ILP {solution.status}, gap {solution.gap:.2%}, {solution.classes} site classes, "
                       f"data axes {solution.data_axes or '()'}, solved in {solution.solve_s:.2f} s")
    per_site = tuple((k, c.time_s, int(c.memory_bytes)) for k, c in solution.per_site.items())
    from autopar.plan import Estimate
    est = Estimate(step_time_s=solution.time_s, compute_time_s=solution.compute_s, comm_time_s=solution.comm_s,
                   memory_bytes_per_device=int(solution.memory_bytes), comm_bytes_per_step=int(solution.comm_bytes),
                   fits=solution.memory_bytes <= limit, memory_limit_bytes=int(limit), cluster=clus.name,
                   per_site=per_site, solver=solver_note)
    return Plan(name=name, mesh=tuple(zip(mesh.names, mesh.sizes)), strategies=tuple(strategies),
                params=tuple(fqn_pls.items()), inputs=tuple(inputs.items()), notes=tuple(planner.notes),
                estimate=est)


def _parse_overrides(ctx: PassContext, mesh: MeshInfo, overrides: dict | None, tp: str):
    """[(site, form, axis)] for every site an override names, validated."""
    out = []
    for key, value in (overrides or {}).items():
        kind_key = key if key in KIND_FORMS else None
        sites = _match(ctx, key)
        form, axis = _parse_form(value, mesh, tp)
        if kind_key and form not in KIND_FORMS[kind_key]:
            raise ValueError(f"override {key!r}: unknown form {form!r}; valid forms for {kind_key}: "
                             f"{', '.join(KIND_FORMS[kind_key])}")
        if kind_key and (kind_key, form) in NOT_YET:
            raise NotImplementedError(f"override {key!r}: form {form!r} is not implemented yet "
                                      f"({NOT_YET[(kind_key, form)]})")
        if not sites:
            found = sorted({s.key for s in ctx.sites})
            why = [n for n in ctx.captured.notes if n.startswith("MoE ") and "left as written" in n]
            raise ValueError(f"override {key!r} matches no recognised structure; keys are a kind "
                             f"({', '.join(KIND_FORMS)}) or a module-path glob over: {', '.join(found) or '(none)'}"
                             + (f". MoE blocks found but not recognised: {'; '.join(why)}" if why else ""))
        for s in sites:
            if form not in KIND_FORMS[s.kind]:
                raise ValueError(f"override {key!r}: {s.kind} {s.key} has no form {form!r}; valid: "
                                 f"{', '.join(KIND_FORMS[s.kind])}")
            if (s.kind, form) in NOT_YET:
                raise NotImplementedError(f"override {key!r}: form {form!r} is not implemented yet "
                                          f"({NOT_YET[(s.kind, form)]})")
            out.append((s, form, None if form == "replicate" else axis))
    return out
