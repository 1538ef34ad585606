"""The Hugging Face model zoo: small models of many families, held the way users hold them.

Each entry of `FAMILIES` is a factory `() -> (model, inputs, tolerance)`:

* `model`: the family's training head (`XForCausalLM`; `BertForMaskedLM`, `T5ForConditionalGeneration`,
  `ViTForImageClassification`) built from a **small config** (hidden 32-64, 2 layers, 4 heads, 2 KV heads
  where the family has GQA, intermediate 64-128, vocab 128, max positions 64) and otherwise **the config
  as shipped** (the config class's defaults: `use_cache` is not touched, tied embeddings, `pad_token_id`,
  rope, soft-capping, norms, multipliers all stay as the family ships them), in fp64, wrapped in the
  user's own loss module (`LossWrap`: `m(input_ids=..., labels=...).loss`), in eval mode.
  The only defaults changed besides sizes: dropout probabilities are set to 0 where a family ships them
  non-zero (dropout draws random masks; one device and the parallel program cannot be compared under
  it), and MoE families use `config._experts_implementation = "eager"` (the default `grouped_mm` takes
  fp32/bf16 only; autopar replaces the experts call by its canonical form whatever the implementation).
* `inputs`: a dict of keyword inputs, batch 4, sequence 16. Token batches are **right-padded** with the
  config's `pad_token_id` (rows of lengths 16, 11, 16, 7) and their labels are -100 at pad positions, as
  Hugging Face collators make them. Content tokens never equal the pad id. No `attention_mask` is passed
  (the wrapper is the one users write around `m(ids, labels=...)`): with right padding a causal model's
  real tokens never see the pads anyway; BERT's and T5's encoders do, as they would without a mask.
* `tolerance`: the max absolute error allowed on the loss, every gradient and every parameter after an
  SGD step (`tests/equivalence.run_equivalence`). `TOL_FP64` (1e-10) where the model computes in fp64
  end to end; `TOL_FP32` (1e-5) where a value that depends on the parameters is rounded to fp32 on the
  way (then a last-bit difference of a sharded sum before the rounding can become a fp32 ulp after it).
  Which families round where: the comment above `LossWrap` (found by looking for fp32 nodes downstream of
  a parameter in the captured graph: `benchmarks/zoo_census.py --fp32`).

Every factory seeds torch (0) before building and draws its inputs from its own generator, so the
same call gives the same model and batch.
"""

from __future__ import annotations

import contextlib
import warnings

import torch
from torch import nn

BATCH, SEQ, VOCAB = 4, 16, 128
MAX_POS = 64
LENGTHS = (16, 11, 16, 7)  # right padding: rows 1 and 3 end in pad tokens
TOL_FP64 = 1e-10
TOL_FP32 = 1e-5

# Why a family gets TOL_FP32 (`benchmarks/zoo_census.py --fp32` lists the fp32 nodes that depend on a parameter
# in each captured graph; a value computed from exact inputs only, such as rope's cos/sin of integer positions,
# is the same on every rank and does not count):
# * every causal LM (all but BERT, T5, ViT): `ForCausalLMLoss` upcasts with `logits.float()`, i.e. rounds the
#   fp64 logits to fp32, so the loss and the logits' gradient are fp32 (the loss is ~4.85: one fp32 ulp is
#   4.8e-7, the error the census sees most);
# * and, before that, most of them round inside their norms: Llama-style RMSNorms (`hidden_states.to(float32)`;
#   Llama, Mistral, Qwen2/3, Phi-3, OLMo, OLMo2, Granite, the MoE families, DeepSeek-V3's q/kv-a norms),
#   Gemma's (`self._norm(x.float())`), Cohere's LayerNorm and rotary (`q.float()`), Gemma2 and Bloom's
#   attention softmax (`softmax(..., dtype=float32)`), the MoE routers (softmax in fp32);
# * T5: T5LayerNorm computes the variance in fp32 (`hidden_states.to(torch.float32).pow(2).mean(-1)`) and its
#   loss is a plain fp64 `CrossEntropyLoss`; one device and two ranks usually agree to 1e-15, but a last-bit
#   difference before that rounding may flip an fp32 ulp of the variance.
# TOL_FP64: BERT (`BertForMaskedLM` uses `CrossEntropyLoss` on fp64 logits, LayerNorm in fp64) and ViT
# (`ForSequenceClassificationLoss` does not upcast): fp64 end to end.


