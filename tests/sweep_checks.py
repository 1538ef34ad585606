"""The assertion of `tests/test_rule_sweep_*.py`: a committed op's check comes out as `passes.checked_ops` says."""

from __future__ import annotations

import pytest

from rule_sweep import recheck


def check_committed(name: str, k: int, local_world) -> None:
    from passes.checked_ops import REFUSED

    ran, bad = recheck(name, k, local_world)
    assert ran, f"{name}: no case ran (its OpInfo samples are gone: regenerate passes/checked_ops.py)"
    if name in REFUSED:
        assert bad, (f"{name} is refused in passes/checked_ops.py ({REFUSED[name][:200]}) but its {ran} cases pass "
                     "now: regenerate the list (python tests/rule_sweep.py --write)")
    elif bad:
        lines = "\n".join("  " + b for b in bad)
        pytest.fail(f"{name}: {len(bad)} of {ran} cases of its checked rule are wrong:\n{lines}", pytrace=False)
