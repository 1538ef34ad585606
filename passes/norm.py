"""Norms: recognition (LayerNorm, and RMSNorm written out as pow-mean-rsqrt-mul) and the sequence form.

Sequence form (Megatron sequence parallelism, Korthikanti et al. 2205.05198) on the axis of the
tensor-parallel blocks: the norm's input — the residual stream — is sharded on the sequence
(`S(1)`), so norms, residual adds and dropout run on s/t tokens. The lowering then needs no special
case: a column-parallel linear consuming the sequence-sharded stream all-gathers it (forward) and
reduce-scatters its input gradient (backward); a row-parallel output added to the sequence-sharded
stream is reduce-scattered (forward) and all-gathered (backward); norm weights see partial
gradients, summed over the axis by `grad_all_reduce`. Precondition: sequence % t == 0.
"""

from __future__ import annotations

import torch
from torch import fx

from passes.context import PassContext, Site, module_path

aten = torch.ops.aten
FORMS = ("replicate", "sequence")
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
            site = Site("norm", module_path(node) or node.name, node)
            for role, i in (("weight", 2), ("bias", 3)):
                a = node.args[i] if len(node.args) > i else None
                if isinstance(a, fx.Node) and a.name in params:
                    site.params[role] = a.name
        elif node.target is aten.pow.Tensor_Scalar:
            x = _rms_input(node)
            if x is None:
                continue
            site = Site("norm", module_path(node) or node.name, node)
        else:
            continue
        shp = tuple(x.meta["val"].shape)
        if len(shp) < 3:
            continue  # (tokens, hidden): no sequence dim to shard
        site.info.update(input=x, seq_dim=1, seq_len=shp[1])
        ctx.add(site)
    return gm
