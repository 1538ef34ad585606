"""The user contract under data mistakes and quietly ignored requests (issue #10, slice "data").

- custom `torch.autograd.Function`s keep their own backward (captured as an opaque node unless their backward is
  the derivative of their forward);
- out-of-range token ids and labels raise `IndexError` as on one device under vocab-parallel embedding and loss;
- requests that cannot be honoured raise: a hand plan over `memory_limit`, a batch that does not divide the data
  axes, tied parameters given different placements by a Plan; overrides resolve by specificity;
- `pm.load_state_dict` takes the full tensors a user already has, and an optimizer built on the original model's
  parameters is caught at its first step.
"""

from __future__ import annotations

import copy
import dataclasses
import re

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import init_device_mesh

import autopar
from autopar.units import fmt_bytes
from autopar.models import GPT, GPTConfig
from equivalence import run_equivalence

CFG = GPTConfig(vocab_size=64, seq_len=8, num_layers=1, num_heads=4, hidden=32)


def _gpt():
    torch.manual_seed(0)
    return GPT(CFG)


def _batch(b=4):
    g = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, CFG.vocab_size, (b, CFG.seq_len), generator=g)
    return tokens, torch.roll(tokens, -1, dims=1)


# ----------------------------------------------------------------------------- custom autograd.Function (item 1)

class RoundSTE(torch.autograd.Function):
    """Straight-through estimator: round forward, identity backward (the traced derivative is zero)."""

    @staticmethod
    def forward(ctx, x):
        return torch.round(x * 4) / 4

    @staticmethod
    def backward(ctx, g):
        return g


class ScaleGrad(torch.autograd.Function):
    """Identity forward, gradient scaled by `scale` (setup_context style, a non-tensor argument)."""

    @staticmethod
    def forward(x, scale):
        return x.clone()

    @staticmethod
    def setup_context(ctx, inputs, output):
        ctx.scale = inputs[1]

    @staticmethod
    def backward(ctx, g):
        return g * ctx.scale, None


class TanhGelu(torch.autograd.Function):
    """A Function whose backward is its forward's derivative (as Bloom's GeLU): traced, forms kept."""

    @staticmethod
    def forward(ctx, x):
        ctx.save_for_backward(x)
        return 0.5 * x * (1 + torch.tanh(0.7978845608 * (x + 0.044715 * x ** 3)))

    @staticmethod
    def backward(ctx, g):
        (x,) = ctx.saved_tensors
        t = torch.tanh(0.7978845608 * (x + 0.044715 * x ** 3))
        return g * (0.5 * (1 + t) + 0.5 * x * (1 - t * t) * 0.7978845608 * (1 + 3 * 0.044715 * x * x))


class WithFunctions(nn.Module):
    def __init__(self, act=RoundSTE):
        super().__init__()
        self.act = act
        self.up = nn.Linear(16, 32)
        self.down = nn.Linear(32, 16)
        self.head = nn.Linear(16, 16)

    def forward(self, x, y):
        h = self.down(self.act.apply(self.up(x)))
        h = ScaleGrad.apply(h, 0.25) if self.act is RoundSTE else h
        return ((self.head(h) - y) ** 2).mean()


def _fn_inputs():
    g = torch.Generator().manual_seed(3)
    return torch.randn(8, 16, generator=g, dtype=torch.float64), torch.randn(8, 16, generator=g, dtype=torch.float64)


@pytest.mark.parametrize("world,plan,overrides", [
    (1, "megatron", None), (2, "megatron", None), (2, "fsdp", None),
    (2, "megatron", {"up": "colwise", "down": "rowwise", "head": "colwise"}),  # sharded activations into the Function
])
def test_custom_autograd_function_keeps_its_own_backward(local_world, fp64, world, plan, overrides):
    torch.manual_seed(0)
    ref, inputs = WithFunctions(), _fn_inputs()
    with local_world(world):
        res = run_equivalence(ref, inputs, (world,), ("tp" if plan == "megatron" else "dp",), plan=plan,
                              overrides=overrides, steps=2)
    if overrides:
        assert {s.key: s.form for s in res.plan.strategies} == overrides
        assert res.local_numel["up.weight"] == 32 * 16 // 2
    assert res.max_err() < 1e-12, res
    assert set(res.grad_err) == {n for n, _ in ref.named_parameters()}
    notes = [n for n in res.plan.notes if n.startswith("custom autograd.Function")]
    assert len(notes) == 2, res.plan.notes
    assert notes[0].startswith("custom autograd.Function test_contract_data.RoundSTE captured as one opaque node, "
                               "batch-local (its rows are independent: it runs on each rank's rows of the batch), so "
                               "that its own backward runs: its backward is not the derivative of its forward "
                               "(gradients differ by up to "), notes
    assert "test_contract_data.ScaleGrad" in notes[1], notes


