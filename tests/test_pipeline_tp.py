"""Tensor parallelism (megatron) inside a pipeline stage (issue #23, `autopar.pipeline_tp`), gloo, fp64, 4 ranks.

pp2 x tp2, 1f1b, a 2-layer Llama-style model (autopar.models.Llama): the global loss on every rank, every
parameter's gradient (on the ranks of its stage, every parameter checked on some rank) and every parameter after
two AdamW steps against one device (clipping and a loaded single-device state dict too); each stage's collectives (the all-reduces of its program, counted per
microbatch) and the schedule's p2p sends (count and bytes per microbatch) asserted exactly.
"""

from __future__ import annotations

import pytest
import torch

from dist_harness import gloo_pool
from pipeline_helpers import check, llama, pp_tp_train

B, S, M = 4, 16, 2  # batch, sequence, microbatches


def _pp_tp(form: str):
    import torch.distributed as dist
    import autopar

    torch.set_default_dtype(torch.float64)
    try:
        ref, pm, tokens, labels, errs, counts, mine, placements = pp_tp_train(llama, form, B, S, M, clip=0.05)
        refs = dict(ref.named_parameters())
        other = llama()  # a single-device state dict loads into the stages' shards
        pm.load_state_dict(other.state_dict())
        assert sorted(pm.state_dict()) == sorted(other.state_dict())
        with torch.no_grad():
            errs["loaded loss"] = abs(float(pm(tokens, labels)) - float(other(tokens, labels)))
        offline = autopar.plan(ref, {"pp": 2, "tp": 2}, (tokens, labels), plan="megatron",
                               overrides={"pipeline": f"{form}@pp"}, microbatches=M)
        priced = {"p2p": pm.plan.estimate.p2p_bytes_per_microbatch, "step": pm.plan.estimate.step_time_s,
                  "offline p2p": offline.estimate.p2p_bytes_per_microbatch, "offline step": offline.estimate.step_time_s,
                  "cut": tuple(pm.plan.pipeline.cut), "offline cut": tuple(offline.pipeline.cut)}
        return {"priced": priced, "errs": errs, "mine": mine, "all": sorted(refs), "counts": counts, "placements": placements,
                "stages": pm.local_stages, "rank": dist.get_rank()}
    finally:
        torch.set_default_dtype(torch.float32)


def test_megatron_in_pp2_stages_matches_one_device():
    results = gloo_pool(4).run(_pp_tp, "1f1b")
    check(results)  # every error <= pipeline_helpers.TOL (1e-10) on its rank, every parameter checked on some rank
    act = (B // M) * S * 32 * 8  # one microbatch's hidden state, fp64 bytes
    for r in results:
        # pm.plan prices what runs (megatron in the stages, the whole activation per tp rank), as autopar.plan does
        pr = r["priced"]
        assert pr["p2p"] == pr["offline p2p"] == act and pr["cut"] == pr["offline cut"] == (0, 1, 2), pr
        assert pr["step"] == pytest.approx(pr["offline step"], rel=1e-9), pr
        first = r["stages"] == [0]
        # megatron's placements, on the stage's tp sub-mesh
        assert r["placements"]["layers.0.attn.wq.weight" if first else "layers.1.attn.wq.weight"] == "(Shard(dim=0),)"
        assert r["placements"]["layers.0.attn.wo.weight" if first else "layers.1.mlp.down.weight"] == "(Shard(dim=1),)"
        assert r["placements"]["layers.0.attn_norm.weight" if first else "norm.weight"] == "(Replicate(),)"
        for step, (p2p, reduces) in enumerate(r["counts"]):
            # p2p: per microbatch one activation forward and its gradient backward, each tp rank to its peer
            assert sorted(p2p) == sorted([("isend" if first else "irecv", act), ("irecv" if first else "isend", act)]
                                         * M), p2p
            # per microbatch and layer: the row-parallel outputs (wo, down) all-reduced forward, the column-parallel
            # inputs' gradients (q/k/v, gate/up) backward; stage 0 adds the vocab-parallel embedding's output;
            # stage 1 the head's input gradient and the vocab-parallel cross-entropy's three (max, sum, target)
            per_mb = [("all_reduce", act // 8)] * 5 if first else \
                [("all_reduce", act // 8)] * 5 + [("all_reduce", (B // M) * S)] * 3
            # the first call too: the stages' metadata is static, so torch runs no metadata inference
            assert sorted(reduces) == sorted(per_mb * M), (step, reduces)


def _refused():
    """What tensor parallelism in a stage does not run yet, raised on every rank before anything is built."""
    from torch.distributed.device_mesh import init_device_mesh
    import autopar
    torch.manual_seed(0)
    tokens = torch.randint(0, 128, (B, S))
    out = []
    for shape, names, form in [((4,), ("pp",), "1f1b")]:
        mesh = init_device_mesh("cpu", shape, mesh_dim_names=names)
        try:
            autopar.parallelize(llama(), mesh, (tokens, tokens), plan="megatron",
                                overrides={"pipeline": f"{form}@pp"}, microbatches=M)
            out.append(None)
        except NotImplementedError as e:
            out.append(str(e))
    return out


def test_megatron_stage_forms_not_yet_run_raise_on_every_rank():
    for r in gloo_pool(4).run(_refused):
        (no_tp,) = r  # zbv runs now (tests/test_pipeline_tp_forms.py)
        assert no_tp is not None and "got 0 other axes" in no_tp and "(pp, dp, tp) mesh" in no_tp
