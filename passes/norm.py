"""Norms: recognition (LayerNorm, and RMSNorm written out as pow-mean-rsqrt-mul).

The site records the normalised input (the residual stream) and its sequence dim; the sequence
form (Megatron sequence parallelism) lives in `autopar.forms`.
"""

from __future__ import annotations

import torch
from torch import fx

from autopar.sites import NormSite, PassContext, module_path

aten = torch.ops.aten
_CASTS = (aten.to.dtype, aten._to_copy.default, aten.to.dtype_layout)


def _rms_input(pow_node: fx.Node) -> fx.Node | None:
    """x for x.pow(2).mean(-1, keepdim) -> + eps -> rsqrt -> x * that (optionally x cast to fp32 first)."""
    if pow_node.args[1] != 2:
        return None
    x = pow_node.args[0]
    means = [u for u in pow_node.users if u.target is aten.mean.dim]
    if len(means) != 1:
        return None
    if x.op == "call_function" and x.target in _CASTS:
        x = x.args[0]
    return x


def recognise_norm_pass(gm: fx.GraphModule, ctx: PassContext) -> fx.GraphModule:
    params = ctx.captured.param_fqns
    for node in gm.graph.nodes:
        if node.op != "call_function":
            continue
        if node.target is aten.layer_norm.default:
            x = node.args[0]
            roles = []
            for role, i in (("weight", 2), ("bias", 3)):
                a = node.args[i] if len(node.args) > i else None
                if isinstance(a, fx.Node) and a.name in params:
                    roles.append((role, a.name))
        elif node.target is aten.pow.Tensor_Scalar:
            x = _rms_input(node)
            if x is None:
                continue
            roles = []
        else:
            continue
        shp = tuple(x.meta["val"].shape)
        if len(shp) < 3:
            continue  # (tokens, hidden): no sequence dim to shard
        ctx.add(NormSite(key=module_path(node) or node.name, node=node, params=tuple(roles), input=x, seq_dim=1,
                         seq_len=shp[1]))
    return gm
