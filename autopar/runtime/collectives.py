"""Autograd-correct collectives, each one fixed forward/backward pair (DESIGN.md §3).

| function           | forward                     | backward                         | placement change |
|--------------------|-----------------------------|----------------------------------|------------------|
| `all_reduce`       | all-reduce (sum)            | identity                         | P -> R           |
| `grad_all_reduce`  | identity                    | all-reduce (sum)                 | R -> R, partial grads (Megatron's f) |
| `all_gather`       | all-gather along dim        | local chunk (no communication)   | S(d) -> R        |
| `all_gather_rs`    | all-gather along dim        | reduce-scatter                   | S(d) -> R, partial grads (SP's g) |
| `split`            | local chunk (no comm.)      | all-gather                       | R -> S(d)        |
| `reduce_scatter`   | reduce-scatter along dim    | all-gather                       | P -> S(d)        |
| `all_to_all`       | all-to-all (split a, cat b) | all-to-all (split b, cat a)      | S(a) -> S(b)     |
| `grad_all_reduce_linears` | linears on x         | all-reduce x's gradient          | R -> S(-1)       |
| `regather_linears` | all-gather x, linears on it | all-gather x, reduce-scatter grad | S(d) -> S(-1)   |

The last two are column-parallel linears fused with the collective of their input (`grad_all_reduce`: Megatron's f;
`all_gather_rs`: SP's g), as Megatron-LM's `LinearWithGradAccumulationAndAsyncCommunication`, so that backward
computes the input gradient first, issues its reduction, and computes the weight gradients while it runs. `regather_linears` (Megatron SP) keeps x's shard, not the
gathered x, for the weight gradients, and all-gathers it again in backward (overlapped with the input gradient).

Every function takes an `AxisRef` naming the mesh axis; the process group is resolved at run time.
Collectives are issued through `torch.ops._c10d_functional` (followed by `wait_tensor`), so they
run on NCCL and gloo alike and are simulated by `LocalTensorMode`; every module of the runtime takes
them from `_c10d` here, which first settles a step's pending agreement among the ranks
(`before_next_collective`). `_StridedShard` layouts pass
`split_factor`: the tensor dim is k equal blocks, each block sharded over the axis.

`record_comms()` collects one `CommRecord` per collective executed (forward and backward), with
the bytes each rank sends under ring algorithms, for tests and benchmarks.
"""

from __future__ import annotations

import contextlib
import functools
import weakref
from dataclasses import dataclass

import torch
from torch.distributed._local_tensor import local_tensor_mode, maybe_run_for_local_tensor

from autopar.mesh import AxisRef, resolve_axis
from cost_model.analytical import send_bytes


class _Functional:
    """`torch.ops._c10d_functional` as the runtime issues every collective through it (`_c10d.all_reduce(...)`), with
    one thing first: a step's pending agreement among the ranks (`before_next_collective`) is settled (waited for,
    raising on every rank if they differ) before the first collective of the step is looked up."""

    def __getattr__(self, name: str):
        if (_BEFORE_COLLECTIVE or _RIDING) and not _DRY:
            settle_pending()
        op = _DRY_OPS[name] if _DRY else _OPS.get(name)
        if op is None:
            op = functools.partial(_below_autograd, getattr(torch.ops._c10d_functional, name))
            if not torch.compiler.is_compiling():  # a global dict grown while dynamo traces guards and recompiles
                _OPS[name] = op
        if _TRACKERS and name != "wait_tensor":
            return functools.partial(_tracked, _TRACKERS[-1], name, op)
        return op


def _below_autograd(op, *args):
    """`op(*args)` with no autograd to record: straight to the kernels below autograd. The functional collectives'
    autograd kernel is Python (`torch.library.register_autograd`), whose no-grad path does exactly this
    (`torch._library.autograd.autograd_impl` -> `forward_no_grad`) at ~20 us of host time per call: the runtime calls
    them inside its autograd functions (grad mode off), 2-5 times a data-parallel step. Anywhere a gradient could be
    recorded, and under torch.compile, the op as registered."""
    if torch.compiler.is_compiling() or (torch.is_grad_enabled() and torch._C._any_requires_grad(*args)):
        return op(*args)
    with torch._C._AutoDispatchBelowAutograd():
        return op(*args)


_OPS: dict[str, functools.partial] = {}  # collective name -> the op called through `_below_autograd`


_c10d = _Functional()
_BEFORE_COLLECTIVE: list = []  # at most one function: a step's agreement, run before its first collective
# At most one `autopar.agree.SummedAgreement`: a call's agreement waiting to ride on its loss's (sum, count)
# all-reduce (`ride_on_loss`); then, once appended to that pair, waiting to be checked (`_RIDDEN`).
_RIDING: list = []
_RIDDEN: list = []


def ride_on_loss(agreement) -> None:
    """Carry `agreement` (an `autopar.agree.SummedAgreement`) in this call's loss all-reduce: the next
    `ops.cross_entropy_sum_count` appends its row to the (sum, count) pair and `ops.sum_over_count` checks the summed
    row before it divides. Any collective issued first instead (through `_c10d`), or `settle_pending()`, all-reduces
    the row alone, on the same group: every rank's first collective of the call is that row's all-reduce either way."""
    _RIDDEN.clear()
    _RIDING[:] = [agreement]


