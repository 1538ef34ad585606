"""Memory per device as the data degree grows at a fixed per-rank batch (issue #24 item 5): a 2-layer Llama (bf16, on
meta, one 512-token sequence per rank) on {"dp": d, "tp": 2}, d from 8 to 4096, planned offline.

- zero1 (state sharded over every axis, parameters whole): memory per device never grows;
- `auto` under the memory limit that the fsdp plan needs at d = 8 finds a plan that fits at every d (what the 405B
  sweep at dp2048 once failed); it is not asked to be monotone: under a limit it spends memory for time;
- fsdp: memory never grows at any d: a parameter whose dims do not divide over the ranks (hidden 1024 over 2048 ranks
  and more) is sharded unevenly, as FSDP2 shards it, ceil(dim 0 / ranks) rows per rank (`autopar.forms.fsdp.shard_dim`),
  not left whole."""

from __future__ import annotations

import torch

import autopar
from autopar.models import Llama, LlamaConfig

CFG = dict(vocab_size=32768, seq_len=512, num_layers=2, num_heads=16, num_kv_heads=4, hidden=1024, ffn_hidden=4096,
           attention="sdpa")
DEGREES = (8, 64, 512, 4096)


def _plan(d: int, plan: str, limit=None):
    with torch.device("meta"):
        model = Llama(LlamaConfig(**CFG)).to(torch.bfloat16)
        ids = torch.zeros(2 * d, CFG["seq_len"], dtype=torch.long)  # one sequence per rank of dp x tp
    return autopar.plan(model, {"dp": d, "tp": 2}, (ids, ids), cluster="h100", plan=plan, memory_limit=limit)


def _non_increasing(mem: dict[int, int]) -> bool:
    vals = [mem[d] for d in sorted(mem)]
    return all(b <= a for a, b in zip(vals, vals[1:]))


def test_zero1_memory_does_not_grow_with_dp():
    mem = {d: _plan(d, "zero1").estimate.memory_bytes_per_device for d in DEGREES}
    assert _non_increasing(mem), mem


def test_auto_fits_the_dp8_budget_at_every_dp():
    limit = _plan(8, "fsdp").estimate.memory_bytes_per_device * 1.003
    for d in DEGREES:
        est = _plan(d, "auto", limit).estimate
        assert est.fits and est.memory_bytes_per_device <= limit, (d, est.memory_bytes_per_device, limit)


def test_fsdp_memory_does_not_grow_with_dp():
    plans = {d: _plan(d, "fsdp") for d in DEGREES}
    mem = {d: p.estimate.memory_bytes_per_device for d, p in plans.items()}
    assert _non_increasing(mem) and mem[4096] < mem[8], mem
    # 8192 ranks: hidden 1024 divides over none, so the norms are sharded unevenly (1 row on the first 1024 ranks)
    notes = plans[4096].notes
    assert any("norm.weight (1024,) is FSDP-sharded unevenly on dim 0 over 8192 ranks: at most 1" in n
               for n in notes), notes
    assert not any("not FSDP-sharded" in n for n in notes), notes
