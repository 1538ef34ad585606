"""Parallel forms inside pipeline stages (issue #23, `autopar.pipeline_runtime`) on real gloo processes, fp64.

pp2 x dp2 under `plan="fsdp"` (gpipe, 1f1b; interleaved-1f1b and zbv with two stages per rank): each stage module is FSDP2-sharded (`fully_shard`, `reshard_after_forward=False`)
over its stage's data axis. Against one device: the loss, every parameter's gradient, the clipped gradients and
the parameters after an AdamW step, and a second step's gradients (from the stepped shards). Collectives of a
steady step (a third one, after a step): per
stage exactly one all-gather of the stage's padded parameters (kept gathered over the microbatches) and one
reduce-scatter of its gradients, no data-parallel gradient all-reduce, and the p2p of one activation per
microbatch and boundary; the first step, and the first after a forward-only call, the same (the stages' metadata
is static: torch's schedules run no metadata inference, which gathered once more). What is not implemented inside a stage raises NotImplementedError on every rank.
"""

from __future__ import annotations

import math
import re

import pytest
import torch

from dist_harness import gloo_pool
from pipeline_helpers import check
from test_pipeline_runtime import H, S, _agreement, _equivalence, _error, _model


def _padded_numel(model, names, world: int) -> int:
    """FSDP2's flat all-gather buffer for these parameters: each one's dim 0 padded to a multiple of `world`."""
    params = dict(_model(model).named_parameters())
    total = 0
    for n in names:
        shape = params[n].shape
        total += math.ceil(shape[0] / world) * world * math.prod(shape[1:])
    return total


