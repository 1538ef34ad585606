"""autopar's "fsdp" plan against torch's FSDP2 (`fully_shard` per block and on the root), on 2 gloo ranks.

The same model (a Llama-style one, then a GPT: 4 layers, hidden 512, 8 x 256 tokens global, AdamW; then the torch.nn
census's three models of issue #22, `common.census_model`: the nn.RMSNorm Llama, the Conv2d + GroupNorm ConvNet (FSDP2
wraps each stage) and the nn.LSTM language model (FSDP2 wraps the nn.LSTM)), parallelised twice:
by `autopar.parallelize(..., plan="fsdp", inputs="local")` (per-layer gathers, the next one prefetched, resharded
after forward and gathered again in backward, one reduce-scatter per layer) and by `fully_shard` on every block and
then on the model, each rank passing its shard of the global batch. Training steps alternate between the two in one
run; the ratio autopar/FSDP2 of the median step times is printed (goal <= 1.0), after a check that both give the
same loss, ending with one headline line `RESULT fsdp/FSDP2 <model> <ratio> (...)` (the spread over 5 blocks of
consecutive rounds, and CPU time beside). `--keep` adds autopar with every layer kept gathered (`autopar.forms.fsdp.keep_gathered`); `--profile`
prints a torch.profiler table of a few steps of each on rank 0.

    python benchmarks/fsdp_vs_fsdp2.py [--quick] [--keep] [--profile] [--only llama|gpt|nn_llama|convnet|lstm|census]
"""

from __future__ import annotations

import copy
import sys

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

import autopar
from autopar.forms import fsdp as fsdp_form
from autopar.models import GPT, GPTConfig, Llama, LlamaConfig
from common import CENSUS_MODELS, census_model, interleaved, launch, profile_steps, report, result, train_step

WORLD_SIZE = 2
BATCH = 8  # sequences per step, global


def run(quick: bool, keep: bool, profile: bool, only: str | None) -> None:
    cfg = LlamaConfig(vocab_size=2048, seq_len=256, num_layers=4, num_heads=8, num_kv_heads=4, hidden=512,
                      ffn_hidden=1536)
    torch.manual_seed(0)  # same model and data on every rank
    if only in (None, "llama"):
        _compare("llama", Llama(cfg), lambda m: m.layers, _tokens(cfg), _shape(cfg), quick, keep, profile)
    cfg = GPTConfig(vocab_size=2048, seq_len=256, num_layers=4, num_heads=8, hidden=512, dropout=0.0)
    torch.manual_seed(0)
    if only in (None, "gpt"):
        _compare("gpt", GPT(cfg), lambda m: m.h, _tokens(cfg), _shape(cfg), quick, keep, profile)
    for name in CENSUS_MODELS:  # the torch.nn census's models (issue #22): same model and data on every rank
        if only in (None, "census", name):
            model, batch, blocks, shape = census_model(name, BATCH)
            _compare(name, model, blocks, batch, shape, quick, keep, profile)


def _tokens(cfg) -> tuple:
    tokens = torch.randint(0, cfg.vocab_size, (BATCH, cfg.seq_len))
    return tokens, torch.roll(tokens, -1, dims=1)


def _shape(cfg) -> str:
    return f"hidden={cfg.hidden} layers={cfg.num_layers} seq={cfg.seq_len} batch={BATCH} global"


def _compare(name: str, model, blocks, batch: tuple, shape: str, quick: bool, keep: bool, profile: bool) -> None:
    rank = dist.get_rank()
    local = tuple(t.chunk(WORLD_SIZE)[rank] for t in batch)
    mesh = init_device_mesh("cpu", (WORLD_SIZE,), mesh_dim_names=("dp",))
    pm = autopar.parallelize(copy.deepcopy(model), mesh, local, plan="fsdp", inputs="local")
    fsdp2 = copy.deepcopy(model)
    for block in blocks(fsdp2):
        fully_shard(block, mesh=mesh)
    fully_shard(fsdp2, mesh=mesh)
    with torch.no_grad():
        ref = model(*batch).item()
        a = pm(*local).item()
        b = fsdp2(*local)
        fsdp2.reshard()  # a root left unsharded by a no-grad forward would train on stale weights
        dist.all_reduce(b)  # FSDP2's loss is the local shard's: average over ranks for the global loss
        b = b.item() / WORLD_SIZE
    if rank == 0:
        print(f"{name} ({shape}): loss single-device {ref:.6f}  autopar {a:.6f}  FSDP2 {b:.6f}")
    assert abs(a - ref) <= 1e-4 * max(1.0, abs(ref)) and abs(b - ref) <= 1e-4 * max(1.0, abs(ref)), (ref, a, b)
    steps, losses = {}, {}
    opt_a = torch.optim.AdamW(pm.parameters(), lr=1e-4)
    steps["autopar"] = lambda: losses.__setitem__("autopar", train_step(pm, opt_a, local))
    opt_b = torch.optim.AdamW(fsdp2.parameters(), lr=1e-4)

    def fsdp2_step():
        loss = train_step(fsdp2, opt_b, local)
        dist.all_reduce(loss)
        losses["FSDP2"] = loss / WORLD_SIZE

    steps["FSDP2"] = fsdp2_step
    if keep:
        plan = fsdp_form.keep_gathered(pm.plan)
        pk = autopar.parallelize(copy.deepcopy(model), mesh, local, plan=plan, inputs="local")
        opt_k = torch.optim.AdamW(pk.parameters(), lr=1e-4)
        steps["autopar_keep"] = lambda: losses.__setitem__("autopar_keep", train_step(pk, opt_k, local))
    if profile:
        profile_steps({"autopar": lambda: train_step(pm, opt_a, local),
                       "FSDP2": lambda: train_step(fsdp2, opt_b, local)})
    times = interleaved(steps, warmup=3, rounds=10 if quick else 100, budget_s=40.0 if quick else 120.0)
    if rank == 0:
        n = 3 + len(times.wall_s["autopar"])
        print(f"  after {n} training steps: " + "  ".join(f"loss {k} {v.item():.6f}" for k, v in losses.items()))
        for label, a in (("", "autopar"), (", keep gathered", "autopar_keep")) if keep else (("", "autopar"),):
            report(f"fsdp_vs_fsdp2[{name}{label}]", times, a, "FSDP2")
            result(f"fsdp/FSDP2 {name}{label}", times, a, "FSDP2")
    assert abs(losses["autopar"].item() - losses["FSDP2"].item()) <= 1e-3 * max(1.0, abs(losses["FSDP2"].item())), \
        losses


def main() -> None:
    launch(run, WORLD_SIZE, "--quick" in sys.argv, "--keep" in sys.argv, "--profile" in sys.argv,
           sys.argv[sys.argv.index("--only") + 1] if "--only" in sys.argv else None)


if __name__ == "__main__":
    main()
