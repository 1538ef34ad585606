"""parallelize(..., float8=...) runs the chosen linears in fp8 (`autopar.runtime.float8`, `passes.lower.
float8_linears_pass`) under dp, fsdp and megatron on 2 gloo ranks, against the single-device float8 model (the same
fp8 linear, `float8_linear`, on one device): loss, every parameter gradient and the parameters after an SGD step, in
fp32, both recipes.

Every amax is all-reduced over the axes that split the dims it reduces over (tokens on dp, a column-parallel
weight's N or a row-parallel one's K on tp), so each rank's scales are the single device's: what remains is, for
tensorwise, fp32 summation order (tolerance 1e-5 relative to the largest entry; measured on 2 ranks: gradients
3.7e-7 dp, 5.0e-7 megatron; parameters after the step 8.4e-8); for rowwise, also the bf16 rounding of a GEMM whose
reduction dim a rank splits (its partial sums stay fp32; the single device writes the sum in bf16, as torchao does):
the float8 tolerance, tests/float8_tolerance.py (measured: fsdp gradients 2.9e-3, megatron 6.4e-2). The float8
linears really run in fp8: against the fp32 model without fp8 the gradients differ by the fp8 error (measured 0.14
tensorwise, 0.18 rowwise; asserted >= 1e-2). Its collectives: the plain plan's plus the amax all-reduces, exactly.
The output head stays fp32 (not in `Plan.float8`)."""

from __future__ import annotations

import copy
from collections import Counter

import pytest
import torch
from torch import nn

from tests.dist_harness import gloo_pool
from tests.float8_tolerance import TOLERANCE

TOL, FP8_AT_LEAST = TOLERANCE[("tensorwise", "fsdp")]["grads"], 1e-2  # TOL: tensorwise (test_float8_fsdp_gather)


class _F8(nn.Module):
    def __init__(self, lin: nn.Linear, recipe: str):
        super().__init__()
        self.lin, self.recipe = lin, recipe

    def forward(self, x):
        from autopar.runtime.float8 import float8_linear
        return float8_linear(x, self.lin.weight, self.lin.bias, self.recipe)


def _reference(model: nn.Module, float8) -> nn.Module:
    """The single-device float8 model: `model` with the plan's float8 linears on `float8_linear`."""
    ref = copy.deepcopy(model)
    for path, recipe in float8:
        parent, _, name = path.rpartition(".")
        holder = ref.get_submodule(parent) if parent else ref
        setattr(holder, name, _F8(getattr(holder, name), recipe))
    return ref


def _step(model, params, inputs):
    loss = model(*inputs)
    loss.backward()
    grads = {n: p.grad.detach().clone() for n, p in params}
    with torch.no_grad():
        for _, p in params:
            p -= 0.1 * p.grad
    return loss.detach(), grads


def _run(plan: str, recipe: str, axis: str = "dp"):
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    import autopar
    from autopar.models import Llama, LlamaConfig
    from autopar.runtime import collectives as C

    mesh = init_device_mesh("cpu", (dist.get_world_size(),), mesh_dim_names=(axis,))
    torch.manual_seed(0)
    model = Llama(LlamaConfig(vocab_size=64, seq_len=8, hidden=32, ffn_hidden=64, num_heads=4, num_kv_heads=2))
    tokens = torch.randint(0, 64, (4, 8), generator=torch.Generator().manual_seed(1))
    inputs = (tokens, tokens.roll(-1, 1))
    pm = autopar.parallelize(copy.deepcopy(model), mesh, inputs, plan=plan, float8=recipe)
    plain = autopar.parallelize(copy.deepcopy(model), mesh, inputs, plan=plan)
    float8 = pm.plan.float8
    ref = _reference(model, float8)
    hp = copy.deepcopy(model)
    names = [n for n, _ in pm.named_parameters()]
    with C.record_comms() as fp8_comms:
        loss, grads = _step(pm, list(pm.named_parameters()), inputs)
    with C.record_comms() as plain_comms:
        _step(plain, list(plain.named_parameters()), inputs)
    key = lambda r: (r.kind, r.axis, r.pass_, r.numel, r.dtype)  # noqa: E731
    extra = Counter(map(key, fp8_comms)) - Counter(map(key, plain_comms))
    full = {n: p.full_tensor() if hasattr(p, "full_tensor") else p for n, p in pm.named_parameters()}
    full_grads = {n: g.full_tensor() if hasattr(g, "full_tensor") else g for n, g in grads.items()}
    ref_params = [(n.replace(".lin.", "."), p) for n, p in ref.named_parameters()]
    ref_loss, ref_grads = _step(ref, ref_params, inputs)
    hp_loss, hp_grads = _step(hp, list(hp.named_parameters()), inputs)
    ref_after = dict(ref_params)
    rel = lambda a, b: float((a - b).abs().max() / b.abs().max().clamp(min=1e-30))  # noqa: E731
    return dict(
        float8=float8, names=names,
        loss=abs(float(loss) - float(ref_loss)) / abs(float(ref_loss)),
        grads=max(rel(full_grads[n], ref_grads[n]) for n in names),
        params=max(rel(full[n], ref_after[n].detach()) for n in names),
        vs_hp=max(rel(full_grads[n], hp_grads[n]) for n in names),
        extra=sorted(extra.items()), missing=sorted((Counter(map(key, plain_comms)) - Counter(map(key, fp8_comms))).items()),
        shapes={path: tuple(model.get_submodule(path).weight.shape) for path, _ in float8},
        placements=dict(pm.plan.params), tokens=int(tokens.numel()))


def _expected_amaxes(r, recipe, axis, ranks=2):
    """The amax all-reduces (MAX) the float8 linears add, from `autopar.forms.float8.CASTS`: on the data axis those
    over the tokens; on the tensor axis those over a column-parallel weight's N or a row-parallel one's K."""
    from autopar.forms.float8 import CASTS
    want = Counter()
    for path, (n, k) in r["shapes"].items():
        pls = r["placements"][f"{path}.weight"]
        split = "m" if axis == "dp" else ("n" if pls == "S(0)" else "k")
        local = {"m": r["tokens"] // (ranks if axis == "dp" else 1), "k": k // (ranks if split == "k" else 1),
                 "n": n // (ranks if split == "n" else 1)}
        for j, (reduced, kept) in enumerate(CASTS[recipe]):
            if split in reduced:
                want[("all_reduce", axis, "forward" if j < 2 else "backward", 1 if kept is None else local[kept],
                      "float32")] += 1
    return want


@pytest.mark.parametrize("plan,recipe,axis", [("dp", "tensorwise", "dp"), ("fsdp", "rowwise", "dp"),
                                              ("megatron", "tensorwise", "tp"), ("megatron", "rowwise", "tp")])
def test_float8_plan_equals_single_device_float8_model(plan, recipe, axis):
    for r in gloo_pool(2).run(_run, plan, recipe, axis):
        assert len(r["float8"]) == 14 and {rc for _, rc in r["float8"]} == {recipe}  # 7 per layer, not the head
        assert "output" not in {p for p, _ in r["float8"]}
        tol = TOLERANCE[(recipe, plan)]  # the float8 tolerance; params after this SGD step move 0.1 x the grads
        assert r["loss"] <= tol["loss"] and r["grads"] <= tol["grads"] and r["params"] <= tol["grads"], r
        assert r["vs_hp"] >= FP8_AT_LEAST, r  # really fp8
        # its collectives: the plain plan's, plus the amax all-reduces (`_expected_amaxes`), exactly
        assert dict(r["extra"]) == dict(_expected_amaxes(r, recipe, axis)) and not r["missing"], r
