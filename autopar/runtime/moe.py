"""MoE experts at run time: dispatch tokens to their top-k experts, run them, combine (DESIGN.md §3).

Every recognised MoE spelling (`passes/moe.py`) reaches the graph as one node,
`autopar::moe_experts(key, x, idx, weights, params)`:

- `x` (T, H) tokens, `idx` (T, k) chosen experts, `weights` (T, k) their routing weights;
- `params`: the experts' weights stacked on a leading expert dim (E, ...), in the order the
  registered `ExpertsSpec` names them;
- returns `y[t] = sum_j weights[t, j] * expert_{idx[t, j]}(x[t])`, dropless (every assignment runs,
  as on one device) unless the spec has a capacity factor.

The custom op exists for capture (its fake implementation gives shapes); lowering replaces the
node by `moe_experts`, which runs in one of three modes:

| mode      | tokens on the expert axis | params on it | communication                                   |
|-----------|---------------------------|--------------|-------------------------------------------------|
| `local`   | (no expert axis)          | all experts  | none                                            |
| `partial` | replicated                | S(0)         | none here; the output is Partial (summed later) |
| `a2a`     | sharded                   | S(0)         | counts all-to-all, then tokens all-to-all (uneven splits) out and back; the same two backward |

In `a2a` mode each rank sends the rows routed to experts of rank d to rank d
(`all_to_all_single` with this step's split sizes, a host sync as in Megatron's
`MoEAlltoAllTokenDispatcher`), the owner runs them grouped by expert, and the results go back the
same way; the routing weights are applied on the source rank, so their gradient needs no
communication. Rows are gathered and scattered by `kernels.moe_permute` (Triton, PyTorch fallback).

Capacity mode (`ExpertsSpec.capacity_factor`): expert e keeps its first
`C = ceil(capacity_factor * T * k / E)` assignments in global order (token, then choice), T counted
over all tokens as on one device; a rank learns where its assignments stand from an all-gather of
per-expert counts over the token-sharded axes, so the same assignments drop as on one device.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Callable

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.func import functional_call

from autopar.mesh import AxisRef, resolve_axis
from autopar.runtime import collectives as C
from autopar.runtime.kernels.moe_permute import permute_rows, unpermute_rows

_c10d = C._c10d  # settles a step's pending agreement first (`collectives._Functional`)


@dataclass
class ExpertsSpec:
    """How one expert computes, given its slices of the stacked parameters."""

    path: str  # module path of the MoE block (or of its experts module)
    num_experts: int
    top_k: int
    param_names: list[str]  # stacked parameters, in the op's order
    expert_fn: Callable[[list[torch.Tensor], torch.Tensor], torch.Tensor]  # (params of one expert, rows) -> rows
    spelling: str  # "modulelist", "hf-stacked", "grouped"
    capacity_factor: float | None = None
    # per parameter name: (dim, blocks) of its FFN features, for tensor-parallel experts (None: not offered, see
    # ffn_why); the dim of the stacked (E, ...) parameter, or of one ModuleList expert's own parameter
    ffn_dims: list[tuple[int, int]] | None = None
    ffn_why: str = ""
    notes: list[str] = field(default_factory=list)


_SPECS: dict[str, ExpertsSpec] = {}


def register(spec: ExpertsSpec, module: nn.Module) -> str:
    key = f"{spec.path}#{id(module)}"
    _SPECS[key] = spec
    return key


def spec_of(key: str) -> ExpertsSpec:
    return _SPECS[key]


# ----------------------------------------------------------------------------- expert functions

def gated_hf_expert(act: Callable):
    """Hugging Face stacked experts (Mixtral, Qwen-MoE, OLMoE): gate_up_proj (2F, H), down_proj (H, F)."""
    def fn(params, x):
        gate_up, down = params
        gate, up = F.linear(x, gate_up).chunk(2, dim=-1)
        return F.linear(act(gate) * up, down)
    return fn


def grouped_expert(act: Callable):
    """torchtitan-style GroupedExperts: w1 (F, H), w2 (H, F), w3 (F, H); `w2(act(w1 x) * w3 x)`."""
    def fn(params, x):
        w1, w2, w3 = params
        return F.linear(act(F.linear(x, w1)) * F.linear(x, w3), w2)
    return fn


def grouped_module_expert(module: nn.Module, names: list[str], counts_dtype: torch.dtype):
    """A GroupedExperts module's own forward `(rows, num_tokens_per_expert)`, called with one expert's
    parameters (stacked as one expert) and all the rows for it."""
    def fn(params, x):
        counts = torch.full((1,), x.shape[0], dtype=counts_dtype, device=x.device)
        return functional_call(module, {n: p.unsqueeze(0) for n, p in zip(names, params)}, (x, counts))
    return fn


def module_expert(template: nn.Module, names: list[str]):
    """A ModuleList expert: the first expert module, called with another expert's parameters."""
    def fn(params, x):
        return functional_call(template, dict(zip(names, params)), (x,))
    return fn


