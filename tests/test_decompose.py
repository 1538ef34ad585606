"""Models built from torch's own norms keep their batch sharded: composite ops decompose into ops with rules.

`passes.decompose.decompose_unruled_pass` (run at capture) replaces `rms_norm`, `instance_norm`... (no sharding
rule) by their decompositions into ops with rules; `group_norm` stays whole, batch-local (its fused kernel runs on
each rank's rows, `passes.batch_local`). Each model runs under `dp` on 2 simulated ranks and
is exact against one device in fp64 (the loss, every gradient, every parameter after an SGD step), the plan notes
no op replicated for want of a rule, and the batch is never gathered.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from autopar.capture import capture
from equivalence import run_equivalence

aten = torch.ops.aten


class Block(nn.Module):
    def __init__(self, d: int, heads: int):
        super().__init__()
        self.heads = heads
        self.norm1, self.norm2 = nn.RMSNorm(d), nn.RMSNorm(d, eps=1e-6)
        self.q, self.k, self.v = (nn.Linear(d, d, bias=False) for _ in range(3))
        self.o = nn.Linear(d, d, bias=False)
        self.up, self.gate, self.down = nn.Linear(d, 2 * d, bias=False), nn.Linear(d, 2 * d, bias=False), \
            nn.Linear(2 * d, d, bias=False)

    def forward(self, x):
        b, s, d = x.shape
        h = self.norm1(x)
        q, k, v = (p(h).view(b, s, self.heads, d // self.heads).transpose(1, 2) for p in (self.q, self.k, self.v))
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.o(a.transpose(1, 2).reshape(b, s, d))
        h = self.norm2(x)
        return x + self.down(F.silu(self.gate(h)) * self.up(h))


class TorchLlama(nn.Module):
    """A Llama written with torch's nn.RMSNorm and F.scaled_dot_product_attention."""

    def __init__(self, vocab=32, d=16, heads=2, layers=2):
        super().__init__()
        self.emb = nn.Embedding(vocab, d)
        self.blocks = nn.ModuleList(Block(d, heads) for _ in range(layers))
        self.norm = nn.RMSNorm(d)
        self.head = nn.Linear(d, vocab, bias=False)

    def forward(self, ids, labels):
        x = self.emb(ids)
        for b in self.blocks:
            x = b(x)
        return F.cross_entropy(self.head(self.norm(x)).flatten(0, 1), labels.flatten())


class ConvNet(nn.Module):
    """Conv2d + a torch norm (GroupNorm or InstanceNorm2d) image classifier."""

    def __init__(self, norm: str, classes: int = 5):
        super().__init__()
        make = {"group": lambda c: nn.GroupNorm(2, c), "instance": lambda c: nn.InstanceNorm2d(c, affine=True)}[norm]
        self.c1, self.n1 = nn.Conv2d(3, 8, 3, padding=1), make(8)
        self.c2, self.n2 = nn.Conv2d(8, 8, 3, padding=1), make(8)
        self.fc = nn.Linear(8, classes)

    def forward(self, x, y):
        x = F.relu(self.n1(self.c1(x)))
        x = F.relu(self.n2(self.c2(x)))
        return F.cross_entropy(self.fc(x.mean((2, 3))), y)


class TableNet(nn.Module):
    """Modules whose ops decompose by torch._decomp's checked table (`DECOMPOSED_FURTHER`)."""

    def __init__(self):
        super().__init__()
        self.conv, self.shuffle, self.act = nn.Conv2d(3, 8, 3, padding=1), nn.PixelShuffle(2), nn.Hardswish()
        self.fc, self.glu, self.prelu, self.out = nn.Linear(2 * 16 * 16, 8), nn.GLU(), nn.PReLU(), nn.Linear(4, 3)

    def forward(self, x, y):
        h = self.act(self.shuffle(self.conv(x))).flatten(1)
        z = self.out(self.prelu(self.glu(self.fc(h))))
        return F.smooth_l1_loss(z, y) + F.binary_cross_entropy_with_logits(z, y.sigmoid()) + F.logsigmoid(z).mean()


def _table_net():
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(1)
    return TableNet(), (torch.randn(4, 3, 8, 8, generator=g), torch.randn(4, 3, generator=g))


def _llama():
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(1)
    return TorchLlama(), (torch.randint(0, 32, (4, 8), generator=g), torch.randint(0, 32, (4, 8), generator=g))


