"""The ILP's objective agrees with the step's timeline on a ZeRO-2 plan (issue #24): the first structure's gather
after the step has no forward before it and its reduction is the step's last (`timeline.ends_s`), which
`overlapped_s` alone hid (the ILP priced test_zero_ilp's model under zero2 at 285.8 us against the timeline's
332.1). Offline, 8 data ranks, the model of tests/test_zero_ilp.py."""

from __future__ import annotations

import autopar
from autopar import planner
from test_zero_ilp import _model


def _objective_and_timeline(plan_name: str) -> tuple[float, float]:
    seen = {}
    orig = planner.step_timeline

    def spy(ctx, solution, *a, **k):
        seen["objective"] = solution.objective_s
        return orig(ctx, solution, *a, **k)

    planner.step_timeline = spy
    try:
        model, x = _model(512, 4096)
        p = autopar.plan(model, {"dp": 8}, (x,), cluster="h100", plan=plan_name)
    finally:
        planner.step_timeline = orig
    return seen["objective"], p.estimate.step_time_s


def test_zero2_objective_agrees_with_the_timeline():
    obj, step = _objective_and_timeline("zero2")
    assert abs(obj - step) <= 0.02 * step, (obj * 1e6, step * 1e6)
