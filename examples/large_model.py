"""A large model the way people start one: built on the meta device, parallelised, then loaded.

    torchrun --standalone --nproc-per-node 4 examples/large_model.py

Rank 0 writes a small Llama (from a config, seeded) to a temporary directory as Hugging Face sharded safetensors
(`save_pretrained`), standing in for a downloaded checkpoint. Then every rank:

1. builds the model under `torch.device("meta")`: no memory for weights;
2. `autopar.parallelize(...)` captures and plans it, and allocates only this rank's shard of each parameter;
3. `autopar.load(pm, path)` reads only this rank's slice of each tensor from the files;
4. checks the loss against the single-device model loaded from the same files, and trains a step.

(`pm.init_weights()` instead of step 3 initialises from scratch, on the shards.)
"""

import shutil
import tempfile

import torch
import torch.distributed as dist
import transformers
from torch import nn
from torch.distributed.device_mesh import init_device_mesh

import autopar


class WithLoss(nn.Module):
    """The user's own training module: the Hugging Face model returning its loss."""

    def __init__(self, m):
        super().__init__()
        self.m = m

    def forward(self, input_ids, labels):
        return self.m(input_ids=input_ids, labels=labels).loss


def main() -> None:
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    config = transformers.LlamaConfig(vocab_size=512, hidden_size=128, intermediate_size=344, num_hidden_layers=4,
                                      num_attention_heads=8, num_key_value_heads=4, max_position_embeddings=128)
    path = [tempfile.mkdtemp() if rank == 0 else None]
    dist.broadcast_object_list(path)
    path = path[0]
    if rank == 0:
        torch.manual_seed(0)
        transformers.LlamaForCausalLM(config).save_pretrained(path, max_shard_size="200KB")
    dist.barrier()

    torch.manual_seed(1)  # the same batch on every rank
    tokens = torch.randint(0, config.vocab_size, (4, 32))
    labels = torch.roll(tokens, shifts=-1, dims=1)

    with torch.device("meta"):
        model = WithLoss(transformers.LlamaForCausalLM(config))
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    pm = autopar.parallelize(model, mesh, (tokens, labels), plan="megatron")
    autopar.load(pm, path)  # the wrapper's "m." prefix is found; or autopar.load(pm, path, prefix="m.")

    loss = pm(tokens, labels)
    ref = WithLoss(transformers.LlamaForCausalLM.from_pretrained(path))  # the same files on one device
    ref_loss = ref(tokens, labels)
    loss.backward()
    opt = torch.optim.AdamW(pm.parameters(), lr=1e-3)
    opt.step()
    opt.zero_grad()
    after = pm(tokens, labels)

    held = sum(p.to_local().numel() * p.element_size() for p in pm.parameters())
    full = sum(p.numel() * p.element_size() for p in pm.parameters())
    for r in range(dist.get_world_size()):
        if r == rank:
            print(f"rank {rank}: loaded loss {loss.item():.6f}, single device {ref_loss.item():.6f}; after a step "
                  f"{after.item():.6f}; holds {held / 2**20:.2f} of {full / 2**20:.2f} MiB of parameters", flush=True)
        dist.barrier()
    assert abs(loss.item() - ref_loss.item()) < 1e-4, (loss.item(), ref_loss.item())
    if rank == 0:
        shutil.rmtree(path)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
