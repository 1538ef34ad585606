"""MLP blocks: a colwise linear, elementwise work, a rowwise linear (Megatron's f ... g pair).

Recognised: linears (one or several: SwiGLU's gate and up, or one fused gate-up projection split
into equal halves, as Phi-3's `gate_up_proj` + `chunk`) whose outputs meet in a region of
elementwise ops that feeds one linear with matching input features. Every op of the region takes
only region values, the feeding linears' outputs and values that do not depend on the batch
(parameters, constants): a residual add or a norm, which mixes in another activation, ends the
region, so an "MLP" never spans two layers. The feeding linears are colwise, the consuming one
rowwise (the form lives in `autopar.forms`), so the block needs one all-reduce forward and one
backward.
"""

from __future__ import annotations

import torch
from torch import fx

from autopar.sites import Kind, LinearSite, MlpSite, PassContext
from passes.patterns import TRANSPARENT
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


def _batch_dependent(gm: fx.GraphModule, user_inputs: set[str]) -> set[fx.Node]:
    out: set[fx.Node] = set()
    for n in gm.graph.nodes:
        if (n.op == "placeholder" and n.name in user_inputs) or any(a in out for a in n.all_input_nodes):
            out.add(n)
    return out


def _starts(site: LinearSite) -> tuple[list[fx.Node], int]:
    """Where the block's hidden activations start: the linear's output, or the equal parts a fused gate-up
    projection is split into (each `out_features / parts` wide)."""
    if site.parts == 1:
        return [site.node], site.out_features
    feats = site.out_features // site.parts
    node = site.node
    while len(node.users) == 1 and next(iter(node.users)).target in TRANSPARENT \
            and int(next(iter(node.users)).meta["val"].shape[-1]) == site.out_features:
        node = next(iter(node.users))
    starts = [g for u in node.users if u.target in (aten.split.Tensor, aten.split_with_sizes.default,
                                                     aten.chunk.default) for g in u.users]
    return starts, feats


def recognise_mlp_pass(gm: fx.GraphModule, ctx: PassContext) -> fx.GraphModule:
    linear_nodes = {s.node: s for s in ctx.of_kind(Kind.LINEAR)}
    batch = _batch_dependent(gm, set(ctx.captured.user_inputs))
    taken = {id(m) for s in ctx.sites if s.kind in (Kind.ATTENTION, Kind.LOSS) for m in s.members()}
    for site in ctx.of_kind(Kind.LINEAR):
        if id(site) in taken:
            continue
        starts, feats = _starts(site)
        region, stack, producers, consumers = set(starts), list(starts), {id(site): site}, {}

        def admissible(u: fx.Node) -> bool:
            """u joins the region if every activation it reads is the region's (or another feeding linear's)."""
            val = u.meta.get("val")
            if not isinstance(val, torch.Tensor) or not val.dim() or int(val.shape[-1]) != feats:
                return False
            found = []
            for inp in u.all_input_nodes:
                if inp in region or inp not in batch:
                    continue
                other = linear_nodes.get(inp)
                if other is None or other.out_features != feats or other.parts != 1 or id(other) in taken:
                    return False
                found.append(other)
            producers.update((id(o), o) for o in found)
            return True

        while stack:
            n = stack.pop()
            for u in n.users:
                if u in linear_nodes:
                    ls = linear_nodes[u]
                    if ls.input is n and ls.in_features == feats and id(ls) not in taken and ls is not site:
                        consumers[id(ls)] = ls
                elif u.op == "call_function" and u.target in _REGION and u not in region and admissible(u):
                    region.add(u)
                    stack.append(u)
        if len(consumers) != 1 or any(id(p) in consumers for p in producers):
            continue
        cols, rows = list(producers.values()), list(consumers.values())
        mlp = MlpSite(key=_mlp_key([s.key for s in cols + rows]), node=site.node, col=tuple(cols), row=tuple(rows),
                      features=site.out_features if site.parts == 1 else feats)
        ctx.add(mlp)
        taken.update(id(s) for s in cols + rows)
    return gm
