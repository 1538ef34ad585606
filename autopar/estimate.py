"""Per-site cost tables: what each candidate form costs in time and memory, per device.

A *site* is a recognised structure (attention, MLP, embedding, loss; a lone linear). For each
site and each candidate it may take — a form on a model axis (or replicated), with or without
FSDP sharding of its parameters over the data axes — `site_costs` returns:

- compute time: 3x the forward FLOPs of its nodes (forward + backward), divided by the data-
  parallel degree (the batch is split) and by t on the form's axis (the work is split), roofline
  against the cluster (`cost_model.analytical.compute_time_s`);
- communication time (alpha-beta per mesh axis, `cost_model.analytical.collective_time_s`):
  the form's collectives (DESIGN.md §3) on its axis — heads/tp: one all-reduce of the block's
  output forward and one of its input gradient backward; vocab embedding: one forward
  all-reduce; vocab loss: the LM head input's gradient all-reduce, 3 all-reduces of b·s fp32, and
  an all-gather of the logits when the model returns them — plus the data-parallel gradient
  reduction of its (local) parameters on every data axis (all-reduce, or all-gather + reduce-
  scatter under FSDP: the same bytes);
- memory: parameters, gradients and optimizer state (Adam: 2 fp32 states) of its local parameter
  shard (divided by the data-parallel degree under FSDP), plus the activations its nodes save for
  backward: the outputs of its nodes, divided by the data-parallel degree, and by t for the
  nodes inside a sharded form (the block's replicated input is not divided by t).

Nodes outside every site ("other": norms, residuals, masks) are data-parallel only.
Estimates ignore compute/communication overlap (the step time is their sum).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
from torch import fx

from cost_model.analytical import collective_time_s, compute_time_s, node_cost
from cost_model.hardware import Cluster, axis_link
from passes.context import PassContext, Site

OPTIMIZER_STATES = {"adam": 2, "adamw": 2, "sgd": 0, "sgd_momentum": 1}


@dataclass(frozen=True, kw_only=True)
class Candidate:
    form: str  # replicate | heads | tp | vocab
    axis: str | None
    fsdp: bool = False

    @property
    def label(self) -> str:
        s = self.form + (f"@{self.axis}" if self.axis else "")
        return s + ("+fsdp" if self.fsdp else "")


@dataclass(frozen=True, kw_only=True)
class Cost:
    compute_s: float
    comm_s: float
    comm_bytes: float
    memory_bytes: float

    @property
    def time_s(self) -> float:
        return self.compute_s + self.comm_s


@dataclass
class SiteStats:
    """Shape facts about one site, gathered once from the graph."""

    flops: float = 0.0  # forward
    compute_dtype: str = "float32"
    act_bytes: float = 0.0  # outputs of its nodes (saved for backward), global
    io_bytes: float = 0.0  # the block's input activation, global
    param_bytes: float = 0.0
    param_numel: int = 0
    param_dim0: list[int] = field(default_factory=list)
    logits_bytes: float = 0.0  # loss: logits, global
    logits_out: bool = False  # loss: the model also returns its logits
    tokens: int = 0


def _bytes(v) -> float:
    if isinstance(v, torch.Tensor):
        return v.numel() * v.element_size()
    if isinstance(v, (list, tuple)):
        return sum(_bytes(x) for x in v)
    return 0.0


def site_nodes(site: Site) -> list[fx.Node]:
    return list(dict.fromkeys([site.node] + [m.node for m in site.members()]))


def _params(site: Site) -> set[str]:
    return site.all_params()


def _between(site: Site) -> list[fx.Node]:
    """Nodes inside a block: reachable from its first layers' outputs and reaching its last layers."""
    if site.kind == "attention":
        starts = [s.node for s in site.info["q"] + site.info["k"] + site.info["v"]]
        ends = [s.node for s in site.info["out"]]
    elif site.kind == "mlp":
        starts = [s.node for s in site.info["col"]]
        ends = [s.node for s in site.info["row"]]
    else:
        return site_nodes(site)
    fwd, stack = set(), list(starts)
    while stack:
        n = stack.pop()
        if n in fwd:
            continue
        fwd.add(n)
        if n not in ends:
            stack.extend(n.users)
    back, stack = set(), list(ends)
    while stack:
        n = stack.pop()
        if n in back:
            continue
        back.add(n)
        if n not in starts:
            stack.extend(n.all_input_nodes)
    return [n for n in fwd & back]


