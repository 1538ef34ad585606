"""Data-parallel gradient buckets without per-gradient overhead (`collectives.grad_sync_bucket`, issue #12 item 1).

Each bucket's flat buffer is all-reduced in place, asynchronously, and its backward returns plain views of it: the
gradients are views of one buffer per bucket (no copy out, no AsyncCollectiveTensor), and nothing reads them before
the all-reduce completes: the autograd node each gradient flows to waits for it in a pre-hook (for a parameter, the
`to_local` node, which runs at the end of the backward), or, where the bucket is not the only consumer of its inputs,
the bucket's backward waits before returning. Asserted on real gloo processes (where the all-reduce is asynchronous),
against one device: several AdamW steps with `zero_grad(set_to_none=True)` and `set_to_none=False`, gradients
accumulated over two backward passes, the parameter also used outside the program in the same loss (its gradients
meet in autograd's input buffer), a tensor hook on a parameter (it sees the reduced gradient), and a parameter with a
second, replicated consumer in the program (a non-exclusive bucket). The lowering marks which buckets are exclusive.
On the CPU a bucket's buffer is reused at the next backward once nothing views it (`collectives._POOL`).
"""

from __future__ import annotations

import copy
import time

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh

import autopar
from autopar.runtime import collectives as C
from autopar.runtime.collectives import record_comms
from dist_harness import gloo_pool

DIM, LAYERS = 16, 3
LAYER_BYTES = (DIM * DIM + DIM) * 8  # one fp64 Linear: one bucket per layer


class Stack(nn.Module):
    def __init__(self, penalty: float = 0.0):
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(DIM, DIM) for _ in range(LAYERS))
        self.penalty = penalty  # > 0: the first weight also feeds a batch-independent term (a second consumer)

    def forward(self, x, y):
        for layer in self.layers:
            x = torch.tanh(layer(x))
        loss = ((x - y) ** 2).mean()
        if self.penalty:
            loss = loss + self.penalty * (self.layers[0].weight ** 2).sum()
        return loss


def _inputs(step: int):
    g = torch.Generator().manual_seed(10 + step)
    return torch.randn(8, DIM, generator=g, dtype=torch.float64), torch.randn(8, DIM, generator=g, dtype=torch.float64)


def _backward(loss) -> None:
    """Rank 1 enters the backward late, so rank 0's all-reduces stay in flight until rank 1 catches up: a gradient
    read on rank 0 before its reduction completes would be read unreduced."""
    if dist.get_rank() == 1:
        time.sleep(0.05)
    loss.backward()


def _buckets(pm):
    return [n for n in pm.graph_module.graph.nodes if n.target is C.grad_sync_bucket]


def _err(a: dict, b: dict) -> float:
    assert a.keys() == b.keys()
    return max((a[k] - b[k]).abs().max().item() for k in a)


def _grads(pm) -> dict:
    return {n: p.grad.full_tensor().clone() for n, p in pm.named_parameters()}


def _ref_grads(ref) -> dict:
    return {n: p.grad.clone() for n, p in ref.named_parameters()}


def _params(pm) -> dict:
    return {n: p.full_tensor().detach().clone() for n, p in pm.named_parameters()}


def _setup(penalty: float = 0.0):
    old, C.GRAD_BUCKET_BYTES = C.GRAD_BUCKET_BYTES, LAYER_BYTES
    try:
        torch.manual_seed(0)
        ref = Stack(penalty).double()
        mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("dp",))
        pm = autopar.parallelize(copy.deepcopy(ref), mesh, _inputs(0), plan="dp")
        pm(*_inputs(0))  # lowered now, with these buckets
    finally:
        C.GRAD_BUCKET_BYTES = old
    return ref, pm


def steps_worker(set_to_none: bool) -> dict:
    """Three AdamW steps; after each backward the gradients are plain views of one flat buffer per bucket."""
    ref, pm = _setup()
    opt_r = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    opt_p = torch.optim.AdamW(pm.parameters(), lr=1e-2)
    out = {"grad_err": 0.0, "param_err": 0.0, "loss_err": 0.0, "plain": True, "shared": True, "buffers": []}
    for step in range(3):
        inputs = _inputs(step)
        with record_comms() as comms:
            loss = pm(*inputs)
            _backward(loss)
        ref_loss = ref(*inputs)
        ref_loss.backward()
        out["loss_err"] = max(out["loss_err"], abs(loss.item() - ref_loss.item()))
        out["grad_err"] = max(out["grad_err"], _err(_grads(pm), _ref_grads(ref)))
        locals_ = {n: p.grad.to_local() for n, p in pm.named_parameters()}
        out["plain"] &= all(type(t) is torch.Tensor for t in locals_.values())
        # a layer's weight and bias: views of the same buffer (its bucket), at adjacent offsets
        for i in range(LAYERS):
            w, b = locals_[f"layers.{i}.weight"], locals_[f"layers.{i}.bias"]
            out["shared"] &= w.untyped_storage().data_ptr() == b.untyped_storage().data_ptr() and w._base is not None
        out["buffers"].append({locals_[f"layers.{i}.weight"].untyped_storage().data_ptr() for i in range(LAYERS)})
        out["comms"] = [(r.kind, r.pass_, r.numel) for r in comms]
        del locals_, w, b  # (views of the buffers)
        opt_r.step()
        opt_p.step()
        opt_r.zero_grad(set_to_none=set_to_none)
        opt_p.zero_grad(set_to_none=set_to_none)
        out["param_err"] = max(out["param_err"], _err(_params(pm), dict(ref.named_parameters())))
    out["exclusive"] = [b.kwargs.get("exclusive", False) for b in _buckets(pm)]
    return out


