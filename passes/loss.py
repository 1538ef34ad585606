"""Losses: recognition. The vocab-parallel cross-entropy form lives in `autopar.forms`."""

from __future__ import annotations

import torch
from torch import fx

from autopar.sites import Kind, LossSite, PassContext, module_path
from passes.patterns import linears_behind

aten = torch.ops.aten


def _vocab_why(node: fx.Node) -> str | None:
    """Why the vocab-parallel cross-entropy cannot replace this loss (None: it can)."""
    logits = node.args[0]
    smoothing = node.args[5] if len(node.args) > 5 else node.kwargs.get("label_smoothing", 0.0)
    weighted = (len(node.args) > 2 and node.args[2] is not None) or node.kwargs.get("weight") is not None
    if len(logits.meta["val"].shape) != 2:
        return f"its logits are {len(logits.meta['val'].shape)}-D (vocab-parallel cross-entropy takes (tokens, vocab))"
    if weighted:
        return "it has class weights"
    if smoothing:
        return f"it uses label smoothing {smoothing}"
    return None


def recognise_loss_pass(gm: fx.GraphModule, ctx: PassContext) -> fx.GraphModule:
    linear_nodes = {s.node: s for s in ctx.of_kind(Kind.LINEAR)}
    for node in gm.graph.nodes:
        if node.op != "call_function":
            continue
        if node.target is aten.cross_entropy_loss.default:
            logits = node.args[0]
            ctx.add(LossSite(key=module_path(node) or "loss", node=node, loss="cross_entropy",
                             head=tuple(linears_behind(logits, linear_nodes)),
                             vocab=int(logits.meta["val"].shape[-1]), vocab_why=_vocab_why(node)))
        elif node.target is aten.mse_loss.default:
            ctx.add(LossSite(key=module_path(node) or "loss", node=node, loss="mse",
                             vocab_why="it is not a cross-entropy over a vocabulary"))
    return gm
