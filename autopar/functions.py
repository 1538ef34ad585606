"""Custom `torch.autograd.Function`s at capture: their own backward is kept.

`torch.export` traces a Function's forward into ATen ops and drops its backward: the lowered program
would differentiate the forward instead (a straight-through estimator, `round` forward and identity
backward, would get zero gradients). During capture, `custom_functions` intercepts `Function.apply` for
Functions defined outside torch and autopar:

- no tensor argument requires a gradient: the backward never runs; traced as usual;
- its backward is checked against the derivative of its forward on random inputs of the traced shapes
  (fp64, on the CPU, two draws of different scale, random output gradients): where they agree (e.g.
  Bloom's GeLU with its closed-form backward), tracing the forward loses nothing and keeps the parallel
  forms around it;
- otherwise (they differ, or the check cannot run: integer inputs, a kernel that needs an accelerator)
  the call becomes one opaque node (`autopar::opaque`, `autopar.runtime.opaque`) that runs the Function
  itself: forward calls `apply`, backward re-runs it under autograd and differentiates through the
  Function's own backward. Like every opaque node it is checked for independent rows (`passes.batch_local`:
  its forward and its own backward, on random inputs of the traced shapes): batch-local (a straight-through
  rounding), it runs on each rank's rows of the batch on a data axis; else (its backward mixes rows) it is
  replicated on every rank (inputs gathered). The capture notes say which and why.

The re-run in backward means a Function whose forward draws random numbers sees other draws there.
"""

from __future__ import annotations

import contextlib

import torch
from torch import nn
from torch.autograd.function import Function
from torch.utils import _pytree as pytree

_INTERNAL = ("torch", "autopar", "passes", "cost_model", "functorch")
_APPLY = Function.__dict__["apply"].__func__


def _foreign(cls) -> bool:
    return (cls.__module__ or "").split(".")[0] not in _INTERNAL


class _FunctionCall(nn.Module):
    """`cls.apply` on the tensors given, with the call's other arguments fixed (what the opaque node runs)."""

    def __init__(self, cls, spec: pytree.TreeSpec, leaves: list, tensor_at: list[int]):
        super().__init__()
        self.cls, self.spec, self.leaves, self.tensor_at = cls, spec, leaves, tensor_at

    def forward(self, *tensors):
        leaves = list(self.leaves)
        for i, t in zip(self.tensor_at, tensors):
            leaves[i] = t
        args, kwargs = pytree.tree_unflatten(leaves, self.spec)
        return self.cls.apply(*args, **kwargs)


def _random_like(t: torch.Tensor, scale: float, gen: torch.Generator) -> torch.Tensor:
    return (torch.randn(tuple(t.shape), dtype=torch.float64, generator=gen) * scale).requires_grad_(t.requires_grad)


class _PlainCtx:
    """A stand-in `ctx` for calling `forward` outside `apply` (what tracing differentiates)."""

    def __init__(self, needs):
        self.needs_input_grad = needs
        self.saved_tensors = ()

    def save_for_backward(self, *ts):
        self.saved_tensors = ts

    def mark_non_differentiable(self, *ts):
        pass

    def mark_dirty(self, *ts):
        pass

    def set_materialize_grads(self, value):
        pass


