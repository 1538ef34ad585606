"""`autopar.layers.find_layers`: a model's repeated blocks, in forward order, with the parameters only they use."""

import torch

from autopar.capture import capture
from autopar.layers import find_layers, layers_matching
from zoo import FAMILIES


def _layers(family):
    model, inputs, _ = FAMILIES[family]()
    c = capture(model, (), inputs) if isinstance(inputs, dict) else capture(model, tuple(inputs) if isinstance(inputs, tuple) else (inputs,), {})
    return c, find_layers(c.gm, set(c.param_fqns) | set(c.buffer_fqns))


def test_llama_layers_in_order_with_their_parameters():
    c, layers = _layers("llama")
    assert [l.path for l in layers] == ["m.model.layers.0", "m.model.layers.1"]
    assert {l.cls for l in layers} == {"LlamaDecoderLayer"}
    for l in layers:
        fqns = {c.param_fqns[p] for p in l.params}
        assert fqns and all(f.startswith(l.path + ".") for f in fqns)
        own = {f for f in c.param_fqns.values() if f.startswith(l.path + ".")}
        assert fqns == own  # every parameter of the block, none of another
    names = [n.name for n in c.gm.graph.nodes]
    assert names.index(layers[0].nodes[-1]) < names.index(layers[1].nodes[0])


def test_globs_and_class_names_select_layers():
    _, layers = _layers("gpt2")
    assert [l.path for l in layers_matching(layers, "h.*")] == ["m.transformer.h.0", "m.transformer.h.1"]
    assert [l.path for l in layers_matching(layers, "transformer.h.1")] == ["m.transformer.h.1"]
    assert len(layers_matching(layers, "GPT2Block")) == 2
    assert layers_matching(layers, "layers.*") == []


def test_a_model_without_numbered_blocks_has_no_layers():
    c = capture(torch.nn.ModuleDict({"f": torch.nn.Linear(4, 4)})["f"], (torch.randn(2, 4),), {})
    assert find_layers(c.gm, set(c.param_fqns)) == []
