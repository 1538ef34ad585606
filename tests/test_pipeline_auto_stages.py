"""`plan="auto"` on a mesh with a pipeline axis chooses every rank's stage plan (issue #23, deliverable 4): under a
memory limit the unconstrained stage plan does not fit, each rank gets the ILP's forms and checkpoint levels for its
own in-flight microbatches (`pipeline_estimate._fit_ranks`, `solver.solve(in_flight=)`), and the result is at least
as fast as the brute-force best over (schedule, microbatches, cut, each rank's named stage plan and level) priced by
the same estimate. Offline (`autopar.plan`), no process group."""

from __future__ import annotations

import itertools

import pytest
import torch

LIMIT = 600_000  # bytes per device: the unconstrained stage plans do not fit (asserted below)


def _model_and_batch():
    from autopar.models import Llama, LlamaConfig
    torch.manual_seed(0)
    model = Llama(LlamaConfig(num_layers=4, num_heads=4, num_kv_heads=2))
    g = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, 128, (8, 16), generator=g)
    return model, (tokens, tokens)


@pytest.fixture(scope="module")
def captures():
    return {}  # `pipeline_estimate`'s capture cache, shared by the tests that price the same sub-models


@pytest.fixture(scope="module")
def chosen(spied):
    return spied[:3]


@pytest.fixture(scope="module")
def spied():
    """The plan, and what its search did: the unconstrained layer costs' microbatches (by id), the stage plans
    `_known` answered (lc, in-flight count, budget, answer) and every (schedule, microbatches) tried."""
    import autopar
    from autopar import pipeline_estimate as pe
    model, batch = _model_and_batch()
    inputs_of, answered, tried = {}, [], []
    layer_costs, known, auto_pipeline = pe.layer_costs, pe._known, pe.auto_pipeline

    def costs_spy(model, sub_sizes, mb_inputs, **kw):
        lc = layer_costs(model, sub_sizes, mb_inputs, **kw)
        inputs_of[id(lc)] = mb_inputs
        return lc

    def known_spy(lc, f, budget, solved):
        got = known(lc, f, budget, solved)
        if got is not None:
            answered.append((lc, f, budget, got[0]))
        return got

    def search_spy(*a, **kw):
        tried.extend(auto_pipeline(*a, **kw))
        return tried
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(pe, "layer_costs", costs_spy)
        mp.setattr(pe, "_known", known_spy)
        mp.setattr(pe, "auto_pipeline", search_spy)
        plan = autopar.plan(model, {"pp": 2, "dp": 2}, batch, plan="auto", memory_limit=LIMIT)
    return model, batch, plan, inputs_of, answered, tried


def _cuts(num_layers: int, n: int):
    for inner in itertools.combinations(range(1, num_layers), n - 1):
        yield (0, *inner, num_layers)


def test_auto_picks_memory_fit_stage_plans_no_worse_than_brute_force(chosen, captures):
    from autopar import pipeline_estimate as pe
    model, batch, plan = chosen
    assert plan.pipeline is not None and plan.estimate.fits and plan.estimate.memory_bytes_per_device <= LIMIT
    sub, mesh = {"dp": 2}, {"pp": 2, "dp": 2}
    cache = captures
    best, default_fits = None, False
    for m in (2, 4):
        mb = pe._microbatch(batch, 8, m)
        free = pe.layer_costs(model, sub, mb, plan="auto", cache=cache)  # the fixed default: no limit, one plan
        pool = [free] + [pe.layer_costs(model, sub, mb, plan="dp", overrides={"checkpoint": lv}, cache=cache)
                         for lv in ("none", "selective", "full")]
        for form, v in pe.AUTO_FORMS:
            kw = dict(form=form, axis="pp", p=2, m=m, v=v, num_layers=4, cluster=None, full_sizes=(2, 2),
                      full_names=("pp", "dp"), memory_limit=LIMIT)
            default_fits |= pe.price_pipeline(free, **kw)[1]["fits"]
            for cut in _cuts(4, 2 * v):
                for ranks in itertools.product(pool, repeat=2):
                    _, fields, _ = pe.price_pipeline(free, **kw, cut=cut, rank_lcs=list(ranks))
                    if fields["fits"] and (best is None or fields["step_time_s"] < best[0]):
                        best = (fields["step_time_s"], form, m, cut, [r.sub_plan.checkpoint for r in ranks])
    # the premise: with one unconstrained stage plan on every rank (the default), no schedule fits
    assert not default_fits
    assert best is not None
    assert plan.estimate.step_time_s <= best[0] * (1 + 1e-9), (plan.estimate.step_time_s, best)
    # the stage plans it took are not the default's: some layers recompute
    assert {lv for _, lv in plan.checkpoint} - {"none"}, plan.checkpoint


