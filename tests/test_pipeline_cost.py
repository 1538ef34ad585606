"""The pipeline's cost and memory model (issue #23, deliverable 3) and its offline plan (deliverable 2): the bubble
of every schedule exactly on equal stages, the microbatches in flight and each rank's peak against hand formulas,
the checkpoint levels' share, the p2p term, the one-layer stage model against the whole model's own estimate, and the
clear errors. No processes; every model is small and on the meta device."""

from __future__ import annotations

import json
import time

import pytest
import torch

import autopar
from autopar.estimate import Cost, peak_bytes
from autopar.models import GPT, GPTConfig
from autopar.pipeline_estimate import LayerCosts, layer_costs, price_pipeline, _microbatch
from autopar.pipeline_plan import PipelinePlan, bubble_fraction
from autopar.plan import Plan
from cost_model import pipeline as pc
from cost_model.analytical import collective_time_s
from cost_model.hardware import axis_link, load_cluster


def _ranks(form, p, v):
    pp = PipelinePlan(form, "pp", 4, v)
    return [pp.stage_rank(k, p) for k in range(p * v)]


@pytest.mark.parametrize("form,p,m,v", [("gpipe", 4, 8, 1), ("1f1b", 4, 8, 1), ("1f1b", 8, 3, 1),
                                        ("interleaved-1f1b", 4, 8, 2), ("interleaved-1f1b", 2, 6, 3),
                                        ("zbv", 4, 8, 2), ("dualpipev", 2, 4, 2)])
def test_bubble_is_the_closed_form_on_equal_stages(form, p, m, v):
    t = 0.25
    pipe, bubble = pc.pipeline_time(form, p, m, [t] * (p * v), _ranks(form, p, v))
    assert pipe == pytest.approx(m * v * t / (1 - bubble_fraction(form, p, m, v)), rel=1e-12)
    assert bubble / pipe == pytest.approx(bubble_fraction(form, p, m, v), rel=1e-12, abs=1e-15)
    if form in ("gpipe", "1f1b"):
        assert pipe == pytest.approx((m + p - 1) * t, rel=1e-12)
    if form in ("zbv", "dualpipev"):
        assert bubble == 0.0


def test_unequal_stages_the_slowest_sets_the_pace():
    # 1F1B on 3 ranks, stage times 1, 3, 2, 5 microbatches: 5 x 3 + (1 + 2) (warm-up and drain through the other
    # stages: Alpa's sum t_i + (m - 1) max t_j)
    pipe, bubble = pc.pipeline_time("1f1b", 3, 5, [1.0, 3.0, 2.0], [0, 1, 2])
    assert (pipe, bubble) == (18.0, 3.0)
    # interleaved: rank 0 runs stages 0 and 2 (1 + 2), rank 1 stages 1 and 3 (3 + 1): 4 x 4 + (3 + 4 - 4) / 2
    pipe, bubble = pc.pipeline_time("interleaved-1f1b", 2, 4, [1.0, 3.0, 2.0, 1.0], [0, 1, 0, 1])
    assert (pipe, bubble) == (17.5, 1.5)


def test_in_flight_microbatches():
    assert [pc.in_flight("1f1b", 4, 8, 1, r) for r in range(4)] == [4, 3, 2, 1]  # stage s holds p - s
    assert [pc.in_flight("1f1b", 4, 2, 1, r) for r in range(4)] == [2, 2, 2, 1]  # never more than m
    assert [pc.in_flight("gpipe", 4, 8, 1, r) for r in range(4)] == [8] * 4
    # interleaved, Megatron's warm-up 2(p-r-1) + (v-1)p chunks + 1, each 1/v of the rank: rank 0 holds p(1 + (p-1)/(pv))
    p, v, m = 4, 2, 8
    assert pc.in_flight("interleaved-1f1b", p, m, v, 0) == pytest.approx(p * (1 + (p - 1) / (p * v)))
    assert [pc.in_flight("interleaved-1f1b", p, m, v, r) for r in range(p)] == [5.5, 4.5, 3.5, 2.5]
    assert pc.in_flight("interleaved-1f1b", 4, 1, 2, 0) == 1.0  # capped by the m*v chunks there are
    assert [pc.in_flight("zbv", 4, 8, 2, r) for r in range(4)] == [4] * 4
    with pytest.raises(ValueError, match="not one of"):
        pc.in_flight("pipedream", 4, 8, 1, 0)


