"""Activation checkpointing levels (`autopar.forms.checkpoint`): lowered, exact, priced, chosen.

Every level on TP, SP, FSDP, ring and EP matches one device (fp64: loss, every gradient, every parameter after
an SGD step), backward really recomputes (each checkpointed layer's body runs again once per step) and issues
again exactly the forward collectives inside the checkpointed layers (`record_comms` pass "recompute"), while
forward and backward collectives stay those of the plan without checkpointing. Dropout: the masks are drawn
again identically in the recompute (checkpointed vs not checkpointed autopar runs on the same RNG stream, which
one device cannot match: autopar's dropout draws per (stream, step, node)). Saved bytes measured per level:
full < selective < none. The ILP picks none under a generous limit and a recomputing level under a tight one;
overrides force a level and bad ones raise what, got, why, fix.
"""

from __future__ import annotations

import pytest
import torch

import autopar
from memory_probe import predicted_saved_bytes
from autopar.forms import checkpoint as ckpt
from autopar.models import GPT, GPTConfig, Llama, LlamaConfig
from autopar.runtime.checkpoint import Checkpointed
from autopar.runtime.collectives import COLLECTIVES
from autopar.solver import InfeasibleError
from dist_harness import gloo_pool
from equivalence import run_equivalence
from passes.checkpoint import walk

TOL = 1e-10
FULL, SELECTIVE, NONE = ckpt.FULL.name, ckpt.SELECTIVE.name, ckpt.NONE.name


def _tokens(vocab=128, batch=4, seq=16):
    g = torch.Generator().manual_seed(0)
    return torch.randint(0, vocab, (batch, seq), generator=g), torch.randint(0, vocab, (batch, seq), generator=g)


def _gpt(**cfg):
    torch.manual_seed(0)
    return GPT(GPTConfig(**cfg))


def _llama(**cfg):
    torch.manual_seed(0)
    return Llama(LlamaConfig(**cfg))


def _moe():
    from test_moe import make_grouped_top2
    torch.manual_seed(0)
    return make_grouped_top2()


# name -> (model, mesh shape, axis names, plan, overrides)
CASES = {
    "dp": (_gpt, (2,), ("dp",), "dp", {}),  # gradient buckets: moved before the checkpointed regions
    "tp": (_gpt, (2,), ("tp",), "megatron", {}),
    "sp": (_llama, (2,), ("tp",), "megatron", {"norm": "sequence"}),
    "fsdp": (_llama, (2,), ("dp",), "fsdp", {}),
    "ring": (lambda: _llama(attention="sdpa"), (2,), ("cp",), "dp", {"attention": "ring@cp"}),
    "ep": (_moe, (2,), ("ep",), "dp", {"moe": "expert@ep"}),
}


def _inputs(case):
    make = CASES[case][0]
    old = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    try:
        return make(), _tokens()
    finally:
        torch.set_default_dtype(old)


def _summary(ref, res) -> dict:
    """What the test asserts, picklable (a gloo worker sends it back)."""
    gm = res.graph_module
    names = {n for n, _ in ref.named_parameters()}
    return dict(
        max_err=res.max_err(), compared=(set(res.grad_err) | res.idle | res.elsewhere == names
                                         and set(res.param_err) | res.elsewhere == names),
        counts=res.comm_counts, checkpoint=dict(res.plan.checkpoint),
        bodies=[(b.path, b.level, b.recomputes) for b in _bodies(gm)],
        inside=_forward_collectives_in_bodies(gm))


def _run(local_world, case, level):
    ref, inputs = _inputs(case)
    _, shape, names, plan, overrides = CASES[case]
    with local_world(2):
        res = run_equivalence(ref, inputs, shape, names, plan=plan, overrides={**overrides, "checkpoint": level})
    return _summary(ref, res)


def run_on_gloo(case, level):
    """A gloo worker's job: the case at `level` (EP's token all-to-alls need real ranks)."""
    torch.manual_seed(0)
    ref, inputs = _inputs(case)
    _, shape, names, plan, overrides = CASES[case]
    torch.set_default_dtype(torch.float64)
    try:
        res = run_equivalence(ref, inputs, shape, names, plan=plan, overrides={**overrides, "checkpoint": level})
    finally:
        torch.set_default_dtype(torch.float32)
    return _summary(ref, res)