def _convnet(norm):
    def build():
        torch.manual_seed(0)
        g = torch.Generator().manual_seed(1)
        return ConvNet(norm), (torch.randn(4, 3, 8, 8, generator=g), torch.randint(0, 5, (4,), generator=g))
    return build


MODELS = {"llama-nn.RMSNorm": (_llama, aten.rms_norm.default),
          "conv-GroupNorm": (_convnet("group"), aten.group_norm.default),
          "conv-InstanceNorm2d": (_convnet("instance"), aten.instance_norm.default),
          "table-decomposed": (_table_net, aten.pixel_shuffle.default)}
KEPT_WHOLE = {"conv-GroupNorm"}  # batch-local, its fused kernel on the local shard (passes.decompose.LEFT_WHOLE)


NORM_PATH = {"llama-nn.RMSNorm": "blocks.0.norm1", "conv-GroupNorm": "n1", "conv-InstanceNorm2d": "n1",
             "table-decomposed": "shuffle"}


@pytest.mark.parametrize("name", [m for m in MODELS if m not in KEPT_WHOLE])
def test_torch_norms_decompose_at_capture(name, fp64):
    build, op = MODELS[name]
    model, inputs = build()
    gm = capture(model, inputs, {}).gm
    targets = [n.target for n in gm.graph.nodes if n.op == "call_function"]
    assert op not in targets, f"{op} left whole"
    from passes.rules import rule_for
    unruled = {str(t) for t in targets if isinstance(t, torch._ops.OpOverload) and rule_for(t) is None}
    assert not unruled, unruled
    # the decomposed nodes keep the module they came from
    from autopar.sites import module_path
    norm = NORM_PATH[name]
    assert [n for n in gm.graph.nodes if n.op == "call_function" and module_path(n) == norm], f"no node of {norm}"


@pytest.mark.parametrize("name", list(MODELS))
def test_torch_norms_stay_batch_sharded_under_dp(name, local_world, fp64):
    build, _ = MODELS[name]
    model, inputs = build()
    with local_world(2):
        res = run_equivalence(model, inputs, (2,), ("dp",), plan="dp")
    assert res.max_err() < 1e-9, (res.loss, res.ref_loss, res.grad_err, res.param_err)
    assert res.grad_err and res.param_err
    replicated = [n for n in res.plan.notes if "replicated" in n or "gathered" in n]
    assert not replicated, replicated
    # the batch is never gathered: no all-gather forward; backward, only instance norm's affine weights repeated per
    # sample (`repeat(weight, [N])`, replicated, split to the batch shard) gather their gradient, N*C elements
    gathers = [c for c in res.comms if c[0].startswith("all_gather")]
    assert all(c[2] == "backward" and c[3] <= 4 * 8 for c in gathers), gathers
    if name != "conv-InstanceNorm2d":
        assert not gathers, gathers


def test_decomposed_rms_norm_takes_megatron_sequence_parallelism(local_world, fp64):
    """nn.RMSNorm decomposed is the `pow -> mean -> rsqrt -> mul` that `passes.norm` recognises: every norm of the
    torch-built Llama is a norm site, and under megatron with `norm: sequence` each runs sequence-sharded, exact."""
    model, inputs = _llama()
    with local_world(2):
        res = run_equivalence(model, inputs, (2,), ("tp",), plan="megatron", overrides={"norm": "sequence"}, steps=2)
    assert res.max_err() < 1e-9, (res.loss, res.ref_loss, res.grad_err, res.param_err)
    assert set(res.grad_err) == {n for n, _ in model.named_parameters()}
    norms = [s for s in res.plan.strategies if s.kind == "norm"]
    assert len(norms) == 2 * 2 + 1 and all(s.form == "sequence" and s.axis == "tp" for s in norms), norms
    c = res.comm_counts
    assert c.get("all_gather.forward", 0) > 2 * 2 and c.get("reduce_scatter.forward", 0) > 2 * 2, c


class Mixed(nn.Module):
    """Ops that must stay whole: an LSTM (batch-local, its decomposition unrolls time), linear and SDPA (the
    recognisers need them), next to an nn.RMSNorm that decomposes."""

    def __init__(self):
        super().__init__()
        self.lstm, self.norm, self.proj = nn.LSTM(8, 8, batch_first=True), nn.RMSNorm(8), nn.Linear(8, 8)

    def forward(self, x):
        h, _ = self.lstm(x)
        q = self.proj(self.norm(h)).unsqueeze(1)
        return F.scaled_dot_product_attention(q, q, q).sum()


