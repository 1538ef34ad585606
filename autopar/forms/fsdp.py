"""FSDP (ZeRO-3) of parameters: sharded over the data axes, all-gathered before use.

Placement: each parameter is sharded over every data axis on one dim that tensor parallelism
leaves whole (dim 0 if it divides, else dim 1: `shard_dim`, the one rule the named `fsdp` plan, the
solver's FSDP candidates and their cost follow); where neither divides, unevenly on the first such dim, as FSDP2
shards dim 0 (`torch.chunk`'s chunks: ceil(dim/d) rows on the first ranks, fewer or none on the last; every shard
padded to the longest in the collectives, `padded_rows`, and priced padded: `priced_stats`, `pad_factor`); only a
parameter with no such dim (a scalar, every dim taken by tensor parallelism) stays whole and data parallel
(`whole`; the plan notes it). Lowering: a `GATHER` directive per
parameter and axis; `passes.lower.group_fsdp_gathers_pass` gathers them per layer (`autopar.layers`; the
parameters outside the layers per stretch between layers): one all-gather per data axis of a flat buffer of the
group's shards, right before its first use, the next group's issued before this group's compute (prefetch);
by default (ZeRO-3) the gathered weights are released after forward and gathered again in backward (the previous
group's prefetched), and each group's gradients are reduce-scattered as one flat buffer as soon as they are
complete (`autopar.runtime.fsdp`). `keep_gathered` marks groups kept gathered from forward to backward
(ZeRO-2-like: no re-gather, the gathered weights held).

Cost (`sync`): per group an all-gather forward per data axis, again in backward when resharded
(`regather_time_s`; a group only embedding lookups read is not saved, so not gathered again), and a
reduce-scatter per data axis backward (`reduce_time_s`, in reduce_dtype bytes under mixed precision), and the copies
into and out of their flat buffers on the compute stream (`copy_s`, added to the structure's compute); each
parameter pays its share of its group's collective (`autopar.estimate.fsdp_groups`). `gather_s` is the gathers' share (what a timeline prefetches ahead of the
forward: `autopar.timeline`). On sequence axes gradients join the data-parallel bucket. State: parameters,
gradients and optimizer state divided by the data-parallel degree, plus the gathered parameters backward reads
(`SiteStats.saved_params`: weights, not biases or embedding tables) of the groups kept gathered from forward to
backward (`held_gathered_bytes`: a resharded group holds none, it is gathered again); for a moment at the end of a
group's backward, what reducing its gradients holds (`reduce_transient_bytes`, added to the step's peak). Volume
per step: `2(p-1)/p · Ψ` (one all-gather, one reduce-scatter), `3(p-1)/p · Ψ` resharded.
"""

from __future__ import annotations

import dataclasses
import fnmatch
import math
from typing import Iterable

from autopar.estimate import MeshCosting, SiteStats
from autopar.forms import dp, zero
from autopar.plan import GATHER_KEEP, Directive, DirectiveKind, Plan
from autopar.sites import Kind, Site
from autopar.spec import Placement, is_shard, shard_layout
from cost_model.analytical import collective_time_s, kernel_time_s, send_bytes

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
        return f"no parameter ({shapes}) has a dim (0 or 1) that tensor parallelism leaves whole"
    return None


def whole(st: SiteStats, data_sizes, model_placements: dict[str, dict[int, Placement]]) -> frozenset[str]:
    """The parameters (placeholders) of a structure that FSDP leaves whole: no `shard_dim`."""
    return frozenset(ph for ph, shape in st.param_shapes.items()
                     if shard_dim(shape, model_placements.get(ph, {}).values(), data_sizes) is None)


def priced_stats(st: SiteStats, data_sizes, model_placements: dict[str, dict[int, Placement]]) -> SiteStats:
    """`st` as FSDP prices it: the parameters it leaves whole (`fsdp_whole`) and, per parameter it shards unevenly,
    its padding (`fsdp_pad`: `pad_factor`), which the sharded state, gathers and reductions carry."""
    pads = {}
    for ph, shape in st.param_shapes.items():
        dim = shard_dim(shape, model_placements.get(ph, {}).values(), data_sizes)
        if dim is not None and shape[dim] % math.prod(data_sizes):
            pads[ph] = pad_factor(shape[dim], data_sizes)
    return dataclasses.replace(st, fsdp_whole=whole(st, data_sizes, model_placements), fsdp_pad=pads)


