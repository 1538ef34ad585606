"""Analytical costs: collectives (alpha-beta, ring algorithms), compute (roofline), FLOPs and
bytes per fx node.

Collectives (`collective_time_s`, `send_bytes`), group size p, link alpha (s) and bandwidth bw
(bytes/s per rank, one direction, times `Link.efficiency`). `n` is in bytes and means:

| kind             | n is                                | per-rank send | time                           |
|------------------|-------------------------------------|---------------|--------------------------------|
| "all_reduce"     | the tensor reduced (same on all)    | 2(p-1)/p · n  | 2(p-1)/p · n/bw + 2(p-1)·alpha |
| "all_gather"     | the FULL gathered output (p shards) | (p-1)/p · n   | (p-1)/p · n/bw + (p-1)·alpha   |
| "reduce_scatter" | the FULL input reduced (n/p out)    | (p-1)/p · n   | (p-1)/p · n/bw + (p-1)·alpha   |
| "all_to_all"     | the local buffer on one rank        | (p-1)/p · n   | (p-1)/p · n/bw + (p-1)·alpha   |
| "p2p"            | the block one rank sends            | n             | n/bw + alpha                   |

A group of size 1 costs nothing. Ring algorithms; on a link with `tree_all_reduce` (NCCL) an
all-reduce's latency is the shorter of the ring's 2(p-1)·alpha and the double binary tree's
2·ceil(log2 p)·alpha (NCCL picks the algorithm by size; the bandwidth term is the ring's). Every time is
multiplied by `Link.time_factor` and `Link.call_s` added to it (a calibration, `autopar.tune`: measured / predicted,
and a fixed cost per collective). When the link carries a measured table for the kind and the group size
(`Link.table`, written by `autopar.profile`), the time is interpolated from it instead: log-log
between measured sizes, the smallest size's time below them, and the last segment's slope
(seconds per byte) above them. Given `interval_s`, the compute before the collective, the time
moves by `sync(interval_s) - sync(Link.table_interval_s)` (`Link.sync_table`, linear between
measured intervals, flat beyond them), never below zero.

Compute (`compute_time_s`), roofline: `max(flops / (peak_flops[dtype]·flops_efficiency),
bytes / (memory_bytes_per_s·memory_efficiency))`.

Compute by op kind (`kernel_time_s`), for clusters whose profile measured per-kind rates
(`Cluster.sdpa_flops`, `vector_bytes_per_s`, `copy_bytes_per_s`, `op_overhead_s`): each node has a
kind (`NodeCost.kind`) and the work of each kind is priced at that kind's rate, plus
`op_overhead_s` per op (views are free):
- "matmul": flops / the matmul rate for the size of one call (`Cluster.matmul_table`, log-linear
  in the flops per call between measured sizes, flat outside them; `peak_flops[dtype]` without a
  table for the dtype);
- "sdpa": flops / the rate for its key length (`Cluster.sdpa_table`, log-linear in the length between
  rows, flat outside), else flops / sdpa_flops[dtype];
- "vector" (pointwise, reductions, norms, softmax, losses): bytes / vector_bytes_per_s;
- "memory" (everything else that moves data: copies, concatenation, embedding gathers): bytes /
  copy_bytes_per_s.
A kind whose rate the cluster lacks falls back to the roofline of that kind's work.

FLOPs and bytes of one fx node (`node_cost`), from the global shapes in `node.meta["val"]`:
- matmuls (`linear`, `mm`, `addmm`, `bmm`, `baddbmm`, `matmul`): `2·M·N·K`, i.e.
  `2 · numel(out) · K` with K the contraction dim. Bias adds are not counted (as FlopCounterMode).
- `scaled_dot_product_attention` (and the fused `_scaled_dot_product_*` kernels):
  `2·B·s_q·s_kv·d + 2·B·s_q·s_kv·d_v` = `4·b·h·s_q·s_kv·d` for B = b·h query heads. With
  `is_causal` it is halved: flash/memory-efficient kernels skip the masked half (FlopCounterMode
  counts the full square). An explicit matmul-softmax-matmul attention is counted as its matmuls.
- bytes of a tensor are its addressed elements (an expanded, stride-0 dim is read once).
- `embedding`: bytes only (read the gathered rows and the indices, write the output).
- pointwise and reduction ops (`torch.Tag.pointwise`/`reduction`, softmax, norms, losses,
  dropout): flops = the largest numel among inputs and outputs; bytes = inputs + outputs
  (`cross_entropy_loss` also writes and reads back its input-sized log-probabilities, as its
  log_softmax + nll_loss decomposition runs).
- views (`view`, `transpose`, `split`, `expand`, ... and `getitem`): free. `to`, `reshape`,
  `flatten` and `contiguous` are views unless they change the dtype or the input's strides do
  not allow a view (then they copy: bytes = in + out).
- everything else: bytes = inputs + outputs, no flops.

Per-form communication volumes (DESIGN.md §3) live with their forms (`autopar.forms`), built on
`send_bytes`, the one formula of a collective's bytes that the estimate, the lowering's plan rows and the
runtime recorder all use.
"""

