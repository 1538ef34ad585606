"""FSDP (ZeRO-3) of parameters: sharded over the data axes, all-gathered before use.

Placement: each parameter is sharded over every data axis on one dim that tensor parallelism
leaves whole (dim 0 if it divides, else dim 1: `shard_dim`, the one rule the named `fsdp` plan, the
solver's FSDP candidates and their cost follow); a parameter with no such dim stays whole and data
parallel (`whole`; the plan notes it). Lowering: a `GATHER` directive per
parameter and axis all-gathers it at the start of the step (innermost axis first, where the tensor
is still divided by the outer axes), and the gradient of the gathered value is reduce-scattered
backward (`all_gather_rs`, the fused gather + partial-gradient pair).

Cost (`sync`): per parameter, an all-gather forward on every data axis, back to back at the start;
each gradient that has its own reduction is reduce-scattered on the outermost axis and all-reduced
whole on the others, as backward produces it (per parameter, as the lowering issues them today; when
gathers are grouped per block, as FSDP2 does, latency is paid per group). `gather_s` is the gathers'
share (what a timeline prefetches ahead of the forward: `autopar.timeline`). On sequence axes gradients join the data-parallel
bucket. State: parameters, gradients and optimizer state divided by the data-parallel degree, plus
the gathered parameters backward reads (`SiteStats.saved_params`: weights, not biases or embedding
tables), which live from forward to backward (not re-gathered in backward, as ZeRO-3 does to save
that memory). Volume per step: `2(p-1)/p · Ψ` (one all-gather, one reduce-scatter).
"""

from __future__ import annotations

import math
from typing import Iterable

from autopar.estimate import MeshCosting, SiteStats
from autopar.forms import dp
from autopar.plan import Directive, DirectiveKind
from autopar.sites import Kind, Site
from autopar.spec import Placement, is_shard
from cost_model.analytical import collective_time_s, send_bytes

NAME = "fsdp"


def precondition(site: Site, st: SiteStats, data_sizes: tuple[int, ...],
                 model_placements: dict[str, dict[int, Placement]]) -> str | None:
    """Why this structure's parameters cannot be FSDP-sharded over data axes of `data_sizes`, given what its form
    places on the model axes (`Form.placements`: placeholder -> {mesh axis: placement}); None: at least one
    can, on its `shard_dim` (the others stay whole: `whole`)."""
    if site.kind is Kind.MOE:
        return "MoE expert weights are split by expert (or feature), not FSDP-sharded"
    size = math.prod(data_sizes)
    if size <= 1:
        return "there is no data-parallel axis"
    if not st.param_shapes:
        return "it has no parameters"
    if not set(st.param_shapes) - whole(st, data_sizes, model_placements):
        shapes = ", ".join(str(tuple(s)) for s in st.param_shapes.values())
        return (f"no parameter ({shapes}) has a dim (0 or 1) that tensor parallelism leaves whole and that divides "
                f"over {size} ranks")
    return None


def whole(st: SiteStats, data_sizes, model_placements: dict[str, dict[int, Placement]]) -> frozenset[str]:
    """The parameters (placeholders) of a structure that FSDP leaves whole: no `shard_dim`."""
    return frozenset(ph for ph, shape in st.param_shapes.items()
                     if shard_dim(shape, model_placements.get(ph, {}).values(), data_sizes) is None)


def shard_dim(shape: tuple[int, ...], model: Iterable[Placement], data_sizes: Iterable[int]) -> int | None:
    """The dim FSDP shards a parameter of `shape` on, over every data axis (sizes `data_sizes`), given its
    placements `model` on the model axes: dim 0, else dim 1, the first that tensor parallelism leaves whole and
    that divides over the data ranks; None: no dim does (the parameter stays whole on the data axes)."""
    size = math.prod(data_sizes)
    taken = {p.dim for p in model if is_shard(p)}
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
        nbytes *= mc.grad_bytes_factor  # mixed precision: reduced in reduce_dtype
        for i, a in enumerate(axes):
            p = mc.size(a)
            kind = "reduce_scatter" if i == 0 else "all_reduce"
            # backward reduces the innermost axis first (after the compute), the others back to back
            interval = backward_s / len(reduced) if i == len(axes) - 1 else 0.0
            t += collective_time_s(kind, int(nbytes), p, mc.link(a), interval_s=interval)
            b += send_bytes(kind, nbytes, p)
    t_seq, b_seq = dp.grad_sync(mc, sum(reduced), mc.seq_axes)
    return t + t_seq, b + b_seq


def params_cost(mc: MeshCosting, st: SiteStats, split: float, backward_s: float) -> tuple[float, float, float, float]:
    """(time, bytes sent, state bytes, gathered bytes) of a structure's parameters, divided `split` ways by its form,
    under FSDP: those it shards (`sync`, `state_bytes`), and those it leaves whole (`st.fsdp_whole`) data parallel."""
    sharded, kept = st.fsdp_parts()
    t, b = sync(mc, [x / split for x in sharded.param_sizes], [x / split for x in sharded.synced_param_sizes],
                backward_s)
    kept_t, kept_b = dp.grad_sync(mc, kept.synced_param_bytes / split)
    local = sharded.param_bytes / split
    # the gathered copies backward reads stay alive until then (a weight; not a bias, not an embedding table)
    gathered = sum(sharded.param_facts[p][0] for p in sharded.saved_params) / split
    return (t + kept_t, b + kept_b, local * mc.state_factor() / mc.dp + gathered
            + dp.state_bytes(mc, kept.param_bytes / split), gathered)


def gather_s(mc: MeshCosting, st: SiteStats, split: float) -> float:
    """The all-gathers' share of `params_cost`'s time (issued before the forward, prefetched)."""
    sharded, _ = st.fsdp_parts()
    return sync(mc, [x / split for x in sharded.param_sizes], [])[0]


def state_bytes(mc: MeshCosting, local_param_bytes: float) -> float:
    return local_param_bytes * mc.state_factor() / mc.dp + local_param_bytes


def volume_bytes(param_bytes: float, p: int) -> float:
    """Bytes each rank sends per step: the all-gather forward and the gradients' reduce-scatter."""
    return send_bytes("all_gather", param_bytes, p) + send_bytes("reduce_scatter", param_bytes, p)
