"""Embeddings under vocab parallelism as users write them: `padding_idx` keeps the pad row's gradient at zero
(as one device does); `scale_grad_by_freq` keeps the table replicated with a note (the scaling counts ids
over the whole vocabulary) and a forced `vocab` raises saying why; `max_norm` (which renormalises rows of the
parameter in place during forward) is refused with a clear error under any plan."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from equivalence import run_equivalence

V, H, B, S = 64, 16, 4, 8


class Emb(nn.Module):
    def __init__(self, **kw):
        super().__init__()
        self.emb = nn.Embedding(V, H, **kw)
        self.out = nn.Linear(H, V, bias=False)

    def forward(self, ids, labels):
        return nn.functional.cross_entropy(self.out(self.emb(ids)).flatten(0, 1), labels.flatten())


def _inputs(pad: int | None):
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, V, (B, S), generator=g)
    if pad is not None:
        ids[:, -3:] = pad  # right-padded rows, as a collator makes them
        ids[0, 0] = pad
    return ids, torch.randint(0, V, (B, S), generator=g)


def _build(**kw):
    old = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    try:
        torch.manual_seed(0)
        return Emb(**kw)
    finally:
        torch.set_default_dtype(old)


@pytest.mark.parametrize("pad", [0, 40])  # the pad row on rank 0's rows, or on rank 1's
def test_padding_idx_row_gets_no_gradient_under_vocab_parallel(local_world, pad):
    model, inputs = _build(padding_idx=pad), _inputs(pad)
    with local_world(2):
        res = run_equivalence(model, inputs, (2,), ("tp",), plan="megatron")
    assert dict(res.plan.params)["emb.weight"] == "S(0)"
    assert max(res.grad_err.values()) < 1e-12 and max(res.param_err.values()) < 1e-12, res.grad_err
    assert abs(res.loss - res.ref_loss) < 1e-12
    assert model.emb.weight.grad[pad].abs().max() == 0  # one device: no gradient on the pad row


def test_grad_by_freq_keeps_the_table_replicated(local_world):
    kw, why = {"scale_grad_by_freq": True}, "frequency"
    model, again, inputs = _build(**kw), _build(**kw), _inputs(None)
    with local_world(2):
        res = run_equivalence(model, inputs, (2,), ("tp",), plan="megatron")
        assert dict(res.plan.params)["emb.weight"] == "R"
        assert any("embedding emb" in n and why in n for n in res.plan.notes), res.plan.notes
        assert max(res.grad_err.values()) < 1e-12 and abs(res.loss - res.ref_loss) < 1e-12
        with pytest.raises(ValueError, match=rf"embedding emb: form 'vocab'.*{why}.*Fix"):
            run_equivalence(again, inputs, (2,), ("tp",), plan="megatron", overrides={"embedding": "vocab"})


@pytest.mark.parametrize("plan", ["megatron", "dp"])
def test_max_norm_is_refused_clearly(local_world, plan):
    model, inputs = _build(max_norm=1.0), _inputs(None)
    with local_world(2):
        with pytest.raises(NotImplementedError, match=r"writes into parameter emb.weight in place.*max_norm.*Fix"):
            run_equivalence(model, inputs, (2,), ("tp",), plan=plan)
