"""Shape facts and mesh pricing shared by every form's cost (`autopar.forms`).

A *site* is a recognised structure (attention, MLP, embedding, loss, norm, MoE; a lone linear).
`gather_stats` reads, once per captured graph, what each site's cost needs (`SiteStats`): its
forward FLOPs and bytes by op kind, the activations saved for backward whose placement its form
decides, its block input, its parameters (and which of them have their own gradient reduced, which
backward reads), the loss' logits and reductions, and the same for everything outside every site
("other": what no form shards).

Memory. Saved activations are what autograd saves (`cost_model.memory.saved_activations` on the
captured graph: views and shared storage once, values freed in forward not at all), each given to the
site whose form decides its placement (`attribute_saved`): a block's interior to the block (tensor
parallelism divides it by t), the residual stream (residual adds, RMS-norm pieces, dropout masks on
it) to the norms (sequence parallelism divides it by t), the logits between the LM head and the loss
to the loss (vocab-parallel divides it by t); what remains is replicated on the model axes. Every
form's `cost` says what its runtime saves beyond the graph (a mask, a copy). The step's peak
(`peak_bytes`): parameters, optimizer state and FSDP's kept gathers, plus the larger end of the
backward: every saved activation with the largest momentary buffer (`Cost.peak_bytes`: the loss'
logit gradients), or every gradient. Model state per parameter element follows one rule
(`cost_model.memory.state_bytes_per_element`, `MeshCosting.state_factor`).

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

import dataclasses
import math
from dataclasses import dataclass, field

import torch
from torch import fx

from cost_model.analytical import _is_view, collective_time_s, compute_time_s, has_kernel_rates, kernel_time_s, node_cost, \
    send_bytes
from cost_model.hardware import Cluster, axis_link, dtype_name
from cost_model.memory import OPTIMIZER_STATES, saved_activations
from cost_model.memory import state_bytes_per_element as element_state_bytes
from autopar.layers import fsdp_units
from autopar.runtime.collectives import FIRST_GRAD_BUCKET_BYTES, GRAD_BUCKET_BYTES
from autopar.sites import Kind, LossSite, PassContext, Site
from passes import meta as M
from passes.batch_local import batch_local, gathers_batch, tensor_inputs
from passes.patterns import TRANSPARENT, parameters_only, tensor_bytes


# aten's cross-entropy backward holds two logit-sized fp32 buffers besides the saved log-probabilities: the gradient
# of the log-probabilities and that of the logits (`_log_softmax_backward_data`); the step's peak is usually there
CE_BACKWARD_BUFFERS = 2


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
    # not in memory_bytes: a buffer alive only while this structure runs (the loss' logit gradients, a ring's K/V
    # double buffer); the step's peak adds the largest of them to the start of the backward (`peak_bytes`)
    peak_bytes: float = 0.0
    # of its gradients, those reduced in the data-parallel buckets (`autopar.forms.dp`): reducing a bucket holds its
    # flat copy besides the gradients at the end of the backward, as large as the bucket (at most `GRAD_BUCKET_BYTES`,
    # or all such gradients when they are fewer: `peak_bytes`); the all-reduce is in place, and the gradients are then
    # views of the flat copy
    bucket_bytes: float = 0.0
    # not in memory_bytes: what FSDP holds while reducing the gradients of this structure's group
    # (`forms.fsdp.reduce_transient_bytes`); the step's peak adds the largest to the end of the backward (`peak_bytes`)
    reduce_transient_bytes: float = 0.0
    # of comm_s: the parameters' synchronisation over the data axes, which overlaps compute (`autopar.timeline`):
    # FSDP's gathers, issued ahead of the structure's forward (prefetch), and the gradient reductions, issued as its
    # backward ends; the rest of comm_s (tensor-parallel collectives, loss reductions) is on the critical path
    gather_s: float = 0.0
    reduce_s: float = 0.0
    regather_s: float = 0.0  # of comm_s: ZeRO-3's re-gather of FSDP's released parameters, before its backward
    # of comm_s: ZeRO-1's all-gather of the parameters after the optimizer step (`autopar.forms.zero`): inside the
    # step, after the optimizer (`autopar.timeline`: nothing covers it); not on a structure's critical stream
    step_gather_s: float = 0.0
    # not in compute_s: its share of the optimizer step (`optimizer_step_s`), and the slowdown of its compute while
    # its parameters' synchronisation overlaps it (`Cluster.overlap_slowdown`): the timeline's terms, for the ILP
    optimizer_s: float = 0.0
    overlap_slowdown: float = 0.0
    # of the critical communication: the backward collective of column-parallel linears' input gradient that runs
    # under their weight gradients (Megatron's async communication, `blocks.weight_grad_cover_s`; `autopar.timeline`)
    hidden_s: float = 0.0

    @property
    def time_s(self) -> float:
        """Compute + communication, nothing overlapped (`autopar.timeline` simulates the overlap)."""
        return self.compute_s + self.comm_s

    @property
    def critical_s(self) -> float:
        """Communication on the critical path: what no compute hides."""
        return max(0.0, self.comm_s - self.gather_s - self.reduce_s - self.regather_s - self.step_gather_s)

    def live_parts(self, grad_share: float) -> tuple[float, float, float]:
        """(held all step: parameters, optimizer state, FSDP's gathered copies; saved activations; gradients), with
        `grad_share` the gradients' share of parameter + gradient + optimizer bytes (`MeshCosting.grad_share`)."""
        state = self.memory_bytes - self.act_bytes
        grads = (state - self.transient_bytes) * grad_share
        return state - grads, self.act_bytes, grads


def peak_bytes(costs, grad_share: float, start_bytes: float = 0.0) -> float:
    """The step's peak memory per device from its structures' costs: what is held all step, plus the larger of the
    two ends of the backward. At its start (the loss' backward) every saved activation is alive, with the largest
    momentary buffer (`Cost.peak_bytes`: the loss' logit gradients) and no gradient yet (`zero_grad(set_to_none=True)`);
    at its end every gradient and no activation, with a gradient bucket being reduced (its flat copy,
    `Cost.bucket_bytes`) and FSDP's largest group being reduced (`Cost.reduce_transient_bytes`). In between, gradients
    accumulate as activations are freed, and the live set stays within the larger end when each layer frees at least
    the bytes its gradients take (saved activations per layer exceed its parameters' gradients whenever batch x
    sequence exceeds about the hidden size).
    `start_bytes`: more at the start of the backward (activation checkpointing: the saved bytes its levels change,
    negative, and the recompute transient, `solver.checkpoint_cost`)."""
    held = act = grads = momentary = bucket = reducing = 0.0
    for c in costs:
        h, a, g = c.live_parts(grad_share)
        held, act, grads, momentary, bucket = held + h, act + a, grads + g, max(momentary, c.peak_bytes), \
            bucket + c.bucket_bytes
        reducing = max(reducing, c.reduce_transient_bytes)
    return held + max(act + momentary + start_bytes, grads + min(GRAD_BUCKET_BYTES, bucket) + reducing)


@dataclass
class SiteStats:
    """Shape facts about one site, gathered once from the graph."""

    flops: float = 0.0  # forward
    compute_dtype: str = "float32"
    act_bytes: float = 0.0  # outputs of its nodes, global: the bytes its ops write (the roofline's traffic)
    # saved for backward (`cost_model.memory.saved_activations`: views and shared storage once), global, whose
    # placement this site's form decides (`attribute_saved`); other: what no form shards (replicated on model axes)
    saved_bytes: float = 0.0
    saved_unbatched_bytes: float = 0.0  # other: saved values that do not depend on the batch (replicated on data)
    saved_unbatched_seq_bytes: float = 0.0  # ... of which those holding the sequence (split on sequence axes)
    peak_bytes: float = 0.0  # a buffer alive only momentarily (the loss' gradients of its logits), global
    attn_out_bytes: float = 0.0  # attention: its output (b, heads, s, d), global
    index_numel: int = 0  # embedding: the ids it looks up, global
    io_bytes: float = 0.0  # the block's input activation, global
    param_bytes: float = 0.0
    param_numel: int = 0
    param_shapes: dict[str, tuple[int, ...]] = field(default_factory=dict)  # placeholder -> shape (FSDP's dims)
    param_sizes: list[float] = field(default_factory=list)  # bytes of each parameter (FSDP gathers each)
    synced_param_sizes: list[float] = field(default_factory=list)  # those whose own gradient is reduced
    # placeholder -> (bytes, used, synced) of each parameter counted here: what `fsdp_parts` splits
    param_facts: dict[str, tuple[float, bool, bool]] = field(default_factory=dict)
    fsdp_whole: frozenset[str] = frozenset()  # priced as FSDP: the parameters it leaves whole (`fsdp.whole`)
    # priced as FSDP: placeholder -> its bytes' factor where it is sharded unevenly, padded (`fsdp.pad_factor`)
    fsdp_pad: dict[str, float] = field(default_factory=dict)
    # placeholder -> (bytes of its FSDP gather group, gathered again in backward): `fsdp_groups`
    fsdp_groups: dict[str, tuple[float, bool]] = field(default_factory=dict)
    fsdp_regathered: int = 0  # of the model's FSDP groups, those gathered again in backward
    saved_params: frozenset[str] = frozenset()  # parameters backward reads (FSDP keeps their gathered copies)
    # (op kind, dtype, flops per call of a matmul / key length of an attention / else 0) -> [flops, bytes, ops], forward
    work: dict[tuple[str, str, int], list[float]] = field(default_factory=dict)
    boundary_grad_bytes: list[float] = field(default_factory=list)  # other: activations whose gradient is reduced
    # other, per boundary: the bytes its gradient's all-reduce moves (a value computed from parameters alone: under
    # mixed precision in reduce_dtype, `passes.lower.mixed_precision_pass`; else as boundary_grad_bytes)
    boundary_reduce_bytes: list[float] = field(default_factory=list)
    # other, per boundary: whether it holds the sequence where its batch-dependent consumer does (on a sequence
    # axis it is then split on the sequence, and its gradient all-gathered, not all-reduced)
    boundary_on_sequence: list[bool] = field(default_factory=list)
    # other, per boundary: the bytes of the parameters its reduction moves onto when one axis reduces it (they join
    # the gradient buckets: `passes.lower.replicated_reductions_to_parameters_pass`), or None where it stays
    boundary_moved_bytes: list = field(default_factory=list)
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
    # other: the nodes that gather the batch (no rule, or a rule that gathers it) and are not batch-local
    # (`passes.batch_local.gathers_batch`), which run whole on
    # every rank of the data axes (their FLOPs not divided), and the bytes of their batch-dependent inputs, which are
    # all-gathered there; "node (op)" of each (`Estimate.unsplit_ops`)
    unsplit: "SiteStats | None" = None
    unsplit_gather_bytes: list[float] = field(default_factory=list)
    unsplit_ops: tuple[str, ...] = ()
    # float8 linears of this site (`autopar.forms.float8`, `apply_float8`): their recipe, the scaling traffic of their
    # activations and output gradients (global; split like the site's work), of those a tensor-parallel form leaves
    # whole on each rank (rowwise: a column-parallel linear's replicated input; both: a row-parallel linear's output
    # gradient), of their weights (whole on each rank but under tensorwise FSDP, which casts the shard), and the
    # weights FSDP gathers in 1 byte (tensorwise: placeholder -> gathered bytes factor)
    float8_recipe: str | None = None
    float8_linears: int = 0
    float8_act_bytes: float = 0.0
    float8_whole_bytes: float = 0.0
    float8_weight_bytes: float = 0.0
    float8_gathered: dict[str, float] = field(default_factory=dict)
    # (recipe, M, K, N, row-parallel, high-precision dtype) of each float8 linear: its amax all-reduces
    # (`autopar.forms.float8.CASTS`), whether its local shape is `skinny`
    float8_shapes: list[tuple] = field(default_factory=list)
    # what pricing one of its linears in fp8 needs (`float8_facts`, `with_float8`), by index into `float8_members`:
    # the `aten.linear` nodes (nn.Linear) the site owns
    float8_facts: dict[int, "Float8Facts"] = field(default_factory=dict)

    def add_node(self, n: fx.Node) -> None:
        c = node_cost(n)
        rows = n.meta.get(M.ROWS)  # an op node_cost counts no FLOPs for (an LSTM, an opaque node): measured at capture
        if not c.flops and rows is not None and rows.flops:
            c = dataclasses.replace(c, flops=int(rows.flops), kind="matmul")
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
        placeholder (`used=False`: the other name of a tied weight) is not counted: a tied name shares its
        twin's storage, and a parameter no op uses gets no gradient, so no optimizer state (its own bytes,
        which are rare and small, are left out)."""
        self.param_shapes[name] = tuple(int(d) for d in v.shape)
        if not counted or not used:
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
        only their parameter fields; an unevenly sharded parameter's bytes padded (`fsdp_pad`: what its shards, their
        gathers and reductions hold and move)."""
        parts = (SiteStats(), SiteStats())
        for name, (nbytes, used, synced) in self.param_facts.items():
            part = parts[name in self.fsdp_whole]
            nbytes = nbytes * self.fsdp_pad.get(name, 1.0)
            part.param_bytes += nbytes
            if name in self.saved_params:
                part.saved_params = part.saved_params | {name}
            part.param_facts[name] = (nbytes, used, synced)
            if used:
                part.param_sizes.append(nbytes)
            if synced:
                part.synced_param_sizes.append(nbytes)
        parts[0].fsdp_groups, parts[0].fsdp_regathered = self.fsdp_groups, self.fsdp_regathered
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


