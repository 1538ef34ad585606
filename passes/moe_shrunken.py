"""An MoE experts module of a meta-device model, verified on a shrunken copy built with the same code and config.

A model on the meta device has no weights, so `passes.moe`'s check that autopar's expert-parallel form reproduces
an MoE experts module (outputs and gradients, on its own inputs) cannot run on the module itself; and the module
cannot be materialised either (one Mixtral-8x22B experts module is 4.8 GB in bf16). Instead (`verify_shrunken`):

1. **Shrunken copy**: the module's class is built again from the config of the Hugging Face model holding it,
   with every integer config field its parameter shapes depend on (found by building it on the meta device with
   each field doubled: hidden size, FFN size) replaced by a small one (distinct values kept in the same order;
   the expert count is kept as it is); the copy must have the module's parameters, of the same ranks and expert
   count. It is materialised on the CPU in the module's dtype with seeded random weights.
2. **Checked on its own**: `passes.moe._compare` runs the copy and autopar's canonical form on random tokens
   routed to every expert, and on a second routing, comparing outputs and the gradients of the tokens, the
   routing weights and every parameter.
3. **Same computation**: the copy runs the same Python code (the same class, and the same forward where one is
   set on the instance) as the real module, and the
   config fields it was not built with differently are equal, so the two differ only in sizes. That the
   code's path does not depend on the sizes is checked too, on the captured graphs: where the real module
   exports on the meta device (`torch.export`, e.g. `experts_implementation="grouped_mm"` or
   `"batched_mm"`), the node targets of its graph and of the copy's graph must be the same sequence; where it
   does not export (a data-dependent loop over experts, `"eager"`), the torch calls the copy makes at two
   different shrunken sizes on the same routing must be the same sequence (`passes.moe_dispatch.record`).
   Since the canonical form is itself written for any sizes (one expert: `down(act(gate x) * up x)` on
   `gate_up_proj`'s two halves), a copy that matches it verifies the real module.

Identical layers share one check (keyed by class, config, parameter shapes and dtype).
"""

from __future__ import annotations

import copy
import inspect
import types

import torch
from torch import nn

# the shrunken sizes, in the order of the real ones: multiples of 8 elements (grouped matmuls want 16-byte strides)
_SMALL = (8, 16, 24, 32, 40, 48, 56, 64)
_OTHER_SMALL = (16, 32, 48, 64, 80, 96, 112, 128)  # a second shrinking, for the size-independence check


def owner_config(model: nn.Module, path: str):
    """The config of the innermost module above `path` (itself included) holding a Hugging Face config."""
    best = None
    for p, mod in model.named_modules():
        if (p == "" or path == p or path.startswith(p + ".")) and _is_config(getattr(mod, "config", None)):
            best = mod.config  # named_modules goes outer to inner along the path
    return best


def _is_config(c) -> bool:
    return c is not None and hasattr(c, "to_dict") and hasattr(c, "model_type")


def _size_fields(cls, config, shapes: dict[str, tuple[int, ...]], num_experts: int) -> dict[str, int]:
    """The integer config fields the module's parameter shapes depend on, other than its expert count: each field
    (of 8 or more) is doubled in turn and the module built on the meta device with it; those that change a shape."""
    fields = {}
    for name, value in vars(config).items():
        if type(value) is not int or value < 8 or value == num_experts:
            continue
        bigger = copy.deepcopy(config)
        setattr(bigger, name, 2 * value)
        try:
            with torch.device("meta"):
                got = {n: tuple(p.shape) for n, p in cls(bigger).named_parameters()}
        except Exception:  # noqa: BLE001 - a field the constructor rejects doubled is not a size it can shrink
            continue
        if got != shapes:
            fields[name] = value
    return fields


def _shrunken_config(config, fields: dict[str, int], table):
    """`config` with each size field's value replaced by a small one (distinct values kept apart, in order)."""
    small_of = dict(zip(sorted(set(fields.values())), table))
    small = copy.deepcopy(config)
    for name, value in fields.items():
        setattr(small, name, small_of[value])
    return small


def _build(cls, config, dtype, seed: int, forward=None) -> nn.Module:
    """`cls(config)` on the CPU in `dtype`, seeded random weights; `forward`: the real module's own (an instance
    attribute bound to it), bound to the copy too."""
    with torch.device("cpu"):
        mod = cls(config)
    mod = mod.to(dtype)
    if forward is not None:
        mod.forward = types.MethodType(forward.__func__, mod)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in mod.parameters():
            p.copy_((torch.randn(p.shape, generator=g, dtype=torch.float64) * 0.3).to(p.dtype))
    return mod


