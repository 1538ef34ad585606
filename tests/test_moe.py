"""Expert parallelism: MoE blocks in each spelling, against the single-device model on gloo.

Every case parallelises a seeded fp64 reference on real gloo processes, trains two SGD steps and
compares the loss (including the auxiliary load-balancing loss), every gradient and every
parameter after each step; the all-to-all count and the expert shards are asserted too.
"""

from __future__ import annotations

import pytest
import torch

from dist_harness import gloo_pool
from equivalence import gloo_equivalence
from test_equivalence_gloo import _param_names, hf_inputs, token_inputs  # the same 4 x 16 token batches

TOL = 1e-10  # fp64 end to end
HF_TOL = 1e-5  # Hugging Face Mixtral routes and computes its loss in fp32


def _llama(style: str, k: int, experts: int = 4, **kw):
    from autopar.models import Llama, LlamaConfig

    model = Llama(LlamaConfig(num_heads=4, num_kv_heads=2, moe_experts=experts, moe_top_k=k, moe_style=style, **kw))
    if k == 1:  # the last expert's router row is the mean of two others: it never wins top-1 (an idle expert)
        for layer in model.layers:
            w = layer.mlp.router.weight
            with torch.no_grad():
                w[-1] = (w[0] + w[1]) / 2
    return model


def make_modulelist_top2():
    return _llama("modulelist", 2)


def make_modulelist_top1():
    return _llama("modulelist", 1)


def make_grouped_top2():
    return _llama("grouped", 2)


def make_grouped_top1():
    return _llama("grouped", 1)


def make_capacity_top2():
    return _llama("modulelist", 2, moe_capacity_factor=1.0)


def make_mixtral():
    from transformers import MixtralConfig, MixtralForCausalLM

    cfg = MixtralConfig(vocab_size=128, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                        num_attention_heads=4, num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2,
                        max_position_embeddings=16, output_router_logits=True, router_aux_loss_coef=0.02,
                        use_cache=False)
    cfg._experts_implementation = "eager"  # fp64 (the default grouped_mm takes fp32/bf16 only)
    return MixtralForCausalLM(cfg).eval()


CASES = {
    # id: (world, make_ref, inputs_fn, mesh shape, axis names, plan, overrides, MoE layers)
    "modulelist-top2-ep2": (2, make_modulelist_top2, token_inputs, (2,), ("ep",), "dp", {"moe": "expert@ep"}, 2),
    "modulelist-top1-ep4": (4, make_modulelist_top1, token_inputs, (4,), ("ep",), "dp", {"moe": "expert@ep"}, 2),
    "grouped-top2-ep4": (4, make_grouped_top2, token_inputs, (4,), ("ep",), "dp", {"moe": "expert@ep"}, 2),
    "grouped-top1-ep2": (2, make_grouped_top1, token_inputs, (2,), ("ep",), "dp", {"moe": "expert@ep"}, 2),
    "grouped-top2-dp2xep2": (4, make_grouped_top2, token_inputs, (2, 2), ("dp", "ep"), "dp", {"moe": "expert@ep"}, 2),
    "modulelist-top2-dp2xep2": (4, make_modulelist_top2, token_inputs, (2, 2), ("dp", "ep"), "dp",
                                {"moe": "expert@ep"}, 2),
    "mixtral-ep2": (2, make_mixtral, hf_inputs, (2,), ("ep",), "dp", {"moe": "expert@ep"}, 2),
    # (no mixtral-ep4: ep=4 runs in modulelist-top1-ep4 and grouped-top2-ep4, Mixtral's spelling in mixtral-ep2 and,
    # on the 4-rank pool, mixtral-dp2xep2)
    "mixtral-dp2xep2": (4, make_mixtral, hf_inputs, (2, 2), ("dp", "ep"), "dp", {"moe": "expert@ep"}, 2),
    "grouped-top2-tp2-partial": (2, make_grouped_top2, token_inputs, (2,), ("tp",), "megatron",
                                 {"moe": "expert@tp"}, 2),
    "grouped-top2-fsdp2-replicated": (2, make_grouped_top2, token_inputs, (2,), ("dp",), "fsdp", None, 2),
    "grouped-top2-tp2-experts": (2, make_grouped_top2, token_inputs, (2,), ("tp",), "megatron", {"moe": "tp@tp"}, 2),
    "mixtral-tp2-experts": (2, make_mixtral, hf_inputs, (2,), ("tp",), "megatron", {"moe": "tp@tp"}, 2),
    "capacity-top2-ep2": (2, make_capacity_top2, token_inputs, (2,), ("ep",), "dp", {"moe": "expert@ep"}, 2),
}


