"""autopar.tune: candidate enumeration (the ILP's k best distinct plans and the hand plans), failure isolation
(a candidate that raises on one rank, one over the memory limit, one out of memory), the cache (a second call and
plan="tuned" measure nothing; the key follows the mesh and dtypes), the calibration (fitted, saved beside the
profile, applied when pricing) and the command line under torchrun on 4 gloo ranks."""

from __future__ import annotations

import dataclasses
import importlib
import itertools
import json
import math
import os
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

import autopar
from autopar.api import _prepare
from autopar.models import GPT, GPTConfig
from autopar.tune import (CALLS, OPTIMIZER, REST, _evaluate, apply_calibration, cache_key, candidates, components, fit_calibration, plan_choices,
                          _update_calibration)
from cost_model.analytical import collective_time_s
from cost_model.hardware import PRESETS, Calibration, Link, calibration_path, load_cluster
from dist_harness import gloo_pool

tune_mod = importlib.import_module("autopar.tune")  # (`autopar.tune` is also the function)
ROOT = Path(__file__).resolve().parents[1]
MESH = {"dp": 2, "tp": 2}


def tiny(batch: int = 8, vocab: int = 128, hidden: int = 32):
    """A 2-layer GPT and a batch of tokens (the command line's factory too)."""
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=vocab, seq_len=16, num_layers=2, num_heads=4, hidden=hidden))
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, vocab, (batch, 16), generator=g)
    return model, (ids, ids.roll(1, dims=1))


def _enumerate(model, inputs, mesh, top_k, cluster="cpu"):
    info, captured, ctx = _prepare(model, mesh, inputs)
    return candidates(model, ctx, info, captured, load_cluster(cluster, info.sizes), top_k), (info, captured, ctx)


# ----------------------------------------------------------------------------- candidates

