"""Published-run fidelity: autopar's cost model against published large-model training runs (the baseline
of issues #11, memory, and #12, step time). It measures what the cost model predicts today; it changes
nothing and hides nothing.

    python benchmarks/published_runs.py [--quick] [--markdown] [--breakdown] [--auto]
        # --quick: the 8-GPU torchtitan row only (its step time and memory; no auto)
        # --float8: the torchtitan bf16/float8 pairs only, their ratios, and auto's float8 choice on FSDP8 x TP8
        # --breakdown: each row's predicted step by category (matmul, attention, elementwise by dtype, copies,
        #   optimizer step, overlap contention, recompute, exposed communication) beside the published step
        # --auto: each pipelined Megatron row planned by `auto` on the same GPUs and batch (the pipeline role, its
        #   schedule, microbatches and checkpoint level chosen), its step against the published configuration's

Every model is built whole (every layer) on the meta device in bf16 with its published shapes and planned
with `autopar.plan(model, mesh_sizes, meta inputs of the global batch, plan=..., cluster=<the run's preset>)`;
nothing runs. The step time is the estimate's timeline (`autopar.timeline`: FSDP gathers prefetched, ZeRO-3's
backward re-gathers prefetched one layer ahead, gradient reductions overlapped with the backward, tensor-parallel
collectives exposed, the optimizer step after the last reduction, compute slowed where communication overlaps it)
at the presets' achieved rates (`cost_model.hardware`: matmul by size, flash attention by sequence length,
elementwise and copy kernels at the measured fraction of HBM bandwidth, NCCL ring/tree, mesh axes mapped to NVLink
within a node and the NICs across nodes). The torchtitan rows run on the `h100_hbm2e` preset (the 96 GB HBM2e,
500 W H100 torchtitan measured on) with torchtitan's Llama 3 as torchtitan trains it: the eager FSDP rows with its
fp32 RMSNorm and complex-fp32 RoPE (`llama_tt_eager_meta`: each upcast an eager kernel the estimate prices by its
bytes), the torch.compile row as `llama_tt_meta` (causal flash SDPA, bf16 elementwise: Inductor fuses the casts);
fp32 parameters under `mp_policy=MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32)`
(bf16 compute and gathers, fp32 gradient reductions, fp32 masters and AdamW states) and every layer at the
`selective` checkpoint level (`{"checkpoint": "selective"}`: torchtitan's per-op SAC, every other matmul output
and the attention outputs kept, the rest recomputed in backward, priced by the estimate). From `plan.estimate`
(step time, memory per device):

- predicted tokens/s/GPU = global batch x sequence / step time / GPUs;
- torchtitan rows: TFLOP/s/GPU = tokens/s/GPU x (6 N + 12 L H s) (torchtitan's own count: N the parameters
  less the token embedding, L layers, H hidden, s sequence; informative, the published figure is tokens/s);
- Megatron rows: TFLOP/s/GPU = F / step time / GPUs with Megatron's count for one step without
  recomputation, F = 72 B s L H^2 (1 + s / (6 H) + V / (12 L H)) (Narayanan et al. 2021, "Efficient
  large-scale language model training on GPU clusters", §5.1, with the recomputation pass taken out: their
  model TFLOP/s are 41-48% MFU of the 989 TFLOP/s bf16 peak, as the Megatron-LM README says).

Each row prints `RATIO published_<row> predicted/published = x`; `--breakdown` prints each row's predicted step by
category (`breakdown`) beside the published step. A hand plan whose estimate does not fit
the device memory is still priced (and says DOES NOT FIT); `auto` raises InfeasibleError when no plan fits,
and the row prints the least memory the planner says any plan needs. Then: the FSDP 8 -> 128 GPU scaling
drop predicted vs published, and the memory rows: predicted peak / published peak, the peak's terms (model
state, FSDP's gathered copies, saved activations at the start of the backward, the loss' momentary buffers), and
whether `auto` (levels free) finds a plan under 80 GB and 95 GB. The published peak is torchtitan's logged
`memory:` figure, `torch.cuda.max_memory_reserved` (the caching allocator's reserve, fragmentation included);
the prediction is the live bytes of autopar's own plan, whose FSDP keeps every gathered parameter from the
forward to the backward (FSDP2 reshards each block after its forward: about 12-14 GiB less) and holds no
allocator slack (torchtitan's reserve above its allocation: not published, typically 10-15%). The two differ
in opposite directions by similar amounts; see the report of issue #11. Issue #11's planning rows are in
`benchmarks/planning.py`.

Sources of the published figures:
- torchtitan Llama-3.1-8B (hidden 4096, 32 layers, 32 heads, 8 KV heads, FFN 14336, vocab 128256), bf16,
  seq 8192, per-op selective activation checkpointing, on the 96 GB H100: 8 GPUs FSDP 8 local batch 2:
  5,762 tok/s/GPU and 82.4 GiB peak; 128 GPUs FSDP 128: 5,605 tok/s/GPU and 67.0 GiB; 64 GPUs FSDP 8 x TP 8
  local batch 12 (per data-parallel rank), torch.compile: 4,378 tok/s/GPU (torchtitan docs/performance.md,
  as quoted in issues #11 and #12).
- Megatron-LM GPT weak scaling (seq 4096, vocab 131072, global batch 192, DP 48, data- and tensor-parallel
  communication overlap): 1.7B TP1 on 48 H100: 408.8 TFLOP/s/GPU; 7.1B TP2 on 96: 465.9; 16B TP4 on 192:
  489.1; 32B TP8 on 384: 459.6 (issue #12, from the Megatron-LM README). The README gives the model table
  as an image (images/model_table.png) whose text this benchmark could not retrieve, so the shapes below
  (GELU MLP 4H, head dim 128) are ASSUMED: the GPT-3-style shapes whose 12 L H^2 + 2 V H parameters give
  the quoted sizes (1.74, 7.11, 16.1, 31.1 B with an untied output layer; autopar.models.GPT ties it, so it
  holds V H fewer parameters: memory only, the FLOP count is the same). Megatron's FLOP count uses the same
  shapes, so the TFLOP/s ratio depends on them only through the MFU the cost model assigns to their matmul
  sizes. Megatron ran DP with its distributed optimizer (ZeRO-1: the optimizer state sharded over DP); every row
  is priced so, with autopar's `zero1` plan, the TP2-TP8 rows with Megatron's tensor-parallel forms on "tp"
  (`MEGATRON_TP`: the `megatron` plan's forms, as overrides), DP on "dp". The TP1 row was priced with `dp` until
  2026-12-07 (zero1 then predicted 1.25x, just outside the band; with the step's ends and the post-step gather
  priced as the timeline runs them, zero1 predicts 1.248x, dp 1.237x).
- Megatron-LM GPT with pipeline parallelism, the same README table (TP8, DP48, seq 4096, vocab 131072; shapes and
  global batches as tabulated in notes/pipeline-zero-fp8.md §3.3, `images/model_table.png`, 2024-07): 70B (84
  layers, hidden 8192, 64 heads) PP2 on 768 H100, batch 384: 419.7 TFLOP/s/GPU; 119B (92, 10240, 80) PP4 on 1536,
  768: 420.5; 177B (96, 12288, 96) PP6 on 2304, 1152: 432.8; 314B (96, 16384, 128) PP8 on 3072, 1536: 474.4; 462B
  (112, 18432, 144) PP16 on 6144, 3072: 459.9. The table states neither the microbatch size nor the virtual
  pipeline stages; these rows ASSUME Megatron's interleaved 1F1B schedule (Narayanan et al. 2021 §2.2.2, the schedule
  the table's runs use) with 2 stages per rank and one sequence per microbatch per data-parallel rank (m = batch /
  48: 8 to 64 microbatches). They are planned as `megatron` on the dp x tp sub-mesh of one microbatch with a
  `{"pipeline": "interleaved-1f1b@pp"}` override, priced by the stage model (`autopar.pipeline_estimate`: one
  layer's plan over every layer, the balanced cut, the interleaved bubble, p2p on the inter-node links, each rank's
  tail). Megatron ran its distributed optimizer (and fit in 80 GB); `megatron` replicates the optimizer state over
  dp, so these rows' memory says DOES NOT FIT beyond PP2: their step time is what is compared.
- torchtitan's 64-GPU run shards parameters over its 8 data-parallel ranks (FSDP 8 x TP 8); no hand plan
  does that (`megatron` is DP x TP), so that row prices `megatron` with torchtitan's sequence-parallel norms
  (`{"norm": "sequence@tp"}`) and says so in its forms.

torchtitan's 64-GPU run saves its sequence-parallel reduce-scatters' outputs under SAC; autopar's recomputing
levels issue a layer's collectives again (`autopar.forms.checkpoint`), so that row pays them twice.
"""

