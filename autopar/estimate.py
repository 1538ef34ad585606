"""Per-site cost tables: what each candidate form costs in time and memory, per device.

A *site* is a recognised structure (attention, MLP, embedding, loss; a lone linear). For each
site and each candidate it may take — a form on a model axis (or replicated), with or without
FSDP sharding of its parameters over the data axes — `site_cost` returns:

- compute time (`_compute_s`): forward + backward = 3x the forward work of its nodes, divided by
  the data-parallel degree (the batch is split) and by t on the form's axis (the work is split).
  With a profiled cluster (per-op-kind rates) each kind of op is priced at its rate, a matmul at
  the rate of its split size, and every op pays the dispatch overhead, which no split divides
  (`cost_model.analytical.kernel_time_s`);
  with a preset, the roofline of the site's FLOPs and activation bytes (`compute_time_s`);
- communication time (`cost_model.analytical.collective_time_s`: a profile's measured table, or
  alpha-beta) of the form's collectives (DESIGN.md §3) on its axis — heads/tp: one all-reduce of
  the block's input-sized output forward and one of its input gradient backward; vocab
  embedding: one forward all-reduce; vocab loss: the LM head input's gradient all-reduce, 3
  all-reduces of b·s fp32, and an all-gather of the logits when the model returns them — plus the
  gradient reduction of its parameters on every data (and sequence) axis, priced as the runtime
  issues it (`passes.lower._bucket_parameter_gradients`, `MeshCosting`):
  - data parallel: one bucketed all-reduce per axis and parameter dtype for the whole model. Each
    site pays its bytes at the bucket's per-byte rate (`MeshCosting.grad_sync`); the bucket's
    fixed cost is paid once, by "other" (`MeshCosting.bucket_fixed_s`). The rate is the chord of
    the all-reduce time between an empty bucket and one of all parameters' gradients, so the sum
    over sites is one collective of the whole bucket (exact for alpha-beta links), plus the copy of
    the gradients into the bucket's flat buffer;
  - FSDP: per parameter, an all-gather forward and a reduce-scatter of its gradient backward on
    each data axis (`MeshCosting.fsdp_sync`);
  - parameters used only by batch-independent ops (a position embedding) have their gradient
    reduced where their output meets the batch: one all-reduce of that activation per axis
    ("other", `SiteStats.boundary_grad_bytes`), outside the bucket;
  - the loss, with the batch split: the loss value, and the valid-token count of a mean, are
    all-reduced (scalars) on every data axis;
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

from cost_model.analytical import collective_time_s, compute_time_s, has_kernel_rates, kernel_time_s, node_cost
from cost_model.hardware import Cluster, axis_link
from passes.context import TRANSPARENT, PassContext, Site

OPTIMIZER_STATES = {"adam": 2, "adamw": 2, "sgd": 0, "sgd_momentum": 1}
# Passes over the local logits (N, V/t), in units of their fp32 bytes, that the vocab-parallel cross-entropy of
# autopar.runtime.ops (_VocabParallelCrossEntropy) makes forward and backward: amax 1, subtract the max 2, exp 2,
# sum 1, normalise in place 2; backward: scale by the incoming gradient 2, zeros for the one-hot 1, the one-hot
# term 2, the difference 3. (aten's fused cross_entropy_loss moves about 9 of the full logits: node_cost.)
VOCAB_CE_PASSES = 16


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
    param_sizes: list[float] = field(default_factory=list)  # bytes of each parameter (FSDP gathers each)
    synced_param_sizes: list[float] = field(default_factory=list)  # those whose own gradient is reduced
    # (op kind, dtype, flops per call of a matmul else 0) -> [flops, bytes, ops], forward
    work: dict[tuple[str, str, int], list[float]] = field(default_factory=dict)
    boundary_grad_bytes: list[float] = field(default_factory=list)  # other: activations whose gradient is reduced
    summed_into: str | None = None  # embedding: the earlier embedding its output is added to (one reduction)
    loss_reductions: int = 0  # loss: scalars all-reduced per data axis (the loss; the count of a mean)
    vocab_ce_extra_bytes: float = 0.0  # loss: what the vocab-parallel cross-entropy moves beyond its node's 3x
    logits_bytes: float = 0.0  # loss: logits, global
    logits_out: bool = False  # loss: the model also returns its logits
    tokens: int = 0

    def add_node(self, n: fx.Node) -> None:
        c = node_cost(n)
        self.flops += c.flops
        if c.flops:
            self.compute_dtype = c.dtype
        self.act_bytes += _bytes(n.meta.get("val"))
        if c.kind != "view":
            w = self.work.setdefault((c.kind, c.dtype, c.flops if c.kind == "matmul" else 0), [0.0, 0.0, 0])
            w[0], w[1], w[2] = w[0] + c.flops, w[1] + c.bytes, w[2] + 1

    def add_param(self, v: torch.Tensor, synced: bool, *, counted: bool = True, used: bool = True) -> None:
        """A parameter of the site; `counted=False` for one another site already counts (a tied weight):
        it constrains the site's FSDP sharding but its bytes are synchronised and stored once. An unused
        placeholder (`used=False`: the other name of a tied weight) is stored but never communicated."""
        self.param_dim0.append(int(v.shape[0]) if v.dim() else 1)
        if not counted:
            return
        self.param_bytes += _bytes(v)
        self.param_numel += v.numel()
        if used:
            self.param_sizes.append(_bytes(v))
        if synced:
            self.synced_param_sizes.append(_bytes(v))

    @property
    def synced_param_bytes(self) -> float:
        """Parameters whose gradient joins the data-parallel bucket (not reduced at a batch boundary)."""
        return sum(self.synced_param_sizes)


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


def _block_input(site: Site) -> fx.Node | None:
    """The activation entering a block: the input of its first column layer (MLP), q projection
    (attention) or LM head (loss); else the site node's first argument."""
    first = next((site.info[role][0].node for role in ("col", "q", "head") if site.info.get(role)), site.node)
    x = first.args[1] if first.target is torch.ops.aten.addmm.default else first.args[0]
    return x if isinstance(x, fx.Node) else None


