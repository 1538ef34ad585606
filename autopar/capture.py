"""Capture: an unmodified model and example inputs -> an ATen-level fx graph with shapes.

`torch.export.export(..., strict=False)` traces on fake tensors (nothing is computed, no memory
is allocated for activations), keeps high-level ops (`aten.linear`, `aten.embedding`,
`aten.scaled_dot_product_attention`, `aten.cross_entropy_loss`), records shapes in
`node.meta["val"]` and module paths in `node.meta["nn_module_stack"]`. Parameters, buffers and
lifted constants become placeholders, mapped back to their fully-qualified names.

Hugging Face models are captured with their KV cache turned off (`config.use_cache = False`), wherever
they sit in the module tree. A custom `torch.autograd.Function` whose backward is not the derivative of its
forward is captured as one opaque node that runs it (`autopar.functions`). A loss torch computes per row and then
reduces, whose whole call cannot be traced (`F.ctc_loss`, `nn.CTCLoss`), is captured as its per-row loss (one opaque
node, batch-local where its rows are) and the reduction in graph ops (`autopar.canonical_losses`).
"""

from __future__ import annotations

import contextlib
import re

import torch
from torch import nn
from torch.export.graph_signature import InputKind, OutputKind
from torch.utils import _pytree as pytree

from autopar.canonical_losses import canonical_loss_notes, canonical_losses
from autopar.captured import Captured
from autopar.functions import custom_functions
from passes import meta as M


class CaptureError(ValueError):
    """The model could not be captured as a graph."""


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
    """Turn the KV cache off wherever a Hugging Face model sits in the module tree (a model wrapped in the
    user's own loss module included): training needs no cache, and a cache in the graph is an input-dependent
    concatenation the parallel forms would have to carry."""
    configs, seen = [], set()
    for mod in model.modules():
        cfg = getattr(mod, "config", None)
        for c in (cfg, getattr(cfg, "text_config", None), getattr(cfg, "decoder", None)):
            if c is not None and id(c) not in seen and getattr(c, "use_cache", None):
                seen.add(id(c))
                configs.append(c)
    for c in configs:
        c.use_cache = False
    try:
        yield
    finally:
        for c in configs:
            c.use_cache = True


@contextlib.contextmanager
def _no_stack_traces():
    """Trace without recording each node's Python stack (`node.meta["stack_trace"]`, which autopar does not read):
    extracting it per op is about a fifth of tracing a large model."""
    import torch.fx.config as fx_config
    old = fx_config.do_not_emit_stack_traces
    fx_config.do_not_emit_stack_traces = True
    try:
        yield
    finally:
        fx_config.do_not_emit_stack_traces = old


def _failing_submodule(model: nn.Module, error: BaseException) -> str | None:
    """The innermost proper submodule whose forward is on the failing trace's stack."""
    names = {id(m): n for n, m in model.named_modules() if n}
    found = None
    tb = error.__traceback__
    while tb is not None:
        owner = tb.tb_frame.f_locals.get("self")
        if owner is not None and id(owner) in names:
            found = names[id(owner)]
        tb = tb.tb_next
    return found


def _first_line(e: BaseException) -> str:
    text = str(e).strip()
    return f"{type(e).__name__}: {text.splitlines()[0] if text else ''}"


# floating dtypes as errors spell them (torch's "BFloat16", "c10::Half", "float", "torch.float32") -> torch's name
_FLOAT_SPELLINGS = {"float": "float32", "Float": "float32", "float32": "float32", "double": "float64",
                    "Double": "float64", "float64": "float64", "half": "float16", "Half": "float16",
                    "float16": "float16", "bfloat16": "bfloat16", "BFloat16": "bfloat16"}
_FLOAT_NAMES = re.compile(r"\b(" + "|".join(_FLOAT_SPELLINGS) + r")\b")


def _mixed_floats(e: BaseException) -> list[str]:
    """The floating dtypes an error names when it names two or more (a dtype mismatch), else []."""
    found = sorted({_FLOAT_SPELLINGS[m] for m in _FLOAT_NAMES.findall(str(e))})
    return found if len(found) >= 2 else []