def test_gradients_are_bucket_views_and_exact_over_steps():
    for set_to_none in (True, False):
        for res in gloo_pool(2).run(steps_worker, set_to_none):
            assert res["exclusive"] == [True] * LAYERS, res["exclusive"]
            assert res["plain"] and res["shared"], res
            # one all-reduce per bucket in backward, and the loss's in forward: nothing else
            assert sorted(res["comms"]) == sorted([("all_reduce", "forward", 1)]
                                                  + [("all_reduce", "backward", DIM * DIM + DIM)] * LAYERS), res
            assert res["loss_err"] <= 1e-12 and res["grad_err"] <= 1e-12 and res["param_err"] <= 1e-12, res
            # the CPU buffer pool: set to None, the gradients of the next backward are views of the same buffers
            # (reused); kept (zeroed in place), they stay views of the first buffers and are added to, while the next
            # backward reduces into other buffers (a reused buffer under them would make grad_err above non-zero)
            first, *later = res["buffers"]
            assert len(first) == LAYERS and all(b == first for b in later), res["buffers"]


def readers_worker() -> dict:
    """Gradients read by autograd before the end of the backward: they must be reduced by then."""
    ref, pm = _setup()
    out = {}
    # two backward passes without zeroing: the second adds to the first's gradients
    for step in range(2):
        _backward(pm(*_inputs(step)))
        ref(*_inputs(step)).backward()
    out["accumulate"] = _err(_grads(pm), _ref_grads(ref))
    pm.zero_grad()
    ref.zero_grad()
    # the parameter also used outside the program: its two gradients are summed in autograd's input buffer
    w, rw = pm.get_parameter("layers.2.weight"), ref.layers[2].weight
    _backward(pm(*_inputs(2)) + 0.5 * (w * w).sum().full_tensor())
    (ref(*_inputs(2)) + 0.5 * (rw * rw).sum()).backward()
    out["outside"] = _err(_grads(pm), _ref_grads(ref))
    pm.zero_grad()
    ref.zero_grad()
    # a tensor hook on a parameter sees the reduced gradient
    seen = []
    handle = pm.get_parameter("layers.1.bias").register_hook(lambda g: seen.append(g.full_tensor().clone()))
    _backward(pm(*_inputs(3)))
    handle.remove()
    ref(*_inputs(3)).backward()
    out["hook"] = (seen[0] - ref.layers[1].bias.grad).abs().max().item()
    return out


def penalty_worker() -> dict:
    """A weight with a second, batch-independent consumer in the program: its bucket is not exclusive."""
    ref, pm = _setup(penalty=0.1)
    for step in range(2):
        _backward(pm(*_inputs(step)))
        ref(*_inputs(step)).backward()
    exclusive = [b.kwargs.get("exclusive", False) for b in _buckets(pm)]
    return {"exclusive": exclusive, "err": _err(_grads(pm), _ref_grads(ref)), "rank": dist.get_rank()}


def test_gradients_read_during_backward_are_reduced():
    for res in gloo_pool(2).run(readers_worker):
        assert all(v <= 1e-12 for v in res.values()), res
    for res in gloo_pool(2).run(penalty_worker):
        assert len(res["exclusive"]) == LAYERS and res["exclusive"].count(False) >= 1, res
        assert res["err"] <= 1e-12, res


def test_buckets_are_exclusive_only_when_they_alone_consume_their_inputs(local_world):
    """The lowering's flag, without processes: a plain stack's buckets alone consume their parameters."""
    for penalty in (0.0, 0.1):
        torch.manual_seed(0)
        model = Stack(penalty).double()
        inputs = _inputs(0)  # made outside the simulated ranks: the same batch on each
        with local_world(2):
            mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("dp",))
            pm = autopar.parallelize(model, mesh, inputs, plan="dp")
        for b in _buckets(pm):
            consumers = {a: [u for u in a.users] for a in b.args[0]}
            alone = all(users == [b] for users in consumers.values())
            assert b.kwargs.get("exclusive", False) == alone, (penalty, b, consumers)
        if penalty:
            assert not all(b.kwargs.get("exclusive", False) for b in _buckets(pm))
