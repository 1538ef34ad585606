"""FSDP placements: the named `fsdp` plan and the solver's FSDP candidates follow one rule
(`autopar.forms.fsdp.shard_dim`: dim 0, else dim 1, whichever tensor parallelism leaves whole and divides
over the data ranks; where none divides, the first it leaves whole, unevenly: tests/test_fsdp_uneven.py), so `auto` can shard every parameter the hand plan shards, and never prices a
sharding the plan then cannot place."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import autopar
from autopar.api import _prepare
from autopar.forms import fsdp as fsdp_form
from autopar.forms import form_of
from autopar.planner import _Placements
from autopar.solver import all_candidates, gather_stats, model_placements
from autopar.spec import R, Shard
from equivalence import run_equivalence

VOCAB, HIDDEN, OUT = 101, 256, 6  # dims 0 (101, 6) divide over no 4 ranks; dims 1 (256) do
SHARDED = {"emb.weight": "S(1)", "fc.weight": "S(1)", "fc.bias": "S(0)"}  # the bias (6,): unevenly, 2, 2, 2, 0
DP4 = {"dp": 4}
SLACK = 4 * 1024  # the ILP counts memory in whole KiB per structure (3 here) and for the rest


class OddRows(nn.Module):
    """An embedding with an odd vocabulary and a linear with 6 outputs: no parameter's dim 0 divides over 4 data
    ranks; the weights' dims 1 do, the bias has none."""

    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(VOCAB, HIDDEN)
        self.fc = nn.Linear(HIDDEN, OUT)

    def forward(self, ids, y):
        return F.mse_loss(self.fc(self.emb(ids)), y)


def _odd_rows():
    torch.manual_seed(0)
    model = OddRows().double()
    ids = torch.randint(0, VOCAB, (8, 4))
    y = torch.randn(8, 4, OUT, dtype=torch.float64)
    return model, (ids, y)


def _limit(model, inputs) -> tuple[float, autopar.Plan]:
    """A memory limit only a plan that FSDP-shards both weights fits, and the hand `fsdp` plan."""
    hand = autopar.plan(model, DP4, inputs, plan="fsdp", cluster="cpu", memory_limit=2**40)
    # leaving either weight whole costs 2 more copies of it (adam, 4 ranks): more than the slack
    assert 2 * 8 * min(VOCAB, OUT) * HIDDEN > SLACK
    return hand.estimate.memory_bytes_per_device + SLACK, hand


def test_shard_dim_is_dim0_else_dim1_whole_under_tensor_parallelism():
    assert fsdp_form.shard_dim((8, 6), [R], [4]) == 0
    assert fsdp_form.shard_dim((6, 8), [R], [4]) == 1
    assert fsdp_form.shard_dim((6, 8), [R, R], [2, 2]) == 1  # every data axis on one dim: 4 ranks
    assert fsdp_form.shard_dim((6, 6), [R], [4]) == 0  # none divides: dim 0, unevenly
    assert fsdp_form.shard_dim((6, 6), [R], [4], uneven=False) is None
    assert fsdp_form.shard_dim((8, 8), [Shard(0)], [4]) == 1  # tensor parallel on dim 0
    assert fsdp_form.shard_dim((8, 6), [Shard(0)], [4]) == 1  # dim 1 does not divide: unevenly
    assert fsdp_form.shard_dim((8, 6), [Shard(0)], [4], uneven=False) is None
    assert fsdp_form.shard_dim((6, 6), [Shard(0), Shard(1)], [4]) is None  # both dims taken
    assert fsdp_form.shard_dim((8,), [R], [4]) == 0 and fsdp_form.shard_dim((6,), [R], [4]) == 0
    assert fsdp_form.shard_dim((), [R], [4]) is None