def _check(s):
    assert s["compared"] and s["max_err"] <= TOL, s


def _bodies(gm) -> list[Checkpointed]:
    return [gm.get_submodule(n.target) for n in gm.graph.nodes if n.op == "call_module"
            and isinstance(gm.get_submodule(n.target), Checkpointed)]


def _forward_collectives_in_bodies(gm) -> dict[str, int]:
    out: dict[str, int] = {}
    for body in _bodies(gm):
        for n in body.body.graph.nodes:
            if n.op == "call_function" and n.target in COLLECTIVES and COLLECTIVES[n.target][0] != "-":
                k = COLLECTIVES[n.target][0] + ".recompute"
                out[k] = out.get(k, 0) + 1
    return out


_RUNS: dict[tuple[str, str], dict] = {}


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("level", [FULL, SELECTIVE])
def test_every_level_matches_one_device_recomputes_and_reissues_what_it_prices(local_world, case, level):
    if (case, NONE) not in _RUNS:  # the plan without checkpointing, once per case
        _RUNS[case, NONE] = gloo_pool(2).run(run_on_gloo, case, NONE)[0] if case == "ep" else \
            _run(local_world, case, NONE)
    base = _RUNS[case, NONE]
    res = gloo_pool(2).run(run_on_gloo, case, level)[0] if case == "ep" else _run(local_world, case, level)
    _check(base)
    assert not base["bodies"] and not any(k.endswith(".recompute") for k in base["counts"])
    _check(res)
    layers = list(res["checkpoint"])
    assert len(layers) == 2 and res["checkpoint"] == {p: level for p in layers}
    # one checkpointed region per layer, and backward ran each layer's forward again, once
    assert res["bodies"] == [(p, level, 1) for p in layers]
    # forward and backward collectives are the plan's; the recompute re-issues the forward ones inside the layers
    plain = {k: v for k, v in res["counts"].items() if not k.endswith(".recompute")}
    again = {k: v for k, v in res["counts"].items() if k.endswith(".recompute")}
    assert plain == base["counts"]
    want = dict(res["inside"])
    if case == "ring":  # the ring's K/V steps run inside ring attention: again whole, both levels
        want["p2p.recompute"] = base["counts"]["p2p.forward"]
    if case == "ep":  # the experts' token all-to-alls (inside the MoE node) are collectives: issued again
        want["all_to_all.recompute"] = base["counts"]["all_to_all.forward"]
    assert again == {k: v for k, v in want.items() if v}, (again, want)
    # FSDP's gathers run before the layers' regions (their full parameters are the regions' inputs, read again in
    # backward through the ZeRO-3 re-gather: `plain` has the base's backward all-gathers), DP has no forward
    # collective: nothing to issue again
    assert (sum(again.values()) == 0) == (case in ("dp", "fsdp")), again


def test_dropout_masks_are_drawn_again_identically(local_world, fp64):
    """Train-mode dropout (p=0.2) under megatron: checkpointed runs give the not checkpointed run's loss and
    gradients (the same masks in the recompute); the masks are really on (eval differs)."""
    ref = _gpt(dropout=0.2)
    inputs = _tokens()
    grads = {}
    for level in (NONE, FULL, SELECTIVE):
        import copy
        model = copy.deepcopy(ref)
        with local_world(2):
            from torch.distributed.device_mesh import init_device_mesh
            mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("tp",))
            torch.manual_seed(7)  # the dropout stream's seed (agreed_seed draws it)
            pm = autopar.parallelize(model, mesh, inputs, plan="megatron", overrides={"checkpoint": level})
            loss = pm(*inputs)
            loss.backward()
            grads[level] = (loss.detach().clone(), {n: p.grad.full_tensor() for n, p in pm.named_parameters()})
            if level != NONE:
                assert all(b.recomputes == 1 for b in _bodies(pm.graph_module))
    with torch.no_grad():
        eval_loss = ref.eval()(*inputs)
    base_loss, base = grads[NONE]
    assert abs(float(eval_loss) - _value(base_loss)) > 1e-3  # dropout is on
    for level in (FULL, SELECTIVE):
        loss, g = grads[level]
        assert abs(_value(loss) - _value(base_loss)) <= TOL
        assert max(_value((g[n] - base[n]).abs().max()) for n in base) <= TOL


