"""Attention on two axes: `heads@tp+ring@cp` and `heads@tp+ulysses@sp` (`autopar/forms/heads_ring.py`,
`heads_ulysses.py`, composed from `heads` and `ring` / `ulysses`).

On a 2x2 mesh under LocalTensorMode, fp64: loss, every gradient and the parameters after two SGD steps match one
device for autopar's GPT (MHA) and Llama (SDPA with grouped KV heads, one KV head: each heads rank picks it before
the ring) and Hugging Face Llama (explicit causal mask, K/V expanded by repeat_kv), with the mesh axes in either
order, and inside a Megatron plan with sequence-parallel norms (TP + SP + CP). Collectives, exactly: on the heads
axis one all-reduce forward (the row-parallel output) and one backward (the column-parallel input gradient) per
layer, each `b·(s/p)·h`; on the sequence axis the ring's p-1 K/V steps forward and 2(p-1) backward of the
heads/t KV heads (`ring.layer_volume_bytes` with h_kv/t), or Ulysses' 4 all-to-alls forward and 4 backward of
`b·(s/u)·h/t` (`ulysses.layer_volume_bytes` with h/t). Sequence-parallel norms on tp nest their split inside the
sequence axis's, whichever axis comes first in the mesh. The override parser refuses an unknown combination and a
repeated axis; preconditions combine with reasons that name the axis. A saved plan lowers on its own. The
estimate prices the bytes a step sends. The solver offers the combined forms on a 2-D mesh and chooses heads+ring
for a long sequence under a memory limit no single-axis form meets.
"""

from __future__ import annotations

from collections import Counter, namedtuple

import pytest
import torch

import autopar
import zoo
from autopar.api import _prepare
from autopar.forms import ring, ulysses
from autopar.models import GPT, GPTConfig, Llama, LlamaConfig
from autopar.solver import candidates, gather_stats
from autopar.spec import Shard, placements_from_str
from equivalence import run_equivalence

B, S, P = 4, 16, 2


Comm = namedtuple("Comm", "kind axis pass_ numel send_bytes")  # a row of `Result.comms`


def _records(res) -> list[Comm]:
    return [Comm(*c) for c in res.comms]


def _tokens():
    g = torch.Generator().manual_seed(1)
    return torch.randint(0, 128, (B, S), generator=g), torch.randint(0, 128, (B, S), generator=g)


def _fp64(make):
    torch.manual_seed(0)
    torch.set_default_dtype(torch.float64)
    try:
        return make()
    finally:
        torch.set_default_dtype(torch.float32)


