"""Batch-local computations: an op without a sharding rule runs on the local shard when its rows are independent.

**The rule.** A computation is *batch-local* when each row of the batch in its outputs depends only on the same row
of its inputs, and its gradients likewise: given output cotangents split by rows, each row of an input's gradient
depends only on the same rows, and the gradient of an input without the batch (a parameter) is the sum over rows
of per-row gradients. Such a computation needs no sharding rule on a data axis (DDP needs none at all): with its
batched inputs split by rows over the axis, every rank runs it on its rows, its outputs are split by rows the same
way, and its unbatched inputs stay replicated, their gradients partial sums that the data-parallel reduction adds
(the lowering wraps a replicated input consumed into a sharded output in `grad_all_reduce`; FSDP reduce-scatters
it). Only a computation that mixes rows (a batch mean, BatchNorm in training, a softmax over the batch) gathers
its sharded inputs and runs whole on every rank.

**Where it applies** (`check_batch_locality`, run at capture on every batch-dependent node): an ATen (or
`torch.library` custom) op with no sharding rule (`passes.rules.rule_for`), such as `aten.lstm.input`,
`aten.gru.input`, `aten.rnn_tanh.input`; an opaque submodule (`autopar::opaque`: one torch.export cannot trace,
`autopar.runtime.opaque`); a custom `autograd.Function` kept whole (`autopar.functions`, also an opaque node);
and an op *with* a rule that gathers the batch (`rule_gathers_batch`: asked with its batch-dependent inputs split on
their batch dims, the rule wants one replicated, as DTensor's for eval-mode `native_batch_norm` does). Whatever its
rule, a batch-local node runs on the local shard of a data axis: the lowering uses `batch_local_rule` on any axis
where the op's own rule would gather an input that arrives split on its batch dim; one that is not batch-local
keeps its rule, and where that gathers the batch on a data axis it is said as for an op without a rule (a note,
`meta.GATHERED`, the warning). The result, a `RowLocality`, is stored on the node (`meta.ROWS`); `batch_local_rule`
is the lowering's rule for such a node (`passes.lower`): on an axis where the inputs arrive split on their batch
dims, every batched input is required split on its batch dim, every unbatched input replicated, and every output
is split on its batch dim (an empty output, eval BatchNorm's saved statistics, replicated); elsewhere (an input
split on another dim, strided) it is replicated (an unruled node) or as its rule says.
An opaque node known never to split by rows (`OpaqueModule.not_rows`: a CTC loss's targets concatenated in one 1-D
tensor, `autopar.canonical_losses`) is not checked: it is not batch-local, for that reason.

**The check** (`_row_check`), numerical, on random inputs of the traced shapes, CPU, fp64 where the op runs in
fp64 (else the traced dtype); weights scaled as nn.Linear initialises them. The rows of the batched inputs are
permuted and split in uneven chunks (1, 2, the rest); the op is run on the whole and on each chunk (the first chunk
twice, with different seeds), with random output cotangents split alike. Batch-local when, for every chunk, each
output equals the whole run's output at the chunk's rows along one dim (found numerically: the output's batch dim,
e.g. dim 1 for an LSTM's `(h_n, c_n)`), each batched input's gradient equals the whole run's at those rows, and the
unbatched inputs' gradients summed over the chunks equal the whole run's (tolerance `_TOLERANCE`: rtol 1e-7 in
fp64). The gradients are checked where the backward is the node's own (an opaque node, another library's op:
`_own_backward`); an ATen op's backward is its forward's derivative, whose Jacobian is block-diagonal over the rows
when the forward's is. A tensor's batch dim is a dim of the batch's size; where several dims have that size, or an
input computed without the batch (an LSTM's zero initial state) may or may not carry it, each assignment is tried
(at most `_MAX_ASSIGNMENTS`), the first that passes wins (the lowering uses it only where the input arrives split
on that dim). A parameter never carries the batch. An op that draws random numbers (dropout inside) is not
checkable: its runs with different seeds differ, so it stays replicated.

**Cost.** The check runs once per distinct (op or module type, shapes, dtypes, other arguments): repeated layers
are checked once (`RowChecks` caches per capture). An ATen op is checked on `_CHECK_ROWS` rows of the batch (its
semantics do not depend on the batch size); an opaque submodule or a Function on its traced shapes (its Python
may). A check whose inputs exceed `_MAX_CHECK_ELEMENTS` elements is not run: the node stays replicated, and the
notes say so. A meta-device model is checked alike (the inputs are random CPU tensors, not its weights); so is a
kernel for the CPU only: one that cannot run there stays replicated, noted. The forward FLOPs of the node
(torch's FLOP formulas on the whole run, `_FlopCount`, scaled to the traced batch) are kept too
(`RowLocality.flops`): `cost_model.analytical.node_cost` counts none for these ops. Measured: an `nn.LSTM`
(d 512, 256 steps, batch 8) is checked in about 1.3 s on one busy CPU core, its capture alone about as long.

**What a plan loses** (`record_work_pass`): after propagation, per node, the share of its work one rank does (the
most-split of its tensors, local over global elements) gives the per-rank FLOP fraction of the plan (per-rank
FLOPs over single-device FLOPs, `Work.fraction`, `Estimate.flop_fraction`), and the nodes that gathered inputs
split on a mesh axis (`meta.GATHERED`: unruled ones, ruled ones that gather the batch on a data axis) the
redundant work that `autopar.api.parallelize` warns about. The
cost model prices those that are not batch-local whole on every data rank (`autopar.estimate.SiteStats.unsplit`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
import math
from dataclasses import dataclass, field

import torch
from torch import fx
from torch.utils import _pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode

from passes import meta as M

_CHECK_ROWS = 3  # rows an ATen op is checked on (chunks of 1 and 2 rows, permuted)
_MAX_CHECK_ELEMENTS = 1 << 24  # inputs of a check, in elements: beyond, the node stays replicated
_MAX_ASSIGNMENTS = 16  # batch-dim assignments tried per node
_TOLERANCE = {torch.float64: (1e-7, 1e-9), torch.float32: (1e-4, 1e-5)}  # (rtol, atol); else (2e-2, 2e-2)


@dataclass(frozen=True)
class RowLocality:
    """What capture found about one unruled node's rows: `local` (batch-local) and, if so, the batch dim of each
    tensor input (None: unbatched, replicated) and of each output; else `why` not. `flops`: its forward FLOPs at
    the traced shapes as torch's FLOP counter measured them (0.0 where the check did not run)."""

    local: bool
    why: str = ""
    in_dims: tuple[int | None, ...] = ()
    out_dims: tuple[int | None, ...] = ()  # None: an empty output (eval BatchNorm's saved statistics), replicated
    flops: float = 0.0


