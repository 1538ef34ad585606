"""ZeRO-1 and ZeRO-2 of parameters over the data axes: the optimizer state sharded, the parameters whole for compute.

Beside `dp` (parameters, gradients and optimizer state replicated) and `fsdp` (ZeRO-3: all three sharded, parameters
gathered per layer for every forward), named plans `zero1` and `zero2` (`autopar.planner`). Each parameter is sharded
over every data axis on its `fsdp.shard_dim` (dim 0 if it divides, else dim 1, else unevenly, padded in the
collectives as under fsdp; zero1's chunks likewise: `autopar.runtime.local_step`); one with no such dim stays data
parallel (replicated state, the plan notes it).

`zero2` (P_os+g): the parameter a user's optimizer holds is its shard (`Shard(dim)` on each data axis, as under
`fsdp`), so the gradient is the shard's (reduce-scattered) and torch.optim creates and updates 1/d of the state
(`autopar.runtime.local_step`: the elementwise step on the local shards). Lowering: the `fsdp` groups per layer with
`GATHER` directives valued `GATHER_PERSIST` (`persist_directives`): each group's gathered parameters (in param_dtype)
persist from one forward to the next and are all-gathered again only after its shards changed, i.e. once after each
optimizer step, in the next forward, prefetched a group ahead (`autopar.runtime.fsdp`: `persist`). Collectives per
step: per group one reduce-scatter per data axis in each backward, one all-gather per data axis in the first forward
after a step; none in the other forwards of a step (gradient accumulation).

`zero1` (P_os): parameters and gradients as `dp` (replicated; gradients all-reduced in the buckets, the full
gradient on every rank after each backward); the plan's `SHARD_STEP` directives (`shard_step_directives`) make the
user's optimizer step only this rank's 1/d chunk of each such parameter and of its gradient, its state created and
kept at that chunk's size (DTensors `Shard(dim)` on the data axes, so `state_dict` and DCP see sharded state), then
the parameters are all-gathered (one all-gather per data axis and dtype, of a flat buffer of every chunk), before the
step returns (`autopar.runtime.local_step`). Only torch's elementwise optimizers can step a chunk as the whole; any
other optimizer, a closure or a disabled local step raises.

Static model state per parameter element (`cost_model.memory.zero_state_bytes_per_element`, P parameter copy for
compute, G gradient, M fp32 master, K optimizer states, d data ranks) as autopar holds it (`state_bytes`):
- zero1: P = G = the parameter's stored dtype (the master itself under `mp_policy`: the compute copy is cast per
  step), no separate master: P + G + K/d (fp32: 8 + 8/d; Megatron's fp32 row);
- zero2: the persistent compute copy in param_dtype, master shard, its gradient (the master's dtype) and states:
  P + (M + G + K)/d (bf16 compute over fp32 masters, Adam: 2 + 16/d; without a policy the full copy and the master
  shard are both the parameter's dtype, P + (P + G + K)/d);
- fsdp (ZeRO-3): (M + G + K)/d.
The published rows (ZeRO paper: 4 + 12/d, 2 + 14/d, 16/d; Megatron's distributed optimizer 6 + 12/d) count fp16
gradients (ZeRO-1/2) or a bf16 parameter copy beside sharded fp32 masters (Megatron); the function reproduces them
from those dtypes, and `state_bytes` says where autopar differs (gradients in the master's dtype: autograd gives a
parameter a gradient of its own dtype; ZeRO-1's masters replicated, as its parameters are).

Cost: zero2 prices as `fsdp` with every group kept gathered (no backward re-gather): per step the forward
all-gather (the gather after the step, prefetched), the reduce-scatter in backward; zero1 as `dp` plus the all-gather
after the step (`step_gather_s`, `dp.step_gather`), on the critical path (it runs inside the optimizer step; Megatron
overlaps it with the next forward, autopar's zero1 does not yet). Volume per step: `2(p-1)/p · Ψ` for zero2 (reduce-scatter +
all-gather), `3(p-1)/p · Ψ` for zero1 (all-reduce + all-gather).

`auto`: the ILP offers each layer class zero1 and zero2 beside dp and fsdp (`Candidate.zero`, priced with this
class's stage: `solver.site_cost`), lowered per parameter (SHARD_STEP for zero1 classes, persisting gathers for zero2
ones), so a memory limit between stages gives a mixed plan (tests/test_zero_ilp.py); the whole plans zero1 / zero2 are
still among the hand plans it is re-ranked against, and so are the ILP's best plans without ZeRO classes
(`solver._ranked`: its k best can be one plan's zero variants that the timeline ranks below the next distinct plans). Not yet (issue #24): a class whose form an override forces is
offered dp / fsdp only; parameters outside every site stay dp; and `autopar.tune` does not measure them; zero1's gather after the step is not overlapped with the next forward; MoE
experts under a zero plan are priced as `dp`; ZeRO-1's one reduction per step under gradient accumulation (full
gradients accumulated locally, a `no_sync`-like opt-in) is not offered: every backward reduces.
Under `mp_policy` zero1 keeps the masters replicated and all-gathers them after the step in the master dtype (fp32),
where Megatron's distributed optimizer (fp32 master shards, bf16 parameters) gathers bf16: priced as it runs (on
Megatron's GPT 32B row, TP8 x DP48, 0.15 s of 1.19 s communication per step against a bf16 gather); a bf16 gather
needs zero1 to hold a bf16 parameter beside fp32 master shards (Megatron's 6 + 12/d), not done.
"""