class LossWrap(nn.Module):
    """A causal LM (or T5: encoder inputs, decoder labels shifted right inside) as users hold it: their own
    module returning the loss."""

    def __init__(self, m):
        super().__init__()
        self.m = m

    def forward(self, input_ids, labels):
        return self.m(input_ids=input_ids, labels=labels).loss


class ImageLossWrap(nn.Module):
    """ViT: images and class labels."""

    def __init__(self, m):
        super().__init__()
        self.m = m

    def forward(self, pixel_values, labels):
        return self.m(pixel_values=pixel_values, labels=labels).loss


@contextlib.contextmanager
def _fp64():
    old = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    try:
        yield
    finally:
        torch.set_default_dtype(old)


def _quiet():
    """Configs warn that bos/eos ids of the shipped tokenizer lie outside a 128-token vocab: harmless
    for training (they are used by generation only)."""
    import transformers
    transformers.logging.set_verbosity_error()
    warnings.filterwarnings("ignore", message=".*token_id.*")


# ----------------------------------------------------------------------------- batches

def _content(g: torch.Generator, pad: int) -> torch.Tensor:
    ids = torch.randint(0, VOCAB, (BATCH, SEQ), generator=g)
    # a tokenizer never emits the pad token inside the text: move any draw of it to the next id
    return torch.where(ids == pad, (ids + 1) % VOCAB, ids)


def _pad_mask() -> torch.Tensor:
    pos = torch.arange(SEQ)
    return torch.stack([pos >= n for n in LENGTHS])  # True at pad positions


def causal_batch(pad: int, seed: int = 0) -> dict[str, torch.Tensor]:
    """Right-padded ids; labels = ids with -100 at pads (DataCollatorForLanguageModeling(mlm=False));
    the model shifts labels itself."""
    g = torch.Generator().manual_seed(seed)
    ids = _content(g, pad)
    pads = _pad_mask()
    ids = ids.masked_fill(pads, pad)
    labels = ids.masked_fill(pads, -100)
    return {"input_ids": ids, "labels": labels}


def mlm_batch(pad: int, mask_token: int, seed: int = 0) -> dict[str, torch.Tensor]:
    """BERT masked LM: right-padded ids, about 15% of the real tokens (at least 2 per row) replaced by
    [MASK], labels the original ids there and -100 everywhere else (pads included)."""
    g = torch.Generator().manual_seed(seed)
    ids = _content(g, pad)
    ids = torch.where(ids == mask_token, ids + 1, ids)  # 103 + 1 is neither [MASK] nor the pad (0)
    pads = _pad_mask()
    ids = ids.masked_fill(pads, pad)
    chosen = torch.zeros(BATCH, SEQ, dtype=torch.bool)
    for r, n in enumerate(LENGTHS):
        k = max(2, round(0.15 * n))
        chosen[r, torch.randperm(n, generator=g)[:k]] = True
    labels = ids.masked_fill(~chosen, -100)
    ids = ids.masked_fill(chosen, mask_token)
    return {"input_ids": ids, "labels": labels}


def seq2seq_batch(pad: int, seed: int = 0) -> dict[str, torch.Tensor]:
    """T5: right-padded encoder ids; targets of other lengths, -100 after their end
    (DataCollatorForSeq2Seq pads labels with -100)."""
    g = torch.Generator().manual_seed(seed)
    ids = _content(g, pad).masked_fill(_pad_mask(), pad)
    target = _content(g, pad)
    tpos = torch.arange(SEQ)
    tlens = (9, 16, 5, 12)
    labels = target.masked_fill(torch.stack([tpos >= n for n in tlens]), -100)
    return {"input_ids": ids, "labels": labels}


# ----------------------------------------------------------------------------- building

