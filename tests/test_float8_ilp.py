"""FP8 chosen per linear class inside the ILP (issue #24, `float8="auto"` on `plan="auto"`): each candidate form of a
structure beside its fp8 variant (`autopar.solver.float8_variants`), checked against an exhaustive search over every
form and every subset of its linears in fp8, priced one by one by the same estimate (`solver.evaluate`); a linear
whose rowwise fp8 pays with its K and N whole loses under tensor parallelism (its shares `skinny` on tp 8), and the
plan's `(float8)` decision says which linears run in fp8 and what that saves per class. Offline, on meta shapes."""

from __future__ import annotations

import itertools

import pytest
import torch
from torch import nn

import autopar
from autopar import float8 as f8plan
from autopar.api import _prepare
from autopar.forms.base import Candidate
from autopar.solver import _classes, _tied_pairs, candidates, evaluate, float8_members, gather_stats, solve
from autopar.timeline import overlapped_s
from cost_model.hardware import load_cluster

H, F, BATCH, SEQ = 4096, 16384, 16, 2048  # rowwise on tp 8: up's N and down's K / 8 = 2048, `skinny`


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.up = nn.Linear(H, F, bias=False)
        self.down = nn.Linear(F, H, bias=False)

    def forward(self, x):
        return x + self.down(nn.functional.gelu(self.up(x)))


class Net(nn.Module):
    """Two identical MLP blocks (one class: their linears share the choice) and an MSE loss (no output head)."""

    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleList([Block() for _ in range(2)])

    def forward(self, x, y):
        for layer in self.layers:
            x = layer(x)
        return nn.functional.mse_loss(x, y)


@pytest.fixture(scope="module")
def planned():
    with torch.device("meta"):
        model = Net().to(torch.bfloat16)
        x = torch.zeros(BATCH, SEQ, H, dtype=torch.bfloat16)
    info, _, ctx = _prepare(model, {"tp": 8}, (x, x), None)
    return model, (x, x), info, ctx


def _with_subsets(site, st, cands, recipe):
    """Every candidate with every subset of the site's linears in fp8 under `recipe`."""
    idx = sorted(st.float8_facts)
    subsets = [s for r in range(1, len(idx) + 1) for s in itertools.combinations(idx, r)]
    return [*cands, *(Candidate(form=c.form, axes=c.axes, fsdp=c.fsdp, zero=c.zero, float8=s, float8_recipe=recipe)
                      for c in cands for s in subsets)]


@pytest.mark.parametrize("recipe", ["rowwise", "tensorwise"])
def test_ilp_float8_equals_exhaustive_search(planned, recipe):
    _, _, info, ctx = planned
    cluster = load_cluster("h100", info.sizes)
    sites = ctx.planning_sites()
    stats, _, _ = gather_stats(ctx)
    classes = _classes(sites, {s.key for p in _tied_pairs(sites) for s in p}, stats)
    mlp = next(cls for cls in classes if cls[0].kind.value == "mlp")
    assert len(mlp) == 2 and sorted(stats[mlp[0].key].float8_facts) == [0, 1]
    options = [(), ("tp",)]
    f8plan.set_offer(ctx, {})  # the oracle prices exactly the assignments it is given
    best = {}  # role option -> (least objective that fits, its choice)
    per_form = {}  # (role option, form label) -> (bf16 time, best fp8 time) of the mlp class
    tried = 0
    for data_axes in options:
        cands = [_with_subsets(cls[0], stats[cls[0].key], candidates(cls[0], stats[cls[0].key], info, data_axes, None),
                               recipe) for cls in classes]
        for combo in itertools.product(*cands):
            choice = {s.key: c for cls, c in zip(classes, combo) for s in cls}
            sol = evaluate(ctx, info, cluster, choice, data_axes)
            tried += 1
            c = choice[mlp[0].key]
            t = overlapped_s(sol.per_site[mlp[0].key])
            bf16, fp8 = per_form.get((data_axes, c.without_float8().label), (None, float("inf")))
            per_form[data_axes, c.without_float8().label] = (t, fp8) if not c.float8 else (bf16, min(fp8, t))
            if sol.memory_bytes <= cluster.device_memory_bytes and sol.objective_s < best.get(data_axes, (1e9,))[0]:
                best[data_axes] = (sol.objective_s, choice)
    assert tried > 20
    f8plan.set_offer(ctx, f8plan.linears(ctx, recipe, cluster, 8, rule=False))
    try:  # the whole ILP (both role options), and the model-axis option alone (tensor parallel or replicated)
        sols = {None: solve(ctx, info, cluster, data_axes_options=options),
                (): solve(ctx, info, cluster, data_axes_options=[()])}
    finally:
        f8plan.set_offer(ctx, {})
    for option, sol in sols.items():
        want, choice = min(best.values(), key=lambda b: b[0]) if option is None else best[option]
        assert sol.status == "optimal"
        assert sol.objective_s == pytest.approx(want, rel=1e-9), (option, sol.choices, choice)
        assert sol.choices[mlp[0].key] == choice[mlp[0].key]
        [fc] = sol.float8_classes
        assert fc.keys == tuple(s.key for s in mlp) and fc.offered == ("layers.0.up", "layers.0.down")
    whole, tp = sols[None], sols[()]
    if recipe == "rowwise":
        # rowwise fp8 pays where each rank holds K and N whole (replicated; FSDP on dp 8), but on tp 8 the shares are
        # skinny (torchao's rowwise filter): no subset pays there. The model-axis option plans tp in bf16, though
        # the same linears pay replicated; the whole ILP plans dp 8 (FSDP) with both in rowwise
        for key in (((), "replicate"), (("tp",), "replicate+fsdp")):
            assert per_form[key][1] < per_form[key][0], key
        assert per_form[(), "tp@tp"][1] > per_form[(), "tp@tp"][0]
        assert tp.choices[mlp[0].key] == Candidate(form="tp", axes=("tp",))
        assert tp.float8_classes[0].fp8 == () and tp.float8_classes[0].gain_s is None
        assert whole.choices[mlp[0].key].label == "replicate+fsdp+rowwise[0, 1]"
        assert whole.float8_classes[0].gain_s == pytest.approx(per_form[("tp",), "replicate+fsdp"][0]
                                                              - per_form[("tp",), "replicate+fsdp"][1])
    else:  # tensorwise pays on tp 8 too (its GEMMs at the tensorwise rate, one scalar amax per cast)
        assert tp.choices[mlp[0].key].label == "tp@tp+tensorwise[0, 1]" and tp.float8_classes[0].gain_s > 0


