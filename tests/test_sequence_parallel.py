"""Megatron sequence parallelism (norm: sequence) and DeepSpeed-Ulysses (attention: ulysses):
fp64 equivalence with one device (loss, every gradient, parameters after two steps) and the exact
collectives of each form; sequences that do not divide are not offered, and forcing them says why."""

from __future__ import annotations

import pytest
import torch
from transformers import LlamaConfig as HFLlamaConfig, LlamaForCausalLM

import autopar
from autopar.models import GPT, GPTConfig, Llama, LlamaConfig
from equivalence import run_equivalence

B, S = 4, 16


def _tokens(seed=1):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 128, (B, S), generator=g), torch.randint(0, 128, (B, S), generator=g)


MODELS = {
    "gpt": (lambda: GPT(GPTConfig()), lambda: _tokens(), 1e-10),
    "gpt-3heads": (lambda: GPT(GPTConfig(num_heads=3, hidden=24)), lambda: _tokens(), 1e-10),
    "llama-gqa": (lambda: Llama(LlamaConfig(num_heads=4, num_kv_heads=1)), lambda: _tokens(), 1e-10),
    "hf-llama": (lambda: LlamaForCausalLM(HFLlamaConfig(
        vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=16, use_cache=False)),
        lambda: dict(zip(("input_ids", "labels"), _tokens())), 1e-5),
    "llama-sdpa-mqa": (lambda: Llama(LlamaConfig(num_heads=4, num_kv_heads=1, attention="sdpa")),
                       lambda: _tokens(), 1e-10),
    "llama-sdpa-bidirectional": (lambda: Llama(LlamaConfig(num_heads=4, num_kv_heads=2, attention="sdpa",
                                                           causal=False)), lambda: _tokens(), 1e-10),
}
LAYERS = 2  # every model above
# the collective each sequence form of attention runs (forward and backward, once per layer at least)
SEQUENCE_COMM = {"ulysses": "all_to_all", "ring": "p2p"}


def _attention_forms(plan) -> list[str]:
    """The form of every attention of the plan; one per layer (so that `all(...)` over it cannot hold vacuously)."""
    forms = [s.form for s in plan.strategies if s.kind == "attention"]
    assert len(forms) == LAYERS, plan.strategies
    return forms


def _ran_sequence_collectives(res, form: str) -> None:
    """The form's collective ran forward and backward in every layer (the plan was lowered as it says)."""
    kind = SEQUENCE_COMM[form]
    c = res.comm_counts
    assert c.get(f"{kind}.forward", 0) >= LAYERS and c.get(f"{kind}.backward", 0) >= LAYERS, c


def _run(local_world, name, shape, names, plan, overrides, steps=2):
    make, inputs, tol = MODELS[name]
    torch.manual_seed(0)
    torch.set_default_dtype(torch.float64)
    try:
        ref, x = make(), inputs()
    finally:
        torch.set_default_dtype(torch.float32)
    world = 1
    for s in shape:
        world *= s
    with local_world(world):
        res = run_equivalence(ref, x, shape, names, plan=plan, overrides=overrides, steps=steps)
    assert set(res.grad_err) == set(res.param_err) == {n for n, p in ref.named_parameters()}
    assert res.max_err() < tol, (res.max_err(), {k: v for k, v in res.grad_err.items() if v > tol})
    return res


@pytest.mark.parametrize("name", ["gpt", "llama-gqa", "hf-llama"])
# A 1-D axis of 2 adds nothing over these: ((4,), ...) takes the 1-D mesh path, ((2, 2), ...) an axis of 2 (and
# test_megatron_sp_on_gloo runs hf-llama on tp=2 processes).
@pytest.mark.parametrize("shape,names", [((4,), ("tp",)), ((2, 2), ("dp", "tp"))])
def test_megatron_sp_matches_one_device(local_world, name, shape, names):
    res = _run(local_world, name, shape, names, "megatron", {"norm": "sequence"})
    norms = [s for s in res.plan.strategies if s.kind == "norm"]
    assert len(norms) == 2 * LAYERS + 1 and all(s.form == "sequence" and s.axis == "tp" for s in norms), norms
    # and the lowering ran it: the stream is gathered into each tensor-parallel block and scattered out of it
    c = res.comm_counts
    assert c.get("all_gather.forward", 0) > 2 * LAYERS and c.get("reduce_scatter.forward", 0) > 2 * LAYERS, c