def _dtype_fix(where: str, dtypes: list[str]) -> str:
    """The fix for a floating dtype mismatch in `where`, under the mixed-precision policy being captured, if any."""
    from autopar.precision import capturing_precision
    precision, mixed = capturing_precision(), " and ".join(dtypes)
    if precision is None or precision.param_dtype is None:
        return (f"Fix: {where} mixes {mixed} tensors where one dtype is needed, and fails the same way without "
                "autopar: make them agree where they meet (e.g. `t.to(x.dtype)`).")
    p = precision.param_dtype
    casts = (f"autopar casts the floating inputs of the model and of each layer (a numbered module of a "
             f"ModuleList/Sequential, e.g. layers.0) to {p}, as FSDP2's fully_shard(cast_forward_inputs=True) does on "
             f"each module it wraps, but a tensor made inside a layer in another dtype (from an fp32 buffer, or "
             f"with an explicit dtype=) or passed to a module that is not a layer keeps its dtype. Fix: cast it to "
             f"the parameters' dtype where it meets them (e.g. `cos.to(q.dtype)`), or compute it outside the layer "
             f"and pass it to the layer as an input.") if precision.cast_forward_inputs else (
             f"mp_policy has cast_forward_inputs=False, so inputs keep their dtype. Fix: leave cast_forward_inputs "
             f"True (FSDP2's default: the floating inputs of the model and of each layer cast to {p}), or cast "
             f"them to the parameters' dtype in the model.")
    return (f"{where} mixes {mixed} tensors where one dtype is needed: under mp_policy the parameters compute in "
            f"{p} (param_dtype) while other tensors keep their dtype; " + casts)


def _trace_fix(model: nn.Module, path: str | None, opaque: dict[str, str], max_opaque: int,
               e: BaseException) -> str:
    """Why and what to change when the trace failed with `e` in the model's own forward (`path` None), in a
    submodule already made opaque (in `opaque`), or in one more than `max_opaque`: a dtype mismatch's story, or
    data-dependent control flow's."""
    dtypes = _mixed_floats(e)
    if dtypes:
        return _dtype_fix(type(model).__name__ if path is None else f"submodule {path}", dtypes)
    where = ("in the model's own forward." if path is None else f"in {path} again after making it opaque."
             if path in opaque else f"in {path}, after {max_opaque} submodules were made opaque already.")
    return ("Why: autopar rewrites the model's graph, so forward must be traceable on fake tensors; data-dependent "
            "Python control flow (branching on tensor values, .item(), loops over nonzero()) cannot be traced. A "
            "submodule where this happens is captured as one replicated opaque node, but here the failure is "
            + where
            + "\nFix: make the branch static for the example inputs, or move the data-dependent part into a "
            "submodule.")


