"""EmbeddingBag over a 2-D input (`autopar.runtime.embedding_bag`): captured as one op over the rows, split by data
parallelism for every mode (sum, mean, max), `padding_idx` and `per_sample_weights`, whether called as
`nn.EmbeddingBag` or `F.embedding_bag`.

Each model is exact against one device (loss, every gradient, parameters after an SGD step, fp64) on 2 simulated
ranks; under dp and fsdp the bag runs on each rank's rows (its input split on the batch dim, its weight replicated:
no all-gather of an activation, no "replicated" note, per-rank FLOP fraction 1/2); under megatron's tensor axis it
is replicated, as the ATen op was. The 1-D form with offsets of the user's (bags of varying length) is not
captured so: whether a rank's bags are its rows depends on the offsets' values, so it is gathered, exactly, and the
plan says so.
"""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from autopar.runtime.embedding_bag import embedding_bag_local
from autopar.spec import R, Shard
from equivalence import run_equivalence
from passes import meta as M

TOL = 1e-10
V, E, C, B, BAG = 12, 6, 5, 4, 5


class Bags(nn.Module):
    """EmbeddingBag over (B, BAG) ids -> linear -> cross-entropy. `weighted`: per-sample weights from a learned
    score per index (so their gradient is checked too); `functional`: `F.embedding_bag` on the module's weight."""

    def __init__(self, mode="mean", padding_idx=None, weighted=False, functional=False):
        super().__init__()
        self.bag = nn.EmbeddingBag(V, E, mode=mode, padding_idx=padding_idx)
        self.score = nn.Embedding(V, 1) if weighted else None
        self.functional = functional
        self.head = nn.Linear(E, C)

    def forward(self, ids, labels):
        psw = self.score(ids).squeeze(-1) if self.score is not None else None
        if self.functional:
            h = F.embedding_bag(ids, self.bag.weight, mode=self.bag.mode, padding_idx=self.bag.padding_idx,
                                per_sample_weights=psw)
        else:
            h = self.bag(ids, per_sample_weights=psw)
        return F.cross_entropy(self.head(torch.tanh(h)), labels)


def _batch():
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, V, (B, BAG), generator=g)
    ids[0, :2] = 0  # the padding index, where there is one
    ids[1, :] = 0  # a bag of padding only (mean: 0/0 handled by torch, max: an empty bag)
    return ids, torch.randint(0, C, (B,), generator=g)


CASES = {
    "sum": dict(mode="sum"),
    "mean": dict(mode="mean"),
    "max": dict(mode="max"),
    "mean-padding": dict(mode="mean", padding_idx=0),
    "max-padding": dict(mode="max", padding_idx=0),
    "sum-weighted-padding": dict(mode="sum", padding_idx=0, weighted=True),
    "functional-max-padding": dict(mode="max", padding_idx=0, functional=True),
}


def _run(ref, batch, mesh, names, plan):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        res = run_equivalence(ref, batch, mesh, names, plan=plan)
    return res, [str(w.message) for w in caught if "not parallel" in str(w.message)]


def _assert_collectives(res, ref, plan):
    """Forward: the loss's all-reduce (its (sum, valid count) pair, `fuse_loss_count_pass`) and, under fsdp, the parameters' gather; no activation is gathered.
    Backward: the gradients' reduction, every parameter once (dp: all-reduce; fsdp: reduce-scatter of what was
    gathered, all-reduce of what it keeps replicated)."""
    forward = [(k, n) for k, _, p, n, _ in res.comms if p == "forward"]
    backward = [(k, n) for k, _, p, n, _ in res.comms if p == "backward"]
    gathered = sum(n for k, n in forward if k == "all_gather")
    assert [(k, n) for k, n in forward if k != "all_gather"] == [("all_reduce", 2)], res.comms
    assert len([k for k, _ in forward if k == "all_gather"]) == (plan == "fsdp"), res.comms
    assert {k for k, _ in backward} <= {"all_reduce", "reduce_scatter"}, res.comms
    assert sum(n for k, n in backward if k == "reduce_scatter") == gathered, res.comms
    world = 2
    assert sum(n for _, n in backward) == sum(_travels(p, world if plan == "fsdp" else 1) for p in ref.parameters()), \
        res.comms


