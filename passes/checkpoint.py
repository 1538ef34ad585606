"""Lowering's last pass: each checkpointed layer's nodes outlined into a submodule run under activation
checkpointing (`autopar.runtime.checkpoint.Checkpointed`).

A layer's region is every call_function node of the lowered graph from its first to its last node (by the
captured graph's node names, `LowerContext.checkpoint`), and the collectives right after it that lowering made
for the layer (the all-reduce of a partial output the lowering carried through the residual add), so the
collectives lowering inserted for the layer are in it and issued again with it (as `autopar.solver` prices). Gradient buckets (`grad_sync_bucket`: an identity forward on parameters,
all-reduce in backward) placed inside are moved before the region: their backward must run once, and they
depend on placeholders only. So are FSDP's per-layer gathers (`fsdp_gather`: the layer's, and the next layer's
`fsdp_prefetch`, which lowering puts at the layer's start): the region starts after its layer's gather, whose
full parameters are its inputs. Checkpoint saves its inputs through the saved-tensor hooks active outside it,
so a resharded group's (`autopar.runtime.fsdp`) are replaced by handles: the recompute reads them through the
ZeRO-3 re-gather in backward (one all-gather per group and axis, as without checkpointing), never a second
gather; a kept group's stay held. The region becomes `checkpoint_<i>` (a `Checkpointed` module) called with the
values it reads from outside and returning those read after it; its body is a GraphModule whose nodes keep
their names and meta. `walk(gm)` yields the nodes of the graph and of its checkpointed bodies (what counts
collectives or looks for ops in a lowered program must use it).
"""

from __future__ import annotations

import operator

from torch import fx

from autopar.runtime import collectives as C
from passes import meta as M
from autopar.runtime.checkpoint import Checkpointed, whole
from autopar.runtime.fsdp import fsdp_gather, fsdp_prefetch
from autopar.runtime.moe import moe_experts
from autopar.runtime.ring_attention import ring_attention


# nodes on parameters only that run once, before the region: their backward is not a recompute
_BEFORE = (C.grad_sync_bucket, fsdp_gather, fsdp_prefetch)


def walk(gm: fx.GraphModule):
    """Every node of `gm`'s graph, a checkpointed region's nodes in place of its call."""
    for n in gm.graph.nodes:
        if n.op == "call_module" and isinstance(gm.get_submodule(n.target), Checkpointed):
            yield from gm.get_submodule(n.target).body.graph.nodes
        else:
            yield n


def _collective_of(n: fx.Node, path: str) -> bool:
    """A collective lowering inserted for the layer at `path` (its CommInfo names the layer or a module in it)."""
    comm = n.meta.get(M.COMM) if n.op == "call_function" and n.target in C.COLLECTIVES else None
    module = getattr(comm, "module", None) or ""
    return module == path or module.startswith(path + ".")


def checkpoint_layers_pass(gm: fx.GraphModule, ctx) -> fx.GraphModule:
    for i, (path, level, names) in enumerate(ctx.checkpoint):
        _outline(gm, f"checkpoint_{i}", path, level, set(names))
    gm.recompile()
    return gm


def _outline(gm: fx.GraphModule, name: str, path: str, level: str, names: set[str]) -> None:
    order = list(gm.graph.nodes)
    idx = [i for i, n in enumerate(order) if n.name in names]
    if not idx:
        return
    end = idx[-1] + 1
    while end < len(order) and _collective_of(order[end], path):  # e.g. the reduction of its partial output
        end += 1
    span = [n for n in order[idx[0]:end] if n.op == "call_function"]
    hoisted = set()
    for n in span:  # gradient buckets, FSDP gathers and prefetches (and their getitems) run before the region
        if n.target in _BEFORE or (n.target is operator.getitem and n.args[0] in hoisted):
            hoisted.add(n)
            order[idx[0]].prepend(n)
    region = [n for n in span if n not in hoisted]
    inside = set(region)
    inputs = list(dict.fromkeys(a for n in region for a in n.all_input_nodes if a not in inside))
    outputs = [n for n in region if any(u not in inside for u in n.users)]
    body = fx.Graph()
    env = {}
    for a in inputs:
        env[a] = body.placeholder(a.name)
        env[a].meta = dict(a.meta)
    for n in region:
        env[n] = body.node_copy(n, lambda a: env[a])
        if n.target in (ring_attention, moe_experts):  # recomputed whole under selective (autopar.runtime.checkpoint)
            env[n].target = whole(n.target)
    body.output(tuple(env[n] for n in outputs))
    gm.add_submodule(name, Checkpointed(fx.GraphModule(gm, body), level, path))
    last = region[-1]
    with gm.graph.inserting_after(last):
        call = gm.graph.call_module(name, tuple(inputs))
    call.meta["autopar_checkpoint"] = (path, level)
    getters = []
    with gm.graph.inserting_after(call):
        for j, n in enumerate(outputs):
            g = gm.graph.call_function(operator.getitem, (call, j))
            g.meta = dict(n.meta)
            getters.append(g)
    for n, g in zip(outputs, getters):
        n.replace_all_uses_with(g, delete_user_cb=lambda u: u not in inside)
    for n in reversed(region):
        gm.graph.erase_node(n)
