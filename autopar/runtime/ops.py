"""Parallel forms of ops whose sharded version is not the op itself on local shards.

- `vocab_parallel_embedding`: the weight is sharded on the vocabulary (rows); ids outside this
  rank's rows look up row 0 and are zeroed, so the output is Partial (summed by the caller's
  all-reduce or reduce-scatter); the `padding_idx` row gets no gradient. Backward needs no
  communication.
- `vocab_parallel_cross_entropy`: logits sharded on the vocabulary; 3 all-reduces of b*s fp32
  values forward (max, target logit, sum of exps), none backward (Megatron's
  `_VocabParallelCrossEntropy`). Returns per-token losses, replicated over the vocab axis.
- Both check their ids against the whole vocabulary first and raise `IndexError` as one device
  does (ids are global vocabulary ids on every rank, so the check needs no collective; it costs
  one min/max reduction and, on an accelerator, one host sync): an out-of-range id would otherwise
  match no rank's rows and quietly look up (or score) zeros.
- `loss_reduce`: sum / mean of per-token losses where the batch is sharded: the mean divides by the
  *global* count of valid tokens (all-reduced, no gradient), so the result is Partial over the
  batch axes and the all-reduce that follows gives exactly the single-device mean. The losses'
  ops issue the count's all-reduce before they compute the losses, and wait for it after. Where the
  partial loss's all-reduce follows directly on one axis (`passes.lower.fuse_loss_count_pass`),
  `cross_entropy_sum_count` returns (sum, count) instead and that one all-reduce carries both
  (`sum_over_count` divides after it).
- `gqa_kv_heads`: the KV heads that this rank's query heads attend to, when KV heads are
  replicated because there are fewer of them than the tensor-parallel degree.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.distributed._local_tensor import maybe_run_for_local_tensor

from autopar.mesh import AxisRef, resolve_axis
from autopar.runtime.collectives import _c10d, _raw_all_reduce, _record, _wait, take_ridden, take_riding


def _check_ids(ids: torch.Tensor, vocab: int, ignore_index: int | None = None) -> None:
    """Raise `IndexError` with one device's words if an id (other than `ignore_index`) is outside [0, vocab)."""
    valid = ids if ignore_index is None else ids[ids != ignore_index]
    if valid.numel() == 0:
        return
    lo, hi = torch.aminmax(valid)
    if bool((lo < 0) | (hi >= vocab)):  # one host sync
        if ignore_index is None:
            raise IndexError("index out of range in self")  # F.embedding's words
        bad = valid[(valid < 0) | (valid >= vocab)][0]
        raise IndexError(f"Target {int(bad)} is out of bounds.")  # F.cross_entropy's words


@maybe_run_for_local_tensor
def _vocab_local_ids(ids: torch.Tensor, rank: int, rows: int, vocab: int):
    _check_ids(ids, vocab)
    start = rank * rows
    outside = (ids < start) | (ids >= start + rows)
    return (ids - start).masked_fill(outside, 0), outside


def vocab_parallel_embedding(weight: torch.Tensor, ids: torch.Tensor, axis: AxisRef | str,
                             padding_idx: int | None = -1) -> torch.Tensor:
    """This rank's rows (V/t, h) of the table, global ids -> the partial lookup (rows of other ranks are zero).
    `padding_idx` (a global id, negative for none): its row's value is looked up but gets no gradient, as
    `F.embedding(..., padding_idx=...)` does on one device."""
    axis = resolve_axis(axis)
    local_ids, outside = _vocab_local_ids(ids, axis.local_rank(), weight.shape[0], weight.shape[0] * axis.size)
    out = F.embedding(local_ids, weight)
    if padding_idx is not None and padding_idx >= 0:
        out = torch.where((ids == padding_idx).unsqueeze(-1), out.detach(), out)
    return out.masked_fill(outside.unsqueeze(-1), 0.0)


@maybe_run_for_local_tensor
def _vocab_local_targets(target: torch.Tensor, rank: int, cols: int, ignore_index: int, vocab: int):
    _check_ids(target, vocab, ignore_index)
    start = rank * cols
    outside = (target < start) | (target >= start + cols) | (target == ignore_index)
    return (target - start).masked_fill(outside, 0), outside


class _VocabParallelCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, target, axis, ignore_index):
        # logits: (N, V/t) local columns, target: (N,) global class ids
        ctx.in_dtype = logits.dtype
        logits = logits.to(torch.promote_types(logits.dtype, torch.float32))  # at least fp32
        local_max = logits.amax(dim=-1)
        global_max = _raw_all_reduce(local_max, axis, op="max")
        shifted = logits - global_max.unsqueeze(-1)
        local_t, outside = _vocab_local_targets(target, axis.local_rank(), logits.shape[-1], ignore_index,
                                               logits.shape[-1] * axis.size)
        target_logit = shifted.gather(-1, local_t.unsqueeze(-1)).squeeze(-1).masked_fill(outside, 0.0)
        target_logit = _raw_all_reduce(target_logit, axis)
        exp = shifted.exp()
        sum_exp = _raw_all_reduce(exp.sum(dim=-1), axis)
        ignored = target == ignore_index
        loss = (sum_exp.log() - target_logit).masked_fill(ignored, 0.0)
        ctx.save_for_backward(exp.div_(sum_exp.unsqueeze(-1)), local_t, outside, ignored)
        return loss

    @staticmethod
    def backward(ctx, g):
        softmax, local_t, outside, ignored = ctx.saved_tensors
        g = g.masked_fill(ignored, 0.0)
        grad = softmax * g.unsqueeze(-1)
        onehot = torch.zeros_like(grad).scatter_(-1, local_t.unsqueeze(-1), 1.0)
        grad = grad - onehot * (g * (~outside)).unsqueeze(-1)
        return grad.to(ctx.in_dtype), None, None, None


