"""`autopar.tune` on 4 gloo ranks, a 2 x 2 mesh (dp, tp), a GPT where the plans differ (2 layers, hidden 256,
vocab 4096, 8 x 64 tokens, AdamW).

1. Tune (the ILP's 5 best distinct plans and the hand plans megatron, dp, fsdp; interleaved rounds) and print the
   table (predicted before and after calibration, measured, peak memory per rank).
2. Measure again, in fresh interleaved rounds, the tuned plan against the best measured hand plan:
   `RATIO tune_vs_best_hand = tuned / best hand` (goal <= 1.02).
3. Calibration on held-aside candidates: fit the calibration on every other measured candidate and predict the
   rest; `RATIO tune_calibrated_median_error` (goal <= 0.10), with the uncalibrated error beside it.

The cache and calibration go to a temporary XDG_CACHE_HOME (this machine's own are left alone).

    python benchmarks/tune.py [--quick]
"""

from __future__ import annotations

import os
import statistics
import sys
import tempfile

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

WORLD_SIZE = 4


def run(quick: bool, cache_dir: str) -> None:
    os.environ["XDG_CACHE_HOME"] = cache_dir
    import autopar
    from autopar.models import GPT, GPTConfig
    from autopar.tune import apply_calibration, fit_calibration, _lower
    from common import interleaved, report, train_step

    rank = dist.get_rank()
    cfg = GPTConfig(vocab_size=4096, seq_len=64, num_layers=2, num_heads=8, hidden=256)
    torch.manual_seed(0)
    model = GPT(cfg)
    tokens = torch.randint(0, cfg.vocab_size, (8, cfg.seq_len))
    inputs = (tokens, tokens.roll(-1, dims=1))
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    steps = 4 if quick else 10
    result = autopar.tune(model, mesh, inputs, top_k=5, steps=steps, warmup=2, cache=False, progress=rank == 0)
    if rank == 0:
        print(result.table(), flush=True)
    if rank == 0 and os.environ.get("TUNE_DUMP"):
        import json
        with open(os.environ["TUNE_DUMP"], "w") as f:
            json.dump([c.to_dict() for c in result.candidates], f)
    measured = [c for c in result.candidates if c.measured_s is not None]
    hands = [c for c in measured if any(h in c.name.split("=") for h in ("megatron", "dp", "fsdp"))]
    best_hand = min(hands, key=lambda c: c.measured_s)
    tuned = result.fastest
    # fresh rounds: the tuned plan against the best hand plan (one pm each, the same optimizer)
    pms = {}
    for name, plan in (("tuned", tuned.plan), ("best hand", best_hand.plan)):
        pm = _lower(model, mesh, inputs, plan, f"bench-{name}")
        pms[name] = (pm, torch.optim.AdamW(pm.parameters(), lr=1e-4))
    t = interleaved({n: (lambda pm=pm, opt=opt: train_step(pm, opt, inputs)) for n, (pm, opt) in pms.items()},
                    warmup=2, iters=6 if quick else 24)
    # held aside: fit on every other measured candidate, predict the others
    fit_on, held = measured[0::2], measured[1::2]
    cal = fit_calibration([(dict(c.components), c.measured_s) for c in fit_on], tuple(mesh.shape), of="cpu")
    err = lambda p, m: abs(p - m) / m  # noqa: E731
    calibrated = [err(apply_calibration(dict(c.components), cal), c.measured_s) for c in held]
    before = [err(c.predicted_s, c.measured_s) for c in held]
    if rank == 0:
        print(f"tuned plan: {tuned.name} ({tuned.forms}); best hand plan: {best_hand.name} ({best_hand.forms})")
        report("tune_vs_best_hand", t, "tuned", "best hand")
        print(f"held aside ({', '.join(c.name for c in held)}; fitted on {', '.join(c.name for c in fit_on)}): "
              f"relative errors calibrated {', '.join(f'{e:.1%}' for e in calibrated)}; uncalibrated "
              f"{', '.join(f'{e:.1%}' for e in before)}")
        print(f"RATIO tune_calibrated_median_error = {statistics.median(calibrated):.3f} (uncalibrated "
              f"{statistics.median(before):.3f}; {len(held)} held-aside candidates, {len(fit_on)} fitted)",
              flush=True)


def main() -> None:
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from common import launch
    with tempfile.TemporaryDirectory() as d:
        launch(run, WORLD_SIZE, "--quick" in sys.argv, d)


if __name__ == "__main__":
    main()
