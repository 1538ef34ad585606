"""A data-parallel mean loss whose global count is waited for in the backward, not the forward (issue #22 item 5).

Under plan="dp" the fused mean cross-entropy all-reduces each rank's (sum, count[, the call's agreement row])
(`ops.cross_entropy_sum_count`, `ops.sum_over_count`) and divides after it: the forward's one synchronisation of
the ranks, where the faster rank waits for the slower, and then waits again at the end of the backward. DDP's forward
has none. Here, where it is exact (`defers_loss`), that all-reduce is issued and not waited for:

- the backward starts from this rank's local sum: the gradient of the loss with respect to the local sum is `g`,
  not `g / N` (N the global count, not known yet);
- each gradient bucket (`collectives._GradSyncBucket`) is all-reduced undivided and divided by N once reduced,
  where the count's all-reduce, issued before any bucket's on the same group, has long completed. Exact: every
  program gradient is (g / N) * sum_r d(sum_r)/dtheta, and every one of the program's contributions to a parameter
  gradient flows through a bucket (`defers_loss` checks the graph: parameters reach the program only through
  exclusive buckets, no other collective, the loss the only output), while the user's own terms ((loss + reg) with
  reg on the parameters) reach the parameters outside the program and are not divided;
- the returned loss is a `LazyLoss`: a 0-dim tensor subclass (as `AsyncCollectiveTensor`) that waits for the
  all-reduce, checks the call's agreement and divides when first read (any op but the autograd seed's `ones_like`);
- the call's agreement (`agree.SummedAgreement`) riding on that all-reduce is checked before any result reaches the
  user: at the loss's first read, or before the first bucket's gradients are divided (and so before any `.grad` is
  written). Every rank sums the same row, so every rank raises at the same point.

Not deferred (today's path, the count waited for in the forward): no_grad or eval calls, inputs requiring grad, a
program with another output or collective, mixed-precision reductions, simulated ranks (`LocalTensorMode`),
compiling, and `ParallelModule.defer_loss = False`.
"""

from __future__ import annotations

import operator

import torch
from torch.utils._pytree import tree_map_only

from autopar.mesh import AxisRef
from autopar.runtime import collectives as C


class DeferredCount:
    """One call's (sum, count[, agreement row]) all-reduce, issued in the forward and waited for at first use."""

    __slots__ = ("axis", "issued", "pending", "agreement", "_summed", "_error")

    def __init__(self):
        self.axis: AxisRef | None = None
        self.issued: bool | torch.Tensor = False  # the pair, between the loss's all_reduce node and its issue
        self.pending: torch.Tensor | None = None  # the functional all-reduce's output, in flight
        self.agreement = None  # the `SummedAgreement` whose row rides in the pair
        self._summed: torch.Tensor | None = None
        self._error: BaseException | None = None

    def issue(self, pair: torch.Tensor, agreement) -> None:
        """Start the all-reduce of this rank's pair; no wait. (The pair is not kept: it holds the graph.)"""
        self.issued = True
        C._record("all_reduce", self.axis, pair, pair.numel(), False)
        self.pending = C._c10d.all_reduce(pair.detach().contiguous(), "sum", self.axis.group_name)
        self.agreement = agreement

    def summed(self) -> torch.Tensor:
        """The summed pair, after the wait and the agreement's check (raising on every rank alike if the ranks
        differ; again at every later use)."""
        if self._error is not None:
            raise self._error
        if self._summed is None:
            got = C._wait(self.pending)
            if self.agreement is not None:
                try:
                    self.agreement.check(got.tolist())
                except BaseException as e:
                    self._error = e
                    raise
            self._summed, self.pending = got, None
        return self._summed

    def count(self) -> float:
        return float(self.summed()[1])


# Ops on a LazyLoss that need only its metadata: the autograd seed (`torch.autograd.backward`'s `ones_like`).
_NO_VALUE = {torch.ops.aten.ones_like.default, torch.ops.aten.zeros_like.default,
             torch.ops.aten.empty_like.default, torch.ops.aten.full_like.default}


