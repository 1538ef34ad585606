"""Reference models used by the tests, examples and benchmarks.

They are ordinary single-device PyTorch models, written the way people write them, with no
annotation for autopar: a GPT with a fused QKV projection and tied embeddings, a Llama-style
model (RMSNorm, RoPE, grouped-query attention written out as matmul-softmax-matmul, SwiGLU),
and a plain MLP. Each forward takes `(tokens, labels)` and returns the mean cross-entropy loss,
or logits when `labels` is None.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn


@dataclass(frozen=True, kw_only=True)
class GPTConfig:
    vocab_size: int = 128
    seq_len: int = 16
    num_layers: int = 2
    num_heads: int = 4
    hidden: int = 32
    dropout: float = 0.0


class CausalSelfAttention(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.num_heads = cfg.num_heads
        self.qkv = nn.Linear(cfg.hidden, 3 * cfg.hidden)  # fused q, k, v
        self.proj = nn.Linear(cfg.hidden, cfg.hidden)
        self.dropout = cfg.dropout

    def forward(self, x):
        b, s, h = x.shape
        q, k, v = self.qkv(x).split(h, dim=2)
        q = q.view(b, s, self.num_heads, h // self.num_heads).transpose(1, 2)
        k = k.view(b, s, self.num_heads, h // self.num_heads).transpose(1, 2)
        v = v.view(b, s, self.num_heads, h // self.num_heads).transpose(1, 2)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        y = y.transpose(1, 2).contiguous().view(b, s, h)
        return F.dropout(self.proj(y), self.dropout, self.training)


class GPTBlock(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.ln1 = nn.LayerNorm(cfg.hidden)
        self.attn = CausalSelfAttention(cfg)
        self.ln2 = nn.LayerNorm(cfg.hidden)
        self.fc = nn.Linear(cfg.hidden, 4 * cfg.hidden)
        self.out = nn.Linear(4 * cfg.hidden, cfg.hidden)

    def forward(self, x):
        x = x + self.attn(self.ln1(x))
        return x + self.out(F.gelu(self.fc(self.ln2(x))))


def _init_weights(module: nn.Module) -> None:
    """GPT-2's initialisation: N(0, 0.02) weights, zero biases."""
    if isinstance(module, (nn.Linear, nn.Embedding)):
        nn.init.normal_(module.weight, std=0.02)
    if isinstance(module, nn.Linear) and module.bias is not None:
        nn.init.zeros_(module.bias)


class GPT(nn.Module):
    def __init__(self, cfg: GPTConfig = GPTConfig()):
        super().__init__()
        self.cfg = cfg
        self.wte = nn.Embedding(cfg.vocab_size, cfg.hidden)
        self.wpe = nn.Embedding(cfg.seq_len, cfg.hidden)
        self.h = nn.ModuleList(GPTBlock(cfg) for _ in range(cfg.num_layers))
        self.ln_f = nn.LayerNorm(cfg.hidden)
        self.lm_head = nn.Linear(cfg.hidden, cfg.vocab_size, bias=False)
        self.lm_head.weight = self.wte.weight  # tied
        self.apply(_init_weights)

    def forward(self, tokens, labels=None):
        pos = torch.arange(tokens.shape[1], device=tokens.device)
        x = self.wte(tokens) + self.wpe(pos)
        for block in self.h:
            x = block(x)
        logits = self.lm_head(self.ln_f(x))
        if labels is None:
            return logits
        logits = logits.flatten(0, 1)
        if logits.dtype in (torch.float16, torch.bfloat16):
            logits = logits.float()  # the loss is computed in fp32
        return F.cross_entropy(logits, labels.flatten())


@dataclass(frozen=True, kw_only=True)
class LlamaConfig:
    vocab_size: int = 128
    seq_len: int = 16
    num_layers: int = 2
    num_heads: int = 4
    num_kv_heads: int = 2
    hidden: int = 32
    ffn_hidden: int = 64
    rope_theta: float = 10000.0
    norm_eps: float = 1e-6
    attention: str = "explicit"  # "explicit" (matmul, causal mask, softmax, matmul) or "sdpa" (GQA via enable_gqa)
    causal: bool = True  # False: bidirectional attention (sdpa spelling only)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x):
        return self.weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps))


def rotate_half(x):
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


