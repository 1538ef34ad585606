"""FP8 linears priced: the recipes, the `_scaled_mm` rates, the casts and amax reductions, and the per-linear rule.

A float8 linear (torchao's `Float8Linear`, the recipes torchtitan trained with) runs its three GEMMs (output,
grad_input, grad_weight) in `torch._scaled_mm` with e4m3 activations and weights and e5m2 gradients; the weight stays
in high precision and is quantised dynamically every step. What it costs beside the GEMMs is the dynamic scaling of
each operand (input x (M, K), weight w (K, N), output gradient g (M, N)): an amax reduction reading the operand and a
cast reading it again and writing the fp8 tensor (one byte per element) in the layouts the GEMMs need, as
torchao's roofline counts it (`benchmarks/float8/float8_roofline.py`, `get_tensor_memory_traffic_bytes` and
`get_float8_mem_sympy`, which assume torch.compile as torchao's training recipes do): tensorwise reads the bf16
tensor for the amax (2 bytes per element, fused into the producing op for the activation and the output gradient:
0) and again for the cast, writing row- and column-major fp8 (2 + 2 x 1); rowwise casts along each dim in its own
kernel, each reading 2 and writing 1 (one read fused with the producer for x and g). Either: 4 bytes per element of
x and g, 6 per element of w (`ACT_CAST_BYTES`, `WEIGHT_CAST_BYTES`).

- `tensorwise` (one scale per tensor, cuBLAS). autopar's runtime all-reduces every amax over the axes that split
  the dims it reduces (`CASTS`, `amax_reductions`: each rank then scales as one device does); under FSDP the
  weights are cast on their shard and all-gathered in fp8 (torchao `enable_fsdp_float8_all_gather`, one amax
  all-reduce for all weights per step: `precompute_float8_dynamic_scale_for_fsdp`): 1 byte per gathered element.
  The estimate prices it so (torchtitan's runs did it) and the runtime runs it
  (`autopar.runtime.float8.float8_linear_gathered`, one scalar amax all-reduce per weight on the data axis).
- `rowwise` (one scale per row, CUTLASS; its GEMMs slower than tensorwise's: `cost_model.hardware._FP8_ACHIEVED`):
  each operand is scaled along both of its dims (the output GEMM's and the weight gradient's reduction dims
  differ); every collective stays in high precision ("all distributed communication is done in high precision", torchtitan docs/float8.md), so under
  tensor parallelism each rank casts the whole replicated activation it receives, not its shard.
  On a skinny share (`skinny`: torchao's rowwise filter thresholds; tensor parallelism makes linears skinny) the
  rowwise GEMMs gain nothing over bf16 and are priced at the high-precision rate (`skinny_s`), the casts on top.

Which linears: torchao's rule (`docs/source/workflows/training.md`, `_auto_filter_for_recipe`): fp8 where
`bf16_gemm_time - fp8_gemm_time > fp8_overhead_time` at the linear's shapes on one rank (`pays`); never the output
head (torchtitan PR #469 keeps it in high precision; DeepSeek-V3 likewise). The recipe (`auto`) is chosen by pricing
the whole plan under each (`autopar.api`): the rule is per linear, the recipe's interaction with the plan's forms
(rowwise under TP) is the estimate's.
"""

from __future__ import annotations

RECIPES = ("tensorwise", "rowwise")
OPTIONS = ("auto", *RECIPES, None)

# the matmul-rate key (`Cluster.peak_flops`, `Cluster.matmul_table`) each recipe's `_scaled_mm` runs at
RATE_KEY = {"tensorwise": "float8_tensorwise", "rowwise": "float8_rowwise"}

# under tensor parallelism, whether a column-parallel linear's input is cast after its high-precision all-gather
# (whole on each rank) rather than on its shard before an fp8 one; under FSDP, whether weights are cast on the shard
# and all-gathered in fp8 (module docstring)
CASTS_GATHERED_INPUT = {"tensorwise": False, "rowwise": True}
FP8_ALL_GATHER = {"tensorwise": True, "rowwise": False}

# The six casts of one linear per step (x, w forward; g, w.T for grad_input; g.T, x.T for grad_weight) as
# (the dims its amax reduces over, the dim it keeps one scale per element of, or None): M tokens, K in, N out
# features (`autopar.runtime.float8`). An axis splitting a reduced dim all-reduces that amax (MAX) there.
CASTS = {
    "tensorwise": (("mk", None), ("nk", None), ("mn", None), ("kn", None), ("mn", None), ("mk", None)),
    "rowwise": (("k", "m"), ("k", "n"), ("n", "m"), ("n", "k"), ("m", "n"), ("m", "k")),
}


