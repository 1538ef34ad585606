"""Numerical check of sharding rules, op by op: forward and backward, fp64, every input placement.

For one sample of an op (its arguments: tensors and python values, `rule_samples.py`) and one
placement per tensor input on a 1-D mesh of n simulated ranks (`check_case`):

1. a one-node fx graph is built as capture builds it: placeholders whose `meta["val"]` is the global
   value, the op node whose `meta["val"]` is the op's global output, one `getitem` per output of a
   multi-output op;
2. every tensor input is a non-user placeholder placed as tested, so it arrives as a local shard
   (parameters do, see `passes.lower.LowerContext`), and the real lowering (`lower_pass`) runs: the
   rule under test decides, collectives are inserted, shapes are localised, ops are swapped for
   their parallel forms, graph outputs are made `R`;
3. the lowered graph runs under `LocalTensorMode(n)` with per-rank inputs: the shard for `S(d)`
   (each rank's piece of every block for `_StridedShard(d, k)`), the whole tensor for `R`, random
   summands (different per rank, summing to the value) for `P`;
4. every rank's output must equal the op on the full inputs; after a backward with a random
   cotangent (replicated: the gradient of an `R` value is complete on every rank) every rank's
   input gradient must be what the gradient convention (`autopar.spec`) says: its shard of the
   full gradient for `S(d)`, the full gradient for `R` and for every summand of `P`.

Nothing is skipped silently: an exception while lowering or running is a failure unless it is
listed in `EXPECTED_ERRORS` (a clear error the lowering raises on purpose); an op whose global
backward does not exist (e.g. `histc`) is checked forward only and says so in the outcome's note.

Which rules are checked: `RULES` as it is (its DTensor-derived and its own entries alike), or any rule
function for every op (`rules_replaced`: DTensor's answer for the ops that keep an own rule or have none,
an old rule reinstated to show the check catches it).
"""

from __future__ import annotations

import contextlib
import itertools
import math
import operator
import os
import random
import re
import traceback
from dataclasses import dataclass, field
from typing import Callable

import torch
from torch import fx
from torch.distributed._local_tensor import LocalTensor, maybe_disable_local_tensor_mode
from torch.utils import _pytree as pytree

from autopar.runtime import collectives as C
from autopar.runtime.ops import new_rng_stream
from autopar.spec import P, R, Partial, Placement, Replicate, Shard, _StridedShard, fmt
from passes import meta as M
from passes.lower import LowerContext, lower_pass
from passes.rules import RULES

# fp64 throughout: a wrong rule is off by far more than reassociated sums are
RTOL, ATOL = 1e-9, 1e-10
MAX_COMBOS = 32  # placement combinations per (sample, axis size): see `combinations`
RNG_STREAM = "rulecheck"


@dataclass
class Sample:
    """One call of an op: tensors and python values as the captured graph would hold them."""

    op: object
    args: tuple
    kwargs: dict = field(default_factory=dict)
    note: str = ""  # what the sample is about, e.g. "P + eps"
    worlds: tuple[int, ...] = (2,)  # mesh axis sizes to check on
    strided: int = 0  # k > 0: also try `_StridedShard(d, split_factor=k)` inputs (a fused QKV split: k = 3)
    check: str = "exact"  # "exact" | "shape": uninitialised output, shapes and dtypes only | "dropout"
    ref: Callable | None = None  # the global computation, when it is not `op(*args, **kwargs)`
    only: list[tuple[Placement, ...]] | None = None  # these combinations instead of all of them
    no_grad: tuple[int, ...] = ()  # tensor inputs (by position among the tensors) the op cannot differentiate

    @property
    def tensors(self) -> list[torch.Tensor]:
        flat, _ = pytree.tree_flatten((self.args, self.kwargs))
        return [a for a in flat if isinstance(a, torch.Tensor)]

    @property
    def name(self) -> str:
        def show(a):
            if isinstance(a, torch.Tensor):
                return f"{str(a.dtype).replace('torch.', '')}{list(a.shape)}"
            if isinstance(a, (list, tuple)):
                return "[" + ",".join(show(x) for x in a) + "]"
            if isinstance(a, torch.dtype):
                return str(a).replace("torch.", "")
            if isinstance(a, str) and "#" in a:  # a registry key (MoE experts): its stable part
                return repr(a.split("#")[0])
            return repr(a)
        text = ", ".join([show(a) for a in self.args] + [f"{k}={show(v)}" for k, v in self.kwargs.items()])
        return f"{op_name(self.op)}({text})" + (f" [{self.note}]" if self.note else "")