from __future__ import annotations

import math
import os
import sys
import time
from dataclasses import dataclass, field, replace

ROOT = os.path.dirname(os.path.abspath(__file__))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)
if os.path.dirname(ROOT) not in sys.path:
    sys.path.insert(0, os.path.dirname(ROOT))

from planning import LLAMA_8B, batch_split_ok, forms, llama_tt_meta, peak_terms  # noqa: E402  (benchmarks/planning.py)

GIB = 2**30
PEAK_BF16 = 989e12  # H100 SXM dense bf16, as the h100 preset
GPT_VOCAB, GPT_SEQ = 131072, 4096
GPT_SHAPES = {  # ASSUMED (see the module docstring): layers, hidden, heads
    "1.7b": (24, 2048, 16), "7.1b": (30, 4096, 32), "16b": (32, 6144, 48), "32b": (36, 8192, 64),
    # the pipelined rows, as the Megatron-LM README's model table gives them (notes/pipeline-zero-fp8.md §3.3)
    "70b": (84, 8192, 64), "119b": (92, 10240, 80), "177b": (96, 12288, 96), "314b": (96, 16384, 128),
    "462b": (112, 18432, 144),
}
# Megatron's pipelined rows: the interleaved schedule with 2 stages per rank and one sequence per microbatch per
# data-parallel rank (ASSUMED: the table states neither the microbatch size nor the virtual stages)
MLM_PP_FORM, MLM_PP_MICROBATCH = "interleaved-1f1b", 1