def backward_mismatch(cls, args: tuple, kwargs: dict) -> str | None:
    """None if `cls`'s backward equals the derivative of its forward on random inputs shaped like the traced
    ones; else why not (or why it could not be checked)."""
    from torch.utils._python_dispatch import _disable_current_modes

    leaves, spec = pytree.tree_flatten((args, kwargs))
    tensor_at = [i for i, x in enumerate(leaves) if isinstance(x, torch.Tensor)]
    if any(not leaves[i].is_floating_point() for i in tensor_at):
        return "it takes integer tensors, so its backward could not be compared with its forward's derivative"
    gen = torch.Generator().manual_seed(0)
    try:
        with _disable_current_modes(), torch.enable_grad():
            for scale in (1.0, 4.0):
                real = list(leaves)
                for i in tensor_at:
                    real[i] = _random_like(leaves[i], scale, gen)
                a, k = pytree.tree_unflatten(real, spec)
                wrt = [real[i] for i in tensor_at if real[i].requires_grad]
                own = [o for o in pytree.tree_leaves(_APPLY(cls, *a, **k)) if isinstance(o, torch.Tensor)]
                if cls.setup_context is torch.autograd.function._SingleLevelFunction.setup_context:
                    plain = cls.forward(_PlainCtx(tuple(isinstance(x, torch.Tensor) and x.requires_grad for x in a)),
                                        *a, **k)
                else:
                    plain = cls.forward(*a, **k)
                plain = [o for o in pytree.tree_leaves(plain) if isinstance(o, torch.Tensor)]
                if len(own) != len(plain):
                    return "its forward returns other outputs outside apply, so it could not be checked"
                grads = [torch.randn(o.shape, dtype=o.dtype, generator=gen) if o.is_floating_point() else None
                         for o in own]
                for x, go, gp in zip(wrt, _grads(own, grads, wrt), _grads(plain, grads, wrt)):
                    go = torch.zeros_like(x) if go is None else go
                    gp = torch.zeros_like(x) if gp is None else gp
                    if not torch.allclose(go, gp, rtol=1e-6, atol=1e-9 * scale):
                        return (f"its backward is not the derivative of its forward (gradients differ by up to "
                                f"{float((go - gp).abs().max()):.3g} on random inputs)")
    except Exception as e:  # noqa: BLE001 - a check that cannot run keeps the Function's own backward
        return f"its backward could not be compared with its forward's derivative ({type(e).__name__}: {e})"
    return None


def _grads(outs, cotangents, wrt):
    pairs = [(o, g) for o, g in zip(outs, cotangents) if g is not None and o.requires_grad]
    if not pairs:
        return [None] * len(wrt)
    return torch.autograd.grad([o for o, _ in pairs], wrt, [g for _, g in pairs], allow_unused=True)


@contextlib.contextmanager
def custom_functions(found: list[tuple[str, str]]):
    """While tracing: Functions whose backward is not their forward's derivative become opaque nodes.
    `found` collects (opaque key, reason) for each."""
    from torch.fx.experimental.proxy_tensor import disable_proxy_modes_tracing

    from autopar.runtime import opaque

    checked: dict[tuple, str | None] = {}

    def apply(cls, *args, **kwargs):
        leaves, spec = pytree.tree_flatten((args, kwargs))
        tensor_at = [i for i, x in enumerate(leaves) if isinstance(x, torch.Tensor)]
        if not _foreign(cls) or not any(leaves[i].requires_grad for i in tensor_at):
            return _APPLY(cls, *args, **kwargs)
        sig = (cls, spec, tuple((tuple(leaves[i].shape), leaves[i].dtype, leaves[i].requires_grad)
                                if i in tensor_at else repr(x) for i, x in enumerate(leaves)))
        if sig not in checked:
            checked[sig] = backward_mismatch(cls, args, kwargs)
        why = checked[sig]
        if why is None:
            return _APPLY(cls, *args, **kwargs)  # the traced forward's derivative is the Function's backward
        with disable_proxy_modes_tracing():  # output shapes, on the trace's fake tensors
            example = _APPLY(cls, *args, **kwargs)
        call = _FunctionCall(cls, spec, [None if i in tensor_at else x for i, x in enumerate(leaves)], tensor_at)
        key = opaque.register(f"{cls.__module__}.{cls.__qualname__}", call, example, why)
        found.append((key, why))
        outs = torch.ops.autopar.opaque(key, [leaves[i] for i in tensor_at], [])
        return pytree.tree_unflatten(list(outs), opaque.describe(key).out_spec)

    original = Function.__dict__["apply"]
    Function.apply = classmethod(apply)
    try:
        yield
    finally:
        Function.apply = original
