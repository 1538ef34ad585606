"""autopar's pipeline (pp2, `1f1b`, 4 microbatches) against the same model split by hand on torch's pipelining, 2 gloo
ranks (issue #23, deliverable 6), and the pipeline cost model against the measurement (deliverable 3).

The model: a Llama-style one (`autopar.models.Llama`, 4 layers, hidden 256, 8 heads, 4 KV heads, vocab 2048), 8 x 128
tokens global, AdamW. autopar: `autopar.parallelize(model, mesh, (tokens, labels), plan="dp",
overrides={"pipeline": "1f1b@pp"}, microbatches=4)` (the runtime cuts the captured graph into 2 stages of 2 layers).
By hand: two `nn.Module`s written for this model (the embedding and layers 0-1; layers 2-3, the final norm and the
head, each recomputing the rotary tables), each in a `torch.distributed.pipelining.PipelineStage`, run by
`Schedule1F1B` with 4 microbatches and a mean cross-entropy loss_fn (torch's default `scale_grads=True`: the mean
of the microbatch means, the global mean here: no label is ignored). Same weights; the losses of both are asserted
equal to the single-device loss before timing. Steps alternate between the two (`common.interleaved`: rounds in
alternating order, a barrier before each step); the headline is `RESULT pp/torch <ratio>`: the ratio of the slowest
rank's median wall-clock step times (goal <= 1.0), with its spread over blocks of rounds and in CPU time; then the
forward+backward and optimizer phases timed apart on each rank.

Fidelity (`--fidelity`, or the default run after the ratio): per pipeline rank, the measured step time against the
estimate's (`pm.plan.estimate.step_time_s`: the cost model's step for the runtime's cut; `cluster` from
`--cluster`, default the library's CPU preset) and the measured peak of live tensor storages in a step
(`tests/memory_probe.LiveStorages`) against the estimate's per-rank peak (`pm.plan.estimate.stages[r].peak_bytes`).
Printed as ratios, measured / predicted (target within +-10%).

    python benchmarks/pp_vs_torch.py [--quick] [--no-fidelity] [--cluster NAME]
"""

from __future__ import annotations

import copy
import os
import statistics
import sys
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import init_device_mesh

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests"))

import autopar
from autopar.models import Llama, LlamaConfig
from common import interleaved, launch, result

WORLD_SIZE = 2
BATCH, MICROBATCHES = 8, 4
CFG = LlamaConfig(vocab_size=2048, seq_len=128, num_layers=4, num_heads=8, num_kv_heads=4, hidden=256,
                  ffn_hidden=768)


def _rope(model: Llama, s: int, dtype, device):
    freqs = torch.outer(torch.arange(s, device=device).float(), model.inv_freq)
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos().to(dtype), emb.sin().to(dtype)


class First(nn.Module):
    """Stage 0 by hand: the embedding and the first half of the layers."""

    def __init__(self, model: Llama, upto: int):
        super().__init__()
        self.embed, self.layers = model.embed, nn.ModuleList(model.layers[:upto])
        self.register_buffer("inv_freq", model.inv_freq, persistent=False)

    def forward(self, tokens):
        x = self.embed(tokens)
        cos, sin = _rope(self, tokens.shape[1], x.dtype, x.device)
        for layer in self.layers:
            x, _ = layer(x, cos, sin)
        return x


class Last(nn.Module):
    """Stage 1 by hand: the other layers, the final norm and the head (the loss is the schedule's loss_fn)."""

    def __init__(self, model: Llama, upto: int):
        super().__init__()
        self.layers, self.norm, self.output = nn.ModuleList(model.layers[upto:]), model.norm, model.output
        self.register_buffer("inv_freq", model.inv_freq, persistent=False)

    def forward(self, x):
        cos, sin = _rope(self, x.shape[1], x.dtype, x.device)
        for layer in self.layers:
            x, _ = layer(x, cos, sin)
        return self.output(self.norm(x))


def _loss_fn(logits, labels):
    return F.cross_entropy(logits.flatten(0, 1), labels.flatten())


