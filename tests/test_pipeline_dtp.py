"""Megatron inside pipeline stages beside a data axis (issue #23, `autopar.pipeline_tp`): a (pp=2, dp=2, tp=2) mesh.

In the suite (`test_pp_dp_tp_layout_on_a_fake_world`, one process, the fake process group of 8 ranks, rank 0): what
the construction builds: each parameter a DTensor on its stage's (dp, tp) sub-mesh with [Replicate(), megatron's
placement] (empty on the other stage's ranks), the stage program on the tp line of this rank's (pp, dp)
coordinate over the same storage, the p2p group along pp, stage 0's tp all-reduces per microbatch forward and
backward, and `pm.plan` equal to `autopar.plan` with the same override.

The run against one device on 8 gloo ranks (`_pp_dp_tp`, checked by `check_pp_dp_tp`) is too slow for the suite
(46 s with the 8-rank pool's start at load 7-11 on 2 cores; the pool alone 51 s and the job 17 s at load 32): it
runs from `python benchmarks/pp_dp_tp_gloo.py`. fp64, 1f1b, 2 microbatches per data rank, a 2-layer Llama-style
model (hidden 16, seq 8): the global loss on every rank, every parameter's gradient (on the ranks of its stage;
every parameter checked on some rank) and every parameter after one AdamW step; each stage's collectives exactly:
the tp all-reduces of its megatron program per microbatch, the gradient all-reduce (one flat bucket) over the dp
sub-group, the loss sums over pp and dp, and the p2p between the stages of one (dp, tp) coordinate (count and bytes
per microbatch).
"""

from __future__ import annotations

import pytest
import torch

from pipeline_helpers import Count, check, llama, pp_dp_tp_step

B, S, H, M = 4, 8, 16, 2  # batch (dp2 x 2 microbatches x 1 row), sequence, hidden, microbatches per data rank


def _llama(layers: int = 2):
    return llama(hidden=H, ffn_hidden=2 * H, seq_len=S, num_layers=layers)


class _Reduces:
    """Records (numel, group ranks) of the eager `dist.all_reduce` calls (the data-axis gradient sum, the loss
    sums, the call check), beside `Count`'s functional ones of the stage programs."""

    def __enter__(self):
        import torch.distributed as dist
        self.calls, self._orig = [], dist.all_reduce

        def all_reduce(t, op=dist.ReduceOp.SUM, group=None, async_op=False):
            self.calls.append((t.numel(), tuple(dist.get_process_group_ranks(group or dist.group.WORLD))))
            return self._orig(t, op=op, group=group, async_op=async_op)
        dist.all_reduce = all_reduce
        return self

    def __exit__(self, *exc):
        import torch.distributed as dist
        dist.all_reduce = self._orig


def _pp_dp_tp():
    import torch.distributed as dist
    import autopar

    torch.set_default_dtype(torch.float64)
    try:
        ref, pm, mesh, tokens, labels, errs, mine, c, eager = pp_dp_tp_step(
            _llama, {"pipeline": "1f1b@pp"}, B, S, M, _Reduces)
        own = {n: p for n, p in pm.named_parameters() if n in mine}
        placements = {n: str(tuple(p.placements)) for n, p in own.items()}
        meshes = {n: tuple(p.device_mesh.mesh_dim_names) for n, p in own.items()}
        sizes = {n: p.to_local().numel() for n, p in own.items()}
        offline = autopar.plan(ref, {"pp": 2, "dp": 2, "tp": 2}, (tokens, labels), plan="megatron",
                               overrides={"pipeline": "1f1b@pp"}, microbatches=M)
        priced = {"p2p": pm.plan.estimate.p2p_bytes_per_microbatch, "step": pm.plan.estimate.step_time_s,
                  "offline p2p": offline.estimate.p2p_bytes_per_microbatch,
                  "offline step": offline.estimate.step_time_s,
                  "cut": tuple(pm.plan.pipeline.cut), "offline cut": tuple(offline.pipeline.cut)}
        groups = {a: tuple(dist.get_process_group_ranks(mesh.get_group(a))) for a in ("pp", "dp")}
        return {"priced": priced, "errs": errs, "mine": mine, "all": sorted(n for n, _ in ref.named_parameters()), "placements": placements,
                "meshes": meshes, "p2p": c.p2p, "reduces": c.reduces, "eager": eager.calls, "groups": groups,
                "local_numel": sum(sizes.values()), "stages": pm.local_stages, "rank": dist.get_rank()}
    finally:
        torch.set_default_dtype(torch.float32)


