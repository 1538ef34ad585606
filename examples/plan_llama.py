"""Factories for `python -m autopar plan --model examples.plan_llama:FACTORY`: a Llama on the meta device
(nothing allocated), returned as `(model, example_inputs)` with token ids and labels of (batch, seq).

    python -m autopar plan --model examples.plan_llama:llama_7b --mesh dp=8,tp=8 --cluster h100 --seq 4096
"""

import torch

from autopar.models import Llama, LlamaConfig


def llama(batch: int = 8, seq: int = 2048, *, layers: int = 32, hidden: int = 4096, heads: int = 32,
          kv_heads: int = 8, ffn: int = 11008, vocab: int = 32000, dtype=torch.bfloat16):
    cfg = LlamaConfig(vocab_size=vocab, seq_len=seq, num_layers=layers, num_heads=heads, num_kv_heads=kv_heads,
                      hidden=hidden, ffn_hidden=ffn)
    with torch.device("meta"):
        model = Llama(cfg).to(dtype)
        ids = torch.zeros(batch, seq, dtype=torch.long)
    return model, (ids, ids)


def llama_7b(batch: int = 8, seq: int = 4096):
    """Llama-2 7B's shapes (6.7 B parameters)."""
    return llama(batch, seq, kv_heads=32)


def tiny(batch: int = 8, seq: int = 64):
    """Two small layers: what the tests plan."""
    return llama(batch, seq, layers=2, hidden=64, heads=4, kv_heads=2, ffn=128, vocab=256, dtype=torch.float32)