def shard_dim(shape: tuple[int, ...], model: Iterable[Placement], data_sizes: Iterable[int], *,
              uneven: bool = True) -> int | None:
    """The dim FSDP shards a parameter of `shape` on, over every data axis (sizes `data_sizes`), given its
    placements `model` on the model axes: dim 0, else dim 1, the first that tensor parallelism leaves whole and
    that divides over the data ranks; where none divides, the first that tensor parallelism leaves whole, sharded
    unevenly (`uneven`: as FSDP2 shards dim 0, `torch.chunk`'s chunks, the last ranks' shorter or empty, padded to
    `padded_rows` for the collectives); None: no such dim (a scalar, or every dim taken: it stays whole on the
    data axes)."""
    sizes = tuple(data_sizes)
    size = math.prod(sizes)
    taken = {p.dim for p in model if is_shard(p)}
    free = [d for d in range(min(2, len(shape))) if d not in taken]
    even = next((d for d in free if shape[d] % size == 0), None)
    if even is not None or not uneven:
        return even
    # uneven only on a dim whose longest shard is shorter than the dim (length >= 2): a dim of 1 would leave the
    # whole parameter on one rank, the per-device peak unchanged (a ViT's (1, 1, d) class token stays whole)
    return next((d for d in free if shape[d] >= 2), None)