def _gradient_boundaries(gm: fx.GraphModule, user_inputs: set[str], params: set[str]) -> list[fx.Node]:
    """Values that depend on a parameter but not on the batch and are consumed by batch-dependent ops:
    with the batch split, the lowering reduces each one's (partial) gradient on the data axes there
    (`passes.lower`: an R input consumed into a sharded output). A parameter used directly by such an
    op is its own boundary (its gradient joins the bucket)."""
    batch, grad = set(), set()
    for n in gm.graph.nodes:
        if n.op == "placeholder" and n.name in user_inputs:
            batch.add(n)
        elif n.op == "placeholder" and n.name in params:
            grad.add(n)
        elif n.op == "call_function" and any(a in batch for a in n.all_input_nodes):
            batch.add(n)
        elif n.op == "call_function" and any(a in grad for a in n.all_input_nodes):
            grad.add(n)
    return [n for n in gm.graph.nodes if n in grad and any(u in batch for u in n.users)]


def _loss_reductions(site: Site) -> int:
    """Scalars a loss all-reduces per data axis with the batch split: its value, and for a mean cross-entropy
    the valid-token count (`autopar.runtime.ops.loss_reduce`); none for reduction='none'."""
    n, ce = site.node, site.info.get("loss") == "cross_entropy"
    i = 3 if ce else 2  # cross_entropy_loss(x, target, weight, reduction, ...); mse_loss(x, target, reduction)
    reduction = n.args[i] if len(n.args) > i else n.kwargs.get("reduction", 1)  # 0 none, 1 mean, 2 sum
    if reduction == 0:
        return 0
    return 2 if ce and reduction == 1 else 1


def summed_embeddings(ctx: PassContext) -> dict[str, str]:
    """Embedding key -> the earlier embedding whose output its output is added to (GPT's position embedding
    into the token embedding). Vocab-parallel, both outputs are partial and their sum is all-reduced once, so
    the later one's form costs no collective of its own when the earlier one is vocab-parallel on the same
    axis (the solver only lets it be vocab-parallel then)."""
    reached: dict[fx.Node, str] = {}
    out = {}
    for site in ctx.of_kind("embedding"):
        n = site.node
        while len(n.users) == 1 and next(iter(n.users)).target in TRANSPARENT:
            n = next(iter(n.users))
        adds = [u for u in n.users if u.target is torch.ops.aten.add.Tensor]
        for add in adds:
            if add in reached:
                out[site.key] = reached[add]
            else:
                reached[add] = site.key
    return out