@dataclass(frozen=True)
class Run:
    """One published run: how to build and plan it, and what was published."""

    name: str
    what: str
    arch: str  # "llama" | "gpt"
    shape: dict
    mesh: dict
    batch: int  # global batch, sequences
    seq: int
    plan: str
    published: float  # tokens/s/GPU (llama rows) or TFLOP/s/GPU (gpt rows)
    unit: str
    published_mem_gib: float | None = None
    notes: tuple = field(default=())
    cluster: str = "h100"  # the hardware preset the run is priced on
    ac: str = ""  # the activation checkpointing level of every layer (`{"checkpoint": ac}`), "" none
    # torchtitan's mixed precision: fp32 parameters (the optimizer's masters), bf16 compute and gathers, fp32 reduce
    mixed: bool = False
    compiled: bool = False  # torch.compile: elementwise ops fused (`llama_tt_meta`), else eager (`llama_tt_eager_meta`)
    overrides: tuple = ()  # (key, form) the plan takes beyond the named plan (the run's own layout)
    # a pipelined run: 'FORM@axis' (the `pipeline` override, `autopar.pipeline_estimate`) and its microbatch count
    pipeline: str = ""
    microbatches: int = 0
    float8: str | None = None  # the float8 recipe torchtitan ran (`autopar.plan(float8=...)`), None: bf16
    pair: str = ""  # a float8 row: the name of its bf16 row (the float8/bf16 ratio is compared)

    @property
    def gpus(self) -> int:
        return math.prod(self.mesh.values())


# Megatron-LM's tensor parallelism on "tp" (what the `megatron` plan gives each kind), as overrides of `zero1`
MEGATRON_TP = (("attention", "heads@tp"), ("mlp", "tp@tp"), ("embedding", "vocab@tp"), ("loss", "vocab@tp"))

RUNS = (
    Run("tt_8b_fsdp8", "torchtitan Llama-3.1-8B, 8 H100, FSDP 8, local batch 2, seq 8192", "llama", LLAMA_8B,
        {"dp": 8}, 16, 8192, "fsdp", 5762.0, "tok/s/GPU", 82.4, ("selective AC", "96 GB H100"),
        cluster="h100_hbm2e", ac="selective", mixed=True),
    Run("tt_8b_fsdp128", "same on 128 H100, FSDP 128", "llama", LLAMA_8B,
        {"dp": 128}, 256, 8192, "fsdp", 5605.0, "tok/s/GPU", 67.0, ("selective AC", "96 GB H100"),
        cluster="h100_hbm2e", ac="selective", mixed=True),
    Run("tt_8b_fsdp8_tp8", "torchtitan Llama-3.1-8B, 64 H100, FSDP 8 x TP 8, local batch 12, seq 8192, compile",
        "llama", LLAMA_8B, {"dp": 8, "tp": 8}, 96, 8192, "megatron", 4378.0, "tok/s/GPU",
        cluster="h100_hbm2e", ac="selective", mixed=True, compiled=True,
        overrides=(("norm", "sequence@tp"),)),  # torchtitan's TP plan: SequenceParallel on every RMSNorm
    Run("mlm_gpt_1.7b_tp1", "Megatron-LM GPT 1.7B, TP1 x DP48, 48 H100", "gpt", {"size": "1.7b"},
        {"dp": 48}, 192, GPT_SEQ, "zero1", 408.8, "TFLOP/s/GPU"),
    Run("mlm_gpt_7.1b_tp2", "Megatron-LM GPT 7.1B, TP2 x DP48, 96 H100", "gpt", {"size": "7.1b"},
        {"dp": 48, "tp": 2}, 192, GPT_SEQ, "zero1", 465.9, "TFLOP/s/GPU", overrides=MEGATRON_TP),
    Run("mlm_gpt_16b_tp4", "Megatron-LM GPT 16B, TP4 x DP48, 192 H100", "gpt", {"size": "16b"},
        {"dp": 48, "tp": 4}, 192, GPT_SEQ, "zero1", 489.1, "TFLOP/s/GPU", overrides=MEGATRON_TP),
    Run("mlm_gpt_32b_tp8", "Megatron-LM GPT 32B, TP8 x DP48, 384 H100", "gpt", {"size": "32b"},
        {"dp": 48, "tp": 8}, 192, GPT_SEQ, "zero1", 459.6, "TFLOP/s/GPU", overrides=MEGATRON_TP),
)


