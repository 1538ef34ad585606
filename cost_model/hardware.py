"""Hardware descriptions: what one device computes and how fast each mesh axis communicates.

A `Cluster` is the cost model's view of the machines: dense peak FLOP/s per dtype, device memory
bandwidth (HBM, or DRAM on a CPU host), device memory capacity, and two alpha-beta `Link`s, one for
groups inside a node (NVLink, loopback) and one for groups that cross nodes (InfiniBand, Ethernet).

Units and conventions:
- `Link.alpha_s` is the latency of one step of a ring algorithm; `Link.bytes_per_s` is the
  bandwidth *one rank sends at* (per direction), so a ring step moving m bytes takes
  `alpha_s + m / (bytes_per_s * efficiency)`. (This is what nccl-tests calls bus bandwidth.)
- `Cluster.peak_flops[dtype]` is the dense matmul peak for that dtype name ("bfloat16",
  "float16", "float32", "float64"). "float32" is IEEE fp32 (no TF32), PyTorch's default for
  matmuls (`torch.backends.cuda.matmul.allow_tf32 = False`).
- `Link.table` (profiles only): measured seconds per collective kind and message size,
  `{kind: ((n_bytes, seconds), ...)}` with n as in `cost_model.analytical`'s table, sizes
  increasing and times non-decreasing, for groups of `Link.table_group_size` ranks. It is the
  cost a collective adds inside a stream of compute (synchronisation included), which on small
  hosts is far above alpha; `collective_time_s` interpolates it and uses alpha-beta for other kinds
  and group sizes. Presets carry no table. The table is measured with `table_interval_s` of
  compute before each collective; `Link.sync_table`, `((interval_s, seconds), ...)`, is what a small
  all-reduce costs after other amounts of compute (0: back to back): the longer ranks compute
  alone, the more they drift apart and the longer the synchronisation. A caller that knows the
  compute before a collective passes it (`collective_time_s(..., interval_s=)`) and the time moves
  by the difference of the sync table between that interval and the table's.
- Per-op-kind compute (profiles only; `None` in the presets, which then use the roofline):
  `matmul_table[dtype]`, `((flops_per_call, flops_per_s), ...)`: training matmul throughput by the
  size of the matmul (small matmuls run slower than the best size, which is `peak_flops`),
  `sdpa_flops[dtype]` (fused attention, forward + backward counted as 3x forward FLOPs),
  `vector_bytes_per_s` (elementwise and reduction ops, bytes read + written),
  `copy_bytes_per_s` (pure data movement: copies, concatenation, gathers) and `op_overhead_s`
  (framework time per op dispatched, independent of its size).
- Efficiencies are explicit fields (`Cluster.flops_efficiency`, `Cluster.memory_efficiency`,
  `Link.efficiency`), never folded into the numbers. The GPU presets carry datasheet peaks with
  efficiency 1.0 and, beside them, the *achieved* rates of their kernels, each with its source cited at
  the presets: `matmul_table` (matmul FLOP/s by the size of the call, up to the maximum achievable
  matmul FLOPS), `sdpa_table` (fused attention by sequence length) and NCCL's all-reduce algorithm
  (`Link.tree_all_reduce`); a profile (`autopar.profile`) carries measured (achieved) numbers, also with
  efficiency 1.0, and replaces them. Use `dataclasses.replace` to model an achievable fraction of a preset.

Mesh topology (`axis_link`): meshes are row-major (the last axis varies fastest over global
ranks), and ranks fill nodes in order, `gpus_per_node` per node. A group along axis `i` contains
ranks `stride_i = prod(mesh_shape[i+1:])` apart, so it stays inside one node when
`prod(mesh_shape[i:]) <= gpus_per_node`; such an axis uses `intra_node`, any other `inter_node`.
Across nodes, a group holding k of a node's GPUs (k = gpus_per_node / stride_i when the stride is
smaller than a node, else 1) sends over k network ports at once (NCCL runs one ring per port, each
crossing the node boundary through another GPU's NIC), so its link has k times `inter_node`'s
bandwidth, at most `intra_node`'s: FSDP over 128 GPUs gets 8 x 50 GB/s on H100 (nccl-tests: 400-450
GB/s bus bandwidth across NDR nodes), a data axis outside a tensor-parallel axis of 8 gets 50 GB/s.
A profiled `Cluster` also stores the link it measured for each axis of the mesh it was measured
on (`mesh_shape`, `axis_links`); for that same mesh shape `axis_link` returns the measured link.

Calibration (`Calibration`, written by `autopar.tune`): factors measured step times fitted against the
model's predictions, one per op kind of compute (`cost_model.analytical.KINDS`) and one per mesh axis of the
mesh it was measured on (its collectives' times), and per mesh axis the fixed seconds each collective adds
(`Calibration.latency`), applied where they are priced (`autopar.estimate.compute_s`, `collective_time_s` through
`Link.time_factor` and `Link.call_s`, which `axis_link` sets). It is saved beside the profile it
corrects (`calibration_path`: the profile's path with `.calibration.json`; for a machine without a profile,
beside the path its profile would have) and `load_cluster` applies it when it loads that profile or, for
`None`, this machine's preset; a preset named explicitly stays as published.

`load_cluster(spec, mesh_shape)` resolves, in order: a `Cluster`; a preset name (`PRESETS`); a
path to a JSON profile; or `None`, meaning the cached profile for this device and mesh at
`default_profile_path(mesh_shape)` (`$XDG_CACHE_HOME/autopar/profile-<device>-<mesh>.json`,
`~/.cache` when XDG_CACHE_HOME is unset) if one exists, else "cpu" when CUDA is unavailable,
else the preset matching `torch.cuda.get_device_name()`.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import re
import warnings
from dataclasses import dataclass, field
from pathlib import Path

__all__ = [
    "TABLE_KINDS", "Link", "Cluster", "PRESETS", "load_cluster", "check_cluster_spec", "axis_link",
    "default_profile_path", "device_name", "Calibration", "calibration_path",
]

_FORMAT = "autopar.cluster/1"
GB = 1e9  # datasheets use decimal units
DTYPES = ("bfloat16", "float16", "float32", "float64")


TABLE_KINDS = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all")


@dataclass(frozen=True, kw_only=True)
class Link:
    """One alpha-beta link: a ring step moving m bytes takes alpha_s + m / (bytes_per_s * efficiency);
    optionally a measured time table per collective kind (see the module docstring)."""

    alpha_s: float  # latency of one algorithm step
    bytes_per_s: float  # per-rank bandwidth, one direction (what a ring algorithm sends at)
    efficiency: float = 1.0  # achievable fraction of bytes_per_s; 1.0 = use bytes_per_s as is
    # all-reduce latency: False, a ring's 2(p-1) steps; True, NCCL's choice of ring or double binary tree
    # (2·ceil(log2 p) steps), whichever is shorter (`cost_model.analytical.collective_time_s`)
    tree_all_reduce: bool = False
    # kind -> ((n_bytes, seconds), ...): measured in a compute stream, for groups of table_group_size ranks
    table: dict[str, tuple[tuple[float, float], ...]] | None = field(default=None, hash=False)
    table_group_size: int | None = None
    table_interval_s: float | None = None  # compute before each collective when the table was measured
    sync_table: tuple[tuple[float, float], ...] | None = None  # (interval_s, seconds) of a small all-reduce
    time_factor: float = 1.0  # measured / predicted collective time on this axis (`Calibration`, set by axis_link)
    call_s: float = 0.0  # fixed seconds each collective on this link adds (`Calibration.latency`, set by axis_link)

    def __post_init__(self):
        if not (self.alpha_s >= 0 and math.isfinite(self.alpha_s)):
            raise ValueError(f"Link.alpha_s must be a finite number >= 0 seconds, got {self.alpha_s}")
        if not (self.bytes_per_s > 0 and math.isfinite(self.bytes_per_s)):
            raise ValueError(f"Link.bytes_per_s must be a finite number > 0, got {self.bytes_per_s}")
        if not 0 < self.efficiency <= 1:
            raise ValueError(f"Link.efficiency must be in (0, 1], got {self.efficiency}")
        if not (self.time_factor > 0 and math.isfinite(self.time_factor)):
            raise ValueError(f"Link.time_factor must be a finite number > 0, got {self.time_factor}")
        if not (self.call_s >= 0 and math.isfinite(self.call_s)):
            raise ValueError(f"Link.call_s must be a finite number >= 0 seconds, got {self.call_s}")
        if self.table is None:
            return
        if not (isinstance(self.table_group_size, int) and self.table_group_size > 1):
            raise ValueError(f"Link.table needs table_group_size, the group size it was measured on (> 1), got "
                             f"{self.table_group_size!r}")
        table = {}
        for kind, rows in self.table.items():
            if kind not in TABLE_KINDS:
                raise ValueError(f"Link.table: unknown collective {kind!r}; expected some of {TABLE_KINDS}")
            rows = tuple((float(n), float(t)) for n, t in rows)
            sizes, times = [n for n, _ in rows], [t for _, t in rows]
            if not rows or sizes[0] < 0 or any(b <= a for a, b in zip(sizes, sizes[1:])):
                raise ValueError(f"Link.table[{kind!r}]: message sizes must be >= 0 and strictly increasing, got "
                                 f"{sizes}")
            if any(t < 0 or not math.isfinite(t) for t in times) or any(b < a for a, b in zip(times, times[1:])):
                raise ValueError(f"Link.table[{kind!r}]: times must be finite, >= 0 and non-decreasing in the "
                                 f"message size (make a measured table monotone first), got {times}")
            table[kind] = rows
        object.__setattr__(self, "table", table)
        if self.sync_table is not None:
            rows = tuple((float(d), float(t)) for d, t in self.sync_table)
            intervals, times = [d for d, _ in rows], [t for _, t in rows]
            if (not rows or intervals[0] < 0 or any(b <= a for a, b in zip(intervals, intervals[1:]))
                    or any(t < 0 for t in times) or any(b < a for a, b in zip(times, times[1:]))):
                raise ValueError(f"Link.sync_table: intervals must be >= 0 and strictly increasing, times >= 0 and "
                                 f"non-decreasing, got {rows}")
            if self.table_interval_s is None or self.table_interval_s < 0:
                raise ValueError("Link.sync_table needs table_interval_s, the compute interval the table was measured "
                                 f"at, got {self.table_interval_s!r}")
            object.__setattr__(self, "sync_table", rows)

    @property
    def effective_bytes_per_s(self) -> float:
        return self.bytes_per_s * self.efficiency


@dataclass(frozen=True, kw_only=True)
class Calibration:
    """Measured / predicted time factors (`autopar.tune`): `compute[kind]` per op kind (and "optimizer", the
    optimizer step), `axes[i]` for the collectives on axis i of `mesh_shape` (other mesh shapes take their
    geometric mean), `sync[i]` for its parameter synchronisation, which the timeline overlaps with compute (FSDP's
    gathers, gradient reductions: how much of it a machine really hides; empty: as `axes`; applied by
    `autopar.tune`'s calibrated predictions), `latency[i]` the seconds each collective on axis i costs beyond its
    priced time (a fixed cost per blocking collective: waking and scheduling every rank's threads, which on
    contended CPU cores no message size explains; empty: none). `of` names the cluster they correct
    (`Cluster.name`); `samples` counts the measurements fitted."""

    compute: dict[str, float] = field(default_factory=dict, hash=False)
    axes: tuple[float, ...] = ()
    sync: tuple[float, ...] = ()
    latency: tuple[float, ...] = ()
    mesh_shape: tuple[int, ...] = ()
    of: str = ""
    samples: int = 0
    source: str = ""

    def __post_init__(self):
        object.__setattr__(self, "axes", tuple(float(a) for a in self.axes))
        object.__setattr__(self, "sync", tuple(float(a) for a in self.sync))
        object.__setattr__(self, "latency", tuple(float(a) for a in self.latency))
        object.__setattr__(self, "mesh_shape", tuple(int(d) for d in self.mesh_shape))
        for what, f in [*self.compute.items(), *enumerate(self.axes), *(("sync", f) for f in self.sync)]:
            if not (f > 0 and math.isfinite(f)):
                raise ValueError(f"Calibration factor {what!r} must be a finite number > 0, got {f}")
        for i, s in enumerate(self.latency):
            if not (s >= 0 and math.isfinite(s)):
                raise ValueError(f"Calibration.latency[{i}] must be a finite number >= 0 seconds, got {s}")
        for what, fs in (("axes", self.axes), ("sync", self.sync), ("latency", self.latency)):
            if fs and len(fs) != len(self.mesh_shape):
                raise ValueError(f"Calibration.{what} has {len(fs)} factors for mesh {self.mesh_shape}; give one "
                                 "per mesh axis")

    def axis_factor(self, mesh_shape: tuple[int, ...], axis_index: int) -> float:
        return _per_axis(self.axes, self.mesh_shape, mesh_shape, axis_index)

    def sync_factor(self, mesh_shape: tuple[int, ...], axis_index: int) -> float:
        if not self.sync:
            return self.axis_factor(mesh_shape, axis_index)
        return _per_axis(self.sync, self.mesh_shape, mesh_shape, axis_index)

    def latency_s(self, mesh_shape: tuple[int, ...], axis_index: int) -> float:
        """Seconds each collective on the axis adds; another mesh shape takes the mean over the fitted axes."""
        if not self.latency:
            return 0.0
        if tuple(mesh_shape) == self.mesh_shape:
            return self.latency[axis_index]
        return sum(self.latency) / len(self.latency)

    def to_json(self) -> str:
        return json.dumps({**dataclasses.asdict(self), "format": _CAL_FORMAT}, indent=2, sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> "Calibration":
        data = json.loads(text)
        if not isinstance(data, dict) or data.pop("format", None) != _CAL_FORMAT:
            raise ValueError(f"not an autopar calibration: expected format {_CAL_FORMAT!r}")
        data.pop("fits", None)  # the measurements it was fitted on (`autopar.tune` keeps them to refit)
        return cls(**data)


def _per_axis(factors: tuple[float, ...], fitted: tuple[int, ...], mesh_shape: tuple[int, ...], i: int) -> float:
    if not factors:
        return 1.0
    if tuple(mesh_shape) == fitted:
        return factors[i]
    return math.exp(sum(math.log(a) for a in factors) / len(factors))


_CAL_FORMAT = "autopar.calibration/1"


@dataclass(frozen=True, kw_only=True)
class Cluster:
    """Per-device compute, memory and the links between devices; see the module docstring."""

    name: str
    gpus_per_node: int  # devices per node (ranks per host for CPU/gloo)
    peak_flops: dict[str, float]  # dtype name -> dense FLOP/s
    memory_bytes_per_s: float  # device memory bandwidth (HBM; DRAM per rank on a CPU host)
    device_memory_bytes: int  # capacity per device
    intra_node: Link
    inter_node: Link
    source: str  # where the numbers come from
    flops_efficiency: float = 1.0  # achievable fraction of peak_flops
    memory_efficiency: float = 1.0  # achievable fraction of memory_bytes_per_s
    mesh_shape: tuple[int, ...] | None = None  # the mesh a profile measured (with axis_links)
    axis_links: tuple[Link | None, ...] = ()  # measured link per axis of mesh_shape (None: size-1 axis)
    # per-op-kind compute, measured by a profile; None: the roofline (peak_flops, memory_bytes_per_s)
    matmul_table: dict[str, tuple[tuple[float, float], ...]] | None = field(default=None, hash=False)
    sdpa_flops: dict[str, float] | None = None  # dtype -> fused-attention FLOP/s (forward + backward)
    # dtype -> ((sequence length, FLOP/s), ...): fused attention by its key length (presets: achieved rates)
    sdpa_table: dict[str, tuple[tuple[float, float], ...]] | None = field(default=None, hash=False)
    vector_bytes_per_s: float | None = None  # elementwise / reduction ops: bytes read + written per second
    copy_bytes_per_s: float | None = None  # pure data movement ops: bytes read + written per second
    op_overhead_s: float | None = None  # framework time per op dispatched
    calibration: Calibration | None = None  # measured / predicted corrections (`autopar.tune`)
    # compute overlapped by communication runs this much slower (NCCL's kernels take SMs: `autopar.timeline`)
    overlap_slowdown: float = 0.0

    def __post_init__(self):
        if self.gpus_per_node < 1:
            raise ValueError(f"cluster {self.name!r}: gpus_per_node must be >= 1, got {self.gpus_per_node}")
        if not self.peak_flops:
            raise ValueError(f"cluster {self.name!r}: peak_flops is empty; give at least one dtype, e.g. "
                             "{'float32': 1e12}")
        for dtype, flops in self.peak_flops.items():
            if not (flops > 0 and math.isfinite(flops)):
                raise ValueError(f"cluster {self.name!r}: peak_flops[{dtype!r}] must be > 0, got {flops}")
        if not self.memory_bytes_per_s > 0 or not self.device_memory_bytes > 0:
            raise ValueError(f"cluster {self.name!r}: memory_bytes_per_s and device_memory_bytes must be > 0, "
                             f"got {self.memory_bytes_per_s} and {self.device_memory_bytes}")
        if not 0 <= self.overlap_slowdown < 10:
            raise ValueError(f"cluster {self.name!r}: overlap_slowdown must be in [0, 10), got {self.overlap_slowdown}")
        for name in ("flops_efficiency", "memory_efficiency"):
            if not 0 < getattr(self, name) <= 1:
                raise ValueError(f"cluster {self.name!r}: {name} must be in (0, 1], got {getattr(self, name)}")
        for name in ("vector_bytes_per_s", "copy_bytes_per_s"):
            v = getattr(self, name)
            if v is not None and not (v > 0 and math.isfinite(v)):
                raise ValueError(f"cluster {self.name!r}: {name} must be None or > 0, got {v}")
        if self.op_overhead_s is not None and not (self.op_overhead_s >= 0 and math.isfinite(self.op_overhead_s)):
            raise ValueError(f"cluster {self.name!r}: op_overhead_s must be None or >= 0 seconds, got "
                             f"{self.op_overhead_s}")
        if self.matmul_table is not None:
            table = {}
            for dtype, rows in self.matmul_table.items():
                rows = tuple((float(f), float(r)) for f, r in rows)
                if not rows or any(f <= 0 or r <= 0 for f, r in rows) or any(b[0] <= a[0] for a, b in zip(rows, rows[1:])):
                    raise ValueError(f"cluster {self.name!r}: matmul_table[{dtype!r}] needs (flops per call, FLOP/s) "
                                     f"rows with both > 0 and the flops strictly increasing, got {rows}")
                table[dtype] = rows
            object.__setattr__(self, "matmul_table", table)
        if self.sdpa_table is not None:
            table = {}
            for dtype, rows in self.sdpa_table.items():
                rows = tuple((float(n), float(r)) for n, r in rows)
                if not rows or any(n <= 0 or r <= 0 for n, r in rows) or any(b[0] <= a[0] for a, b in zip(rows, rows[1:])):
                    raise ValueError(f"cluster {self.name!r}: sdpa_table[{dtype!r}] needs (sequence length, FLOP/s) rows "
                                     f"with both > 0 and the lengths strictly increasing, got {rows}")
                table[dtype] = rows
            object.__setattr__(self, "sdpa_table", table)
        for dtype, flops in (self.sdpa_flops or {}).items():
            if not (flops > 0 and math.isfinite(flops)):
                raise ValueError(f"cluster {self.name!r}: sdpa_flops[{dtype!r}] must be > 0, got {flops}")
        if self.axis_links and (self.mesh_shape is None or len(self.axis_links) != len(self.mesh_shape)):
            raise ValueError(f"cluster {self.name!r}: axis_links has {len(self.axis_links)} entries but mesh_shape "
                             f"is {self.mesh_shape}; give one link (or None) per mesh axis")

    def peak_flops_for(self, dtype) -> float:
        """Achievable FLOP/s for a dtype (name or torch.dtype): peak * flops_efficiency.

        Integer and bool dtypes (index arithmetic, masks) use the float32 entry."""
        name = dtype_name(dtype)
        if name not in self.peak_flops:
            if not _is_floating(name) and "float32" in self.peak_flops:
                name = "float32"
            else:
                raise ValueError(
                    f"cluster {self.name!r} has no peak FLOP/s for dtype {name!r}; it knows "
                    f"{sorted(self.peak_flops)}. Fix: profile that dtype (autopar.profile(mesh, "
                    f"dtypes=({name!r}, ...))) or add it to peak_flops.")
        return self.peak_flops[name] * self.flops_efficiency

    @property
    def effective_memory_bytes_per_s(self) -> float:
        return self.memory_bytes_per_s * self.memory_efficiency

    def to_json(self) -> str:
        data = dataclasses.asdict(self)
        data["format"] = _FORMAT
        return json.dumps(data, indent=2, sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> "Cluster":
        """The Cluster `to_json` wrote; a ValueError saying what is wrong with anything else."""
        try:
            data = json.loads(text)
        except json.JSONDecodeError as e:
            raise ValueError(f"not valid JSON ({e.msg} at line {e.lineno}, column {e.colno}; a truncated file?)") \
                from None
        fmt = data.pop("format", None) if isinstance(data, dict) else None
        if fmt != _FORMAT:
            raise ValueError(f"not an autopar cluster profile: format is {fmt!r}, expected {_FORMAT!r}")
        try:
            data["intra_node"] = Link(**data["intra_node"])
            data["inter_node"] = Link(**data["inter_node"])
            if data.get("mesh_shape") is not None:
                data["mesh_shape"] = tuple(data["mesh_shape"])
            data["axis_links"] = tuple(None if x is None else Link(**x) for x in data.get("axis_links", ()))
            if data.get("calibration") is not None:
                data["calibration"] = Calibration(**data["calibration"])
            return cls(**data)
        except KeyError as e:
            raise ValueError(f"field {e.args[0]!r} is missing") from None
        except TypeError as e:
            raise ValueError(f"its fields do not make a Cluster: {e}") from None


def dtype_name(dtype) -> str:
    """'bfloat16' for torch.bfloat16 or 'bfloat16'."""
    return str(dtype).removeprefix("torch.")


def _is_floating(name: str) -> bool:
    return "float" in name or name in ("half", "double")


# ----------------------------------------------------------------------------------------- presets
# Interconnect latencies (alpha) are not on any datasheet: they are order-of-magnitude values for
# one NCCL ring step (a few microseconds over NVLink, more across an InfiniBand fabric). Measure
# them with `python -m autopar profile` when they matter (small messages).
_NVLINK_ALPHA_S = 2e-6  # assumed
_IB_ALPHA_S = 5e-6  # assumed

_H100_FLOPS = {
    # NVIDIA H100 Tensor Core GPU datasheet, SXM5 column (dense = half the "with sparsity" figures):
    "bfloat16": 989e12,  # BF16 Tensor Core 1,979 TFLOPS with sparsity -> 989 dense
    "float16": 989e12,  # FP16 Tensor Core 1,979 TFLOPS with sparsity -> 989 dense
    "float32": 67e12,  # FP32 (non-tensor-core; TF32 would be 494.5 dense)
    "float64": 67e12,  # FP64 Tensor Core 67 TFLOPS
    # FP8 Tensor Core 3,958 TFLOPS with sparsity -> 1,979 dense; the `_scaled_mm` of each float8 recipe
    # (`autopar.forms.float8`) is a separate key: they reach different fractions of it (`_FP8_ACHIEVED`)
    "float8_tensorwise": 1979e12,
    "float8_rowwise": 1979e12,
}

# Achieved, not peak, rates of the GPU presets (a profile of the real cluster replaces them all):
#
# - Matmul (`_matmul_table`): the best a bf16/fp16 matmul reaches is the "maximum achievable matmul FLOPS"
#   (MAMF) that mamf-finder.py measured over thousands of shapes (S. Bekman, "Machine Learning Engineering",
#   compute/accelerator/README.md, MAMF table, BF16: H100 SXM 794.5 of 989 TFLOPS = 80.3%, A100 SXM 271.2 of
#   312 = 86.9%). Smaller matmuls run slower: a call of f FLOPs takes f / MAMF + T0, T0 the fixed time of a
#   kernel (launch, prologue and the last partial wave of tiles; assumed 8 us, the order of one CUDA kernel
#   launch plus a cuBLAS epilogue), so the rate f / (f / MAMF + T0) rises monotonically with the size. fp32
#   (no TF32) and fp64 run on the CUDA cores at the datasheet figure, reached only by large matmuls alike.
# - Fused attention (`_sdpa_table`, by key length): FlashAttention-2 (PyTorch's flash SDPA backend) reaches
#   "up to 335 TFLOPs/s" forward + backward on H100 (Dao 2023, FlashAttention-2, §4.1) and ~70% of peak on
#   A100 at long sequences (same paper: "up to 73%" of 312); short sequences run slower (its Fig. 4-6: at 512
#   tokens about 2/3 of the 16k rate): rate(s) = best · s / (s + 256). FlashAttention counts the backward as
#   2.5x the forward (5 matmuls of 2), autopar as 2x (`estimate.compute_s`: 3x the forward), so the rate in
#   autopar's count is best · 3 / 3.5.
# - Collectives: nccl-tests bus bandwidth on 8 H100 SXM over NVLink is 460-480 GB/s for all_reduce at large
#   sizes (the datasheet's 450 GB/s per direction holds); across nodes with one 400 Gb/s NDR NIC per GPU, a
#   group holding all 8 GPUs of each node reaches 400-450 GB/s (every GPU's NIC carries a share: NCCL runs one
#   ring per NIC), a group with one GPU per node a NIC's 50 GB/s (`axis_link` maps a mesh axis to this).
#   All-reduce latency is NCCL's ring or double binary tree, whichever is shorter (NCCL 2.4 "Massively scale
#   your deep learning training with NCCL 2.4", NVIDIA blog 2019: trees give logarithmic latency).
# - Elementwise and copy kernels (`vector_bytes_per_s`, `copy_bytes_per_s`: eager PyTorch runs each pointwise op,
#   reduction and cast as its own kernel, priced by the bytes it reads and writes): a device-to-device copy on H100
#   SXM moves 2,903 GB/s, 86.7% of the 3,350 GB/s HBM3 peak (Voltage Park / Georgia Tech H100 cluster benchmark,
#   github.com/aigatech/vpbenchmarking: "GPU D2D (HBM3) 2,903 GB/s, 86.7% of HBM3 peak"); the presets take that fraction of their datasheet bandwidth.
# - Communication slowing compute (`overlap_slowdown`): overlapping collectives with compute slowed the compute by
#   18.9% on average (40% at most) against the same compute alone, measured on H100 and A100 with GPT and Llama
#   training (Lee et al. 2025, "Characterizing Compute-Communication Overlap in GPU-Accelerated Distributed Deep
#   Learning: Performance and Power Implications", arXiv 2507.03114): NCCL's kernels occupy SMs (and power) the
#   compute kernels then lack.
# - FP8 `_scaled_mm` (`_FP8_ACHIEVED`, of the FP8 dense peak): torchao measured one H100's achieved fractions of the
#   peaks at large shapes, bf16 0.69 and fp8 0.78 (`torchao/testing/training/roofline_utils.py`, "NVIDIA H100":
#   `pct_achievable_gemm_tops_bf16` / `_fp8`, "based on experimental observation with sample large inputs"): fp8
#   reaches 0.78 / 0.69 = 1.13x the fraction bf16 does. Against bf16's MAMF (80.3%, above), tensorwise (cuBLAS)
#   is put at 0.803 x 1.13 = 0.908 of the fp8 peak [derived]. Rowwise (CUTLASS, a scale per row) is slower: torchao's
#   published Llama3-8B FSDP2 runs on 8 H100 (docs/source/workflows/training.md: bf16 6,150, tensorwise 7,689.5 =
#   +25.0%, rowwise 6,768 = +10.1% tok/s) put it at 0.625 of the fp8 peak [derived: the rate at which this cost
#   model's step gains what that run gained on its shapes, bs 1, seq 8192, selective AC; no kernel rate published].
_T0_S = 8e-6  # assumed fixed time of one matmul kernel (see above)
_FP8_ACHIEVED = {"float8_tensorwise": 794.5 / 989 * 0.78 / 0.69, "float8_rowwise": 0.625}
_HBM_ACHIEVED = 2903 / 3350  # D2D copy / datasheet HBM bandwidth, H100 SXM (see above)
_OVERLAP_SLOWDOWN = 0.189  # compute slowdown under overlapped communication (Lee et al. 2025, see above)


def _matmul_table(peak: dict[str, float], mamf: float) -> dict[str, tuple[tuple[float, float], ...]]:
    """(flops per call, achieved FLOP/s) rows from 1 MFLOP to 10 PFLOP per call: f / (f / best + T0)."""
    sizes = [10.0 ** e for e in range(6, 17)]
    out = {}
    for dtype, flops in peak.items():
        best = flops * mamf if dtype in ("bfloat16", "float16") else flops * _FP8_ACHIEVED.get(dtype, 1.0)
        out[dtype] = tuple((f, f / (f / best + _T0_S)) for f in sizes)
    return out


def _sdpa_table(best_fa_count: float, dtypes=("bfloat16", "float16")) -> dict[str, tuple[tuple[float, float], ...]]:
    """(key length, FLOP/s in autopar's count) rows from 128 to 1M tokens: best · s / (s + 256) · 3 / 3.5."""
    lengths = [2.0 ** e for e in range(7, 21)]
    return {dt: tuple((s, best_fa_count * 3 / 3.5 * s / (s + 256)) for s in lengths) for dt in dtypes}


def _h100_like(name: str, *, peak: dict[str, float], mamf: float, memory_bytes_per_s: float, device_memory_bytes: int,
               source: str) -> Cluster:
    """An HGX/DGX H100-class node: 8 GPUs on NVLink 4, one 400 Gb/s NDR port per GPU, achieved rates above."""
    return Cluster(
        name=name,
        gpus_per_node=8,  # DGX/HGX H100: 8 GPUs per node
        peak_flops=dict(peak),
        memory_bytes_per_s=memory_bytes_per_s,
        device_memory_bytes=device_memory_bytes,
        # H100 SXM datasheet: NVLink 900 GB/s total (both directions) -> 450 GB/s per direction
        intra_node=Link(alpha_s=_NVLINK_ALPHA_S, bytes_per_s=450 * GB, tree_all_reduce=True),
        # DGX H100: one ConnectX-7 400 Gb/s NDR InfiniBand port per GPU -> 50 GB/s per direction
        inter_node=Link(alpha_s=_IB_ALPHA_S, bytes_per_s=50 * GB, tree_all_reduce=True),
        source=source,
        matmul_table=_matmul_table(peak, mamf),
        # FlashAttention-2 on H100 SXM (see above), at the same fraction of a part's bf16 peak
        sdpa_table=_sdpa_table(335e12 * peak["bfloat16"] / _H100_FLOPS["bfloat16"]),
        vector_bytes_per_s=memory_bytes_per_s * _HBM_ACHIEVED,
        copy_bytes_per_s=memory_bytes_per_s * _HBM_ACHIEVED,
        overlap_slowdown=_OVERLAP_SLOWDOWN,
    )


_MAMF_H100 = 794.5 / 989  # MAMF table, H100 SXM bf16 (see above)

PRESETS: dict[str, Cluster] = {
    "h100": _h100_like(
        "h100", peak=_H100_FLOPS, mamf=_MAMF_H100,
        memory_bytes_per_s=3.35e12,  # H100 SXM datasheet: HBM3 3.35 TB/s
        device_memory_bytes=80 * 10**9,  # H100 SXM datasheet: 80 GB (decimal; torch reports about 79 GiB usable)
        source="NVIDIA H100 Tensor Core GPU datasheet (SXM5), DGX H100 (8x ConnectX-7 NDR 400 Gb/s); achieved "
               "matmul (MAMF), FlashAttention-2 and NCCL rates as cited in cost_model/hardware.py; alphas assumed"),
    # The H100 that torchtitan's published runs used (Meta Grand Teton): 96 GB HBM2e at 2.4 TB/s, 500 W power limit;
    # torchtitan docs (benchmarks/llama3_h100_202412_torchtitan.md): "the actual peak TFLOPs number is between SXM and
    # NVL, and we don't know its exact value". Peak: the middle of SXM (989) and NVL (835: H100 NVL datasheet, BF16
    # 1,671 TFLOPS with sparsity) bf16, which halves the largest error either end could make; the same achieved
    # fraction of it (MAMF) as the SXM part.
    "h100_hbm2e": _h100_like(
        "h100_hbm2e", peak={**_H100_FLOPS, "bfloat16": 912e12, "float16": 912e12,  # FP8 at the same fraction of SXM
                            "float8_tensorwise": 1979e12 * 912 / 989, "float8_rowwise": 1979e12 * 912 / 989},
        mamf=_MAMF_H100,
        memory_bytes_per_s=2.4e12, device_memory_bytes=96 * 10**9,
        source="H100 96 GB HBM2e 2.4 TB/s, 500 W (torchtitan's Grand Teton hosts, 400 Gb/s RDMA per GPU); peak between "
               "the H100 SXM and NVL datasheets; achieved rates as the h100 preset"),
    "h200": _h100_like(
        "h200", peak=_H100_FLOPS, mamf=_MAMF_H100,  # H200 SXM datasheet: same Tensor Core figures as H100 SXM
        memory_bytes_per_s=4.8e12,  # H200 SXM datasheet: HBM3e 4.8 TB/s
        device_memory_bytes=141 * 10**9,  # H200 SXM datasheet: 141 GB
        source="NVIDIA H200 Tensor Core GPU datasheet (SXM), HGX H200 with 400 Gb/s NDR InfiniBand per GPU; achieved "
               "rates as the h100 preset; alphas assumed"),
    "a100": Cluster(
        name="a100",
        gpus_per_node=8,  # DGX A100: 8 GPUs per node
        peak_flops={
            # NVIDIA A100 Tensor Core GPU datasheet, A100 80GB SXM column:
            "bfloat16": 312e12,  # BF16 Tensor Core 312 TFLOPS (624 with sparsity)
            "float16": 312e12,  # FP16 Tensor Core 312 TFLOPS
            "float32": 19.5e12,  # FP32 19.5 TFLOPS (TF32 would be 156)
            "float64": 19.5e12,  # FP64 Tensor Core 19.5 TFLOPS
        },
        memory_bytes_per_s=2.039e12,  # A100 80GB SXM datasheet: HBM2e 2,039 GB/s
        device_memory_bytes=80 * 10**9,  # 80 GB
        # A100 datasheet: NVLink 600 GB/s (both directions) -> 300 GB/s per direction
        intra_node=Link(alpha_s=_NVLINK_ALPHA_S, bytes_per_s=300 * GB, tree_all_reduce=True),
        # DGX A100: one ConnectX-6 200 Gb/s HDR InfiniBand port per GPU -> 25 GB/s per direction
        inter_node=Link(alpha_s=_IB_ALPHA_S, bytes_per_s=25 * GB, tree_all_reduce=True),
        source="NVIDIA A100 Tensor Core GPU datasheet (80GB SXM), DGX A100 (8x ConnectX-6 HDR 200 Gb/s); achieved "
               "matmul (MAMF 271.2/312) and FlashAttention-2 (73% of peak) rates as cited; alphas assumed",
        matmul_table=_matmul_table({"bfloat16": 312e12, "float16": 312e12, "float32": 19.5e12, "float64": 19.5e12},
                                   271.2 / 312),
        sdpa_table=_sdpa_table(0.73 * 312e12),  # FlashAttention-2 paper: up to 73% of A100 peak
        vector_bytes_per_s=2.039e12 * _HBM_ACHIEVED,  # the H100's achieved fraction of HBM (see above)
        copy_bytes_per_s=2.039e12 * _HBM_ACHIEVED,
        overlap_slowdown=_OVERLAP_SLOWDOWN,  # measured on A100 and H100 (see above)
    ),
    # A small CPU host running one gloo rank per core (OMP_NUM_THREADS=1). The numbers are about
    # half of what `torchrun --nproc-per-node 2 -m autopar profile` measured on a 2-core AMD EPYC VM
    # (KVM, torch 2.13, 2 ranks): matmul fp32 101-107 GFLOP/s, bf16 444 (avx512_bf16; CPUs without
    # it are far slower), fp16 3 (no fast kernel), fp64 55; copy 53-60 GB/s (read + write); gloo
    # all_reduce over loopback alpha 72-115 us per step, 1.2-3.3 GB/s per rank (4 ranks on the 2
    # cores: 119-154 us, 1.7-2.1 GB/s).
    "cpu": Cluster(
        name="cpu",
        gpus_per_node=8,  # ranks per host
        peak_flops={"bfloat16": 100e9, "float16": 1e9, "float32": 50e9, "float64": 25e9},
        memory_bytes_per_s=20e9,
        device_memory_bytes=8 * 2**30,  # per rank
        intra_node=Link(alpha_s=200e-6, bytes_per_s=1e9),  # gloo over loopback
        # assumed: TCP over 10 GbE (1.25 GB/s) shared by 8 ranks per host
        inter_node=Link(alpha_s=500e-6, bytes_per_s=1.25e9 / 8),
        source="conservative CPU/gloo host: about half of the numbers measured on a 2-core AMD EPYC VM "
               "(1 thread per rank, gloo over loopback); inter-node assumed 10 GbE",
    ),
}

_GPU_NAMES = (("h200", "h200"), ("h100", "h100"), ("a100", "a100"))  # h100_hbm2e: by name only  # substring of get_device_name() -> preset


# ---------------------------------------------------------------------------------------- loading
def device_name() -> str:
    """This process' device as used in profile file names: 'cpu' or the CUDA name, slugged."""
    import torch

    if not torch.cuda.is_available():
        return "cpu"
    return re.sub(r"[^a-z0-9]+", "-", torch.cuda.get_device_name().lower()).strip("-")


def default_profile_path(mesh_shape: tuple[int, ...], device: str | None = None) -> Path:
    """Where `autopar.profile` caches a profile and `load_cluster(None, mesh_shape)` looks for it."""
    root = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "autopar"
    mesh = "x".join(str(int(s)) for s in mesh_shape)
    return root / f"profile-{device or device_name()}-{mesh}.json"


def _cached_profile(mesh_shape: tuple[int, ...] | None) -> Path | None:
    """The cached profile for this device and mesh shape; else one for a mesh with as many devices."""
    if mesh_shape is None:
        return None
    exact = default_profile_path(mesh_shape)
    if exact.is_file():
        return exact
    world = math.prod(mesh_shape)
    prefix = f"profile-{device_name()}-"
    for path in sorted(exact.parent.glob(prefix + "*.json")):
        dims = path.stem.removeprefix(prefix).split("x")
        if all(d.isdigit() for d in dims) and math.prod(int(d) for d in dims) == world:
            return path
    return None


def _preset_for_this_machine() -> Cluster:
    import torch

    if not torch.cuda.is_available():
        return PRESETS["cpu"]
    gpu = torch.cuda.get_device_name()
    for needle, preset in _GPU_NAMES:
        if needle in gpu.lower():
            return PRESETS[preset]
    warnings.warn(
        f"autopar has no hardware preset for {gpu!r} (presets: {sorted(PRESETS)}); planning with the "
        "'a100' preset. Fix: run `torchrun --nproc-per-node N -m autopar profile` once on this machine "
        "(the profile is cached and used from then on), or pass a preset name.", stacklevel=3)
    return PRESETS["a100"]


def check_cluster_spec(spec) -> None:
    """A TypeError unless `spec` is something `load_cluster` takes."""
    if spec is not None and not isinstance(spec, (str, os.PathLike, Cluster)):
        raise TypeError(f"cluster must be a preset name ({', '.join(map(repr, sorted(PRESETS)))}), a path to a JSON "
                        f"profile written by `python -m autopar profile`, a Cluster, or None (this machine's cached "
                        f"profile or preset); got {type(spec).__name__} {spec!r}")


def calibration_path(profile: "str | os.PathLike") -> Path:
    """Where the calibration of the profile at `profile` is saved (`autopar.tune`) and loaded."""
    profile = Path(profile)
    return profile.with_name(profile.name.removesuffix(".json") + ".calibration.json")


def _calibrated(cluster: Cluster, profile: Path | None) -> Cluster:
    """`cluster` with the calibration saved beside `profile`, when there is one for this cluster."""
    path = calibration_path(profile) if profile is not None else None
    if path is None or not path.is_file():
        return cluster
    try:
        cal = Calibration.from_json(path.read_text())
    except (OSError, ValueError, TypeError) as e:
        warnings.warn(f"the calibration {str(path)!r} is not valid ({e}); pricing without it. Fix: tune again "
                      "(autopar.tune rewrites it) or delete the file.", stacklevel=3)
        return cluster
    return dataclasses.replace(cluster, calibration=cal) if cal.of == cluster.name else cluster


def load_cluster(spec: "str | os.PathLike | Cluster | None" = None,
                 mesh_shape: tuple[int, ...] | None = None) -> Cluster:
    """A `Cluster` from a preset name, a Cluster, a JSON profile path, or None (see module docstring)."""
    if isinstance(spec, Cluster):
        return spec
    check_cluster_spec(spec)
    if spec is None:
        cluster, profile = _this_machine(mesh_shape)
        return _calibrated(cluster, profile)
    if isinstance(spec, str) and spec.lower() in PRESETS:
        return PRESETS[spec.lower()]
    path = Path(spec)
    return _calibrated(_load_path(spec, path), path)


def profile_of(mesh_shape: tuple[int, ...] | None) -> Path | None:
    """The profile `load_cluster(None, mesh_shape)` reads, or where this machine's profile would be (beside
    which its calibration is saved); None without a mesh shape."""
    if mesh_shape is None:
        return None
    return _cached_profile(tuple(mesh_shape)) or default_profile_path(tuple(mesh_shape))


def _this_machine(mesh_shape) -> tuple[Cluster, Path | None]:
    """This machine's cached profile for the mesh (else its preset), and the profile path its calibration is
    beside."""
    cached = _cached_profile(tuple(mesh_shape) if mesh_shape is not None else None)
    if cached is not None:
        try:
            return Cluster.from_json(cached.read_text()), cached
        except (OSError, ValueError) as e:
            preset = _preset_for_this_machine()
            warnings.warn(f"the cached cluster profile {str(cached)!r} is not a valid autopar profile ({e}); "
                          f"planning with the {preset.name!r} preset instead. Fix: measure again with `torchrun "
                          "--nproc-per-node N -m autopar profile` (it rewrites the file), or delete the file.",
                          stacklevel=3)
            return preset, None
    return _preset_for_this_machine(), profile_of(mesh_shape)


def _load_path(spec, path: Path) -> Cluster:
    if path.suffix == ".json" or path.is_file():
        if not path.is_file():
            raise ValueError(f"cluster profile {str(path)!r} does not exist; write one with "
                             f"`torchrun --nproc-per-node N -m autopar profile --out {path}`")
        try:
            return Cluster.from_json(path.read_text())
        except (ValueError, OSError) as e:
            raise ValueError(f"cluster profile {str(path)!r} is not a valid autopar profile: {e}. Fix: write it again "
                             f"with `torchrun --nproc-per-node N -m autopar profile --out {path}`, or pass a preset "
                             f"name ({', '.join(map(repr, sorted(PRESETS)))})") from None
    raise ValueError(f"unknown cluster {spec!r}: expected one of the presets {sorted(PRESETS)}, a path to a JSON "
                     "profile written by `python -m autopar profile`, a Cluster, or None (auto-detect)")


def axis_link(cluster: Cluster, mesh_shape: tuple[int, ...], axis_index: int) -> Link:
    """The link a collective along mesh axis `axis_index` runs over (see the module docstring)."""
    mesh_shape = tuple(int(s) for s in mesh_shape)
    if not -len(mesh_shape) <= axis_index < len(mesh_shape):
        raise ValueError(f"mesh axis {axis_index} does not exist in a mesh of shape {mesh_shape}")
    axis_index %= len(mesh_shape)
    if cluster.mesh_shape == mesh_shape and cluster.axis_links and cluster.axis_links[axis_index] is not None:
        link = cluster.axis_links[axis_index]
    else:
        span = math.prod(mesh_shape[axis_index:])  # ranks covered by one group and the faster axes inside it
        if span <= cluster.gpus_per_node:
            link = cluster.intra_node
        else:
            stride = span // mesh_shape[axis_index]
            per_node = max(1, min(mesh_shape[axis_index], cluster.gpus_per_node // stride))  # its GPUs in one node
            inter, intra = cluster.inter_node, cluster.intra_node
            link = inter if per_node == 1 else dataclasses.replace(
                inter, bytes_per_s=min(per_node * inter.bytes_per_s, intra.bytes_per_s))
    if cluster.calibration is not None:
        cal = cluster.calibration
        link = dataclasses.replace(link, time_factor=cal.axis_factor(mesh_shape, axis_index),
                                   call_s=cal.latency_s(mesh_shape, axis_index))
    return link
