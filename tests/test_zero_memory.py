"""ZeRO's memory model (`cost_model.memory.zero_state_bytes_per_element`, `autopar.forms.zero`) and what the
estimate prices for the zero1 / zero2 / fsdp plans: the published formulas from their dtypes, the static state of
each plan per parameter element exactly as autopar holds it (with and without `mp_policy`, d in {2, 4, 8}), and
the bytes each plan sends per step (zero1: all-reduce + all-gather; zero2: reduce-scatter + all-gather). No
processes: plans on a mesh given as a dict."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.distributed.fsdp import MixedPrecisionPolicy

import autopar
from autopar.forms import zero
from cost_model.analytical import send_bytes
from cost_model.memory import zero_state_bytes_per_element

RANKS = (2, 4, 8, 64)


def _zero(stage, d, p, g, m, k):
    return zero_state_bytes_per_element(stage, d, param_bytes=p, grad_bytes=g, master_bytes=m, optimizer_bytes=k)


@pytest.mark.parametrize("d", RANKS)
def test_the_published_formulas(d):
    # ZeRO paper, fp16 mixed precision with Adam: fp16 parameters and gradients, fp32 masters and two moments (K=12)
    paper = [_zero(s, d, 2, 2, 4, 8) for s in range(4)]
    assert paper == [16, 4 + 12 / d, 2 + 14 / d, 16 / d]
    # Megatron-LM's distributed optimizer (stage 1): bf16 parameters, fp32 gradients 6 + 12/d; fp32 / fp32: 8 + 8/d
    assert _zero(1, d, 2, 4, 4, 8) == 6 + 12 / d and _zero(0, d, 2, 4, 4, 8) == 18
    assert _zero(1, d, 4, 4, 0, 8) == 8 + 8 / d and _zero(0, d, 4, 4, 0, 8) == 16


def test_the_papers_example():
    """ZeRO paper's 7.5B model on 64 data ranks: 120 GB (DDP), 31.4 (P_os), 16.6 (P_os+g), 1.9 (P_os+g+p)."""
    gb = [7.5e9 * _zero(s, 64, 2, 2, 4, 8) / 1e9 for s in range(4)]
    assert [round(x, 1) for x in gb] == [120.0, 31.4, 16.6, 1.9]


def test_bad_input():
    with pytest.raises(ValueError, match="stage must be 0"):
        _zero(4, 2, 2, 2, 4, 8)
    with pytest.raises(ValueError, match="num_ranks must be a positive int"):
        _zero(1, 0, 2, 2, 4, 8)


BF16 = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)


def _model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 64)), torch.randn(8, 64)


def _state(plan, numel) -> tuple[float, float, float]:
    """(parameters, gradients, optimizer) bytes per parameter element the estimate holds, over every structure."""
    sites = plan.estimate.sites
    return tuple(sum(getattr(s, k) for s in sites) / numel
                 for k in ("parameters_bytes", "gradients_bytes", "optimizer_bytes"))


@pytest.mark.parametrize("mp", [None, BF16], ids=["fp32", "bf16-fp32"])
@pytest.mark.parametrize("d", [2, 4, 8])
def test_estimate_state_per_plan(d, mp):
    """Adam, fp32 model (the masters). P: the compute copy the forward reads; G: gradients; K: the two moments.
    - dp: 4 + 4 + 8 = 16 (the bf16 compute copy under a policy is cast per step: not static);
    - zero1 (parameters and gradients replicated, the step sharded): 4 + 4 + 8/d, Megatron's fp32 row, under either;
    - zero2: the persistent compute copy whole, the fp32 master shard, its gradient and moments /d: P + 16/d, P = 2
      under bf16 compute (the paper's 2 + 14/d holds fp16 gradients: autopar's are the masters' fp32), 4 without;
    - fsdp (ZeRO-3): 16/d, the paper's."""
    model, x = _model()
    numel = sum(p.numel() for p in model.parameters())
    got = {name: _state(autopar.plan(model, {"dp": d}, (x,), plan=name, mp_policy=mp), numel)
           for name in ("dp", "zero1", "zero2", "fsdp")}
    p = 2 if mp is not None else 4
    want = {"dp": (4, 4, 8), "zero1": (4, 4, 8 / d), "zero2": (p + 4 / d, 4 / d, 8 / d), "fsdp": (4 / d, 4 / d, 8 / d)}
    for name, parts in want.items():
        assert got[name] == pytest.approx(parts, abs=2e-3), (name, got[name], parts)
    # and each the memory function of what autopar holds
    assert sum(got["dp"]) == pytest.approx(_zero(0, d, 4, 4, 0, 8), abs=5e-3)
    assert sum(got["zero1"]) == pytest.approx(_zero(1, d, 4, 4, 0, 8), abs=5e-3)
    assert sum(got["zero2"]) == pytest.approx(_zero(2, d, p, 4, 4, 8), abs=5e-3)
    assert sum(got["fsdp"]) == pytest.approx(_zero(3, d, 0, 4, 4, 8), abs=5e-3)


