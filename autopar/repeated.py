"""Capture a repeated layer once (issue #25 item 1): a model whose `nn.ModuleList` holds N >= 3 layers of one
structure is exported with the list cut to its first two layers, and the second layer's graph nodes are copied
N - 2 times in the fx graph, each copy reading its own (renamed) parameter placeholders and tagged with its own
module path in `nn_module_stack` (what `autopar.layers` and the solver group layers by). torch.export's time grows
with the number of traced ops; this makes capture cost two layers whatever the depth.

Two layers, not one: the first layer's inputs come from outside the list (the embedding), the second's from the
first, so the second layer's nodes name which of their inputs is the carried hidden state (a node of layer 0, read
at the same position in the previous copy) and which are shared (rotary tables, masks: read by every copy as is).

The copies are made only when every layer is the same structure as the first: the module class of every
submodule, the forward's code (no instance-level forward), parameter and buffer names, shapes, dtypes and
`requires_grad`, and every plain attribute (ints, floats, strings, ...) except `layer_idx` (Hugging Face's key for
the KV cache, which capture switches off). The two captured layers must be op-for-op the same, and nothing
outside the list may read the first layer's values. Otherwise (`None`): the caller captures the whole model.

Used by offline planning only (`autopar.plan`, `python -m autopar plan`): `parallelize` still captures and runs the
whole model, so its exactness does not rest on this graph; a plan made on the copies equals the plan made on the
full capture (tests/test_repeated_capture.py: placements, directives and estimate).
"""

from __future__ import annotations

import collections

import torch
from torch import fx, nn

_IGNORED_ATTRS = frozenset({"layer_idx"})
_PLAIN = (int, float, str, bool, type(None), tuple, torch.dtype)


def _signature(m: nn.Module) -> tuple:
    """What decides a layer's graph: per submodule, its class, forward code, parameters, buffers, plain attributes."""
    out = []
    for path, sub in m.named_modules():
        if "forward" in sub.__dict__:
            return ("instance forward", id(sub))  # unique: never equal to another layer's
        attrs = tuple(sorted((k, repr(v)) for k, v in sub.__dict__.items()
                             if not k.startswith("_") and k not in _IGNORED_ATTRS and isinstance(v, _PLAIN)))
        hooks = (len(sub._forward_hooks), len(sub._forward_pre_hooks))
        out.append((path, type(sub), type(sub).forward.__code__, attrs, hooks,
                    tuple((n, tuple(p.shape), p.dtype, p.requires_grad) for n, p in sub.named_parameters(recurse=False)),
                    tuple((n, tuple(b.shape), b.dtype) for n, b in sub.named_buffers(recurse=False))))
    return tuple(out)


def repeated_list(model: nn.Module) -> tuple[str, int] | None:
    """(path, N) of the model's largest `nn.ModuleList` of N >= 3 layers of one structure (`_signature`), or None."""
    best = None
    for path, m in model.named_modules():
        if not isinstance(m, nn.ModuleList) or len(m) < 3 or not path:
            continue
        if list(m._modules) != [str(i) for i in range(len(m))]:
            continue
        first = _signature(m[0])
        if all(_signature(x) == first for x in list(m)[1:]) and (best is None or len(m) > best[1]):
            best = (path, len(m))
    return best


def _layer_nodes(gm: fx.GraphModule, prefix: str) -> list[fx.Node]:
    out = []
    for n in gm.graph.nodes:
        if n.op in ("placeholder", "output"):
            continue
        stack = n.meta.get("nn_module_stack") or {}
        if any(p == prefix or p.startswith(prefix + ".") for p, _ in stack.values()):
            out.append(n)
    return out


def _retag(stack: dict, old: str, new: str) -> dict:
    def sub(s: str) -> str:
        i = s.find(old)
        while i != -1:
            end = i + len(old)
            if (i == 0 or not s[i - 1].isalnum() and s[i - 1] != "_") and (end == len(s) or s[end] == "."):
                return s[:i] + new + s[end:]
            i = s.find(old, i + 1)
        return s
    return {sub(k): (sub(p), t) for k, (p, t) in stack.items()}


def _renumber(gm: fx.GraphModule, order: list[str]) -> None:
    """Rebuild the graph with its placeholders in call order (`order`) and its nodes named as torch.export names
    them on the whole model (the i-th node of a base name: `base`, `base_1`, ...), so that the graph's fingerprint
    (`Captured.fingerprint`, which a saved plan records) is the full capture's."""
    import re
    old = gm.graph
    new = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    phs = {n.name: n for n in old.nodes if n.op == "placeholder"}
    seen: dict[str, int] = {}
    for n in [phs[name] for name in order] + [n for n in old.nodes if n.op != "placeholder"]:
        if n.op in ("placeholder", "output"):
            name = n.name
        else:
            base = re.sub(r"_\d+$", "", n.name)
            k = seen.get(base, 0)
            seen[base] = k + 1
            name = base if k == 0 else f"{base}_{k}"
        c = new.create_node(n.op, n.target, fx.node.map_arg(n.args, env.__getitem__),
                            fx.node.map_arg(n.kwargs, env.__getitem__), name=name, type_expr=n.type)
        c.meta = dict(n.meta)
        env[n] = c
    new._codegen = old._codegen
    gm.graph = new


def capture_repeated(model: nn.Module, args: tuple, kwargs: dict, capture_fn):
    """The model's capture with its repeated layers copied from the second (module docstring), or None when the
    model has no such list or the two captured layers do not match (the caller then captures it whole)."""
    found = repeated_list(model)
    if found is None:
        return None
    path, n_layers = found
    ml = model.get_submodule(path)
    saved = ml._modules
    ml._modules = collections.OrderedDict(list(saved.items())[:2])
    try:
        captured = capture_fn(model, args, kwargs)
    finally:
        ml._modules = saved
    return _replicate(captured, path, n_layers, model)


