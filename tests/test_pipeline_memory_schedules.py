"""Each pipeline stage's peak memory against the cost model's under the multi-stage schedules and FSDP inside a
stage (issue #23, deliverable 3; benchmarks/memory_fidelity.py --pipeline prints the table): interleaved 1F1B and
ZB-V on pp2 (two stages per rank, one pool job), 1F1B with fsdp stages on a (pp2, dp2) mesh (one 4-rank job), each
rank's measured peak (`memory_probe.LiveStorages`) within +-10% of `pm.plan.estimate.stages[pp coordinate]`.

What each case needs priced (each fails the band without it): interleaved 1F1B holds more warm-up chunks and,
like ZB-V, torch's multi-stage runtime keeps every sent tensor until the step ends; ZB-V keeps a microbatch's graph
from its input-gradient pass to its weight-gradient pass (`cost_model.pipeline.backward_states` walks torch's own
order); fsdp stages keep their parameters gathered and their gradients unsharded for the step
(`pipeline_estimate._gathered_bytes`: without it the peak is under-predicted by 32%).
"""

from __future__ import annotations

from dist_harness import gloo_pool


def _peaks(cases, dp):
    from benchmarks.memory_fidelity import pipeline_measure
    return [pipeline_measure(f, dp=dp, plan=plan) for f, plan in cases]


def _check(rows):
    for rank_rows in rows:
        for r in rank_rows:
            ratio = r["peak"] / r["peak_est"]
            assert 0.9 <= ratio <= 1.1, (f"{r['form']} rank {r['rank']}: measured {r['peak']} B, predicted "
                                         f"{r['peak_est']} B, ratio {ratio:.3f}; at the peak: {r['at_peak']}")


def test_multi_stage_schedules_stage_peaks_within_10_percent():
    rows = gloo_pool(2).run(_peaks, (("interleaved-1f1b", "dp"), ("zbv", "dp")), 1)
    _check(rows)
    # the schedules hold differently: ZB-V's rank 1 (stages 1 and 2, its W passes deferred to the drain) more than
    # interleaved 1F1B's (stages 1 and 3)
    inter, zbv = rows[1]
    assert zbv["peak_est"] > inter["peak_est"] and zbv["peak"] > inter["peak"]


def test_fsdp_stages_peak_within_10_percent():
    rows = gloo_pool(4).run(_peaks, (("1f1b", "fsdp"),), 2)
    _check(rows)
    # the gathered parameters and unsharded gradients are priced: more than the shards' state alone
    r = rows[0][0]
    assert r["peak_est"] > r["base"] + 2 * r["params_est"] + 2 * r["grads_est"]