def test_tail_hides_the_reduction_under_the_last_backward():
    assert pc.tail_s(reduce_s=1.0, gather_s=0.0, optimizer_s=0.5, rank_compute_s=3.0) == 0.5  # 1 s under 2 s
    assert pc.tail_s(reduce_s=3.0, gather_s=2.0, optimizer_s=0.5, rank_compute_s=3.0) == pytest.approx(1 + 1 + 0.5)


GIB = 2**30


def _synthetic(act=1.0 * GIB, state=4.0 * GIB, ck=None, boundary=8 * 2**20):
    """Hand-made per-layer costs: 1 s a layer, 0.5 s embedding, 2 s head; `state` bytes of parameters, gradients and
    optimizer state and `act` saved per layer, no activations outside the layers."""
    layer = Cost(compute_s=1.0, comm_s=0.0, comm_bytes=0.0, memory_bytes=state + act, act_bytes=act)
    first = Cost(compute_s=0.5, comm_s=0.0, comm_bytes=0.0, memory_bytes=0.0)
    last = Cost(compute_s=2.0, comm_s=0.0, comm_bytes=0.0, memory_bytes=0.0)
    return LayerCosts(layer=layer, first=first, last=last, checkpoint=ck, boundary_bytes=boundary, grad_share=0.25,
                      param_share=0.25, sub_plan=None)


def _price(lc, form="1f1b", p=4, m=8, v=1, layers=8, cut=None):
    return price_pipeline(lc, form=form, axis="pp", p=p, m=m, v=v, num_layers=layers, cluster="h100",
                          full_sizes=(p, 8), full_names=("pp", "tp"), cut=cut)


def test_rank_memory_is_state_plus_in_flight_activations():
    lc = _synthetic()
    pplan, f, _ = _price(lc, cut=(0, 2, 4, 6, 8))
    assert pplan.cut == (0, 2, 4, 6, 8)
    for r, s in enumerate(f["stages"]):
        state, act = 2 * 4.0 * GIB, 2 * 1.0 * GIB
        assert s.in_flight == 4 - r and s.layers == 2
        # held (parameters + optimizer) + the start of a later microbatch's backward (m > in flight: as many in
        # flight as at the first): its in-flight activations next to every gradient, accumulated since the first;
        # a stage that sends holds its output per microbatch in flight and the output gradient it receives
        sent = (r < 3) * 8 * 2**20 * (4 - r + 1)
        assert s.peak_bytes == int(state * 0.75 + state * 0.25 + (4 - r) * act + sent)
        assert (s.parameters_bytes, s.gradients_bytes, s.optimizer_bytes) == (int(state / 4), int(state / 4),
                                                                             int(state / 2))
        assert s.activations_bytes == int(act)
    assert f["memory_bytes_per_device"] == f["stages"][0].peak_bytes
    # GPipe holds all m microbatches on every rank (m at its first backward, m - 1 and every gradient at the next)
    _, g, _ = _price(lc, form="gpipe", cut=(0, 2, 4, 6, 8))
    assert [s.peak_bytes for s in g["stages"]] == [int(8 * 0.75 * GIB + 8 * 2 * GIB + 9 * 8 * 2**20)] * 3 + \
        [int(8 * 0.75 * GIB + 8 * 2 * GIB)]
    # the unpipelined estimate's rule (`estimate.peak_bytes`) with the activations times in flight, plus the gradients
    # accumulated over the microbatches
    two = Cost(compute_s=2.0, comm_s=0.0, comm_bytes=0.0, memory_bytes=2 * (4.0 + 4 * 1.0) * GIB,
               act_bytes=2 * 4 * GIB)
    assert f["stages"][0].peak_bytes == int(peak_bytes([two], 0.25, 5 * 8 * 2**20) + 2 * 4.0 * GIB * 0.25)


def test_checkpoint_level_scales_with_in_flight_microbatches_and_adds_recompute():
    # a level that frees 0.75 GiB of each layer's 1 GiB and recomputes 0.3 s, with a 0.2 GiB recompute transient
    ck = Cost(compute_s=0.3, comm_s=0.0, comm_bytes=0.0, memory_bytes=-0.55 * GIB, act_bytes=-0.75 * GIB,
              transient_bytes=0.2 * GIB)
    plain, f0, _ = _price(_synthetic(), cut=(0, 2, 4, 6, 8))
    _, f1, _ = _price(_synthetic(ck=ck), cut=(0, 2, 4, 6, 8))
    s0 = f1["stages"][0]
    state = 8.0 * GIB
    # rank 0: 4 microbatches in flight, each 2 layers x (1 - 0.75) GiB, plus one layer's transient, next to the
    # gradients accumulated since the first microbatch's backward
    assert s0.peak_bytes == int(state * 0.75 + state * 0.25 + 4 * 2 * 0.25 * GIB + 0.2 * GIB + 5 * 8 * 2**20)
    assert s0.activations_bytes == int(2 * 0.25 * GIB)
    assert s0.compute_s == pytest.approx(f0["stages"][0].compute_s + 2 * 0.3)


