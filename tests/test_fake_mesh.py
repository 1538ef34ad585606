"""Plans for large meshes without processes: one simulated rank of a 256-rank world (fake process
group), checking local shapes and the collectives of the rewritten graph (values are not checked:
the fake backend's collectives return made-up data)."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

import autopar
from autopar.models import Llama, LlamaConfig
from passes.lower import collective_nodes


@pytest.mark.parametrize("rank", [0, 37, 255])
def test_256_rank_plan_shards_and_counts_collectives(rank):
    if dist.is_initialized():
        dist.destroy_process_group()
    dist.init_process_group("fake", rank=rank, world_size=256)
    try:
        mesh = init_device_mesh("cpu", (32, 8), mesh_dim_names=("dp", "tp"))
        cfg = LlamaConfig(vocab_size=256, seq_len=16, num_layers=2, num_heads=8, num_kv_heads=8, hidden=64,
                          ffn_hidden=128)
        torch.manual_seed(0)
        model = Llama(cfg)
        ids = torch.randint(0, 256, (64, 16))
        pm = autopar.parallelize(model, mesh, (ids, ids), plan="megatron")
        full = dict(model.named_parameters())
        for name, p in pm.named_parameters():
            tp_sharded = any(getattr(pl, "dim", None) is not None for pl in p.placements)
            expected = full[name].numel() // (8 if tp_sharded else 1)
            assert p.to_local().numel() == expected, name
        assert pm.embed.weight.to_local().shape == (256 // 8, 64)
        assert pm.get_parameter("layers.0.attn.wq.weight").to_local().shape == (64 // 8, 64)
        assert pm.get_parameter("layers.0.mlp.down.weight").to_local().shape == (64, 128 // 8)
        # tensor parallel: the vocab-parallel embedding's all-reduce, then per layer one forward
        # all-reduce after attention and one after the MLP (Megatron's g), nothing else forward on tp
        fwd_tp = [n for n in collective_nodes(pm.graph_module)
                  if n.meta["autopar_comm"].axis == "tp" and n.meta["autopar_comm"].forward == "all_reduce"]
        modules = [n.meta["autopar_comm"].module for n in fwd_tp]
        assert len(fwd_tp) == 1 + 2 * cfg.num_layers, modules
        assert sum(m.startswith("layers.0") for m in modules) == 2, modules
        loss = pm(ids, ids)  # runs: local shapes are consistent end to end
        loss.backward()
        assert loss.shape == ()
    finally:
        dist.destroy_process_group()
