"""Measure the machine a mesh runs on and describe it as a `cost_model.hardware.Cluster`.

`profile(mesh)` runs on every rank of the mesh (collectively) and measures:
- matmul throughput per dtype: square n x n matmuls for each n in `sizes`, best of `repeats`
  after one warm-up, `2n^3 / t`; the best size counts. A larger size is skipped when, scaled by
  n^3, it would take more than `max_matmul_s` (slow dtypes, e.g. fp16 on most CPUs).
- memory bandwidth: `dst.copy_(src)` of `memory_bytes`, best of `repeats`, `2 · bytes / t`
  (read + write).
- each mesh axis of size p > 1: `all_reduce` of float32 messages of `message_bytes` over the
  axis' group (all groups of the axis at once), best of `repeats`, each after a barrier. A
  weighted least-squares fit (relative error) of `t(n) = A + B·n` gives the ring model of
  `cost_model.analytical`, `t = 2(p-1)·alpha + 2(p-1)/p · n / bw`: `alpha = A / (2(p-1))`,
  `bw = 2(p-1) / (p·B)`.

Every rank contributes its measurements and all ranks agree on the result: rates are reduced
with MIN and times with MAX over the world (the slowest rank counts), so every rank returns the
same `Cluster`. The fastest measured axis becomes `intra_node`, the slowest `inter_node`, and the
per-axis links are kept (`Cluster.axis_links` for `Cluster.mesh_shape`). A mesh with no axis of
size > 1 measures no link; its links come from the device's preset.

Rank 0 writes the JSON to `path`, or to `cost_model.hardware.default_profile_path(mesh.shape)`
where `load_cluster(None, mesh_shape)` finds it, and shows a plain-text progress bar on stderr.
From the shell: `torchrun --nproc-per-node N -m autopar profile --out PATH`.
"""

from __future__ import annotations

import math
import os
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from cost_model.hardware import PRESETS, Cluster, Link, _preset_for_this_machine, default_profile_path, device_name

__all__ = ["profile"]

_DEFAULTS = {  # device type -> (matmul sizes, all_reduce message bytes, copy bytes)
    "cpu": ((256, 512, 1024), (4, 2**16, 2**20, 2**23), 2**26),
    "cuda": ((2048, 4096, 8192), (4, 2**20, 2**26, 2**28), 2**30),
}


class _Progress:
    """`autopar profile [#####.....] 5/10 what` on stderr, rank 0 only."""

    def __init__(self, total: int, enabled: bool):
        self.total, self.done, self.enabled = total, 0, enabled
        self.tty = enabled and sys.stderr.isatty()

    def step(self, what: str) -> None:
        self.done += 1
        if not self.enabled:
            return
        width = 30
        filled = width * self.done // self.total
        line = f"autopar profile [{'#' * filled}{'.' * (width - filled)}] {self.done}/{self.total} {what}"
        end = "" if self.tty and self.done < self.total else "\n"
        sys.stderr.write(("\r" + line.ljust(100) if self.tty else line) + end)
        sys.stderr.flush()


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _best_s(fn, device: torch.device, repeats: int, before=None) -> float:
    fn()  # warm-up
    best = math.inf
    for _ in range(repeats):
        if before is not None:
            before()
        _sync(device)
        t0 = time.perf_counter()
        fn()
        _sync(device)
        best = min(best, time.perf_counter() - t0)
    return best


def _matmul_flops(dtype: str, sizes, device, repeats: int, max_matmul_s: float, progress: _Progress) -> float:
    best = 0.0
    for i, n in enumerate(sizes):
        a = torch.randn(n, n, device=device).to(getattr(torch, dtype))
        b = torch.randn(n, n, device=device).to(getattr(torch, dtype))
        t = _best_s(lambda: torch.mm(a, b), device, repeats)
        best = max(best, 2 * n**3 / t)
        progress.step(f"matmul {dtype} {n}")
        if i + 1 < len(sizes) and t * (sizes[i + 1] / n) ** 3 > max_matmul_s:
            for m in sizes[i + 1:]:
                progress.step(f"matmul {dtype} {m} (skipped: {n} took {t:.3f} s)")
            break
    return best


def _fit_all_reduce(message_bytes, times_s, p: int) -> Link:
    """Weighted least squares of t = A + B·n (weights 1/t), mapped to a ring all-reduce link."""
    w = [1 / t for t in times_s]
    sw = sum(x * x for x in w)
    sn = sum(x * x * n for x, n in zip(w, message_bytes))
    snn = sum(x * x * n * n for x, n in zip(w, message_bytes))
    st = sum(x * x * t for x, t in zip(w, times_s))
    snt = sum(x * x * n * t for x, n, t in zip(w, message_bytes, times_s))
    det = sw * snn - sn * sn
    slope = (sw * snt - sn * st) / det if det else 0.0
    if slope <= 0:  # noise: fall back to the largest message's rate
        slope = times_s[-1] / message_bytes[-1]
    intercept = (st - slope * sn) / sw
    if intercept <= 0:
        intercept = max(min(t - slope * n for n, t in zip(message_bytes, times_s)), 0.0)
    return Link(alpha_s=intercept / (2 * (p - 1)), bytes_per_s=2 * (p - 1) / (p * slope))


