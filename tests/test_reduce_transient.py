"""What the end of the backward holds besides the gradients, priced in the step's peak (`autopar.estimate.peak_bytes`):

- FSDP: reducing a group's gradients holds its unsharded gradients and their flat copy (2x the group), and, when
  another layer is gathered again in backward, that layer's prefetched re-gather and its copy-in ((3 + 1/dp)x):
  `autopar.forms.fsdp.reduce_transient_bytes`;
- data parallel: a bucket's flat copy (1x the bucket; the all-reduce is in place), the same whether the flat buffer
  comes from the runtime's CPU pool or is fresh (the probe counts a pooled buffer while it is in use).

Checked on the estimate (LocalTensorMode-free, no ranks) and against the peak of live storages of a training step on
2 gloo ranks (`tests/memory_probe.py`), on a GPT with few tokens and wide layers, so that the end of the backward is
the peak."""

from __future__ import annotations

import pytest
import torch
from torch.distributed.device_mesh import init_device_mesh

import autopar
from autopar.api import _prepare
from autopar.estimate import gather_stats, mesh_costing
from autopar.forms import fsdp as fsdp_form
from autopar.models import GPT, GPTConfig
from cost_model import hardware as H
from dist_harness import gloo_pool
from autopar.runtime import collectives as C
from memory_probe import LiveStorages, measured_step

V, S, HID, B = 128, 32, 256, 2


def _model(layers: int) -> GPT:
    torch.manual_seed(0)
    return GPT(GPTConfig(vocab_size=V, seq_len=S, num_layers=layers, num_heads=4, hidden=HID))


def _inputs():
    ids = torch.randint(0, V, (B, S), generator=torch.Generator().manual_seed(0))
    return ids, torch.roll(ids, -1, dims=1)


def _layer_bytes(model: GPT) -> int:
    return sum(p.numel() * p.element_size() for p in model.h[0].parameters())


def _peak_without_transients(e) -> float:
    held = sum(s.parameters_bytes + s.optimizer_bytes + s.transient_bytes for s in e.sites)
    return held + max(sum(s.activations_bytes for s in e.sites) + max(s.momentary_bytes for s in e.sites),
                      sum(s.gradients_bytes for s in e.sites))


@pytest.mark.parametrize("layers, times", [(1, 2.0), (2, 3.5)])
def test_fsdp_reduce_transient_counts_the_regathered_groups(layers, times):
    """One layer: its gradients and their flat copy (2x); several: also the layer before's re-gather prefetched by
    this layer's backward, and its copy-in of the local shards ((3 + 1/2)x on 2 ranks). The estimate's peak is the
    end of the backward plus the largest."""
    model, x = _model(layers), _inputs()
    _, _, ctx = _prepare(model, {"dp": 2}, x, None)
    stats, other, _ = gather_stats(ctx)
    mc = mesh_costing(ctx, stats, other, ("dp",), (2,), ("dp",), H.PRESETS["cpu"])
    layer = _layer_bytes(model)
    worst = max(fsdp_form.reduce_transient_bytes(mc, st, 1) for st in (*stats.values(), other))
    assert worst == pytest.approx(times * layer)
    e = autopar.plan(model, {"dp": 2}, x, plan="fsdp", cluster="cpu").estimate
    assert e.memory_bytes_per_device - _peak_without_transients(e) == pytest.approx(times * layer, abs=4 * len(e.sites))


def test_dp_bucket_holds_one_flat_copy():
    """Data parallel: the end of the backward adds one flat copy of the bucket (here every gradient: under the cap)."""
    model, x = _model(2), _inputs()
    e = autopar.plan(model, {"dp": 2}, x, plan="dp", cluster="cpu").estimate
    grads = sum(s.gradients_bytes for s in e.sites)
    assert e.memory_bytes_per_device - _peak_without_transients(e) == pytest.approx(grads, abs=4 * len(e.sites))


def measured_peaks() -> list[tuple[str, int, bool, float, float]]:
    """In a gloo worker: (plan, layers, pooled, measured peak, estimated peak) of a training step after a warm-up
    step; `pooled`: the DP buckets' flat buffers come from the runtime's CPU pool (else fresh ones)."""
    out = []
    for plan, layers, pooled in (("fsdp", 1, True), ("fsdp", 2, True), ("dp", 2, True), ("dp", 2, False)):
        mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("dp",))
        x = _inputs()
        pm = autopar.parallelize(_model(layers), mesh, x, plan=plan)
        pool, C._POOL = C._POOL, C._POOL if pooled else _NoPool()
        try:
            _, live = measured_step(pm, x, torch.optim.Adam(pm.parameters()))
        finally:
            C._POOL = pool
        out.append((plan, layers, pooled, live.peak, pm.plan.estimate.memory_bytes_per_device))
    return out


class _NoPool(dict):
    """A pool that keeps nothing: every flat buffer is fresh."""

    def setdefault(self, key, default=None):
        return []


def test_end_of_backward_peak_matches_the_probe():
    """On real ranks (FSDP's reduce-scatters and DP's all-reduces are asynchronous there): the estimated peak within
    15% of the measured one (issue #11's bound), for FSDP with one and two re-gathered layers and for DP; DP's peak
    is the same with the CPU pool of flat buffers and without it (the probe counts a pooled buffer while in use)."""
    for rows in gloo_pool(2).run(measured_peaks):
        for plan, layers, _, peak, est in rows:
            assert est == pytest.approx(peak, rel=0.15), (plan, layers, est / peak)
        dp = [peak for plan, _, _, peak, _ in rows if plan == "dp"]
        # within 1% (a buffer the probe did not count while in use would be the bucket: ~20%); not bitwise: one 32 KB
        # tensor (the logits' size) is freed before or after the peak's allocation depending on when the
        # asynchronous all-reduces complete (measured both ways with either buffer, 32385032 or 32417800 bytes)
        assert dp[0] == pytest.approx(dp[1], rel=0.01), dp


def test_probe_counts_a_pooled_buffer_while_in_use(monkeypatch):
    """The probe's rule for the runtime's CPU pool: a pooled flat buffer counts from the op that hands it out until
    only the pool holds it, and again when it is handed out again (`cat(out=)`, as a bucket fills it)."""
    monkeypatch.setattr(C, "_POOL", {})
    n, like = 2**18, torch.ones(1)
    with LiveStorages() as live:
        buf = C.pooled_empty(n, torch.float32, like)
        buf.fill_(1.0)
        assert live.current == 4 * n
        del buf
        other = torch.zeros(n)  # an op: the idle pooled buffer no longer counts
        assert live.current == 4 * n and live.peak == 4 * n
        del other
        flat = torch.cat([torch.ones(n)], out=C.pooled_empty(n, torch.float32, like))  # the same buffer again
        assert flat.untyped_storage().data_ptr() == next(iter(C._POOL.values()))[0].untyped_storage().data_ptr()
        assert live.current == 8 * n  # the pooled buffer and the ones it copied