def gather_stats(ctx: PassContext) -> tuple[dict[str, SiteStats], SiteStats, set[str]]:
    """Stats per composite site (by key), stats of everything else, and the params sites own."""
    gm = ctx.captured.gm
    ph = {n.name: n for n in gm.graph.nodes if n.op == "placeholder"}
    stats: dict[str, SiteStats] = {}
    covered_nodes: set[fx.Node] = set()
    owned: set[str] = set()
    sites = [s for s in ctx.sites if s.kind != "linear"]
    covered_linears = {m.key for s in sites for m in s.members()}
    sites += [s for s in ctx.of_kind("linear") if s.key not in covered_linears]
    outputs = set(gm.graph.output_node().all_input_nodes)
    for site in sites:
        st = SiteStats()
        nodes = _between(site) + site_nodes(site)
        nodes = list(dict.fromkeys(nodes))
        for n in nodes:
            if n in covered_nodes:
                continue
            covered_nodes.add(n)
            c = node_cost(n)
            st.flops += c.flops
            if c.flops:
                st.compute_dtype = c.dtype
            st.act_bytes += _bytes(n.meta.get("val"))
        first = site_nodes(site)[1] if len(site_nodes(site)) > 1 else site.node
        x = first.args[1] if first.target is torch.ops.aten.addmm.default else first.args[0]
        st.io_bytes = _bytes(x.meta.get("val")) if isinstance(x, fx.Node) else 0.0
        for p in _params(site):
            owned.add(p)
            v = ph[p].meta["val"]
            st.param_bytes += _bytes(v)
            st.param_numel += v.numel()
            st.param_dim0.append(int(v.shape[0]) if v.dim() else 1)
        if site.kind == "loss" and site.info.get("head"):
            logits = site.info["head"][0].node
            st.logits_bytes = _bytes(logits.meta.get("val"))
            st.logits_out = _reaches_output(logits, outputs)
            st.tokens = int(site.node.args[1].meta["val"].numel())
        stats[site.key] = st
    other = SiteStats()
    for n in gm.graph.nodes:
        if n.op == "call_function" and n not in covered_nodes:
            c = node_cost(n)
            other.flops += c.flops
            other.act_bytes += _bytes(n.meta.get("val"))
    for name, fqn in ctx.captured.param_fqns.items():
        if name not in owned:
            v = ph[name].meta["val"]
            other.param_bytes += _bytes(v)
            other.param_numel += v.numel()
            other.param_dim0.append(int(v.shape[0]) if v.dim() else 1)
    return stats, other, owned


def _reaches_output(node: fx.Node, outputs: set[fx.Node]) -> bool:
    from passes.context import TRANSPARENT
    stack, seen = [node], set()
    while stack:
        n = stack.pop()
        if n in seen:
            continue
        seen.add(n)
        if n in outputs:
            return True
        stack.extend(u for u in n.users if u.op == "call_function" and u.target in TRANSPARENT)
    return False


@dataclass(frozen=True, kw_only=True)
class MeshCosting:
    names: tuple[str, ...]
    sizes: tuple[int, ...]
    data_axes: tuple[str, ...]
    cluster: Cluster
    optimizer: str = "adam"
    seq_axes: tuple[str, ...] = ()  # axes the sequence is split over (Ulysses / ring attention)

    @property
    def dp(self) -> int:
        """Ranks the tokens of a step are split over: the batch on data axes, the sequence on sequence axes."""
        return math.prod(self.sizes[self.names.index(a)] for a in self.data_axes + self.seq_axes)

    def size(self, axis: str) -> int:
        return self.sizes[self.names.index(axis)]

    def link(self, axis: str):
        return axis_link(self.cluster, self.sizes, self.names.index(axis))

    def allreduce_s(self, nbytes: float, axis: str) -> float:
        return collective_time_s("all_reduce", int(nbytes), self.size(axis), self.link(axis))

    def grad_sync(self, local_param_bytes: float) -> tuple[float, float]:
        """(time, bytes sent) of reducing gradients of local parameters over every data axis."""
        t = b = 0.0
        for a in self.data_axes + self.seq_axes:
            p = self.size(a)
            t += self.allreduce_s(local_param_bytes, a)
            b += 2 * (p - 1) / p * local_param_bytes
        return t, b

    def state_factor(self) -> float:
        """Parameter + gradient + optimizer states, in multiples of the parameter bytes (fp32 states)."""
        return 2 + OPTIMIZER_STATES[self.optimizer] * 1.0