def test_step_bubble_p2p_and_cut():
    lc = _synthetic(boundary=64 * 2**20)
    pplan, f, extra = _price(lc, p=4, m=8, layers=8)
    # the cut balances 1 s layers with 0.5 s before and 2 s after: the last stage gets fewer layers
    assert pplan.cut[0] == 0 and pplan.cut[-1] == 8 and pplan.cut[-1] - pplan.cut[-2] == 1
    link = axis_link(load_cluster("h100", (4, 8)), (4, 8), 0)
    one = collective_time_s("p2p", 64 * 2**20, 2, link)
    assert one > 0 and f["p2p_bytes_per_microbatch"] == 64 * 2**20
    sends = [1, 2, 2, 1]
    assert [s.p2p_s for s in f["stages"]] == pytest.approx([n * one for n in sends])
    # V-shaped on 2 ranks: stages 0, 3 on rank 0 and 1, 2 on rank 1; the turn 1 -> 2 stays on rank 1
    _, zbv, _ = _price(lc, form="zbv", p=2, m=8, v=2, layers=8)
    assert [s.p2p_s for s in zbv["stages"]] == pytest.approx([2 * one, 2 * one])
    times = [s.compute_s + s.exposed_s + s.p2p_s for s in f["stages"]]
    # warm-up and drain through the other stages (Alpa's sum t_i + (m - 1) max t_j)
    assert extra["pipe_s"] == pytest.approx(8 * max(times) + sum(times) - max(times))
    assert f["bubble_s"] == pytest.approx(sum(times) - max(times))
    assert f["step_time_s"] == pytest.approx(extra["pipe_s"] + max(s.tail_s for s in f["stages"]))
    # the step is its compute, its exposed communication and its bubble, exactly
    assert f["step_time_s"] == pytest.approx(f["compute_time_s"] + f["exposed_comm_s"] + f["bubble_s"], rel=1e-12)
    slow = max(f["stages"], key=lambda s: s.compute_s + s.exposed_s + s.p2p_s)
    assert f["comm_time_s"] == pytest.approx(8 * slow.p2p_s)  # no collective but the p2p in these costs


def _gpt(layers=4, batch=8):
    cfg = GPTConfig(vocab_size=64, seq_len=16, num_layers=layers, num_heads=4, hidden=32)
    with torch.device("meta"):
        model = GPT(cfg)
        ids = torch.zeros(batch, 16, dtype=torch.long)
    return model, (ids, ids)


def test_one_layer_stage_model_matches_the_whole_models_estimate():
    """The layer costs from the model cut to one and two layers, composed over every layer, are the whole model's
    own per-structure costs (identical layers): compute, communication and saved activations."""
    from autopar.api import _prepare
    from autopar.inputs import batch_dims
    from autopar.planner import build_priced
    model, inputs = _gpt(layers=5)
    sub = {"dp": 2, "tp": 2}
    lc = layer_costs(model, sub, inputs, plan="megatron", cluster="h100")
    info, captured, ctx = _prepare(model, sub, inputs)
    _, sol = build_priced(ctx, info, "megatron", None, dict(zip(captured.user_inputs,
                                                                   batch_dims(captured.example_shapes))),
                          cluster="h100")
    whole = list(sol.per_site.values()) + [sol.other]
    for field in ("compute_s", "comm_s", "act_bytes", "memory_bytes", "reduce_s"):
        composed = 5 * getattr(lc.layer, field) + getattr(lc.first, field) + getattr(lc.last, field)
        assert composed == pytest.approx(sum(getattr(c, field) for c in whole), rel=1e-9), field
    assert lc.layer.compute_s > 0 and lc.layer.act_bytes > 0 and lc.last.compute_s > 0


