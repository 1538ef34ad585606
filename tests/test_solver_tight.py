"""`auto` at a memory limit just above and below the least any plan needs (issue #24: a tight limit was once seen
crashing in `solver._priced` with `'NoneType' object has no attribute 'choices'`). The sweep on small models (GPT and
Llama on meta, 2 layers; tests/test_fsdp_dims.py's) did not reproduce it; the one way there is the ILP without the
limit returning no solution (`_solve_one`: CP-SAT out of time before a first solution, on a busy host), which
`_priced` and the no-fit report then read. Here it is made to happen: the plan (or the InfeasibleError) must come back
all the same."""

from __future__ import annotations

import pytest
import torch

import autopar
from autopar import solver
from autopar.models import GPT, GPTConfig


def _gpt():
    with torch.device("meta"):
        model = GPT(GPTConfig(vocab_size=1000, seq_len=64, num_layers=2, num_heads=4, hidden=64))
        ids = torch.zeros(8, 64, dtype=torch.long)
    return model, (ids, ids)


def test_tight_limits_plan_or_say_the_least_even_when_the_unlimited_solve_times_out(monkeypatch):
    model, inputs = _gpt()
    real, unlimited = solver._solve_one, []

    def timed_out(*args, **kwargs):  # the solve without the limit (2**62) finds nothing in time
        if args[5] == 2.0**62:
            unlimited.append(1)
            return None, 0.0
        return real(*args, **kwargs)

    monkeypatch.setattr(solver, "_solve_one", timed_out)
    with pytest.raises(autopar.InfeasibleError, match="the least memory any plan needs") as e:  # below: the report
        autopar.plan(model, {"dp": 2, "tp": 4}, inputs, cluster="h100", memory_limit=1)
    least, before = e.value.least_bytes, len(unlimited)
    assert before, "the no-fit report never asked for the unlimited solve"
    # just above the least: it fits with some structure off its fastest form, so `_priced` asks for the unlimited solve
    p = autopar.plan(model, {"dp": 2, "tp": 4}, inputs, cluster="h100", memory_limit=least * 1.0001)
    assert p.estimate.fits and p.estimate.memory_bytes_per_device <= least * 1.0001, p.estimate
    assert p.explain()
    assert len(unlimited) > before, "the unlimited solve was never asked for: the test does not reach _priced's path"
