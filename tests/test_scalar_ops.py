"""`autopar.runtime.scalar_ops`: DTensor pointwise ops with Python-number arguments, run on the local shard.

The fast path must give bitwise what DTensor's own dispatch gives (the same local values, the same spec:
placements, shape, stride, dtype) for Replicate and Shard placements, in place and out of place, also where the
result's dtype differs from the input's and with DTensor arguments of the same layout; it must not run (and the
result must still be right) for Partial, for plain-tensor arguments, for DTensors of another layout (broadcast)
and while disabled. AdamW steps on DTensor parameters match bitwise with it on and off.
Two simulated ranks (LocalTensorMode): Shard(0) of 5 rows is uneven.
"""

from __future__ import annotations

import pytest
import torch
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_tensor

from autopar.runtime import scalar_ops

aten = torch.ops.aten

CALLS = {  # name -> (call on a float DTensor d, with e a DTensor of d's layout and r a replicated row; fast path?)
    "mul_": (lambda d, e, r: d.mul_(0.9), True),
    "add_": (lambda d, e, r: d.add_(1e-3), True),
    "sub": (lambda d, e, r: d.sub(0.25, alpha=2), True),
    "div": (lambda d, e, r: d.div(1.7), True),
    "rdiv": (lambda d, e, r: 3.0 / d, True),
    "pow": (lambda d, e, r: d.pow(2.0), True),
    "clamp": (lambda d, e, r: d.clamp(min=-0.5, max=0.5), True),
    "mul_.Scalar": (lambda d, e, r: aten.mul_.Scalar(d, 0.5), True),
    "gt": (lambda d, e, r: d.gt(0.1), True),  # bool result
    "lerp_": (lambda d, e, r: d.lerp_(e, 0.1), True),  # a DTensor argument of the same layout
    "addcdiv_": (lambda d, e, r: d.addcdiv_(e, e, value=-0.01), True),
    "add_ row": (lambda d, e, r: d.add_(r), False),  # broadcast: another layout, DTensor's own dispatch
    "mul 0-dim tensor": (lambda d, e, r: d.mul(torch.tensor(0.5, dtype=torch.float64)), False),
}


def _pair(placements):
    """Twice the same (d, e, r): one for the fast path, one for DTensor's dispatch."""
    mesh = init_device_mesh("cpu", (2,))
    torch.manual_seed(0)
    full = torch.randn(5, 3, dtype=torch.float64)
    other = torch.randn(5, 3, dtype=torch.float64)
    row = torch.randn(3, dtype=torch.float64)
    return [(distribute_tensor(full.clone(), mesh, placements), distribute_tensor(other.clone(), mesh, placements),
             distribute_tensor(row.clone(), mesh, [Replicate()])) for _ in range(2)]


def _same(a, b) -> None:
    assert isinstance(a, DTensor) and isinstance(b, DTensor)
    assert a.placements == b.placements and a.shape == b.shape and a.stride() == b.stride() and a.dtype == b.dtype
    assert a._spec.tensor_meta == b._spec.tensor_meta
    for x, y in zip(a._local_tensor._local_tensors.values(), b._local_tensor._local_tensors.values()):
        assert x.dtype == y.dtype and x.shape == y.shape and x.stride() == y.stride()
        assert torch.equal(x, y), (x, y)


@pytest.mark.parametrize("placements", [[Replicate()], [Shard(0)], [Shard(1)]], ids=["R", "S0", "S1"])
def test_fast_path_is_bitwise_the_slow_path(local_world, monkeypatch, placements):
    scalar_ops.install()
    taken = []
    original = scalar_ops._local_result
    monkeypatch.setattr(scalar_ops, "_local_result", lambda *a: taken.append(original(*a)) or taken[-1])
    with local_world(2):
        (d, e, r), (d0, e0, r0) = _pair(placements)
        for name, (call, expect_fast) in CALLS.items():
            taken.clear()
            fast = call(d, e, r)
            with scalar_ops.fast_path(False):
                slow = call(d0, e0, r0)
            _same(fast, slow)
            _same(d, d0)  # in-place calls wrote the same values
            in_place = "_" in name
            assert (fast is d) == in_place and (slow is d0) == in_place, name
            assert any(t is not None for t in taken) == expect_fast, name


def test_partial_is_refused_and_right(local_world):
    """`add(Partial, 1)` on each rank's partial sum would add 1 per rank: the handler hands it to DTensor."""
    scalar_ops.install()
    with local_world(2):
        mesh = init_device_mesh("cpu", (2,))
        full = torch.arange(6, dtype=torch.float64).reshape(2, 3)
        part = DTensor.from_local(torch.ones(2, 3, dtype=torch.float64) * full / 2, mesh, [Partial()])
        assert scalar_ops._local_result(aten.add.Tensor, (part, 1.0), {}) is None
        out = part + 1.0
        with scalar_ops.fast_path(False):
            ref = part + 1.0
        assert torch.equal(out.full_tensor(), full + 1.0) and torch.equal(ref.full_tensor(), full + 1.0)


def test_adamw_steps_match_bitwise(local_world):
    """Single-tensor AdamW (mul_, lerp_, addcmul_, div, add_, addcdiv_ with changing step sizes) on DTensor
    parameters, fast path on and off: the same parameters bit for bit after three steps."""
    scalar_ops.install()
    with local_world(2):
        mesh = init_device_mesh("cpu", (2,))
        torch.manual_seed(1)
        values = [torch.randn(6, 4, dtype=torch.float64), torch.randn(4, dtype=torch.float64)]
        grads = [[torch.randn_like(v) for v in values] for _ in range(3)]
        placements = [[Shard(0)], [Replicate()]]
        runs = []
        for on in (True, False):
            params = [torch.nn.Parameter(distribute_tensor(v.clone(), mesh, pl)) for v, pl in zip(values, placements)]
            opt = torch.optim.AdamW(params, lr=1e-2, weight_decay=0.1, foreach=False)
            with scalar_ops.fast_path(on):
                for step in grads:
                    for p, g, pl in zip(params, step, placements):
                        p.grad = distribute_tensor(g, mesh, pl)
                    opt.step()
            runs.append(params)
        for a, b in zip(*runs):
            _same(a.data, b.data)


def test_autograd_through_the_fast_path(local_world):
    scalar_ops.install()
    with local_world(2):
        mesh = init_device_mesh("cpu", (2,))
        x = torch.randn(4, 3, dtype=torch.float64)
        grads = []
        for on in (True, False):
            d = distribute_tensor(x.clone(), mesh, [Shard(0)]).requires_grad_()
            with scalar_ops.fast_path(on):
                (d * 3.0 - 1.0).pow(2.0).sum().backward()
            grads.append(d.grad)
        _same(*grads)
        assert torch.allclose(grads[0].full_tensor(), 6.0 * (3.0 * x - 1.0))