def take_riding():
    """The agreement waiting to ride, now riding (None if there is none)."""
    if not _RIDING:
        return None
    agreement = _RIDING.pop()
    _RIDDEN[:] = [agreement]
    return agreement


def take_ridden():
    """The agreement whose row was appended to the loss's pair, to check on the summed pair (None if none)."""
    return _RIDDEN.pop() if _RIDDEN else None
_TRACKERS: list[list] = []  # the innermost list gets every collective issued (`tracking`); empty: nothing recorded


def _tracked(log: list, name: str, op, x: torch.Tensor, *rest):
    log.append((name, tuple(x.shape), x.dtype, x.device, rest))
    return op(x, *rest)


@contextlib.contextmanager
def tracking(log: list):
    """Every collective the runtime issues inside is appended to `log` as (op name, the input's shape, dtype and device,
    the op's other arguments: reduce op, group size, splits, group name), in issue order, so that `replay` can
    issue the same ones again (`autopar.pipeline_runtime`: a stage whose computation raised midway issues the rest
    of its program's collectives, which its peers wait in)."""
    _TRACKERS.append(log)
    try:
        yield log
    finally:
        _TRACKERS.pop()


_DRY: list = []  # non-empty inside `dry_run`: the collectives are local stand-ins


def _dry_all_gather(x, group_size, *_):
    return torch.cat([x] * group_size)