def _reduced_bytes(v, precision) -> float:
    """The bytes a gradient reduction of `v` (computed from parameters alone) moves: under a policy with a reduce
    dtype (`Precision.collective_dtypes`) its elements at reduce_dtype, as the lowering reduces every gradient
    collective of such a value (`passes.lower.mixed_precision_pass`); else its own bytes."""
    reduce_dtype = precision.collective_dtypes[1] if precision is not None else None
    if reduce_dtype is None or not isinstance(v, torch.Tensor) or not v.dtype.is_floating_point:
        return _bytes(v)
    return float(v.numel() * torch.empty((), dtype=reduce_dtype).element_size())


def _moved_to_parameters(n: fx.Node, params: set[str], user_inputs: set[str]) -> float | None:
    """The bytes of the parameters a boundary's gradient reduction moves onto in the lowering
    (`passes.lower.replicated_reductions_to_parameters_pass`, `passes.patterns.parameters_only`: computed from
    parameters alone, none of it used elsewhere, its parameters no larger than it), or None where it stays."""
    if len(n.users) != 1 or n.op != "call_function":
        return None
    found = parameters_only(n, lambda p: None if p.name in user_inputs else "param" if p.name in params else "const")
    moved = sum(map(tensor_bytes, found or ()))
    return moved if found and moved <= tensor_bytes(n) else None


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