def test_recurrent_and_ruled_ops_stay_whole(fp64):
    gm = capture(Mixed(), (torch.randn(2, 4, 8),), {}).gm
    targets = {n.target for n in gm.graph.nodes if n.op == "call_function"}
    assert {aten.lstm.input, aten.linear.default, aten.scaled_dot_product_attention.default} <= targets, targets
    assert aten.rms_norm.default not in targets and aten.rsqrt.default in targets


def test_group_norm_stays_whole_and_batch_local(fp64):
    """nn.GroupNorm is not decomposed (its pointwise decomposition does several times the fused kernel's element
    work): capture finds it batch-local (`meta.ROWS`), so the lowering runs it whole on each rank's rows."""
    from passes import meta as M

    model, inputs = _convnet("group")()
    gm = capture(model, inputs, {}).gm
    norms = [n for n in gm.graph.nodes if n.target is aten.group_norm.default]
    assert len(norms) == 2 and all(n.meta[M.ROWS].local and n.meta[M.ROWS].in_dims[0] == 0 for n in norms), \
        [n.meta.get(M.ROWS) for n in norms]
    assert not [n for n in gm.graph.nodes if n.target in (aten.var_mean.correction, aten.native_group_norm.default)]


def test_a_decomposition_with_an_unruled_op_is_not_inlined(fp64):
    """Where an op of the decomposition has no rule, the composite op stays whole (replicated, noted), not half
    decomposed."""
    from passes.rules import RULES
    from rule_check import rules_replaced

    with rules_replaced(lambda op: None if op is aten.rsqrt.default else RULES.get(op)):
        gm = capture(nn.RMSNorm(8), (torch.randn(2, 4, 8),), {}).gm
    targets = [n.target for n in gm.graph.nodes if n.op == "call_function"]
    assert targets == [aten.rms_norm.default], targets


def test_as_strided_to_a_contiguous_layout_is_a_view():
    """`native_group_norm`'s CPU decomposition reshapes by `as_strided`; of a contiguous value at offset 0 to the
    contiguous strides of a shape with its element count, that is a view; any other as_strided stays (and then the
    decomposition is refused: as_strided has no rule)."""
    from torch.fx.experimental.proxy_tensor import make_fx

    from passes.decompose import _as_strided_to_view

    def f(x):
        return x.as_strided([2, 6], [6, 1]), x.as_strided([2, 3], [6, 1]), x.t().contiguous().as_strided([12], [1])

    sub = make_fx(f)(torch.randn(3, 4))
    _as_strided_to_view(sub)
    sub.recompile()
    kinds = [n.target for n in sub.graph.nodes if n.op == "call_function"]
    assert kinds.count(aten.view.default) == 2 and kinds.count(aten.as_strided.default) == 1, kinds
    x = torch.randn(3, 4)
    for got, want in zip(sub(x), f(x)):
        assert torch.equal(got, want)


def _f64(*shape, pos=False, seed=0):
    t = torch.randn(shape, generator=torch.Generator().manual_seed(seed + len(shape)), dtype=torch.float64)
    return t.abs() + 0.5 if pos else t


