"""Dropout RNG semantics under sharding, and bf16 models (loss in fp32)."""

from __future__ import annotations

import copy

import torch
from torch.distributed._local_tensor import LocalTensorMode
from torch.distributed.device_mesh import init_device_mesh

import autopar
from autopar.models import GPT, GPTConfig
from autopar.runtime.ops import new_rng_stream, parallel_dropout


from conftest import set_fake_world as _fake_world


def test_dropout_masks_match_on_replicas_and_differ_across_shards(monkeypatch):
    from autopar.runtime import ops

    monkeypatch.setattr(ops, "_RNG_STREAMS", dict(ops._RNG_STREAMS))  # the test's stream leaves with the test
    _fake_world(4)
    with LocalTensorMode(4):
        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
        dp_key, tp_key = [a.key for a in autopar.api.mesh_info(mesh).axes]
        new_rng_stream("test", 1234)
        x = torch.ones(64, 64)
        same = parallel_dropout(x, 0.5, True, "test", 0, ())
        masks = [same._local_tensors[r] for r in range(4)]
        assert all(torch.equal(masks[0], m) for m in masks[1:]), "replicated value: every rank draws one mask"
        shard = parallel_dropout(x, 0.5, True, "test", 0, (tp_key,))
        per = [shard._local_tensors[r] for r in range(4)]
        # ranks 0,1 differ on tp; ranks 0,2 share the tp coordinate (dp differs but the value is not dp-sharded)
        assert not torch.equal(per[0], per[1]) and torch.equal(per[0], per[2])
        assert abs(float((per[0] == 0).float().mean()) - 0.5) < 0.05
        assert torch.equal(parallel_dropout(x, 0.5, False, "test", 0, (tp_key,)), x)


def test_dropout_model_keeps_replicas_identical_and_draws_new_masks_each_step():
    _fake_world(4)
    torch.manual_seed(0)
    ref = GPT(GPTConfig(dropout=0.3))
    ids = torch.randint(0, 128, (4, 16))
    inputs = (ids, torch.randint(0, 128, (4, 16)))
    with LocalTensorMode(4):
        pm = autopar.parallelize(copy.deepcopy(ref), init_device_mesh("cpu", (4,), mesh_dim_names=("tp",)), inputs)
        drop = [n for n in pm.graph_module.graph.nodes if n.target is autopar.runtime.ops.parallel_dropout]
        assert len(drop) == ref.cfg.num_layers  # one after each attention projection
        l1, l2 = pm(*inputs), pm(*inputs)
        for loss in (l1, l2):
            vals = [float(loss._local_tensors[r]) for r in range(4)]
            assert max(vals) - min(vals) == 0.0, vals
        assert float(l1._local_tensors[0]) != float(l2._local_tensors[0])
        # `pm.eval()` turns dropout off as on the model (a program captured in eval mode): the same loss every
        # call, on every rank, the eval model's
        pm.eval()
        l3, l4 = pm(*inputs), pm(*inputs)
        assert len({float(l3._local_tensors[r]) for r in range(4)}) == 1
        assert float(l3._local_tensors[0]) == float(l4._local_tensors[0])
        with torch.distributed._local_tensor.maybe_disable_local_tensor_mode():
            want = float(ref.eval()(*inputs))
        assert abs(float(l3._local_tensors[0]) - want) < 1e-5


def test_bf16_model_matches_single_device_within_bf16_noise_and_loss_is_fp32():
    _fake_world(2)
    torch.manual_seed(0)
    ref = GPT(GPTConfig()).to(torch.bfloat16)
    ids = torch.randint(0, 128, (4, 16))
    inputs = (ids, torch.randint(0, 128, (4, 16)))
    want = ref(*inputs)
    assert want.dtype == torch.float32
    with LocalTensorMode(2):
        pm = autopar.parallelize(copy.deepcopy(ref), init_device_mesh("cpu", (2,), mesh_dim_names=("tp",)), inputs)
        assert pm.get_parameter("h.0.fc.weight").dtype == torch.bfloat16
        got = pm(*inputs)
        assert got.dtype == torch.float32
        for r in range(2):
            assert abs(float(got._local_tensors[r]) - float(want)) / float(want) < 2e-2
