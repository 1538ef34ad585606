"""Equivalence harness: a parallelised model against the single-device model, loss, every gradient
and every parameter after an optimizer step. Runs under LocalTensorMode (all ranks in one process)
or inside real gloo worker processes (see dist_harness.py)."""

from __future__ import annotations

import copy
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor

import autopar
from autopar.runtime.collectives import record_comms


@dataclass
class Result:
    loss: float
    ref_loss: float
    grad_err: dict[str, float] = field(default_factory=dict)
    param_err: dict[str, float] = field(default_factory=dict)
    plan: object = None
    graph_module: object = None  # the lowered graph
    comm_counts: dict[str, int] = field(default_factory=dict)
    comms: list[tuple] = field(default_factory=list)  # (kind, axis, pass, numel, send_bytes) of the last step, in order
    graph_counts: dict[str, int] = field(default_factory=dict)
    local_numel: dict[str, int] = field(default_factory=dict)
    idle: set[str] = field(default_factory=set)  # parameters without a reference gradient
    elsewhere: set[str] = field(default_factory=set)  # parameters that live on other ranks only

    def max_err(self) -> float:
        return max([abs(self.loss - self.ref_loss), *self.grad_err.values(), *self.param_err.values()])


def _worst(t: torch.Tensor) -> float:
    """Max over every simulated rank (LocalTensor) or this rank's value."""
    lt = getattr(t, "_local_tensors", None)
    if lt is not None:
        return max(float(v) for v in lt.values())
    return float(t)


def loss_of(out) -> torch.Tensor:
    if isinstance(out, torch.Tensor):
        return out
    if isinstance(out, dict) or hasattr(out, "keys"):
        return out["loss"]
    return out[0]


def run_equivalence(ref: torch.nn.Module, inputs, mesh_shape, names, *, plan="megatron", overrides=None,
                    steps: int = 1, lr: float = 0.1, cluster=None, memory_limit=None,
                    optimizer=torch.optim.SGD) -> Result:
    """Parallelise a deepcopy of `ref` on a mesh of `mesh_shape`, train `steps` steps with `optimizer` (SGD) next
    to `ref`, return the errors. Must run with a process group (fake under LocalTensorMode, or gloo).
    `cluster` and `memory_limit` go to `autopar.parallelize` (what the `auto` plan is solved for)."""
    model = copy.deepcopy(ref)
    mesh = init_device_mesh("cpu", mesh_shape, mesh_dim_names=names)
    args, kwargs = (inputs, {}) if not isinstance(inputs, dict) else ((), inputs)
    pm = autopar.parallelize(model, mesh, inputs, plan=plan, overrides=overrides, cluster=cluster,
                             memory_limit=memory_limit)
    ref_opt = optimizer(ref.parameters(), lr=lr)
    opt = optimizer(pm.parameters(), lr=lr)
    res = Result(0.0, 0.0, plan=pm.plan)
    from torch.distributed._local_tensor import maybe_disable_local_tensor_mode
    for _ in range(steps):
        with maybe_disable_local_tensor_mode():  # the reference is one plain single-device run
            ref_opt.zero_grad()
            ref_loss = loss_of(ref(*args, **kwargs))
            ref_loss.backward()
        opt.zero_grad()
        with record_comms() as recs:
            loss = loss_of(pm(*args, **kwargs))
            loss.backward()
        res.loss = _worst((loss.detach() - ref_loss.detach()).abs()) + float(ref_loss)
        res.ref_loss = float(ref_loss)
        ref_params = dict(ref.named_parameters())
        for name, p in pm.named_parameters():
            rp = ref_params[name]
            if isinstance(p, DTensor) and p.device_mesh.get_coordinate() is None:
                res.elsewhere.add(name)  # an expert owned by other ranks (expert parallel ModuleList)
                continue
            if rp.grad is None:
                # a ModuleList expert that no token chose has no gradient on one device; its canonical
                # (stacked) form gives it a zero one, which SGD treats alike (see passes/moe.py)
                assert p.grad is None or _worst(p.grad.full_tensor().abs().max()) == 0, \
                    f"{name}: gradient where the reference has none"
                res.idle.add(name)
                continue
            assert isinstance(p, DTensor), f"{name} is not a DTensor"
            res.grad_err[name] = _worst((p.grad.full_tensor() - rp.grad).abs().max())
        with maybe_disable_local_tensor_mode():
            ref_opt.step()
        opt.step()
        for name, p in pm.named_parameters():
            if name not in res.elsewhere:
                res.param_err[name] = _worst((p.full_tensor() - ref_params[name].detach()).abs().max())
        counts: dict[str, int] = {}
        for r in recs:
            k = f"{r.kind}.{r.pass_}"
            counts[k] = counts.get(k, 0) + 1
        res.comm_counts = counts
        res.comms = [(r.kind, r.axis, r.pass_, r.numel, r.send_bytes) for r in recs]
    res.graph_counts = {}
    res.graph_module = pm.graph_module
    from passes.lower import collective_nodes
    for n in collective_nodes(pm.graph_module):
        res.graph_counts[n.target.__name__] = res.graph_counts.get(n.target.__name__, 0) + 1
    res.local_numel = {n: p.to_local().numel() for n, p in pm.named_parameters()}
    assert set(dict(pm.named_parameters())) == set(dict(ref.named_parameters())), "parameter names changed"
    return res


