"""Each pipeline stage's peak memory, measured on 2 gloo ranks, against the cost model's (issue #23, deliverable 3):
`pm.plan.estimate.stages[r].peak_bytes` within +-10% of the peak of live tensor storages in a training step
(`memory_probe.LiveStorages`: parameters, Adam state, inputs, and every storage an op returns until freed), for
1F1B and GPipe on pp2 (the model and the case are benchmarks/memory_fidelity.py --pipeline's, which prints the table).

And the stage parameters are the pipeline's own: an optimizer step on the pipelined module leaves the user's model as
it was (they are not views of its storage).
"""

from __future__ import annotations

import pytest
import torch

from dist_harness import gloo_pool


def _stage_peaks(forms: tuple[str, ...]) -> list[dict]:
    from benchmarks.memory_fidelity import pipeline_measure
    return [pipeline_measure(f) for f in forms]


def _user_model_untouched() -> bool:
    from torch.distributed.device_mesh import init_device_mesh

    import autopar
    from benchmarks.memory_fidelity import inputs, model

    m = model("llama-pp")
    before = {k: v.detach().clone() for k, v in m.state_dict().items()}
    x = inputs(4)
    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("pp",))
    pm = autopar.parallelize(m, mesh, x, plan="dp", overrides={"pipeline": "1f1b@pp"}, microbatches=2)
    ptrs = {p.untyped_storage().data_ptr() for p in m.parameters()}
    shared = [n for n, p in pm.named_parameters()
              if (p.to_local() if hasattr(p, "to_local") else p).untyped_storage().data_ptr() in ptrs]
    opt = torch.optim.SGD(pm.parameters(), lr=0.5)
    pm(*x).backward()
    opt.step()
    changed = [k for k, v in m.state_dict().items() if not torch.equal(v, before[k])]
    assert not shared and not changed, f"stage parameters share the user's storage: {shared}; changed: {changed}"
    return True


def test_stage_peak_memory_within_10_percent():
    rows = gloo_pool(2).run(_stage_peaks, ("1f1b", "gpipe"))
    for rank_rows in rows:
        for r in rank_rows:
            ratio = r["peak"] / r["peak_est"]
            assert 0.9 <= ratio <= 1.1, (f"{r['form']} rank {r['rank']}: measured {r['peak']} B, predicted "
                                         f"{r['peak_est']} B, ratio {ratio:.3f}; at the peak: {r['at_peak']}")
    # the accumulated gradients are priced: without them 1F1B's peak is under-predicted by 20-26%
    one = [rank_rows[0] for rank_rows in rows]
    assert all(r["peak_est"] > r["grads_est"] + r["base"] for r in one)


def test_optimizer_step_on_the_pipeline_leaves_the_user_model():
    assert gloo_pool(2).run(_user_model_untouched) == [True, True]
