"""Shared by the benchmarks: interleaved step timing, gloo process launch, a medium MLP-stack model.

Machines are noisy (DESIGN.md §5), so two implementations are never timed in separate runs: their
training steps alternate within one run (A B, B A, A B, ...), each step timed on every rank between
a barrier and its end, and the slowest rank's time counts. Every process uses one thread.
"""

from __future__ import annotations

import os
import statistics
import tempfile
import time
from dataclasses import dataclass
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


@dataclass
class Timings:
    wall_s: dict[str, list[float]]  # per step: wall-clock seconds on the slowest rank
    cpu_s: dict[str, list[float]]  # per step: CPU seconds of the busiest rank's process


def interleaved(steps: dict[str, Callable[[], object]], *, warmup: int, iters: int,
                budget_s: float = 25.0) -> Timings:
    """Time each step, alternating the order every round (A B, B A, ...).

    Stops after `iters` rounds, or earlier once `budget_s` seconds are spent (at least 5 rounds).
    """
    names = list(steps)
    for _ in range(warmup):
        for n in names:
            steps[n]()
    wall: dict[str, list[float]] = {n: [] for n in names}
    cpu: dict[str, list[float]] = {n: [] for n in names}
    multi = dist.is_initialized() and dist.get_world_size() > 1
    start = time.perf_counter()
    for i in range(iters):
        for n in names if i % 2 == 0 else reversed(names):
            if multi:
                dist.barrier()
            t0, c0 = time.perf_counter(), time.process_time()
            steps[n]()
            wall[n].append(time.perf_counter() - t0)
            cpu[n].append(time.process_time() - c0)
        stop = torch.tensor([float(i >= 4 and time.perf_counter() - start > budget_s)])
        if multi:  # every rank must run the same number of rounds
            dist.all_reduce(stop, op=dist.ReduceOp.MAX)
        if stop.item():
            break
    if multi:  # a step takes as long as its slowest rank
        for d in (wall, cpu):
            for n in names:
                t = torch.tensor(d[n], dtype=torch.float64)
                dist.all_reduce(t, op=dist.ReduceOp.MAX)
                d[n] = t.tolist()
    return Timings(wall, cpu)


def report(label: str, t: Timings, a: str, b: str) -> float:
    """Print `RATIO label a/b = ...`, the ratio of the median wall-clock step times, and two
    cross-checks that a busy machine disturbs less: the median of the ratios of steps run back to
    back, and the ratio of median CPU times (time this process ran, not time it waited for a core)."""
    med = {n: statistics.median(v) for n, v in t.wall_s.items()}
    paired = statistics.median(x / y for x, y in zip(t.wall_s[a], t.wall_s[b]))
    cpu = statistics.median(t.cpu_s[a]) / statistics.median(t.cpu_s[b])
    print(f"  {a}: median {med[a] * 1e3:.1f} ms/step   {b}: median {med[b] * 1e3:.1f} ms/step")
    print(f"RATIO {label} {a}/{b} = {med[a] / med[b]:.3f} (median wall time of {len(t.wall_s[a])} interleaved "
          f"steps each; paired steps {paired:.3f}; CPU time {cpu:.3f})", flush=True)
    return med[a] / med[b]


def _entry(rank: int, world_size: int, init_file: str, fn: Callable, args: tuple) -> None:
    torch.set_num_threads(1)  # one core per rank: steadier timings on a small (often shared) CPU
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
