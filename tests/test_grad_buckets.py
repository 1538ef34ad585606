"""Data-parallel gradient buckets (`bucket_gradients_pass`, `collectives.grad_sync_bucket`), as DDP makes them.

Parameters in reverse order of first use fill buckets of at most `GRAD_BUCKET_BYTES`, the first closed once it holds
`FIRST_GRAD_BUCKET_BYTES` (with the gradient that crossed that size, as DDP's); each bucket sits before its
parameters' first use, so in backward its all-reduce is issued as soon as their gradients exist (the last layer's
first, while earlier layers' backward still runs) and waited for by the end of the backward. Asserted: the number
of buckets for a given size, their contents and order (graph and the collectives actually run), and on real gloo
processes (where the all-reduce is asynchronous) gradients and parameters equal to one device's, also when
gradients accumulate over two backward passes.
"""

from __future__ import annotations

import contextlib
import pickle

import pytest
import torch
from torch import nn
from torch.distributed.device_mesh import init_device_mesh

import autopar
from autopar.runtime import collectives as C
from autopar.runtime.collectives import record_comms
from dist_harness import gloo_pool
from equivalence import gloo_equivalence

LAYERS, DIM = 4, 16
LAYER_BYTES = (DIM * DIM + DIM) * 8  # one fp64 Linear: weight and bias


class Stack(nn.Module):
    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(DIM, DIM) for _ in range(LAYERS))

    def forward(self, x, y):
        for layer in self.layers:
            x = torch.tanh(layer(x))
        return ((x - y) ** 2).mean()


def make_stack():
    return Stack()


def stack_inputs():
    g = torch.Generator().manual_seed(1)
    return torch.randn(8, DIM, generator=g, dtype=torch.float64), torch.randn(8, DIM, generator=g, dtype=torch.float64)


def _lower(local_world, monkeypatch, bucket_bytes):
    monkeypatch.setattr(C, "GRAD_BUCKET_BYTES", bucket_bytes)
    torch.manual_seed(0)
    model = Stack().double()
    inputs = stack_inputs()
    with local_world(2):
        mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("dp",))
        pm = autopar.parallelize(model, mesh, inputs, plan="dp")
        loss = pm(*inputs)
        with record_comms() as bwd:
            loss.backward()
    gm = pm.graph_module
    gm.graph.lint()
    buckets = [n for n in gm.graph.nodes if n.target is C.grad_sync_bucket]
    return pm, gm, buckets, list(bwd)


def _layer_of(node) -> int:
    """The layer index of a bucketed placeholder (its name is the parameter's path, e.g. p_layers_2_weight)."""
    return int(node.name.split("layers_")[1].split("_")[0])


def test_one_bucket_per_layer_last_layer_first(local_world, monkeypatch):
    pm, gm, buckets, bwd = _lower(local_world, monkeypatch, LAYER_BYTES)
    assert len(buckets) == LAYERS
    # each bucket: one layer's weight and bias, the last layer's bucket first in the order they are filled
    assert [sorted({_layer_of(a) for a in b.args[0]}) for b in buckets] == [[i] for i in range(LAYERS)]
    assert all(len(b.args[0]) == 2 for b in buckets)
    # each bucket sits right before its layer's first use: in backward it runs as soon as that layer's gradients exist
    order = {n: i for i, n in enumerate(gm.graph.nodes)}
    for b in buckets:
        first_use = min(order[u] for a in b.args[0] for u in a.users)
        assert order[b] == first_use, (b, b.args[0])
        users = [u for item in b.users for u in item.users]
        assert users and all(order[u] > order[b] for u in users)
    # the collectives run: one all-reduce per layer, the last layer's first (issued during the backward)
    assert [(r.kind, r.axis, r.numel) for r in bwd] == [("all_reduce", "dp", DIM * DIM + DIM)] * LAYERS
    assert [r.fn for r in pm.plan.comms].count("grad_sync_bucket") == LAYERS
    assert pm.plan.comm_counts()["all_reduce.backward"] == LAYERS


def test_bucket_size_sets_the_number_of_buckets(local_world, monkeypatch):
    for size, expected in [(2**62, 1), (2 * LAYER_BYTES, 2), (3 * LAYER_BYTES, 2), (LAYER_BYTES - 1, 2 * LAYERS)]:
        _, _, buckets, bwd = _lower(local_world, monkeypatch, size)
        assert len(buckets) == len(bwd) == expected, (size, len(buckets), len(bwd))
        # every parameter in exactly one bucket; no bucket over the size unless it holds a single parameter
        params = [a for b in buckets for a in b.args[0]]
        assert len(params) == len(set(params)) == 2 * LAYERS
        for b in buckets:
            nbytes = sum(a.meta["val"].numel() * 8 for a in b.args[0])
            assert nbytes <= size or len(b.args[0]) == 1, (size, nbytes)
        # filled in reverse order of first use: layers never interleave, the last ones first (buckets in backward
        # order: the reverse of the graph's)
        layers = [_layer_of(a) for b in reversed(buckets) for a in b.args[0]]
        assert layers == sorted(layers, reverse=True), layers


