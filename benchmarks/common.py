"""Shared by the benchmarks: interleaved step timing, gloo process launch, a medium MLP-stack model.

Machines are noisy (DESIGN.md §5), so two implementations are never timed in separate runs: their
training steps alternate within one run (A B, B A, A B, ...), each step timed on every rank between
a barrier and its end, and the slowest rank's time counts. The ratio is of the medians.
"""

from __future__ import annotations

import os
import statistics
import tempfile
import time
from typing import Callable

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F
from torch import nn


class Block(nn.Module):
    """A pre-norm residual MLP block: x + fc2(gelu(fc1(norm(x))))."""

    def __init__(self, dim: int, ffn: int):
        super().__init__()
        self.norm = nn.LayerNorm(dim)
        self.fc1 = nn.Linear(dim, ffn)
        self.fc2 = nn.Linear(ffn, dim)

    def forward(self, x):
        return x + self.fc2(F.gelu(self.fc1(self.norm(x))))


class MLPStack(nn.Module):
    """`num_layers` MLP blocks; forward(x, y) returns the mean squared error."""

    def __init__(self, dim: int, ffn: int, num_layers: int):
        super().__init__()
        self.blocks = nn.ModuleList(Block(dim, ffn) for _ in range(num_layers))

    def forward(self, x, y):
        for block in self.blocks:
            x = block(x)
        return F.mse_loss(x, y)


def train_step(model: nn.Module, opt: torch.optim.Optimizer, inputs: tuple) -> torch.Tensor:
    loss = model(*inputs)
    loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    return loss.detach()


def interleaved(steps: dict[str, Callable[[], object]], *, warmup: int, iters: int) -> dict[str, list[float]]:
    """Seconds per call of each step, alternating the order every round; slowest rank's time."""
    names = list(steps)
    for _ in range(warmup):
        for n in names:
            steps[n]()
    times: dict[str, list[float]] = {n: [] for n in names}
    multi = dist.is_initialized() and dist.get_world_size() > 1
    for i in range(iters):
        for n in names if i % 2 == 0 else reversed(names):
            if multi:
                dist.barrier()
            t0 = time.perf_counter()
            steps[n]()
            times[n].append(time.perf_counter() - t0)
    if multi:  # the step takes as long as its slowest rank
        for n in names:
            t = torch.tensor(times[n], dtype=torch.float64)
            dist.all_reduce(t, op=dist.ReduceOp.MAX)
            times[n] = t.tolist()
    return times


def report(label: str, times: dict[str, list[float]], a: str, b: str) -> float:
    ma, mb = statistics.median(times[a]), statistics.median(times[b])
    print(f"  {a}: median {ma * 1e3:.1f} ms/step   {b}: median {mb * 1e3:.1f} ms/step")
    print(f"RATIO {label} {a}/{b} = {ma / mb:.3f} (median of {len(times[a])} interleaved steps each)", flush=True)
    return ma / mb


def _entry(rank: int, world_size: int, init_file: str, fn: Callable, args: tuple) -> None:
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // world_size))
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world_size)
    try:
        fn(*args)
        dist.barrier()
    finally:
        dist.destroy_process_group()


def launch(fn: Callable, world_size: int, *args) -> None:
    """Run `fn(*args)` on `world_size` fresh gloo processes (a FileStore rendezvous, no ports)."""
    with tempfile.TemporaryDirectory() as d:
        mp.spawn(_entry, args=(world_size, os.path.join(d, "store"), fn, args), nprocs=world_size, join=True)
