"""The ordered recognition pipeline, and the runner of every pass list (recognition, lowering): it lints the
graph after each pass and names the pass on failure."""

from __future__ import annotations

from torch import fx

from passes.attention import recognise_attention_pass
from passes.embedding import recognise_embedding_pass
from passes.fuse_attention import fuse_attention_pass
from passes.linear import recognise_linear_pass
from passes.loss import recognise_loss_pass
from passes.masks import recognise_masks_pass
from passes.mlp import recognise_mlp_pass
from passes.moe import recognise_moe_pass
from passes.norm import recognise_norm_pass

# recognition: each pass adds Sites to the PassContext; none mutates the graph
RECOGNISE = [
    fuse_attention_pass,  # the one rewrite: explicit attention -> SDPA (flash memory; every attention form applies)
    recognise_linear_pass,
    recognise_embedding_pass,
    recognise_attention_pass,
    recognise_masks_pass,  # which explicit masks are the causal mask (AttentionSite.mask_causal)
    recognise_loss_pass,
    recognise_mlp_pass,
    recognise_moe_pass,  # MoE blocks were verified and captured as autopar::moe_experts
    recognise_norm_pass,
]


def run_passes(gm: fx.GraphModule, ctx, passes) -> fx.GraphModule:
    done = []
    for p in passes:
        try:
            gm = p(gm, ctx)
            gm.graph.lint()
        except Exception as e:
            raise type(e)(f"{e}\n(in pass {p.__name__}; passes before it: {[d.__name__ for d in done]})") from e
        done.append(p)
    return gm
