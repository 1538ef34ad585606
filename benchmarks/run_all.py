"""Run every benchmark (each in a fresh process) and print their RATIO lines together at the end.

    python benchmarks/run_all.py [--quick]        # or: make bench
"""

from __future__ import annotations

import os
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
BENCHMARKS = ("tp_vs_parallelize_module.py", "tp_overlap.py", "dp_vs_ddp.py", "fsdp_vs_fsdp2.py", "overhead.py", "planning.py",
              "plan_quality.py", "long_context.py", "sequence_forms.py", "checkpoint_levels.py", "moe.py", "cost_fidelity.py",
              "published_runs.py", "tune.py", "memory_fidelity.py")
GOALS = {"tp_vs_hand_plan": "<= 1.0", "tp_overlap": "<= 1.0", "dp_vs_ddp": "<= 1.0", "fsdp_vs_fsdp2": "<= 1.0", "overhead": "<= 1.05",
         "planning_* fits": "yes, auto/best hand <= 1.0, planned <= 10 s (8B) / 30 s (70B)",
         "plan_quality": "<= 1.0", "long_context": "<= 1.0",
         "sequence bytes": "1.00", "moe_ep_vs_replicated": "< 1.0", "moe_expert_param_share": "1/ep", "cost_fidelity_spearman": ">= 0.9", "cost_fidelity_median_rel_error": "<= 0.25",
         "published_* (throughput)": "0.75-1.25", "published_mem_*": "0.80-1.20",
         "published_fsdp_8_to_128_scaling": "within 10 points of -2.7%", "tune_vs_best_hand": "<= 1.02",
         "tune_calibrated_median_error": "<= 0.10", "memory_saved_*": "0.9-1.1", "memory_peak_*": "0.85-1.15"}


def main() -> None:
    ratios = []
    for script in BENCHMARKS:
        print(f"== {script}", flush=True)
        t0 = time.perf_counter()
        proc = subprocess.Popen([sys.executable, os.path.join(HERE, script), *sys.argv[1:]],
                                stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        for line in proc.stdout:
            print(line, end="", flush=True)
            if line.startswith("RATIO "):
                ratios.append(line.strip())
        if proc.wait() != 0:
            sys.exit(f"{script} failed with exit code {proc.returncode}")
        print(f"   ({time.perf_counter() - t0:.0f} s)")
    print("\n== summary (goals: " + ", ".join(f"{k} {v}" for k, v in GOALS.items()) + ")")
    for line in ratios:
        print(line)


if __name__ == "__main__":
    main()
