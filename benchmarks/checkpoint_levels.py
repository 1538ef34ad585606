"""Activation checkpointing levels, measured against the plan's own estimate (issue #11 item 7, first check, per
level): bytes kept for backward per rank after one forward, for dp, fsdp, tp, tp+sp, ulysses and ring on a Llama
and a GPT, at every level.

Measured (rank 0, simulated ranks under LocalTensorMode): unique storages autograd saved (saved_tensors_hooks)
plus what selective layers kept (their policy's cache), parameters excluded (`measure_saved_bytes` in
tests/test_checkpoint_levels.py). Predicted: the estimate's saved activations at level none
(`tests/memory_probe.py: predicted_saved_bytes`) plus what the plan's levels change
(`Estimate.checkpoint_saved_bytes`). Also the saving's ratio (predicted / measured bytes a level frees) and the
forward collectives issued again in backward (`record_comms` pass "recompute"). Goal: every ratio 0.9-1.1.

    python benchmarks/checkpoint_levels.py
"""

from __future__ import annotations

import copy
import os
import sys

import torch
import torch.distributed as dist
from torch.distributed._local_tensor import LocalTensorMode
from torch.distributed.device_mesh import init_device_mesh

for _p in (os.path.join(os.path.dirname(__file__), ".."), os.path.join(os.path.dirname(__file__), "..", "tests")):
    if _p not in sys.path:
        sys.path.insert(0, _p)

import autopar  # noqa: E402
from autopar.forms import checkpoint as ckpt  # noqa: E402
from autopar.models import GPT, GPTConfig, Llama, LlamaConfig  # noqa: E402
from autopar.runtime.collectives import record_comms  # noqa: E402
from test_checkpoint_levels import measure_saved_bytes  # noqa: E402
from memory_probe import predicted_saved_bytes  # noqa: E402

P, B, S = 2, 4, 64


PLANS = {  # name: (mesh axis, plan, overrides), as benchmarks/memory_fidelity.py
    "dp": ("dp", "dp", {}),
    "fsdp": ("dp", "fsdp", {}),
    "tp": ("tp", "megatron", {}),
    "tp+sp": ("tp", "megatron", {"norm": "sequence"}),
    "ulysses": ("sp", "dp", {"attention": "ulysses@sp"}),
    "ring": ("cp", "dp", {"attention": "ring@cp"}),
}
# expert parallelism's uneven all-to-alls need real ranks (not LocalTensorMode): its saved bytes at level none are in
# benchmarks/memory_fidelity.py (gloo), its levels' equivalence in tests/test_checkpoint_levels.py (gloo)


def predicted_saved(plan) -> float:
    """What the plan's estimate says one rank keeps for backward: every structure's saved activations (and FSDP's
    kept gathers) at level none, plus what the plan's checkpoint levels change (`Estimate.checkpoint_saved_bytes`)."""
    return predicted_saved_bytes(plan) + plan.estimate.checkpoint_saved_bytes


def main() -> None:
    dist.init_process_group("fake", rank=0, world_size=P)
    g = torch.Generator().manual_seed(0)
    inputs = (torch.randint(0, 128, (B, S), generator=g), torch.randint(0, 128, (B, S), generator=g))
    torch.manual_seed(0)
    models = {"llama": Llama(LlamaConfig(num_layers=4, hidden=64, ffn_hidden=128, seq_len=S, attention="sdpa")),
              "gpt": GPT(GPTConfig(num_layers=4, hidden=64, seq_len=S))}
    print(f"{P} simulated ranks, b={B} s={S}, fp32; bytes kept for backward per rank after one forward: measured, and "
          "predicted by the plan's own estimate")
    print(f"{'model':9} {'plan':8} {'level':10} {'measured':>10} {'predicted':>10} {'ratio':>6}  {'saving ratio':>12}  "
          "recomputed collectives")
    ratios = []
    for name, model in models.items():
        for plan_name, (axis, plan, overrides) in PLANS.items():
            measured, predicted = {}, {}
            for lv in ckpt.LEVELS:
                with LocalTensorMode(P):
                    mesh = init_device_mesh("cpu", (P,), mesh_dim_names=(axis,))
                    pm = autopar.parallelize(copy.deepcopy(model), mesh, inputs, plan=plan,
                                             overrides={**overrides, ckpt.KEY: lv})
                    with record_comms() as recs:
                        measured[lv] = measure_saved_bytes(pm, inputs)
                predicted[lv] = predicted_saved(pm.plan)
                again = sum(1 for r in recs if r.pass_ == "recompute")
                saving = measured[ckpt.NONE.name] - measured[lv]
                saving_ratio = f"{(predicted[ckpt.NONE.name] - predicted[lv]) / saving:.2f}" if saving else "-"
                ratio = predicted[lv] / measured[lv]
                ratios.append((f"{name}_{plan_name}_{lv}", ratio))
                print(f"{name:9} {plan_name:8} {lv:10} {measured[lv]:>10} {predicted[lv]:>10.0f} {ratio:>6.3f}  "
                      f"{saving_ratio:>12}  {again}", flush=True)
    dist.destroy_process_group()
    for label, r in ratios:
        print(f"RATIO memory_saved_level_{label} (predicted/measured): {r:.3f}")
    worst = min(ratios, key=lambda x: -abs(x[1] - 1.0))
    print(f"RESULT checkpoint levels saved bytes predicted/measured: {min(r for _, r in ratios):.3f}-"
          f"{max(r for _, r in ratios):.3f} over {len(ratios)} plan x level rows (worst {worst[0]}; goal 0.9-1.1)")


if __name__ == "__main__":
    main()