@pytest.mark.parametrize("mp", [None, BF16], ids=["fp32", "bf16-fp32"])
def test_estimate_prices_the_reduce_scatter_and_the_gather(mp):
    """Bytes each rank sends per step (no other collective in this model): dp all-reduces the gradients (fp32:
    reduce_dtype); zero1 adds the all-gather of the (fp32, replicated) parameters after the step; zero2
    reduce-scatters the gradients (fp32) and all-gathers the compute copy (param_dtype) once per step."""
    model, x = _model()
    numel = sum(p.numel() for p in model.parameters())
    compute = 2 if mp is not None else 4
    for d in (2, 4, 8):
        sent = {name: autopar.plan(model, {"dp": d}, (x,), plan=name, mp_policy=mp).estimate.comm_bytes_per_step
                for name in ("dp", "zero1", "zero2")}
        assert sent["dp"] == round(send_bytes("all_reduce", 4 * numel, d))
        assert sent["zero1"] == round(send_bytes("all_reduce", 4 * numel, d) + send_bytes("all_gather", 4 * numel, d))
        assert sent["zero2"] == round(send_bytes("reduce_scatter", 4 * numel, d)
                                      + send_bytes("all_gather", compute * numel, d))
        if mp is None:
            assert sent["zero1"] == round(zero.volume_bytes(4 * numel, d, 1))
            assert sent["zero2"] == round(zero.volume_bytes(4 * numel, d, 2)) == sent["dp"]


def test_plans_round_trip_and_say_what_they_leave_whole():
    """zero1's step directives and zero2's persistent gathers survive the JSON round trip; a parameter with no dim
    that divides over the data ranks is sharded unevenly, and the plan says so; both plans print and explain."""
    from autopar.plan import GATHER_PERSIST, DirectiveKind, Plan
    torch.manual_seed(0)
    model, x = nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 5)), torch.randn(8, 64)
    z1 = autopar.plan(model, {"dp": 2}, (x,), plan="zero1")
    z2 = autopar.plan(model, {"dp": 2}, (x,), plan="zero2")
    for p in (z1, z2):
        assert Plan.from_json(p.to_json()) == p
        assert p.table() and p.explain()
    steps = {(d.node, d.value) for d in z1.directives if d.kind is DirectiveKind.SHARD_STEP}
    assert steps == {("0.weight", "0"), ("0.bias", "0"), ("2.weight", "1"), ("2.bias", "0")}, steps  # (5, 64): dim 1
    # the bias (5,): its step sharded unevenly (3, 2 of its 5 rows), as fsdp and zero2 shard it
    assert any("2.bias (5,): its optimizer step is sharded unevenly (ZeRO-1)" in n for n in z1.notes), z1.notes
    gathers = {d.node: d.value for d in z2.directives if d.kind is DirectiveKind.GATHER}
    assert gathers == dict.fromkeys(("0.weight", "0.bias", "2.weight", "2.bias"), GATHER_PERSIST), gathers
    assert any("2.bias (5,) is FSDP-sharded unevenly on dim 0 over 2 ranks" in n for n in z2.notes), z2.notes
