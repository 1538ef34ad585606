"""Expert parallelism: an unmodified Llama whose MLPs are mixtures of experts, on a 2 x 2 CPU mesh.

    torchrun --standalone --nproc-per-node 4 examples/moe.py

The MoE block is written the classic way (a router, an `nn.ModuleList` of experts, a Python loop that
skips idle experts, a load-balancing loss). autopar keeps its router and loss as written, captures the
experts' dispatch (verified on the example inputs), then shards the experts over "ep" (each rank holds 2 of the 8) and dispatches tokens with
all-to-alls; the batch is split over both axes. Every rank trains the single-device model next to
it and prints both losses (auxiliary loss included): they match.
"""

import copy

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

import autopar
from autopar.models import Llama, LlamaConfig


def main() -> None:
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=256, seq_len=32, num_layers=2, num_heads=4, num_kv_heads=2, hidden=64,
                      ffn_hidden=128, moe_experts=8, moe_top_k=2)
    model = Llama(cfg)
    tokens = torch.randint(0, cfg.vocab_size, (8, cfg.seq_len))
    labels = torch.roll(tokens, shifts=-1, dims=1)

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "ep"))
    pm = autopar.parallelize(copy.deepcopy(model), mesh, (tokens, labels), plan="dp", overrides={"moe": "expert@ep"})
    if rank == 0:
        print(pm.plan)

    opt = torch.optim.AdamW(pm.parameters(), lr=1e-3)
    ref_opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    for step in range(5):
        loss = pm(tokens, labels)
        loss.backward()
        opt.step()
        opt.zero_grad()
        ref_loss = model(tokens, labels)
        ref_loss.backward()
        ref_opt.step()
        ref_opt.zero_grad()
        if rank == 0:
            print(f"step {step}: parallel loss {loss.item():.6f}   single-device loss {ref_loss.item():.6f}")

    experts = [p for n, p in pm.named_parameters() if ".experts." in n]
    local = sum(p.to_local().numel() for p in experts)
    full = sum(p.numel() for p in experts)
    for r in range(dist.get_world_size()):
        if r == rank:
            print(f"rank {rank}: holds {100 * local / full:.1f}% of the expert weights", flush=True)
        dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