def _travels(p, world: int) -> int:
    """The elements of `p` in its gradient's reduction: fsdp's reduce-scatter of an uneven shard is padded to the
    longest shard (`autopar.forms.fsdp.padded_rows`), as FSDP2 pads dim 0."""
    from autopar.forms.fsdp import padded_rows, shard_dim
    d = shard_dim(tuple(p.shape), (), (world,)) if world > 1 else None
    if d is None or p.shape[d] % world == 0:
        return p.numel()
    return padded_rows(p.shape[d], (world,)) * world * (p.numel() // p.shape[d])


def _placements(res):
    """The lowered bag's (weight, ids, per-sample weights, output) placements, one per mesh axis."""
    (node,) = [n for n in res.graph_module.graph.nodes if n.target is embedding_bag_local]
    weight, ids, psw = node.args[:3]
    return [_placed(weight), _placed(ids), None if psw is None else _placed(psw), node.meta[M.PLACEMENTS]]


def _placed(node):
    """A node's placements; through the weight's own gathers and gradient hooks (FSDP's gather, dp's grad sync),
    to the parameter's."""
    while M.PLACEMENTS not in node.meta:
        node = node.args[0]
    return node.meta[M.PLACEMENTS]


@pytest.mark.parametrize("plan", ["dp", "fsdp"])
@pytest.mark.parametrize("case", list(CASES))
def test_bag_runs_on_the_local_rows(local_world, fp64, case, plan):
    torch.manual_seed(0)
    ref, batch = Bags(**CASES[case]), _batch()
    with local_world(2):
        res, said = _run(ref, batch, (2,), ("dp",), plan)
    assert res.max_err() < TOL, res
    assert set(res.grad_err) == {n for n, _ in ref.named_parameters()}
    _assert_collectives(res, ref, plan)
    assert not said, said
    assert not [n for n in res.plan.notes if n.startswith("replicated")], res.plan.notes
    assert res.plan.estimate.flop_fraction == pytest.approx(0.5), res.plan.estimate
    assert _placements(res) == [(R,), (Shard(0),), (Shard(0),) if CASES[case].get("weighted") else None, (Shard(0),)]


def test_bag_on_the_data_axis_of_megatron(local_world, fp64):
    """On a dp x tp mesh the bag's rows are split on dp; on tp (no input split there) it is replicated."""
    torch.manual_seed(0)
    ref, batch = Bags(**CASES["sum-weighted-padding"]), _batch()
    with local_world(4):
        res, said = _run(ref, batch, (2, 2), ("dp", "tp"), "megatron")
    assert res.max_err() < TOL, res
    assert not said, said
    assert _placements(res) == [(R, R), (Shard(0), R), (Shard(0), R), (Shard(0), R)]


class OffsetBags(nn.Module):
    """1-D ids with offsets of the user's: bags of lengths 3, 1, 4, 2 (the batch is the labels' B bags)."""

    def __init__(self):
        super().__init__()
        self.bag = nn.EmbeddingBag(V, E, mode="mean")
        self.head = nn.Linear(E, C)

    def forward(self, ids, labels):
        offsets = torch.tensor([0, 3, 4, 8])
        return F.cross_entropy(self.head(self.bag(ids, offsets)), labels)


def test_bags_with_user_offsets_are_gathered_exactly(local_world, fp64):
    g = torch.Generator().manual_seed(2)
    batch = torch.randint(0, V, (10,), generator=g), torch.randint(0, C, (B,), generator=g)
    torch.manual_seed(0)
    ref = OffsetBags()
    with local_world(2):
        res, said = _run(ref, batch, (2,), ("dp",), "dp")
    assert res.max_err() < TOL, res
    assert set(res.grad_err) == {n for n, _ in ref.named_parameters()}
    assert not [n for n in res.graph_module.graph.nodes if n.target is embedding_bag_local]
    assert len(said) == 1 and "embedding_bag (aten.embedding_bag.padding_idx in bag)" in said[0], said
    assert [c[:4] for c in res.comms if c[0] == "all_gather"] == [("all_gather", "dp", "forward", 10)], res.comms
