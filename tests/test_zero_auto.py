"""`plan="auto"` chooses among dp / zero1 / zero2 / fsdp by the step's estimated time under the memory limit
(`autopar.planner._reranked`: the ILP's solutions and the hand plans megatron, fsdp, zero1, zero2 priced on one
timeline). Offline: one MLP on 8 data ranks, the limit set between each named plan's estimated memory and the next hungrier one's, so the plans
that need more do not fit; each of the four is then auto's plan, recognised by its directives (not by a label), and
`explain()` says why. On 2 gloo ranks (fp64, AdamW, 2 steps): an auto plan that chose zero1 trains exactly as one
device (loss, every gradient, every parameter after each step) with zero1's exact collectives."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import autopar
from autopar.plan import GATHER_PERSIST, DirectiveKind
from dist_harness import gloo_pool
from train_helpers import train_against_one_device

NAMED = ("dp", "zero1", "zero2", "fsdp")
STEPS = 2
TOL = 1e-10


def _mlp(hidden: int, rows: int):
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(hidden, hidden) for _ in range(4)])
    return model, torch.randn(rows, hidden)


def _state_form(plan) -> str:
    """What a plan does with the parameters' state on the data axes, from its directives."""
    kinds = {(d.kind, d.value if d.kind is DirectiveKind.GATHER else "") for d in plan.directives}
    if (DirectiveKind.GATHER, GATHER_PERSIST) in kinds:
        return "zero2"
    if any(k is DirectiveKind.GATHER for k, _ in kinds):
        return "fsdp"
    if any(k is DirectiveKind.SHARD_STEP for k, _ in kinds):
        return "zero1"
    return "dp"


def _memory(model, mesh, x) -> dict[str, float]:
    return {n: autopar.plan(model, mesh, (x,), cluster="h100", plan=n).estimate.memory_bytes_per_device
            for n in NAMED}


def test_auto_chooses_each_state_sharding_where_it_is_the_fastest_that_fits():
    """A batch large enough that tensor parallelism's activation traffic costs more than the gradients' (so the
    data-parallel family is the fastest), memory ordered dp > zero1 > zero2 > fsdp and time the other way: no
    limit -> dp; a limit between each plan's memory and the next hungrier one's -> that plan."""
    model, x = _mlp(512, 4096)
    mesh = {"dp": 8}
    mem = _memory(model, mesh, x)
    assert mem["dp"] > mem["zero1"] > mem["zero2"] > mem["fsdp"], mem
    got = {}
    for want in NAMED:
        # the limit halfway between this plan's memory and the next hungrier plan's
        limit = None if want == "dp" else (mem[want] + mem[NAMED[NAMED.index(want) - 1]]) / 2
        plan = autopar.plan(model, mesh, (x,), cluster="h100", memory_limit=limit)
        got[want] = _state_form(plan)
        assert plan.estimate.fits
        text = plan.explain()
        assert "re-ranked" in text, text
        if want in ("zero1", "zero2"):  # a hand plan won: explain names it, and why the faster ones are out
            assert f"{want} + checkpoint none" in text and "does not fit" in text, text
    assert got == {n: n for n in NAMED}, got


def auto_zero_worker(d: int):
    """gloo worker: the MLP on one device and under `auto` with the memory limit at zero1's estimate, AdamW, STEPS
    steps, fp64. Returns (the state form auto chose, the largest errors, each step's collectives, numel)."""
    from torch.distributed.device_mesh import init_device_mesh

    torch.set_default_dtype(torch.float64)
    try:
        ref, x = _mlp(64, 1024)
        model, _ = _mlp(64, 1024)
        limit = _memory(model, {"dp": d}, x)["zero1"] * (1 + 1e-6)
        mesh = init_device_mesh("cpu", (d,), mesh_dim_names=("dp",))
        pm = autopar.parallelize(model, mesh, (x,), plan="auto", cluster="h100", memory_limit=limit)
        chosen = _state_form(pm.plan)
        errs, steps = train_against_one_device(ref, pm, x, STEPS)
        return chosen, errs, steps, sum(p.numel() for p in ref.parameters())
    finally:
        torch.set_default_dtype(torch.float32)


def test_auto_zero1_trains_as_one_device():
    for chosen, errs, steps, numel in gloo_pool(2).run(auto_zero_worker, 2):
        assert chosen == "zero1", chosen
        assert errs["loss"] <= TOL and errs["grad"] <= TOL and errs["param"] <= TOL, errs
        for recs in steps:
            # zero1: the gradient buckets all-reduced in backward (every parameter once), one all-gather of every
            # parameter inside the step; in forward only the output's all-gather (pm returns the global output)
            backward = [r for r in recs if r[2] == "backward"]
            assert {r[:3] for r in backward} == {("all_reduce", "dp", "backward")}, recs
            assert sum(r[3] for r in backward) == numel, (recs, numel)
            assert [r for r in recs if r[2] == "step"] == [("all_gather", "dp", "step", numel)], recs
            assert [r for r in recs if r[2] not in ("backward", "step")] == [("all_gather", "dp", "forward", 1024 * 64)]
