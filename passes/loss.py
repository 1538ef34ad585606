"""Losses: recognition, and the vocab-parallel cross-entropy form.

Vocab form: the LM head is column-parallel, its logits stay sharded on the vocabulary, and the
cross-entropy is computed with 3 all-reduces of b*s fp32 values (max, target logit, sum of exps)
instead of gathering b*s*V logits (`autopar.runtime.ops.vocab_parallel_cross_entropy`).
Whatever the form, a mean over a sharded batch divides by the *global* count of valid tokens.
Preconditions for vocab: 2-D logits, no class weights, no label smoothing, vocab % t == 0.
"""

from __future__ import annotations

import torch
from torch import fx

from passes.attention import _linears_behind
from passes.context import PassContext, Site, module_path

aten = torch.ops.aten
FORMS = ("replicate", "vocab")


def recognise_loss_pass(gm: fx.GraphModule, ctx: PassContext) -> fx.GraphModule:
    linear_nodes = {s.node: s for s in ctx.of_kind("linear")}
    for node in gm.graph.nodes:
        if node.op != "call_function":
            continue
        if node.target is aten.cross_entropy_loss.default:
            logits = node.args[0]
            site = Site("loss", module_path(node) or "loss", node)
            heads = [s for s in _linears_behind(logits, linear_nodes)]
            smoothing = node.args[5] if len(node.args) > 5 else node.kwargs.get("label_smoothing", 0.0)
            weighted = (len(node.args) > 2 and node.args[2] is not None) or node.kwargs.get("weight") is not None
            site.info.update(loss="cross_entropy", head=heads, vocab=int(logits.meta["val"].shape[-1]),
                             vocab_ok=len(logits.meta["val"].shape) == 2 and not smoothing and not weighted)
            ctx.add(site)
        elif node.target is aten.mse_loss.default:
            site = Site("loss", module_path(node) or "loss", node)
            site.info.update(loss="mse", head=[], vocab=None, vocab_ok=False)
            ctx.add(site)
    return gm
