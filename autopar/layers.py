"""The model's repeated layers (transformer blocks), found in the captured graph.

A *layer* is a module that sits in a `ModuleList`/`Sequential` (its path ends in an integer, e.g.
`model.layers.3`, `transformer.h.0`), the outermost such module on a node's `nn_module_stack`.
Three things work layer by layer: activation checkpointing (a level per layer, chosen per layer
*class*), FSDP's per-layer gathers (one all-gather for a layer's parameters, the next layer's
prefetched, released after forward and gathered again in backward), and the memory estimate's
live set. `find_layers` returns them in forward order; each names its nodes in graph order and the
parameters (placeholders) only its nodes use.

The same rule on the module tree (`layer_modules`: a module whose path's last component, and no earlier one, is an
integer) names the modules that get FSDP2's per-module forward-input casts under a mixed-precision policy
(`autopar.precision.layer_input_casts`), as `fully_shard` on each of them would.

FSDP gathers per *unit* (`fsdp_units`): the layers, and the outermost recurrent modules (`nn.RNN`, `nn.LSTM`,
`nn.GRU`) outside them, which FSDP2 users wrap on their own (`fully_shard(model.lstm)`): a multi-layer recurrent
module is one op in the graph, but as large as a stack of layers, so its gather and its gradients' reduction
overlap the rest of the model only as a unit of its own.

A layer's *class* (`Layer.cls`) is its module's type name: layers of one class are alike and take
one decision (a checkpoint level), as the ILP decides per class. Module paths here are the
paths in the captured model (the user's model, wrapper included), as override keys are.
"""

from __future__ import annotations

import fnmatch
from dataclasses import dataclass

from torch import fx, nn


@dataclass(frozen=True)
class Layer:
    path: str  # module path, e.g. "model.layers.3"
    cls: str  # the module's type name, e.g. "LlamaDecoderLayer"
    nodes: tuple[str, ...]  # names of its call_function nodes, in graph order
    params: tuple[str, ...]  # placeholders of the parameters (and buffers) only its nodes use

    @property
    def index(self) -> int:
        return int(self.path.rsplit(".", 1)[-1])

    def matches(self, key: str) -> bool:
        """Whether an override key (a module-path glob, or the layer class) names this layer. A glob matches the
        path or any suffix of it made of whole components: `layers.*` names `model.layers.3`."""
        if key == self.cls:
            return True
        parts = self.path.split(".")
        return any(fnmatch.fnmatchcase(".".join(parts[i:]), key) for i in range(len(parts)))


def is_layer_path(path: str) -> bool:
    """Whether the module at `path` is a layer: its last path component, and no earlier one, is an integer (the
    outermost numbered module)."""
    *outer, last = path.split(".")
    return last.isdigit() and not any(c.isdigit() for c in outer)


def layer_modules(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """(path, module) of the model's layers, from its module tree (`is_layer_path`), in registration order."""
    return [(path, m) for path, m in model.named_modules() if path and is_layer_path(path)]


def _layer_of(node: fx.Node) -> tuple[str, str] | None:
    """(path, type name) of the outermost numbered module on the node's module stack, or None."""
    for path, ty in (node.meta.get("nn_module_stack") or {}).values():
        if path and path.rsplit(".", 1)[-1].isdigit():
            name = ty if isinstance(ty, str) else getattr(ty, "__name__", str(ty))
            return path, name.rsplit(".", 1)[-1]
    return None


def find_layers(gm: fx.GraphModule, param_placeholders: set[str] | frozenset[str] = frozenset()) -> list[Layer]:
    """The layers of a captured graph in forward order (see the module docstring). `param_placeholders`: the
    placeholders that are parameters or buffers (`Captured.param_fqns` and `buffer_fqns`); a layer's `params` are
    those of them whose every user is one of its nodes. Forward order is the order of a layer's first node; a layer
    whose nodes are interleaved with another's (rare: shared modules) still gets every node it owns."""
    order: dict[str, tuple[str, list[str]]] = {}
    owner: dict[str, str] = {}
    for node in gm.graph.nodes:
        if node.op != "call_function":
            continue
        found = _layer_of(node)
        if found is None:
            continue
        path, cls = found
        order.setdefault(path, (cls, []))[1].append(node.name)
        owner[node.name] = path
    return _units(gm, order, owner, param_placeholders)


def _units(gm: fx.GraphModule, order: dict[str, tuple[str, list[str]]], owner: dict[str, str],
           param_placeholders) -> list[Layer]:
    """`Layer`s from each path's (class, nodes) and each node's path: a unit's parameters are those only its nodes
    use."""
    params: dict[str, list[str]] = {p: [] for p in order}
    for node in gm.graph.find_nodes(op="placeholder"):
        if node.target not in param_placeholders or not node.users:
            continue
        paths = {owner.get(u.name) for u in node.users}
        if len(paths) == 1 and None not in paths:
            params[paths.pop()].append(node.target)
    return [Layer(path=p, cls=cls, nodes=tuple(nodes), params=tuple(params[p])) for p, (cls, nodes) in order.items()]


# the recurrent modules FSDP gathers as units of their own (`fsdp_units`), by their qualified names as
# `nn_module_stack` records them
_RECURRENT = frozenset(f"{c.__module__}.{c.__qualname__}" for c in (nn.RNN, nn.LSTM, nn.GRU))


def _type_name(ty) -> str:
    return ty if isinstance(ty, str) else f"{ty.__module__}.{ty.__qualname__}"


def fsdp_units(gm: fx.GraphModule, param_placeholders: set[str] | frozenset[str] = frozenset()) -> list[Layer]:
    """The units FSDP gathers one by one (module docstring): `find_layers`, and each outermost `nn.RNN`/`nn.LSTM`/
    `nn.GRU` on a node's module stack outside every layer, as a `Layer` of its own (its path, its class name, its
    nodes, the parameters only its nodes use); in forward order."""
    layers = find_layers(gm, param_placeholders)
    inside = {name for layer in layers for name in layer.nodes}
    order: dict[str, tuple[str, list[str]]] = {}
    owner: dict[str, str] = {}
    for node in gm.graph.nodes:
        if node.op != "call_function" or node.name in inside:
            continue
        for path, ty in (node.meta.get("nn_module_stack") or {}).values():
            if path and _type_name(ty) in _RECURRENT:
                order.setdefault(path, (_type_name(ty).rsplit(".", 1)[-1], []))[1].append(node.name)
                owner[node.name] = path
                break
    if not order:
        return layers
    units = layers + _units(gm, order, owner, param_placeholders)
    first = {n.name: i for i, n in enumerate(gm.graph.nodes)}
    return sorted(units, key=lambda u: first[u.nodes[0]])


def layers_matching(layers: list[Layer], key: str) -> list[Layer]:
    return [l for l in layers if l.matches(key)]


__all__ = ["Layer", "find_layers", "fsdp_units", "is_layer_path", "layer_modules", "layers_matching"]
