"""The committed rule sweep re-checked (`tests/rule_sweep.py`, `passes.checked_ops`): every op of one part of the
committed ops with OpInfo samples, a different part of `rule_sweep.CHUNKS` each UTC day (so each op is re-checked
within CHUNKS days; `RULE_SWEEP_PART=k` picks part k, `RULECHECK_FULL=1` checks every part). A checked op must still
pass every case; a refused op must still fail one (else regenerate: `python tests/rule_sweep.py --write`). The whole
sweep costs ~5 CPU minutes, too much for every `make test`; one part ~40 s."""

from __future__ import annotations

import datetime
import os

import pytest

from rule_sweep import CHUNKS, chunk, recheck


def _parts() -> list[int]:
    if os.environ.get("RULECHECK_FULL") == "1":
        return list(range(1, CHUNKS + 1))
    if os.environ.get("RULE_SWEEP_PART"):
        return [int(os.environ["RULE_SWEEP_PART"])]
    return [datetime.datetime.now(datetime.timezone.utc).date().toordinal() % CHUNKS + 1]


CASES = [pytest.param(name, k, id=f"part{k}-{name}") for k in _parts() for name in chunk(k)]


def test_parts_cover_the_committed_ops():
    from passes.checked_ops import CHECKED, REFUSED

    parts = [set(chunk(k)) for k in range(1, CHUNKS + 1)]
    assert set().union(*parts) == {n for n, src in CHECKED.items() if src} | set(REFUSED)
    assert sum(map(len, parts)) == len(set().union(*parts))


@pytest.mark.parametrize("name, k", CASES)
def test_committed_rule(name, k, local_world, fp64):
    from passes.checked_ops import REFUSED

    ran, bad = recheck(name, k, local_world)
    assert ran, f"{name}: no case ran (its OpInfo samples are gone: regenerate passes/checked_ops.py)"
    if name in REFUSED:
        assert bad, (f"{name} is refused in passes/checked_ops.py ({REFUSED[name][:200]}) but its {ran} cases pass "
                     "now: regenerate the list (python tests/rule_sweep.py --write)")
    elif bad:
        lines = "\n".join("  " + b for b in bad)
        pytest.fail(f"{name}: {len(bad)} of {ran} cases of its checked rule are wrong:\n{lines}", pytrace=False)


@pytest.mark.parametrize("op, table, key", [
    ("aten.broadcast_tensors.default", "DENY", "aten.broadcast_tensors.default"),  # DTensor's answer is wrong
    ("aten.cumsum.default", "DIM_ARG", "aten.cumsum.default"),  # DTensor mishandles a negative scan dim
])
def test_the_sweep_refuses_a_wrong_dtensor_answer(op, table, key, local_world, fp64, monkeypatch):
    """The sweep's check is what refuses: with the known fix of a DTensor bug undone (`passes.dtensor_rules`),
    DTensor's raw answer for the op fails some case, so the op would be refused, never trusted."""
    from passes import dtensor_rules as D
    from passes.rules import op_named
    from rule_samples import samples_for
    from rule_sweep import check_op

    target = op_named(op)
    monkeypatch.setattr(D, table, {k: v for k, v in getattr(D, table).items() if k is not target})
    monkeypatch.setattr(D, "_CACHE", {})
    ran, bad, _ = check_op(target, samples_for(target), local_world)
    assert ran and bad, f"{op}: {ran} cases, none wrong"
