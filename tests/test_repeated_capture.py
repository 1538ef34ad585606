"""Offline planning captures a repeated layer once (`autopar.repeated`, issue #25 item 1): the plan made on the
copied layers is the plan made on the whole model's capture; layers that differ are captured whole."""

from __future__ import annotations

import math

import pytest
import torch
import autopar
from autopar.api import _resolve_plan
from autopar.models import Llama, LlamaConfig, LlamaMLP
from autopar.prepare import _prepare
from autopar.repeated import repeated_list

MESH = {"dp": 2, "tp": 2}


def _model(moe: int = 0):
    torch.manual_seed(0)
    return Llama(LlamaConfig(num_layers=4, attention="sdpa", moe_experts=moe, moe_style="grouped"))


def _inputs():
    ids = torch.zeros(4, 16, dtype=torch.long)
    return (ids, ids)


def _captures(model, plan="auto"):
    out = []
    for reuse in (False, True):
        info, captured, ctx = _prepare(model, MESH, _inputs(), reuse_layers=reuse)
        out.append((captured, _resolve_plan(plan, ctx, info, None, captured, "h100")))
    return out


def _graph(captured):
    return [(n.op, n.name, str(n.target), tuple(getattr(n.meta.get("val"), "shape", ()) or ()),
             tuple((n.meta.get("nn_module_stack") or {}).values()), str(n.args), str(n.kwargs))
            for n in captured.gm.graph.nodes]


@pytest.mark.parametrize("moe", [0, 4], ids=["dense", "moe"])
def test_copied_layers_plan_equals_full_capture(moe):
    model = _model(moe)
    assert repeated_list(model) == ("layers", 4)
    (full, p_full), (fast, p_fast) = _captures(model)
    assert any("planned on copies of layers.1" in n for n in fast.notes)
    assert not any("planned on copies" in n for n in full.notes)
    assert fast.notes[:-1] == full.notes  # the notes of the copies' layers (verified MoE blocks) as on the whole
    # the graph built from the copies is the full capture's: ops, names, shapes, module paths, inputs, fingerprint
    assert _graph(fast) == _graph(full)
    assert fast.input_kinds == full.input_kinds and fast.param_fqns == full.param_fqns
    assert fast.fingerprint() == full.fingerprint()
    # and so is the plan
    assert p_fast.strategies == p_full.strategies
    assert p_fast.params == p_full.params and p_fast.inputs == p_full.inputs
    assert p_fast.directives == p_full.directives and p_fast.checkpoint == p_full.checkpoint
    assert p_fast.graph == p_full.graph
    assert math.isclose(p_fast.estimate.step_time_s, p_full.estimate.step_time_s, rel_tol=1e-9)
    assert p_fast.estimate.memory_bytes_per_device == p_full.estimate.memory_bytes_per_device


def test_autopar_plan_takes_the_fast_path_and_lowers():
    """`autopar.plan` (the CLI's entry) plans on the copies; lowered offline, it lists the full capture's comms."""
    model = _model()
    p = autopar.plan(model, MESH, _inputs(), plan="megatron", lower=True)
    assert any("planned on copies of layers.1" in n for n in p.notes)
    info, captured, ctx = _prepare(model, MESH, _inputs())
    full = _resolve_plan("megatron", ctx, info, None, captured, "h100")
    assert p.params == full.params and p.graph == full.graph
    assert p.comms, "a lowered megatron plan lists its collectives"


def test_layers_that_differ_are_captured_whole():
    """One layer another width, or one attribute that changes its forward: no copies, the full capture."""
    model = _model()
    cfg = LlamaConfig(num_layers=4, attention="sdpa", ffn_hidden=96)
    model.layers[2].mlp = LlamaMLP(cfg)
    assert repeated_list(model) is None
    (full, p_full), (fast, p_fast) = _captures(model, plan="megatron")
    assert not any("planned on copies" in n for n in fast.notes)
    assert _graph(fast) == _graph(full) and p_fast.params == p_full.params
    other = _model()
    other.layers[3].attn_norm.eps = 1e-3
    assert repeated_list(other) is None