@pytest.mark.parametrize("case", list(CASES))
def test_moe_equivalence(case, fp64):
    world, make, inputs_fn, shape, names, plan, overrides, layers = CASES[case]
    results = gloo_pool(world).run(gloo_equivalence, make, inputs_fn, shape, names, plan, overrides, 2)
    expected = _param_names(make)
    tol = HF_TOL if "mixtral" in case else TOL
    for rank, res in enumerate(results):
        assert set(res.grad_err) | res.idle | res.elsewhere == expected
        assert set(res.param_err) | res.elsewhere == expected
        bad = {k: v for k, v in {**res.grad_err, **{f"{k} (after step)": v for k, v in res.param_err.items()}}.items()
               if not v <= tol}
        assert not bad, f"rank {rank}: differs from single-device: {bad}"
        assert abs(res.loss - res.ref_loss) <= tol * max(1.0, abs(res.ref_loss)), (rank, res.loss, res.ref_loss)
    assert set().union(*(set(r.grad_err) | r.idle for r in results)) == expected  # every parameter, somewhere
    if "modulelist-top1" in case:  # the idle last expert (router row = mean of two others) has no reference grad
        idle = set().union(*(r.idle for r in results))
        assert {f"layers.{i}.mlp.experts.3.{w}.weight" for i in range(2) for w in ("gate", "up", "down")} <= idle
    counts = results[0].comm_counts
    if "partial" in case or "-experts" in case or not overrides:  # tokens replicated on the expert axis (or no EP): no all-to-all
        assert "all_to_all.forward" not in counts and "all_to_all.backward" not in counts, counts
    else:  # per MoE layer: counts, tokens out, tokens back forward; tokens out and back backward
        assert counts.get("all_to_all.forward") == 3 * layers, counts
        assert counts.get("all_to_all.backward") == 2 * layers, counts
    if not overrides:
        return
    if overrides["moe"].startswith("tp"):  # every expert's FFN features split: 1/t of each expert weight per rank
        t = shape[0]
        full = {n: p.numel() for n, p in _shapes(make).items() if ".experts" in n}
        for res in results:
            assert all(res.local_numel[n] * t == v for n, v in full.items()), res.local_numel
        return
    ep = shape[names.index(overrides["moe"].split("@")[1])]
    full = {n: p.numel() for n, p in _shapes(make).items() if ".experts" in n}
    for res in results:  # 1/ep of the expert weights per rank, in every spelling
        local = {n: v for n, v in res.local_numel.items() if n in full}
        assert sum(local.values()) * ep == sum(full.values()), (sum(local.values()), sum(full.values()))
        for name, numel in local.items():
            owned = name.split(".experts.")[1][0].isdigit()  # ModuleList: whole experts on their owner
            assert numel in (0, full[name]) if owned else numel * ep == full[name], (name, numel)
    assert all(r.comm_counts == results[0].comm_counts for r in results), [r.comm_counts for r in results]


def _shapes(make):
    return dict(make().named_parameters())  # under the fp64 fixture, as the workers build them


# ----------------------------------------------------------------------------- Hugging Face Qwen3-MoE


def make_qwen3_moe():
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    cfg = Qwen3MoeConfig(vocab_size=128, hidden_size=32, intermediate_size=64, moe_intermediate_size=24,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                         num_experts=4, num_experts_per_tok=2, norm_topk_prob=True, max_position_embeddings=16,
                         output_router_logits=True, router_aux_loss_coef=0.02, use_cache=False)
    cfg._experts_implementation = "eager"
    return Qwen3MoeForCausalLM(cfg).eval()


