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
def chosen():
    import autopar
    model, batch = _model_and_batch()
    return model, batch, autopar.plan(model, {"pp": 2, "dp": 2}, batch, plan="auto", memory_limit=LIMIT)


def _cuts(num_layers: int, n: int):
    for inner in itertools.combinations(range(1, num_layers), n - 1):
        yield (0, *inner, num_layers)


def test_auto_picks_memory_fit_stage_plans_no_worse_than_brute_force(chosen):
    from autopar import pipeline_estimate as pe
    model, batch, plan = chosen
    assert plan.pipeline is not None and plan.estimate.fits and plan.estimate.memory_bytes_per_device <= LIMIT
    sub, mesh = {"dp": 2}, {"pp": 2, "dp": 2}
    cache: dict = {}
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
    least = []
    for f in (1, 4):
        with pytest.raises(InfeasibleError) as e:
            pe._sub_plan(pe._truncated(model, "layers", 2), {"dp": 2}, batch, "auto", None, None, None,
                         memory_limit=1, in_flight=f)
        least.append(e.value.least_bytes)
    assert least[1] > least[0]
    with pytest.raises(ValueError, match="in_flight must be a positive integer"):
        pe._sub_plan(pe._truncated(model, "layers", 2), {"dp": 2}, batch, "auto", None, None, None,
                     memory_limit=1, in_flight=0)