from __future__ import annotations

import math
import operator
from dataclasses import dataclass

import torch
from torch import fx
from torch.utils import _pytree as pytree

from cost_model.hardware import Cluster, Link, dtype_name

__all__ = [
    "COLLECTIVES", "collective_time_s", "interpolate_table", "send_bytes", "compute_time_s", "KINDS",
    "has_kernel_rates", "matmul_flops_per_s", "sdpa_flops_per_s", "kernel_time_s", "NodeCost", "node_cost",
]

aten = torch.ops.aten

# kind -> (fraction of n each rank sends as a function of p, number of alpha steps)
COLLECTIVES = {
    "all_reduce": (lambda p: 2 * (p - 1) / p, lambda p: 2 * (p - 1)),
    "all_gather": (lambda p: (p - 1) / p, lambda p: p - 1),
    "reduce_scatter": (lambda p: (p - 1) / p, lambda p: p - 1),
    "all_to_all": (lambda p: (p - 1) / p, lambda p: p - 1),
    "p2p": (lambda p: 1.0, lambda p: 1),
}


def _collective(kind: str):
    try:
        return COLLECTIVES[kind]
    except KeyError:
        raise ValueError(f"unknown collective {kind!r}; expected one of {sorted(COLLECTIVES)}") from None


def send_bytes(kind: str, numel_bytes: int, group_size: int) -> float:
    """Bytes one rank sends for a collective over `group_size` ranks (n as in the module table)."""
    fraction, _ = _collective(kind)
    if group_size < 1:
        raise ValueError(f"group_size must be >= 1, got {group_size}")
    return 0.0 if group_size == 1 else fraction(group_size) * numel_bytes


def collective_time_s(kind: str, numel_bytes: int, group_size: int, link: Link, *,
                      interval_s: float | None = None) -> float:
    """Time of a collective: interpolated from the link's measured table when it has one for this kind
    and group size (adjusted for `interval_s` of compute before it when the link measured that), else
    alpha-beta of a ring (module table): send_bytes / bw + steps · alpha."""
    _, steps = _collective(kind)
    if group_size == 1:
        return 0.0
    if link.table and kind in link.table and link.table_group_size == group_size:
        t = interpolate_table(link.table[kind], numel_bytes)
        if interval_s is not None and link.sync_table:
            t += _piecewise_linear(link.sync_table, interval_s) - _piecewise_linear(link.sync_table,
                                                                                     link.table_interval_s)
        return max(t, 0.0) * link.time_factor + link.call_s
    n_steps = steps(group_size)
    if kind == "all_reduce" and link.tree_all_reduce:
        n_steps = min(n_steps, 2 * math.ceil(math.log2(group_size)))
    return (send_bytes(kind, numel_bytes, group_size) / link.effective_bytes_per_s
            + n_steps * link.alpha_s) * link.time_factor + link.call_s


def _piecewise_linear(rows, x: float) -> float:
    """y at x from ((x, y), ...) rows (x increasing): linear between rows, flat outside them."""
    if x <= rows[0][0]:
        return rows[0][1]
    for (x0, y0), (x1, y1) in zip(rows, rows[1:]):
        if x <= x1:
            return y0 + (y1 - y0) * (x - x0) / (x1 - x0)
    return rows[-1][1]


