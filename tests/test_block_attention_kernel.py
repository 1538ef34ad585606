"""Block attention with log-sum-exp (autopar.runtime.kernels.block_attention): both implementations.

* The PyTorch fallback against a naive fp64 attention (explicit mask, `repeat_interleave` GQA,
  autograd for the gradients): out, lse, and dq, dk, dv from `block_attention_backward`, for
  full, causal, GQA, Sq != Sk, Dv != D and fully masked rows (causal_offset < 0: out = 0,
  lse = -inf, zero gradients, never NaN; pitfall 17).
* The backward contract: split K,V into blocks, merge the block outputs with the online softmax,
  and the sum of the per-block backwards (each given the GLOBAL out and lse) is the full gradient.
* The Triton kernels against the fallback, in a subprocess with TRITON_INTERPRET=1 (Triton decides
  whether a kernel is interpreted when the module defining it is imported, so the interpreter
  cannot be switched on inside this pytest process). Tiny sizes keep the interpreter fast.
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from autopar.runtime.kernels.block_attention import (
    attention_delta,
    block_attention,
    block_attention_backward,
)
from autopar.runtime.ring_attention import merge_attention

TESTS_DIR = Path(__file__).resolve().parent

# (B, H, Hkv, Sq, Sk, D, Dv, causal, causal_offset)
CASES = [
    (2, 3, 3, 12, 12, 8, 8, False, 0),     # full, odd head count
    (2, 3, 3, 12, 12, 8, 8, True, 0),      # diagonal-causal block
    (1, 4, 2, 10, 10, 8, 8, True, 0),      # GQA, causal
    (2, 6, 1, 7, 13, 4, 5, False, 0),      # MQA, Sq != Sk, Dv != D
    (1, 4, 2, 9, 9, 8, 8, True, -3),       # first 3 query rows fully masked
    (1, 2, 1, 5, 9, 4, 4, True, 2),        # Sq < Sk, causal with offset
]
IDS = ["full", "causal", "gqa-causal", "mqa-ragged-dv", "masked-rows", "offset"]


def _inputs(b, h, hkv, sq, sk, d, dv, dtype=torch.float64, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(b, h, sq, d, generator=g, dtype=torch.float64).to(dtype)
    k = torch.randn(b, hkv, sk, d, generator=g, dtype=torch.float64).to(dtype)
    v = torch.randn(b, hkv, sk, dv, generator=g, dtype=torch.float64).to(dtype)
    dout = torch.randn(b, h, sq, dv, generator=g, dtype=torch.float64).to(dtype)
    return q, k, v, dout


def naive_attention(q, k, v, causal, scale, causal_offset=0):
    """fp64 attention with explicit masks; fully masked rows -> out 0, lse -inf."""
    group = q.shape[1] // k.shape[1]
    kk, vv = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
    s = q @ kk.transpose(-1, -2) * scale
    if causal:
        allowed = torch.arange(k.shape[2])[None, :] <= torch.arange(q.shape[2])[:, None] + causal_offset
        s = s.masked_fill(~allowed, float("-inf"))
    lse = torch.logsumexp(s, -1)
    p = torch.exp(s - torch.where(lse.isinf(), torch.zeros_like(lse), lse)[..., None])
    return p @ vv, lse


def _reference(case):
    b, h, hkv, sq, sk, d, dv, causal, off = case
    q, k, v, dout = _inputs(b, h, hkv, sq, sk, d, dv)
    scale = d ** -0.5
    qr, kr, vr = (t.clone().requires_grad_() for t in (q, k, v))
    out, lse = naive_attention(qr, kr, vr, causal, scale, off)
    grads = torch.autograd.grad(out, (qr, kr, vr), dout)
    return (q, k, v, dout, scale), (out.detach(), lse.detach(), grads)


@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_fallback_matches_naive(case):
    (q, k, v, dout, scale), (out_ref, lse_ref, grads_ref) = _reference(case)
    causal, off = case[7], case[8]
    out, lse = block_attention(q, k, v, causal=causal, scale=scale, causal_offset=off, impl="torch")
    assert out.dtype == torch.float64 and lse.dtype == torch.float64 and lse.shape == q.shape[:3]
    torch.testing.assert_close(out, out_ref, atol=1e-12, rtol=0)
    assert torch.equal(lse.isinf(), lse_ref.isinf())
    torch.testing.assert_close(lse, lse_ref, atol=1e-12, rtol=0)
    grads = block_attention_backward(dout, q, k, v, out, lse, causal=causal, scale=scale, causal_offset=off,
                                     impl="torch")
    for name, g, g_ref in zip("qkv", grads, grads_ref):
        assert g.shape == g_ref.shape, name
        torch.testing.assert_close(g, g_ref, atol=1e-12, rtol=0, msg=f"d{name}")


def test_fully_masked_rows_are_zero_not_nan():
    q, k, v, dout = _inputs(1, 2, 1, 6, 6, 4, 4)
    out, lse = block_attention(q, k, v, causal=True, scale=0.5, causal_offset=-2, impl="torch")
    assert not out.isnan().any() and not lse.isnan().any()
    assert torch.equal(out[:, :, :2], torch.zeros_like(out[:, :, :2]))
    assert (lse[:, :, :2] == float("-inf")).all() and lse[:, :, 2:].isfinite().all()
    dq, dk, dv = block_attention_backward(dout, q, k, v, out, lse, causal=True, scale=0.5, causal_offset=-2,
                                          impl="torch")
    assert all(t.isfinite().all() for t in (dq, dk, dv))
    assert torch.equal(dq[:, :, :2], torch.zeros_like(dq[:, :, :2]))
    # an empty KV block: every row fully masked
    out0, lse0 = block_attention(q, k[:, :, :0], v[:, :, :0], causal=False, scale=0.5, impl="torch")
    assert torch.equal(out0, torch.zeros_like(out0)) and (lse0 == float("-inf")).all()


@pytest.mark.parametrize("causal", [False, True])
def test_blockwise_backward_with_global_lse(causal):
    """Two KV blocks merged by the online softmax; per-block backwards (global out/lse) sum to the full grad."""
    b, h, hkv, s, d = 2, 4, 2, 10, 8
    q, k, v, dout = _inputs(b, h, hkv, s, s, d, d)
    scale = d ** -0.5
    cut = 4
    # block A: keys [0, cut) -- causal mask j <= i; block B: keys [cut, s) -- j + cut <= i
    out_a, lse_a = block_attention(q, k[:, :, :cut], v[:, :, :cut], causal=causal, scale=scale, impl="torch")
    out_b, lse_b = block_attention(q, k[:, :, cut:], v[:, :, cut:], causal=causal, scale=scale,
                                   causal_offset=-cut, impl="torch")
    out, lse = merge_attention(out_a, lse_a, out_b, lse_b)
    out_ref, lse_ref = naive_attention(q, k, v, causal, scale)
    torch.testing.assert_close(out, out_ref, atol=1e-12, rtol=0)
    torch.testing.assert_close(lse, lse_ref, atol=1e-12, rtol=0)
    delta = attention_delta(dout, out)
    dq_a, dk_a, dv_a = block_attention_backward(dout, q, k[:, :, :cut], v[:, :, :cut], out, lse, delta=delta,
                                                causal=causal, scale=scale, impl="torch")
    dq_b, dk_b, dv_b = block_attention_backward(dout, q, k[:, :, cut:], v[:, :, cut:], out, lse, delta=delta,
                                                causal=causal, scale=scale, causal_offset=-cut, impl="torch")
    _, (_, _, (dq_ref, dk_ref, dv_ref)) = _reference((b, h, hkv, s, s, d, d, causal, 0))
    torch.testing.assert_close(dq_a + dq_b, dq_ref, atol=1e-12, rtol=0)
    torch.testing.assert_close(torch.cat([dk_a, dk_b], 2), dk_ref, atol=1e-12, rtol=0)
    torch.testing.assert_close(torch.cat([dv_a, dv_b], 2), dv_ref, atol=1e-12, rtol=0)


def test_merge_is_stable_for_large_and_infinite_lse():
    # pitfall 9: the naive exp form overflows fp32 at lse ~ 89; pitfall 17: -inf rows
    lse = torch.tensor([[[1000.0, -1000.0, float("-inf"), float("-inf"), 5.0]]])
    lse_b = torch.tensor([[[999.0, float("-inf"), 3.0, float("-inf"), 5.0]]])
    out = torch.tensor([[[[1.0], [2.0], [0.0], [0.0], [1.0]]]])
    out_b = torch.tensor([[[[3.0], [0.0], [4.0], [0.0], [3.0]]]])
    m_out, m_lse = merge_attention(out, lse, out_b, lse_b)
    assert not m_out.isnan().any() and not m_lse.isnan().any()
    torch.testing.assert_close(m_lse, torch.logaddexp(lse, lse_b))
    w = torch.sigmoid(torch.tensor(-1.0))  # weight of out_b when lse_b = lse - 1
    expected = torch.tensor([1.0 + 2.0 * float(w), 2.0, 4.0, 0.0, 2.0])
    torch.testing.assert_close(m_out.flatten(), expected)


def test_low_precision_returns_input_dtype_and_fp32_lse():
    q, k, v, dout = _inputs(1, 2, 1, 8, 8, 8, 8, dtype=torch.bfloat16)
    out, lse = block_attention(q, k, v, causal=True, scale=8 ** -0.5, impl="torch")
    assert out.dtype == torch.bfloat16 and lse.dtype == torch.float32
    out32, _ = block_attention(q, k, v, causal=True, scale=8 ** -0.5, out_dtype=torch.float32, impl="torch")
    assert out32.dtype == torch.float32
    ref, _ = naive_attention(q.double(), k.double(), v.double(), True, 8 ** -0.5)
    torch.testing.assert_close(out32.double(), ref, atol=1e-5, rtol=0)
    dq, dk, dv = block_attention_backward(dout, q, k, v, out, lse, causal=True, scale=8 ** -0.5,
                                          grad_dtype=torch.float32, impl="torch")
    assert dq.dtype == dk.dtype == dv.dtype == torch.float32


def test_bad_arguments_say_what_to_do():
    q, k, v, _ = _inputs(1, 3, 2, 4, 4, 4, 4)
    with pytest.raises(ValueError, match="not a multiple"):
        block_attention(q, k, v, causal=False, scale=1.0)
    q, k, v, _ = _inputs(1, 2, 1, 4, 4, 4, 4)
    with pytest.raises(ValueError, match="impl must be one of"):
        block_attention(q, k, v, causal=False, scale=1.0, impl="cuda")
    with pytest.raises(ValueError, match="supports"):
        block_attention(q, k, v, causal=False, scale=1.0, impl="triton")  # fp64


# ----------------------------------------------------------------------------- Triton (interpreted)

TRITON_CASES = [
    (1, 2, 2, 20, 20, 8, 8, False, 0),
    (2, 3, 3, 20, 20, 8, 8, True, 0),      # two 16-row tiles, ragged last tile
    (1, 4, 2, 17, 33, 12, 5, False, 0),    # GQA, Sq != Sk, D and Dv not powers of two
    (1, 4, 1, 19, 19, 16, 16, True, -3),   # MQA, fully masked rows
    (1, 2, 1, 5, 9, 8, 8, True, -7),       # every row fully masked
]


def _triton_main() -> None:
    """Run in a subprocess with TRITON_INTERPRET=1: Triton vs the fallback, fp32, fwd and bwd."""
    assert os.environ.get("TRITON_INTERPRET") == "1"
    for case in TRITON_CASES:
        b, h, hkv, sq, sk, d, dv, causal, off = case
        q, k, v, dout = _inputs(b, h, hkv, sq, sk, d, dv, dtype=torch.float32, seed=1)
        q_nc = q.transpose(1, 2).contiguous().transpose(1, 2)  # non-contiguous strides reach the kernel
        scale = d ** -0.5
        kw = dict(causal=causal, scale=scale, causal_offset=off)
        out_t, lse_t = block_attention(q_nc, k, v, impl="triton", **kw)
        out_f, lse_f = block_attention(q, k, v, impl="torch", **kw)
        assert out_t.dtype == torch.float32 and lse_t.dtype == torch.float32, case
        assert not out_t.isnan().any() and not lse_t.isnan().any(), case
        assert torch.equal(lse_t.isinf(), lse_f.isinf()), case
        torch.testing.assert_close(out_t, out_f, atol=2e-6, rtol=1e-5, msg=f"out {case}")
        torch.testing.assert_close(lse_t, lse_f, atol=2e-6, rtol=1e-5, msg=f"lse {case}")
        g_t = block_attention_backward(dout, q_nc, k, v, out_f, lse_f, impl="triton", **kw)
        g_f = block_attention_backward(dout, q, k, v, out_f, lse_f, impl="torch", **kw)
        for name, a, ref in zip("qkv", g_t, g_f):
            assert a.shape == ref.shape and a.isfinite().all(), (name, case)
            torch.testing.assert_close(a, ref, atol=5e-6, rtol=1e-5, msg=f"d{name} {case}")
    # the kernels in ring attention's per-rank steps (LocalTensorMode hands them plain tensors)
    from test_ring_attention import check_ring_on_local_world

    err = check_ring_on_local_world(2, causal=True, heads=(3, 1), dtype=torch.float32, impl="triton")
    assert err < 1e-5, err
    print("triton interpreted checks passed")


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton is not installed")
def test_triton_kernels_match_fallback_interpreted():
    env = dict(os.environ, TRITON_INTERPRET="1", OMP_NUM_THREADS="1",
               PYTHONPATH=os.pathsep.join([str(TESTS_DIR.parent), str(TESTS_DIR), os.environ.get("PYTHONPATH", "")]))
    proc = subprocess.run([sys.executable, "-c", "import test_block_attention_kernel as t; t._triton_main()"],
                          cwd=TESTS_DIR, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, f"interpreted Triton checks failed:\n{proc.stdout}\n{proc.stderr[-6000:]}"
    assert "triton interpreted checks passed" in proc.stdout