def _mlm_pp(size: str, pp: int, batch: int, published: float) -> Run:
    gpus = pp * 48 * 8
    return Run(f"mlm_gpt_{size}_pp{pp}", f"Megatron-LM GPT {size.upper()}, TP8 x PP{pp} x DP48, {gpus} H100", "gpt",
               {"size": size}, {"pp": pp, "dp": 48, "tp": 8}, batch, GPT_SEQ, "megatron", published, "TFLOP/s/GPU",
               pipeline=f"{MLM_PP_FORM}@pp", microbatches=batch // (48 * MLM_PP_MICROBATCH))


RUNS = RUNS + (
    _mlm_pp("70b", 2, 384, 419.7), _mlm_pp("119b", 4, 768, 420.5), _mlm_pp("177b", 6, 1152, 432.8),
    _mlm_pp("314b", 8, 1536, 474.4), _mlm_pp("462b", 16, 3072, 459.9),
)
# torchtitan's bf16/float8 pairs (issue #24; notes/pipeline-zero-fp8.md §6.3): Llama-3.1-8B with torch.compile in
# both, tensorwise with the float8 all-gather on FSDP (torchtitan docs/performance.md Tables 1 and 3: 8 and 128 H100,
# local batch 2) and on FSDP 8 x TP 8 (torchtitan#1207: 64 H100, local batch 12, per-op SAC: bf16 4,378, rowwise
# 3,708.5, tensorwise 5,078.1). The bf16 FSDP8 x TP8 row is `tt_8b_fsdp8_tp8` above.
_TT_FSDP8 = RUNS[0]
_TT_TP8 = RUNS[2]
FLOAT8_RUNS = (
    replace(_TT_FSDP8, name="tt_8b_fsdp8_compile", what="torchtitan Llama-3.1-8B, 8 H100, FSDP 8, local batch 2, "
            "compile", published=6667.0, published_mem_gib=None, compiled=True),
    replace(_TT_FSDP8, name="tt_8b_fsdp8_float8", what="same, float8 tensorwise + fp8 all-gather", published=8532.0,
            published_mem_gib=None, compiled=True, float8="tensorwise", pair="tt_8b_fsdp8_compile"),
    replace(RUNS[1], name="tt_8b_fsdp128_compile", what="torchtitan Llama-3.1-8B, 128 H100, FSDP 128, compile",
            published=6514.0, published_mem_gib=None, compiled=True),
    replace(RUNS[1], name="tt_8b_fsdp128_float8", what="same, float8 tensorwise + fp8 all-gather", published=8380.0,
            published_mem_gib=None, compiled=True, float8="tensorwise", pair="tt_8b_fsdp128_compile"),
    replace(_TT_TP8, name="tt_8b_fsdp8_tp8_rowwise", what="torchtitan Llama-3.1-8B, 64 H100, FSDP 8 x TP 8, float8 "
            "rowwise", published=3708.5, float8="rowwise", pair="tt_8b_fsdp8_tp8"),
    replace(_TT_TP8, name="tt_8b_fsdp8_tp8_tensorwise", what="same, float8 tensorwise", published=5078.1,
            float8="tensorwise", pair="tt_8b_fsdp8_tp8"),
)
FLOAT8_AUTO_ROW = "tt_8b_fsdp8_tp8"  # `auto` with float8="auto" on this row's mesh and batch must not choose rowwise
PUBLISHED_SCALING = 5605.0 / 5762.0 - 1  # torchtitan FSDP 8 -> 128 GPUs: -2.7%

def llama_tt_eager_meta(shape: dict, seq: int, batch: int):
    """torchtitan's Llama 3 as its eager FSDP runs execute it (torchtitan `torchtitan/models/llama/model.py` and
    `models/norms.py`, Dec 2024, `norm_type = "rmsnorm"`): `llama_tt_meta` with its fp32 upcasts, each an eager
    kernel of its own that the estimate prices by its bytes: RMSNorm computes in fp32 (`self._norm(x.float())
    .type_as(x) * self.weight`) and RoPE multiplies complex fp32 (`view_as_complex(xq.float()...) * freqs_cis`,
    complex64 frequencies; the loss' logits `.float()` as in `llama_tt_meta`). The torch.compile row keeps
    `llama_tt_meta`: Inductor fuses these casts into the neighbouring kernels."""
    import torch
    import torch.nn.functional as F
    from autopar.models import Llama, LlamaAttention, LlamaConfig, RMSNorm

    class Norm(RMSNorm):
        def forward(self, x):
            xf = x.float()
            return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)).type_as(x) * self.weight

    class Attention(LlamaAttention):
        def forward(self, x, _, freqs_cis):
            b, s, _h = x.shape
            q = self.wq(x).view(b, s, self.num_heads, self.head_dim)
            k = self.wk(x).view(b, s, self.num_kv_heads, self.head_dim)
            v = self.wv(x).view(b, s, self.num_kv_heads, self.head_dim)
            f = freqs_cis.view(1, s, 1, self.head_dim // 2)
            q = torch.view_as_real(torch.view_as_complex(q.float().reshape(b, s, self.num_heads, -1, 2)) * f)
            k = torch.view_as_real(torch.view_as_complex(k.float().reshape(b, s, self.num_kv_heads, -1, 2)) * f)
            q, k = q.flatten(3).type_as(x), k.flatten(3).type_as(x)
            y = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                               is_causal=True, enable_gqa=True)
            return self.wo(y.transpose(1, 2).reshape(b, s, -1))

    class TorchtitanLlama(Llama):
        def __init__(self, cfg):
            super().__init__(cfg)
            for layer in self.layers:
                layer.attn_norm, layer.mlp_norm = Norm(cfg.hidden, cfg.norm_eps), Norm(cfg.hidden, cfg.norm_eps)
                layer.attn = Attention(cfg)
            self.norm = Norm(cfg.hidden, cfg.norm_eps)

        def forward(self, tokens, labels):
            s = tokens.shape[1]
            freqs = torch.outer(torch.arange(s, device=tokens.device).float(), self.inv_freq)
            freqs_cis = torch.polar(torch.ones_like(freqs), freqs)
            x = self.embed(tokens)
            for layer in self.layers:
                x, _ = layer(x, None, freqs_cis)
            logits = self.output(self.norm(x)).flatten(0, 1).float()
            return F.cross_entropy(logits, labels.flatten(), ignore_index=-100)

    cfg = LlamaConfig(vocab_size=shape["vocab"], seq_len=seq, num_layers=shape["layers"], num_heads=shape["heads"],
                      num_kv_heads=shape["kv_heads"], hidden=shape["hidden"], ffn_hidden=shape["ffn"],
                      rope_theta=500000.0, norm_eps=1e-5, attention="sdpa")
    with torch.device("meta"):
        model = TorchtitanLlama(cfg).to(torch.bfloat16)
        ids = torch.zeros(batch, seq, dtype=torch.long)
    return model, (ids, ids)


