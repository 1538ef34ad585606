"""Capture: unmodified models, outputs of any structure, untraceable submodules as opaque nodes."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed._local_tensor import LocalTensorMode
from transformers import GPT2Config, GPT2LMHeadModel

import autopar
from equivalence import run_equivalence


from conftest import set_fake_world as _fake_world


class Branchy(nn.Module):
    """Data-dependent control flow: torch.export cannot trace it."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(16, 16)

    def forward(self, x):
        if x.sum() > 0:
            return self.fc(x) * 2
        return self.fc(x)


class WithBranchy(nn.Module):
    def __init__(self):
        super().__init__()
        self.up = nn.Linear(16, 32)
        self.down = nn.Linear(32, 16)
        self.branchy = Branchy()
        self.head = nn.Linear(16, 16)

    def forward(self, x, y):
        h = self.down(torch.relu(self.up(x)))
        return ((self.head(self.branchy(h)) - y) ** 2).mean()


class TupleOut(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Linear(16, 32)
        self.b = nn.Linear(32, 16)

    def forward(self, x):
        h = self.b(torch.relu(self.a(x)))
        return {"loss": h.pow(2).mean(), "parts": (h, h.sum(-1))}


@pytest.fixture(autouse=True)
def fp64():
    torch.set_default_dtype(torch.float64)
    yield
    torch.set_default_dtype(torch.float32)


def test_untraceable_submodule_becomes_replicated_opaque_node_and_matches():
    _fake_world(4)
    torch.manual_seed(0)
    ref = WithBranchy()
    inputs = (torch.randn(8, 16), torch.randn(8, 16))
    with LocalTensorMode(4):
        res = run_equivalence(ref, inputs, (2, 2), ("dp", "tp"), steps=2)
    assert any(n.startswith("branchy captured as one opaque node") for n in res.plan.notes), res.plan.notes
    assert res.max_err() < 1e-12, res
    # the traceable rest is still tensor parallel
    forms = {s.key: s.form for s in res.plan.strategies}
    assert forms["{up,down}"] == "tp"


def test_dict_and_tuple_outputs_are_returned_whole_on_every_rank():
    _fake_world(2)
    torch.manual_seed(0)
    ref = TupleOut()
    x = torch.randn(4, 16)
    want = ref(x)
    with LocalTensorMode(2):
        from torch.distributed.device_mesh import init_device_mesh
        pm = autopar.parallelize(ref, init_device_mesh("cpu", (2,), mesh_dim_names=("tp",)), (x,))
        got = pm(x)
        assert set(got) == {"loss", "parts"} and isinstance(got["parts"], tuple)
        for g, w in ((got["loss"], want["loss"]), (got["parts"][0], want["parts"][0]), (got["parts"][1], want["parts"][1])):
            for r in range(2):
                assert torch.allclose(g._local_tensors[r], w, atol=1e-12)


def test_hf_model_with_kv_cache_on_is_captured_with_cache_off():
    _fake_world(2)
    torch.manual_seed(0)
    cfg = GPT2Config(vocab_size=128, n_positions=16, n_embd=32, n_layer=1, n_head=4, resid_pdrop=0, embd_pdrop=0,
                     attn_pdrop=0)
    assert cfg.use_cache
    ref = GPT2LMHeadModel(cfg)
    ids, labels = torch.randint(0, 128, (2, 16)), torch.randint(0, 128, (2, 16))
    with LocalTensorMode(2):
        res = run_equivalence(ref, {"input_ids": ids, "labels": labels}, (2,), ("tp",))
    assert ref.config.use_cache  # restored
    assert res.max_err() < 1e-5