# ----------------------------------------------------------------------------- capture: the check

@dataclass
class RowChecks:
    """The checks of one capture, cached by what decides them (repeated layers are checked once)."""

    batch_size: int
    cache: dict = field(default_factory=dict)


def check_batch_locality(gm: fx.GraphModule, user_inputs: list[str], batch_size: int) -> None:
    """Set `meta.ROWS` on every batch-dependent node that has no sharding rule (an unruled op, an opaque node) or
    whose rule gathers the batch (`rule_gathers_batch`)."""
    if batch_size < 2:
        return
    checks = RowChecks(batch_size)
    batch = _batch_dependent(gm, set(user_inputs))
    for node in gm.graph.nodes:
        if node in batch and (needs_row_check(node) or rule_gathers_batch(node, batch, batch_size)):
            node.meta[M.ROWS] = rows = _check_node(node, batch, checks)
            if rows.local and node.target is torch.ops.autopar.opaque.default:
                from autopar.runtime.opaque import describe
                describe(node.args[0]).rows = (batch_size, rows.in_dims, rows.out_dims)


def needs_row_check(node: fx.Node) -> bool:
    """A node the lowering has no rule for: an op without a registered rule, or an opaque node. (The lowering's
    own lookup, `passes.lower._Lowerer._call`, must agree: a node it finds a rule for never reads `meta.ROWS`.)"""
    from passes.rules import rule_for
    if node.op != "call_function" or not isinstance(node.target, torch._ops.OpOverload):
        return False
    return node.target is torch.ops.autopar.opaque.default or rule_for(node.target) is None


