"""Memory per device as the data degree grows at a fixed per-rank batch (issue #24 item 5): a 2-layer Llama (bf16, on
meta, one 512-token sequence per rank) on {"dp": d, "tp": 2}, d from 8 to 4096, planned offline.

- zero1 (state sharded over every axis, parameters whole): memory per device never grows;
- `auto` under the memory limit that the fsdp plan needs at d = 8 finds a plan that fits at every d (what the 405B
  sweep at dp2048 once failed); it is not asked to be monotone: under a limit it spends memory for time;
- fsdp: memory never grows while every parameter's dim divides over the ranks (d <= 512 here, 1024 ranks); past
  that the parameters with no dividing dim stay whole, and the plan says which. Not yet: uneven (padded) FSDP shards,
  as FSDP2 makes them, which would keep fsdp's memory falling at any d."""

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


def test_fsdp_memory_shrinks_while_dims_divide():
    mem = {d: _plan(d, "fsdp").estimate.memory_bytes_per_device for d in (8, 64, 512)}
    assert _non_increasing(mem) and mem[512] < mem[8], mem
    notes = _plan(1024, "fsdp").notes  # 2048 ranks: hidden 1024 divides over none
    assert any("norm.weight (1024,) is not FSDP-sharded" in n and "2048 ranks" in n for n in notes), notes
