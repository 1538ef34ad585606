"""Embeddings: recognition and the vocab-parallel form.

Vocab form on an axis of size t: the table is sharded on rows (`Shard(0)`); each rank looks up the
ids in its rows and zeroes the rest (`autopar.runtime.ops.vocab_parallel_embedding`), the partial
outputs are all-reduced. A tied LM head uses the same row shard (column-parallel logits).
Precondition: vocab % t == 0 (uneven vocab shards are not supported yet: the table stays replicated).
"""

from __future__ import annotations

import torch
from torch import fx

from passes.context import PassContext, Site, module_path

aten = torch.ops.aten
FORMS = ("replicate", "vocab")


def recognise_embedding_pass(gm: fx.GraphModule, ctx: PassContext) -> fx.GraphModule:
    params = ctx.captured.param_fqns
    for node in gm.graph.nodes:
        if node.op == "call_function" and node.target is aten.embedding.default:
            w = node.args[0]
            if w.op == "placeholder" and w.name in params:
                vocab, dim = (int(s) for s in w.meta["val"].shape)
                site = Site("embedding", module_path(node) or node.name, node, {"weight": w.name})
                site.info.update(vocab=vocab, dim=dim)
                ctx.add(site)
    return gm