def _value(t) -> float:
    lt = getattr(t, "_local_tensors", None)
    return float(next(iter(lt.values()))) if lt is not None else float(t)


# ----------------------------------------------------------------------------- saved bytes

def measure_saved_bytes(pm, inputs) -> int:
    """Bytes kept for backward after one forward on rank 0: unique storages autograd saved outside checkpointed
    layers (and the checkpoints' inputs), plus what selective layers kept (their policy's cache)."""
    seen: dict[int, int] = {}

    def local(t):
        lt = getattr(t, "_local_tensors", None)
        return lt[0] if lt is not None else t

    def pack(t):
        t0 = local(t)
        if isinstance(t0, torch.Tensor) and not isinstance(t0, torch.nn.Parameter):
            s = t0.untyped_storage()
            seen[s.data_ptr()] = s.nbytes()
        return t

    params = {local(p.to_local()).untyped_storage().data_ptr() for p in pm.parameters()}
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = pm(*inputs)
    for body in _bodies(pm.graph_module):
        for entries in (body.last_storage or {}).values() if body.level == SELECTIVE else ():
            for v in entries.values():
                for x in (v if isinstance(v, (tuple, list)) else [v]):
                    x = getattr(x, "val", x)
                    if isinstance(x, torch.Tensor):
                        s = local(x).untyped_storage()
                        seen[s.data_ptr()] = s.nbytes()
    loss.backward()
    return sum(n for ptr, n in seen.items() if ptr not in params)


def test_saved_bytes_full_below_selective_below_none(local_world, fp64):
    ref = _llama(num_layers=2, hidden=64, ffn_hidden=128, seq_len=64)  # two layers order the levels as well as four
    inputs = _tokens(seq=64)
    measured, predicted, delta = {}, {}, {}
    import copy
    for level in (NONE, SELECTIVE, FULL):
        with local_world(2):
            from torch.distributed.device_mesh import init_device_mesh
            mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("dp",))
            pm = autopar.parallelize(copy.deepcopy(ref), mesh, inputs, plan="dp", overrides={"checkpoint": level})
            measured[level] = measure_saved_bytes(pm, inputs)
            delta[level] = pm.plan.estimate.checkpoint_saved_bytes
            predicted[level] = predicted_saved_bytes(pm.plan) + delta[level]
    assert measured[FULL] < measured[SELECTIVE] < measured[NONE], measured
    # the plan's estimate: the levels' change of the saved bytes (`Estimate.checkpoint_saved_bytes`), within issue
    # #11's 0.9-1.1 of what is measured (benchmarks/checkpoint_levels.py: every plan and level)
    assert delta[NONE] == 0 and delta[FULL] < delta[SELECTIVE] < 0, delta
    for level in (NONE, SELECTIVE, FULL):
        assert predicted[level] == pytest.approx(measured[level], rel=0.1), (level, predicted, measured)


# the plans whose saved bytes per level the estimate missed (issue #11 item 7 check 1), each for its own cause:
# Llama under TP reads its residual stream twice in each checkpointed region (partial sums carried through the
# residual adds, and their all-reduced copy for the norms); under SP the row-parallel outputs selective keeps are
# whole (partial sums before their reduce-scatter); ring attention keeps nothing under selective (recomputed whole);
# selective keeps SDPA's log-sum-exp; RoPE's tables are kept once, whole where a sequence axis slices them
SAVED_CASES = {
    "llama-tp-full": ("llama", "tp", "megatron", {}, FULL),
    "llama-tp-selective": ("llama", "tp", "megatron", {}, SELECTIVE),
    "llama-sp-selective": ("llama", "tp", "megatron", {"norm": "sequence"}, SELECTIVE),
    "llama-ring-selective": ("llama", "cp", "dp", {"attention": "ring@cp"}, SELECTIVE),
    "gpt-ring-selective": ("gpt", "cp", "dp", {"attention": "ring@cp"}, SELECTIVE),
}