def interpolate_table(rows, n: float) -> float:
    """Seconds for n bytes from measured ((bytes, seconds), ...) rows (sizes increasing): log-log between
    rows, the first row's time below them, the last segment's seconds per byte above them."""
    if n <= rows[0][0] or len(rows) == 1:
        return rows[0][1]
    for (n0, t0), (n1, t1) in zip(rows, rows[1:]):
        if n > n1:
            continue
        if n == n1 or t0 == t1:  # exact at measured sizes and on flat segments
            return t1
        if n0 > 0 and t0 > 0:
            w = math.log(n / n0) / math.log(n1 / n0)
            return t0 * (t1 / t0) ** w
        return t0 + (t1 - t0) * (n - n0) / (n1 - n0)
    (n0, t0), (n1, t1) = rows[-2], rows[-1]
    return t1 + (t1 - t0) / (n1 - n0) * (n - n1)


def compute_time_s(flops: float, bytes_moved: float, dtype, cluster: Cluster) -> float:
    """Roofline: max(flops / achievable FLOP/s for dtype, bytes / achievable memory bandwidth)."""
    flops_s = flops / cluster.peak_flops_for(dtype) if flops else 0.0
    return max(flops_s, bytes_moved / cluster.effective_memory_bytes_per_s)


KINDS = ("matmul", "sdpa", "vector", "memory")


def has_kernel_rates(cluster: Cluster) -> bool:
    """Whether the cluster has per-op-kind compute rates (a profile, or a GPU preset's achieved rates) rather
    than only a roofline."""
    return any(x is not None for x in (cluster.matmul_table, cluster.sdpa_flops, cluster.sdpa_table,
                                       cluster.vector_bytes_per_s, cluster.copy_bytes_per_s, cluster.op_overhead_s))


def _log_linear(rows, x: float) -> float:
    """y at x from ((x, y), ...) rows (x increasing, > 0): linear in log x between rows, flat outside."""
    if x <= rows[0][0]:
        return rows[0][1]
    for (x0, y0), (x1, y1) in zip(rows, rows[1:]):
        if x <= x1:
            return y0 + (y1 - y0) * math.log(x / x0) / math.log(x1 / x0)
    return rows[-1][1]


def sdpa_flops_per_s(cluster: Cluster, dtype, seq_len: float | None = None) -> float | None:
    """Fused-attention throughput for keys of `seq_len` tokens: the cluster's table by length when it has one for
    the dtype (and the length is known), else its single measured rate; None when it has neither."""
    name = dtype_name(dtype)
    rows = (cluster.sdpa_table or {}).get(name)
    if rows and seq_len:
        return _log_linear(rows, seq_len) * cluster.flops_efficiency
    if cluster.sdpa_flops and name in cluster.sdpa_flops:
        return cluster.sdpa_flops[name] * cluster.flops_efficiency
    if rows:
        return rows[-1][1] * cluster.flops_efficiency
    return None


def matmul_flops_per_s(cluster: Cluster, dtype, flops_per_call: float | None = None) -> float:
    """Matmul throughput for calls of `flops_per_call` forward FLOPs: the cluster's measured table for the dtype
    (log-linear in the flops between sizes, flat outside), else its peak."""
    rows = (cluster.matmul_table or {}).get(dtype_name(dtype))
    if not rows or flops_per_call is None:
        return cluster.peak_flops_for(dtype)
    if flops_per_call <= rows[0][0]:
        return rows[0][1] * cluster.flops_efficiency
    for (f0, r0), (f1, r1) in zip(rows, rows[1:]):
        if flops_per_call <= f1:
            return (r0 + (r1 - r0) * math.log(flops_per_call / f0) / math.log(f1 / f0)) * cluster.flops_efficiency
    return rows[-1][1] * cluster.flops_efficiency


