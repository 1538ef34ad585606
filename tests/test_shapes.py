"""Shapes that change: a ParallelModule called with another batch size or sequence length re-lowers the same
plan's forms for the new shapes (one re-capture per shape, cached, at most `max_programs`), and matches the
single-device model (loss, every gradient, every parameter after an SGD step; `equivalence.compare_step`) on
simulated ranks. A form whose precondition fails for the new shape runs replicated for it, with a plan note."""

from __future__ import annotations

import copy
from collections import Counter

import pytest
import torch
from torch.distributed.device_mesh import init_device_mesh

import autopar
import autopar.module
from autopar.models import GPT, MLP, GPTConfig
from autopar.runtime.collectives import record_comms
from equivalence import compare_step

FP64 = 1e-10


def _inputs(batch, seq, vocab=128):
    return torch.randint(0, vocab, (batch, seq)), torch.randint(0, vocab, (batch, seq))


def _step(pm, ref, x) -> tuple[float, Counter]:
    """One compared step; the largest error and the collectives it ran, by (kind, pass)."""
    with record_comms() as recs:
        errs = compare_step(pm, ref, x)
    return max(errs.values()), Counter((r.kind, r.pass_) for r in recs)


@pytest.mark.parametrize("plan", ["megatron", "fsdp", "auto"])
def test_other_batch_sizes_and_sequence_lengths_rerun_the_plan_and_match(local_world, fp64, plan):
    torch.manual_seed(0)
    ref = GPT(GPTConfig())
    shapes = [(4, 16), (4, 8), (8, 12), (4, 16)]  # batches that divide over fsdp's 4 ranks
    xs = {s: _inputs(*s) for s in shapes}
    with local_world(4):
        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
        pm = autopar.parallelize(copy.deepcopy(ref), mesh, xs[(4, 16)], plan=plan)
        first = pm.plan
        comms = {}
        for s in shapes:
            err, comms[s] = _step(pm, ref, xs[s])
            assert err < FP64, (s, err)
            # the same forms and placements, the same collectives (their sizes follow the shapes)
            assert [(t.key, t.label) for t in pm.plan.strategies] == [(t.key, t.label) for t in first.strategies]
            assert pm.plan.params == first.params and pm.plan.inputs == first.inputs
            assert comms[s] == comms[(4, 16)], (s, comms[s], comms[(4, 16)])
            assert pm.plan.comm_counts() == first.comm_counts()
        assert len(pm.programs()) == 3, pm.programs()  # the example's shape is reused, not re-captured
        assert comms[(4, 16)] or plan == "auto", "the plan runs collectives"  # auto keeps this tiny GPT replicated


def test_a_batch_that_does_not_divide_runs_replicated_inputs_with_a_note(local_world, fp64):
    torch.manual_seed(0)
    ref = GPT(GPTConfig())
    x, odd = _inputs(4, 16), _inputs(3, 16)  # inputs are made outside the simulated ranks
    with local_world(4):
        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
        pm = autopar.parallelize(copy.deepcopy(ref), mesh, x, plan="megatron")
        with pytest.warns(UserWarning, match=r"input tokens replicated: batch 3 does not divide over 2 data-parallel "
                                             r"ranks.*Fix: a batch size divisible"):
            err, _ = _step(pm, ref, odd)
        assert err < FP64
        assert "input tokens replicated: batch 3 does not divide over 2 data-parallel ranks (axes ('dp',))" in \
            pm.plan.notes
        assert dict(pm.plan.inputs)["tokens"] == "RR"


