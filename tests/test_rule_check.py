"""Every sharding rule, checked numerically op by op, forward and backward, fp64 (see `rule_check.py`).

- `test_rule[...]`: every op of `passes.rules.RULES` with hand-written samples (the ops the test models use, own
  rules and DTensor-derived alike; every own rule has samples). The derived rules of the other ops are checked on
  OpInfo-generated samples by the sweep (`rule_sweep.py`, re-checked by `test_rule_sweep_*.py`); here, that the
  committed lists (`passes.checked_ops`) are the sweep's for this torch. One
  test per op and mesh-axis size: every sample of the op (`rule_samples.py`) under every combination of input
  placements (R, S(d) for each dim that divides, P for floating inputs, `_StridedShard` where a sample asks; at
  most `rule_check.MAX_COMBOS` per sample, in a fixed order), lowered by the real `lower_pass` and run on
  simulated ranks, against the op on the full inputs. Axes of 2, and 4 where a sample asks.
- `test_unruled_ops_are_replicated_and_noted`: an op without a rule gathers its sharded inputs, computes right,
  and the lowering notes it.
- `RULECHECK_FULL=1` checks every combination (no cap) and adds `test_dtensor_alternative[...]`: DTensor's
  derived answer for the ops that keep an own rule and for ops without a rule (`rule_samples.EXTRA_OPS`), the
  evidence for moving an op to DTensor or adding one to the table.

A failure lists every failing (sample, placements): what the lowered graph did, node by node, and how far off
which output or gradient is, on which rank.
"""

from __future__ import annotations

import os

import pytest
import torch

import autopar  # noqa: F401  (import order: passes.rules needs autopar first)
from autopar.spec import P, R, Shard
from passes import meta as M
from passes.dtensor_rules import dtensor_rule
from passes.rules import DERIVED, OWN_RULES, RULES
from rule_check import Sample, check_sample, rules_replaced
from rule_samples import EXTRA_OPS, samples_for

aten = torch.ops.aten
FULL = os.environ.get("RULECHECK_FULL") == "1"
MAX_COMBOS = 10**9 if FULL else None  # None: rule_check.MAX_COMBOS
RULE_OPS = sorted((op for op in RULES if samples_for(op)), key=str)
OWN_OPS = sorted(OWN_RULES, key=str)


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
    missing = [str(op) for op in OWN_OPS if not samples_for(op)]
    assert not missing, f"ops with an own rule without samples in tests/rule_samples.py: {missing}"


def test_every_rule_is_own_or_checked():
    """The table holds autopar's own rules and the derived rules the sweep checked, nothing else."""
    from passes.checked_ops import CHECKED

    assert set(RULES) == set(OWN_RULES) | set(DERIVED)
    assert all(RULES[op] is dtensor_rule and str(op) in CHECKED for op in DERIVED)


def test_committed_sweep_is_this_torchs():
    """`passes.checked_ops` names exactly the ops the sweep covers (DTensor's registry as this torch has it); a new
    op, or one gone, asks for the list to be regenerated (`python tests/rule_sweep.py --write`)."""
    from passes.checked_ops import CHECKED, REFUSED, UNSAMPLED
    from rule_sweep import sweep_ops

    committed = set(CHECKED) | set(REFUSED) | set(UNSAMPLED)
    assert len(committed) == len(CHECKED) + len(REFUSED) + len(UNSAMPLED)
    swept = {str(op) for op in sweep_ops()}
    assert committed == swept, (f"new: {sorted(swept - committed)[:20]}; gone: {sorted(committed - swept)[:20]}: "
                                "regenerate passes/checked_ops.py (python tests/rule_sweep.py --write)")


@pytest.mark.parametrize("op, n", _cases(RULE_OPS, (2, 4)))
def test_rule(op, n, local_world, fp64):
    assert_all_ok(op, run(samples_for(op), n, local_world, MAX_COMBOS))


def test_unruled_ops_are_replicated_and_noted(local_world, fp64):
    """An op without a rule: its sharded inputs are gathered (never a guess), the result is right, and the
    lowering notes the replication ("... no sharding rule ...")."""
    ops = [op for op in EXTRA_OPS if op not in RULES]
    assert ops
    for op in ops:
        sample = samples_for(op)[0]
        shard = next(i for i, t in enumerate(sample.tensors) if t.dim() and t.shape[0] % 2 == 0)
        pls = tuple(Shard(0) if i == shard else R for i in range(len(sample.tensors)))
        (o,) = run([Sample(**{**sample.__dict__, "only": [pls], "worlds": (2,)})], 2, local_world)
        assert o.ok, o.line()
        assert any("no sharding rule" in note and str(op) in note for note in o.lowering_notes), (op, o.lowering_notes)


def _dtensor_everywhere(op):
    return dtensor_rule


_dtensor_everywhere.extra_ops = EXTRA_OPS