def kernel_time_s(kind: str, flops: float, bytes_moved: float, dtype, cluster: Cluster, num_ops: float = 0, *,
                  flops_per_call: float | None = None, seq_len: float | None = None) -> float:
    """Time of `num_ops` ops of one kind doing `flops` and `bytes_moved` in all (module docstring);
    `flops_per_call`: the forward FLOPs of one matmul call, for the size-dependent matmul rate; `seq_len`: an
    attention's key length, for the length-dependent attention rate."""
    if kind not in KINDS:
        raise ValueError(f"unknown op kind {kind!r}; expected one of {KINDS}")
    overhead = num_ops * (cluster.op_overhead_s or 0.0)
    name = dtype_name(dtype)
    if kind == "matmul":
        return overhead + (flops / matmul_flops_per_s(cluster, dtype, flops_per_call) if flops else 0.0)
    sdpa_rate = sdpa_flops_per_s(cluster, name, seq_len) if kind == "sdpa" else None
    if sdpa_rate:
        return overhead + flops / sdpa_rate
    if kind == "vector" and cluster.vector_bytes_per_s:
        return overhead + bytes_moved / (cluster.vector_bytes_per_s * cluster.memory_efficiency)
    if kind == "memory" and cluster.copy_bytes_per_s:
        return overhead + bytes_moved / (cluster.copy_bytes_per_s * cluster.memory_efficiency)
    return overhead + compute_time_s(flops, bytes_moved, dtype, cluster)


# ------------------------------------------------------------------------------------- per node
@dataclass(frozen=True, kw_only=True)
class NodeCost:
    flops: int = 0
    bytes: int = 0  # memory traffic: tensors read + written
    dtype: str = "float32"  # the dtype the FLOPs run in (peak_flops key)
    kind: str = "view"  # matmul | sdpa | vector | memory | view (free: no kernel, no op counted)
    seq_len: int = 0  # sdpa: the key length (the attention rate depends on it)

    def time_s(self, cluster: Cluster, *, divisor: float = 1) -> float:
        """Forward time when the work is split evenly over `divisor` devices: by op kind when the cluster
        measured per-kind rates (one op's overhead included), else the roofline."""
        if self.kind == "view":
            return 0.0
        if has_kernel_rates(cluster):
            return kernel_time_s(self.kind, self.flops / divisor, self.bytes / divisor, self.dtype, cluster, 1,
                                 flops_per_call=self.flops / divisor, seq_len=self.seq_len or None)
        return compute_time_s(self.flops / divisor, self.bytes / divisor, self.dtype, cluster)


_MATMULS = {
    aten.linear.default: 0, aten.mm.default: 0, aten.bmm.default: 0, aten.matmul.default: 0,
    aten.addmm.default: 1, aten.baddbmm.default: 1,
}  # op -> index of the left operand (whose last dim is K)
_SDPA = {
    aten.scaled_dot_product_attention.default,
    aten._scaled_dot_product_flash_attention.default,
    aten._scaled_dot_product_efficient_attention.default,
    aten._scaled_dot_product_flash_attention_for_cpu.default,
}
if hasattr(aten, "_scaled_dot_product_cudnn_attention"):
    _SDPA.add(aten._scaled_dot_product_cudnn_attention.default)
_REDUCTION_LIKE = {
    "softmax", "_softmax", "log_softmax", "_log_softmax", "layer_norm", "native_layer_norm", "rms_norm",
    "_fused_rms_norm", "group_norm", "native_group_norm", "batch_norm", "cross_entropy_loss", "nll_loss",
    "nll_loss_forward", "mse_loss", "dropout", "native_dropout", "cumsum", "logsumexp",
}
_MAYBE_COPY = {"to", "_to_copy", "reshape", "contiguous", "flatten"}


def _vals(x) -> list[torch.Tensor]:
    return [v for v in pytree.tree_leaves(x) if isinstance(v, torch.Tensor)]


def _arg_vals(node: fx.Node) -> list[torch.Tensor]:
    leaves = pytree.tree_leaves((node.args, node.kwargs))
    return [v for a in leaves if isinstance(a, fx.Node) for v in _vals(a.meta.get("val"))]