def gather_stats(ctx: PassContext) -> tuple[dict[str, SiteStats], SiteStats, set[str]]:
    """Stats per composite site (by key), stats of everything else, and the params sites own."""
    gm = ctx.captured.gm
    ph = {n.name: n for n in gm.graph.nodes if n.op == "placeholder"}
    boundaries = _gradient_boundaries(gm, set(ctx.captured.user_inputs), set(ctx.captured.param_fqns))
    synced = {n.name for n in boundaries if n.op == "placeholder"}
    summed = summed_embeddings(ctx)
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
            st.add_node(n)
        x = _block_input(site)
        st.io_bytes = _bytes(x.meta.get("val")) if x is not None else 0.0
        for p in sorted(_params(site)):
            st.add_param(ph[p].meta["val"], p in synced, counted=p not in owned, used=bool(ph[p].users))
            owned.add(p)
        if site.kind == "embedding":
            st.summed_into = summed.get(site.key)
        if site.kind == "loss":
            st.loss_reductions = _loss_reductions(site)
            logits = site.node.args[0].meta.get("val")
            if isinstance(logits, torch.Tensor) and site.info.get("loss") == "cross_entropy":
                fp32 = logits.numel() * max(4, logits.element_size())  # the runtime computes in at least fp32
                st.vocab_ce_extra_bytes = max(0.0, VOCAB_CE_PASSES * fp32 - 3 * node_cost(site.node).bytes)
        if site.kind == "loss" and site.info.get("head"):
            logits = site.info["head"][0].node
            st.logits_bytes = _bytes(logits.meta.get("val"))
            st.logits_out = _reaches_output(logits, outputs)
            st.tokens = int(site.node.args[1].meta["val"].numel())
        stats[site.key] = st
    other = SiteStats()
    for n in gm.graph.nodes:
        if n.op == "call_function" and n not in covered_nodes:
            other.add_node(n)
    for name, fqn in ctx.captured.param_fqns.items():
        if name not in owned:
            other.add_param(ph[name].meta["val"], name in synced, used=bool(ph[name].users))
    other.boundary_grad_bytes = [_bytes(n.meta.get("val")) for n in boundaries if n.op != "placeholder"]
    return stats, other, owned


def _reaches_output(node: fx.Node, outputs: set[fx.Node]) -> bool:
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


def mesh_costing(ctx: PassContext, stats: dict[str, SiteStats], other: SiteStats, names, sizes, data_axes,
                 cluster: Cluster, *, optimizer: str = "adam", seq_axes=()) -> "MeshCosting":
    """A MeshCosting whose gradient bucket holds every parameter's gradient (one bucket per dtype)."""
    ph = {n.name: n for n in ctx.captured.gm.graph.nodes if n.op == "placeholder"}
    dtypes = {ph[p].meta["val"].dtype for p in ctx.captured.param_fqns}
    total = other.param_bytes + sum(st.param_bytes for st in stats.values())
    return MeshCosting(names=tuple(names), sizes=tuple(sizes), data_axes=tuple(data_axes), cluster=cluster,
                       optimizer=optimizer, seq_axes=tuple(seq_axes), bucket_bytes=total,
                       num_buckets=max(1, len(dtypes)))