@pytest.mark.parametrize("form", ["1f1b", "gpipe"])
def test_pp2_x_dp2_fsdp_matches_one_device_and_gathers_once_per_step(form):
    m, batch = 2, 8
    results = gloo_pool(4).run(_equivalence, form, 4, (2, 2), ("pp", "dp"), m, batch, 1.0, None, 0.05, "fsdp")
    check(results)
    assert results[0]["cut"] == (0, 2, 4) and [r["stages"] for r in results] == [[0], [0], [1], [1]]
    mb_bytes = batch // (2 * m) * S * H * 8
    for r in results:
        padded = _padded_numel(4, r["mine"], 2)
        assert padded >= sum(dict(_model(4).named_parameters())[n].numel() for n in r["mine"])
        steady = r["steady"]
        # one gather for all microbatches (reshard_after_forward=False), one reduce-scatter after the last backward
        assert steady["fsdp"] == [("all_gather_single", padded, 2), ("reduce_scatter_single", padded, 2)], steady
        # the agreement and the global loss over pp and dp; no gradient all-reduce (FSDP reduce-scattered them)
        assert steady["reduces"] == [(_agreement(batch), 4), (1, 2), (1, 2)], steady["reduces"]
        assert sorted(steady["p2p"]) == sorted([("irecv", mb_bytes // 8, mb_bytes)] * m
                                               + [("isend", mb_bytes // 8, mb_bytes)] * m)
        # the first step, and the first after a forward-only call, as any other: the stages' metadata is static, so
        # torch runs no metadata inference (which gathered once more)
        assert r["fsdp"] == steady["fsdp after eval"] == steady["fsdp"]
        # forward only (train -> eval): one gather for the microbatches, no reduce-scatter
        assert r["fsdp_no_grad"] == [("all_gather_single", padded, 2)]


@pytest.mark.parametrize("form", ["interleaved-1f1b", "zbv"])
def test_two_fsdp_stages_per_rank_gather_and_reduce_scatter_once_each(form):
    m, batch = 4, 8
    results = gloo_pool(4).run(_equivalence, form, 4, (2, 2), ("pp", "dp"), m, batch, 1.0, 2, 0.05, "fsdp")
    check(results)
    for r in results:
        assert len(r["stages"]) == 2
        fsdp = r["steady"]["fsdp"]
        gathers = [n for kind, n, world in fsdp if kind == "all_gather_single" and world == 2]
        scatters = [n for kind, n, world in fsdp if kind == "reduce_scatter_single" and world == 2]
        # each of the rank's two stages: one gather of its padded parameters, one reduce-scatter of their gradients
        assert len(fsdp) == 4 and len(gathers) == len(scatters) == 2 and sorted(gathers) == sorted(scatters), fsdp
        assert sum(gathers) == _padded_numel(4, r["mine"], 2)
        assert r["steady"]["reduces"] == [(_agreement(batch), 4), (1, 2), (1, 2)]


def test_fsdp_stages_under_mp_policy_compute_gather_and_send_in_param_dtype():
    """mp_policy=MixedPrecisionPolicy(fp32, fp32) on fp64 masters: FSDP2's own policy per stage. The p2p carries fp32
    activations (4 bytes each), gathers and reduce-scatters stay one each per stage and step, the gradients are the
    masters' dtype; against the fp64 model the errors are fp32 rounding (above fp64's, below 1e-4)."""
    m, batch = 2, 8
    results = gloo_pool(4).run(_equivalence, "1f1b", 4, (2, 2), ("pp", "dp"), m, batch, 1.0, None, 0.05, "fsdp",
                               "float32")
    rows = batch // (2 * m) * S * H
    for r in results:
        errs = r["errs"]
        assert max(errs.values()) < 1e-4, {k: v for k, v in errs.items() if not v < 1e-4}
        assert errs["loss"] > 1e-12  # computed in fp32, not in the masters' fp64
        assert r["grad_dtypes"] == ["torch.float64"]
        padded = _padded_numel(4, r["mine"], 2)
        assert r["steady"]["fsdp"] == [("all_gather_single", padded, 2), ("reduce_scatter_single", padded, 2)]
        assert sorted(r["steady"]["p2p"]) == sorted([("irecv", rows, 4 * rows)] * m + [("isend", rows, 4 * rows)] * m)


@pytest.mark.parametrize("case, expected", [
    # GPT-2's embedding is tied to its head, on the other stage: two FSDP shardings with no sum between them
    (("gpt", (2, 2), ("pp", "dp"), "1f1b@pp", 2, 8, "fsdp"),
     r"plan='fsdp': parameter '(wte|lm_head)\.weight' is used by stages \[0, 1\].*Fix: plan='dp'"),
    (("llama2", (2,), ("pp",), "1f1b@pp", 2, 8, "fsdp"),
     r"plan='fsdp' on mesh axes \('pp',\): FSDP inside a stage shards over exactly one data axis"),
    (("llama2", (2,), ("pp",), "1f1b@pp", 2, 8, "auto"), r"inside a pipeline stage only \('dp', 'fsdp', 'megatron'\)"),
])
def test_unsupported_stage_forms_raise_on_every_rank(case, expected):
    for r in gloo_pool(2 if len(case[1]) == 1 else 4).run(_error, *case):
        assert r is not None and r[0] == "NotImplementedError" and re.search(expected, r[1], re.S), r


def test_fsdp_stages_keep_the_call_contract():
    """`test_pipeline_runtime._contract` under plan='fsdp' on pp2 x dp2: no backward leaves no gradient, no_grad and
    eval run forward only, two calls then two backwards accumulate (the gradients a backward left are not touched
    by the next call's schedule), bad calls raise on every rank, and load_state_dict takes the single-device
    model's full tensors into FSDP's shards."""
    from test_pipeline_runtime import TOL, _contract
    for rank, r in enumerate(gloo_pool(4).run(_contract, "fsdp", (2, 2), ("pp", "dp"), 8)):
        assert r["keys"]
        assert r["unused"][0] and r["unused"][1] <= TOL
        assert r["no_grad"][0] and r["no_grad"][1] <= TOL
        assert r["eval"][0] and r["eval"][1] <= TOL and r["eval"][3]
        assert r["no_grad"][2] == r["eval"][2] == (["isend"] if rank < 2 else ["irecv"])
        assert r["twice"] <= TOL
        assert r["bad"][0] == "IndexError" and "index out of range" in r["bad"][1], r["bad"]
        assert r["other"][0] == "RankMismatchError" and "every rank passes the same whole batch" in r["other"][1]
        assert r["after"] <= TOL
        assert r["loaded"] <= TOL
