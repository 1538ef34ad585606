"""Each form's exact collectives: graph nodes, Plan.comms rows (with bytes) and what runs (record_comms).

Expected numbers are derived here from the forms in DESIGN.md §3, never copied from output:

* row-parallel linear: its Partial output is all-reduced forward (identity backward);
* column-parallel linear: its replicated input's gradient is all-reduced backward (`grad_all_reduce`, fused with
  the linears into `grad_all_reduce_linears`), only when that input depends on a parameter (a user input has no
  gradient, so nothing to reduce);
* a Megatron layer (attention heads + MLP) therefore moves 2 all-reduces forward and 2 backward of
  b*s*h activations each;
* vocab-parallel embedding: one forward all-reduce of its b*s*h Partial output, nothing backward;
* vocab-parallel cross-entropy: 3 forward all-reduces of b*s values (max, target logit, sum of exps),
  computed inside the op, in at least fp32 (fp64 here: the logits are fp64);
* data parallel: one gradient all-reduce per distinct parameter, forward only the scalar loss
  (plus the global valid-token count of a mean cross-entropy over a sharded batch).

Bytes are what each rank sends with ring algorithms: an all-reduce of n elements of size e on p ranks
sends 2(p-1)/p * n * e bytes.
"""

from __future__ import annotations

import copy
from collections import Counter

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import init_device_mesh

import autopar
from autopar.models import GPT, MLP, GPTConfig, Llama, LlamaConfig
from autopar.runtime.collectives import record_comms
from passes.lower import collective_nodes

F64 = 8  # bytes per fp64 element


def ar_bytes(numel: int, p: int, itemsize: int = F64) -> int:
    """Bytes each rank sends in a ring all-reduce of `numel` elements over p ranks."""
    return round(2 * (p - 1) / p * numel * itemsize)


class NormMLP(nn.Module):
    """LayerNorm then the MLP: the MLP's input depends on a parameter, so its gradient must be reduced."""

    def __init__(self, dim: int = 16, hidden: int = 64):
        super().__init__()
        self.norm = nn.LayerNorm(dim)
        self.fc1 = nn.Linear(dim, hidden)
        self.fc2 = nn.Linear(hidden, dim)

    def forward(self, x, y):
        return F.mse_loss(self.fc2(torch.relu(self.fc1(self.norm(x)))), y)


class EmbedOnly(nn.Module):
    """An embedding straight into a loss: its vocab-parallel form needs exactly one all-reduce."""

    def __init__(self, vocab: int = 128, dim: int = 32):
        super().__init__()
        self.emb = nn.Embedding(vocab, dim)

    def forward(self, ids, y):
        return F.mse_loss(self.emb(ids), y)


class Run:
    """A parallelised model after one forward and backward, with what ran."""

    def __init__(self, pm, fwd, bwd, ref):
        self.pm, self.plan, self.fwd, self.bwd, self.ref = pm, pm.plan, fwd, bwd, ref

    def graph_counts(self) -> Counter:
        return Counter(n.target.__name__ for n in collective_nodes(self.pm.graph_module))

    def runtime_counts(self) -> Counter:
        return Counter(f"{r.kind}.{r.pass_}" for r in self.fwd + self.bwd)

    def rows(self, axis=None, prefix=None, fn=None):
        return [c for c in self.plan.comms
                if (axis is None or c.axis == axis) and (fn is None or c.fn == fn)
                and (prefix is None or c.module == prefix or c.module.startswith(prefix + "."))]


def parallel_run(local_world, model, inputs, shape, names, plan="megatron", overrides=None) -> Run:
    world = 1
    for s in shape:
        world *= s
    ref = copy.deepcopy(model)
    with local_world(world):
        mesh = init_device_mesh("cpu", shape, mesh_dim_names=names)
        pm = autopar.parallelize(model, mesh, inputs, plan=plan, overrides=overrides)
        with record_comms() as fwd:
            loss = pm(*inputs)
        with record_comms() as bwd:
            loss.backward()
    assert len(pm.plan.comms) == len(collective_nodes(pm.graph_module)), "one Plan.comms row per collective node"
    return Run(pm, list(fwd), list(bwd), ref)


