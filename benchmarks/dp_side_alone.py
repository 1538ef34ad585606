"""One side of `dp_vs_ddp.py --only convnet` alone, with each thread's CPU time (issue #22 item 5).

Two gloo ranks run only autopar's "dp" steps or only DDP's (the same census ConvNet, data, AdamW and step as
`dp_vs_ddp.py`: a barrier, forward, backward, step, zero_grad; DDP's loss all-reduced as there). After a warm-up, rank 0
reads every thread's run time (`/proc/self/task/*/schedstat`, ns) before and after the timed steps and prints it per
thread (named by /proc's comm, gloo's workers among them), with the process CPU and wall per step. Built to be run
under `py-spy record --subprocesses --native --threads --idle` for a whole-process sampling profile of one side.

    python benchmarks/dp_side_alone.py autopar|ddp [--steps N] [--model convnet|lstm|nn_llama]
"""

from __future__ import annotations

import copy
import os
import statistics
import sys
import time

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.nn.parallel import DistributedDataParallel

import autopar
from common import census_model, launch


def thread_ns() -> dict[str, int]:
    """Run time in ns of each of this process's threads, keyed "comm/tid"."""
    out = {}
    for tid in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{tid}/comm") as f:
                comm = f.read().strip()
            with open(f"/proc/self/task/{tid}/schedstat") as f:
                out[f"{comm}/{tid}"] = int(f.read().split()[0])
        except OSError:
            pass
    return out


def faults() -> tuple[int, int, float, float]:
    """This process's (minor, major) page faults and its user, system CPU seconds (/proc/self/stat)."""
    with open("/proc/self/stat") as f:
        v = f.read().rsplit(")", 1)[1].split()
    tick = os.sysconf("SC_CLK_TCK")
    return int(v[7]), int(v[9]), int(v[11]) / tick, int(v[12]) / tick


def body(side: str, steps: int, name: str) -> None:
    rank = dist.get_rank()
    model, batch, _, _ = census_model(name, 8)
    local = tuple(t.chunk(2)[rank] for t in batch)
    if side == "autopar":
        mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("dp",))
        m = autopar.parallelize(copy.deepcopy(model), mesh, local, plan="dp", inputs="local")
    else:
        m = DistributedDataParallel(copy.deepcopy(model))
    opt = torch.optim.AdamW(m.parameters(), lr=1e-4)

    phases = []  # per step: (minor faults, main-thread CPU s) of forward, backward, optimizer step + zero_grad

    def step():
        dist.barrier()
        marks = [(faults()[0], time.thread_time())]
        loss = m(*local)
        marks.append((faults()[0], time.thread_time()))
        loss.backward()
        marks.append((faults()[0], time.thread_time()))
        opt.step()
        opt.zero_grad(set_to_none=True)
        marks.append((faults()[0], time.thread_time()))
        phases.append([(b[0] - a[0], b[1] - a[1]) for a, b in zip(marks, marks[1:])])
        if side == "ddp":
            dist.all_reduce(loss.detach())

    for _ in range(5):
        step()
    phases.clear()
    t0, w0, c0, f0 = thread_ns(), time.perf_counter(), time.process_time(), faults()
    for _ in range(steps):
        step()
    t1, w1, c1, f1 = thread_ns(), time.perf_counter(), time.process_time(), faults()
    if rank == 0:
        print(f"{side} {name}: {steps} steps, per step wall {1e3 * (w1 - w0) / steps:.2f} ms, "
              f"process CPU {1e3 * (c1 - c0) / steps:.2f} ms "
              f"(user {1e3 * (f1[2] - f0[2]) / steps:.2f}, system {1e3 * (f1[3] - f0[3]) / steps:.2f}), "
              f"minor page faults {(f1[0] - f0[0]) / steps:.1f}, major {(f1[1] - f0[1]) / steps:.1f} per step")
        med = [[statistics.median(p[i][j] for p in phases) for j in range(2)] for i in range(3)]
        print("  main thread, median per phase: " + "  ".join(
            f"{n} {1e3 * c:.2f} ms CPU, {f:.0f} faults" for n, (f, c) in zip(("forward", "backward", "step"), med)))
        for k in sorted(t1, key=lambda k: -(t1[k] - t0.get(k, 0))):
            d = (t1[k] - t0.get(k, 0)) / steps / 1e6
            if d > 0.005:
                print(f"  thread {k:28s} {d:7.3f} ms/step")


if __name__ == "__main__":
    args = sys.argv[1:]
    n = int(args[args.index("--steps") + 1]) if "--steps" in args else 200
    model = args[args.index("--model") + 1] if "--model" in args else "convnet"
    launch(body, 2, args[0], n, model)
