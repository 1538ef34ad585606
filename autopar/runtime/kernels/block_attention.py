"""Block attention with its log-sum-exp: the compute step of ring attention (parallel-forms.md §6).

    out, lse = block_attention(q, k, v, causal=..., scale=...)
    dq, dk, dv = block_attention_backward(dout, q, k, v, out, lse, causal=..., scale=...)

Shapes: q (B, H, Sq, D), k (B, Hkv, Sk, D), v (B, Hkv, Sk, Dv) with H % Hkv == 0 (GQA: query head h
reads KV head h // (H // Hkv), the `repeat_interleave` convention of SDPA's `enable_gqa`; no KV copy
is made). out (B, H, Sq, Dv); lse (B, H, Sq) is the natural-log log-sum-exp of the scaled scores of
each query row, in the accumulation dtype (fp32, or fp64 for fp64 inputs).

Mask: `causal` lets query i attend key j iff j <= i + causal_offset (top-left aligned). With the
default offset 0 and Sq == Sk this is the diagonal-block causal mask; offset -1 is the
`q[1:]` vs `k[:-1]` block of the stripe layout. A query row with no key to attend (fully masked,
pitfall 17) gets out = 0 and lse = -inf, never NaN, in both passes.

Backward: `block_attention_backward` takes the GLOBAL out and lse of the merged attention (all blocks
together) and returns this block's contribution to the gradients:
    P = exp(scale·QKᵀ − lse),  dV = Pᵀ·dO,  dS = P ∘ (dO·Vᵀ − Δ),  dQ = scale·dS·K,  dK = scale·dSᵀ·Q
with Δ = rowsum(dO ∘ O) (pass `delta` to reuse it across blocks). dK, dV sum over the query heads
of a GQA group. Gradients come back in `grad_dtype` (default: the dtype of q, k, v).

Implementations (`impl`, or the env var AUTOPAR_BLOCK_ATTENTION; default "auto"):
* "torch": pure PyTorch, scores materialised per block, math in the accumulation dtype.
* "triton": flash-attention tiling (online softmax forward; backward as one dK/dV kernel per KV tile
  that loops over the query heads of its GQA group, so no atomics, and one dQ kernel per query
  tile). fp16/bf16/fp32 only, fp32 accumulation, fp32 dots in IEEE precision. On CPU it needs
  TRITON_INTERPRET=1 set before this module is imported (Triton reads it when the kernels are
  decorated).
* "auto": Triton for CUDA tensors of those dtypes when triton imports, else the PyTorch fallback.
"""

from __future__ import annotations

import os

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - depends on the environment
    triton = None
    tl = None

HAS_TRITON = triton is not None
_TRITON_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
_IMPLS = ("auto", "torch", "triton")


def acc_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype block attention accumulates in (and returns lse in): fp32, or fp64 for fp64."""
    return torch.float64 if dtype == torch.float64 else torch.float32


# ----------------------------------------------------------------------------- public API

def block_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, causal: bool, scale: float,
                    causal_offset: int = 0, out_dtype: torch.dtype | None = None,
                    impl: str | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention of q over one KV block: (out (B, H, Sq, Dv) in `out_dtype`, lse (B, H, Sq))."""
    _check_shapes(q, k, v)
    out_dtype = out_dtype or q.dtype
    if _pick_impl(q, impl) == "triton":
        return _triton_forward(q, k, v, causal, scale, causal_offset, out_dtype)
    return _torch_forward(q, k, v, causal, scale, causal_offset, out_dtype)