def _build(make_model, config, wrap, inputs, tol):
    torch.manual_seed(0)
    with _fp64():
        model = wrap(make_model(config))
    model.eval()
    # fp64 throughout, except parameters the family keeps in fp32 on purpose (DeepSeek-V3's router weight:
    # `_keep_in_fp32_modules_strict`)
    keep = tuple(getattr(model.m, "_keep_in_fp32_modules_strict", None) or ())
    for name, p in model.named_parameters():
        assert p.dtype == torch.float64 or any(k in name for k in keep), f"{name} is {p.dtype}, not fp64"
    return model, inputs, tol


def _causal(config_cls: str, model_cls: str, tol: float, pad_in_batch: int | None = None, moe: bool = False,
            **cfg):
    """A causal LM family. `pad_in_batch`: the pad id the batches use when the shipped config has none."""
    import transformers
    _quiet()
    config = getattr(transformers, config_cls)(**cfg)
    if moe:
        config._experts_implementation = "eager"
    pad = config.pad_token_id if config.pad_token_id is not None else pad_in_batch
    assert pad is not None and 0 <= pad < VOCAB, (config_cls, pad)
    return _build(getattr(transformers, model_cls), config, LossWrap, causal_batch(pad), tol)


# Shared small sizes (names differ per family).
H, I, L, NH, KV = 32, 64, 2, 4, 2
# The shipped config has no pad_token_id (its tokenizer has none, or one outside a 128-token vocab):
# batches are padded with id 0, as a user setting `tokenizer.pad_token` to a low special token would.
NO_PAD = 0


def gpt2():
    # GPT2Config ships resid/embd/attn/summary dropout 0.1: set to 0 (dropout cannot be compared).
    return _causal("GPT2Config", "GPT2LMHeadModel", TOL_FP32, NO_PAD, vocab_size=VOCAB, n_positions=MAX_POS,
                   n_embd=H, n_layer=L, n_head=NH, n_inner=I, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
                   summary_first_dropout=0.0)


def llama():
    return _causal("LlamaConfig", "LlamaForCausalLM", TOL_FP32, NO_PAD, vocab_size=VOCAB, hidden_size=H,
                   intermediate_size=I, num_hidden_layers=L, num_attention_heads=NH, num_key_value_heads=KV,
                   max_position_embeddings=MAX_POS)


def mistral():
    return _causal("MistralConfig", "MistralForCausalLM", TOL_FP32, NO_PAD, vocab_size=VOCAB, hidden_size=H,
                   intermediate_size=I, num_hidden_layers=L, num_attention_heads=NH, num_key_value_heads=KV,
                   max_position_embeddings=MAX_POS)


def qwen2():
    return _causal("Qwen2Config", "Qwen2ForCausalLM", TOL_FP32, NO_PAD, vocab_size=VOCAB, hidden_size=H,
                   intermediate_size=I, num_hidden_layers=L, num_attention_heads=NH, num_key_value_heads=KV,
                   max_position_embeddings=MAX_POS)


def qwen3():
    # Qwen3 ships head_dim independent of hidden/heads (128 by default): 16 here, so q_proj is 32 -> 64.
    return _causal("Qwen3Config", "Qwen3ForCausalLM", TOL_FP32, NO_PAD, vocab_size=VOCAB, hidden_size=H,
                   intermediate_size=I, num_hidden_layers=L, num_attention_heads=NH, num_key_value_heads=KV,
                   head_dim=16, max_position_embeddings=MAX_POS)


def gemma():
    # Gemma ships head_dim 256 independent of hidden/heads: 16 here. pad_token_id 0, tied embeddings.
    return _causal("GemmaConfig", "GemmaForCausalLM", TOL_FP32, vocab_size=VOCAB, hidden_size=H,
                   intermediate_size=I, num_hidden_layers=L, num_attention_heads=NH, num_key_value_heads=KV,
                   head_dim=16, max_position_embeddings=MAX_POS)


def gemma2():
    # Attention and final-logit soft-capping, query_pre_attn_scalar, sliding/full layers: as shipped.
    return _causal("Gemma2Config", "Gemma2ForCausalLM", TOL_FP32, vocab_size=VOCAB, hidden_size=H,
                   intermediate_size=I, num_hidden_layers=L, num_attention_heads=NH, num_key_value_heads=KV,
                   head_dim=16, max_position_embeddings=MAX_POS)


