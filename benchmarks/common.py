"""Shared by the benchmarks: interleaved step timing (`interleaved`, `Timings.ratio`, `result`), gloo process launch,
a medium MLP-stack model.

Machines are noisy (DESIGN.md §5), so two implementations are never timed in separate runs: their
training steps alternate within one run (A B, B A, A B, ...), each step timed on every rank between
a barrier and its end, and the slowest rank's time counts. Every process uses one thread.
"""

from __future__ import annotations

import os
import statistics
import tempfile
import time
from dataclasses import dataclass, field
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
    """What `interleaved` measured: one entry per round (one timed step of each name per round)."""

    wall_s: dict[str, list[float]]  # per round: wall-clock seconds on the slowest rank
    cpu_s: dict[str, list[float]]  # per round: CPU seconds of the busiest rank's process
    rank_wall_s: dict[str, list[list[float]]] = field(default_factory=dict)  # [rank][round]
    rank_cpu_s: dict[str, list[list[float]]] = field(default_factory=dict)  # [rank][round]

    @property
    def rounds(self) -> int:
        return len(next(iter(self.wall_s.values()), []))

    def ratio(self, a: str, b: str, what: str = "wall", blocks: int = 5) -> tuple[float, float, float]:
        """a/b of median step times (`what`: "wall" or "cpu"), with the spread: the lowest and highest ratio over
        `blocks` runs of consecutive rounds (each the ratio of its medians). Returns (ratio, lowest, highest)."""
        d = self.wall_s if what == "wall" else self.cpu_s
        n = len(d[a])
        k = max(1, n // blocks)
        per = [statistics.median(d[a][i:i + k]) / statistics.median(d[b][i:i + k]) for i in range(0, n - k + 1, k)]
        return statistics.median(d[a]) / statistics.median(d[b]), min(per), max(per)


def tune_gpt_2x2() -> tuple[nn.Module, tuple, object]:
    """The tune benchmarks' model, inputs and mesh (`tune.py`, `mirror.py`): a GPT of 2 layers, hidden 256, vocab
    4096, 8 x 64 tokens (seed 0) on a 2 x 2 mesh ("dp", "tp") of this process group: a model where plans differ."""
    from torch.distributed.device_mesh import init_device_mesh

    from autopar.models import GPT, GPTConfig

    cfg = GPTConfig(vocab_size=4096, seq_len=64, num_layers=2, num_heads=8, hidden=256)
    torch.manual_seed(0)
    model = GPT(cfg)
    tokens = torch.randint(0, cfg.vocab_size, (8, cfg.seq_len))
    return model, (tokens, tokens.roll(-1, dims=1)), init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))


def interleaved(steps: dict[str, Callable[[], object]], *, warmup: int, rounds: int | None = None,
                iters: int | None = None, budget_s: float = 25.0) -> Timings:
    """Time named training steps against each other, interleaved: the one timing loop every benchmark uses.

    `steps` maps a name to a callable running one step (forward, backward, optimizer). Each of `warmup` untimed
    rounds, then each timed round, runs every step once, the order reversed every other round (A B, B A, A B, ...),
    so drift on the machine hits all alike. Each step starts after a barrier (when a process group is up) and is
    timed on every rank in wall-clock time (`time.perf_counter`) and in this process's CPU time
    (`time.process_time`: what a busy, shared machine disturbs least). Stops after `rounds` timed rounds (`iters`
    is the older name), or earlier once `budget_s` seconds are spent (at least 5 rounds); every rank runs the same
    number. A step takes as long as its slowest rank: `Timings.wall_s` / `.cpu_s` hold, per round, the maximum
    over ranks; `.rank_wall_s` / `.rank_cpu_s` every rank's own times. `Timings.ratio` gives a ratio with its
    spread; `result` prints it as one `RESULT` line.
    """
    rounds = rounds if rounds is not None else iters
    if rounds is None:
        raise TypeError("interleaved needs rounds=")
    names = list(steps)
    for _ in range(warmup):
        for n in names:
            steps[n]()
    wall: dict[str, list[float]] = {n: [] for n in names}
    cpu: dict[str, list[float]] = {n: [] for n in names}
    multi = dist.is_initialized() and dist.get_world_size() > 1
    start = time.perf_counter()
    for i in range(rounds):
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
    per_rank = {}
    for key, d in (("wall", wall), ("cpu", cpu)):
        per_rank[key] = {}
        for n in names:
            t = torch.tensor(d[n], dtype=torch.float64)
            if multi:
                out = [torch.empty_like(t) for _ in range(dist.get_world_size())]
                dist.all_gather(out, t)
            else:
                out = [t]
            per_rank[key][n] = [o.tolist() for o in out]
            d[n] = torch.stack(out).amax(0).tolist()  # a step takes as long as its slowest rank
    return Timings(wall, cpu, per_rank["wall"], per_rank["cpu"])