def gpt_meta(size: str, batch: int):
    """autopar.models.GPT (fused QKV, GELU MLP 4H, tied embeddings) on meta in bf16, and its meta inputs."""
    import torch
    from autopar.models import GPT, GPTConfig

    layers, hidden, heads = GPT_SHAPES[size]
    cfg = GPTConfig(vocab_size=GPT_VOCAB, seq_len=GPT_SEQ, num_layers=layers, num_heads=heads, hidden=hidden)
    with torch.device("meta"):
        model = GPT(cfg).to(torch.bfloat16)
        ids = torch.zeros(batch, GPT_SEQ, dtype=torch.long)
    return model, (ids, ids)


def build(run: Run):
    if run.arch == "llama":
        build_llama = llama_tt_meta if run.compiled else llama_tt_eager_meta
        model, inputs = build_llama(run.shape, run.seq, run.batch)
        return (model.float() if run.mixed else model), inputs  # mixed: the fp32 masters torchtitan holds
    return gpt_meta(run.shape["size"], run.batch)


def mp_policy(run: Run):
    """torchtitan's `MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32)` for a mixed run, else None."""
    if not run.mixed:
        return None
    import torch
    from torch.distributed.fsdp import MixedPrecisionPolicy
    return MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)


def plan_overrides(run: Run) -> dict | None:
    """The run's checkpoint level and own layout as `autopar.plan` overrides."""
    out = {"checkpoint": run.ac} if run.ac else {}
    return {**out, **dict(run.overrides)} or None


def flops_per_step(run: Run, model) -> float:
    """The FLOPs of one step as the publisher counts them (see the module docstring)."""
    tokens = run.batch * run.seq
    if run.arch == "llama":
        s = run.shape
        n = sum(p.numel() for p in model.parameters()) - s["vocab"] * s["hidden"]  # less the token embedding
        return tokens * (6 * n + 12 * s["layers"] * s["hidden"] * run.seq)
    layers, h, _ = GPT_SHAPES[run.shape["size"]]
    s, v = run.seq, GPT_VOCAB
    return 72 * run.batch * s * layers * h**2 * (1 + s / (6 * h) + v / (12 * layers * h))