def gemma3():
    # Text-only Gemma 3 (Gemma3ForCausalLM): q/k norms, sliding layers, rope per layer type, as shipped.
    return _causal("Gemma3TextConfig", "Gemma3ForCausalLM", TOL_FP32, vocab_size=VOCAB, hidden_size=H,
                   intermediate_size=I, num_hidden_layers=L, num_attention_heads=NH, num_key_value_heads=KV,
                   head_dim=16, max_position_embeddings=MAX_POS)


def phi():
    # PhiConfig ships its dropouts at 0; partial rotary 0.5, parallel attention + MLP, dense q/k/v.
    return _causal("PhiConfig", "PhiForCausalLM", TOL_FP32, NO_PAD, vocab_size=VOCAB, hidden_size=H,
                   intermediate_size=I, num_hidden_layers=L, num_attention_heads=NH,
                   max_position_embeddings=MAX_POS)


def phi3():
    # Fused qkv_proj and gate_up_proj. GQA as in Phi-3-medium / Phi-4 (40 heads, 10 KV heads). The shipped
    # pad_token_id is 32000 (= eos of the 32064-token vocab), outside a 128-token vocab: it becomes the
    # last id, 127, which lies in rank 1's half of a vocab-parallel table.
    return _causal("Phi3Config", "Phi3ForCausalLM", TOL_FP32, vocab_size=VOCAB, hidden_size=H,
                   intermediate_size=I, num_hidden_layers=L, num_attention_heads=NH, num_key_value_heads=KV,
                   max_position_embeddings=MAX_POS, original_max_position_embeddings=MAX_POS,
                   pad_token_id=VOCAB - 1, eos_token_id=VOCAB - 1)


def gptj():
    # GPT-J-6B: head_dim 256, rotary_dim 64 (a quarter); here head_dim 16, rotary_dim 4. Dropouts ship at 0.
    return _causal("GPTJConfig", "GPTJForCausalLM", TOL_FP32, NO_PAD, vocab_size=VOCAB, n_positions=MAX_POS,
                   n_embd=64, n_layer=L, n_head=NH, rotary_dim=4, n_inner=128)


def gpt_neox():
    # Fused query_key_value interleaved per head, partial rotary 0.25, parallel residual, as shipped.
    return _causal("GPTNeoXConfig", "GPTNeoXForCausalLM", TOL_FP32, NO_PAD, vocab_size=VOCAB, hidden_size=64,
                   num_hidden_layers=L, num_attention_heads=NH, intermediate_size=128,
                   max_position_embeddings=MAX_POS)


def opt():
    # OPTConfig ships dropout 0.1: set to 0. pad_token_id 1, tied embeddings, learned positions offset by 2.
    return _causal("OPTConfig", "OPTForCausalLM", TOL_FP32, vocab_size=VOCAB, hidden_size=H, ffn_dim=I,
                   num_hidden_layers=L, num_attention_heads=NH, word_embed_proj_dim=H,
                   max_position_embeddings=MAX_POS, dropout=0.0)


def falcon():
    # Falcon-7B layout as shipped: multi_query (one KV head) fused into query_key_value, parallel
    # attention, no biases, rope, tied embeddings.
    return _causal("FalconConfig", "FalconForCausalLM", TOL_FP32, NO_PAD, vocab_size=VOCAB, hidden_size=H,
                   num_hidden_layers=L, num_attention_heads=NH, ffn_hidden_size=I,
                   max_position_embeddings=MAX_POS)


def bloom():
    # ALiBi, fused query_key_value, embedding LayerNorm, tied embeddings. Its tokenizer pads with id 3.
    return _causal("BloomConfig", "BloomForCausalLM", TOL_FP32, 3, vocab_size=VOCAB, hidden_size=H, n_layer=L,
                   n_head=NH)


def stablelm():
    return _causal("StableLmConfig", "StableLmForCausalLM", TOL_FP32, NO_PAD, vocab_size=VOCAB, hidden_size=H,
                   intermediate_size=I, num_hidden_layers=L, num_attention_heads=NH, num_key_value_heads=KV,
                   max_position_embeddings=MAX_POS)