def gloo_equivalence(make_ref, inputs_fn, mesh_shape, names, plan="megatron", overrides=None, steps=1,
                     optimizer=torch.optim.SGD):
    """Run inside a gloo worker: build the same reference on every rank (seeded), compare."""
    torch.manual_seed(0)
    torch.set_default_dtype(torch.float64)
    try:
        ref = make_ref()
        inputs = inputs_fn()
        res = run_equivalence(ref, inputs, mesh_shape, names, plan=plan, overrides=overrides, steps=steps,
                              optimizer=optimizer)
    finally:
        torch.set_default_dtype(torch.float32)
    res.plan = res.graph_module = None  # not sent back from the worker
    return res


def compare_step(pm, ref: torch.nn.Module, inputs, *, lr: float = 0.1, context=None) -> dict[str, float]:
    """One training step of `pm` and of the single-device `ref` on `inputs` (a tuple of positional inputs or a
    dict of keyword inputs), both under `context()` when given (e.g. autocast), then one SGD step on each:
    the largest difference of the loss ("loss"), of every parameter's gradient ("grad NAME") and of every
    parameter after the step ("param NAME"), over every simulated rank."""
    import contextlib
    from torch.distributed._local_tensor import maybe_disable_local_tensor_mode
    args, kwargs = ((), inputs) if isinstance(inputs, dict) else (tuple(inputs), {})
    context = context or contextlib.nullcontext
    with maybe_disable_local_tensor_mode():  # the reference is one plain single-device run
        ref.zero_grad(set_to_none=True)
        with context():
            ref_loss = loss_of(ref(*args, **kwargs))
        ref_loss.backward()
    pm.zero_grad(set_to_none=True)
    with context():
        loss = loss_of(pm(*args, **kwargs))
    loss.backward()
    errs = {"loss": _worst((loss.detach().double() - ref_loss.detach().double()).abs())}
    ref_params = dict(ref.named_parameters())
    for name, p in pm.named_parameters():
        rp = ref_params[name]
        assert rp.grad is not None and p.grad is not None, f"{name}: no gradient"
        errs[f"grad {name}"] = _worst((p.grad.full_tensor().double() - rp.grad.double()).abs().max())
    with maybe_disable_local_tensor_mode():
        torch.optim.SGD(ref.parameters(), lr=lr).step()
    torch.optim.SGD(pm.parameters(), lr=lr).step()
    for name, p in pm.named_parameters():
        errs[f"param {name}"] = _worst((p.full_tensor().double() - ref_params[name].detach().double()).abs().max())
    assert set(dict(pm.named_parameters())) == set(ref_params), "parameter names changed"
    return errs
