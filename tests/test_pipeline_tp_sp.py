"""Megatron sequence parallelism across pipeline stage boundaries (issue #23, `autopar.pipeline_tp`), gloo, fp64,
4 ranks: pp2 x tp2, plan='megatron', overrides={"pipeline": "1f1b@pp", "norm": "sequence"}.

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
from test_pipeline_runtime import _check
from test_pipeline_tp import _Count

B, S, M, H = 4, 16, 2, 32  # batch, sequence, microbatches, hidden
TP = 2


def _llama(layers: int = 2):
    from autopar.models import Llama, LlamaConfig
    return Llama(LlamaConfig(num_layers=layers, num_heads=4, num_kv_heads=2))


def _pp_tp_sp(form: str, layers: int = 2):
    import copy
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor
    import autopar

    torch.manual_seed(0)
    torch.set_default_dtype(torch.float64)
    try:
        ref = _llama(layers)
        model = copy.deepcopy(ref)
        g = torch.Generator().manual_seed(1)
        tokens = torch.randint(0, 128, (B, S), generator=g)
        labels = torch.randint(0, 128, (B, S), generator=g)
        labels[0, :5] = -100  # ignored labels spread unevenly over the microbatches
        mesh = init_device_mesh("cpu", (2, TP), mesh_dim_names=("pp", "tp"))
        overrides = {"pipeline": f"{form}@pp", "norm": "sequence"}
        pm = autopar.parallelize(model, mesh, (tokens, labels), plan="megatron", overrides=overrides,
                                 microbatches=M)
        assert [n for n, _ in pm.named_parameters()] == [n for n, _ in ref.named_parameters()]
        refs = dict(ref.named_parameters())
        opt_ref = torch.optim.AdamW(ref.parameters(), lr=0.01)
        opt = torch.optim.AdamW(pm.parameters(), lr=0.01)
        errs, counts, mine = {}, [], []
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
                errs[f"grad {step} {n}"] = float((p.grad.full_tensor() - refs[n].grad).abs().max())
            opt_ref.step()
            opt.step()
            for n, p in pm.named_parameters():
                if n in mine:
                    errs[f"param {step} {n}"] = float((p.full_tensor() - refs[n].detach()).abs().max())
        with torch.no_grad():
            errs["no_grad loss"] = abs(float(pm(tokens, labels)) - float(ref(tokens, labels)))
        norms = sorted({(s.form, s.axis) for k, st in pm._tp.items() for s in st[2].strategies if s.kind == "norm"})
        offline = autopar.plan(ref, {"pp": 2, "tp": TP}, (tokens, labels), plan="megatron", overrides=overrides,
                               microbatches=M)
        priced = {"p2p": pm.plan.estimate.p2p_bytes_per_microbatch,
                  "offline p2p": offline.estimate.p2p_bytes_per_microbatch}
        return {"errs": errs, "mine": mine, "all": sorted(refs), "counts": counts, "norms": norms, "priced": priced,
                "stages": pm.local_stages, "rank": dist.get_rank()}
    finally:
        torch.set_default_dtype(torch.float32)


def test_megatron_sp_across_pp2_boundary_matches_one_device():
    results = gloo_pool(4).run(_pp_tp_sp, "1f1b")
    for r in results:
        print(r["rank"], r["stages"], r["norms"], r["priced"])
        for step, (p2p, red) in enumerate(r["counts"]):
            print(" step", step, sorted(p2p))
            print("   ", sorted(red))
        print({k: v for k, v in r["errs"].items() if v > 1e-10})
    _check(results)