def _fp64(make):
    old = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    try:
        torch.manual_seed(0)
        return make()
    finally:
        torch.set_default_dtype(old)


def _tokens(b, s, vocab=128):
    g = torch.Generator().manual_seed(0)
    return torch.randint(0, vocab, (b, s), generator=g), torch.randint(0, vocab, (b, s), generator=g)


def _dense(b, d):
    g = torch.Generator().manual_seed(0)
    return (torch.randn(b, d, generator=g, dtype=torch.float64), torch.randn(b, d, generator=g, dtype=torch.float64))


# ---------------------------------------------------------------------------------------------- MLP


def test_mlp_tp2_on_a_user_input_all_reduces_once_forward(local_world):
    """fc1 colwise, fc2 rowwise. The input x is a user input (no gradient), so the colwise input needs no
    backward all-reduce: the whole step is the one forward all-reduce of fc2's (b, d) output."""
    b, d, t = 8, 16, 2
    run = parallel_run(local_world, _fp64(MLP), _dense(b, d), (t,), ("tp",))
    assert run.graph_counts() == {"all_reduce": 1}, run.plan
    (row,) = run.plan.comms
    assert (row.fn, row.axis, row.forward, row.backward) == ("all_reduce", "tp", "all_reduce", "-")
    assert row.module == "fc2"
    assert (row.bytes_forward, row.bytes_backward) == (ar_bytes(b * d, t), 0)
    assert run.runtime_counts() == {"all_reduce.forward": 1}
    assert [r.numel for r in run.fwd] == [b * d]
    assert run.plan.comm_counts() == run.runtime_counts()
    assert sum(r.send_bytes for r in run.fwd + run.bwd) == run.plan.comm_bytes_per_step()


def test_mlp_tp2_with_a_parameter_dependent_input_reduces_its_gradient(local_world):
    """LayerNorm -> fc1 (colwise) -> fc2 (rowwise): Megatron's f/g pair, 1 all-reduce forward (fc2's output)
    and 1 backward (the gradient of fc1's replicated input, which flows on into the norm's weights)."""
    b, d, t = 8, 16, 2
    run = parallel_run(local_world, _fp64(NormMLP), _dense(b, d), (t,), ("tp",))
    assert run.graph_counts() == {"all_reduce": 1, "grad_all_reduce_linears": 1}, run.plan
    fwd_row = run.rows(fn="all_reduce")[0]
    bwd_row = run.rows(fn="grad_all_reduce_linears")[0]
    assert (fwd_row.module, fwd_row.bytes_forward, fwd_row.bytes_backward) == ("fc2", ar_bytes(b * d, t), 0)
    assert (bwd_row.module, bwd_row.bytes_forward, bwd_row.bytes_backward) == ("fc1", 0, ar_bytes(b * d, t))
    assert run.runtime_counts() == {"all_reduce.forward": 1, "all_reduce.backward": 1}
    assert [r.numel for r in run.bwd] == [b * d]
    assert run.plan.comm_counts() == run.runtime_counts()
    assert sum(r.send_bytes for r in run.fwd + run.bwd) == run.plan.comm_bytes_per_step()


# ---------------------------------------------------------------------------------------------- GPT, TP


B, S, H, L, V = 4, 16, 32, 2, 128


@pytest.fixture
def gpt_tp4(local_world):
    return parallel_run(local_world, _fp64(lambda: GPT(GPTConfig())), _tokens(B, S), (4,), ("tp",))


