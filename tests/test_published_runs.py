"""benchmarks/published_runs.py does not rot, and the cost model stays close to published runs: its --quick row
(torchtitan Llama-3.1-8B on 8 H100s, FSDP 8, selective checkpointing, bf16 mixed precision) plans on the meta device
and prints its RATIO lines, its throughput is the estimate's timeline (the checkpoint level's recomputation
included) turned into tokens/s/GPU, the Megatron FLOP count matches a term-by-term count, every published row is
predicted within the bounds below, and so is the peak memory of the two torchtitan FSDP runs, for which `auto`
finds a plan under 80 GB (the inputs are published figures, so these are real checks of the cost model: issues
#11 item 7 and #12 item 3)."""

from __future__ import annotations

import os
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks"))
import published_runs as pr  # noqa: E402

# predicted peak / published peak (torch.cuda max reserved, on the 96 GB H100) within the goal, +-20%
MEMORY = {"tt_8b_fsdp8": 82.4, "tt_8b_fsdp128": 67.0}
# predicted / published within the goal, +-25% (every row; 0.90-1.24 today; the pipelined rows 0.92-1.04)
MEETS_GOAL = ("tt_8b_fsdp8", "tt_8b_fsdp128", "tt_8b_fsdp8_tp8", "mlm_gpt_1.7b_tp1", "mlm_gpt_7.1b_tp2",
              "mlm_gpt_16b_tp4", "mlm_gpt_32b_tp8", "mlm_gpt_70b_pp2", "mlm_gpt_119b_pp4", "mlm_gpt_177b_pp6",
              "mlm_gpt_314b_pp8", "mlm_gpt_462b_pp16")
# rows the cost model still predicts outside the goal, with the bound a regression must not cross: none today
MISSES_GOAL: dict[str, float] = {}


@pytest.fixture(scope="module")
def priced():
    """Every published row priced once (the slow part), shared by the tests below."""
    return {run.name: pr.price(run) for run in pr.RUNS}


def test_quick_row_prices_the_8_gpu_fsdp_run(capsys, priced):
    out = pr.main(["--quick"], priced=priced)
    text = capsys.readouterr().out
    (r,) = out["results"]
    run = r["run"]
    assert run.name == "tt_8b_fsdp8" and run.gpus == 8 and r["infeasible"] is None and run.cluster == "h100_hbm2e"
    assert 7.9e9 < r["params"] < 8.1e9  # Llama-3.1-8B's shapes
    assert r["tok_s_gpu"] == pytest.approx(run.batch * run.seq / r["step_s"] / 8)
    assert r["ratio"] == pytest.approx(r["tok_s_gpu"] / 5762.0)
    # the timeline: compute (the selective level's recomputation included) plus the exposed communication
    assert 0 <= r["exposed_s"] <= r["comm_s"] and r["levels"] == ["selective"]
    assert r["step_s"] == pytest.approx(r["compute_s"] + r["exposed_s"])
    # the fsdp hand plan: every structure with parameters is sharded over the data axis
    for label in r["forms"].split(", "):
        assert label.startswith("norm") or "+fsdp" in label, label
    assert f"RATIO published_tt_8b_fsdp8 predicted/published = {r['ratio']:.2f}" in text
    assert f"RATIO published_mem_tt_8b_fsdp8 predicted/published = {r['mem_gib'] / 82.4:.2f}" in text


