"""Single-tensor AdamW's step on the dp_vs_ddp GPT's parameters: plain tensors, replicated DTensors as torch
dispatches them, replicated DTensors with `autopar.runtime.scalar_ops` (Python-number pointwise ops run on
the local tensor), and replicated DTensors marked as `ParallelModule` marks its parameters, whose steps run on
the local tensors (`autopar.runtime.local_step`, what autopar's parameters get). One process (a 1-rank gloo
group), the four optimizers stepped in turn (order reversed every other round), CPU time per step; prints the
medians and `RESULT dtensor AdamW step local/plain ... fast/plain ... torch/plain ...`.
A 16x16 tensor's per-op costs (`--ops`) show the dispatch overhead alone.

    python benchmarks/dtensor_scalar_ops.py [--quick] [--ops]
"""

from __future__ import annotations

import statistics
import sys
import time

import torch
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Replicate, distribute_tensor

from autopar.models import GPT, GPTConfig
from autopar.runtime import local_step, scalar_ops
from common import launch

KINDS = ("plain", "DTensor torch", "DTensor fast", "DTensor local step")


def run(quick: bool, ops: bool) -> None:
    mesh = init_device_mesh("cpu", (1,))
    scalar_ops.install()
    local_step.install()
    torch.manual_seed(0)
    cfg = GPTConfig(vocab_size=2048, seq_len=256, num_layers=4, num_heads=8, hidden=512, dropout=0.0)
    values = [p.detach() for p in GPT(cfg).parameters()]
    grads = [torch.randn_like(v) * 1e-3 for v in values]
    opts = {}
    for kind in KINDS:
        wrap = (lambda t: t.clone()) if kind == "plain" else (lambda t: distribute_tensor(t.clone(), mesh, [Replicate()]))
        params = [torch.nn.Parameter(wrap(v)) for v in values]
        for p, g in zip(params, grads):
            p.grad = wrap(g)
        if kind == "DTensor local step":
            local_step.register(params)
        opts[kind] = torch.optim.AdamW(params, lr=1e-4)
    times = {k: [] for k in KINDS}
    for r in range(2 + (8 if quick else 30)):
        for kind in (KINDS if r % 2 else KINDS[::-1]):
            with scalar_ops.fast_path(kind != "DTensor torch"), local_step.enabled(kind == "DTensor local step"):
                t = time.process_time()
                opts[kind].step()
                if r >= 2:
                    times[kind].append(time.process_time() - t)
    med = {k: statistics.median(v) for k, v in times.items()}
    print(f"AdamW step, {len(values)} parameters, {sum(v.numel() for v in values) / 1e6:.1f} M elements, CPU ms "
          f"(median of {len(times['plain'])}): " + "  ".join(f"{k} {v * 1e3:.1f}" for k, v in med.items()))
    print(f"RESULT dtensor AdamW step local/plain {med['DTensor local step'] / med['plain']:.3f} "
          f"fast/plain {med['DTensor fast'] / med['plain']:.3f} "
          f"torch/plain {med['DTensor torch'] / med['plain']:.3f}", flush=True)
    if ops:
        _per_op(mesh)


def _per_op(mesh) -> None:
    x = torch.randn(16, 16)
    d, g = (distribute_tensor(torch.randn(16, 16), mesh, [Replicate()]) for _ in range(2))
    calls = {"mul_(0.9)": lambda t, u: t.mul_(0.9), "add_(1e-8)": lambda t, u: t.add_(1e-8),
             "div(1.5)": lambda t, u: t.div(1.5), "lerp_(u, 0.1)": lambda t, u: t.lerp_(u, 0.1),
             "addcmul_(u, u)": lambda t, u: t.addcmul_(u, u, value=1e-3)}
    for name, call in calls.items():
        row = []
        for kind, t, u in (("plain", x, x.clone()), ("DTensor torch", d, g), ("DTensor fast", d, g)):
            with scalar_ops.fast_path(kind == "DTensor fast"):
                best = []
                for _ in range(5):
                    s = time.perf_counter()
                    for _ in range(300):
                        call(t, u)
                    best.append((time.perf_counter() - s) / 300)
            row.append(f"{kind} {min(best) * 1e6:6.1f}")
        print(f"  {name:16s} us/call: " + "  ".join(row))


if __name__ == "__main__":
    launch(run, 1, "--quick" in sys.argv, "--ops" in sys.argv)