@pytest.mark.parametrize("case", list(SAVED_CASES))
def test_saved_bytes_per_level_are_the_plans_estimate(local_world, case):
    """Two layers, b=4, s=64, fp32: the plan's own estimate of what one rank keeps for backward at the level
    (`predicted_saved_bytes` + `Estimate.checkpoint_saved_bytes`) is what is measured, to the few bytes of the
    scalars the probe sees besides (2%; issue #11's band is 0.9-1.1; before, with four layers: Llama tp 0.713
    full / 0.857 selective, tp+sp selective 0.895, ring selective 1.155 Llama / 1.111 GPT)."""
    import copy
    from torch.distributed.device_mesh import init_device_mesh
    name, axis, plan, overrides, level = SAVED_CASES[case]
    model = (_llama(num_layers=2, hidden=64, ffn_hidden=128, seq_len=64, attention="sdpa") if name == "llama"
             else _gpt(num_layers=2, hidden=64, seq_len=64))
    inputs = _tokens(seq=64)
    with local_world(2):
        mesh = init_device_mesh("cpu", (2,), mesh_dim_names=(axis,))
        pm = autopar.parallelize(copy.deepcopy(model), mesh, inputs, plan=plan,
                                 overrides={**overrides, ckpt.KEY: level})
        measured = measure_saved_bytes(pm, inputs)
    predicted = predicted_saved_bytes(pm.plan) + pm.plan.estimate.checkpoint_saved_bytes
    assert pm.plan.estimate.checkpoint_saved_bytes < 0
    assert predicted == pytest.approx(measured, rel=0.02), (case, predicted, measured)


# ----------------------------------------------------------------------------- the solver

def _plan(memory_limit=None, overrides=None, plan="auto"):
    model = _llama(num_layers=4, hidden=64, ffn_hidden=256, seq_len=64)
    return autopar.plan(model, {"dp": 2}, _tokens(seq=64), plan=plan, memory_limit=memory_limit,
                        overrides=overrides)


def test_solver_picks_none_when_memory_allows_and_recomputes_when_tight():
    roomy = _plan()
    assert set(dict(roomy.checkpoint).values()) == {NONE}, roomy.checkpoint
    forced = {lv: _plan(plan="dp", overrides={"checkpoint": lv}).estimate for lv in (NONE, SELECTIVE, FULL)}
    need = {lv: est.memory_bytes_per_device for lv, est in forced.items()}
    # the estimate is the step's peak: once the activations fall below the end of the backward (gradients and the
    # gradient bucket's copies), recomputing more lowers it no further
    assert need[FULL] <= need[SELECTIVE] < need[NONE], need
    times = forced
    assert times[NONE].compute_time_s < times[SELECTIVE].compute_time_s < times[FULL].compute_time_s
    # selective fits (and costs less time than full); FSDP-sharding every structure without recompute does not (with
    # per-layer gathers FSDP is the cheaper lever where it fits: the ILP takes it over selective above this limit)
    fsdp_none = _plan(plan="fsdp", overrides={"checkpoint": NONE}).estimate.memory_bytes_per_device
    limit = min(need[SELECTIVE], fsdp_none - 1)
    tight = _plan(memory_limit=limit)
    assert set(dict(tight.checkpoint).values()) == {SELECTIVE}, tight.checkpoint
    assert tight.estimate.memory_bytes_per_device <= limit
    # below the tight plan (hence below any plan without recompute): recomputing, at less memory
    below = min((need[SELECTIVE] + need[FULL]) / 2, tight.estimate.memory_bytes_per_device - 1)
    tighter = _plan(memory_limit=below)
    assert NONE not in set(dict(tighter.checkpoint).values()), tighter.checkpoint
    assert tighter.estimate.memory_bytes_per_device <= below
    explained = tight.explain()
    assert ckpt.KEY in explained and "the ILP" in explained
    with pytest.raises(InfeasibleError):
        _plan(memory_limit=need[FULL] / 4)


def _meta_gpt(batch):
    with torch.device("meta"):
        model = GPT(GPTConfig(vocab_size=8192, seq_len=256, num_layers=2, num_heads=8, hidden=512)).to(torch.bfloat16)
        ids = torch.zeros(batch, 256, dtype=torch.long)
    return model, (ids, ids)


