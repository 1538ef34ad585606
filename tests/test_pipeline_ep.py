"""Expert parallelism inside pipeline stages (issue #23, `autopar.pipeline_ep`), gloo, fp64, 4 ranks: pp2 x ep2.

A 2-layer Llama-style model whose MLPs are mixtures of 4 stacked (grouped) experts, top-2 (autopar.models.Llama),
1f1b with 2 microbatches: the global loss on every rank, every parameter's gradient (on the ranks of its stage,
every parameter checked on some rank) and every parameter after two AdamW steps against one device, the clipped
gradients too; each rank holds 2 of its stage's 4 experts; each stage's collectives (the expert all-to-alls per
microbatch and MoE layer, the one bucket of replicated gradients summed over ep per step) and the schedule's p2p
sends (count and bytes per microbatch: this rank's rows only) asserted exactly.
"""

from __future__ import annotations

import torch

from dist_harness import gloo_pool
from pipeline_helpers import Count, check, held, llama, reference_and_batch, train_steps

B, S, M, H, E = 8, 8, 2, 32, 4  # batch, sequence, microbatches, hidden, experts


class _CountAllReduce(Count):
    """`Count`, and the pipeline's own `torch.distributed.all_reduce` calls: (numel, group size)."""

    def __enter__(self):
        import torch.distributed as dist
        self.all_reduce, self._orig = [], dist.all_reduce

        def all_reduce(t, *a, group=None, **kw):
            self.all_reduce.append((t.numel(), dist.get_world_size(group)))
            return self._orig(t, *a, group=group, **kw)
        dist.all_reduce = all_reduce
        return super().__enter__()

    def __exit__(self, *exc):
        import torch.distributed as dist
        dist.all_reduce = self._orig
        return super().__exit__(*exc)


def _llama():
    return llama(moe_experts=E, moe_top_k=2, moe_style="grouped")


def _pp_ep(path: str):
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    import autopar

    torch.set_default_dtype(torch.float64)
    try:
        ref, model, tokens, labels = reference_and_batch(_llama, B, S)
        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("pp", "ep"))
        pm = autopar.parallelize(model, mesh, (tokens, labels), plan="dp",
                                 overrides={"pipeline": "1f1b@pp", "moe": "expert@ep"}, microbatches=M)
        assert [n for n, _ in pm.named_parameters()] == [n for n, _ in ref.named_parameters()]
        refs = dict(ref.named_parameters())
        errs, counts = {}, []
        # the last step also checks the total norm over every stage and expert shard, and the clipped gradients
        for step, c, mine in train_steps(ref, pm, (tokens, labels), errs, counter=_CountAllReduce, clip=0.05):
            counts.append((c.p2p, c.reduces, c.all_reduce))
            if step == 0:
                placements = {n: str(tuple(p.placements)) for n, p in pm.named_parameters() if n in mine}
                local = {n: (p.to_local().numel(), p.numel()) for n, p in pm.named_parameters() if n in mine}
        # a DCP checkpoint of the stepped pp x ep module loads bit-equal into a plain dp (expert-parallel) plan
        import torch.distributed.checkpoint as dcp
        trained = {}
        parts = [None] * dist.get_world_size()
        dist.all_gather_object(parts, held(pm))
        for part in parts:
            trained.update(part)
        dcp.save(pm.state_dict(), checkpoint_id=f"{path}/ppep")
        torch.manual_seed(5)
        flat = autopar.parallelize(_llama(), init_device_mesh("cpu", (4,), mesh_dim_names=("ep",)), (tokens, labels),
                                   plan="dp", overrides={"moe": "expert@ep"})
        sd = flat.state_dict()
        dcp.load(sd, checkpoint_id=f"{path}/ppep")
        flat.load_state_dict(sd)
        got = held(flat)
        errs["dcp names"] = float(set(got) != set(trained))
        errs["dcp not bit-equal"] = float(sum(not torch.equal(got[n], trained[n]) for n in got))
        replicated = sum(p.numel() for n, p in pm.named_parameters() if n in mine and ".experts." not in n)
        return {"replicated": replicated, "errs": errs, "mine": mine, "all": sorted(refs), "counts": counts, "placements": placements,
                "local": local, "stages": pm.local_stages, "rank": dist.get_rank()}
    finally:
        torch.set_default_dtype(torch.float32)


