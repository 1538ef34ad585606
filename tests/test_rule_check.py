"""Every sharding rule, checked numerically op by op, forward and backward, fp64 (see `rule_check.py`).

- `test_rule[...]`: autopar's own rules (`passes.rules.RULES`). One test per op and mesh-axis size:
  every sample of the op (`rule_samples.py`) under every combination of input placements (R, S(d)
  for each dim that divides, P for floating inputs, `_StridedShard` where a sample asks), lowered
  by the real `lower_pass` and run on simulated ranks, against the op on the full inputs.
- `test_dtensor_rule[...]`: the rules derived from DTensor's strategies (`passes.dtensor_rules`),
  used for every op of the graph, checked the same way on the ops of `RULES` and on ops real graphs
  hold that have no autopar rule (`rule_samples.EXTRA_OPS`). By default the first
  `DTENSOR_MAX_SAMPLES` samples of an op try at most `DTENSOR_MAX_COMBOS` placement combinations each,
  on an axis of 2 (DTensor's decomposition-based propagation, e.g. for SDPA, costs ~0.3 s a query);
  `RULECHECK_FULL=1` checks every sample and combination, on axes of 2 and 4.

A failure lists every failing (sample, placements): what the lowered graph did, node by node, and
how far off which output or gradient is, on which rank.
"""

from __future__ import annotations

import os

import pytest
import torch

import autopar  # noqa: F401  (import order: passes.rules needs autopar first)
from autopar.spec import P, R
from passes.dtensor_rules import dtensor_rule
from passes.rules import RULES
from rule_check import Sample, check_sample, rules_replaced
from rule_samples import EXTRA_OPS, samples_for

aten = torch.ops.aten
FULL = os.environ.get("RULECHECK_FULL") == "1"
DTENSOR_MAX_COMBOS = None if FULL else 6
DTENSOR_MAX_SAMPLES = None if FULL else 3
RULE_OPS = sorted(RULES, key=str)
DTENSOR_OPS = RULE_OPS + [op for op in EXTRA_OPS if op not in RULES]


def _cases(ops, worlds):
    return [pytest.param(op, n, id=f"{op}-axis{n}") for n in worlds for op in ops
            if any(n in s.worlds for s in samples_for(op))]


def run(samples, n: int, local_world, max_combos=None) -> list:
    from torch.distributed.device_mesh import init_device_mesh

    from autopar.mesh import mesh_info

    outcomes = []
    with local_world(n):
        info = mesh_info(init_device_mesh("cpu", (n,), mesh_dim_names=("tp",)))
        for sample in samples:
            if n in sample.worlds:
                outcomes += check_sample(sample, n, info, max_combos)
    return outcomes


def assert_all_ok(op, outcomes) -> None:
    assert outcomes, f"no sample of {op} ran"
    bad = [o for o in outcomes if not o.ok]
    if bad:
        lines = "\n".join("  " + o.line() for o in bad)
        pytest.fail(f"{op}: {len(bad)} of {len(outcomes)} placement combinations are wrong:\n{lines}", pytrace=False)


def test_every_rule_has_samples():
    missing = [str(op) for op in RULE_OPS if not samples_for(op)]
    assert not missing, f"ops in RULES without samples in tests/rule_samples.py: {missing}"


@pytest.mark.parametrize("op, n", _cases(RULE_OPS, (2, 4)))
def test_rule(op, n, local_world, fp64):
    assert_all_ok(op, run(samples_for(op), n, local_world))


def _dtensor_everywhere(op):
    return dtensor_rule


_dtensor_everywhere.extra_ops = EXTRA_OPS


@pytest.mark.parametrize("op, n", _cases(DTENSOR_OPS, (2, 4) if FULL else (2,)))
def test_dtensor_rule(op, n, local_world, fp64):
    with rules_replaced(_dtensor_everywhere):
        outcomes = run(samples_for(op)[:DTENSOR_MAX_SAMPLES], n, local_world, DTENSOR_MAX_COMBOS)
    assert_all_ok(op, outcomes)


# Ops with floating inputs and outputs but no gradient to check (the output does not depend on the
# values differentiably, or the op has no derivative): their check is forward only. Ops with integer or
# boolean outputs (comparisons, argmax, one_hot) have no backward at all.
FORWARD_ONLY = {"histc", "bincount", "detach", "zeros_like", "ones_like", "full_like", "new_ones", "new_zeros",
                "new_full", "new_empty", "type_as"}


def test_forward_only_ops_are_the_known_ones(local_world, fp64):
    """Nothing is skipped silently: the samples checked forward only (no gradient flows through the op)
    are exactly those of FORWARD_ONLY."""
    samples = [s for op in DTENSOR_OPS for s in samples_for(op)]
    seen = set()
    for o in run([Sample(**{**s.__dict__, "only": [tuple(R for _ in s.tensors)], "worlds": (2,)}) for s in samples],
                 2, local_world):
        if o.note:
            seen.add(o.sample.name.split("(")[0].split(".")[0])
    assert seen == FORWARD_ONLY


def test_checker_flags_partial_plus_constant(local_world, fp64):
    """The bug the checker was written for, as a rule that keeps `Partial` through `x + eps` (what
    `elementwise_rule` did): every rank adds eps to its summand, so the sum is off by (n - 1) * eps."""
    def keeps_partial(node, tin, ins, n):
        return list(ins), ins[0]

    sample = Sample(aten.add.Tensor, (torch.randn(4, 6, dtype=torch.float64), 1e-6), only=[(P,), (R,)])
    with rules_replaced(lambda op: keeps_partial if op is aten.add.Tensor else RULES.get(op)):
        for n in (2, 4):
            bad, good = run([Sample(**{**sample.__dict__, "worlds": (n,)})], n, local_world)
            assert not bad.ok and bad.kind == "forward" and bad.error == pytest.approx((n - 1) * 1e-6, rel=1e-6), bad.line()
            assert good.ok, good.line()


def test_lowering_buckets_grads_of_the_first_op(local_world, fp64):
    """passes.lower._bucket_parameter_gradients inserts its buckets before the graph's first
    non-placeholder node; when that node is itself one of the bucketed `grad_all_reduce`s (the first op
    of the graph consumes two replicated parameters into a sharded output) it is erased mid-way and the
    graph comes out out of order ("used before it has been defined"). The rule check keeps an unused
    first node in its graphs to stay clear of it; this test builds the graph without it."""
    from torch import fx
    from torch.distributed.device_mesh import init_device_mesh

    from autopar.mesh import mesh_info
    from autopar.spec import Shard
    from passes.lower import LowerContext, lower_pass

    x, w, b = torch.randn(4, 6), torch.randn(8, 6), torch.randn(8)
    g = fx.Graph()
    phs = []
    for name, t in (("x", x), ("w", w), ("b", b)):
        ph = g.placeholder(name)
        ph.meta["val"] = torch.empty_like(t, device="meta")
        phs.append(ph)
    node = g.call_function(aten.linear.default, tuple(phs))
    node.meta["val"] = torch.empty(4, 8, device="meta")
    g.output(node)
    with local_world(2):
        info = mesh_info(init_device_mesh("cpu", (2,), mesh_dim_names=("tp",)))
        ctx = LowerContext(info, {"x": (Shard(0),), "w": (R,), "b": (R,)}, set())
        lower_pass(fx.GraphModule(torch.nn.Module(), g), ctx)