_ASKED_RANKS = 2  # the axis size a rule is asked on at capture (`rule_gathers_batch`)


def rule_gathers_batch(node: fx.Node, batch: set[fx.Node], batch_size: int) -> bool:
    """A node whose sharding rule gathers the batch: asked (`passes.rules.rule_for`) with every batch-dependent
    tensor input split on its batch dim (its first dim of the batch's size) over `_ASKED_RANKS` ranks, it requires
    one of them replicated (BatchNorm's rule, derived from DTensor's, wants its input whole). Such a node is
    row-checked too: batch-local, the lowering runs it on the local shard on that axis instead (`batch_local_rule`)."""
    from autopar.spec import R, Shard, is_shard
    from passes.rules import rule_for
    if node.op != "call_function" or not isinstance(node.target, torch._ops.OpOverload) or \
            batch_size % _ASKED_RANKS:
        return False
    rule = rule_for(node.target)
    if rule is None or getattr(rule, "wants_axis", False):
        return False
    tin = tensor_inputs(node)
    ins = []
    for t in tin:
        dim = next((d for d, s in enumerate(t.meta["val"].shape) if int(s) == batch_size), None) \
            if t in batch else None
        ins.append(R if dim is None else Shard(dim))
    if not any(is_shard(p) for p in ins):
        return False
    try:
        req, _ = rule(node, tin, ins, _ASKED_RANKS)
    except Exception:  # noqa: BLE001 - a rule that cannot answer here is asked again by the lowering
        return False
    return gathers(ins, req)


def gathers(ins, req) -> bool:
    """Whether a decision requires replicated some input that arrives split."""
    from autopar.spec import is_shard
    return any(is_shard(p) and not is_shard(r) for p, r in zip(ins, req))


def gathers_batch(node: fx.Node) -> bool:
    """Whether the lowering gathers the node's batch-split inputs on a data axis unless it is batch-local: it has no
    rule (or is opaque), or capture found that its rule gathers them (`rule_gathers_batch`: `meta.ROWS` set)."""
    return needs_row_check(node) or M.ROWS in node.meta


def _batch_dependent(gm: fx.GraphModule, user_inputs: set[str]) -> set[fx.Node]:
    batch: set[fx.Node] = set()
    for n in gm.graph.nodes:
        if (n.op == "placeholder" and n.name in user_inputs) or any(a in batch for a in n.all_input_nodes):
            batch.add(n)
    return batch


def tensor_inputs(node: fx.Node) -> list[fx.Node]:
    """The node's tensor inputs in the lowering's order (`passes.lower._Lowerer._tensor_inputs`)."""
    flat, _ = pytree.tree_flatten((node.args, node.kwargs))
    return [a for a in flat if isinstance(a, fx.Node) and isinstance(a.meta.get("val"), torch.Tensor)]


def _outputs(node: fx.Node) -> list:
    val = node.meta.get("val")
    return list(val) if isinstance(val, (list, tuple)) else [val]