def test_straight_through_gradient_is_not_zero(local_world, fp64):
    """The symptom the issue reports: under the traced derivative `up` got zero gradients."""
    torch.manual_seed(0)
    model = WithFunctions()
    x, y = _fn_inputs()
    with local_world(1):
        pm = autopar.parallelize(copy.deepcopy(model), init_device_mesh("cpu", (1,)), (x, y), plan="megatron")
        pm(x, y).backward()
        grad = pm.get_parameter("up.weight").grad.full_tensor()
    assert float(grad.abs().max()._local_tensors[0]) > 1e-3


def test_function_whose_backward_is_its_derivative_is_traced_with_forms_kept(local_world, fp64):
    torch.manual_seed(0)
    ref, inputs = WithFunctions(act=TanhGelu), _fn_inputs()
    with local_world(2):
        res = run_equivalence(ref, inputs, (2,), ("tp",), plan="megatron", steps=2)
    assert res.max_err() < 1e-12, res
    assert not [n for n in res.plan.notes if "opaque" in n], res.plan.notes
    assert {s.key: s.form for s in res.plan.strategies}["{up,down}"] == "tp"


# ----------------------------------------------------------------------------- out-of-range ids and labels (item 5)

def _parallel_gpt(local_world, plan="megatron", world=2):
    model = _gpt()
    tokens, labels = _batch()
    with local_world(world):
        mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("tp" if plan == "megatron" else "dp",))
        pm = autopar.parallelize(copy.deepcopy(model), mesh, (tokens, labels), plan=plan)
    forms = {s.kind: s.form for s in pm.plan.strategies}
    if plan == "megatron":
        assert forms["embedding"] == "vocab" and forms["loss"] == "vocab", forms
    return model, pm, tokens, labels


@pytest.mark.parametrize("plan", ["megatron", "fsdp"])
def test_out_of_range_token_id_raises_index_error_like_one_device(local_world, fp64, plan):
    model, pm, tokens, labels = _parallel_gpt(local_world, plan)
    for bad in (CFG.vocab_size, -1):
        t = tokens.clone()
        t[1, 3] = bad
        with pytest.raises(IndexError, match="index out of range in self"):
            model(t, labels)
        with local_world(2), pytest.raises(IndexError, match="^index out of range in self$"):
            pm(t, labels)


@pytest.mark.parametrize("plan", ["megatron", "fsdp"])
def test_out_of_range_label_raises_index_error_like_one_device(local_world, fp64, plan):
    model, pm, tokens, labels = _parallel_gpt(local_world, plan)
    for bad in (CFG.vocab_size + 3, -1):
        lab = labels.clone()
        lab[2, 5] = bad
        with pytest.raises(IndexError, match=f"Target {bad} is out of bounds."):
            model(tokens, lab)
        with local_world(2), pytest.raises(IndexError, match=f"^Target {bad} is out of bounds.$"):
            pm(tokens, lab)


def test_ignore_index_labels_stay_ignored_under_vocab_parallel_loss(local_world, fp64):
    model, pm, tokens, labels = _parallel_gpt(local_world)
    lab = labels.clone()
    lab[:, -1] = -100
    want = model(tokens, lab)
    with local_world(2):
        got = pm(tokens, lab)
    for r in range(2):
        torch.testing.assert_close(got._local_tensors[r], want, rtol=0, atol=1e-12)


# ----------------------------------------------------------------------------- requests honoured or refused (item 7)

def _gpt2():
    torch.manual_seed(0)
    return GPT(GPTConfig(vocab_size=64, seq_len=8, num_layers=2, num_heads=4, hidden=32))