def _batch_dependent(gm: fx.GraphModule, user_inputs: set[str]) -> set[fx.Node]:
    """Nodes whose value depends on a user input (the batch)."""
    out: set[fx.Node] = set()
    for n in gm.graph.nodes:
        if (n.op == "placeholder" and n.name in user_inputs) or any(a in out for a in n.all_input_nodes):
            out.add(n)
    return out


def _stream(ctx: PassContext, interior: set[fx.Node]) -> set[fx.Node]:
    """The residual stream: values with the leading (batch, sequence) dims of a norm's input connected to one
    (either way) through nodes outside the interior of attention, MLP, MoE and loss blocks (residual adds,
    dropouts, the pieces of an RMS norm, the embedding output, a row-parallel layer's output). Megatron sequence
    parallelism splits all of it on the sequence (`autopar.forms.sequence_norm`)."""
    norms = ctx.of_kind(Kind.NORM)
    if not norms:
        return set()
    lead = tuple(norms[0].input.meta["val"].shape[:2])

    def on(n: fx.Node) -> bool:
        v = n.meta.get("val")
        return (n.op == "call_function" and n not in interior and isinstance(v, torch.Tensor) and v.dim() >= 2
                and tuple(v.shape[:2]) == lead)

    seen: set[fx.Node] = set()
    stack = [s.input for s in norms if on(s.input)] + [s.node for s in norms if on(s.node)]
    while stack:
        n = stack.pop()
        if n in seen:
            continue
        seen.add(n)
        stack.extend(m for m in (*n.all_input_nodes, *n.users) if m not in seen and on(m))
    return seen


