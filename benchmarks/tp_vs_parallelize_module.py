"""autopar's "megatron" plan against torch's hand-written tensor-parallel plan, on 2 gloo ranks.

The same model, parallelised twice: by `autopar.parallelize(..., plan="megatron")` and by
`torch.distributed.tensor.parallel.parallelize_module` with the equivalent hand plan
(ColwiseParallel on the first linear of each MLP / q, k, v, gate, up; RowwiseParallel on the
second / o, down). Training steps (forward + backward + AdamW step) alternate between the two in
one run; the ratio autopar/torch of the median step times is printed (goal <= 1.0), after a check
that both give the single-device loss.

    python benchmarks/tp_vs_parallelize_module.py [--quick]
"""

from __future__ import annotations

import contextlib
import copy
import sys

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, loss_parallel, parallelize_module

import autopar
from autopar.models import Llama, LlamaConfig
from common import MLPStack, interleaved, launch, report, train_step

WORLD_SIZE = 2
BATCH = 4  # sequences per step in the transformer benchmarks


def _compare(name: str, desc: str, model, inputs, mesh, hand_plan, *, warmup: int, iters: int, after_hand=None,
             hand_ctx=contextlib.nullcontext) -> None:
    rank = dist.get_rank()
    pm = autopar.parallelize(copy.deepcopy(model), mesh, inputs, plan="megatron")
    hand = parallelize_module(copy.deepcopy(model), mesh, hand_plan)
    if after_hand:
        after_hand(hand)
    with torch.no_grad():
        ref, a = model(*inputs).item(), pm(*inputs).item()
        with hand_ctx():
            b = hand(*inputs).item()
    if rank == 0:
        print(f"{name} ({desc}): loss single-device {ref:.6f}  autopar {a:.6f}  torch {b:.6f}  "
              f"(|autopar - torch| = {abs(a - b):.2e})")
    assert abs(a - ref) <= 1e-4 * max(1.0, abs(ref)) and abs(b - ref) <= 1e-4 * max(1.0, abs(ref)), (ref, a, b)
    opt_a = torch.optim.AdamW(pm.parameters(), lr=1e-4)
    opt_b = torch.optim.AdamW(hand.parameters(), lr=1e-4)
    losses = {}

    def hand_step():
        with hand_ctx():  # loss_parallel must cover the forward and the backward
            losses["torch"] = train_step(hand, opt_b, inputs)

    times = interleaved({"autopar": lambda: losses.__setitem__("autopar", train_step(pm, opt_a, inputs)),
                         "torch": hand_step},
                        warmup=warmup, iters=iters)
    if rank == 0:
        print(f"  after {warmup + len(times.wall_s['autopar'])} training steps: loss autopar {losses['autopar'].item():.6f}  "
              f"torch {losses['torch'].item():.6f}")
        report(f"tp_vs_hand_plan[{name}]", times, "autopar", "torch")


def mlp_stack(quick: bool) -> None:
    dim, ffn, num_layers, tokens = 512, 2048, 4, 512
    torch.manual_seed(0)  # same model and data on every rank
    model = MLPStack(dim, ffn, num_layers)
    inputs = (torch.randn(4, tokens // 4, dim), torch.randn(4, tokens // 4, dim))
    mesh = init_device_mesh("cpu", (WORLD_SIZE,), mesh_dim_names=("tp",))
    plan = {}
    for i in range(num_layers):
        plan[f"blocks.{i}.fc1"] = ColwiseParallel()
        plan[f"blocks.{i}.fc2"] = RowwiseParallel()
    _compare("mlp_stack", f"dim={dim} ffn={ffn} layers={num_layers} tokens={tokens}", model, inputs, mesh, plan,
             warmup=3, iters=6 if quick else 100)


def llama(quick: bool) -> None:
    cfg = LlamaConfig(vocab_size=2048, seq_len=128, num_layers=2, num_heads=8, num_kv_heads=4, hidden=512,
                      ffn_hidden=1536)
    torch.manual_seed(0)
    model = Llama(cfg)
    tokens = torch.randint(0, cfg.vocab_size, (BATCH, cfg.seq_len))
    inputs = (tokens, torch.roll(tokens, -1, dims=1))
    mesh = init_device_mesh("cpu", (WORLD_SIZE,), mesh_dim_names=("tp",))
    _compare("llama", f"hidden={cfg.hidden} layers={cfg.num_layers} heads={cfg.num_heads}/{cfg.num_kv_heads} "
             f"seq={cfg.seq_len} batch={BATCH}", model, inputs, mesh, llama_hand_plan(cfg),
             warmup=3, iters=6 if quick else 100, after_hand=local_heads, hand_ctx=loss_parallel)


def llama_hand_plan(cfg: LlamaConfig) -> dict:
    """torch's tensor-parallel plan for `autopar.models.Llama`, as torchtitan writes it (no sequence parallelism)."""
    plan = {}
    for i in range(cfg.num_layers):
        plan.update({f"layers.{i}.attn.{n}": ColwiseParallel() for n in ("wq", "wk", "wv")})
        plan.update({f"layers.{i}.mlp.{n}": ColwiseParallel() for n in ("gate", "up")})
        plan[f"layers.{i}.attn.wo"] = RowwiseParallel()
        plan[f"layers.{i}.mlp.down"] = RowwiseParallel()
    # Megatron's vocabulary-parallel embedding, LM head and cross-entropy, as torchtitan writes them
    plan["embed"] = RowwiseParallel(input_layouts=Replicate())
    plan["output"] = ColwiseParallel(output_layouts=Shard(-1), use_local_output=False)
    return plan


def local_heads(hand) -> None:
    """The model's views use its global head counts; the hand plan needs the per-rank counts."""
    for layer in hand.layers:
        layer.attn.num_heads //= WORLD_SIZE
        layer.attn.num_kv_heads //= WORLD_SIZE


def run(quick: bool) -> None:
    mlp_stack(quick)
    llama(quick)


def main() -> None:
    launch(run, WORLD_SIZE, "--quick" in sys.argv)


if __name__ == "__main__":
    main()
