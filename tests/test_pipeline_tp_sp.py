"""Megatron sequence parallelism across pipeline stage boundaries (issue #23, `autopar.pipeline_tp`), gloo, fp64,
4 ranks: pp2 x tp2, plan='megatron', overrides={"pipeline": "1f1b@pp", "norm": "sequence"}, and under zbv.

A 2-layer Llama-style model (autopar.models.Llama) against one device: the global loss on every rank, every
parameter's gradient (on the ranks of its stage, every parameter checked on some rank), every parameter after two
AdamW steps; the collectives of each stage program per microbatch (Megatron SP's all-gathers before the column
linears, reduce-scatters after the row linears, the first stage's embedding output reduce-scattered onto the
sequence, the last stage's final norm gathered before the head) and the schedule's p2p sends (count and bytes per
microbatch: each tp rank sends its own sequence shard, 1/tp of the bytes the non-SP plan sends) asserted exactly;
the cost model's p2p bytes for the boundary (`autopar.pipeline_estimate`) equal to what runs.
"""

from __future__ import annotations

import torch

from dist_harness import gloo_pool
from pipeline_helpers import check, llama, pp_tp_train

B, S, M, H = 4, 16, 2, 32  # batch, sequence, microbatches, hidden
TP = 2


def _llama(layers: int = 2):
    return llama(num_layers=layers)


def _pp_tp_sp(form: str, layers: int = 2):
    import torch.distributed as dist
    import autopar

    torch.set_default_dtype(torch.float64)
    try:
        overrides = {"pipeline": f"{form}@pp", "norm": "sequence"}
        ref, pm, tokens, labels, errs, counts, mine, _ = pp_tp_train(lambda: _llama(layers), form, B, S, M, tp=TP,
                                                                     overrides={"norm": "sequence"})
        refs = dict(ref.named_parameters())
        with torch.no_grad():
            errs["no_grad loss"] = abs(float(pm(tokens, labels)) - float(ref(tokens, labels)))
        norms = sorted({(s.form, s.axis) for k, st in pm._tp.items() for s in st[2].strategies if s.kind == "norm"})
        arrivals = {k: {n: str(p) for n, p in st[-1][0].items()} for k, st in pm._tp.items()}
        offline = autopar.plan(ref, {"pp": 2, "tp": TP}, (tokens, labels), plan="megatron", overrides=overrides,
                               microbatches=M)
        priced = {"p2p": pm.plan.estimate.p2p_bytes_per_microbatch,
                  "offline p2p": offline.estimate.p2p_bytes_per_microbatch}
        return {"errs": errs, "mine": mine, "all": sorted(refs), "counts": counts, "norms": norms, "priced": priced,
                "arrivals": arrivals,
                "stages": pm.local_stages, "rank": dist.get_rank()}
    finally:
        torch.set_default_dtype(torch.float32)