if FULL:
    @pytest.mark.parametrize("op, n", _cases(OWN_OPS + [op for op in EXTRA_OPS if op not in RULES], (2, 4)))
    def test_dtensor_alternative(op, n, local_world, fp64):
        """What DTensor's derived rule would do for an op that keeps autopar's own rule or has none."""
        with rules_replaced(_dtensor_everywhere):
            outcomes = run(samples_for(op), n, local_world, MAX_COMBOS)
        assert_all_ok(op, outcomes)


# Ops with floating inputs and outputs but no gradient to check (the output does not depend on the
# values differentiably, or the op has no derivative): their check is forward only. Ops with integer or
# boolean outputs (comparisons, argmax, one_hot) have no backward at all.
FORWARD_ONLY = {"histc", "bincount", "detach", "detach_", "zeros_like", "ones_like", "full_like", "new_ones",
                "new_zeros", "new_full", "new_empty", "type_as", "remainder"}


def test_forward_only_ops_are_the_known_ones(local_world, fp64):
    """Nothing is skipped silently: the samples checked forward only (no gradient flows through the op)
    are exactly those of FORWARD_ONLY."""
    samples = [s for op in RULE_OPS + EXTRA_OPS for s in samples_for(op)]
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
    (today,) = run([Sample(**{**sample.__dict__, "only": [(P,)]})], 2, local_world)
    assert today.ok and "all_reduce" in today.decision, today.line()  # the table's rule reduces first


# ----------------------------------------------------------------------------- lowering bugs the checker found

def _one_node_graph(op, named: dict, out_val, args=None):
    from torch import fx

    g = fx.Graph()
    phs = {}
    for name, t in named.items():
        phs[name] = g.placeholder(name)
        phs[name].meta["val"] = torch.empty_like(t, device="meta")
    node = g.call_function(op, tuple(phs[a] if isinstance(a, str) and a in phs else a
                                     for a in (args or list(named))))
    node.meta["val"] = torch.empty_like(out_val, device="meta")
    return g, node


def _lower(local_world, g, placements):
    from torch import fx
    from torch.distributed.device_mesh import init_device_mesh

    from autopar.mesh import mesh_info
    from passes.lower import LowerContext, lower_pass

    with local_world(2):
        info = mesh_info(init_device_mesh("cpu", (2,), mesh_dim_names=("tp",)))
        return lower_pass(fx.GraphModule(torch.nn.Module(), g), LowerContext(info, placements, set()))


def test_lowering_buckets_grads_of_the_first_op(local_world, fp64):
    """`bucket_gradients_pass` used to insert its buckets before the graph's first non-placeholder node; when that
    node was itself one of the bucketed `grad_all_reduce`s (the first op of the graph consumes two replicated
    parameters into a sharded output) it was erased mid-way and the graph came out of order ("used before it has
    been defined"). Each bucket now goes before its parameters' first use, parameters in reverse order of first use
    (b's reduction was traced after w's)."""
    from autopar.runtime import collectives as C

    x, w, b = torch.randn(4, 6), torch.randn(8, 6), torch.randn(8)
    g, node = _one_node_graph(aten.linear.default, {"x": x, "w": w, "b": b}, torch.randn(4, 8))
    g.output(node)
    gm = _lower(local_world, g, {"x": (Shard(0),), "w": (R,), "b": (R,)})
    (bucket,) = [n for n in gm.graph.nodes if n.target is C.grad_sync_bucket]
    assert [a.name for a in bucket.args[0]] == ["b", "w"]
    linear = next(n for n in gm.graph.nodes if n.target is aten.linear.default)
    assert [a.args for a in linear.args[1:]] == [(bucket, 1), (bucket, 0)]
    gm.graph.lint()


def test_in_place_write_into_a_redistributed_view_is_refused(local_world, fp64):
    """`buf[:, :4].copy_(src)` writes through a view: were the view redistributed (a copy), `buf` would never see
    the write. Where a rule asks for that, the lowering refuses with a clear error instead of a wrong result."""
    def gathers_self(node, tin, ins, n):
        return [R] * len(ins), R

    def graph():
        buf, src = torch.randn(4, 8), torch.randn(4, 4)
        g, view = _one_node_graph(aten.slice.Tensor, {"buf": buf}, buf[:, :4], ["buf", 1, 0, 4])
        src_ph = g.placeholder("src")
        src_ph.meta["val"] = torch.empty_like(src, device="meta")
        write = g.call_function(aten.copy_.default, (view, src_ph))
        write.meta["val"] = torch.empty_like(src, device="meta")
        g.output(view.args[0])
        return g

    placed = {"buf": (Shard(0),), "src": (Shard(0),)}
    with rules_replaced(lambda op: gathers_self if op is aten.copy_.default else RULES.get(op)):
        with pytest.raises(NotImplementedError, match="writes in place into slice.*a view of another tensor.*Fix:"):
            _lower(local_world, graph(), placed)
    gm = _lower(local_world, graph(), placed)  # the table's copy_ (DTensor's) writes into the view as it is
    assert next(n for n in gm.graph.nodes if n.target is aten.copy_.default).meta[M.PLACEMENTS] == (Shard(0),)
