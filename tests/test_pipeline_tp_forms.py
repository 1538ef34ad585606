"""Megatron inside pipeline stages beyond 1f1b on a Llama (issue #23, `autopar.pipeline_tp`): GPT's embedding tied to
its head on the other stage, and what is refused with a reason, gloo fp64 on the shared 4-rank pool.

pp2 x tp2, `1f1b`, 2 microbatches, GPT (autopar.models.GPT, 2 layers): the embedding (vocab-parallel, `Shard(0)`)
on stage 0 and the head (column-parallel on the vocabulary, `Shard(0)`) on stage 1 are one weight: each stage's
ranks hold its tp shard, their gradient parts are summed over the pipeline axis shard by shard (one all-reduce of
the shard per step), and both stages step it alike. The global loss on every rank, every gradient and every
parameter after two AdamW steps against one device; the tp all-reduces of each stage program (per microbatch), the
tied weight's sum and the p2p sends (count and bytes) asserted exactly.
"""
from __future__ import annotations

import torch

from dist_harness import gloo_pool
from test_pipeline_runtime import _agreement
from test_pipeline_tp import _Count

B, S, M = 4, 16, 2
TOL = 1e-10
H, V = 32, 128  # GPTConfig's defaults: hidden, vocabulary


def _gpt():
    from autopar.models import GPT, GPTConfig
    return GPT(GPTConfig(num_layers=2))


def _tied_pp_tp():
    import copy
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    import autopar

    torch.manual_seed(0)
    torch.set_default_dtype(torch.float64)
    try:
        ref = _gpt()
        model = copy.deepcopy(ref)
        g = torch.Generator().manual_seed(1)
        tokens = torch.randint(0, V, (B, S), generator=g)
        labels = torch.randint(0, V, (B, S), generator=g)
        labels[0, :5] = -100  # ignored labels spread unevenly over the microbatches
        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("pp", "tp"))
        pm = autopar.parallelize(model, mesh, (tokens, labels), plan="megatron",
                                 overrides={"pipeline": "1f1b@pp"}, microbatches=M)
        assert [n for n, _ in pm.named_parameters()] == [n for n, _ in ref.named_parameters()]
        refs = dict(ref.named_parameters())
        opt_ref = torch.optim.AdamW(ref.parameters(), lr=0.01)
        opt = torch.optim.AdamW(pm.parameters(), lr=0.01)
        errs, counts, mine, placements = {}, [], [], {}
        sums = []
        orig = dist.all_reduce

        def all_reduce(t, *a, **k):  # the pipeline's own sums (loss, tied weight), by numel and group size
            sums.append((t.numel(), dist.get_world_size(k.get("group", a[1] if len(a) > 1 else None))))
            return orig(t, *a, **k)
        for step in range(2):
            opt_ref.zero_grad()
            opt.zero_grad()
            ref_loss = ref(tokens, labels)
            ref_loss.backward()
            sums.clear()
            dist.all_reduce = all_reduce
            try:
                with _Count() as c:
                    loss = pm(tokens, labels)
            finally:
                dist.all_reduce = orig
            loss.backward()
            counts.append((c.p2p, c.reduces, list(sums)))
            errs[f"loss {step}"] = abs(float(loss) - float(ref_loss))
            for n, p in pm.named_parameters():
                if p.device_mesh.get_coordinate() is None:  # another stage's
                    assert p.grad is None and p.to_local().numel() == 0
                    continue
                if step == 0:
                    mine.append(n)
                    placements[n] = (p.device_mesh.mesh_dim_names, str(tuple(p.placements)))
                errs[f"grad {step} {n}"] = float((p.grad.full_tensor() - refs[n].grad).abs().max())
            if step == 1:
                errs["norm"] = abs(float(pm.clip_grad_norm_(0.05))
                                   - float(torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.05)))
            opt_ref.step()
            opt.step()
            for n, p in pm.named_parameters():
                if n in mine:
                    errs[f"param {step} {n}"] = float((p.full_tensor() - refs[n].detach()).abs().max())
        return {"errs": errs, "mine": mine, "counts": counts, "placements": placements, "stages": pm.local_stages,
                "rank": dist.get_rank()}
    finally:
        torch.set_default_dtype(torch.float32)


def test_gpt_tied_embedding_and_head_on_two_megatron_stages():
    results = gloo_pool(4).run(_tied_pp_tp)
    act = (B // M) * S * H * 8  # one microbatch's hidden state, fp64 bytes
    for r in results:
        bad = {k: v for k, v in r["errs"].items() if not v <= TOL}
        assert not bad, (r["rank"], bad)
        assert "wte.weight" in r["mine"], r["mine"]
        # one tensor on both stages' ranks, each holding its vocabulary shard
        assert r["placements"]["wte.weight"] == (("pp_shared", "tp"), "(Replicate(), Shard(dim=0))"), r["placements"]
        first = r["stages"] == [0]
        for step, (p2p, reduces, sums) in enumerate(r["counts"]):
            assert sorted(p2p) == sorted([("isend" if first else "irecv", act), ("irecv" if first else "isend", act)]
                                         * M), p2p
            # the call's input agreement and the loss over the whole mesh, then the tied weight's shard (V/2 x H)
            # over the pipeline axis
            assert sums == [(_agreement(B), 4), (1, 4), (V // 2 * H, 2)], sums
            # per microbatch and layer: the row-parallel outputs (attention and MLP projections) all-reduced
            # forward, the column-parallel inputs' gradients (qkv, fc) backward; stage 0 adds the vocab-parallel
            # embedding's output, stage 1 the head's input gradient and the vocab-parallel cross-entropy's three
            per_mb = [("all_reduce", act // 8)] * 5 if first else \
                [("all_reduce", act // 8)] * 5 + [("all_reduce", (B // M) * S)] * 3
            # the first call also runs torch's metadata inference on one microbatch: stage 0's forward, the last
            # stage's forward and backward
            inference = [] if step else [("all_reduce", act // 8)] * 3 if first else per_mb
            assert sorted(reduces) == sorted(per_mb * M + inference), (step, reduces)
    assert {n for r in results for n in r["mine"]} == {n for n, _ in _gpt().named_parameters()}
