"""`verify(model, mesh, example_inputs, **parallelize_kwargs) -> VerifyReport`: the check to run once before a
long job. The single-device model (a deep copy, on every rank: for models that fit one device) and the parallel
module train `steps` SGD steps side by side on the same global inputs; the report gives, per step, the largest
difference of the loss, of every parameter's gradient and of every parameter after the step, each against a
tolerance set by the precision the model computes in, and `passed`.

What is compared, and against what scale (`Check.scale`):

| check  | difference                                   | scale                                              |
|--------|----------------------------------------------|----------------------------------------------------|
| loss   | |loss - reference loss|                       | |reference loss|                                    |
| grad   | max |grad.full_tensor() - reference grad|    | max |reference grad|                               |
| param  | max |param.full_tensor() - reference param|  | max |reference param - initial param| (the update)  |

A check passes when `difference <= rtol * max(scale, floor) + atol`: `floor` is 1e-3 of the largest scale
among the step's checks of the same kind (a gradient that is exactly zero on one device tolerates only noise
far below the model's gradients), `atol` is 0 except for parameters, where it is 4 ulps of the parameter
(both sides round `p - lr * g` to the parameter's precision). Parameters are measured against their update, not
their size, so a wrong gradient shows after the step however small `lr` is.

Tolerance (`rtol_for`): `sqrt(eps)` of the least precise floating dtype the captured program computes in (a
model in fp64 that rounds its logits to fp32 for the loss is checked at fp32's tolerance): fp64 1.5e-8, fp32
3.5e-4, fp16 3.1e-2, bf16 8.8e-2. A correct plan differs from one device only in the order of its sums and
in where it rounds: a sum of n terms reordered moves by about sqrt(n) * eps relative to its terms (the
random-walk bound of rounding errors), below sqrt(eps) for any reduction of fewer than 1/eps terms (8e6 in
fp32). A wrong plan (a dropped or doubled reduction, a wrong shard, a gradient scaled by the mesh size)
moves results by a relative 1/p or more, p <= 8 the size of a mesh axis. Pass `rtol=` to choose another.

Across ranks: every rank compares its own `full_tensor()` with its own reference, and the report holds the
largest difference over all ranks (a MAX all-reduce; under LocalTensorMode the largest over the simulated
ranks), so a wrong replica or shard on any one rank fails the check, and every rank gets the same report. The
reference starts from rank 0's parameters and inputs (broadcast), as `parallelize` does.

Random draws: a model that draws random numbers (dropout in training mode) cannot be compared with its
parallel program (the two draw different masks). `verify` runs the reference forward twice; if the losses
differ and the model is in training mode, both sides are checked in eval mode (`report.notes` says so);
if they differ in eval mode too, `verify` raises.

`parallelize` must leave the model as it was: `verify` compares every parameter and buffer of the model,
after parallelizing and after training the parallel module, with a copy taken before (`model_unchanged`).
"""

from __future__ import annotations

import copy
import math
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor
from torch.utils import _pytree as pytree

__all__ = ["verify", "VerifyReport", "Check", "rtol_for"]

_KINDS = ("loss", "grad", "param")
_FLOOR = 1e-3  # of the largest scale among a step's checks of one kind
_PARAM_ULPS = 4


def rtol_for(dtype: torch.dtype) -> float:
    """sqrt(machine epsilon): half the significant bits must agree (see the module docstring)."""
    return math.sqrt(torch.finfo(dtype).eps)