def test_qwen3_moe_ep2():
    results = gloo_pool(2).run(gloo_equivalence, make_qwen3_moe, hf_inputs, (2,), ("ep",), "dp",
                               {"moe": "expert@ep"}, 2)
    for res in results:
        assert res.max_err() <= HF_TOL * max(1.0, abs(res.ref_loss)), res.max_err()
        assert res.comm_counts.get("all_to_all.forward") == 6, res.comm_counts


# ----------------------------------------------------------------------------- in one process


def test_idle_expert_fixture_really_idles(fp64):
    """The top-1 fixtures leave their last expert without a token on one device (so the EP runs cover an
    expert that receives nothing)."""
    torch.manual_seed(0)
    for make in (make_modulelist_top1, make_grouped_top1):
        model = make()
        seen = []
        for layer in model.layers:
            if hasattr(layer.mlp.experts, "w1"):
                layer.mlp.experts.register_forward_hook(lambda m, a, o: seen.append(a[1][-1].item()))
            else:
                layer.mlp.experts[-1].register_forward_hook(lambda m, a, o: seen.append(a[0].shape[0]))
        model(*token_inputs())
        assert all(v == 0 for v in seen), seen


def test_recognition_notes_and_spellings(fp64):
    from autopar.capture import capture

    torch.manual_seed(0)
    for make, inputs, spelling, n in ((make_modulelist_top2, token_inputs(), "modulelist", 2),
                                      (make_grouped_top2, token_inputs(), "grouped", 2),
                                      (make_capacity_top2, token_inputs(), "modulelist", 2),
                                      (make_mixtral, hf_inputs(), "hf-stacked", 2)):
        model = make()
        args, kwargs = (inputs, {}) if not isinstance(inputs, dict) else ((), inputs)
        cap = capture(model, args, kwargs)
        ops = [x for x in cap.gm.graph.nodes if x.target is torch.ops.autopar.moe_experts.default]
        assert len(ops) == n
        assert not [x for x in cap.notes if "opaque" in x], cap.notes  # nothing left untraceable
        if spelling != "hf-stacked":
            assert sum(f"({spelling}," in x and "verified" in x for x in cap.notes) == n, cap.notes


class SigmoidMoE(torch.nn.Module):
    """A router no canonical form has (sigmoid scores, not renormalised): its dispatch is captured, its router kept."""

    def __init__(self, h=16, E=4):
        super().__init__()
        self.router = torch.nn.Linear(h, E, bias=False)
        self.experts = torch.nn.ModuleList(torch.nn.Linear(h, h) for _ in range(E))

    def forward(self, x):
        s = torch.sigmoid(self.router(x))
        w, idx = torch.topk(s, 2, dim=-1)
        out = torch.zeros_like(x)
        for e, expert in enumerate(self.experts):
            t, slot = torch.where(idx == e)
            if t.numel() == 0:
                continue
            out.index_add_(0, t, expert(x[t]) * w[t, slot, None])
        return out


