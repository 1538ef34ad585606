"""The model `parallelize` was given keeps its own parameters, which the ParallelModule does not use.

`ParallelModule` holds new parameters (DTensors under the same names); the original model's stay as they
were and never get a gradient from `pm(...).backward()`. An optimizer built on them (`AdamW(model.parameters())`
instead of `AdamW(pm.parameters())`) would step nothing, silently. `mark_replaced` records the original
parameters (weakly); a global optimizer step pre-hook (`torch.optim.optimizer.register_optimizer_step_pre_hook`)
raises when an optimizer steps such parameters and none of them has a gradient (the mistake's signature:
a user who also trains the original model on its own has gradients there and is left alone).
"""

from __future__ import annotations

import torch
from torch.optim.optimizer import register_optimizer_step_pre_hook
from torch import nn
from torch.utils.weak import WeakIdKeyDictionary

_REPLACED = WeakIdKeyDictionary()  # original parameter -> (model class name, fqn)
_HOOK = None


def mark_replaced(model: nn.Module, pm: nn.Module) -> None:
    """Remember `model`'s parameters as replaced by `pm`'s; install the step guard once."""
    global _HOOK
    for fqn, p in model.named_parameters():
        if p is not pm.get_parameter(fqn):
            _REPLACED[p] = (type(model).__name__, fqn)
    if _HOOK is None:
        _HOOK = register_optimizer_step_pre_hook(_refuse_replaced)


def _refuse_replaced(optimizer: torch.optim.Optimizer, args, kwargs) -> None:
    if not len(_REPLACED):
        return
    stale = [_REPLACED[p] for group in optimizer.param_groups for p in group["params"] if p in _REPLACED]
    if not stale or any(p.grad is not None for group in optimizer.param_groups for p in group["params"]
                        if p in _REPLACED):
        return
    model, fqn = stale[0]
    raise RuntimeError(
        f"{type(optimizer).__name__}.step() was called on parameters of the {model} that autopar.parallelize "
        f"replaced ({len(stale)} of them, e.g. {fqn!r}). The ParallelModule trains its own parameters (DTensors "
        "under the same names); the original model's never get a gradient, so this step would change nothing. "
        f"Fix: build the optimizer on the ParallelModule, e.g. torch.optim.{type(optimizer).__name__}"
        "(pm.parameters(), ...), after calling parallelize.")
