"""A checkpoint saved with torch.distributed.checkpoint from a pipelined module loads into a non-pipelined plan
(dp) and back, bit-equal (issue #23's contract), 2 gloo ranks: a 1F1B pp2 module trained one step is saved; a dp
module of another initialisation loads it and holds every parameter bit-equal; it is saved again and a fresh pp2
module loads that, its stages' parameters bit-equal to the first's."""

from __future__ import annotations

import torch

from dist_harness import gloo_pool
from pipeline_helpers import held, llama


def _model(seed: int):
    torch.manual_seed(seed)
    return llama()


def _round_trip(path: str) -> int:
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.device_mesh import init_device_mesh

    import autopar
    from autopar.models import LlamaConfig

    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, LlamaConfig().vocab_size, (4, 16), generator=g)
    x = (ids, torch.roll(ids, -1, 1))
    pp_mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("pp",))
    dp_mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("dp",))
    pp = autopar.parallelize(_model(0), pp_mesh, x, plan="dp", overrides={"pipeline": "1f1b@pp"}, microbatches=2)
    opt = torch.optim.AdamW(pp.parameters(), lr=1e-2)
    pp(*x).backward()
    opt.step()
    ref = {}
    parts = [None] * dist.get_world_size()
    dist.all_gather_object(parts, held(pp))
    for part in parts:
        ref.update(part)
    assert set(ref) == {n for n, _ in _model(0).named_parameters()}
    dcp.save(pp.state_dict(), checkpoint_id=f"{path}/pp")

    dp = autopar.parallelize(_model(1), dp_mesh, x, plan="dp")
    sd = dp.state_dict()
    dcp.load(sd, checkpoint_id=f"{path}/pp")
    dp.load_state_dict(sd)
    got = held(dp)
    assert set(got) == set(ref)
    bad = [n for n in ref if not torch.equal(got[n], ref[n])]
    assert not bad, f"not bit-equal after pp -> dp: {bad}"
    dcp.save(dp.state_dict(), checkpoint_id=f"{path}/dp")

    back = autopar.parallelize(_model(2), pp_mesh, x, plan="dp", overrides={"pipeline": "1f1b@pp"}, microbatches=2)
    sd = back.state_dict()
    dcp.load(sd, checkpoint_id=f"{path}/dp")
    back.load_state_dict(sd)
    mine = held(back)
    assert mine, "this rank holds no stage parameter"
    bad = [n for n in mine if not torch.equal(mine[n], ref[n])]
    assert not bad, f"not bit-equal after dp -> pp: {bad}"
    return len(mine)


def test_dcp_pipeline_to_dp_and_back_bit_equal(tmp_path):
    num_held = gloo_pool(2).run(_round_trip, str(tmp_path))
    assert all(h > 0 for h in num_held)