def _check_node(node: fx.Node, batch: set[fx.Node], checks: RowChecks) -> RowLocality:
    if node.target is torch.ops.autopar.opaque.default:
        from autopar.runtime.opaque import describe
        if describe(node.args[0]).not_rows:  # known never to split by rows (CTC's concatenated targets)
            return RowLocality(False, describe(node.args[0]).not_rows)
    tin = tensor_inputs(node)
    outs = _outputs(node)
    if not outs or not all(isinstance(o, torch.Tensor) for o in outs):
        return RowLocality(False, "it returns values other than tensors")
    n = checks.batch_size
    options = []
    for t in tin:
        dims = [d for d, s in enumerate(t.meta["val"].shape) if int(s) == n]
        if t in batch and not dims:
            return RowLocality(False, f"its input {t.name} depends on the batch but has no dim of the batch's size {n}")
        # a parameter, buffer or constant never carries the batch; a value computed without it (an LSTM's zero
        # initial state) may: both are tried, the batch first
        options.append(dims if t in batch else [None] if t.op == "placeholder" else dims + [None])
    opaque = node.target is torch.ops.autopar.opaque.default
    key = (_what(node), tuple((tuple(t.meta["val"].shape), t.meta["val"].dtype) for t in tin),
           tuple(tuple(o.shape) for o in outs), _other_args(node))
    if key in checks.cache:
        return checks.cache[key]
    call = _caller(node)
    rows = n if opaque else min(n, _CHECK_ROWS)
    # a buffer or constant is not differentiated (BatchNorm's running statistics cannot be)
    frozen = [t.op == "placeholder" and not t.meta["val"].requires_grad for t in tin]
    result, first = None, None
    with _buffers_kept(node):
        for assignment in itertools.islice(filter(_alike(tin, options), itertools.product(*options)), _MAX_ASSIGNMENTS):
            if all(d is None for d in assignment):
                continue
            vals = [t.meta["val"] for t in tin]
            bad = None if opaque else _shapes_refused(call, vals, list(assignment), rows)
            got = RowLocality(False, bad) if bad else _row_check(call, vals, list(assignment), n, rows,
                                                                 _own_backward(node), frozen)
            if got.local:
                result = got
                break
            first = first or got
            if got.why.startswith(("it draws", "its check needs")):
                break  # the same whatever the assignment
    checks.cache[key] = result or first or RowLocality(False, "no input carries the batch")
    return checks.cache[key]


@contextlib.contextmanager
def _buffers_kept(node: fx.Node):
    """An opaque module's buffers as they were before its check ran it (a forward may update them)."""
    if node.target is not torch.ops.autopar.opaque.default:
        yield
        return
    from autopar.runtime.opaque import describe
    mod = describe(node.args[0]).module
    kept = [(b, b.detach().clone()) for b in mod.buffers()]
    try:
        yield
    finally:
        with torch.no_grad():
            for b, v in kept:
                b.copy_(v)


def _own_backward(node: fx.Node) -> bool:
    """Whether the node's gradients need checking apart from its forward: an ATen op's backward is the derivative
    of its forward, so rows independent forward (a block-diagonal Jacobian) are independent backward; an opaque
    node (a module, possibly with Functions of its own; a Function kept whole) or another library's op (its
    registered autograd) may differ."""
    return node.target is torch.ops.autopar.opaque.default or node.target.namespace != "aten"


def _what(node: fx.Node):
    """What decides the check besides shapes: the op, or an opaque node's module (type, configuration, mode)."""
    if node.target is not torch.ops.autopar.opaque.default:
        return node.target
    from autopar.runtime.opaque import describe
    mod = describe(node.args[0]).module
    return (type(mod), repr(mod), mod.training)


def _other_args(node: fx.Node):
    flat, _ = pytree.tree_flatten((node.args, node.kwargs))
    return tuple("T" if isinstance(a, fx.Node) else repr(a) for a in flat
                 if not (node.target is torch.ops.autopar.opaque.default and a is node.args[0]))


