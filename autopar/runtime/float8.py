"""A float8 linear on `torch._scaled_mm`, forward and backward in fp8 (torchao's `Float8Linear` recipes).

`float8_linear(x, weight, bias, recipe)` computes `x @ weight.T + bias` with all three GEMMs in `torch._scaled_mm`:

- output = x8 @ w8.T: x and the weight in e4m3 (`torch.float8_e4m3fn`);
- grad_input = g8 @ w8: the output gradient in e5m2 (`torch.float8_e5m2`; rowwise: e4m3), the weight in e4m3;
- grad_weight = g8.T @ x8: the output gradient in e5m2 (rowwise: e4m3), the input in e4m3.

Scales are dynamic (from each operand's amax, every call), fp32, and divide out in `_scaled_mm` (`scale_a`,
`scale_b` are the inverse scales): `tensorwise` one per tensor; `rowwise` one per row along each GEMM's reduction
dim (for the output GEMM: x per row of K, w per row of K; for grad_input: g per row of N, w per column over N; for
grad_weight: g per column over M, x per column over M), as torchao's `ROWWISE` recipe scales them, each scale
rounded down to a power of 2 (`round_scales_to_power_of_2`). Each recipe is torchao's `Float8LinearConfig.
from_recipe_name(recipe)` (`GRAD_DTYPE`, `POW2_SCALES`, `FAST_ACCUM`): per linear, bit-identical to torchao 0.18's
`Float8Linear` on the CPU (fp32 and bf16; `_mm`: the rowwise GEMMs' bf16 outputs), which is what lets a model
converted with torchao run here (`autopar.torchao_float8`). `_scaled_mm` wants its second operand column-major: each
is passed as a transposed row-major tensor. The high-precision x and weight are saved for backward and cast again there along the dims
backward needs (torchao does the same). The bias gradient is the output gradient summed in high precision.

Parallel (`m_axes`, `k_axes`, `n_axes`: the mesh axes splitting the tokens M, the in features K, the out features N
of this rank's operands; `passes.lower.float8_linears_pass`): every amax is all-reduced (MAX) over the axes that
split the dims it reduces over, so each rank's scales are the single device's and its fp8 GEMMs compute exactly
its part of what the single-device fp8 linear computes (summation order aside). Data parallelism splits M;
a column-parallel weight N (w and g are sharded there); a row-parallel one K (w and x). Tensorwise reduces over
both dims of each operand; rowwise over one: x and w over K forward, g and w over N for grad_input, g and x over M
for grad_weight (`autopar.forms.float8.amax_reductions` counts them, `autopar.forms.blocks.float8_cost` prices
them).
"""

from __future__ import annotations

import torch

from autopar.forms.float8 import RECIPES  # ("tensorwise", "rowwise"): the planner's recipe names

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
TENSORWISE, ROWWISE = RECIPES
_EPS = 1e-12  # an all-zero operand keeps a finite scale (torchao's EPS)

# Each recipe as torchao's `Float8LinearConfig.from_recipe_name` configures it (torchao 0.18 `torchao/float8/config.py`):
# the output gradient's fp8 dtype (tensorwise e5m2; rowwise e4m3 for all three GEMMs), whether every scale is rounded
# down to a power of 2 (`round_scales_to_power_of_2`: rowwise), and `use_fast_accum` on the output GEMM only (both)
GRAD_DTYPE = {TENSORWISE: E5M2, ROWWISE: E4M3}
POW2_SCALES = {TENSORWISE: False, ROWWISE: True}
FAST_ACCUM = {"output": True, "grad_input": False, "grad_weight": False}


