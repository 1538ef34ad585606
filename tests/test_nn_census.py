"""The torch.nn census (`tests/nn_census.py`) under autopar: every row, every plan, on 2 simulated ranks.

For each row (small models built only from torch.nn's building blocks, fp64) and each of `dp`, `fsdp`
(`dp=2`), `megatron` (`tp=2`) and `auto` (`dp=2`, cluster "cpu"): the loss, every parameter gradient and every
parameter after an SGD step equal the single-device model's (1e-10); and under `dp` and `fsdp` one rank runs at
most 1/2 + 2% of the single-device FLOPs of forward + backward, counted with its local shapes
(`nn_census.FlopCount`: torch's FLOP formulas, `aten._grouped_mm`, and one FLOP per element of every other
computing ATen op; a custom op, whose inside no counter sees, fails the row): of the model's matmul FLOPs on one
device, and of all FLOPs of autopar's own program on a 1-rank mesh (the same decompositions: nn.RMSNorm
written out in pointwise ops does more element work than a fused kernel), and no op or opaque node runs on the
gathered batch (the plan's "no sharding rule, its sharded inputs are gathered" / "opaque node, replicated on every
rank" notes: a cheap one, a loss, fits in the 2%, but it is still not data parallel). A failing row names the
values that differ, or the ops that run more than their share and what the plan gathered.

The single-device run of each row (and its 1-rank program) is made once and shared by its four plans.
"""

from __future__ import annotations

import warnings

import pytest
import torch

from nn_census import (CENSUS, FLOP_PLANS, FLOP_SLACK, PLANS, TOL, WORLD, ZERO_PLANS, ZERO_ROWS, FlopCount, PlanRun,
                       flop_problem, gathered, reference, run_plan)

_REFERENCES: dict = {}


def _reference(name: str, world):
    if name not in _REFERENCES:
        _REFERENCES[name] = reference(name, world)
    return _REFERENCES[name]


@pytest.fixture(autouse=True)
def _quiet_warnings():
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="Converting a tensor with requires_grad=True to a scalar")
        yield


def row_problems(run: PlanRun, ref) -> list[str]:
    problems = []
    off = run.off(TOL)
    if off:
        worst = sorted(off.items(), key=lambda kv: -kv[1] if kv[1] == kv[1] else float("-inf"))[:4]
        problems.append(f"{len(off)} values differ from one device by more than {TOL:g}; worst: "
                        + ", ".join(f"{k} {v:.1e}" for k, v in worst))
    if run.plan in FLOP_PLANS:
        flops = flop_problem(run, ref)
        if flops:
            problems.append(flops + (f"; plan notes: {run.notes}" if run.notes else ""))
        whole = gathered(run.notes)
        if whole:
            problems.append(f"the batch is gathered for {whole} (each rank runs them on the whole batch); plan notes: "
                            f"{run.notes}")
    return problems


@pytest.mark.parametrize("plan", PLANS)
@pytest.mark.parametrize("name", list(CENSUS))
def test_census_row(local_world, name, plan):
    ref = _reference(name, local_world)
    run = run_plan(name, plan, ref, local_world)
    problems = row_problems(run, ref)
    assert not problems, f"{name} under {plan}:\n  " + "\n  ".join(problems)


@pytest.mark.parametrize("plan", ZERO_PLANS)
@pytest.mark.parametrize("name", ZERO_ROWS)
def test_census_row_under_zero(local_world, name, plan):
    """ZeRO-1/2 (optimizer state, and under zero2 the gradients, sharded; parameters replicated): exact and data
    parallel (each rank at most 1/2 + 2% of the FLOPs) on models no ZeRO test was written for."""
    ref = _reference(name, local_world)
    run = run_plan(name, plan, ref, local_world)
    problems = row_problems(run, ref)
    assert not problems, f"{name} under {plan}:\n  " + "\n  ".join(problems)


# ----------------------------------------------------------------------------- the checks themselves

def test_flop_count_counts_local_shapes_and_names_what_runs_whole(local_world):
    """The counter sees one simulated rank's local shapes (half the batch: half the FLOPs, exactly, for a linear
    and a norm), and a run at 1.0 of one device fails the bound naming the ops that ran more than their share."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.LayerNorm(8))
    x = torch.randn(4, 8)
    with FlopCount() as whole:
        model(x).sum().backward()
    with local_world(WORLD):
        from torch.distributed._local_tensor import LocalTensor
        halves = LocalTensor({r: x.chunk(WORLD)[r] for r in range(WORLD)})
        with FlopCount() as local:
            model(halves).sum()
    with FlopCount() as forward:
        model(x).sum()
    assert whole.matmul["addmm"] == 2 * 4 * 8 * 8 and local.matmul["addmm"] == 2 * 2 * 8 * 8
    assert local.other["native_layer_norm"] * WORLD == forward.other["native_layer_norm"] > 0
    ref = type("Ref", (), {"flops": whole, "program_flops": whole})()
    run = PlanRun("dp", {"loss": 0.0}, whole, 1.0, 1.0, [], "", [])
    problem = flop_problem(run, ref)
    assert problem.startswith("one rank runs 1.000 of the 1-rank program's FLOPs and 1.000 of one device's matmul") \
        and "addmm +" in problem, problem
    half = 0.5 + FLOP_SLACK
    assert not flop_problem(PlanRun("dp", {"loss": 0.0}, whole, half, half, [], "", []), ref)
    assert flop_problem(PlanRun("dp", {"loss": 0.0}, whole, half, 0.6, [], "", []), ref)


def test_gathered_reads_the_plan_notes():
    notes = ["replicated rms_norm_3 (aten.rms_norm.default) in body.1: no sharding rule, its sharded inputs are "
             "gathered", "replicated rms_norm (aten.rms_norm.default) in norm: no sharding rule, its sharded inputs "
             "are gathered", "loss captured as one opaque node, replicated on every rank: it is not traceable (...)",
             "loss loss replicated, not vocab@tp: it is not a cross-entropy over a vocabulary",
             "replicated opaque (autopar.opaque.default) in m: no sharding rule, and not batch-local (rows mix), its "
             "sharded inputs are gathered"]
    assert gathered(notes) == ["rms_norm", "opaque loss", "autopar.opaque"]


def test_every_row_builds_the_same_model_and_batch_in_fp64():
    """The census's contract: a fresh, equal model and batch per call (the plans' runs compare to one reference),
    fp64 parameters, batch 4 (divisible by 2 and 4)."""
    for name, entry in CENSUS.items():
        (m1, in1), (m2, in2) = entry.build(), entry.build()
        assert all(torch.equal(a, b) for a, b in zip(m1.state_dict().values(), m2.state_dict().values())), name
        assert all(torch.equal(a, b) for a, b in zip(in1, in2)), name
        assert all(p.dtype == torch.float64 for p in m1.parameters()), name
        assert in1[0].shape[0] == 4, (name, in1[0].shape)