def _caller(node: fx.Node):
    """f(list of tensor inputs) -> list of tensor outputs, differentiable (an opaque node runs its module)."""
    flat, spec = pytree.tree_flatten((node.args, node.kwargs))
    slots = [i for i, a in enumerate(flat) if isinstance(a, fx.Node) and isinstance(a.meta.get("val"), torch.Tensor)]
    if node.target is torch.ops.autopar.opaque.default:
        from autopar.runtime.opaque import _run
        key, xs = node.args[0], node.args[1]

        def run_opaque(tensors):
            return _run(key, tensors[:len(xs)], tensors[len(xs):])
        return run_opaque

    def run_op(tensors):
        leaves = list(flat)
        for i, t in zip(slots, tensors):
            leaves[i] = t
        args, kwargs = pytree.tree_unflatten(leaves, spec)
        out = node.target(*args, **kwargs)
        return [o for o in pytree.tree_leaves(out) if isinstance(o, torch.Tensor)]
    return run_op


def _alike(tin: list[fx.Node], options: list[list]):
    """A filter on assignments: values of one shape and dtype that may carry the batch (not parameters, buffers,
    constants) carry it on the same dim (or neither does),
    as an LSTM's initial `(h_0, c_0)` do. Besides halving the assignments tried, it keeps the check from calling
    a kernel on states that disagree with each other, which `aten.lstm` does not check (on the CPU and on meta
    alike it reads past the smaller one and crashes the process)."""
    groups: dict[tuple, list[int]] = {}
    for i, t in enumerate(tin):
        if options[i] == [None]:
            continue
        groups.setdefault((tuple(t.meta["val"].shape), t.meta["val"].dtype), []).append(i)
    same = [g for g in groups.values() if len(g) > 1]
    return lambda assignment: all(len({assignment[i] for i in g}) == 1 for g in same)


def _shapes_refused(call, vals: list[torch.Tensor], in_dims: list, rows: int) -> str | None:
    """Why the op refuses its inputs with `rows` (and 1) rows on the dims `in_dims` (on the meta device: its shape
    checks, nothing computed), or None. Run before the numerical check because a wrong assignment can crash a CPU
    kernel instead of raising: `aten.lstm` given initial states whose layer dim was taken for the batch (2 layers,
    a batch of 2) reads past them and segfaults. An opaque node (Python) is not asked: its code may not run on meta."""
    from torch.utils._python_dispatch import _disable_current_modes
    try:
        with _disable_current_modes(), torch.no_grad():
            for r in dict.fromkeys((rows, 1)):
                call([torch.empty([r if d == dim else int(s) for d, s in enumerate(v.shape)], dtype=v.dtype,
                                  device="meta") for v, dim in zip(vals, in_dims)])
    except NotImplementedError:
        return None  # no meta kernel (a CPU-only custom op): the numerical check decides
    except Exception as e:  # noqa: BLE001 - whatever else the op raises, it refuses these shapes
        msg = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        return f"it refuses its inputs split on dims {in_dims} ({type(e).__name__}: {msg})"
    return None


def _random(v: torch.Tensor, dim: int | None, rows: int, dtype, gen: torch.Generator, positive: bool = False
            ) -> torch.Tensor:
    """Random values shaped like `v` with `rows` rows on its batch dim `dim`. An unbatched input (a weight) is scaled
    as nn.Linear initialises one, by 1/sqrt(its last dim): with unit weights a recurrence (an LSTM over many steps)
    is chaotic, and rounding alone would tell a chunk's run from the whole one's. `positive` (a buffer: statistics
    such as BatchNorm's running variance, whose negative values give NaN): uniform in [0.5, 1.5)."""
    if positive and v.is_floating_point():
        shape = [rows if d == dim else int(s) for d, s in enumerate(v.shape)]
        return torch.rand(shape, generator=gen, dtype=dtype) + 0.5
    shape = [rows if d == dim else int(s) for d, s in enumerate(v.shape)]
    if v.dtype is torch.bool:
        return torch.rand(shape, generator=gen) < 0.5
    if not v.is_floating_point():
        return torch.randint(0, 2, shape, generator=gen, dtype=v.dtype)  # valid indices into any dim of size >= 2
    scale = 1.0 if dim is not None or not shape else 1.0 / math.sqrt(max(1, shape[-1]))
    return torch.randn(shape, generator=gen, dtype=dtype) * scale


