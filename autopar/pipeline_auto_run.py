"""What `parallelize(plan="auto")` runs on a mesh with a pipeline axis (issue #23, deliverable 4): the plan auto priced.

`autopar.plan(plan="auto")` (offline) gives each rank of the pipeline axis the ILP's stage plan for its in-flight
microbatches (`pipeline_estimate._fit_ranks`). `parallelize(plan="auto")` searches the same way
(`pipeline_estimate.auto_pipeline(runnable=True)`) over the stage plans the stage runtime (`autopar.pipeline_runtime`)
lowers exactly as they were priced, and runs the winner; `pm.plan` is that priced plan. The runnable stage plans:

| stage plan | where (the axes the pipeline leaves) | the runtime's stage program |
|---|---|---|
| `dp` | any | the stage's captured sub-graph, rows split over the data axes, gradients summed once per step |
| `fsdp` | exactly one data axis, no weight used by two stages | torch's FSDP2 on the stage module (gathered once per step) |
| `megatron` | the last axis named `tp`, at most one data axis before it, no tied weight | autopar's lowering of the stage's megatron plan on its tp line (`autopar.pipeline_tp`) |

each with every activation-checkpoint level (`autopar.forms.checkpoint`: none, selective, full) per rank: a rank's
layers take one level (`level_variants`, the fastest that fits the rank's budget, what `_fit_ranks` asks for), which
the runtime lowers into that stage's program (`Plan.checkpoint`: per layer, its stage's level; the dp / fsdp stage
graphs outlined by `passes.checkpoint.checkpoint_layers_pass`, the megatron stage plans built with the level as a
`checkpoint:<layer>` override). One stage plan for every rank (the runtime runs one), the level per rank. `zbv` is
weighed without checkpoint levels (torch's split backward with checkpointed regions is not checked against one
device here).

Not runnable, so not searched (said in the plan's notes, `excluded`): the ILP's free per-class forms (FSDP or ZeRO
on some classes only, sequence or context parallelism on a data axis, a mix of forms per rank), which the stage
runtime has no lowering for yet.
"""

from __future__ import annotations

import math

STAGE_PLAN_NOTE = "pipeline stage plan: "  # + the named stage plan every stage runs (`stage_plan_of`)
EXCLUDED = ("not searched by parallelize(plan='auto'): the ILP's free per-class stage forms (FSDP or ZeRO on some "
            "classes, sequence / context parallelism on a data axis), which the stage runtime cannot lower yet; "
            "searched instead: the named stage plans it runs ({plans}) at each checkpoint level per rank")


def _tied(model) -> bool:
    return len({id(q) for q in model.parameters()}) < len(list(model.named_parameters(remove_duplicate=False)))


def stage_plans(model, mesh: dict, axis: str) -> list[tuple[str, int]]:
    """(named stage plan, its data-parallel degree: the ranks a microbatch's rows split over) for every stage plan
    the runtime runs on this mesh (module docstring's table)."""
    rest = [a for a in mesh if a != axis]
    degree = math.prod(mesh[a] for a in rest)
    out = [("dp", degree)]
    tied = _tied(model)
    if len(rest) == 1 and mesh[rest[0]] > 1 and not tied:
        out.append(("fsdp", degree))
    if rest and rest[-1] == "tp" and len(rest) in (1, 2) and mesh["tp"] > 1 and not tied:
        out.append(("megatron", degree // mesh["tp"]))
    return out


def level_variants(model, sub: dict, mb_inputs, stage_plan: str, base, *, cluster, overrides, precision, optimizer,
                   cache):
    """`make(in_flight, budget)` for `pipeline_estimate._fit_ranks`: the layer costs of `stage_plan` at the fastest
    checkpoint level whose two-layer peak with that many microbatches in flight is within `budget`, else the
    leanest (the rank's own peak decides whether it fits). `base`: `stage_plan`'s costs at no level."""
    from autopar import pipeline_estimate as pe
    from autopar.forms import checkpoint as ckpt
    variants = {ckpt.DEFAULT.name: base}

    def at(level: str):
        if level not in variants:
            variants[level] = pe.layer_costs(model, sub, mb_inputs, plan=stage_plan, cluster=cluster,
                                             overrides={**(overrides or {}), ckpt.KEY: level}, precision=precision,
                                             optimizer=optimizer, cache=cache)
        return variants[level]

    def make(f: int, budget: float):
        every = [at(lv) for lv in ckpt.LEVELS]
        fits = [x for x in every if pe._two_layer_bytes(x, f) <= budget]
        if fits:
            return min(fits, key=pe.layer_time_s)
        return min(every, key=lambda x: pe._two_layer_bytes(x, f))
    return make


def stage_plan_of(plan) -> str:
    """The named stage plan a runnable auto Plan's stages run (its `STAGE_PLAN_NOTE`)."""
    found = [n[len(STAGE_PLAN_NOTE):] for n in plan.notes if n.startswith(STAGE_PLAN_NOTE)]
    if len(found) != 1:
        raise ValueError(f"plan {plan.name!r} pipelines {plan.pipeline.label if plan.pipeline else 'nothing'} but "
                         f"names {len(found)} stage plan(s) in its notes ({STAGE_PLAN_NOTE!r}...); the pipeline "
                         "runtime needs exactly one. Fix: re-plan with parallelize(plan='auto'), or name the "
                         "stage plan: plan='dp', overrides={'pipeline': ...}")
    return found[0]


def checkpoint_levels(plan) -> dict[str, str]:
    """Layer path -> its level, for the layers the plan recomputes (a level other than none)."""
    from autopar.forms import checkpoint as ckpt
    return {path: lv for path, lv in plan.checkpoint if ckpt.level(lv, f"plan {plan.name!r}").recomputes}


__all__ = ["EXCLUDED", "STAGE_PLAN_NOTE", "checkpoint_levels", "level_variants", "stage_plan_of", "stage_plans"]
