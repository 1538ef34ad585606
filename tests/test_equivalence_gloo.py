"""Numeric equivalence on real gloo processes (2 and 4 ranks), the twin of test_equivalence_local.

The workers of `dist_harness.gloo_pool` import this module by name (tests/ is on their sys.path), so
the model and input factories below stay at module level and cheap to import. Every rank builds the
same seeded reference (`equivalence.gloo_equivalence`), parallelises it, trains one or two SGD steps
and compares loss, every gradient and every updated parameter with its own single-device run.
"""

from __future__ import annotations

import pytest
import torch

from dist_harness import gloo_pool
from equivalence import gloo_equivalence

TOL = 1e-10  # fp64 end to end
HF_TOL = 1e-5  # Hugging Face losses run on fp32 logits


def make_gpt():
    from autopar.models import GPT, GPTConfig

    return GPT(GPTConfig())


def make_llama():
    from autopar.models import Llama, LlamaConfig

    return Llama(LlamaConfig(num_heads=4, num_kv_heads=2))


def make_hf_llama():
    from transformers import LlamaConfig, LlamaForCausalLM

    return LlamaForCausalLM(LlamaConfig(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=16,
                                        use_cache=False)).eval()


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
    # id: (world, make_ref, inputs_fn, mesh shape, axis names, plan, steps, tolerance)
    "gpt-tp4": (4, make_gpt, token_inputs, (4,), ("tp",), "megatron", 1, TOL),
    "llama-dp2xtp2": (4, make_llama, token_inputs, (2, 2), ("dp", "tp"), "megatron", 2, TOL),
    "hf_llama-tp2": (2, make_hf_llama, hf_inputs, (2,), ("tp",), "megatron", 1, HF_TOL),
}


@pytest.mark.parametrize("case", list(CASES))
def test_gloo_equivalence(case):
    world, make, inputs_fn, shape, names, plan, steps, tol = CASES[case]
    results = gloo_pool(world).run(gloo_equivalence, make, inputs_fn, shape, names, plan, None, steps)
    assert len(results) == world
    expected = _param_names(make)
    for rank, res in enumerate(results):
        assert set(res.grad_err) == expected, f"rank {rank}: gradients compared {sorted(res.grad_err)}"
        assert set(res.param_err) == expected, f"rank {rank}: parameters compared {sorted(res.param_err)}"
        bad = {k: v for k, v in {**res.grad_err, **{f"{k} (after step)": v for k, v in res.param_err.items()}}.items()
               if not v <= tol}
        assert not bad, f"rank {rank}: differs from single-device: {bad}"
        assert abs(res.loss - res.ref_loss) <= tol * max(1.0, abs(res.ref_loss)), (rank, res.loss, res.ref_loss)
        assert res.max_err() <= tol * max(1.0, abs(res.ref_loss)), (rank, res.max_err())
        assert res.comm_counts, f"rank {rank}: no collective ran"
    # every rank: the same loss, the same reference, the same collectives, the same local shard sizes
    assert len({r.loss for r in results}) == 1, [r.loss for r in results]
    assert len({r.ref_loss for r in results}) == 1, [r.ref_loss for r in results]
    assert all(r.comm_counts == results[0].comm_counts for r in results), [r.comm_counts for r in results]
    assert all(r.graph_counts == results[0].graph_counts for r in results)
    assert all(r.local_numel == results[0].local_numel for r in results)
