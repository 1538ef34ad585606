"""autopar in one page: parallelise an unmodified GPT on a 2 x 2 CPU mesh and train it.

    torchrun --standalone --nproc-per-node 4 examples/quickstart.py      # or: make demo

Every rank trains the parallel model and, next to it, the same single-device model (it is
small), and prints both losses: they match to floating-point tolerance.
"""

import copy

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

import autopar
from autopar.models import GPT, GPTConfig


def main() -> None:
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(0)  # same model and data on every rank
    cfg = GPTConfig(vocab_size=256, seq_len=32, num_layers=2, num_heads=4, hidden=64, dropout=0.0)
    model = GPT(cfg)
    tokens = torch.randint(0, cfg.vocab_size, (8, cfg.seq_len))
    labels = torch.roll(tokens, shifts=-1, dims=1)

    # 2 data-parallel groups x 2-way tensor parallel; plan="auto" would let the planner choose
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    pm = autopar.parallelize(copy.deepcopy(model), mesh, (tokens, labels), plan="megatron")
    if rank == 0:
        print(pm.plan)  # every structure's form, parameter placements and collectives
        # pm.graph_module.print_readable() shows the rewritten program, collectives included

    opt = torch.optim.AdamW(pm.parameters(), lr=1e-3)
    ref_opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    for step in range(5):
        loss = pm(tokens, labels)  # global inputs: autopar slices the batch itself
        loss.backward()
        opt.step()
        opt.zero_grad()
        ref_loss = model(tokens, labels)
        ref_loss.backward()
        ref_opt.step()
        ref_opt.zero_grad()
        if rank == 0:
            print(f"step {step}: parallel loss {loss.item():.6f}   single-device loss {ref_loss.item():.6f}")

    # parameters are DTensors under their original names; to_local() is this rank's shard
    local = sum(p.to_local().numel() for p in pm.parameters())
    full = sum(p.numel() for p in pm.parameters())
    for r in range(dist.get_world_size()):
        if r == rank:
            print(f"rank {rank}: holds {100 * local / full:.1f}% of parameter elements", flush=True)
        dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
