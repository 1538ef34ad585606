"""Checks of what users pass to `autopar.plan` and `autopar.parallelize`, each raising what is wrong, what was
given and the fix, before any work is done (`check_model`, `check_options`) or before a given plan is used
(`check_given_plan`: a Plan object or one loaded from a file, against this mesh, model and graph)."""

from __future__ import annotations

import itertools
import os

from torch import nn
from torch.distributed.tensor import DTensor

from autopar.captured import Captured
from autopar.forms import form_of
from autopar.mesh import MeshInfo
from autopar.module import ParallelModule
from autopar.plan import Plan
from autopar.planner import PLANS
from autopar.sites import Kind
from autopar.spec import Partial, _StridedShard, is_owned, is_shard, placements_from_str
from autopar.units import parse_bytes
from cost_model.hardware import check_cluster_spec

__all__ = ["check_model", "check_options", "check_given_plan"]

_REDO = "Fix: re-plan for this model, mesh and inputs (autopar.plan(...)) and save that plan."


def check_model(model) -> None:
    """Before capture: the model must be a single-device nn.Module, not one autopar (or FSDP/TP) already
    parallelised."""
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    inner = next((n or "the model" for n, m in model.named_modules() if isinstance(m, ParallelModule)), None)
    if inner is not None:
        raise TypeError(f"{inner} is a ParallelModule, the result of autopar.parallelize: autopar parallelises a "
                        "single-device model once. Fix: pass the original model to parallelize (with another mesh or "
                        "plan if you want another layout); pm.plan shows what the ParallelModule runs.")
    held = [n for n, t in itertools.chain(model.named_parameters(), model.named_buffers()) if isinstance(t, DTensor)]
    if held:
        raise ValueError(f"the model already holds DTensors ({', '.join(held[:3])}{', ...' if len(held) > 3 else ''}"
                         f"; {len(held)} in all): it was parallelised before (fully_shard, parallelize_module or "
                         "distribute_tensor). autopar takes a single-device model with plain tensors. Fix: pass the "
                         "model before it was parallelised, or one with plain weights (DTensor.full_tensor()).")


def check_options(plan, cluster, memory_limit) -> int | None:
    """Before capture, the options' types; returns memory_limit in bytes (None: the cluster's device memory)."""
    if not isinstance(plan, (str, os.PathLike, Plan)):
        raise TypeError(f"plan must be one of {', '.join(map(repr, PLANS))}, a Plan or the path of a saved plan; "
                        f"got {type(plan).__name__} {plan!r}")
    check_cluster_spec(cluster)
    return parse_bytes(memory_limit, "memory_limit")


def check_given_plan(plan: Plan, source: str, info: MeshInfo, captured: Captured,
                     names: set[str] | None = None) -> None:
    """A plan given (or loaded from `source`) fits this mesh, this model's parameters (`names`: all of their names,
    tied aliases too; a plan entry for any other name is refused), known kinds and forms, the tensors' shapes and
    this graph."""
    if tuple(plan.mesh) != tuple(zip(info.names, info.sizes)):
        raise ValueError(f"{source} was made for mesh {plan.mesh}, but this mesh is "
                         f"{tuple(zip(info.names, info.sizes))}. {_REDO}")
    mine, theirs = set(captured.param_fqns.values()), set(dict(plan.params))
    missing = sorted(mine - theirs)
    extra = sorted(theirs - mine)  # (tied aliases of this model's parameters too, but only shown when some are missing)
    if missing:
        raise ValueError(f"{source} has no placement for this model's parameters {_few(missing)}"
                         + (f" and places parameters it does not have, {_few(extra)}" if extra else "")
                         + f": it was made for another model. {_REDO}")
    unknown = sorted(theirs - mine - (names or set()))
    if names is not None and unknown:
        raise ValueError(f"{source} places parameters this model does not have, {_few(unknown)} (its other entries "
                         "match the model): a hand edit, or a plan made for another model. Every entry must name a "
                         f"parameter of this model. {_REDO}")
    for st in plan.strategies:
        try:
            form_of(Kind(st.kind), st.form)
        except ValueError as e:
            raise ValueError(f"{source}: structure {st.key!r} has kind {st.kind!r} and form {st.form!r}, which autopar "
                             f"does not know ({e}). {_REDO}") from None
    _check_placements(plan, source, captured)
    if plan.graph and plan.graph != captured.fingerprint():
        raise ValueError(f"{source} was made for another graph (fingerprint {plan.graph}; this model on these inputs "
                         f"captures as {captured.fingerprint()}): a plan fits only the model and input shapes it was "
                         f"made for. {_REDO}")


def _check_placements(plan: Plan, source: str, captured: Captured) -> None:
    """Every parameter and input placement of a given plan is one autopar can lay out: a shard of a dim the tensor
    has, an owner on the axis, never a partial value."""
    shapes = {fqn: tuple(captured.placeholder(ph).meta["val"].shape) for ph, fqn in captured.param_fqns.items()}
    shapes.update({ph: s for ph, s in zip(captured.user_inputs, captured.example_shapes) if s is not None})
    for what, rows in (("parameter", plan.params), ("input", plan.inputs)):
        for name, text in rows:
            if name not in shapes:
                continue
            shape = shapes[name]
            for (axis, size), p in zip(plan.mesh, placements_from_str(text)):
                why = None
                if isinstance(p, Partial):
                    why = "a parameter or input is never a partial sum"
                elif is_shard(p) and not 0 <= p.dim < len(shape):
                    why = f"it has no dim {p.dim}"
                elif isinstance(p, _StridedShard) and (p.split_factor < 1 or shape[p.dim] % (p.split_factor * size)):
                    why = (f"dim {p.dim} does not split into {p.split_factor} blocks, each split over {size} ranks")
                elif is_owned(p) and not 0 <= p.owner < size:
                    why = f"axis {axis!r} has no rank {p.owner}"
                if why:
                    raise ValueError(f"{source} places {what} {name!r} of shape {shape} as {text!r} on mesh "
                                     f"{plan.mesh}: {why}. {_REDO}")


def _few(names: list[str], n: int = 5) -> str:
    return ", ".join(names[:n]) + (f", ... ({len(names)} in all)" if len(names) > n else "")
