"""Activation checkpointing levels, measured against the plan's own estimate (issue #11 item 7, first check, per
level): bytes kept for backward per rank after one forward, for dp, fsdp, tp, tp+sp, ulysses and ring on a Llama
and a GPT, and expert parallelism on the Llama with MoE MLPs, at every level.

Measured (rank 0, simulated ranks under LocalTensorMode; EP on gloo processes, whose uneven all-to-alls need real
ranks): unique storages autograd saved (saved_tensors_hooks)
plus what selective layers kept (their policy's cache), parameters excluded (`measure_saved_bytes` in
tests/test_checkpoint_levels.py). Predicted: the estimate's saved activations at level none
(`tests/memory_probe.py: predicted_saved_bytes`) plus what the plan's levels change
(`Estimate.checkpoint_saved_bytes`). Also the saving's ratio (predicted / measured bytes a level frees) and the
forward collectives issued again in backward (`record_comms` pass "recompute"). Goal: every ratio 0.9-1.1.

    python benchmarks/checkpoint_levels.py [--quick: the Llama and EP rows] [--only=PLAN: one plan's rows]
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
# expert parallelism's uneven all-to-alls need real ranks (not LocalTensorMode): its rows run on P gloo processes
GLOO = {"ep": ("ep", "dp", {"moe": "expert@ep"})}


def _models():
    torch.manual_seed(0)
    return {"llama": Llama(LlamaConfig(num_layers=4, hidden=64, ffn_hidden=128, seq_len=S, attention="sdpa")),
            "gpt": GPT(GPTConfig(num_layers=4, hidden=64, seq_len=S))}


def _moe():
    """The Llama above with a grouped top-2 MoE of 4 experts for its MLPs."""
    torch.manual_seed(0)
    return Llama(LlamaConfig(num_layers=4, hidden=64, ffn_hidden=128, seq_len=S, attention="sdpa", moe_experts=4,
                             moe_top_k=2, moe_style="grouped"))


def _inputs():
    g = torch.Generator().manual_seed(0)
    return torch.randint(0, 128, (B, S), generator=g), torch.randint(0, 128, (B, S), generator=g)


def _gloo_rows(out_path: str, plans: list) -> None:
    """On every gloo rank: each of `plans` (GLOO's) at every level, rank 0's measured and predicted bytes (and the
    recomputed collectives) written to `out_path`."""
    import json
    rows = []
    for plan_name in plans:
        axis, plan, overrides = GLOO[plan_name]
        for lv in ckpt.LEVELS:
            mesh = init_device_mesh("cpu", (P,), mesh_dim_names=(axis,))
            inputs = _inputs()
            pm = autopar.parallelize(_moe(), mesh, inputs, plan=plan, overrides={**overrides, ckpt.KEY: lv})
            with record_comms() as recs:
                measured = measure_saved_bytes(pm, inputs)
            rows.append(("llama-moe", plan_name, lv, measured, predicted_saved(pm.plan),
                         sum(1 for r in recs if r.pass_ == "recompute")))
    if dist.get_rank() == 0:
        with open(out_path, "w") as f:
            json.dump(rows, f)


def predicted_saved(plan) -> float:
    """What the plan's estimate says one rank keeps for backward: every structure's saved activations (and FSDP's
    kept gathers) at level none, plus what the plan's checkpoint levels change (`Estimate.checkpoint_saved_bytes`)."""
    return predicted_saved_bytes(plan) + plan.estimate.checkpoint_saved_bytes


def main() -> None:
    import json
    import tempfile
    from common import launch
    quick = "--quick" in sys.argv  # the Llama only (the GPT's rows are the Llama's cases without RoPE, bias-free
    only = next((a.split("=", 1)[1] for a in sys.argv if a.startswith("--only=")), None)  # linears, GQA)
    dist.init_process_group("fake", rank=0, world_size=P)
    inputs = _inputs()
    models = {k: m for k, m in _models().items() if not quick or k == "llama"}
    print(f"{P} simulated ranks (ep: {P} gloo ranks), b={B} s={S}, fp32; bytes kept for backward per rank after "
          "one forward: measured, and predicted by the plan's own estimate")
    print(f"{'model':9} {'plan':8} {'level':10} {'measured':>10} {'predicted':>10} {'ratio':>6}  {'saving ratio':>12}  "
          "recomputed collectives")
    rows = []
    for name, model in models.items():
        for plan_name, (axis, plan, overrides) in PLANS.items():
            if only is not None and only != plan_name:
                continue
            for lv in ckpt.LEVELS:
                with LocalTensorMode(P):
                    mesh = init_device_mesh("cpu", (P,), mesh_dim_names=(axis,))
                    pm = autopar.parallelize(copy.deepcopy(model), mesh, inputs, plan=plan,
                                             overrides={**overrides, ckpt.KEY: lv})
                    with record_comms() as recs:
                        measured = measure_saved_bytes(pm, inputs)
                rows.append((name, plan_name, lv, measured, predicted_saved(pm.plan),
                             sum(1 for r in recs if r.pass_ == "recompute")))
                _print(rows)
    dist.destroy_process_group()
    with tempfile.TemporaryDirectory() as d:
        out = os.path.join(d, "rows.json")
        launch(_gloo_rows, P, out, [p for p in GLOO if only in (None, p)])
        with open(out) as f:
            for row in json.load(f):
                rows.append(tuple(row))
                _print(rows)
    ratios = [(f"{m}_{p}_{lv}", pred / meas) for m, p, lv, meas, pred, _ in rows]
    for label, r in ratios:
        print(f"RATIO memory_saved_level_{label} (predicted/measured): {r:.3f}")
    worst = min(ratios, key=lambda x: -abs(x[1] - 1.0))
    print(f"RESULT checkpoint levels saved bytes predicted/measured: {min(r for _, r in ratios):.3f}-"
          f"{max(r for _, r in ratios):.3f} over {len(ratios)} plan x level rows (worst {worst[0]}; goal 0.9-1.1)")


def _print(rows) -> None:
    """The last row, with its saving's ratio against its plan's level none (the row of its plan before it)."""
    name, plan_name, lv, measured, predicted, again = rows[-1]
    base = next(r for r in rows if r[:2] == (name, plan_name) and r[2] == ckpt.NONE.name)
    saving = base[3] - measured
    saving_ratio = f"{(base[4] - predicted) / saving:.2f}" if saving else "-"
    print(f"{name:9} {plan_name:8} {lv:10} {measured:>10} {predicted:>10.0f} {predicted / measured:>6.3f}  "
          f"{saving_ratio:>12}  {again}", flush=True)


if __name__ == "__main__":
    main()