class LlamaAttention(nn.Module):
    """Grouped-query attention written out as matmul, causal mask, softmax, matmul."""

    def __init__(self, cfg: LlamaConfig):
        super().__init__()
        self.num_heads, self.num_kv_heads = cfg.num_heads, cfg.num_kv_heads
        self.head_dim = cfg.hidden // cfg.num_heads
        self.wq = nn.Linear(cfg.hidden, cfg.num_heads * self.head_dim, bias=False)
        self.wk = nn.Linear(cfg.hidden, cfg.num_kv_heads * self.head_dim, bias=False)
        self.wv = nn.Linear(cfg.hidden, cfg.num_kv_heads * self.head_dim, bias=False)
        self.wo = nn.Linear(cfg.num_heads * self.head_dim, cfg.hidden, bias=False)
        self.spelling = cfg.attention
        self.causal = cfg.causal

    def forward(self, x, cos, sin):
        b, s, _ = x.shape
        q = self.wq(x).view(b, s, self.num_heads, self.head_dim).transpose(1, 2)
        k = self.wk(x).view(b, s, self.num_kv_heads, self.head_dim).transpose(1, 2)
        v = self.wv(x).view(b, s, self.num_kv_heads, self.head_dim).transpose(1, 2)
        q = q * cos + rotate_half(q) * sin
        k = k * cos + rotate_half(k) * sin
        if self.spelling == "sdpa":
            y = F.scaled_dot_product_attention(q, k, v, is_causal=self.causal, enable_gqa=True)
            return self.wo(y.transpose(1, 2).reshape(b, s, -1))
        rep = self.num_heads // self.num_kv_heads
        k = k[:, :, None].expand(b, self.num_kv_heads, rep, s, self.head_dim).reshape(b, self.num_heads, s, self.head_dim)
        v = v[:, :, None].expand(b, self.num_kv_heads, rep, s, self.head_dim).reshape(b, self.num_heads, s, self.head_dim)
        scores = q @ k.transpose(2, 3) / math.sqrt(self.head_dim)
        mask = torch.triu(torch.ones(s, s, dtype=torch.bool, device=x.device), diagonal=1)
        scores = scores.masked_fill(mask, float("-inf"))
        y = torch.softmax(scores.float(), dim=-1).to(q.dtype) @ v
        return self.wo(y.transpose(1, 2).reshape(b, s, -1))


class LlamaMLP(nn.Module):
    def __init__(self, cfg: LlamaConfig):
        super().__init__()
        self.gate = nn.Linear(cfg.hidden, cfg.ffn_hidden, bias=False)
        self.up = nn.Linear(cfg.hidden, cfg.ffn_hidden, bias=False)
        self.down = nn.Linear(cfg.ffn_hidden, cfg.hidden, bias=False)

    def forward(self, x):
        return self.down(F.silu(self.gate(x)) * self.up(x))


class LlamaBlock(nn.Module):
    def __init__(self, cfg: LlamaConfig):
        super().__init__()
        self.attn_norm = RMSNorm(cfg.hidden, cfg.norm_eps)
        self.attn = LlamaAttention(cfg)
        self.mlp_norm = RMSNorm(cfg.hidden, cfg.norm_eps)
        self.mlp = LlamaMLP(cfg)

    def forward(self, x, cos, sin):
        x = x + self.attn(self.attn_norm(x), cos, sin)
        return x + self.mlp(self.mlp_norm(x))


class Llama(nn.Module):
    def __init__(self, cfg: LlamaConfig = LlamaConfig()):
        super().__init__()
        self.cfg = cfg
        self.embed = nn.Embedding(cfg.vocab_size, cfg.hidden)
        self.layers = nn.ModuleList(LlamaBlock(cfg) for _ in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden, cfg.norm_eps)
        self.output = nn.Linear(cfg.hidden, cfg.vocab_size, bias=False)
        head_dim = cfg.hidden // cfg.num_heads
        inv_freq = 1.0 / (cfg.rope_theta ** (torch.arange(0, head_dim, 2).float() / head_dim))
        self.register_buffer("inv_freq", inv_freq, persistent=False)

    def forward(self, tokens, labels=None):
        s = tokens.shape[1]
        freqs = torch.outer(torch.arange(s, device=tokens.device).float(), self.inv_freq)
        emb = torch.cat((freqs, freqs), dim=-1)
        x = self.embed(tokens)
        cos, sin = emb.cos().to(x.dtype), emb.sin().to(x.dtype)
        for layer in self.layers:
            x = layer(x, cos, sin)
        logits = self.output(self.norm(x))
        if labels is None:
            return logits
        logits = logits.flatten(0, 1)
        if logits.dtype in (torch.float16, torch.bfloat16):
            logits = logits.float()  # the loss is computed in fp32
        return F.cross_entropy(logits, labels.flatten(), ignore_index=-100)


class MLP(nn.Module):
    """Two-layer perceptron regression model: forward(x, y) returns the mean squared error."""

    def __init__(self, dim: int = 16, hidden: int = 64):
        super().__init__()
        self.fc1 = nn.Linear(dim, hidden)
        self.fc2 = nn.Linear(hidden, dim)

    def forward(self, x, y=None):
        out = self.fc2(torch.relu(self.fc1(x)))
        if y is None:
            return out
        return F.mse_loss(out, y)