def test_gpt_tp4_two_all_reduces_per_layer_each_way(gpt_tp4):
    t = 4
    for i in range(L):
        rows = gpt_tp4.rows(axis="tp", prefix=f"h.{i}")
        fwd = [r for r in rows if r.forward == "all_reduce"]
        bwd = [r for r in rows if r.backward == "all_reduce"]
        assert len(fwd) == 2, (
            f"layer h.{i}: expected 2 forward all-reduces (the row-parallel attn.proj and out outputs), "
            f"Plan.comms attributes {[(r.module, r.fn) for r in fwd]} to it")
        assert sorted(r.module for r in bwd) == [f"h.{i}.attn.qkv", f"h.{i}.fc"], [(r.module, r.fn) for r in bwd]
        for r in fwd:
            assert (r.bytes_forward, r.bytes_backward) == (ar_bytes(B * S * H, t), 0), r
        for r in bwd:
            assert (r.bytes_forward, r.bytes_backward) == (0, ar_bytes(B * S * H, t)), r
        assert len(rows) == 4, rows


def test_gpt_tp4_totals_graph_and_runtime(gpt_tp4):
    """Per layer 2 + 2; the embeddings' one forward all-reduce; the LM head's backward one (colwise, input
    from ln_f); cross-entropy's 3 in-op all-reduces of b*s values. Nothing else."""
    t = 4
    run = gpt_tp4
    assert run.graph_counts() == {"all_reduce": 2 * L + 1, "grad_all_reduce_linears": 2 * L + 1}, run.plan
    assert run.plan.comm_counts() == {"all_reduce.forward": 2 * L + 1, "all_reduce.backward": 2 * L + 1}
    assert run.plan.comm_bytes_per_step() == (4 * L + 2) * ar_bytes(B * S * H, t)
    assert {r.axis for r in run.fwd + run.bwd} == {"tp"}
    assert Counter(r.numel for r in run.fwd) == {B * S * H: 2 * L + 1, B * S: 3}
    assert Counter(r.numel for r in run.bwd) == {B * S * H: 2 * L + 1}
    assert {r.kind for r in run.fwd + run.bwd} == {"all_reduce"}
    head = run.rows(prefix="lm_head")
    assert [(r.fn, r.backward) for r in head] == [("grad_all_reduce_linears", "all_reduce")], head


def test_gpt_embedding_all_reduce_belongs_to_the_embeddings(gpt_tp4):
    """wte(tokens) + wpe(pos): both Partial, summed, then one all-reduce. A reduction belongs to the module
    that produced the partial sums (passes/lower.py), i.e. not to a transformer layer."""
    fwd = [r for r in gpt_tp4.rows(axis="tp") if r.forward == "all_reduce" and not r.module.startswith("h.")]
    assert len(fwd) == 1, [(r.module, r.fn) for r in gpt_tp4.rows(axis="tp") if r.forward == "all_reduce"]
    assert fwd[0].module in ("wte", "wpe", ""), (
        f"the embeddings' all-reduce is attributed to {fwd[0].module!r}")


def test_vocab_parallel_cross_entropy_three_forward_all_reduces(local_world):
    """Counted with record_comms around a call: the 3 all-reduces of b*s values (max, target logit,
    sum of exps) are in-op, recorded with kind all_reduce; none of them has a backward."""
    t = 4
    model = _fp64(lambda: GPT(GPTConfig()))
    run = parallel_run(local_world, model, _tokens(B, S), (t,), ("tp",))
    ce = [r for r in run.fwd if r.numel == B * S]
    assert len(ce) == 3 and {(r.kind, r.axis) for r in ce} == {("all_reduce", "tp")}, ce
    assert all(r.send_bytes == ar_bytes(B * S, t, max(torch.float64.itemsize, 4)) for r in ce), ce
    assert not [r for r in run.bwd if r.numel == B * S]
    loss = [s for s in run.plan.strategies if s.kind == "loss"]
    assert [(s.form, s.axis) for s in loss] == [("vocab", "tp")]


