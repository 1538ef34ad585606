"""Data parallelism of parameters: replicated over the data axes, gradients all-reduced in buckets.

Lowering (`passes.lower`): a parameter consumed by batch-sharded work gets `grad_all_reduce` on each
data axis, and `bucket_gradients_pass` turns those of one axis and dtype into all-reduces of flat
buffers (DDP buckets of at most `GRAD_BUCKET_BYTES`, the first closed once it holds `FIRST_GRAD_BUCKET_BYTES`, with
the gradient that crossed that size, as DDP's; the last-used parameters first), each issued asynchronously during the backward as soon as its gradients are ready.

Cost: each structure pays its gradient bytes at the bucket's per-byte rate on every data (and
sequence) axis, `grad_sync`; the buckets' fixed cost is paid once per bucket (`bucket_fixed_s`,
charged to "other"); their overlap with the backward is not priced. The rate is the chord of the all-reduce time between an empty bucket and one holding all
parameters' gradients, so the sum over structures is one collective of the whole bucket (exact
for alpha-beta links), plus the copy of the gradients into the flat buffer. Volume per step:
`2(p-1)/p · Ψ` (`volume_bytes`).
"""

from __future__ import annotations

from autopar.estimate import MeshCosting
from autopar.forms import zero
from cost_model.analytical import send_bytes

NAME = "dp"


def grad_sync(mc: MeshCosting, local_param_bytes: float, axes: tuple[str, ...] | None = None) -> tuple[float, float]:
    """(time, bytes sent) of this share of the gradient bucket on every data and sequence axis (or `axes`):
    its bytes at the bucket's per-byte rate, and their copy into the bucket's flat buffer (read + write)."""
    t = b = 0.0
    copy_bytes_per_s = mc.cluster.copy_bytes_per_s or mc.cluster.effective_memory_bytes_per_s
    local_param_bytes *= mc.grad_bytes_factor  # mixed precision: the gradients are reduced in reduce_dtype
    for a in mc.data_axes + mc.seq_axes if axes is None else axes:
        p = mc.size(a)
        if p == 1:
            continue
        t += mc.bucket_rate(a)[1] * local_param_bytes + 2 * local_param_bytes / copy_bytes_per_s
        b += send_bytes("all_reduce", local_param_bytes, p)
    return t, b


def step_gather(mc: MeshCosting, local_param_bytes: float) -> tuple[float, float]:
    """(time, bytes sent) of zero1's all-gather of these parameters after the optimizer step (`zero.step_gather_s`),
    on the critical path (the step waits for it); nothing under other plans. The parameters as stored: under a
    policy the masters, which zero1 keeps replicated."""
    if mc.zero != 1:
        return 0.0, 0.0
    return zero.step_gather_s(mc, local_param_bytes * mc.state_factor() * mc.param_share())


def bucket_fixed_s(mc: MeshCosting) -> float:
    """The fixed cost of the gradient buckets: one per data / sequence axis and parameter dtype."""
    return mc.num_buckets * sum(mc.bucket_rate(a)[0] for a in mc.data_axes + mc.seq_axes)


def bucket_bytes(mc: MeshCosting, local_param_bytes: float) -> float:
    """Gradient bytes these parameters put in the data-parallel buckets (none without a data or sequence axis):
    reducing a bucket holds its flat copy (all-reduced in place: `autopar.estimate.peak_bytes`)."""
    if all(mc.size(a) == 1 for a in mc.data_axes + mc.seq_axes):
        return 0.0
    return local_param_bytes * mc.grad_share() * mc.state_factor()


def state_bytes(mc: MeshCosting, local_param_bytes: float) -> float:
    """Parameters, gradients and optimizer state, replicated over the data axes (zero1: the state sharded,
    `zero.state_bytes`)."""
    if mc.zero == 1:
        return zero.state_bytes(mc, local_param_bytes, 1)
    return local_param_bytes * mc.state_factor()


def volume_bytes(param_bytes: float, p: int) -> float:
    """Bytes each rank sends per step for the gradients of `param_bytes` of parameters on an axis of p ranks."""
    return send_bytes("all_reduce", param_bytes, p)