def _row_check(call, vals: list[torch.Tensor], in_dims: list, n: int, rows: int, grads: bool,
               frozen: list[bool]) -> RowLocality:
    """Whether `call` is batch-local with input batch dims `in_dims` (the module docstring's test)."""
    from torch.utils._python_dispatch import _disable_current_modes
    numel = sum(math.prod(rows if d == in_dims[i] else int(s) for d, s in enumerate(v.shape))
                for i, v in enumerate(vals))
    if numel > _MAX_CHECK_ELEMENTS:
        return RowLocality(False, f"its check needs {numel} input elements, more than autopar checks at capture "
                                  f"({_MAX_CHECK_ELEMENTS})")
    try:
        with _disable_current_modes(), torch.random.fork_rng(devices=[]), torch.enable_grad():
            traced = next((v.dtype for v in vals if v.is_floating_point()), torch.float64)
            dtypes = list(dict.fromkeys((torch.float64, traced)))  # fp64 where the op runs in it
            for i, dtype in enumerate(dtypes):
                try:
                    return _row_check_in(call, vals, in_dims, n, rows, dtype, grads, frozen)
                except (RuntimeError, TypeError, NotImplementedError):
                    if i == len(dtypes) - 1:
                        raise
    except Exception as e:  # noqa: BLE001 - a check that cannot run leaves the node replicated
        return RowLocality(False, f"it could not run on random CPU inputs to check its rows "
                                  f"({type(e).__name__}: {str(e).strip().splitlines()[0] if str(e).strip() else ''})")


class _FlopCount(TorchDispatchMode):
    """The FLOPs of the ops run under it, by torch's FLOP formulas (`torch.utils.flop_counter.flop_registry`:
    matmuls, convolutions, attention). `FlopCounterMode` counts the same but tracks modules, at several times the
    cost of an LSTM's many small ops."""

    def __init__(self):
        super().__init__()
        self.flops = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        from torch.utils.flop_counter import flop_registry
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        formula = flop_registry.get(func._overloadpacket)
        if formula is not None:
            self.flops += formula(*args, **kwargs, out_val=out)
        return out


def _row_check_in(call, vals, in_dims, n, rows, dtype, check_grads: bool, frozen: list[bool]) -> RowLocality:
    gen = torch.Generator().manual_seed(0)
    xs = [_random(v, d, rows, dtype, gen, positive=f) for v, d, f in zip(vals, in_dims, frozen)]
    for x, f in zip(xs, frozen):
        x.requires_grad_(x.is_floating_point() and not f)

    def run(inputs, seed):
        torch.manual_seed(seed)
        return call(inputs)

    with _FlopCount() as counter:
        whole = run(xs, 0)
    flops = counter.flops * n / rows
    result = _row_result(xs, whole, in_dims, rows, run, gen, dtype, check_grads)
    return dataclasses.replace(result, flops=flops)