OWNED_NEEDS_PROCESSES = (
    "ModuleList experts under expert parallelism need one process per rank (gloo or NCCL): each rank holds "
    "different experts, which LocalTensorMode's one shared module cannot express. Fix: run under torchrun, "
    "or store the experts stacked (E, ...) as GroupedExperts / Hugging Face experts do.")


def local_expert_stack(params: list[torch.Tensor], axis: AxisRef | str, per_rank: int) -> torch.Tensor:
    """ModuleList experts under expert parallelism: stack this rank's experts (the others are empty
    here: each expert's weights live on the rank that owns it)."""
    axis = resolve_axis(axis)
    r = axis.local_rank()
    if not isinstance(r, int):
        raise NotImplementedError(OWNED_NEEDS_PROCESSES)
    return torch.stack(params[r * per_rank:(r + 1) * per_rank])


# ----------------------------------------------------------------------------- the graph op

@torch.library.custom_op("autopar::moe_experts", mutates_args=())
def moe_experts_op(key: str, x: torch.Tensor, idx: torch.Tensor, weights: torch.Tensor,
                   params: list[torch.Tensor]) -> torch.Tensor:
    with torch.no_grad():
        return moe_experts(x, idx, weights, list(params), key)


@moe_experts_op.register_fake
def _(key, x, idx, weights, params):
    return torch.empty_like(x)


# ----------------------------------------------------------------------------- all-to-all with splits

def _record_rows(axis: AxisRef, rows_total: int, rows_self: int, row_numel: int, itemsize: int, backward: bool):
    if not C._RECORDERS:
        return
    rec = C.CommRecord("all_to_all", axis.name, C.pass_name(backward), rows_total * row_numel,
                       (rows_total - rows_self) * row_numel * itemsize)
    for r in C._RECORDERS:
        r.append(rec)


def _a2a_rows(x: torch.Tensor, out_splits: list[int], in_splits: list[int], axis: AxisRef, backward: bool):
    me = axis.local_rank()
    _record_rows(axis, sum(in_splits), in_splits[me], math.prod(x.shape[1:]), x.element_size(), backward)
    return C._wait(_c10d.all_to_all_single(x.contiguous(), out_splits, in_splits, axis.group_name))


class _AllToAllRows(torch.autograd.Function):
    """Rows to ranks with uneven splits; backward sends the gradients back the same way."""

    @staticmethod
    def forward(ctx, x, out_splits, in_splits, axis):
        ctx.splits, ctx.axis = (out_splits, in_splits), axis
        return _a2a_rows(x, out_splits, in_splits, axis, backward=False)

    @staticmethod
    def backward(ctx, g):
        out_splits, in_splits = ctx.splits
        return _a2a_rows(g, in_splits, out_splits, ctx.axis, backward=True), None, None, None


