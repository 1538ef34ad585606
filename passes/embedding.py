"""Embeddings: recognition. Its vocab-parallel form lives in `autopar.forms`."""

from __future__ import annotations

import torch
from torch import fx

from autopar.sites import EmbeddingSite, PassContext, module_path

aten = torch.ops.aten


def recognise_embedding_pass(gm: fx.GraphModule, ctx: PassContext) -> fx.GraphModule:
    params = ctx.captured.param_fqns
    for node in gm.graph.nodes:
        if node.op == "call_function" and node.target is aten.embedding.default:
            w = node.args[0]
            if w.op == "placeholder" and w.name in params:
                vocab, dim = (int(s) for s in w.meta["val"].shape)
                padding_idx = node.args[2] if len(node.args) > 2 else node.kwargs.get("padding_idx", -1)
                by_freq = node.args[3] if len(node.args) > 3 else node.kwargs.get("scale_grad_by_freq", False)
                views = [w] + [u for u in w.users if u.target in (aten.detach.default, aten.alias.default)]
                renorm = any(u.target is aten.embedding_renorm_.default for v in views for u in v.users)
                ctx.add(EmbeddingSite(key=module_path(node) or node.name, node=node, params=(("weight", w.name),),
                                      vocab=vocab, dim=dim,
                                      padding_idx=None if padding_idx is None or padding_idx < 0 else int(padding_idx),
                                      max_norm=1.0 if renorm else None, scale_grad_by_freq=bool(by_freq)))
    return gm
