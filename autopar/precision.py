"""Mixed precision as users specify it: `torch.distributed.fsdp.MixedPrecisionPolicy` (`mp_policy=`).

Semantics (FSDP2's, for every plan: dp, fsdp, megatron, auto):

| what                         | dtype                                                                           |
|------------------------------|---------------------------------------------------------------------------------|
| parameters (optimizer's)     | as the model holds them (the masters, e.g. fp32), sharded as planned            |
| compute copies               | `param_dtype`, each local parameter cast once per step (an FSDP shard before    |
|                              | its all-gather: the gather moves `param_dtype` bytes)                           |
| activations, TP collectives  | as the model computes with `param_dtype` parameters                             |
| gradient reductions          | `reduce_dtype` (None: `param_dtype`): dp buckets, FSDP reduce-scatters,         |
|                              | gradient all-reduces of parameters                                              |
| gradients the optimizer sees | the master dtype                                                                |
| forward inputs               | floating (not complex) ones cast to `param_dtype` (`cast_forward_inputs=True`): |
|                              | the model's (`cast_inputs`) and each layer's (`layer_input_casts`), as          |
|                              | `fully_shard` on the root and on each layer casts its module's forward inputs   |
| buffers, tensors made inside | their own dtype (FSDP2 casts neither)                                           |
| outputs                      | the model's cast to `output_dtype` when given (not each layer's, as a           |
|                              | `fully_shard`ed layer's would be: one policy for the model, whose outputs the   |
|                              | caller gets)                                                                    |

The program is captured from the model as the user holds it, its parameters (and, with `cast_forward_inputs`,
its floating inputs and each layer's) taken at `param_dtype` (`capture_dtypes`, `cast_inputs`, `layer_input_casts`;
a layer is `autopar.layers`'s, the outermost numbered module, e.g. `layers.3`): the graph is the program that runs,
its layers' input casts included (`aten.to.dtype` nodes at each layer's entry, e.g. of fp32 RoPE tables the model
computes at the top and passes to every block),
with the ops and dtypes the model's code chooses for `param_dtype` parameters (a norm's fp32 upcast, a mask made in
the parameters' dtype), so the plan's graph fingerprint names what runs and a plan made for another `param_dtype`
cannot lower it. What the graph cannot say (`reduce_dtype`, `output_dtype`, `cast_forward_inputs`) the Plan carries
as `Plan.precision` (`Precision.spec()`), checked against the `mp_policy` a plan is used with. The lowering
(`passes.lower.mixed_precision_pass`) makes the parameter-side collectives cast (forward: to `param_dtype`;
backward: gradient to `reduce_dtype`, reduced, back to the master dtype) and casts the other parameter uses. Left
as it is: the reduction of a value computed from the parameters' param_dtype copies by arithmetic (not lookups or
views; none in the models tested) runs in `reduce_dtype` but its result is rounded to `param_dtype` once, as a
param_dtype value's gradient.

Pricing (`autopar.estimate`): compute at param_dtype's rate and activations in param_dtype (the graph's ops are:
tensor-parallel collectives of activations and their gradients move param_dtype bytes, as they run), gathers at
param_dtype bytes and gradient reductions at reduce_dtype bytes (`MeshCosting.grad_bytes_factor`; a value computed
from parameters alone and reduced at the batch boundary, a positional embedding's output, too:
`SiteStats.boundary_reduce_bytes`), and
parameter + gradient + optimizer state from the masters' dtype (`state_bytes_per_element`: Adam, fp32 masters, 16 B).
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
from dataclasses import dataclass

import torch
from torch import nn
from torch.utils import _pytree as pytree

__all__ = ["Precision", "precision_of", "check_plan_precision", "capture_dtypes", "capturing_precision", "as_dtypes",
           "layer_input_casts", "mark_captured", "cast_inputs", "cast_outputs"]

_FLOATS = {str(d).removeprefix("torch."): d for d in (torch.float64, torch.float32, torch.bfloat16, torch.float16)}


@dataclass(frozen=True, kw_only=True)
class Precision:
    """A validated `MixedPrecisionPolicy`, by dtype name ("bfloat16"); None fields as the policy's."""

    param_dtype: str | None = None
    reduce_dtype: str | None = None
    output_dtype: str | None = None
    cast_forward_inputs: bool = True

    def __post_init__(self):
        for name in ("param_dtype", "reduce_dtype", "output_dtype"):
            v = getattr(self, name)
            if v is not None and v not in _FLOATS:
                raise ValueError(f"Precision.{name} must be one of {sorted(_FLOATS)} or None, got {v!r}")

    def dtype(self, name: str) -> torch.dtype | None:
        v = getattr(self, name)
        return None if v is None else _FLOATS[v]

    @property
    def collective_dtypes(self) -> tuple[torch.dtype | None, torch.dtype | None]:
        """(cast forward to, reduce gradients in) for the parameter-side collectives; reduce_dtype None: param's."""
        p = self.dtype("param_dtype")
        return p, self.dtype("reduce_dtype") or p

    def spec(self) -> str:
        """The plan's record (`Plan.precision`), e.g. 'param_dtype=bfloat16 reduce_dtype=float32 output_dtype=None
        cast_forward_inputs=True'."""
        return " ".join(f"{k}={getattr(self, k)}" for k in ("param_dtype", "reduce_dtype", "output_dtype",
                                                                "cast_forward_inputs"))

    @classmethod
    def parse(cls, spec: str) -> "Precision | None":
        """`spec()` back (empty: None); a ValueError naming what is wrong."""
        if not spec:
            return None
        try:
            kv = dict(part.split("=", 1) for part in spec.split())
            return cls(**{k: (None if v == "None" else v == "True" if k == "cast_forward_inputs" else v)
                          for k, v in kv.items()})
        except (ValueError, TypeError) as e:
            raise ValueError(f"plan precision {spec!r} is not 'param_dtype=... reduce_dtype=... output_dtype=... "
                             f"cast_forward_inputs=...': {e}") from None