def test_the_recompute_reissues_the_tensor_parallel_forward_not_the_data_parallel_reduction():
    """Issue #23: on dp x tp, full checkpointing adds the tensor-parallel forward collectives again, priced the same
    whatever the data-parallel gradient reduction costs: dp 2 and dp 4 at the same local batch issue the same
    tensor-parallel all-reduces (the recompute runs the forward only) while their gradient reductions differ."""
    priced, on_dp = {}, {}
    for dp in (2, 4):
        model, inputs = _meta_gpt(batch=2 * dp)
        est = {lv: autopar.plan(model, {"dp": dp, "tp": 4}, inputs, plan="megatron", cluster="h100",
                                overrides={"checkpoint": lv}).estimate for lv in (NONE, FULL)}
        priced[dp] = est[FULL].comm_time_s - est[NONE].comm_time_s
        on_dp[dp] = sum(dict(s.comm_axes).get("dp", 0.0) for s in est[NONE].sites)
    assert priced[2] > 0
    assert on_dp[4] > 1.2 * on_dp[2], on_dp  # the gradient reductions differ, so a share of them would show
    assert priced[4] == pytest.approx(priced[2], rel=1e-9), (priced, on_dp)


def test_override_forces_a_level_per_glob_and_class():
    plan = _plan(overrides={"checkpoint": SELECTIVE, "checkpoint:layers.0": FULL})
    levels = dict(plan.checkpoint)
    assert levels == {"layers.0": FULL, "layers.1": SELECTIVE, "layers.2": SELECTIVE, "layers.3": SELECTIVE}
    plan = _plan(plan="megatron", overrides={"checkpoint:LlamaBlock": FULL})
    assert set(dict(plan.checkpoint).values()) == {FULL}
    assert f"activation checkpointing: layers.0, layers.1, layers.2, layers.3: {FULL}" in plan.table()
    assert set(dict(_plan(plan="megatron").checkpoint).values()) == {NONE}  # a named plan's default


def test_plan_round_trips_its_levels_and_the_strict_reader_refuses_bad_ones():
    plan = _plan(plan="dp", overrides={"checkpoint:layers.*": FULL})
    again = autopar.Plan.from_json(plan.to_json())
    assert again.checkpoint == plan.checkpoint and all(lv == FULL for _, lv in again.checkpoint)
    bad = plan.to_json().replace('"checkpoint": [', '"checkpoint": [["layers.0"], ', 1)
    with pytest.raises(ValueError, match=r"checkpoint\[0\] must be a \[layer path, checkpoint level\] pair"):
        autopar.Plan.from_json(bad)


@pytest.mark.parametrize("overrides, match", [
    ({"checkpoint": "some"}, r"override 'checkpoint': got 'some', which is not an activation checkpointing level"
                             r".*Levels: none, selective, full.*Fix"),
    ({"checkpoint:blocks.*": "full"}, r"override 'checkpoint:blocks\.\*' matches no layer: the layers are layers.0"
                                      r".*class LlamaBlock.*Fix"),
    ({"checkpoint:": "full"}, r"the layer glob after 'checkpoint:' is empty.*Fix"),
    ({"checkpoint:layers.?": "full", "checkpoint:layers.*": "none"}, r"equally specific.*Fix"),
])
def test_bad_overrides_say_what_got_why_fix(overrides, match):
    with pytest.raises(ValueError, match=match):
        _plan(plan="dp", overrides=overrides)


def test_a_saved_plan_with_a_bad_level_is_refused_when_lowered(local_world, fp64):
    import dataclasses
    plan = _plan(plan="dp")
    loaded = autopar.Plan.from_json(dataclasses.replace(plan, checkpoint=(("layers.0", "most"),)).to_json())
    ref, inputs = _llama(num_layers=4, hidden=64, ffn_hidden=256, seq_len=64), _tokens(seq=64)
    with local_world(2):
        from torch.distributed.device_mesh import init_device_mesh
        mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("dp",))
        with pytest.raises(ValueError, match="got 'most', which is not an activation checkpointing level"):
            autopar.parallelize(ref, mesh, inputs, plan=loaded)


def test_walk_sees_the_nodes_inside_checkpointed_layers(local_world):
    ref, inputs = _inputs("tp")
    with local_world(2):
        res = run_equivalence(ref, inputs, (2,), ("tp",), plan="megatron", overrides={"checkpoint": FULL})
    gm = res.graph_module
    inside = [n for b in _bodies(gm) for n in b.body.graph.nodes]
    assert inside and set(inside) <= set(walk(gm))
    assert not any(n.op == "call_function" and n.target in COLLECTIVES and n.meta.get("autopar_comm") is None
                   for n in inside)
    assert sum(1 for r in res.plan.comms if r.fn == "all_reduce") == 2 * 2 + 1  # both layers' + the loss'


