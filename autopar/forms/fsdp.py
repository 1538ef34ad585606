"""FSDP (ZeRO-3) of parameters: sharded over the data axes, all-gathered before use.

Placement: each parameter is sharded over every data axis on one dim that tensor parallelism
leaves whole (dim 0 if it divides, else dim 1: `shard_dim`). Lowering: a `GATHER` directive per
parameter and axis all-gathers it at the start of the step (innermost axis first, where the tensor
is still divided by the outer axes), and the gradient of the gathered value is reduce-scattered
backward (`all_gather_rs`, the fused gather + partial-gradient pair).

Cost (`sync`): per parameter, an all-gather forward on every data axis, back to back at the start;
each gradient that has its own reduction is reduce-scattered on the outermost axis and all-reduced
whole on the others, as backward produces it. On sequence axes gradients join the data-parallel
bucket. State: parameters, gradients and optimizer state divided by the data-parallel degree, plus
the gathered parameters, which live from forward to backward (not re-gathered in backward, as
ZeRO-3 does to save that memory). Volume per step: `2(p-1)/p · Ψ` (one all-gather, one reduce-scatter).
"""

from __future__ import annotations

import math

from autopar.estimate import MeshCosting, SiteStats
from autopar.forms import dp
from autopar.plan import Directive, DirectiveKind
from autopar.sites import Kind, Site
from cost_model.analytical import collective_time_s, send_bytes

NAME = "fsdp"


def precondition(site: Site, st: SiteStats, dp_size: int, model_split: int) -> str | None:
    """Why this structure's parameters cannot be FSDP-sharded over `dp_size` data ranks, with its form's axis of
    `model_split` ranks (None: they can)."""
    if site.kind is Kind.MOE:
        return "MoE expert weights are split by expert (or feature), not FSDP-sharded"
    if dp_size <= 1:
        return "there is no data-parallel axis"
    if not st.param_dim0:
        return "it has no parameters"
    bad = [d for d in st.param_dim0 if d % (dp_size * model_split)]
    if bad:
        return f"parameter dim 0 of size {bad[0]} does not divide over {dp_size * model_split} ranks"
    return None


def shard_dim(shape: tuple[int, ...], taken: set[int], size: int) -> int | None:
    """The dim FSDP shards a parameter on over `size` ranks: 0, else 1, not one tensor parallelism shards."""
    return next((d for d in range(min(2, len(shape))) if d not in taken and shape[d] % size == 0), None)


def gather_directives(fqn: str, axes: list[str]) -> list[Directive]:
    return [Directive(kind=DirectiveKind.GATHER, node=fqn, axis=a) for a in axes]


def sync(mc: MeshCosting, gathered: list[float], reduced: list[float], backward_s: float = 0.0) -> tuple[float, float]:
    """(time, bytes sent) of FSDP on the data axes, as lowering issues it (module docstring)."""
    t = b = 0.0
    axes = sorted(mc.data_axes, key=mc.names.index)
    for nbytes in gathered:
        for i, a in enumerate(axes):
            p = mc.size(a)
            n = nbytes / math.prod(mc.size(o) for o in axes[:i])  # the gathered tensor on this axis
            t += collective_time_s("all_gather", int(n), p, mc.link(a), interval_s=0.0)
            b += send_bytes("all_gather", n, p)
    for nbytes in reduced:
        for i, a in enumerate(axes):
            p = mc.size(a)
            kind = "reduce_scatter" if i == 0 else "all_reduce"
            # backward reduces the innermost axis first (after the compute), the others back to back
            interval = backward_s / len(reduced) if i == len(axes) - 1 else 0.0
            t += collective_time_s(kind, int(nbytes), p, mc.link(a), interval_s=interval)
            b += send_bytes(kind, nbytes, p)
    t_seq, b_seq = dp.grad_sync(mc, sum(reduced), mc.seq_axes)
    return t + t_seq, b + b_seq


def state_bytes(mc: MeshCosting, local_param_bytes: float) -> float:
    return local_param_bytes * mc.state_factor() / mc.dp + local_param_bytes


def volume_bytes(param_bytes: float, p: int) -> float:
    """Bytes each rank sends per step: the all-gather forward and the gradients' reduce-scatter."""
    return send_bytes("all_gather", param_bytes, p) + send_bytes("reduce_scatter", param_bytes, p)