def moe_cost(site: Site, st: SiteStats, cand: Candidate, mc: MeshCosting) -> Cost:
    """An MoE block: router + experts (+ aux loss in `st`), replicated or expert-parallel on `cand.axis`.

    Expert work per token is 2 FLOPs per expert weight element for each of its k experts; routing is
    assumed balanced. On a data axis (tokens sharded there) EP moves each token's k rows out and back
    by all-to-all, forward and backward: 4 all-to-alls of k*T*h*(ep-1)/ep (DESIGN.md §3). On a model
    axis (tokens replicated) each rank runs its experts on every token and the output is all-reduced
    (forward) and so is the input's gradient (backward); tensor-parallel experts (`tp`) cost the same
    way, each rank running 1/t of every expert's features."""
    info = site.info
    T, H, k, E = info["tokens"], info["hidden"], info["top_k"], info["num_experts"]
    item = info.get("itemsize", 4)
    per_expert = info["expert_numel"] / E
    ffn = per_expert / (3 * H)  # a gated MLP expert holds 3*H*F weights
    dp = mc.dp
    ep = mc.size(cand.axis) if cand.form in ("expert", "tp") else 1  # experts (or their features) split ep ways
    on_data = cand.form == "expert" and cand.axis in mc.data_axes + mc.seq_axes  # tokens sharded there
    tokens = T / dp  # this rank's tokens
    work = 2 * T * k * per_expert / dp / (1 if on_data else ep)
    dtype = info.get("dtype", st.compute_dtype)
    dtype = dtype if dtype in mc.cluster.peak_flops else "float32"
    routed_bytes = T / dp * k * (2 * H + 3 * ffn) * item / (1 if on_data else ep)  # expert activations saved
    compute = compute_time_s(3 * (st.flops / dp + work), 3 * (st.act_bytes / dp + routed_bytes), dtype, mc.cluster)
    comm_s = comm_b = 0.0
    if cand.form == "expert" and on_data:
        link = mc.link(cand.axis)
        rows = tokens * k * H * item
        for _ in range(4):
            comm_s += collective_time_s("all_to_all", int(rows), ep, link)
            comm_b += (ep - 1) / ep * rows
    elif cand.form in ("expert", "tp"):  # every token on every rank: partial outputs all-reduced, and input grads
        for _ in range(2):
            comm_s += mc.allreduce_s(tokens * H * item, cand.axis)
            comm_b += 2 * (ep - 1) / ep * tokens * H * item
    expert_bytes = info["expert_numel"] * item
    dense_bytes = max(st.param_bytes - expert_bytes, 0.0)
    local = dense_bytes + expert_bytes / ep
    gs_t, gs_b = MeshCosting(names=mc.names, sizes=mc.sizes, cluster=mc.cluster, optimizer=mc.optimizer,
                             data_axes=tuple(a for a in mc.data_axes if a != cand.axis),
                             seq_axes=tuple(a for a in mc.seq_axes if a != cand.axis)).grad_sync(expert_bytes / ep)
    d_t, d_b = mc.grad_sync(dense_bytes)
    state = local * mc.state_factor() / (dp if cand.fsdp else 1) + (local if cand.fsdp else 0.0)
    return Cost(compute_s=compute, comm_s=comm_s + gs_t + d_t, comm_bytes=comm_b + gs_b + d_b,
                memory_bytes=state + st.act_bytes / dp + routed_bytes)


