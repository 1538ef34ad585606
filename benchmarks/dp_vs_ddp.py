"""autopar's "dp" plan against torch's DistributedDataParallel, on 2 gloo ranks.

The same model (a Llama-style one, then a GPT: 4 layers, hidden 512, 8 x 256 tokens global, AdamW; then the torch.nn
census's three models of issue #22, `common.census_model`: the nn.RMSNorm Llama (4 blocks, d 512, vocab 4096, 8 x 256
tokens), the Conv2d + GroupNorm ConvNet (16 images 32 x 32) and the nn.LSTM language model (8 x 128 tokens)), parallelised twice: by
`autopar.parallelize(..., plan="dp", inputs="local")` and by `DistributedDataParallel`, each rank passing its
shard of the global batch. Training steps alternate between the two in one run; the ratio autopar/DDP of
the median step times is printed (goal <= 1.0), after a check that both give the same loss. `--global` adds
autopar with `inputs="global"` (every rank passes the whole batch, autopar slices it); `--one-bucket` adds
autopar with every gradient in one bucket (the lowering before DDP-sized buckets: one all-reduce after the whole
backward); `--profile` prints a torch.profiler table of a few steps of autopar and DDP on rank 0; `--foreach` gives
both AdamW(foreach=True) (one dispatch per op over all parameters: autopar's parameters are DTensors, whose per-op
dispatch the default single-tensor AdamW on CPU pays once per parameter and op, DDP's plain tensors do not);
`--slow-scalars` adds autopar with DTensor's pointwise ops on Python numbers dispatched as torch does
(`autopar.runtime.scalar_ops.fast_path(False)`: the figure before that fast path, in the same run);
`--dtensor-step` adds autopar with the optimizer stepping the DTensor parameters themselves
(`autopar.runtime.local_step.enabled(False)`: the figure before the step ran on the local tensors).
Each comparison ends with one headline line, `RESULT dp/DDP <model> <ratio> (...)`: the ratio of the slowest
rank's median wall-clock step times, its spread over 5 blocks of consecutive rounds, and the same in CPU time;
then the step's phases (forward, backward, optimizer step) timed apart on rank 0, where they differ.

    python benchmarks/dp_vs_ddp.py [--quick] [--global] [--one-bucket] [--profile] [--foreach] [--slow-scalars]
                                   [--dtensor-step] [--only llama|gpt|nn_llama|convnet|lstm|census]
"""

from __future__ import annotations

import copy
import statistics
import sys
import time

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.nn.parallel import DistributedDataParallel

import autopar
from autopar.runtime import collectives, local_step, scalar_ops
from autopar.models import GPT, GPTConfig, Llama, LlamaConfig
from common import CENSUS_MODELS, census_model, interleaved, launch, profile_steps, report, result, train_step

WORLD_SIZE = 2
BATCH = 8  # sequences per step, global


def run(quick: bool, with_global: bool, one_bucket: bool, profile: bool, only: str | None, foreach: bool,
        slow_scalars: bool, dtensor_step: bool) -> None:
    variants = (with_global, one_bucket, profile, foreach, slow_scalars, dtensor_step)
    cfg = LlamaConfig(vocab_size=2048, seq_len=256, num_layers=4, num_heads=8, num_kv_heads=4, hidden=512,
                      ffn_hidden=1536)
    torch.manual_seed(0)  # same model and data on every rank
    if only in (None, "llama"):
        _compare("llama", Llama(cfg), _tokens(cfg), _shape(cfg), quick, *variants)
    cfg = GPTConfig(vocab_size=2048, seq_len=256, num_layers=4, num_heads=8, hidden=512, dropout=0.0)
    torch.manual_seed(0)
    if only in (None, "gpt"):
        _compare("gpt", GPT(cfg), _tokens(cfg), _shape(cfg), quick, *variants)
    for name in CENSUS_MODELS:  # the torch.nn census's models (issue #22): same model and data on every rank
        if only in (None, "census", name):
            model, batch, _, shape = census_model(name, BATCH)
            _compare(name, model, batch, shape, quick, *variants)


def _tokens(cfg) -> tuple:
    tokens = torch.randint(0, cfg.vocab_size, (BATCH, cfg.seq_len))
    return tokens, torch.roll(tokens, -1, dims=1)


def _shape(cfg) -> str:
    return f"hidden={cfg.hidden} layers={cfg.num_layers} seq={cfg.seq_len} batch={BATCH} global"


