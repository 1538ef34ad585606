"""The pipeline contract (autopar.pipeline_plan): closed-form bubbles, the balanced stage cut, stage placement,
JSON round trip on a Plan, and the clear errors; a 'pipeline' override says it is not implemented yet."""

import itertools

import pytest

from autopar.pipeline_plan import PipelinePlan, balanced_cut, bubble_fraction, parse_pipeline
from autopar.plan import Plan


def test_bubbles_are_the_closed_forms():
    assert bubble_fraction("1f1b", 4, 8) == 3 / 11
    assert bubble_fraction("gpipe", 2, 4) == 1 / 5
    assert bubble_fraction("interleaved-1f1b", 4, 8, 2) == 3 / 19
    assert bubble_fraction("zbv", 4, 8, 2) == 0.0
    assert bubble_fraction("1f1b", 1, 8) == 0.0


def test_balanced_cut_is_the_minimax_cut():
    # brute force over every cut of 7 layers into 3 stages, with embedding and head costs
    costs, first, last = [3.0, 1.0, 4.0, 1.0, 5.0, 9.0, 2.0], 2.0, 6.0
    def worst(cut):
        return max(sum(costs[a:b]) + (first if k == 0 else 0) + (last if k == len(cut) - 2 else 0)
                   for k, (a, b) in enumerate(zip(cut, cut[1:])))
    best = min(worst((0, i, j, 7)) for i, j in itertools.combinations(range(1, 7), 2))
    cut = balanced_cut(costs, 3, first, last)
    assert len(cut) == 4 and cut[0] == 0 and cut[-1] == 7 and worst(cut) == best
    assert balanced_cut([1.0] * 8, 4) == (0, 2, 4, 6, 8)
    assert len(balanced_cut([1.0] * 126, 16, 2.0, 3.0)) == 17
    with pytest.raises(ValueError, match="at most 2 stages"):
        balanced_cut([1.0, 1.0], 3)


def test_stage_ranks_follow_torch_schedules():
    assert [PipelinePlan("zbv", "pp", 8, 2).stage_rank(k, 4) for k in range(8)] == [0, 1, 2, 3, 3, 2, 1, 0]
    assert [PipelinePlan("interleaved-1f1b", "pp", 8, 2).stage_rank(k, 4) for k in range(8)] == [0, 1, 2, 3] * 2


def test_plan_round_trips_and_bad_values_are_named():
    p = Plan(name="x", mesh=(("pp", 2),), pipeline=PipelinePlan("1f1b", "pp", 4, 1, (0, 2, 5)))
    assert Plan.from_json(p.to_json()) == p
    assert Plan.from_json(Plan(name="x", mesh=(("pp", 2),)).to_json()).pipeline is None
    with pytest.raises(ValueError, match="not one of"):
        PipelinePlan("2f2b", "pp", 4)
    with pytest.raises(ValueError, match="two or more stages per rank"):
        PipelinePlan("interleaved-1f1b", "pp", 4, 1)
    with pytest.raises(ValueError, match="increase strictly"):
        PipelinePlan("1f1b", "pp", 4, 1, (0, 2, 2))
    with pytest.raises(ValueError, match="not an axis of the mesh"):
        parse_pipeline("1f1b@pp", ("dp", "tp"))
    assert parse_pipeline("zbv@pp", ("pp", "dp")) == ("zbv", "pp")