def run(quick: bool, fidelity: bool, cluster: str | None) -> None:
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = Llama(CFG)
    tokens = torch.randint(0, CFG.vocab_size, (BATCH, CFG.seq_len))
    labels = torch.roll(tokens, -1, dims=1)
    mesh = init_device_mesh("cpu", (WORLD_SIZE,), mesh_dim_names=("pp",))
    pm = autopar.parallelize(copy.deepcopy(model), mesh, (tokens, labels), plan="dp",
                             overrides={"pipeline": "1f1b@pp"}, microbatches=MICROBATCHES)
    cut = pm.plan.pipeline.cut
    hand_model = copy.deepcopy(model)
    mod = First(hand_model, cut[1]) if rank == 0 else Last(hand_model, cut[1])
    stage = PipelineStage(mod, rank, WORLD_SIZE, torch.device("cpu"))
    sched = Schedule1F1B(stage, MICROBATCHES, loss_fn=_loss_fn)

    def hand_forward_backward():
        if rank == 0:
            sched.step(tokens)
            out = torch.zeros(())
        else:
            losses = []
            sched.step(target=labels, losses=losses)
            out = torch.stack(losses).mean().detach()
        dist.all_reduce(out)  # the last stage's loss, on every rank
        return out

    with torch.no_grad():
        ref = float(model(tokens, labels))
    a = float(pm(tokens, labels).detach())  # a training step's loss (its gradients are dropped with it)
    b = float(hand_forward_backward())
    for p in mod.parameters():
        p.grad = None
    if rank == 0:
        print(f"llama pp2 1f1b x{MICROBATCHES} (hidden={CFG.hidden} layers={CFG.num_layers} seq={CFG.seq_len} "
              f"batch={BATCH} global, cut {list(cut)}): loss single-device {ref:.6f}  autopar {a:.6f}  "
              f"torch by hand {b:.6f}", flush=True)
    assert abs(a - ref) <= 1e-5 * max(1.0, abs(ref)) and abs(b - ref) <= 1e-5 * max(1.0, abs(ref)), (ref, a, b)

    opt_a = torch.optim.AdamW(pm.parameters(), lr=1e-4)
    opt_b = torch.optim.AdamW(mod.parameters(), lr=1e-4)
    phases: dict[str, list[tuple[float, float]]] = {"autopar": [], "torch": []}

    def step_a():
        t0 = time.perf_counter()
        loss = pm(tokens, labels)
        loss.backward()
        t1 = time.perf_counter()
        opt_a.step()
        opt_a.zero_grad(set_to_none=True)
        phases["autopar"].append((t1 - t0, time.perf_counter() - t1))

    def step_b():
        t0 = time.perf_counter()
        hand_forward_backward()
        t1 = time.perf_counter()
        opt_b.step()
        opt_b.zero_grad(set_to_none=True)
        phases["torch"].append((t1 - t0, time.perf_counter() - t1))

    t = interleaved({"autopar": step_a, "torch": step_b}, warmup=2 if quick else 3, rounds=6 if quick else 30,
                    budget_s=15 if quick else 40)
    if rank == 0:
        med = {n: statistics.median(v) for n, v in t.wall_s.items()}
        print(f"  autopar: median {med['autopar'] * 1e3:.1f} ms/step   torch by hand: median "
              f"{med['torch'] * 1e3:.1f} ms/step")
    result("pp/torch llama pp2 1f1b x4", t, "autopar", "torch")
    for name, ph in phases.items():
        fb = statistics.median(x[0] for x in ph) * 1e3
        op = statistics.median(x[1] for x in ph) * 1e3
        got = [torch.empty(2, dtype=torch.float64) for _ in range(WORLD_SIZE)]
        dist.all_gather(got, torch.tensor([fb, op], dtype=torch.float64))
        if rank == 0:
            print("  " + name + ": " + "; ".join(f"rank {r}: forward+backward {g[0]:.1f} ms, optimizer {g[1]:.1f} ms"
                                                  for r, g in enumerate(got)), flush=True)
    if fidelity:
        _fidelity(model, tokens, labels, mesh, t.rank_wall_s["autopar"], t.rank_cpu_s["autopar"], cluster)


def _fidelity(model, tokens, labels, mesh, walls, cpus, cluster) -> None:
    """Each pipeline rank's measured step and peak memory against the cost model's (the runtime's cut)."""
    from memory_probe import LiveStorages
    from autopar.pipeline_estimate import plan_pipeline
    rank = dist.get_rank()
    pm = autopar.parallelize(copy.deepcopy(model), mesh, (tokens, labels), plan="dp",
                             overrides={"pipeline": "1f1b@pp"}, microbatches=MICROBATCHES)
    est = pm.plan if cluster is None else plan_pipeline(
        model, {"pp": WORLD_SIZE}, (tokens, labels), pipeline="1f1b@pp", microbatches=MICROBATCHES, plan="dp",
        cluster=cluster, cut=pm.plan.pipeline.cut)
    opt = torch.optim.AdamW(pm.parameters(), lr=1e-4)
    for _ in range(2):  # the optimizer state exists, as in the timed steps
        pm(tokens, labels).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    def local(t):
        return t.to_local() if hasattr(t, "to_local") else t
    existing = [local(p) for p in pm.parameters()] + [tokens, labels] + \
        [local(v) for st in opt.state.values() for v in st.values() if isinstance(v, torch.Tensor)]
    with LiveStorages([t for t in existing if t.numel()]) as live:
        pm(tokens, labels).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    peak = torch.tensor([float(live.peak)], dtype=torch.float64)
    peaks = [torch.empty_like(peak) for _ in range(WORLD_SIZE)]
    dist.all_gather(peaks, peak)
    if rank == 0:
        e = est.estimate
        print(f"fidelity (cluster {e.cluster}): measured / predicted, per pipeline rank", flush=True)
        for r, s in enumerate(e.stages):
            step, cpu = statistics.median(walls[r]), statistics.median(cpus[r])
            print(f"  {s.key}: step {step * 1e3:.1f} ms / {e.step_time_s * 1e3:.1f} ms = {step / e.step_time_s:.2f} "
                  f"(CPU time {cpu * 1e3:.1f} ms: {cpu / e.step_time_s:.2f})   peak memory "
                  f"{float(peaks[r]) / 2**20:.2f} MiB / {s.peak_bytes / 2**20:.2f} MiB = "
                  f"{float(peaks[r]) / s.peak_bytes:.2f} (predicted: parameters {s.parameters_bytes / 2**20:.2f}, "
                  f"gradients {s.gradients_bytes / 2**20:.2f}, optimizer {s.optimizer_bytes / 2**20:.2f}, "
                  f"activations {s.activations_bytes / 2**20:.2f} MiB x {s.in_flight:g} in flight)", flush=True)
        slow = statistics.median(max(w) for w in zip(*walls))
        print(f"RESULT pp fidelity step {slow / e.step_time_s:.2f} (measured slowest rank / predicted; load average "
              f"{os.getloadavg()[0]:.1f} on {os.cpu_count()} cores)", flush=True)


if __name__ == "__main__":
    quick = "--quick" in sys.argv
    cluster = sys.argv[sys.argv.index("--cluster") + 1] if "--cluster" in sys.argv else None
    launch(run, WORLD_SIZE, quick, "--no-fidelity" not in sys.argv, cluster)