@dataclass(frozen=True, kw_only=True)
class MeshCosting:
    names: tuple[str, ...]
    sizes: tuple[int, ...]
    data_axes: tuple[str, ...]
    cluster: Cluster
    optimizer: str = "adam"
    seq_axes: tuple[str, ...] = ()  # axes the sequence is split over (Ulysses / ring attention)
    bucket_bytes: float = 0.0  # gradient bytes of all parameters: the bucket whose per-byte rate sites pay
    num_buckets: int = 1  # parameter dtypes: one bucket per axis and dtype

    @property
    def dp(self) -> int:
        """Ranks the tokens of a step are split over: the batch on data axes, the sequence on sequence axes."""
        return math.prod(self.sizes[self.names.index(a)] for a in self.data_axes + self.seq_axes)

    def size(self, axis: str) -> int:
        return self.sizes[self.names.index(axis)]

    def link(self, axis: str):
        return axis_link(self.cluster, self.sizes, self.names.index(axis))

    def allreduce_s(self, nbytes: float, axis: str, interval_s: float | None = None) -> float:
        """An all-reduce on `axis`, after `interval_s` of compute when known (`collective_time_s`)."""
        return collective_time_s("all_reduce", int(nbytes), self.size(axis), self.link(axis), interval_s=interval_s)

    def _bucket_rate(self, axis: str) -> tuple[float, float]:
        """(fixed seconds, seconds per byte) of the gradient bucket's all-reduce on `axis`: the chord of its
        time between an empty bucket and a bucket of `bucket_bytes`."""
        fixed = self.allreduce_s(0, axis)
        if self.bucket_bytes <= 0:
            return fixed, 0.0
        return fixed, max(0.0, self.allreduce_s(self.bucket_bytes, axis) - fixed) / self.bucket_bytes

    def grad_sync(self, local_param_bytes: float, axes: tuple[str, ...] | None = None) -> tuple[float, float]:
        """(time, bytes sent) of this share of the data-parallel gradient bucket on every data and sequence
        axis (or `axes`): its bytes at the bucket's per-byte rate (the fixed cost is `bucket_fixed_s`, paid
        once), and their copy into the bucket's flat buffer (read + write, `grad_sync_bucket` concatenates)."""
        t = b = 0.0
        copy_bytes_per_s = self.cluster.copy_bytes_per_s or self.cluster.effective_memory_bytes_per_s
        for a in self.data_axes + self.seq_axes if axes is None else axes:
            p = self.size(a)
            if p == 1:
                continue
            t += self._bucket_rate(a)[1] * local_param_bytes + 2 * local_param_bytes / copy_bytes_per_s
            b += 2 * (p - 1) / p * local_param_bytes
        return t, b

    def bucket_fixed_s(self) -> float:
        """The fixed cost of the gradient buckets: one per data / sequence axis and parameter dtype."""
        return self.num_buckets * sum(self._bucket_rate(a)[0] for a in self.data_axes + self.seq_axes)

    def fsdp_sync(self, gathered: list[float], reduced: list[float], backward_s: float = 0.0) -> tuple[float, float]:
        """(time, bytes sent) of FSDP on the data axes, as `passes.lower` issues it: each parameter is
        all-gathered before use on every axis, innermost first (there the tensor is still divided by the
        outer axes), all at the start of the step, back to back. Each gradient reduced on its own
        (`reduced`; one reduced at a batch boundary is not) is reduce-scattered on the outermost axis (the
        gather and the reduction fuse there) and all-reduced, whole, on every other axis, as backward
        produces it (`backward_s` of the structure's backward shared between them). On sequence axes the
        gradients join the bucket."""
        t = b = 0.0
        axes = sorted(self.data_axes, key=self.names.index)
        for nbytes in gathered:
            for i, a in enumerate(axes):
                p = self.size(a)
                n = nbytes / math.prod(self.size(o) for o in axes[:i])  # the gathered tensor on this axis
                t += collective_time_s("all_gather", int(n), p, self.link(a), interval_s=0.0)
                b += (p - 1) / p * n
        for nbytes in reduced:
            for i, a in enumerate(axes):
                p = self.size(a)
                kind = "reduce_scatter" if i == 0 else "all_reduce"
                # backward reduces the innermost axis first (after the compute), the others back to back
                interval = backward_s / len(reduced) if i == len(axes) - 1 else 0.0
                t += collective_time_s(kind, int(nbytes), p, self.link(a), interval_s=interval)
                b += (p - 1) / p * nbytes * (1 if i == 0 else 2)
        t_seq, b_seq = self.grad_sync(sum(reduced), self.seq_axes)
        return t + t_seq, b + b_seq

    def scalar_reductions(self, count: int) -> tuple[float, float]:
        """(time, bytes sent) of `count` fp32 scalar all-reduces on every data and sequence axis."""
        t = b = 0.0
        for a in self.data_axes + self.seq_axes:
            p = self.size(a)
            t += count * self.allreduce_s(4, a)
            b += count * 2 * (p - 1) / p * 4
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
    compute = _compute_s(st, dp, mc.cluster) + compute_time_s(3 * work, 3 * routed_bytes, dtype, mc.cluster)
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
    gs_t, gs_b = mc.grad_sync(expert_bytes / ep, axes=tuple(a for a in mc.data_axes + mc.seq_axes if a != cand.axis))
    d_t, d_b = mc.grad_sync(dense_bytes)
    state = local * mc.state_factor() / (dp if cand.fsdp else 1) + (local if cand.fsdp else 0.0)
    return Cost(compute_s=compute, comm_s=comm_s + gs_t + d_t, comm_bytes=comm_b + gs_b + d_b,
                memory_bytes=state + st.act_bytes / dp + routed_bytes)


def _compute_s(st: SiteStats, divisor: float, cluster: Cluster) -> float:
    """Forward + backward (3x the forward work) of a site's nodes with the work split over `divisor` ranks:
    by op kind when the cluster measured kernel rates (every op runs on every rank: the dispatch overhead
    is not divided), else the roofline of all its FLOPs and activation bytes."""
    if has_kernel_rates(cluster):
        return sum(kernel_time_s(kind, 3 * flops / divisor, 3 * nbytes / divisor, _dtype(dtype, cluster), cluster,
                                 num_ops=3 * ops, flops_per_call=per_call / divisor if per_call else None)
                   for (kind, dtype, per_call), (flops, nbytes, ops) in st.work.items())
    return compute_time_s(3 * st.flops / divisor, 3 * st.act_bytes / divisor, _dtype(st.compute_dtype, cluster),
                          cluster)