def test_vocab_parallel_embedding_one_forward_all_reduce(local_world):
    b, s, h, t = 4, 16, 32, 4
    g = torch.Generator().manual_seed(0)
    inputs = (torch.randint(0, 128, (b, s), generator=g), torch.randn(b, s, h, generator=g, dtype=torch.float64))
    run = parallel_run(local_world, _fp64(EmbedOnly), inputs, (t,), ("tp",))
    assert [(s.key, s.form) for s in run.plan.strategies if s.kind == "embedding"] == [("emb", "vocab")]
    assert dict(run.plan.params)["emb.weight"] == "S(0)"
    assert run.graph_counts() == {"all_reduce": 1}, run.plan
    (row,) = run.plan.comms
    assert (row.module, row.forward, row.backward) == ("emb", "all_reduce", "-")
    assert (row.bytes_forward, row.bytes_backward) == (ar_bytes(b * s * h, t), 0)
    assert run.runtime_counts() == {"all_reduce.forward": 1}
    assert [r.numel for r in run.fwd] == [b * s * h]


# ---------------------------------------------------------------------------------------------- DP


def _distinct_params(model):
    return dict(model.named_parameters())  # tied weights once


def test_dp_mlp_gradients_reduced_in_one_bucket(local_world):
    b, d, p = 8, 16, 2
    run = parallel_run(local_world, _fp64(MLP), _dense(b, d), (p,), ("dp",), plan="dp")
    params = _distinct_params(run.ref)
    total = sum(q.numel() for q in params.values())
    # the inputs are split over dp (no communication: they have no gradient to gather)
    assert run.graph_counts() == {"grad_sync_bucket": 1, "all_reduce": 1, "split": 2}, run.plan
    assert all(r.bytes_forward == 0 and r.bytes_backward == 0 for r in run.rows(fn="split"))
    # backward: every parameter's gradient in one all-reduce (a DDP bucket), of their total size
    assert [r.numel for r in run.bwd] == [total]
    assert sum(r.bytes_backward for r in run.rows(fn="grad_sync_bucket")) == \
        pytest.approx(sum(ar_bytes(q.numel(), p) for q in params.values()), abs=len(params))
    # forward: only the loss (mse's count is static, so no count all-reduce)
    assert [(r.kind, r.numel) for r in run.fwd] == [("all_reduce", 1)]
    assert run.plan.comm_counts() == run.runtime_counts() == {"all_reduce.forward": 1, "all_reduce.backward": 1}


def test_dp_gpt_gradients_reduced_in_one_bucket(local_world):
    p = 4
    run = parallel_run(local_world, _fp64(lambda: GPT(GPTConfig())), _tokens(B, S), (p,), ("dp",), plan="dp")
    params = _distinct_params(run.ref)  # wte.weight and lm_head.weight are one tensor: reduced once
    assert len(params) == 2 + 12 * L + 2
    # one bucket for every parameter. The position embedding is looked up for arange(s), the same on every rank:
    # its *output* (s, h) is what meets the sharded batch, and its gradient is partial there; computed from wpe
    # alone, of wpe's size, the reduction moves onto wpe.weight and joins the bucket
    # (`replicated_reductions_to_parameters_pass`), instead of blocking the end of the backward
    assert [r.numel for r in run.bwd] == [sum(q.numel() for q in params.values())]
    assert {(r.kind, r.axis) for r in run.bwd} == {("all_reduce", "dp")}
    # forward: the loss itself and the global valid-token count, in one all-reduce (`fuse_loss_count_pass`)
    assert sorted((r.kind, r.numel) for r in run.fwd) == [("all_reduce", 2)]
    gc = run.graph_counts()
    assert gc["grad_sync_bucket"] == 1 and gc["all_reduce"] == 1 and "grad_all_reduce" not in gc, gc
    assert set(gc) <= {"grad_sync_bucket", "grad_all_reduce", "all_reduce", "split"}, gc


