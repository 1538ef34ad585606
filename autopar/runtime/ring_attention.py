"""Ring attention (context parallelism) over one mesh axis, zigzag layout (DESIGN.md §3 "Ring").

Layout. The sequence (length S) is cut into 2p chunks of c = S/(2p) tokens; rank r of the axis holds
chunks r and 2p-1-r, concatenated: (B, H, 2c, D). `zigzag_shard` / `zigzag_unshard` convert and
`zigzag_positions` gives the global token positions a rank holds (RoPE and masks use these, never
the physical index; pitfall 15).

Forward (`ring_attention`). Step 0 attends the local K,V; at step i (1 <= i < p) rank r holds the
K,V block of rank s = (r - i) mod p, received from rank r-1 while step i-1 computed (one transfer
of the packed K,V per step: p-1 transfers). Block results merge into fp32 accumulators with the
online softmax (parallel-forms.md §6.1, sigmoid/logsigmoid form, guarded against -inf rows).
With causal masking the zigzag schedule is (q0/q1: the chunks r, 2p-1-r; k0/k1 likewise for s):

| step          | source s     | q0 = chunk r vs           | q1 = chunk 2p-1-r vs      | block computed            |
|---------------|--------------|---------------------------|---------------------------|---------------------------|
| 0             | r            | k0 causal, k1 masked      | k0 full, k1 causal        | (q, kv) causal            |
| 1 <= i <= r   | r-i < r      | k0 full, k1 masked        | k0 full, k1 masked        | (q, kv[:c]) non-causal    |
| i > r         | r-i+p > r    | k0, k1 masked             | k0 full, k1 full          | (q[c:], kv) non-causal    |

(chunk s < r < 2p-1-r < 2p-1-s for i <= r, and r < s <= p-1 < p <= 2p-1-s < 2p-1-r for i > r), so
every step but the first costs 2c x c scores on every rank: the load is balanced. Without causal
masking every step is (q, kv) non-causal and the layout does not matter.

Backward. dQ accumulates locally; K,V circulate again from the saved local block (pitfall 11: never
from a stale buffer), p-1 transfers; the dK,dV contributions for the block of rank s are summed in an
fp32 accumulator that starts on rank s+1 at step 1, travels with the ring and reaches s after step
p-1 (p-1 transfers), where s adds its own step-0 contribution. Each step uses the global out and lse
with Δ = rowsum(dO ∘ O) (`block_attention_backward`).

Transfers. Each ring step is one `_c10d_functional.all_to_all_single` whose split sizes send the
whole packed buffer to rank r+1 and receive from r-1 (zero elsewhere): it runs on NCCL and gloo and
under LocalTensorMode (which has no send/recv; per-rank split sizes are LocalIntNode SymInts). The
next K,V transfer is issued before the current block is computed and waited after it. Each transfer
is recorded (`record_comms`) as a CommRecord of kind "p2p" whose numel / send_bytes are the buffer
each rank sends (ring P2P step of block m: m, parallel-forms.md §0).

Per-rank control flow (which half of q or kv a step uses depends on r) runs through
`maybe_run_for_local_tensor`, so one simulated process runs every rank's branch.
"""

from __future__ import annotations

import torch
from torch.distributed._local_tensor import maybe_run_for_local_tensor

from autopar.mesh import AxisRef, resolve_axis
from autopar.runtime import collectives
from autopar.runtime.collectives import _raw_all_gather
from autopar.runtime.kernels.block_attention import (
    acc_dtype,
    attention_delta,
    block_attention,
    block_attention_backward,
)

_c10d = collectives._c10d  # settles a step's pending agreement first (`collectives._Functional`)

__all__ = ["ring_attention", "zigzag_shard", "zigzag_unshard", "zigzag_positions", "zigzag_schedule",
           "merge_attention"]


# ----------------------------------------------------------------------------- online-softmax merge

