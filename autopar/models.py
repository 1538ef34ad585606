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
    moe_experts: int = 0  # > 0: every MLP is a mixture of this many experts
    moe_top_k: int = 2
    moe_style: str = "modulelist"  # "modulelist" (Python loop over nn.ModuleList) or "grouped" (stacked weights)
    moe_aux_coef: float = 0.01  # load-balancing loss weight ("modulelist" returns it; "grouped" is aux-free)
    moe_capacity_factor: float | None = None  # "modulelist" only: drop assignments beyond capacity


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


class MoEBlock(nn.Module):
    """Mixture of experts, the classic way: a router, an `nn.ModuleList` of SwiGLU experts and a Python
    loop that skips experts no token chose (data-dependent: it cannot be traced). Softmax, top-k,
    weights renormalised; returns `(y, aux)` with the Switch load-balancing loss. With a capacity
    factor, expert e keeps its first `ceil(cf * T * k / E)` assignments in (token, choice) order."""

    def __init__(self, cfg: LlamaConfig):
        super().__init__()
        self.top_k, self.num_experts = cfg.moe_top_k, cfg.moe_experts
        self.capacity_factor = cfg.moe_capacity_factor
        self.router = nn.Linear(cfg.hidden, cfg.moe_experts, bias=False)
        self.experts = nn.ModuleList(LlamaMLP(cfg) for _ in range(cfg.moe_experts))

    def forward(self, x):
        b, s, h = x.shape
        xf = x.reshape(-1, h)
        probs = torch.softmax(self.router(xf), dim=-1)
        w, idx = torch.topk(probs, self.top_k, dim=-1)
        w = w / w.sum(dim=-1, keepdim=True)
        out = torch.zeros_like(xf)
        cap = None if self.capacity_factor is None else \
            math.ceil(self.capacity_factor * xf.shape[0] * self.top_k / self.num_experts)
        for e, expert in enumerate(self.experts):
            token, slot = torch.where(idx == e)
            if cap is not None:
                token, slot = token[:cap], slot[:cap]
            if token.numel() == 0:
                continue
            out.index_add_(0, token, expert(xf[token]) * w[token, slot, None])
        frac = F.one_hot(idx, self.num_experts).to(probs.dtype).sum(1).mean(0)
        aux = self.num_experts * (frac * probs.mean(0)).sum() / self.top_k
        return out.reshape(b, s, h), aux


class GroupedExperts(nn.Module):
    """torchtitan-style experts: weights stacked on a leading expert dim, tokens arrive sorted by expert."""

    def __init__(self, cfg: LlamaConfig):
        super().__init__()
        E, f, h = cfg.moe_experts, cfg.ffn_hidden, cfg.hidden
        self.w1 = nn.Parameter(torch.randn(E, f, h) / math.sqrt(h))
        self.w2 = nn.Parameter(torch.randn(E, h, f) / math.sqrt(f))
        self.w3 = nn.Parameter(torch.randn(E, f, h) / math.sqrt(h))

    def forward(self, x, num_tokens_per_expert):
        outs = []
        for e, part in enumerate(torch.split(x, num_tokens_per_expert.tolist(), dim=0)):
            outs.append((F.silu(part @ self.w1[e].T) * (part @ self.w3[e].T)) @ self.w2[e].T)
        return torch.cat(outs, dim=0)


class GroupedMoE(nn.Module):
    """Router (top-k of the logits, softmax over the k), tokens sorted by expert, `GroupedExperts`;
    auxiliary-loss-free (returns y only)."""

    def __init__(self, cfg: LlamaConfig):
        super().__init__()
        self.top_k = cfg.moe_top_k
        self.router = nn.Linear(cfg.hidden, cfg.moe_experts, bias=False)
        self.experts = GroupedExperts(cfg)

    def forward(self, x):
        b, s, h = x.shape
        xf = x.reshape(-1, h)
        top, idx = torch.topk(self.router(xf), self.top_k, dim=-1)
        w = torch.softmax(top, dim=-1)
        order = torch.argsort(idx.reshape(-1), stable=True)
        counts = torch.bincount(idx.reshape(-1), minlength=self.experts.w1.shape[0])
        token = order // self.top_k
        y = self.experts(xf[token], counts) * w.reshape(-1)[order, None]
        return torch.zeros_like(xf).index_add(0, token, y).reshape(b, s, h)


class LlamaBlock(nn.Module):
    def __init__(self, cfg: LlamaConfig):
        super().__init__()
        self.attn_norm = RMSNorm(cfg.hidden, cfg.norm_eps)
        self.attn = LlamaAttention(cfg)
        self.mlp_norm = RMSNorm(cfg.hidden, cfg.norm_eps)
        if cfg.moe_experts:
            self.mlp = MoEBlock(cfg) if cfg.moe_style == "modulelist" else GroupedMoE(cfg)
        else:
            self.mlp = LlamaMLP(cfg)

    def forward(self, x, cos, sin):
        x = x + self.attn(self.attn_norm(x), cos, sin)
        out = self.mlp(self.mlp_norm(x))
        if isinstance(out, tuple):  # (y, load-balancing loss)
            return x + out[0], out[1]
        return x + out, None


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
        aux = []
        for layer in self.layers:
            x, a = layer(x, cos, sin)
            if a is not None:
                aux.append(a)
        logits = self.output(self.norm(x))
        if labels is None:
            return logits
        logits = logits.flatten(0, 1)
        if logits.dtype in (torch.float16, torch.bfloat16):
            logits = logits.float()  # the loss is computed in fp32
        loss = F.cross_entropy(logits, labels.flatten(), ignore_index=-100)
        if aux:
            loss = loss + self.cfg.moe_aux_coef * sum(aux)
        return loss


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