def test_offline_plan_with_a_pipeline_override():
    model, inputs = _gpt(layers=6)
    t0 = time.perf_counter()
    p = autopar.plan(model, {"pp": 2, "dp": 2, "tp": 2}, inputs, plan="megatron", cluster="h100",
                     overrides={"pipeline": "1f1b@pp"}, microbatches=4)
    assert time.perf_counter() - t0 < 30
    pp = p.pipeline
    assert (pp.form, pp.axis, pp.microbatches, pp.stages_per_rank) == ("1f1b", "pp", 4, 1)
    assert len(pp.cut) == 3 and pp.cut[0] == 0 and pp.cut[-1] == 6
    e = p.estimate
    assert [s.key for s in e.stages] == ["pp=0", "pp=1"] and [s.in_flight for s in e.stages] == [2, 1]
    assert sum(s.layers for s in e.stages) == 6
    assert e.memory_bytes_per_device == max(s.peak_bytes for s in e.stages)
    # one microbatch of 2 sequences over dp 2 per rank: a (1, 16, 32) fp32 activation per boundary
    assert e.p2p_bytes_per_microbatch == 1 * 16 * 32 * 4
    assert e.step_time_s > e.bubble_s > 0
    assert e.step_time_s == pytest.approx(e.compute_time_s + e.exposed_comm_s + e.bubble_s, rel=1e-9)
    assert all(s.exposed_s > 0 and s.sync_s > 0 for s in e.stages)  # tp collectives; dp gradient reduction
    # every layer's structures and parameters are in the plan, on the whole mesh (replicated over pp)
    keys = {s.key for s in p.strategies}
    assert {f"h.{i}.attn" for i in range(6)} <= keys
    fqns = dict(p.params)
    assert set(fqns) == {n for n, _ in model.named_parameters(remove_duplicate=False)}  # tied names too
    assert all(pl.startswith("R") and len(pl) >= 3 for pl in fqns.values())
    assert [lv for _, lv in p.checkpoint] == ["none"] * 6
    assert "pipeline 1f1b@pp" in p.explain() and "(pipeline)" in p.explain()
    assert f"pipeline: 1f1b@pp, 4 microbatches, 1 stage(s) per rank, layer cut {list(pp.cut)}" in p.table()
    back = Plan.from_json(p.to_json())
    assert back == p and json.loads(p.to_json())["pipeline"]["cut"] == list(pp.cut)


def test_interleaved_bubble_is_smaller_and_memory_follows_in_flight():
    model, inputs = _gpt(layers=8, batch=8)
    kw = dict(plan="megatron", cluster="h100", microbatches=8)
    one = autopar.plan(model, {"pp": 2, "tp": 2}, inputs, overrides={"pipeline": "1f1b@pp"}, **kw)
    inter = autopar.plan(model, {"pp": 2, "tp": 2}, inputs, overrides={"pipeline": "interleaved-1f1b@pp"}, **kw)
    assert inter.pipeline.stages_per_rank == 2 and len(inter.pipeline.cut) == 5
    assert inter.estimate.bubble_s < one.estimate.bubble_s
    assert [s.in_flight for s in inter.estimate.stages] == [2.5, 1.5]  # (2(p-r-1) + (v-1)p + 1) / v
    assert [s.stages for s in inter.estimate.stages] == [(0, 2), (1, 3)]


def test_pipeline_errors():
    model, inputs = _gpt(layers=2, batch=6)
    mesh = {"pp": 2, "tp": 2}
    with pytest.raises(ValueError, match=r"microbatches=4 must be a positive integer dividing the batch \(6\)"):
        autopar.plan(model, mesh, inputs, plan="megatron", overrides={"pipeline": "1f1b@pp"}, microbatches=4)
    with pytest.raises(ValueError, match=r"4 stages, but GPT has 2 layers"):
        autopar.plan(model, mesh, inputs, plan="megatron", overrides={"pipeline": "interleaved-1f1b@pp"},
                     microbatches=2)
    with pytest.raises(ValueError, match=r"pipeline axis 'cp'.*not an axis of the mesh"):
        autopar.plan(model, mesh, inputs, plan="megatron", overrides={"pipeline": "1f1b@cp"}, microbatches=2)
    with pytest.raises(ValueError, match="no axis is pipelined"):
        autopar.plan(model, mesh, inputs, plan="megatron", microbatches=2)
    with pytest.raises(NotImplementedError, match="pipelined plan is not lowered offline"):
        autopar.plan(model, mesh, inputs, plan="megatron", overrides={"pipeline": "1f1b@pp"}, microbatches=2,
                     lower=True)
    # no microbatches: the planner's choice, the least estimated step among the counts that divide the batch
    chosen = autopar.plan(model, mesh, inputs, plan="megatron", overrides={"pipeline": "1f1b@pp"})
    (d,) = [d for d in chosen.decisions if d.kind == "pipeline"]
    steps = {int(r.label.split(", ")[1].split()[0]): r.time_s for r in d.candidates}
    assert sorted(steps) == [2, 6]  # the divisors of 6 at or above p = 2, 2p = 4 and 4p = 8
    assert chosen.pipeline.microbatches == min(steps, key=steps.get)
    for m, t in steps.items():  # each is what an explicit count prices
        explicit = autopar.plan(model, mesh, inputs, plan="megatron", overrides={"pipeline": "1f1b@pp"},
                                microbatches=m)
        assert explicit.estimate.step_time_s == pytest.approx(t, rel=1e-12)


