"""Measuring memory on CPU, where allocator statistics are not available: what autograd saves for backward
(unique storages seen by `saved_tensors_hooks`) and the peak of live tensor storages during a training step
(`LiveStorages`, a TorchDispatchMode that tracks every storage an op returns until it is freed).

Used by tests/test_memory_estimate.py and benchmarks/memory_fidelity.py to check `Plan.estimate`'s memory."""

from __future__ import annotations

import torch
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils import _pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode

from autopar.runtime.collectives import idle_pooled


def local(t: torch.Tensor, rank: int = 0) -> torch.Tensor:
    """The tensor a rank holds: a DTensor's local shard; under LocalTensorMode, `rank`'s tensor."""
    if hasattr(t, "to_local"):
        t = t.to_local()
    lt = getattr(t, "_local_tensors", None)
    return lt[rank] if lt is not None else t


def _key(t: torch.Tensor) -> tuple[int, int]:
    s = t.untyped_storage()
    return s.data_ptr(), s.nbytes()


class SavedStorages:
    """`with SavedStorages(exclude) as s: loss = pm(*x)`: `s.bytes` is the bytes of the unique storages autograd
    saved for backward on this rank (rank 0 under LocalTensorMode), those of `exclude` (parameters) left out."""

    def __init__(self, exclude=(), rank: int = 0):
        self.rank = rank
        self.exclude = {_key(local(t, rank))[0] for t in exclude}
        self.storages: dict[int, int] = {}

    def _pack(self, t):
        ptr, nbytes = _key(local(t, self.rank))
        if ptr not in self.exclude:
            self.storages[ptr] = nbytes
        return t

    def __enter__(self):
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, lambda t: t)
        self._hooks.__enter__()
        return self

    def __exit__(self, *exc):
        self._hooks.__exit__(*exc)

    @property
    def bytes(self) -> int:
        return sum(self.storages.values())


class LiveStorages(TorchDispatchMode):
    """Peak bytes of live tensor storages: those of `existing` (parameters, optimizer state, inputs) plus every
    storage an op returns, until it is freed (checked before each op). Views count once (by storage).

    A flat buffer of the runtime's CPU pool (`autopar.runtime.collectives.pooled_empty`) counts while it is in use:
    from the op that fills it (a bucket's `cat(out=)`) until only the pool holds it (`idle_pooled`), as a caching
    allocator's allocated bytes (CUDA's `memory_allocated`) count a block only while it is handed out. Kept idle
    between steps it is reserved, not allocated (counting it from the start would add a whole gradient copy to the
    forward and the start of the backward, where the small models peak): the estimate prices allocated bytes, and
    on a GPU the runtime does not pool."""

    def __init__(self, existing=()):
        super().__init__()
        self.live: dict[int, tuple[StorageWeakRef, int]] = {}
        self.current = 0
        for t in existing:
            self._add(t)
        self.base = self.peak = self.current
        self.at_peak = ""  # the op after which the peak was reached, and the sizes then live (for diagnosis)

    def _add(self, t) -> None:
        if not isinstance(t, torch.Tensor) or t.device.type == "meta" or hasattr(t, "_local_tensors"):
            return
        try:
            s = t.untyped_storage()
            ptr = s.data_ptr()
        except RuntimeError:  # a wrapper subclass without storage (an async collective's result): its inner tensor
            return  # came from an op, and is counted there
        if ptr in self.live or s.nbytes() == 0:
            return
        self.live[ptr] = (StorageWeakRef(s), s.nbytes())
        self.current += s.nbytes()

    def _prune(self) -> None:
        idle = idle_pooled()
        for k, (ref, n) in list(self.live.items()):
            if ref.expired() or k in idle:
                del self.live[k]
                self.current -= n

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self._prune()
        out = func(*args, **(kwargs or {}))
        for t in pytree.tree_leaves(out):
            self._add(t)
        if self.current > self.peak:
            self.peak = self.current
            self.at_peak = f"{func}: " + ", ".join(str(n) for _, n in sorted(self.live.values(), key=lambda v: -v[1])[:12])
        return out


def optimizer_tensors(opt: torch.optim.Optimizer) -> list[torch.Tensor]:
    return [local(v) for state in opt.state.values() for v in state.values()
            if isinstance(v, torch.Tensor) and v.dim() > 0]


def predicted_saved_bytes(plan) -> float:
    """What the estimate says autograd saves on one rank: every structure's activations and FSDP's gathered
    parameters (kept from forward for backward)."""
    return sum(s.activations_bytes + s.transient_bytes for s in plan.estimate.sites)


def measured_step(pm, x, opt: torch.optim.Optimizer) -> tuple[SavedStorages, LiveStorages]:
    """One warm-up training step (so the optimizer's state exists), then a measured one: what autograd saved in its
    forward (parameters excluded) and the peak of live storages over forward, backward and the optimizer step."""
    pm(*x).backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    params = [local(p) for p in pm.parameters()]
    with LiveStorages(params + optimizer_tensors(opt) + list(x)) as live:
        with SavedStorages(params) as saved:
            loss = pm(*x)
        loss.backward()
        del loss
        opt.step()
        opt.zero_grad(set_to_none=True)
    return saved, live
