"""A model the user converted with torchao 0.18 (`convert_to_float8_training`; pyproject's [test] extra installs it)
is captured and parallelised (`autopar.torchao_float8`): each `Float8Linear` a plain linear over the same
parameters, run in fp8 under the recipe its config names.

Under dp, fsdp (tensorwise with `enable_fsdp_float8_all_gather`: the weight gathered in fp8) and megatron on 2 gloo
ranks, both recipes, fp32: the converted model equals the same converted model on one device (torchao's own
Float8Linear forward and backward) within the float8 tolerance (tests/float8_tolerance.py, where each term is
explained): loss, every parameter gradient, the parameters after one AdamW step. Measured (2 ranks, this model):

  plan / recipe        loss     grads (max rel)  step (max, in lr)  flipped steps
  fsdp tensorwise      0        3.8e-7           8.0e-3             0
  megatron tensorwise  0        3.1e-7           1.2e-5             0
  dp, fsdp rowwise     1.1e-7   2.9e-3           3.3e-5             0
  megatron rowwise     1.4e-4   6.4e-2           2 (a flip)         0.69 %
  fp8 vs no fp8        2.3e-4   0.10-0.14        -                  -

A wrong rowwise recipe, against the same torchao model: e5m2 gradients (torchao's tensorwise dtype) grads 0.13
dp / 0.19 megatron; scales not rounded to powers of 2: 0.13 / 0.13, loss 5.3e-4 / 4.0e-4: each above its tolerance.
Its collectives are exactly those of autopar's own `float8=recipe` on the unconverted model (lowered offline)."""

from __future__ import annotations

import copy
import dataclasses

import pytest
import torch
from torch import nn
from torchao.float8 import Float8LinearConfig, convert_to_float8_training

import autopar
from tests.dist_harness import gloo_pool
from tests.float8_tolerance import TOLERANCE

LR = 1e-2


def _llama(dtype=torch.float32):
    from autopar.models import Llama, LlamaConfig
    torch.manual_seed(0)
    return Llama(LlamaConfig(vocab_size=64, seq_len=8, hidden=32, ffn_hidden=64, num_heads=4,
                             num_kv_heads=2)).to(dtype)


def _converted(model, recipe, fsdp_fp8=False):
    """`model` converted as torchtitan converts it: every nn.Linear but the output head."""
    config = Float8LinearConfig.from_recipe_name(recipe)
    if fsdp_fp8:
        config = dataclasses.replace(config, enable_fsdp_float8_all_gather=True)
    return convert_to_float8_training(copy.deepcopy(model), config=config,
                                      module_filter_fn=lambda m, fqn: fqn != "output")


def _inputs():
    tokens = torch.randint(0, 64, (4, 8), generator=torch.Generator().manual_seed(1))
    return tokens, tokens.roll(-1, 1)


def _full(t):
    t = t.full_tensor() if hasattr(t, "full_tensor") else t
    return t._tensor if hasattr(t, "_tensor") else t  # torchao's fp8-gather weight wrapper holds the tensor


def _step(model, inputs):
    """(loss, {name: full gradient}, {name: full parameter after one AdamW step})."""
    params = list(model.named_parameters())
    opt = torch.optim.AdamW([p for _, p in params], lr=LR)
    loss = model(*inputs)
    loss.backward()
    grads = {n: _full(p.grad.detach()).clone() for n, p in params}
    opt.step()
    return float(loss.detach()), grads, {n: _full(p.detach()).clone() for n, p in params}


def _rel(a, b) -> float:
    return float((a.double() - b.double()).abs().max() / b.double().abs().max().clamp(min=1e-30))


def errors(loss, grads, after, ref_loss, ref_grads, ref_after) -> dict:
    """The terms tests/float8_tolerance.py bounds."""
    rel = _rel
    moved = {n: (after[n].double() - ref_after[n].double()).abs() for n in ref_after}
    return dict(loss=abs(loss - ref_loss) / abs(ref_loss), grads=max(rel(grads[n], ref_grads[n]) for n in ref_grads),
                step=max(float(m.max()) for m in moved.values()) / LR,
                flips=sum(int((m > LR / 2).sum()) for m in moved.values()) / sum(m.numel() for m in moved.values()))


