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
import difflib
import itertools
import os

from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.utils import _pytree as pytree

from autopar.agree import agree_across_ranks, agreed_seed, solve_on_rank0
from autopar.capture import Captured, capture, split_example_inputs
from autopar.checks import check_given_plan, check_model, check_options
from autopar.mesh import MeshInfo, mesh_info
from autopar.module import ParallelModule
from autopar.plan import Plan
from autopar.planner import PLANS, build_plan
from autopar.runtime.ops import new_rng_stream
from autopar.sites import PassContext
from passes.lower import comm_rows, lower_context, lower_pass
from passes.pipeline import RECOGNISE, run_passes

__all__ = ["parallelize", "plan", "ParallelModule"]


def plan(model: nn.Module, mesh, example_inputs, *, plan="auto", cluster=None, memory_limit=None,
         overrides=None) -> Plan:
    """Plan without running anything: `mesh` may be a DeviceMesh or axis sizes such as {"dp": 8, "tp": 8},
    and the model may live on the meta device. Returns the Plan with its cost estimate."""
    check_model(model)
    memory_limit = check_options(plan, cluster, memory_limit)
    info, captured, ctx = _prepare(model, mesh, example_inputs)
    with _local_tensor_off():
        chosen = _resolve_plan(plan, ctx, info, overrides, captured, cluster, memory_limit)
    return _tie_placements(chosen, model).with_comms((), captured.notes)


def parallelize(model: nn.Module, mesh: DeviceMesh, example_inputs, *, plan="auto", overrides=None, cluster=None,
                memory_limit=None) -> ParallelModule:
    """Turn a single-device model into a distributed program on `mesh`; see DESIGN.md §1."""
    if isinstance(mesh, dict):
        raise TypeError("parallelize needs a DeviceMesh (it runs the model); use autopar.plan(...) to plan for a "
                        "mesh given as axis sizes")
    check_model(model)
    _refuse_meta(model)
    memory_limit = check_options(plan, cluster, memory_limit)
    info, captured, ctx = _prepare(model, mesh, example_inputs)
    chosen = solve_on_rank0(lambda: _resolve_plan(plan, ctx, info, overrides, captured, cluster, memory_limit))
    chosen = _tie_placements(chosen, model)
    agree_across_ranks(chosen, mesh)
    stream = f"pm{next(_STREAMS)}"
    new_rng_stream(stream, agreed_seed(mesh))
    lctx = lower_context(chosen, captured, info, rng_stream=stream)
    gm = lower_pass(captured.gm, lctx)
    chosen = chosen.with_comms(comm_rows(gm, info), captured.notes + lctx.notes)
    return ParallelModule(model, mesh, captured, chosen, gm, stream)


# ----------------------------------------------------------------------------- steps

_STREAMS = itertools.count()


def _refuse_meta(model: nn.Module) -> None:
    """parallelize runs the model: until it can materialise a model on the meta device, it says so."""
    meta = [n for n, t in itertools.chain(model.named_parameters(), model.named_buffers()) if t.is_meta]
    if meta:
        raise NotImplementedError(
            f"the model is on the meta device ({', '.join(meta[:3])}{', ...' if len(meta) > 3 else ''}): "
            "parallelize does not support meta-device models yet. Fix: use autopar.plan(...) to plan it (planning "
            "works on the meta device), or materialise it first (model.to_empty(device=...), then initialise or "
            "load its weights).")


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
    source = "the given Plan"
    if isinstance(plan, (str, os.PathLike)):
        if not os.path.isfile(plan):
            near = difflib.get_close_matches(str(plan).lower(), PLANS, n=1)
            raise ValueError(f"plan {str(plan)!r} is neither a plan name ({', '.join(map(repr, PLANS))}) nor an "
                             "existing file. Fix: give one of the names"
                             + (f" (did you mean {near[0]!r}?)" if near else "")
                             + ", a Plan, or the path of a plan saved with Plan.save (the file must exist).")
        source = f"plan file {str(plan)!r}"
        plan = Plan.load(plan)
    if overrides:
        raise ValueError(f"overrides apply to the named plans {PLANS}; edit a saved Plan directly")
    check_given_plan(plan, source, info, captured)
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