def _dry_reduce_scatter(x, _op, group_size, *_):
    return x.narrow(0, 0, x.shape[0] // group_size).clone()


def _dry_all_to_all(x, output_split_sizes, *_):
    if output_split_sizes is None:
        return x.clone()
    return x.new_zeros((sum(output_split_sizes), *x.shape[1:]))


# what `dry_run` issues instead of each collective: a local tensor of the result's shape, no communication
_DRY_OPS = {"all_reduce": lambda x, *_: x.clone(), "all_reduce_": lambda x, *_: x,
            "all_gather_into_tensor": _dry_all_gather, "reduce_scatter_tensor": _dry_reduce_scatter,
            "all_to_all_single": _dry_all_to_all, "wait_tensor": lambda x: x}


@contextlib.contextmanager
def dry_run():
    """Inside, every collective the runtime issues (through `_c10d`) is a local stand-in of the result's shape (an
    all-reduce returns its input, an all-gather repeats it, a reduce-scatter takes the first chunk): no
    communication, so one rank can run a program alone, under `tracking`, to learn which collectives it issues and
    in what order (`autopar.pipeline_runtime`: a tensor-parallel stage's program before its first real run). The
    values are meaningless; only the sequence counts."""
    _DRY.append(True)
    try:
        yield
    finally:
        _DRY.pop()


def replay(calls, fill: float = float("nan")) -> None:
    """Issue `calls` (entries of a `tracking` log) on tensors filled with `fill` (zeros for an integer dtype) and
    wait for each: what a rank whose program raised sends its peers instead, so they do not wait for a collective
    that never comes (and see NaN in what they receive)."""
    for name, shape, dtype, device, rest in calls:
        x = torch.full(shape, fill if dtype.is_floating_point or dtype.is_complex else 0, dtype=dtype, device=device)
        _wait(getattr(torch.ops._c10d_functional, name)(x, *rest))


def before_next_collective(fn) -> None:
    """Run `fn()` (an agreement's settle: `autopar.agree.agree_on_call(wait=False)`) just before the next collective
    the runtime issues, or at `settle_pending()`, whichever comes first."""
    _BEFORE_COLLECTIVE[:] = [fn]


def settle_pending(failed: bool = False) -> None:
    """Run the function `before_next_collective` left, if it has not run (it runs once, even if it raises); an
    agreement still waiting to ride (`ride_on_loss`) is all-reduced alone and checked. `failed`: the call's program
    raised on this rank: a waiting agreement tells the other ranks so (they raise rather than reduce without this
    rank), and is not checked here (this rank's own error is the one to raise)."""
    if _RIDING:
        _RIDING.pop().alone(failed=failed)()
    if _BEFORE_COLLECTIVE:
        fn = _BEFORE_COLLECTIVE.pop()
        fn()


@dataclass(frozen=True)
class CommRecord:
    kind: str  # all_reduce | all_gather | reduce_scatter | all_to_all
    axis: str
    # forward | backward | recompute (a checkpointed layer's forward collectives issued again in backward) | step (an
    # optimizer step's: ZeRO-1's parameter all-gather)
    pass_: str
    numel: int  # elements of the full (logical) tensor moved
    send_bytes: int  # bytes each rank sends (ring / pairwise algorithms)
    dtype: str = ""  # of the tensor moved, e.g. "bfloat16" (mixed precision: gathers in param_dtype, reductions not)


_RECORDERS: list[list[CommRecord]] = []
_RECOMPUTING = [0]  # > 0 while backward runs a checkpointed layer's forward again (`autopar.runtime.checkpoint`)
_STEPPING = [0]  # > 0 while an optimizer step gathers its parameters (ZeRO-1: `autopar.runtime.local_step`)


@contextlib.contextmanager
def stepping():
    """Collectives issued inside are recorded with pass "step": the optimizer step's (ZeRO-1's parameter gather)."""
    _STEPPING[0] += 1
    try:
        yield
    finally:
        _STEPPING[0] -= 1


@contextlib.contextmanager
def recomputing():
    """Collectives issued inside are recorded with pass "recompute": a checkpointed layer's forward run again in
    backward."""
    _RECOMPUTING[0] += 1
    try:
        yield
    finally:
        _RECOMPUTING[0] -= 1


@contextlib.contextmanager
def record_comms():
    records: list[CommRecord] = []
    _RECORDERS.append(records)
    try:
        yield records
    finally:
        _RECORDERS.remove(records)


def pass_name(backward: bool) -> str:
    """The pass a collective issued now belongs to: backward, a recompute in backward, or forward."""
    return "backward" if backward else "step" if _STEPPING[0] else "recompute" if _RECOMPUTING[0] else "forward"


def _record(kind: str, axis: AxisRef, t: torch.Tensor, full_numel: int, backward: bool) -> None:
    if not _RECORDERS:
        return
    rec = CommRecord(kind, axis.name, pass_name(backward), full_numel,
                     round(send_bytes(kind, full_numel * t.element_size(), axis.size)),
                     str(t.dtype).removeprefix("torch."))
    for r in _RECORDERS:
        r.append(rec)


# ----------------------------------------------------------------------------- raw collectives

def _wait(t: torch.Tensor) -> torch.Tensor:
    return _c10d.wait_tensor(t)


def _raw_all_reduce(x: torch.Tensor, axis: AxisRef, backward: bool = False, op: str = "sum") -> torch.Tensor:
    _record("all_reduce", axis, x, x.numel(), backward)
    return _wait(_c10d.all_reduce(x.contiguous(), op, axis.group_name))


def _piece(block: torch.Tensor, dim: int, n: int, r: int, zigzag: bool) -> torch.Tensor:
    """Rank r's piece of one block: chunk r of n, or chunks r and 2n-1-r of 2n on a zigzag axis."""
    if zigzag:
        chunks = block.chunk(2 * n, dim)
        return torch.cat([chunks[r], chunks[2 * n - 1 - r]], dim)
    # torch.chunk's chunk r, as DTensor's Shard splits: of a dim that does not divide, the last ranks' shorter or
    # empty (an uneven FSDP shard: `autopar.forms.fsdp.shard_dim`)
    size = -(-block.shape[dim] // n)
    start = min(r * size, block.shape[dim])
    return block.narrow(dim, start, min(size, block.shape[dim] - start))


def _to_blocks(x: torch.Tensor, dim: int, n: int, k: int, zigzag: bool = False) -> torch.Tensor:
    """Natural order -> rank-major order: rank r's pieces of all k blocks adjacent, ranks in order."""
    if k == 1 and not zigzag:
        return x
    blocks = x.chunk(k, dim)
    return torch.cat([_piece(b, dim, n, r, zigzag) for r in range(n) for b in blocks], dim)


def _from_blocks(x: torch.Tensor, dim: int, n: int, k: int, zigzag: bool = False) -> torch.Tensor:
    """Rank-major order (what an all-gather returns) -> natural order."""
    if k == 1 and not zigzag:
        return x
    per_rank = [r.chunk(k, dim) for r in x.chunk(n, dim)]  # [rank][block]
    out = []
    for b in range(k):
        if zigzag:
            halves = [per_rank[r][b].chunk(2, dim) for r in range(n)]
            out += [halves[j][0] if j < n else halves[2 * n - 1 - j][1] for j in range(2 * n)]
        else:
            out += [per_rank[r][b] for r in range(n)]
    return torch.cat(out, dim)


def _issue_all_gather(x: torch.Tensor, dim: int, axis: AxisRef, backward: bool = False) -> torch.Tensor:
    """Start an all-gather; `_finish_all_gather` waits for it (work in between overlaps it)."""
    n = axis.size
    _record("all_gather", axis, x, x.numel() * n, backward)
    return _c10d.all_gather_into_tensor(x.movedim(dim, 0).contiguous(), n, axis.group_name)


def _finish_all_gather(pending: torch.Tensor, dim: int, axis: AxisRef, split_factor: int = 1) -> torch.Tensor:
    y = _wait(pending).movedim(0, dim)  # (.., n*local, ..) in rank-major order
    return _from_blocks(y, dim, axis.size, split_factor, axis.zigzag).contiguous()


def _raw_all_gather(x: torch.Tensor, dim: int, axis: AxisRef, split_factor: int = 1, backward: bool = False):
    return _finish_all_gather(_issue_all_gather(x, dim, axis, backward), dim, axis, split_factor)


def _issue_reduce_scatter(x: torch.Tensor, dim: int, axis: AxisRef, split_factor: int = 1, backward: bool = False):
    """Start a reduce-scatter; `_finish_reduce_scatter` waits for it (work in between overlaps it)."""
    n = axis.size
    _record("reduce_scatter", axis, x, x.numel(), backward)
    x = _to_blocks(x, dim, n, split_factor, axis.zigzag)
    return _c10d.reduce_scatter_tensor(x.movedim(dim, 0).contiguous(), "sum", n, axis.group_name)


def _finish_reduce_scatter(pending: torch.Tensor, dim: int) -> torch.Tensor:
    return _wait(pending).movedim(0, dim).contiguous()


def _raw_reduce_scatter(x: torch.Tensor, dim: int, axis: AxisRef, split_factor: int = 1, backward: bool = False):
    return _finish_reduce_scatter(_issue_reduce_scatter(x, dim, axis, split_factor, backward), dim)


@maybe_run_for_local_tensor
def _take_chunk(x: torch.Tensor, dim: int, n: int, index: int, split_factor: int, zigzag: bool = False) -> torch.Tensor:
    blocks = x.chunk(split_factor, dim) if split_factor > 1 else [x]
    return torch.cat([_piece(b, dim, n, index, zigzag) for b in blocks], dim).contiguous()


def _raw_split(x: torch.Tensor, dim: int, axis: AxisRef, split_factor: int = 1) -> torch.Tensor:
    if x.shape[dim] % (axis.size * split_factor):
        raise ValueError(f"cannot split dim {dim} of size {x.shape[dim]} evenly over axis {axis}")
    if axis.zigzag and x.shape[dim] % (2 * axis.size * split_factor):
        raise ValueError(f"cannot split dim {dim} of size {x.shape[dim]} into 2x{axis.size} zigzag chunks over {axis}")
    return _take_chunk(x, dim, axis.size, axis.local_rank(), split_factor, axis.zigzag)


def _raw_all_to_all(x: torch.Tensor, split_dim: int, cat_dim: int, axis: AxisRef, backward: bool = False):
    n = axis.size
    if axis.zigzag:
        raise NotImplementedError(f"all-to-all over the context-parallel axis {axis} (zigzag layout) is not supported")
    _record("all_to_all", axis, x, x.numel(), backward)
    # chunks along split_dim go to ranks 0..n-1; received chunks are concatenated along cat_dim
    chunks = x.movedim(split_dim, 0).unflatten(0, (n, -1))  # (n, s/n, ...)
    send = chunks.contiguous().flatten(0, 1)
    splits = [send.shape[0] // n] * n
    recv = _wait(_c10d.all_to_all_single(send, splits, splits, axis.group_name))
    recv = recv.unflatten(0, (n, -1)).movedim(1, split_dim + 1)  # (n, ..., local split, ...)
    # recv[j] is rank j's piece: concatenate along cat_dim (shifted by the leading n)
    return torch.cat(recv.unbind(0), dim=cat_dim).contiguous()


# ----------------------------------------------------------------------------- mixed precision
# A parameter-side collective under a mixed-precision policy (`autopar.precision`) takes the master (e.g. fp32)
# parameter and `mp = (param_dtype, reduce_dtype)`: forward it casts to param_dtype first (an FSDP gather moves
# param_dtype bytes); backward it casts the gradient to reduce_dtype, reduces, and returns it in the input's dtype.
# The casts sit inside the collective because autograd hands each input the gradient in that input's dtype: a
# reduction after a separate cast would be rounded to param_dtype on the way back. Given `mp = (param_dtype,
# reduce_dtype, True)` a collective keeps its input's dtype (an all-gather gathers param_dtype bytes and returns them
# in it, exactly): in a chain of collectives on one parameter (several axes) only the last one casts.

def _to_param(x: torch.Tensor, mp) -> torch.Tensor:
    return x.to(mp[0]) if mp is not None and mp[0] is not None and mp[0] != x.dtype else x


def _to_reduce(g: torch.Tensor, mp) -> torch.Tensor:
    return g.to(mp[1]) if mp is not None and mp[1] is not None and mp[1] != g.dtype else g


def _to_input(g: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return g.to(dtype) if g.dtype != dtype else g


def _keeps_dtype(mp) -> bool:
    return mp is not None and len(mp) > 2 and mp[2]


# ----------------------------------------------------------------------------- autograd pairs

class _AllReduce(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, axis):
        return _raw_all_reduce(x, axis)

    @staticmethod
    def backward(ctx, g):
        return g, None


class _GradAllReduce(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, axis, *mp):  # mp: () or (param_dtype, reduce_dtype[, keep]) ("mixed precision" above)
        ctx.axis, ctx.mp, ctx.dtype = axis, (mp[0] if mp else None), x.dtype
        y = x if _keeps_dtype(ctx.mp) else _to_param(x, ctx.mp)
        return y if y is not x else x.view_as(x)

    @staticmethod
    def backward(ctx, g):
        gx = _to_input(_raw_all_reduce(_to_reduce(g, ctx.mp), ctx.axis, backward=True), ctx.dtype)
        return (gx, None) + ((None,) if ctx.mp is not None else ())


class _AllGather(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, dim, axis, split_factor, reduce_grad, mp=None):
        ctx.args = (dim, axis, split_factor, reduce_grad)
        ctx.mp, ctx.dtype = mp, x.dtype
        y = _raw_all_gather(_to_param(x, mp), dim, axis, split_factor)
        return _to_input(y, x.dtype) if _keeps_dtype(mp) else y

    @staticmethod
    def backward(ctx, g):
        dim, axis, split_factor, reduce_grad = ctx.args
        g = _to_reduce(g, ctx.mp)
        if reduce_grad:
            gx = _raw_reduce_scatter(g, dim, axis, split_factor, backward=True)
        else:
            gx = _raw_split(g, dim, axis, split_factor)
        return _to_input(gx, ctx.dtype), None, None, None, None, None


class _Split(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, dim, axis, split_factor):
        ctx.args = (dim, axis, split_factor)
        return _raw_split(x, dim, axis, split_factor)

    @staticmethod
    def backward(ctx, g):
        dim, axis, split_factor = ctx.args
        return _raw_all_gather(g, dim, axis, split_factor, backward=True), None, None, None


class _ReduceScatter(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, dim, axis, split_factor):
        ctx.args = (dim, axis, split_factor)
        return _raw_reduce_scatter(x, dim, axis, split_factor)

    @staticmethod
    def backward(ctx, g):
        dim, axis, split_factor = ctx.args
        return _raw_all_gather(g, dim, axis, split_factor, backward=True), None, None, None


class _AllToAll(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, split_dim, cat_dim, axis):
        ctx.args = (split_dim, cat_dim, axis)
        return _raw_all_to_all(x, split_dim, cat_dim, axis)

    @staticmethod
    def backward(ctx, g):
        split_dim, cat_dim, axis = ctx.args
        return _raw_all_to_all(g, cat_dim, split_dim, axis, backward=True), None, None, None


def _project(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None, in_out: bool) -> torch.Tensor:
    """linear(x, w, b) (w is (out, in)), or addmm(b, x, w) / mm(x, w) when `in_out` (w is (in, out), x 2-D)."""
    if not in_out:
        return torch.nn.functional.linear(x, w, b)
    return torch.mm(x, w) if b is None else torch.addmm(b, x, w)


# The linears' backward matmuls run in the dtype of their output gradient: the dtype autocast ran the forward in
# (operands cast as autocast does), else the operands' own. Autograd casts each returned gradient to its input's
# dtype; the input gradient is cast to it before it is summed and reduced, as autocast's casts would in the graph.

def _input_grad(grads, ws, in_out, dtype: torch.dtype) -> torch.Tensor:
    """The gradient of the input the linears share, in `dtype` (the input's): the sum of g_i @ w_i (w_i^T where
    `in_out`)."""
    gx = None
    for g, w, t in zip(grads, ws, in_out):
        gi = _to_input(g.matmul((w.t() if t else w).to(g.dtype)), dtype)
        gx = gi if gx is None else gx + gi
    return gx


def _param_grads(x: torch.Tensor | None, grads, need_w, need_b, in_out, bias_shapes) -> list:
    """(grad w_i, grad b_i) interleaved, None where not needed; `x` the linears' (full) input; a bias' gradient is
    the output gradient summed to the bias' shape (addmm broadcasts a (n,), (1, n) or (m, n) bias)."""
    out = []
    for g, nw, nb, t, shape in zip(grads, need_w, need_b, in_out, bias_shapes):
        g2 = g.reshape(-1, g.shape[-1])
        if nw:
            x2 = x.reshape(-1, x.shape[-1]).to(g.dtype)
            out.append(x2.t().mm(g2) if t else g2.t().mm(x2))
        else:
            out.append(None)
        out.append(g.sum_to_size(shape) if nb else None)
    return out


# Overlap of the tensor-parallel backward collectives with the weight gradients (Megatron-LM's
# `LinearWithGradAccumulationAndAsyncCommunication`). Set False to run them one after the other (the
# benchmark's baseline, `benchmarks/tp_overlap.py`); the collectives and the numbers are the same.
OVERLAP = [True]


class _AllReduceLinears(torch.autograd.Function):
    """`linear(x, w_i, b_i)` (or `addmm`/`mm` where `in_out[i]`) for each i, x replicated and each linear
    column-parallel, so x's gradient is partial: Megatron's f fused with the linears. Backward computes x's
    gradient first (summed over the linears), issues its all-reduce, computes the weight and bias gradients while
    it runs, then waits."""

    @staticmethod
    def forward(ctx, x, axis, in_out, *weights_and_biases):
        ws, bs = weights_and_biases[0::2], weights_and_biases[1::2]
        ctx.axis, ctx.in_out = axis, in_out
        ctx.bias_shapes = tuple(None if b is None else b.shape for b in bs)
        ctx.save_for_backward(x, *ws)
        return tuple(_project(x, w, b, t) for w, b, t in zip(ws, bs, in_out))

    @staticmethod
    def backward(ctx, *grads):
        x, *ws = ctx.saved_tensors
        need_x, need_w, need_b = ctx.needs_input_grad[0], ctx.needs_input_grad[3::2], ctx.needs_input_grad[4::2]
        pending = None
        if need_x:
            gx = _input_grad(grads, ws, ctx.in_out, x.dtype).contiguous()
            _record("all_reduce", ctx.axis, gx, gx.numel(), True)
            pending = _c10d.all_reduce(gx, "sum", ctx.axis.group_name)
            if not OVERLAP[0]:
                pending = _wait(pending)
        out = _param_grads(x, grads, need_w, need_b, ctx.in_out, ctx.bias_shapes)
        return (_wait(pending) if pending is not None else None, None, None, *out)


class _RegatherLinears(torch.autograd.Function):
    """`linear(full, w_i, b_i)` (or `addmm`/`mm` where `in_out[i]`) for each i, `full` the all-gather of `shard`
    along dim (Megatron sequence parallelism: SP's g fused with the column-parallel linears). Saves `shard`, not
    `full`. Backward (Megatron's order): issues the all-gather of `shard` again, computes full's gradient meanwhile
    (it needs only the output gradients and the weights), waits for the gather, issues the reduce-scatter of full's
    gradient (shard's gradient), computes the weight gradients on the gathered input while it runs, then waits."""

    @staticmethod
    def forward(ctx, shard, dim, axis, split_factor, in_out, *weights_and_biases):
        ws, bs = weights_and_biases[0::2], weights_and_biases[1::2]
        ctx.args = (dim, axis, split_factor, in_out)
        ctx.bias_shapes = tuple(None if b is None else b.shape for b in bs)
        ctx.save_for_backward(shard, *ws)
        full = _raw_all_gather(shard, dim, axis, split_factor)
        return tuple(_project(full, w, b, t) for w, b, t in zip(ws, bs, in_out))

    @staticmethod
    def backward(ctx, *grads):
        dim, axis, split_factor, in_out = ctx.args
        shard, *ws = ctx.saved_tensors
        need_x, need_w, need_b = ctx.needs_input_grad[0], ctx.needs_input_grad[5::2], ctx.needs_input_grad[6::2]
        pending = _issue_all_gather(shard, dim, axis, backward=True) if any(need_w) else None
        gx = _input_grad(grads, ws, in_out, shard.dtype) if need_x else None
        x = _finish_all_gather(pending, dim, axis, split_factor) if pending is not None else None
        if gx is not None:
            gx = _issue_reduce_scatter(gx, dim, axis, split_factor, backward=True)
            if not OVERLAP[0]:
                gx = _wait(gx)
        out = _param_grads(x, grads, need_w, need_b, in_out, ctx.bias_shapes)
        gshard = _finish_reduce_scatter(gx, dim) if gx is not None else None
        return (gshard, None, None, None, None, *out)


# ----------------------------------------------------------------------------- graph-callable API

def all_reduce(x: torch.Tensor, axis: AxisRef) -> torch.Tensor:
    """P -> R: sum over the axis; backward identity."""
    return _AllReduce.apply(x, resolve_axis(axis))


def grad_all_reduce(x: torch.Tensor, axis: AxisRef, mp=None) -> torch.Tensor:
    """R consumed by sharded work: identity; backward sums the partial gradients over the axis. `mp`: (param_dtype,
    reduce_dtype) of a mixed-precision parameter (see "mixed precision" above)."""
    return _GradAllReduce.apply(x, resolve_axis(axis), *(() if mp is None else (mp,)))


def all_gather(x: torch.Tensor, dim: int, axis: AxisRef, split_factor: int = 1, mp=None) -> torch.Tensor:
    """S(dim) -> R; backward takes this rank's chunk of the (replicated) gradient. `mp` as `grad_all_reduce`."""
    return _AllGather.apply(x, dim, resolve_axis(axis), split_factor, False, mp)


def all_gather_rs(x: torch.Tensor, dim: int, axis: AxisRef, split_factor: int = 1, mp=None) -> torch.Tensor:
    """S(dim) -> R feeding sharded work; backward reduce-scatters the partial gradients. `mp` as
    `grad_all_reduce`: an FSDP shard gathered in param_dtype, its gradient reduce-scattered in reduce_dtype."""
    return _AllGather.apply(x, dim, resolve_axis(axis), split_factor, True, mp)


def split(x: torch.Tensor, dim: int, axis: AxisRef, split_factor: int = 1) -> torch.Tensor:
    """R -> S(dim): keep this rank's chunk; backward all-gathers."""
    return _Split.apply(x, dim, resolve_axis(axis), split_factor)


def reduce_scatter(x: torch.Tensor, dim: int, axis: AxisRef, split_factor: int = 1) -> torch.Tensor:
    """P -> S(dim); backward all-gathers."""
    return _ReduceScatter.apply(x, dim, resolve_axis(axis), split_factor)


def all_to_all(x: torch.Tensor, split_dim: int, cat_dim: int, axis: AxisRef) -> torch.Tensor:
    """S(cat_dim) -> S(split_dim); backward is the inverse all-to-all."""
    return _AllToAll.apply(x, split_dim, cat_dim, resolve_axis(axis))


def grad_all_reduce_linears(x: torch.Tensor, axis: AxisRef, weights: tuple, biases: tuple,
                            in_out: tuple | None = None) -> tuple:
    """`linear(grad_all_reduce(x), w, b)` for every (w, b) (`addmm(b, x, w)` / `mm(x, w)` where `in_out`: w is (in,
    out)): column-parallel linears on a replicated x. Backward all-reduces x's gradient (one all-reduce for all the
    linears) while the weight gradients are computed."""
    in_out = tuple(in_out) if in_out is not None else (False,) * len(weights)
    interleaved = [t for wb in zip(weights, biases) for t in wb]
    return _AllReduceLinears.apply(x, resolve_axis(axis), in_out, *interleaved)


def regather_linears(shard: torch.Tensor, dim: int, axis: AxisRef, split_factor: int, weights: tuple, biases: tuple,
                     in_out: tuple | None = None) -> tuple:
    """`linear(all_gather_rs(shard), w, b)` for every (w, b) (`addmm(b, full, w)` / `mm(full, w)` where `in_out`: w
    is (in, out)): forward all-gathers `shard` along dim; keeps `shard` for backward and all-gathers it again there
    for the weight gradients, which overlap the reduce-scatter of the input gradient."""
    in_out = tuple(in_out) if in_out is not None else (False,) * len(weights)
    interleaved = [t for wb in zip(weights, biases) for t in wb]
    return _RegatherLinears.apply(shard, dim, resolve_axis(axis), split_factor, in_out, *interleaved)


# DDP's default bucket size (`bucket_cap_mb=25`): `bucket_gradients_pass` fills buckets of at most this many bytes of
# gradient (a larger parameter gets a bucket of its own), parameters in reverse order of first use, so the buckets
# of the last layers are reduced while the earlier layers' backward still runs. The first bucket holds at most
# DDP's first-bucket size (`dist._DEFAULT_FIRST_BUCKET_BYTES`), so a reduction is in flight early in the backward.
GRAD_BUCKET_BYTES = 25 * 2**20
FIRST_GRAD_BUCKET_BYTES = 2**20


class _GradSyncBucket(torch.autograd.Function):
    """Identity on several tensors; backward all-reduces all their gradients in one flat buffer.

    On a real process group the all-reduce is issued asynchronously and in place (as DDP does) and the backward
    returns plain views of the flat buffer, so the reduction overlaps the rest of the backward and no gradient is
    copied out. No gradient is read before it is reduced: when every input is `exclusive` (the bucket is its only
    consumer in the program, so its gradient reaches the input's autograd node from this bucket alone), that node
    waits for the all-reduce just before it runs (a pre-hook); for a parameter fed through `DTensor.to_local`, that
    node is created before the program runs and so runs at the end of the backward, after everything the reduction
    can overlap. Otherwise (an input with other consumers, a leaf, `create_graph=True`, a gradient cast back from
    reduce_dtype) the backward waits before it returns. A callback at the end of the backward waits for every
    reduction it issued. Under `LocalTensorMode` (simulated ranks) it is reduced synchronously."""

    @staticmethod
    def forward(ctx, axis, mp, exclusive, *xs):
        ctx.axis, ctx.mp = axis, mp
        ctx.shapes = [(x.shape, x.dtype) for x in xs]
        ctx.pending = []  # the flat buffer in flight, once the backward issued it; the pre-hooks wait for it
        nodes = {x.grad_fn for x in xs} if exclusive else {None}
        ctx.hooked = None not in nodes
        if ctx.hooked:
            for node in nodes:
                node.register_prehook(functools.partial(_wait_pending, ctx.pending))
        ys = [_to_param(x, mp) for x in xs]
        return tuple(y if y is not x else x.view_as(x) for x, y in zip(xs, ys))

    @staticmethod
    def backward(ctx, *grads):
        grads = [_to_reduce(g if g is not None else torch.zeros(s, dtype=d), ctx.mp)
                 for g, (s, d) in zip(grads, ctx.shapes)]
        flat = _flat_cat(grads)
        # compiled (a train step under torch.compile runs its backward's frames through dynamo): the functional,
        # out-of-place reduction, waited here; inductor cannot functionalize the in-place one
        if local_tensor_mode() is None and type(flat) is torch.Tensor and not torch.compiler.is_compiling():
            _record("all_reduce", ctx.axis, flat, flat.numel(), True)
            flat = _c10d.all_reduce_(flat, "sum", ctx.axis.group_name)
            cast = any(g.dtype != d for g, (_, d) in zip(grads, ctx.shapes))  # a cast back reads the buffer now
            if ctx.hooked and not cast and not torch.is_grad_enabled():
                ctx.pending.append(flat)
                torch.autograd.Variable._execution_engine.queue_callback(functools.partial(_wait, flat))
                torch.autograd.Variable._execution_engine.queue_callback(_after_backward)
            else:
                _wait(flat)
        else:
            flat = _raw_all_reduce(flat, ctx.axis, backward=True)
        views = (v.view(g.shape) for v, g in zip(flat.split([g.numel() for g in grads]), grads))
        return (None, None, None, *(_to_input(v, d) for v, (_, d) in zip(views, ctx.shapes)))


# On a CPU host each fresh bucket-sized buffer is new pages from the kernel (a 25 MiB allocation is mmapped and
# returned on free), zero-filled on first touch: about twice the cost of the copy itself. DDP keeps its buckets; here
# a bucket's flat buffer is reused at the next backward once nothing holds it any more (the gradients viewing it
# were set to None), up to `_POOL_BYTES` retained per process: between steps the process keeps the gradients' bytes,
# as DDP keeps its buckets. (FSDP's buffers are not pooled: a pool would keep a full group's gradients between
# steps, which FSDP exists not to hold.) CUDA's caching allocator already reuses memory.
_POOL: dict[tuple, list[torch.Tensor]] = {}
_POOL_BYTES = 2**30


def pooled_empty(numel: int, dtype: torch.dtype, like: torch.Tensor) -> torch.Tensor:
    """An uninitialised flat buffer on `like`'s device: on the CPU one of `_POOL`'s that nothing else holds if there
    is one; else (another device, a tensor subclass, simulated ranks) `like.new_empty`."""
    if like.device.type != "cpu" or type(like) is not torch.Tensor or local_tensor_mode() is not None:
        return like.new_empty(numel, dtype=dtype)
    device = like.device
    free = _POOL.setdefault((numel, dtype), [])
    for buf in free:
        if _idle(buf):
            return buf
    buf = torch.empty(numel, dtype=dtype, device=device)
    held = sum(b.numel() * b.element_size() for bufs in _POOL.values() for b in bufs)
    if held + buf.numel() * buf.element_size() <= _POOL_BYTES:  # as many per size as were in use at once
        free.append(buf)
    return buf


def _idle(buf: torch.Tensor) -> bool:
    """Nothing but the pool holds `buf`."""
    return torch._C._storage_Use_Count(buf.untyped_storage()._cdata) <= 2  # the pool's tensor and this call's


def idle_pooled() -> set[int]:
    """The data pointers of the pool's buffers nothing else holds: memory kept for reuse, not in use (a memory
    probe counts a pooled buffer while it is in use, `tests/memory_probe.py`)."""
    return {buf.untyped_storage().data_ptr() for bufs in _POOL.values() for buf in bufs if _idle(buf)}


def _flat_cat(grads: list[torch.Tensor]) -> torch.Tensor:
    """The gradients concatenated into one flat buffer (`pooled_empty`)."""
    parts = [g.reshape(-1) for g in grads]
    first = parts[0]
    if torch.compiler.is_compiling() or any(type(p) is not torch.Tensor or p.dtype != first.dtype for p in parts) or first.device.type != "cpu":
        return torch.cat(parts)
    return torch.cat(parts, out=pooled_empty(sum(p.numel() for p in parts), first.dtype, first))


def _wait_pending(pending: list, grad_inputs):
    """Pre-hook of the autograd node a bucket's gradient flows to: its all-reduce is complete before the node runs."""
    for flat in pending:
        _wait(flat)  # idempotent: waits only the first time


# Called once at the end of a backward that reduced gradients asynchronously (registered by `ParallelModule.forward`):
# they turn the parameters' gradients back into plain tensors once reduced, so users (torch.save, pickling, numpy)
# never meet an AsyncCollectiveTensor.
_AFTER_BACKWARD: list = []


def after_backward(fn) -> None:
    """Run `fn()` once at the end of the next backward that reduces gradients asynchronously (a weak reference to a
    bound method: a dropped module is skipped)."""
    ref = weakref.WeakMethod(fn) if hasattr(fn, "__self__") else (lambda: fn)
    if all(r() != fn for r in _AFTER_BACKWARD):
        _AFTER_BACKWARD.append(ref)


def _after_backward() -> None:
    pending, _AFTER_BACKWARD[:] = list(_AFTER_BACKWARD), []
    for ref in pending:
        fn = ref()
        if fn is not None:
            fn()


def grad_sync_bucket(xs: tuple, axis: AxisRef, mp=None, exclusive: bool = False) -> tuple:
    """Data-parallel gradient reduction of many parameters as one all-reduce (a DDP bucket), issued as soon as
    their gradients are ready and waited for by the end of the backward. `mp` as `grad_all_reduce`: the bucket is
    reduced in reduce_dtype. `exclusive`: the bucket is the only consumer of every x in the program
    (`bucket_gradients_pass` knows), so its reduction is waited for only where the gradients flow on, not before
    the bucket's backward returns."""
    return _GradSyncBucket.apply(resolve_axis(axis), mp, exclusive, *xs)


# What each graph-callable collective moves, forward and backward (used to count and price them).
COLLECTIVES: dict[object, tuple[str, str]] = {
    all_reduce: ("all_reduce", "-"),
    grad_all_reduce: ("-", "all_reduce"),
    all_gather: ("all_gather", "-"),
    all_gather_rs: ("all_gather", "reduce_scatter"),
    split: ("-", "all_gather"),
    reduce_scatter: ("reduce_scatter", "all_gather"),
    all_to_all: ("all_to_all", "all_to_all"),
    grad_sync_bucket: ("-", "all_reduce"),
    grad_all_reduce_linears: ("-", "all_reduce"),
    regather_linears: ("all_gather", "reduce_scatter+all_gather"),
}
