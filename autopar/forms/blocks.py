"""Cost pieces several forms share: a structure's parameters over the data axes, a tensor-parallel block,
an MoE block. Each form's module says which it uses and what it adds."""

from __future__ import annotations

from autopar.estimate import Cost, MeshCosting, SiteStats, compute_s
from autopar.forms import dp, fsdp
from autopar.forms.base import Candidate
from autopar.sites import MoeSite
from cost_model.analytical import compute_time_s, send_bytes

COUNT_ITEMSIZE = 8  # the per-expert row counts expert parallelism exchanges are int64 (`autopar.runtime.moe`)


class Comms:
    """Accumulates (seconds, bytes sent) of a form's own collectives on one axis."""

    def __init__(self, mc: MeshCosting, axis: str | None):
        self.mc, self.axis, self.time_s, self.bytes = mc, axis, 0.0, 0.0

    def add(self, kind: str, nbytes: float, interval_s: float | None = None, *, axis: str | None = None) -> None:
        t, b = self.mc.collective(kind, nbytes, axis or self.axis, interval_s)
        self.time_s, self.bytes = self.time_s + t, self.bytes + b


def finish(st: SiteStats, cand: Candidate, mc: MeshCosting, *, compute: float, comms: Comms | None, act: float,
           param_split: int = 1, backward_s: float | None = None, peak: float = 0.0, hidden: float = 0.0) -> Cost:
    """A structure's cost: its compute and collectives, plus its parameters over the data axes (FSDP or the
    data-parallel bucket, their state) and the loss' scalar reductions. `param_split`: the ranks its
    parameters are divided over by the form itself; `act`: its saved activations on this rank; `peak`: what it
    holds only while it runs (`Cost.peak_bytes`); `hidden`: of its collectives, what its weight gradients cover
    (`Cost.hidden_s`, `weight_grad_cover_s`)."""
    backward_s = 2 * compute / 3 if backward_s is None else backward_s
    f8_s, f8_t, f8_b = float8_cost(st, cand, mc, param_split)
    compute += f8_s
    bucket = 0.0  # under FSDP, the few parameters it leaves whole are bucketed: not counted
    gather = regather = reducing = 0.0
    step_t = step_b = 0.0  # zero1's gather after the step (`Cost.step_gather_s`)
    if cand.fsdp:
        t, b, state, gathered = fsdp.params_cost(mc, st, param_split, backward_s)
        reducing = fsdp.reduce_transient_bytes(mc, st, param_split)
        gather = min(t, fsdp.gather_s(mc, st, param_split))
        regather = min(t - gather, fsdp.regather_s(mc, st, param_split))
        compute += fsdp.copy_s(mc, st, param_split)
    else:
        t, b = dp.grad_sync(mc, st.synced_param_bytes / param_split)
        step_t, step_b = dp.step_gather(mc, st.param_bytes / param_split)
        state, gathered = dp.state_bytes(mc, st.param_bytes / param_split), 0.0
        bucket = dp.bucket_bytes(mc, st.param_bytes / param_split)
    # a loss not split over model axes (the replicated cross-entropy, not the vocab-parallel one) sends its mean's
    # (sum, count) in one all-reduce (`passes.lower.fuse_loss_count_pass`)
    lr_t, lr_b = mc.scalar_reductions(st.loss_reductions, fused=not cand.axes)
    own_t, own_b = (comms.time_s, comms.bytes) if comms else (0.0, 0.0)
    hidden = min(hidden, (own_t + lr_t) / 2, backward_s)  # within the timeline's backward half (`autopar.timeline`)
    own_t, own_b = own_t + f8_t, own_b + f8_b
    return Cost(compute_s=compute, comm_s=own_t + t + lr_t + step_t, comm_bytes=own_b + b + lr_b + step_b,
                memory_bytes=state + act,
                act_bytes=act, transient_bytes=gathered, peak_bytes=peak, bucket_bytes=bucket, gather_s=gather,
                reduce_s=t - gather - regather, regather_s=regather, hidden_s=hidden,
                reduce_transient_bytes=reducing, step_gather_s=step_t)