def test_auto_shards_on_dim1_like_the_hand_plan_and_estimates_the_same_memory():
    model, inputs = _odd_rows()
    limit, hand = _limit(model, inputs)
    assert dict(hand.params) == SHARDED, hand
    assert any("fc.bias (6,) is FSDP-sharded unevenly on dim 0" in n for n in hand.notes), hand.notes
    dp = autopar.plan(model, DP4, inputs, plan="dp", cluster="cpu", memory_limit=limit)
    assert not dp.estimate.fits  # replicated weights do not fit: auto must shard
    auto = autopar.plan(model, DP4, inputs, plan="auto", cluster="cpu", memory_limit=limit)
    assert auto.estimate.fits
    assert dict(auto.params) == SHARDED, auto
    assert {s.form for s in auto.strategies} == {"replicate"}, auto.strategies
    assert auto.estimate.memory_bytes_per_device == hand.estimate.memory_bytes_per_device
    # adam: 4 copies of a replicated parameter (at the step's peak, the end of backward here: parameter, 2 moments,
    # gradient), and 1 more of every gradient while their bucket is all-reduced (its flat copy, reduced in place);
    # FSDP on 4 ranks: 4/4 of its shards, plus its gathered copy where backward reads it (the linear's weight; the
    # embedding table's copy is freed after the lookup), and 2 copies of its group's gradients while they are
    # reduce-scattered (unsharded and flat; one group, not gathered again: `forms.fsdp.reduce_transient_bytes`; the
    # group's bytes as `estimate.fsdp_groups` counts them). The linear's weight saves 2 copies, the table 3, the
    # bucket adds all of them once and FSDP's reduction twice; the bias (6,), sharded unevenly, 4 copies of it
    # replicated against 4 of its shard padded to 2 elements
    size = {n: p.numel() * p.element_size() for n, p in model.named_parameters()}
    assert dp.estimate.memory_bytes_per_device - hand.estimate.memory_bytes_per_device == \
        2 * size["fc.weight"] + 3 * size["emb.weight"] + sum(size.values()) - 2 * sum(size.values()) \
        + 4 * size["fc.bias"] - 4 * 2 * 8
    # the solver offers FSDP for both structures (before: refused, dim 0 does not divide over 4 ranks)
    _, _, ctx = _prepare(model, DP4, inputs, None)
    info = _prepare(model, DP4, inputs, None)[0]
    stats, _, _ = gather_stats(ctx)
    for site in ctx.planning_sites():
        rows = {c.label: why for c, why in all_candidates(site, stats[site.key], info, ("dp",))}
        if site.all_params():
            assert rows["replicate+fsdp"] == "", (site.key, rows)