def _compare(name: str, model, batch: tuple, shape: str, quick: bool, with_global: bool, one_bucket: bool,
             profile: bool, foreach: bool, slow_scalars: bool, dtensor_step: bool) -> None:
    rank = dist.get_rank()
    local = tuple(t.chunk(WORLD_SIZE)[rank] for t in batch)
    mesh = init_device_mesh("cpu", (WORLD_SIZE,), mesh_dim_names=("dp",))
    pm = autopar.parallelize(copy.deepcopy(model), mesh, local, plan="dp", inputs="local")
    ddp = DistributedDataParallel(copy.deepcopy(model))
    with torch.no_grad():
        ref = model(*batch).item()
        a = pm(*local)
        b = ddp(*local)
        dist.all_reduce(b)  # DDP's loss is the local shard's: average over ranks for the global loss
        b = b.item() / WORLD_SIZE
        a = a.item()
    if rank == 0:
        print(f"{name} ({shape}): loss single-device {ref:.6f}  autopar {a:.6f}  DDP {b:.6f}")
    assert abs(a - ref) <= 1e-4 * max(1.0, abs(ref)) and abs(b - ref) <= 1e-4 * max(1.0, abs(ref)), (ref, a, b)
    steps, losses = {}, {}

    def adamw(params, lr):
        return torch.optim.AdamW(params, lr=lr, foreach=foreach or None)

    opt_a = adamw(pm.parameters(), lr=1e-4)
    phases: dict[str, list[tuple[float, float, float]]] = {"autopar": [], "DDP": []}

    def phased_step(model, opt, name):
        """One training step, its forward, backward and optimizer step timed apart (this rank's wall clock)."""
        t0 = time.perf_counter()
        loss = model(*local)
        t1 = time.perf_counter()
        loss.backward()
        t2 = time.perf_counter()
        opt.step()
        opt.zero_grad(set_to_none=True)
        phases[name].append((t1 - t0, t2 - t1, time.perf_counter() - t2))
        return loss.detach()

    steps["autopar"] = lambda: losses.__setitem__("autopar", phased_step(pm, opt_a, "autopar"))
    opt_b = adamw(ddp.parameters(), lr=1e-4)

    def ddp_step():
        loss = phased_step(ddp, opt_b, "DDP")
        dist.all_reduce(loss)
        losses["DDP"] = loss / WORLD_SIZE

    steps["DDP"] = ddp_step
    if with_global:
        pg = autopar.parallelize(copy.deepcopy(model), mesh, batch, plan="dp")
        opt_g = adamw(pg.parameters(), lr=1e-4)
        steps["autopar_global"] = lambda: losses.__setitem__("autopar_global", train_step(pg, opt_g, batch))
    if one_bucket:
        sizes = collectives.GRAD_BUCKET_BYTES, collectives.FIRST_GRAD_BUCKET_BYTES
        collectives.GRAD_BUCKET_BYTES = collectives.FIRST_GRAD_BUCKET_BYTES = 2**62
        try:
            p1 = autopar.parallelize(copy.deepcopy(model), mesh, local, plan="dp", inputs="local")
            with torch.no_grad():
                p1(*local)  # lowered for these inputs now, with one bucket
        finally:
            collectives.GRAD_BUCKET_BYTES, collectives.FIRST_GRAD_BUCKET_BYTES = sizes
        opt_1 = adamw(p1.parameters(), lr=1e-4)
        steps["autopar_one_bucket"] = lambda: losses.__setitem__("autopar_one_bucket", train_step(p1, opt_1, local))
    def variant(key: str, context) -> None:
        """autopar once more, each of its steps under `context()`."""
        pv = autopar.parallelize(copy.deepcopy(model), mesh, local, plan="dp", inputs="local")
        opt_v = adamw(pv.parameters(), lr=1e-4)

        def step():
            with context():
                losses[key] = train_step(pv, opt_v, local)

        steps[key] = step

    if slow_scalars:
        variant("autopar_slow_scalars", lambda: scalar_ops.fast_path(False))
    if dtensor_step:
        variant("autopar_dtensor_step", lambda: local_step.enabled(False))
    if profile:
        profile_steps({"autopar": lambda: train_step(pm, opt_a, local), "DDP": lambda: train_step(ddp, opt_b, local)})
    times = interleaved(steps, warmup=3, rounds=10 if quick else 100, budget_s=40.0 if quick else 120.0)
    if rank == 0:
        n = 3 + len(times.wall_s["autopar"])
        print(f"  after {n} training steps: " + "  ".join(f"loss {k} {v.item():.6f}" for k, v in losses.items()))
        label = f"{name}, AdamW foreach" if foreach else name
        for what, a in (("", "autopar"), (", one bucket", "autopar_one_bucket"), (", inputs=global", "autopar_global"),
                        (", slow scalars", "autopar_slow_scalars"), (", DTensor step", "autopar_dtensor_step")):
            if a in times.wall_s:
                report(f"dp_vs_ddp[{label}{what}]", times, a, "DDP")
                result(f"dp/DDP {label}{what}", times, a, "DDP")
        warm = 3  # the untimed rounds' steps come first
        med = {k: [statistics.median(t[i] for t in v[warm:]) for i in range(3)] for k, v in phases.items()}
        print(f"  phases on rank 0, median ms autopar / DDP: " + "  ".join(
            f"{ph} {1e3 * a:.1f} / {1e3 * d:.1f} = {a / d:.3f}"
            for ph, a, d in zip(("forward", "backward", "optimizer step"), med["autopar"], med["DDP"])))
    assert abs(losses["autopar"].item() - losses["DDP"].item()) <= 1e-3 * max(1.0, abs(losses["DDP"].item())), losses


def main() -> None:
    launch(run, WORLD_SIZE, "--quick" in sys.argv, "--global" in sys.argv, "--one-bucket" in sys.argv,
           "--profile" in sys.argv, sys.argv[sys.argv.index("--only") + 1] if "--only" in sys.argv else None,
           "--foreach" in sys.argv, "--slow-scalars" in sys.argv, "--dtensor-step" in sys.argv)


if __name__ == "__main__":
    main()