def test_microbatch_inputs_cut_only_batched_tensors():
    x, y = torch.zeros(8, 3), torch.zeros(5)
    a, b = _microbatch((x, y), 8, 4)
    assert a.shape == (2, 3) and b.shape == (5,)


def _mid_gpt():
    cfg = GPTConfig(vocab_size=8192, seq_len=512, num_layers=4, num_heads=8, hidden=1024)
    with torch.device("meta"):
        model = GPT(cfg).to(torch.bfloat16)
        ids = torch.zeros(8, 512, dtype=torch.long)
    return model, (ids, ids)


def _pipeline_decision(p):
    (d,) = [d for d in p.decisions if d.keys == ("(pipeline)",)]
    fitting = [r for r in d.candidates if not r.excluded]
    assert d.chosen in {r.label.split(",")[0] if r.label[0] != "n" else "no pipeline" for r in fitting}
    best = min(fitting, key=lambda r: r.step_s)
    assert d.chosen == (best.label.split(",")[0] if best.label[0] != "n" else "no pipeline")  # the fastest that fits
    return d


def test_auto_weighs_the_pp_axis_and_keeps_the_faster_unpipelined_plan():
    model, inputs = _mid_gpt()
    p = autopar.plan(model, {"pp": 4, "tp": 2}, inputs, plan="auto", cluster="h100", microbatches=8)
    d = _pipeline_decision(p)
    assert p.pipeline is None and d.chosen == "no pipeline"
    assert "the least estimated step" in d.decided_by and "1f1b@pp, 8 microbatches" in d.decided_by
    assert any(r.label.startswith("1f1b@pp") for r in d.candidates)
    assert "(pipeline)" in p.explain()


def test_auto_pipelines_when_no_plan_fits_otherwise():
    """Under a limit below the least memory of every unpipelined plan (155 MB on pp4 x tp2) but above what a
    pipeline's stage needs, auto pipelines the axis and says why; below that too, it raises as before."""
    model, inputs = _mid_gpt()
    p = autopar.plan(model, {"pp": 4, "tp": 2}, inputs, plan="auto", cluster="h100", microbatches=8,
                     memory_limit=130e6)
    d = _pipeline_decision(p)
    assert p.pipeline is not None and p.pipeline.form == "1f1b" and p.pipeline.cut == (0, 1, 2, 3, 4)
    assert p.estimate.fits and p.estimate.memory_bytes_per_device <= 130e6 and p.name == "auto"
    assert "without a pipeline: no plan fits" in d.decided_by and "bubble" in d.decided_by
    with pytest.raises(autopar.InfeasibleError, match="no plan fits"):
        autopar.plan(model, {"pp": 4, "tp": 2}, inputs, plan="auto", cluster="h100", microbatches=8,
                     memory_limit=20e6)


def test_auto_microbatches_need_a_pipeline_axis():
    model, inputs = _gpt(layers=2)
    with pytest.raises(ValueError, match="auto pipelines only an axis named 'pp'"):
        autopar.plan(model, {"dp": 2, "tp": 2}, inputs, plan="auto", cluster="h100", microbatches=2)


def test_microbatch_candidates():
    from autopar.pipeline_estimate import microbatch_candidates
    assert microbatch_candidates(64, 4) == [4, 8, 16]
    assert microbatch_candidates(12, 4) == [4, 12]  # smallest divisors at or above p, 2p, 4p
    assert microbatch_candidates(3, 4) == [3]


