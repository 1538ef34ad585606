"""The user contract under data mistakes and quietly ignored requests (issue #10, slice "data").

- custom `torch.autograd.Function`s keep their own backward (captured as an opaque node unless their backward is
  the derivative of their forward);
- out-of-range token ids and labels raise `IndexError` as on one device under vocab-parallel embedding and loss;
- requests that cannot be honoured raise: a hand plan over `memory_limit`, a batch that does not divide the data
  axes, tied parameters given different placements by a Plan; overrides resolve by specificity;
- `pm.load_state_dict` takes the full tensors a user already has, and an optimizer built on the original model's
  parameters is caught at its first step.
"""

from __future__ import annotations

import copy
import re

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import init_device_mesh

import autopar
from autopar.models import GPT, GPTConfig
from equivalence import run_equivalence

CFG = GPTConfig(vocab_size=64, seq_len=8, num_layers=1, num_heads=4, hidden=32)


def _gpt():
    torch.manual_seed(0)
    return GPT(CFG)


def _batch(b=4):
    g = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, CFG.vocab_size, (b, CFG.seq_len), generator=g)
    return tokens, torch.roll(tokens, -1, dims=1)


# ----------------------------------------------------------------------------- out-of-range ids and labels (item 5)

def _megatron_gpt(local_world, world=2):
    model = _gpt()
    tokens, labels = _batch()
    with local_world(world):
        mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("tp",))
        pm = autopar.parallelize(copy.deepcopy(model), mesh, (tokens, labels), plan="megatron")
    forms = {s.kind: s.form for s in pm.plan.strategies}
    assert forms["embedding"] == "vocab" and forms["loss"] == "vocab", forms
    return model, pm, tokens, labels


def test_out_of_range_token_id_raises_index_error_like_one_device(local_world, fp64):
    model, pm, tokens, labels = _megatron_gpt(local_world)
    for bad in (CFG.vocab_size, -1):
        t = tokens.clone()
        t[1, 3] = bad
        with pytest.raises(IndexError, match="index out of range in self"):
            model(t, labels)
        with local_world(2), pytest.raises(IndexError, match="^index out of range in self$"):
            pm(t, labels)


def test_out_of_range_label_raises_index_error_like_one_device(local_world, fp64):
    model, pm, tokens, labels = _megatron_gpt(local_world)
    for bad in (CFG.vocab_size + 3, -1):
        lab = labels.clone()
        lab[2, 5] = bad
        with pytest.raises(IndexError, match=f"Target {bad} is out of bounds."):
            model(tokens, lab)
        with local_world(2), pytest.raises(IndexError, match=f"^Target {bad} is out of bounds.$"):
            pm(tokens, lab)


def test_ignore_index_labels_stay_ignored_under_vocab_parallel_loss(local_world, fp64):
    model, pm, tokens, labels = _megatron_gpt(local_world)
    lab = labels.clone()
    lab[:, -1] = -100
    want = model(tokens, lab)
    with local_world(2):
        got = pm(tokens, lab)
    for r in range(2):
        torch.testing.assert_close(got._local_tensors[r], want, rtol=0, atol=1e-12)
