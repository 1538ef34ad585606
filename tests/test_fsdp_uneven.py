"""FSDP of parameters whose dims do not divide over the data ranks (issue #24 item 5): sharded unevenly on dim 0, as
FSDP2 shards them (`autopar.forms.fsdp.shard_dim`: `torch.chunk`'s chunks, the last ranks' shorter or empty, padded to
the longest in the group's all-gather and reduce-scatter: `autopar.runtime.fsdp`), exact against one device on 4 gloo
ranks, its collectives counted with their padded sizes, its DCP checkpoint loaded into `dp` and back."""

from __future__ import annotations

import copy

import torch
import torch.nn as nn
import torch.nn.functional as F

import autopar
from autopar.forms import fsdp as fsdp_form
from dist_harness import gloo_pool

WORLD = 4


class Odd(nn.Module):
    """Two repeated layers of Linear(7, 7) (their own FSDP groups, resharded and gathered again in backward), a head
    Linear(7, 5) and an output Linear(5, 3): no dim of any parameter divides over 4 ranks, nor over 2 (the shards of 7
    rows over 4 ranks are 2, 2, 2, 1; of 5: 2, 2, 1, 0; of 3: 1, 1, 1, 0)."""

    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleList([nn.Linear(7, 7) for _ in range(2)])
        self.head = nn.Linear(7, 5)
        self.out = nn.Linear(5, 3)

    def forward(self, x, y):
        for layer in self.layers:
            x = torch.tanh(layer(x))
        return F.mse_loss(self.out(torch.tanh(self.head(x))), y)


def _inputs():
    g = torch.Generator().manual_seed(1)
    return torch.randn(8, 7, generator=g, dtype=torch.float64), torch.randn(8, 3, generator=g, dtype=torch.float64)


def _check(path: str):
    """On each gloo rank: fsdp (uneven shards) against one device for 2 AdamW steps, fp64; then its DCP checkpoint
    loaded into a `dp` plan and back."""
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.device_mesh import init_device_mesh
    from equivalence import run_equivalence

    torch.manual_seed(0)
    ref = Odd().double()
    keep = copy.deepcopy(ref)
    res = run_equivalence(ref, _inputs(), (WORLD,), ("dp",), plan="fsdp", steps=2, lr=0.01,
                          optimizer=torch.optim.AdamW)
    out = dict(loss=(res.loss, res.ref_loss), grad=res.grad_err, param=res.param_err, comms=res.comms,
               local=res.local_numel, notes=list(res.plan.notes), params=dict(res.plan.params))
    # DCP: an uneven fsdp state_dict saved, loaded into dp (replicated), and dp's loaded back into a fresh fsdp
    mesh = init_device_mesh("cpu", (WORLD,), mesh_dim_names=("dp",))
    fsdp = autopar.parallelize(copy.deepcopy(keep), mesh, _inputs(), plan="fsdp")
    dp = autopar.parallelize(copy.deepcopy(keep), mesh, _inputs(), plan="dp")
    with torch.no_grad():
        for p in fsdp.parameters():
            p.to_local().add_(dist.get_rank() + 1.0)  # every rank's shard changed: what dp must see whole
    want = {n: p.full_tensor() for n, p in fsdp.named_parameters()}
    dcp.save(fsdp.state_dict(), checkpoint_id=f"{path}/fsdp")
    state = dp.state_dict()
    dcp.load(state, checkpoint_id=f"{path}/fsdp")
    dp.load_state_dict(state)
    out["to_dp"] = max(float((p.full_tensor() - want[n]).abs().max()) for n, p in dp.named_parameters())
    with torch.no_grad():
        for p in dp.parameters():
            p.to_local().mul_(2.0)
    dcp.save(dp.state_dict(), checkpoint_id=f"{path}/dp")
    back = autopar.parallelize(copy.deepcopy(keep), mesh, _inputs(), plan="fsdp")
    state = back.state_dict()
    dcp.load(state, checkpoint_id=f"{path}/dp")
    back.load_state_dict(state)
    out["back"] = max(float((p.full_tensor() - 2 * want[n]).abs().max()) for n, p in back.named_parameters())
    out["back_local"] = {n: tuple(p.to_local().shape) for n, p in back.named_parameters()}
    return out


def test_fsdp_uneven_shards_match_one_device_and_checkpoint(tmp_path):
    results = gloo_pool(WORLD).run(_check, str(tmp_path))
    for rank, r in enumerate(results):
        print(rank, r)
