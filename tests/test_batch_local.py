"""Batch-local computations (`passes.batch_local`): an op without a sharding rule, an opaque submodule, a custom
autograd.Function kept whole, or an op whose rule gathers the batch (eval BatchNorm) runs on each rank's rows when
capture finds its rows independent; one that mixes rows (a softmax over the batch, ruled) stays gathered, and
`parallelize` warns naming it with the share of FLOPs run redundantly.

Each model is exact against one device (loss, every gradient, parameters after an SGD step, fp64) under dp and fsdp
on 2 simulated ranks; the lowered graph's collectives show whether the batch stays split (no all-gather of an
activation), and the plan's estimate gives the per-rank FLOP fraction.
"""

from __future__ import annotations

import re
import warnings

import pytest
import torch
from torch import nn

from autopar.capture import capture
from autopar.spec import R, Shard
from equivalence import run_equivalence
from passes import meta as M

TOL = 1e-10
V, E, H, B, S = 16, 6, 8, 4, 5


class RNNLM(nn.Module):
    """embedding -> nn.LSTM / nn.GRU / nn.RNN (batch_first) -> linear -> cross-entropy."""

    def __init__(self, cell=nn.LSTM):
        super().__init__()
        self.emb = nn.Embedding(V, E)
        self.rnn = cell(E, H, batch_first=True)
        self.head = nn.Linear(H, V)

    def forward(self, tokens, labels):
        h, _ = self.rnn(self.emb(tokens))
        return nn.functional.cross_entropy(self.head(h).flatten(0, 1), labels.flatten())


def _tokens():
    g = torch.Generator().manual_seed(1)
    return torch.randint(0, V, (B, S), generator=g), torch.randint(0, V, (B, S), generator=g)


class RowBranch(nn.Module):
    """Data-dependent control flow per row (torch.export cannot trace `.item()`): opaque, and row-local."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(H, H)

    def forward(self, x):
        return torch.stack([self.lin(r) if r.sum().item() > 0 else torch.tanh(r) * 2 for r in x])


class MixRows(nn.Module):
    """Data-dependent control flow that mixes rows (x - x.mean(0)): opaque, not batch-local."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(H, H)

    def forward(self, x):
        h = self.lin(x)
        return h - h.mean(0) if h.abs().sum().item() > 0 else h


class RoundSTE(torch.autograd.Function):
    """Round forward, identity backward (kept whole: its backward is not its forward's derivative); row-local."""

    @staticmethod
    def forward(ctx, x):
        return torch.round(x * 4) / 4

    @staticmethod
    def backward(ctx, g):
        return g


class CenterGrad(torch.autograd.Function):
    """Identity forward, backward centres the gradient over the batch: its backward mixes rows."""

    @staticmethod
    def forward(ctx, x):
        return x.clone()

    @staticmethod
    def backward(ctx, g):
        return g - g.mean(0)