def _logits_region(site: LossSite, owner: dict[fx.Node, str]) -> set[fx.Node]:
    """Nodes outside every site between a loss' LM head and the loss (the logits' upcast, flattening)."""
    out: set[fx.Node] = set()
    stack = [u for lin in site.head for u in lin.node.users]
    while stack:
        n = stack.pop()
        if n in out or n in owner or n.op != "call_function":
            continue
        out.add(n)
        stack.extend(n.users)
    return out


def _reaches_batch(n: fx.Node, batch: set[fx.Node]) -> bool:
    """Whether batch-dependent work consumes `n`, directly or through views."""
    stack, seen = list(n.users), set()
    while stack:
        u = stack.pop()
        if u in seen:
            continue
        seen.add(u)
        if u in batch:
            return True
        if u.op == "call_function" and (u.target in TRANSPARENT or _is_view(u)):
            stack.extend(u.users)
    return False


def attribute_saved(ctx: PassContext, owner: dict[fx.Node, str], stats: dict[str, SiteStats], other: SiteStats
                    ) -> None:
    """Add each tensor autograd saves for backward (`cost_model.memory.saved_activations` of the captured graph:
    views and shared storage counted once, values freed in forward not at all) to the stats of the site whose
    form decides its placement (by the node that produces it, or that an extra buffer is placed like):

    - the residual stream (`_stream`): shared evenly by the norms (sequence parallelism splits it on the
      sequence; otherwise it is replicated on model axes);
    - between an LM head and its loss (`_logits_region`: the upcast, flattening, cross-entropy's log-probabilities):
      the loss (vocab-parallel cross-entropy splits it on the vocabulary);
    - else produced inside a site (`owner`): that site (tensor parallelism splits a block's interior);
    - else other: replicated on model axes; split on the data axes when it depends on the batch
      (`saved_bytes`), else whole there (`saved_unbatched_bytes`), and then split on a sequence axis when
      batch-dependent work takes it on the sequence (`saved_unbatched_seq_bytes`: rotary tables).

    Parameters backward reads (`saved_params`: a linear's weight, a norm's weight; not a bias, not an embedding
    table) are what FSDP's gathered copies keep alive until backward (`autopar.forms.fsdp.params_cost`).
    """
    gm = ctx.captured.gm
    sites = {s.key: s for s in ctx.planning_sites()}
    interior = {n for n, key in owner.items() if sites[key].kind in (Kind.ATTENTION, Kind.MLP, Kind.MOE, Kind.LOSS)}
    interior -= {lin.node for site in sites.values() for lin in _row_linears(site)}  # their outputs join the stream
    stream = _stream(ctx, interior)
    logits = {n: site.key for site in ctx.of_kind(Kind.LOSS) for n in _logits_region(site, owner)}
    norms = [s.key for s in ctx.of_kind(Kind.NORM)]
    batch = _batch_dependent(gm, set(ctx.captured.user_inputs))
    seq_len = next((s.seq_len for s in ctx.of_kind(Kind.ATTENTION)), None)
    params = set(ctx.captured.param_fqns)
    for saved in saved_activations(gm, set(ctx.captured.user_inputs) | params).values():
        if saved.node.op == "placeholder" and saved.node.name in params:
            for st in (*stats.values(), other):
                if saved.node.name in st.param_facts:
                    st.saved_params = st.saved_params | {saved.node.name}
            continue
        n = saved.node
        if n in stream:
            for key in norms:
                stats[key].saved_bytes += saved.bytes / len(norms)
        elif n in logits:
            stats[logits[n]].saved_bytes += saved.bytes
        elif n in owner:
            stats[owner[n]].saved_bytes += saved.bytes
        elif n in batch:
            other.saved_bytes += saved.bytes
        else:
            other.saved_unbatched_bytes += saved.bytes
            # split on a sequence axis where the batch-dependent work consuming it takes it (a boundary holding the
            # sequence: the lowering splits it there); values before such a boundary stay whole
            if _reaches_batch(n, batch) and _on_sequence(n, seq_len):
                other.saved_unbatched_seq_bytes += saved.bytes


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
    """Stats per composite site (by key), stats of everything else, and the params sites own. Read once per graph
    and set of sites (cached on `ctx`: planning prices several plans of one capture); callers do not mutate them."""
    gm = ctx.captured.gm
    key = (id(gm), len(gm.graph.nodes), tuple(s.key for s in ctx.sites),
           tuple(sorted((getattr(ctx, "float8", None) or {}).items())))
    cached = getattr(ctx, "_gathered_stats", None)
    if cached is None or cached[0] != key:
        cached = (key, _gather_stats(ctx))
        ctx._gathered_stats = cached
    return cached[1]