def vocab_parallel_cross_entropy(logits: torch.Tensor, target: torch.Tensor, axis: AxisRef,
                                 ignore_index: int = -100) -> torch.Tensor:
    """Per-token losses (fp32) of vocab-sharded logits (N, V/t) against global targets (N,)."""
    axis = resolve_axis(axis)
    return _VocabParallelCrossEntropy.apply(logits, target, axis, ignore_index)


class _Count:
    """The global count of valid tokens for a mean loss, its all-reduce over the first count axis issued when made
    (it needs only the targets, so it runs while the losses are computed) and waited for by `value`."""

    def __init__(self, target: torch.Tensor, ignore_index: int, count_axes: tuple[AxisRef, ...],
                 dtype: torch.dtype):
        with torch.no_grad():
            self.count = (target != ignore_index).sum().to(dtype)
            self.rest = tuple(count_axes)
            self.pending = False
            if self.rest:
                axis, self.rest = resolve_axis(self.rest[0]), self.rest[1:]
                _record("all_reduce", axis, self.count, self.count.numel(), False)
                self.count, self.pending = _c10d.all_reduce(self.count, "sum", axis.group_name), True

    def value(self) -> torch.Tensor:
        with torch.no_grad():
            count = _wait(self.count) if self.pending else self.count
            for axis in self.rest:
                count = _raw_all_reduce(count, resolve_axis(axis))
        return count


def loss_reduce(losses: torch.Tensor, target: torch.Tensor, reduction: int, ignore_index: int,
                count_axes: tuple[AxisRef, ...], out_dtype: torch.dtype, count: _Count | None = None) -> torch.Tensor:
    """Reduce per-token losses like `F.cross_entropy` does, with the count taken over the global batch (`count`:
    issued before the losses were computed; made here otherwise)."""
    if reduction == 0:  # none
        return losses.to(out_dtype)
    total = losses.sum()
    if reduction == 2:  # sum
        return total.to(out_dtype)
    count = count if count is not None else _Count(target, ignore_index, count_axes, total.dtype)
    return (total / count.value()).to(out_dtype)


def _early_count(target: torch.Tensor, reduction: int, ignore_index: int, count_axes: tuple[AxisRef, ...],
                 dtype: torch.dtype) -> _Count | None:
    return _Count(target, ignore_index, count_axes, dtype) if reduction == 1 else None


def cross_entropy_sharded_batch(logits: torch.Tensor, target: torch.Tensor, reduction: int, ignore_index: int,
                                label_smoothing: float, count_axes: tuple[AxisRef, ...]) -> torch.Tensor:
    """`aten.cross_entropy_loss` on a batch-sharded (N, C) input: local sum / global valid count."""
    count = _early_count(target, reduction, ignore_index, count_axes, logits.dtype)
    losses = F.cross_entropy(logits, target, reduction="none", ignore_index=ignore_index,
                             label_smoothing=label_smoothing)
    return loss_reduce(losses, target, reduction, ignore_index, count_axes, logits.dtype, count)


def cross_entropy_sum_count(logits: torch.Tensor, target: torch.Tensor, ignore_index: int,
                            label_smoothing: float) -> torch.Tensor:
    """A mean `aten.cross_entropy_loss` on a batch-sharded (N, C) input whose loss is all-reduced next
    (`passes.lower.fuse_loss_count_pass`): this rank's (sum of the per-token losses, count of valid tokens) as one
    2-element tensor, partial, so the loss's all-reduce carries the count too (one all-reduce, not the count's and
    then the loss's); `sum_over_count` divides after it. The count takes no gradient."""
    losses = F.cross_entropy(logits, target, reduction="none", ignore_index=ignore_index,
                             label_smoothing=label_smoothing)
    total = losses.sum()
    with torch.no_grad():
        count = (target != ignore_index).sum().to(total.dtype)
    pair = torch.stack([total, count])
    agreement = take_riding()
    if agreement is None:
        return pair
    # the call's agreement rides along (`collectives.ride_on_loss`): one fp64 all-reduce of (sum, count, its row)
    return torch.cat([pair.to(torch.float64), agreement.payload()])


