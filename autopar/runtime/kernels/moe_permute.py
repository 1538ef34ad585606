"""Token permutation for MoE dispatch: gather rows to expert order, scatter-add them back (issue #5).

    y = permute_rows(x, src)                          # y[i] = x[src[i]]
    out = unpermute_rows(y, dst, weights, num_rows)   # out[dst[i]] += weights[i] * y[i]

Shapes: x (T, H), src (N,) with values in [0, T); y (N, H), dst (N,) with values in [0, num_rows),
weights (N,) or None (all ones); out (num_rows, H). Indices are int64 (or int32). Rows may repeat
(top-k routing sends a token to k experts) or be absent (dropped tokens): a repeated row
accumulates, an absent one gets zero. Any of N, T, H may be 0. Inputs need not be contiguous (they
are made so). Values of src/dst are not range-checked on the Triton path (that would cost a host
sync per call); the PyTorch fallback raises on an out-of-range index.

Dtypes: the result has the dtype of x (resp. y). Sums run in the accumulation dtype (fp32, or fp64
for fp64 inputs) and are cast back once, so bf16 rows routed k times are added in fp32.

Gradients (both functions are differentiable once; `torch.autograd.Function`s):
* permute_rows:   grad_x = zeros(T, H).index_add_(0, src, grad_y)     -> `_scatter_add_rows`
* unpermute_rows: grad_y[i] = weights[i] * grad_out[dst[i]]           -> `_gather_rows`
                  grad_weights[i] = sum_h grad_out[dst[i], h] * y[i, h] (same gather, fused; None
                  when weights is None or does not require grad)
So each direction is one gather and one scatter-add, and the two kernels below serve all four.

Implementations (`impl`, or the env var AUTOPAR_MOE_PERMUTE; default "auto"), as block attention:
* "torch": `index_select` / `index_add_` in the accumulation dtype.
* "triton": `_gather_rows_kernel` (one program per BLOCK_N rows, looping over H in BLOCK_H chunks,
  the tail masked) and `_scatter_add_rows_kernel` (the same tiling, `tl.atomic_add` into a
  zero-initialised buffer of the accumulation dtype, so the order repeated rows are summed in is not
  fixed). fp16/bf16/fp32/fp64. On CPU it needs TRITON_INTERPRET=1 set before this module is imported
  (Triton reads it when the kernels are decorated).
* "auto": Triton when triton imports, the tensor is a plain `torch.Tensor` of those dtypes (not a
  FakeTensor, DTensor or LocalTensor: those have no memory to hand a kernel) and it is on a CUDA
  device, or on the CPU with the kernels interpreted; else the PyTorch fallback.
`pick_impl(x)` says which one a call on `x` takes.
"""

from __future__ import annotations

import os

import torch
from torch.autograd.function import once_differentiable

try:
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - depends on the environment
    triton = None
    tl = None

HAS_TRITON = triton is not None
_TRITON_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
_INDEX_DTYPES = (torch.int32, torch.int64)
_IMPLS = ("auto", "torch", "triton")


