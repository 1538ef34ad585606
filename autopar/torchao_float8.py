"""A model the user already converted with torchao (`torchao.float8.convert_to_float8_training`): each `Float8Linear`
becomes a plain `nn.Linear` holding the same parameters, and its `Float8LinearConfig` becomes autopar's float8 choice
for that linear (`Plan.float8`: (module path, recipe)), so the model is captured (torch.export fails on torchao's
weight subclass and its autograd function) and runs `autopar.runtime.float8.float8_linear` under any plan.

torchao is not imported: its modules are recognised by class path and their configs read field by field (enum
`.value`s and dtypes; `torchao/float8/config.py` of torchao 0.18). A config maps when every field that changes the
numerics is one of the recipes autopar runs (`RECIPE_FIELDS`: `Float8LinearConfig.from_recipe_name("tensorwise")`
and `("rowwise")`, which `autopar.runtime.float8` computes bit for bit as torchao's `Float8Linear` does); otherwise
`unconvert` raises naming the fields that differ. The fields that do not change the numerics:

- `enable_fsdp_float8_all_gather`: whether FSDP gathers the weight in fp8. The values are the same either way (the
  shard cast with the whole weight's scale is the whole weight's cast); autopar's fsdp gathers a tensorwise weight in
  fp8 whenever it can (`passes.lower._fp8_gathered_weights`, as the estimate prices it), so `False` is noted on the
  plan, not honoured (the bytes differ, not the values).
- `pad_inner_dim` (zero padding to a multiple of 16: the same sums), `emulate` (the same quantisation, the GEMM done
  in high precision: as `_scaled_mm` on the CPU), `force_recompute_fp8_weight_in_bwd` (no-op in torchao 0.18).

What the planner does with it: the linears the user converted run in fp8 under the recipe their config names, the
others (the output head, if the user's `module_filter_fn` left it out) in high precision; `float8=` must stay None
(the model already says which). `autopar.plan` and `autopar.parallelize` call `unconvert` first; the user's model
is not modified (a copy of its module tree over the same parameter and buffer tensors).
"""

from __future__ import annotations

import torch
from torch import nn

from autopar.forms.float8 import RECIPES

TENSORWISE, ROWWISE = RECIPES

FLOAT8_LINEAR = ("torchao.float8", "Float8Linear")  # (module prefix, class name)
FP8_WEIGHT = ("torchao.float8", "WeightWithDynamicFloat8CastTensor")  # the weight under enable_fsdp_float8_all_gather

_CASTS = ("cast_config_input", "cast_config_input_for_grad_weight", "cast_config_weight",
          "cast_config_weight_for_grad_input", "cast_config_grad_output", "cast_config_grad_output_for_grad_weight")
_GEMMS = ("gemm_config_output", "gemm_config_grad_input", "gemm_config_grad_weight")


def _recipe(granularity: str, grad: torch.dtype, pow2: bool) -> dict[str, object]:
    """torchao's `Float8LinearConfig.from_recipe_name(...)`, the fields that change the numerics, flattened."""
    e4m3 = torch.float8_e4m3fn
    out: dict[str, object] = {}
    for c in _CASTS:
        dtype = grad if c.startswith("cast_config_grad_output") else e4m3
        out |= {f"{c}.scaling_type": "dynamic", f"{c}.scaling_granularity": granularity, f"{c}.target_dtype": dtype}
    out |= {"gemm_config_output.use_fast_accum": True, "gemm_config_grad_input.use_fast_accum": False,
            "gemm_config_grad_weight.use_fast_accum": False, "round_scales_to_power_of_2": pow2}
    return out


# autopar's recipe name -> the config fields torchao's recipe of that name sets (`autopar.runtime.float8`'s
# GRAD_DTYPE, POW2_SCALES and FAST_ACCUM are these)
RECIPE_FIELDS = {
    TENSORWISE: _recipe("tensorwise", torch.float8_e5m2, False),
    ROWWISE: _recipe("axiswise", torch.float8_e4m3fn, True),
}


def is_float8_linear(module: nn.Module) -> bool:
    cls = type(module)
    return cls.__module__.startswith(FLOAT8_LINEAR[0]) and cls.__name__ == FLOAT8_LINEAR[1]


def _value(v):
    return getattr(v, "value", v)  # torchao's enums hold their names as values ("dynamic", "axiswise")


def config_fields(config) -> dict[str, object]:
    """The numerics-changing fields of a torchao `Float8LinearConfig`, flattened as `RECIPE_FIELDS` keys them."""
    out: dict[str, object] = {}
    for c in _CASTS:
        cast = getattr(config, c, None)
        for f in ("scaling_type", "scaling_granularity", "target_dtype"):
            out[f"{c}.{f}"] = _value(getattr(cast, f, None))
    for g in _GEMMS:
        out[f"{g}.use_fast_accum"] = getattr(getattr(config, g, None), "use_fast_accum", None)
    out["round_scales_to_power_of_2"] = getattr(config, "round_scales_to_power_of_2", None)
    return out