def _gather_stats(ctx: PassContext) -> tuple[dict[str, SiteStats], SiteStats, set[str]]:
    gm = ctx.captured.gm
    ph = {n.name: n for n in gm.graph.nodes if n.op == "placeholder"}
    boundaries = _gradient_boundaries(gm, set(ctx.captured.user_inputs), set(ctx.captured.param_fqns))
    synced = {n.name for n in boundaries if n.op == "placeholder"}
    summed = summed_embeddings(ctx)
    stats: dict[str, SiteStats] = {}
    covered_nodes: set[fx.Node] = set()
    owner: dict[fx.Node, str] = {}  # node -> the site that counts it
    owned: set[str] = set()
    outputs = set(gm.graph.output_node().all_input_nodes)
    for site in ctx.planning_sites():
        st = SiteStats()
        for n in block_nodes(site):
            if n in covered_nodes:
                continue
            covered_nodes.add(n)
            owner[n] = site.key
            st.add_node(n)
        x = _block_input(site)
        st.io_bytes = _bytes(x.meta.get("val")) if x is not None else 0.0
        for p in sorted(site.all_params()):
            st.add_param(p, ph[p].meta["val"], p in synced, counted=p not in owned, used=bool(ph[p].users))
            owned.add(p)
        if site.kind is Kind.EMBEDDING:
            st.summed_into = summed.get(site.key)
            ids = site.node.args[1].meta.get("val")
            st.index_numel = ids.numel() if isinstance(ids, torch.Tensor) else 0
        if site.kind is Kind.ATTENTION:
            st.attn_out_bytes = _bytes(site.node.meta.get("val"))
        if site.kind is Kind.LOSS:
            st.loss_reductions = _loss_reductions(site)
            logits = site.node.args[0].meta.get("val")
            if isinstance(logits, torch.Tensor) and site.loss == "cross_entropy":
                st.ce_logits_fp32_bytes = logits.numel() * max(4, logits.element_size())  # at least fp32
                st.ce_fused_bytes = node_cost(site.node).bytes
                st.peak_bytes = CE_BACKWARD_BUFFERS * st.ce_logits_fp32_bytes
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
    batch = _batch_dependent(gm, set(ctx.captured.user_inputs))
    for n in gm.graph.nodes:
        if n.op == "call_function" and n not in covered_nodes:
            if n in batch and gathers_batch(n) and batch_local(n) is None:  # gathered on the data axes
                other.unsplit = other.unsplit or SiteStats()
                other.unsplit.add_node(n)
                other.unsplit_gather_bytes += [_bytes(a.meta.get("val")) for a in tensor_inputs(n) if a in batch]
                other.unsplit_ops += (f"{n.name} ({n.target})",)
            else:
                other.add_node(n)
    for name, fqn in ctx.captured.param_fqns.items():
        if name not in owned:
            other.add_param(name, ph[name].meta["val"], name in synced, used=bool(ph[name].users))
    other.boundary_grad_bytes = [_bytes(n.meta.get("val")) for n in boundaries if n.op != "placeholder"]
    other.boundary_reduce_bytes = [_reduced_bytes(n.meta.get("val"), getattr(ctx.captured, "precision", None))
                                   for n in boundaries if n.op != "placeholder"]
    seq_len = next((s.seq_len for s in ctx.of_kind(Kind.ATTENTION)), None)  # what sequence forms split
    other.boundary_on_sequence = [_on_sequence(n, seq_len) for n in boundaries if n.op != "placeholder"]
    other.boundary_moved_bytes = [_moved_to_parameters(n, set(ctx.captured.param_fqns), set(ctx.captured.user_inputs))
                                  for n in boundaries if n.op != "placeholder"]
    reduced = {p for st in (*stats.values(), other) for p, (_, used, sync) in st.param_facts.items() if used and sync}
    facts = _fsdp_group_facts(gm, reduced)
    groups = {p: fact for group in facts for p, fact in group.items()}
    regathered = sum(any(again for _, again in group.values()) for group in facts)
    for st in (*stats.values(), other):
        st.fsdp_groups = {p: groups[p] for p in st.param_facts if p in groups}
        st.fsdp_regathered = regathered
    attribute_saved(ctx, owner, stats, other)
    apply_float8(ctx, owner, stats)
    return stats, other, owned


def float8_shapes(lin) -> tuple[int, int, int]:
    """(M, K, N) of a linear site's GEMM: tokens, in features, out features."""
    out = lin.node.meta["val"]
    n = int(out.shape[-1])
    return out.numel() // n, int(lin.in_features), n