def _local_world_size(device: torch.device) -> int:
    if "LOCAL_WORLD_SIZE" in os.environ:
        return int(os.environ["LOCAL_WORLD_SIZE"])
    if device.type == "cuda":
        return torch.cuda.device_count()
    return dist.get_world_size()


def _device_memory_bytes(device: torch.device, local_ranks: int) -> int:
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).total_memory
    return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE") // max(1, local_ranks)


def profile(mesh: DeviceMesh, path: str | os.PathLike | None = None, *, dtypes=("float32",), sizes=None,
            message_bytes=None, memory_bytes: int | None = None, repeats: int = 3, max_matmul_s: float = 0.5,
            progress: bool = True) -> Cluster:
    """Measure compute, memory bandwidth and each mesh axis' links; every rank returns the same Cluster."""
    if not isinstance(mesh, DeviceMesh):
        raise TypeError(f"mesh must be a DeviceMesh, got {type(mesh).__name__}; build one with "
                        "init_device_mesh('cpu' or 'cuda', (sizes...))")
    if mesh.device_type not in _DEFAULTS:
        raise ValueError(f"autopar.profile supports 'cpu' and 'cuda' meshes, got a {mesh.device_type!r} mesh")
    for dt in dtypes:
        if not isinstance(getattr(torch, str(dt), None), torch.dtype):
            raise ValueError(f"unknown dtype {dt!r}; expected names such as 'float32', 'bfloat16'")
    default_sizes, default_msgs, default_mem = _DEFAULTS[mesh.device_type]
    sizes = tuple(sorted(sizes or default_sizes))
    message_bytes = tuple(sorted(message_bytes or default_msgs))
    memory_bytes = memory_bytes or default_mem
    if len(message_bytes) < 2:
        raise ValueError(f"message_bytes needs at least 2 sizes to fit latency and bandwidth, got {message_bytes}")
    device = (torch.device("cuda", torch.cuda.current_device()) if mesh.device_type == "cuda"
              else torch.device("cpu"))
    shape = tuple(int(s) for s in mesh.shape)
    axes = [i for i, s in enumerate(shape) if s > 1]
    rank0 = dist.get_rank() == 0
    bar = _Progress(len(dtypes) * len(sizes) + 1 + len(axes) * len(message_bytes), progress and rank0)

    # rates: reduced with MIN over ranks (the slowest rank counts)
    flops = [_matmul_flops(str(dt), sizes, device, repeats, max_matmul_s, bar) for dt in dtypes]
    src = torch.empty(memory_bytes // 4, device=device)
    dst = torch.empty_like(src)
    copy_bw = 2 * memory_bytes / _best_s(lambda: dst.copy_(src), device, repeats)
    del src, dst
    bar.step("memory copy")
    local_ranks = _local_world_size(device)
    rates = torch.tensor(flops + [copy_bw, float(local_ranks), float(_device_memory_bytes(device, local_ranks))],
                         dtype=torch.float64, device=device)

    # all_reduce times per axis and message size: reduced with MAX
    times = []
    for i in axes:
        group = mesh.get_group(i)
        for n in message_bytes:
            x = torch.zeros(max(1, n // 4), dtype=torch.float32, device=device)
            times.append(_best_s(lambda: dist.all_reduce(x, group=group), device, repeats,
                                 before=lambda: dist.barrier(group=group)))
            bar.step(f"all_reduce axis {i} ({shape[i]} ranks) {n} B")
    times_t = torch.tensor(times or [0.0], dtype=torch.float64, device=device)
    dist.all_reduce(rates, op=dist.ReduceOp.MIN)
    dist.all_reduce(times_t, op=dist.ReduceOp.MAX)
    rates, times = rates.tolist(), times_t.tolist()

    links: list[Link | None] = [None] * len(shape)
    for k, i in enumerate(axes):
        msgs = [max(1, n // 4) * 4 for n in message_bytes]
        links[i] = _fit_all_reduce(msgs, times[k * len(msgs):(k + 1) * len(msgs)], shape[i])
    measured = [link for link in links if link is not None]
    if measured:
        intra = max(measured, key=lambda link: link.bytes_per_s)
        inter = min(measured, key=lambda link: link.bytes_per_s)
        link_note = "links measured per mesh axis"
    else:
        preset = PRESETS["cpu"] if device.type == "cpu" else _preset_for_this_machine()
        intra, inter = preset.intra_node, preset.inter_node
        link_note = f"no mesh axis of size > 1: links from the {preset.name!r} preset"
    name = device_name()
    cluster = Cluster(
        name=f"profile-{name}",
        gpus_per_node=int(rates[len(dtypes) + 1]),
        peak_flops={str(dt): f for dt, f in zip(dtypes, rates[:len(dtypes)])},
        memory_bytes_per_s=rates[len(dtypes)],
        device_memory_bytes=int(rates[len(dtypes) + 2]),
        intra_node=intra,
        inter_node=inter,
        source=f"measured by autopar.profile on {name}, mesh {shape}, {dist.get_backend()}, torch "
               f"{torch.__version__}, threads {torch.get_num_threads()}; {link_note}",
        mesh_shape=shape,
        axis_links=tuple(links),
    )
    if rank0:
        out = Path(path) if path is not None else default_profile_path(shape)
        out.parent.mkdir(parents=True, exist_ok=True)
        tmp = out.with_name(out.name + f".tmp{os.getpid()}")
        tmp.write_text(cluster.to_json())
        tmp.replace(out)
    return cluster