def precision_of(mp_policy) -> Precision | None:
    """`mp_policy` checked: None, or a `torch.distributed.fsdp.MixedPrecisionPolicy` of floating dtypes. A policy
    that changes nothing (every dtype None) is None."""
    from torch.distributed.fsdp import MixedPrecisionPolicy
    if mp_policy is None:
        return None
    if not isinstance(mp_policy, MixedPrecisionPolicy):
        raise TypeError(
            f"mp_policy must be a torch.distributed.fsdp.MixedPrecisionPolicy, got {type(mp_policy).__name__} "
            f"{mp_policy!r}. autopar runs FSDP2's policy for every plan. Fix: mp_policy=MixedPrecisionPolicy("
            "param_dtype=torch.bfloat16, reduce_dtype=torch.float32), or leave it None (the model's dtypes).")
    names = {}
    for field in ("param_dtype", "reduce_dtype", "output_dtype"):
        d = getattr(mp_policy, field)
        if d is None:
            names[field] = None
            continue
        if not isinstance(d, torch.dtype) or not d.is_floating_point or str(d).removeprefix("torch.") not in _FLOATS:
            raise ValueError(
                f"mp_policy.{field} must be a floating dtype ({', '.join('torch.' + n for n in _FLOATS)}) or None, "
                f"got {d!r}: parameters, gradients and outputs are cast to it. Fix: e.g. {field}=torch.bfloat16.")
        names[field] = str(d).removeprefix("torch.")
    if not isinstance(mp_policy.cast_forward_inputs, bool):
        raise TypeError(f"mp_policy.cast_forward_inputs must be a bool, got {mp_policy.cast_forward_inputs!r}")
    if all(v is None for v in names.values()):
        return None
    return Precision(**names, cast_forward_inputs=mp_policy.cast_forward_inputs)


def check_plan_precision(plan_spec: str, precision: Precision | None, source: str) -> None:
    """A given plan runs only under the policy it was made for (the graph says param_dtype; this the rest)."""
    made = Precision.parse(plan_spec)
    if made != precision:
        raise ValueError(
            f"{source} was made for mixed precision {made.spec() if made else 'none (the model dtypes)'}, but "
            f"mp_policy gives {precision.spec() if precision else 'none (the model dtypes)'}: a plan runs only the "
            "precision it was planned and priced for. Fix: pass the mp_policy the plan was made with, or re-plan "
            "with this one.")


# ----------------------------------------------------------------------------- capture and call

_CAPTURING: contextvars.ContextVar[Precision | None] = contextvars.ContextVar("autopar_capturing", default=None)


def capturing_precision() -> Precision | None:
    """The policy of the `capture_dtypes` the caller is in (None outside one): what a capture error's fix reads."""
    return _CAPTURING.get()