def recipe_of(config, path: str = "") -> str:
    """autopar's recipe for a torchao config, or ValueError naming each field that no recipe autopar runs has."""
    got = config_fields(config)
    for recipe, fields in RECIPE_FIELDS.items():
        if got == fields:
            return recipe
    # the nearest recipe: the one with fewest fields differing
    recipe, fields = min(RECIPE_FIELDS.items(), key=lambda kv: sum(got[k] != v for k, v in kv[1].items()))
    diff = [f"{k}={got[k]!r} (its {recipe} recipe: {v!r})" for k, v in fields.items() if got[k] != v]
    where = f"torchao Float8Linear {path!r}" if path else "a torchao Float8Linear"
    raise ValueError(
        f"{where}: its Float8LinearConfig is not a recipe autopar runs: {'; '.join(diff)}. Why: autopar maps a "
        "converted linear to its own fp8 linear (autopar.runtime.float8), which computes torchao's 'tensorwise' and "
        "'rowwise' recipes exactly and nothing else (no high-precision grad_weight as in 'rowwise_with_gw_hp', no "
        "disabled or mixed-granularity casts, no other fp8 dtypes or fast-accumulation choices). Fix: convert with "
        "Float8LinearConfig.from_recipe_name('tensorwise') or ('rowwise'), or pass the unconverted model (plain "
        "nn.Linear) with float8='tensorwise', 'rowwise' or 'auto'")


def _plain_weight(w: torch.Tensor) -> nn.Parameter:
    """The weight as a plain parameter: torchao's `WeightWithDynamicFloat8CastTensor` unwrapped to its tensor."""
    for t in (w, w.data):  # a wrapper subclass made a parameter is its own type (`_is_param`)
        cls = type(t)
        if cls.__module__.startswith(FP8_WEIGHT[0]) and cls.__name__ == FP8_WEIGHT[1]:
            return nn.Parameter(t._tensor.detach(), requires_grad=w.requires_grad)
    return w


def _plain_linear(m: nn.Module) -> nn.Linear:
    lin = nn.Linear(m.in_features, m.out_features, bias=m.bias is not None, device="meta")
    lin.weight = _plain_weight(m.weight)
    if m.bias is not None:
        lin.bias = m.bias
    lin.train(m.training)
    return lin


def _copy_tree(m: nn.Module, memo: dict[int, nn.Module]) -> nn.Module:
    """`m`'s module tree copied (a module used twice stays one), each Float8Linear a plain nn.Linear; every other
    module a shallow copy sharing its parameters, buffers and attributes."""
    if id(m) in memo:
        return memo[id(m)]
    if is_float8_linear(m):
        out = memo[id(m)] = _plain_linear(m)
        return out
    out = memo[id(m)] = object.__new__(type(m))
    out.__dict__ = dict(m.__dict__)
    out._parameters = dict(m._parameters)
    out._buffers = dict(m._buffers)
    out._modules = {name: None if sub is None else _copy_tree(sub, memo) for name, sub in m._modules.items()}
    return out


def unconvert(model: nn.Module) -> tuple[nn.Module, tuple[tuple[str, str], ...], tuple[str, ...]] | None:
    """None when `model` holds no torchao Float8Linear; else (the model with each one a plain nn.Linear over the same
    parameters, ((module path, recipe), ...) sorted, notes for the plan)."""
    found = [(path, m) for path, m in model.named_modules() if is_float8_linear(m)]
    if not found:
        return None
    if isinstance(model, nn.Module) and is_float8_linear(model):
        raise ValueError("the model itself is a torchao Float8Linear: autopar parallelises a model whose linears are "
                         "converted, not one linear. Fix: wrap it in a module (nn.Sequential(linear))")
    choice, hp_gather = [], []
    for path, m in found:
        config = getattr(m, "config", None)
        if config is None:
            raise ValueError(f"torchao Float8Linear {path!r} has no `config` attribute, which torchao >= 0.7 sets "
                             "(Float8LinearConfig): autopar reads its recipe there. Fix: convert with a current "
                             "torchao (convert_to_float8_training(model, config=...))")
        recipe = recipe_of(config, path)
        choice.append((path, recipe))
        if recipe == TENSORWISE and not getattr(config, "enable_fsdp_float8_all_gather", False):
            hp_gather.append(path)
    plain = _copy_tree(model, {})
    recipes = sorted({r for _, r in choice})
    notes = (f"torchao-converted model: {len(choice)} Float8Linear module(s) mapped to autopar's fp8 linear "
             f"({', '.join(recipes)}; autopar.torchao_float8)",)
    if hp_gather:
        notes += (f"torchao enable_fsdp_float8_all_gather=False on {len(hp_gather)} tensorwise linear(s) (e.g. "
                  f"{hp_gather[0]!r}): under fsdp autopar gathers their weights in fp8 anyway, the same values in "
                  "half the bytes of bf16 (passes.lower._fp8_gathered_weights)",)
    return plain, tuple(sorted(choice)), notes


def check_float8_option(float8, choice) -> None:
    """`float8=` on a converted model: None (the model's own choice is used)."""
    if float8 is not None:
        raise ValueError(f"float8={float8!r} on a model converted with torchao ({len(choice)} Float8Linear "
                         f"module(s), e.g. {choice[0][0]!r} {choice[0][1]}): the model already says which linears run "
                         "in fp8 and how. Fix: drop float8 (the converted linears keep their torchao recipe), or pass "
                         "the unconverted model with float8=...")


__all__ = ["unconvert", "recipe_of", "RECIPE_FIELDS", "is_float8_linear"]
