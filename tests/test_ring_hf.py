"""Ring attention (context parallelism) on Hugging Face causal LMs from the zoo (`tests/zoo.py`).

Under `torch.export` these models build an explicit mask (`create_causal_mask` traces to arange, `le`,
`index`, `&` and the packed-sequence check on the positions: `diff`, `cumsum`) and pass it to SDPA. The zoo's
batches hold pad tokens but no `attention_mask` (the user's wrapper calls `m(input_ids=..., labels=...)`), so
no input reaches the mask: recognition evaluates it, finds the causal mask, and ring attention runs is_causal
with the mask dropped. RoPE: the models compute `position_ids` inside (`cache_position = arange(S)`), and the
rotary cos/sin, replicated, are split in the zigzag layout where they meet the sequence-sharded q and k, so
every rank rotates its tokens by their global positions.

Each family at 2 and 4 ranks: loss, every gradient and the parameters after an SGD step match one device
(the zoo's tolerance: these families round the logits to fp32 for the loss); the ring's collectives per
layer are p-1 K/V steps forward and p-1 K/V + p-1 dK/dV steps backward, each this rank's block of the KV
heads (the grouped K/V behind `repeat_kv`, not the expanded ones), `ring.layer_volume_bytes` per layer.
"""

from __future__ import annotations

import re
from collections import namedtuple

import pytest
from torch import nn
from torch.distributed.device_mesh import init_device_mesh

import autopar
import zoo
from autopar.api import _prepare
from autopar.forms.ring import layer_volume_bytes
from autopar.runtime import collectives as C
from autopar.solver import candidates, gather_stats
from equivalence import run_equivalence
from passes.masks import _ancestors

Comm = namedtuple("Comm", "kind axis pass_ numel send_bytes")  # a row of `Result.comms`


def _records(res) -> list[Comm]:
    return [Comm(*c) for c in res.comms]


FAMILIES = ["llama", "mistral", "qwen2", "qwen3", "gemma"]


def _from_rotary(node) -> bool:
    return any(any(path.endswith("rotary_emb") for path, _ in n.meta.get("nn_module_stack", {}).values())
               for n in _ancestors(node))


@pytest.mark.parametrize("p", [2, 4])
@pytest.mark.parametrize("family", FAMILIES)
def test_ring_on_hugging_face_matches_one_device(local_world, family, p):
    model, inputs, tol = zoo.FAMILIES[family]()
    sites = _prepare(model, {"cp": p}, inputs)[2].of_kind("attention")
    assert sites and all(s.has_mask and s.mask_causal for s in sites), [(s.key, s.mask_note) for s in sites]
    with local_world(p):
        res = run_equivalence(model, inputs, (p,), ("cp",), plan="dp", overrides={"attention": "ring@cp"})
    assert set(res.grad_err) == {n for n, _ in model.named_parameters()}
    assert res.max_err() < tol, (res.max_err(), res.loss - res.ref_loss)
    assert [s.form for s in res.plan.strategies if s.kind == "attention"] == ["ring"] * len(sites)

    layers, site = len(sites), sites[0]
    p2p = [r for r in _records(res) if r.kind == "p2p"]
    assert {r.axis for r in p2p} == {"cp"}
    assert sum(r.pass_ == "forward" for r in p2p) == (p - 1) * layers
    assert sum(r.pass_ == "backward" for r in p2p) == 2 * (p - 1) * layers
    h_kv = site.kv_heads * site.head_dim  # the KV heads of k_proj: ring circulates K/V before repeat_kv
    step = 2 * zoo.BATCH * zoo.SEQ // p * h_kv * 8
    assert all(r.send_bytes == step for r in p2p), {r.send_bytes for r in p2p}
    assert sum(r.send_bytes for r in p2p) == layers * layer_volume_bytes(zoo.BATCH, zoo.SEQ, h_kv, p, 8)

    splits = [n for n in res.graph_module.graph.nodes if n.op == "call_function" and n.target is C.split]
    assert all(n.args[2].endswith("~zigzag") for n in splits)  # every split on the context axis is zigzag
    rope = [n for n in splits if _from_rotary(n.args[0])]
    assert len(rope) == 2 * layers, [n.args[0] for n in rope]  # cos and sin, per layer, on their sequence dim
    assert all(n.args[1] == len(n.args[0].meta["val"].shape) - 2 for n in rope)


class PaddedLossWrap(nn.Module):
    """A causal LM called with the collator's padding mask."""

    def __init__(self, m):
        super().__init__()
        self.m = m

    def forward(self, input_ids, attention_mask, labels):
        return self.m(input_ids=input_ids, attention_mask=attention_mask, labels=labels).loss


def test_a_padding_mask_or_a_narrow_sliding_window_keeps_ring_refused(local_world):
    """With the user's `attention_mask` the mask depends on an input; Mistral with a 4-token window at 16 tokens
    is not causal. Ring is not offered (the solver takes Ulysses on the sequence axis) and forcing it says why."""
    import transformers
    model, inputs, _ = zoo.FAMILIES["llama"]()
    padded = PaddedLossWrap(model.m)
    batch = {**inputs, "attention_mask": (inputs["labels"] != -100).long()}
    cfg = transformers.MistralConfig(vocab_size=zoo.VOCAB, hidden_size=zoo.H, intermediate_size=zoo.I,
                                     num_hidden_layers=zoo.L, num_attention_heads=zoo.NH, num_key_value_heads=zoo.KV,
                                     max_position_embeddings=zoo.MAX_POS, sliding_window=4)
    windowed = zoo.LossWrap(transformers.MistralForCausalLM(cfg))
    cases = [(padded, batch, r"its mask depends on input attention_mask \(padding\)"),
             (windowed, inputs, r"its mask is a sliding window of 4 tokens, not causal over the 16-token sequence")]
    for model, x, why in cases:
        sites = _prepare(model, {"cp": 2}, x)[2].of_kind("attention")
        assert all(not s.mask_causal and re.fullmatch(why, s.mask_note) for s in sites), [s.mask_note for s in sites]
        with local_world(2):
            mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("cp",))
            with pytest.raises(ValueError, match=r"form 'ring' on mesh axis 'cp' \(size 2\) is not possible: "
                                                 + why + r"; ring attention supports is_causal or no mask\. "
                                                 r"Fix: 'ulysses', 'heads' or 'replicate'"):
                autopar.parallelize(model, mesh, x, plan="dp", overrides={"attention": "ring"})
        info, _, ctx = _prepare(model, {"cp": 2}, x)
        stats = gather_stats(ctx)[0]
        offered = {c.form for s in ctx.of_kind("attention") for c in candidates(s, stats[s.key], info, (), None, ("cp",))}
        assert offered == {"ulysses"}, offered  # the sequence split on cp: Ulysses, never ring
