"""The pipeline step against the cost model's, per schedule (issue #23, deliverable 3: "each stage's peak and the step
against the prediction, within +-10%"), 2 gloo ranks (one core each), pp2.

For each of `1f1b`, `gpipe`, `interleaved-1f1b` and `zbv` (two stages per rank for the last two), 4 microbatches:
`autopar.parallelize(model, mesh, (tokens, labels), plan="dp", overrides={"pipeline": f"{form}@pp"},
microbatches=4)`, the model and batch of benchmarks/pp_vs_torch.py (a Llama of 4 layers, hidden 256, vocab 2048,
8 x 128 tokens, AdamW). All schedules' training steps (forward, backward, optimizer) alternate round-robin
(`common.interleaved`, a barrier before each); the slowest rank's median step is set against
`pm.plan.estimate.step_time_s` (the runtime's cut priced by `autopar.pipeline_estimate`; `--cluster NAME` a profile
from `python -m autopar profile`, default the library's CPU preset, as `pm.plan` uses). Prints per schedule the
measured and predicted step, the ratio, the predicted bubble, and the `RESULT pp step <form>` lines.

    python benchmarks/pp_step_fidelity.py [--quick] [--cluster NAME]
"""

from __future__ import annotations

import copy
import os
import statistics
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
for _p in (ROOT, HERE, os.path.join(ROOT, "tests")):
    if _p not in sys.path:
        sys.path.insert(0, _p)

from common import interleaved, launch  # noqa: E402

FORMS = ("1f1b", "gpipe", "interleaved-1f1b", "zbv")
WORLD_SIZE, BATCH, MICROBATCHES = 2, 8, 4


def run(quick: bool, cluster: str | None) -> None:
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    import autopar
    from autopar.models import Llama
    from autopar.pipeline_estimate import plan_pipeline
    from pp_vs_torch import CFG

    torch.manual_seed(0)
    model = Llama(CFG)
    g = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, CFG.vocab_size, (BATCH, CFG.seq_len), generator=g)
    labels = torch.roll(tokens, -1, dims=1)
    mesh = init_device_mesh("cpu", (WORLD_SIZE,), mesh_dim_names=("pp",))
    steps, plans = {}, {}
    for form in FORMS:
        pm = autopar.parallelize(copy.deepcopy(model), mesh, (tokens, labels), plan="dp",
                                 overrides={"pipeline": f"{form}@pp"}, microbatches=MICROBATCHES)
        opt = torch.optim.AdamW(pm.parameters(), lr=1e-4)
        plans[form] = pm.plan if cluster is None else plan_pipeline(
            model, {"pp": WORLD_SIZE}, (tokens, labels), pipeline=f"{form}@pp", microbatches=MICROBATCHES,
            plan="dp", cluster=cluster, cut=pm.plan.pipeline.cut)

        def step(pm=pm, opt=opt):
            pm(tokens, labels).backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
        steps[form] = step
    t = interleaved(steps, warmup=2, rounds=6 if quick else 20, budget_s=30 if quick else 120)
    if dist.get_rank() != 0:
        return
    # where a gap comes from: one microbatch's forward + backward of the whole model, eager on this process alone,
    # against the stages' priced compute summed (what the pipeline composes), and AdamW on the model's parameters
    import time
    mb = BATCH // MICROBATCHES
    eager, opt_t = [], []
    ref = copy.deepcopy(model)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-4)
    for _ in range(6):
        t0 = time.perf_counter()
        ref(tokens[:mb], labels[:mb]).backward()
        t1 = time.perf_counter()
        ref_opt.step()
        ref_opt.zero_grad(set_to_none=True)
        eager.append(t1 - t0)
        opt_t.append(time.perf_counter() - t1)
    e1 = plans["1f1b"].estimate
    compute_pred = sum(s.compute_s + s.exposed_s for s in e1.stages)
    opt_pred = sum(s.optimizer_s for s in e1.stages)
    e0 = plans[FORMS[0]].estimate
    print(f"pipeline step, pp{WORLD_SIZE} gloo (one core per rank), llama {CFG.num_layers} layers h={CFG.hidden} "
          f"vocab={CFG.vocab_size}, {BATCH} x {CFG.seq_len} tokens, {MICROBATCHES} microbatches, fp32, AdamW; "
          f"cluster {e0.cluster}; load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores")
    print(f"{'form':17s} {'measured':>9s} {'predicted':>9s} {'ratio':>6s} {'cpu ratio':>9s} {'bubble':>8s}")
    for form in FORMS:
        e = plans[form].estimate
        wall, cpu = statistics.median(t.wall_s[form]), statistics.median(t.cpu_s[form])
        print(f"{form:17s} {wall * 1e3:7.1f}ms {e.step_time_s * 1e3:7.1f}ms {wall / e.step_time_s:6.2f} "
              f"{cpu / e.step_time_s:9.2f} {e.bubble_s * 1e3:6.1f}ms")
    print(f"one microbatch's forward + backward, whole model, eager on one rank: {statistics.median(eager[2:]) * 1e3:.1f}"
          f" ms; the 1f1b stages' priced compute summed {compute_pred * 1e3:.1f} ms "
          f"(measured / predicted {statistics.median(eager[2:]) / compute_pred:.2f}); AdamW on every parameter "
          f"{statistics.median(opt_t[2:]) * 1e3:.1f} ms, priced {opt_pred * 1e3:.1f} ms over the ranks")
    for form in FORMS:
        e = plans[form].estimate
        print(f"RESULT pp step {form} {statistics.median(t.wall_s[form]) / e.step_time_s:.3f} (measured slowest rank "
              f"/ predicted, wall; CPU time {statistics.median(t.cpu_s[form]) / e.step_time_s:.3f})", flush=True)


if __name__ == "__main__":
    launch(run, WORLD_SIZE, "--quick" in sys.argv,
           sys.argv[sys.argv.index("--cluster") + 1] if "--cluster" in sys.argv else None)
