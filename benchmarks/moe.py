"""Expert parallelism, measured.

1. Bytes per all-to-all (4 gloo ranks, fp32, ep = 4): a 2-layer Llama whose MLPs are 8-expert top-2
   MoE blocks, 512 tokens per rank, one training step. The token all-to-alls (dispatch and combine,
   forward and backward) are counted where they are issued, against DESIGN.md §3's
   `k*T*h*(ep-1)/ep` per all-to-all (uniform routing; the measured figure follows this batch's routing).
2. Per-rank share of the expert parameters, stacked spellings (GroupedExperts) and ModuleList.
3. Cost model, Mixtral-8x7B-shaped layers on 8 H100s (seq 4096, batch 8, bf16): experts replicated
   (data parallel), expert parallel, tensor-parallel experts (every expert's FFN split, Megatron
   plan), expert parallel on replicated tokens, and `plan="auto"`: step time and memory per device.

    python benchmarks/moe.py
"""

from __future__ import annotations

import copy
import math
import os
import sys

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
for _p in (ROOT, HERE):
    if _p not in sys.path:
        sys.path.insert(0, _p)

from common import launch  # noqa: E402

EP, B, S, H, FFN, E, K, L = 4, 8, 256, 64, 128, 8, 2, 2


def _model(style: str):
    from autopar.models import Llama, LlamaConfig

    torch.manual_seed(0)
    return Llama(LlamaConfig(vocab_size=256, seq_len=S, num_layers=L, num_heads=4, num_kv_heads=2, hidden=H,
                             ffn_hidden=FFN, moe_experts=E, moe_top_k=K, moe_style=style))


def _worker(out_path: str) -> None:
    import json

    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    import autopar
    from autopar.runtime.collectives import record_comms
    from autopar.forms.expert import layer_volume_bytes

    rank = dist.get_rank()
    g = torch.Generator().manual_seed(0)
    x = torch.randint(0, 256, (B * EP // 2, S), generator=g), torch.randint(0, 256, (B * EP // 2, S), generator=g)
    result = {}
    for style in ("grouped", "modulelist"):
        model = _model(style)
        mesh = init_device_mesh("cpu", (EP,), mesh_dim_names=("ep",))
        pm = autopar.parallelize(copy.deepcopy(model), mesh, x, plan="dp", overrides={"moe": "expert@ep"})
        with record_comms() as recs:
            pm(*x).backward()
        tokens_local = x[0].numel() // EP
        token_a2a = [r for r in recs if r.kind == "all_to_all" and r.numel % H == 0 and r.numel >= H]
        measured = sum(r.send_bytes for r in token_a2a)
        formula = L * layer_volume_bytes(tokens_local, K, H, EP, 4)
        expert_local = sum(p.to_local().numel() for n, p in pm.named_parameters() if ".experts." in n)
        expert_full = sum(p.numel() for n, p in model.named_parameters() if ".experts." in n)
        sums = torch.tensor([measured, formula], dtype=torch.float64)
        dist.all_reduce(sums)
        result[style] = dict(a2a_count=len(token_a2a), measured=sums[0].item() / EP, formula=sums[1].item() / EP,
                             share=expert_local / expert_full)
    if rank == 0:
        with open(out_path, "w") as f:
            json.dump(result, f)


def cost_model_scenario() -> None:
    import autopar
    from transformers import MixtralConfig, MixtralForCausalLM

    cfg = MixtralConfig(vocab_size=32000, hidden_size=4096, intermediate_size=14336, num_hidden_layers=4,
                        num_attention_heads=32, num_key_value_heads=8, num_local_experts=8, num_experts_per_tok=2,
                        max_position_embeddings=4096, use_cache=False)
    with torch.device("meta"):
        model = MixtralForCausalLM(cfg).to(torch.bfloat16)
    ids = torch.zeros(8, 4096, dtype=torch.long, device="meta")
    inputs = {"input_ids": ids, "labels": ids}
    rows = {}
    for label, mesh, plan, ov in (
            ("experts replicated (dp)", {"dp": 8}, "dp", None),
            ("expert parallel (dp + expert@dp)", {"dp": 8}, "dp", {"moe": "expert@dp"}),
            ("tensor-parallel experts (megatron + tp@tp)", {"tp": 8}, "megatron", {"moe": "tp@tp"}),
            ("EP on replicated tokens (megatron + expert@tp)", {"tp": 8}, "megatron", {"moe": "expert@tp"}),
            ("auto", {"dp": 8}, "auto", None)):
        p = autopar.plan(model, mesh, inputs, plan=plan, overrides=ov, cluster="h100", memory_limit=80e9)
        rows[label] = p.estimate
        moe = sorted({f"{s.form}@{s.axis}" if s.axis else s.form for s in p.strategies if s.kind == "moe"})
        layer = dict((k_, t) for k_, t, _ in p.estimate.per_site)["model.layers.0.mlp.experts"]
        print(f"  {label:46s} {p.estimate.step_time_s * 1e3:7.1f} ms/step  {layer * 1e3:6.2f} ms/MoE layer  "
              f"{p.estimate.memory_bytes_per_device / 2**30:6.1f} GiB/device  fits {p.estimate.fits}  moe: {', '.join(moe)}")
    ep, rep = rows["expert parallel (dp + expert@dp)"], rows["experts replicated (dp)"]
    tp, auto = rows["tensor-parallel experts (megatron + tp@tp)"], rows["auto"]
    print(f"RATIO moe_ep_vs_replicated step time = {ep.step_time_s / rep.step_time_s:.3f}, memory = "
          f"{ep.memory_bytes_per_device / rep.memory_bytes_per_device:.3f} (cost model, 8 x H100)")
    print(f"RATIO moe_ep_vs_tp_experts step time = {ep.step_time_s / tp.step_time_s:.3f}, memory = "
          f"{ep.memory_bytes_per_device / tp.memory_bytes_per_device:.3f} (cost model, 8 x H100)")
    best = min(r.step_time_s for k_, r in rows.items() if k_ != "auto")
    print(f"RATIO moe_auto_vs_best_hand = {auto.step_time_s / best:.3f}")


def main() -> None:
    import json
    import tempfile

    print(f"1-2. gloo, {EP} ranks, {L} MoE layers, {E} experts top-{K}, h={H}, {B * EP // 2 * S // EP} tokens per rank")
    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "out.json")
        launch(_worker, EP, path)
        with open(path) as f:
            res = json.load(f)
    for style, r in res.items():
        print(f"  {style:10s}: {r['a2a_count']} token all-to-alls, {r['measured'] / 2**10:.1f} KiB sent per rank, "
              f"formula {r['formula'] / 2**10:.1f} KiB; expert parameters per rank {r['share']:.3f} of all")
        print(f"RATIO moe_a2a_bytes {style} measured/formula = {r['measured'] / r['formula']:.3f} "
              f"(uniform-routing formula; routing of this batch)")
        print(f"RATIO moe_expert_param_share {style} = {r['share']:.3f} (1/ep = {1 / EP:.3f})")
    print("3. cost model, Mixtral-8x7B-shaped (4 layers), 8 x H100, 8 x 4096 tokens, bf16")
    cost_model_scenario()


if __name__ == "__main__":
    main()