from __future__ import annotations

import dataclasses
import math

from autopar.plan import GATHER_PERSIST, Directive, DirectiveKind
from cost_model.analytical import collective_time_s, send_bytes

PLANS = {"zero1": 1, "zero2": 2}  # named plan -> ZeRO stage


def stage_of(plan_name: str) -> int:
    """The ZeRO stage of a named plan: 1, 2, 3 (fsdp) or 0 (replicated optimizer state)."""
    return PLANS.get(plan_name, 3 if plan_name == "fsdp" else 0)


def persist_directives(directives: list[Directive]) -> list[Directive]:
    """zero2: every FSDP gather directive made persistent (`GATHER_PERSIST`)."""
    return [dataclasses.replace(d, value=GATHER_PERSIST) if d.kind is DirectiveKind.GATHER else d for d in directives]


def shard_step_directives(fqn: str, axes: list[str], dim: int) -> list[Directive]:
    """zero1: the optimizer steps the shard of `fqn` on tensor dim `dim` over the data `axes`."""
    return [Directive(kind=DirectiveKind.SHARD_STEP, node=fqn, axis=a, value=str(dim)) for a in axes]


def state_bytes(mc, local_param_bytes: float, stage: int) -> float:
    """Static state of parameters of `local_param_bytes` (the graph's, param_dtype, bytes) under ZeRO `stage` 1 or 2,
    as autopar holds it (module docstring), from `MeshCosting`'s state per parameter byte (`state_factor`: stored
    parameter + gradient + states) and its parameters' share."""
    factor = mc.state_factor()
    share = mc.param_share()  # the stored parameter's (master's) share of factor; the gradient's is the same
    if stage == 1:  # P + G whole, K / d
        return local_param_bytes * factor * (2 * share + (1 - 2 * share) / mc.dp)
    if stage == 2:  # the compute copy whole (the graph's bytes), master + gradient + states / d
        return local_param_bytes + local_param_bytes * factor / mc.dp
    raise ValueError(f"ZeRO stage must be 1 or 2 here, got {stage}")


def state_parts(mc, stage: int) -> tuple[float, float, float]:
    """(parameters, gradients, optimizer states) of `state_bytes` per graph parameter byte under `stage` 1 or 2: the
    parts `Plan.explain` shows (zero2's master shard counted with the parameters)."""
    factor, share = mc.state_factor(), mc.param_share()
    states = factor * (1 - 2 * share) / mc.dp
    if stage == 1:
        return factor * share, factor * share, states
    return 1 + factor * share / mc.dp, factor * share / mc.dp, states


def step_gather_s(mc, local_param_bytes: float) -> tuple[float, float]:
    """(time, bytes sent) of zero1's all-gather of the parameters after the step, one per data axis (innermost first,
    each on the buffer gathered so far), its share of one flat buffer: priced at the bucket's size."""
    t = b = 0.0
    axes = sorted(mc.data_axes, key=mc.names.index)
    whole = max(mc.bucket_bytes, local_param_bytes)
    for i, a in enumerate(reversed(axes)):
        p = mc.size(a)
        if p == 1:
            continue
        outer = math.prod(mc.size(o) for o in axes[:len(axes) - 1 - i])
        full = whole / outer  # the buffer gathered on this axis
        t += collective_time_s("all_gather", int(full), p, mc.link(a), interval_s=0.0) * local_param_bytes / whole
        b += send_bytes("all_gather", local_param_bytes / outer, p)
    return t, b


def volume_bytes(param_bytes: float, p: int, stage: int) -> float:
    """Bytes each rank sends per step for parameters of `param_bytes` on an axis of p ranks."""
    reduce = send_bytes("all_reduce" if stage == 1 else "reduce_scatter", param_bytes, p)
    return reduce + send_bytes("all_gather", param_bytes, p)