def test_auto_plan_sharded_on_dim1_matches_one_device(local_world, fp64):
    model, inputs = _odd_rows()
    limit, _ = _limit(model, inputs)
    planned = autopar.plan(model, DP4, inputs, plan="auto", cluster="cpu", memory_limit=limit)
    numels = {n: p.numel() for n, p in model.named_parameters()}
    with local_world(4):
        res = run_equivalence(model, inputs, (4,), ("dp",), plan="auto", cluster="cpu", memory_limit=limit)
    assert res.plan.params == planned.params and res.plan.strategies == planned.strategies
    assert set(res.grad_err) == set(res.param_err) == set(numels)
    assert abs(res.loss - res.ref_loss) <= 1e-12 * max(1.0, abs(res.ref_loss)), (res.loss, res.ref_loss)
    assert max(res.grad_err.values()) <= 1e-12, res.grad_err
    assert max(res.param_err.values()) <= 1e-12, res.param_err
    local = {n: k.node._local_ints if isinstance(k, torch.SymInt) else k  # uneven: per simulated rank
             for n, k in res.local_numel.items()}
    assert local == {"emb.weight": VOCAB * HIDDEN // 4, "fc.weight": OUT * HIDDEN // 4,
                     "fc.bias": {0: 2, 1: 2, 2: 2, 3: 0}}, local
    # FSDP: every parameter (the model has no layers: one group, kept gathered for backward as FSDP2's root)
    # all-gathered as one flat buffer on dp forward (gathered numel, the bias (6,) padded to 4 x 2; a rank sends 3/4
    # of its fp64 bytes) and their gradients reduce-scattered as one; the loss all-reduced once
    gathered = {"fc.weight": OUT * HIDDEN, "emb.weight": VOCAB * HIDDEN, "fc.bias": 4 * 2}
    n = sum(gathered.values())
    want = [("all_gather", "dp", "forward", n, 3 * n * 8 // 4), ("reduce_scatter", "dp", "backward", n, 3 * n * 8 // 4),
            ("all_reduce", "dp", "forward", 1, 3 * 8 // 2)]
    assert sorted(res.comms) == sorted(want), res.comms
    rows = [(r.bytes_forward, r.bytes_backward) for r in res.plan.comms if r.fn == "fsdp_gather"]
    assert rows == [(3 * n * 8 // 4, 3 * n * 8 // 4)], res.plan.comms
    assert {(d.kind.value, d.node, d.axis) for d in res.plan.directives} >= {("gather", n, "dp") for n in gathered}


class EmbMlp(nn.Module):
    """An embedding (vocab 64, hidden 6) and an MLP 6 -> 16 -> 6: tensor parallelism shards the embedding's dim 0,
    the MLP's column weight's dim 0 and its row weight's dim 1."""

    def __init__(self, vocab=64, hidden=6, ffn=16):
        super().__init__()
        self.emb = nn.Embedding(vocab, hidden)
        self.up = nn.Linear(hidden, ffn, bias=False)
        self.down = nn.Linear(ffn, hidden, bias=False)

    def forward(self, ids, y):
        return F.mse_loss(self.down(F.gelu(self.up(self.emb(ids)))), y)


def _meta_gpt():
    from autopar.models import GPT, GPTConfig
    with torch.device("meta"):
        model = GPT(GPTConfig(vocab_size=1000, seq_len=16, num_layers=1, num_heads=4, hidden=24))
        ids = torch.zeros(8, 16, dtype=torch.long)
    return model, (ids, ids)


CASES = {
    "odd-rows/dp4": (_odd_rows, DP4),
    "emb-mlp/dp4xtp2": (lambda: (EmbMlp(), (torch.zeros(8, 4, dtype=torch.long), torch.zeros(8, 4, 6))),
                        {"dp": 4, "tp": 2}),
    "emb-mlp/dp2xtp2": (lambda: (EmbMlp(vocab=63, hidden=8), (torch.zeros(8, 4, dtype=torch.long),
                                                              torch.zeros(8, 4, 8))), {"dp": 2, "tp": 2}),
    "gpt/dp2xtp4": (_meta_gpt, {"dp": 2, "tp": 4}),
}


@pytest.mark.parametrize("case", list(CASES))
def test_solver_prices_fsdp_on_the_parameters_the_plan_shards(case):
    """Every structure, form and axes with data axis dp: the parameters the solver prices whole under FSDP are those
    the planner, given that form's placements, leaves whole; it offers FSDP iff the planner shards one."""
    make, mesh = CASES[case]
    model, inputs = make()
    info, _, ctx = _prepare(model, mesh, inputs, None)
    stats, _, _ = gather_stats(ctx)
    data = info.names.index("dp")
    seen = {True: 0, False: 0}
    for site in ctx.planning_sites():
        if not site.all_params():
            continue
        for cand, why in all_candidates(site, stats[site.key], info, ("dp",)):
            if not cand.fsdp:
                continue
            pls = _Placements(ctx, info)
            pls.assign(site, cand)
            pls.shard_fsdp(site.all_params(), ["dp"], [])
            left = {ph for ph in site.all_params() if pls.pls[ph][data] == R}
            sizes = [info.axis(a).size for a in cand.axes]
            model_pls = model_placements(site, form_of(site.kind, cand.form), cand.axes, info.names, sizes)
            assert fsdp_form.whole(stats[site.key], (info.axis("dp").size,), model_pls) == left, (site.key, cand)
            assert (why == "") == (left != site.all_params()), (site.key, cand.label, why, left)
            assert not why or why.startswith("FSDP: no parameter ("), why
            seen[why == ""] += 1
    assert seen[True], seen
    if case == "emb-mlp/dp4xtp2":  # vocab@tp takes the embedding's dim 0; its dim 1 (6) is sharded unevenly on 4 ranks
        assert not seen[False], seen