@dataclass(frozen=True, kw_only=True)
class Check:
    """One compared value: the loss of a step, or one parameter's gradient or value after a step."""

    kind: str  # loss | grad | param
    name: str  # "loss" or the parameter's fully-qualified name
    step: int  # 1-based
    dtype: str
    diff: float  # max |parallel - reference| over the tensor and over every rank
    scale: float  # what the difference is relative to (module docstring)
    limit: float  # the largest difference that passes: rtol * max(scale, floor) + atol
    rtol: float

    def __post_init__(self):
        if self.kind not in _KINDS:
            raise ValueError(f"Check.kind must be one of {_KINDS}, got {self.kind!r}")

    @property
    def rel(self) -> float:
        return self.diff / self.scale if self.scale > 0 else (0.0 if self.diff == 0 else math.inf)

    @property
    def passed(self) -> bool:
        return self.diff <= self.limit  # False for NaN

    @property
    def badness(self) -> float:
        """diff / limit: above 1 fails."""
        if math.isnan(self.diff):
            return math.inf
        return self.diff / self.limit if self.limit > 0 else (0.0 if self.diff == 0 else math.inf)


@dataclass(frozen=True, kw_only=True)
class VerifyReport:
    """What `verify` found; identical on every rank. `print(report)` for the summary and the failures."""

    plan: str  # one line: the plan's name, mesh and forms per kind of structure
    plan_table: str  # the plan's full table (`Plan.table()`)
    steps: int
    lr: float
    compute_dtype: str  # the least precise floating dtype the captured program computes in
    tolerances: tuple[tuple[str, float], ...]  # parameter dtype -> rtol used
    checks: tuple[Check, ...]
    model_unchanged: bool  # the model's parameters and buffers are as before parallelize and training
    parallelize_time_s: float
    reference_time_s: float  # the single-device model's `steps` steps (forward, backward, SGD)
    parallel_time_s: float  # the parallel module's, on the slowest rank (all simulated ranks: LocalTensorMode)
    notes: tuple[str, ...] = ()
    passed: bool

    def failures(self) -> list[Check]:
        return [c for c in self.checks if not c.passed]

    def worst(self, n: int = 5) -> list[Check]:
        """The `n` checks closest to (or furthest past) their limit."""
        return sorted(self.checks, key=lambda c: -c.badness)[:n]

    def loss_diffs(self) -> list[float]:
        return [c.diff for c in self.checks if c.kind == "loss"]

    def table(self) -> str:
        """One row per parameter and step (gradient and parameter after the step), after the loss rows."""
        rows = [("step", "value", "dtype", "max |diff|", "rel", "rtol", "", "param after step", "rel", "")]
        by_key = {(c.kind, c.name, c.step): c for c in self.checks}
        for c in self.checks:
            if c.kind == "loss":
                rows.append((str(c.step), "loss", c.dtype, _g(c.diff), _g(c.rel), _g(c.rtol), _ok(c), "", "", ""))
        for c in self.checks:
            if c.kind == "grad":
                p = by_key.get(("param", c.name, c.step))
                rows.append((str(c.step), c.name, c.dtype, _g(c.diff), _g(c.rel), _g(c.rtol), _ok(c),
                             _g(p.diff) if p else "-", _g(p.rel) if p else "-", _ok(p) if p else ""))
        widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
        lines = ["  ".join(x.ljust(w) for x, w in zip(r, widths)).rstrip() for r in rows]
        lines.insert(1, "  ".join("-" * w for w in widths))
        return "\n".join(lines)

    def __str__(self) -> str:
        fails = self.failures()
        head = "PASSED" if self.passed else "FAILED"
        lines = [f"autopar.verify: {head}: {self.plan}",
                 f"  {self.steps} SGD step(s), lr {self.lr:g}; the model computes in {self.compute_dtype}; "
                 "rtol " + ", ".join(f"{d} {r:.1e}" for d, r in self.tolerances),
                 f"  {len(self.checks)} checks (loss, every gradient, every parameter after each step), "
                 f"{len(fails)} failed; loss difference per step: " + ", ".join(_g(d) for d in self.loss_diffs()),
                 f"  time: parallelize {self.parallelize_time_s:.2f} s, single device {self.reference_time_s:.3f} s, "
                 f"parallel {self.parallel_time_s:.3f} s"]
        if not self.model_unchanged:
            lines.append("  the model was modified by parallelize or by training the parallel module (see notes)")
        lines += [f"  note: {n}" for n in self.notes]
        shown = fails[:20] if fails else self.worst(5)
        lines.append("  failed checks" + (f" (first 20 of {len(fails)})" if len(fails) > 20 else "") + ":" if fails
                     else "  closest to their limit:")
        for c in shown:
            what = "loss" if c.kind == "loss" else f"{c.kind} {c.name}"
            lines.append(f"    step {c.step} {what}: |diff| {_g(c.diff)} (rel {_g(c.rel)}), limit {_g(c.limit)}"
                         f" ({c.dtype}, rtol {c.rtol:.1e}){'' if c.passed else '  FAIL'}")
        return "\n".join(lines)


