"""A model converted by torchao (`Float8Linear` modules, recognised by class path; torchao is not a dependency and
not imported) is refused before capture (`autopar.prepare.check_not_torchao_float8`, in the `_prepare` that plan
and parallelize share), with what to do instead."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import autopar


def _converted() -> nn.Module:
    """A stand-in for torchao's `Float8Linear` (same class path and name; torchao is not installed here)."""
    cls = type("Float8Linear", (nn.Linear,), {"__module__": "torchao.float8.float8_linear"})
    model = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 8))
    model[0].__class__ = cls
    return model


def test_torchao_converted_model_is_refused_clearly():
    model, x = _converted(), torch.randn(4, 8)
    with pytest.raises(NotImplementedError, match=r"1 torchao Float8Linear module\(s\) \('0': torchao\.float8\."
                                                  r"float8_linear\.Float8Linear\).*Fix: pass the unconverted model"):
        autopar.plan(model, {"dp": 2}, (x,), plan="dp")
    plain = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 8))
    assert autopar.plan(plain, {"dp": 2}, (x,), plan="dp").estimate is not None  # a plain model is planned