def test_a_sequence_the_ring_form_cannot_split_runs_that_attention_replicated_with_a_note(local_world, fp64):
    torch.manual_seed(0)
    ref = GPT(GPTConfig())
    xs = {s: _inputs(2, s) for s in (16, 8, 6)}  # inputs are made outside the simulated ranks
    with local_world(2):
        mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("cp",))
        pm = autopar.parallelize(copy.deepcopy(ref), mesh, xs[16], plan="dp", overrides={"attention": "ring@cp"})
        err, ring = _step(pm, ref, xs[8])  # 8 = 2 x 2 zigzag chunks of 2: ring still applies
        assert err < FP64 and ring[("p2p", "forward")] > 0
        assert {s.label for s in pm.plan.strategies if s.kind == "attention"} == {"ring@cp"}
        err, fallback = _step(pm, ref, xs[6])  # 6 does not split into 2 x 2 chunks
        assert err < FP64
        assert ("p2p", "forward") not in fallback
        assert {s.label for s in pm.plan.strategies if s.kind == "attention"} == {"replicate"}
        notes = [n for n in pm.plan.notes if "replicated for these inputs, not ring@cp" in n]
        assert len(notes) == 2 and "sequence 6 does not split into 2x2 zigzag chunks" in notes[0], pm.plan.notes
        err, again = _step(pm, ref, xs[16])  # the example's program: ring again
        assert err < FP64 and again[("p2p", "forward")] > 0


def test_programs_are_cached_up_to_max_programs_least_recently_used_first(local_world, fp64, monkeypatch):
    torch.manual_seed(0)
    ref = MLP()
    xs = {b: (torch.randn(b, 16), torch.randn(b, 16)) for b in (2, 4, 6, 8, 10)}
    captures = []
    relower = autopar.module.relower
    monkeypatch.setattr(autopar.module, "relower", lambda *a, **k: captures.append(k["key"]) or relower(*a, **k))
    with local_world(2):
        mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("dp",))
        pm = autopar.parallelize(copy.deepcopy(ref), mesh, xs[2], plan="dp")
        assert type(pm).max_programs == 8  # the documented default
        pm.max_programs = 3
        for b in (2, 4, 6, 2, 8):  # 8 drops the least recently used: 4
            assert _step(pm, ref, xs[b])[0] < FP64
        assert len(captures) == 3 and len(pm.programs()) == 3
        assert pm.programs() == [f"inputs (({b}, 16), ({b}, 16)), train mode" for b in (6, 2, 8)]
        assert _step(pm, ref, xs[6])[0] < FP64 and len(captures) == 3  # cached
        assert _step(pm, ref, xs[4])[0] < FP64 and len(captures) == 4  # dropped: captured again
        assert len(pm.programs()) == 3


def gloo_shapes_and_modes() -> list[float]:
    """Run on every rank of a gloo pool: GPT on tp=2, steps at three shapes, then in eval mode; the errors."""
    torch.manual_seed(0)
    torch.set_default_dtype(torch.float64)
    try:
        ref = GPT(GPTConfig(dropout=0.1))
        g = torch.Generator().manual_seed(1)
        xs = [tuple(torch.randint(0, 128, s, generator=g) for _ in range(2)) for s in ((4, 16), (2, 8), (4, 12))]
        mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("tp",))
        pm = autopar.parallelize(copy.deepcopy(ref).eval(), mesh, xs[0], plan="megatron")
        ref.eval()
        errs = [max(compare_step(pm, ref, x).values()) for x in xs]
        pm.train()  # dropout on: every rank draws the masks its plan says (no reference to compare with)
        losses = [float(pm(*x)) for x in xs[:2]]
        return errs + [len(pm.programs())] + losses
    finally:
        torch.set_default_dtype(torch.float32)


def test_real_processes_re_lower_the_same_program_on_every_rank():
    """On gloo processes every rank re-captures and re-plans on its own: the programs must agree (else a
    collective would hang or mismatch), and match one device."""
    from dist_harness import gloo_pool

    results = gloo_pool(2).run(gloo_shapes_and_modes)
    for errs in results:
        assert max(errs[:3]) < FP64, errs
        assert errs[3] == 5  # three shapes in eval mode, two in train mode
    assert results[0] == results[1], results  # identical losses on both ranks, dropout included