@dataclass(frozen=True)
class Float8Facts:
    """One linear of a site as `with_float8` prices it in fp8: its key, its GEMM's work entry (flops per call, bytes,
    dtype), (M, K, N), whether a tensor-parallel form makes it row-parallel, and its weight placeholder with the bytes
    per element FSDP would gather it in (None: no fp8 gather, under mixed precision the runtime's)."""

    key: str
    flops: float
    nbytes: float
    dtype: str
    mkn: tuple[int, int, int]
    row: bool
    weight: str | None
    item: int | None


def float8_members(site) -> list:
    """The linears a site's float8 choice indexes (`Candidate.float8`): its members, or a lone linear itself."""
    return site.members() or ([site] if site.kind is Kind.LINEAR else [])


def _float8_facts(ctx: PassContext, site, owner: dict[fx.Node, str], phs: dict[str, fx.Node]) -> dict[int, Float8Facts]:
    rows = {id(lin) for lin in _row_linears(site)}
    out = {}
    precision = getattr(ctx.captured, "precision", None)
    for i, lin in enumerate(float8_members(site)):
        if owner.get(lin.node) != site.key or lin.node.meta.get("val") is None \
                or lin.node.target is not torch.ops.aten.linear.default:
            continue
        c = node_cost(lin.node)
        if not c.flops:
            continue
        weight = lin.param.get("weight")
        item = None
        if weight is not None and precision is None:
            v = phs.get(weight)
            item = v.meta["val"].element_size() if v is not None else 2
        out[i] = Float8Facts(key=lin.key, flops=c.flops, nbytes=c.bytes, dtype=c.dtype, mkn=float8_shapes(lin),
                             row=id(lin) in rows, weight=weight, item=item)
    return out


def _add_float8(st: SiteStats, f: Float8Facts, recipe: str) -> None:
    """Move one linear's GEMMs to `recipe`'s `_scaled_mm` rate and record its scaling traffic on `st` (priced in
    `autopar.forms.blocks.finish`, which knows the form's split)."""
    import autopar.forms.float8 as f8
    w = st.work.get(("matmul", f.dtype, f.flops))
    if w is None:
        return
    w[0], w[1], w[2] = w[0] - f.flops, w[1] - f.nbytes, w[2] - 1
    if w[2] <= 0:
        del st.work[("matmul", f.dtype, f.flops)]
    g = st.work.setdefault(("matmul", f8.RATE_KEY[recipe], f.flops), [0.0, 0.0, 0])
    g[0], g[1], g[2] = g[0] + f.flops, g[1] + f.nbytes, g[2] + 1
    m, k, n = f.mkn
    per = f8.ACT_CAST_BYTES[recipe]
    st.float8_recipe = recipe
    st.float8_linears += 1
    st.float8_act_bytes += per * (m * k + m * n)
    st.float8_whole_bytes += per * (m * n if f.row else (m * k if f8.CASTS_GATHERED_INPUT[recipe] else 0.0))
    st.float8_weight_bytes += f8.WEIGHT_CAST_BYTES[recipe] * k * n
    st.float8_shapes.append((recipe, m, k, n, f.row, f.dtype))
    if f8.FP8_ALL_GATHER[recipe] and f.weight is not None and f.item is not None:
        st.float8_gathered[f.weight] = 1.0 / f.item


def with_float8(st: SiteStats, linears: tuple[int, ...], recipe: str) -> SiteStats:
    """`st` (a site's stats without float8) with its linears `linears` (indices into `float8_members`) in fp8 under
    `recipe`: the stats a candidate with `Candidate.float8` is priced on (`autopar.solver.site_cost`)."""
    assert st.float8_linears == 0, "float8 chosen twice: by ctx.float8 and by the candidate"
    out = dataclasses.replace(st, work={k: list(v) for k, v in st.work.items()}, float8_shapes=[],
                              float8_gathered={})
    for i in linears:
        _add_float8(out, st.float8_facts[i], recipe)
    return out


def apply_float8(ctx: PassContext, owner: dict[fx.Node, str], stats: dict[str, SiteStats]) -> None:
    """Price the linears `ctx.float8` names ({linear site key: recipe}) in fp8 (`_add_float8`), and record on every
    site what pricing its linears in fp8 needs (`SiteStats.float8_facts`: the candidates' float8, `with_float8`)."""
    chosen = getattr(ctx, "float8", None) or {}
    phs = {p.name: p for p in ctx.captured.gm.graph.find_nodes(op="placeholder")}
    for site in ctx.planning_sites():
        st = stats[site.key]
        st.float8_facts = _float8_facts(ctx, site, owner, phs)
        for f in st.float8_facts.values():
            if f.key in chosen:
                _add_float8(st, f, chosen[f.key])


