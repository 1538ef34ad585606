"""Mirror images on 4 gloo ranks, a 2 x 2 mesh (dp, tp), the GPT of `benchmarks/tune.py` (issue #12: tune measured
megatron at ~310 ms and its "mirror" at 410-490 ms).

1. Plain all-reduce on the mesh's groups, interleaved: dp ({0,2},{1,3}) against tp ({0,1},{2,3}), 4 KiB to 2 MiB.
2. Four plans interleaved: megatron (batch over dp, heads over tp), its mirror image (`autopar.tune.mirror`: batch
   over tp, heads over dp), `auto` on the CPU preset (megatron + ZeRO-3 FSDP on dp) and its mirror image (heads over
   dp, FSDP on tp: the plan tune called auto#3). Each mirror issues the same collectives as its original on the
   other axis (`tests/test_tune_mirror.py`).

`RESULT mirror/megatron` and `RESULT mirror/auto` (goal: 1 within the spread: a mirror runs alike), then
`RESULT auto(fsdp)/megatron` (what the gap tune saw is: ZeRO-3 on the data axis, not the axis swap), each in wall
time and in CPU time (what a busy machine disturbs least).

    python benchmarks/mirror.py [--quick]
"""

from __future__ import annotations

import os
import statistics
import sys
import time

import torch
import torch.distributed as dist

WORLD_SIZE = 4
SWAP = {"dp": "tp", "tp": "dp"}


def _all_reduce_groups(mesh, rounds: int) -> None:
    groups = {axis: mesh.get_group(axis) for axis in ("dp", "tp")}
    for nbytes in (4096, 256 * 1024, 2 << 20):
        t = torch.ones(nbytes // 4)
        times = {axis: [] for axis in groups}
        for i in range(rounds + 3):
            for axis in (("dp", "tp") if i % 2 else ("tp", "dp")):
                dist.barrier()
                t0 = time.perf_counter()
                dist.all_reduce(t, group=groups[axis])
                if i >= 3:
                    times[axis].append(time.perf_counter() - t0)
        med = {}
        for axis, v in times.items():
            v = torch.tensor(v)
            dist.all_reduce(v, op=dist.ReduceOp.MAX)  # an all-reduce takes as long as its slowest rank
            med[axis] = statistics.median(v.tolist())
        if dist.get_rank() == 0:
            print(f"all_reduce {nbytes:>8} B: dp {{0,2}},{{1,3}} {med['dp'] * 1e6:.0f} us, tp {{0,1}},{{2,3}} "
                  f"{med['tp'] * 1e6:.0f} us, dp/tp {med['dp'] / med['tp']:.3f}", flush=True)


def run(quick: bool) -> None:
    import autopar
    from autopar.tune import _lower, mirror
    from common import interleaved, result, train_step, tune_gpt_2x2

    rank = dist.get_rank()
    model, inputs, mesh = tune_gpt_2x2()
    _all_reduce_groups(mesh, 20 if quick else 60)
    megatron = autopar.plan(model, mesh, inputs, plan="megatron")
    auto = autopar.plan(model, mesh, inputs, cluster="cpu")
    plans = {"megatron": megatron, "mirror(megatron)": mirror(megatron, SWAP),
             "auto": auto, "mirror(auto)": mirror(auto, SWAP)}
    if rank == 0:
        for name, plan in plans.items():
            gathers = sorted({d.axis for d in plan.directives if d.kind.value == "gather"})
            print(f"{name}: batch {dict(plan.inputs)['tokens']}, "
                  f"{', '.join(sorted({s.label for s in plan.strategies if s.axes}))}; FSDP gathers on {gathers}")
    steps = {}
    for name, plan in plans.items():
        pm = _lower(model, mesh, inputs, plan, f"mirror-{name}")
        opt = torch.optim.AdamW(pm.parameters(), lr=1e-4)
        steps[name] = lambda pm=pm, opt=opt: train_step(pm, opt, inputs)
    t = interleaved(steps, warmup=2, rounds=20 if quick else 60, budget_s=150.0 if quick else 600.0)
    if rank == 0:
        for name in steps:
            print(f"{name}: median {statistics.median(t.wall_s[name]) * 1e3:.1f} ms/step wall, "
                  f"{statistics.median(t.cpu_s[name]) * 1e3:.1f} ms CPU")
        result("mirror/megatron", t, "mirror(megatron)", "megatron")
        result("mirror/auto", t, "mirror(auto)", "auto")
        result("auto(fsdp)/megatron", t, "auto", "megatron")


def main() -> None:
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from common import launch
    launch(run, WORLD_SIZE, "--quick" in sys.argv)


if __name__ == "__main__":
    main()