def test_k_best_distinct_plans_in_order_with_the_hand_plans(monkeypatch):
    # the mirror-image merging is checked among the dp/fsdp/model-parallel assignments: with the ILP's per-class
    # ZeRO rows (tests/test_zero_ilp.py) this GPT's 4 (and 8) best differ by ZeRO stages and hold no mirror pair
    import autopar.solver as solver_mod
    whole = solver_mod.all_candidates
    monkeypatch.setattr(solver_mod, "all_candidates",
                        lambda *a, **k: [(c, why) for c, why in whole(*a, **k) if not c.zero])
    model, inputs = tiny()
    info, captured, ctx = _prepare(model, MESH, inputs)
    cpu = load_cluster("cpu", info.sizes)
    assert tune_mod._interchangeable(info, dataclasses.replace(cpu, gpus_per_node=2)) == []  # axes on other links
    with monkeypatch.context() as m:  # every plan its own candidate, mirror images too
        m.setattr(tune_mod, "_interchangeable", lambda info, cluster: [])
        apart = candidates(model, ctx, info, captured, cpu, 16)
    ilp = [c for c in apart if c.name.startswith("auto#")]
    assert [c.name.split("=")[0] for c in ilp] == [f"auto#{i + 1}" for i in range(16)]
    swaps = tune_mod._interchangeable(info, cpu)
    assert swaps == [{"dp": "tp", "tp": "dp"}]
    # within one node a plan and its mirror image (the same forms, dp and tp swapped) run alike. k: the fewest best
    # plans that hold a plan and its mirror image, read off the plans themselves (this GPT's 16 best on the uniform
    # 2 x 2 CPU mesh hold a pair; how far down it sits follows the pricing)
    sig = tune_mod._signature
    mirrored = [j for j, c in enumerate(ilp)
                if any(sig(c.plan) != sig(o.plan) and sig(c.plan) in tune_mod._signatures(o.plan, swaps)
                       for o in ilp[:j])]
    assert mirrored, [c.name for c in ilp]
    k = mirrored[0] + 1
    # with the swaps known, the k best are measured once each, under both names
    cands = candidates(model, ctx, info, captured, cpu, k)
    names = [n for c in cands for n in c.name.split("=")]
    assert sorted(n for n in names if n.startswith("auto#")) == sorted(f"auto#{i + 1}" for i in range(k))
    merged = [c for c in cands if c.name.count("auto#") > 1]
    assert merged, [c.name for c in cands]
    for c in merged:
        first, *mirrors = [n for n in c.name.split("=") if n.startswith("auto#")]
        for m in mirrors:
            other = next(x for x in apart if m in x.name.split("="))
            assert sig(other.plan) != sig(c.plan)
            assert sig(other.plan) in tune_mod._signatures(c.plan, swaps)
            assert other.predicted_s == pytest.approx(c.predicted_s, rel=1e-9)
    assignments = [plan_choices(c.plan) for c in ilp]
    for a, b in itertools.combinations(assignments, 2):
        assert a[0] != b[0]  # distinct in the forms, not only in cost
    from autopar.solver import evaluate
    objective = [evaluate(ctx, info, cpu, plan_choices(c.plan)[0], plan_choices(c.plan)[1],
                          seq_axes=plan_choices(c.plan)[2]).objective_s for c in ilp[:4]]
    assert objective == sorted(objective)  # the 4 best by what the ILP minimises, best first
    names = " ".join(c.name for c in cands)
    for hand in ("megatron", "dp", "fsdp"):
        assert hand in names
    # each plan's assignment (read off its decisions) prices exactly as its estimate, plus the optimizer step; its
    # parts add up to the prediction with every calibration factor 1 (each op kind priced apart)
    cluster = load_cluster("cpu", info.sizes)
    identity = dataclasses.replace(cluster, calibration=Calibration(axes=(1.0, 1.0), mesh_shape=(2, 2), of="cpu"))
    for c in cands:
        parts = dict(c.components)
        assert math.isclose(_evaluate(ctx, info, cluster, c.plan) + parts[OPTIMIZER], c.predicted_s,
                            rel_tol=1e-9), c.name
        assert math.isclose(apply_calibration(parts, None), _evaluate(ctx, info, identity, c.plan) + parts[OPTIMIZER],
                            rel_tol=1e-9), c.name
        assert apply_calibration(parts, None) == pytest.approx(sum(v for k, v in parts.items()
                                                                   if not k.startswith(CALLS)))
    # data parallel (over both axes): its gradient reductions are synchronisation, and its optimizer updates whole
    # parameters; FSDP's synchronisation (gathers, gathered again in backward, reduce-scatters) is more, its optimizer
    # updates a shard of each parameter
    by = {n: c for c in cands for n in c.name.split("=")}
    dp, fsdp = dict(by["dp"].components), dict(by["fsdp"].components)
    sync = lambda parts: sum(v for k, v in parts.items() if k.startswith("sync:"))  # noqa: E731
    assert 0 < sync(dp) < sync(fsdp), (dp, fsdp)
    assert fsdp[OPTIMIZER] < dp[OPTIMIZER] / 2  # (FSDP over both axes: a quarter of each parameter)
    # a plan found twice is measured once: no two candidates lower alike
    sigs = [(c.plan.params, c.plan.inputs, tuple(sorted(map(repr, c.plan.directives)))) for c in cands]
    assert len(set(sigs)) == len(sigs)


def test_fewer_plans_when_fewer_exist():
    """A 2-layer MLP regression on 2 ranks has few assignments: asked for 40, the ILP gives every one once, then
    stops (no error)."""
    from autopar.models import MLP
    model = MLP(dim=8, hidden=16)
    inputs = (torch.randn(4, 8), torch.randn(4, 8))
    cands, _ = _enumerate(model, inputs, {"dp": 2}, top_k=40)
    ilp = [c for c in cands if c.name.startswith("auto#")]
    assert 1 < len(ilp) < 40
    forms = [plan_choices(c.plan)[0] for c in ilp]
    assert all(a != b for a, b in itertools.combinations(forms, 2))
    again, _ = _enumerate(model, inputs, {"dp": 2}, top_k=len(ilp))
    assert [c.name for c in again] == [c.name for c in cands]


