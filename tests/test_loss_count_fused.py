"""A mean cross-entropy's valid-token count rides on the loss's own all-reduce (`passes.lower.fuse_loss_count_pass`).

Under `dp` on one data axis the loss was two small forward all-reduces (the count inside the loss op, then the
partial loss): now one all-reduce of this rank's (sum, count), divided after it. Asserted on 2 gloo ranks against
one device in fp64, with ignored targets (so the count is not the batch size) and label smoothing: the loss, every
parameter gradient and the parameters after two AdamW steps; the exact collectives of a step (forward: one
all-reduce of the (sum, count) pair with the call's agreement riding on it, `autopar.agree.SummedAgreement`;
backward: the one gradient bucket); and the lowered graph (the fused op, no `cross_entropy_sharded_batch` left).
"""

from __future__ import annotations

import copy

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import init_device_mesh

import autopar
from autopar.runtime import ops as O
from autopar.runtime.collectives import record_comms
from dist_harness import gloo_pool


class Head(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(6, 8), nn.Linear(8, 5)

    def forward(self, x, y):
        return F.cross_entropy(self.b(torch.tanh(self.a(x))), y, ignore_index=-1, label_smoothing=0.1)


def _inputs(step: int, rank: int):
    """The global batch of `step` (8 rows; rank 0's half has 3 ignored targets, rank 1's 1) and this rank's half."""
    g = torch.Generator().manual_seed(step)
    x, y = torch.randn(8, 6, generator=g, dtype=torch.float64), torch.randint(0, 5, (8,), generator=g)
    y[[0, 1, 3, 6]] = -1
    return (x, y), (x[4 * rank:4 * rank + 4], y[4 * rank:4 * rank + 4])


def fused_worker() -> dict:
    import torch.distributed as dist
    rank = dist.get_rank()
    torch.manual_seed(0)
    ref = Head().double()
    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("dp",))
    pm = autopar.parallelize(copy.deepcopy(ref), mesh, _inputs(0, rank)[1], plan="dp", inputs="local")
    opt_r, opt_p = (torch.optim.AdamW(m.parameters(), lr=1e-2) for m in (ref, pm))
    out = {"loss": 0.0, "grad": 0.0, "param": 0.0}
    for step in range(2):
        whole, mine = _inputs(step, rank)
        with record_comms() as comms:
            loss = pm(*mine)
            loss.backward()
        ref_loss = ref(*whole)
        ref_loss.backward()
        out["loss"] = max(out["loss"], abs(loss.item() - ref_loss.item()))
        grads = {n: p.grad.full_tensor() for n, p in pm.named_parameters()}
        out["grad"] = max(out["grad"], *((grads[n] - p.grad).abs().max().item() for n, p in ref.named_parameters()))
        opt_r.step()
        opt_p.step()
        opt_r.zero_grad()
        opt_p.zero_grad()
        params = {n: p.full_tensor() for n, p in pm.named_parameters()}
        out["param"] = max(out["param"], *((params[n] - p).abs().max().item() for n, p in ref.named_parameters()))
        out["comms"] = [(r.kind, r.pass_, r.numel) for r in comms]
    targets = [n.target for n in pm.graph_module.graph.nodes if n.op == "call_function"]
    out["fused"] = (targets.count(O.cross_entropy_sum_count), targets.count(O.sum_over_count),
                    targets.count(O.cross_entropy_sharded_batch))
    return out


def test_count_rides_on_the_loss_all_reduce_exactly():
    n_params = 6 * 8 + 8 + 8 * 5 + 5
    for res in gloo_pool(2).run(fused_worker):
        assert res["loss"] <= 1e-12 and res["grad"] <= 1e-12 and res["param"] <= 1e-12, res
        assert res["fused"] == (1, 1, 0), res
        fwd = [c for c in res["comms"] if c[1] == "forward"]
        bwd = [c for c in res["comms"] if c[1] == "backward"]
        # (sum, count) and the call's agreement riding on it (4 flags, 2 digest words at 2 ranks): one all-reduce
        assert [(k, n) for k, _, n in fwd] == [("all_reduce", 2 + 4 + 2)], res["comms"]
        assert [(k, n) for k, _, n in bwd] == [("all_reduce", n_params)], res["comms"]  # the one bucket
