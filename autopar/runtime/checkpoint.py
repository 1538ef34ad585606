"""A checkpointed layer at run time: its lowered nodes (outlined by `passes.checkpoint`) run under non-reentrant
`torch.utils.checkpoint.checkpoint`.

- `full`: checkpoint keeps the region's inputs; backward runs the region's forward again (its collectives are
  issued again: `record_comms` records them with pass "recompute") and uses what that recomputes. Early stop
  is off: the recompute runs the whole region (what `autopar.solver` prices), not only up to the last tensor
  backward needs (which would skip, e.g., a tensor-parallel layer's last all-reduce: a possible saving left).
- `selective`: `create_selective_checkpoint_contexts` with `policy()`: the outputs of the ops in
  `autopar.forms.checkpoint.saved_ops()` (every other matmul, SDPA) are kept, every other op
  (collectives included) is recomputed. Ring attention (an autograd Function whose blocks' score matrices a matmul policy
  would keep, O(s^2) each) and the MoE experts (per-expert matmuls whose number and sizes follow the routing) run
  whole again in the recompute: nothing inside them is kept.
- RNG: `preserve_rng_state=True` restores the global generators before the recompute, and autopar's dropout
  derives its masks from (stream, step, node), which do not change between a forward and its backward: every
  dropout draws the same mask again.
- Without grad (eval, `torch.no_grad`), the region just runs.
"""

from __future__ import annotations

import contextlib
import functools

import torch
from torch import fx, nn
from torch.utils.checkpoint import (CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts,
                                    set_checkpoint_early_stop)

from autopar.forms.checkpoint import LEVELS, SELECTIVE, keeps_matmul, matmul_ops, saved_ops
from autopar.runtime import collectives as C

_OPAQUE = [0]  # depth of whole-recomputed calls (ring attention) in progress


def whole(fn):
    """`fn` with nothing inside it kept by the selective policy (recomputed whole)."""
    @functools.wraps(fn)
    def run(*args, **kwargs):
        _OPAQUE[0] += 1
        try:
            return fn(*args, **kwargs)
        finally:
            _OPAQUE[0] -= 1
    run.__autopar_whole__ = fn
    return run


@functools.lru_cache(maxsize=None)
def _saved() -> frozenset:
    return saved_ops()


@functools.lru_cache(maxsize=None)
def _matmuls() -> frozenset:
    return matmul_ops()


def policy():
    """Selective checkpointing of one region's forward: keep every other matmul output (`keeps_matmul`, counted in
    the forward and again in the recompute, so both make the same choices) and the attention outputs,
    recompute the rest."""
    counts = {False: 0, True: 0}

    def decide(ctx, func, *args, **kwargs) -> CheckpointPolicy:
        if _OPAQUE[0] or func not in _saved():
            return CheckpointPolicy.PREFER_RECOMPUTE
        if func in _matmuls():
            counts[ctx.is_recompute] += 1
            if not keeps_matmul(counts[ctx.is_recompute]):
                return CheckpointPolicy.PREFER_RECOMPUTE
        return CheckpointPolicy.MUST_SAVE
    return decide


class Checkpointed(nn.Module):
    """A layer's lowered nodes (`body`), run under activation checkpointing at `level`."""

    def __init__(self, body: fx.GraphModule, level: str, path: str):
        super().__init__()
        self.body = body
        self.level = LEVELS[level].name
        self.path = path
        self.recomputes = 0  # how many times backward ran the body again (tests, benchmarks)
        self.last_storage = None  # selective: what the last forward kept (the policy's cache), for measurement

    def forward(self, *args):
        if not torch.is_grad_enabled():
            return self.body(*args)
        calls = [0]

        def run(*a):
            calls[0] += 1
            if calls[0] == 1:
                return self.body(*a)
            self.recomputes += 1
            with C.recomputing():
                return self.body(*a)

        if self.level == SELECTIVE.name:
            def context():
                fwd, rec = create_selective_checkpoint_contexts(policy())
                self.last_storage = fwd.storage
                return fwd, rec
        else:
            context = _noop_contexts
        with set_checkpoint_early_stop(False):  # the whole region again: every forward collective, as priced
            return checkpoint(run, *args, use_reentrant=False, preserve_rng_state=True, context_fn=context)


def _noop_contexts():
    return contextlib.nullcontext(), contextlib.nullcontext()


__all__ = ["Checkpointed", "policy", "whole"]