def price(run: Run, memory_limit=None) -> dict:
    """Plan `run` and return what the cost model predicts for it (or the planner's refusal)."""
    import autopar
    from autopar.solver import InfeasibleError

    model, inputs = build(run)
    out = {"run": run, "params": sum(p.numel() for p in model.parameters())}
    t0 = time.perf_counter()
    overrides = plan_overrides(run) if run.plan != "auto" else None
    if run.pipeline:
        overrides = {**(overrides or {}), "pipeline": run.pipeline}
    try:
        p = autopar.plan(model, run.mesh, inputs, plan=run.plan, cluster=run.cluster, memory_limit=memory_limit,
                         overrides=overrides, mp_policy=mp_policy(run), microbatches=run.microbatches or None,
                         float8=run.float8)
    except InfeasibleError as e:
        out.update(plan_s=time.perf_counter() - t0, infeasible=str(e), least_gib=e.least_bytes / GIB)
        return out
    e = p.estimate
    step = e.step_time_s  # with the checkpoint level's recomputation (and re-issued collectives)
    tok_s_gpu = run.batch * run.seq / step / run.gpus
    tflops = flops_per_step(run, model) / step / run.gpus / 1e12
    predicted = tok_s_gpu if run.unit == "tok/s/GPU" else tflops
    out.update(plan_s=time.perf_counter() - t0, infeasible=None, step_s=step, compute_s=e.compute_time_s,
               comm_s=e.comm_time_s, exposed_s=e.exposed_comm_s, terms=stage_terms(p) if p.pipeline else peak_terms(p),
               levels=sorted({lv for _, lv in p.checkpoint}),
               mem_gib=e.memory_bytes_per_device / GIB, fits=e.fits,
               limit_gib=e.memory_limit_bytes / GIB, tok_s_gpu=tok_s_gpu, tflops=tflops, mfu=tflops * 1e12 / PEAK_BF16,
               predicted=predicted, ratio=predicted / run.published, forms=forms(p), batch_ok=batch_split_ok(p),
               bubble_s=e.bubble_s, pipeline=p.pipeline, float8=p.float8)
    return out


def stage_terms(p) -> str:
    """A pipelined plan's peak on its most loaded rank (`Estimate.stages`): model state plus the activations of the
    microbatches it holds in flight."""
    s = max(p.estimate.stages, key=lambda x: x.peak_bytes)
    state = s.parameters_bytes + s.gradients_bytes + s.optimizer_bytes
    return (f"{s.key}: {s.layers} layers, model state {state / GIB:.1f} + {s.in_flight:g} microbatches in flight x "
            f"{s.activations_bytes / GIB:.1f} saved = peak {s.peak_bytes / GIB:.1f} GiB")


def breakdown(run: Run) -> dict[str, float]:
    """The predicted step of `run` by category, ms per device (`--breakdown`): each op of the captured graph priced by
    its kind at the preset's rate (`cost_model.analytical.kernel_time_s`), forward + backward (3x forward), divided
    over the ranks its structure's form splits it (the data axes, times the form's own axes); the optimizer step
    (`Estimate.optimizer_s`); FSDP's copies into and out of its flat buffers (`autopar.forms.fsdp.copy_s`); the
    compute the timeline adds where communication overlaps it (`Estimate.contention_s`); the selective level's recompute
    and the rest (what remains of the estimate's compute time: with no level, what the per-op split over ranks
    approximates); the exposed communication; and the step published, for the MFU
    it implies."""
    import autopar
    from autopar.api import _prepare
    from autopar.estimate import gather_stats, mesh_costing
    from autopar.forms import fsdp
    from autopar.precision import precision_of
    from cost_model.analytical import kernel_time_s
    from cost_model.hardware import PRESETS

    model, inputs = build(run)
    kw = dict(plan=run.plan, overrides=plan_overrides(run), mp_policy=mp_policy(run))
    cluster = PRESETS[run.cluster]
    p = autopar.plan(model, run.mesh, inputs, cluster=cluster, **kw)
    _, _, ctx = _prepare(model, run.mesh, inputs, precision=precision_of(mp_policy(run)))
    stats, other, _ = gather_stats(ctx)
    axes = {s.key: s.axes for s in p.strategies}
    out: dict[str, float] = {}
    for key, st in [*stats.items(), ("", other)]:
        div = run.mesh["dp"] * math.prod(run.mesh[a] for a in axes.get(key, ()))
        for (kind, dtype, size), (flops, nbytes, ops) in st.work.items():
            label = {"matmul": "matmul", "sdpa": "attention"}.get(kind, f"{'elementwise' if kind == 'vector' else 'copies'}"
                                                                         f" {dtype.replace('bfloat16', 'bf16').replace('float32', 'fp32')}")
            t = kernel_time_s(kind, 3 * flops / div, 3 * nbytes / div, dtype, cluster, 3 * ops,
                              flops_per_call=size / div if size and kind == "matmul" else None,
                              seq_len=size if size and kind == "sdpa" else None)
            if t:
                out[label] = out.get(label, 0.0) + t * 1e3
    e = p.estimate
    out["optimizer step"] = e.optimizer_s * 1e3
    if run.plan == "fsdp":  # every structure FSDP-sharded over dp: its flat buffers' copies (`fsdp.copy_s`)
        mc = mesh_costing(ctx, stats, other, tuple(run.mesh), tuple(run.mesh.values()), ("dp",), cluster)
        out["fsdp copies"] = sum(fsdp.copy_s(mc, st, 1) for st in (*stats.values(), other)) * 1e3
    out["overlap contention"] = e.contention_s * 1e3
    out["recompute and rest"] = e.compute_time_s * 1e3 - sum(out.values())
    out["exposed comm"] = e.exposed_comm_s * 1e3
    out["step"] = e.step_time_s * 1e3
    tokens = run.batch * run.seq / run.gpus
    out["published step"] = (tokens / run.published if run.unit == "tok/s/GPU"
                             else flops_per_step(run, model) / run.gpus / (run.published * 1e12)) * 1e3
    return out