def test_hand_plan_over_memory_limit_raises_with_the_estimate(local_world):
    model, inputs = _gpt2(), _batch()
    planned = autopar.plan(model, {"tp": 2}, inputs, plan="megatron", cluster="cpu", memory_limit=1024)
    assert not planned.estimate.fits  # planning alone still returns the plan, saying it does not fit
    need = fmt_bytes(planned.estimate.memory_bytes_per_device)
    with local_world(2):
        mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("tp",))
        for plan in ("megatron", planned):
            with pytest.raises(autopar.InfeasibleError, match=r"(?s)" + re.escape(
                    f"plan 'megatron' needs an estimated {need} per device") + r".*memory_limit of 1\.00 "
                    r"KiB on mesh \{'tp': 2\}.*Fix: plan='auto'.*larger memory_limit"):
                autopar.parallelize(model, mesh, inputs, plan=plan, cluster="cpu", memory_limit=1024)
        pm = autopar.parallelize(model, mesh, inputs, plan="megatron", cluster="cpu", memory_limit=2**40)
        assert pm.plan.estimate.fits


def _attention_forms(plan):
    return {s.key: s.form for s in plan.strategies if s.kind == "attention"}


def test_the_more_specific_override_wins_whatever_the_order():
    model, inputs = _gpt2(), _batch()
    a = autopar.plan(model, {"tp": 2}, inputs, plan="megatron", overrides={"h.0.attn": "heads", "attention": "replicate"})
    b = autopar.plan(model, {"tp": 2}, inputs, plan="megatron", overrides={"attention": "replicate", "h.0.attn": "heads"})
    assert _attention_forms(a) == _attention_forms(b) == {"h.0.attn": "heads", "h.1.attn": "replicate"}
    assert a.to_json() == b.to_json()
    # a glob beats a kind, an exact path beats a glob
    c = autopar.plan(model, {"tp": 2}, inputs, plan="megatron",
                     overrides={"h.1.attn": "replicate", "h.*.attn": "heads", "attention": "replicate"})
    assert _attention_forms(c) == {"h.0.attn": "heads", "h.1.attn": "replicate"}


def test_equally_specific_overrides_that_disagree_raise():
    model, inputs = _gpt2(), _batch()
    with pytest.raises(ValueError, match=re.escape("overrides 'h.*.attn': 'heads' and 'h.0.att?': 'replicate' both "
                                                   "name attention h.0.attn and are equally specific")
                       + r".*Fix: drop one, or name the structure by its exact module path \('h\.0\.attn': \.\.\.\)"):
        autopar.plan(model, {"tp": 2}, inputs, plan="megatron", overrides={"h.*.attn": "heads", "h.0.att?": "replicate"})
    # equally specific keys that agree are fine
    p = autopar.plan(model, {"tp": 2}, inputs, plan="megatron", overrides={"h.*.attn": "heads", "h.0.att?": "heads"})
    assert _attention_forms(p) == {"h.0.attn": "heads", "h.1.attn": "heads"}


@pytest.mark.parametrize("plan", ["dp", "fsdp", "megatron"])
def test_batch_that_does_not_divide_the_data_axes_raises(local_world, plan):
    model = _gpt2()
    inputs = _batch(b=3)
    shape, names = ((2, 2), ("dp", "tp")) if plan == "megatron" else ((2,), ("dp",))
    with local_world(len(names) * 2 if plan == "megatron" else 2):
        mesh = init_device_mesh("cpu", shape, mesh_dim_names=names)
        with pytest.raises(ValueError, match=r"input tokens has batch 3, which does not divide over the 2 "
                                             r"data-parallel ranks of mesh axes \('dp',\).*Fix: a batch size "
                                             r"divisible by 2 \(e\.g\. 4\), or a plan without data parallelism"):
            autopar.parallelize(copy.deepcopy(model), mesh, inputs, plan=plan)
    # planning alone keeps the input replicated and says so
    planned = autopar.plan(model, dict(zip(names, shape)), inputs, plan=plan)
    assert "input tokens replicated: batch 3 does not divide over 2 data-parallel ranks (axes ('dp',))" \
        in planned.notes, planned.notes
    with local_world(len(names) * 2 if plan == "megatron" else 2):  # and running that plan raises alike
        mesh = init_device_mesh("cpu", shape, mesh_dim_names=names)
        with pytest.raises(ValueError, match=r"input tokens has batch 3, which does not divide"):
            autopar.parallelize(copy.deepcopy(model), mesh, inputs, plan=planned)
    assert dict(planned.inputs)["tokens"] == "R" * len(shape)


