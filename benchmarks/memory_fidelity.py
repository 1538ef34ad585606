"""Memory, predicted vs measured, per rank, on real gloo ranks (issue #11 item 7, first two checks).

(a) Saved activations: what autograd saves for backward during one training step of the rewritten program,
    measured as the unique storages `saved_tensors_hooks` see (parameters excluded), against the estimate's
    activations plus FSDP's gathered parameters (`Plan.estimate.sites`: the saved-tensor model per structure,
    `autopar.estimate.attribute_saved`). Goal: every ratio within 0.9-1.1.
(b) Peak memory of a training step (forward, backward, optimizer step) on CPU: allocator statistics are not
    available there, so the peak of live tensor storages is tracked by a TorchDispatchMode
    (`tests/memory_probe.py: LiveStorages`), starting from the parameters, the optimizer state (after one warm-up
    step) and the inputs; against `Plan.estimate.memory_bytes_per_device` (parameters, gradients, optimizer state,
    saved activations, FSDP's gathered parameters, the largest momentary buffer). Goal: within +-15%.

Plans: dp, fsdp, megatron (TP), TP+SP (megatron with sequence norms), ulysses, ring, and expert parallelism
(MoE Llama), on a GPT and a Llama-style model (fp32, Adam), 2 gloo ranks.

(c) `--pipeline`: each pipeline stage's peak (the same probe) against `Plan.estimate.stages[r].peak_bytes`, pp2
    under 1F1B, GPipe, interleaved 1F1B and ZB-V (2 stages per rank), dp inside the stages, and 1F1B with fsdp
    inside the stages of a (pp2, dp2) mesh (4 ranks; rank = global rank, dp-major), 4 microbatches, a 4-layer
    Llama. Goal: within +-10%.

    python benchmarks/memory_fidelity.py [--quick] [--pipeline]
"""

from __future__ import annotations

import json
import os
import sys
import tempfile

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
for _p in (ROOT, HERE, os.path.join(ROOT, "tests")):
    if _p not in sys.path:
        sys.path.insert(0, _p)

from common import launch  # noqa: E402

W = 2
B, S, V, H, L = 8, 128, 512, 64, 2
# name -> (mesh axis, hand plan, overrides)
PLANS = {
    "dp": ("dp", "dp", None),
    "fsdp": ("dp", "fsdp", None),
    "tp": ("tp", "megatron", None),
    "tp+sp": ("tp", "megatron", {"norm": "sequence"}),
    "ulysses": ("sp", "dp", {"attention": "ulysses@sp"}),
    "ring": ("cp", "dp", {"attention": "ring@cp"}),
    "ep": ("ep", "dp", {"moe": "expert@ep"}),
}
# gpt-wide: few tokens, wide layers, so that the gradients at the end of backward outweigh the activations at its
# start (the other end of the peak)
CASES = [(m, p) for m in ("gpt", "llama") for p in PLANS if p != "ep"] + [("llama-moe", "ep")] + \
    [("gpt-wide", p) for p in ("dp", "fsdp", "tp")]


def model(name: str):
    from autopar.models import GPT, GPTConfig, Llama, LlamaConfig

    torch.manual_seed(0)
    if name == "gpt":
        return GPT(GPTConfig(vocab_size=V, seq_len=S, num_layers=L, num_heads=4, hidden=H))
    if name == "gpt-wide":
        return GPT(GPTConfig(vocab_size=V, seq_len=S, num_layers=L, num_heads=4, hidden=8 * H))
    if name == "llama-pp":
        return Llama(LlamaConfig(vocab_size=V, seq_len=S // 2, num_layers=4, num_heads=4, num_kv_heads=2,
                                 hidden=2 * H, ffn_hidden=4 * H))
    moe = dict(moe_experts=4, moe_top_k=2, moe_style="grouped") if name == "llama-moe" else {}
    return Llama(LlamaConfig(vocab_size=V, seq_len=S, num_layers=L, num_heads=4, num_kv_heads=2, hidden=H,
                             ffn_hidden=2 * H, attention="sdpa", **moe))


def inputs(batch: int = B):
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, V, (batch, S), generator=g)
    return ids, torch.roll(ids, -1, dims=1)


