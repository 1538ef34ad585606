"""`autopar.dtensors.to_locals`: many DTensors' local tensors through one autograd node.

It must give what `DTensor.to_local()` gives, one by one: the same local tensors (fresh tensor objects, a
Parameter's marked as one), and in backward the same gradient DTensors (placements, global shape and stride,
values) for Replicate, Shard (even and uneven) and a transposed local gradient (another stride), a None where an
output got no gradient, and differentiable gradients under `create_graph=True`. Under no_grad it returns the
local tensors themselves, as `to_local` does. Two simulated ranks (LocalTensorMode).
"""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor

from autopar.dtensors import to_locals

PLACEMENTS = ([Replicate()], [Shard(0)], [Shard(1)], [Shard(0)])  # the last one uneven: 5 rows on 2 ranks
SHAPES = ((4, 6), (4, 6), (4, 6), (5, 3))


def _params(mesh):
    torch.manual_seed(0)
    return [nn.Parameter(distribute_tensor(torch.randn(s, dtype=torch.float64), mesh, p))
            for s, p in zip(SHAPES, PLACEMENTS)]


def _loss(locals_, transposed: bool):
    """A loss of the local tensors; the first one's gradient has a column-major layout when `transposed` (the
    layout of the tensor it is multiplied with); the third gets no gradient."""
    w = torch.arange(24, dtype=torch.float64).reshape(6, 4).t() if transposed else 2.0
    return (locals_[0] * w).sum() + (locals_[1] * 3).sum() + (locals_[3] ** 3).sum()


def _grads(loss, params):
    return torch.autograd.grad(loss, params, allow_unused=True)  # as they arrive, before AccumulateGrad's layout


def test_same_locals_and_gradients_as_to_local(local_world):
    with local_world(2):
        mesh = init_device_mesh("cpu", (2,))
        for transposed in (False, True):
            mine, ref = _params(mesh), _params(mesh)
            outs = to_locals(mine)
            refs = [p.to_local() for p in ref]
            for o, r, p in zip(outs, refs, mine):
                assert o is not p._local_tensor and torch.equal(o, r) and isinstance(o, nn.Parameter)
            assert len({o.grad_fn for o in outs}) == 1  # one autograd node for all
            for g, h in zip(_grads(_loss(outs, transposed), mine), _grads(_loss(refs, transposed), ref)):
                if h is None:
                    assert g is None
                    continue
                assert type(g) is DTensor and g.placements == h.placements
                assert g.shape == h.shape and g.stride() == h.stride() and g.dtype == h.dtype
                assert torch.equal(g.to_local(), h.to_local())
            strides = [g.stride() for g in _grads(_loss(to_locals(mine), transposed), mine) if g is not None]
            assert (strides[0] == (1, 4)) == transposed  # the case of another stride is met


def test_create_graph_gives_differentiable_gradients(local_world):
    with local_world(2):
        mesh = init_device_mesh("cpu", (2,))
        mine, ref = _params(mesh), _params(mesh)
        (gm,) = torch.autograd.grad(_loss(to_locals(mine), False), mine[3], create_graph=True)
        (gr,) = torch.autograd.grad(_loss([p.to_local() for p in ref], False), ref[3], create_graph=True)
        assert gm.requires_grad and gr.requires_grad
        (hm,) = torch.autograd.grad(gm.sum(), mine[3])
        (hr,) = torch.autograd.grad(gr.sum(), ref[3])
        assert hm.placements == hr.placements and torch.equal(hm.to_local(), hr.to_local())


def test_no_grad_returns_the_local_tensors(local_world):
    with local_world(2):
        mesh = init_device_mesh("cpu", (2,))
        params = _params(mesh)
        with torch.no_grad():
            outs = to_locals(params)
        assert all(torch.equal(o, p._local_tensor) and not o.requires_grad for o, p in zip(outs, params))
