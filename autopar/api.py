"""Public entry points: `parallelize(model, mesh, example_inputs) -> ParallelModule` and `plan(...) -> Plan`.

capture -> recognise -> plan -> lower -> run (DESIGN.md §2):

| step      | where                                                      |
|-----------|------------------------------------------------------------|
| capture   | `autopar.capture` (torch.export, opaque submodules, MoE)    |
| recognise | `passes.pipeline.RECOGNISE` (typed sites, `autopar.sites`) |
| plan      | `autopar.planner` (named plans, overrides; the ILP in `autopar.solver`; forms in `autopar.forms`) |
| agree     | `autopar.agree` (rank 0 plans, every rank checks the hash)  |
| lower     | `passes.lower.LOWER` (from the plan alone)                  |
| run       | `autopar.module.ParallelModule`                             |
"""

from __future__ import annotations

import dataclasses
import itertools

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.utils import _pytree as pytree

from autopar.agree import agree_across_ranks, agreed_seed, solve_on_rank0
from autopar.capture import Captured, capture, split_example_inputs
from autopar.dtensors import mesh_device
from autopar.mesh import MeshInfo, mesh_info
from autopar.module import ParallelModule
from autopar.plan import Plan
from autopar.planner import PLANS, build_plan
from autopar.runtime.ops import new_rng_stream
from autopar.weights import is_meta_model
from autopar.sites import PassContext
from passes.lower import comm_rows, lower_context, lower_pass
from passes.pipeline import RECOGNISE, run_passes

__all__ = ["parallelize", "plan", "ParallelModule"]


def plan(model: nn.Module, mesh, example_inputs, *, plan="auto", cluster=None, memory_limit=None,
         overrides=None) -> Plan:
    """Plan without running anything: `mesh` may be a DeviceMesh or axis sizes such as {"dp": 8, "tp": 8},
    and the model may live on the meta device. Returns the Plan with its cost estimate."""
    info, captured, ctx = _prepare(model, mesh, example_inputs)
    with _local_tensor_off():
        chosen = _resolve_plan(plan, ctx, info, overrides, captured, cluster, memory_limit)
    return _tie_placements(chosen, model).with_comms((), captured.notes)


def parallelize(model: nn.Module, mesh: DeviceMesh, example_inputs, *, plan="auto", overrides=None, cluster=None,
                memory_limit=None) -> ParallelModule:
    """Turn a single-device model into a distributed program on `mesh`; see DESIGN.md §1. A model on the meta
    device is captured and planned on shapes and each rank allocates only its shards: fill them with
    `autopar.load(pm, path)` or `pm.init_weights()` (`autopar.weights`)."""
    if isinstance(mesh, dict):
        raise TypeError("parallelize needs a DeviceMesh (it runs the model); use autopar.plan(...) to plan for a "
                        "mesh given as axis sizes")
    _refuse_meta_moe(model)
    info, captured, ctx = _prepare(model, mesh, example_inputs)
    chosen = solve_on_rank0(lambda: _resolve_plan(plan, ctx, info, overrides, captured, cluster, memory_limit))
    chosen = _tie_placements(chosen, model)
    agree_across_ranks(chosen, mesh)
    stream = f"pm{next(_STREAMS)}"
    new_rng_stream(stream, agreed_seed(mesh))
    lctx = lower_context(chosen, captured, info, rng_stream=stream)
    gm = lower_pass(captured.gm, lctx)
    if is_meta_model(model):
        _meta_to_device(gm, mesh_device(mesh), captured)
    chosen = chosen.with_comms(comm_rows(gm, info), captured.notes + lctx.notes)
    return ParallelModule(model, mesh, captured, chosen, gm, stream)


# ----------------------------------------------------------------------------- steps

_STREAMS = itertools.count()


def _local_tensor_off():
    from torch.distributed._local_tensor import maybe_disable_local_tensor_mode
    return maybe_disable_local_tensor_mode()


def _prepare(model, mesh, example_inputs, overrides=None) -> tuple[MeshInfo, Captured, PassContext]:
    """Capture and recognise: the mesh's axes, the captured program, and its recognised sites."""
    info = mesh_info(mesh)
    args, kwargs = split_example_inputs(example_inputs)
    args, kwargs = _plain_inputs(args, kwargs)
    with _local_tensor_off():  # tracing runs on fake tensors, never on simulated ranks
        captured = capture(model, args, kwargs)
    ctx = PassContext(captured)
    run_passes(captured.gm, ctx, RECOGNISE)
    return info, captured, ctx


