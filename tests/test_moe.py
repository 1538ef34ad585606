"""Expert parallelism: MoE blocks in each spelling, against the single-device model on gloo.

Every case parallelises a seeded fp64 reference on real gloo processes, trains two SGD steps and
compares the loss (including the auxiliary load-balancing loss), every gradient and every
parameter after each step; the all-to-all count and the expert shards are asserted too.
"""

from __future__ import annotations

import math

import pytest
import torch

from dist_harness import gloo_pool
from equivalence import gloo_equivalence

TOL = 1e-10  # fp64 end to end
HF_TOL = 1e-5  # Hugging Face Mixtral routes and computes its loss in fp32


def _llama(style: str, k: int, experts: int = 4, **kw):
    from autopar.models import Llama, LlamaConfig

    model = Llama(LlamaConfig(num_heads=4, num_kv_heads=2, moe_experts=experts, moe_top_k=k, moe_style=style, **kw))
    if k == 1:  # the last expert's router row is the mean of two others: it never wins top-1 (an idle expert)
        for layer in model.layers:
            w = layer.mlp.router.weight
            with torch.no_grad():
                w[-1] = (w[0] + w[1]) / 2
    return model


def make_modulelist_top2():
    return _llama("modulelist", 2)


def make_modulelist_top1():
    return _llama("modulelist", 1)


def make_grouped_top2():
    return _llama("grouped", 2)


def make_grouped_top1():
    return _llama("grouped", 1)


def make_capacity_top2():
    return _llama("modulelist", 2, moe_capacity_factor=1.0)


def make_mixtral():
    from transformers import MixtralConfig, MixtralForCausalLM

    cfg = MixtralConfig(vocab_size=128, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                        num_attention_heads=4, num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2,
                        max_position_embeddings=16, output_router_logits=True, router_aux_loss_coef=0.02,
                        use_cache=False)
    cfg._experts_implementation = "eager"  # fp64 (the default grouped_mm takes fp32/bf16 only)
    return MixtralForCausalLM(cfg).eval()


def _ids():
    g = torch.Generator().manual_seed(1)
    return torch.randint(0, 128, (4, 16), generator=g), torch.randint(0, 128, (4, 16), generator=g)


def token_inputs():
    return _ids()


def hf_inputs():
    ids, labels = _ids()
    return {"input_ids": ids, "labels": labels}


def _param_names(make) -> set[str]:
    old = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    try:
        return {n for n, _ in make().named_parameters()}
    finally:
        torch.set_default_dtype(old)


CASES = {
    # id: (world, make_ref, inputs_fn, mesh shape, axis names, plan, overrides, MoE layers)
    "modulelist-top2-ep2": (2, make_modulelist_top2, token_inputs, (2,), ("ep",), "dp", {"moe": "expert@ep"}, 2),
    "modulelist-top1-ep4": (4, make_modulelist_top1, token_inputs, (4,), ("ep",), "dp", {"moe": "expert@ep"}, 2),
    "grouped-top2-ep4": (4, make_grouped_top2, token_inputs, (4,), ("ep",), "dp", {"moe": "expert@ep"}, 2),
    "grouped-top1-ep2": (2, make_grouped_top1, token_inputs, (2,), ("ep",), "dp", {"moe": "expert@ep"}, 2),
    "grouped-top2-dp2xep2": (4, make_grouped_top2, token_inputs, (2, 2), ("dp", "ep"), "dp", {"moe": "expert@ep"}, 2),
    "modulelist-top2-dp2xep2": (4, make_modulelist_top2, token_inputs, (2, 2), ("dp", "ep"), "dp",
                                {"moe": "expert@ep"}, 2),
    "mixtral-ep2": (2, make_mixtral, hf_inputs, (2,), ("ep",), "dp", {"moe": "expert@ep"}, 2),
    "mixtral-dp2xep2": (4, make_mixtral, hf_inputs, (2, 2), ("dp", "ep"), "dp", {"moe": "expert@ep"}, 2),
    "grouped-top2-tp2-partial": (2, make_grouped_top2, token_inputs, (2,), ("tp",), "megatron",
                                 {"moe": "expert@tp"}, 2),
    "capacity-top2-ep2": (2, make_capacity_top2, token_inputs, (2,), ("ep",), "dp", {"moe": "expert@ep"}, 2),
}


@pytest.mark.parametrize("case", list(CASES))
def test_moe_equivalence(case):
    world, make, inputs_fn, shape, names, plan, overrides, layers = CASES[case]
    results = gloo_pool(world).run(gloo_equivalence, make, inputs_fn, shape, names, plan, overrides, 2)
    expected = _param_names(make)
    tol = HF_TOL if "mixtral" in case else TOL
    for rank, res in enumerate(results):
        assert set(res.grad_err) | res.idle == expected and set(res.param_err) == expected
        if "top1" in case:  # the idle expert (router row = mean of two others) got no token, in every layer
            assert {n for n in res.idle if ".experts." in n or n.endswith(("w1", "w2", "w3"))} or \
                "grouped" in case, res.idle
        bad = {k: v for k, v in {**res.grad_err, **{f"{k} (after step)": v for k, v in res.param_err.items()}}.items()
               if not v <= tol}
        assert not bad, f"rank {rank}: differs from single-device: {bad}"
        assert abs(res.loss - res.ref_loss) <= tol * max(1.0, abs(res.ref_loss)), (rank, res.loss, res.ref_loss)
    counts = results[0].comm_counts
    if "partial" in case:  # tokens replicated on the expert axis: no all-to-all, the output is all-reduced
        assert "all_to_all.forward" not in counts and "all_to_all.backward" not in counts, counts
    else:  # per MoE layer: counts, tokens out, tokens back forward; tokens out and back backward
        assert counts.get("all_to_all.forward") == 3 * layers, counts
        assert counts.get("all_to_all.backward") == 2 * layers, counts
    ep = shape[names.index(overrides["moe"].split("@")[1])]
    for name, numel in results[0].local_numel.items():
        if name.endswith(("experts.w1", "experts.w2", "experts.w3", "gate_up_proj", "down_proj")):
            full = math.prod(dict((n, p.shape) for n, p in _shapes(make).items())[name])
            assert numel * ep == full, (name, numel, full)  # 1/ep of every stacked expert weight per rank
    assert all(r.comm_counts == results[0].comm_counts for r in results), [r.comm_counts for r in results]


def _shapes(make):
    old = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    try:
        return dict(make().named_parameters())
    finally:
        torch.set_default_dtype(old)