def op_name(op) -> str:
    return str(op).replace("aten.", "").replace(".default", "")


@dataclass
class Outcome:
    sample: Sample
    n: int
    placements: tuple[Placement, ...]
    ok: bool
    kind: str  # ok | expected error | forward | backward | lowering error | run error
    detail: str = ""
    decision: str = ""  # what the lowered graph does, node by node
    error: float = 0.0  # largest absolute error
    note: str = ""
    lowering_notes: list[str] = field(default_factory=list)  # what the lowering noted (`LowerContext.notes`)

    def line(self) -> str:
        pls = ",".join(fmt(p) for p in self.placements) or "-"
        return (f"{self.sample.name} n={self.n} in=({pls}): {self.kind}"
                + (f" err={self.error:.3g}" if self.error else "") + (f": {self.detail}" if self.detail else "")
                + (f"\n      lowered: {self.decision}" if self.decision else ""))


# Combinations the lowering refuses on purpose, with a clear error: (op, placements regex on "R,S(0)",
# message regex, why). A listed combination passes only if it raises that error.
EXPECTED_ERRORS: list[tuple[object, str, str, str]] = []


# ----------------------------------------------------------------------------- placements

def placement_options(t: torch.Tensor, n: int, strided: int = 0) -> list[Placement]:
    """R; S(d) for every dim that divides over n; `_StridedShard(d, strided)` where asked and it divides;
    P for floating tensors."""
    out: list[Placement] = [R]
    for d, size in enumerate(t.shape):
        if size > 0 and size % n == 0:
            out.append(Shard(d))
    if strided:
        for d, size in enumerate(t.shape):
            if size > 0 and size % (strided * n) == 0:
                out.append(_StridedShard(d, split_factor=strided))
    if t.dtype.is_floating_point:
        out.append(P)
    return out


def combinations(sample: Sample, n: int, max_combos: int | None = None) -> list[tuple[Placement, ...]]:
    """Every combination of input placements; above `max_combos` (default MAX_COMBOS), in this order
    until the cap: every input placed alike (where it can be), each input's options with the others R,
    then a fixed random choice of the rest."""
    if sample.only is not None:
        return list(sample.only)
    cap = MAX_COMBOS if max_combos is None else max_combos
    opts = [placement_options(t, n, sample.strided) for t in sample.tensors]
    total = math.prod(len(o) for o in opts)
    if total <= cap:
        return list(itertools.product(*opts))
    chosen: dict[tuple, None] = {}
    for p in dict.fromkeys(p for o in opts for p in o):
        chosen[tuple(p if p in o else R for o in opts)] = None
    for i, o in enumerate(opts):
        for p in o:
            chosen[tuple(p if j == i else R for j in range(len(opts)))] = None
    rng = random.Random(sample.name + str(n))
    every = list(itertools.product(*opts))
    rng.shuffle(every)
    for c in every:
        chosen[c] = None
        if len(chosen) >= cap:
            break
    return list(chosen)[:cap]


# ----------------------------------------------------------------------------- per-rank values

def _piece(t: torch.Tensor, p: Placement, n: int, r: int) -> torch.Tensor:
    """Rank r's local piece of the full tensor t placed p (written here, independent of the runtime)."""
    if isinstance(p, _StridedShard):
        return torch.cat([b.chunk(n, p.dim)[r] for b in t.chunk(p.split_factor, p.dim)], p.dim)
    if isinstance(p, Shard):
        return t.chunk(n, p.dim)[r]
    return t


def _summands(t: torch.Tensor, n: int, gen: torch.Generator) -> list[torch.Tensor]:
    """n random tensors, of mixed signs and larger than t, that sum to t."""
    parts = [torch.randn(t.shape, generator=gen, dtype=t.dtype) * (t.abs() + 1) for _ in range(n - 1)]
    return parts + [t - sum(parts)]


def _local(values: dict[int, torch.Tensor]) -> LocalTensor:
    return LocalTensor({r: v.contiguous() for r, v in values.items()})


# ----------------------------------------------------------------------------- graph

def _meta(v):
    if isinstance(v, torch.Tensor):
        return torch.empty_strided(v.shape, v.stride(), dtype=v.dtype, device="meta")
    if isinstance(v, (list, tuple)):
        return type(v)(_meta(x) for x in v)
    return v