# ----------------------------------------------------------------------------- calibration

def _synthetic(truth: dict[str, float], n: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        parts = {k: float(torch.rand((), generator=g)) * 1e-3 for k in truth}
        parts[REST] = 1e-5
        measured = sum(truth[k] * v for k, v in parts.items() if k != REST) + parts[REST]
        out.append((parts, measured))
    return out


def test_fit_learns_how_much_synchronisation_is_hidden():
    """Where the collectives' threads share the cores with compute (a CPU host), the synchronisation the timeline
    hides is not hidden: measured steps pay it in full and more, while the critical-path collectives cost what was
    predicted. The fit tells the two apart per axis, and the optimizer step's factor, from the measurements."""
    truth = {"compute:matmul": 1.2, "axis:0": 1.0, "sync:0": 2.5, "axis:1": 0.8, "sync:1": 0.1, OPTIMIZER: 3.0}
    fits = _synthetic(truth, 16, seed=3)
    cal = fit_calibration(fits[:12], (2, 2), of="cpu", ridge=1e-4)
    assert cal.sync_factor((2, 2), 0) == pytest.approx(2.5, rel=0.05)
    assert cal.sync_factor((2, 2), 1) == pytest.approx(0.1, abs=0.05)
    assert cal.axes[0] == pytest.approx(1.0, rel=0.05) and cal.compute[OPTIMIZER] == pytest.approx(3.0, rel=0.05)
    for parts, measured in fits[12:]:  # held aside
        assert apply_calibration(parts, cal) == pytest.approx(measured, rel=0.02)
    # one factor per axis (the calibration before) cannot: its held-aside error stays large
    merged = [({k.replace("sync:", "axis:"): 0.0 for k in p} | {f"axis:{i}": p.get(f"axis:{i}", 0) + p.get(f"sync:{i}", 0)
                for i in (0, 1)} | {k: v for k, v in p.items() if not k.startswith(("axis:", "sync:"))}, m)
              for p, m in fits]
    old = fit_calibration(merged[:12], (2, 2), of="cpu", ridge=1e-4)
    assert max(abs(apply_calibration(p, old) - m) / m for p, m in merged[12:]) > 0.05
    # round trip; a calibration saved before `sync` existed prices synchronisation as its axis
    again = Calibration.from_json(cal.to_json())
    assert again == cal and again.sync == cal.sync
    legacy = Calibration(axes=(2.0, 3.0), mesh_shape=(2, 2), of="cpu")
    assert legacy.sync_factor((2, 2), 1) == 3.0
    with pytest.raises(ValueError, match="sync"):
        Calibration(axes=(1.0, 1.0), sync=(1.0,), mesh_shape=(2, 2), of="cpu")


def test_fit_recovers_factors_and_predicts_held_aside():
    truth = {"compute:matmul": 3.0, "compute:vector": 1.5, "axis:0": 2.0, "axis:1": 6.0}
    fits = _synthetic(truth, 12)
    cal = fit_calibration(fits[:8], (2, 2), of="cpu", ridge=1e-4)
    assert cal.compute["matmul"] == pytest.approx(3.0, rel=0.05)
    assert cal.axes[1] == pytest.approx(6.0, rel=0.05)
    for parts, measured in fits[8:]:  # held aside
        assert apply_calibration(parts, cal) == pytest.approx(measured, rel=0.02)
        assert abs(apply_calibration(parts, None) - measured) / measured > 0.3


def test_calibration_saved_beside_the_profile_round_trips_and_prices(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    model, inputs = tiny()
    cands, (info, captured, ctx) = _enumerate(model, inputs, MESH, top_k=2, cluster=None)
    base = load_cluster(None, info.sizes)
    assert base.calibration is None
    fits = [(dict(c.components), c.predicted_s * (3.0 if i % 2 else 2.5)) for i, c in enumerate(cands)]
    from cost_model.hardware import profile_of
    profile = profile_of(info.sizes)
    cal = _update_calibration(profile, base, info.sizes, captured.fingerprint(), fits, save=True)
    path = calibration_path(profile)
    assert path.is_file() and path.name.endswith(".calibration.json")
    assert Calibration.from_json(path.read_text()) == cal
    # every later load of this machine's cluster (other models too) prices with it
    loaded = load_cluster(None, info.sizes)
    assert loaded.calibration == cal
    for name in ("megatron", "fsdp"):
        plain = autopar.plan(model, MESH, inputs, plan=name, cluster=base)
        calibrated = autopar.plan(model, MESH, inputs, plan=name)
        # the calibrated sum of parts is what the loaded cluster prices (the cost model scales an axis' collectives
        # by its factor, synchronisation included, and leaves the optimizer step out); the plan's own (overlapped)
        # estimate follows it
        priced = _evaluate(ctx, info, loaded, calibrated)
        parts = dict(next(c for c in cands if name in c.name).components)
        parts.pop(OPTIMIZER)
        assert priced == pytest.approx(apply_calibration(parts, dataclasses.replace(cal, sync=())), rel=1e-9)
        assert priced > 2 * _evaluate(ctx, info, base, plain)
        assert calibrated.estimate.step_time_s > 2 * plain.estimate.step_time_s
    # a second model's measurements are fitted with the first's, which are kept
    other, other_inputs = tiny(vocab=256)
    cands2, (_, captured2, _) = _enumerate(other, other_inputs, MESH, top_k=1, cluster=None)
    _update_calibration(profile, base, info.sizes, captured2.fingerprint(),
                        [(dict(c.components), c.predicted_s * 2.0) for c in cands2], save=True)
    saved = json.loads(path.read_text())
    assert {f["graph"] for f in saved["fits"]} == {captured.fingerprint(), captured2.fingerprint()}
    # measurements that pay a latency per collective: the saved calibration carries it, and the cluster loaded
    # afterwards prices every collective of a later plan with it
    calls = lambda c: sum(v for k, v in c.components if k.startswith(CALLS))  # noqa: E731
    late = _update_calibration(profile, base, info.sizes, captured.fingerprint(),
                               [(dict(c.components), 2.0 * c.predicted_s + 2e-3 * calls(c)) for c in cands], save=True)
    assert late.latency and min(late.latency) > 0
    assert load_cluster(None, info.sizes).calibration.latency == late.latency
    # a preset named explicitly stays as published
    assert load_cluster("cpu", info.sizes).calibration is None


def test_link_time_factor_scales_collectives():
    link = Link(alpha_s=1e-5, bytes_per_s=1e9)
    slow = dataclasses.replace(link, time_factor=2.5)
    assert collective_time_s("all_reduce", 2**20, 4, slow) == pytest.approx(
        2.5 * collective_time_s("all_reduce", 2**20, 4, link))
    with pytest.raises(ValueError, match="time_factor"):
        Link(alpha_s=0, bytes_per_s=1e9, time_factor=0)

    # a fixed latency per collective is added once, after the factor; a group of one rank issues nothing
    fixed = dataclasses.replace(slow, call_s=3e-4)
    assert collective_time_s("all_gather", 2**20, 4, fixed) == pytest.approx(
        collective_time_s("all_gather", 2**20, 4, slow) + 3e-4)
    assert collective_time_s("all_gather", 2**20, 1, fixed) == 0.0
    with pytest.raises(ValueError, match="call_s"):
        Link(alpha_s=0, bytes_per_s=1e9, call_s=-1e-3)


def _with_calls(truth: dict[str, float], latency: tuple[float, float], n: int, seed: int):
    """Synthetic measurements of plans that differ in their collectives per axis (0 to 30, as the GPT's dp, megatron
    and fsdp plans: 4 to 14 on each axis) as much as in their seconds."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for parts, _ in _synthetic(truth, n, seed):
        counts = {f"{CALLS}:{i}": float(torch.randint(0, 31, (), generator=g)) for i in (0, 1)}
        measured = (sum(truth[k] * v for k, v in parts.items() if k != REST) + parts[REST]
                    + sum(s * counts[f"{CALLS}:{i}"] for i, s in enumerate(latency)))
        out.append((parts | counts, measured))
    return out


def test_fit_learns_a_latency_per_collective():
    """Where every blocking collective costs a fixed time that no message size explains (ranks woken on contended
    cores), plans with many collectives (FSDP's gathers and reduce-scatters per layer group) run slower than their
    seconds say. The fit finds the latency per axis, and it predicts held-aside plans; factors alone cannot."""
    truth = {"compute:matmul": 1.5, "compute:vector": 2.0, "axis:0": 2.0, "sync:0": 2.5, "axis:1": 3.0, OPTIMIZER: 2.0}
    fits = _with_calls(truth, (2e-4, 5e-5), 24, seed=5)
    cal = fit_calibration(fits[:16], (2, 2), of="cpu", ridge=1e-4, latency_ridge=1e-4)
    assert cal.latency == pytest.approx((2e-4, 5e-5), rel=0.05)
    assert cal.latency_s((2, 2), 1) == cal.latency[1] and cal.latency_s((4,), 0) == pytest.approx(1.25e-4, rel=0.05)
    assert cal.compute["matmul"] == pytest.approx(1.5, rel=0.05) and cal.axes[1] == pytest.approx(3.0, rel=0.05)
    for parts, measured in fits[16:]:  # held aside
        assert apply_calibration(parts, cal) == pytest.approx(measured, rel=0.02)
    seconds = lambda rows: [({k: v for k, v in p.items() if not k.startswith(CALLS)}, m) for p, m in rows]  # noqa: E731
    without = fit_calibration(seconds(fits[:16]), (2, 2), of="cpu", ridge=1e-4, latency_ridge=1e-4)
    assert without.latency == ()
    assert max(abs(apply_calibration(p, without) - m) / m for p, m in seconds(fits[16:])) > 0.05
    # saved and loaded with the calibration
    again = Calibration.from_json(cal.to_json())
    assert again == cal and again.latency == cal.latency
    with pytest.raises(ValueError, match="latency"):
        Calibration(axes=(1.0, 1.0), latency=(1e-3, -1e-3), mesh_shape=(2, 2), of="cpu")
    with pytest.raises(ValueError, match="latency"):
        Calibration(axes=(1.0, 1.0), latency=(1e-3,), mesh_shape=(2, 2), of="cpu")


def test_fit_charges_no_latency_the_measurements_do_not_ask_for():
    """Measurements that the seconds explain (every plan twice as slow as priced, however many collectives it issues)
    leave the latency at none; measurements faster than the seconds say for plans with more collectives cannot make
    it negative (non-negative least squares), nor any factor."""
    truth = {"compute:matmul": 2.0, "compute:vector": 2.0, "axis:0": 2.0, "sync:0": 2.0, "axis:1": 2.0}
    fits = _with_calls(truth, (0.0, 0.0), 12, seed=7)
    cal = fit_calibration(fits, (2, 2), of="cpu")
    assert cal.latency == ()
    assert all(f == pytest.approx(2.0, rel=0.02) for f in [*cal.compute.values(), *cal.axes, *cal.sync])
    faster = [(p, m - 1e-5 * p[f"{CALLS}:0"]) for p, m in fits]
    cal = fit_calibration(faster, (2, 2), of="cpu", latency_ridge=1e-4)
    assert cal.latency_s((2, 2), 0) == 0.0 and min(cal.latency, default=0.0) >= 0
    assert min([*cal.compute.values(), *cal.axes, *cal.sync]) > 0
    # by default the latency is charged only where the measurements clearly ask for it: one that explains a tenth of
    # the step is learnt, shrunk towards none
    slower = _with_calls(truth, (3e-5, 3e-5), 12, seed=7)
    learnt = fit_calibration(slower, (2, 2), of="cpu").latency
    assert learnt and all(0 < s < 3e-5 for s in learnt)


def test_nnls_matches_every_active_set():
    """`_nnls` against the best of every subset of free variables (least squares on the subset, kept when
    non-negative): the non-negative least-squares optimum is one of them."""
    g = torch.Generator().manual_seed(11)
    for _ in range(20):
        a = torch.randn(7, 4, generator=g, dtype=torch.float64).numpy()
        b = torch.randn(7, generator=g, dtype=torch.float64).numpy()
        x = tune_mod._nnls(a, b)
        assert (x >= 0).all()
        best = float(np.sum(b ** 2))
        for free in itertools.product((False, True), repeat=4):
            cols = np.array(free)
            if not cols.any():
                continue
            z = np.linalg.lstsq(a[:, cols], b, rcond=None)[0]
            if (z >= 0).all():
                best = min(best, float(np.sum((a[:, cols] @ z - b) ** 2)))
        assert float(np.sum((a @ x - b) ** 2)) == pytest.approx(best, rel=1e-9, abs=1e-12)


def test_latency_prices_every_collective_of_later_plans():
    """A calibration's latency per collective reaches the cost model through the mesh axis' link (`axis_link`,
    `Link.call_s`): a plan priced with it costs `calls:<i>` (`components`) times the latency more on each axis, so
    later plans, of other models too, are priced with it; the plan with more collectives pays more."""
    model, inputs = tiny()
    cands, (info, captured, ctx) = _enumerate(model, inputs, MESH, top_k=1)
    cpu = load_cluster("cpu", info.sizes)
    cal = Calibration(axes=(1.0, 1.0), latency=(4e-4, 1e-4), mesh_shape=(2, 2), of=cpu.name)
    slow = dataclasses.replace(cpu, calibration=cal)
    from cost_model.hardware import axis_link
    assert [axis_link(slow, (2, 2), i).call_s for i in (0, 1)] == [4e-4, 1e-4]
    assert axis_link(slow, (4,), 0).call_s == pytest.approx(2.5e-4)  # another mesh: the mean
    by = {n: c for c in cands for n in c.name.split("=")}
    extra = {}
    for name in ("megatron", "dp", "fsdp"):
        parts = dict(by[name].components)
        calls = [parts.get(f"{CALLS}:{i}", 0.0) for i in (0, 1)]
        assert all(c > 0 for c in calls), (name, parts)
        identity = dataclasses.replace(cpu, calibration=dataclasses.replace(cal, latency=()))
        extra[name] = _evaluate(ctx, info, slow, by[name].plan) - _evaluate(ctx, info, identity, by[name].plan)
        assert extra[name] == pytest.approx(4e-4 * calls[0] + 1e-4 * calls[1], rel=1e-9)
        assert apply_calibration(parts, cal) == pytest.approx(apply_calibration(parts, None) + extra[name], rel=1e-9)
    # FSDP gathers and reduce-scatters each layer group on each data axis; dp reduces its gradient bucket once
    fsdp, dp = dict(by["fsdp"].components), dict(by["dp"].components)
    assert all(fsdp[f"{CALLS}:{i}"] > dp[f"{CALLS}:{i}"] for i in (0, 1))
    assert extra["fsdp"] > extra["dp"]
    # the plan's own estimate (its overlapped timeline) is priced with it too
    plain = autopar.plan(model, MESH, inputs, plan="fsdp", cluster=cpu)
    assert autopar.plan(model, MESH, inputs, plan="fsdp", cluster=slow).estimate.step_time_s > \
        plain.estimate.step_time_s


# ----------------------------------------------------------------------------- the cache key

def test_cache_key_follows_graph_mesh_and_dtypes():
    model, inputs = tiny()
    cluster = PRESETS["cpu"]

    def key(m, mesh, x):
        info, captured, _ = _prepare(m, mesh, x)
        return cache_key(captured, info, cluster, m, x)

    k = key(model, MESH, inputs)
    assert k == key(model, MESH, inputs)
    assert k != key(model, {"dp": 4, "tp": 1}, inputs)
    assert k != key(model, {"data": 2, "tp": 2}, inputs)
    assert k != key(model.double(), MESH, inputs)
    other, _ = tiny(vocab=256)
    assert k != key(other, MESH, inputs)


# ----------------------------------------------------------------------------- on 4 gloo ranks

class _InjectedError(RuntimeError):
    pass


def _failing_optimizers(plan_of_build: list):
    """Build 2 fails on rank 1 only; build 3's optimizer fails at its second step on rank 2 only; build 4 runs
    out of memory (on every rank) at its first step."""
    calls = itertools.count(1)

    def make(params):
        import torch.distributed as dist
        n, rank = next(calls), dist.get_rank()
        if n == 2 and rank == 1:
            raise _InjectedError("injected build failure")
        opt = torch.optim.AdamW(params, lr=1e-4)
        if n in (3, 4):
            step, count = opt.step, itertools.count(1)

            def failing_step(*a, **k):
                i = next(count)
                if n == 3 and i == 2 and rank == 2:
                    raise _InjectedError("injected step failure")
                if n == 4:
                    raise torch.OutOfMemoryError("injected: tried to allocate 1 TiB")
                return step(*a, **k)
            opt.step = failing_step
        return opt
    return make


def _with_cache(cache_dir: str, fn):
    old = os.environ.get("XDG_CACHE_HOME")
    os.environ["XDG_CACHE_HOME"] = cache_dir
    try:
        return fn()
    finally:
        if old is None:
            os.environ.pop("XDG_CACHE_HOME", None)
        else:
            os.environ["XDG_CACHE_HOME"] = old


def _job_isolation_and_cache(cache_dir: str):
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    def run():
        tune_mod = sys.modules["autopar.tune"]
        model, inputs = tiny()
        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
        result = autopar.tune(model, mesh, inputs, top_k=2, steps=2, warmup=1, progress=False,
                              optimizer=_failing_optimizers([]), cluster="cpu")
        first = [(c.name, c.measured_s, c.skipped, c.peak_bytes) for c in result.candidates]
        # the cache: a second call and plan="tuned" measure nothing
        real = tune_mod._measure
        tune_mod._measure = lambda *a, **k: (_ for _ in ()).throw(AssertionError("measured again"))
        try:
            again = autopar.tune(model, mesh, inputs, top_k=2, steps=2, warmup=1, progress=False, cluster="cpu")
            pm = autopar.parallelize(model, mesh, inputs, plan="tuned", cluster="cpu")
        finally:
            tune_mod._measure = real
        loss = pm(*inputs)
        loss.backward()
        return dict(first=first, winner=result.plan.to_json(), again_measured=again.measured,
                    again_winner=again.plan.to_json(), tuned=pm.plan.params == result.plan.params,
                    table=result.table() if dist.get_rank() == 0 else "", loss=float(loss))
    return _with_cache(cache_dir, run)


def test_failures_are_isolated_and_the_result_is_cached(tmp_path):
    out = gloo_pool(4).run(_job_isolation_and_cache, str(tmp_path))
    assert all(o["first"] == out[0]["first"] for o in out)  # every rank saw the same outcome
    rows = out[0]["first"]
    assert len(rows) == 5, rows  # 2 of the ILP, 3 hand plans, in the order they are built
    assert rows[1][2] == "rank 1: _InjectedError: injected build failure", rows
    assert rows[2][2] == "rank 2: _InjectedError: injected step failure", rows
    assert rows[3][2] == "rank 0: out of memory: injected: tried to allocate 1 TiB (and ranks [1, 2, 3])", rows
    for i in (1, 2, 3):
        assert rows[i][1] is None and rows[i][0] not in out[0]["table"].split("fastest")[0].splitlines()[-1]
    for name, t, why, peaks in (rows[0], rows[4]):  # the others went on
        assert t > 0 and len(peaks) == 4 and min(peaks) > 0 and not why
    fastest = min((rows[0], rows[4]), key=lambda r: r[1])
    assert f"{fastest[0]} " in out[0]["table"].split("fastest")[0].splitlines()[-1]
    # cached: the second call and plan="tuned" returned the winner without measuring (the job would have raised)
    assert all(o["again_measured"] is False and o["again_winner"] == o["winner"] and o["tuned"] for o in out)
    assert math.isfinite(out[0]["loss"])
    assert list((tmp_path / "autopar" / "tune").glob("*.json"))


def _job_memory_limit(cache_dir: str):
    from torch.distributed.device_mesh import init_device_mesh

    def run():
        model, inputs = tiny(vocab=16384, hidden=256, batch=4)  # 16 MiB of parameters, nearly all the embedding
        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
        dp_state = 4 * sum(p.numel() * p.element_size() for p in model.parameters())  # AdamW: p, grad, 2 states
        limit = int(0.9 * dp_state)
        result = autopar.tune(model, mesh, inputs, top_k=0, steps=1, warmup=0, progress=False, cache=False,
                              memory_limit=limit, cluster="cpu")
        return limit, [(c.name, c.measured_s, c.skipped, c.peak_bytes) for c in result.candidates]
    return _with_cache(cache_dir, run)


def test_a_candidate_over_the_memory_limit_is_skipped(tmp_path):
    """dp holds every parameter and its AdamW state whole on every rank: over 9/10 of that, it is skipped; the
    plans that shard the (large) embedding go on (megatron holds half of it; what each measured is within the
    limit)."""
    out = gloo_pool(4).run(_job_memory_limit, str(tmp_path))
    limit, rows = out[0]
    assert all(o == out[0] for o in out)
    assert [r[0] for r in rows] == ["megatron", "dp", "fsdp"]
    dp = rows[1]
    assert dp[1] is None and dp[2].startswith("exceeds the memory limit: rank ") \
        and dp[2].endswith(f"over {limit / 2**20:.1f} MiB per rank"), rows
    measured = [r for r in rows if r[1] is not None]
    assert measured, rows
    for name, t, why, peaks in measured:
        assert max(peaks) <= limit


# ----------------------------------------------------------------------------- the command line

def _job_cli(argv: list[str], cache_dir: str):
    """`python -m autopar ...`'s main() on this pool rank (its process group already joined, as under torchrun):
    (exit status, stdout, stderr)."""
    import contextlib
    import io

    from autopar.__main__ import main

    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        rc = _with_cache(cache_dir, lambda: main(argv))
    return rc, out.getvalue(), err.getvalue()


def test_cli_tunes_on_4_ranks(tmp_path):
    """The `tune` command's main() on the shared 4-rank gloo pool: the same code torchrun runs after joining the
    group, without starting 4 interpreters that re-import torch (~40 s on 2 busy cores). The entry point itself
    (`torchrun -m autopar`, the ranks' exit status) is tested by test_verify's failing command line."""
    argv = ["tune", "--model", "test_tune:tiny", "--mesh", "2x2", "--mesh-names", "dp,tp", "--top-k", "1",
            "--steps", "2", "--warmup", "1", "--out", str(tmp_path / "plan.json")]
    outs = gloo_pool(4).run(_job_cli, argv, str(tmp_path))
    assert [o[0] for o in outs] == [0] * 4, outs
    rc, stdout, stderr = outs[0]
    assert stdout.count("fastest: ") == 1 and "predicted" in stdout and "calibrated" in stdout
    assert "autopar tune auto#1" in stderr  # the progress bars, rank 0 only
    assert all(o[1] == "" and "autopar tune" not in o[2] for o in outs[1:]), outs[1:]
    plan = autopar.Plan.load(str(tmp_path / "plan.json"))
    assert dict(plan.mesh) == {"dp": 2, "tp": 2}
    assert list(tmp_path.glob("autopar/*.calibration.json"))  # saved beside this machine's profile