@torch.library.custom_op("autopar_test::row_gate", mutates_args=())
def row_gate(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """A custom kernel without a sharding rule: each row gated by sigmoid(row . w) (row-local)."""
    return x * torch.sigmoid(x @ w)[:, None]


@row_gate.register_fake
def _(x, w):
    return torch.empty_like(x)


@torch.library.custom_op("autopar_test::center_rows", mutates_args=())
def center_rows(x: torch.Tensor) -> torch.Tensor:
    """A custom kernel that mixes rows: x - x.mean(0)."""
    return x - x.mean(0)


@center_rows.register_fake
def _(x):
    return torch.empty_like(x)


def _save_inputs(ctx, inputs, output):
    ctx.save_for_backward(*inputs)


def _own_backward(fn):
    def backward(ctx, g):
        xs = [t.detach().requires_grad_() for t in ctx.saved_tensors]
        with torch.enable_grad():
            return torch.autograd.grad(fn(*xs), xs, g)
    return backward


row_gate.register_autograd(_own_backward(lambda x, w: x * torch.sigmoid(x @ w)[:, None]), setup_context=_save_inputs)
center_rows.register_autograd(_own_backward(lambda x: x - x.mean(0)), setup_context=_save_inputs)


class CustomOp(nn.Module):
    def __init__(self, mixes: bool):
        super().__init__()
        self.mixes = mixes
        self.gate = nn.Parameter(torch.randn(H))

    def forward(self, x):
        return center_rows(x) * self.gate if self.mixes else row_gate(x, self.gate)


class Wrapped(nn.Module):
    """linear -> the part under test -> linear -> mean squared error."""

    def __init__(self, part):
        super().__init__()
        self.up = nn.Linear(H, H)
        self.part = part
        self.down = nn.Linear(H, H)

    def forward(self, x, y):
        h = self.up(x)
        h = self.part.apply(h) if isinstance(self.part, type) else self.part(h)
        return ((self.down(h) - y) ** 2).mean()


class EvalBatchNorm(nn.Module):
    """BatchNorm on its running statistics (eval): an op with a sharding rule (DTensor's `native_batch_norm`) that
    gathers the batch, though its rows are independent."""

    def __init__(self):
        super().__init__()
        self.weight, self.bias = nn.Parameter(torch.randn(H)), nn.Parameter(torch.randn(H))
        self.register_buffer("mean", torch.randn(H))
        self.register_buffer("var", torch.rand(H) + 0.5)

    def forward(self, x):
        return torch.nn.functional.batch_norm(x, self.mean, self.var, self.weight, self.bias, training=False)


class SoftmaxOverBatch(nn.Module):
    """A ruled op that mixes rows: softmax over the batch dim (its rule gathers the batch, rightly)."""

    def forward(self, x):
        return torch.softmax(x, 0)


def _dense():
    g = torch.Generator().manual_seed(2)
    return torch.randn(8, H, generator=g, dtype=torch.float64), torch.randn(8, H, generator=g, dtype=torch.float64)


# (an opaque module branching per row runs on gloo ranks: `test_row_local_opaque_module_on_gloo`; simulated ranks
# cannot branch apart on `.item()`)
MODELS = {
    "lstm": (lambda: RNNLM(nn.LSTM), _tokens, True),
    "gru": (lambda: RNNLM(nn.GRU), _tokens, True),
    "rnn": (lambda: RNNLM(nn.RNN), _tokens, True),
    "function-row-local": (lambda: Wrapped(RoundSTE), _dense, True),
    "custom-op-row-local": (lambda: Wrapped(CustomOp(mixes=False)), _dense, True),
    "custom-op-mixes-rows": (lambda: Wrapped(CustomOp(mixes=True)), _dense, False),
    "opaque-mixes-rows": (lambda: Wrapped(MixRows()), _dense, False),
    "function-backward-mixes-rows": (lambda: Wrapped(CenterGrad), _dense, False),
    "ruled-row-local": (lambda: Wrapped(EvalBatchNorm()), _dense, True),
    "ruled-mixes-rows": (lambda: Wrapped(SoftmaxOverBatch()), _dense, False),
}
GATHERED_OP = {"custom-op-mixes-rows": "autopar_test.center_rows.default", "ruled-mixes-rows": "aten.softmax.int"}


def _run(ref, batch, plan):
    """`run_equivalence` on a 1-D data mesh of 2, and the warnings it gave that the batch is not split."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        res = run_equivalence(ref, batch, (2,), ("dp",), plan=plan)
    return res, [str(w.message) for w in caught if "not parallel" in str(w.message)]


def _gloo_row_branch(plan):
    """On a gloo rank: the per-row branching opaque model, exact, its collectives, the warnings, the FLOP fraction."""
    torch.manual_seed(0)
    torch.set_default_dtype(torch.float64)
    try:
        res, said = _run(Wrapped(RowBranch()), _dense(), plan)
    finally:
        torch.set_default_dtype(torch.float32)
    notes = [n for n in res.plan.notes if "opaque" in n or n.startswith("replicated")]
    return res.max_err(), set(res.grad_err), res.graph_counts, said, res.plan.estimate.flop_fraction, notes


def _gathers(res) -> int:
    """All-gathers of activations in the lowered graph (FSDP's parameter gathers are `fsdp_gather` nodes)."""
    counts = res if isinstance(res, dict) else res.graph_counts
    return sum(n for k, n in counts.items() if k.startswith("all_gather"))


@pytest.mark.parametrize("plan", ["dp", "fsdp"])
@pytest.mark.parametrize("name", list(MODELS))
def test_batch_local_runs_on_the_local_rows(local_world, fp64, name, plan):
    make, inputs, local = MODELS[name]
    torch.manual_seed(0)
    ref, batch = make(), inputs()
    with local_world(2):
        res, said = _run(ref, batch, plan)
    assert res.max_err() < TOL, res
    assert set(res.grad_err) == {n for n, _ in ref.named_parameters()}
    work = res.graph_module.meta[M.WORK]
    fraction = res.plan.estimate.flop_fraction
    assert fraction == pytest.approx(work.fraction)
    if local:
        assert _gathers(res) == 0, res.graph_counts  # the batch stays split through the computation
        assert not said, said
        assert fraction == pytest.approx(0.5), fraction  # every FLOP split over the 2 ranks
        assert not [n for n in res.plan.notes if n.startswith("replicated")], res.plan.notes
    else:
        assert _gathers(res) >= 1, res.graph_counts
        assert len(said) == 1, said
        found, share = work.redundant(("dp",))
        assert [op for _, op, _, _, _ in found] == [GATHERED_OP.get(name, "autopar.opaque.default")], found
        assert re.search(rf" {share:.1%} of the model's FLOPs run redundantly; each rank runs {fraction:.3f} ",
                         said[0]), said[0]
        assert fraction > 0.5


def test_lstm_on_the_data_axis_of_megatron(local_world, fp64):
    """Megatron's data axis splits the LSTM's batch too (the tensor-parallel axis leaves it whole)."""
    torch.manual_seed(0)
    ref, batch = RNNLM(nn.LSTM), _tokens()
    with local_world(4), warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        res = run_equivalence(ref, batch, (2, 2), ("dp", "tp"), plan="megatron")
    assert res.max_err() < TOL, res
    (lstm,) = [n for n in res.graph_module.graph.nodes if n.target is torch.ops.aten.lstm.input]
    assert lstm.meta[M.PLACEMENTS] == [(Shard(0), R), (Shard(1), R), (Shard(1), R)], lstm.meta[M.PLACEMENTS]
    assert not [w for w in caught if "not parallel" in str(w.message)]
    assert res.plan.estimate.flop_fraction <= 0.5 + 1e-9


def test_ruled_batch_local_op_under_megatron(local_world, fp64):
    """Eval BatchNorm under megatron on dp x tp: on the data axis, where its rule would gather the batch, it runs on
    the local rows; on the model axis (its input replicated there) as its rule says."""
    torch.manual_seed(0)
    ref, batch = Wrapped(EvalBatchNorm()), _dense()
    with local_world(4), warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        res = run_equivalence(ref, batch, (2, 2), ("dp", "tp"), plan="megatron")
    assert res.max_err() < TOL, res
    assert set(res.grad_err) == {n for n, _ in ref.named_parameters()}
    (bn,) = [n for n in res.graph_module.graph.nodes if n.target is torch.ops.aten.native_batch_norm.default]
    assert bn.meta[M.PLACEMENTS][0] == (Shard(0), R), bn.meta[M.PLACEMENTS]
    assert not [w for w in caught if "not parallel" in str(w.message)]
    assert not [n for n in res.plan.notes if n.startswith("replicated")], res.plan.notes


def _big_lstm():
    """An LSTM language model large enough that auto splits its batch on an H100 (planned on shapes only)."""
    model = RNNLM(nn.LSTM)
    model.emb, model.rnn, model.head = nn.Embedding(512, 256), nn.LSTM(256, 256, batch_first=True), nn.Linear(256, 512)
    g = torch.Generator().manual_seed(3)
    return model, (torch.randint(0, 512, (64, 64), generator=g), torch.randint(0, 512, (64, 64), generator=g))


def test_auto_splits_a_batch_local_lstm_and_prices_what_it_cannot():
    """auto splits the LSTM's batch (batch-local: priced divided by the data axis); a row-mixing opaque module is
    priced whole on every data rank plus its gathers, and explain says so."""
    import autopar
    model, batch = _big_lstm()
    plan = autopar.plan(model, {"dp": 4}, batch, plan="auto", cluster="h100", lower=True)
    assert dict(plan.inputs)["tokens"] == "S(0)", plan.inputs
    assert not [c for c in plan.comms if c.module == "rnn" and c.fn.startswith("all_gather")], plan.comms
    assert plan.estimate.flop_fraction == pytest.approx(0.25) and not plan.estimate.unsplit_ops
    mixed = Wrapped(MixRows())
    mixed.up, mixed.part.lin, mixed.down = nn.Linear(64, 512), nn.Linear(512, 512), nn.Linear(512, 64)
    g = torch.Generator().manual_seed(4)
    dense = torch.randn(256, 64, generator=g), torch.randn(256, 64, generator=g)
    dp = autopar.plan(mixed, {"dp": 4}, dense, plan="dp", cluster="h100", lower=True)
    est = dp.estimate
    assert est.unsplit_ops == ("opaque (autopar.opaque.default)",), est.unsplit_ops
    assert est.unsplit_compute_s > 0 and est.unsplit_comm_s > 0, est
    assert est.flop_fraction > 0.5, est.flop_fraction
    assert "(batch gathered) 1 op(s)" in dp.explain() and "ms of compute not divided" in dp.explain()
    # auto weighs that: here splitting the batch does not pay (the opaque matmul is most of the work), and its
    # explain says what every data role was charged
    auto = autopar.plan(mixed, {"dp": 4}, dense, plan="auto", cluster="h100")
    assert dict(auto.inputs)["x"] == "R" and not auto.estimate.unsplit_ops, auto.inputs
    roles = auto.explain().split("\n\n")[0]
    assert "each assignment with data axes runs 1 op that gathers the batch (no sharding rule, or a rule that " \
           "gathers it) and is not batch-local (opaque (autopar.opaque.default)) whole on every data rank" in roles, \
        roles


def test_lstm_batch_dims_found_numerically():
    """An LSTM's output has the batch on dim 0 (batch_first), its (h_n, c_n) and initial state on dim 1."""
    torch.set_default_dtype(torch.float64)
    try:
        cap = capture(RNNLM(nn.LSTM), _tokens(), {})
    finally:
        torch.set_default_dtype(torch.float32)
    (lstm,) = [n for n in cap.gm.graph.nodes if n.target is torch.ops.aten.lstm.input]
    rows = lstm.meta[M.ROWS]
    assert rows.local and rows.out_dims == (0, 1, 1), rows
    assert rows.in_dims[:3] == (0, 1, 1) and set(rows.in_dims[3:]) == {None}, rows  # x, (h0, c0), parameters
    assert rows.flops == 2 * B * S * 4 * H * (E + H)  # the gates' matmuls, as torch's FLOP counter counts them


def test_a_batch_as_large_as_the_layer_count_neither_crashes_nor_confuses_the_dims():
    """Two stacked layers and a batch of 2 (a pipeline microbatch, a small per-rank batch): the initial state
    `(h0, c0)` is (2 layers, 2 rows, H), so either dim may be the batch. The check once tried h0 on one dim and c0
    on the other, and `aten.lstm` read past the smaller state: the process died (SIGSEGV) at capture."""
    model = RNNLM(nn.LSTM)
    model.rnn = nn.LSTM(E, H, num_layers=2, batch_first=True)
    tokens, labels = _tokens()
    cap = capture(model, (tokens[:2], labels[:2]), {})
    (lstm,) = [n for n in cap.gm.graph.nodes if n.target is torch.ops.aten.lstm.input]
    rows = lstm.meta[M.ROWS]
    assert rows.local and rows.out_dims == (0, 1, 1) and rows.in_dims[:3] == (0, 1, 1), rows


def test_a_meta_device_lstm_is_checked_on_random_inputs():
    """A model on the meta device (no weights to run) is checked alike: the row check draws its own CPU inputs."""
    import autopar
    with torch.device("meta"):
        model = RNNLM(nn.LSTM)
    plan = autopar.plan(model, {"dp": 2}, _tokens(), plan="dp", lower=True)
    assert plan.estimate.flop_fraction == pytest.approx(0.5) and not plan.estimate.unsplit_ops, plan.estimate
    assert not [n for n in plan.notes if n.startswith("replicated")], plan.notes


def test_repeated_layers_are_checked_once(monkeypatch):
    """The check is cached by (op, shapes, arguments): a second LSTM layer of the same shape adds no check."""
    import passes.batch_local as bl

    class Stack(nn.Module):
        def __init__(self, layers):
            super().__init__()
            self.emb = nn.Embedding(V, H)
            self.layers = nn.ModuleList(nn.LSTM(H, H, batch_first=True) for _ in range(layers))

        def forward(self, tokens):
            h = self.emb(tokens)
            for layer in self.layers:
                h = layer(h)[0]
            return h.sum()

    calls = []
    real = bl._row_check
    monkeypatch.setattr(bl, "_row_check", lambda *a: calls.append(1) or real(*a))
    counts = []
    for layers in (1, 2):
        calls.clear()
        cap = capture(Stack(layers), (_tokens()[0],), {})
        rows = [n.meta[M.ROWS] for n in cap.gm.graph.nodes if n.target is torch.ops.aten.lstm.input]
        assert len(rows) == layers and all(r.local for r in rows), rows
        counts.append(len(calls))
    assert counts[0] >= 1 and counts[1] == counts[0], counts


def test_a_row_mixing_opaque_module_says_why_in_the_notes(local_world, fp64):
    torch.manual_seed(0)
    ref, batch = Wrapped(MixRows()), _dense()
    with local_world(2):
        res = run_equivalence(ref, batch, (2,), ("dp",), plan="dp")
    (note,) = [n for n in res.plan.notes if n.startswith("part captured as one opaque node")]
    assert "replicated on every rank (not batch-local: its output 0 on a subset of the rows" in note, note


def test_row_local_opaque_module_on_gloo():
    """An opaque submodule whose control flow branches on each row's values (`.item()`) runs on each rank's rows
    under dp and fsdp (real ranks: each branches on its own rows)."""
    from dist_harness import gloo_pool
    names = {n for n, _ in Wrapped(RowBranch()).named_parameters()}
    for plan in ("dp", "fsdp"):
        for err, grads, counts, said, fraction, notes in gloo_pool(2).run(_gloo_row_branch, plan):
            assert err < TOL and grads == names, (plan, err, grads)
            assert _gathers(counts) == 0 and not said, (plan, counts, said)
            assert fraction == pytest.approx(0.5), (plan, fraction)
            assert len(notes) == 1 and "part captured as one opaque node, batch-local" in notes[0], notes