def _nbytes(t: torch.Tensor) -> int:
    """Bytes a kernel touches: broadcast (stride-0) dims of an expanded view are read once."""
    addressed = math.prod(int(n) for n, st in zip(t.shape, t.stride()) if st != 0)
    return addressed * t.element_size()


def _bound_args(node: fx.Node) -> dict:
    """The node's arguments by schema name (defaults filled in)."""
    schema = node.target._schema
    out = {}
    for i, a in enumerate(schema.arguments):
        if i < len(node.args):
            out[a.name] = node.args[i]
        elif a.name in node.kwargs:
            out[a.name] = node.kwargs[a.name]
        elif a.has_default_value():
            out[a.name] = a.default_value
    return out


def _val(x):
    return x.meta.get("val") if isinstance(x, fx.Node) else None


def _is_view(node: fx.Node) -> bool:
    """An op returning an alias of its input without a copy (see the module docstring)."""
    if node.target is operator.getitem:
        return True
    schema = getattr(node.target, "_schema", None)
    if schema is None or schema.is_mutable or not any(r.alias_info is not None for r in schema.returns):
        return False
    name = schema.name.split("::")[-1]
    if name in _MAYBE_COPY:
        src, out = _val(node.args[0]), _val(node)
        if not isinstance(src, torch.Tensor) or not isinstance(out, torch.Tensor) or src.dtype != out.dtype:
            return False
        if name == "contiguous":
            return src.is_contiguous()
        try:  # reshape/flatten alias their input exactly when `view` could (same shape, same strides)
            torch.empty_strided(src.shape, src.stride(), dtype=src.dtype, device="meta").view(out.shape)
            return True
        except RuntimeError:
            return False
    return True


def _float_dtype(vals: list[torch.Tensor]) -> str:
    for v in vals:
        if v.is_floating_point():
            return dtype_name(v.dtype)
    return dtype_name(vals[0].dtype) if vals else "float32"


def node_cost(node: fx.Node) -> NodeCost:
    """FLOPs and bytes of one node from its global shapes (rules in the module docstring)."""
    if node.op != "call_function" or _is_view(node):
        return NodeCost()
    outs, ins = _vals(node.meta.get("val")), _arg_vals(node)
    io_bytes = sum(map(_nbytes, ins)) + sum(map(_nbytes, outs))
    dtype = _float_dtype(ins + outs)
    target = node.target
    if target in _MATMULS and outs:
        left = _val(node.args[_MATMULS[target]])
        k = int(left.shape[-1])
        return NodeCost(flops=2 * outs[0].numel() * k, bytes=io_bytes, dtype=dtype, kind="matmul")
    if target in _SDPA:
        a = _bound_args(node)
        q, k, v = _val(a["query"]), _val(a["key"]), _val(a["value"])
        batch_heads = math.prod(int(x) for x in q.shape[:-2])
        s_q, d, s_kv, d_v = int(q.shape[-2]), int(q.shape[-1]), int(k.shape[-2]), int(v.shape[-1])
        flops = 2 * batch_heads * s_q * s_kv * (d + d_v)
        if a.get("is_causal"):
            flops //= 2
        return NodeCost(flops=flops, bytes=io_bytes, dtype=dtype, kind="sdpa", seq_len=s_kv)
    if target is aten.embedding.default:
        rows = sum(map(_nbytes, outs))
        return NodeCost(bytes=2 * rows + _nbytes(_val(node.args[1])), dtype=dtype, kind="memory")
    tags = getattr(target, "tags", ())
    name = getattr(target, "_schema", None) and target._schema.name.split("::")[-1]
    if torch.Tag.pointwise in tags or torch.Tag.reduction in tags or name in _REDUCTION_LIKE:
        if name == "cross_entropy_loss" and ins:  # log_softmax writes the log-probabilities, nll_loss reads them
            io_bytes += 2 * _nbytes(ins[0])
        return NodeCost(flops=max((v.numel() for v in ins + outs), default=0), bytes=io_bytes, dtype=dtype,
                        kind="vector")
    return NodeCost(bytes=io_bytes, dtype=dtype, kind="memory")