def _dtype(dtype: str, cluster: Cluster) -> str:
    if dtype in cluster.peak_flops:
        return dtype
    return "float32" if "float32" in cluster.peak_flops else next(iter(cluster.peak_flops))


def site_cost(site: Site, st: SiteStats, cand: Candidate, mc: MeshCosting) -> Cost:
    if site.kind == "moe":
        return moe_cost(site, st, cand, mc)
    dp = mc.dp
    # work split over a model axis (heads/tp/vocab; a sequence-parallel norm runs on s/t tokens);
    # Ulysses / ring split over a sequence axis, already in dp
    sharded = cand.form in ("heads", "tp", "vocab", "sequence")
    t = mc.size(cand.axis) if sharded else 1
    compute = _compute_s(st, dp * t, mc.cluster)
    # compute before the site's collectives in its forward / backward pass (their synchronisation grows with it)
    fwd_s, bwd_s = compute / 3, 2 * compute / 3
    comm_s = comm_b = 0.0

    def ar(nbytes: float, interval_s: float | None = None) -> None:
        nonlocal comm_s, comm_b
        comm_s += mc.allreduce_s(nbytes, cand.axis, interval_s)
        comm_b += 2 * (t - 1) / t * nbytes

    act = st.act_bytes / dp
    if sharded:
        if site.kind in ("attention", "mlp"):
            ar(st.io_bytes / dp, fwd_s)  # forward: the row-parallel output
            ar(st.io_bytes / dp, bwd_s)  # backward: the column-parallel input's gradient
            act = st.io_bytes / dp + (st.act_bytes - st.io_bytes) / dp / t
        elif site.kind == "embedding":
            if st.summed_into is None:  # else reduced with the embedding it is added to
                ar(st.act_bytes / dp, fwd_s)
            act = st.act_bytes / dp
        elif site.kind == "loss":
            # the vocab-parallel cross-entropy runs more elementwise passes than the fused op it replaces
            compute += kernel_time_s("vector", 0, st.vocab_ce_extra_bytes / dp / t, "float32", mc.cluster) \
                if has_kernel_rates(mc.cluster) else compute_time_s(0, st.vocab_ce_extra_bytes / dp / t, "float32",
                                                                     mc.cluster)
            ar(st.io_bytes / dp, bwd_s)  # the LM head input's gradient
            for _ in range(3):  # max, target logit, sum of exps: they split the forward between them
                ar(st.tokens / dp * 4, fwd_s / 3)
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
    split = t if sharded and cand.form != "sequence" else 1
    local_params = st.param_bytes / split
    if cand.fsdp:
        gs_t, gs_b = mc.fsdp_sync([b / split for b in st.param_sizes], [b / split for b in st.synced_param_sizes],
                                  bwd_s)
    else:
        gs_t, gs_b = mc.grad_sync(st.synced_param_bytes / split)
    lr_t, lr_b = mc.scalar_reductions(st.loss_reductions)
    comm_s, comm_b = comm_s + gs_t + lr_t, comm_b + gs_b + lr_b
    state = local_params * mc.state_factor() / (dp if cand.fsdp else 1)
    if cand.fsdp:
        state += local_params  # the gathered parameters live from forward to backward
    return Cost(compute_s=compute, comm_s=comm_s, comm_bytes=comm_b, memory_bytes=state + act)


def other_cost(st: SiteStats, mc: MeshCosting, *, fsdp: bool = False) -> Cost:
    """Nodes and parameters outside every site (data parallel only), the gradient buckets' fixed cost, and
    the reductions of gradients at batch boundaries. `fsdp`: its parameters are FSDP-sharded too (then no
    bucket is left to pay for: every site is FSDP in the plans that set it)."""
    compute = _compute_s(st, mc.dp, mc.cluster)
    if fsdp:
        comm_s, comm_b = mc.fsdp_sync(st.param_sizes, st.synced_param_sizes, 2 * compute / 3)
        state = st.param_bytes * mc.state_factor() / mc.dp + st.param_bytes
    else:
        comm_s, comm_b = mc.grad_sync(st.synced_param_bytes)
        comm_s += mc.bucket_fixed_s()
        state = st.param_bytes * mc.state_factor()
    for a in mc.data_axes + mc.seq_axes:
        p = mc.size(a)
        for nbytes in st.boundary_grad_bytes:
            comm_s += mc.allreduce_s(nbytes, a)
            comm_b += 2 * (p - 1) / p * nbytes
    return Cost(compute_s=compute, comm_s=comm_s, comm_bytes=comm_b, memory_bytes=state + st.act_bytes / mc.dp)