def build_graph(sample: Sample, out_val) -> tuple[fx.GraphModule, list[str]]:
    """The one-node graph of the sample, as capture builds it (global values in meta["val"])."""
    g = fx.Graph()
    flat, spec = pytree.tree_flatten((sample.args, sample.kwargs))
    names = []
    for i, a in enumerate(flat):
        if isinstance(a, torch.Tensor):
            ph = g.placeholder(f"in{len(names)}")
            ph.meta["val"] = _meta(a)
            names.append(ph.name)
            flat[i] = ph
    args, kwargs = pytree.tree_unflatten(flat, spec)
    node = g.call_function(sample.op, tuple(args), dict(kwargs))
    node.meta["val"] = _meta(out_val)
    if isinstance(out_val, (list, tuple)):
        outs = []
        for j, v in enumerate(out_val):
            item = g.call_function(operator.getitem, (node, j))
            item.meta["val"] = _meta(v)
            outs.append(item)
        g.output(tuple(outs))
    else:
        g.output(node)
    return fx.GraphModule(torch.nn.Module(), g), names


def _describe(gm: fx.GraphModule) -> str:
    parts = []
    for node in gm.graph.nodes:
        if node.op != "call_function" or node.target.__name__ == "getitem":
            continue
        pls = node.meta.get(M.PLACEMENTS)
        if isinstance(pls, list):
            where = "[" + ",".join("".join(fmt(p) for p in x) for x in pls) + "]"
        else:
            where = "".join(fmt(p) for p in pls) if pls else "?"
        ins = ",".join(a.name for a in node.all_input_nodes)
        name = node.target.__name__ if node.target in C.COLLECTIVES or not isinstance(node.target, torch._ops.OpOverload) \
            else op_name(node.target)
        parts.append(f"{node.name}={name}({ins})->{where}")
    return "; ".join(parts)


# ----------------------------------------------------------------------------- rule table swaps

@contextlib.contextmanager
def rules_replaced(rule_for: Callable[[object], Callable | None]):
    """Every op's rule is `rule_for(op)` (None: no rule, i.e. replicated) while the block runs; the
    ops' rules in `RULES` come back afterwards. `passes.lower` reads the same dict object."""
    saved = dict(RULES)
    ops = set(saved) | set(getattr(rule_for, "extra_ops", ()))
    new = {op: rule_for(op) for op in ops}  # asked before the swap: rule_for may read RULES as it is
    try:
        RULES.clear()
        RULES.update({op: r for op, r in new.items() if r is not None})
        yield
    finally:
        RULES.clear()
        RULES.update(saved)


# ----------------------------------------------------------------------------- the check

def _global(sample: Sample, leaves: list[torch.Tensor]):
    """The op on the full inputs (leaves' clones, so in-place ops do not touch a leaf)."""
    it = iter(leaves)
    flat, spec = pytree.tree_flatten((sample.args, sample.kwargs))
    flat = [next(it).clone() if isinstance(a, torch.Tensor) else a for a in flat]
    args, kwargs = pytree.tree_unflatten(flat, spec)
    fn = sample.ref or sample.op
    return fn(*args, **kwargs)


def _flat_outputs(out) -> list[torch.Tensor]:
    return [o for o in (out if isinstance(out, (list, tuple)) else [out]) if isinstance(o, torch.Tensor)]


def _err(a: torch.Tensor, b: torch.Tensor, loose: bool = False) -> float:
    """Largest absolute error beyond the tolerance, 0.0 when a matches b (inf where shapes or dtypes differ).
    `loose`: a tensor of the case is fp32 or narrower, so values round at its precision (summands of P too)."""
    if a.shape != b.shape or a.dtype != b.dtype:
        return math.inf
    if torch.equal(a, b):
        return 0.0
    if not (a.dtype.is_floating_point or a.dtype.is_complex):
        return float((a.double() - b.double()).abs().max())
    rtol, atol = (1e-5, 1e-6) if loose or a.dtype != torch.float64 else (RTOL, ATOL)
    if torch.allclose(a, b, rtol=rtol, atol=atol, equal_nan=True):
        return 0.0
    same = (a == b) | (a.isnan() & b.isnan())
    diff = (a - b).abs().masked_fill(same, 0.0)
    bad = diff > atol + rtol * b.abs()
    return float(diff[bad].max()) if bool(bad.any()) else 0.0