def float8_cost(st: SiteStats, cand: Candidate, mc: MeshCosting, param_split: int) -> tuple[float, float, float]:
    """(compute seconds, collective seconds, bytes sent) of a structure's float8 scaling (`autopar.forms.float8`): the
    activations' and output gradients' amax + cast passes split like its work (over the data ranks and the form's
    `param_split`), but those the form leaves whole on each rank (`SiteStats.float8_whole_bytes`) split over the data
    ranks only; the weights' on this rank's share (`param_split`), and on the FSDP shard under tensorwise (cast before
    the fp8 all-gather). The amax all-reduces autopar's runtime issues so that every rank scales as one device does
    (`autopar.forms.float8.CASTS`): on each data axis those over the tokens, on a tensor-parallel form's axis those
    over the features it splits (a column-parallel linear's N, a row-parallel one's K). A rowwise linear whose
    share on this rank is `skinny` (`autopar.forms.float8.skinny`: tensor parallelism divides its N or K) runs its
    GEMMs at the high-precision rate: the difference is added to the compute."""
    if not st.float8_linears:
        return 0.0, 0.0, 0.0
    from autopar.forms.float8 import FP8_ALL_GATHER, amax_reductions, cast_s, skinny_s
    whole = st.float8_whole_bytes if param_split > 1 else 0.0
    act = (st.float8_act_bytes - whole) / (mc.dp * param_split) + whole / mc.dp
    weight = st.float8_weight_bytes / param_split / (mc.dp if cand.fsdp and FP8_ALL_GATHER[st.float8_recipe] else 1)
    t = b = slow = 0.0
    for recipe, m, k, n, row, dtype in st.float8_shapes:  # amaxes all-reduced where their dims are split (the runtime's)
        tp = param_split > 1 and cand.axis is not None
        local = {"m": m / mc.dp, "k": k / param_split if row else k, "n": n if row else n / param_split}
        slow += skinny_s(local["m"], local["k"], local["n"], recipe, mc.cluster, dtype)  # rowwise on skinny shares
        splits = [(a, "m") for a in mc.data_axes if mc.size(a) > 1] + ([(cand.axis, "k" if row else "n")] if tp else [])
        for axis, dim in splits:
            for numel in amax_reductions(recipe, dim, local):
                ct, cb = mc.collective("all_reduce", 4 * numel, axis)
                t, b = t + ct, b + cb
    if cand.fsdp:  # each weight shard's amax before its fp8 gather (not an uneven one's: gathered in its dtype)
        for _ in (w for w in st.float8_gathered if w not in st.fsdp_pad):
            for axis in (a for a in mc.data_axes if mc.size(a) > 1):
                ct, cb = mc.collective("all_reduce", 4.0, axis)
                t, b = t + ct, b + cb
    return cast_s(act + weight, mc.cluster) + slow, t, b


def replicated(st: SiteStats, cand: Candidate, mc: MeshCosting) -> Cost:
    """Every rank runs the structure on its share of the tokens, parameters whole."""
    return finish(st, cand, mc, compute=compute_s(st, mc.dp, mc.cluster), comms=None, act=st.saved_bytes / mc.dp,
                  peak=st.peak_bytes / mc.dp)


def tensor_parallel_volume_bytes(block_input_bytes: float, t: int) -> float:
    """Bytes each rank sends per tensor-parallel block, forward + backward: two all-reduces of its input's size
    (a transformer layer, attention + MLP, sends twice that: `8(t-1)/t · bsh`)."""
    return 2 * send_bytes("all_reduce", block_input_bytes, t)


def weight_grad_cover_s(st: SiteStats, columns, compute: float, comm_s: float) -> float:
    """Of `comm_s`, the backward collective of the input gradient of the column-parallel linears `columns`
    (LinearSites sharing one input), what runs under their weight gradients: the runtime issues it once their input
    gradient is computed and computes the weight gradients meanwhile (Megatron's async communication,
    `autopar.runtime.collectives.grad_all_reduce_linears`, `regather_linears`). A weight gradient is a matmul of its
    linear's forward FLOPs; of the structure's `compute` (forward + backward, 3x its forward), the linears' share of
    its forward FLOPs / 3. Under sequence parallelism the collective is a reduce-scatter (half the all-reduce), and
    the re-gather (priced by the norm) runs under the input gradient's matmuls: this prices both as one all-reduce
    under the weight gradients."""
    flops = sum(2 * lin.node.meta["val"].numel() * lin.in_features for lin in {id(c): c for c in columns}.values())
    if not flops or not st.flops:
        return 0.0
    return min(comm_s, compute / 3 * min(1.0, flops / st.flops))


