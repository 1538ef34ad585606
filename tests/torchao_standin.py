"""torchao's float8 training API as tests/test_float8_torchao_model.py uses it: the real `torchao.float8` where it is
installed (pyproject's [test] extra pins torchao 0.18.0), else a stand-in with torchao 0.18's shapes, so that the
mapping (`autopar.torchao_float8`) is exercised in a venv without torchao too.

The stand-in mirrors `torchao/float8/config.py` (0.18): `ScalingType`, `ScalingGranularity`, `CastConfig`,
`Float8GemmConfig`, `Float8LinearConfig` with its six cast configs, three GEMM configs and flags, and
`from_recipe_name` for "tensorwise", "rowwise" and "rowwise_with_gw_hp" as torchao sets them; a `Float8Linear` of
class path `torchao.float8.float8_linear.Float8Linear`, its weight wrapped (`WeightWithDynamicFloat8CastTensor`,
class path `torchao.float8.fsdp_utils`) under `enable_fsdp_float8_all_gather`, as `Float8Linear.from_float` does.
Its forward is autopar's fp8 linear under the recipe the config names, which tests/test_float8_torchao_model.py
checks bit for bit against real torchao's `Float8Linear` where torchao is installed."""

from __future__ import annotations

import dataclasses
import enum

import torch
from torch import nn

try:  # the real one (pyproject [test]: torchao==0.18.0, no dependencies)
    from torchao.float8 import Float8LinearConfig, convert_to_float8_training  # noqa: F401
    REAL = True
except ImportError:
    REAL = False

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2

if not REAL:
    class ScalingType(enum.Enum):
        DYNAMIC = "dynamic"
        DISABLED = "disabled"

    class ScalingGranularity(enum.Enum):
        TENSORWISE = "tensorwise"
        AXISWISE = "axiswise"

    @dataclasses.dataclass(frozen=True)
    class CastConfig:
        scaling_type: ScalingType = ScalingType.DYNAMIC
        scaling_granularity: ScalingGranularity = ScalingGranularity.TENSORWISE
        target_dtype: torch.dtype | None = None

    @dataclasses.dataclass(frozen=True)
    class Float8GemmConfig:
        use_fast_accum: bool = False

    @dataclasses.dataclass(frozen=True)
    class Float8LinearConfig:
        cast_config_input: CastConfig = CastConfig()
        cast_config_input_for_grad_weight: CastConfig | None = None
        cast_config_weight: CastConfig = CastConfig()
        cast_config_weight_for_grad_input: CastConfig | None = None
        cast_config_grad_output: CastConfig = CastConfig()
        cast_config_grad_output_for_grad_weight: CastConfig | None = None
        gemm_config_output: Float8GemmConfig = Float8GemmConfig(use_fast_accum=True)
        gemm_config_grad_input: Float8GemmConfig = Float8GemmConfig()
        gemm_config_grad_weight: Float8GemmConfig = Float8GemmConfig()
        enable_fsdp_float8_all_gather: bool = False
        pad_inner_dim: bool = False
        emulate: bool = False
        force_recompute_fp8_weight_in_bwd: bool = False
        round_scales_to_power_of_2: bool = False

        def __post_init__(self):  # torchao: the defaults filled in, e4m3 but e5m2 for the gradient
            for name, base in (("cast_config_input_for_grad_weight", "cast_config_input"),
                               ("cast_config_weight_for_grad_input", "cast_config_weight"),
                               ("cast_config_grad_output_for_grad_weight", "cast_config_grad_output")):
                if getattr(self, name) is None:
                    object.__setattr__(self, name, getattr(self, base))
            for name in ("cast_config_input", "cast_config_input_for_grad_weight", "cast_config_weight",
                         "cast_config_weight_for_grad_input", "cast_config_grad_output",
                         "cast_config_grad_output_for_grad_weight"):
                c = getattr(self, name)
                if c.target_dtype is None:
                    dtype = E5M2 if name.startswith("cast_config_grad_output") else E4M3
                    object.__setattr__(self, name, dataclasses.replace(c, target_dtype=dtype))

        @staticmethod
        def from_recipe_name(name: str) -> "Float8LinearConfig":
            axis = CastConfig(scaling_granularity=ScalingGranularity.AXISWISE, target_dtype=E4M3)
            if name == "tensorwise":
                return Float8LinearConfig()
            if name == "rowwise":
                return Float8LinearConfig(cast_config_input=axis, cast_config_weight=axis,
                                          cast_config_grad_output=axis, round_scales_to_power_of_2=True)
            if name == "rowwise_with_gw_hp":
                off = CastConfig(scaling_type=ScalingType.DISABLED)
                tw = CastConfig()
                return Float8LinearConfig(cast_config_input=axis, cast_config_weight=axis,
                                          cast_config_grad_output=axis, cast_config_input_for_grad_weight=off,
                                          cast_config_weight_for_grad_input=tw,
                                          cast_config_grad_output_for_grad_weight=off,
                                          round_scales_to_power_of_2=True)
            raise ValueError(name)

    class _Weight(torch.Tensor):
        """Stand-in for torchao's `WeightWithDynamicFloat8CastTensor` (a wrapper subclass holding `_tensor`)."""

        @staticmethod
        def __new__(cls, tensor):
            return torch.Tensor._make_wrapper_subclass(cls, tensor.shape, dtype=tensor.dtype, device=tensor.device,
                                                       requires_grad=tensor.requires_grad)

        def __init__(self, tensor):
            self._tensor = tensor

        @classmethod
        def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
            unwrap = lambda t: t._tensor if isinstance(t, _Weight) else t  # noqa: E731
            return func(*torch.utils._pytree.tree_map(unwrap, args),
                        **torch.utils._pytree.tree_map(unwrap, kwargs or {}))

    _Weight.__name__ = _Weight.__qualname__ = "WeightWithDynamicFloat8CastTensor"
    _Weight.__module__ = "torchao.float8.fsdp_utils"

    class Float8Linear(nn.Linear):
        def forward(self, x):
            from autopar.runtime.float8 import float8_linear
            from autopar.torchao_float8 import recipe_of
            w = self.weight._tensor if isinstance(self.weight, _Weight) else self.weight
            return float8_linear(x, w, self.bias, recipe_of(self.config))

    Float8Linear.__module__ = "torchao.float8.float8_linear"

    def convert_to_float8_training(module, *, module_filter_fn=None, config=None):
        config = config or Float8LinearConfig()
        for path, m in list(module.named_modules()):
            for name, child in list(m.named_children()):
                fqn = f"{path}.{name}" if path else name
                if type(child) is nn.Linear and (module_filter_fn is None or module_filter_fn(child, fqn)):
                    new = Float8Linear(child.in_features, child.out_features, bias=child.bias is not None,
                                       device="meta")
                    new.config, new.weight, new.bias = config, child.weight, child.bias
                    if config.enable_fsdp_float8_all_gather:
                        new.weight = nn.Parameter(_Weight(child.weight.data), requires_grad=child.weight.requires_grad)
                    setattr(m, name, new)
        return module