def test_plan_auto_float8_auto_chooses_per_class_and_explains(planned):
    model, inputs, _, _ = planned
    p = autopar.plan(model, {"tp": 8}, inputs, plan="auto", cluster="h100", float8="auto")
    bf16 = autopar.plan(model, {"tp": 8}, inputs, plan="auto", cluster="h100")
    assert dict(p.float8) == {f"layers.{i}.{n}": "tensorwise" for i in range(2) for n in ("up", "down")}
    assert p.estimate.step_time_s < bf16.estimate.step_time_s
    text = p.explain(f8plan.DECISION_KEY)
    assert "chosen tensorwise" in text and "binary per linear class in the ILP" in text
    assert "tensorwise (4 linears)" in text and "rowwise (4 linears)" in text  # each recipe solved
    assert "fp8 on layers.0.up, layers.0.down of layers.0.up, layers.0.down, saving" in text
    assert "float8-classes" not in {d.kind for d in p.decisions}  # merged into the (float8) decision


class _Mlp(nn.Module):
    def __init__(self, h, f):
        super().__init__()
        self.up = nn.Linear(h, f, bias=False)
        self.down = nn.Linear(f, h, bias=False)

    def forward(self, x, y):
        return nn.functional.mse_loss(x + self.down(nn.functional.gelu(self.up(x))), y)


def test_uneven_fsdp_shard_gathered_in_its_dtype_as_lowered():
    """A tensorwise weight FSDP shards unevenly (neither 16388 nor 4100 divides dp 8) is gathered padded in bf16 by
    the lowering (no `fsdp_gather_fp8`), and the estimate now agrees: fp8 adds only the activations' and gradients'
    amax all-reduces (4 scalars per linear on dp), no 1-byte gather, no shard amax; an even one keeps its fp8 gather,
    and its gathered copy kept for backward is held in 1 byte (the runtime saves the fp8 weight)."""
    from cost_model.analytical import send_bytes
    amax = send_bytes("all_reduce", 4, 8)
    for h, f, even in ((4096, 16384, True), (4100, 16388, False)):
        with torch.device("meta"):
            model = _Mlp(h, f).to(torch.bfloat16)
            x = torch.zeros(8, 256, h, dtype=torch.bfloat16)
        kw = dict(plan="fsdp", cluster="h100")
        bf16 = autopar.plan(model, {"dp": 8}, (x, x), **kw)
        fp8 = autopar.plan(model, {"dp": 8}, (x, x), float8="tensorwise", lower=True, **kw)
        assert len(fp8.float8) == 2
        saved = bf16.estimate.comm_bytes_per_step - fp8.estimate.comm_bytes_per_step
        fp8_gathers = [c for c in fp8.comms if c.fn == "fsdp_gather_fp8"]
        held = bf16.estimate.memory_bytes_per_device - fp8.estimate.memory_bytes_per_device
        if even:  # each weight gathered once in 1 byte instead of 2: (p - 1) / p of its elements saved; its gathered
            # copy (outside any layer: kept to backward, as FSDP2's root) held in fp8, 1 byte per element
            assert len(fp8_gathers) == 2 and saved == 2 * h * f * 7 // 8 - 2 * 5 * amax
            assert held == 2 * h * f
        else:
            assert not fp8_gathers and saved == -2 * 4 * amax and held == 0