def fsdp_groups(gm, params: set[str]) -> dict[str, tuple[float, bool]]:
    """The FSDP gather groups of the parameters (placeholders) `params` whose gradients FSDP reduces, as lowering
    makes them (`passes.lower.group_fsdp_gathers_pass`): those only one unit (`autopar.layers.fsdp_units`: a layer, or
    a recurrent module outside the layers) uses, per unit;
    the others per stretch between layers. Per parameter: (bytes of its group, whether the group is gathered again
    in backward: a layer's group, some parameter of which an op other than an embedding lookup reads, so autograd
    saves it; groups outside the layers stay gathered, as FSDP2's root)."""
    return {p: fact for facts in _fsdp_group_facts(gm, params) for p, fact in facts.items()}


def _fsdp_group_facts(gm, params: set[str]) -> list[dict[str, tuple[float, bool]]]:
    """`fsdp_groups` per group, in graph order."""
    layers = fsdp_units(gm, params)  # the layers, and the recurrent modules outside them
    order = {n: i for i, n in enumerate(gm.graph.nodes)}
    by_name = {n.name: n for n in gm.graph.nodes}
    starts = [min(order[by_name[x]] for x in layer.nodes) for layer in layers]
    owner = {p: layer.path for layer in layers for p in layer.params}
    members: dict[str, list] = {}
    for ph in gm.graph.find_nodes(op="placeholder"):
        if ph.name not in params or not ph.users:
            continue
        key = owner.get(ph.name)
        if key is None:
            first = min(order[u] for u in ph.users)
            key = f"({sum(s <= first for s in starts)})"
        members.setdefault(key, []).append(ph)
    out = []
    for phs in members.values():
        nbytes = sum(p.meta["val"].numel() * p.meta["val"].element_size() for p in phs)
        again = phs[0].name in owner and any("embedding" not in str(u.target) for p in phs for u in p.users)
        out.append({p.name: (float(nbytes), again) for p in phs})
    return out


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
                 cluster: Cluster, *, optimizer: str = "adam", seq_axes=(), zero: int = 0) -> "MeshCosting":
    """A MeshCosting whose gradient buckets hold every parameter's gradient: at least one bucket per dtype, and
    as many buckets as their bytes fill (`_num_buckets`)."""
    ph = {n.name: n for n in ctx.captured.gm.graph.nodes if n.op == "placeholder"}
    dtypes = {ph[p].meta["val"].dtype for p in ctx.captured.param_fqns}
    by_dtype: dict[torch.dtype, float] = {}
    for p in ctx.captured.param_fqns:
        by_dtype[ph[p].meta["val"].dtype] = by_dtype.get(ph[p].meta["val"].dtype, 0.0) + _bytes(ph[p].meta["val"])
    param_dtype = max(by_dtype, key=by_dtype.get) if by_dtype else torch.float32
    total = other.param_bytes + sum(st.param_bytes for st in stats.values())
    return MeshCosting(names=tuple(names), sizes=tuple(sizes), data_axes=tuple(data_axes), cluster=cluster,
                       optimizer=optimizer, param_dtype=dtype_name(param_dtype), seq_axes=tuple(seq_axes),
                       bucket_bytes=total, num_buckets=max(len(dtypes), _num_buckets(total)), zero=zero,
                       **precision_costing(ctx.captured, dtypes, optimizer))


def _num_buckets(total: float) -> int:
    """How many buckets `total` bytes of gradient fill: a first one of `FIRST_GRAD_BUCKET_BYTES`, then
    `GRAD_BUCKET_BYTES` each (`bucket_gradients_pass`)."""
    first = min(FIRST_GRAD_BUCKET_BYTES, GRAD_BUCKET_BYTES)
    return 1 if total <= first else 1 + math.ceil((total - first) / GRAD_BUCKET_BYTES)


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
    # the one rule (`cost_model.memory`): the master is what the optimizer updates, no further fp32 copy
    return float(element_state_bytes(master_dtype, optimizer=optimizer, master_weights=False).total)


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
    param_dtype: str = "float32"  # the parameters' dtype (the one holding most of their bytes)
    seq_axes: tuple[str, ...] = ()  # axes the sequence is split over (Ulysses / ring attention)
    bucket_bytes: float = 0.0  # gradient bytes of all parameters: the bucket whose per-byte rate sites pay
    num_buckets: int = 1  # gradient buckets per axis: one per dtype, as many as the gradients fill (`_num_buckets`)
    # mixed precision (`precision_costing`): state per byte of the graph's (param_dtype) parameters, and the bytes a
    # gradient reduction moves per such byte (reduce_dtype); None / 1.0: the model's dtypes
    state_bytes_per_param_byte: float | None = None
    grad_bytes_factor: float = 1.0
    # the named plan's ZeRO stage of the parameters over the data axes (`autopar.forms.zero`): 0 (dp / fsdp as the
    # candidates say), 1 (zero1: the step sharded) or 2 (zero2: FSDP-sharded, gathered copies persisting)
    zero: int = 0

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

    def scalar_reductions(self, count: int, *, fused: bool = False) -> tuple[float, float]:
        """(time, bytes sent) of `count` fp32 scalar all-reduces on every data and sequence axis. `fused`: the
        `count` scalars travel in one all-reduce when the batch is split on one axis (a mean cross-entropy's
        (sum, count): `passes.lower.fuse_loss_count_pass`)."""
        t = b = 0.0
        axes = self.data_axes + self.seq_axes
        if fused and count > 1 and len(axes) == 1:
            return self.collective("all_reduce", 4 * count, axes[0])
        for a in axes:
            ct, cb = self.collective("all_reduce", 4, a)
            t, b = t + count * ct, b + count * cb
        return t, b

    def state_factor(self) -> float:
        """Parameter + gradient + optimizer state, in multiples of the parameter bytes: under mixed precision, of the
        param_dtype bytes the graph holds (`state_bytes_per_element`: fp32 masters, 16 bytes per element with Adam);
        else `cost_model.memory.state_bytes_per_element` of the parameters' dtype without masters (a 16-bit model
        trained by torch.optim as it is keeps 16-bit states): 2 + the optimizer's states."""
        if self.state_bytes_per_param_byte is not None:
            return self.state_bytes_per_param_byte
        per = element_state_bytes(self.param_dtype, optimizer=self.optimizer, master_weights=False)
        return per.total / per.param

    def param_share(self) -> float:
        """Parameters' share of parameter + gradient + optimizer bytes (as `grad_share`)."""
        if self.state_bytes_per_param_byte is not None:
            return 1 / (2 + OPTIMIZER_STATES[self.optimizer])
        per = element_state_bytes(self.param_dtype, optimizer=self.optimizer, master_weights=False)
        return per.param / per.total

    def grad_share(self) -> float:
        """Gradients' share of parameter + gradient + optimizer bytes: under a policy one of the master's 2 + states
        parts (`state_bytes_per_element`), else as `cost_model.memory.state_bytes_per_element` says."""
        if self.state_bytes_per_param_byte is not None:
            return 1 / (2 + OPTIMIZER_STATES[self.optimizer])
        per = element_state_bytes(self.param_dtype, optimizer=self.optimizer, master_weights=False)
        return per.grad / per.total