def starcoder2():
    # Starcoder2Config ships residual/embedding/attention dropout at 0; GQA, biases, tied embeddings.
    return _causal("Starcoder2Config", "Starcoder2ForCausalLM", TOL_FP32, NO_PAD, vocab_size=VOCAB,
                   hidden_size=H, intermediate_size=I, num_hidden_layers=L, num_attention_heads=NH,
                   num_key_value_heads=KV, max_position_embeddings=MAX_POS)


def olmo():
    # Non-parametric LayerNorm, pad_token_id 1.
    return _causal("OlmoConfig", "OlmoForCausalLM", TOL_FP32, vocab_size=VOCAB, hidden_size=H,
                   intermediate_size=I, num_hidden_layers=L, num_attention_heads=NH, num_key_value_heads=KV,
                   max_position_embeddings=MAX_POS)


def olmo2():
    # q_norm/k_norm: RMSNorm over all heads of q (and of k) together, post-norm residual; pad 1.
    return _causal("Olmo2Config", "Olmo2ForCausalLM", TOL_FP32, vocab_size=VOCAB, hidden_size=H,
                   intermediate_size=I, num_hidden_layers=L, num_attention_heads=NH, num_key_value_heads=KV,
                   max_position_embeddings=MAX_POS)


def granite():
    # GraniteConfig's multipliers ship at 1.0 (the logits are still divided by logits_scaling in the graph).
    return _causal("GraniteConfig", "GraniteForCausalLM", TOL_FP32, NO_PAD, vocab_size=VOCAB, hidden_size=H,
                   intermediate_size=I, num_hidden_layers=L, num_attention_heads=NH, num_key_value_heads=KV,
                   max_position_embeddings=MAX_POS)


def cohere():
    # Parallel attention + MLP, LayerNorm without bias, logit_scale 0.0625, tied embeddings, pad 0.
    return _causal("CohereConfig", "CohereForCausalLM", TOL_FP32, vocab_size=VOCAB, hidden_size=H,
                   intermediate_size=I, num_hidden_layers=L, num_attention_heads=NH, num_key_value_heads=KV,
                   max_position_embeddings=MAX_POS)


def mixtral():
    # 4 experts top-2 (as shipped: 8 experts top-2), no router logits output (output_router_logits False).
    return _causal("MixtralConfig", "MixtralForCausalLM", TOL_FP32, NO_PAD, moe=True, vocab_size=VOCAB,
                   hidden_size=H, intermediate_size=I, num_hidden_layers=L, num_attention_heads=NH,
                   num_key_value_heads=KV, max_position_embeddings=MAX_POS, num_local_experts=4,
                   num_experts_per_tok=2)


def qwen2_moe():
    # 4 experts top-2 plus the sigmoid-gated shared expert (as shipped: 60 experts top-4 + shared).
    return _causal("Qwen2MoeConfig", "Qwen2MoeForCausalLM", TOL_FP32, NO_PAD, moe=True, vocab_size=VOCAB,
                   hidden_size=H, intermediate_size=I, num_hidden_layers=L, num_attention_heads=NH,
                   num_key_value_heads=KV, max_position_embeddings=MAX_POS, num_experts=4, num_experts_per_tok=2,
                   moe_intermediate_size=32, shared_expert_intermediate_size=I)


def qwen3_moe():
    # 4 experts top-2 (as shipped: 128 top-8, renormalised top-k), q/k norms per head, head_dim 16.
    return _causal("Qwen3MoeConfig", "Qwen3MoeForCausalLM", TOL_FP32, NO_PAD, moe=True, vocab_size=VOCAB,
                   hidden_size=H, intermediate_size=I, num_hidden_layers=L, num_attention_heads=NH,
                   num_key_value_heads=KV, head_dim=16, max_position_embeddings=MAX_POS, num_experts=4,
                   num_experts_per_tok=2, moe_intermediate_size=32)


def olmoe():
    # 4 experts top-2 (as shipped: 64 top-8), q/k norms over all heads, pad 1.
    return _causal("OlmoeConfig", "OlmoeForCausalLM", TOL_FP32, moe=True, vocab_size=VOCAB, hidden_size=H,
                   intermediate_size=32, num_hidden_layers=L, num_attention_heads=NH, num_key_value_heads=KV,
                   max_position_embeddings=MAX_POS, num_experts=4, num_experts_per_tok=2)