def merge_attention(out: torch.Tensor, lse: torch.Tensor, out_b: torch.Tensor, lse_b: torch.Tensor):
    """Merge block (out_b, lse_b) into the running (out, lse); all in the accumulation dtype.

    out' = out - sigmoid(lse_b - lse) * (out - out_b),  lse' = max(lse, lse_b) + log1p(exp(-|lse - lse_b|))
    (the sigmoid/logsigmoid form; the max form of lse' stays finite, and -inf when both are -inf:
    a query row with nothing to attend in either part keeps out = 0, lse = -inf, never NaN).
    """
    d = lse_b - lse
    d = torch.where(torch.isnan(d), torch.full_like(d, float("-inf")), d)  # -inf - (-inf): nothing new
    out = out - torch.sigmoid(d).unsqueeze(-1) * (out - out_b)
    lse = torch.maximum(lse, lse_b) - torch.nn.functional.logsigmoid(d.abs())
    return out, lse


# ----------------------------------------------------------------------------- ring transfers

@maybe_run_for_local_tensor
def _ring_split_sizes(rank: int, p: int, n: int) -> tuple[int, ...]:
    # (input split sizes..., output split sizes...): send all n to rank+1, receive n from rank-1
    send, recv = [0] * p, [0] * p
    send[(rank + 1) % p] = n
    recv[(rank - 1) % p] = n
    return tuple(send + recv)


def _record_p2p(axis: AxisRef, flat: torch.Tensor, backward: bool) -> None:
    collectives._record("p2p", axis, flat, flat.numel(), backward)  # a ring step sends its whole buffer once


class _Shift:
    """One ring step in flight: `tensors` go to rank r+1, rank r-1's arrive; `wait()` returns them."""

    def __init__(self, tensors: list[torch.Tensor], axis: AxisRef, backward: bool):
        self.shapes = [t.shape for t in tensors]
        flat = torch.cat([t.reshape(-1) for t in tensors])
        p = axis.size
        sizes = list(_ring_split_sizes(axis.local_rank(), p, flat.numel()))
        _record_p2p(axis, flat, backward)
        self.buf = _c10d.all_to_all_single(flat, sizes[p:], sizes[:p], axis.group_name)

    def wait(self) -> list[torch.Tensor]:
        flat = _c10d.wait_tensor(self.buf)
        out, i = [], 0
        for shape in self.shapes:
            n = shape.numel()
            out.append(flat[i:i + n].view(shape))
            i += n
        return out


# ----------------------------------------------------------------------------- per-rank steps

def zigzag_schedule(step: int, rank: int, causal: bool) -> tuple[str, str, bool]:
    """Which rows of the local q and of the visiting K,V block step `step` computes on rank `rank`.

    Returns (q_rows, kv_rows, block_causal): q_rows "all" or "second" (chunk 2p-1-r only), kv_rows
    "all" or "first" (chunk s only, s = (rank - step) mod p), and whether the block is the
    diagonal-causal one. Rows not selected are fully masked; see the module docstring's table.
    """
    if step == 0:
        return "all", "all", causal
    if not causal:
        return "all", "all", False
    if step <= rank:
        return "all", "first", False
    return "second", "all", False


def _rows(x: torch.Tensor, which: str, c: int) -> torch.Tensor:
    return {"all": x, "first": x[:, :, :c], "second": x[:, :, c:]}[which]


def _pad_rows(x: torch.Tensor, which: str) -> torch.Tensor:
    # a contribution to rows `which` of 2c rows -> all 2c rows (zeros elsewhere)
    if which == "all":
        return x
    z = torch.zeros_like(x)
    return torch.cat([x, z] if which == "first" else [z, x], 2)


@maybe_run_for_local_tensor
def _forward_step(q, k, v, out, lse, step: int, rank: int, causal: bool, scale: float, impl):
    """Merge the attention of q over the K,V block of rank (rank - step) into (out, lse) (None at step 0)."""
    c = q.shape[2] // 2
    q_rows, kv_rows, block_causal = zigzag_schedule(step, rank, causal)
    out_b, lse_b = block_attention(_rows(q, q_rows, c), _rows(k, kv_rows, c), _rows(v, kv_rows, c),
                                   causal=block_causal, scale=scale, out_dtype=acc_dtype(q.dtype), impl=impl)
    if step == 0:
        return out_b, lse_b
    if q_rows == "all":
        return merge_attention(out, lse, out_b, lse_b)
    out1, lse1 = merge_attention(out[:, :, c:], lse[:, :, c:], out_b, lse_b)
    return torch.cat([out[:, :, :c], out1], 2), torch.cat([lse[:, :, :c], lse1], 2)


