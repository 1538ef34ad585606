"""Megatron inside the stages of a (pp=2, dp=2, tp=2) mesh against one device, 8 gloo ranks (issue #23): a manual
check, too slow for the test suite on 2 shared cores (the 8-rank pool's start alone is 50 s under load).

Runs `tests/test_pipeline_dtp._pp_dp_tp` on every rank (fp64, 1f1b, 2 microbatches per data rank, a 2-layer
Llama-style model of hidden 16 and sequence 8; one AdamW step) and asserts `check_pp_dp_tp` on the results: the
global loss on every rank, every parameter's gradient and every parameter after the step within 1e-10 of one
device, each stage's tp all-reduces, the gradient bucket over the dp sub-group, the loss sums, and the p2p per
microbatch exactly. Prints the pool's start and each job's wall time.

    python benchmarks/pp_dp_tp_gloo.py [--repeat N]
"""

from __future__ import annotations

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests"))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeat", type=int, default=1, help="jobs to run on the started pool (default 1)")
    args = ap.parse_args()
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    from dist_harness import gloo_pool
    from test_pipeline_dtp import check_pp_dp_tp
    t0 = time.perf_counter()
    pool = gloo_pool(8)
    pool.run("test_pipeline_dtp:_llama")  # the workers started and the test module imported
    print(f"8-rank gloo pool started in {time.perf_counter() - t0:.1f} s")
    for i in range(args.repeat):
        t = time.perf_counter()
        results = pool.run("test_pipeline_dtp:_pp_dp_tp")
        check_pp_dp_tp(results)
        worst = max(v for r in results for v in r["errs"].values())
        print(f"job {i}: {time.perf_counter() - t:.1f} s, checks passed; the largest error against one device "
              f"{worst:.2e} over {sum(len(r['errs']) for r in results)} checked values")
    print("RESULT pp_dp_tp ok")


if __name__ == "__main__":
    main()