class SigmoidNet(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.inp = torch.nn.Linear(8, 16)
        self.moe = SigmoidMoE()
        self.out = torch.nn.Linear(16, 8)

    def forward(self, x, y):
        return torch.nn.functional.mse_loss(self.out(self.moe(self.inp(x))), y)


def make_sigmoid_net():
    return SigmoidNet()


def sigmoid_inputs():
    g = torch.Generator().manual_seed(2)
    return torch.randn(8, 8, generator=g), torch.randn(8, 8, generator=g)


def test_block_without_canonical_form_keeps_its_router_and_matches(fp64):
    """Its dispatch is captured (not the whole block), so it is recognised; data parallel matches one device."""
    import autopar

    torch.manual_seed(0)
    plan = autopar.plan(make_sigmoid_net(), {"dp": 2}, sigmoid_inputs(), plan="dp", overrides={"moe": "expert"})
    why = [n for n in plan.notes if n.startswith("MoE moe")]
    assert why and "router and auxiliary losses are kept as written" in why[0], plan.notes
    assert [(s.kind, s.form) for s in plan.strategies if s.kind == "moe"] == [("moe", "expert")]
    results = gloo_pool(2).run(gloo_equivalence, make_sigmoid_net, sigmoid_inputs, (2,), ("dp",), "dp", None, 2)
    for res in results:
        assert res.max_err() <= TOL, res.max_err()


def test_solver_picks_expert_parallel_where_it_wins():
    """Mixtral-shaped layers on 8 H100s: EP beats replicated experts in time and memory, and auto picks it."""
    import autopar
    from transformers import MixtralConfig, MixtralForCausalLM

    cfg = MixtralConfig(vocab_size=32000, hidden_size=4096, intermediate_size=14336, num_hidden_layers=2,
                        num_attention_heads=32, num_key_value_heads=8, num_local_experts=8, num_experts_per_tok=2,
                        max_position_embeddings=4096, use_cache=False)
    with torch.device("meta"):
        model = MixtralForCausalLM(cfg).to(torch.bfloat16)
    ids = torch.zeros(8, 4096, dtype=torch.long, device="meta")
    inputs = {"input_ids": ids, "labels": ids}
    est = {}
    for label, plan, ov in (("replicated", "dp", None), ("ep", "dp", {"moe": "expert@dp"}), ("auto", "auto", None)):
        p = autopar.plan(model, {"dp": 8}, inputs, plan=plan, overrides=ov, cluster="h100", memory_limit=80e9)
        est[label] = p
    auto = est["auto"]
    assert {(s.form, s.axis) for s in auto.strategies if s.kind == "moe"} == {("expert", "dp")}
    # the ILP minimises each structure's overlapped time (`autopar.timeline.overlapped_s`), the estimate simulates the
    # whole step's timeline: they may rank near-equal plans differently by the step's head and tail (here FSDP of the
    # attention, embedding and loss, 0.7% apart)
    assert auto.estimate.step_time_s <= est["ep"].estimate.step_time_s * 1.01
    assert est["ep"].estimate.step_time_s < est["replicated"].estimate.step_time_s
    assert est["ep"].estimate.memory_bytes_per_device < est["replicated"].estimate.memory_bytes_per_device / 2


# ----------------------------------------------------------------------------- dispatch round trip


def round_trip(world: int, tokens: int, k: int, experts: int, hidden: int):
    """In a gloo worker: dispatch -> identity experts -> combine, in a2a mode, against x * sum(w)."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from autopar.mesh import mesh_info
    from autopar.runtime import moe as rt
    from autopar.runtime.collectives import record_comms

    torch.set_default_dtype(torch.float64)
    key = None
    try:
        rank = dist.get_rank()
        axis = mesh_info(init_device_mesh("cpu", (world,), mesh_dim_names=("ep",))).axis("ep")
        spec = rt.ExpertsSpec("identity", experts, k, ["scale"], lambda params, x: x * params[0], "test")
        key = rt.register(spec, torch.nn.Identity())
        g = torch.Generator().manual_seed(10 + rank)
        x = torch.randn(tokens, hidden, generator=g, requires_grad=True)
        idx = torch.stack([torch.randperm(experts - 1, generator=g)[:k] for _ in range(tokens)])  # last expert idle
        w = torch.rand(tokens, k, generator=g, requires_grad=True)
        scale = torch.ones(experts // world, 1, requires_grad=True)
        with record_comms() as recs:
            y = rt.moe_experts(x, idx, w, [scale], key, axis.key, "a2a")
            gy = torch.randn(y.shape, generator=g)
            y.backward(gy)
        expect = x.detach() * w.detach().sum(1, keepdim=True)
        owner = idx // (experts // world)
        off_rank_rows = int((owner != rank).sum())
        token_bytes = [r.send_bytes for r in recs if r.kind == "all_to_all" and r.numel % hidden == 0 and r.numel > 0
                       and r.pass_ == "forward"]
        return dict(y_err=float((y - expect).abs().max()),
                    gx_err=float((x.grad - gy * w.detach().sum(1, keepdim=True)).abs().max()),
                    gw_err=float((w.grad - (gy.unsqueeze(1) * x.detach().unsqueeze(1)).sum(-1)).abs().max()),
                    kinds=sorted((r.kind, r.pass_) for r in recs),
                    sent_bytes=token_bytes[0] if token_bytes else None,
                    expected_bytes=off_rank_rows * hidden * 8,
                    scale_grad=scale.grad.reshape(-1).tolist(),
                    counts=torch.bincount(idx.reshape(-1), minlength=experts).tolist())
    finally:
        torch.set_default_dtype(torch.float32)
        rt._SPECS.pop(key, None)  # the worker outlives the job: leave its registry as it was


@pytest.mark.parametrize("world", [2, 4])
def test_dispatch_identity_combine_round_trip(world):
    results = gloo_pool(world).run(round_trip, world, 12, 2, 8, 5)
    for rank, r in enumerate(results):
        assert r["y_err"] < 1e-12 and r["gx_err"] < 1e-12 and r["gw_err"] < 1e-12, r
        # forward: counts, rows out, rows back; backward: rows out, rows back
        assert r["kinds"] == sorted([("all_to_all", "forward")] * 3 + [("all_to_all", "backward")] * 2), r["kinds"]
        assert r["sent_bytes"] == r["expected_bytes"], r  # each rank sends exactly its off-rank rows
    assert results[-1]["scale_grad"][-1] == 0.0  # the idle last expert gets a zero gradient


def test_experts_not_dividing_over_the_axis_is_a_clear_error(fp64):
    import autopar

    torch.manual_seed(0)
    with pytest.raises(ValueError, match=r"4 experts do not divide over 3 ranks.*Fix"):
        autopar.plan(make_grouped_top2(), {"ep": 3}, token_inputs(), plan="dp", overrides={"moe": "expert@ep"})


# ----------------------------------------------------------------------------- checkpoints


def moe_dcp_round_trip(path: str):
    """Expert-parallel ModuleList (owned experts) and GroupedExperts (S(0)) save with DCP and load into a
    replicated plan of a differently initialised model: every weight comes back."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.device_mesh import init_device_mesh

    import autopar

    torch.set_default_dtype(torch.float64)
    try:
        mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("ep",))
        errs = {}
        for make in (make_modulelist_top2, make_grouped_top2):
            torch.manual_seed(0)
            ref = make()
            pm = autopar.parallelize(ref, mesh, token_inputs(), plan="dp", overrides={"moe": "expert@ep"})
            sd = pm.state_dict()
            assert set(sd) == set(ref.state_dict()), set(sd) ^ set(ref.state_dict())
            where = f"{path}/{make.__name__}"
            dcp.save(sd, checkpoint_id=where)
            torch.manual_seed(5)
            pm2 = autopar.parallelize(make(), mesh, token_inputs(), plan="dp")
            target = pm2.state_dict()
            dcp.load(target, checkpoint_id=where)
            pm2.load_state_dict(target)
            ref_params = dict(ref.named_parameters())
            errs[make.__name__] = max(float((p.full_tensor() - ref_params[n].detach()).abs().max())
                                      for n, p in pm2.named_parameters())
        return errs
    finally:
        torch.set_default_dtype(torch.float32)


def test_expert_parallel_checkpoint_loads_into_another_plan():
    import tempfile

    path = tempfile.mkdtemp(prefix="autopar-moe-dcp-")
    for errs in gloo_pool(2).run(moe_dcp_round_trip, path):
        assert all(v == 0.0 for v in errs.values()), errs


def test_owned_experts_under_local_tensor_mode_say_to_use_processes(local_world, fp64):
    import autopar
    from torch.distributed.device_mesh import init_device_mesh

    torch.manual_seed(0)
    model, inputs = make_modulelist_top2(), token_inputs()
    with local_world(2):
        mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("ep",))
        with pytest.raises(NotImplementedError, match="one process per rank.*stacked"):
            autopar.parallelize(model, mesh, inputs, plan="dp", overrides={"moe": "expert@ep"})
