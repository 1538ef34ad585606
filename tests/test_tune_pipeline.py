"""`autopar.tune` measures pipeline candidates (issue #23, deliverable 4), 2 gloo ranks, a tiny Llama: a
(pipeline override, microbatches) pair is priced offline, built as `parallelize` builds it, timed in the same rounds
as the other candidates and named in the report; left out of the calibration fit. A bad pair is a clear error."""

from __future__ import annotations

import pytest
import torch

from dist_harness import gloo_pool


def _tune_with_pipeline():
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    import autopar
    from autopar.models import Llama, LlamaConfig

    torch.manual_seed(0)
    model = Llama(LlamaConfig(num_layers=2, num_heads=4, num_kv_heads=2))
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, LlamaConfig().vocab_size, (4, 16), generator=g)
    x = (ids, torch.roll(ids, -1, 1))
    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("pp",))
    with pytest.raises(ValueError, match="axis"):
        autopar.tune(model, mesh, x, pipelines=(("1f1b@tp", 2),), cache=False, progress=False)
    with pytest.raises(ValueError, match="pairs"):
        autopar.tune(model, mesh, x, pipelines=(("1f1b@pp",),), cache=False, progress=False)
    res = autopar.tune(model, mesh, x, top_k=1, steps=1, warmup=0, cache=False, calibrate=False, progress=False,
                       pipelines=(("1f1b@pp", 2),))
    pp = [c for c in res.candidates if c.plan.pipeline is not None]
    assert [c.name for c in pp] == ["pipeline 1f1b@pp m=2"], [c.name for c in res.candidates]
    c = pp[0]
    assert not c.skipped, c.skipped
    assert c.plan.pipeline.form == "1f1b" and c.plan.pipeline.microbatches == 2
    assert c.measured_s is not None and c.measured_s > 0 and len(c.step_times_s) >= 1
    assert c.predicted_s == c.plan.estimate.step_time_s > 0
    assert len(c.peak_bytes) == dist.get_world_size() and all(b > 0 for b in c.peak_bytes)
    assert "pipeline 1f1b@pp m=2" in res.table()
    assert any(o.measured_s is not None for o in res.candidates if o.plan.pipeline is None)  # timed alongside
    return c.measured_s


def test_tune_measures_a_pipeline_candidate():
    times = gloo_pool(2).run(_tune_with_pipeline)
    assert times[0] == times[1]  # the slowest rank's time, agreed
