"""Part 4 of 4 of the committed rule sweep, re-checked (`tests/rule_sweep.py`: every op of `passes.checked_ops` with
OpInfo samples, round-robin in 4 files so that xdist spreads them). A checked op must still pass every case; a
refused op must still fail one (else regenerate the list: `python tests/rule_sweep.py --write`)."""

from __future__ import annotations

import pytest

from rule_sweep import chunk
from sweep_checks import check_committed

CHUNK = 4


@pytest.mark.parametrize("name", chunk(CHUNK))
def test_committed_rule(name, local_world, fp64):
    check_committed(name, CHUNK, local_world)