def test_dp_over_two_axes_reduces_gradients_in_one_bucket_per_axis(local_world):
    """plan="dp" on a 2x2 mesh: the batch is split over both axes, so every gradient is reduced over both.
    The runtime issues one bucket per axis (the chained per-axis reductions are bucketed round by round),
    each of every parameter's gradient; forward only the loss (reduced over both axes)."""
    b, d = 8, 16
    run = parallel_run(local_world, _fp64(NormMLP), _dense(b, d), (2, 2), ("dp", "tp"), plan="dp")
    params = _distinct_params(run.ref)
    total = sum(q.numel() for q in params.values())
    gc = run.graph_counts()
    assert gc["grad_sync_bucket"] == 2 and "grad_all_reduce" not in gc, gc
    assert sorted(r.axis for r in run.rows(fn="grad_sync_bucket")) == ["dp", "tp"]
    assert sorted((r.axis, r.numel) for r in run.bwd) == [("dp", total), ("tp", total)]
    assert all(r.bytes_backward == pytest.approx(sum(ar_bytes(q.numel(), 2) for q in params.values()),
                                                 abs=len(params)) for r in run.rows(fn="grad_sync_bucket"))
    assert sorted((r.kind, r.axis, r.numel) for r in run.fwd) == [("all_reduce", "dp", 1), ("all_reduce", "tp", 1)]


# ---------------------------------------------------------------------------------------------- 2-D


def test_llama_dp2_tp2_collectives_per_axis(local_world):
    """Megatron on tp, data parallel on dp. tp: per layer 2 forward (outputs of wo, down) and 2 backward (inputs of
    the q/k/v and gate/up projections), the embedding's forward one, the LM head's backward one.
    dp: the gradients of every parameter's tp-local shard in one bucketed all-reduce; forward only the loss."""
    dp, tp, b, s, h = 2, 2, 4, 16, 32
    run = parallel_run(local_world, _fp64(lambda: Llama(LlamaConfig(num_heads=4, num_kv_heads=2))),
                       _tokens(b, s), (dp, tp), ("dp", "tp"))
    local_act = (b // dp) * s * h
    for i in range(L):
        rows = run.rows(axis="tp", prefix=f"layers.{i}")
        # (the residual stream stays Partial through `x + wo(..)`, a sum of partials, so these reductions
        # are attributed to the layer's residual adds rather than to wo / down)
        assert len([r for r in rows if r.forward == "all_reduce"]) == 2, rows
        assert len([r for r in rows if r.backward == "all_reduce"]) == 2, rows
        assert len(rows) == 4, rows
        assert all(r.bytes_forward + r.bytes_backward == ar_bytes(local_act, tp) for r in rows), rows
    tp_rows = run.rows(axis="tp")
    assert len(tp_rows) == 4 * L + 2, tp_rows
    params = _distinct_params(run.ref)
    local = {n: q.to_local().numel() for n, q in run.pm.named_parameters()}
    dp_grads = run.rows(axis="dp", fn="grad_sync_bucket")
    assert len(dp_grads) == 1 and dp_grads[0].bytes_backward == pytest.approx(
        sum(ar_bytes(local[n], dp) for n in params), abs=len(params)), dp_grads
    dp_fwd = [r for r in run.rows(axis="dp") if r.forward != "-"]
    assert [(r.fn, r.bytes_forward) for r in dp_fwd] == [("all_reduce", ar_bytes(1, dp))], dp_fwd
    # at run time: tp forward = 2L + 1 activations + 3 cross-entropy (b/dp * s values); dp forward = count + loss
    tp_fwd = Counter(r.numel for r in run.fwd if r.axis == "tp")
    assert tp_fwd == {local_act: 2 * L + 1, (b // dp) * s: 3}, tp_fwd
    assert sorted(r.numel for r in run.fwd if r.axis == "dp") == [1, 1]
    assert [r.numel for r in run.bwd if r.axis == "dp"] == [sum(local[n] for n in params)]
    assert Counter(r.numel for r in run.bwd if r.axis == "tp") == {local_act: 2 * L + 1}