def test_a_new_program_keeps_the_levels_and_eval_runs_without_recompute(local_world, fp64):
    """Another sequence length re-captures and re-lowers the plan: the layers keep their level. In eval under
    no_grad the layers just run (nothing to recompute) and match the model."""
    import copy
    ref = _gpt()
    inputs, shorter = _tokens(), _tokens(seq=8)
    with local_world(2):
        from torch.distributed.device_mesh import init_device_mesh
        mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("tp",))
        pm = autopar.parallelize(copy.deepcopy(ref), mesh, inputs, plan="megatron",
                                 overrides={"checkpoint:h.1": FULL})
        assert dict(pm.plan.checkpoint) == {"h.0": NONE, "h.1": FULL}
        pm(*shorter).backward()
        assert dict(pm.plan.checkpoint) == {"h.0": NONE, "h.1": FULL}
        assert [(b.path, b.recomputes) for b in _bodies(pm.graph_module)] == [("h.1", 1)]
        pm.eval()
        with torch.no_grad():
            got = pm(*inputs)
        assert [b.recomputes for b in _bodies(pm.graph_module)] == [0]
    with torch.no_grad():
        want = ref.eval()(*inputs)
    assert abs(_value(got) - float(want)) <= TOL


# the recompute's collectives priced against those issued: the 1-D cases, and TP beside a data axis (its gradient
# reduction is not re-issued by the recompute, only the forward's tensor-parallel all-reduces)
RECOMPUTE_CASES = {**{c: CASES[c] for c in ("tp", "sp", "fsdp")},
                   "dp_tp": (_gpt, (2, 2), ("dp", "tp"), "megatron", {})}


@pytest.mark.parametrize("case", list(RECOMPUTE_CASES))
def test_the_priced_recompute_collectives_are_the_ones_issued(local_world, case):
    """The plan's estimate charges full checkpointing the collectives its recompute issues (recorded, each priced by
    the same cost model): exactly under TP, alone or beside a data axis (forward and backward collectives mirror
    each other; the data-parallel gradient reduction is not issued again), and FSDP (none: its gathers run before
    the layers' regions; the recompute reads the ZeRO-3 re-gather, priced without checkpointing too); under SP the
    solver's half of the candidate's communication counts the backward re-gathers' share too (an upper bound,
    within 1.5x). And more compute than none."""
    import copy
    import math
    from autopar.estimate import MeshCosting
    from cost_model.hardware import load_cluster
    from autopar.runtime.collectives import record_comms
    make, shape, names, plan, overrides = RECOMPUTE_CASES[case]
    model, inputs = make(), _tokens()
    est, recs = {}, []
    for level in (NONE, FULL):
        with local_world(math.prod(shape)):
            from torch.distributed.device_mesh import init_device_mesh
            mesh = init_device_mesh("cpu", shape, mesh_dim_names=names)
            pm = autopar.parallelize(copy.deepcopy(model), mesh, inputs, plan=plan,
                                     overrides={**overrides, "checkpoint": level})
            with record_comms() as recs:
                pm(*inputs).backward()
        est[level] = pm.plan.estimate
    again = [r for r in recs if r.pass_ == "recompute"]
    assert bool(again) == (case != "fsdp")
    if case == "dp_tp":  # only the tensor-parallel forward is issued again, never the gradients' reduction on dp
        assert {r.axis for r in again} == {"tp"}, again
    mc = MeshCosting(names=names, sizes=shape, data_axes=(), cluster=load_cluster(None, shape))
    issued = sum(mc.collective(r.kind, r.numel * 4, r.axis)[0] for r in again)  # fp32
    priced = est[FULL].comm_time_s - est[NONE].comm_time_s
    if case != "sp":
        assert priced == pytest.approx(issued, rel=1e-9, abs=1e-15)
    else:
        assert issued <= priced <= 1.5 * issued, (priced, issued)
    assert est[FULL].compute_time_s > est[NONE].compute_time_s