def _meta_to_device(gm, device, captured: Captured) -> None:
    """A meta-device model traces factory calls and moves (`arange(..., device=meta)`, `x.to(meta)`) on meta: the
    program runs them on the mesh's device."""
    lost = [name for name, c in captured.constants.items() if c.is_meta]
    if lost:
        raise NotImplementedError(
            f"the meta-device model's forward makes tensor constants on the meta device ({', '.join(lost)}), whose "
            "values no rank can know. Fix: build the model off the meta device, or make those tensors buffers.")
    def retarget(a):
        return device if isinstance(a, torch.device) and a.type == "meta" else a

    for node in gm.graph.nodes:
        if node.op == "call_function":
            node.args = pytree.tree_map(retarget, node.args)
            node.kwargs = pytree.tree_map(retarget, node.kwargs)
    gm.recompile()


def _refuse_meta_moe(model: nn.Module) -> None:
    """A meta-device model is parallelised without running it; an MoE block's canonical form is checked by running
    it on real weights, so a meta MoE model cannot be parallelised yet (it can be planned)."""
    if not is_meta_model(model):
        return
    from passes.moe import find_moe_modules
    found = find_moe_modules(model)
    if found:
        raise NotImplementedError(
            f"{type(model).__name__} is on the meta device and has MoE blocks ({found[0].path}, ...): autopar verifies "
            "its rewrite of an MoE block on real weights, which a meta model does not have, so parallelising a meta "
            "MoE model is not supported yet. Fix: build the model on the CPU (or its device) and parallelise that; "
            "autopar.plan(...) plans the meta model.")


def _plain_inputs(args, kwargs):
    """Inputs are global (the same on every rank): under LocalTensorMode, trace rank 0's copy."""
    from torch.distributed._local_tensor import LocalTensor

    def plain(a):
        if isinstance(a, LocalTensor):
            return a.reconcile()  # raises if the simulated ranks disagree
        return a

    return pytree.tree_map(plain, (args, kwargs))


def _resolve_plan(plan, ctx, info: MeshInfo, overrides, captured, cluster=None, memory_limit=None) -> Plan:
    """A named plan built for these sites, or a given / saved Plan checked against this model and mesh."""
    if isinstance(plan, str) and plan in PLANS:
        batch = {}
        flat_shapes = captured.example_shapes
        first = next((s for s in flat_shapes if s), None)
        for ph, s in zip(captured.user_inputs, flat_shapes):
            batch[ph] = s[0] if s and first and len(s) >= 1 and s[0] == first[0] else 0
        shapes = dict(zip(captured.user_inputs, flat_shapes))
        return build_plan(ctx, info, plan, overrides, batch, cluster=cluster, memory_limit=memory_limit,
                          input_shapes=shapes)
    if isinstance(plan, str):
        plan = Plan.load(plan)
    if not isinstance(plan, Plan):
        raise TypeError(f"plan must be one of {PLANS}, a Plan or a path to a saved plan; got {plan!r}")
    if overrides:
        raise ValueError(f"overrides apply to the named plans {PLANS}; edit a saved Plan directly")
    if tuple(plan.mesh) != tuple(zip(info.names, info.sizes)):
        raise ValueError(f"the plan was made for mesh {plan.mesh}, but this mesh is "
                         f"{tuple(zip(info.names, info.sizes))}; re-plan for this mesh")
    missing = set(captured.param_fqns.values()) - set(dict(plan.params))
    if missing:
        raise ValueError(f"the plan has no placement for parameters {sorted(missing)[:5]}; it was made for another model")
    return plan


def _tie_placements(plan: Plan, model: nn.Module) -> Plan:
    """Tied parameters (one tensor, several names) share one placement: the one the graph uses."""
    groups: dict[int, list[str]] = {}
    for fqn, p in model.named_parameters(remove_duplicate=False):
        groups.setdefault(id(p), []).append(fqn)
    pls = dict(plan.params)
    replicated = "R" * len(plan.mesh)
    for names in groups.values():
        chosen = {pls[n] for n in names if n in pls and pls[n] != replicated}
        if len(chosen) > 1:
            raise ValueError(f"tied parameters {names} were given different placements {sorted(chosen)}; "
                             "give the structures that share them compatible forms")
        if chosen:
            for n in names:
                pls[n] = next(iter(chosen))
    return dataclasses.replace(plan, params=tuple(pls.items()))
