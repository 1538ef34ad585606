"""Megatron inside the stages of a (pp=2, dp=2, tp=2) mesh against one device, 8 gloo ranks (issue #23): a manual
check, too slow for the test suite on 2 shared cores (the 8-rank pool's start alone is 50 s under load).

Case `megatron`: runs `tests/test_pipeline_dtp._pp_dp_tp` on every rank (fp64, 1f1b, 2 microbatches per data rank, a 2-layer
Llama-style model of hidden 16 and sequence 8; one AdamW step) and asserts `check_pp_dp_tp` on the results: the
global loss on every rank, every parameter's gradient and every parameter after the step within 1e-10 of one
device, each stage's tp all-reduces, the gradient bucket over the dp sub-group, the loss sums, and the p2p per
microbatch exactly. Cases `sp`, `sp-gpipe`, `sp-zbv`: the same with Megatron sequence parallelism in every stage
(`"norm": "sequence"`, `tests/test_pipeline_dtp_sp._pp_dp_tp_sp`, asserted by `check_pp_dp_tp_sp`) under 1f1b, gpipe
and zbv (4 layers: two one-layer stages per pipeline rank): the boundary crossing as each tp rank's sequence shard,
SP's all-gathers and reduce-scatters per microbatch exactly (zbv's weight-step re-issues included). Prints the
pool's start and each job's wall time.

    python benchmarks/pp_dp_tp_gloo.py [--case megatron|sp|sp-gpipe|sp-zbv|all] [--repeat N]
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
    ap.add_argument("--case", choices=("megatron", "sp", "sp-gpipe", "sp-zbv", "all"), default="all",
                    help="megatron's replicated boundaries, sequence parallelism under 1f1b, gpipe or zbv, or all "
                         "(default)")
    args = ap.parse_args()
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    from dist_harness import gloo_pool
    from test_pipeline_dtp import check_pp_dp_tp
    from test_pipeline_dtp_sp import FORMS, check_pp_dp_tp_sp
    cases = {"megatron": ("test_pipeline_dtp:_pp_dp_tp", (), check_pp_dp_tp),
             **{"sp" if form == "1f1b" else f"sp-{form}":
                ("test_pipeline_dtp_sp:_pp_dp_tp_sp", (form,), lambda res, f=form: check_pp_dp_tp_sp(res, f))
                for form in FORMS}}
    chosen = list(cases) if args.case == "all" else [args.case]
    t0 = time.perf_counter()
    pool = gloo_pool(8)
    pool.run("test_pipeline_dtp:_llama")  # the workers started and the test module imported
    print(f"8-rank gloo pool started in {time.perf_counter() - t0:.1f} s")
    for case in chosen:
        job, job_args, check = cases[case]
        for i in range(args.repeat):
            t = time.perf_counter()
            results = pool.run(job, *job_args)
            check(results)
            worst = max(v for r in results for v in r["errs"].values())
            print(f"{case} job {i}: {time.perf_counter() - t:.1f} s, checks passed; the largest error against one "
                  f"device {worst:.2e} over {sum(len(r['errs']) for r in results)} checked values")
        print(f"RESULT pp_dp_tp {case} ok")


if __name__ == "__main__":
    main()