def test_the_first_bucket_is_small_as_ddps(local_world, monkeypatch):
    """The first bucket (the gradients ready first: the last layer's) is closed once it holds `FIRST_GRAD_BUCKET_BYTES`,
    as DDP's first bucket, so a reduction starts early in the backward; the others fill up to `GRAD_BUCKET_BYTES`."""
    assert C.FIRST_GRAD_BUCKET_BYTES == 2**20  # DDP's dist._DEFAULT_FIRST_BUCKET_BYTES
    monkeypatch.setattr(C, "FIRST_GRAD_BUCKET_BYTES", LAYER_BYTES)
    _, _, buckets, bwd = _lower(local_world, monkeypatch, 2**62)
    assert [sorted({_layer_of(a) for a in b.args[0]}) for b in reversed(buckets)] == [[LAYERS - 1], list(range(LAYERS - 1))]
    assert [r.numel for r in bwd] == [DIM * DIM + DIM, (LAYERS - 1) * (DIM * DIM + DIM)]


class Head(nn.Module):
    """A classifier whose head's weight (read last in the forward, so its gradient is ready first) is larger than the
    first bucket: a trunk of small layers, then `Linear(DIM, CLASSES)`."""

    def __init__(self):
        super().__init__()
        self.trunk = nn.ModuleList(nn.Linear(DIM, DIM) for _ in range(LAYERS))
        self.head = nn.Linear(DIM, 64)

    def forward(self, x, y):
        for layer in self.trunk:
            x = torch.tanh(layer(x))
        return nn.functional.cross_entropy(self.head(x), y)


def test_the_first_bucket_closes_as_ddps_with_the_gradient_that_fills_it(local_world, monkeypatch):
    """DDP closes its first bucket once it holds `first_bucket_bytes_cap`, the gradient that crossed the cap in it
    (torch's `compute_bucket_assignment_by_size`): the head's weight, ready first and larger than the cap, is reduced
    with its bias while the trunk's backward runs, not left to wait in the next bucket for the whole backward. Compared
    with DDP's own assignment of the same gradients in the same order; the later buckets hold at most the size."""
    head_bytes = (DIM * 64 + 64) * 8
    monkeypatch.setattr(C, "FIRST_GRAD_BUCKET_BYTES", 64 * 8 + 1)  # more than the head's bias, less than its weight
    monkeypatch.setattr(C, "GRAD_BUCKET_BYTES", 2 * head_bytes)
    torch.manual_seed(0)
    model = Head().double()
    g = torch.Generator().manual_seed(1)
    inputs = torch.randn(8, DIM, generator=g, dtype=torch.float64), torch.randint(0, 64, (8,), generator=g)
    with local_world(2):
        mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("dp",))
        pm = autopar.parallelize(model, mesh, inputs, plan="dp")
        with record_comms() as comms:
            pm(*inputs).backward()
    buckets = [[a.meta["val"] for a in b.args[0]] for b in reversed(
        [n for n in pm.graph_module.graph.nodes if n.target is C.grad_sync_bucket])]  # in backward order
    grads = [t for b in buckets for t in b]
    ddp, _ = torch.distributed._compute_bucket_assignment_by_size(
        [torch.empty(t.shape, dtype=t.dtype) for t in grads], [C.FIRST_GRAD_BUCKET_BYTES, C.GRAD_BUCKET_BYTES])
    assert ddp[0] == [0, 1] and len(buckets[0]) == 2 and sum(t.numel() for t in buckets[0]) * 8 == head_bytes, buckets
    assert all(sum(t.numel() * 8 for t in b) <= C.GRAD_BUCKET_BYTES for b in buckets[1:]), buckets
    assert [r.numel for r in comms if r.pass_ == "backward"] == [sum(t.numel() for t in b) for b in buckets]


@contextlib.contextmanager
def _bucket_bytes(size):
    """In a gloo worker: the pool's processes outlive the test, so the size is restored after it."""
    old, C.GRAD_BUCKET_BYTES = C.GRAD_BUCKET_BYTES, size
    try:
        yield
    finally:
        C.GRAD_BUCKET_BYTES = old


def gloo_worker(bucket_bytes, steps):
    with _bucket_bytes(bucket_bytes):
        return gloo_equivalence(make_stack, stack_inputs, (2,), ("dp",), "dp", None, steps)


def accumulate_worker(bucket_bytes):
    with _bucket_bytes(bucket_bytes):
        return _accumulate()