def _ranks(t, n: int) -> list[torch.Tensor]:
    if isinstance(t, LocalTensor):
        return [t._local_tensors[r] for r in range(n)]
    return [t] * n


def _expected_error(sample: Sample, pls, exc: BaseException) -> str | None:
    text = ",".join(fmt(p) for p in pls)
    for op, pl_re, msg_re, why in EXPECTED_ERRORS:
        if op is sample.op and re.fullmatch(pl_re, text) and re.search(msg_re, str(exc)):
            return why
    return None


def check_case(sample: Sample, placements: tuple[Placement, ...], n: int, mesh_info, seed: int = 0) -> Outcome:
    """Lower and run one (sample, input placements) on n simulated ranks; see the module docstring.
    Must run inside `LocalTensorMode(n)` on a fake process group of n ranks, with `mesh_info` a 1-D
    mesh of n ranks (autopar.mesh.MeshInfo)."""
    gen = torch.Generator().manual_seed(seed)
    with maybe_disable_local_tensor_mode():
        full = [t.detach().clone().requires_grad_(t.dtype.is_floating_point and i not in sample.no_grad)
                for i, t in enumerate(sample.tensors)]
        ref = _global(sample, full)
        ref_outs = _flat_outputs(ref)
        gm, names = build_graph(sample, ref)
        diff_outs = [o for o in ref_outs if o.requires_grad]
        cots = [torch.randn(o.shape, generator=gen, dtype=o.dtype) for o in diff_outs]
        needs = [t for t in full if t.requires_grad]
        note = ""
        ref_grads = None
        if diff_outs and needs:
            try:
                ref_grads = torch.autograd.grad(diff_outs, needs, cots, allow_unused=True)
            except (RuntimeError, NotImplementedError) as e:
                if "not implemented" not in str(e) and "does not require grad" not in str(e):
                    raise
                note = f"forward only: the op has no backward ({str(e).splitlines()[0][:80]})"
        elif needs and any(o.dtype.is_floating_point for o in ref_outs):
            note = "forward only: no gradient flows through the op (its floating outputs do not require grad)"
        ref_grads = dict(zip(map(id, needs), ref_grads)) if ref_grads is not None else None
        per_rank = []
        for t, p in zip(full, placements):
            v = t.detach()
            if isinstance(p, Partial):
                per_rank.append(dict(enumerate(_summands(v, n, gen))))
            else:
                per_rank.append({r: _piece(v, p, n, r) for r in range(n)})
        ctx = LowerContext(mesh_info, {name: (p,) for name, p in zip(names, placements)}, set(),
                           rng_stream=RNG_STREAM)
        try:
            lowered = lower_pass(gm, ctx)
        except Exception as e:  # noqa: BLE001  (classified below: expected, or a failure)
            if os.environ.get("RULECHECK_TRACE"):
                traceback.print_exc()
            why = _expected_error(sample, placements, e)
            return Outcome(sample, n, placements, why is not None, "expected error" if why else "lowering error",
                           f"{type(e).__name__}: {str(e).splitlines()[0][:300]}" + (f" ({why})" if why else ""))
        decision = _describe(lowered)
        new_rng_stream(RNG_STREAM, 1234)
    leaves = []
    for t, vals in zip(full, per_rank):
        lt = _local(vals)
        if t.requires_grad:
            lt.requires_grad_()
        leaves.append(lt)
    try:
        inplace = getattr(sample.op, "_schema", None) is not None and sample.op._schema.name.endswith("_")
        out = lowered(*[lt.clone() if inplace else lt for lt in leaves])
        outs = _flat_outputs(out)
        if len(outs) != len(ref_outs):
            raise AssertionError(f"{len(outs)} outputs, the op has {len(ref_outs)}")
        got_grads = None
        if ref_grads is not None:
            local_diff = [o for o, r in zip(outs, ref_outs) if r.requires_grad]
            if any(not o.requires_grad for o in local_diff):
                return Outcome(sample, n, placements, False, "backward",
                               "an output has no gradient path in the lowered graph", decision)
            local_needs = [lt for lt, t in zip(leaves, full) if t.requires_grad]
            local_cots = [_local({r: c for r in range(n)}) for c in cots]
            got_grads = torch.autograd.grad(local_diff, local_needs, local_cots, allow_unused=True)
    except Exception as e:  # noqa: BLE001
        if os.environ.get("RULECHECK_TRACE"):
            traceback.print_exc()
        why = _expected_error(sample, placements, e)
        return Outcome(sample, n, placements, why is not None, "expected error" if why else "run error",
                       f"{type(e).__name__}: {str(e).splitlines()[0][:300] if str(e) else ''}"
                       + (f" ({why})" if why else ""), decision)
    with maybe_disable_local_tensor_mode():
        if sample.check == "dropout":
            return _check_dropout(sample, placements, n, full, outs, ref_grads, got_grads, cots, decision)
        loose = any(t.dtype.is_floating_point and t.dtype != torch.float64 for t in full + ref_outs)
        for i, (o, r) in enumerate(zip(outs, ref_outs)):
            for rank, v in enumerate(_ranks(o, n)):
                if sample.check == "shape":
                    e = 0.0 if (v.shape == r.shape and v.dtype == r.dtype) else math.inf
                else:
                    e = _err(v.detach(), r.detach(), loose)
                if e:
                    return Outcome(sample, n, placements, False, "forward",
                                   f"output {i} on rank {rank}: {_what(v, r)}", decision, e, note)
        if ref_grads is not None:
            grads = iter(got_grads)
            for j, (t, p) in enumerate(zip(full, placements)):
                if not t.requires_grad:
                    continue
                g = next(grads)
                want_full = ref_grads[id(t)]
                want_full = torch.zeros_like(t) if want_full is None else want_full
                for rank, v in enumerate(_ranks(g, n) if g is not None else [None] * n):
                    want = _piece(want_full, p, n, rank) if not isinstance(p, (Partial, Replicate)) else want_full
                    v = torch.zeros_like(want) if v is None else v
                    e = _err(v, want, loose)
                    if e:
                        return Outcome(sample, n, placements, False, "backward",
                                       f"gradient of input {j} ({fmt(p)}) on rank {rank}: {_what(v, want)}",
                                       decision, e, note)
    return Outcome(sample, n, placements, True, "ok", "", decision, 0.0, note, list(ctx.notes))