def _counts_a2a(counts: torch.Tensor, axis: AxisRef) -> torch.Tensor:
    """Per-(destination rank, local expert) counts -> per-(source rank, local expert) counts."""
    n = axis.size
    _record_rows(axis, counts.numel(), counts.numel() // n, 1, counts.element_size(), False)
    return C._wait(_c10d.all_to_all_single(counts.contiguous(), [counts.numel() // n] * n,
                                           [counts.numel() // n] * n, axis.group_name))


# ----------------------------------------------------------------------------- run

def _run_grouped(spec: ExpertsSpec, params: list[torch.Tensor], rows: torch.Tensor, counts: list[int]) -> torch.Tensor:
    """Rows grouped by local expert (counts[e] rows for expert e) -> expert outputs, same order."""
    outs, start = [], 0
    for e, c in enumerate(counts):
        outs.append(spec.expert_fn([p[e] for p in params], rows[start:start + c]))
        start += c
    if not outs:
        return rows[:0]
    return torch.cat(outs, 0)


def _capacity_keep(idx: torch.Tensor, spec: ExpertsSpec, token_axes: tuple[AxisRef, ...], total_tokens: int):
    """Mask (T*k,) of assignments an expert keeps under capacity, counted in global (token, choice) order."""
    E, k = spec.num_experts, spec.top_k
    cap = math.ceil(spec.capacity_factor * total_tokens * k / E)
    flat = idx.reshape(-1)
    onehot = F.one_hot(flat, E)
    pos = onehot.cumsum(0) - onehot  # earlier local assignments to the same expert
    before = torch.zeros(E, dtype=pos.dtype, device=pos.device)
    block = onehot.sum(0)  # assignments per expert in the token block seen so far (inner axes first)
    for axis in reversed(token_axes):  # token shards are in rank-major order, outer mesh axis first
        gathered = C._wait(_c10d.all_gather_into_tensor(block.unsqueeze(0).contiguous(), axis.size,
                                                        axis.group_name))
        me = axis.local_rank()
        before = before + gathered[:me].sum(0)
        block = gathered.sum(0)
    return (pos.gather(1, flat.unsqueeze(1)).squeeze(1) + before[flat]) < cap


def moe_experts(x: torch.Tensor, idx: torch.Tensor, weights: torch.Tensor, params: list[torch.Tensor], key: str,
                axis: AxisRef | str | None = None, mode: str = "local", token_axes: tuple = (),
                total_tokens: int | None = None) -> torch.Tensor:
    """y[t] = sum_j weights[t, j] * expert_{idx[t, j]}(x[t]); see the module docstring for the modes."""
    spec = _SPECS[key]
    T, H = x.shape
    E, k = spec.num_experts, idx.shape[1]
    flat = idx.reshape(-1)
    keep = None
    if spec.capacity_factor is not None:
        keep = _capacity_keep(idx, spec, tuple(resolve_axis(a) for a in token_axes), total_tokens or T)
    w = weights.reshape(-1).to(x.dtype)
    if keep is not None:
        w = w * keep.to(w.dtype)
        flat = torch.where(keep, flat, torch.full_like(flat, E))  # dropped: routed to no expert
    if mode == "local":
        lo, e_local = 0, E
    else:
        axis = resolve_axis(axis)
        e_local = E // axis.size
        lo = axis.local_rank() * e_local
    if mode == "partial":  # replicated tokens: only assignments to this rank's experts
        mine = (flat >= lo) & (flat < lo + e_local)
        flat = torch.where(mine, flat, torch.full_like(flat, E))
    order = torch.argsort(flat, stable=True)
    counts = torch.bincount(flat, minlength=E + 1)
    sent = int(counts[:E].sum()) if mode != "partial" else int(counts[lo:lo + e_local].sum())
    order = order[:sent]  # assignments to no expert here (index E: dropped or another rank's) sort last
    token_of = order // k
    rows = permute_rows(x, token_of)  # (sent, H), grouped by expert
    if mode == "a2a":
        n = axis.size
        counts_e = counts[:E]
        recv_counts = _counts_a2a(counts_e, axis).view(n, e_local)
        in_splits = counts_e.view(n, e_local).sum(1).tolist()
        out_splits = recv_counts.sum(1).tolist()
        recv = _AllToAllRows.apply(rows, out_splits, in_splits, axis)  # (sum out_splits, H), by (source, expert)
        seg = torch.repeat_interleave(torch.arange(e_local, device=x.device).repeat(n), recv_counts.reshape(-1))
        regroup = torch.argsort(seg, stable=True)  # by (expert, source)
        grouped = permute_rows(recv, regroup)
        out = _run_grouped(spec, params, grouped, recv_counts.sum(0).tolist())
        back = unpermute_rows(out, regroup, None, recv.shape[0])  # (source, expert) order again
        rows_out = _AllToAllRows.apply(back, in_splits, out_splits, axis)
    else:
        rows_out = _run_grouped(spec, params, rows, counts[lo:lo + e_local].tolist())
    return unpermute_rows(rows_out, token_of, w[order], T)