def padded_rows(length: int, sizes) -> int:
    """The rows every rank's shard is padded to in FSDP's collectives: the longest shard's, the first rank's at each
    nesting (torch.chunk's chunks are full but the last): ceil(... ceil(length / n0) ... / nk)."""
    rows = length
    for n in sizes:
        rows = -(-rows // n)
    return rows


def pad_factor(length: int, sizes) -> float:
    """Bytes per rank of an unevenly sharded dim of `length` over `sizes` against an even split: the padded shard
    (`padded_rows`) times the ranks, over the dim."""
    return padded_rows(length, sizes) * math.prod(sizes) / length


def gather_directives(fqn: str, axes: list[str], keep: bool = False) -> list[Directive]:
    """The parameter `fqn` all-gathered on `axes`: released after forward and gathered again in backward, or kept
    gathered from forward to backward (`keep`)."""
    return [Directive(kind=DirectiveKind.GATHER, node=fqn, axis=a, value=GATHER_KEEP if keep else "") for a in axes]


def keep_gathered(plan: Plan, key: str = "*") -> Plan:
    """`plan` with the FSDP parameters whose fqn matches the glob `key` (`"layers.3.*"`, `"*"`) kept gathered from
    forward to backward (ZeRO-2-like: no re-gather in backward, the gathered weights held); a layer's group keeps
    them when every one of its parameters does (lowering: `passes.lower.group_fsdp_gathers_pass`)."""
    hit = [d for d in plan.directives if d.kind is DirectiveKind.GATHER and fnmatch.fnmatchcase(d.node, key)]
    if not hit:
        gathered = sorted({d.node for d in plan.directives if d.kind is DirectiveKind.GATHER})
        raise ValueError(f"keep_gathered: no FSDP-gathered parameter of plan {plan.name!r} matches {key!r} (gathered: "
                         f"{gathered[:6]}{'...' if len(gathered) > 6 else ''}). Fix: a glob over parameter names, "
                         "e.g. 'layers.3.*', on a plan that FSDP-shards them (plan='fsdp').")
    directives = tuple(dataclasses.replace(d, value=GATHER_KEEP) if d in hit else d for d in plan.directives)
    return dataclasses.replace(plan, directives=directives)


def sync(mc: MeshCosting, gathered: list[tuple[float, float, bool]], reduced: list[tuple[float, float]],
         backward_s: float = 0.0) -> tuple[float, float]:
    """(time, bytes sent) of FSDP on the data axes, as lowering issues it (module docstring). `gathered`: per
    parameter (its bytes, its group's bytes, whether the group is gathered again in backward); `reduced`: per
    parameter whose gradient FSDP reduces (its bytes, its group's bytes). A group's collective is priced once: each
    parameter pays its share of the group's time (`gather_time_s`, `regather_time_s`, `reduce_time_s`)."""
    t = b = 0.0
    for nbytes, group, again in gathered:
        gt, gb = gather_time_s(mc, nbytes, group)
        t, b = t + gt, b + gb
        if again:
            rt, rb = regather_time_s(mc, nbytes, group)
            t, b = t + rt, b + rb
    site = sum(n for n, _ in reduced)
    for nbytes, group in reduced:
        # a group's reduce-scatter follows the group's backward: this structure's, scaled by bytes to the group
        rt, rb = reduce_time_s(mc, nbytes * mc.grad_bytes_factor, group * mc.grad_bytes_factor,
                               backward_s * group / site)  # mixed precision: reduced in reduce_dtype
        t, b = t + rt, b + rb
    t_seq, b_seq = dp.grad_sync(mc, sum(n for n, _ in reduced), mc.seq_axes)
    return t + t_seq, b + b_seq


def _axes(mc: MeshCosting) -> list[str]:
    return sorted(mc.data_axes, key=mc.names.index)  # outermost first


def gather_time_s(mc: MeshCosting, nbytes: float, group: float) -> tuple[float, float]:
    """(time, bytes sent) of a parameter of `nbytes` in its group's all-gather forward (one per data axis,
    innermost first, on the group's flat buffer of `group` bytes): its share of the group's time."""
    t = b = 0.0
    axes = _axes(mc)
    for i, a in enumerate(axes):
        p = mc.size(a)
        outer = math.prod(mc.size(o) for o in axes[:i])  # the gathered buffer on this axis
        t += collective_time_s("all_gather", int(group / outer), p, mc.link(a), interval_s=0.0) * nbytes / group
        b += send_bytes("all_gather", nbytes / outer, p)
    return t, b


def regather_time_s(mc: MeshCosting, nbytes: float, group: float) -> tuple[float, float]:
    """(time, bytes sent) of gathering a resharded group again in backward (ZeRO-3): the forward gather again. A group
    kept gathered (`keep_gathered`) saves this and holds `held_gathered_bytes` instead."""
    return gather_time_s(mc, nbytes, group)


def held_gathered_bytes(local_param_bytes: float, keep: bool) -> float:
    """Bytes of a group's gathered parameters held from forward to backward: all of them when kept gathered, none
    when resharded (then only while the group computes, and its prefetched successor: a transient)."""
    return local_param_bytes if keep else 0.0


def reduce_time_s(mc: MeshCosting, nbytes: float, group: float, interval_s: float = 0.0) -> tuple[float, float]:
    """(time, bytes sent) of a parameter's gradient in its group's reduce-scatter (one per data axis, outermost
    first, the flat buffer divided by the axes before): its share of the group's time."""
    t = b = 0.0
    axes = _axes(mc)
    for i, a in enumerate(axes):
        p = mc.size(a)
        outer = math.prod(mc.size(o) for o in axes[:i])
        interval = interval_s if i == len(axes) - 1 else 0.0
        whole = collective_time_s("reduce_scatter", int(group / outer), p, mc.link(a), interval_s=interval)
        t += whole * nbytes / group
        b += send_bytes("reduce_scatter", nbytes / outer, p)
    return t, b


def gather_factor(st: SiteStats, name: str) -> float:
    """The bytes FSDP gathers parameter `name` in, per byte of its own dtype: a tensorwise float8 weight's 1 byte
    (`SiteStats.float8_gathered`), but not one sharded unevenly (`st.fsdp_pad`), which the runtime gathers padded in
    its dtype (`passes.lower`'s fp8 gathers leave it out)."""
    return 1.0 if name in st.fsdp_pad else st.float8_gathered.get(name, 1.0)


def params_cost(mc: MeshCosting, st: SiteStats, split: float, backward_s: float) -> tuple[float, float, float, float]:
    """(time, bytes sent, state bytes, gathered bytes) of a structure's parameters, divided `split` ways by its form,
    under FSDP: those it shards (`sync`, `state_bytes`), and those it leaves whole (`st.fsdp_whole`) data parallel."""
    sharded, kept = st.fsdp_parts()
    gathered, reduced = [], []
    for name, (nbytes, used, synced) in sharded.param_facts.items():
        group, again = sharded.fsdp_groups.get(name, (nbytes, False)) if synced else (nbytes, False)
        again = again and mc.zero != 2  # zero2: every group kept (and persisting): none gathered again in backward
        if used:  # a tensorwise float8 weight is gathered in 1 byte (`SiteStats.float8_gathered`)
            gathered.append((nbytes * gather_factor(st, name) / split, group / split, again))
        if synced:
            reduced.append((nbytes / split, group / split))
    t, b = sync(mc, gathered, reduced, backward_s)
    kept_t, kept_b = dp.grad_sync(mc, kept.synced_param_bytes / split)
    local = sharded.param_bytes / split  # the shards' bytes times the ranks (padded where uneven)
    full = sum(st.param_facts[p][0] for p in sharded.param_facts) / split  # the gathered parameters' (not padded)
    if mc.zero == 2:  # the gathered copies persist: the whole parameters held, no transient beside them
        state = full + (zero.state_bytes(mc, local, 2) - local)  # zero2's whole compute copy is not padded
        return t + kept_t, b + kept_b, state + dp.state_bytes(mc, kept.param_bytes / split), 0.0
    # the gathered copies backward reads stay alive until then (a weight; not a bias, not an embedding table) in a
    # group kept gathered; a resharded group gathers them again in backward instead. A tensorwise float8 weight
    # gathered in fp8 is kept so, in 1 byte (`autopar.runtime.float8._Float8GatheredLinear` saves the fp8 weight)
    gathered = sum(held_gathered_bytes(st.param_facts[p][0] * gather_factor(st, p),
                                       not sharded.fsdp_groups.get(p, (0.0, False))[1])
                   for p in sharded.saved_params) / split
    return (t + kept_t, b + kept_b, local * mc.state_factor() / mc.dp + gathered
            + dp.state_bytes(mc, kept.param_bytes / split), gathered)


def gather_s(mc: MeshCosting, st: SiteStats, split: float) -> float:
    """The forward all-gathers' share of `params_cost`'s time (issued before the layer's compute, prefetched)."""
    sharded, _ = st.fsdp_parts()
    t = 0.0
    for name, (nbytes, used, synced) in sharded.param_facts.items():
        group = sharded.fsdp_groups.get(name, (nbytes, False))[0] if synced else nbytes
        if used:
            t += gather_time_s(mc, nbytes * gather_factor(st, name) / split, group / split)[0]
    return t


def regather_s(mc: MeshCosting, st: SiteStats, split: float) -> float:
    """The backward re-gathers' share of `params_cost`'s time (ZeRO-3: issued before the layer's backward)."""
    sharded, _ = st.fsdp_parts()
    t = 0.0
    for name, (nbytes, used, synced) in sharded.param_facts.items():
        group, again = sharded.fsdp_groups.get(name, (nbytes, False)) if synced else (nbytes, False)
        if used and again and mc.zero != 2:
            t += regather_time_s(mc, nbytes * gather_factor(st, name) / split, group / split)[0]
    return t


def copy_s(mc: MeshCosting, st: SiteStats, split: float) -> float:
    """The compute stream's copies around FSDP's collectives (`autopar.runtime.fsdp`, as FSDP2's
    `foreach_all_gather` copy-in, `foreach_all_gather_copy_out` and `foreach_reduce`'s `chunk_cat`), memory-bound at
    the cluster's copy rate: per gather (forward, and again in backward when resharded) the local shards copied into
    the flat buffer (read + write, cast to param_dtype) and the gathered buffer copied out into the full parameters
    (read + write); per reduction the full gradients copied into the flat buffer in reduce_dtype (read, and write
    `grad_bytes_factor` times their bytes)."""
    sharded, _ = st.fsdp_parts()
    moved = 0.0
    for name, (nbytes, used, synced) in sharded.param_facts.items():
        full = nbytes / split
        again = sharded.fsdp_groups.get(name, (nbytes, False))[1] and mc.zero != 2 if synced else False
        if used:
            moved += (1 + again) * (2 * full / mc.dp + 2 * full)
        if synced:
            moved += full * (1 + mc.grad_bytes_factor)
    return kernel_time_s("memory", 0.0, moved, mc.param_dtype, mc.cluster) if moved else 0.0


def reduce_transient_bytes(mc: MeshCosting, st: SiteStats, split: float) -> float:
    """What FSDP holds for a moment when it reduces the gradients of this structure's group, at the end of the
    group's backward (`autopar.runtime.fsdp._reduce_scatter`; measured with `tests/memory_probe.py` at the
    reduce-scatter on gloo): the group's unsharded gradients and their flat copy in reduce_dtype; and, when the
    group is gathered again in backward and another group is too (the layer before it), that layer's re-gather,
    prefetched by this group's backward: its gathered buffer and its flat copy-in of the local shards. The layer before
    is priced as this group (layers of one class are alike). So 2x the group's gradients with one re-gathered group
    (a one-layer model, or groups kept gathered), (3 + 1/dp)x with several. The previous group's reduce-scatter
    is complete by then (its flat copy freed): not counted. The step's peak adds the largest (`estimate.peak_bytes`)."""
    sharded, _ = st.fsdp_parts()
    worst = 0.0
    for name, (nbytes, used, synced) in sharded.param_facts.items():
        if not synced:
            continue
        group, again = sharded.fsdp_groups.get(name, (nbytes, False))
        prefetch = again and sharded.fsdp_regathered > 1 and mc.zero != 2
        worst = max(worst, group / split * (1 + mc.grad_bytes_factor + prefetch * (1 + 1 / mc.dp)))
    return worst


def state_bytes(mc: MeshCosting, local_param_bytes: float) -> float:
    return local_param_bytes * mc.state_factor() / mc.dp + local_param_bytes


def volume_bytes(param_bytes: float, p: int) -> float:
    """Bytes each rank sends per step: the all-gather forward and the gradients' reduce-scatter."""
    return send_bytes("all_gather", param_bytes, p) + send_bytes("reduce_scatter", param_bytes, p)