def block_attention_backward(dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                             out: torch.Tensor, lse: torch.Tensor, *, causal: bool, scale: float,
                             causal_offset: int = 0, delta: torch.Tensor | None = None,
                             grad_dtype: torch.dtype | None = None,
                             impl: str | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """This block's (dq, dk, dv), given the global `out`/`lse` (or `delta` = rowsum(dout * out))."""
    _check_shapes(q, k, v)
    if dout.shape != q.shape[:-1] + v.shape[-1:] or lse.shape != q.shape[:-1]:
        raise ValueError(f"block_attention_backward: dout {tuple(dout.shape)} must be (B, H, Sq, Dv) = "
                         f"{tuple(q.shape[:-1] + v.shape[-1:])} and lse {tuple(lse.shape)} must be "
                         f"{tuple(q.shape[:-1])}")
    acc = acc_dtype(q.dtype)
    if delta is None:
        delta = attention_delta(dout, out)
    grad_dtype = grad_dtype or q.dtype
    if _pick_impl(q, impl) == "triton":
        return _triton_backward(dout, q, k, v, lse.to(acc), delta.to(acc), causal, scale, causal_offset, grad_dtype)
    return _torch_backward(dout, q, k, v, lse.to(acc), delta.to(acc), causal, scale, causal_offset, grad_dtype)


def attention_delta(dout: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """Δ = rowsum(dO ∘ O) (B, H, Sq) in the accumulation dtype: the softmax-backward row term."""
    acc = acc_dtype(dout.dtype)
    return (dout.to(acc) * out.to(acc)).sum(-1)


def _check_shapes(q, k, v) -> None:
    if q.dim() != 4 or k.dim() != 4 or v.dim() != 4:
        raise ValueError(f"block_attention expects (B, H, S, D) tensors, got q {tuple(q.shape)}, "
                         f"k {tuple(k.shape)}, v {tuple(v.shape)}")
    (b, h, _, d), (bk, hkv, sk, dk), (bv, hv, sv, _) = q.shape, k.shape, v.shape
    if not (b == bk == bv and hkv == hv and sk == sv and d == dk):
        raise ValueError(f"block_attention: q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)} disagree "
                         "(need the same batch, k and v the same heads and length, q and k the same head dim)")
    if hkv == 0 or h % hkv:
        raise ValueError(f"block_attention: {h} query heads are not a multiple of {hkv} KV heads "
                         "(GQA needs H % Hkv == 0)")


def _pick_impl(q: torch.Tensor, impl: str | None) -> str:
    impl = impl or os.environ.get("AUTOPAR_BLOCK_ATTENTION", "auto")
    if impl not in _IMPLS:
        raise ValueError(f"block attention impl must be one of {_IMPLS}, got {impl!r} "
                         "(from the impl argument or AUTOPAR_BLOCK_ATTENTION)")
    if impl == "auto":
        return "triton" if HAS_TRITON and q.is_cuda and q.dtype in _TRITON_DTYPES else "torch"
    if impl == "triton":
        if not HAS_TRITON:
            raise RuntimeError("block attention impl 'triton' was requested but triton does not import")
        if q.dtype not in _TRITON_DTYPES:
            raise ValueError(f"the Triton block attention supports {_TRITON_DTYPES}, got {q.dtype}; use impl='torch'")
        if not q.is_cuda and not isinstance(_fwd_kernel, _interpreted_type()):
            raise RuntimeError("the Triton block attention on CPU tensors needs TRITON_INTERPRET=1 set before "
                               "autopar.runtime.kernels is imported")
    return impl


def _interpreted_type():
    from triton.runtime.interpreter import InterpretedFunction
    return InterpretedFunction


# ----------------------------------------------------------------------------- PyTorch fallback

def _mask(sq: int, sk: int, causal_offset: int, device) -> torch.Tensor:
    # (Sq, Sk) True where query i may attend key j
    return torch.arange(sk, device=device)[None, :] <= torch.arange(sq, device=device)[:, None] + causal_offset


def _scores(q, k, causal, scale, causal_offset):
    # (B, H, Sq, D) x (B, Hkv, Sk, D) -> (B, Hkv, G, Sq, Sk) scaled, masked with -inf
    acc = acc_dtype(q.dtype)
    hkv = k.shape[1]
    qf = q.to(acc).unflatten(1, (hkv, -1))
    kf = k.to(acc).unsqueeze(2)
    s = torch.matmul(qf, kf.transpose(-1, -2)) * scale
    if causal:
        s = s.masked_fill(~_mask(q.shape[2], k.shape[2], causal_offset, q.device), float("-inf"))
    return qf, kf, s


def _torch_forward(q, k, v, causal, scale, causal_offset, out_dtype):
    b, h, sq, _ = q.shape
    acc = acc_dtype(q.dtype)
    if k.shape[2] == 0:
        return (q.new_zeros((b, h, sq, v.shape[-1]), dtype=out_dtype),
                q.new_full((b, h, sq), float("-inf"), dtype=acc))
    _, _, s = _scores(q, k, causal, scale, causal_offset)
    m = s.amax(-1, keepdim=True)
    m = torch.where(m == float("-inf"), torch.zeros_like(m), m)  # fully masked row: exp(-inf - 0) = 0
    e = torch.exp(s - m)
    l = e.sum(-1, keepdim=True)
    out = torch.matmul(e, v.to(acc).unsqueeze(2)) / torch.where(l == 0, torch.ones_like(l), l)
    lse = (m + torch.log(l)).squeeze(-1)  # log(0) = -inf for a fully masked row
    return out.flatten(1, 2).to(out_dtype), lse.flatten(1, 2)


def _torch_backward(dout, q, k, v, lse, delta, causal, scale, causal_offset, grad_dtype):
    acc = acc_dtype(q.dtype)
    if k.shape[2] == 0:
        return (torch.zeros_like(q, dtype=grad_dtype), torch.zeros_like(k, dtype=grad_dtype),
                torch.zeros_like(v, dtype=grad_dtype))
    hkv = k.shape[1]
    qf, kf, s = _scores(q, k, causal, scale, causal_offset)
    lse = lse.unflatten(1, (hkv, -1)).unsqueeze(-1)
    lse = torch.where(lse == float("-inf"), torch.zeros_like(lse), lse)  # its row is fully masked: P = 0
    p = torch.exp(s - lse)  # (B, Hkv, G, Sq, Sk)
    do = dout.to(acc).unflatten(1, (hkv, -1))
    vf = v.to(acc).unsqueeze(2)
    dv = torch.matmul(p.transpose(-1, -2), do).sum(2)
    ds = p * (torch.matmul(do, vf.transpose(-1, -2)) - delta.unflatten(1, (hkv, -1)).unsqueeze(-1))
    dq = torch.matmul(ds, kf).flatten(1, 2) * scale
    dk = torch.matmul(ds.transpose(-1, -2), qf).sum(2) * scale
    return dq.to(grad_dtype), dk.to(grad_dtype), dv.to(grad_dtype)


# ----------------------------------------------------------------------------- Triton kernels

if HAS_TRITON:

    @triton.jit
    def _fwd_kernel(Q, K, V, O, LSE,
                    sqb, sqh, sqm, sqd, skb, skh, skn, skd, svb, svh, svn, svd, sob, soh, som, sod,
                    H, G, SQ, SK, D, DV, scale, causal_offset,
                    CAUSAL: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                    BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr, PRECISION: tl.constexpr):
        # one program: BLOCK_M query rows of one (batch, head); online softmax over the KV tiles
        pid_m = tl.program_id(0)
        pid_bh = tl.program_id(1)
        b = pid_bh // H
        h = pid_bh % H
        hk = h // G
        offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        offs_n0 = tl.arange(0, BLOCK_N)
        offs_d = tl.arange(0, BLOCK_D)
        offs_dv = tl.arange(0, BLOCK_DV)
        row_ok = offs_m < SQ
        q = tl.load(Q + b * sqb + h * sqh + offs_m[:, None] * sqm + offs_d[None, :] * sqd,
                    mask=row_ok[:, None] & (offs_d[None, :] < D), other=0.0)
        k_base = K + b * skb + hk * skh
        v_base = V + b * svb + hk * svh
        m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
        l_i = tl.zeros([BLOCK_M], tl.float32)
        acc = tl.zeros([BLOCK_M, BLOCK_DV], tl.float32)
        hi = SK
        if CAUSAL:
            hi = tl.minimum(SK, (pid_m + 1) * BLOCK_M + causal_offset)
        for start_n in range(0, hi, BLOCK_N):
            offs_n = start_n + offs_n0
            col_ok = offs_n < SK
            kt = tl.load(k_base + offs_n[None, :] * skn + offs_d[:, None] * skd,
                         mask=col_ok[None, :] & (offs_d[:, None] < D), other=0.0)  # (BLOCK_D, BLOCK_N)
            s = tl.dot(q, kt, input_precision=PRECISION) * scale
            valid = col_ok[None, :]
            if CAUSAL:
                valid = valid & (offs_n[None, :] <= offs_m[:, None] + causal_offset)
            s = tl.where(valid, s, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, 1))
            m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
            alpha = tl.exp(m_i - m_safe)
            p = tl.exp(s - m_safe[:, None])
            l_i = l_i * alpha + tl.sum(p, 1)
            vb = tl.load(v_base + offs_n[:, None] * svn + offs_dv[None, :] * svd,
                         mask=col_ok[:, None] & (offs_dv[None, :] < DV), other=0.0)
            acc = acc * alpha[:, None] + tl.dot(p.to(vb.dtype), vb, input_precision=PRECISION)
            m_i = m_new
        out = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
        lse = tl.where(l_i == 0.0, float("-inf"), m_i + tl.log(tl.where(l_i == 0.0, 1.0, l_i)))
        tl.store(O + b * sob + h * soh + offs_m[:, None] * som + offs_dv[None, :] * sod,
                 out.to(O.dtype.element_ty), mask=row_ok[:, None] & (offs_dv[None, :] < DV))
        tl.store(LSE + pid_bh * SQ + offs_m, lse, mask=row_ok)

    @triton.jit
    def _bwd_dkdv_kernel(Q, K, V, DO, LSE, DELTA, DK, DV_,
                         sqb, sqh, sqm, sqd, skb, skh, skn, skd, svb, svh, svn, svd,
                         sdob, sdoh, sdom, sdod,
                         H, HKV, G, SQ, SK, D, DV, scale, causal_offset,
                         CAUSAL: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                         BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr, PRECISION: tl.constexpr):
        # one program: BLOCK_N keys of one (batch, KV head), summed over the G query heads of its group
        pid_n = tl.program_id(0)
        pid_bhk = tl.program_id(1)
        b = pid_bhk // HKV
        hk = pid_bhk % HKV
        start_n = pid_n * BLOCK_N
        offs_n = start_n + tl.arange(0, BLOCK_N)
        offs_m0 = tl.arange(0, BLOCK_M)
        offs_d = tl.arange(0, BLOCK_D)
        offs_dv = tl.arange(0, BLOCK_DV)
        col_ok = offs_n < SK
        kb = tl.load(K + b * skb + hk * skh + offs_n[:, None] * skn + offs_d[None, :] * skd,
                     mask=col_ok[:, None] & (offs_d[None, :] < D), other=0.0)  # (BLOCK_N, BLOCK_D)
        vb = tl.load(V + b * svb + hk * svh + offs_n[:, None] * svn + offs_dv[None, :] * svd,
                     mask=col_ok[:, None] & (offs_dv[None, :] < DV), other=0.0)
        dk = tl.zeros([BLOCK_N, BLOCK_D], tl.float32)
        dv = tl.zeros([BLOCK_N, BLOCK_DV], tl.float32)
        lo = 0
        if CAUSAL:  # query i reaches key j iff i >= j - causal_offset
            lo = tl.maximum(start_n - causal_offset, 0)
            lo = (lo // BLOCK_M) * BLOCK_M
        for g in range(0, G):
            h = hk * G + g
            q_base = Q + b * sqb + h * sqh
            do_base = DO + b * sdob + h * sdoh
            row_base = (b * H + h) * SQ
            for start_m in range(lo, SQ, BLOCK_M):
                offs_m = start_m + offs_m0
                row_ok = offs_m < SQ
                q = tl.load(q_base + offs_m[:, None] * sqm + offs_d[None, :] * sqd,
                            mask=row_ok[:, None] & (offs_d[None, :] < D), other=0.0)
                do = tl.load(do_base + offs_m[:, None] * sdom + offs_dv[None, :] * sdod,
                             mask=row_ok[:, None] & (offs_dv[None, :] < DV), other=0.0)
                lse = tl.load(LSE + row_base + offs_m, mask=row_ok, other=0.0)
                lse = tl.where(lse == float("-inf"), 0.0, lse)
                delta = tl.load(DELTA + row_base + offs_m, mask=row_ok, other=0.0)
                s = tl.dot(q, tl.trans(kb), input_precision=PRECISION) * scale  # (BLOCK_M, BLOCK_N)
                valid = row_ok[:, None] & col_ok[None, :]
                if CAUSAL:
                    valid = valid & (offs_n[None, :] <= offs_m[:, None] + causal_offset)
                p = tl.where(valid, tl.exp(s - lse[:, None]), 0.0)
                dv += tl.dot(tl.trans(p).to(do.dtype), do, input_precision=PRECISION)
                dp = tl.dot(do, tl.trans(vb), input_precision=PRECISION)
                ds = p * (dp - delta[:, None])
                dk += tl.dot(tl.trans(ds).to(q.dtype), q, input_precision=PRECISION)
        dk = dk * scale
        out_row = pid_bhk * SK + offs_n
        tl.store(DK + out_row[:, None] * D + offs_d[None, :], dk.to(DK.dtype.element_ty),
                 mask=col_ok[:, None] & (offs_d[None, :] < D))
        tl.store(DV_ + out_row[:, None] * DV + offs_dv[None, :], dv.to(DV_.dtype.element_ty),
                 mask=col_ok[:, None] & (offs_dv[None, :] < DV))

    @triton.jit
    def _bwd_dq_kernel(Q, K, V, DO, LSE, DELTA, DQ,
                       sqb, sqh, sqm, sqd, skb, skh, skn, skd, svb, svh, svn, svd,
                       sdob, sdoh, sdom, sdod,
                       H, G, SQ, SK, D, DV, scale, causal_offset,
                       CAUSAL: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                       BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr, PRECISION: tl.constexpr):
        # one program: BLOCK_M query rows of one (batch, head), looping over the KV tiles
        pid_m = tl.program_id(0)
        pid_bh = tl.program_id(1)
        b = pid_bh // H
        h = pid_bh % H
        hk = h // G
        offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        offs_n0 = tl.arange(0, BLOCK_N)
        offs_d = tl.arange(0, BLOCK_D)
        offs_dv = tl.arange(0, BLOCK_DV)
        row_ok = offs_m < SQ
        q = tl.load(Q + b * sqb + h * sqh + offs_m[:, None] * sqm + offs_d[None, :] * sqd,
                    mask=row_ok[:, None] & (offs_d[None, :] < D), other=0.0)
        do = tl.load(DO + b * sdob + h * sdoh + offs_m[:, None] * sdom + offs_dv[None, :] * sdod,
                     mask=row_ok[:, None] & (offs_dv[None, :] < DV), other=0.0)
        lse = tl.load(LSE + pid_bh * SQ + offs_m, mask=row_ok, other=0.0)
        lse = tl.where(lse == float("-inf"), 0.0, lse)
        delta = tl.load(DELTA + pid_bh * SQ + offs_m, mask=row_ok, other=0.0)
        k_base = K + b * skb + hk * skh
        v_base = V + b * svb + hk * svh
        dq = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
        hi = SK
        if CAUSAL:
            hi = tl.minimum(SK, (pid_m + 1) * BLOCK_M + causal_offset)
        for start_n in range(0, hi, BLOCK_N):
            offs_n = start_n + offs_n0
            col_ok = offs_n < SK
            kb = tl.load(k_base + offs_n[:, None] * skn + offs_d[None, :] * skd,
                         mask=col_ok[:, None] & (offs_d[None, :] < D), other=0.0)  # (BLOCK_N, BLOCK_D)
            vb = tl.load(v_base + offs_n[:, None] * svn + offs_dv[None, :] * svd,
                         mask=col_ok[:, None] & (offs_dv[None, :] < DV), other=0.0)
            s = tl.dot(q, tl.trans(kb), input_precision=PRECISION) * scale
            valid = row_ok[:, None] & col_ok[None, :]
            if CAUSAL:
                valid = valid & (offs_n[None, :] <= offs_m[:, None] + causal_offset)
            p = tl.where(valid, tl.exp(s - lse[:, None]), 0.0)
            dp = tl.dot(do, tl.trans(vb), input_precision=PRECISION)
            ds = p * (dp - delta[:, None])
            dq += tl.dot(ds.to(kb.dtype), kb, input_precision=PRECISION)
        dq = dq * scale
        tl.store(DQ + (pid_bh * SQ + offs_m[:, None]) * D + offs_d[None, :], dq.to(DQ.dtype.element_ty),
                 mask=row_ok[:, None] & (offs_d[None, :] < D))

else:  # pragma: no cover
    _fwd_kernel = _bwd_dkdv_kernel = _bwd_dq_kernel = None


def _tiles(q: torch.Tensor, d: int, dv: int) -> dict:
    block_d = max(16, triton.next_power_of_2(d))
    block_dv = max(16, triton.next_power_of_2(dv))
    if not q.is_cuda:  # the interpreter: small tiles are fastest
        return dict(BLOCK_M=16, BLOCK_N=16, BLOCK_D=block_d, BLOCK_DV=block_dv, num_warps=1)
    block = 64 if max(block_d, block_dv) <= 128 else 32
    return dict(BLOCK_M=block, BLOCK_N=block, BLOCK_D=block_d, BLOCK_DV=block_dv,
                num_warps=4 if max(block_d, block_dv) <= 64 else 8)


def _precision(q: torch.Tensor) -> str:
    return "ieee" if q.dtype == torch.float32 else "tf32"  # ignored for fp16/bf16 dots


def _triton_forward(q, k, v, causal, scale, causal_offset, out_dtype):
    b, h, sq, d = q.shape
    hkv, sk, dv = k.shape[1], k.shape[2], v.shape[3]
    out = torch.empty((b, h, sq, dv), dtype=out_dtype, device=q.device)
    lse = torch.empty((b, h, sq), dtype=torch.float32, device=q.device)
    if sq == 0 or b * h == 0:
        return out, lse
    cfg = _tiles(q, d, dv)
    grid = (triton.cdiv(sq, cfg["BLOCK_M"]), b * h)
    _fwd_kernel[grid](q, k, v, out, lse, *q.stride(), *k.stride(), *v.stride(), *out.stride(),
                      h, h // hkv, sq, sk, d, dv, float(scale), int(causal_offset),
                      CAUSAL=bool(causal), PRECISION=_precision(q), **cfg)
    return out, lse


def _triton_backward(dout, q, k, v, lse, delta, causal, scale, causal_offset, grad_dtype):
    b, h, sq, d = q.shape
    hkv, sk, dv = k.shape[1], k.shape[2], v.shape[3]
    lse, delta = lse.contiguous(), delta.contiguous()
    dq = torch.empty((b, h, sq, d), dtype=grad_dtype, device=q.device)
    dk = torch.empty((b, hkv, sk, d), dtype=grad_dtype, device=q.device)
    dvt = torch.empty((b, hkv, sk, dv), dtype=grad_dtype, device=q.device)
    cfg = _tiles(q, d, dv)
    strides = (*q.stride(), *k.stride(), *v.stride(), *dout.stride())
    common = dict(CAUSAL=bool(causal), PRECISION=_precision(q), **cfg)
    if sk and b * hkv:
        _bwd_dkdv_kernel[(triton.cdiv(sk, cfg["BLOCK_N"]), b * hkv)](
            q, k, v, dout, lse, delta, dk, dvt, *strides,
            h, hkv, h // hkv, sq, sk, d, dv, float(scale), int(causal_offset), **common)
    if sq and b * h:
        _bwd_dq_kernel[(triton.cdiv(sq, cfg["BLOCK_M"]), b * h)](
            q, k, v, dout, lse, delta, dq, *strides,
            h, h // hkv, sq, sk, d, dv, float(scale), int(causal_offset), **common)
    return dq, dk, dvt