def _routing(num_tokens: int, hidden: int, num_experts: int, k: int, dtype, seed: int):
    """Tokens (T, H), experts (T, k) with every expert chosen by some token, weights (T, k) summing to 1."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(num_tokens, hidden, generator=g, dtype=torch.float64).to(dtype)
    order = torch.rand(num_tokens, num_experts, generator=g).argsort(-1)
    first = torch.arange(num_tokens) % num_experts  # every expert hit
    rest = order[order != first[:, None]].reshape(num_tokens, num_experts - 1)[:, :k - 1]
    idx = torch.cat([first[:, None], rest], 1)
    w = torch.softmax(torch.randn(num_tokens, k, generator=g, dtype=torch.float64), -1).to(dtype)
    return x, idx, w


def _targets(mod: nn.Module, args) -> list[str] | None:
    """The node targets of `mod`'s exported graph, or None where it does not export."""
    import contextlib
    import io
    try:  # torch.export writes the partial graph of a forward it cannot export to stderr
        with contextlib.redirect_stderr(io.StringIO()):
            ep = torch.export.export(mod, args, strict=False)
    except Exception:  # noqa: BLE001 - a data-dependent forward does not export: compared by its calls instead
        return None
    return [str(n.target) for n in ep.graph.nodes if n.op == "call_function"]


def _calls(mod: nn.Module, args) -> list[str]:
    from passes.moe_dispatch import record
    return [e.name for e in record(mod.forward, args, [], False).entries]


_CHECKED: dict[tuple, str | None] = {}


def verify_shrunken(found, model: nn.Module, top_k: int, check) -> str | None:
    """None if a shrunken copy of the Hugging Face experts module `found` (on the meta device) matches autopar's
    canonical form and computes as the real one does (module docstring); else why not. `check(copy, spec key,
    args)`: why the copy differs from the canonical form on `args` (`passes.moe`), or None."""
    mod, E = found.module, found.num_experts
    config = owner_config(model, found.path)
    if config is None:
        return "no Hugging Face config holds it, so a smaller copy of it cannot be built with the same code"
    try:
        names = list(inspect.signature(type(mod).__init__).parameters)[1:]
    except (TypeError, ValueError):
        names = []
    if not names or any(p.default is inspect.Parameter.empty
                        for p in list(inspect.signature(type(mod).__init__).parameters.values())[2:]):
        return f"{type(mod).__name__}(...) does not take the config alone, so a smaller copy cannot be built"
    params = dict(mod.named_parameters())
    dtype = next(iter(params.values())).dtype
    own = mod.__dict__.get("forward")  # a forward set on the instance: the copy runs it too
    if own is not None and not (isinstance(own, types.MethodType) and own.__self__ is mod):
        return "its forward is replaced on the instance by a function not bound to it, which a copy cannot run"
    key = (type(mod), getattr(own, "__func__", None), repr(config.to_dict()),
           tuple((n, tuple(p.shape)) for n, p in params.items()), dtype, top_k)
    if key not in _CHECKED:
        _CHECKED[key] = _verify(found, mod, config, E, dtype, top_k, check, own)
    return _CHECKED[key]


def _verify(found, mod, config, E, dtype, top_k, check, own) -> str | None:
    shapes = {n: tuple(p.shape) for n, p in mod.named_parameters()}
    fields = _size_fields(type(mod), config, shapes, E)
    if not fields or len(set(fields.values())) > len(_SMALL):
        return f"its parameter shapes depend on {len(fields)} config sizes, which a shrunken copy cannot map"
    try:
        small = _build(type(mod), _shrunken_config(config, fields, _SMALL), dtype, seed=0, forward=own)
    except Exception as e:  # noqa: BLE001 - the module's own constructor failing on the smaller config is a reason
        return f"building it with a smaller config failed: {type(e).__name__}: {e}"
    got = {n: tuple(p.shape) for n, p in small.named_parameters()}
    if set(got) != set(shapes) or any(len(got[n]) != len(s) or got[n][0] != s[0] for n, s in shapes.items()):
        return (f"its copy built with a smaller config has parameters {got}, not those of the real one ({shapes}) "
                "with smaller sizes")
    hidden = small.down_proj.shape[1]
    T, k = max(3 * E, 8), top_k
    from autopar.runtime import moe as rt
    spec = rt.ExpertsSpec(found.path, E, k, list(found.expert_params), rt.gated_hf_expert(small.act_fn),
                          found.spelling)
    spec_key = rt.register(spec, small)
    for seed in (1, 2):  # two routings of other tokens
        args = _routing(T, hidden, E, k, dtype, seed=seed)
        try:
            why = check(small, spec_key, args)
        except Exception as e:  # noqa: BLE001 - the copy failing to run (e.g. an op's size limits) is a reason
            why = f"running it failed: {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
        if why is not None:
            return f"on a shrunken copy ({hidden} hidden features, random weights): {why}"
    x, idx, w = args
    meta_args = (torch.empty(T, mod.down_proj.shape[1], dtype=dtype, device="meta"), idx.to("meta"), w.to("meta"))
    real_graph = _targets(mod, meta_args)
    if real_graph is not None:
        small_graph = _targets(small, args)
        if small_graph != real_graph:
            return "its graph captured at the real sizes is not the graph of its shrunken copy (other ops)"
        return None
    other = _build(type(mod), _shrunken_config(config, fields, _OTHER_SMALL), dtype, seed=0, forward=own)
    x2 = torch.randn(T, other.down_proj.shape[1], dtype=torch.float64).to(dtype)
    if _calls(small, args) != _calls(other, (x2, *args[1:])):
        return "its forward makes other torch calls at other sizes, so a shrunken copy does not stand for it"
    return None
