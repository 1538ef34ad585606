"""Megatron sequence parallelism inside the stages of a (pp=2, dp=2, tp=2) mesh (issue #23, `autopar.pipeline_tp`):
`plan="megatron", overrides={"pipeline": "1f1b@pp", "norm": "sequence"}`.

In the suite (`test_pp_dp_tp_sp_layout_on_a_fake_world`, one process, the fake process group of 8 ranks, rank 0):
every stage's norms sequence-parallel on tp, the boundary crossing as the sequence shard (`Shard(1)` on the tp
line: stage 1 takes it so, stage 0 leaves it so), each parameter a DTensor on its stage's (dp, tp) sub-mesh with
[Replicate(), megatron's placement], the stage program on the tp line of this rank's (pp, dp) coordinate, stage 0's
Megatron-SP collectives on one microbatch exactly (all-gathers of the shard, reduce-scatters of the whole value,
the norms' gradient bucket over tp), and the cost model's p2p bytes (1/tp of the non-SP boundary).

The run against one device on 8 gloo ranks (`_pp_dp_tp_sp(form)`, checked by `check_pp_dp_tp_sp`) is too slow for
the suite (the 8-rank pool's start alone is ~50 s on 2 busy cores): `python benchmarks/pp_dp_tp_gloo.py --case sp`
(`sp-gpipe`, `sp-zbv`, or `all`) runs it. fp64, 1f1b, gpipe or zbv, 2 microbatches per data rank, a Llama-style
model (hidden 16, seq 8; 2 layers, 4 under zbv): the global loss on every rank, every parameter's gradient and
every parameter after one AdamW step; each stage's tp collectives per microbatch (zbv's weight-step re-issues
included), the dp gradient bucket, the loss sum and the p2p (count and bytes per microbatch) exactly.
"""

from __future__ import annotations

import torch

from pipeline_helpers import Count, check, pp_dp_tp_step
from test_pipeline_dtp import B, H, M, S, _Reduces, _llama

TP = 2
OVERRIDES = {"pipeline": "1f1b@pp", "norm": "sequence"}
FORMS = ("1f1b", "gpipe", "zbv")  # the schedules checked against one device (`benchmarks/pp_dp_tp_gloo.py --case`)
LAYERS = {"1f1b": 2, "gpipe": 2, "zbv": 4}  # zbv: two one-layer stages per pipeline rank
ROWS = B // (2 * M)  # one microbatch of one data rank
SHARD = ROWS * S * H // TP  # its hidden state's sequence shard (elements)
TOKENS = ROWS * S


def _collectives(ag: int, rs: int, ce: int = 0, buckets=()) -> list:
    """Megatron SP's functional collectives (elements): all-gathers of the shard, reduce-scatters of the whole
    value, the vocab-parallel cross-entropy's all-reduces of one value per token, the norms' gradient buckets."""
    return ([("all_gather_into_tensor", SHARD)] * ag + [("reduce_scatter_tensor", 2 * SHARD)] * rs
            + [("all_reduce", TOKENS)] * ce + [("all_reduce_", n) for n in buckets])


# per layer and microbatch: forward an all-gather before q/k/v and before gate/up, a reduce-scatter after wo and
# down; backward their transposes and the gathered inputs gathered again for the weight gradients
# (`regather_linears`): as on pp x tp (tests/test_pipeline_tp_sp.py)
FIRST = _collectives(6 + 1, 4 + 1, buckets=[2 * H])  # + the embedding's output reduce-scattered onto the sequence
LAST = _collectives(6 + 2, 4 + 1, 3, buckets=[3 * H])  # + the final norm gathered before the head; cross-entropy
# zbv (one layer per stage): torch's zero-bubble split re-runs a non-first stage's fused nodes in its weight step
# (`stage_backward_weight`): per layer the two regathered column linears' all-gather and reduce-scatter and one row
# linear's gradient all-gather, and the head's regather pair, issued a second time (as on pp x tp)
AGAIN = {"ag": 3, "rs": 2}
ZBV_ENDS = FIRST + LAST + _collectives(AGAIN["ag"] + 2, AGAIN["rs"] + 1)  # stages 0 and 3
ZBV_MIDDLE = _collectives(2 * (6 + AGAIN["ag"]), 2 * (4 + AGAIN["rs"]), buckets=[2 * H, 2 * H])  # stages 1 and 2


def _pp_dp_tp_sp(form: str = "1f1b"):
    import torch.distributed as dist
    import autopar

    torch.set_default_dtype(torch.float64)
    try:
        overrides = {**OVERRIDES, "pipeline": f"{form}@pp"}
        ref, pm, mesh, tokens, labels, errs, mine, c, eager = pp_dp_tp_step(
            lambda: _llama(LAYERS[form]), overrides, B, S, M, _Reduces)
        local_numel = sum(p.to_local().numel() for n, p in pm.named_parameters() if n in mine)
        norms = sorted({(s.form, s.axis) for st in pm._tp.values() for s in st[2].strategies if s.kind == "norm"})
        arrivals = {k: {n: str(p) for n, p in st[-1][0].items()} for k, st in pm._tp.items()}
        offline = autopar.plan(ref, {"pp": 2, "dp": 2, "tp": TP}, (tokens, labels), plan="megatron",
                               overrides=overrides, microbatches=M)
        priced = {"p2p": pm.plan.estimate.p2p_bytes_per_microbatch,
                  "offline p2p": offline.estimate.p2p_bytes_per_microbatch}
        groups = {a: tuple(dist.get_process_group_ranks(mesh.get_group(a))) for a in ("pp", "dp")}
        return {"errs": errs, "mine": mine, "all": sorted(n for n, _ in ref.named_parameters()), "p2p": c.p2p, "reduces": c.reduces,
                "eager": eager.calls, "groups": groups, "local_numel": local_numel, "norms": norms,
                "arrivals": arrivals, "priced": priced, "stages": pm.local_stages, "rank": dist.get_rank()}
    finally:
        torch.set_default_dtype(torch.float32)