def _g(x: float) -> str:
    return f"{x:.3g}"


def _ok(c: Check) -> str:
    return "ok" if c.passed else "FAIL"


# ----------------------------------------------------------------------------- verify

def verify(model: nn.Module, mesh, example_inputs, *, steps: int = 1, lr: float = 1e-2, loss_fn=None,
           rtol: float | None = None, **parallelize_kwargs) -> VerifyReport:
    """Train `model` on one device and `autopar.parallelize(model, mesh, example_inputs, **parallelize_kwargs)`
    side by side for `steps` SGD steps (learning rate `lr`) and compare the loss, every gradient and every
    parameter after each step (module docstring). The model's output must be a scalar loss, or give `loss_fn`:
    `loss_fn(output) -> scalar tensor` (e.g. `lambda out: out.loss` for a Hugging Face model). `rtol`
    replaces the dtype's tolerance. Collective over the mesh: call it on every rank, with LocalTensorMode
    or a real process group. The model is not modified."""
    from autopar import api

    if not isinstance(steps, int) or steps < 1:
        raise ValueError(f"verify: steps must be a positive int, got {steps!r}")
    if not (isinstance(lr, (int, float)) and lr > 0):
        raise ValueError(f"verify: lr must be a positive number, got {lr!r}")
    if not isinstance(model, nn.Module):
        raise TypeError(f"verify: model must be an nn.Module, got {type(model).__name__}")
    if parallelize_kwargs.get("inputs", "global") != "global":
        raise NotImplementedError("verify compares the parallel module with one device on the same global "
                                  "batch; inputs='local' is not supported. Fix: pass the global batch.")
    _check_backend()
    meta = [n for n, t in list(model.named_parameters()) + list(model.named_buffers()) if t.is_meta]
    if meta:
        raise ValueError(f"verify runs the model on one device, but {meta[0]} (and {len(meta) - 1} more) is on the "
                         "meta device and has no values. Fix: materialise and initialise the model first.")
    args, kwargs = _split(example_inputs)
    notes: list[str] = []
    with _local_tensor_off():
        original = _snapshot(model)
        ref = copy.deepcopy(model)
        args, kwargs = _from_rank0(ref, args, kwargs, mesh, notes)
        start = _snapshot(ref)  # rank 0's
        if _draws_random_numbers(ref, args, kwargs, loss_fn, start):
            if not model.training:
                raise ValueError("verify: the model gives different outputs on two identical calls even in eval "
                                 "mode (it draws random numbers), so no comparison with its parallel program is "
                                 "meaningful. Fix: make the forward deterministic for the check (e.g. dropout "
                                 "only when self.training).")
            notes.append("the model draws random numbers in training mode (dropout): both sides were checked in "
                         "eval mode; dropout masks themselves are not compared")
            ref.eval()
    was_training = model.training
    if ref.training != was_training:
        model.eval()
    try:
        t0 = time.perf_counter()
        pm = api.parallelize(model, mesh, example_inputs, **parallelize_kwargs)
        parallelize_time = time.perf_counter() - t0
    finally:
        model.train(was_training)
    pm.train(ref.training)
    changed = _changed(model, original)
    compute = _compute_dtype(pm.graph_module, model)
    checks, ref_time, par_time = _train_side_by_side(ref, pm, args, kwargs, start, steps, lr, loss_fn,
                                                     compute, rtol)
    changed += [n for n in _changed(model, original) if n not in changed]
    parallelize_time, ref_time, par_time, any_changed = _rank_max(
        [parallelize_time, ref_time, par_time, float(bool(changed))], mesh)
    if changed:
        notes.append("parallelize or training the parallel module changed the model's "
                     + ", ".join(changed[:5]) + (f" and {len(changed) - 5} more" if len(changed) > 5 else ""))
    elif any_changed:
        notes.append("parallelize or training the parallel module changed the model on another rank")
    dtypes = sorted({c.dtype for c in checks if c.kind != "loss"})
    return VerifyReport(
        plan=_plan_line(pm.plan), plan_table=pm.plan.table(), steps=steps, lr=float(lr), compute_dtype=str(compute)
        .removeprefix("torch."), tolerances=tuple((d, _rtol(getattr(torch, d), compute, rtol)) for d in dtypes),
        checks=tuple(checks), model_unchanged=any_changed == 0, parallelize_time_s=parallelize_time,
        reference_time_s=ref_time, parallel_time_s=par_time, notes=tuple(notes),
        passed=any_changed == 0 and all(c.passed for c in checks))