def tensor_parallel(st: SiteStats, cand: Candidate, mc: MeshCosting, columns=()) -> Cost:
    """A Megatron block (attention by heads, MLP colwise -> rowwise) on `cand.axis` of size t: work and
    parameters / t; one all-reduce of the block's output forward (the row-parallel sum) and one of its
    input's gradient backward (the column-parallel f), each the size of the block input, the latter under the
    weight gradients of its column-parallel linears `columns` (`weight_grad_cover_s`); activations inside the
    block / t (what it saves is produced inside it: its input is the norm's, `attribute_saved`)."""
    t = mc.size(cand.axis)
    compute = compute_s(st, mc.dp * t, mc.cluster)
    comms = Comms(mc, cand.axis)
    comms.add("all_reduce", st.io_bytes / mc.dp, compute / 3)
    forward_s = comms.time_s
    comms.add("all_reduce", st.io_bytes / mc.dp, 2 * compute / 3)
    hidden = weight_grad_cover_s(st, columns, compute, comms.time_s - forward_s)
    return finish(st, cand, mc, compute=compute, comms=comms, act=st.saved_bytes / mc.dp / t, param_split=t,
                  hidden=hidden)


def moe(site: MoeSite, st: SiteStats, cand: Candidate, mc: MeshCosting, *, split: int, on_data: bool) -> Cost:
    """An MoE block: router + experts (+ aux loss in `st`), the experts (or their features) split `split` ways.

    Expert work per token is 2 FLOPs per expert weight element for each of its k experts; routing is
    assumed balanced. With the experts on a data axis (`on_data`: tokens sharded there) each token's k rows
    go out and back by all-to-all, forward and backward: 4 all-to-alls of k*T*h*(ep-1)/ep (DESIGN.md §3),
    after one all-to-all of the per-expert row counts (the splits; int64). On a model axis (tokens
    replicated) each rank runs its experts (or its share of every expert's features) on every token and
    the output is all-reduced (forward), and backward the input's gradient and the routing weights'
    (T, k) gradient, which each rank holds partially. Expert gradients are reduced over the data axes
    the experts are not split over."""
    T, H, k, E = site.tokens, site.hidden, site.top_k, site.num_experts
    item = site.itemsize
    per_expert = site.expert_numel / E
    ffn = per_expert / (3 * H)  # a gated MLP expert holds 3*H*F weights
    tokens = T / mc.dp  # this rank's tokens
    work = 2 * T * k * per_expert / mc.dp / (1 if on_data else split)
    dtype = site.dtype if site.dtype in mc.cluster.peak_flops else "float32"
    routed_bytes = tokens * k * (2 * H + 3 * ffn) * item / (1 if on_data else split)  # expert activations moved
    # saved per routed row (`autopar.runtime.moe`): the expert's input rows (H), its gate output, their SiLU, the up
    # output and their product (4F), and its output rows, kept for the routing weights' gradient (H)
    routed_saved = tokens * k * (2 * H + 4 * ffn) * item / (1 if on_data else split)
    compute = compute_s(st, mc.dp, mc.cluster) + compute_time_s(3 * work, 3 * routed_bytes, dtype, mc.cluster)
    comms = Comms(mc, cand.axis)
    if split > 1 and on_data:
        comms.add("all_to_all", E * COUNT_ITEMSIZE)  # rows per (rank, expert): the dispatch's splits
        for _ in range(4):
            comms.add("all_to_all", tokens * k * H * item)
    elif split > 1:  # every token on every rank: partial outputs all-reduced, and input and routing weight grads
        for _ in range(2):
            comms.add("all_reduce", tokens * H * item)
        comms.add("all_reduce", tokens * k * item)
    expert_bytes = site.expert_numel * item
    dense_bytes = max(st.param_bytes - expert_bytes, 0.0)
    local = dense_bytes + expert_bytes / split
    gs_t, gs_b = dp.grad_sync(mc, expert_bytes / split,
                              axes=tuple(a for a in mc.data_axes + mc.seq_axes if a != cand.axis))
    d_t, d_b = dp.grad_sync(mc, dense_bytes)
    state = local * mc.state_factor() / (mc.dp if cand.fsdp else 1) + (local if cand.fsdp else 0.0)
    return Cost(compute_s=compute, comm_s=comms.time_s + gs_t + d_t, comm_bytes=comms.bytes + gs_b + d_b,
                memory_bytes=state + st.saved_bytes / mc.dp + routed_saved, act_bytes=st.saved_bytes / mc.dp + routed_saved,
                transient_bytes=local if cand.fsdp else 0.0, bucket_bytes=0.0 if cand.fsdp else dp.bucket_bytes(mc, local))
