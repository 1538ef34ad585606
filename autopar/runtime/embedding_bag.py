"""EmbeddingBag over a 2-D input: captured as one op over the rows, so that data parallelism splits it.

**Why.** `F.embedding_bag` with a 2-D input `(B, bag)` (one bag per row) flattens it to 1-D indices and makes
offsets `arange(0, B * bag, bag)`, a factory of the global batch size, before the ATen op
(`aten._embedding_bag`). On a data axis that graph cannot run on local rows: the offsets' length is the global
batch, the ATen op has no sharding rule, and the batch-local check (`passes.batch_local`) cannot see rows in a
1-D index tensor, so the batch was gathered and every rank ran the whole bag.

**What.** While capturing (`embedding_bags_by_rows`, entered by `autopar.capture`), `F.embedding_bag` (which
`nn.EmbeddingBag.forward` calls) traces a 2-D call as `autopar::embedding_bag_rows(weight, input, per_sample_weights,
mode, padding_idx) -> (B, D)`, whose fake kernel gives `(rows of input, D)` and whose kernel is torch's own
`F.embedding_bag`. Output row b depends only on input row b (and on `per_sample_weights` row b), and the weight's
gradient is the sum over rows of per-row gradients, for every mode (sum, mean, max) and `padding_idx`: the op
is batch-local, and it is not special-cased for that: like any op without a rule, capture's numerical row check
(`passes.batch_local`) finds so and the lowering runs it on the local rows (its weight replicated on the data
axis, its gradient a partial sum that dp all-reduces; fsdp gathers it as any parameter; under a tensor-parallel
plan, where no input arrives split on its batch dim, it is replicated, as the ATen op was). Its local form
(`passes.local_forms`) calls `F.embedding_bag` itself on the local tensors, under autograd: the backward is
torch's (`aten._embedding_bag_backward`, max mode's argmax scatter included), and FLOP counters see ATen ops.

Chosen over a sharding rule for `aten._embedding_bag` on the flattened form (recognising `view(-1)` of a (B, bag)
input and `arange(0, B*bag, bag)` offsets, then rewriting the arange to local sizes): that would need a pattern
matcher over three nodes, a local form for the factory, and agreement with how views of Shard(0) flatten, for a
result the row check already gives an op that keeps the rows visible.

**Not intercepted** (torch's own path is traced, gathered on a data axis, exact): 1-D indices with user offsets
(bags of varying length: whether a rank's bags are its rows depends on the offsets' values, not on shapes);
`scale_grad_by_freq` (the weight's gradient is scaled by each index's frequency in the whole batch: it mixes
rows); `max_norm` (renormalises the weight in place in forward); `sparse=True` (sparse gradients);
`include_last_offset` (only meaningful with offsets).
"""

from __future__ import annotations

import contextlib

import torch
import torch.nn.functional as F

_EMBEDDING_BAG = F.embedding_bag  # torch's own, kept before any patch


def by_rows(input, weight, offsets=None, max_norm=None, norm_type=2.0, scale_grad_by_freq=False, mode="mean",
            sparse=False, per_sample_weights=None, include_last_offset=False, padding_idx=None) -> bool:
    """Whether this `F.embedding_bag` call is the per-row form the op captures (the module docstring's list)."""
    return (isinstance(input, torch.Tensor) and isinstance(weight, torch.Tensor) and input.dim() == 2
            and not input.is_floating_point() and weight.dim() == 2 and weight.is_floating_point()
            and offsets is None and max_norm is None and not scale_grad_by_freq and not sparse
            and not include_last_offset and mode in ("sum", "mean", "max")
            and (per_sample_weights is None or mode == "sum"))


def embedding_bag_local(weight: torch.Tensor, input: torch.Tensor, per_sample_weights: torch.Tensor | None,
                        mode: str, padding_idx: int | None) -> torch.Tensor:
    """The lowered op: torch's `F.embedding_bag` on the tensors it gets (a rank's rows), under autograd."""
    return _EMBEDDING_BAG(input, weight, mode=mode, per_sample_weights=per_sample_weights, padding_idx=padding_idx)


@torch.library.custom_op("autopar::embedding_bag_rows", mutates_args=())
def embedding_bag_rows(weight: torch.Tensor, input: torch.Tensor, per_sample_weights: torch.Tensor | None,
                       mode: str, padding_idx: int | None) -> torch.Tensor:
    with torch.no_grad():
        return embedding_bag_local(weight, input, per_sample_weights, mode, padding_idx).clone()


@embedding_bag_rows.register_fake
def _(weight, input, per_sample_weights, mode, padding_idx):
    return weight.new_empty((input.shape[0], weight.shape[1]))


def _setup(ctx, inputs, output):
    weight, input, per_sample_weights, mode, padding_idx = inputs
    ctx.mode, ctx.padding_idx, ctx.has_psw = mode, padding_idx, per_sample_weights is not None
    ctx.save_for_backward(weight, input, per_sample_weights)


def _backward(ctx, grad):
    """Torch's backward of the same call (recomputed here: only an unlowered graph runs this; the lowered program
    calls `embedding_bag_local` under autograd)."""
    weight, input, psw = ctx.saved_tensors
    weight = weight.detach().requires_grad_(True)
    psw = psw.detach().requires_grad_(True) if ctx.has_psw else None
    with torch.enable_grad():
        out = embedding_bag_local(weight, input, psw, ctx.mode, ctx.padding_idx)
    wrt = [weight] + ([psw] if psw is not None else [])
    got = torch.autograd.grad(out, wrt, grad)
    return got[0], None, got[1] if psw is not None else None, None, None


embedding_bag_rows.register_autograd(_backward, setup_context=_setup)


def _traced_embedding_bag(input, weight, offsets=None, max_norm=None, norm_type=2.0, scale_grad_by_freq=False,
                          mode="mean", sparse=False, per_sample_weights=None, include_last_offset=False,
                          padding_idx=None):
    args = (input, weight, offsets, max_norm, norm_type, scale_grad_by_freq, mode, sparse, per_sample_weights,
            include_last_offset, padding_idx)
    if not by_rows(*args):
        return _EMBEDDING_BAG(*args)
    if padding_idx is not None and not -weight.shape[0] <= padding_idx < weight.shape[0]:
        return _EMBEDDING_BAG(*args)  # torch's own error
    if padding_idx is not None and padding_idx < 0:
        padding_idx += weight.shape[0]
    if per_sample_weights is not None and per_sample_weights.shape != input.shape:
        return _EMBEDDING_BAG(*args)  # torch's own error
    return torch.ops.autopar.embedding_bag_rows(weight, input, per_sample_weights, mode, padding_idx)


@contextlib.contextmanager
def embedding_bags_by_rows():
    """While tracing, a 2-D `F.embedding_bag` call (and `nn.EmbeddingBag` on a 2-D input) is `embedding_bag_rows`."""
    before = F.embedding_bag
    F.embedding_bag = _traced_embedding_bag
    try:
        yield
    finally:
        F.embedding_bag = before
