"""autopar's own overhead: `parallelize` on a 1-rank mesh against the eager single-device model.

On one rank nothing is communicated, so any difference in step time (forward + backward + AdamW
step) is autopar's: the rewritten graph, DTensor parameters, input handling. Steps of the two
alternate in one run; the ratio parallelize/eager of the median step times is printed (goal <= 1.05).

`--check-inputs`: the per-call agreement that every rank passed the same batch (inputs="global", on by default:
a digest of the inputs in the call's all-reduce, left in flight) costs nothing on one rank, where it is skipped.
This mode measures it where it runs: 2 gloo ranks, the GPT and a Llama under "dp" and "megatron", one
ParallelModule whose steps alternate with `pm.check_inputs` on and off in one run; the ratio on/off of the median
step times is printed (goal <= 1.01).

    python benchmarks/overhead.py [--quick] [--check-inputs]
"""

from __future__ import annotations

import copy
import os
import statistics
import sys
import tempfile
import time

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

import autopar
from autopar.models import GPT, GPTConfig, Llama, LlamaConfig
from common import MLPStack, interleaved, launch, report, train_step

BATCH = 4  # sequences per step in the transformer benchmark


def _compare(name: str, desc: str, model, inputs, *, warmup: int, iters: int) -> None:
    mesh = init_device_mesh("cpu", (1,), mesh_dim_names=("dp",))
    pm = autopar.parallelize(copy.deepcopy(model), mesh, inputs, plan="auto")
    eager = copy.deepcopy(model)
    with torch.no_grad():
        a, b = pm(*inputs).item(), eager(*inputs).item()
    print(f"{name} ({desc}): loss parallelize {a:.6f}  eager {b:.6f}")
    assert abs(a - b) <= 1e-5 * max(1.0, abs(b)), (a, b)
    opt_a = torch.optim.AdamW(pm.parameters(), lr=1e-4)
    opt_b = torch.optim.AdamW(eager.parameters(), lr=1e-4)
    times = interleaved({"parallelize": lambda: train_step(pm, opt_a, inputs),
                         "eager": lambda: train_step(eager, opt_b, inputs)}, warmup=warmup, iters=iters)
    report(f"overhead[{name}]", times, "parallelize", "eager")


def run(quick: bool) -> None:
    dim, ffn, num_layers, tokens = 512, 2048, 4, 512
    torch.manual_seed(0)
    model = MLPStack(dim, ffn, num_layers)
    inputs = (torch.randn(4, tokens // 4, dim), torch.randn(4, tokens // 4, dim))
    _compare("mlp_stack", f"dim={dim} ffn={ffn} layers={num_layers} tokens={tokens}", model, inputs,
             warmup=3, iters=6 if quick else 100)

    cfg = GPTConfig(vocab_size=2048, seq_len=128, num_layers=4, num_heads=8, hidden=512, dropout=0.0)
    torch.manual_seed(0)
    model = GPT(cfg)
    tokens = torch.randint(0, cfg.vocab_size, (BATCH, cfg.seq_len))
    _compare("gpt", f"hidden={cfg.hidden} layers={cfg.num_layers} heads={cfg.num_heads} seq={cfg.seq_len} batch={BATCH}",
             model, (tokens, torch.roll(tokens, -1, dims=1)), warmup=3, iters=6 if quick else 100)


def _check_inputs_cost(quick: bool) -> None:
    """On every rank of 2: per model and plan, steps with the per-call input check on and off, interleaved."""
    gpt = GPTConfig(vocab_size=2048, seq_len=128, num_layers=4, num_heads=8, hidden=512, dropout=0.0)
    llama = LlamaConfig(vocab_size=2048, seq_len=128, num_layers=4, num_heads=8, num_kv_heads=4, hidden=512,
                        ffn_hidden=1408)
    for name, make, cfg in (("gpt", GPT, gpt), ("llama", Llama, llama)):
        for plan in ("dp", "megatron"):
            torch.manual_seed(0)
            model = make(cfg)
            tokens = torch.randint(0, cfg.vocab_size, (BATCH, cfg.seq_len))
            inputs = (tokens, torch.roll(tokens, -1, dims=1))
            mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("dp" if plan == "dp" else "tp",))
            pm = autopar.parallelize(model, mesh, inputs, plan=plan)
            opt = torch.optim.AdamW(pm.parameters(), lr=1e-4)

            def step(on: bool):
                pm.check_inputs = on
                return train_step(pm, opt, inputs)

            times = interleaved({"check on": lambda: step(True), "check off": lambda: step(False)},
                                warmup=3, iters=6 if quick else 60, budget_s=25 if quick else 120)
            issue_s, settle_s = _check_alone(pm, inputs, 20 if quick else 200)
            if dist.get_rank() == 0:
                report(f"check_inputs[{name} {plan} 2 ranks]", times, "check on", "check off")
                off = statistics.median(times.wall_s["check off"])
                print(f"  the check alone: {issue_s * 1e6:.0f} us per call to digest the batch and issue the "
                      f"all-reduce ({issue_s / off:.2%} of the check-off step), {settle_s * 1e6:.0f} us more to wait "
                      "for it when nothing overlaps it", flush=True)


def _check_alone(pm, inputs, n: int) -> tuple[float, float]:
    """Seconds per call of the per-call check on its own: digesting and issuing (what a step pays; the all-reduce's
    latency overlaps the program up to its first collective), and waiting for the all-reduce right away."""
    cap = pm._current.captured
    key = pm._key(inputs, {})
    flat = list(inputs)
    issue = settle = 0.0
    for _ in range(n):
        dist.barrier()
        t0 = time.perf_counter()
        done = pm._check_inputs(key, cap, flat, wait=False)
        t1 = time.perf_counter()
        done()
        issue, settle = issue + t1 - t0, settle + time.perf_counter() - t1
    return issue / n, settle / n


def main() -> None:
    if "--check-inputs" in sys.argv:
        launch(_check_inputs_cost, 2, "--quick" in sys.argv)
        return
    torch.set_num_threads(1)  # as each rank in tp_vs_parallelize_module.py: steadier timings
    with tempfile.TemporaryDirectory() as d:
        dist.init_process_group("gloo", init_method=f"file://{os.path.join(d, 'store')}", rank=0, world_size=1)
        try:
            run("--quick" in sys.argv)
        finally:
            dist.destroy_process_group()


if __name__ == "__main__":
    main()
