"""MoE token permutation (autopar.runtime.kernels.moe_permute): both implementations.

* The PyTorch fallback against the plain reference (`x[src]`, `zeros().index_add_`) in fp64:
  forward for repeated and missing rows, N = 0, T = 0, H = 5 (not a power of two) and
  non-contiguous inputs; the gradients of x, y and weights by `torch.autograd.gradcheck`.
* Round trips: a permutation gathered and scattered back with unit weights, and top-2 routing
  (each token sent twice, its two weights summing to 1), both return x.
* bf16 sums run in fp32 (256 rows of 2^-9 onto a 1.0 row: 1.5, where bf16 steps would stay at 1.0).
* The Triton kernels against the fallback, in a subprocess with TRITON_INTERPRET=1 (Triton decides
  whether a kernel is interpreted when the module defining it is imported, so the interpreter
  cannot be switched on inside this pytest process): fp32/fp64 forward and every gradient to
  1e-6/1e-12, bf16 close. The fallback functions are replaced by ones that raise while the "auto"
  calls run, so the Triton path is proven taken; a FakeTensor still gets the fallback.
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from autopar.runtime.kernels import moe_permute as mp
from autopar.runtime.kernels.moe_permute import permute_rows, pick_impl, unpermute_rows

TESTS_DIR = Path(__file__).resolve().parent

# (T, H, src): rows repeated and missing, in and out of order
CASES = [
    (6, 8, [4, 0, 4, 4, 1, 5, 0]),   # rows 2, 3 missing; 4 three times
    (5, 5, [2, 2, 0, 4]),             # H = 5: not a power of two
    (4, 3, []),                       # N = 0
    (0, 5, []),                       # T = 0 (and so N = 0)
    (3, 4, [0, 1, 2]),                # the identity
]
IDS = ["repeat-missing", "h5", "n0", "t0", "identity"]


def _inputs(t, h, src, dtype=torch.float64, seed=0, non_contiguous=False):
    g = torch.Generator().manual_seed(seed)
    src = torch.tensor(src, dtype=torch.int64)
    if non_contiguous:  # a transposed x and a strided src reach the functions
        x = torch.randn(h, t, generator=g, dtype=torch.float64).to(dtype).t()
        src = torch.stack([src, torch.zeros_like(src)], 1)[:, 0]
    else:
        x = torch.randn(t, h, generator=g, dtype=torch.float64).to(dtype)
    w = torch.rand(src.numel(), generator=g, dtype=torch.float64).to(dtype)
    return x, src, w


def reference_unpermute(y, dst, w, num_rows):
    out = torch.zeros(num_rows, y.shape[1], dtype=y.dtype)
    return out.index_add_(0, dst, y * (w[:, None] if w is not None else 1))


@pytest.mark.parametrize("non_contiguous", [False, True], ids=["contiguous", "strided"])
@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_fallback_matches_reference(case, non_contiguous):
    t, h, src_list = case
    x, src, w = _inputs(t, h, src_list, non_contiguous=non_contiguous)
    y = permute_rows(x, src, impl="torch")
    assert y.shape == (len(src_list), h) and y.dtype == torch.float64
    assert torch.equal(y, x[src])
    num_rows = t + 2  # two rows no entry of dst reaches
    for weights in (w, None):
        out = unpermute_rows(y, src, weights, num_rows, impl="torch")
        assert out.shape == (num_rows, h)
        torch.testing.assert_close(out, reference_unpermute(y, src, weights, num_rows), atol=1e-12, rtol=0)


@pytest.mark.parametrize("case", [c for c in CASES if c[2]], ids=[i for c, i in zip(CASES, IDS) if c[2]])
def test_fallback_gradients(case):
    t, h, src_list = case
    x, src, w = _inputs(t, h, src_list)
    x.requires_grad_()
    assert torch.autograd.gradcheck(lambda x: permute_rows(x, src, impl="torch"), (x,))
    y = torch.randn(len(src_list), h, dtype=torch.float64, requires_grad=True)
    w.requires_grad_()
    assert torch.autograd.gradcheck(lambda y, w: unpermute_rows(y, src, w, t + 1, impl="torch"), (y, w))
    assert torch.autograd.gradcheck(lambda y: unpermute_rows(y, src, None, t + 1, impl="torch"), (y,))


def test_empty_gradients_and_no_weight_grad():
    x = torch.randn(4, 5, dtype=torch.float64, requires_grad=True)
    empty = torch.zeros(0, dtype=torch.int64)
    y = permute_rows(x, empty, impl="torch")
    (gx,) = torch.autograd.grad(y.sum(), x)
    assert torch.equal(gx, torch.zeros_like(x))
    w = torch.rand(3, dtype=torch.float64)  # no grad wanted for it
    yr = torch.randn(3, 5, dtype=torch.float64, requires_grad=True)
    out = unpermute_rows(yr, torch.tensor([1, 1, 0]), w, 2, impl="torch")
    (gy,) = torch.autograd.grad(out, yr, torch.ones_like(out))
    torch.testing.assert_close(gy, w[:, None].expand(3, 5), atol=0, rtol=0)


def _round_trip_checks(impl: str, dtype=torch.float64, atol=1e-12) -> None:
    t, h = 7, 5
    x, _, _ = _inputs(t, h, [], dtype=dtype, seed=3)
    perm = torch.randperm(t, generator=torch.Generator().manual_seed(3))
    y = permute_rows(x, perm, impl=impl)
    back = unpermute_rows(y, perm, torch.ones(t, dtype=dtype), t, impl=impl)
    assert torch.equal(back, x)
    # top-2: token tok goes to two experts; dispatch order sorts the assignments by expert
    g = torch.Generator().manual_seed(4)
    experts = torch.stack([torch.randperm(4, generator=g)[:2] for _ in range(t)])  # (T, 2), distinct per token
    probs = torch.rand(t, 2, generator=g, dtype=torch.float64)
    probs = (probs / probs.sum(1, keepdim=True)).to(dtype)
    order = torch.argsort(experts.reshape(-1), stable=True)
    token_of = order // 2
    y = permute_rows(x, token_of, impl=impl)
    back = unpermute_rows(y, token_of, probs.reshape(-1)[order], t, impl=impl)
    torch.testing.assert_close(back, x, atol=atol, rtol=0)


def test_round_trip_fallback():
    _round_trip_checks("torch")


def _bf16_accumulation_checks(impl: str) -> None:
    y = torch.cat([torch.ones(1, 3), torch.full((256, 3), 2.0 ** -9)]).to(torch.bfloat16)
    out = unpermute_rows(y, torch.zeros(257, dtype=torch.int64), None, 1, impl=impl)
    assert out.dtype == torch.bfloat16
    assert torch.equal(out, torch.full((1, 3), 1.5, dtype=torch.bfloat16)), out


def test_bf16_sums_in_fp32_fallback():
    _bf16_accumulation_checks("torch")


def test_bad_arguments_say_what_to_do():
    x = torch.randn(4, 5)
    with pytest.raises(ValueError, match="int64"):
        permute_rows(x, torch.tensor([0.0, 1.0]))
    with pytest.raises(ValueError, match="no rows"):
        permute_rows(x[:0], torch.tensor([0]))
    with pytest.raises(ValueError, match="weights must be"):
        unpermute_rows(x, torch.tensor([0, 1, 2, 3]), torch.ones(3), 4)
    with pytest.raises(ValueError, match="num_rows"):
        unpermute_rows(x, torch.tensor([0, 1, 2, 3]), None, 0)
    with pytest.raises(ValueError, match="impl must be one of"):
        permute_rows(x, torch.tensor([0]), impl="cuda")
    with pytest.raises(ValueError, match="supports"):
        pick_impl(x.to(torch.int32), "triton")


# ----------------------------------------------------------------------------- Triton (interpreted)

# (T, H, N, seed): N > 32 rows spans programs (BLOCK_N = 32 interpreted), H = 70 loops past BLOCK_H = 64
TRITON_CASES = [(9, 5, 20, 0), (30, 70, 45, 1), (6, 8, 0, 2), (0, 5, 0, 3)]
TOL = {torch.float32: dict(atol=1e-6, rtol=1e-6), torch.float64: dict(atol=1e-12, rtol=0),
       torch.bfloat16: dict(atol=2e-2, rtol=2e-2)}


def _forward_backward(x, src, w, num_rows, impl):
    x, w = x.clone().requires_grad_(), w.clone().requires_grad_()
    y = permute_rows(x, src, impl=impl)
    out = unpermute_rows(y, src, w, num_rows, impl=impl)
    g = torch.randn(out.shape, generator=torch.Generator().manual_seed(9), dtype=torch.float64).to(out.dtype)
    grads = torch.autograd.grad(out, (x, w), g) if out.numel() else (torch.zeros_like(x), torch.zeros_like(w))
    return y, out, grads


def _raise_fallback(*args):
    raise AssertionError("the PyTorch fallback ran where the Triton path was expected")


def _triton_main() -> None:
    """Run in a subprocess with TRITON_INTERPRET=1: Triton vs the fallback, fwd and bwd, 3 dtypes."""
    assert os.environ.get("TRITON_INTERPRET") == "1" and mp._interpreted()
    for dtype in (torch.float32, torch.float64, torch.bfloat16):
        for t, h, n, seed in TRITON_CASES:
            g = torch.Generator().manual_seed(seed)
            src = torch.randint(0, max(t, 1), (n,), generator=g)  # repeats and gaps
            x, _, w = _inputs(t, h, [], dtype=dtype, seed=seed, non_contiguous=True)
            w = torch.rand(n, generator=g, dtype=torch.float64).to(dtype)
            assert pick_impl(x) == "triton", (dtype, t, h, n)
            ref = _forward_backward(x, src, w, t + 1, "torch")
            fallback = (mp._torch_gather, mp._torch_scatter_add)
            mp._torch_gather = mp._torch_scatter_add = _raise_fallback
            try:
                y, out, grads = _forward_backward(x, src, w, t + 1, None)  # "auto"
            finally:
                mp._torch_gather, mp._torch_scatter_add = fallback
            case = (dtype, t, h, n)
            assert torch.equal(y, ref[0]), case  # a gather is a copy
            assert out.dtype == dtype and grads[0].dtype == dtype and grads[1].dtype == dtype, case
            torch.testing.assert_close(out, ref[1], **TOL[dtype], msg=f"out {case}")
            for name, a, b in zip(("x", "weights"), grads, ref[2]):
                torch.testing.assert_close(a, b, **TOL[dtype], msg=f"d{name} {case}")
    _round_trip_checks("triton")
    _round_trip_checks("triton", dtype=torch.float32, atol=1e-6)
    _bf16_accumulation_checks("triton")
    # tensors without memory of their own (capture's FakeTensors) keep to the fallback
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        fake = torch.empty(4, 8)
        assert pick_impl(fake) == "torch"
        assert permute_rows(fake, torch.tensor([1, 1, 3])).shape == (3, 8)
    print("triton interpreted checks passed")


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton is not installed (its wheels exist only for Linux x86_64)")
def test_triton_kernels_match_fallback_interpreted():
    env = dict(os.environ, TRITON_INTERPRET="1", OMP_NUM_THREADS="1",
               PYTHONPATH=os.pathsep.join([str(TESTS_DIR.parent), str(TESTS_DIR), os.environ.get("PYTHONPATH", "")]))
    proc = subprocess.run([sys.executable, "-c", "import test_moe_permute_kernel as t; t._triton_main()"],
                          cwd=TESTS_DIR, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, f"interpreted Triton checks failed:\n{proc.stdout}\n{proc.stderr[-6000:]}"
    assert "triton interpreted checks passed" in proc.stdout