def test_plan_giving_tied_parameters_different_placements_raises(local_world):
    model, inputs = _gpt2(), _batch()
    with local_world(2):
        mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("tp",))
        pm = autopar.parallelize(copy.deepcopy(model), mesh, inputs, plan="megatron")
        params = dict(pm.plan.params)
        assert params["wte.weight"] == params["lm_head.weight"] == "S(0)"
        edited = dataclasses.replace(pm.plan, params=tuple({**params, "lm_head.weight": "R"}.items()))
        with pytest.raises(ValueError, match=re.escape("tied parameters ['wte.weight', 'lm_head.weight'] (one tensor "
                                                       "under several names) were given different placements "
                                                       "{'wte.weight': 'S(0)', 'lm_head.weight': 'R'} by the plan")
                           + ".*Fix: give every name the same placement"):
            autopar.parallelize(copy.deepcopy(model), mesh, inputs, plan=edited)
        autopar.parallelize(copy.deepcopy(model), mesh, inputs, plan=pm.plan)  # the plan as saved is fine


# ----------------------------------------------------------------------------- loading weights a user has (item 8)

def _other_gpt2():
    torch.manual_seed(7)
    return GPT(GPTConfig(vocab_size=64, seq_len=8, num_layers=2, num_heads=4, hidden=32))


def _assert_holds(pm, model):
    want = dict(model.named_parameters(remove_duplicate=False))
    for name, p in pm.named_parameters(remove_duplicate=False):
        full = p.full_tensor()
        for r in range(2):
            assert torch.equal(full._local_tensors[r], want[name].detach()), name


@pytest.mark.parametrize("plan", ["megatron", "fsdp"])
def test_load_state_dict_of_full_tensors_shards_them_into_place(local_world, fp64, plan):
    model, other, inputs = _gpt2(), _other_gpt2(), _batch()
    full_sd = other.state_dict()
    assert not any(isinstance(v, torch.distributed.tensor.DTensor) for v in full_sd.values())
    with local_world(2):
        mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("dp" if plan == "fsdp" else "tp",))
        pm = autopar.parallelize(model, mesh, inputs, plan=plan)
        if plan == "megatron":
            assert "_StridedShard" in repr(pm.get_parameter("h.0.attn.qkv.weight").placements)
        placements = {n: p.placements for n, p in pm.named_parameters()}
        result = pm.load_state_dict(full_sd)
        assert not result.missing_keys and not result.unexpected_keys
        assert {n: p.placements for n, p in pm.named_parameters()} == placements
        _assert_holds(pm, other)
        assert pm.get_parameter("wte.weight") is pm.get_parameter("lm_head.weight")  # still tied
        got = pm(*inputs)
    want = other(*inputs)
    for r in range(2):
        torch.testing.assert_close(got._local_tensors[r], want, rtol=0, atol=1e-12)


def test_load_state_dict_mixing_dtensors_and_full_tensors(local_world, fp64):
    model, other, inputs = _gpt2(), _other_gpt2(), _batch()
    with local_world(2):
        mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("tp",))
        pm = autopar.parallelize(model, mesh, inputs, plan="megatron")
        pm_other = autopar.parallelize(copy.deepcopy(other), mesh, inputs, plan="megatron")
        mixed = pm_other.state_dict()
        full = other.state_dict()
        for k in list(mixed)[::2]:
            mixed[k] = full[k]
        assert {type(v).__name__ for v in mixed.values()} == {"DTensor", "Tensor"}
        pm.load_state_dict(mixed)
        _assert_holds(pm, other)