def _replicate(captured, path: str, n_layers: int, model: nn.Module):
    gm, graph = captured.gm, captured.gm.graph
    p0, p1 = f"{path}.0", f"{path}.1"
    per_layer = []  # notes about the second layer, which each copy repeats (a verified MoE block's)
    for note in captured.notes:
        if p0 in note or p1 in note:
            if not (note.startswith(f"MoE {p1}.") or note.startswith(f"MoE {p0}.")) or "verified" not in note:
                return None  # opaque submodules, MoE fallbacks: decided per layer, so captured whole
            if note.startswith(f"MoE {p1}."):
                per_layer.append(note)
    l0, l1 = _layer_nodes(gm, p0), _layer_nodes(gm, p1)
    if not l1 or len(l0) != len(l1) or any(a.op != b.op or a.target != b.target for a, b in zip(l0, l1)):
        return None
    s0, s1 = set(l0), set(l1)
    if any(u not in s0 and u not in s1 for n in l0 for u in n.users):
        return None
    corr = dict(zip(l0, l1))
    from autopar.runtime import moe as rt_moe
    keys: set[str] = set()
    for n in l1:
        for a in n.args:
            if isinstance(a, str) and p1 in a:
                try:
                    spec = rt_moe.spec_of(a)
                except KeyError:
                    return None  # a per-module key other than a MoE block's: captured whole
                if spec.spelling == "modulelist":
                    return None  # its expert function may read the module's own experts
                keys.add(a)
    # the second layer's parameters and buffers: placeholder -> (kind, fqn suffix within the layer)
    fqn_of = {**{k: ("param", v) for k, v in captured.param_fqns.items()},
              **{k: ("buffer", v) for k, v in captured.buffer_fqns.items()}}
    own = {}
    for name, (kind, fqn) in fqn_of.items():
        if fqn.startswith(p1 + "."):
            own[name] = (kind, fqn[len(p1) + 1:])
    placeholders = {n.name: n for n in graph.nodes if n.op == "placeholder"}
    kinds = list(captured.input_kinds)
    last_ph_index = max((i for i, (nm, _, _) in enumerate(kinds) if nm in own), default=None)
    if last_ph_index is None:
        return None
    external = [(n, u) for n in l1 for u in list(n.users) if u not in s1]
    prev = {n: n for n in l1}  # layer-1 node -> its counterpart in the previous copy
    anchor = l1[-1]
    insert_ph_after = placeholders[kinds[last_ph_index][0]]
    new_kinds = []
    for k in range(2, n_layers):
        pk = f"{path}.{k}"
        phs = {}
        for name, (kind, suffix) in own.items():
            fqn = f"{pk}.{suffix}"
            with graph.inserting_after(insert_ph_after):
                ph = graph.placeholder(("p_" if kind == "param" else "b_") + fqn.replace(".", "_"))
            ph.meta = dict(placeholders[name].meta)
            insert_ph_after = ph
            phs[placeholders[name]] = ph
            (captured.param_fqns if kind == "param" else captured.buffer_fqns)[ph.name] = fqn
            new_kinds.append((ph.name, kind, fqn))
        env: dict[fx.Node, fx.Node] = {}
        import dataclasses
        rekey = {}
        for key in keys:
            if p1 in key:
                spec = rt_moe.spec_of(key)
                sub = spec.path.replace(p1, pk, 1)
                rekey[key] = rt_moe.register(dataclasses.replace(spec, path=sub), model.get_submodule(sub))

        def arg(a, env=env, phs=phs):
            if a in env:
                return env[a]
            if a in phs:
                return phs[a]
            if a in s0:  # the carried hidden state: the previous copy's value at that position
                return prev[corr[a]]
            return a  # shared by every layer (rotary tables, masks, inputs)
        for n in l1:
            with graph.inserting_after(anchor):
                c = graph.node_copy(n, arg)
            if rekey:
                c.args = tuple(rekey.get(a, a) if isinstance(a, str) else a for a in c.args)
            c.meta = dict(n.meta)
            if "nn_module_stack" in n.meta:
                c.meta["nn_module_stack"] = _retag(n.meta["nn_module_stack"], p1, pk)
            env[n] = c
            anchor = c
        prev = {n: env[n] for n in l1}
    for n, u in external:
        u.replace_input_with(n, prev[n])
    captured.input_kinds = kinds[:last_ph_index + 1] + new_kinds + kinds[last_ph_index + 1:]
    _renumber(gm, [name for name, _, _ in captured.input_kinds])
    captured.param_fqns = {nm: fqn for nm, kind, fqn in captured.input_kinds if kind == "param"}
    captured.buffer_fqns = {nm: fqn for nm, kind, fqn in captured.input_kinds if kind == "buffer"}
    gm.graph.lint()  # (setting gm.graph recompiled it)
    notes = list(captured.notes)
    if per_layer:
        at = notes.index(per_layer[-1]) + 1
        notes[at:at] = [_retag({"": (n, None)}, p1, f"{path}.{k}")[""][0].replace(f"MoE {p1}.", f"MoE {path}.{k}.")
                        for k in range(2, n_layers) for n in per_layer]
    captured.notes = notes + [
        f"{path}.{{2..{n_layers - 1}}} planned on copies of {p1}'s captured graph (same structure, "
        "autopar.repeated); parallelize captures every layer"]
    return captured


__all__ = ["capture_repeated", "repeated_list"]