def float8_rows() -> tuple:
    """The float8 rows and the bf16 rows they pair with (`--float8`)."""
    pairs = {r.pair for r in FLOAT8_RUNS}
    return tuple(r for r in RUNS if r.name in pairs) + FLOAT8_RUNS


def float8_ratio(by: dict, run: Run) -> tuple[float, float]:
    """(predicted, published) float8/bf16 throughput ratio of a float8 row against its bf16 pair."""
    base = by[run.pair]
    return by[run.name]["predicted"] / base["predicted"], run.published / base["run"].published


def float8_auto(run: Run) -> dict:
    """`auto` with float8="auto" on `run`'s model, mesh and batch: the recipe it chooses (issue #24: not rowwise on
    FSDP8 x TP8)."""
    r = price(replace(run, plan="auto", float8="auto", overrides=()))
    chosen = sorted({recipe for _, recipe in r.get("float8") or ()}) or ["none"]
    return {**r, "float8_recipes": chosen}


def auto_fits(run: Run, limit_bytes: float) -> dict:
    """Does `auto` find a plan for `run`'s model, mesh and batch under `limit_bytes`?"""
    auto = replace(run, plan="auto")
    return price(auto, memory_limit=limit_bytes)


def fmt_row(r: dict) -> str:
    run = r["run"]
    if r["infeasible"]:
        return f"  {run.what} [{run.plan}]: INFEASIBLE: {r['infeasible']}"
    return (f"  {run.what} [{run.plan}, {run.cluster}, {r['params'] / 1e9:.2f} B params]: predicted "
            f"{r['step_s'] * 1e3:.0f} ms/step (compute {r['compute_s'] * 1e3:.0f}"
            + (" with checkpoint level " + "/".join(r["levels"]) if r["levels"] else "")
            + f", comm {r['comm_s'] * 1e3:.0f} of which exposed {r['exposed_s'] * 1e3:.0f}), "
            f"{r['tok_s_gpu']:,.0f} tok/s/GPU, "
            f"{r['tflops']:.0f} TFLOP/s/GPU ({r['mfu']:.0%} of peak), {r['mem_gib']:.1f} GiB/device "
            f"({'fits' if r['fits'] else 'DOES NOT FIT'} {r['limit_gib']:.1f}); published {run.published:,.1f} "
            f"{run.unit}\n    forms: {r['forms']}"
            + (f"\n    pipeline {r['pipeline'].label}: {r['pipeline'].microbatches} microbatches, "
               f"{r['pipeline'].stages_per_rank} stages per rank, cut {list(r['pipeline'].cut)}, bubble "
               f"{r['bubble_s'] * 1e3:.0f} ms; {r['terms']}" if r.get("pipeline") else "")
            + ("" if r["batch_ok"] else "\n    the batch does not divide over the plan's data axes: input replicated"))