def test_published_rows_and_fsdp_scaling(priced):
    assert set(MEETS_GOAL) | set(MISSES_GOAL) == {r.name for r in pr.RUNS}
    got = priced
    for name in MEETS_GOAL:
        assert 0.75 <= got[name]["ratio"] <= 1.25, (name, got[name]["ratio"])
    for name, bound in MISSES_GOAL.items():
        assert 0.75 <= got[name]["ratio"] <= bound, (name, got[name]["ratio"])
    # torchtitan FSDP 8 -> 128 GPUs: published -2.7%; within 10 points (FSDP 128 crosses nodes on all 8 NICs)
    drop = got["tt_8b_fsdp128"]["tok_s_gpu"] / got["tt_8b_fsdp8"]["tok_s_gpu"] - 1
    assert abs(drop - pr.PUBLISHED_SCALING) <= 0.10, drop
    # peak memory of the same plan (fsdp, every layer selective, bf16 compute over fp32 masters)
    for name, published in MEMORY.items():
        run = next(r for r in pr.RUNS if r.name == name)
        assert run.published_mem_gib == published and run.mixed and run.ac == "selective"
        assert 0.80 <= got[name]["mem_gib"] / published <= 1.20, (name, got[name]["mem_gib"], got[name]["terms"])


@pytest.mark.parametrize("name", sorted(MEMORY))
def test_auto_fits_the_torchtitan_runs_under_80_gb(name):
    run = next(r for r in pr.RUNS if r.name == name)
    a = pr.auto_fits(run, 80e9)
    assert a["infeasible"] is None and a["fits"] and a["batch_ok"], a.get("infeasible") or a["terms"]
    assert a["mem_gib"] * 2**30 <= 80e9


def test_megatron_flop_count_term_by_term():
    run = next(r for r in pr.RUNS if r.name == "mlm_gpt_16b_tp4")
    layers, h, _ = pr.GPT_SHAPES["16b"]
    b, s, v = run.batch, run.seq, pr.GPT_VOCAB
    # per layer forward: QKV + projection + MLP 24 b s h^2, scores and values 4 b s^2 h; logits 2 b s h v; x3 for
    # forward + backward (no recomputation)
    expect = 3 * (layers * (24 * b * s * h * h + 4 * b * s * s * h) + 2 * b * s * h * v)
    assert pr.flops_per_step(run, None) == pytest.approx(expect, rel=1e-12)
    assert pr.PUBLISHED_SCALING == pytest.approx(-0.0272, abs=1e-3)
    assert all(r.batch % r.mesh["dp"] == 0 for r in pr.RUNS)  # every run splits its batch over dp


PIPELINED = {"mlm_gpt_70b_pp2": (2, 84, 8), "mlm_gpt_119b_pp4": (4, 92, 16), "mlm_gpt_177b_pp6": (6, 96, 24),
             "mlm_gpt_314b_pp8": (8, 96, 32), "mlm_gpt_462b_pp16": (16, 112, 64)}


@pytest.mark.parametrize("name", sorted(PIPELINED))
def test_pipelined_megatron_rows_are_priced_as_pipelines(priced, name):
    """Issue #23 item 5: each Megatron PP row is planned with its pipeline (interleaved 1F1B over pp, one sequence
    per microbatch per dp rank) on TP8 x DP48, every layer in one stage, the bubble at least the closed form's share of
    the slowest rank's schedule, and predicted within the goal (`MEETS_GOAL`)."""
    from autopar.pipeline_plan import bubble_fraction
    r = priced[name]
    pp, layers, m = PIPELINED[name]
    run = r["run"]
    assert run.mesh == {"pp": pp, "dp": 48, "tp": 8} and run.gpus == pp * 384 and run.batch == 48 * m
    plan = r["pipeline"]
    assert (plan.form, plan.axis, plan.microbatches, plan.stages_per_rank) == ("interleaved-1f1b", "pp", m, 2)
    assert plan.cut[0] == 0 and plan.cut[-1] == layers and len(plan.cut) == 2 * pp + 1
    assert pr.GPT_SHAPES[run.shape["size"]][0] == layers
    closed = bubble_fraction("interleaved-1f1b", pp, m, 2)
    # the bubble: (p - 1) slowest chunks; the closed form's share of a schedule of equal chunks, more when uneven
    assert r["bubble_s"] > 0 and r["bubble_s"] / (r["step_s"]) <= closed * 1.2
    assert 0.75 <= r["ratio"] <= 1.25, (name, r["ratio"])