def full_state_dict_on_processes():
    """On real ranks: `pm.load_state_dict` and `set_model_state_dict(full_state_dict=True)` of a single-device
    model's state dict, for a fused-QKV GPT under megatron (`_StridedShard`) and a ModuleList MoE under expert
    parallelism (owned experts). Returns the largest difference to the source weights, per case."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict
    from test_moe import make_modulelist_top2, token_inputs

    torch.set_default_dtype(torch.float64)
    try:
        errs = {}
        gpt = lambda: GPT(GPTConfig(vocab_size=64, seq_len=8, num_layers=2, num_heads=4, hidden=32))  # noqa: E731
        cases = (("gpt-megatron", gpt, gpt, _batch(), ("tp",), "megatron", None),
                 ("moe-ep", make_modulelist_top2, make_modulelist_top2, token_inputs(), ("ep",), "dp",
                  {"moe": "expert@ep"}))
        for label, make, make_other, inputs, names, plan, overrides in cases:
            mesh = init_device_mesh("cpu", (2,), mesh_dim_names=names)
            torch.manual_seed(0)
            pm = autopar.parallelize(make(), mesh, inputs, plan=plan, overrides=overrides)
            for seed, how in ((5, "load_state_dict"), (6, "set_model_state_dict")):
                torch.manual_seed(seed)
                other = make_other()
                if how == "load_state_dict":
                    pm.load_state_dict(other.state_dict())
                else:
                    set_model_state_dict(pm, other.state_dict(), options=StateDictOptions(full_state_dict=True))
                want = dict(other.named_parameters(remove_duplicate=False))
                err = 0.0
                for n, p in pm.named_parameters(remove_duplicate=False):
                    if p.device_mesh.get_coordinate() is None:
                        assert p.to_local().numel() == 0  # an expert owned by the other rank
                        continue
                    err = max(err, float((p.full_tensor() - want[n].detach()).abs().max()))
                errs[f"{label} {how}"] = err
        return errs
    finally:
        torch.set_default_dtype(torch.float32)


def test_full_state_dict_loads_on_processes_with_fused_qkv_and_owned_experts():
    from dist_harness import gloo_pool
    for errs in gloo_pool(2).run(full_state_dict_on_processes):
        assert len(errs) == 4 and all(v == 0.0 for v in errs.values()), errs


def test_load_state_dict_of_wrong_shape_is_reported_by_torch(local_world):
    model, inputs = _gpt2(), _batch()
    sd = model.state_dict()
    sd["h.0.fc.weight"] = torch.zeros(3, 3)
    with local_world(2):
        mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("tp",))
        pm = autopar.parallelize(copy.deepcopy(model), mesh, inputs, plan="megatron")
        with pytest.raises(RuntimeError, match=r"size mismatch for h\.0\.fc\.weight: copying a param with shape "
                                               r"torch\.Size\(\[3, 3\]\)"):
            pm.load_state_dict(sd)


def dcp_load_into_another_shape(path: str):
    """Save a megatron GPT with torch.distributed.checkpoint, then `autopar.load` it into a GPT of another hidden size
    (fsdp); returns what each rank raised."""
    import torch.distributed.checkpoint as dcp
    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("tp",))
    make = lambda hidden: GPT(GPTConfig(vocab_size=64, seq_len=8, num_layers=1, num_heads=2, hidden=hidden))  # noqa
    torch.manual_seed(0)  # the same model and batch on every rank
    inputs = (torch.randint(0, 64, (4, 8)), torch.randint(0, 64, (4, 8)))
    dcp.save(autopar.parallelize(make(16), mesh, inputs, plan="megatron").state_dict(), checkpoint_id=path)
    pm = autopar.parallelize(make(32), mesh, inputs, plan="fsdp")
    try:
        autopar.load(pm, path)
    except Exception as e:  # noqa: BLE001 - compared by the test
        return type(e).__name__, str(e)
    return "ok", ""


def test_dcp_checkpoint_of_another_shape_names_the_parameter_and_both_shapes(tmp_path):
    from dist_harness import gloo_pool
    results = gloo_pool(2).run(dcp_load_into_another_shape, str(tmp_path / "ckpt"))
    assert len(set(results)) == 1, results  # every rank raises the same
    kind, message = results[0]
    assert kind == "ValueError", results
    assert re.search(r"autopar\.load: the torch\.distributed\.checkpoint in '.*ckpt' holds wte\.weight with shape "
                     r"\(64, 16\), but this model's wte\.weight has shape \(64, 32\) \(and \d+ more parameters "
                     r"differ: .*\): it was saved from a model of another shape.*Fix: build the model with the config",
                     message), message


def test_optimizer_built_on_the_original_model_is_refused_at_its_first_step(local_world):
    model, inputs = _gpt2(), _batch()
    with local_world(2):
        mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("tp",))
        pm = autopar.parallelize(model, mesh, inputs, plan="megatron")
        wrong = torch.optim.AdamW(model.parameters(), lr=0.1)
        pm(*inputs).backward()
        before = {n: p.detach().clone() for n, p in model.named_parameters()}
        with pytest.raises(RuntimeError, match=re.escape(
                "AdamW.step() was called on parameters of the GPT that autopar.parallelize replaced (") +
                r".*never get a gradient, so this step would change nothing\. Fix: build the optimizer on the "
                r"ParallelModule, e.g\. torch\.optim\.AdamW\(pm\.parameters\(\), \.\.\.\)"):
            wrong.step()
        assert all(torch.equal(before[n], p) for n, p in model.named_parameters())
        right = torch.optim.AdamW(pm.parameters(), lr=0.1)
        right.step()  # the ParallelModule's own parameters step
    # training the original model on its own (it has gradients) is left alone
    model(*inputs).backward()
    wrong.step()
    assert not all(torch.equal(before[n], p) for n, p in model.named_parameters())