# Tensor accesses per element of one optimizer step, as `torch.optim`'s multi-tensor ("foreach", the default on CUDA,
# and torchtitan's: `fused=False, foreach=True`) implementations run it, each `_foreach_*` op reading and writing whole
# tensors: AdamW (`torch/optim/adamw.py`, `_multi_tensor_adamw`) decays the parameters (mul_: 2), updates the first
# moment (lerp_: m, g -> m, 3) and the second (mul_ 2, addcmul_ v, g, g -> v 4), takes sqrt (2), divides by the bias
# correction (2), adds eps (2) and updates the parameters (addcdiv_: p, m, denom -> p, 4): 21 accesses over its 4
# tensors (parameter, gradient, 2 moments); SGD add_(p, g -> p): 3 over 2; with momentum mul_ 2 + add_ 3 + add_ 3
# = 8 over 3.
OPTIMIZER_ACCESSES = {"adam": 21 / 4, "adamw": 21 / 4, "sgd": 3 / 2, "sgd_momentum": 8 / 3}


def optimizer_step_s(costs, optimizer: str, cluster: Cluster) -> float:
    """The optimizer step on this device (`autopar.timeline`: on the compute stream after the last reduction):
    memory-bound elementwise passes over what the structures hold of parameters, gradients and optimizer state
    (`Cost.memory_bytes` less activations and FSDP's gathered copies: its local shard), `OPTIMIZER_ACCESSES` times
    their bytes at the cluster's elementwise rate (`kernel_time_s`, "vector")."""
    state = sum(max(0.0, c.memory_bytes - c.act_bytes - c.transient_bytes) for c in costs)
    if state <= 0 or optimizer not in OPTIMIZER_ACCESSES:
        return 0.0
    return kernel_time_s("vector", 0.0, OPTIMIZER_ACCESSES[optimizer] * state, "float32", cluster)


def compute_s(st: SiteStats, divisor: float, cluster: Cluster) -> float:
    """Forward + backward (3x the forward work) of a site's nodes with the work split over `divisor` ranks:
    by op kind when the cluster measured kernel rates (every op runs on every rank: the dispatch overhead
    is not divided), else the roofline of all its FLOPs and activation bytes. A calibrated cluster
    (`Cluster.calibration`, `autopar.tune`) prices each kind apart and scales it by its measured factor."""
    cal = cluster.calibration
    if has_kernel_rates(cluster) or cal is not None:
        rates = has_kernel_rates(cluster)
        return sum((cal.compute.get(kind, 1.0) if cal is not None else 1.0)
                   * (kernel_time_s(kind, 3 * flops / divisor, 3 * nbytes / divisor, compute_dtype(dtype, cluster),
                                    cluster, num_ops=3 * ops,
                                    flops_per_call=size / divisor if size and kind == "matmul" else None,
                                    seq_len=size if size and kind == "sdpa" else None)
                      if rates else compute_time_s(3 * flops / divisor, 3 * nbytes / divisor,
                                                   compute_dtype(dtype, cluster), cluster))
                   for (kind, dtype, size), (flops, nbytes, ops) in st.work.items())
    return compute_time_s(3 * st.flops / divisor, 3 * st.act_bytes / divisor, compute_dtype(st.compute_dtype, cluster),
                          cluster)


def compute_dtype(dtype: str, cluster: Cluster) -> str:
    if dtype in cluster.peak_flops:
        return dtype
    return "float32" if "float32" in cluster.peak_flops else next(iter(cluster.peak_flops))


