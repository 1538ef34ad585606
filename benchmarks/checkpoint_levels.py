"""Activation checkpointing levels, measured: bytes kept for backward per rank after one forward, and what the
cost model predicts the levels save (`autopar.forms.checkpoint.price`, as the solver divides it).

Measured (rank 0, simulated ranks under LocalTensorMode): unique storages autograd saved (saved_tensors_hooks)
plus what selective layers kept (their policy's cache), parameters excluded (`measure_saved_bytes` in
tests/test_checkpoint_levels.py). Predicted saving of a level = sum over layers of (saved[none] - saved[level])
/ the ranks the tokens are split over (and the model axes). Also: the forward collectives issued again in
backward (`record_comms` pass "recompute") and the recompute count.

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
from autopar.layers import find_layers  # noqa: E402
from autopar.models import GPT, GPTConfig, Llama, LlamaConfig  # noqa: E402
from autopar.runtime.collectives import record_comms  # noqa: E402
from autopar.capture import capture  # noqa: E402
from test_checkpoint_levels import measure_saved_bytes  # noqa: E402

P, B, S = 2, 4, 64


def predicted_saving(model, inputs, split: int) -> dict[str, float]:
    cap = capture(model, inputs, {})
    layers = find_layers(cap.gm, set(cap.param_fqns) | set(cap.buffer_fqns))
    prices = [ckpt.price(cap.gm, la) for la in layers]
    return {lv: sum(p.saved[ckpt.NONE.name] - p.saved[lv] for p in prices) / split for lv in ckpt.LEVELS}


def main() -> None:
    dist.init_process_group("fake", rank=0, world_size=P)
    g = torch.Generator().manual_seed(0)
    inputs = (torch.randint(0, 128, (B, S), generator=g), torch.randint(0, 128, (B, S), generator=g))
    torch.manual_seed(0)
    models = {"llama": Llama(LlamaConfig(num_layers=4, hidden=64, ffn_hidden=128, seq_len=S, attention="sdpa")),
              "gpt": GPT(GPTConfig(num_layers=4, hidden=64, seq_len=S))}
    print(f"{P} simulated ranks, b={B} s={S}, fp32; bytes kept for backward per rank after one forward")
    print(f"{'model':6} {'plan':9} {'level':10} {'measured':>10} {'saving':>10} {'predicted':>10} {'ratio':>6}  "
          "recomputed collectives")
    for name, model in models.items():
        for plan, axis in (("dp", "dp"), ("megatron", "tp")):
            pred = predicted_saving(model, inputs, P)
            measured = {}
            for lv in ckpt.LEVELS:
                with LocalTensorMode(P):
                    mesh = init_device_mesh("cpu", (P,), mesh_dim_names=(axis,))
                    pm = autopar.parallelize(copy.deepcopy(model), mesh, inputs, plan=plan,
                                             overrides={ckpt.KEY: lv})
                    with record_comms() as recs:
                        measured[lv] = measure_saved_bytes(pm, inputs)
                again = sum(1 for r in recs if r.pass_ == "recompute")
                saving = measured[ckpt.NONE.name] - measured[lv]
                ratio = f"{pred[lv] / saving:.2f}" if saving else "-"
                print(f"{name:6} {plan:9} {lv:10} {measured[lv]:>10} {saving:>10} {pred[lv]:>10.0f} {ratio:>6}  "
                      f"{again}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
