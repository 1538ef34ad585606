"""`autopar.load` of a checkpoint whose tensors transformers converts one-to-many on `from_pretrained`: Dinov2 with
SwiGLU keeps `mlp.weights_in` on disk and `Chunk`s it into `gate_proj` and `up_proj` (transformers'
`conversion_mapping`). A converter autopar does not slice runs transformers' own operations on the whole sources
(read once for all its targets), then each rank takes its shard. Exact against `from_pretrained` of the same files
under fsdp (the chunks sharded on their rows) and megatron (gate/up column-parallel), fp64, 2 gloo ranks."""

import torch

from dist_harness import gloo_pool

TOL = 1e-12
LR = 1e-2


def _dinov2_worker(path: str):
    import os

    import torch.distributed as dist
    import transformers
    from safetensors import safe_open
    from torch.distributed.device_mesh import init_device_mesh

    import autopar
    import autopar.weights as weights
    import zoo

    old = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    try:
        cfg = transformers.Dinov2Config(hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                                        intermediate_size=64, image_size=16, patch_size=8, use_swiglu_ffn=True,
                                        num_labels=3)
        torch.manual_seed(0)
        if dist.get_rank() == 0:
            transformers.Dinov2ForImageClassification(cfg).save_pretrained(path)
        dist.barrier()
        with safe_open(os.path.join(path, "model.safetensors"), "pt") as f:
            on_disk = sorted(k for k in f.keys() if ".mlp." in k)
        g = torch.Generator().manual_seed(1)
        x, y = torch.randn(4, 3, 16, 16, generator=g), torch.tensor([0, 1, 2, 1])
        out = {"on_disk": on_disk}
        for plan in ("fsdp", "megatron"):
            with torch.device("meta"):
                meta = zoo.ImageLossWrap(transformers.Dinov2ForImageClassification(cfg)).eval()
            mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("dp" if plan == "fsdp" else "tp",))
            pm = autopar.parallelize(meta, mesh, (x, y), plan=plan)
            reads = []
            real = weights._fill_by_transformers
            weights._fill_by_transformers = lambda *a, **k: reads.append(real(*a, **k)) or reads[-1]
            try:
                autopar.load(pm, path)
            finally:
                weights._fill_by_transformers = real
            ref = zoo.ImageLossWrap(transformers.Dinov2ForImageClassification.from_pretrained(
                path, dtype=torch.float64)).eval()
            loss, rloss = pm(x, y), ref(x, y)
            loss.backward()
            rloss.backward()
            theirs = dict(ref.named_parameters())
            # Dinov2's mask_token is unused without a mask: no gradient on either side
            err = {f"{n}.grad": (0.0 if p.grad is None and theirs[n].grad is None else float("inf"))
                   if p.grad is None or theirs[n].grad is None
                   else float((p.grad.full_tensor() - theirs[n].grad).abs().max())
                   for n, p in pm.named_parameters()}
            torch.optim.AdamW(pm.parameters(), lr=LR).step()
            torch.optim.AdamW(ref.parameters(), lr=LR).step()
            err.update({n: float((p.full_tensor() - theirs[n]).abs().max()) for n, p in pm.named_parameters()})
            err["loss"] = abs(float(loss) - float(rloss))
            placements = {n: str(p.placements) for n, p in pm.named_parameters() if "gate_proj.weight" in n}
            out[plan] = (err, len(theirs), len(list(pm.named_parameters())), sum(len(r) for r in reads),
                         len(reads), placements)
        return out
    finally:
        torch.set_default_dtype(old)


def test_dinov2_swiglu_chunked_weights_load_exactly_under_fsdp_and_megatron(tmp_path):
    for rank, out in enumerate(gloo_pool(2).run(_dinov2_worker, str(tmp_path))):
        # the premise: the file holds the fused `weights_in` that from_pretrained chunks, not gate/up
        assert any("mlp.weights_in.weight" in k for k in out["on_disk"]), out["on_disk"]
        assert not any("gate_proj" in k for k in out["on_disk"]), out["on_disk"]
        for plan in ("fsdp", "megatron"):
            err, n_ref, n_pm, sources_read, fills, placements = out[plan]
            assert n_pm == n_ref, (plan, n_pm, n_ref)
            bad = {k: v for k, v in err.items() if not v <= TOL}
            assert not bad, f"rank {rank} {plan}: differs from from_pretrained: {bad}"
            # 2 layers x (weight, bias) x (gate, up) filled by the converter; each fused source read once
            assert fills == 8 and sources_read == 4, (plan, fills, sources_read)
            assert placements and all("Shard" in p for p in placements.values()), (plan, placements)