@contextlib.contextmanager
def capture_dtypes(model: nn.Module, precision: Precision | None):
    """`model` with its floating parameters at `param_dtype` (converted copies; tied names share one) and its layers'
    forward-input casts (`layer_input_casts`), restored afterwards: what the capture traces under a policy."""
    want = precision.dtype("param_dtype") if precision is not None else None
    if want is None:
        yield
        return
    dtypes = {fqn: want for fqn, p in model.named_parameters(remove_duplicate=False) if p.dtype.is_floating_point}
    token = _CAPTURING.set(precision)
    try:
        with as_dtypes(model, dtypes), layer_input_casts(model, precision):
            yield
    finally:
        _CAPTURING.reset(token)


@contextlib.contextmanager
def layer_input_casts(model: nn.Module, precision: Precision | None):
    """`model` with FSDP2's forward-input cast on each layer (`autopar.layers.layer_modules`), removed afterwards:
    under `cast_forward_inputs` a forward pre-hook casts the layer's floating (not complex) tensor arguments and
    keyword arguments to `param_dtype`, as `fully_shard(layer, mp_policy=...)` does (`FSDPState._pre_forward` ->
    `_cast_forward_inputs`, with torch's own `_apply_to_tensors` and `_cast_fp_tensor`: a tensor already at
    param_dtype is passed as it is, so no node is traced for it). Traced, the casts are `aten.to.dtype` nodes at
    the layer's entry: the program runs them on every rank, whatever the plan."""
    want = precision.dtype("param_dtype") if precision is not None and precision.cast_forward_inputs else None
    if want is None:
        yield
        return
    from torch.distributed.fsdp._fully_shard._fsdp_common import _cast_fp_tensor
    from torch.distributed.utils import _apply_to_tensors

    from autopar.layers import layer_modules
    cast = functools.partial(_cast_fp_tensor, want)

    def hook(module, args, kwargs):
        return _apply_to_tensors(cast, args), _apply_to_tensors(cast, kwargs)

    handles = [m.register_forward_pre_hook(hook, prepend=True, with_kwargs=True) for _, m in layer_modules(model)]
    try:
        yield
    finally:
        for h in handles:
            h.remove()


@contextlib.contextmanager
def as_dtypes(model: nn.Module, dtypes: dict[str, torch.dtype]):
    """`model` with its parameters and buffers named in `dtypes` (fqn -> dtype) converted where they differ (the
    same copy under every tied name), restored afterwards."""
    swapped, made = [], {}
    for fqn, t in list(model.named_parameters(remove_duplicate=False)) + \
            list(model.named_buffers(remove_duplicate=False)):
        want = dtypes.get(fqn)
        if want is None or want == t.dtype:
            continue
        if id(t) not in made:
            value = t.detach().to(want)
            made[id(t)] = nn.Parameter(value, requires_grad=t.requires_grad) if isinstance(t, nn.Parameter) else value
        *path, leaf = fqn.split(".")
        mod = model.get_submodule(".".join(path))
        table = mod._parameters if leaf in mod._parameters else mod._buffers
        swapped.append((table, leaf, table[leaf]))
        table[leaf] = made[id(t)]
    try:
        yield
    finally:
        for table, leaf, old in reversed(swapped):
            table[leaf] = old



def mark_captured(captured, model: nn.Module, precision: Precision | None) -> None:
    """Record on a capture the policy it was made under and, then, the masters' dtype (the most elements')."""
    captured.precision = precision
    if precision is not None:
        counts: dict[torch.dtype, int] = {}
        for p in model.parameters():
            if p.dtype.is_floating_point:
                counts[p.dtype] = counts.get(p.dtype, 0) + p.numel()
        captured.master_dtype = max(counts, key=counts.get) if counts else None


def cast_inputs(precision: Precision | None, args, kwargs):
    """The inputs the program takes: floating tensors at `param_dtype` when the policy casts forward inputs."""
    want = precision.dtype("param_dtype") if precision is not None and precision.cast_forward_inputs else None
    if want is None:
        return args, kwargs
    return pytree.tree_map_only(torch.Tensor, lambda t: t.to(want) if t.is_floating_point() else t, (args, kwargs))


def cast_outputs(precision: Precision | None, outputs):
    """Floating outputs at `output_dtype` when the policy gives one."""
    want = precision.dtype("output_dtype") if precision is not None else None
    if want is None:
        return outputs
    return pytree.tree_map_only(torch.Tensor, lambda t: t.to(want) if t.is_floating_point() else t, outputs)