def _accumulate():
    """Two backward passes without zeroing: the second adds to gradients whose all-reduce may still be in flight."""
    torch.manual_seed(0)
    ref = Stack().double()
    model = Stack().double()
    model.load_state_dict(ref.state_dict())
    inputs = stack_inputs()
    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("dp",))
    pm = autopar.parallelize(model, mesh, inputs, plan="dp")
    ran, original = [], C._after_backward
    C._after_backward = lambda: (ran.append(1), original())  # the end-of-backward step of the asynchronous path
    try:
        for _ in range(2):
            ref(*inputs).backward()
            pm(*inputs).backward()
    finally:
        C._after_backward = original
    buckets = sum(n.target is C.grad_sync_bucket for n in pm.graph_module.graph.nodes)
    # the reductions ran asynchronously, and once reduced the gradients are plain tensors again (picklable)
    plain = all(type(p.grad.to_local()) is torch.Tensor for p in pm.parameters())
    pickle.dumps({n: p.grad.full_tensor() for n, p in pm.named_parameters()})
    asynchronous = len(ran) >= 2 and plain
    ref_grads = dict(ref.named_parameters())
    errs = {n: (p.grad.full_tensor() - ref_grads[n].grad).abs().max().item() for n, p in pm.named_parameters()}
    return buckets, asynchronous, errs


def test_gradients_exact_on_gloo_with_several_buckets():
    results = gloo_pool(2).run(gloo_worker, LAYER_BYTES, 2)
    for res in results:
        assert res.graph_counts.get("grad_sync_bucket") == LAYERS, res.graph_counts
        assert res.comm_counts.get("all_reduce.backward") == LAYERS, res.comm_counts
        assert len(res.grad_err) == len(res.param_err) == 2 * LAYERS
        assert res.max_err() <= 1e-12, (res.grad_err, res.param_err)
    for buckets, asynchronous, errs in gloo_pool(2).run(accumulate_worker, LAYER_BYTES):
        assert buckets == LAYERS and asynchronous
        assert len(errs) == 2 * LAYERS and max(errs.values()) <= 1e-12, errs


def _gpt(seq_len: int):
    from autopar.models import GPT, GPTConfig
    return GPT(GPTConfig(vocab_size=64, seq_len=seq_len, num_layers=2, num_heads=2, hidden=16, dropout=0.0))


def _tokens():
    tokens = torch.randint(0, 64, (4, 8), generator=torch.Generator().manual_seed(2))
    return tokens, torch.roll(tokens, -1, dims=1)


@pytest.mark.parametrize("seq_len", [8, 16])
def test_a_parameter_only_values_reduction_moves_to_its_parameter(local_world, fp64, seq_len):
    """The position embedding `wpe(arange(s))`, replicated, meets the batch-sharded tokens: its gradient is
    partial. With as many positions as tokens (seq_len 8) the reduction moves onto `wpe.weight` and joins a
    bucket (no blocking all-reduce of an activation is left); with twice as many positions (16) the parameter
    is larger than the activation and the activation keeps its reduction. Both match the single-device model:
    the loss, every gradient, every parameter after an optimizer step."""
    from equivalence import run_equivalence
    torch.manual_seed(0)
    ref, inputs = _gpt(seq_len), _tokens()  # (made outside the simulated ranks: one batch, not one per rank)
    with local_world(2):
        # AdamW with eps 1e-3: the key bias's gradient is rounding noise (softmax ignores it), which eps 1e-8 would
        # scale to steps of ~1e-11 whose sign is the noise's (tests/test_local_step.py)
        res = run_equivalence(ref, inputs, (2,), ("dp",), plan="dp", steps=2,
                              optimizer=lambda ps, lr: torch.optim.AdamW(ps, lr=lr, eps=1e-3))
    assert res.max_err() < 1e-12, res.max_err()
    nodes = list(res.graph_module.graph.nodes)
    activation = [n for n in nodes if n.target is C.grad_all_reduce and n.args[0].op != "placeholder"]
    bucketed = {a.name for n in nodes if n.target is C.grad_sync_bucket for a in n.args[0]}
    if seq_len == 8:
        assert not activation and "p_wpe_weight" in bucketed
    else:
        assert [n.args[0].target for n in activation] == [torch.ops.aten.embedding.default]
        assert "p_wpe_weight" not in bucketed
    # the exact collectives of the step: the buckets' all-reduces in backward (+ the position embedding's, when
    # it stays), the loss's and the valid-token count's in forward, as one all-reduce (`fuse_loss_count_pass`)
    assert res.comm_counts == {"all_reduce.forward": 1, "all_reduce.backward": len(
        [n for n in nodes if n.target is C.grad_sync_bucket]) + len(activation)}, res.comm_counts
