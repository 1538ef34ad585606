"""The float8 tolerance: how far a float8 plan on 2 gloo ranks may be from the single-device float8 model (torchao's
`Float8Linear`, which autopar's fp8 linear equals bit for bit per linear), per recipe and plan, in an fp32 model.
Used by tests/test_float8_torchao_model.py (against real torchao) and tests/test_float8_runtime.py (against autopar's
fp8 linear on one device). Set from measured runs (tests/test_float8_torchao_model.py's docstring: the Llama there,
AdamW lr 1e-2) with margin, and tight enough that a wrong recipe fails (README, float8).

Each entry: loss (relative), grads (max |g - g_ref| over each parameter, relative to that gradient's largest entry,
the worst parameter), step (max |p - p_ref| after one AdamW step, in units of the step's size lr: its first step moves
each entry by lr * g / (|g| + eps)), flips (the fraction of entries whose step differs by more than half a step:
AdamW's first step is lr * sign(g), so an entry whose gradient is within the fp8 noise of 0 steps the other way).

- tensorwise: exact but for fp32 summation order (every scale is the single device's; no bf16 rounding).
- rowwise under dp / fsdp: the data-parallel grad_weight GEMM's partial sums (over each rank's tokens) stay fp32 for
  their reduction, where the single device writes the whole sum in bf16 (`autopar.runtime.float8._mm`): grad_weight
  differs by that one bf16 rounding, which nothing later in the step reads.
- rowwise under megatron: the same on the row-parallel output GEMM (wo, down: partial sums over K) and the
  column-parallel grad_input GEMM (wq, wk, wv, gate, up: over N); those feed later casts to e4m3, where a value moved
  by a bf16 rounding crosses an e4m3 rounding boundary now and then (one e4m3 step is 2^-3 relative): a few percent
  on the largest entry of some gradients. Looser; the wrong recipes measured above it (README, float8).
"""

TOLERANCE = {
    ("tensorwise", "dp"): dict(loss=1e-6, grads=1e-5, step=5e-2, flips=0.0),
    ("tensorwise", "fsdp"): dict(loss=1e-6, grads=1e-5, step=5e-2, flips=0.0),
    ("tensorwise", "megatron"): dict(loss=1e-6, grads=1e-5, step=5e-2, flips=0.0),
    ("rowwise", "dp"): dict(loss=1e-5, grads=1e-2, step=5e-2, flips=0.0),
    ("rowwise", "fsdp"): dict(loss=1e-5, grads=1e-2, step=5e-2, flips=0.0),
    ("rowwise", "megatron"): dict(loss=5e-4, grads=1e-1, step=2.0, flips=1.5e-2),
}