def _train_side_by_side(ref, pm, args, kwargs, start, steps, lr, loss_fn, compute, rtol):
    ref_opt = torch.optim.SGD(ref.parameters(), lr=lr)
    opt = torch.optim.SGD(pm.parameters(), lr=lr)
    ref_params = dict(ref.named_parameters())
    checks: list[Check] = []
    ref_time = par_time = 0.0
    for step in range(1, steps + 1):
        with _local_tensor_off():  # the reference is one plain single-device run
            t0 = time.perf_counter()
            ref_opt.zero_grad()
            ref_loss = _loss(ref(*args, **kwargs), loss_fn, "the model")
            ref_loss.backward()
            ref_time += time.perf_counter() - t0
        t0 = time.perf_counter()
        opt.zero_grad()
        loss = _loss(pm(*args, **kwargs), loss_fn, "the parallel module")
        loss.backward()
        par_time += time.perf_counter() - t0
        rows = [("loss", "loss", ref_loss.dtype, (loss.detach() - ref_loss.detach()).abs(), ref_loss.detach().abs())]
        for name, p in pm.named_parameters():
            rp = ref_params[name]
            rows.append(("grad", name, p.dtype, *_grad_diff(p, rp)))
        with _local_tensor_off():
            t0 = time.perf_counter()
            ref_opt.step()
            ref_time += time.perf_counter() - t0
        t0 = time.perf_counter()
        opt.step()
        par_time += time.perf_counter() - t0
        for name, p in pm.named_parameters():
            rp = ref_params[name].detach()
            with _local_tensor_off():
                update = (rp - start[name]).abs().max() if rp.numel() else rp.new_zeros(())
                size = rp.abs().max() if rp.numel() else rp.new_zeros(())
            rows.append(("param", name, p.dtype, _diff(p, rp), update, size))
        checks += _checks(rows, step, pm.mesh, compute, rtol)
    return checks, ref_time, par_time


def _grad_diff(p, rp):
    """(max |parallel grad - reference grad|, max |reference grad|); a missing gradient counts as zeros."""
    with _local_tensor_off():
        rg = rp.grad if rp.grad is not None else torch.zeros_like(rp)
        scale = rg.abs().max() if rg.numel() else rg.new_zeros(())
    if _elsewhere(p):
        return rg.new_zeros(()), scale
    if p.grad is None:
        return scale, scale
    return _diff(p.grad, rg), scale


def _diff(t, ref: torch.Tensor):
    """max |t - ref| on this rank (a LocalTensor: one value per simulated rank). An expert weight owned by
    other ranks only (empty here) counts 0: its owners compare it."""
    if _elsewhere(t):
        return ref.new_zeros(())
    if isinstance(t, DTensor):
        t = t.full_tensor()
    if t.numel() == 0:
        return ref.new_zeros(())
    return (t.detach() - ref.detach()).abs().max()


