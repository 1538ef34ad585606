"""Pipelines on models no other pipeline test uses (issue #23), against one device in fp64: Hugging Face zoo families
(tests/zoo.py) and torch.nn census networks (tests/nn_census.py) under `1f1b@pp` with plan='dp' on pp2 (2 gloo
ranks), and the zoo families under pp2 x tp2 megatron with `norm: sequence` (4 gloo ranks). Prints the table
model x mesh x result: "exact" with the worst error (loss, every gradient, every parameter after one AdamW step)
within the family's tolerance, or the error raised. Jobs: `tests/test_pipeline_foreign.py`.

    python benchmarks/pp_foreign.py [--zoo qwen2,opt] [--census transformer_encoder,vit,rmsnorm_llama] [--no-tp]
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
    ap.add_argument("--zoo", default="qwen2,opt", help="zoo families (tests/zoo.py FAMILIES), comma-separated")
    ap.add_argument("--census", default="transformer_encoder,vit,rmsnorm_llama",
                    help="census rows (tests/nn_census.py CENSUS), comma-separated")
    ap.add_argument("--no-tp", action="store_true", help="skip the pp2 x tp2 sequence-parallel rows")
    args = ap.parse_args()
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    from dist_harness import gloo_pool
    from test_pipeline_foreign import summarise
    zoo = [n for n in args.zoo.split(",") if n]
    census = [n for n in args.census.split(",") if n]
    table = []
    t = time.perf_counter()
    pool = gloo_pool(2)
    if zoo:
        table += [(n, "pp2 1f1b dp", r) for n, r in summarise(pool.run("test_pipeline_foreign:_pp_dp", "zoo", zoo)).items()]
    if census:
        table += [(n, "pp2 1f1b dp", r)
                  for n, r in summarise(pool.run("test_pipeline_foreign:_pp_dp", "census", census)).items()]
    print(f"pp2 rows: {time.perf_counter() - t:.1f} s")
    if zoo and not args.no_tp:
        t = time.perf_counter()
        table += [(n, "pp2 x tp2 megatron norm=sequence", r)
                  for n, r in summarise(gloo_pool(4).run("test_pipeline_foreign:_pp_tp_sp", zoo)).items()]
        print(f"pp2 x tp2 rows: {time.perf_counter() - t:.1f} s")
    print(f"{'model':<22} {'mesh':<34} result")
    for name, mesh, r in table:
        if r[0] == "raised" or isinstance(r[1], str):
            text = " ".join(map(str, r))
        else:
            text = f"{r[0]} (tol {r[2]:.0e}): " + ", ".join(f"{k} {e:.1e}" for k, (e, _) in r[1].items()) + \
                f" [worst param: {r[1]['param'][1].split(' ', 1)[1]}]"
        print(f"{name:<22} {mesh:<34} {text}")
    wrong = [(n, m) for n, m, r in table if r[0] == "WRONG"]
    print("RESULT pp_foreign", "ok" if not wrong else f"WRONG {wrong}")


if __name__ == "__main__":
    main()