def test_megatron_sp_collectives_per_layer(local_world):
    """Each TP block: all-gather in / reduce-scatter out forward, the reverse backward (no all-reduce of
    activations); the vocab-parallel loss keeps its 3 all-reduces; norm weights and row biases get
    their gradients summed over the axis."""
    res = _run(local_world, "gpt", (4,), ("tp",), "megatron", {"norm": "sequence"}, steps=1)
    layers, cfg = 2, GPTConfig()
    t = 4
    blocks = 2 * layers
    norms = 2 * layers + 1
    c = res.comm_counts
    # inputs of blocks and of the LM head are gathered; block outputs and the embedding are scattered; backward,
    # the reverse, and each gathered input is gathered again for its linears' weight gradients (Megatron: the
    # linears keep the shard, not the gathered copy)
    assert c["all_gather.forward"] == blocks + 1 and c["reduce_scatter.forward"] == blocks + 1, c
    assert c["reduce_scatter.backward"] == blocks + 1 and c["all_gather.backward"] == 2 * (blocks + 1), c
    assert res.plan.comm_counts() == {k: n for k, n in c.items() if k != "all_reduce.forward"}  # (loss: inside its op)
    assert c["all_reduce.forward"] == 3, c  # max, target logit, sum-exp of the vocab-parallel loss
    # gradients of parameters inside the sequence-parallel region (norms' w, b and row-parallel biases),
    # summed over the axis in one bucket
    assert c["all_reduce.backward"] == 1, c
    bucket = [r for r in res.plan.comms if r.fn == "grad_sync_bucket"]
    assert len(bucket) == 1 and bucket[0].axis == "tp"
    assert bucket[0].bytes_backward == pytest.approx(2 * (t - 1) / t * (2 * norms + blocks) * cfg.hidden * 8, abs=32)
    # bytes: one all-gather of the (b, s, h) stream moves (t-1)/t of it from each rank
    elems = B * S * cfg.hidden
    # the gather into each column-parallel block is fused with its linears (`regather_linears`): forward the
    # all-gather; backward the reduce-scatter of the input gradient and the all-gather again, each (t-1)/t of it
    again = [r for r in res.plan.comms if r.fn == "regather_linears"]
    assert sorted(r.module for r in again) == sorted([f"h.{i}.{m}" for i in range(layers) for m in ("attn.qkv", "fc")]
                                                     + ["lm_head"])
    assert all((r.forward, r.backward, r.bytes_forward, r.bytes_backward) ==
               ("all_gather", "reduce_scatter+all_gather", (t - 1) * elems // t * 8, 2 * (t - 1) * elems // t * 8)
               for r in again)
    recorded = sum(b for kind, _, pass_, _, b in res.comms if (kind, pass_) == ("all_gather", "backward"))
    assert recorded == sum(r.bytes_backward // 2 for r in again) + sum(
        r.bytes_backward for r in res.plan.comms if r.backward == "all_gather") \
        == 2 * (blocks + 1) * (t - 1) * elems // t * 8


def test_megatron_sp_keeps_column_inputs_sharded_for_backward(local_world):
    """What autograd saves at run time (saved_tensors_hooks, rank 0, parameters excluded): under SP no whole
    (b, s, h) stream is kept (the column-parallel linears keep its shard and re-gather it backward), under TP
    alone the norms' inputs and outputs are; the bytes are those the memory model reads off the lowered graph."""
    from torch.distributed.device_mesh import init_device_mesh

    from cost_model.memory import activation_bytes

    def local(t):
        lt = getattr(t, "_local_tensors", None)
        return lt[0] if lt is not None else t

    t, h = 2, GPTConfig().hidden
    kept = {}
    for name, overrides in (("tp", None), ("sp", {"norm": "sequence"})):
        torch.manual_seed(0)
        model, x = GPT(GPTConfig()), _tokens()
        saved = {}

        def pack(v):
            v = local(v)
            saved[v.untyped_storage().data_ptr()] = v.untyped_storage().nbytes()
            return v

        with local_world(t):
            mesh = init_device_mesh("cpu", (t,), mesh_dim_names=("tp",))
            pm = autopar.parallelize(model, mesh, x, plan="megatron", overrides=overrides)
            params = {local(p.to_local()).untyped_storage().data_ptr() for p in pm.parameters()}
            with torch.autograd.graph.saved_tensors_hooks(pack, lambda v: v):
                pm(*x)
        acts = [n for ptr, n in saved.items() if ptr not in params]
        kept[name] = sum(1 for n in acts if n == B * S * h * 4)  # fp32 (b, s, h) storages (a view reads as its base)
        assert sum(acts) == pytest.approx(activation_bytes(pm.graph_module, (t,)), rel=0.02)
    assert kept == {"tp": 4 * LAYERS + 2, "sp": 0}, kept


@pytest.mark.parametrize("name", ["gpt", "gpt-3heads", "hf-llama"])
# (1-D axis of 2: covered by ((4,), ...) for the 1-D mesh and ((2, 2), ...) for u=2, including gpt-3heads' error)
@pytest.mark.parametrize("shape,names,axis", [((4,), ("sp",), "sp"), ((2, 2), ("dp", "sp"), "sp")])
def test_ulysses_matches_one_device(local_world, name, shape, names, axis):
    make, _, _ = MODELS[name]
    heads = 3 if name == "gpt-3heads" else 4
    u = shape[-1]
    if heads % u:
        with pytest.raises(ValueError, match=r"'ulysses'.*3 heads do not divide over"):
            _run(local_world, name, shape, names, "dp", {"attention": f"ulysses@{axis}"})
        return
    res = _run(local_world, name, shape, names, "dp", {"attention": f"ulysses@{axis}"})
    assert all(f == "ulysses" for f in _attention_forms(res.plan))
    # tokens are split on the sequence over the Ulysses axis (and on the batch over dp)
    want = "S(0)S(1)" if len(shape) == 2 else "S(1)"
    assert len(res.plan.inputs) == 2 and all(p == want for _, p in res.plan.inputs), res.plan.inputs
    c = res.comm_counts
    assert c.get("all_to_all.forward") == c.get("all_to_all.backward") == 4 * LAYERS, c


def test_ulysses_collectives_four_all_to_alls_each_way_per_layer(local_world):
    res = _run(local_world, "gpt", (4,), ("sp",), "dp", {"attention": "ulysses@sp"}, steps=1)
    layers = 2
    c = res.comm_counts
    assert c["all_to_all.forward"] == 4 * layers and c["all_to_all.backward"] == 4 * layers, c
    # volume: q, k, v (seq -> heads) and o (heads -> seq): local buffers b*(s/u)*h each
    u, h = 4, GPTConfig().hidden
    a2a = [r for r in res.plan.comms if r.fn == "all_to_all"]
    per = (u - 1) * (B * S * h // u) // u * 8
    assert len(a2a) == 4 * layers and all(r.bytes_forward == per == r.bytes_backward for r in a2a)
    total_fwd = sum(r.bytes_forward for r in a2a) / layers / 8
    assert total_fwd == pytest.approx((u - 1) / u**2 * B * S * (2 * h + 2 * h))  # DESIGN.md §3 with h_kv = h


@pytest.mark.parametrize("shape,names", [((2,), ("sp",)), ((2, 2), ("dp", "sp")), ((4,), ("sp",))])
def test_ulysses_sends_kv_heads_before_repeat_kv(local_world, shape, names):
    """Hugging Face Llama with 4 heads and 2 KV heads expands K/V by `repeat_kv` before SDPA. Where the KV heads
    divide over the axis (u=2) the all-to-all sends the 2 KV heads and each rank repeats its own: the plan's and
    the run's bytes are DESIGN.md's `(u-1)/u^2 * b*s*(2h + 2h_kv)` per layer each way, half of q's for k and v (not
    the expanded K/V's 4/3 of it); at u=4 (more ranks than KV heads) the expanded K/V are sent, as before."""
    from autopar.forms.ulysses import layer_volume_bytes
    res = _run(local_world, "hf-llama", shape, names, "dp", {"attention": "ulysses@sp"}, steps=1)
    u, dp = shape[-1], shape[0] if len(shape) == 2 else 1
    h, h_kv = 32, 16 if u == 2 else 32  # features of q/o and of k/v as sent
    a2a = [r for r in res.plan.comms if r.fn == "all_to_all"]
    assert len(a2a) == 4 * LAYERS and all(r.bytes_forward == r.bytes_backward for r in a2a), a2a
    q = (u - 1) * (B // dp * S * h // u) // u * 8
    kv = q * h_kv // h
    for layer in range(LAYERS):
        rows = sorted(r.bytes_forward for r in a2a if r.module == f"model.layers.{layer}.self_attn")
        assert rows == sorted([q, q, kv, kv]), (layer, rows)
        want = layer_volume_bytes(B // dp, S, h, h_kv, u, 8, backward=False)
        assert sum(rows) == pytest.approx(want)
    ran = [(pass_, b) for kind, _, pass_, _, b in res.comms if kind == "all_to_all"]
    assert sorted(b for p, b in ran if p == "forward") == sorted(r.bytes_forward for r in a2a)
    assert sorted(b for p, b in ran if p == "backward") == sorted(r.bytes_backward for r in a2a)


def test_indivisible_sequence_not_offered_and_forced_is_an_error(local_world):
    torch.manual_seed(0)
    model = GPT(GPTConfig(seq_len=15))
    g = torch.Generator().manual_seed(0)
    x = (torch.randint(0, 128, (2, 15), generator=g), torch.randint(0, 128, (2, 15), generator=g))
    torch.set_default_dtype(torch.float64)  # the explicit softmax runs in fp32: a downcast, so it stays unfused
    try:
        llama, tokens = Llama(LlamaConfig()), _tokens()
    finally:
        torch.set_default_dtype(torch.float32)
    with local_world(2):
        from torch.distributed.device_mesh import init_device_mesh
        mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("tp",))
        with pytest.raises(ValueError, match=r"norm h\.0\.ln1: form 'sequence'.*\(15\) to divide over 2"):
            autopar.parallelize(model, mesh, x, plan="megatron", overrides={"norm": "sequence"})
        with pytest.raises(ValueError, match=r"'ulysses'.*sequence 15 does not divide over 2"):
            autopar.parallelize(model, mesh, x, plan="dp", overrides={"attention": "ulysses"})
        with pytest.raises(ValueError, match=r"explicit matmul-softmax-matmul attention, not fused into SDPA: it rounds "
                                             r"the scores to torch.float32"):
            autopar.parallelize(llama, mesh, tokens, plan="dp", overrides={"attention": "ulysses"})


@pytest.mark.parametrize("name", ["gpt", "gpt-3heads"])
# (1-D axis of 2: covered by ((4,), ...) for the 1-D mesh and ((2, 2), ...) for p=2)
@pytest.mark.parametrize("shape,names", [((4,), ("cp",)), ((2, 2), ("dp", "cp"))])
def test_ring_attention_matches_one_device(local_world, name, shape, names):
    res = _run(local_world, name, shape, names, "dp", {"attention": "ring@cp"})
    assert all(f == "ring" for f in _attention_forms(res.plan))
    p, layers = shape[-1], 2
    c = res.comm_counts
    # p-1 K/V steps forward per layer; backward passes K/V and dK/dV: 2(p-1)
    assert c["p2p.forward"] == (p - 1) * layers and c["p2p.backward"] == 2 * (p - 1) * layers, c


@pytest.mark.parametrize("form", ["ring", "ulysses"])
def test_sequence_forms_with_gqa_and_fewer_kv_heads_than_ranks(local_world, form):
    res = _run(local_world, "llama-sdpa-mqa", (4,), ("cp",), "dp", {"attention": form})
    assert all(f == form for f in _attention_forms(res.plan))
    _ran_sequence_collectives(res, form)


def test_ring_not_offered_with_an_explicit_mask_or_indivisible_sequence(local_world):
    torch.manual_seed(0)
    model = GPT(GPTConfig(seq_len=12))
    g = torch.Generator().manual_seed(0)
    x = (torch.randint(0, 128, (2, 12), generator=g), torch.randint(0, 128, (2, 12), generator=g))
    with local_world(4):
        from torch.distributed.device_mesh import init_device_mesh
        mesh = init_device_mesh("cpu", (4,), mesh_dim_names=("cp",))
        with pytest.raises(ValueError, match=r"'ring'.*sequence 12 does not split into 2x4 zigzag chunks"):
            autopar.parallelize(model, mesh, x, plan="dp", overrides={"attention": "ring"})
    # a padding mask (rows 1 and 3 end in pads) is no causal mask: every query sees only some keys
    hf = MODELS["hf-llama"][0]()
    ids, labels = _tokens()
    mask = torch.ones_like(ids)
    mask[1, 10:] = 0
    mask[3, 5:] = 0
    padded = {"input_ids": ids, "attention_mask": mask, "labels": labels}
    with pytest.raises(ValueError, match=r"'ring'.*its mask depends on input attention_mask \(padding\); ring "
                                         r"attention supports is_causal or no mask"):
        autopar.plan(hf, {"cp": 2}, padded, plan="dp", overrides={"attention": "ring"})
    # not offered: the ILP, free to choose, never gives the attention ring
    free = autopar.plan(hf, {"cp": 2}, padded, cluster="h100", memory_limit=2**40)
    assert "ring" not in _attention_forms(free)
    # without the user's attention_mask, HF's mask is built from positions only and proved causal: ring applies
    plain = autopar.plan(hf, {"cp": 2}, {"input_ids": ids, "labels": labels}, plan="dp",
                         overrides={"attention": "ring"})
    assert _attention_forms(plain) == ["ring", "ring"]


@pytest.mark.parametrize("form", ["ulysses", "ring"])
def test_explicit_attention_is_fused_and_takes_sequence_forms(local_world, form):
    """Llama's matmul / causal masked_fill / softmax / matmul becomes one SDPA node (fp32 model: no
    precision is lost by fusing), so Ulysses and ring attention apply to it."""
    from autopar.api import _prepare
    torch.manual_seed(0)
    ref, x = Llama(LlamaConfig(num_heads=4, num_kv_heads=2)), _tokens()
    _, captured, ctx = _prepare(ref, {"cp": 2}, x, None)
    targets = [n.target for n in captured.gm.graph.nodes if n.op == "call_function"]
    assert targets.count(torch.ops.aten.scaled_dot_product_attention.default) == 2
    assert torch.ops.aten.softmax.int not in targets
    assert all(s.spelling == "sdpa" and s.causal for s in ctx.of_kind("attention"))
    with local_world(2):
        res = run_equivalence(ref, x, (2,), ("cp",), plan="dp", overrides={"attention": form}, steps=2)
    assert res.max_err() < 1e-5, res.max_err()
    assert set(res.grad_err) == set(res.param_err) == {n for n, _ in ref.named_parameters()}
    assert all(f == form for f in _attention_forms(res.plan))
    _ran_sequence_collectives(res, form)


@pytest.mark.parametrize("form", ["ring", "ulysses"])
@pytest.mark.parametrize("p", [2, 4])
def test_sequence_forms_non_causal(local_world, form, p):
    res = _run(local_world, "llama-sdpa-bidirectional", (p,), ("cp",), "dp", {"attention": form})
    assert all(f == form for f in _attention_forms(res.plan))
    _ran_sequence_collectives(res, form)


@pytest.mark.parametrize("case", ["gpt-tp4", "hf_llama-tp2"])
def test_megatron_sp_on_gloo(case):
    """Megatron SP on real gloo processes, fp64: loss, every gradient, every parameter after two steps equal to
    each rank's single-device run; every gathered column-parallel input gathered again backward."""
    from dist_harness import gloo_pool
    from equivalence import gloo_equivalence
    from test_equivalence_gloo import HF_TOL, TOL, _param_names, hf_inputs, make_gpt, make_hf_llama, token_inputs

    world, make, inputs_fn, tol = {"gpt-tp4": (4, make_gpt, token_inputs, TOL),
                                   "hf_llama-tp2": (2, make_hf_llama, hf_inputs, HF_TOL)}[case]
    results = gloo_pool(world).run(gloo_equivalence, make, inputs_fn, (world,), ("tp",), "megatron",
                                   {"norm": "sequence"}, 2)
    assert len(results) == world
    for rank, res in enumerate(results):
        assert set(res.grad_err) == set(res.param_err) == _param_names(make), rank
        assert res.max_err() <= tol * max(1.0, abs(res.ref_loss)), (rank, res.max_err(), res.grad_err)
        c = res.comm_counts
        # per layer 2 gathered block inputs, and the LM head's: each gathered forward and again backward (and the
        # block outputs' scatters gathered backward); HF's returned logits are gathered too (vocab, forward only)
        gathered, stream = 2 * LAYERS + 1, B * S * 32
        fwd = [n for kind, _, pass_, n, _ in res.comms if (kind, pass_) == ("all_gather", "forward")]
        bwd = [n for kind, _, pass_, n, _ in res.comms if (kind, pass_) == ("all_gather", "backward")]
        assert fwd.count(stream) == gathered and bwd == [stream] * 2 * gathered, (rank, c)
        assert len(fwd) == gathered + (case == "hf_llama-tp2"), (rank, c)
        assert c == results[0].comm_counts


def test_megatron_sp_regathers_conv1d_inputs(local_world):
    """HF GPT-2's Conv1D layers are `addmm(b, x.view(-1, h), w)` with w (in, out): their gathered inputs are kept
    sharded and re-gathered backward too; loss, every gradient and parameter after two steps as one device."""
    import zoo
    from passes.lower import collective_nodes

    model, inputs, tol = zoo.FAMILIES["gpt2"]()
    with local_world(2):
        res = run_equivalence(model, inputs, (2,), ("tp",), plan="megatron", overrides={"norm": "sequence"}, steps=2)
    assert set(res.grad_err) == set(res.param_err) == {n for n, _ in model.named_parameters()}
    assert res.max_err() < tol, res.max_err()
    again = [n for n in collective_nodes(res.graph_module) if n.target.__name__ == "regather_linears"]
    assert len(again) == 2 * LAYERS + 1 and sum(any(n.args[6]) for n in again) == 2 * LAYERS  # the LM head: linear
    assert res.comm_counts["all_gather.backward"] == 2 * (2 * LAYERS + 1), res.comm_counts