def _refused():
    """What expert parallelism in a stage does not run yet, raised on every rank (NotImplementedError)."""
    from torch.distributed.device_mesh import init_device_mesh
    import autopar
    from autopar.models import Llama, LlamaConfig
    torch.manual_seed(0)
    tokens = torch.randint(0, 128, (B, S))
    cases = [((2, 2), ("pp", "ep"), "zbv", "dp", _llama()), ((2, 2), ("pp", "ep"), "1f1b", "fsdp", _llama())]
    out = []
    for shape, names, form, plan, model in cases:
        mesh = init_device_mesh("cpu", shape, mesh_dim_names=names)
        try:
            autopar.parallelize(model, mesh, (tokens, tokens), plan=plan,
                                overrides={"pipeline": f"{form}@pp", "moe": "expert@ep"}, microbatches=M)
            out.append(None)
        except NotImplementedError as e:
            out.append(str(e))
    return out


def test_expert_parallel_pp2_x_ep2_stages_match_one_device(tmp_path):
    results = gloo_pool(4).run(_pp_ep, str(tmp_path))
    check(results)  # every error <= 1e-10 on its rank, every parameter checked on some rank
    rows = B // M // 2  # one microbatch's rows on one ep rank
    act = rows * S * H * 8  # its hidden state, fp64 bytes
    routed = 2 * rows * S * H  # the top-2 routed rows this rank sends to the experts (elements)
    for r in results:
        first = r["stages"] == [0]
        layer = 0 if first else 1
        experts = f"layers.{layer}.mlp.experts.w1"
        assert r["placements"][experts] == "(Shard(dim=0),)", r["placements"]
        numel, full = r["local"][experts]
        assert numel * 2 == full  # 2 of the 4 experts on each ep rank
        assert r["placements"][f"layers.{layer}.mlp.router.weight"] == "(Replicate(),)"
        for step, (p2p, colls, reduces) in enumerate(r["counts"]):
            # p2p: per microbatch this rank's rows of the hidden state forward and their gradient backward
            assert sorted(p2p) == sorted([("isend" if first else "irecv", act), ("irecv" if first else "isend", act)]
                                         * M), p2p
            # inside the stage programs only the expert all-to-alls on the ep sub-group (no per-microbatch
            # gradient all-reduce); per microbatch and MoE layer (one per stage): forward the E split counts, the
            # routed tokens out and back; backward their gradients out and back. The first call too (the stages'
            # metadata is static: torch runs no metadata inference)
            assert {c[0] for c in colls} == {"all_to_all_single"}, colls
            assert sum(1 for c in colls if c[1] == E) == M, colls
            tokens = [c[1] for c in colls if c[1] != E]
            assert len(tokens) == 4 * M, colls
            assert tokens.count(routed) >= 2 * M, colls  # what this rank sends out
            # the pipeline's own: the ranks' agreement on the batch (11 digests), the loss over the whole (pp, ep)
            # mesh in one all-reduce (each ep rank adds its rows' part), and one bucket of the stage's replicated
            # gradients over ep (the experts' are not summed)
            assert reduces == [(11, 4), (1, 4), (r["replicated"], 2)], reduces
    for a, b in ((0, 1), (2, 3)):  # what one ep rank's experts receive the other sends: the pair moves 2 x routed
        for step in range(2):
            moved = [sum(c[1] for c in results[i]["counts"][step][1] if c[1] != E) for i in (a, b)]
            n = len([c for c in results[a]["counts"][step][1] if c[1] != E])
            assert sum(moved) == 2 * routed * n, moved
    assert results[0]["replicated"] == sum(p.numel() for n, p in _llama().named_parameters()
                                           if n.startswith(("embed.", "layers.0.")) and ".experts." not in n)


def test_expert_parallel_stage_forms_not_yet_run_raise_on_every_rank():
    for r in gloo_pool(4).run(_refused):
        zbv, fsdp = r
        assert zbv is not None and "zero-bubble" in zbv and "Fix: '1f1b'" in zbv, zbv
        assert fsdp is not None and "plan='fsdp'" in fsdp and "Fix: plan='dp'" in fsdp, fsdp
