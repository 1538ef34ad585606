"""Long context in the cost model: at 128k tokens a sequence form (Ulysses or ring attention) beats
every tensor/data-parallel plan, and the ILP picks it.

A 1B-class Llama (16 layers, hidden 2048, 16 heads, 8 KV heads, SDPA) on 64 H100s ({"dp": 8, "tp": 8}),
one sequence of 131072 tokens per step. Prints each plan's estimated step time and memory per device,
and the ratio auto / best hand plan (goal <= 1.0; the hand plans do not even fit in 80 GB).

    python benchmarks/long_context.py
"""

from __future__ import annotations

import time

import torch

import autopar
from autopar.models import Llama, LlamaConfig


def main() -> None:
    seq = 131072
    cfg = LlamaConfig(vocab_size=32000, seq_len=seq, num_layers=16, num_heads=16, num_kv_heads=8, hidden=2048,
                      ffn_hidden=5632, attention="sdpa")
    with torch.device("meta"):
        model = Llama(cfg).to(torch.bfloat16)
        ids = torch.zeros(1, seq, dtype=torch.long)
    mesh = {"dp": 8, "tp": 8}
    results = {}
    for plan in ("auto", "megatron", "dp", "fsdp"):
        t0 = time.perf_counter()
        p = autopar.plan(model, mesh, (ids, ids), plan=plan, cluster="h100")
        e = p.estimate
        forms = sorted({f"{s.kind}:{s.label}" for s in p.strategies if s.form != "replicate"})
        results[plan] = e
        print(f"{plan:9s} {e.step_time_s * 1e3:9.1f} ms/step  {e.memory_bytes_per_device / 2**30:7.1f} GiB/device  "
              f"fits={e.fits!s:5s}  planned in {time.perf_counter() - t0:.1f} s  {', '.join(forms) or 'replicated'}")
    best_hand = min(results[h].step_time_s for h in ("megatron", "dp", "fsdp"))
    print(f"RATIO long_context_128k auto/best_hand = {results['auto'].step_time_s / best_hand:.3f} (goal <= 1.0); "
          f"hand plans fitting in 80 GB: {sum(results[h].fits for h in ('megatron', 'dp', 'fsdp'))} of 3")


if __name__ == "__main__":
    main()