def _elsewhere(t) -> bool:
    """An expert weight that lives on other ranks only (an `Owned` parameter, `autopar.dtensors.owned_tensor`)."""
    return isinstance(t, DTensor) and t.device_mesh.get_coordinate() is None


def _checks(rows, step, mesh, compute, rtol) -> list[Check]:
    """Reduce every row's difference over ranks (one MAX all-reduce) and compare it with its limit."""
    flat = []
    for row in rows:
        flat += [row[3], row[4]] + ([row[5]] if row[0] == "param" else [])
    values = iter(_rank_max(flat, mesh))
    reduced = []
    for kind, name, dtype, *_ in rows:
        diff, scale = next(values), next(values)
        size = next(values) if kind == "param" else 0.0
        reduced.append((kind, name, dtype, diff, scale, size))
    largest = {k: max((r[4] for r in reduced if r[0] == k), default=0.0) for k in _KINDS}
    out = []
    for kind, name, dtype, diff, scale, size in reduced:
        tol = _rtol(dtype, compute, rtol)
        atol = _PARAM_ULPS * torch.finfo(dtype).eps * size if kind == "param" else 0.0
        limit = tol * max(scale, _FLOOR * largest[kind]) + atol
        out.append(Check(kind=kind, name=name, step=step, dtype=str(dtype).removeprefix("torch."), diff=diff,
                         scale=scale, limit=limit, rtol=tol))
    return out


def _rtol(dtype: torch.dtype, compute: torch.dtype, override: float | None) -> float:
    if override is not None:
        return float(override)
    return max(rtol_for(dtype), rtol_for(compute))


def _rank_max(values: list, mesh) -> list[float]:
    """Each value's largest over every rank: over the simulated ranks of a LocalTensor, then (real process
    groups) one MAX all-reduce over the world. NaN counts as +inf so it survives the reduction."""
    out = []
    for v in values:
        per_rank = getattr(v, "_local_tensors", None)
        vals = [float(x) for x in per_rank.values()] if per_rank is not None else [float(v)]
        out.append(max(math.inf if math.isnan(x) else x for x in vals))
    if _real_world():
        device = "cuda" if mesh.device_type == "cuda" else "cpu"
        t = torch.tensor(out, dtype=torch.float64, device=device)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        out = t.tolist()
    return out


# ----------------------------------------------------------------------------- helpers

def _local_tensor_off():
    from torch.distributed._local_tensor import maybe_disable_local_tensor_mode
    return maybe_disable_local_tensor_mode()


def _simulated() -> bool:
    from torch.distributed._local_tensor import local_tensor_mode
    return local_tensor_mode() is not None


def _real_world() -> bool:
    return (dist.is_initialized() and dist.get_world_size() > 1 and not _simulated()
            and dist.get_backend() != "fake")


def _check_backend() -> None:
    if dist.is_initialized() and dist.get_backend() == "fake" and not _simulated():
        raise ValueError("verify: the default process group is the 'fake' backend, whose collectives return made-up "
                         "values, so nothing can be compared. Fix: run under LocalTensorMode (all ranks simulated "
                         "with real numbers) or on a real process group (torchrun with gloo or nccl).")


def _split(example_inputs):
    from autopar.capture import split_example_inputs
    return split_example_inputs(example_inputs)


def _loss(out, loss_fn, who: str) -> torch.Tensor:
    if loss_fn is not None:
        out = loss_fn(out)
    if not isinstance(out, torch.Tensor) or out.numel() != 1 or not out.is_floating_point():
        got = (f"a tensor of shape {tuple(out.shape)} and dtype {out.dtype}" if isinstance(out, torch.Tensor)
               else type(out).__name__)
        raise ValueError(f"verify: {who} {'gave loss_fn(output) =' if loss_fn else 'returned'} {got}, but verify "
                         "needs a scalar floating-point loss to differentiate. Fix: return the loss from forward, or "
                         "pass loss_fn=lambda output: <scalar loss> (e.g. lambda out: out.loss for a Hugging Face "
                         "model called with labels).")
    return out.reshape(())