def _row_result(xs, whole, in_dims, rows, run, gen, dtype, check_grads: bool) -> RowLocality:
    rtol, atol = _TOLERANCE.get(dtype, (2e-2, 2e-2))
    close = lambda a, b: a.shape == b.shape and torch.allclose(a, b, rtol=rtol, atol=atol)  # noqa: E731
    wrt = [i for i, x in enumerate(xs) if x.requires_grad] if check_grads else []
    cots = [torch.randn(w.shape, generator=gen, dtype=w.dtype) if w.is_floating_point() and w.numel() else None
            for w in whole]
    grads = _grads(whole, cots, [xs[i] for i in wrt])
    perm = torch.randperm(rows, generator=gen)
    chunks = [perm[:1], perm[1:3], perm[3:]] if rows >= 4 else [perm[:1], perm[1:]]  # uneven where rows > 2
    out_dims: list[int | None] = [None] * len(whole)
    summed = [torch.zeros_like(xs[i]) if in_dims[i] is None else None for i in wrt]
    for c, idx in enumerate(chunks):
        part = [x.detach().index_select(d, idx).requires_grad_(x.requires_grad) if d is not None else x
                for x, d in zip(xs, in_dims)]
        got = run(part, 0)
        if len(got) != len(whole):
            return RowLocality(False, "it returns another number of outputs on fewer rows")
        if c == 0 and not all(torch.equal(a, g) for a, g in zip(run(part, 1), got)):  # one row, another seed
            return RowLocality(False, "it draws random numbers (runs with different seeds differ), so its rows "
                                      "cannot be checked")
        for k, (g, w) in enumerate(zip(got, whole)):
            if w.numel() == 0:
                if g.numel() != 0:
                    return RowLocality(False, f"its output {k} is empty on all rows, not on fewer")
                continue
            if out_dims[k] is None:
                found = [d for d in range(w.dim()) if w.shape[d] == rows and g.shape[d] == len(idx)
                         and close(g.detach(), w.detach().index_select(d, idx))]
                if not found:
                    return RowLocality(False, f"its output {k} on a subset of the rows is not those rows of its "
                                              "output on all of them: it mixes rows of the batch")
                out_dims[k] = found[0]
            elif not close(g.detach(), w.detach().index_select(out_dims[k], idx)):
                return RowLocality(False, f"its output {k} mixes rows of the batch")
        part_cots = [c.index_select(d, idx) if c is not None else None for c, d in zip(cots, out_dims)]
        part_grads = _grads(got, part_cots, [part[i] for i in wrt])
        for j, (i, g, pg) in enumerate(zip(wrt, grads, part_grads)):
            g = torch.zeros_like(xs[i]) if g is None else g
            pg = torch.zeros_like(part[i]) if pg is None else pg
            if in_dims[i] is None:
                summed[j] = summed[j] + pg
            elif not close(pg, g.index_select(in_dims[i], idx)):
                return RowLocality(False, f"the gradient of its input {i} mixes rows of the batch")
    for j, i in enumerate(wrt):
        full = torch.zeros_like(xs[i]) if grads[j] is None else grads[j]
        if in_dims[i] is None and not close(summed[j], full):
            return RowLocality(False, f"the gradient of its unbatched input {i} is not the sum over rows")
    if any(d is None and w.numel() for d, w in zip(out_dims, whole)):
        return RowLocality(False, "an output does not carry the batch")
    return RowLocality(True, "", tuple(in_dims), tuple(out_dims))


def _grads(outs, cotangents, wrt):
    pairs = [(o, c) for o, c in zip(outs, cotangents) if c is not None and o.requires_grad]
    if not pairs or not wrt:
        return [None] * len(wrt)
    got = torch.autograd.grad([o for o, _ in pairs], wrt, [c for _, c in pairs], allow_unused=True)
    return [None if g is None else g.detach() for g in got]


# ----------------------------------------------------------------------------- lowering: the rule

def batch_local(node: fx.Node) -> RowLocality | None:
    found = node.meta.get(M.ROWS)
    return found if found is not None and found.local else None


def batch_local_rule(node, tin, ins, n):
    """A batch-local node on one mesh axis: inputs split on their batch dims there -> every batched input split on
    its batch dim, every unbatched one replicated (its gradient partial: reduced by data parallelism), every output
    split on its batch dim; otherwise replicated (inputs gathered)."""
    from autopar.spec import R, Shard
    from passes.rules import replicate_rule
    rows = node.meta[M.ROWS]
    if not on_batch_dims(rows, ins):
        return replicate_rule(node, tin, ins, n)
    req = [R if d is None else Shard(d) for d in rows.in_dims]
    outs = [R if d is None else Shard(d) for d in rows.out_dims]
    return req, outs if isinstance(node.meta.get("val"), (list, tuple)) else outs[0]


def on_batch_dims(rows: RowLocality, ins) -> bool:
    """Some input is split on this axis, and every split input on its batch dim (plainly, not strided)."""
    from autopar.spec import _StridedShard, is_shard
    split = [(i, p) for i, p in enumerate(ins) if is_shard(p)]
    return bool(split) and all(not isinstance(p, _StridedShard) and rows.in_dims[i] == p.dim for i, p in split)