def _what(got: torch.Tensor, want: torch.Tensor) -> str:
    got, want = got.detach(), want.detach()
    if got.shape != want.shape:
        return f"shape {list(got.shape)}, expected {list(want.shape)}"
    if got.dtype != want.dtype:
        return f"dtype {got.dtype}, expected {want.dtype}"
    if got.dtype.is_floating_point:
        d = (got - want).abs()
        i = int(d.nan_to_num(math.inf).argmax())
        return (f"max |error| {float(d.nan_to_num(math.inf).max()):.3g} "
                f"(got {float(got.flatten()[i]):.6g}, expected {float(want.flatten()[i]):.6g})")
    return f"{int((got != want).sum())} of {want.numel()} elements differ"


def _check_dropout(sample, placements, n, full, outs, ref_grads, got_grads, cots, decision) -> Outcome:
    """Train-mode dropout draws its own mask: every output element is 0 or x/(1-p), the same on every
    rank (the output is R), and the gradient is the cotangent through that mask."""
    x = full[0].detach()
    p = sample.args[1]
    ranks = _ranks(outs[0], n)
    keep = ranks[0] != 0
    want = torch.where(keep, x / (1 - p), torch.zeros_like(x))
    for rank, v in enumerate(ranks):
        e = _err(v.detach(), want)
        if e:
            return Outcome(sample, n, placements, False, "forward", f"rank {rank}: not x/(1-p) or 0 with rank 0's "
                           "mask (masks differ between ranks, or values are wrong)", decision, e)
    frac = float(keep.double().mean())
    if not 0.2 < frac < 0.95:
        return Outcome(sample, n, placements, False, "forward", f"kept {frac:.2f} of the elements", decision)
    g_want = cots[0] * keep / (1 - p)
    for rank, v in enumerate(_ranks(got_grads[0], n)):
        want_r = _piece(g_want, placements[0], n, rank) if not isinstance(placements[0], (Partial, Replicate)) \
            else g_want
        e = _err(v, want_r)
        if e:
            return Outcome(sample, n, placements, False, "backward", f"rank {rank}: {_what(v, want_r)}", decision, e)
    return Outcome(sample, n, placements, True, "ok", "", decision)


def check_sample(sample: Sample, n: int, mesh_info, max_combos: int | None = None) -> list[Outcome]:
    return [check_case(sample, pls, n, mesh_info, seed=i)
            for i, pls in enumerate(combinations(sample, n, max_combos))]