def deepseek_v3():
    # MLA (q/kv low-rank with rope/nope split, interleaved rope), first layer dense then MoE with a shared
    # expert and group-limited sigmoid routing. Shipped: 256 experts in 8 groups, top-4 groups, top-8,
    # 3 dense layers; here 8 experts in 4 groups, top-2 groups, top-2, 1 dense layer.
    return _causal("DeepseekV3Config", "DeepseekV3ForCausalLM", TOL_FP32, NO_PAD, moe=True, vocab_size=VOCAB,
                   hidden_size=H, intermediate_size=I, moe_intermediate_size=32, num_hidden_layers=L,
                   num_attention_heads=NH, num_key_value_heads=NH, n_shared_experts=1, n_routed_experts=8,
                   kv_lora_rank=16, q_lora_rank=24, qk_rope_head_dim=8, v_head_dim=8, qk_nope_head_dim=8,
                   n_group=4, topk_group=2, num_experts_per_tok=2, first_k_dense_replace=1,
                   max_position_embeddings=MAX_POS)


def bert():
    # BertConfig ships hidden/attention dropout 0.1: set to 0. pad 0, [MASK] = 103 (bert-base-uncased).
    import transformers
    _quiet()
    config = transformers.BertConfig(vocab_size=VOCAB, hidden_size=H, num_hidden_layers=L, num_attention_heads=NH,
                                     intermediate_size=I, max_position_embeddings=MAX_POS, hidden_dropout_prob=0.0,
                                     attention_probs_dropout_prob=0.0)
    return _build(transformers.BertForMaskedLM, config, LossWrap, mlm_batch(config.pad_token_id, 103), TOL_FP64)


def t5():
    # T5Config ships dropout_rate 0.1: set to 0. Relative position buckets, ReLU FFN, tied embeddings with
    # the decoder output scaled by d_model**-0.5, pad 0 (also the decoder start token).
    import transformers
    _quiet()
    # T5Config's defaults have no decoder_start_token_id (every T5 checkpoint's config.json sets it to the
    # pad id, 0, and _shift_right needs it): set as t5-small ships it.
    config = transformers.T5Config(vocab_size=VOCAB, d_model=H, d_kv=8, d_ff=I, num_layers=L, num_decoder_layers=L,
                                   num_heads=NH, dropout_rate=0.0, decoder_start_token_id=0)
    return _build(transformers.T5ForConditionalGeneration, config, LossWrap, seq2seq_batch(config.pad_token_id),
                  TOL_FP32)


def vit():
    # ViTConfig ships its dropouts at 0. 16x16 images in 4x4 patches (16 patches + [CLS]), 2 labels as
    # shipped (single-label classification: cross-entropy). Images have no padding.
    import transformers
    _quiet()
    config = transformers.ViTConfig(hidden_size=H, num_hidden_layers=L, num_attention_heads=NH, intermediate_size=I,
                                    image_size=16, patch_size=4)
    g = torch.Generator().manual_seed(0)
    with _fp64():
        pixels = torch.randn(BATCH, 3, 16, 16, generator=g)
    labels = torch.randint(0, config.num_labels, (BATCH,), generator=g)
    return _build(transformers.ViTForImageClassification, config, ImageLossWrap,
                  {"pixel_values": pixels, "labels": labels}, TOL_FP64)


FAMILIES = {
    "gpt2": gpt2, "llama": llama, "mistral": mistral, "qwen2": qwen2, "qwen3": qwen3, "gemma": gemma,
    "gemma2": gemma2, "gemma3": gemma3, "phi": phi, "phi3": phi3, "gptj": gptj, "gpt_neox": gpt_neox, "opt": opt,
    "falcon": falcon, "bloom": bloom, "stablelm": stablelm, "starcoder2": starcoder2, "olmo": olmo, "olmo2": olmo2,
    "granite": granite, "cohere": cohere, "bert": bert, "t5": t5, "vit": vit, "mixtral": mixtral,
    "qwen2_moe": qwen2_moe, "qwen3_moe": qwen3_moe, "olmoe": olmoe, "deepseek_v3": deepseek_v3,
}