def main(argv=None, priced: dict | None = None) -> dict:
    """The benchmark; `priced`: rows already priced (`price`) by run name, reused (tests share them)."""
    argv = sys.argv[1:] if argv is None else argv
    quick, markdown, parts = "--quick" in argv, "--markdown" in argv, "--breakdown" in argv
    only_float8 = "--float8" in argv
    runs = RUNS[:1] if quick else float8_rows() if only_float8 else RUNS + FLOAT8_RUNS
    results = []
    print("== throughput: predicted (cost model, h100 preset) vs published")
    for run in runs:
        r = (priced or {}).get(run.name) or price(run)
        results.append(r)
        print(fmt_row(r), flush=True)
    by = {r["run"].name: r for r in results}

    print("== memory: predicted peak of the same plan vs published peak (96 GB H100, selective AC)")
    mem = []
    for r in results:
        run = r["run"]
        if run.published_mem_gib is None or r["infeasible"]:
            continue
        autos = {} if quick or only_float8 else {gb: auto_fits(run, gb * 1e9) for gb in (80, 95)}
        mem.append((r, autos))
        says = "; ".join(f"auto under {gb} GB: "
                         + (f"INFEASIBLE (least {a['least_gib']:.0f} GiB)" if a["infeasible"] else
                            f"plan at {a['mem_gib']:.1f} GiB, {a['tok_s_gpu']:,.0f} tok/s/GPU")
                         for gb, a in autos.items())
        print(f"  {run.what}: predicted {r['mem_gib']:.1f} GiB ({r['terms']}) vs published "
              f"{run.published_mem_gib} GiB (torch.cuda max reserved)" + (f"; {says}" if says else ""), flush=True)

    print()
    for r in results:
        run = r["run"]
        if r["infeasible"]:
            print(f"RATIO published_{run.name} predicted/published = INFEASIBLE (least {r['least_gib']:.0f} GiB; "
                  f"goal 0.75-1.25)")
        else:
            print(f"RATIO published_{run.name} predicted/published = {r['ratio']:.2f} ({r['predicted']:,.1f} / "
                  f"{run.published:,.1f} {run.unit}; goal 0.75-1.25)")
    if "tt_8b_fsdp8" in by and "tt_8b_fsdp128" in by and not by["tt_8b_fsdp128"]["infeasible"]:
        pred = by["tt_8b_fsdp128"]["tok_s_gpu"] / by["tt_8b_fsdp8"]["tok_s_gpu"] - 1
        print(f"RATIO published_fsdp_8_to_128_scaling predicted = {pred:+.1%} (published {PUBLISHED_SCALING:+.1%}; "
              f"goal within 10 points)")
    for run in (x["run"] for x in results):
        if run.pair and run.pair in by and not by[run.name]["infeasible"] and not by[run.pair]["infeasible"]:
            pred, pub = float8_ratio(by, run)
            print(f"RATIO published_float8_{run.name} float8/bf16 predicted = {pred:.3f} (published {pub:.3f}, "
                  f"{(pred - pub) * 100:+.1f} points; goal within 10 points)")
    if not quick and FLOAT8_AUTO_ROW in by:
        a = float8_auto(by[FLOAT8_AUTO_ROW]["run"])
        print(f"RATIO float8_auto_{FLOAT8_AUTO_ROW} chosen = {'/'.join(a['float8_recipes'])} (goal: not rowwise; "
              f"{a.get('tok_s_gpu', 0):,.0f} tok/s/GPU predicted)")
    for r, autos in mem:
        run = r["run"]
        ok = "".join(f", auto@{gb}GB {'fits' if not a['infeasible'] else 'INFEASIBLE'}" for gb, a in autos.items())
        print(f"RATIO published_mem_{run.name} predicted/published = {r['mem_gib'] / run.published_mem_gib:.2f} "
              f"({r['mem_gib']:.1f} / {run.published_mem_gib} GiB{ok}; goal 0.80-1.20)")

    autos_pp = []
    if "--auto" in argv:  # issue #23 item 5: auto on the same GPUs and batch against the published configuration
        print("\n== auto (the pipeline role, schedule, microbatches and checkpoint level its own) vs the published "
              "pipelined configuration, same cost model")
        for r in results:
            run = r["run"]
            if not run.pipeline or r["infeasible"]:
                continue
            a = price(replace(run, plan="auto", pipeline="", microbatches=0))
            autos_pp.append((r, a))
            print(fmt_row(a), flush=True)
    if parts:
        print("\n== the predicted step by category, ms per device (`breakdown`; the pipelined rows: see their stages)")
        for run in (r for r in runs if not r.pipeline):
            b = breakdown(run)
            print(f"  {run.name}: " + ", ".join(f"{k} {v:.0f}" for k, v in b.items()), flush=True)
    for r, a in autos_pp:
        run = r["run"]
        if a["infeasible"]:
            print(f"RATIO auto_vs_published_{run.name} = INFEASIBLE (least {a['least_gib']:.0f} GiB)")
            continue
        what = a["pipeline"].label + f" m={a['pipeline'].microbatches}" if a.get("pipeline") else "no pipeline"
        print(f"RATIO auto_vs_published_{run.name} published-config step / auto step = "
              f"{r['step_s'] / a['step_s']:.3f} (auto: {what}, {a['step_s'] * 1e3:.0f} ms, "
              f"{'fits' if a['fits'] else 'DOES NOT FIT'} {a['mem_gib']:.0f} GiB; published config "
              f"{r['step_s'] * 1e3:.0f} ms, {'fits' if r['fits'] else 'DOES NOT FIT'} {r['mem_gib']:.0f} GiB)")
    if markdown:
        print("\n| run | published | predicted | predicted / published | predicted memory |")
        print("|---|---|---|---|---|")
        for r in results:
            run = r["run"]
            if r["infeasible"]:
                print(f"| {run.what} | {run.published:,.1f} {run.unit} | infeasible (least {r['least_gib']:.0f} GiB) "
                      "| - | - |")
                continue
            mem_s = f"{r['mem_gib']:.0f} GiB"
            if run.published_mem_gib:
                mem_s += f" (published {run.published_mem_gib})"
            print(f"| {run.what} (`{run.plan}`) | {run.published:,.1f} {run.unit} | {r['predicted']:,.1f} "
                  f"({r['mfu']:.0%} MFU) | **{r['ratio']:.2f}** | {mem_s} |")
    return {"results": results, "memory": mem}


if __name__ == "__main__":
    main()
