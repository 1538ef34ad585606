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

from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.utils import _pytree as pytree

from autopar.agree import agree_across_ranks, agreed_seed, solve_on_rank0
from autopar.capture import Captured, capture, split_example_inputs
from autopar.mesh import MeshInfo, mesh_info
from autopar.module import ParallelModule
from autopar.plan import Plan
from autopar.planner import PLANS, build_plan, check_batch, check_memory_limit
from autopar.runtime.ops import new_rng_stream
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
    return _tie_placements(chosen, model, from_user=not (isinstance(plan, str) and plan in PLANS)) \
        .with_comms((), captured.notes)


def parallelize(model: nn.Module, mesh: DeviceMesh, example_inputs, *, plan="auto", overrides=None, cluster=None,
                memory_limit=None) -> ParallelModule:
    """Turn a single-device model into a distributed program on `mesh`; see DESIGN.md §1.

    `overrides` ({key: form}): where several keys name one structure, the most specific wins whatever the dict's
    order (an exact module path beats a glob, which beats a kind: `{"h.0.attn": "heads", "attention":
    "replicate"}` gives h.0.attn heads); equally specific keys that disagree raise. Requests that cannot be
    honoured raise rather than run otherwise: a plan whose estimate exceeds an explicit `memory_limit`
    (`InfeasibleError`), a batch that does not divide over the plan's data axes, tied parameters that a given
    Plan places differently.
    """
    if isinstance(mesh, dict):
        raise TypeError("parallelize needs a DeviceMesh (it runs the model); use autopar.plan(...) to plan for a "
                        "mesh given as axis sizes")
    info, captured, ctx = _prepare(model, mesh, example_inputs)
    chosen = solve_on_rank0(lambda: _resolve_plan(plan, ctx, info, overrides, captured, cluster, memory_limit))
    chosen = _tie_placements(chosen, model, from_user=not (isinstance(plan, str) and plan in PLANS))
    check_batch(chosen)  # on every rank, after rank 0's plan is shared: every rank raises alike
    check_memory_limit(chosen, memory_limit)
    agree_across_ranks(chosen, mesh)
    stream = f"pm{next(_STREAMS)}"
    new_rng_stream(stream, agreed_seed(mesh))
    lctx = lower_context(chosen, captured, info, rng_stream=stream)
    gm = lower_pass(captured.gm, lctx)
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


def _tie_placements(plan: Plan, model: nn.Module, from_user: bool = False) -> Plan:
    """Tied parameters (one tensor, several names) share one placement: the one the graph uses (a built plan
    places the name the graph reads; the others follow). A Plan the user gave must place them alike already."""
    groups: dict[int, list[str]] = {}
    for fqn, p in model.named_parameters(remove_duplicate=False):
        groups.setdefault(id(p), []).append(fqn)
    pls = dict(plan.params)
    replicated = "R" * len(plan.mesh)
    for names in groups.values():
        given = {n: pls[n] for n in names if n in pls}
        if from_user and len(set(given.values())) > 1:
            raise ValueError(
                f"tied parameters {names} (one tensor under several names) were given different placements "
                f"{given} by the plan; one tensor has one placement. Fix: give every name the same placement in "
                "the Plan (e.g. the one the graph uses, as autopar.plan(...) returns it), or re-plan.")
        chosen = {p for p in given.values() if p != replicated}
        if len(chosen) > 1:
            raise ValueError(f"tied parameters {names} were given different placements {sorted(chosen)}; "
                             "give the structures that share them compatible forms")
        if chosen:
            for n in names:
                pls[n] = next(iter(chosen))
    return dataclasses.replace(plan, params=tuple(pls.items()))
