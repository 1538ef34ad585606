"""The single-device-vs-parallel training loop the ZeRO equivalence tests share (tests/test_zero_auto.py,
tests/test_zero_ilp.py): fp64 on the caller's side, AdamW on both, a fresh random batch each step, the square-mean
loss; the largest loss, gradient and after-step parameter errors over every parameter, and each step's collectives."""

from __future__ import annotations

import torch


def grad_error(ref, pm) -> float:
    """The largest |difference| between every parameter's gradient under `pm` (DTensors, gathered) and on `ref`."""
    ref_params = dict(ref.named_parameters())
    return max(float((p.grad.full_tensor() - ref_params[name].grad).abs().max()) for name, p in pm.named_parameters())


def param_error(ref, pm) -> float:
    """The largest |difference| between every parameter under `pm` (DTensors, gathered) and on `ref`."""
    ref_params = dict(ref.named_parameters())
    return max(float((p.full_tensor() - ref_params[name].detach()).abs().max()) for name, p in pm.named_parameters())


def train_against_one_device(ref, pm, x, steps: int):
    """Train `ref` (one device) and `pm` (its parallelized copy) side by side for `steps` AdamW steps on batches
    shaped like `x`. Returns (errs, steps): errs the largest |difference| of the loss, of every parameter's gradient
    and of every parameter after each step ("loss", "grad", "param"); steps each step's recorded collectives as
    (kind, axis, pass, numel)."""
    from autopar.runtime.collectives import record_comms
    opt = torch.optim.AdamW(pm.parameters(), lr=1e-2, weight_decay=0.1)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2, weight_decay=0.1)
    errs = {"loss": 0.0, "grad": 0.0, "param": 0.0}
    out = []
    g = torch.Generator().manual_seed(1)
    for _ in range(steps):
        batch = torch.randn(x.shape, generator=g)
        opt.zero_grad(set_to_none=True)
        ref_opt.zero_grad(set_to_none=True)
        with record_comms() as recs:
            ref_loss = ref(batch).square().mean()
            ref_loss.backward()
            loss = pm(batch).square().mean()
            loss.backward()
            errs["loss"] = max(errs["loss"], float((loss.detach() - ref_loss.detach()).abs()))
            errs["grad"] = max(errs["grad"], grad_error(ref, pm))
            ref_opt.step()
            opt.step()
        errs["param"] = max(errs["param"], param_error(ref, pm))
        out.append([(r.kind, r.axis, r.pass_, r.numel) for r in recs])
    return errs, out
