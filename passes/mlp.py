"""MLP blocks: a colwise linear, elementwise work, a rowwise linear (Megatron's f ... g pair).

Recognised: linears (one or several: SwiGLU's gate and up) whose outputs meet in a region of
elementwise ops that feeds one linear with matching input features. The feeding linears are
colwise, the consuming one rowwise, so the block needs one all-reduce forward and one backward.
"""

from __future__ import annotations

import torch
from torch import fx

from passes.context import TRANSPARENT, PassContext, Site
from passes.rules import ELEMENTWISE

aten = torch.ops.aten
_REGION = set(ELEMENTWISE) | TRANSPARENT


def _mlp_key(keys: list[str]) -> str:
    """The MLP's own module path when its layers share a parent named like one ("mlp", "ffn",
    "feed_forward"), else the parent with its layers listed: "h.0.{fc,out}"."""
    parts = [k.split(".") for k in keys]
    out = []
    for col in zip(*parts):
        if len(set(col)) != 1:
            break
        out.append(col[0])
    prefix = ".".join(out)
    if out and any(w in out[-1].lower() for w in ("mlp", "ffn", "feed_forward", "feedforward")):
        return prefix
    rest = [".".join(p[len(out):]) for p in parts]
    return (prefix + "." if prefix else "") + "{" + ",".join(rest) + "}"


def recognise_mlp_pass(gm: fx.GraphModule, ctx: PassContext) -> fx.GraphModule:
    linear_nodes = {s.node: s for s in ctx.of_kind("linear")}
    taken = set()
    for a in ctx.of_kind("attention"):
        for role in ("q", "k", "v", "out"):
            taken.update(id(s) for s in a.info[role])
    for l in ctx.of_kind("loss"):
        taken.update(id(s) for s in l.info["head"])
    for site in ctx.of_kind("linear"):
        if id(site) in taken:
            continue
        feats = site.info["out_features"]
        region, stack, producers, consumers = set(), [site.node], {id(site): site}, {}
        while stack:
            n = stack.pop()
            for u in n.users:
                if u in linear_nodes:
                    ls = linear_nodes[u]
                    x = u.args[1] if u.target is aten.addmm.default else u.args[0]
                    if x is n and ls.info["in_features"] == feats and id(ls) not in taken:
                        consumers[id(ls)] = ls
                elif u.op == "call_function" and u.target in _REGION and u not in region:
                    region.add(u)
                    stack.append(u)
                    for inp in u.all_input_nodes:
                        if inp in linear_nodes and inp is not site.node:
                            other = linear_nodes[inp]
                            if other.info["out_features"] == feats and id(other) not in taken:
                                producers[id(other)] = other
        if len(consumers) != 1:
            continue
        cols, rows = list(producers.values()), list(consumers.values())
        mlp = Site("mlp", _mlp_key([s.key for s in cols + rows]), site.node)
        mlp.info.update(col=cols, row=rows, features=feats)
        ctx.add(mlp)
        taken.update(id(s) for s in cols + rows)
    return gm
