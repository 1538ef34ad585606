"""Measure the machine a mesh runs on and describe it as a `cost_model.hardware.Cluster`.

`profile(mesh)` runs on every rank of the mesh (collectively). Every timing starts after a barrier
(all ranks run the same work at once, as in training, sharing memory bandwidth and cores) and is the
median of `repeats` runs after one warm-up. It measures:
- matmul throughput per dtype, as training runs matmuls: a linear layer's forward and backward
  (`y = x W^T`, then `g W` and `g^T x`, two of them on transposed operands) with x, W, g square
  n x n for each n in `sizes`, `3 · 2n^3 / t` (the estimate prices 3x the forward FLOPs at this
  rate): `Cluster.matmul_table` by forward FLOPs per call (2n^3); the best size is `peak_flops`.
  Matmuls are measured twice, before and after the collectives, and each size keeps its faster
  pass (a transient slowdown of one pass moved every prediction by 20%).
  A larger size is skipped when, scaled by n^3, it would take more than `max_matmul_s` (slow
  dtypes, e.g. fp16 on most CPUs).
- memory bandwidth: `dst.copy_(src)` of `memory_bytes`, `2 · bytes / t` (read + write): the roofline's.
- per-op-kind rates (`Cluster.sdpa_flops`, `vector_bytes_per_s`, `copy_bytes_per_s`,
  `op_overhead_s`, see `cost_model.analytical.kernel_time_s`): fused attention forward + backward
  (FLOPs counted as 3x forward, causal halved), per dtype; elementwise and reduction ops (add,
  mul, gelu, layer_norm, softmax, sum) and data movement (clone, cat, index_select), bytes read +
  written, each op allocating its output as model ops do, on tensors of `kernel_bytes` / 4,
  `kernel_bytes` and 4 x `kernel_bytes` (all bytes over all time: whether an output lands on
  fresh pages, which the kernel must fault in and zero, varies with the allocator's state and
  makes one size's rate swing several-fold on a CPU host);
  and the framework time per op: a chain of ops on one-element tensors, forward + backward, per
  op and per unit of work (3 per forward op, as the estimate counts them).
- each mesh axis of size p > 1, collectives in situ (`Link.table`): for each kind (all_reduce,
  all_gather, reduce_scatter, all_to_all, issued as the runtime issues them, through
  `torch.ops._c10d_functional` and `wait_tensor`) and each size in `message_bytes` (4 B to 8 MiB
  by default, 4x apart: gloo's cost is not smooth in the size), `iters` iterations of (a matmul of
  about `insitu_matmul_s` + the collective) minus `iters` of the matmul alone, per iteration. This
  is what a collective adds to a stream of compute, synchronisation with the other ranks
  included; on a small CPU host it is ~1-2 ms from a few KiB on, far above the latency a
  back-to-back loop of tiny messages sees. The table is made
  non-decreasing in the size (pool-adjacent-violators: noise does not make a larger message
  cheaper). Sizes are n as `cost_model.analytical` defines it per kind (the full tensor of an
  all-reduce, the gathered output of an all-gather, the full input of a reduce-scatter, the local
  buffer of an all-to-all). Synchronisation also grows with the compute ranks do alone before a
  collective (they drift apart; idle threads go to sleep): a small all-reduce is timed the same way
  after 0 (back to back), 1, 4 and 16 matmuls (`Link.sync_table`, made non-decreasing, with
  `Link.table_interval_s` the compute of one matmul, the table's). The alpha-beta link (for other
  kinds and group sizes) is a weighted
  least-squares fit (relative error) of the all-reduce row, `t(n) = A + B·n`, mapped to the ring
  model `t = 2(p-1)·alpha + 2(p-1)/p · n / bw`: `alpha = A / (2(p-1))`, `bw = 2(p-1) / (p·B)`.

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
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.device_mesh import DeviceMesh

from cost_model.hardware import PRESETS, TABLE_KINDS, Cluster, Link, _preset_for_this_machine, default_profile_path, \
    device_name

__all__ = ["profile"]

_c10d = torch.ops._c10d_functional

_MESSAGES = tuple(4 * 4**k for k in range(11)) + (2**23,)  # 4 B .. 4 MiB in steps of 4x, and 8 MiB
_SYNC_MATMULS = (0, 1, 4, 16)  # matmuls of ~insitu_matmul_s before a collective: the sync table's intervals
_DEFAULTS = {  # device type -> matmul sizes, collective message bytes, copy bytes, kernel bytes, SDPA (b, h, s, d)
    "cpu": dict(sizes=(256, 512, 1024), messages=_MESSAGES, memory=2**26, kernel=2**21, sdpa=(4, 8, 128, 64)),
    "cuda": dict(sizes=(2048, 4096, 8192), messages=_MESSAGES, memory=2**30, kernel=2**26, sdpa=(4, 16, 1024, 128)),
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


def _timed_s(fn, device: torch.device, group=None) -> float:
    """One run of fn after a barrier (every rank starts together), device work included."""
    dist.barrier(group=group)
    _sync(device)
    t0 = time.perf_counter()
    fn()
    _sync(device)
    return time.perf_counter() - t0


def _median_s(fn, device: torch.device, repeats: int, group=None) -> float:
    fn()  # warm-up
    return statistics.median(_timed_s(fn, device, group) for _ in range(repeats))


def _matmul_rates(dtype: str, sizes, device, repeats: int, max_matmul_s: float, progress: _Progress) -> list[float]:
    """FLOP/s of a training matmul (linear forward + backward) per size; 0.0 for sizes skipped as too slow."""
    rates = [0.0] * len(sizes)
    for i, n in enumerate(sizes):
        x, w, g = (torch.randn(n, n, device=device).to(getattr(torch, dtype)) for _ in range(3))
        x.requires_grad_()
        w.requires_grad_()
        t = _median_s(lambda: torch.autograd.grad(F.linear(x, w), (x, w), g), device, repeats) / 3
        rates[i] = 2 * n**3 / t
        progress.step(f"matmul {dtype} {n}")
        if i + 1 < len(sizes) and t * (sizes[i + 1] / n) ** 3 > max_matmul_s:
            for m in sizes[i + 1:]:
                progress.step(f"matmul {dtype} {m} (skipped: {n} took {t:.3f} s)")
            break
    return rates


# ------------------------------------------------------------------------------------- op kinds
def _sdpa_flops(dtype: str, shape, device, repeats: int) -> float:
    """Fused causal attention, forward + backward: 3x the forward FLOPs (halved by causality) per second."""
    b, h, s, d = shape
    q, k, v = (torch.randn(b, h, s, d, device=device).to(getattr(torch, dtype)).requires_grad_() for _ in range(3))

    def step():
        F.scaled_dot_product_attention(q, k, v, is_causal=True).sum().backward()

    return 3 * (4 * b * h * s * s * d // 2) / _median_s(step, device, repeats)


def _ops_bytes_per_s(ops, device, repeats: int) -> float:
    """Bytes read + written per second over a list of (fn, bytes) ops, each allocating its output."""
    total = sum(nbytes for _, nbytes in ops)
    return total / _median_s(lambda: [fn() for fn, _ in ops], device, repeats)


def _vector_bytes_per_s(nbytes: int, device, repeats: int) -> float:
    cols = 256
    x, y = (torch.randn(max(1, nbytes // 4 // cols), cols, device=device) for _ in range(2))
    w = torch.ones(cols, device=device)
    n = x.numel() * 4
    ops = [(lambda: x + y, 3 * n), (lambda: x * y, 3 * n), (lambda: F.gelu(x), 2 * n),
           (lambda: F.layer_norm(x, (cols,), w, w), 2 * n), (lambda: torch.softmax(x, -1), 2 * n),
           (lambda: x.sum(-1), n)]
    return _ops_bytes_per_s(ops, device, repeats)


def _copy_bytes_per_s(nbytes: int, device, repeats: int) -> float:
    cols = 256
    x = torch.randn(max(2, nbytes // 4 // cols), cols, device=device)
    half = x.shape[0] // 2
    a, b = x[:half], x[half:]
    idx = torch.randint(0, x.shape[0], (x.shape[0],), device=device)
    n = x.numel() * 4
    ops = [(lambda: x.clone(), 2 * n), (lambda: torch.cat([a, b]), 2 * n),
           (lambda: x.index_select(0, idx), 2 * n + idx.numel() * 8)]
    return _ops_bytes_per_s(ops, device, repeats)


def _op_overhead_s(device, repeats: int, num_ops: int = 200) -> float:
    """Framework time per unit of op work: a chain of ops on one element, forward + backward, / (3 · ops)."""
    x = torch.ones(1, device=device, requires_grad=True)

    def chain():
        y = x
        for _ in range(num_ops):
            y = y * 1.0
        y.backward()

    return _median_s(chain, device, repeats) / (3 * num_ops)


# ---------------------------------------------------------------------------------- collectives
def _collective_op(kind: str, nbytes: int, p: int, group_name: str, device):
    """(n as the cost model defines it, a function issuing the collective as the runtime does)."""
    if kind == "all_reduce":
        x = torch.zeros(max(1, nbytes // 4), device=device)
        return x.numel() * 4, lambda: _c10d.wait_tensor(_c10d.all_reduce(x, "sum", group_name))
    if kind == "all_gather":  # n: the gathered output
        x = torch.zeros(max(1, nbytes // 4 // p), device=device)
        return x.numel() * 4 * p, lambda: _c10d.wait_tensor(_c10d.all_gather_into_tensor(x, p, group_name))
    if kind == "reduce_scatter":  # n: the full input
        x = torch.zeros(max(1, nbytes // 4 // p) * p, device=device)
        return x.numel() * 4, lambda: _c10d.wait_tensor(_c10d.reduce_scatter_tensor(x, "sum", p, group_name))
    assert kind == "all_to_all", kind  # n: the local buffer
    x = torch.zeros(max(1, nbytes // 4 // p) * p, device=device)
    splits = [x.numel() // p] * p
    return x.numel() * 4, lambda: _c10d.wait_tensor(_c10d.all_to_all_single(x, splits, splits, group_name))


def _in_situ_s(op, compute, iters: int, repeats: int, device, group) -> tuple[float, float]:
    """(seconds one collective adds to a stream of compute, seconds of compute per iteration): medians over
    repeats of (compute + collective) loops minus compute-only loops, per iteration (never negative)."""
    def loop(with_op: bool):
        def run():
            for _ in range(iters):
                compute()
                if with_op:
                    op()
        return run

    op()  # warm-up (connections, buffers)
    diffs, bases = [], []
    for _ in range(repeats):
        base = _timed_s(loop(False), device, group)
        both = _timed_s(loop(True), device, group)
        diffs.append(max(0.0, both - base) / iters)
        bases.append(base / iters)
    return statistics.median(diffs), statistics.median(bases)


def _increasing(values: list[float]) -> list[float]:
    """A non-decreasing sequence made strictly increasing: a value equal to the one before nudged just above it."""
    out: list[float] = []
    for v in values:
        out.append(v if not out or v > out[-1] else out[-1] * (1 + 1e-6) + 1e-12)
    return out


def _monotone(times: list[float]) -> list[float]:
    """The non-decreasing sequence closest to `times` in least squares (pool adjacent violators)."""
    blocks: list[list[float]] = []  # [sum, count]
    for t in times:
        blocks.append([t, 1])
        while len(blocks) > 1 and blocks[-2][0] / blocks[-2][1] > blocks[-1][0] / blocks[-1][1]:
            s, c = blocks.pop()
            blocks[-1][0] += s
            blocks[-1][1] += c
    out: list[float] = []
    for s, c in blocks:
        out += [s / c] * c
    for i in range(1, len(out)):  # exactly non-decreasing despite rounding
        out[i] = max(out[i], out[i - 1])
    return out


def _fit_all_reduce(message_bytes, times_s, p: int) -> Link:
    """Weighted least squares of t = A + B·n (weights 1/t), mapped to a ring all-reduce link."""
    w = [1 / max(t, 1e-12) for t in times_s]
    sw = sum(x * x for x in w)
    sn = sum(x * x * n for x, n in zip(w, message_bytes))
    snn = sum(x * x * n * n for x, n in zip(w, message_bytes))
    st = sum(x * x * t for x, t in zip(w, times_s))
    snt = sum(x * x * n * t for x, n, t in zip(w, message_bytes, times_s))
    det = sw * snn - sn * sn
    slope = (sw * snt - sn * st) / det if det else 0.0
    if slope <= 0:  # noise: fall back to the largest message's rate
        slope = max(times_s[-1], 1e-12) / message_bytes[-1]
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
            message_bytes=None, memory_bytes: int | None = None, kernel_bytes: int | None = None, repeats: int = 5,
            iters: int = 20, insitu_matmul_s: float = 1e-3, max_matmul_s: float = 0.5,
            progress: bool = True) -> Cluster:
    """Measure compute, memory bandwidth, op kinds and each mesh axis' collectives; every rank returns the
    same Cluster."""
    if not isinstance(mesh, DeviceMesh):
        raise TypeError(f"mesh must be a DeviceMesh, got {type(mesh).__name__}; build one with "
                        "init_device_mesh('cpu' or 'cuda', (sizes...))")
    if mesh.device_type not in _DEFAULTS:
        raise ValueError(f"autopar.profile supports 'cpu' and 'cuda' meshes, got a {mesh.device_type!r} mesh")
    for dt in dtypes:
        if not isinstance(getattr(torch, str(dt), None), torch.dtype):
            raise ValueError(f"unknown dtype {dt!r}; expected names such as 'float32', 'bfloat16'")
    defaults = _DEFAULTS[mesh.device_type]
    sizes = tuple(sorted(sizes or defaults["sizes"]))
    message_bytes = tuple(sorted(message_bytes or defaults["messages"]))
    memory_bytes = memory_bytes or defaults["memory"]
    kernel_bytes = kernel_bytes or defaults["kernel"]
    if len(message_bytes) < 2:
        raise ValueError(f"message_bytes needs at least 2 sizes to fit latency and bandwidth, got {message_bytes}")
    device = (torch.device("cuda", torch.cuda.current_device()) if mesh.device_type == "cuda"
              else torch.device("cpu"))
    shape = tuple(int(s) for s in mesh.shape)
    axes = [i for i, s in enumerate(shape) if s > 1]
    rank0 = dist.get_rank() == 0
    bar = _Progress(len(dtypes) * (2 * len(sizes) + 1) + 4
                    + len(axes) * (len(TABLE_KINDS) * len(message_bytes) + len(_SYNC_MATMULS)), progress and rank0)

    # rates: reduced with MIN over ranks (the slowest rank counts)
    mm_rates = [r for dt in dtypes for r in _matmul_rates(str(dt), sizes, device, repeats, max_matmul_s, bar)]
    src = torch.empty(memory_bytes // 4, device=device)
    dst = torch.empty_like(src)
    copy_bw = 2 * memory_bytes / _median_s(lambda: dst.copy_(src), device, repeats)
    del src, dst
    bar.step("memory copy")
    sdpa = []
    for dt in dtypes:
        sdpa.append(_sdpa_flops(str(dt), defaults["sdpa"], device, repeats))
        bar.step(f"attention {dt}")
    spread = (kernel_bytes // 4, kernel_bytes, 4 * kernel_bytes)
    vector_bw = sum(spread) / sum(n / _vector_bytes_per_s(n, device, repeats) for n in spread)
    bar.step("elementwise and reduction ops")
    move_bw = sum(spread) / sum(n / _copy_bytes_per_s(n, device, repeats) for n in spread)
    bar.step("data movement ops")
    local_ranks = _local_world_size(device)
    rates = torch.tensor(mm_rates + sdpa + [copy_bw, vector_bw, move_bw, float(local_ranks),
                                            float(_device_memory_bytes(device, local_ranks))],
                         dtype=torch.float64, device=device)
    dist.all_reduce(rates, op=dist.ReduceOp.MIN)  # every rank sizes the in-situ matmul alike
    rates = rates.tolist()
    nd, ns = len(dtypes), len(sizes)
    mm_rates, rates = rates[:nd * ns], rates[nd * ns:]  # then: sdpa per dtype, copy, vector, move, ranks, memory
    flops = [max(mm_rates[j * ns:(j + 1) * ns]) for j in range(nd)]

    # times: reduced with MAX
    times = [_op_overhead_s(device, repeats)]
    bar.step("op overhead")
    matmul_dtype = "float32" if "float32" in map(str, dtypes) else str(dtypes[0])
    rate = flops[list(map(str, dtypes)).index(matmul_dtype)]
    n = max(32, int(round((rate * insitu_matmul_s / 2) ** (1 / 3) / 16)) * 16)
    a = torch.randn(n, n, device=device).to(getattr(torch, matmul_dtype))
    b = torch.randn(n, n, device=device).to(getattr(torch, matmul_dtype))
    out = torch.empty_like(a)
    matmul = lambda: torch.mm(a, b, out=out)  # noqa: E731
    # the axes measured in turn, point by point (not one axis after the other): drift of a busy host over the
    # minutes this takes hits every axis alike, so axes that run alike are measured alike (`tune._interchangeable`)
    sizes_used: dict[tuple[int, str], list[int]] = {}
    got: dict[tuple, object] = {}  # (axis, kind, size index) or (axis, "sync", k) -> time(s)
    groups = {i: mesh.get_group(i) for i in axes}
    for kind in TABLE_KINDS:
        for j, nbytes in enumerate(message_bytes):
            for i in axes:
                n_model, op = _collective_op(kind, nbytes, shape[i], groups[i].group_name, device)
                sizes_used.setdefault((i, kind), []).append(n_model)
                got[i, kind, j] = _in_situ_s(op, matmul, iters, repeats, device, groups[i])[0]
                bar.step(f"{kind} in situ, axis {i} ({shape[i]} ranks) {n_model} B")
    # synchronisation against the compute before a collective: a small all-reduce after k matmuls
    for k in _SYNC_MATMULS:
        compute = lambda k=k: [matmul() for _ in range(k)]  # noqa: E731
        for i in axes:
            _, op = _collective_op("all_reduce", message_bytes[0], shape[i], groups[i].group_name, device)
            got[i, "sync", k] = _in_situ_s(op, compute, max(4, iters // max(1, k // 2)), repeats, device, groups[i])
            bar.step(f"all_reduce after {k} matmuls, axis {i}")
    for i in axes:  # per axis: its tables, then its synchronisation pairs (read back below in this order)
        times += [got[i, kind, j] for kind in TABLE_KINDS for j in range(len(message_bytes))]
        times += [t for k in _SYNC_MATMULS for t in got[i, "sync", k]]
    times_t = torch.tensor(times, dtype=torch.float64, device=device)
    dist.all_reduce(times_t, op=dist.ReduceOp.MAX)
    times = times_t.tolist()
    op_overhead, times = times[0], times[1:]

    # matmuls again, a minute later: a transient slowdown (another process, the host) that hit one pass is
    # rejected by keeping each size's faster pass; a slowdown of both is real
    again = torch.tensor([r for dt in dtypes for r in _matmul_rates(str(dt), sizes, device, repeats, max_matmul_s,
                                                                    bar)], dtype=torch.float64, device=device)
    dist.all_reduce(again, op=dist.ReduceOp.MIN)
    mm_rates = [max(a, b) if a > 0 and b > 0 else 0.0 for a, b in zip(mm_rates, again.tolist())]
    matmul_table = {str(dt): tuple((2.0 * n**3, r) for n, r in zip(sizes, mm_rates[j * ns:(j + 1) * ns]) if r > 0)
                    for j, dt in enumerate(dtypes)}
    flops = [max(r for _, r in matmul_table[str(dt)]) for dt in dtypes]

    links: list[Link | None] = [None] * len(shape)
    k = 0
    for i in axes:
        table = {}
        for kind in TABLE_KINDS:
            used = sizes_used[(i, kind)]
            row = _monotone(times[k:k + len(used)])
            k += len(used)
            points: dict[int, float] = {}
            for nb, t in zip(used, row):  # rounding to whole elements can repeat a size: keep the larger time
                points[nb] = max(points.get(nb, 0.0), t)
            table[kind] = tuple(sorted(points.items()))
        sync = times[k:k + 2 * len(_SYNC_MATMULS)]
        k += 2 * len(_SYNC_MATMULS)
        added, intervals = sync[0::2], sync[1::2]
        intervals[0] = 0.0  # back to back: no compute between collectives
        # k matmuls take longer than fewer, but on a busy host one measurement can come out below the one before
        # (4 matmuls timed under 1): the intervals made increasing, as the times are made non-decreasing
        intervals = _increasing(_monotone(intervals))
        sync_table = tuple(zip(intervals, _monotone(added)))
        ar = table["all_reduce"]
        fit = _fit_all_reduce([nb for nb, _ in ar], [t for _, t in ar], shape[i])
        links[i] = Link(alpha_s=fit.alpha_s, bytes_per_s=fit.bytes_per_s, table=table, table_group_size=shape[i],
                        table_interval_s=intervals[_SYNC_MATMULS.index(1)], sync_table=sync_table)
    measured = [link for link in links if link is not None]
    if measured:
        intra = max(measured, key=lambda link: link.bytes_per_s)
        inter = min(measured, key=lambda link: link.bytes_per_s)
        link_note = "collectives measured in situ per mesh axis"
    else:
        preset = PRESETS["cpu"] if device.type == "cpu" else _preset_for_this_machine()
        intra, inter = preset.intra_node, preset.inter_node
        link_note = f"no mesh axis of size > 1: links from the {preset.name!r} preset"
    name = device_name()
    cluster = Cluster(
        name=f"profile-{name}",
        gpus_per_node=int(rates[nd + 3]),
        peak_flops={str(dt): f for dt, f in zip(dtypes, flops)},
        memory_bytes_per_s=rates[nd],
        device_memory_bytes=int(rates[nd + 4]),
        intra_node=intra,
        inter_node=inter,
        source=f"measured by autopar.profile on {name}, mesh {shape}, {dist.get_backend()}, torch "
               f"{torch.__version__}, threads {torch.get_num_threads()}; {link_note}",
        mesh_shape=shape,
        axis_links=tuple(links),
        matmul_table=matmul_table,
        sdpa_flops={str(dt): f for dt, f in zip(dtypes, rates[:nd])},
        vector_bytes_per_s=rates[nd + 1],
        copy_bytes_per_s=rates[nd + 2],
        op_overhead_s=op_overhead,
    )
    if rank0:
        out_path = Path(path) if path is not None else default_profile_path(shape)
        out_path.parent.mkdir(parents=True, exist_ok=True)
        tmp = out_path.with_name(out_path.name + f".tmp{os.getpid()}")
        tmp.write_text(cluster.to_json())
        tmp.replace(out_path)
    return cluster