# op -> (args, kwargs[, tensors not differentiated]): composite ops of torch.nn modules, and every op of
# passes.decompose.DECOMPOSED_FURTHER
DECOMPOSED = {
    aten.rms_norm.default: ((_f64(2, 4, 6), [6], _f64(6), None), {}),
    aten.group_norm.default: ((_f64(2, 4, 3, 3), 2, _f64(4), _f64(4), 1e-5, False), {}),
    aten.instance_norm.default: ((_f64(2, 4, 5), _f64(4), _f64(4), None, None, True, 0.1, 1e-5, False), {}),
    aten.batch_norm.default: ((_f64(4, 3, 5), _f64(3), _f64(3), _f64(3), _f64(3, pos=True), False, 0.1, 1e-5,
                               False), {}, (3, 4)),
    aten.cosine_embedding_loss.default: ((_f64(4, 6), _f64(4, 6, seed=1), torch.tensor([1., -1., 1., -1.])), {}),
    aten.prelu.default: ((_f64(2, 3, 4), _f64(3)), {}),
    aten.log_sigmoid.default: ((_f64(4, 6),), {}),
    aten.native_group_norm.default: ((_f64(2, 4, 9), _f64(4), _f64(4), 2, 4, 9, 2, 1e-5), {}),
    aten.hardswish.default: ((_f64(4, 6) * 4,), {}),
    aten.log_sigmoid_forward.default: ((_f64(4, 6),), {}),
    aten.glu.default: ((_f64(4, 6), -1), {}),
    aten.smooth_l1_loss.default: ((_f64(4, 6), _f64(4, 6, seed=1), 1, 0.5), {}),
    aten.huber_loss.default: ((_f64(4, 6), _f64(4, 6, seed=1), 0, 0.7), {}),
    aten.binary_cross_entropy_with_logits.default: ((_f64(4, 6), torch.rand(4, 6, dtype=torch.float64), _f64(6),
                                                     _f64(6, pos=True), 1), {}, (2, 3)),
    aten.pixel_shuffle.default: ((_f64(2, 8, 3, 3), 2), {}),
    aten._prelu_kernel.default: ((_f64(2, 3, 4), _f64(3, 1)), {}),
}


def test_every_table_decomposition_is_checked():
    from passes.decompose import DECOMPOSED_FURTHER

    assert set(DECOMPOSED_FURTHER) <= set(DECOMPOSED)


@pytest.mark.parametrize("op", list(DECOMPOSED), ids=str)
def test_decompositions_give_the_ops_values_and_gradients(op):
    """What the pass inlines (`passes.decompose.decomposition` of a one-node graph on fake values, its rewrites
    included) against the op: every output and every input gradient, fp64, on real values."""
    from torch import fx
    from torch._subclasses.fake_tensor import FakeTensorMode

    from passes.decompose import decomposition

    args, kwargs, *rest = DECOMPOSED[op]
    no_grad = rest[0] if rest else ()
    fake = FakeTensorMode()
    g = fx.Graph()
    flat, spec = torch.utils._pytree.tree_flatten((args, kwargs))
    tensors = []
    for i, a in enumerate(flat):
        if isinstance(a, torch.Tensor):
            ph = g.placeholder(f"in{len(tensors)}")
            ph.meta["val"] = fake.from_tensor(a)
            tensors.append(a)
            flat[i] = ph
    a, k = torch.utils._pytree.tree_unflatten(flat, spec)
    node = g.call_function(op, tuple(a), dict(k))
    with fake:
        node.meta["val"] = op(*torch.utils._pytree.tree_map_only(fx.Node, lambda n: n.meta["val"], (a, k))[0], **k)
    g.output(node)
    sub = decomposition(node)
    assert sub is not None, f"{op} did not decompose into ops with rules"
    assert op not in {n.target for n in sub.graph.nodes}
    leaves = [t.clone().requires_grad_(t.dtype.is_floating_point and i not in no_grad) for i, t in enumerate(tensors)]
    it = iter(leaves)
    full = [next(it) if isinstance(x, fx.Node) else x for x in flat]
    a_full, k_full = torch.utils._pytree.tree_unflatten(full, spec)
    want = op(*a_full, **k_full)
    got = sub(*leaves)
    want = [w for w in (want if isinstance(want, (list, tuple)) else [want]) if isinstance(w, torch.Tensor)]
    got = [x for x in (got if isinstance(got, (list, tuple)) else [got]) if isinstance(x, torch.Tensor)]
    assert len(got) == len(want)
    for x, w in zip(got, want):
        torch.testing.assert_close(x, w, rtol=1e-10, atol=1e-12)
    diff = [(x, w) for x, w in zip(got, want) if w.requires_grad]
    cots = [torch.randn(w.shape, generator=torch.Generator().manual_seed(3), dtype=w.dtype) for _, w in diff]
    needs = [t for t in leaves if t.requires_grad]
    g_got = torch.autograd.grad([x for x, _ in diff], needs, cots, allow_unused=True)
    g_want = torch.autograd.grad([w for _, w in diff], needs, cots, allow_unused=True)
    for i, (x, w) in enumerate(zip(g_got, g_want)):
        x = torch.zeros_like(needs[i]) if x is None else x
        w = torch.zeros_like(needs[i]) if w is None else w
        torch.testing.assert_close(x, w, rtol=1e-10, atol=1e-12, msg=lambda m: f"gradient of input {i}: {m}")
