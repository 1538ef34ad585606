"""autopar.runtime.float8: the fp8 linear on torch._scaled_mm (CPU in torch 2.13), forward and backward in fp8.

Against an fp64 emulation of the same quantisation (each operand cast to e4m3 / e5m2 with its tensorwise or rowwise
scale, then dequantised and multiplied exactly): equal to fp32 rounding with fp32 outputs, to bf16 rounding with bf16
(measured: <= 2.3e-7 and <= 5.1e-3 relative to the largest entry; rowwise: its scales powers of 2 and its gradient
e4m3, torchao's ROWWISE recipe, its fp32 outputs rounded to bf16 as torchao's are: measured 2.9e-3); against the
high-precision linear, the fp8 error (measured 3.6-5.1%: a kernel that silently ran in high precision would be 0 there and fail)."""

from __future__ import annotations

import pytest
import torch

from autopar.runtime.float8 import E4M3, GRAD_DTYPE, POW2_SCALES, cast, float8_linear


def _dq(t, dtype, dim, pow2=False):
    q, inv = cast(t, dtype, dim, pow2=pow2)
    return q.double() * inv.double()


def _rel(a, ref):
    return float((a.detach().double() - ref).abs().max() / ref.abs().max())


@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise"])
def test_float8_linear_matches_its_emulation_forward_and_backward(recipe):
    torch.manual_seed(0)
    dim, p2, gd = -1 if recipe == "rowwise" else None, POW2_SCALES[recipe], GRAD_DTYPE[recipe]
    # rowwise in fp32: every GEMM written in bf16, as torchao writes it (`autopar.runtime.float8._mm`): <= 2^-8
    for dtype, tol in ((torch.float32, 4e-3 if recipe == "rowwise" else 1e-6), (torch.bfloat16, 1.5e-2)):
        x = torch.randn(4, 8, 32, dtype=dtype, requires_grad=True)
        w = torch.randn(48, 32, dtype=dtype, requires_grad=True)
        b = torch.randn(48, dtype=dtype, requires_grad=True)
        y = float8_linear(x, w, b, recipe)
        g = torch.randn_like(y)
        y.backward(g)
        x2, g2, wd = x.detach().reshape(-1, 32), g.reshape(-1, 48), w.detach()
        ref_y = _dq(x2, E4M3, dim, p2) @ _dq(wd, E4M3, dim, p2).t() + b.detach().double()
        ref_gx = _dq(g2, gd, dim, p2) @ _dq(wd.t(), E4M3, dim, p2).t()  # grad_input: the gradient x e4m3 weight
        ref_gw = _dq(g2.t(), gd, dim, p2) @ _dq(x2.t(), E4M3, dim, p2).t()  # grad_weight: the gradient x e4m3 input
        assert y.dtype == x.grad.dtype == w.grad.dtype == dtype
        assert _rel(y.reshape(-1, 48), ref_y) < tol
        assert _rel(x.grad.reshape(-1, 32), ref_gx) < tol
        assert _rel(w.grad, ref_gw) < tol
        assert torch.equal(b.grad, g2.sum(0))  # the bias gradient in high precision
        hp = x2.double() @ wd.double().t() + b.detach().double()
        assert 0.01 < _rel(y.reshape(-1, 48), hp) < 0.1  # really fp8: its error, not high precision's
    with pytest.raises(ValueError, match="is not one of"):
        float8_linear(x, w, b, "blockwise")