def check_pp_dp_tp_sp(results, form: str = "1f1b"):
    """The assertions on `_pp_dp_tp_sp(form)`'s per-rank results (`benchmarks/pp_dp_tp_gloo.py --case sp`, 8 ranks):
    gpipe and 1f1b run the same stage programs on one stage per pipeline rank; zbv two (0 and 3 on the first
    pipeline rank, 1 and 2 on the second: the 1 -> 2 boundary handed over locally)."""
    check(results)  # every error <= pipeline_helpers.TOL (1e-10) on its rank, every parameter checked somewhere
    shard_bytes = SHARD * 8
    zbv = form == "zbv"
    for r in results:
        first = r["rank"] < 4  # pipeline rank 0
        assert r["stages"] == ([0, 3] if first else [1, 2]) if zbv else [r["rank"] // 4], r["stages"]
        assert r["norms"] == [("sequence", "tp")], r["norms"]
        # every stage but the first takes its one activation as the sequence shard
        assert sorted(r["arrivals"]) == list(range(LAYERS[form])) and r["arrivals"][0] == {}, r["arrivals"]
        assert all(list(a.values()) == ["(Shard(dim=1),)"] for k, a in r["arrivals"].items() if k), r["arrivals"]
        assert r["priced"]["p2p"] == r["priced"]["offline p2p"] == shard_bytes, r["priced"]
        # p2p: per microbatch and boundary between the pipeline ranks this tp rank's sequence shard forward and its
        # gradient backward, to the peer stage of this (dp, tp) coordinate: 1/tp of the non-SP bytes
        crossings = 2 if zbv else 1
        assert sorted(r["p2p"]) == sorted([("isend", shard_bytes), ("irecv", shard_bytes)] * crossings * M), r["p2p"]
        # the first call issues what every call does (the stages' metadata is static: no metadata inference)
        per_mb = (ZBV_ENDS if first else ZBV_MIDDLE) if zbv else FIRST if first else LAST
        assert sorted(r["reduces"]) == sorted(per_mb * M), sorted(r["reduces"])
        dp, pp = r["groups"]["dp"], r["groups"]["pp"]
        assert len(dp) == 2 and r["rank"] in dp and len(pp) == 2 and r["rank"] in pp
        # eager: the gradients summed over the dp sub-group in one bucket; the loss one sum over the whole mesh
        assert [(n, g) for n, g in r["eager"] if g == dp and n > 1] == [(r["local_numel"], dp)], r["eager"]
        assert [(n, g) for n, g in r["eager"] if n == 1] == [(1, tuple(range(len(results))))], r["eager"]


def test_pp_dp_tp_sp_layout_on_a_fake_world():
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Replicate, Shard
    import autopar
    from conftest import set_fake_world
    set_fake_world(8)
    torch.manual_seed(0)
    torch.set_default_dtype(torch.float64)
    try:
        ref = _llama()
        tokens = torch.randint(0, 128, (B, S))
        mesh = init_device_mesh("cpu", (2, 2, TP), mesh_dim_names=("pp", "dp", "tp"))
        pm = autopar.parallelize(ref, mesh, (tokens, tokens), plan="megatron", overrides=OVERRIDES, microbatches=M)
        assert pm.local_stages == [0] and pm._data_axes == ("dp",)
        norms = sorted({(s.form, s.axis) for st in pm._tp.values() for s in st[2].strategies if s.kind == "norm"})
        assert norms == [("sequence", "tp")]
        # the boundary: stage 1 takes its one activation as the sequence shard, stage 0 leaves it so
        (arrive0, leave0), (arrive1, leave1) = pm._tp[0][-1], pm._tp[1][-1]
        assert arrive0 == {} and list(arrive1.values()) == [(Shard(1),)] and leave0 == [(Shard(1),)], pm._tp[1][-1]
        assert leave1 is None  # the loss leaves replicated
        stage = pm._stage_modules[0]
        assert stage.pm.mesh.mesh.tolist() == [0, 1]  # the tp line of (pp 0, dp 0)
        assert stage.out_metas == [((ROWS, S // TP, H), torch.float64)]  # what it sends: its sequence shard
        assert dist.get_process_group_ranks(pm._p2p_group) == [0, 4]
        inner = dict(stage.pm.named_parameters())
        for n, p in pm.named_parameters():
            assert isinstance(p, DTensor) and p.device_mesh.mesh_dim_names == ("dp", "tp"), n
            assert p.placements[0] == Replicate(), n
            if n.startswith(("embed.", "layers.0.")):  # stage 0's: the stage program's storage
                assert p.to_local().data_ptr() == inner[n].to_local().data_ptr() and p.to_local().numel() > 0, n
            else:
                assert p.device_mesh.mesh.tolist() == [[4, 5], [6, 7]] and p.to_local().numel() == 0, n
        # stage 0 on one microbatch, forward and backward: Megatron SP's collectives exactly (values made up)
        with Count() as c:
            (h,) = stage(**{stage.user[0]: tokens[:ROWS]})
            assert tuple(h.shape) == (ROWS, S // TP, H)
            h.sum().backward()
        assert sorted(c.reduces) == sorted(FIRST), sorted(c.reduces)
        # the cost model prices the boundary as it runs (`autopar.plan` alike: the 8-rank job checks it)
        assert pm.plan.estimate.p2p_bytes_per_microbatch == SHARD * 8
    finally:
        torch.set_default_dtype(torch.float32)
