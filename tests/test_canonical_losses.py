"""Losses captured per row, then reduced in graph ops (`autopar.canonical_losses`): CTC loss data parallel.

`F.ctc_loss` / `nn.CTCLoss` cannot be traced whole (`aten._ctc_loss` has a data-dependent output shape); capture
makes its per-row loss (`reduction="none"`) one opaque node and writes the reduction in graph ops. Each model is
exact against one device (loss, every gradient, parameters after an SGD step, fp64) on 2 simulated ranks. With
padded 2-D targets the per-row node is batch-local (capture's check says so), the batch stays split (no all-gather
in the lowered graph) and one rank does half the FLOPs; with targets concatenated in one 1-D tensor it stays
gathered, and the batch-local check and the capture notes say why.
"""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from autopar.canonical_losses import CONCATENATED_TARGETS
from autopar.capture import capture
from equivalence import run_equivalence
from passes import meta as M

TOL = 1e-10
B, T, D, C = 4, 10, 6, 5


class Frames(nn.Module):
    """(batch, time, D) -> log-probabilities (time, batch, classes) -> CTC loss, by `nn.CTCLoss` or `F.ctc_loss`."""

    def __init__(self, reduction: str, blank: int = 0, zero_infinity: bool = False, functional: bool = False):
        super().__init__()
        self.proj = nn.Linear(D, C)
        self.loss = nn.CTCLoss(blank=blank, reduction=reduction, zero_infinity=zero_infinity)
        self.functional = functional

    def forward(self, x, targets, input_lengths, target_lengths):
        log_probs = self.proj(x).log_softmax(-1).transpose(0, 1)
        if self.functional:
            return F.ctc_loss(log_probs, targets, input_lengths, target_lengths, blank=self.loss.blank,
                              reduction=self.loss.reduction, zero_infinity=self.loss.zero_infinity)
        return self.loss(log_probs, targets, input_lengths, target_lengths)


def _batch(blank: int, concatenated: bool, impossible: bool = False):
    """A batch of 4: frames, labels other than `blank`, input and target lengths (varied; with `impossible`, row 2's
    input is too short for its targets: its loss is infinite)."""
    g = torch.Generator().manual_seed(3)
    x = torch.randn(B, T, D, generator=g, dtype=torch.float64)
    target_lengths = torch.tensor([4, 3, 2, 4])
    input_lengths = torch.tensor([10, 8, 1 if impossible else 10, 7])
    labels = [l for l in range(C) if l != blank]
    targets = torch.tensor(labels)[torch.randint(0, len(labels), (B, 4), generator=g)]
    if concatenated:
        targets = torch.cat([targets[b, :n] for b, n in enumerate(target_lengths.tolist())])
    return x, targets, input_lengths, target_lengths


CASES = {  # name: (model kwargs, batch kwargs)
    "mean-padded": (dict(reduction="mean"), dict(blank=0, concatenated=False)),
    "sum-padded-functional": (dict(reduction="sum", functional=True), dict(blank=0, concatenated=False)),
    "mean-zero-infinity-blank-4": (dict(reduction="mean", blank=4, zero_infinity=True),
                                   dict(blank=4, concatenated=False, impossible=True)),
}


def _rows_nodes(gm):
    return [n for n in gm.graph.nodes if n.target is torch.ops.autopar.opaque.default]


@pytest.mark.parametrize("name", list(CASES))
def test_ctc_loss_rows_are_batch_local_and_exact(local_world, name):
    model_kw, batch_kw = CASES[name]
    torch.manual_seed(0)
    ref = Frames(**model_kw).double()
    batch = _batch(**batch_kw)
    with torch.no_grad():
        assert torch.isfinite(ref(*batch)), "zero_infinity must turn the impossible row's infinite loss into 0"
    cap = capture(ref, batch, {})
    (node,) = _rows_nodes(cap.gm)
    rows = node.meta[M.ROWS]
    assert rows.local and rows.in_dims == (1, 0, 0, 0) and rows.out_dims == (0,), rows
    after = {str(n.target) for n in cap.gm.graph.nodes if n.op == "call_function"} - {str(node.target)}
    reduction = model_kw["reduction"]
    assert {"aten.mean.default", "aten.div.Tensor", "aten.clamp_min.default"} <= after if reduction == "mean" else \
        "aten.sum.default" in after, after
    assert any("captured as one opaque node, batch-local" in n and f"reduction {reduction!r} in graph ops" in n
               for n in cap.notes), cap.notes
    for plan in ("dp", "fsdp"):
        with local_world(2):
            res = run_equivalence(ref, batch, (2,), ("dp",), plan=plan)
        assert res.max_err() < TOL, (plan, res.loss, res.ref_loss, res.grad_err, res.param_err)
        assert len(res.grad_err) == 2 and not any(k.startswith("all_gather") for k in res.graph_counts), \
            (plan, res.graph_counts)
        assert res.plan.estimate.flop_fraction <= 0.5 + 0.02, (plan, res.plan.estimate.flop_fraction)
        assert not [n for n in res.plan.notes if "gathered" in n], res.plan.notes


def test_ctc_loss_with_concatenated_targets_stays_gathered_and_says_why(local_world):
    torch.manual_seed(0)
    ref = Frames("mean").double()
    batch = _batch(blank=0, concatenated=True)
    assert batch[1].shape == (13,)
    cap = capture(ref, batch, {})
    (node,) = _rows_nodes(cap.gm)
    rows = node.meta[M.ROWS]
    assert not rows.local and rows.why == CONCATENATED_TARGETS, rows
    assert any("replicated on every rank (not batch-local: CTC targets are one concatenated 1-D tensor" in n
               for n in cap.notes), cap.notes
    with local_world(2), warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        res = run_equivalence(ref, batch, (2,), ("dp",), plan="dp")
    assert res.max_err() < TOL, (res.loss, res.ref_loss, res.grad_err, res.param_err)
    assert res.graph_counts.get("all_gather") == 3, res.graph_counts  # log-probs and both lengths, for the loss
    assert any("replicated on every rank (not batch-local: CTC targets are one concatenated" in n
               for n in res.plan.notes), res.plan.notes
    said = [str(w.message) for w in caught if "not parallel" in str(w.message)]
    assert len(said) == 1 and "autopar.opaque.default in loss" in said[0], said
