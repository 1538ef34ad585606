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