@maybe_run_for_local_tensor
def _backward_step(dq, dout, q, k, v, out, lse, delta, step: int, rank: int, causal: bool, scale: float, impl):
    """(dq + this block's dq, dk, dv of the K,V block of rank (rank - step)), in the dtype of dq."""
    c = q.shape[2] // 2
    q_rows, kv_rows, block_causal = zigzag_schedule(step, rank, causal)
    dq_b, dk, dv = block_attention_backward(
        _rows(dout, q_rows, c), _rows(q, q_rows, c), _rows(k, kv_rows, c), _rows(v, kv_rows, c),
        _rows(out, q_rows, c), _rows(lse, q_rows, c), delta=_rows(delta, q_rows, c),
        causal=block_causal, scale=scale, grad_dtype=dq.dtype, impl=impl)
    return dq + _pad_rows(dq_b, q_rows), _pad_rows(dk, kv_rows), _pad_rows(dv, kv_rows)


# ----------------------------------------------------------------------------- ring attention

class _RingAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, axis: AxisRef, causal: bool, scale: float, impl):
        p, rank = axis.size, axis.local_rank()
        out = lse = None  # step 0 starts the fp32 (fp64 for fp64) accumulators
        k_cur, v_cur = k.contiguous(), v.contiguous()  # pitfall 13: transfer contiguous K,V
        for step in range(p):
            shift = _Shift([k_cur, v_cur], axis, backward=False) if step < p - 1 else None
            out, lse = _forward_step(q, k_cur, v_cur, out, lse, step, rank, causal, scale, impl)
            if shift is not None:
                k_cur, v_cur = shift.wait()
        out = out.to(q.dtype)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.args = (axis, causal, scale, impl)
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse = ctx.saved_tensors
        axis, causal, scale, impl = ctx.args
        p, rank = axis.size, axis.local_rank()
        acc = acc_dtype(q.dtype)
        delta = attention_delta(dout, out)
        dq = torch.zeros(q.shape, dtype=acc, device=q.device)
        k_cur, v_cur = k.contiguous(), v.contiguous()  # the saved local block (pitfall 11)
        dkv_shift = None
        for step in range(p):
            kv_shift = _Shift([k_cur, v_cur], axis, backward=True) if step < p - 1 else None
            dq, dk_b, dv_b = _backward_step(dq, dout, q, k_cur, v_cur, out, lse, delta, step, rank, causal,
                                            scale, impl)
            if step == 0:
                dk_own, dv_own = dk_b, dv_b
            else:
                if dkv_shift is not None:  # the accumulator of this K,V block, from rank r-1
                    dk_in, dv_in = dkv_shift.wait()
                    dk_b, dv_b = dk_in + dk_b, dv_in + dv_b
                dkv_shift = _Shift([dk_b, dv_b], axis, backward=True)
            if kv_shift is not None:
                k_cur, v_cur = kv_shift.wait()
        if dkv_shift is not None:
            dk_in, dv_in = dkv_shift.wait()
            dk_own, dv_own = dk_own + dk_in, dv_own + dv_in
        return dq.to(q.dtype), dk_own.to(k.dtype), dv_own.to(v.dtype), None, None, None, None


def ring_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, axis: AxisRef | str, *, causal: bool,
                   scale: float | None = None, impl: str | None = None) -> torch.Tensor:
    """Attention over the whole sequence, from this rank's zigzag shards q (B, H, 2c, D), k, v (B, Hkv, 2c, D).

    Returns this rank's zigzag shard of the output (B, H, 2c, Dv) in q's dtype. `scale` defaults to
    1/sqrt(D); `impl` picks the block kernel ("auto" | "torch" | "triton", see `block_attention`).
    """
    axis = resolve_axis(axis)
    if q.dim() != 4 or k.dim() != 4 or v.dim() != 4:
        raise ValueError(f"ring_attention expects (B, H, S_local, D) tensors, got q {tuple(q.shape)}, "
                         f"k {tuple(k.shape)}, v {tuple(v.shape)}")
    if k.shape[2] != q.shape[2] or v.shape[2] != q.shape[2]:
        raise ValueError(f"ring_attention over axis {axis}: q, k, v must hold the same local tokens, got "
                         f"lengths {q.shape[2]}, {k.shape[2]}, {v.shape[2]}")
    if causal and q.shape[2] % 2:
        raise ValueError(f"causal ring_attention over axis {axis} needs the zigzag layout (2 chunks per rank), "
                         f"but the local sequence length {q.shape[2]} is odd: shard a sequence divisible by "
                         f"2*{axis.size} with zigzag_shard")
    if q.shape[1] % k.shape[1]:
        raise ValueError(f"ring_attention: {q.shape[1]} query heads are not a multiple of {k.shape[1]} KV heads")
    scale = q.shape[-1] ** -0.5 if scale is None else float(scale)
    return _RingAttention.apply(q, k, v, axis, bool(causal), scale, impl)