class LazyLoss(torch.Tensor):
    """The mean loss, replicated, as a 0-dim tensor whose value is computed at first use: the count's all-reduce
    waited for, the agreement checked, sum / count. Every op on it (item, detach, +, print) returns plain tensors."""

    __slots__ = ("deferred", "_value")
    __torch_function__ = torch._C._disabled_torch_function_impl

    @staticmethod
    def __new__(cls, deferred: DeferredCount, dtype: torch.dtype, device: torch.device):
        r = torch.Tensor._make_wrapper_subclass(cls, (), dtype=dtype, device=device)
        r.deferred, r._value = deferred, None
        return r

    def value(self) -> torch.Tensor:
        if self._value is None:
            got = self.deferred.summed()
            self._value = (got[0] / got[1]).to(self.dtype)  # as `ops.sum_over_count`
        return self._value

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        if func in _NO_VALUE:
            def unwrap(e):
                return torch.empty((), dtype=e.dtype, device=e.device)
        else:
            def unwrap(e):
                return e.value()
        return func(*tree_map_only(LazyLoss, unwrap, args), **tree_map_only(LazyLoss, unwrap, kwargs or {}))

    def __repr__(self) -> str:  # type: ignore[override]
        return repr(self.value())

    def tolist(self):
        return self.value().tolist()

    def numpy(self, *args, **kwargs):
        return self.value().numpy(*args, **kwargs)

    def __reduce_ex__(self, protocol):
        return self.value().__reduce_ex__(protocol)


class _DeferredMean(torch.autograd.Function):
    """pair (this rank's (sum, count[, row])) -> the LazyLoss; backward: the loss's gradient to the local sum as is
    (the buckets divide by the global count)."""

    @staticmethod
    def forward(ctx, pair, deferred, agreement, out_dtype):
        ctx.shape, ctx.dtype = pair.shape, pair.dtype
        deferred.issue(pair, agreement)
        return LazyLoss(deferred, out_dtype, pair.device)

    @staticmethod
    def backward(ctx, g):
        rest = torch.zeros(ctx.shape[0] - 1, dtype=ctx.dtype, device=g.device)
        return torch.cat([g.reshape(1).to(ctx.dtype), rest]), None, None, None


def deferred_mean(pair: torch.Tensor, deferred: DeferredCount, agreement, out_dtype: torch.dtype) -> torch.Tensor:
    return _DeferredMean.apply(pair, deferred, agreement, out_dtype)


def defers_loss(gm: torch.fx.GraphModule, params: set[str]) -> bool:
    """Whether the program's gradients are exact with its loss's count deferred (module docstring): its one output is
    `sum_over_count(all_reduce(cross_entropy_sum_count(...)))`, it runs only ATen ops besides (no other collective),
    and every parameter (`params`: their placeholders' names) feeds gradient buckets (`grad_sync_bucket`, exclusive,
    no mixed-precision reduction) and nothing else."""
    from autopar.runtime import ops
    nodes = list(gm.graph.nodes)
    (out,) = [n for n in nodes if n.op == "output"]
    results = out.args[0] if isinstance(out.args[0], (tuple, list)) else (out.args[0],)
    if len(results) != 1 or getattr(results[0], "target", None) is not ops.sum_over_count:
        return False
    mean = results[0]
    ar = mean.args[0]
    if getattr(ar, "target", None) is not C.all_reduce or getattr(ar.args[0], "target", None) \
            is not ops.cross_entropy_sum_count or len(ar.users) != 1 or len(ar.args[0].users) != 1:
        return False
    singles = {ops.sum_over_count: 0, C.all_reduce: 0, ops.cross_entropy_sum_count: 0}
    for n in nodes:
        if n.op in ("call_module", "call_method", "get_attr"):
            return False
        if n.op == "placeholder" and n.target in params:
            if any(u.target is not C.grad_sync_bucket for u in n.users):
                return False
        if n.op != "call_function":
            continue
        if n.target in singles:
            singles[n.target] += 1
        elif n.target is C.grad_sync_bucket:
            if n.kwargs.get("exclusive") is not True or n.kwargs.get("mp") is not None or len(n.args) > 2:
                return False
            for x in n.args[0]:
                if any(u.target is not C.grad_sync_bucket for u in x.users):
                    return False
        elif not (isinstance(n.target, torch._ops.OpOverload) and n.target.namespace in ("aten", "prims")
                  or n.target is operator.getitem):
            return False
    return all(v == 1 for v in singles.values())