def acc_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype rows are summed in: fp32, or fp64 for fp64."""
    return torch.float64 if dtype == torch.float64 else torch.float32


# ----------------------------------------------------------------------------- public API

def permute_rows(x: torch.Tensor, src: torch.Tensor, *, impl: str | None = None) -> torch.Tensor:
    """y (N, H) with y[i] = x[src[i]]: the rows of x (T, H) in dispatch order (see the module docstring)."""
    _check_index("permute_rows", "x", x, "src", src)
    if x.shape[0] == 0 and src.numel():
        raise ValueError(f"permute_rows: src has {src.numel()} entries but x {tuple(x.shape)} has no rows to "
                         "gather; src values must lie in [0, T)")
    return _PermuteRows.apply(x.contiguous(), src.contiguous(), pick_impl(x, impl))


def unpermute_rows(y: torch.Tensor, dst: torch.Tensor, weights: torch.Tensor | None, num_rows: int, *,
                   impl: str | None = None) -> torch.Tensor:
    """out (num_rows, H) with out[dst[i]] += weights[i] * y[i]: rows of y (N, H) combined back per token."""
    _check_index("unpermute_rows", "y", y, "dst", dst)
    if weights is not None and (weights.shape != dst.shape or not weights.is_floating_point()
                                or weights.device != y.device):
        raise ValueError(f"unpermute_rows: weights must be a floating (N,) = ({dst.numel()},) tensor on {y.device} "
                         f"or None, got {weights.dtype} {tuple(weights.shape)} on {weights.device}")
    if num_rows < 0 or (num_rows == 0 and dst.numel()):
        raise ValueError(f"unpermute_rows: num_rows = {num_rows} leaves no row for the {dst.numel()} entries of dst; "
                         "dst values must lie in [0, num_rows)")
    weights = weights.contiguous() if weights is not None else None
    return _UnpermuteRows.apply(y.contiguous(), dst.contiguous(), weights, int(num_rows), pick_impl(y, impl))


def pick_impl(x: torch.Tensor, impl: str | None = None) -> str:
    """"triton" or "torch": the implementation a call on rows `x` takes (`impl` or AUTOPAR_MOE_PERMUTE)."""
    impl = impl or os.environ.get("AUTOPAR_MOE_PERMUTE", "auto")
    if impl not in _IMPLS:
        raise ValueError(f"moe_permute impl must be one of {_IMPLS}, got {impl!r} "
                         "(from the impl argument or AUTOPAR_MOE_PERMUTE)")
    plain = type(x) is torch.Tensor
    if impl == "auto":
        usable = HAS_TRITON and plain and x.dtype in _TRITON_DTYPES
        return "triton" if usable and (x.is_cuda or (x.device.type == "cpu" and _interpreted())) else "torch"
    if impl == "triton":
        if not HAS_TRITON:
            raise RuntimeError("moe_permute impl 'triton' was requested but triton does not import")
        if x.dtype not in _TRITON_DTYPES:
            raise ValueError(f"the Triton moe_permute supports {_TRITON_DTYPES}, got {x.dtype}; use impl='torch'")
        if not plain:
            raise ValueError(f"the Triton moe_permute needs plain tensors, got a {type(x).__name__}; use impl='torch'")
        if not x.is_cuda and not _interpreted():
            raise RuntimeError("the Triton moe_permute on CPU tensors needs TRITON_INTERPRET=1 set before "
                               "autopar.runtime.kernels is imported")
    return impl


def _check_index(fn: str, rows_name: str, rows: torch.Tensor, index_name: str, index: torch.Tensor) -> None:
    if rows.dim() != 2 or index.dim() != 1 or index.dtype not in _INDEX_DTYPES:
        raise ValueError(f"{fn}: expects {rows_name} (rows, H) and {index_name} a 1-D int64/int32 tensor, got "
                         f"{rows_name} {tuple(rows.shape)} and {index_name} {index.dtype} {tuple(index.shape)}")
    if rows.device != index.device:
        raise ValueError(f"{fn}: {rows_name} is on {rows.device} but {index_name} on {index.device}; "
                         "move the index to the rows' device")


def _interpreted() -> bool:
    from triton.runtime.interpreter import InterpretedFunction
    return isinstance(_gather_rows_kernel, InterpretedFunction)


# ----------------------------------------------------------------------------- autograd

class _PermuteRows(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, src, impl):
        ctx.save_for_backward(src)
        ctx.num_rows, ctx.impl = x.shape[0], impl
        y, _ = _gather_rows(x, src, None, None, impl)
        return y

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_y):
        (src,) = ctx.saved_tensors
        return _scatter_add_rows(grad_y.contiguous(), src, None, ctx.num_rows, ctx.impl), None, None


class _UnpermuteRows(torch.autograd.Function):
    @staticmethod
    def forward(ctx, y, dst, weights, num_rows, impl):
        want_dw = weights is not None and ctx.needs_input_grad[2]
        ctx.save_for_backward(dst, weights, y if want_dw else None)
        ctx.impl = impl
        return _scatter_add_rows(y, dst, weights, num_rows, impl)

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_out):
        dst, weights, y = ctx.saved_tensors
        # grad_y[i] = w[i] * grad_out[dst[i]]; grad_w[i] = <grad_out[dst[i]], y[i]> (y saved only if wanted)
        grad_y, grad_w = _gather_rows(grad_out.contiguous(), dst, weights, y, ctx.impl)
        return (grad_y if ctx.needs_input_grad[0] else None), None, grad_w, None, None


def _gather_rows(x, idx, weights, other, impl):
    """(weights[i] * x[idx[i]] for each i, and <x[idx[i]], other[i]> in weights' dtype or None if no other)."""
    if impl == "triton":
        return _triton_gather(x, idx, weights, other)
    return _torch_gather(x, idx, weights, other)


def _scatter_add_rows(y, idx, weights, num_rows, impl):
    """(num_rows, H) in y's dtype: sum of weights[i] * y[i] over the i with idx[i] = row."""
    if impl == "triton":
        return _triton_scatter_add(y, idx, weights, num_rows)
    return _torch_scatter_add(y, idx, weights, num_rows)


# ----------------------------------------------------------------------------- PyTorch fallback

def _torch_gather(x, idx, weights, other):
    acc = acc_dtype(x.dtype)
    rows = x.index_select(0, idx)  # (T, H) -> (N, H)
    grad_w = (rows.to(acc) * other.to(acc)).sum(1).to(weights.dtype) if other is not None else None
    if weights is not None:
        rows = (rows.to(acc) * weights.to(acc)[:, None]).to(x.dtype)
    return rows, grad_w


def _torch_scatter_add(y, idx, weights, num_rows):
    acc = acc_dtype(y.dtype)
    src = y.to(acc)
    if weights is not None:
        src = src * weights.to(acc)[:, None]
    out = torch.zeros((num_rows, y.shape[1]), dtype=acc, device=y.device)
    return out.index_add_(0, idx, src).to(y.dtype)  # (N, H) -> (num_rows, H)


# ----------------------------------------------------------------------------- Triton kernels

if HAS_TRITON:

    @triton.jit
    def _gather_rows_kernel(X, IDX, W, OTHER, Y, DW, N, H,
                            HAS_W: tl.constexpr, WANT_DW: tl.constexpr,
                            ACC: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_H: tl.constexpr):
        # one program: BLOCK_N output rows i; Y[i] = W[i] * X[IDX[i]], DW[i] = sum_h X[IDX[i], h] * OTHER[i, h]
        offs_n = tl.program_id(0).to(tl.int64) * BLOCK_N + tl.arange(0, BLOCK_N)
        row_ok = offs_n < N
        src = tl.load(IDX + offs_n, mask=row_ok, other=0).to(tl.int64)
        if HAS_W:
            w = tl.load(W + offs_n, mask=row_ok, other=0.0).to(ACC)
        dw = tl.zeros([BLOCK_N], ACC)
        for h0 in range(0, H, BLOCK_H):
            offs_h = h0 + tl.arange(0, BLOCK_H)
            ok = row_ok[:, None] & (offs_h[None, :] < H)
            rows = tl.load(X + src[:, None] * H + offs_h[None, :], mask=ok, other=0.0)
            if WANT_DW:
                other = tl.load(OTHER + offs_n[:, None] * H + offs_h[None, :], mask=ok, other=0.0)
                dw += tl.sum(rows.to(ACC) * other.to(ACC), 1)
            if HAS_W:
                rows = (rows.to(ACC) * w[:, None]).to(Y.dtype.element_ty)
            tl.store(Y + offs_n[:, None] * H + offs_h[None, :], rows, mask=ok)
        if WANT_DW:
            tl.store(DW + offs_n, dw.to(DW.dtype.element_ty), mask=row_ok)

    @triton.jit
    def _scatter_add_rows_kernel(Y, IDX, W, OUT, N, H,
                                 HAS_W: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_H: tl.constexpr):
        # one program: BLOCK_N input rows i; OUT[IDX[i]] += W[i] * Y[i] (OUT in the accumulation dtype)
        offs_n = tl.program_id(0).to(tl.int64) * BLOCK_N + tl.arange(0, BLOCK_N)
        row_ok = offs_n < N
        dst = tl.load(IDX + offs_n, mask=row_ok, other=0).to(tl.int64)
        acc_ty = OUT.dtype.element_ty
        if HAS_W:
            w = tl.load(W + offs_n, mask=row_ok, other=0.0).to(acc_ty)
        for h0 in range(0, H, BLOCK_H):
            offs_h = h0 + tl.arange(0, BLOCK_H)
            ok = row_ok[:, None] & (offs_h[None, :] < H)
            rows = tl.load(Y + offs_n[:, None] * H + offs_h[None, :], mask=ok, other=0.0).to(acc_ty)
            if HAS_W:
                rows = rows * w[:, None]
            # rows repeated in IDX (top-k) meet here from different programs, hence the atomics
            tl.atomic_add(OUT + dst[:, None] * H + offs_h[None, :], rows, mask=ok, sem="relaxed")

else:  # pragma: no cover
    _gather_rows_kernel = _scatter_add_rows_kernel = None


def _tiles(x: torch.Tensor, h: int) -> dict:
    block_h = max(16, triton.next_power_of_2(h))
    if not x.is_cuda:  # the interpreter: few, wide programs are fastest; still loop over H past 64
        return dict(BLOCK_N=32, BLOCK_H=min(block_h, 64), num_warps=1)
    block_h = min(block_h, 1024)
    return dict(BLOCK_N=max(1, 4096 // block_h), BLOCK_H=block_h, num_warps=4)


def _triton_gather(x, idx, weights, other):
    n, h = idx.shape[0], x.shape[1]
    acc = acc_dtype(x.dtype)
    y = torch.empty((n, h), dtype=x.dtype, device=x.device)
    grad_w = torch.empty((n,), dtype=weights.dtype, device=x.device) if other is not None else None
    if n == 0:
        return y, grad_w
    if h == 0:
        return y, (grad_w.zero_() if grad_w is not None else None)
    cfg = _tiles(x, h)
    _gather_rows_kernel[(triton.cdiv(n, cfg["BLOCK_N"]),)](
        x, idx, weights if weights is not None else x, other if other is not None else x, y,
        grad_w if grad_w is not None else y, n, h,
        HAS_W=weights is not None, WANT_DW=other is not None,
        ACC=tl.float64 if acc == torch.float64 else tl.float32, **cfg)
    return y, grad_w


def _triton_scatter_add(y, idx, weights, num_rows):
    n, h = y.shape
    acc = acc_dtype(y.dtype)
    out = torch.zeros((num_rows, h), dtype=acc, device=y.device)
    if n and h:
        cfg = _tiles(y, h)
        _scatter_add_rows_kernel[(triton.cdiv(n, cfg["BLOCK_N"]),)](
            y, idx, weights if weights is not None else y, out, n, h, HAS_W=weights is not None, **cfg)
    return out.to(y.dtype)  # no copy for fp32/fp64