def site_cost(site: Site, st: SiteStats, cand: Candidate, mc: MeshCosting) -> Cost:
    if site.kind == "moe":
        return moe_cost(site, st, cand, mc)
    dp = mc.dp
    # work split over a model axis (heads/tp/vocab; a sequence-parallel norm runs on s/t tokens);
    # Ulysses / ring split over a sequence axis, already in dp
    sharded = cand.form in ("heads", "tp", "vocab", "sequence")
    t = mc.size(cand.axis) if sharded else 1
    cluster = mc.cluster
    dtype = st.compute_dtype if st.compute_dtype in cluster.peak_flops else "float32"
    flops = 3 * st.flops / dp / (t if sharded else 1)
    compute = compute_time_s(flops, 3 * st.act_bytes / dp / (t if sharded else 1), dtype, cluster)
    comm_s = comm_b = 0.0

    def ar(nbytes: float) -> None:
        nonlocal comm_s, comm_b
        comm_s += mc.allreduce_s(nbytes, cand.axis)
        comm_b += 2 * (t - 1) / t * nbytes

    act = st.act_bytes / dp
    if sharded:
        if site.kind in ("attention", "mlp"):
            ar(st.io_bytes / dp)  # forward: the row-parallel output
            ar(st.io_bytes / dp)  # backward: the column-parallel input's gradient
            act = st.io_bytes / dp + (st.act_bytes - st.io_bytes) / dp / t
        elif site.kind == "embedding":
            ar(st.act_bytes / dp)
            act = st.act_bytes / dp
        elif site.kind == "loss":
            ar(st.io_bytes / dp)
            for _ in range(3):
                ar(st.tokens / dp * 4)
            if st.logits_out:
                nbytes = st.logits_bytes / dp
                comm_s += collective_time_s("all_gather", int(nbytes), t, mc.link(cand.axis))
                comm_b += (t - 1) / t * nbytes
            act = st.io_bytes / dp + (st.act_bytes - st.io_bytes) / dp / t
    if cand.form in ("ulysses", "ring"):
        u, link = mc.size(cand.axis), mc.link(cand.axis)
        kv = site.info["kv_heads"] / site.info["heads"]
        m = st.io_bytes / dp  # one (b, s/u, h) buffer on this rank
        if cand.form == "ulysses":  # q, k, v seq->heads and o heads->seq, forward and backward
            for nbytes in (m, m * kv, m * kv, m) * 2:
                comm_s += collective_time_s("all_to_all", int(nbytes), u, link)
                comm_b += (u - 1) / u * nbytes
        else:  # ring: p-1 K/V steps forward; K/V and dK/dV (accumulated in fp32) backward
            block = 2 * m * kv
            for nbytes in [block] * (u - 1) + [block, 2 * block] * (u - 1):
                comm_s += collective_time_s("p2p", int(nbytes), u, link)
                comm_b += nbytes
            act += 2 * block  # K/V double buffer
    if cand.form == "sequence":  # norm weights stay replicated; their partial gradients are summed over t
        ar(st.param_bytes)
        act = st.act_bytes / dp / t  # the norm and its residual stream hold s/t tokens
    local_params = st.param_bytes / (t if sharded and cand.form != "sequence" else 1)
    gs_t, gs_b = mc.grad_sync(local_params)
    comm_s, comm_b = comm_s + gs_t, comm_b + gs_b
    state = local_params * mc.state_factor() / (dp if cand.fsdp else 1)
    if cand.fsdp:
        state += local_params  # the gathered parameters live from forward to backward
    return Cost(compute_s=compute, comm_s=comm_s, comm_bytes=comm_b, memory_bytes=state + act)


def other_cost(st: SiteStats, mc: MeshCosting) -> Cost:
    dtype = "float32" if "float32" in mc.cluster.peak_flops else next(iter(mc.cluster.peak_flops))
    compute = compute_time_s(3 * st.flops / mc.dp, 3 * st.act_bytes / mc.dp, dtype, mc.cluster)
    gs_t, gs_b = mc.grad_sync(st.param_bytes)
    return Cost(compute_s=compute, comm_s=gs_t, comm_bytes=gs_b,
                memory_bytes=st.param_bytes * mc.state_factor() + st.act_bytes / mc.dp)