def gathered_why(node: fx.Node, ruled: bool = False) -> str:
    """Why a node with no rule (`ruled`: whose rule gathers the batch) gathers its split inputs."""
    rows = node.meta.get(M.ROWS)
    head = "its sharding rule gathers the batch" if ruled else "no sharding rule"
    if rows is None:
        return head
    if not rows.local:
        return f"{head}, and not batch-local ({rows.why})"
    return f"{head}, and its inputs are split on dims other than their batch dims {list(rows.in_dims)}"


# ----------------------------------------------------------------------------- what the lowered plan runs per rank

@dataclass(frozen=True)
class Work:
    """The forward FLOPs of a lowered program (`record_work_pass`): on one device, per rank (each node's FLOPs
    times the share of them one rank does), and the nodes without a rule that gathered inputs split on a mesh axis:
    (node name, op, module path, axes, FLOPs)."""

    flops: float
    per_rank_flops: float
    unsplit: tuple[tuple[str, str, str, tuple[str, ...], float], ...] = ()

    @property
    def fraction(self) -> float:
        """Per-rank FLOPs over single-device FLOPs."""
        return self.per_rank_flops / self.flops if self.flops else 1.0

    def redundant(self, axes) -> tuple[list[tuple], float]:
        """The unsplit nodes gathered on any of `axes` (the data axes), and their share of the FLOPs."""
        found = [u for u in self.unsplit if set(u[3]) & set(axes)]
        return found, (sum(u[4] for u in found) / self.flops if self.flops else 0.0)


def node_flops(node: fx.Node) -> float:
    """Forward FLOPs of a node (`cost_model.analytical.node_cost`; for an op it counts none, such as an LSTM or an
    opaque node, those torch's FLOP counter measured at capture)."""
    from cost_model.analytical import node_cost
    flops = node_cost(node).flops
    rows = node.meta.get(M.ROWS)
    return float(flops or (rows.flops if rows is not None else 0.0))


def record_work_pass(gm: fx.GraphModule, ctx) -> fx.GraphModule:
    """After propagation (placements known, nothing fused yet): `gm.meta[meta.WORK]`, the program's `Work`. A node's
    share on one rank is that of its most-split tensor (input or output): local over global elements."""
    from autopar.runtime.collectives import COLLECTIVES
    from autopar.spec import is_shard
    sizes = ctx.mesh.sizes
    placed = dict(ctx.placements)
    placed.update(ctx.arrivals)

    def share(pls) -> float:
        return 1.0 / math.prod(n for p, n in zip(pls, sizes) if is_shard(p)) if pls else 1.0

    def placements(n: fx.Node):
        pls = n.meta.get(M.PLACEMENTS)
        if pls is None and n.op == "placeholder":
            pls = placed.get(n.name)
        return pls

    total = per_rank = 0.0
    unsplit = []
    for node in gm.graph.nodes:
        if node.op != "call_function" or node.target in COLLECTIVES:
            continue
        flops = node_flops(node)
        if node.meta.get(M.GATHERED):
            op, axes = node.meta[M.GATHERED]
            unsplit.append((node.name, op, _module(node), axes, flops))
        if not flops:
            continue
        outs = placements(node)
        outs = outs if isinstance(outs, list) else [outs]
        shares = [share(p) for p in outs if p is not None] + [share(placements(a)) for a in node.all_input_nodes
                                                              if placements(a) is not None
                                                              and not isinstance(placements(a), list)]
        total += flops
        per_rank += flops * min(shares, default=1.0)
    gm.meta[M.WORK] = Work(total, per_rank, tuple(unsplit))
    return gm


def _module(node: fx.Node) -> str:
    stack = node.meta.get("nn_module_stack")
    return list(stack.values())[-1][0] if stack else ""
