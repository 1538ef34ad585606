"""Tensor-parallel backward overlap (Megatron-LM's async communication), on 2 gloo ranks.

The issue's model (Llama-style, 4 layers, hidden 512, 8 x 256 tokens, AdamW), parallelised with `plan="megatron"`
and with `plan="megatron"` + sequence parallelism (`{"norm": "sequence"}`): each with the overlapped backward (the
column-parallel linears' input-gradient all-reduce, or reduce-scatter under SP, issued before their weight gradients
are computed) and with the old sequential backward (`autopar.runtime.collectives.OVERLAP[0] = False`: the same
collectives and numbers, each waited for before the weight gradients); and torch's own
`parallelize_module` ColwiseParallel/RowwiseParallel plan (`tp_vs_parallelize_module.llama_hand_plan`). Training steps
of all five alternate in one run (interleaved rounds, the slowest rank counting), after a check that each gives the
single-device loss. Printed: RATIO lines (median wall time, paired steps, CPU time) and the median and spread
(min-max) of the per-round ratios; then the time each variant's backward spends blocked waiting for collectives
(what the overlap hides, measured directly).

    python benchmarks/tp_overlap.py [--quick]
"""

from __future__ import annotations

import copy
import sys
import time

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor.parallel import loss_parallel, parallelize_module

import autopar
from autopar.models import Llama, LlamaConfig
from autopar.runtime import collectives
from common import interleaved, launch, report, result, train_step
from tp_vs_parallelize_module import llama_hand_plan, local_heads

WORLD_SIZE = 2
BATCH = 8  # sequences per step (every tensor-parallel rank runs the whole batch)


def _sequential(step):
    """`step` with the tensor-parallel collectives waited for before the weight gradients (the old backward)."""
    def run():
        collectives.OVERLAP[0] = False
        try:
            return step()
        finally:
            collectives.OVERLAP[0] = True
    return run


def _blocked_in_backward_waits(steps: dict, names: tuple, n: int) -> dict:
    """Seconds per step this rank spends blocked in waits for collectives inside the backward (where the tensor-
    parallel input-gradient reductions are waited for), over `n` more steps of each of `names`: what the overlap
    hides, measured directly (wall-clock step ratios on 2 shared cores are noisier than the gain)."""
    wait, spent = collectives._wait, {name: 0.0 for name in names}
    current = [None]

    def timed(t):
        if current[0] is None or torch._C._current_graph_task_id() == -1:  # forward: not counted
            return wait(t)
        t0 = time.perf_counter()
        out = wait(t)
        spent[current[0]] += time.perf_counter() - t0
        return out

    collectives._wait = timed
    try:
        for _ in range(n):
            for name in names:
                current[0] = name
                dist.barrier()
                steps[name]()
        current[0] = None
    finally:
        collectives._wait = wait
    out = {}
    for name in names:  # the slowest rank
        t = torch.tensor([spent[name] / n])
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        out[name] = t.item()
    return out


def run(quick: bool) -> None:
    rank = dist.get_rank()
    cfg = LlamaConfig(vocab_size=2048, seq_len=256, num_layers=4, num_heads=8, num_kv_heads=4, hidden=512,
                      ffn_hidden=1536)
    torch.manual_seed(0)  # same model and data on every rank
    model = Llama(cfg)
    tokens = torch.randint(0, cfg.vocab_size, (BATCH, cfg.seq_len))
    inputs = (tokens, torch.roll(tokens, -1, dims=1))
    mesh = init_device_mesh("cpu", (WORLD_SIZE,), mesh_dim_names=("tp",))
    models = {
        "tp": autopar.parallelize(copy.deepcopy(model), mesh, inputs, plan="megatron"),
        "tp_seq": autopar.parallelize(copy.deepcopy(model), mesh, inputs, plan="megatron"),
        "sp": autopar.parallelize(copy.deepcopy(model), mesh, inputs, plan="megatron", overrides={"norm": "sequence"}),
        "sp_seq": autopar.parallelize(copy.deepcopy(model), mesh, inputs, plan="megatron",
                                      overrides={"norm": "sequence"}),
    }
    hand = parallelize_module(copy.deepcopy(model), mesh, llama_hand_plan(cfg))
    local_heads(hand)
    with torch.no_grad():
        ref = model(*inputs).item()
        got = {k: pm(*inputs).item() for k, pm in models.items()}
        with loss_parallel():
            got["torch"] = hand(*inputs).item()
    if rank == 0:
        print(f"llama (hidden={cfg.hidden} layers={cfg.num_layers} seq={cfg.seq_len} batch={BATCH}): loss "
              f"single-device {ref:.6f}  " + "  ".join(f"{k} {v:.6f}" for k, v in got.items()))
    assert all(abs(v - ref) <= 1e-4 * max(1.0, abs(ref)) for v in got.values()), (ref, got)
    losses, steps = {}, {}
    for k, pm in models.items():
        opt = torch.optim.AdamW(pm.parameters(), lr=1e-4)
        step = (lambda k=k, pm=pm, opt=opt: losses.__setitem__(k, train_step(pm, opt, inputs)))
        steps[k] = _sequential(step) if k.endswith("_seq") else step
    opt_h = torch.optim.AdamW(hand.parameters(), lr=1e-4)

    def hand_step():
        with loss_parallel():  # it must cover the forward and the backward
            losses["torch"] = train_step(hand, opt_h, inputs)

    steps["torch"] = hand_step
    warmup = 2 if quick else 3
    times = interleaved(steps, warmup=warmup, rounds=10 if quick else 100, budget_s=30.0 if quick else 300.0)
    if rank == 0:
        print(f"  after {warmup + len(times.wall_s['tp'])} training steps: "
              + "  ".join(f"loss {k} {v.item():.6f}" for k, v in losses.items()))
        for a, b in (("tp", "tp_seq"), ("sp", "sp_seq"), ("tp", "torch"), ("tp_seq", "torch"), ("sp", "torch")):
            report(f"tp_overlap[{a}/{b}]", times, a, b)
            result(f"tp_overlap {a}/{b}", times, a, b)
    first = losses["tp"].item()
    assert all(abs(v.item() - first) <= 1e-3 * max(1.0, abs(first)) for v in losses.values()), losses
    blocked = _blocked_in_backward_waits(steps, ("tp", "tp_seq", "sp", "sp_seq"), 3 if quick else 6)
    if rank == 0:
        print("  blocked in backward collective waits per step (slowest rank): "
              + "  ".join(f"{k} {v * 1e3:.1f} ms" for k, v in blocked.items()), flush=True)


def main() -> None:
    launch(run, WORLD_SIZE, "--quick" in sys.argv)


if __name__ == "__main__":
    main()
