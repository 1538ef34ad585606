"""Every op in the graphs of the test models has a checked sharding rule, or is replicated on purpose.

The graphs: the Hugging Face zoo families (`tests/zoo.py`) and autopar's own models (`autopar.models`: GPT,
Llama with explicit and SDPA attention, with ModuleList, grouped and capacity-bounded MoE, the MLP), as
`autopar.capture` captures them (composite ops without a rule decomposed: `passes.decompose`). Every ATen (and
autopar) op in them has a rule (`passes.rules.rule_for`: own or DTensor-derived, checked op by op, forward and
backward, by `test_rule_check.py` and the rule sweep) or is in `passes.rules.REPLICATED_ON_PURPOSE` (with why). A model that brings a new op without a rule fails here; once allowed, the lowering gathers its sharded inputs
and notes it (`test_rule_check.test_unruled_ops_are_replicated_and_noted`): a replication, never a guess.
"""

from __future__ import annotations

import warnings

import pytest
import torch

from autopar.capture import capture, split_example_inputs
from autopar.models import GPT, MLP, GPTConfig, Llama, LlamaConfig
from passes.rules import REPLICATED_ON_PURPOSE, RULES, rule_for
from test_equivalence_gloo import token_inputs
from zoo import FAMILIES


def _own(make, inputs=token_inputs):
    def build():
        torch.manual_seed(0)
        return make(), inputs()
    return build


def _mlp_inputs():
    g = torch.Generator().manual_seed(1)
    return torch.randn(8, 16, generator=g), torch.randn(8, 16, generator=g)


OWN_MODELS = {
    "GPT": _own(lambda: GPT(GPTConfig())),
    "Llama": _own(lambda: Llama(LlamaConfig(num_heads=4, num_kv_heads=2))),
    "Llama-sdpa": _own(lambda: Llama(LlamaConfig(num_heads=4, num_kv_heads=2, attention="sdpa"))),
    "Llama-moe": _own(lambda: Llama(LlamaConfig(num_heads=4, num_kv_heads=2, moe_experts=4))),
    "Llama-moe-grouped": _own(lambda: Llama(LlamaConfig(num_heads=4, num_kv_heads=2, moe_experts=4,
                                                        moe_style="grouped"))),
    "Llama-moe-capacity": _own(lambda: Llama(LlamaConfig(num_heads=4, num_kv_heads=2, moe_experts=4,
                                                         moe_capacity_factor=1.5))),
    "MLP": _own(MLP, _mlp_inputs),
}


def _ops(model, inputs) -> set:
    args, kwargs = split_example_inputs(inputs)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        gm = capture(model, args, kwargs).gm
    return {n.target for n in gm.graph.nodes if n.op == "call_function" and isinstance(n.target, torch._ops.OpOverload)}


def test_every_op_of_the_test_models_has_a_rule_or_is_replicated_on_purpose(fp64):
    unruled: dict[str, set[str]] = {}
    seen = set()
    builders = {**{f"zoo {f}": (lambda f=f: FAMILIES[f]()[:2]) for f in FAMILIES}, **OWN_MODELS}
    for name, build in builders.items():
        model, inputs = build()
        ops = _ops(model, inputs)
        assert ops, name
        seen |= ops
        for op in {op for op in ops if rule_for(op) is None} - set(REPLICATED_ON_PURPOSE):
            unruled.setdefault(str(op), set()).add(name)
    assert not unruled, (
        "ops in the test models' graphs without a sharding rule (add one to passes/rules.py, DTensor-derived where "
        "DTensor answers, with samples in tests/rule_samples.py; or list the op in REPLICATED_ON_PURPOSE with why): "
        + "; ".join(f"{op} in {sorted(models)}" for op, models in sorted(unruled.items())))
    assert len(seen) > 90, len(seen)  # the graphs were captured whole (94 distinct ops in the zoo alone)


@pytest.mark.parametrize("op", list(REPLICATED_ON_PURPOSE), ids=str)
def test_replicated_on_purpose_says_why_and_has_no_rule(op):
    assert op not in RULES and len(REPLICATED_ON_PURPOSE[op]) > 20