def _scale(t: torch.Tensor, dtype: torch.dtype, dim: int | None, axes: tuple = (), backward: bool = False,
           pow2: bool = False) -> torch.Tensor:
    """fp32 scale mapping `t`'s amax (over everything, or over `dim` kept; all-reduced MAX over `axes`) to `dtype`'s
    largest finite value; `pow2`: rounded down to a power of 2 (torchao's `_round_scale_down_to_power_of_2`), after
    the all-reduce so that every rank rounds the same amax."""
    with torch.no_grad():
        amax = t.abs().amax() if dim is None else t.abs().amax(dim=dim, keepdim=True)
        for a in axes:
            from autopar.mesh import resolve_axis
            from autopar.runtime.collectives import _raw_all_reduce
            amax = _raw_all_reduce(amax, resolve_axis(a), backward=backward, op="max")
        s = (torch.finfo(dtype).max / amax.to(torch.float64).clamp(min=_EPS)).to(torch.float32)
        return torch.exp2(torch.floor(torch.log2(s))) if pow2 else s


def cast(t: torch.Tensor, dtype: torch.dtype, dim: int | None, axes: tuple = (), backward: bool = False,
         pow2: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """(t in fp8 `dtype`, the inverse scale `_scaled_mm` multiplies back), scaled per tensor (`dim` None) or along
    `dim` (one scale per slice over `dim`); `axes`: mesh axes whose ranks hold the other slices of what the amax
    reduces over (its amax all-reduced MAX there); `pow2`: the scale rounded down to a power of 2."""
    return _cast_with(t, dtype, _scale(t, dtype, dim, axes, backward, pow2))


def _cast_with(t: torch.Tensor, dtype: torch.dtype, s: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """`cast` with the scale `s` given."""
    fmax = torch.finfo(dtype).max
    return (t.to(torch.float32) * s).clamp(-fmax, fmax).to(dtype), s.reciprocal()


def _mm(a: torch.Tensor, sa: torch.Tensor, b_t: torch.Tensor, sb: torch.Tensor, out_dtype: torch.dtype,
        fast_accum: bool = False, split: bool = False):
    """a (m, k) row-major @ b (k, n), `b_t` its (n, k) row-major transpose (so `b_t.t()` is column-major).

    Rowwise scales (`sa` (m, 1)) with an fp32 or fp16 result are written in bf16 and cast, as torchao's
    `addmm_float8_unwrapped` does on every device (CUDA's rowwise `_scaled_mm` writes bf16 only): so a rowwise linear
    is bit-identical to torchao's `Float8Linear` in an fp32 model too. Except where `split` (the GEMM's reduction dim
    is split over ranks: a row-parallel output, a column-parallel grad_input, a data-parallel grad_weight) on the CPU,
    whose kernel writes fp32: that rank's partial sum is kept in fp32 for its reduction, since rounding each partial
    to bf16 before the sum (as torchao under FSDP/TP does, and CUDA must) adds rounding the single device does not
    have; the sum then lacks the single device's one bf16 rounding, the only difference from it (README, float8)."""
    bf16_out = sa.dim() and out_dtype in (torch.float32, torch.float16) and (a.is_cuda or not split)
    out = torch.bfloat16 if bf16_out else out_dtype
    return torch._scaled_mm(a.contiguous(), b_t.contiguous().t(), scale_a=sa, scale_b=sb.t() if sb.dim() else sb,
                            out_dtype=out, use_fast_accum=fast_accum).to(out_dtype)


class _Float8Linear(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias, recipe, axes):
        m_axes, k_axes, n_axes = axes
        rowwise, p2 = recipe == ROWWISE, POW2_SCALES[recipe]
        x2 = x.reshape(-1, x.shape[-1])  # (M, K)
        x8, sx = cast(x2, E4M3, -1 if rowwise else None, k_axes if rowwise else m_axes + k_axes, pow2=p2)  # (M, 1)
        w8, sw = cast(weight, E4M3, -1 if rowwise else None, k_axes if rowwise else n_axes + k_axes, pow2=p2)
        out = _mm(x8, sx, w8, sw, x.dtype, FAST_ACCUM["output"], bool(k_axes))  # (M, K) @ (K, N)
        if bias is not None:
            out = out + bias
        ctx.save_for_backward(x2, weight)
        ctx.recipe, ctx.has_bias, ctx.x_shape, ctx.axes = recipe, bias is not None, x.shape, axes
        return out.reshape(*x.shape[:-1], weight.shape[0])

    @staticmethod
    def backward(ctx, grad_out):
        x2, weight = ctx.saved_tensors
        m_axes, k_axes, n_axes = ctx.axes
        rowwise, p2, gd = ctx.recipe == ROWWISE, POW2_SCALES[ctx.recipe], GRAD_DTYPE[ctx.recipe]
        g = grad_out.reshape(-1, weight.shape[0])  # (M, N)
        grad_x = grad_w = grad_b = None
        if ctx.needs_input_grad[0]:  # (M, N) @ (N, K): g scaled per row (over N), w per column (over N)
            g8, sg = cast(g, gd, -1 if rowwise else None, n_axes if rowwise else m_axes + n_axes, True, p2)
            wt8, swt = cast(weight.t(), E4M3, -1 if rowwise else None, n_axes if rowwise else k_axes + n_axes, True,
                            p2)
            grad_x = _mm(g8, sg, wt8, swt, grad_out.dtype, FAST_ACCUM["grad_input"], bool(n_axes)).reshape(ctx.x_shape)
        if ctx.needs_input_grad[1]:  # (N, M) @ (M, K): g.T per row (over M), x per column (over M)
            gt8, sgt = cast(g.t(), gd, -1 if rowwise else None, m_axes if rowwise else m_axes + n_axes, True, p2)
            xt8, sxt = cast(x2.t(), E4M3, -1 if rowwise else None, m_axes if rowwise else m_axes + k_axes, True, p2)
            grad_w = _mm(gt8, sgt, xt8, sxt, weight.dtype, FAST_ACCUM["grad_weight"], bool(m_axes))
        if ctx.has_bias and ctx.needs_input_grad[2]:
            grad_b = g.sum(0)
        return grad_x, grad_w, grad_b, None, None


def float8_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
                  recipe: str = "tensorwise", m_axes: tuple = (), k_axes: tuple = (), n_axes: tuple = ()
                  ) -> torch.Tensor:
    """`F.linear(x, weight, bias)` with its forward and backward GEMMs in fp8 (module docstring); `m_axes`,
    `k_axes`, `n_axes`: the mesh axes (keys) that split its tokens, its in features, its out features."""
    if recipe not in RECIPES:
        raise ValueError(f"float8_linear: recipe {recipe!r} is not one of {RECIPES}. Fix: one of them")
    return _Float8Linear.apply(x, weight, bias, recipe, (tuple(m_axes), tuple(k_axes), tuple(n_axes)))


def _gather_fp8(w8: torch.Tensor, dim: int, axis, backward: bool = False) -> torch.Tensor:
    """All-gather an fp8 shard in 1 byte per element (it travels as its uint8 bits, recorded as fp8)."""
    from autopar.runtime.collectives import _c10d, _finish_all_gather, _record
    _record("all_gather", axis, w8, w8.numel() * axis.size, backward)
    pending = _c10d.all_gather_into_tensor(w8.view(torch.uint8).movedim(dim, 0).contiguous(), axis.size,
                                           axis.group_name)
    return _finish_all_gather(pending, dim, axis).view(w8.dtype)


class _Float8GatheredLinear(torch.autograd.Function):
    """A tensorwise float8 linear whose FSDP weight shard is cast to fp8 before its all-gather (torchao's
    `enable_fsdp_float8_all_gather`): the shard's amax all-reduced (MAX) over the data axis (and any axis splitting
    the weight otherwise), so the scale is the whole weight's, as on one device; the shard cast with it, gathered in
    1 byte per element, and that fp8 weight is both GEMMs' weight operand (tensorwise: one scale, w.T's fp8 is the
    transpose of w's). Backward: grad_input from the fp8 weight (kept from forward when FSDP keeps this layer
    gathered, else the shard cast again with the forward's scale and gathered again in fp8, as FSDP re-gathers a
    resharded layer), grad_weight in high precision, reduce-scattered to the shard (sum), as FSDP reduces it."""

    @staticmethod
    def forward(ctx, x, shard, bias, axes, gather):
        from autopar.mesh import resolve_axis
        m_axes, k_axes, n_axes = axes
        g_axis, g_dim, _ = gather
        x2 = x.reshape(-1, x.shape[-1])
        x8, sx = cast(x2, E4M3, None, m_axes + k_axes)
        scale = _scale(shard, E4M3, None, (g_axis,) + n_axes + k_axes)  # the whole weight's amax
        s8, sw = _cast_with(shard, E4M3, scale)
        w8 = _gather_fp8(s8, g_dim, resolve_axis(g_axis))  # (N, K), the single device's fp8 weight
        out = _mm(x8, sx, w8, sw, x.dtype, FAST_ACCUM["output"])
        if bias is not None:
            out = out + bias
        keep = gather[2]
        ctx.save_for_backward(x2, w8 if keep else shard, scale)
        ctx.has_bias, ctx.x_shape, ctx.axes, ctx.gather, ctx.w_dtype = bias is not None, x.shape, axes, gather, \
            shard.dtype
        return out.reshape(*x.shape[:-1], w8.shape[0])

    @staticmethod
    def backward(ctx, grad_out):
        from autopar.mesh import resolve_axis
        from autopar.runtime.collectives import _raw_reduce_scatter
        x2, w, scale = ctx.saved_tensors
        m_axes, k_axes, n_axes = ctx.axes
        g_axis, g_dim, keep = ctx.gather
        if keep:
            w8, sw = w, scale.reciprocal()
        else:  # resharded after forward: the shard cast again with the forward's scale, gathered again in fp8
            s8, sw = _cast_with(w, E4M3, scale)
            w8 = _gather_fp8(s8, g_dim, resolve_axis(g_axis), backward=True)
        g = grad_out.reshape(-1, w8.shape[0])
        grad_x = grad_w = grad_b = None
        if ctx.needs_input_grad[0]:
            g8, sg = cast(g, E5M2, None, m_axes + n_axes, True)
            grad_x = _mm(g8, sg, w8.t(), sw, grad_out.dtype).reshape(ctx.x_shape)
        if ctx.needs_input_grad[1]:
            gt8, sgt = cast(g.t(), E5M2, None, m_axes + n_axes, True)
            xt8, sxt = cast(x2.t(), E4M3, None, m_axes + k_axes, True)
            full = _mm(gt8, sgt, xt8, sxt, ctx.w_dtype)
            grad_w = _raw_reduce_scatter(full, g_dim, resolve_axis(g_axis), backward=True)
        if ctx.has_bias and ctx.needs_input_grad[2]:
            grad_b = g.sum(0)
        return grad_x, grad_w, grad_b, None, None


def float8_linear_gathered(x: torch.Tensor, shard: torch.Tensor, bias: torch.Tensor | None, gather_axis, gather_dim: int,
                           m_axes: tuple = (), k_axes: tuple = (), n_axes: tuple = (), keep: bool = False
                           ) -> torch.Tensor:
    """`float8_linear(x, weight, bias, "tensorwise", ...)` where `weight` is FSDP's all-gather of `shard` on
    `gather_axis` (dim `gather_dim`), gathered in fp8 (`_Float8GatheredLinear`); `keep`: the fp8 weight is kept for
    backward rather than gathered again."""
    return _Float8GatheredLinear.apply(x, shard, bias, (tuple(m_axes), tuple(k_axes), tuple(n_axes)),
                                       (gather_axis, gather_dim, bool(keep)))
