"""Shape facts and mesh pricing shared by every form's cost (`autopar.forms`).

A *site* is a recognised structure (attention, MLP, embedding, loss, norm, MoE; a lone linear).
`gather_stats` reads, once per captured graph, what each site's cost needs (`SiteStats`): its
forward FLOPs and bytes by op kind, the activations its nodes save, its block input, its parameters
(and which of them have their own gradient reduced), the loss' logits and reductions, and the same
for everything outside every site ("other": norms, residuals, masks, which are data-parallel only).

`MeshCosting` prices on one role assignment of the mesh (data axes, sequence axes, the cluster):
collectives on an axis (`cost_model.analytical.collective_time_s`: a profile's measured table, or
alpha-beta), the optimizer's state, and compute (`compute_s`): forward + backward = 3x the forward
work of the site's nodes, divided by the ranks the work is split over. With per-op-kind rates (a
profiled cluster, or a GPU preset's achieved rates) each kind of op is priced at its rate, a matmul at
the rate of its split size, an attention at the rate of its key length, and every op pays the dispatch
overhead, which no split divides (`kernel_time_s`; a kind without a rate: its roofline); with only
peaks (the cpu preset), the roofline of the site's FLOPs and activation bytes (`compute_time_s`).

What a form adds (its collectives, how it splits work, parameters and activations) is in the form's
own module; how parameters are synchronised over the data axes in `autopar.forms.dp` and
`autopar.forms.fsdp`. A `Cost` says which part of its communication is the parameters' synchronisation
(`gather_s`, `reduce_s`: overlappable); `autopar.timeline` simulates the step with that overlap.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
from torch import fx

from cost_model.analytical import collective_time_s, compute_time_s, has_kernel_rates, kernel_time_s, node_cost, \
    send_bytes
from cost_model.hardware import Cluster, axis_link
from autopar.runtime.collectives import GRAD_BUCKET_BYTES
from autopar.sites import Kind, LossSite, PassContext, Site
from passes.patterns import TRANSPARENT

OPTIMIZER_STATES = {"adam": 2, "adamw": 2, "sgd": 0, "sgd_momentum": 1}


@dataclass(frozen=True, kw_only=True)
class Cost:
    compute_s: float
    comm_s: float
    comm_bytes: float
    memory_bytes: float
    # of memory_bytes: the activations saved for backward, and FSDP's gathered copy of the parameters; the rest is
    # parameters, gradients and optimizer state (`MeshCosting.state_factor`: 1 : 1 : the optimizer's states)
    act_bytes: float = 0.0
    transient_bytes: float = 0.0
    # of comm_s: the parameters' synchronisation over the data axes, which overlaps compute (`autopar.timeline`):
    # FSDP's gathers, issued ahead of the structure's forward (prefetch), and the gradient reductions, issued as its
    # backward ends; the rest of comm_s (tensor-parallel collectives, loss reductions) is on the critical path
    gather_s: float = 0.0
    reduce_s: float = 0.0

    @property
    def time_s(self) -> float:
        """Compute + communication, nothing overlapped (`autopar.timeline` simulates the overlap)."""
        return self.compute_s + self.comm_s

    @property
    def critical_s(self) -> float:
        """Communication on the critical path: what no compute hides."""
        return max(0.0, self.comm_s - self.gather_s - self.reduce_s)


@dataclass
class SiteStats:
    """Shape facts about one site, gathered once from the graph."""

    flops: float = 0.0  # forward
    compute_dtype: str = "float32"
    act_bytes: float = 0.0  # outputs of its nodes (saved for backward), global
    io_bytes: float = 0.0  # the block's input activation, global
    param_bytes: float = 0.0
    param_numel: int = 0
    param_shapes: dict[str, tuple[int, ...]] = field(default_factory=dict)  # placeholder -> shape (FSDP's dims)
    param_sizes: list[float] = field(default_factory=list)  # bytes of each parameter (FSDP gathers each)
    synced_param_sizes: list[float] = field(default_factory=list)  # those whose own gradient is reduced
    # placeholder -> (bytes, used, synced) of each parameter counted here: what `fsdp_parts` splits
    param_facts: dict[str, tuple[float, bool, bool]] = field(default_factory=dict)
    fsdp_whole: frozenset[str] = frozenset()  # priced as FSDP: the parameters it leaves whole (`fsdp.whole`)
    # (op kind, dtype, flops per call of a matmul / key length of an attention / else 0) -> [flops, bytes, ops], forward
    work: dict[tuple[str, str, int], list[float]] = field(default_factory=dict)
    boundary_grad_bytes: list[float] = field(default_factory=list)  # other: activations whose gradient is reduced
    # other, per boundary: whether it holds the sequence where its batch-dependent consumer does (on a sequence
    # axis it is then split on the sequence, and its gradient all-gathered, not all-reduced)
    boundary_on_sequence: list[bool] = field(default_factory=list)
    summed_into: str | None = None  # embedding: the earlier embedding its output is added to (one reduction)
    loss_reductions: int = 0  # loss: scalars all-reduced per data axis (the loss; the count of a mean)
    ce_logits_fp32_bytes: float = 0.0  # cross-entropy loss: its logits in (at least) fp32
    ce_fused_bytes: float = 0.0  # cross-entropy loss: what aten's fused op moves forward (`node_cost`)
    logits_bytes: float = 0.0  # loss: logits, global
    logits_out: bool = False  # loss: the model also returns its logits
    tokens: int = 0
    # norm: its share (1 / the number of norms) of the gradient bucket sequence parallelism adds on its axis, and
    # of the row-parallel biases whose gradients that bucket sums (added after the reduce-scatter: partial)
    sequence_bucket_share: float = 0.0
    sequence_bias_bytes: float = 0.0

    def add_node(self, n: fx.Node) -> None:
        c = node_cost(n)
        self.flops += c.flops
        if c.flops:
            self.compute_dtype = c.dtype
        self.act_bytes += _bytes(n.meta.get("val"))
        if c.kind != "view":
            size = c.flops if c.kind == "matmul" else c.seq_len if c.kind == "sdpa" else 0
            w = self.work.setdefault((c.kind, c.dtype, size), [0.0, 0.0, 0])
            w[0], w[1], w[2] = w[0] + c.flops, w[1] + c.bytes, w[2] + 1

    def add_param(self, name: str, v: torch.Tensor, synced: bool, *, counted: bool = True, used: bool = True) -> None:
        """A parameter of the site; `counted=False` for one another site already counts (a tied weight):
        it constrains the site's FSDP sharding but its bytes are synchronised and stored once. An unused
        placeholder (`used=False`: the other name of a tied weight) is stored but never communicated."""
        self.param_shapes[name] = tuple(int(d) for d in v.shape)
        if not counted:
            return
        self.param_bytes += _bytes(v)
        self.param_numel += v.numel()
        self.param_facts[name] = (_bytes(v), used, synced)
        if used:
            self.param_sizes.append(_bytes(v))
        if synced:
            self.synced_param_sizes.append(_bytes(v))

    def fsdp_parts(self) -> tuple["SiteStats", "SiteStats"]:
        """The parameters FSDP shards and those it leaves whole (`fsdp_whole`: data parallel), each as stats holding
        only their parameter fields."""
        parts = (SiteStats(), SiteStats())
        for name, (nbytes, used, synced) in self.param_facts.items():
            part = parts[name in self.fsdp_whole]
            part.param_bytes += nbytes
            part.param_facts[name] = (nbytes, used, synced)
            if used:
                part.param_sizes.append(nbytes)
            if synced:
                part.synced_param_sizes.append(nbytes)
        return parts

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


def block_nodes(site: Site) -> list[fx.Node]:
    """Nodes inside a block (reachable from its first layers' outputs and reaching its last layers), then its
    anchor and member nodes."""
    return list(dict.fromkeys(_between(site) + site.nodes()))


def _between(site: Site) -> list[fx.Node]:
    if site.kind is Kind.ATTENTION:
        starts = [s.node for s in site.q + site.k + site.v]
        ends = [s.node for s in site.out]
    elif site.kind is Kind.MLP:
        starts = [s.node for s in site.col]
        ends = [s.node for s in site.row]
    else:
        return []
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
    first = next((getattr(site, role)[0].node for role in ("col", "q", "head") if getattr(site, role, ())), site.node)
    x = first.args[1] if first.target is torch.ops.aten.addmm.default else first.args[0]
    return x if isinstance(x, fx.Node) else None


def _row_linears(site: Site) -> tuple:
    """The row-parallel layers of a block tensor parallelism splits: an attention's output projection, an MLP's
    row layers (what Megatron sequence parallelism reduce-scatters onto the sequence)."""
    if site.kind is Kind.ATTENTION:
        return site.out
    if site.kind is Kind.MLP:
        return site.row
    return ()


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


def _on_sequence(n: fx.Node, seq_len: int | None) -> bool:
    """Whether boundary `n` holds the sequence at the dim where a consumer does (right-aligned: a broadcast
    operand such as a position embedding (S, h) added to a (b, S, h) stream). With the sequence split, the
    lowering splits such a value on that dim (`collectives.split`: backward all-gathers its gradient) and
    all-reduces the gradient of any other value (`grad_all_reduce`)."""
    v = n.meta.get("val")
    if seq_len is None or not isinstance(v, torch.Tensor):
        return False
    for u in n.users:
        out = u.meta.get("val")
        if not isinstance(out, torch.Tensor):
            continue
        off = out.dim() - v.dim()
        if any(out.shape[j] == seq_len and j - off >= 0 and v.shape[j - off] == seq_len for j in range(out.dim())):
            return True
    return False


def _loss_reductions(site: LossSite) -> int:
    """Scalars a loss all-reduces per data axis with the batch split: its value, and for a mean cross-entropy
    the valid-token count (`autopar.runtime.ops.loss_reduce`); none for reduction='none'."""
    n, ce = site.node, site.loss == "cross_entropy"
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
    for site in ctx.of_kind(Kind.EMBEDDING):
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
    outputs = set(gm.graph.output_node().all_input_nodes)
    for site in ctx.planning_sites():
        st = SiteStats()
        for n in block_nodes(site):
            if n in covered_nodes:
                continue
            covered_nodes.add(n)
            st.add_node(n)
        x = _block_input(site)
        st.io_bytes = _bytes(x.meta.get("val")) if x is not None else 0.0
        for p in sorted(site.all_params()):
            st.add_param(p, ph[p].meta["val"], p in synced, counted=p not in owned, used=bool(ph[p].users))
            owned.add(p)
        if site.kind is Kind.EMBEDDING:
            st.summed_into = summed.get(site.key)
        if site.kind is Kind.LOSS:
            st.loss_reductions = _loss_reductions(site)
            logits = site.node.args[0].meta.get("val")
            if isinstance(logits, torch.Tensor) and site.loss == "cross_entropy":
                st.ce_logits_fp32_bytes = logits.numel() * max(4, logits.element_size())  # at least fp32
                st.ce_fused_bytes = node_cost(site.node).bytes
        if site.kind is Kind.LOSS and site.head:
            logits = site.head[0].node
            st.logits_bytes = _bytes(logits.meta.get("val"))
            st.logits_out = _reaches_output(logits, outputs)
            st.tokens = int(site.node.args[1].meta["val"].numel())
        stats[site.key] = st
    norms = ctx.of_kind(Kind.NORM)
    row_bias_bytes = sum(_bytes(ph[lin.param["bias"]].meta["val"]) for site in ctx.planning_sites()
                         for lin in _row_linears(site)
                         if "bias" in lin.param and len(lin.node.meta["val"].shape) >= 3)  # (b, s, h) outputs
    for site in norms:
        stats[site.key].sequence_bucket_share = 1 / len(norms)
        stats[site.key].sequence_bias_bytes = row_bias_bytes / len(norms)
    other = SiteStats()
    for n in gm.graph.nodes:
        if n.op == "call_function" and n not in covered_nodes:
            other.add_node(n)
    for name, fqn in ctx.captured.param_fqns.items():
        if name not in owned:
            other.add_param(name, ph[name].meta["val"], name in synced, used=bool(ph[name].users))
    other.boundary_grad_bytes = [_bytes(n.meta.get("val")) for n in boundaries if n.op != "placeholder"]
    seq_len = next((s.seq_len for s in ctx.of_kind(Kind.ATTENTION)), None)  # what sequence forms split
    other.boundary_on_sequence = [_on_sequence(n, seq_len) for n in boundaries if n.op != "placeholder"]
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
    """A MeshCosting whose gradient buckets hold every parameter's gradient: at least one bucket per dtype, and
    as many as `GRAD_BUCKET_BYTES` buckets their bytes fill (`bucket_gradients_pass`)."""
    ph = {n.name: n for n in ctx.captured.gm.graph.nodes if n.op == "placeholder"}
    dtypes = {ph[p].meta["val"].dtype for p in ctx.captured.param_fqns}
    total = other.param_bytes + sum(st.param_bytes for st in stats.values())
    return MeshCosting(names=tuple(names), sizes=tuple(sizes), data_axes=tuple(data_axes), cluster=cluster,
                       optimizer=optimizer, seq_axes=tuple(seq_axes), bucket_bytes=total,
                       num_buckets=max(1, len(dtypes), math.ceil(total / GRAD_BUCKET_BYTES)),
                       **precision_costing(ctx.captured, dtypes, optimizer))


def state_bytes_per_element(master_dtype: torch.dtype, param_dtype: torch.dtype | None,
                            reduce_dtype: torch.dtype | None, optimizer: str) -> float:
    """Bytes per parameter element held across the step under a mixed-precision policy (`autopar.precision`): the
    master parameter, its gradient as the optimizer sees it (master dtype: a reduce_dtype gradient is cast back
    after its reduction) and the optimizer's states (PyTorch keeps them in the parameter's dtype: Adam's two
    moments). param_dtype compute copies and reduce_dtype buffers live within a step (activations, FSDP's gathered
    copy, the collectives), not here. Adam, fp32 masters, bf16 / fp32: 4 + 4 + 2 x 4 = 16."""
    if optimizer not in OPTIMIZER_STATES:
        raise ValueError(f"optimizer must be one of {sorted(OPTIMIZER_STATES)}, got {optimizer!r}")
    del param_dtype, reduce_dtype  # transients (see above)
    return torch.empty((), dtype=master_dtype).element_size() * (2 + OPTIMIZER_STATES[optimizer])


def precision_costing(captured, dtypes: set, optimizer: str) -> dict:
    """MeshCosting's mixed-precision fields for a capture made under a policy (its parameters at param_dtype, the
    bytes every `SiteStats` counts): the state per byte of those parameters, and the bytes a gradient reduction
    moves per byte of them (reduce_dtype / param_dtype). Empty without a policy."""
    precision = getattr(captured, "precision", None)
    if precision is None:
        return {}
    graph = max(dtypes, key=lambda d: torch.empty((), dtype=d).element_size())
    held = torch.empty((), dtype=graph).element_size()
    param_dtype, reduce_dtype = precision.collective_dtypes
    master = captured.master_dtype or graph
    state = state_bytes_per_element(master, param_dtype, reduce_dtype, optimizer)
    return {"state_bytes_per_param_byte": state / held,
            "grad_bytes_factor": torch.empty((), dtype=reduce_dtype or graph).element_size() / held}


@dataclass(frozen=True, kw_only=True)
class MeshCosting:
    names: tuple[str, ...]
    sizes: tuple[int, ...]
    data_axes: tuple[str, ...]
    cluster: Cluster
    optimizer: str = "adam"
    seq_axes: tuple[str, ...] = ()  # axes the sequence is split over (Ulysses / ring attention)
    bucket_bytes: float = 0.0  # gradient bytes of all parameters: the bucket whose per-byte rate sites pay
    num_buckets: int = 1  # gradient buckets per axis: one per dtype, one per `GRAD_BUCKET_BYTES`
    # mixed precision (`precision_costing`): state per byte of the graph's (param_dtype) parameters, and the bytes a
    # gradient reduction moves per such byte (reduce_dtype); None / 1.0: the model's dtypes
    state_bytes_per_param_byte: float | None = None
    grad_bytes_factor: float = 1.0

    @property
    def dp(self) -> int:
        """Ranks the tokens of a step are split over: the batch on data axes, the sequence on sequence axes."""
        return math.prod(self.sizes[self.names.index(a)] for a in self.data_axes + self.seq_axes)

    def size(self, axis: str) -> int:
        return self.sizes[self.names.index(axis)]

    def link(self, axis: str):
        return axis_link(self.cluster, self.sizes, self.names.index(axis))

    def collective(self, kind: str, nbytes: float, axis: str, interval_s: float | None = None) -> tuple[float, float]:
        """(seconds, bytes this rank sends) of one collective on `axis`, after `interval_s` of compute when known;
        `nbytes` as `cost_model.analytical` defines it for the kind (`collective_time_s`, `send_bytes`)."""
        p = self.size(axis)
        return (collective_time_s(kind, int(nbytes), p, self.link(axis), interval_s=interval_s),
                send_bytes(kind, nbytes, p))

    def allreduce_s(self, nbytes: float, axis: str, interval_s: float | None = None) -> float:
        """An all-reduce on `axis`, after `interval_s` of compute when known (`collective_time_s`)."""
        return self.collective("all_reduce", nbytes, axis, interval_s)[0]

    def bucket_rate(self, axis: str) -> tuple[float, float]:
        """(fixed seconds, seconds per byte) of the gradient bucket's all-reduce on `axis`: the chord of its
        time between an empty bucket and a bucket of `bucket_bytes`."""
        fixed = self.allreduce_s(0, axis)
        if self.bucket_bytes <= 0:
            return fixed, 0.0
        return fixed, max(0.0, self.allreduce_s(self.bucket_bytes, axis) - fixed) / self.bucket_bytes

    def scalar_reductions(self, count: int) -> tuple[float, float]:
        """(time, bytes sent) of `count` fp32 scalar all-reduces on every data and sequence axis."""
        t = b = 0.0
        for a in self.data_axes + self.seq_axes:
            ct, cb = self.collective("all_reduce", 4, a)
            t, b = t + count * ct, b + count * cb
        return t, b

    def state_factor(self) -> float:
        """Parameter + gradient + optimizer states, in multiples of the parameter bytes (fp32 states); under mixed
        precision, of the param_dtype bytes the graph holds (`state_bytes_per_element`)."""
        if self.state_bytes_per_param_byte is not None:
            return self.state_bytes_per_param_byte
        return 2 + OPTIMIZER_STATES[self.optimizer] * 1.0


def compute_s(st: SiteStats, divisor: float, cluster: Cluster) -> float:
    """Forward + backward (3x the forward work) of a site's nodes with the work split over `divisor` ranks:
    by op kind when the cluster measured kernel rates (every op runs on every rank: the dispatch overhead
    is not divided), else the roofline of all its FLOPs and activation bytes."""
    if has_kernel_rates(cluster):
        return sum(kernel_time_s(kind, 3 * flops / divisor, 3 * nbytes / divisor, compute_dtype(dtype, cluster), cluster,
                                 num_ops=3 * ops, flops_per_call=size / divisor if size and kind == "matmul" else None,
                                 seq_len=size if size and kind == "sdpa" else None)
                   for (kind, dtype, size), (flops, nbytes, ops) in st.work.items())
    return compute_time_s(3 * st.flops / divisor, 3 * st.act_bytes / divisor, compute_dtype(st.compute_dtype, cluster),
                          cluster)


def compute_dtype(dtype: str, cluster: Cluster) -> str:
    if dtype in cluster.peak_flops:
        return dtype
    return "float32" if "float32" in cluster.peak_flops else next(iter(cluster.peak_flops))