def sum_over_count(sum_count: torch.Tensor, out_dtype: torch.dtype) -> torch.Tensor:
    """The global (sum, count) pair of `cross_entropy_sum_count`, all-reduced: the mean loss, replicated. With the
    call's agreement riding on it (more than 2 entries), the summed row is checked first: ranks that differ, or one
    that failed, raise here on every rank, before any of this call's results is returned."""
    if sum_count.numel() > 2:
        agreement = take_ridden()
        assert agreement is not None, "a summed agreement row without its agreement"
        agreement.check(sum_count.detach().tolist())
    return (sum_count[0] / sum_count[1]).to(out_dtype)


def riding_loss_axis(gm) -> str | None:
    """The mesh axis (its graph key) of the fused loss all-reduce that this call's agreement can ride on, or None.
    It can where the program's first `cross_entropy_sum_count` (the one that takes the agreement) is followed by its
    all-reduce with only ATen ops between them (no collective slips in between: a collective issued BEFORE the pair
    meets the waiting agreement first and all-reduces it alone, on every rank alike)."""
    from autopar.runtime import collectives as C
    nodes = list(gm.graph.nodes)
    first = next((i for i, n in enumerate(nodes) if n.op == "call_function" and n.target is cross_entropy_sum_count),
                 None)
    if first is None or len(nodes[first].users) != 1:
        return None
    (ar,) = nodes[first].users
    if ar.target is not C.all_reduce or len(ar.args) != 2 or ar.kwargs:
        return None
    for n in nodes[first + 1:nodes.index(ar)]:
        if n.op == "call_function" and not isinstance(n.target, torch._ops.OpOverload):
            return None
        if n.op in ("call_module", "call_method"):
            return None
    return ar.args[1] if isinstance(ar.args[1], str) else None


def vocab_parallel_cross_entropy_loss(logits: torch.Tensor, target: torch.Tensor, axis: AxisRef, reduction: int,
                                      ignore_index: int, count_axes: tuple[AxisRef, ...]) -> torch.Tensor:
    count = _early_count(target, reduction, ignore_index, count_axes,
                         torch.promote_types(logits.dtype, torch.float32))  # the per-token losses' dtype
    losses = vocab_parallel_cross_entropy(logits, target, axis, ignore_index)
    return loss_reduce(losses, target, reduction, ignore_index, count_axes, logits.dtype, count)


def sum_div(x: torch.Tensor, dims, keepdim: bool, divisor: int) -> torch.Tensor:
    """A mean over dims that are sharded: local sum divided by the global element count (Partial)."""
    if dims is None:
        return x.sum() / divisor
    return x.sum(dims, keepdim=keepdim) / divisor


def mse_loss_sharded(a: torch.Tensor, b: torch.Tensor, reduction: int, divisor: int) -> torch.Tensor:
    sq = (a - b).pow(2)
    if reduction == 0:
        return sq
    return sq.sum() / (divisor if reduction == 1 else 1)


@maybe_run_for_local_tensor
def _kv_head_index(rank: int, q_heads_local: int, group: int, num_kv_heads: int, device: torch.device):
    first = rank * q_heads_local // group
    last = ((rank + 1) * q_heads_local - 1) // group
    return torch.arange(first, last + 1, device=device).clamp_(max=num_kv_heads - 1)


def gqa_kv_heads(kv: torch.Tensor, axis: AxisRef, num_q_heads: int) -> torch.Tensor:
    """(B, Hkv, S, D) replicated -> the KV heads this rank's query-head shard needs."""
    axis = resolve_axis(axis)
    num_kv = kv.shape[1]
    q_local = num_q_heads // axis.size
    index = _kv_head_index(axis.local_rank(), q_local, num_q_heads // num_kv, num_kv, kv.device)
    return kv.index_select(1, index)


# ----------------------------------------------------------------------------- dropout

# Megatron's RNG-tracker semantics: a dropout on a value replicated over an axis draws the same mask
# on every rank of that axis (replicas stay identical); on a sharded value each shard draws its own.
# Masks come from a generator seeded by (stream seed agreed across ranks, step, node, shard coordinates).
_RNG_STREAMS: dict[str, list[int]] = {}  # stream key -> [seed, step]


def new_rng_stream(key: str, seed: int) -> None:
    _RNG_STREAMS[key] = [seed, 0]


def advance_rng_stream(key: str) -> None:
    _RNG_STREAMS[key][1] += 1


@maybe_run_for_local_tensor
def _dropout_keep(x: torch.Tensor, p: float, seed: int) -> torch.Tensor:
    g = torch.Generator(device=x.device).manual_seed(int(seed) % (2**63 - 1))
    return torch.rand(x.shape, generator=g, device=x.device, dtype=torch.float32) >= p


def parallel_dropout(x: torch.Tensor, p: float, train: bool, stream: str, node_index: int,
                     sharded_axes: tuple[str, ...]) -> torch.Tensor:
    if not train or p == 0.0:
        return x
    seed, step = _RNG_STREAMS[stream]
    seed = seed * 1_000_003 + step * 7919 + node_index * 104_729
    for i, key in enumerate(sharded_axes):
        axis = resolve_axis(key)
        seed = seed + (axis.local_rank() + 1) * 15_485_863 * (i + 1)
    keep = _dropout_keep(x, p, seed)
    return x * keep.to(x.dtype) / (1.0 - p)
