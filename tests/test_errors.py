"""Bad input gets a clear error: what, got, why, how to fix; and nothing is lost."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed._local_tensor import LocalTensorMode
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

import autopar
from autopar.models import GPT, GPTConfig, MLP


from conftest import set_fake_world as _fake_world


@pytest.fixture
def world4():
    _fake_world(4)


def _gpt(**kw):
    torch.manual_seed(0)
    cfg = GPTConfig(**kw)
    model = GPT(cfg)
    ids = torch.randint(0, cfg.vocab_size, (4, cfg.seq_len))
    return model, (ids, torch.randint(0, cfg.vocab_size, (4, cfg.seq_len)))


def test_mesh_size_must_equal_world_size(world4):
    model, inputs = _gpt()
    mesh = DeviceMesh("cpu", [0, 1])
    with pytest.raises(ValueError, match=r"mesh has 2 devices.*world has 4 ranks.*init_device_mesh"):
        autopar.parallelize(model, mesh, inputs)


def test_mesh_must_be_a_device_mesh(world4):
    model, inputs = _gpt()
    with pytest.raises(TypeError, match="DeviceMesh"):
        autopar.parallelize(model, (2, 2), inputs)


def test_forced_heads_not_divisible_says_why_and_fix(world4):
    model, inputs = _gpt(num_heads=3, hidden=24)
    with LocalTensorMode(4):
        mesh = init_device_mesh("cpu", (4,), mesh_dim_names=("tp",))
        with pytest.raises(ValueError, match=r"attention h\.0\.attn.*'heads'.*3 heads do not divide over 4.*Fix"):
            autopar.parallelize(model, mesh, inputs, overrides={"attention": "heads"})


def test_heuristic_replicates_indivisible_heads_and_still_matches(world4):
    torch.set_default_dtype(torch.float64)
    try:
        model, inputs = _gpt(num_heads=3, hidden=24)
        ref = copy.deepcopy(model)
        with LocalTensorMode(4):
            mesh = init_device_mesh("cpu", (4,), mesh_dim_names=("tp",))
            pm = autopar.parallelize(model, mesh, inputs, plan="megatron")
            assert any("3 heads do not divide over 4" in n for n in pm.plan.notes)
            loss = pm(*inputs)
            err = (loss - ref(*inputs).detach()).abs()
            assert max(float(v) for v in err._local_tensors.values()) < 1e-12
    finally:
        torch.set_default_dtype(torch.float32)


class DataDependent(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x):
        if x.sum() > 0:  # branches on a tensor value: cannot be traced
            return self.fc(x).sum()
        return x.sum()


def test_uncapturable_model_raises_capture_error(world4):
    with LocalTensorMode(4):
        mesh = init_device_mesh("cpu", (4,))
        with pytest.raises(autopar.CaptureError, match=r"(?s)could not capture DataDependent.*Why:.*Fix:"):
            autopar.parallelize(DataDependent(), mesh, (torch.randn(8, 4),))


def test_overrides_unknown_key_form_axis_and_memory(world4):
    model, inputs = _gpt()
    with LocalTensorMode(4):
        mesh = init_device_mesh("cpu", (4,), mesh_dim_names=("tp",))
        with pytest.raises(ValueError, match=r"matches no recognised structure.*h\.0\.attn"):
            autopar.parallelize(model, mesh, inputs, overrides={"decoder.*": "replicate"})
        with pytest.raises(ValueError, match=r"unknown form 'diagonal'.*replicate, colwise, rowwise"):
            autopar.parallelize(model, mesh, inputs, overrides={"linear": "diagonal"})
        with pytest.raises(ValueError, match=r"override 'moe' matches no recognised structure"):
            autopar.parallelize(model, mesh, inputs, overrides={"moe": "expert"})  # GPT has no MoE
        with pytest.raises(ValueError, match=r"axis 'dp' does not exist.*\('tp',\)"):
            autopar.parallelize(model, mesh, inputs, overrides={"attention": "heads@dp"})
        with pytest.raises(ValueError, match=r"pipeline axis 'pp'.*not an axis of the mesh \(tp\)"):
            autopar.parallelize(model, mesh, inputs, overrides={"pipeline": "1f1b@pp"})
        with pytest.raises(NotImplementedError, match=r"'dualpipev' pipeline schedule is not implemented yet.*"
                                                      r"implemented: gpipe, 1f1b, interleaved-1f1b, zbv\. Fix"):
            autopar.parallelize(model, mesh, inputs, overrides={"pipeline": "dualpipev@tp"})
        with pytest.raises(NotImplementedError, match=r"under LocalTensorMode.*Fix: run on real processes"):
            autopar.parallelize(model, mesh, inputs, plan="dp", overrides={"pipeline": "1f1b@tp"})
        with pytest.raises(ValueError, match=r"pipeline '1f1b@tp': microbatches=3 must be a positive integer "
                                             r"dividing the batch"):
            autopar.plan(model, mesh, inputs, plan="dp", overrides={"pipeline": "1f1b@tp"}, microbatches=3)
        with pytest.raises(autopar.InfeasibleError, match=r"(?s)no plan fits 1\.00 KiB.*least memory any plan needs is "
                                                          r"\d+(\.\d+)? KiB.*Fix: raise memory_limit"):
            autopar.parallelize(model, mesh, inputs, memory_limit=1024)


def test_call_with_an_unguardable_input_says_what_to_pass(world4):
    """Other shapes, modes and input values re-lower the plan (tests/test_shapes.py, tests/test_contract_modes.py);
    a non-tensor input that cannot be compared with the captured one is an error that says what to pass."""
    torch.manual_seed(0)
    model = MLP()
    with LocalTensorMode(4):
        mesh = init_device_mesh("cpu", (4,))
        pm = autopar.parallelize(model, mesh, (torch.randn(8, 16), torch.randn(8, 16)))
        with pytest.raises(TypeError, match=r"input 1 \(flattened\) is a _Unhashable.*neither a tensor nor hashable.*Fix"):
            pm(torch.randn(8, 16), _Unhashable())


class _Unhashable(list):
    """A leaf to pytree (not a list subclass it flattens) that cannot be hashed."""


def test_model_is_not_modified_by_a_failed_parallelize(world4):
    model, inputs = _gpt()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with LocalTensorMode(4):
        mesh = init_device_mesh("cpu", (4,), mesh_dim_names=("tp",))
        with pytest.raises(ValueError):
            autopar.parallelize(model, mesh, inputs, overrides={"attention": "heads@nope"})
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
