"""Factories for `python -m autopar verify --model verify_models:<name>` in tests/test_verify.py: each returns
(model, example_inputs), the same on every rank (seeded)."""

from __future__ import annotations

import torch

from autopar.models import GPT, GPTConfig


def gpt():
    """A 2-layer GPT in fp64 and a batch of 4 x 16 tokens."""
    torch.manual_seed(0)
    model = GPT(GPTConfig()).double()
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, 128, (4, 16), generator=g)
    labels = torch.randint(0, 128, (4, 16), generator=g)
    return model, (ids, labels)


WRONG_PARAM = "ln_f.weight"


def gpt_wrong_on_rank1():
    """`gpt()`, with a bug injected into the parallel module on rank 1 only: the gradient of its replica of
    `WRONG_PARAM` is scaled by 1.5 (rank 0's copy is right, so only a check across ranks sees it)."""
    import torch.distributed as dist

    import autopar.api

    parallelize = autopar.api.parallelize

    def broken(*args, **kwargs):
        pm = parallelize(*args, **kwargs)
        if dist.get_rank() == 1:
            pm.get_parameter(WRONG_PARAM).register_hook(lambda g: g * 1.5)
        return pm

    autopar.api.parallelize = broken
    return gpt()


def moe_top1():
    """A 2-layer Llama whose MLPs are 4-expert top-1 MoEs over a `ModuleList` (experts owned whole by their
    ranks under expert parallelism); the last expert never wins a token (an expert without a gradient)."""
    from autopar.models import Llama, LlamaConfig

    torch.manual_seed(0)
    model = Llama(LlamaConfig(num_heads=4, num_kv_heads=2, moe_experts=4, moe_top_k=1, moe_style="modulelist"))
    model = model.double()
    for layer in model.layers:
        w = layer.mlp.router.weight
        with torch.no_grad():
            w[-1] = (w[0] + w[1]) / 2
    _, inputs = gpt()
    return model, inputs
