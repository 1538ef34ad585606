"""State dicts and torch.distributed.checkpoint on real gloo processes: parameters keep their names,
fused-QKV (_StridedShard) weights save and load, a checkpoint reshards into another plan, and the
plan every rank runs is the one rank 0 solved (hash-checked)."""

from __future__ import annotations

import tempfile

import torch

from dist_harness import gloo_pool


def _gpt_and_inputs(seed: int):
    from autopar.models import GPT, GPTConfig

    torch.manual_seed(seed)
    model = GPT(GPTConfig())
    g = torch.Generator().manual_seed(1)
    return model, (torch.randint(0, 128, (4, 16), generator=g), torch.randint(0, 128, (4, 16), generator=g))


def dcp_round_trip(path: str):
    import torch.distributed.checkpoint as dcp
    from torch.distributed.device_mesh import init_device_mesh

    import autopar

    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("tp",))
    model, inputs = _gpt_and_inputs(0)
    pm = autopar.parallelize(model, mesh, inputs, plan="megatron")
    qkv = pm.get_parameter("h.0.attn.qkv.weight")
    assert "_StridedShard" in repr(qkv.placements), qkv.placements
    sd = pm.state_dict()
    assert set(sd) == {k for k in model.state_dict()}, set(sd) ^ set(model.state_dict())
    dcp.save(sd, checkpoint_id=path)
    # load into a differently initialised model with another plan (fsdp over the same 2 ranks)
    other, _ = _gpt_and_inputs(7)
    pm2 = autopar.parallelize(other, mesh, inputs, plan="fsdp")
    target = pm2.state_dict()
    dcp.load(target, checkpoint_id=path)
    pm2.load_state_dict(target)
    errs = {n: float((a.full_tensor() - b.full_tensor()).abs().max())
            for (n, a), (_, b) in zip(pm.named_parameters(), pm2.named_parameters())}
    same_loss = float(pm(*inputs)) == float(pm2(*inputs))
    # and back into a megatron plan (strided weights are sliced again on load)
    pm3 = autopar.parallelize(_gpt_and_inputs(9)[0], mesh, inputs, plan="megatron")
    target = pm3.state_dict()
    dcp.load(target, checkpoint_id=path)
    pm3.load_state_dict(target)
    errs3 = max(float((a.full_tensor() - b.full_tensor()).abs().max())
                for a, b in zip(pm.parameters(), pm3.parameters()))
    return max(errs.values()), same_loss, errs3


def test_dcp_save_and_reshard_load_with_fused_qkv():
    path = tempfile.mkdtemp(prefix="autopar-dcp-")
    for err, same_loss, err3 in gloo_pool(2).run(dcp_round_trip, path):
        assert err == 0.0 and err3 == 0.0 and same_loss


def plans_agree():
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    import autopar
    from autopar.models import MLP

    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    torch.manual_seed(dist.get_rank())  # ranks differ in their initial weights: rank 0's are broadcast
    model = MLP()
    x = torch.randn(8, 16, generator=torch.Generator().manual_seed(0))
    pm = autopar.parallelize(model, mesh, (x, x), plan="megatron")
    return pm.plan.to_json(), [float(p.full_tensor().sum()) for p in pm.parameters()]


def test_every_rank_runs_rank_zeros_plan_and_weights():
    results = gloo_pool(2).run(plans_agree)
    assert results[0] == results[1]
