"""What `parallelize(plan="auto")` runs on a mesh with a pipeline axis (issue #23, deliverable 4): the plan auto priced.

`autopar.plan(plan="auto")` (offline) gives each rank of the pipeline axis the ILP's stage plan for its in-flight
microbatches (`pipeline_estimate._fit_ranks`). `parallelize(plan="auto")` searches the same way
(`pipeline_estimate.auto_pipeline(runnable=True)`) over the stage plans the stage runtime (`autopar.pipeline_runtime`)
lowers exactly as they were priced, and runs the winner; `pm.plan` is that priced plan. The runnable stage plans:

| stage plan | where (the axes the pipeline leaves) | the runtime's stage program |
|---|---|---|
| `dp` | any | the stage's captured sub-graph, rows split over the data axes, gradients summed once per step |
| `fsdp` | exactly one data axis, no weight used by two stages | torch's FSDP2 on the stage module (gathered once per step) |
| `megatron` | tensor parallel on the last axis, at most one data axis before it, no tied weight | autopar's lowering of the stage's megatron plan on its tp line (`autopar.pipeline_tp`) |

each with every activation-checkpoint level (`autopar.forms.checkpoint`: none, selective, full) per rank: a rank's
layers take one level (`pipeline_estimate.level_variants`, the fastest that fits the rank's budget, what `_fit_ranks` asks for), which
the runtime lowers into that stage's program (`Plan.checkpoint`: per layer, its stage's level; the dp / fsdp stage
graphs outlined by `passes.checkpoint.checkpoint_layers_pass`, the megatron stage plans built with the level as a
`checkpoint:<layer>` override). One stage plan for every rank (the runtime runs one), the level per rank. `zbv` is
weighed without checkpoint levels (torch's split backward with checkpointed regions is not checked against one
device here).

Not runnable, so not searched (said in the plan's '(pipeline)' decision, `with_search_note`): the ILP's free
per-class forms (FSDP or ZeRO on some classes only, sequence or context parallelism on a data axis, a mix of forms
per rank), which the stage runtime has no lowering for yet; a level under `zbv`.
"""

from __future__ import annotations

import math

STAGE_PLAN_NOTE = "pipeline stage plan: "  # + the named stage plan every stage runs (`stage_plan_of`)
SEARCH_NOTE = ("parallelize(plan='auto') weighs only the stage plans the pipeline runtime runs: {plans} inside every "
               "stage, each rank at its own checkpoint level (none under zbv); not weighed: the ILP's free per-class "
               "stage forms (FSDP or ZeRO on some classes only, sequence or context parallelism on a data axis, "
               "forms differing per rank), which the stage runtime cannot lower yet (autopar.plan prices them "
               "offline)")


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
    if len(rest) in (1, 2) and mesh[rest[-1]] > 1 and not tied:  # megatron: tensor parallel on the last axis
        out.append(("megatron", degree // mesh[rest[-1]]))
    return out


def with_search_note(plan, model, mesh: dict, axis: str):
    """`plan` (auto's, from `parallelize`) with `SEARCH_NOTE` in its '(pipeline)' decision: what was weighed."""
    import dataclasses
    text = SEARCH_NOTE.format(plans=", ".join(repr(n) for n, _ in stage_plans(model, mesh, axis)))
    decisions = tuple(dataclasses.replace(d, decided_by=f"{d.decided_by}; {text}") if d.kind == "pipeline" else d
                      for d in plan.decisions)
    return dataclasses.replace(plan, decisions=decisions)


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


__all__ = ["SEARCH_NOTE", "STAGE_PLAN_NOTE", "checkpoint_levels", "stage_plan_of", "stage_plans", "with_search_note"]