ACT = (B // M) * S * H * 8  # one microbatch's hidden state, fp64 bytes: what a non-SP megatron boundary sends
SHARD, ROWS = (B // M) * S * H // TP, (B // M) * S  # its sequence shard's elements; a microbatch's tokens
# Megatron SP per layer and microbatch (elements: all-gathers of the shard, reduce-scatters of the whole value):
# forward an all-gather before each column linear (q/k/v, gate/up) and a reduce-scatter after each row linear
# (wo, down); backward the reduce-scatters' gradients all-gathered, the all-gathers' reduce-scattered, and the
# gathered inputs all-gathered again for the weight gradients (`regather_linears`)
LAYER = {"ag": 2 + 2 + 2, "rs": 2 + 2}
EMBED = {"ag": 1, "rs": 1}  # the vocab-parallel embedding's output reduce-scattered onto the sequence, and back
HEAD = {"ag": 1 + 1, "rs": 1}  # the final norm's output gathered before the head (and again backward), its gradient
CE = 3  # the vocab-parallel cross-entropy's all-reduces (max, sum, target) of one value per token


def _collectives(ag: int, rs: int, ce: int = 0, buckets=()) -> list:
    return ([("all_gather_into_tensor", SHARD)] * ag + [("reduce_scatter_tensor", ROWS * H)] * rs
            + [("all_reduce", ROWS)] * ce + [("all_reduce_", n) for n in buckets])


def _common(results, layers: int):
    check(results)  # every error <= TOL (1e-10) on its rank, every parameter checked on some rank
    for r in results:
        assert r["norms"] == [("sequence", "tp")], r["norms"]  # every stage's norms sequence-parallel on tp
        # every boundary crosses as the sequence shard (one activation each: the rotary tables are recomputed)
        assert r["arrivals"][0] == {} and len(r["arrivals"]) == layers, r["arrivals"]
        assert all(list(v.values()) == ["(Shard(dim=1),)"] for k, v in r["arrivals"].items() if k), r["arrivals"]
        # the cost model prices the boundary as it runs: each tp rank's shard, 1/tp of the non-SP bytes
        assert r["priced"]["p2p"] == r["priced"]["offline p2p"] == ACT // TP, r["priced"]


def test_megatron_sp_across_pp2_boundary_matches_one_device():
    results = gloo_pool(4).run(_pp_tp_sp, "1f1b")
    _common(results, 2)
    for r in results:
        first = r["stages"] == [0]
        for step, (p2p, reduces) in enumerate(r["counts"]):
            # per microbatch one sequence shard forward and its gradient backward, each tp rank to its peer
            assert sorted(p2p) == sorted([("isend", ACT // TP), ("irecv", ACT // TP)] * M), p2p
            # + one bucket of the norms' replicated gradients summed over tp (attn and mlp norms; the final norm)
            if first:
                per_mb = _collectives(LAYER["ag"] + EMBED["ag"], LAYER["rs"] + EMBED["rs"], buckets=[2 * H])
            else:
                per_mb = _collectives(LAYER["ag"] + HEAD["ag"], LAYER["rs"] + HEAD["rs"], CE, buckets=[3 * H])
            # the first call too: the stages' metadata is static, so torch runs no metadata inference
            assert sorted(reduces) == sorted(per_mb * M), (step, sorted(reduces))


def test_megatron_sp_under_zbv():
    """zbv: 4 one-layer stages, V-shaped (stages 0 and 3 on the first pipeline rank); the 1 -> 2 boundary stays on
    the second pipeline rank (its shard handed over locally)."""
    results = gloo_pool(4).run(_pp_tp_sp, "zbv", 4)
    _common(results, 4)
    for r in results:
        ends = r["stages"] == [0, 3]
        assert r["stages"] == ([0, 3] if r["rank"] < 2 else [1, 2]), r
        p2p, reduces = r["counts"][1]  # the second step (as the first)
        # per microbatch the shards of boundaries 0->1 and 2->3 forward, their gradients backward
        assert sorted(p2p) == sorted([("isend", ACT // TP), ("irecv", ACT // TP)] * 2 * M), p2p
        # torch's zero-bubble split re-runs a non-first stage's fused nodes in its weight step
        # (`stage_backward_weight`): per layer the two regathered column linears' all-gather and reduce-scatter
        # and one row linear's gradient all-gather, and the head's regather pair, issued a second time (the second
        # results unused; the gradients exact)
        again = {"ag": 3, "rs": 2}
        if ends:
            per_mb = _collectives(LAYER["ag"] + EMBED["ag"] + LAYER["ag"] + again["ag"] + 2 * HEAD["ag"],
                                  LAYER["rs"] + EMBED["rs"] + LAYER["rs"] + again["rs"] + 2 * HEAD["rs"], CE,
                                  buckets=[2 * H, 3 * H])
        else:
            per_mb = _collectives(2 * (LAYER["ag"] + again["ag"]), 2 * (LAYER["rs"] + again["rs"]),
                                  buckets=[2 * H, 2 * H])
        assert sorted(reduces) == sorted(per_mb * M), sorted(reduces)


def _refused():
    """What sequence parallelism across a boundary does not run, raised on every rank before anything is built."""
    from torch.distributed.device_mesh import init_device_mesh
    import autopar
    tokens = torch.randint(0, 128, (B, S))
    out = []
    for shape, names, norm in [((2, 2), ("pp", "tp"), "sequence@pp")]:  # (pp, dp, tp): test_pipeline_dtp_sp
        mesh = init_device_mesh("cpu", shape, mesh_dim_names=names)
        try:
            autopar.parallelize(_llama(), mesh, (tokens, tokens), plan="megatron",
                                overrides={"pipeline": "1f1b@pp", "norm": norm}, microbatches=M)
            out.append(None)
        except NotImplementedError as e:
            out.append(str(e))
    return out


def test_sp_across_boundary_refusals_on_every_rank():
    for r in gloo_pool(4).run(_refused):
        (wrong_axis,) = r
        assert wrong_axis is not None and "'sequence' or 'sequence@tp'" in wrong_axis, wrong_axis
