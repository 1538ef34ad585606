"""`autopar.tune` on 4 gloo ranks, a 2 x 2 mesh (dp, tp), a GPT where the plans differ (2 layers, hidden 256,
vocab 4096, 8 x 64 tokens, AdamW).

0. Profile the mesh (`autopar.profile`), the cluster tune prices with and calibrates.
1. Tune (the ILP's 5 best distinct plans and the hand plans megatron, dp, fsdp; interleaved rounds) and print the
   table (predicted before and after calibration, measured, peak memory per rank).
2. Measure again, in fresh interleaved rounds, the tuned plan against the best measured hand plan:
   `RESULT tuned/best hand <ratio> (...)` (goal <= 1.02).
3. Calibration on held-aside candidates, two folds: fit the calibration on every other measured candidate and
   predict the rest, then the other way round; `RESULT tune calibrated median error` is the median relative error
   of the held-aside predictions (goal <= 0.10), with the uncalibrated error beside it.

Within tune's own measurement the tuned plan cannot be slower than a hand plan (the hand plans are candidates and
the fastest wins); step 2 measures both again in fresh rounds, so the ratio shows whether the choice holds.

The cache and calibration go to a temporary XDG_CACHE_HOME (this machine's own are left alone).

    python benchmarks/tune.py [--quick]      # TUNE_DUMP=path.json: also write the candidates (to refit offline)
"""

from __future__ import annotations

import os
import statistics
import sys
import tempfile
import time

import torch
import torch.distributed as dist

WORLD_SIZE = 4


def run(quick: bool, cache_dir: str) -> None:
    import faulthandler
    import signal
    faulthandler.register(signal.SIGUSR1)  # `kill -USR1 <pid>`: where a rank waits, if it ever hangs
    os.environ["XDG_CACHE_HOME"] = cache_dir
    import autopar
    from autopar.tune import apply_calibration, fit_calibration, _lower
    from common import interleaved, report, result as result_line, train_step, tune_gpt_2x2

    rank = dist.get_rank()
    model, inputs, mesh = tune_gpt_2x2()
    steps = 4 if quick else 10
    profile = os.path.join(cache_dir, "profile-2x2.json")
    t0 = time.perf_counter()
    autopar.profile(mesh, profile, progress=False)  # the cluster as measured; its calibration is saved beside it
    if rank == 0:
        print(f"profiled the 2 x 2 mesh in {time.perf_counter() - t0:.0f} s", flush=True)
    result = autopar.tune(model, mesh, inputs, top_k=5, steps=steps, warmup=2, cache=False, progress=rank == 0,
                          cluster=profile)
    if rank == 0:
        print(result.table(), flush=True)
    if rank == 0 and os.environ.get("TUNE_DUMP"):
        import json
        with open(os.environ["TUNE_DUMP"], "w") as f:
            json.dump([c.to_dict() for c in result.candidates], f)
        with open(profile) as src, open(os.environ["TUNE_DUMP"] + ".profile.json", "w") as dst:
            dst.write(src.read())  # the cluster the candidates were priced on (to refit offline)
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
                    warmup=2, rounds=10 if quick else 30, budget_s=60.0 if quick else 180.0)
    # held aside, two folds: fit on every other measured candidate, predict the rest, then the other way round
    err = lambda p, m: abs(p - m) / m  # noqa: E731
    calibrated, before, held_names = [], [], []
    for fold in (0, 1):
        fit_on, held = measured[fold::2], measured[1 - fold::2]
        cal = fit_calibration([(dict(c.components), c.measured_s) for c in fit_on], tuple(mesh.shape),
                              of=result.calibration.of)
        calibrated += [err(apply_calibration(dict(c.components), cal), c.measured_s) for c in held]
        before += [err(c.predicted_s, c.measured_s) for c in held]
        held_names += [c.name for c in held]
    if rank == 0:
        print(f"tuned plan: {tuned.name} ({tuned.forms}); best hand plan: {best_hand.name} ({best_hand.forms})")
        if tuned is best_hand:  # the ratio below times one plan against itself: this machine's noise floor
            print("the tuned plan is the best hand plan: tuned/best hand is 1 by identity, the measured ratio is noise")
        report("tune_vs_best_hand", t, "tuned", "best hand")
        result_line("tuned/best hand", t, "tuned", "best hand")
        print("held aside (each fitted on the other half): " + ", ".join(
            f"{n} {c:.1%} (uncalibrated {b:.1%})" for n, c, b in zip(held_names, calibrated, before)))
        print(f"RATIO tune_calibrated_median_error = {statistics.median(calibrated):.3f} (uncalibrated "
              f"{statistics.median(before):.3f}; {len(held_names)} candidates, each held aside once: two folds)",
              flush=True)
        print(f"RESULT tune calibrated median error {statistics.median(calibrated):.3f} (held aside, two folds: "
              f"{min(calibrated):.3f}-{max(calibrated):.3f} over {len(held_names)} candidates; uncalibrated "
              f"{statistics.median(before):.3f})", flush=True)


def main() -> None:
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from common import launch
    with tempfile.TemporaryDirectory() as d:
        launch(run, WORLD_SIZE, "--quick" in sys.argv, d)


if __name__ == "__main__":
    main()