def measure(model_name: str, plan_name: str) -> dict:
    """On every rank: one warm-up step (the optimizer's state exists), then a measured step."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    import autopar
    from memory_probe import measured_step, predicted_saved_bytes

    axis, plan, overrides = PLANS[plan_name]
    mesh = init_device_mesh("cpu", (W,), mesh_dim_names=(axis,))
    x = inputs(2 if model_name == "gpt-wide" else B)
    pm = autopar.parallelize(model(model_name), mesh, x, plan=plan, overrides=overrides)
    saved, live = measured_step(pm, x, torch.optim.Adam(pm.parameters(), lr=1e-3))
    est = pm.plan.estimate
    return dict(rank=dist.get_rank(), saved=saved.bytes, saved_est=predicted_saved_bytes(pm.plan), peak=live.peak,
                peak_est=est.memory_bytes_per_device, base=live.base, at_peak=live.at_peak)


def pipeline_measure(form: str, microbatches: int = 4, dp: int = 1, plan: str = "dp") -> dict:
    """On every rank of a (pp=2[, dp]) mesh: one warm-up step, then the peak of a measured one against the
    stage's (`pm.plan.estimate.stages[pp coordinate]`)."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    import autopar
    from memory_probe import LiveStorages, local, optimizer_tensors

    x = inputs(B)
    x = (x[0][:, : S // 2], x[1][:, : S // 2])
    mesh = init_device_mesh("cpu", (W, dp), mesh_dim_names=("pp", "dp")) if dp > 1 else \
        init_device_mesh("cpu", (W,), mesh_dim_names=("pp",))
    pm = autopar.parallelize(model("llama-pp"), mesh, x, plan=plan, overrides={"pipeline": f"{form}@pp"},
                             microbatches=microbatches)
    opt = torch.optim.Adam(pm.parameters(), lr=1e-3)
    pm(*x).backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    existing = [local(p) for p in pm.parameters()] + optimizer_tensors(opt) + list(x)
    with LiveStorages([t for t in existing if t.numel()]) as live:
        pm(*x).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    s = pm.plan.estimate.stages[dist.get_rank() // dp]
    return dict(form=form if plan == "dp" else f"{form}+{plan}", rank=dist.get_rank(), peak=live.peak, base=live.base, at_peak=live.at_peak,
                peak_est=s.peak_bytes, params_est=s.parameters_bytes, grads_est=s.gradients_bytes,
                opt_est=s.optimizer_bytes, act_est=s.activations_bytes, in_flight=s.in_flight)


def _pipeline_worker(out_path: str, cases: list, dp: int) -> None:
    import torch.distributed as dist

    rows = [pipeline_measure(f, dp=dp, plan=plan) for f, plan in cases]
    got = [None] * dist.get_world_size()
    dist.all_gather_object(got, rows)
    if dist.get_rank() == 0:
        with open(out_path, "w") as f:
            json.dump([r for form_rows in zip(*got) for r in form_rows], f)


# (schedule, stage plan, data-parallel degree): pp2 alone, then fsdp inside the stages of a (pp2, dp2) mesh
PIPELINE_CASES = [("1f1b", "dp", 1), ("gpipe", "dp", 1), ("interleaved-1f1b", "dp", 1), ("zbv", "dp", 1),
                  ("1f1b", "fsdp", 2)]


def pipeline_main() -> None:
    rows = []
    for dp in sorted({c[2] for c in PIPELINE_CASES}):
        with tempfile.TemporaryDirectory() as d:
            out = os.path.join(d, "rows.json")
            launch(_pipeline_worker, W * dp, out, [(f, pl) for f, pl, n in PIPELINE_CASES if n == dp], dp)
            with open(out) as f:
                rows += [r for r in json.load(f) if r["rank"] % dp == 0]  # one data rank per stage (alike)
    forms = list(dict.fromkeys(r["form"] for r in rows))
    mib = 2**20
    print(f"pipeline stage peak memory, pp{W} gloo, llama 4 layers h={2 * H} b={B} s={S // 2} vocab={V}, 4 microbatches,"
          f" fp32, Adam")
    print(f"{'form':16s} {'rank':>4s} {'measured':>10s} {'predicted':>10s} {'ratio':>6s}   predicted parts (MiB): "
          f"params grads optimizer activations x in flight")
    for r in sorted(rows, key=lambda r: (forms.index(r["form"]), r["rank"])):
        print(f"{r['form']:16s} {r['rank']:4d} {r['peak'] / mib:8.3f}Mi {r['peak_est'] / mib:8.3f}Mi "
              f"{r['peak'] / r['peak_est']:6.3f}   {r['params_est'] / mib:.3f} {r['grads_est'] / mib:.3f} "
              f"{r['opt_est'] / mib:.3f} {r['act_est'] / mib:.3f} x {r['in_flight']:g}")
    for r in rows:
        print(f"RATIO memory_peak_pp_{r['form']}_rank{r['rank']} (measured/predicted): {r['peak'] / r['peak_est']:.3f}")


def _worker(out_path: str, cases: list) -> None:
    import torch.distributed as dist

    rows = [measure(m, p) for m, p in cases]
    if dist.get_rank() == 0:
        with open(out_path, "w") as f:
            json.dump(rows, f)


def main() -> None:
    if "--pipeline" in sys.argv:
        return pipeline_main()
    quick = "--quick" in sys.argv
    only = next((a.split("=", 1)[1] for a in sys.argv if a.startswith("--only=")), None)
    cases = [c for c in CASES if (not quick or c[0] != "llama" or c[1] in ("tp+sp", "ring"))
             and (only is None or only in (c[0], c[1], f"{c[0]}:{c[1]}"))]
    with tempfile.TemporaryDirectory() as d:
        out = os.path.join(d, "rows.json")
        launch(_worker, W, out, cases)
        with open(out) as f:
            rows = json.load(f)
    mib = 2**20
    print(f"memory per rank (rank 0), {W} gloo ranks, b={B} s={S} h={H} layers={L} vocab={V}, fp32, Adam")
    print(f"{'model':10s} {'plan':8s} {'saved meas':>11s} {'saved est':>10s} {'ratio':>6s}   "
          f"{'peak meas':>10s} {'peak est':>9s} {'ratio':>6s}")
    for (m, p), r in zip(cases, rows):
        print(f"{m:10s} {p:8s} {r['saved'] / mib:9.3f}Mi {r['saved_est'] / mib:8.3f}Mi {r['saved_est'] / r['saved']:6.3f}"
              f"   {r['peak'] / mib:8.3f}Mi {r['peak_est'] / mib:7.3f}Mi {r['peak_est'] / r['peak']:6.3f}")
    if "--verbose" in sys.argv:
        for (m, p), r in zip(cases, rows):
            print(f"{m} {p}: base {r['base']}, peak after {r['at_peak']}")
    for (m, p), r in zip(cases, rows):
        print(f"RATIO memory_saved_{m}_{p} (predicted/measured): {r['saved_est'] / r['saved']:.3f}")
    for (m, p), r in zip(cases, rows):
        print(f"RATIO memory_peak_{m}_{p} (predicted/measured): {r['peak_est'] / r['peak']:.3f}")


if __name__ == "__main__":
    main()