def _eager_failure(model: nn.Module, path: str, args: tuple, kwargs: dict, e: BaseException,
                   e2: BaseException) -> str:
    """The error when submodule `path` did not trace (`e`) and failed eagerly too (`e2`), its fix by what failed:
    a dtype mismatch (the model's computation, not its tracing), meta tensors, or anything else."""
    head = f"autopar could not capture {type(model).__name__}: "
    dtypes = _mixed_floats(e2)
    if dtypes:
        return (head + f"submodule {path} fails on the example inputs, traced and eagerly: {_first_line(e2)}\n"
                + _dtype_fix(f"submodule {path}", dtypes))
    head += (f"submodule {path} is not traceable ({_first_line(e)}) and running it eagerly on the example inputs to "
             f"capture it as an opaque node failed too: {_first_line(e2)}\n")
    tensors = [t for t in pytree.tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
    if any(t.is_meta for t in tensors + list(model.parameters()) + list(model.buffers())):
        return head + ("Fix: pass real (not meta) example inputs and parameters: an untraceable submodule is run once "
                       "eagerly to record its outputs, which meta tensors cannot do.")
    return head + (f"Fix: make {path} run on the example inputs (eagerly it raised the error above), or make it "
                   "traceable (no branching on tensor values, .item() or nonzero()) so that it is not an opaque node.")


def _record_output(model: nn.Module, path: str, args: tuple, kwargs: dict):
    """Run the model once eagerly on the example inputs; return what submodule `path` returned."""
    seen = []
    handle = model.get_submodule(path).register_forward_hook(lambda m, i, o: seen.append(o))
    try:
        with torch.no_grad(), _no_kv_cache(model):
            model(*args, **kwargs)
    finally:
        handle.remove()
    if len(seen) != 1:
        raise CaptureError(f"submodule {path} ran {len(seen)} times; an opaque submodule must run exactly once")
    return seen[0]


@contextlib.contextmanager
def _opaque_forwards(model: nn.Module, keys: dict[str, str]):
    from autopar.runtime.opaque import make_opaque_forward
    mods = {path: model.get_submodule(path) for path in keys}
    for path, mod in mods.items():
        mod.forward = make_opaque_forward(keys[path])
    try:
        yield
    finally:
        for mod in mods.values():
            del mod.forward


_ALIASES = (torch.ops.aten.detach.default, torch.ops.aten.alias.default)


def _refuse_parameter_mutation(gm, params: dict[str, str], model_name: str) -> None:
    """A forward that writes into a parameter in place (an `nn.Embedding(max_norm=...)` renormalises its looked-up
    rows through `weight.detach()`) cannot run on the parameter's shards as the graph reads them: raise, saying so."""
    for node in gm.graph.nodes:
        if node.op != "call_function" or not isinstance(node.target, torch._ops.OpOverload):
            continue
        args = node.target._schema.arguments
        for i, a in enumerate(node.args[:len(args)]):
            info = args[i].alias_info
            if not (info is not None and info.is_write and hasattr(a, "op")):
                continue
            while a.op == "call_function" and a.target in _ALIASES:
                a = a.args[0]
            if a.op == "placeholder" and a.name in params:
                raise NotImplementedError(
                    f"{model_name}.forward writes into parameter {params[a.name]} in place "
                    f"({node.target.__name__}{', e.g. nn.Embedding(max_norm=...)' if 'renorm' in str(node.target) else ''}); "
                    "autopar runs forward on parameter shards and does not support parameters mutated in forward "
                    "yet. Fix: apply the renormalisation (or other in-place update) outside forward, e.g. after the "
                    "optimizer step, and drop it from the module.")


_BATCH_NORMS = (torch.ops.aten.batch_norm.default, torch.ops.aten.native_batch_norm.default,
                torch.ops.aten._native_batch_norm_legit.default, torch.ops.aten._native_batch_norm_legit_functional.default)


def _refuse_train_batch_norm(gm, model_name: str) -> None:
    """BatchNorm in train mode normalises with the statistics of the batch and updates its running statistics
    in place: under data parallelism each rank would see only its shard of the batch (one device's numbers need
    a cross-rank reduction, SyncBatchNorm), and the running-statistics buffers would be updated per rank. Raise,
    saying so; eval mode (running statistics, read only) is supported."""
    for node in gm.graph.nodes:
        if node.op == "call_function" and node.target in _BATCH_NORMS and node.args[5] is True:
            stack = node.meta.get("nn_module_stack") or {}
            where = list(stack.values())[-1][0] if stack else model_name
            raise NotImplementedError(
                f"{model_name}: BatchNorm {where or '(root)'} runs in train mode (batch statistics and running-"
                "statistics updates); autopar does not support it yet: under data parallelism each rank would "
                "normalise with its own shard's statistics (one device's numbers need SyncBatchNorm's cross-rank "
                "reduction) and update its running statistics alone. Fix: run the model in eval mode "
                "(model.eval() / pm.eval(): running statistics, read only, are supported), or use a norm without "
                "batch statistics (LayerNorm, GroupNorm, RMSNorm).")


_REPLICATED = "replicated on every rank"


def _opaque_rows(gm) -> dict[str, str]:
    """Opaque key -> how its node runs on a data axis: on each rank's rows (batch-local, `passes.batch_local`), or
    replicated, and why."""
    out = {}
    for node in gm.graph.nodes:
        if node.target is torch.ops.autopar.opaque.default:
            rows = node.meta.get(M.ROWS)
            out[node.args[0]] = ("batch-local (its rows are independent: it runs on each rank's rows of the batch)"
                                 if rows is not None and rows.local else
                                 _REPLICATED + (f" (not batch-local: {rows.why})" if rows is not None else ""))
    return out


def _function_notes(gm, functions: list[tuple[str, str]], rows: dict[str, str]) -> list[str]:
    """One note per custom autograd.Function call kept as an opaque node: where it is and why."""
    from autopar.runtime import opaque
    why = dict(functions)
    notes = []
    for node in gm.graph.nodes:
        if node.target is torch.ops.autopar.opaque.default and node.args[0] in why:
            stack = list((node.meta.get("nn_module_stack") or {}).values())
            where = f" in {stack[-1][0]}" if stack and stack[-1][0] else ""
            notes.append(f"custom autograd.Function {opaque.describe(node.args[0]).path}{where} captured as one "
                         f"opaque node, {rows.get(node.args[0], _REPLICATED)}, so that its own backward runs: "
                         f"{why[node.args[0]]}")
    return notes


def capture(model: nn.Module, args: tuple, kwargs: dict, *, max_opaque: int = 16) -> Captured:
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    from autopar.runtime import opaque
    from autopar.runtime.embedding_bag import embedding_bags_by_rows
    from passes.decompose import decompose_unruled_pass
    from passes.moe import canonical_forwards, recognise_moe_modules
    if any(p.is_meta for p in model.parameters()):  # a meta-device model is traced on meta inputs (shapes only)
        args, kwargs = pytree.tree_map_only(torch.Tensor, lambda t: t.to("meta"), (args, kwargs))
    moe_notes: list[str] = []
    with _no_kv_cache(model):
        moe = recognise_moe_modules(model, args, kwargs, moe_notes)
    keys: dict[str, str] = {}  # module path -> opaque key
    while True:
        functions: list[tuple[str, str]] = []  # (opaque key, why) of custom autograd.Functions kept whole
        try:
            losses: list[tuple[str, str]] = []  # (opaque key, reduction) of losses captured per row, then reduced
            with _no_kv_cache(model), _opaque_forwards(model, keys), canonical_forwards(moe), \
                    custom_functions(functions), canonical_losses(losses), embedding_bags_by_rows(), \
                    _no_stack_traces():
                ep = torch.export.export(model, args, kwargs, strict=False)
            break
        except Exception as e:  # noqa: BLE001 - re-raised with context
            path = _failing_submodule(model, e)
            failed = [v for v in moe if path is not None and (path + ".").startswith(v.found.path + ".")]
            if failed:  # a verified MoE replacement that does not trace: the block is traced as written instead
                moe = [v for v in moe if v not in failed]
                for v in failed:
                    moe_notes[:] = [n for n in moe_notes if not n.startswith(f"MoE {v.found.path} ")]
                    moe_notes.append(f"MoE {v.found.path} left as written: its verified replacement did not trace "
                                     f"({_first_line(e)})")
                continue
            if path is None or path in keys or len(keys) >= max_opaque:
                raise CaptureError(
                    f"autopar could not capture {type(model).__name__} with torch.export (non-strict): "
                    f"{_first_line(e)}\n" + _trace_fix(model, path, keys, max_opaque, e)) from e
            try:
                out = _record_output(model, path, args, kwargs)
            except Exception as e2:  # noqa: BLE001
                raise CaptureError(_eager_failure(model, path, args, kwargs, e, e2)) from e2
            keys[path] = opaque.register(path, model.get_submodule(path), out, _first_line(e))
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
    _refuse_parameter_mutation(gm, params, type(model).__name__)
    _refuse_train_batch_norm(gm, type(model).__name__)
    gm = decompose_unruled_pass(gm)  # composite ops without a sharding rule, into ops with one (passes.decompose)
    flat, in_spec = pytree.tree_flatten((args, kwargs))
    shapes = [tuple(a.shape) if isinstance(a, torch.Tensor) else None for a in flat]
    num_out = sum(1 for s in sig.output_specs if s.kind in (OutputKind.USER_OUTPUT, OutputKind.LOSS_OUTPUT))
    from autopar.inputs import batch_dims
    from passes.batch_local import check_batch_locality
    check_batch_locality(gm, users, next((b for b in batch_dims(shapes) if b), 0))
    rows = _opaque_rows(gm)
    notes = [f"{path} captured as one opaque node, {rows.get(k, _REPLICATED)}: it is not traceable "
             f"({opaque.describe(k).reason})" for path, k in keys.items()] + moe_notes
    notes += _function_notes(gm, functions, rows) + canonical_loss_notes(gm, losses, rows)
    from autopar.index_checks import index_checks
    return Captured(gm, kinds, params, buffers, consts, users, ep.call_spec.in_spec or in_spec,
                    ep.call_spec.out_spec, num_out, shapes, notes, index_checks=index_checks(gm, users))
