"""Losses torch computes per row and then reduces, captured as the per-row loss and the reduction in graph ops.

Some of torch's losses cannot be traced whole on fake tensors: `F.ctc_loss` (and `nn.CTCLoss`, which calls it)
raises `DynamicOutputShapeException` in `aten._ctc_loss`, so without help the loss module becomes one opaque node
whose reduction ("mean", "sum") mixes the rows of the batch: batch-local it is not, and on a data axis it would run
on the gathered batch on every rank. Yet torch itself computes such a loss per row and reduces afterwards. During
capture, `canonical_losses` swaps `torch.nn.functional.ctc_loss` for a call of its per-row loss, `reduction="none"`
(`CTCRows`: `blank` and `zero_infinity` honoured, its backward torch's own), captured as one opaque node
(`autopar.runtime.opaque`: its output is the example's (batch,) shape), followed by the reduction written in graph
ops exactly as ATen's `ctc_loss_impl` defines it:

- "mean": each row's loss divided by its target length clamped to >= 1, then the mean over the batch;
- "sum": the sum over the batch;
- "none": the per-row losses as they are.

The per-row node is checked like every opaque node (`passes.batch_local`: numerically, each row of its output and
of its inputs' gradients from the same row alone): with padded 2-D targets `(batch, max target length)` it is
batch-local, so on a data axis each rank runs it on its own rows, and the reduction is an ordinary op with a rule (a
mean over a split dim is the lowering's sum over the global count). Targets given as one concatenated 1-D tensor
(`sum(target_lengths)` labels) cannot be split by rows (a row's labels sit at an offset that the lengths of all the
rows before it decide), so the per-row node is marked not batch-local with that reason (`OpaqueModule.not_rows`)
and runs on the gathered batch; the capture notes say why and how to make it data parallel.

Only the call spelled `F.ctc_loss` / `torch.nn.functional.ctc_loss` (what `nn.CTCLoss` calls) with tensor lengths and
batched `(time, batch, classes)` log-probabilities is swapped; anything else (unbatched input, lengths as Python
lists, a name imported before capture) runs as written.
"""

from __future__ import annotations

import contextlib

import torch
import torch.nn.functional as F
from torch import nn

_REDUCTIONS = ("mean", "sum", "none")
_ORIGINAL_CTC = F.ctc_loss

CONCATENATED_TARGETS = ("CTC targets are one concatenated 1-D tensor (sum(target_lengths) labels), which cannot be "
                        "split by rows: a row's labels sit at an offset set by the lengths of the rows before it. "
                        "Fix: pass padded 2-D targets (batch, max target length) to make the CTC loss data parallel")


class CTCRows(nn.Module):
    """The per-row CTC loss (`reduction="none"`), what the opaque node runs."""

    def __init__(self, blank: int, zero_infinity: bool):
        super().__init__()
        self.blank, self.zero_infinity = blank, zero_infinity

    def forward(self, log_probs, targets, input_lengths, target_lengths):
        return _ORIGINAL_CTC(log_probs, targets, input_lengths, target_lengths, blank=self.blank, reduction="none",
                             zero_infinity=self.zero_infinity)

    def extra_repr(self) -> str:
        return f"blank={self.blank}, zero_infinity={self.zero_infinity}"


def _reduce(rows: torch.Tensor, target_lengths: torch.Tensor, reduction: str) -> torch.Tensor:
    """ATen's reduction of the per-row CTC losses (`ctc_loss_impl`, Tensor lengths)."""
    if reduction == "mean":
        return (rows / target_lengths.clamp_min(1)).mean()
    if reduction == "sum":
        return rows.sum()
    return rows


def _swappable(log_probs, targets, input_lengths, target_lengths, reduction) -> bool:
    return (all(isinstance(t, torch.Tensor) for t in (log_probs, targets, input_lengths, target_lengths))
            and log_probs.dim() == 3 and targets.dim() in (1, 2) and reduction in _REDUCTIONS)


@contextlib.contextmanager
def canonical_losses(found: list[tuple[str, str]]):
    """While tracing: `F.ctc_loss` is its per-row loss (an opaque node) and its reduction in graph ops (the module
    docstring). `found` collects (opaque key, reduction) per call."""
    from torch.fx.experimental.proxy_tensor import disable_proxy_modes_tracing

    from autopar.runtime import opaque

    modules: dict[tuple, CTCRows] = {}  # one per (blank, zero_infinity, targets' layout): the opaque key is its

    def ctc_loss(log_probs, targets, input_lengths, target_lengths, blank=0, reduction="mean", zero_infinity=False):
        if not _swappable(log_probs, targets, input_lengths, target_lengths, reduction):
            return _ORIGINAL_CTC(log_probs, targets, input_lengths, target_lengths, blank=blank, reduction=reduction,
                                 zero_infinity=zero_infinity)
        concatenated = targets.dim() == 1
        sig = (int(blank), bool(zero_infinity), concatenated)
        if sig not in modules:
            modules[sig] = CTCRows(*sig[:2])
        with disable_proxy_modes_tracing():  # the output's shape and dtype, for the opaque node's fake kernel
            example = torch.empty(log_probs.shape[1], dtype=log_probs.dtype, device=log_probs.device)
        key = opaque.register(f"ctc_loss(blank={sig[0]}, zero_infinity={sig[1]})", modules[sig], example,
                              "torch's CTC loss has a data-dependent output shape (aten._ctc_loss)")
        if concatenated:
            opaque.describe(key).not_rows = CONCATENATED_TARGETS
        found.append((key, reduction))
        rows = torch.ops.autopar.opaque(key, [log_probs, targets, input_lengths, target_lengths], [])[0]
        return _reduce(rows, target_lengths, reduction)

    F.ctc_loss = ctc_loss
    try:
        yield
    finally:
        F.ctc_loss = _ORIGINAL_CTC


def canonical_loss_notes(gm, found: list[tuple[str, str]], rows: dict[str, str]) -> list[str]:
    """One note per loss captured per row (`found`, from `canonical_losses`): where it is, how its per-row node
    runs on a data axis (`rows`: opaque key -> batch-local, or replicated and why)."""
    from autopar.runtime import opaque
    reduction = dict(found)
    notes = []
    for node in gm.graph.nodes:
        if node.target is torch.ops.autopar.opaque.default and node.args[0] in reduction:
            key = node.args[0]
            stack = list((node.meta.get("nn_module_stack") or {}).values())
            where = f" in {stack[-1][0]}" if stack and stack[-1][0] else ""
            line = (f"{opaque.describe(key).path}{where} captured as one opaque node, {rows[key]}, its per-row loss "
                    f"(reduction 'none', {opaque.describe(key).reason}), followed by the reduction "
                    f"{reduction[key]!r} in graph ops")
            if line not in notes:
                notes.append(line)
    return notes