def check_pp_dp_tp(results):
    """The assertions on `_pp_dp_tp`'s per-rank results (`benchmarks/pp_dp_tp_gloo.py` runs it on 8 gloo ranks)."""
    check(results)  # every error <= pipeline_helpers.TOL (1e-10) on its rank, every parameter checked somewhere
    rows = B // (2 * M)
    act = rows * S * H * 8  # one microbatch's hidden state, fp64 bytes
    for r in results:
        pr = r["priced"]  # pm.plan prices what runs, as autopar.plan does with the same override
        assert pr["p2p"] == pr["offline p2p"] and pr["cut"] == pr["offline cut"] == (0, 1, 2), pr
        assert pr["step"] == pytest.approx(pr["offline step"], rel=1e-9), pr
        first = r["stages"] == [0]
        assert r["stages"] == [r["rank"] // 4]
        # megatron's placements, replicated over dp, on the stage's (dp, tp) sub-mesh
        assert set(r["meshes"].values()) == {("dp", "tp")}
        assert r["placements"]["layers.0.attn.wq.weight" if first else "layers.1.attn.wq.weight"] == \
            "(Replicate(), Shard(dim=0))"
        assert r["placements"]["layers.0.attn.wo.weight" if first else "layers.1.mlp.down.weight"] == \
            "(Replicate(), Shard(dim=1))"
        assert r["placements"]["layers.0.attn_norm.weight" if first else "norm.weight"] == "(Replicate(), Replicate())"
        # p2p: per microbatch one activation forward and its gradient backward, to the peer stage of this (dp, tp)
        assert sorted(r["p2p"]) == sorted([("isend" if first else "irecv", act),
                                           ("irecv" if first else "isend", act)] * M), r["p2p"]
        # tp all-reduces per microbatch (as on pp x tp): 5 of the hidden state; the last stage adds the
        # vocab-parallel cross-entropy's three; the first call is a step as any other (the stages' metadata is
        # static: torch runs no metadata inference)
        per_mb = [("all_reduce", act // 8)] * 5 + ([] if first else [("all_reduce", rows * S)] * 3)
        assert sorted(r["reduces"]) == sorted(per_mb * M), r["reduces"]
        # eager: the gradients summed over the dp sub-group in one bucket (this rank's tp shards of its stage)
        dp, pp = r["groups"]["dp"], r["groups"]["pp"]
        assert len(dp) == 2 and r["rank"] in dp and len(pp) == 2 and r["rank"] in pp
        grads = [(n, g) for n, g in r["eager"] if g == dp and n > 1]
        assert grads == [(r["local_numel"], dp)], r["eager"]
        # the loss: under tensor parallelism one sum over the whole mesh (`_summed_groups`: the tp ranks but the
        # first add zero), the one collective every rank of the call meets
        whole = tuple(range(len(results)))
        assert [(n, g) for n, g in r["eager"] if n == 1] == [(1, whole)], r["eager"]


def test_pp_dp_tp_layout_on_a_fake_world():
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
        mesh = init_device_mesh("cpu", (2, 2, 2), mesh_dim_names=("pp", "dp", "tp"))
        pm = autopar.parallelize(ref, mesh, (tokens, tokens), plan="megatron", overrides={"pipeline": "1f1b@pp"},
                                 microbatches=M)
        assert pm.local_stages == [0] and pm._data_axes == ("dp",)
        stage = pm._stage_modules[0]
        inner = dict(stage.pm.named_parameters())
        assert stage.pm.mesh.mesh.tolist() == [0, 1]  # the tp line of (pp 0, dp 0)
        assert dist.get_process_group_ranks(pm._p2p_group) == [0, 4]  # stage 0 -> stage 1 at (dp 0, tp 0)
        assert dist.get_process_group_ranks(mesh.get_group("dp")) == [0, 2]  # the gradient sum's sub-group
        placements = {}
        for n, p in pm.named_parameters():
            assert isinstance(p, DTensor) and p.device_mesh.mesh_dim_names == ("dp", "tp"), n
            placements[n] = tuple(p.placements)
            assert p.placements[0] == Replicate(), n
            if n.startswith(("embed.", "layers.0.")):  # stage 0: this rank's, the stage program's storage
                assert p.device_mesh.mesh.tolist() == [[0, 1], [2, 3]], n
                q = inner[n]
                assert q.device_mesh.mesh.tolist() == [0, 1] and tuple(q.placements) == tuple(p.placements[1:])
                assert p.to_local().data_ptr() == q.to_local().data_ptr() and p.to_local().numel() > 0
            else:  # stage 1's, on its ranks' sub-mesh, empty here
                assert p.device_mesh.mesh.tolist() == [[4, 5], [6, 7]] and p.to_local().numel() == 0, n
        assert placements["layers.0.attn.wq.weight"] == placements["layers.1.attn.wq.weight"] == (Replicate(), Shard(0))
        assert placements["layers.1.mlp.down.weight"] == (Replicate(), Shard(1))
        assert placements["norm.weight"] == (Replicate(), Replicate())
        # stage 0's program on one microbatch (1 row): the embedding's and each row-parallel output's all-reduce
        # forward, the column-parallel inputs' gradients backward (the values are the fake group's, not checked)
        rows = B // (2 * M)
        with Count() as c:
            assert len(stage.user) == 1  # the tokens (the labels are the last stage's)
            (h,) = stage(**{stage.user[0]: tokens[:rows]})
            h.sum().backward()
        assert sorted(c.reduces) == [("all_reduce", rows * S * H)] * 5, c.reduces
        offline = autopar.plan(ref, {"pp": 2, "dp": 2, "tp": 2}, (tokens, tokens), plan="megatron",
                               overrides={"pipeline": "1f1b@pp"}, microbatches=M)
        assert pm.plan.estimate.p2p_bytes_per_microbatch == offline.estimate.p2p_bytes_per_microbatch == \
            rows * S * H * 8
        assert tuple(pm.plan.pipeline.cut) == tuple(offline.pipeline.cut) == (0, 1, 2)
        assert pm.plan.estimate.step_time_s == pytest.approx(offline.estimate.step_time_s, rel=1e-9)
    finally:
        torch.set_default_dtype(torch.float32)