MODELS = {  # name -> () -> (model, inputs, tolerance, hidden, KV width at the attention after any repeat_kv)
    "gpt": lambda: (_fp64(lambda: GPT(GPTConfig())), _tokens(), 1e-10, 32, 32),
    "llama-mqa": lambda: (_fp64(lambda: Llama(LlamaConfig(num_heads=4, num_kv_heads=1, attention="sdpa"))),
                          _tokens(), 1e-10, 32, 8),
    "llama-mha": lambda: (_fp64(lambda: Llama(LlamaConfig(num_heads=4, num_kv_heads=4, attention="sdpa"))),
                          _tokens(), 1e-10, 32, 32),
    "hf-llama": lambda: zoo.FAMILIES["llama"]() + (zoo.H, zoo.NH * zoo.H // zoo.NH),
}


def _run(local_world, name, names, form, plan="dp", extra=None, steps=2):
    model, inputs, tol, hidden, kv_width = MODELS[name]()
    seq = names[1] if names[0] == "tp" else names[0]
    with local_world(4):
        res = run_equivalence(model, inputs, (2, 2), names, plan=plan, steps=steps,
                              overrides={"attention": f"heads@tp+{form}@{seq}", **(extra or {})})
    assert set(res.grad_err) == {n for n, _ in model.named_parameters()}
    assert res.max_err() < tol, (res.max_err(), {k: v for k, v in res.grad_err.items() if v > tol})
    att = [s for s in res.plan.strategies if s.kind == "attention"]
    assert att and all(s.form == f"heads+{form}" and s.axes == ("tp", seq) for s in att), att
    assert all("S(1)" in p for _, p in res.plan.inputs), res.plan.inputs  # tokens split on the sequence axis
    return res, len(att), hidden, kv_width


def _heads_all_reduces(res, layers, hidden):
    """One all-reduce forward and one backward per layer on tp, each b*(s/p)*h, and nothing else of the
    attention's on tp (dp plan: the rest of the model is replicated on tp)."""
    tp = [(r.kind, r.pass_, r.numel) for r in _records(res) if r.axis == "tp"]
    assert Counter(tp) == {("all_reduce", "forward", B * S // P * hidden): layers,
                           ("all_reduce", "backward", B * S // P * hidden): layers}, Counter(tp)


# the K/V width each tp rank circulates: its KV heads x head dim (GPT: 2 of 4 heads; Llama MQA: its one KV head,
# picked on every rank; HF Llama: 1 of the 2 grouped KV heads, taken before repeat_kv)
RING_KV_WIDTH = {"gpt": 16, "llama-mqa": 8, "hf-llama": 8}


# The axis order is a mesh-level path, the model a graph-level one: both orders for one model, one order (each) for
# the others, rather than every model in both orders (the same code paths, two runs fewer).
@pytest.mark.parametrize("name,names", [("gpt", ("tp", "cp")), ("gpt", ("cp", "tp")), ("llama-mqa", ("tp", "cp")),
                                        ("hf-llama", ("cp", "tp"))])
def test_heads_ring_matches_one_device(local_world, name, names):
    res, layers, hidden, kv_width = _run(local_world, name, names, "ring")
    p2p = [r for r in _records(res) if r.kind == "p2p"]
    assert {r.axis for r in p2p} == {"cp"}
    assert sum(r.pass_ == "forward" for r in p2p) == (P - 1) * layers
    assert sum(r.pass_ == "backward" for r in p2p) == 2 * (P - 1) * layers
    assert sum(r.send_bytes for r in p2p) == layers * ring.layer_volume_bytes(B, S, RING_KV_WIDTH[name], P, 8)
    if name == "llama-mqa":  # its one KV head is replicated over tp (each rank picks it): K/V gradients summed on tp
        tp = Counter((r.kind, r.pass_, r.numel) for r in _records(res) if r.axis == "tp")
        assert tp == {("all_reduce", "forward", B * S // P * hidden): layers,
                      ("all_reduce", "backward", B * S // P * hidden): layers,
                      ("all_reduce", "backward", B * S // P * kv_width): 2 * layers}, tp
    else:
        _heads_all_reduces(res, layers, hidden)


# (both axis orders for one model, one order each for the others: see test_heads_ring_matches_one_device)
@pytest.mark.parametrize("name,names", [("gpt", ("tp", "sp")), ("gpt", ("sp", "tp")), ("llama-mha", ("sp", "tp")),
                                        ("hf-llama", ("tp", "sp"))])
def test_heads_ulysses_matches_one_device(local_world, name, names):
    res, layers, hidden, kv_width = _run(local_world, name, names, "ulysses")
    a2a = [r for r in _records(res) if r.kind == "all_to_all"]
    assert {r.axis for r in a2a} == {"sp"}
    per = B * S // P * hidden // P  # (b, s/u, h/t) on each rank; K/V as wide (MHA, or expanded by repeat_kv)
    assert Counter((r.pass_, r.numel) for r in a2a) == {("forward", per): 4 * layers, ("backward", per): 4 * layers}
    assert sum(r.send_bytes for r in a2a) == layers * ulysses.layer_volume_bytes(B, S, hidden // P, kv_width // P,
                                                                                  P, 8)
    _heads_all_reduces(res, layers, hidden)


SP = {"mlp": "tp@tp", "norm": "sequence@tp"}


@pytest.mark.parametrize("names", [("cp", "tp"), ("tp", "cp")])
@pytest.mark.parametrize("name", ["llama-mqa", "hf-llama"])
def test_heads_ring_with_sequence_parallel_norms(local_world, name, names):
    """TP + SP + CP: MLPs tensor parallel and norms sequence parallel on tp, attention heads on tp and ring on cp.
    The norms split each rank's zigzag shard of the tokens further over tp, whichever axis comes first in the mesh:
    Llama's replicated one-KV-head projection takes that split input, so its RoPE cos/sin are split the same way."""
    res, layers, _, _ = _run(local_world, name, names, "ring", extra=SP, steps=1)
    forms = Counter((s.kind, s.form, s.axes) for s in res.plan.strategies if s.kind in ("mlp", "norm"))
    assert forms[("mlp", "tp", ("tp",))] == layers and forms[("norm", "sequence", ("tp",))] == 2 * layers + 1, forms
    assert res.comm_counts["p2p.forward"] == layers and res.comm_counts["p2p.backward"] == 2 * layers
    assert not any(r.kind == "all_reduce" and r.axis == "tp" and r.numel == B * S // P * 32 for r in _records(res))


@pytest.mark.parametrize("form", ["ulysses", "ring"])
def test_a_sequence_axis_after_the_norms_model_axis(local_world, form):
    """Mesh (tp, sp): Llama's RoPE runs on tokens split over sp (the inputs) and then over tp (sequence-parallel
    norms), so a replicated value meeting them is split sp first, whatever the mesh order."""
    model, inputs, tol, _, _ = MODELS["llama-mqa"]()
    with local_world(4):
        res = run_equivalence(model, inputs, (2, 2), ("tp", "sp"), plan="dp", steps=1,
                              overrides={"attention": f"{form}@sp", **SP})
    assert res.max_err() < tol, res.max_err()


def _plan(model, inputs, mesh, overrides, **kw):
    return autopar.plan(model, mesh, inputs, plan="dp", overrides=overrides, cluster="h100", **kw)


def test_override_errors_and_combined_preconditions():
    gpt = GPT(GPTConfig())
    x = _tokens()
    mesh = {"tp": 2, "cp": 2}
    with pytest.raises(ValueError, match=r"unknown form 'ring\+heads'; valid forms for attention: .*heads\+ring.*"
                                         r"heads\+ulysses"):
        _plan(gpt, x, mesh, {"attention": "ring@cp+heads@tp"})
    with pytest.raises(ValueError, match=r"unknown form 'heads\+vocab'"):
        _plan(gpt, x, mesh, {"attention": "heads@tp+vocab@cp"})
    with pytest.raises(ValueError, match=r"names mesh axis 'tp' twice; a combined form takes distinct axes"):
        _plan(gpt, x, mesh, {"attention": "heads@tp+ring@tp"})
    with pytest.raises(ValueError, match=r"names mesh axis 'cp' twice"):
        _plan(gpt, x, mesh, {"attention": "heads+ring"})  # both parts default to the last axis
    with pytest.raises(ValueError, match=r"'heads\+ring' on mesh axis 'tp' \(size 2\), 'cp' \(size 2\) is not possible: "
                                         r"on its heads axis \(size 2\): 3 heads do not divide over 2 ranks"):
        _plan(GPT(GPTConfig(num_heads=3, hidden=24)), x, mesh, {"attention": "heads@tp+ring@cp"})
    g = torch.Generator().manual_seed(0)
    x14 = (torch.randint(0, 128, (2, 14), generator=g),) * 2
    with pytest.raises(ValueError, match=r"on its sequence axis \(size 2\): sequence 14 does not split into 2x2 "
                                         r"zigzag chunks\. Fix: pad the sequence"):
        _plan(GPT(GPTConfig(seq_len=14)), x14, mesh, {"attention": "heads@tp+ring@cp"})
    with pytest.raises(ValueError, match=r"on its sequence axis \(size 2\): for the 1 heads of each rank of the heads "
                                         r"axis: 1 heads do not divide over 2 ranks"):
        _plan(GPT(GPTConfig(num_heads=2, hidden=32)), x, mesh, {"attention": "heads@tp+ulysses@cp"})
    mqa = Llama(LlamaConfig(num_heads=4, num_kv_heads=1, attention="sdpa"))
    with pytest.raises(ValueError, match=r"the attention takes 1 KV heads, which do not divide over the 2x2 ranks of "
                                         r"its two axes"):
        _plan(mqa, x, mesh, {"attention": "heads@tp+ulysses@cp"})


def _meta_llama(seq, batch):
    cfg = LlamaConfig(vocab_size=32000, seq_len=seq, num_layers=2, num_heads=32, num_kv_heads=4, hidden=4096,
                      ffn_hidden=14336, attention="sdpa")
    with torch.device("meta"):
        model = Llama(cfg).to(torch.bfloat16)
        ids = torch.zeros(batch, seq, dtype=torch.long)
    return model, (ids, ids)


def test_solver_offers_two_axis_attention_and_chooses_it_for_a_long_sequence():
    mesh = {"tp": 4, "cp": 4}
    model, inputs = _meta_llama(131072, 1)
    info, _, ctx = _prepare(model, mesh, inputs)
    stats = gather_stats(ctx)[0]
    site = ctx.of_kind("attention")[0]
    offered = {c.label for c in candidates(site, stats[site.key], info, (), None, ("cp",))}
    # one axis the sequence role, the other a model axis: ring and Ulysses alone, or within heads; heads+ulysses
    # needs the 4 KV heads to divide over 4x4 ranks
    assert {"ring@cp", "ulysses@cp", "heads@tp+ring@cp"} <= offered and not any("heads+ulysses" in c or
                                                                                  "heads@tp+ulysses" in c
                                                                                  for c in offered), offered
    limit = 13 * 2**30  # heads+ring needs 12.4 GiB (saved-tensor peak, bf16 states), ring alone on either axis 13.8-14.4
    auto = autopar.plan(model, mesh, inputs, cluster="h100", memory_limit=limit)
    att = {(s.form, s.axes) for s in auto.strategies if s.kind == "attention"}
    assert len(att) == 1 and next(iter(att))[0] == "heads+ring", att
    ((_, (model_axis, seq_axis)),) = att
    mlps = {(s.form, s.axes) for s in auto.strategies if s.kind == "mlp"}
    assert mlps == {("tp", (model_axis,))}, mlps  # the MLPs tensor parallel on the attention's heads axis
    ax = list(mesh).index(seq_axis)  # the token inputs split on the sequence axis
    assert auto.estimate.fits and all(placements_from_str(p)[ax] == Shard(1) for _, p in auto.inputs), auto.inputs
    for single in ("ring@cp", "ulysses@cp", "ring@tp", "heads@tp", "heads@cp"):
        alone = autopar.plan(model, mesh, inputs, cluster="h100", overrides={"attention": single})
        assert alone.estimate.memory_bytes_per_device > limit, (single, alone.estimate.summary())
        assert alone.estimate.step_time_s > auto.estimate.step_time_s, (single, alone.estimate.summary())
    short, short_inputs = _meta_llama(2048, 16)  # the same tokens in short rows: no sequence split pays
    plain = autopar.plan(short, mesh, short_inputs, cluster="h100", memory_limit=limit)
    assert not any("+" in s.form for s in plain.strategies if s.kind == "attention"), plain


def test_a_saved_two_axis_plan_lowers_on_its_own(local_world, tmp_path):
    """The plan's directives (heads placements on tp; ring, zigzag and causal-mask directives on cp) are all
    lowering needs: a saved and loaded HF Llama plan gives the same program."""
    import copy

    from autopar.plan import DirectiveKind, Plan
    from torch.distributed.device_mesh import init_device_mesh
    model, inputs, _, _, _ = MODELS["hf-llama"]()
    with local_world(4):
        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("tp", "cp"))
        pm = autopar.parallelize(copy.deepcopy(model), mesh, inputs, plan="dp",
                                 overrides={"attention": "heads@tp+ring@cp"})
        path = tmp_path / "plan.json"
        pm.plan.save(str(path))
        loaded = Plan.load(str(path))
        assert {d.kind for d in loaded.directives} >= {DirectiveKind.ATTENTION, DirectiveKind.ZIGZAG,
                                                       DirectiveKind.CAUSAL_MASK}
        again = autopar.parallelize(copy.deepcopy(model), mesh, inputs, plan=str(path))
    assert again.plan.comms == pm.plan.comms and again.plan.params == pm.plan.params
    assert str(again.graph_module.code) == str(pm.graph_module.code)
    assert [s.label for s in loaded.strategies if s.kind == "attention"] == ["heads@tp+ring@cp"] * 2


@pytest.mark.parametrize("form", ["ring", "ulysses"])
def test_the_estimate_prices_the_bytes_the_step_sends(local_world, form):
    """The combined forms' cost (the heads block's all-reduces on tp, the sequence form's collectives for the
    heads of one rank on cp) gives the bytes one training step sends, up to the output projection's bias, which
    stays whole on tp while the estimate's gradient bucket counts 1/t of it (as `test_estimate` notes for tp)."""
    from test_estimate import COUNTING, _gpt
    from torch.distributed.device_mesh import init_device_mesh

    from autopar.runtime.collectives import record_comms
    model, inputs = _gpt()
    with local_world(4):
        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("tp", "cp"))
        pm = autopar.parallelize(model, mesh, inputs, plan="dp", cluster=COUNTING,
                                 overrides={"attention": f"heads@tp+{form}@cp"})
        with record_comms() as recs:
            pm(*inputs).backward()
    assert {r.kind for r in recs if r.axis == "tp"} == {"all_reduce"}
    bias = GPTConfig().hidden * 4 * GPTConfig().num_layers  # fp32, one per layer
    assert pm.plan.estimate.comm_bytes_per_step == pytest.approx(sum(r.send_bytes for r in recs), abs=bias)


@pytest.mark.parametrize("names", [("tp", "cp"), ("cp", "tp")])
def test_megatron_puts_its_model_axis_where_no_override_takes_the_sequence(local_world, names):
    """megatron's tensor parallelism goes on the last axis that no override uses as a sequence axis: with the
    attention forced heads@tp+ring@cp, the MLPs, embedding and loss take tp whichever order the mesh has."""
    res, layers, _, _ = _run(local_world, "gpt", names, "ring", plan="megatron")
    forms = {s.kind: s.axes for s in res.plan.strategies if s.kind in ("mlp", "embedding", "loss")}
    assert forms and all(axes == ("tp",) for axes in forms.values()), res.plan