# ----------------------------------------------------------------------------- zigzag layout

def _check_zigzag(x: torch.Tensor, dim: int, axis: AxisRef) -> None:
    if x.shape[dim] % (2 * axis.size):
        raise ValueError(f"zigzag layout over axis {axis}: dim {dim} of size {x.shape[dim]} is not divisible by "
                         f"2*{axis.size} (the sequence is cut into 2p chunks); pad the sequence")


@maybe_run_for_local_tensor
def _zigzag_take(x: torch.Tensor, dim: int, p: int, rank: int) -> torch.Tensor:
    chunks = x.chunk(2 * p, dim)
    return torch.cat([chunks[rank], chunks[2 * p - 1 - rank]], dim)


def _zigzag_reorder(x: torch.Tensor, dim: int, p: int) -> torch.Tensor:
    # rank-major (chunk r, chunk 2p-1-r for r = 0..p-1) -> sequence order: chunk j sits at 2j or 2(2p-1-j)+1
    pieces = x.chunk(2 * p, dim)
    return torch.cat([pieces[2 * j] if j < p else pieces[2 * (2 * p - 1 - j) + 1] for j in range(2 * p)], dim)


def _zigzag_gather(x: torch.Tensor, dim: int, axis: AxisRef, backward: bool) -> torch.Tensor:
    return _zigzag_reorder(_raw_all_gather(x, dim, axis, backward=backward), dim, axis.size)


class _ZigzagShard(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, dim, axis):
        ctx.args = (dim, axis)
        return _zigzag_take(x, dim, axis.size, axis.local_rank()).contiguous()

    @staticmethod
    def backward(ctx, g):
        dim, axis = ctx.args
        return _zigzag_gather(g, dim, axis, backward=True), None, None


class _ZigzagUnshard(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, dim, axis):
        ctx.args = (dim, axis)
        return _zigzag_gather(x, dim, axis, backward=False)

    @staticmethod
    def backward(ctx, g):
        dim, axis = ctx.args
        return _zigzag_take(g, dim, axis.size, axis.local_rank()).contiguous(), None, None


def zigzag_shard(x: torch.Tensor, dim: int, axis: AxisRef | str) -> torch.Tensor:
    """R -> zigzag S(dim): keep chunks r and 2p-1-r of 2p (no communication); backward all-gathers."""
    axis = resolve_axis(axis)
    dim = dim % x.dim()
    _check_zigzag(x, dim, axis)
    return _ZigzagShard.apply(x, dim, axis)


def zigzag_unshard(x: torch.Tensor, dim: int, axis: AxisRef | str) -> torch.Tensor:
    """Zigzag S(dim) -> R: all-gather and restore sequence order; backward keeps the local chunks."""
    axis = resolve_axis(axis)
    dim = dim % x.dim()
    if x.shape[dim] % 2:
        raise ValueError(f"zigzag_unshard over axis {axis}: dim {dim} holds {x.shape[dim]} tokens, not 2 equal chunks")
    return _ZigzagUnshard.apply(x, dim, axis)


@maybe_run_for_local_tensor
def _positions(seq_len: int, p: int, rank: int, device) -> torch.Tensor:
    c = seq_len // (2 * p)
    return torch.cat([torch.arange(rank * c, (rank + 1) * c, device=device),
                      torch.arange((2 * p - 1 - rank) * c, (2 * p - rank) * c, device=device)])


def zigzag_positions(seq_len: int, axis: AxisRef | str, *, device=None) -> torch.Tensor:
    """The global positions (2c,) of the tokens this rank holds in the zigzag layout (int64)."""
    axis = resolve_axis(axis)
    if seq_len % (2 * axis.size):
        raise ValueError(f"zigzag layout over axis {axis}: sequence length {seq_len} is not divisible by 2*{axis.size}")
    return _positions(seq_len, axis.size, axis.local_rank(), device)
