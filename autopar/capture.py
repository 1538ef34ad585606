"""Capture: an unmodified model and example inputs -> an ATen-level fx graph with shapes.

`torch.export.export(..., strict=False)` traces on fake tensors (nothing is computed, no memory
is allocated for activations), keeps high-level ops (`aten.linear`, `aten.embedding`,
`aten.scaled_dot_product_attention`, `aten.cross_entropy_loss`), records shapes in
`node.meta["val"]` and module paths in `node.meta["nn_module_stack"]`. Parameters, buffers and
lifted constants become placeholders, mapped back to their fully-qualified names.

Hugging Face models are captured with their KV cache turned off (`config.use_cache = False`).
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch
from torch import fx, nn
from torch.export.graph_signature import InputKind, OutputKind
from torch.utils import _pytree as pytree


class CaptureError(ValueError):
    """The model could not be captured as a graph."""


@dataclass
class Captured:
    gm: fx.GraphModule
    input_kinds: list[tuple[str, str, str | None]]  # (placeholder, kind, fqn/constant name) in call order
    param_fqns: dict[str, str]  # placeholder -> parameter fqn
    buffer_fqns: dict[str, str]  # placeholder -> buffer fqn
    constants: dict[str, torch.Tensor]  # placeholder -> lifted constant tensor
    user_inputs: list[str]  # placeholders of user inputs, in flattened call order
    in_spec: pytree.TreeSpec
    out_spec: pytree.TreeSpec
    num_user_outputs: int
    example_shapes: list[tuple | None]  # per flattened user input: shape of tensors, None otherwise


def split_example_inputs(example_inputs) -> tuple[tuple, dict]:
    if isinstance(example_inputs, dict):
        return (), dict(example_inputs)
    if isinstance(example_inputs, torch.Tensor):
        return (example_inputs,), {}
    if isinstance(example_inputs, (tuple, list)):
        return tuple(example_inputs), {}
    raise TypeError(
        f"example_inputs must be a tuple of positional inputs or a dict of keyword inputs, got "
        f"{type(example_inputs).__name__}; e.g. parallelize(model, mesh, (tokens, labels))")


@contextlib.contextmanager
def _no_kv_cache(model: nn.Module):
    cfg = getattr(model, "config", None)
    old = getattr(cfg, "use_cache", None)
    if old:
        cfg.use_cache = False
    try:
        yield
    finally:
        if old:
            cfg.use_cache = old


def capture(model: nn.Module, args: tuple, kwargs: dict) -> Captured:
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    try:
        with _no_kv_cache(model):
            ep = torch.export.export(model, args, kwargs, strict=False)
    except Exception as e:  # noqa: BLE001 - re-raised with context
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise CaptureError(
            f"autopar could not capture {type(model).__name__} with torch.export (non-strict): "
            f"{type(e).__name__}: {first}\n"
            "Why: autopar rewrites the model's graph, so the whole forward must be traceable on fake "
            "tensors; data-dependent Python control flow (branching on tensor values, .item(), "
            "loops over nonzero()) cannot be traced.\n"
            "Fix: make the branch static for the example inputs, or move the data-dependent part out "
            "of forward. (Capturing such a submodule as one replicated opaque node is not implemented yet.)"
        ) from e
    sig = ep.graph_signature
    for spec in sig.output_specs:
        if spec.kind not in (OutputKind.USER_OUTPUT, OutputKind.LOSS_OUTPUT):
            raise CaptureError(
                f"{type(model).__name__}.forward mutates state ({spec.kind.name} {spec.target}), e.g. BatchNorm "
                "running statistics; autopar does not support models that mutate buffers in forward yet. "
                "Fix: use a norm without running statistics (LayerNorm/RMSNorm) or put the model in eval mode.")
    gm = ep.graph_module
    for node in list(gm.graph.nodes):  # dtype/device asserts of the trace: not part of the computation
        if node.op == "call_function" and node.target is torch.ops.aten._assert_tensor_metadata.default:
            gm.graph.erase_node(node)
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    assert len(placeholders) == len(sig.input_specs)
    kinds, params, buffers, consts, users = [], {}, {}, {}, []
    for node, spec in zip(placeholders, sig.input_specs):
        name = node.name
        if spec.kind == InputKind.PARAMETER:
            params[name] = spec.target
            kinds.append((name, "param", spec.target))
        elif spec.kind == InputKind.BUFFER:
            buffers[name] = spec.target
            kinds.append((name, "buffer", spec.target))
        elif spec.kind == InputKind.CONSTANT_TENSOR:
            consts[name] = ep.constants[spec.target]
            kinds.append((name, "constant", spec.target))
        elif spec.kind == InputKind.USER_INPUT:
            users.append(name)
            kinds.append((name, "input", None))
        else:
            raise CaptureError(f"unsupported graph input kind {spec.kind.name} for {name}")
    flat, in_spec = pytree.tree_flatten((args, kwargs))
    shapes = [tuple(a.shape) if isinstance(a, torch.Tensor) else None for a in flat]
    num_out = sum(1 for s in sig.output_specs if s.kind in (OutputKind.USER_OUTPUT, OutputKind.LOSS_OUTPUT))
    return Captured(gm, kinds, params, buffers, consts, users, ep.call_spec.in_spec or in_spec,
                    ep.call_spec.out_spec, num_out, shapes)