def test_explain_names_the_schedule_bubble_memory_and_each_ranks_stage_plan(chosen):
    _, _, plan = chosen
    (d,) = [d for d in plan.decisions if d.kind == "pipeline"]
    assert d.chosen == plan.pipeline.label
    text = plan.explain()
    for words in ("memory-fit stage plans", "bubble", "peak", "pp=0:", "pp=1:", "checkpoint",
                  "every rank's stage plan"):
        assert words in d.decided_by, (words, d.decided_by)
    assert "no pipeline (auto on the whole mesh)" in text
    # every layer's checkpoint level is its stage's (the cut's layers on one rank share one level)
    levels = dict(plan.checkpoint)
    cut = plan.pipeline.cut
    for k in range(len(cut) - 1):
        assert len({levels[f"layers.{i}"] for i in range(cut[k], cut[k + 1])}) == 1


def test_in_flight_counts_the_activations_against_the_limit():
    """`solver.solve(in_flight=f)`: the least memory any plan needs grows with f (activations held f times)."""
    from autopar import pipeline_estimate as pe
    from autopar.solver import InfeasibleError
    model, batch = _model_and_batch()
    least, cache = [], {}
    for f in (1, 4):
        with pytest.raises(InfeasibleError) as e:  # one capture of the two-layer model for both
            pe._sub_plan(pe._truncated(model, "layers", 2), {"dp": 2}, batch, "auto", None, None, None,
                         memory_limit=1, in_flight=f, cache=cache, key=(2, 8))
        least.append(e.value.least_bytes)
    assert least[1] > least[0]
    with pytest.raises(ValueError, match="in_flight must be a positive integer"):
        pe._sub_plan(pe._truncated(model, "layers", 2), {"dp": 2}, batch, "auto", None, None, None,
                     memory_limit=1, in_flight=0)


def test_search_shortcuts_change_no_answer(spied, captures):
    """`auto_pipeline`'s two shortcuts against doing without them: every stage plan `_known` answered from answers in
    hand is the ILP's own answer for that (microbatch, in-flight count, budget), and every (schedule, microbatches)
    its bound left unfitted (at the brute force's microbatch counts) fits no faster than the best step found."""
    from autopar import pipeline_estimate as pe
    model, batch, _, inputs_of, answered, tried = spied
    sub = {"dp": 2}
    pruned = [t for t in tried if t.pruned]
    fitted = [t for t in tried if t.fits]
    assert answered and pruned and fitted  # the premise: both shortcuts were taken here
    cache = captures
    for lc, f, budget, got in answered:
        solved = pe.stage_variant(model, sub, inputs_of[id(lc)], lc, memory_limit=budget, in_flight=f, cache=cache)
        assert (got is None) == (solved is None), (f, budget)
        if got is not None:
            assert pe.layer_time_s(got) == pytest.approx(pe.layer_time_s(solved), rel=1e-9), (f, budget)
            assert pe._stage_plan_text(got) == pe._stage_plan_text(solved), (f, budget)
    best = min(t.step_s for t in fitted)
    checked = 0
    for t in pruned:
        form, m = t.label.split("@")[0], int(t.label.split(", ")[1].split()[0])
        if m not in (2, 4):
            continue
        mb = pe._microbatch(batch, 8, m)
        lc = pe.layer_costs(model, sub, mb, plan="auto", cache=cache)
        kw = dict(form=form, axis="pp", p=2, m=m, v=dict(pe.AUTO_FORMS)[form], num_layers=4, cluster=None,
                  full_sizes=(2, 2), full_names=("pp", "dp"), optimizer="adam", memory_limit=LIMIT)

        def plain(f, b, mb=mb, lc=lc):  # the ILP every time
            return pe.stage_variant(model, sub, mb, lc, memory_limit=b, in_flight=f, cache=cache)
        _, (_, fields, _) = pe._fit_ranks(lc, kw, plain)
        assert not fields["fits"] or fields["step_time_s"] >= best * (1 - 1e-9), (t.label, fields["step_time_s"], best)
        checked += 1
    assert checked