def amax_reductions(recipe: str, split: str, local: dict[str, float]) -> list[float]:
    """The fp32 amax all-reduces (their element counts) one linear issues per step on an axis splitting its dim
    `split` ("m", "k" or "n"); `local`: this rank's M, K, N."""
    return [1.0 if kept is None else local[kept] for reduced, kept in CASTS[recipe] if split in reduced]


# bytes of memory traffic per operand element for its scaling, by recipe (module docstring)
ACT_CAST_BYTES = {"tensorwise": 4.0, "rowwise": 4.0}  # x and g (the amax read fused with the producer)
WEIGHT_CAST_BYTES = {"tensorwise": 6.0, "rowwise": 6.0}


def check_option(float8) -> None:
    """One of `OPTIONS`, or a given choice: ((linear module path, recipe), ...), a torchao-converted model's
    (`autopar.torchao_float8`)."""
    if isinstance(float8, tuple) and all(isinstance(p, tuple) and len(p) == 2 and isinstance(p[0], str)
                                         and p[1] in RECIPES for p in float8):
        return
    if float8 not in OPTIONS:
        raise ValueError(f"float8={float8!r} is not a float8 option. Why: autopar prices and runs float8 linears with "
                         f"torchao's recipes. Fix: one of {OPTIONS}")


def has_rates(cluster) -> bool:
    """Whether the cluster knows `_scaled_mm` rates (the GPU presets with FP8 tensor cores; the cpu preset does not)."""
    return all(k in cluster.peak_flops for k in RATE_KEY.values())


def gemm_s(m: float, k: float, n: float, dtype: str, cluster) -> float:
    """Forward + backward (three GEMMs of 2mkn) of one linear at `dtype`'s size-dependent rate."""
    from cost_model.analytical import matmul_flops_per_s
    f = 2.0 * m * k * n
    return 3 * f / matmul_flops_per_s(cluster, dtype, f)


def cast_s(nbytes: float, cluster) -> float:
    """Elementwise passes over `nbytes` (the amax and cast kernels) at the cluster's elementwise rate."""
    from cost_model.analytical import kernel_time_s
    return kernel_time_s("vector", 0.0, nbytes, "bfloat16", cluster)


def overhead_bytes(m: float, k: float, n: float, recipe: str) -> float:
    """Scaling traffic of one linear's x, w and g (forward + backward)."""
    return ACT_CAST_BYTES[recipe] * (m * k + m * n) + WEIGHT_CAST_BYTES[recipe] * k * n


def skinny(recipe: str, k: float, n: float) -> bool:
    """Whether a linear of `k` in and `n` out features (this rank's shares) is one whose rowwise fp8 GEMMs run no
    faster than bf16's: torchao's `_auto_filter_for_rowwise` (`torchao/float8/float8_linear_utils.py`) leaves such
    linears in bf16 because its H100 measurements (the rowwise table of `torchao/float8/README.md`, GEMMs and casts
    compiled) found them slower there, thresholds read as its code reads them (`K, N = weight.shape`: out, in
    features): in <= 2048, or out <= 1024, or in <= 4096 and out <= 2048. The CUTLASS rowwise kernel's rate falls
    on such skinny shapes (pytorch/pytorch#147971: rowwise down to 50% of tensorwise's efficiency in the long tail),
    which the large-shape rate (`cost_model.hardware._FP8_ACHIEVED`) does not see. Tensor parallelism makes linears
    skinny: it divides a column-parallel linear's out features and a row-parallel one's in features by t (Llama-3.1-8B
    on TP 8: every linear of a layer falls under these thresholds, which is why torchtitan#1207's FSDP 8 x TP 8
    rowwise run is slower than bf16 while the FSDP runs gain)."""
    return recipe == "rowwise" and (k <= 2048 or n <= 1024 or (k <= 4096 and n <= 2048))


def skinny_s(m: float, k: float, n: float, recipe: str, cluster, compute_dtype: str = "bfloat16") -> float:
    """Seconds a `skinny` rowwise linear's three GEMMs take beyond the recipe's rate: they run at `compute_dtype`'s
    rate (no fp8 gain; its casts still paid), 0 for any other linear."""
    if not skinny(recipe, k, n) or not has_rates(cluster):
        return 0.0
    return max(0.0, gemm_s(m, k, n, compute_dtype, cluster) - gemm_s(m, k, n, RATE_KEY[recipe], cluster))


def pays(m: float, k: float, n: float, recipe: str, cluster, compute_dtype: str = "bfloat16") -> bool:
    """torchao's rule on one rank's shapes: the GEMMs' saving exceeds the scaling's time (a `skinny` rowwise linear
    saves nothing)."""
    if not has_rates(cluster) or skinny(recipe, k, n):
        return False
    saved = gemm_s(m, k, n, compute_dtype, cluster) - gemm_s(m, k, n, RATE_KEY[recipe], cluster)
    return saved > cast_s(overhead_bytes(m, k, n, recipe), cluster)