def _runs(cases):
    """Each (plan, recipe, fsdp_fp8, axis): the converted model parallelised against itself on one device."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    out = []
    for plan, recipe, fsdp_fp8, axis in cases:
        mesh = init_device_mesh("cpu", (dist.get_world_size(),), mesh_dim_names=(axis,))
        model = _converted(_llama(), recipe, fsdp_fp8)
        inputs = _inputs()
        pm = autopar.parallelize(copy.deepcopy(model), mesh, inputs, plan=plan)
        got = _step(pm, inputs)
        ref = _step(copy.deepcopy(model), inputs)  # torchao on one device
        hp_grads = _step(_llama(), inputs)[1]  # no fp8
        out.append(dict(
            case=(plan, recipe, fsdp_fp8), float8=pm.plan.float8, notes=pm.plan.notes, **errors(*got, *ref),
            vs_hp=max(_rel(got[1][n], hp_grads[n]) for n in hp_grads), names=sorted(got[1]) == sorted(ref[1]),
            fp8_gathers=sum(c.fn == "fsdp_gather_fp8" for c in pm.plan.comms)))
    return out


# tensorwise under dp: tests/test_float8_runtime.py (against autopar's fp8 linear on one device, torchao's bit for bit)
CASES = [("fsdp", "tensorwise", True, "dp"), ("megatron", "tensorwise", False, "tp"), ("dp", "rowwise", False, "dp"),
         ("fsdp", "rowwise", False, "dp"), ("megatron", "rowwise", False, "tp")]


def test_converted_model_equals_torchao_single_device_under_dp_fsdp_megatron():
    linears = {f"layers.{i}.{m}" for i in range(2) for m in ("attn.wq", "attn.wk", "attn.wv", "attn.wo", "mlp.gate",
                                                               "mlp.up", "mlp.down")}
    for rank_runs in gloo_pool(2).run(_runs, CASES):
        for r in rank_runs:
            plan, recipe, fsdp_fp8 = r["case"]
            tol = TOLERANCE[(recipe, plan)]
            print(r["case"], {k: f"{r[k]:.2e}" for k in ("loss", "grads", "step", "flips", "vs_hp")})
            assert dict(r["float8"]) == dict.fromkeys(linears, recipe), r  # the converted linears, not the head
            assert r["names"] and any("torchao-converted model: 14" in n for n in r["notes"]), r
            assert all(r[k] <= tol[k] for k in tol), (r, tol)
            assert r["vs_hp"] >= 1e-2, r  # really fp8
            assert r["fp8_gathers"] == (14 if fsdp_fp8 else 0), r


@pytest.mark.parametrize("plan,recipe", [("fsdp", "tensorwise"), ("megatron", "rowwise")])
def test_collectives_are_autopar_s_own_float8(plan, recipe):
    """The converted model's lowered plan lists exactly the collectives of `float8=recipe` on the plain model."""
    model, inputs = _llama(), _inputs()
    mesh = {"dp": 2} if plan == "fsdp" else {"tp": 2}
    mine = autopar.plan(_converted(model, recipe), mesh, inputs, plan=plan, lower=True)
    own = autopar.plan(model, mesh, inputs, plan=plan, lower=True, float8=recipe)
    assert mine.float8 == own.float8 and len(mine.float8) == 14
    assert mine.comms == own.comms and any(c.fn == "float8_amax" for c in mine.comms)


def test_each_linear_is_torchao_s_bit_for_bit():
    """autopar's fp8 linear against the converted module's own forward and backward (torchao's kernels): equal, every
    output and gradient, both recipes, fp32 and bf16. The rows of x and of the output gradient span 2^-24..1: with
    power-of-2 scales the e4m3 rounding of an entry depends on its scale only where it falls below e4m3's normal range
    (2^-6 after scaling), so only entries far below their slice's largest tell a wrong scale axis from the right one."""
    from autopar.runtime.float8 import float8_linear
    spread = torch.logspace(-24, 0, 32, base=2.0).reshape(4, 8, 1)  # per token (row of M)
    for recipe in ("tensorwise", "rowwise"):
        for dtype in (torch.float32, torch.bfloat16):
            torch.manual_seed(0)
            lin = nn.Linear(32, 48).to(dtype)
            conv = _converted(nn.Sequential(lin, nn.Linear(48, 48)), recipe)[0]
            x = (torch.randn(4, 8, 32) * spread).to(dtype).requires_grad_()
            g = (torch.randn(4, 8, 48) * spread.flip(0)).to(dtype)
            conv(x).backward(g)
            x2, w, b = (t.detach().clone().requires_grad_() for t in (x, lin.weight, lin.bias))
            y = float8_linear(x2, w, b, recipe)
            y.backward(g)
            assert torch.equal(y, conv(x)) and torch.equal(x2.grad, x.grad), (recipe, dtype)
            assert torch.equal(w.grad, conv.weight.grad) and torch.equal(b.grad, conv.bias.grad), (recipe, dtype)


def test_configs_map_or_raise_naming_the_field():
    from autopar.torchao_float8 import recipe_of, unconvert
    cfg = Float8LinearConfig.from_recipe_name
    assert recipe_of(cfg("tensorwise")) == "tensorwise" and recipe_of(cfg("rowwise")) == "rowwise"
    with pytest.raises(ValueError, match=r"'l': .*cast_config_input_for_grad_weight\.scaling_type='disabled' \(its "
                                         r"rowwise recipe: 'dynamic'\).*Fix: convert with Float8LinearConfig"):
        recipe_of(cfg("rowwise_with_gw_hp"), "l")
    pow2 = dataclasses.replace(cfg("tensorwise"), round_scales_to_power_of_2=True)
    with pytest.raises(ValueError, match=r"round_scales_to_power_of_2=True \(its tensorwise recipe: False\)"):
        recipe_of(pow2)
    model = _converted(_llama(), "tensorwise", fsdp_fp8=True)
    plain, choice, notes = unconvert(model)
    assert len(choice) == 14 and {r for _, r in choice} == {"tensorwise"} and len(notes) == 1  # fp8 gather on
    assert type(model.layers[0].attn.wq).__name__ == "Float8Linear"  # the user's model is not modified
    assert type(plain.layers[0].attn.wq) is nn.Linear and type(plain.layers[0].attn.wq.weight) is nn.Parameter
    assert plain.layers[0].attn.wq.bias is model.layers[0].attn.wq.bias and plain.output.weight is model.output.weight
    assert "enable_fsdp_float8_all_gather=False" in unconvert(_converted(_llama(), "tensorwise"))[2][1]
    inputs = _inputs()
    with pytest.raises(ValueError, match=r"float8='auto' on a model converted with torchao.*Fix: drop float8"):
        autopar.plan(model, {"dp": 2}, inputs, plan="dp", float8="auto")
    with pytest.raises(NotImplementedError, match="a torchao-converted model's float8 linears with a 'pipeline'"):
        autopar.plan(model, {"pp": 2}, inputs, plan="dp", overrides={"pipeline": "1f1b@pp"})
