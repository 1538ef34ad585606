"""Megatron inside pipeline stages beyond 1f1b on a Llama (issue #23, `autopar.pipeline_tp`): GPT's embedding tied to
its head on the other stage, and the zero-bubble V schedule, gloo fp64 on the shared 4-rank pool.

pp2 x tp2, `1f1b`, 2 microbatches, GPT (autopar.models.GPT, 2 layers): the embedding (vocab-parallel, `Shard(0)`)
on stage 0 and the head (column-parallel on the vocabulary, `Shard(0)`) on stage 1 are one weight: each stage's
ranks hold its tp shard, their gradient parts are summed over the pipeline axis shard by shard (one all-reduce of
the shard per step), and both stages step it alike. The global loss on every rank, every gradient and every
parameter after two AdamW steps against one device; the tp all-reduces of each stage program (per microbatch), the
tied weight's sum and the p2p sends (count and bytes) asserted exactly.

pp2 x tp2 under `zbv` (torch's ScheduleZBVZeroBubble, 4 one-layer stages of a Llama, V-shaped: stages 0 and 3 on the
first pipeline rank): the loss, every gradient and every parameter after two AdamW steps exact, a forward-only call
too; the p2p and every tp all-reduce counted (see the test for the weight step's repeated backward all-reduces).
"""
from __future__ import annotations

import torch

from dist_harness import gloo_pool
from test_pipeline_runtime import _agreement
from pipeline_helpers import Count, llama, reference_and_batch, stage_grads, stepped_params, train_steps

B, S, M = 4, 16, 2
TOL = 1e-10
H, V = 32, 128  # GPTConfig's defaults: hidden, vocabulary


def _gpt():
    from autopar.models import GPT, GPTConfig
    return GPT(GPTConfig(num_layers=2))


def _tied_pp_tp():
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    import autopar

    torch.set_default_dtype(torch.float64)
    try:
        ref, model, tokens, labels = reference_and_batch(_gpt, B, S, V)
        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("pp", "tp"))
        pm = autopar.parallelize(model, mesh, (tokens, labels), plan="megatron",
                                 overrides={"pipeline": "1f1b@pp"}, microbatches=M)
        assert [n for n, _ in pm.named_parameters()] == [n for n, _ in ref.named_parameters()]
        refs = dict(ref.named_parameters())
        opt_ref = torch.optim.AdamW(ref.parameters(), lr=0.01)
        opt = torch.optim.AdamW(pm.parameters(), lr=0.01)
        errs, counts = {}, []
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
                with Count() as c:
                    loss = pm(tokens, labels)
            finally:
                dist.all_reduce = orig
            loss.backward()
            counts.append((c.p2p, c.reduces, list(sums)))
            errs[f"loss {step}"] = abs(float(loss) - float(ref_loss))
            checked = stage_grads(pm, refs, errs, f"grad {step}")
            if step == 0:
                mine = checked
                placements = {n: (p.device_mesh.mesh_dim_names, str(tuple(p.placements)))
                              for n, p in pm.named_parameters() if n in mine}
            if step == 1:
                errs["norm"] = abs(float(pm.clip_grad_norm_(0.05))
                                   - float(torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.05)))
            opt_ref.step()
            opt.step()
            stepped_params(pm, refs, mine, errs, f"param {step}")
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
            # the first call too: the stages' metadata is static, so torch runs no metadata inference
            assert sorted(reduces) == sorted(per_mb * M), (step, reduces)
    assert {n for r in results for n in r["mine"]} == {n for n, _ in _gpt().named_parameters()}


def _llama(layers: int):
    return llama(num_layers=layers)


def _zbv_pp_tp():
    """pp2 x tp2 under zbv: 4 stages of one layer, V-shaped (stages 0 and 3 on the first pipeline rank)."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    import autopar

    torch.set_default_dtype(torch.float64)
    try:
        ref, model, tokens, labels = reference_and_batch(lambda: _llama(4), B, S, V)
        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("pp", "tp"))
        pm = autopar.parallelize(model, mesh, (tokens, labels), plan="megatron",
                                 overrides={"pipeline": "zbv@pp"}, microbatches=M)
        errs, counts = {}, []
        for _, c, mine in train_steps(ref, pm, (tokens, labels), errs):
            counts.append((c.p2p, c.reduces))
        with torch.no_grad():
            errs["no_grad loss"] = abs(float(pm(tokens, labels)) - float(ref(tokens, labels)))
        return {"errs": errs, "mine": mine, "counts": counts, "stages": pm.local_stages, "rank": dist.get_rank()}
    finally:
        torch.set_default_dtype(torch.float32)


def test_zbv_with_megatron_stages():
    results = gloo_pool(4).run(_zbv_pp_tp)
    act = (B // M) * S * 32 * 8  # one microbatch's hidden state, fp64 bytes (Llama hidden 32)
    hidden, rows = act // 8, (B // M) * S
    for r in results:
        bad = {k: v for k, v in r["errs"].items() if not v <= TOL}
        assert not bad, (r["rank"], bad)
        ends = r["stages"] == [0, 3]
        assert r["stages"] == ([0, 3] if r["rank"] < 2 else [1, 2]), r
        p2p, reduces = r["counts"][1]  # the second step (as the first)
        # per microbatch: the activation of boundaries 0->1 and 2->3 forward, their gradients backward (1->2 stays
        # on the second rank)
        assert sorted(p2p) == sorted([("isend", act), ("irecv", act)] * 2 * M), p2p
        # per microbatch and layer: 2 forward all-reduces (row-parallel outputs) and 2 backward (column-parallel
        # inputs' gradients); stage 0 adds the embedding's forward one, stage 3 the head's backward one and the
        # cross-entropy's three. torch's zero-bubble split runs a non-first stage's backward twice through autopar's
        # fused linear-and-reduce node (input step, then weight step from that node: `stage_backward_weight`), so
        # each backward all-reduce of stages 1-3 is issued twice (the second result unused; the gradients exact)
        if ends:
            per_mb = [hidden] * (3 + 2) + [hidden] * 2 + [rows] * 3 + [hidden] * (2 + 1) * 2
        else:
            per_mb = ([hidden] * 2 + [hidden] * 2 * 2) * 2
        assert sorted(n for _, n in reduces) == sorted(per_mb * M), reduces
    assert {n for r in results for n in r["mine"]} == {n for n, _ in _llama(4).named_parameters()}
