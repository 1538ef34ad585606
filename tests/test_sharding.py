"""Tensor parallelism really shards: parameters and matmul FLOPs per rank; plans print, round-trip, diff.

FLOPs are counted with `torch.utils.flop_counter.FlopCounterMode` entered *inside* `LocalTensorMode`:
each op on a LocalTensor is seen once with the per-rank (local) shapes, so the count is one rank's
work. It counts the matmuls (`mm`, `addmm`, `bmm`; the CPU SDPA math path is not counted on either
side). With every linear sharded over t ranks, each rank does exactly 1/t of the model's matmul FLOPs,
forward and backward.
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.utils.flop_counter import FlopCounterMode

import autopar
from autopar.models import GPT, GPTConfig, Llama, LlamaConfig
from autopar.plan import Plan

T = 4
FORCE_TP = {"attention": "heads", "mlp": "tp", "embedding": "vocab", "loss": "vocab"}


def _tokens(b=4, s=16, vocab=128):
    g = torch.Generator().manual_seed(0)
    return torch.randint(0, vocab, (b, s), generator=g), torch.randint(0, vocab, (b, s), generator=g)


def _hf_gpt2():
    from transformers import GPT2Config, GPT2LMHeadModel

    return GPT2LMHeadModel(GPT2Config(vocab_size=128, n_positions=16, n_embd=32, n_layer=2, n_head=4,
                                      use_cache=False, resid_pdrop=0, embd_pdrop=0, attn_pdrop=0)).eval()


def _hf_llama():
    from transformers import LlamaConfig as HFLlamaConfig
    from transformers import LlamaForCausalLM

    return LlamaForCausalLM(HFLlamaConfig(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                          num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=16,
                                          use_cache=False)).eval()


# KV heads == 4 so that every projection can shard over 4 ranks (fewer KV heads stay replicated by design)
MODELS = {
    "gpt": (lambda: GPT(GPTConfig()), False),
    "llama": (lambda: Llama(LlamaConfig(num_heads=4, num_kv_heads=4)), False),
    "hf_gpt2": (_hf_gpt2, True),
    "hf_llama": (_hf_llama, True),
}


def build(name):
    make, hf = MODELS[name]
    old = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    try:
        torch.manual_seed(0)
        model = make()
    finally:
        torch.set_default_dtype(old)
    ids, labels = _tokens()
    inputs = {"input_ids": ids, "labels": labels} if hf else (ids, labels)
    return model, inputs


def call(m, inputs):
    out = m(**inputs) if isinstance(inputs, dict) else m(*inputs)
    return out if isinstance(out, torch.Tensor) else out["loss"]


def weights_to_shard(model: nn.Module) -> dict[str, torch.Tensor]:
    """Every linear-like (nn.Linear, HF Conv1D) and embedding weight, tied ones once."""
    out = {}
    seen = set()
    for mod_name, mod in model.named_modules():
        if isinstance(mod, (nn.Linear, nn.Embedding)) or type(mod).__name__ == "Conv1D":
            w = mod.weight
            if id(w) not in seen:
                seen.add(id(w))
                out[f"{mod_name}.weight"] = w
    return out


def matmul_flops(counter: FlopCounterMode) -> int:
    counts = counter.get_flop_counts()["Global"]
    return sum(v for k, v in counts.items() if str(k).split(".")[-1] in ("mm", "addmm", "bmm", "baddbmm"))


@pytest.mark.parametrize("name", list(MODELS))
def test_forced_tp4_shards_every_weight_and_quarters_matmul_flops(local_world, name):
    model, inputs = build(name)
    ref = copy.deepcopy(model)
    targets = weights_to_shard(ref)
    assert len(targets) >= 6
    with FlopCounterMode(display=False) as ref_counter:
        call(ref, inputs).backward()
    ref_flops = matmul_flops(ref_counter)
    assert ref_flops > 0

    with local_world(T):
        mesh = init_device_mesh("cpu", (T,), mesh_dim_names=("tp",))
        pm = autopar.parallelize(model, mesh, inputs, overrides=FORCE_TP)
        params = dict(pm.named_parameters(remove_duplicate=False))
        unsharded = {}
        for n, full in targets.items():
            local = params[n].to_local()
            per_rank = {r: t.numel() for r, t in local._local_tensors.items()} if hasattr(local, "_local_tensors") \
                else {0: local.numel()}
            if sorted(per_rank) != list(range(T)) or any(v * T != full.numel() for v in per_rank.values()):
                unsharded[n] = (tuple(full.shape), per_rank, str(params[n].placements))
        assert not unsharded, f"weights not sharded 1/{T} per rank on every rank: {unsharded}\n{pm.plan}"
        with FlopCounterMode(display=False) as counter:
            call(pm, inputs).backward()
    flops = matmul_flops(counter)
    # exactly 1/T of every matmul, up to matmuls on replicated data (none expected): allow 1%
    assert flops * T == pytest.approx(ref_flops, rel=0.01), (flops, ref_flops, counter.get_flop_counts()["Global"])


@pytest.fixture
def gpt_plans(local_world):
    model, inputs = build("gpt")
    with local_world(4):
        mesh = init_device_mesh("cpu", (4,), mesh_dim_names=("tp",))
        auto = autopar.parallelize(copy.deepcopy(model), mesh, inputs, plan="megatron")
        dp = autopar.parallelize(copy.deepcopy(model), mesh, inputs, plan="dp")
    return model, inputs, auto.plan, dp.plan


def test_plan_printing_lists_every_structure(gpt_plans):
    model, _, auto, dp = gpt_plans
    for plan in (auto, dp):
        # print(plan) folds the two identical layers into one row each (`autopar.layer_rows`); full=True: every row
        assert "h.{0,1}.attn  ×2" in str(plan) and "h.1.attn" not in str(plan)
        text = plan.table(full=True)
        lines = text.splitlines()
        assert lines[0].startswith(f"Plan {plan.name!r} on mesh (tp=4)"), lines[0]
        keys = [s.key for s in plan.strategies]
        # every recognised structure of the model
        for k in ["wte", "wpe", "loss"] + [f"h.{i}.attn" for i in range(2)]:
            assert k in keys, (k, keys)
        for s in plan.strategies:
            row = [ln for ln in lines if ln.split() and ln.split()[0] == s.key]
            assert len(row) == 1, f"strategy {s.key!r} has {len(row)} rows in\n{text}"
            assert s.kind in row[0] and s.form in row[0], row[0]
            for fqn, pls in s.params:
                assert f"={pls}" in row[0], (fqn, pls, row[0])
        if plan.comms:
            assert f"total: {len(plan.comms)} collective nodes" in text
        for note in plan.notes:
            assert f"note: {note}" in text
    # every parameter of the model has a placement in the plan
    assert set(dict(auto.params)) == {n for n, _ in model.named_parameters(remove_duplicate=False)}


def test_plan_json_round_trip(gpt_plans, tmp_path, local_world):
    model, inputs, auto, dp = gpt_plans
    for plan in (auto, dp):
        again = Plan.from_json(plan.to_json())
        assert again == plan
        assert again.to_json() == plan.to_json()
        path = tmp_path / f"{plan.name}.json"
        plan.save(str(path))
        assert Plan.load(str(path)) == plan
    # a saved plan drives parallelize to the same program
    with local_world(4):
        mesh = init_device_mesh("cpu", (4,), mesh_dim_names=("tp",))
        pm = autopar.parallelize(copy.deepcopy(model), mesh, inputs, plan=str(tmp_path / f"{auto.name}.json"))
    assert pm.plan.params == auto.params and pm.plan.inputs == auto.inputs
    assert pm.plan.comms == auto.comms


def test_plan_diff_auto_vs_dp(gpt_plans):
    _, _, auto, dp = gpt_plans
    assert auto.diff(auto) == "(plans are identical)"
    lines = set(auto.diff(dp).splitlines())
    for s in auto.strategies:
        if s.form != "replicate":
            assert f"{s.key}: {s.label} -> replicate" in lines, (s.key, lines)
    a, d = dict(auto.params), dict(dp.params)
    for fqn in a:
        if a[fqn] != d[fqn]:
            assert f"param {fqn}: {a[fqn]} -> {d[fqn]}" in lines, fqn
    assert any(a[f] != d[f] for f in a)
    for name in ("tokens", "labels"):
        assert f"input {name}: R -> S(0)" in lines
    # nothing unchanged is reported
    unchanged = [f"param {f}:" for f in a if a[f] == d[f]] + \
        [f"{s.key}: " for s in auto.strategies if s.form == "replicate"]
    assert not [ln for ln in lines for u in unchanged if ln.startswith(u)], sorted(lines)
    back = set(dp.diff(auto).splitlines())
    assert len(back) == len(lines)
    assert f"param wte.weight: R -> {a['wte.weight']}" in back