def test_a_126_layer_405b_model_plans_on_16384_gpus_in_seconds():
    """Issue #23: offline, a Llama-3.1-405B-shaped model (126 layers) on pp16 x dp128 x tp8 plans in seconds: every
    stage from one layer's plan, whatever the depth."""
    from autopar.models import Llama, LlamaConfig
    cfg = LlamaConfig(vocab_size=128256, seq_len=8192, num_layers=126, num_heads=128, num_kv_heads=8, hidden=16384,
                      ffn_hidden=53248, rope_theta=500000.0, attention="sdpa")
    with torch.device("meta"):
        model = Llama(cfg).to(torch.bfloat16)
        ids = torch.zeros(2048, 8192, dtype=torch.long)
    t0 = time.perf_counter()
    p = autopar.plan(model, {"pp": 16, "dp": 128, "tp": 8}, (ids, ids), plan="megatron", cluster="h100",
                     overrides={"pipeline": "1f1b@pp", "checkpoint": "full"}, microbatches=16)
    assert time.perf_counter() - t0 < 30
    cut = p.pipeline.cut
    assert len(cut) == 17 and cut[-1] == 126 and all(7 <= b - a <= 8 for a, b in zip(cut, cut[1:]))
    assert len(p.checkpoint) == 126 and {lv for _, lv in p.checkpoint} == {"full"}
    assert len(p.estimate.stages) == 16 and p.estimate.stages[0].in_flight == 16
    # one sequence per microbatch per dp rank: a (1, 8192, 16384) bf16 activation crosses each boundary
    assert p.estimate.p2p_bytes_per_microbatch == 8192 * 16384 * 2
    # 16 microbatches on 16 stages: the 1F1B bubble is about (p-1)/(m+p-1) of the schedule
    assert p.estimate.bubble_s / p.estimate.step_time_s == pytest.approx(15 / 31, rel=0.05)


def test_cli_plans_a_pipeline_offline(tmp_path, capsys):
    from autopar.__main__ import main
    out = tmp_path / "plan.json"
    assert main(["plan", "--model", "examples.plan_llama:tiny", "--mesh", "pp=2,tp=2", "--cluster", "h100",
                 "--plan", "megatron", "--override", "pipeline=1f1b@pp", "--microbatches", "2", "--batch", "4",
                 "--seq", "32", "--quiet", "--out", str(out)]) == 0
    plan = Plan.load(str(out))
    assert plan.pipeline.label == "1f1b@pp" and plan.pipeline.microbatches == 2
    assert "pipeline: 1f1b@pp, 2 microbatches" in capsys.readouterr().out
    with pytest.raises(SystemExit, match="microbatches=3 must be a positive integer dividing the batch"):
        main(["plan", "--model", "examples.plan_llama:tiny", "--mesh", "pp=2,tp=2", "--plan", "megatron",
              "--override", "pipeline=1f1b@pp", "--microbatches", "3", "--batch", "4", "--seq", "32", "--quiet"])


def test_stage_model_state_follows_the_forms_on_the_remaining_axes():
    """A stage's parameters, gradients and optimizer state are its sub-mesh plan's: replicated over dp under `dp`,
    sharded over it under `fsdp` (half on dp=2), and the same layers on each rank either way."""
    model, inputs = _gpt(layers=4)
    kw = dict(cluster="h100", overrides={"pipeline": "1f1b@pp"}, microbatches=2)
    dp = autopar.plan(model, {"pp": 2, "dp": 2}, inputs, plan="dp", **kw).estimate.stages
    fsdp = autopar.plan(model, {"pp": 2, "dp": 2}, inputs, plan="fsdp", **kw).estimate.stages
    for a, b in zip(dp, fsdp):
        assert a.layers == b.layers and a.parameters_bytes > 0
        assert b.parameters_bytes == pytest.approx(a.parameters_bytes / 2, rel=0.05)
        assert b.optimizer_bytes == pytest.approx(a.optimizer_bytes / 2, rel=0.05)


def test_torch_schedule_takes_what_its_constructor_accepts():
    from autopar.pipeline_estimate import torch_schedule_takes
    assert not torch_schedule_takes("1f1b", 4, 3) and torch_schedule_takes("1f1b", 4, 4)
    # interleaved: rounds max(1, m // p); m must be a multiple of them (torch's ScheduleInterleaved1F1B)
    assert torch_schedule_takes("interleaved-1f1b", 4, 10) and not torch_schedule_takes("interleaved-1f1b", 4, 9)
    assert torch_schedule_takes("zbv", 2, 2) and torch_schedule_takes("gpipe", 4, 1)