def _snapshot(model: nn.Module) -> dict[str, torch.Tensor]:
    """Every parameter and buffer, cloned, by fully-qualified name."""
    out = {n: p.detach().clone() for n, p in model.named_parameters()}
    out.update({n: b.detach().clone() for n, b in model.named_buffers()})
    return out


def _changed(model: nn.Module, original: dict) -> list[str]:
    with _local_tensor_off():
        now = dict(model.named_parameters())
        now.update(dict(model.named_buffers()))
        return [n for n, t in original.items()
                if n not in now or now[n].shape != t.shape or not torch.equal(now[n].detach(), t)]


def _restore(model: nn.Module, original: dict) -> None:
    with torch.no_grad():
        for n, t in list(model.named_parameters()) + list(model.named_buffers()):
            if n in original:
                t.copy_(original[n])


def _from_rank0(ref: nn.Module, args, kwargs, mesh, notes: list[str]):
    """The reference starts from rank 0's parameters, buffers and inputs, as `parallelize` does (broadcast)."""
    if not _real_world():
        return args, kwargs
    tensors = [t for _, t in list(ref.named_parameters()) + list(ref.named_buffers())]
    differ = torch.zeros((), dtype=torch.float64, device="cuda" if mesh.device_type == "cuda" else "cpu")
    with torch.no_grad():
        for t in tensors:
            mine = t.detach().clone()
            dist.broadcast(t.data, src=0)
            differ = torch.maximum(differ, (~torch.eq(mine, t.data)).any().to(differ))

    def bcast(a):
        nonlocal differ
        if isinstance(a, torch.Tensor):
            b = a.detach().clone()
            dist.broadcast(b, src=0)
            differ = torch.maximum(differ, (~torch.eq(a, b)).any().to(differ))
            return b
        return a

    args, kwargs = pytree.tree_map(bcast, (args, kwargs))
    dist.all_reduce(differ, op=dist.ReduceOp.MAX)
    if differ.item():
        notes.append("the model or the inputs differ across ranks: both sides used rank 0's (seed the model's "
                     "initialisation and the data the same on every rank)")
    return args, kwargs


def _draws_random_numbers(ref: nn.Module, args, kwargs, loss_fn, start) -> bool:
    """Two identical forward calls of the reference disagree (its buffers are restored afterwards)."""
    with torch.no_grad():
        a = _loss(ref(*args, **kwargs), loss_fn, "the model")
        b = _loss(ref(*args, **kwargs), loss_fn, "the model")
    _restore(ref, start)
    return not torch.equal(a, b)


def _compute_dtype(gm, model: nn.Module) -> torch.dtype:
    """The least precise floating dtype of any value in the program (or of the parameters)."""
    dtypes = {p.dtype for p in model.parameters() if p.is_floating_point()}
    for n in gm.graph.nodes:
        for v in pytree.tree_leaves(n.meta.get("val")):
            if isinstance(v, torch.Tensor) and v.is_floating_point():
                dtypes.add(v.dtype)
    if not dtypes:
        return torch.get_default_dtype()
    return max(dtypes, key=lambda d: torch.finfo(d).eps)


def _plan_line(plan) -> str:
    counts: dict[tuple[str, str], int] = {}
    for s in plan.strategies:
        counts[(s.kind, s.label)] = counts.get((s.kind, s.label), 0) + 1
    forms = ", ".join(f"{k} {lbl} x{n}" for (k, lbl), n in sorted(counts.items()))
    mesh = ", ".join(f"{a}={n}" for a, n in plan.mesh)
    return f"plan {plan.name!r} on mesh ({mesh})" + (f": {forms}" if forms else "")