def result(label: str, t: Timings, a: str, b: str, blocks: int = 5) -> float:
    """Print the headline as one line, `RESULT <label> <ratio> (...)`: a/b of the median wall-clock step times of
    the slowest rank, its spread over `blocks` runs of consecutive rounds, and the same for CPU time."""
    r, lo, hi = t.ratio(a, b, "wall", blocks)
    c, clo, chi = t.ratio(a, b, "cpu", blocks)
    print(f"RESULT {label} {r:.3f} (wall, blocks of rounds {lo:.3f}-{hi:.3f}; CPU time {c:.3f}, {clo:.3f}-{chi:.3f}; "
          f"{t.rounds} rounds)", flush=True)
    return r


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


def profile_steps(steps: dict[str, Callable[[], object]], n: int = 3, rows: int = 25) -> None:
    """rank 0 prints a torch.profiler table (self CPU time) of `n` steps of each named step, after 2 untimed."""
    from torch.profiler import ProfilerActivity, profile
    for name, step in steps.items():
        for _ in range(2):
            step()
        with profile(activities=[ProfilerActivity.CPU]) as p:
            for _ in range(n):
                step()
        if not dist.is_initialized() or dist.get_rank() == 0:
            print(f"--- profile {name} ({n} steps, rank 0)")
            print(p.key_averages().table(sort_by="self_cpu_time_total", row_limit=rows))


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


# ----------------------------------------------------------------------------- the torch.nn census's models

CENSUS_MODELS = ("nn_llama", "convnet", "lstm")


def census_model(name: str, batch: int = 8) -> tuple[nn.Module, tuple, Callable, str]:
    """One of the torch.nn census's models (`tests/nn_census.py`) at benchmark size, fp32, seed 0: (model, the global
    batch, the blocks FSDP2 wraps one by one, a description of the shape).

    * "nn_llama": issue #22's Llama from torch's own modules (nn.RMSNorm, F.scaled_dot_product_attention): 4 blocks,
      d 512, 8 heads, ffn 1536, vocab 4096, `batch` x 256 tokens;
    * "convnet": Conv2d + GroupNorm + ReLU stages of 64, 128, 256 channels, 32 x 32 images, 2 x `batch` images;
    * "lstm": an nn.LSTM language model: vocab 4096, d 512, 2 layers, `batch` x 128 tokens.
    """
    import sys
    here = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tests")
    if here not in sys.path:
        sys.path.insert(0, here)
    import nn_census

    torch.manual_seed(0)
    g = torch.Generator().manual_seed(1)
    if name == "nn_llama":
        model, inputs = nn_census.rmsnorm_llama(g, vocab=4096, dim=512, layers=4, heads=8, batch=batch, seq=256)
        return model, inputs, lambda m: m.layers, f"nn.RMSNorm Llama: 4 blocks, d 512, vocab 4096, {batch} x 256 tokens"
    if name == "convnet":
        model, inputs = nn_census.convnet(g, channels=(64, 128, 256), image=32, batch=2 * batch)
        return (model, inputs, lambda m: m.stages,
                f"Conv2d+GroupNorm ConvNet: channels 64/128/256, {2 * batch} images 32 x 32, 10 classes")
    if name == "lstm":
        model, inputs = nn_census.lstm_lm(g, vocab=4096, dim=512, layers=2, batch=batch, seq=128)
        return model, inputs, lambda m: [m.lstm], f"nn.LSTM LM: vocab 4096, d 512, 2 layers, {batch} x 128 tokens"
    raise ValueError(f"census model {name!r}: expected one of {CENSUS_MODELS}")
