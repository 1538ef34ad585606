"""Attention and LM-head structures of the Hugging Face zoo (`tests/zoo.py`) that `megatron` shards.

Per family: what recognition finds on the captured graph (site fields), the forms the megatron plan gives
(`attention: heads`, `loss: vocab`), the equivalence on 2 simulated ranks (loss, every gradient, every
parameter after an SGD step against one device; fp64 models, loss on fp32 logits as the families compute it:
the zoo's tolerance), and the exact collectives of each attention block (`plan.comms`, the graph's collective
nodes). Then the sharding rules these structures need, checked numerically forward and backward for every
input placement they accept.

| family   | structure                                                            |
|----------|----------------------------------------------------------------------|
| gemma2   | soft-capped explicit attention (tanh), soft-capped logits, tied head |
| gemma3   | q/k norms ending in `type_as`                                        |
| gpt_neox | fused QKV interleaved per head: `view(b, s, h, 3d)`, `chunk(3, -1)`  |
| bloom    | ALiBi attention: `baddbmm(alibi, q, k^T)` on (b*heads, s, d)         |
| falcon   | multi-query fused QKV: heads slice + KV index, `x @ W.T`             |
| phi3     | GQA fused QKV: unequal q/k/v slices                                  |
| granite  | logits divided by logits_scaling                                     |
| cohere   | logits multiplied by logit_scale                                     |
"""

from __future__ import annotations

import itertools
import operator
from collections import Counter

import pytest
import transformers
import torch
from torch import fx

import autopar
from autopar.api import _prepare
from autopar.forms.ring import ring_precondition
from autopar.forms.ulysses import ulysses_precondition
from autopar.runtime import collectives as C
from autopar.runtime import ops as O
from autopar.runtime.collectives import _take_chunk
from autopar.spec import P, R, Partial, Replicate, Shard, _StridedShard, is_shard
from equivalence import run_equivalence
from passes import meta as M
from passes.rules import RULES
from zoo import FAMILIES

aten = torch.ops.aten


def _sites(family: str):
    model, inputs, _ = FAMILIES[family]()
    _, captured, ctx = _prepare(model, {"tp": 2}, inputs)
    return captured, {k: ctx.of_kind(k) for k in ("attention", "loss", "linear")}


def _keys(linears) -> list[str]:
    return [lin.key.rsplit(".", 1)[-1] for lin in linears]


# ----------------------------------------------------------------------------- recognition

def test_gemma2_soft_capped_attention_and_logits_are_recognised():
    _, sites = _sites("gemma2")
    attn = sites["attention"]
    assert len(attn) == 2
    for a in attn:
        assert (a.spelling, a.heads, a.kv_heads, a.head_dim, a.seq_len) == ("explicit", 4, 2, 16, 16)
        assert a.node.target is aten.matmul.default  # left explicit: SDPA cannot soft-cap
        assert (_keys(a.q), _keys(a.k), _keys(a.v), _keys(a.out)) == (["q_proj"], ["k_proj"], ["v_proj"], ["o_proj"])
        assert "soft-capped (tanh(scores / cap) * cap)" in a.unfused_why
        for why in (ulysses_precondition(a, 2), ring_precondition(a, 2)):
            assert "not fused into SDPA: its scores are soft-capped" in why and "Fix: 'heads'" in why
    (loss,) = sites["loss"]
    assert _keys(loss.head) == ["lm_head"] and loss.vocab == 128 and loss.vocab_why is None


def test_gemma3_q_projection_found_through_its_norm():
    _, sites = _sites("gemma3")
    for a in sites["attention"]:
        assert (a.spelling, a.heads, a.kv_heads, a.head_dim) == ("sdpa", 4, 2, 16)
        assert (_keys(a.q), _keys(a.k), _keys(a.v), _keys(a.out)) == (["q_proj"], ["k_proj"], ["v_proj"], ["o_proj"])


def test_gpt_neox_fused_qkv_is_interleaved_per_head():
    _, sites = _sites("gpt_neox")
    for a in sites["attention"]:
        (qkv,) = a.q
        assert a.k == a.v == (qkv,) and _keys(a.out) == ["dense"]
        assert (qkv.parts, qkv.head_interleaved, qkv.part_slices) == (1, 16, ())
        assert (a.heads, a.kv_heads, a.head_dim) == (4, 4, 16)


def test_bloom_baddbmm_alibi_attention_is_recognised():
    _, sites = _sites("bloom")
    attn = sites["attention"]
    assert len(attn) == 2
    for a in attn:
        assert a.node.target is aten.baddbmm.default and a.spelling == "explicit"
        assert (a.heads, a.kv_heads, a.head_dim, a.seq_len) == (4, 4, 8, 16)
        (qkv,) = a.q
        assert a.k == a.v == (qkv,) and _keys(a.out) == ["dense"]
        assert (qkv.parts, qkv.head_interleaved) == (1, 8)  # view(b, s, heads, 3, d), select on the 3
        assert "per (batch x head) with bmm/baddbmm" in ulysses_precondition(a, 2)


@pytest.mark.parametrize("family,blocks,takers,kv_heads", [
    ("falcon", [(0, 32), (32, 40), (40, 48)], [aten.slice.Tensor, aten.index.Tensor, aten.index.Tensor], 1),
    ("phi3", [(0, 32), (32, 48), (48, 64)], [aten.slice.Tensor] * 3, 2),
])
def test_fused_qkv_with_unequal_blocks_is_taken_apart(family, blocks, takers, kv_heads):
    """Falcon's `view(b, s, heads + 2, d)` then `[:, :, :-2]`, `[:, :, [-2]]`, `[:, :, [-1]]` (or, from transformers
    5.25, one `split([heads, 1, 1], dim=-2)`); Phi-3's slices of
    the features: the blocks tile the output, and KV heads are those of the k block (not the repeat_kv'd)."""
    _, sites = _sites(family)
    for a in sites["attention"]:
        (qkv,) = a.q
        assert a.k == a.v == (qkv,) and (qkv.parts, qkv.head_interleaved) == (1, 0)
        assert [(f, e) for _, f, e in qkv.part_slices] == blocks
        got = [n.target for n, _, _ in qkv.part_slices]
        assert got == ([operator.getitem] * 3 if family == "falcon" and FALCON_SPLITS else takers), got
        assert (a.heads, a.kv_heads, a.head_dim) == (4, kv_heads, 8)


@pytest.mark.parametrize("family", ["granite", "cohere"])
def test_scaled_logits_come_from_the_lm_head(family):
    _, sites = _sites(family)
    (loss,) = sites["loss"]
    assert _keys(loss.head) == ["lm_head"] and loss.vocab_why is None


# ----------------------------------------------------------------------------- megatron on 2 ranks

def _attention_comms(plan, key: str) -> Counter:
    """(fn, forward, backward) -> count of the collectives attributed to one attention block (a local split
    whose backward never runs moves nothing: left out)."""
    return Counter((c.fn, c.forward, c.backward) for c in plan.comms
                   if (c.module == key or c.module.startswith(key + ".")) and (c.forward, c.backward) != ("-", "-"))


# transformers >= 5.25's Falcon splits its per-head view (`split([heads, 1, 1], dim=-2)`) and repeats its one KV head
# for attention (`repeat_kv`): the repeated k and v are split by heads (their gradients all-gathered backward)
# where the older spelling kept them whole (`broadcast_to` after an index: their gradients all-reduced)
FALCON_SPLITS = tuple(int(v) for v in transformers.__version__.split(".")[:2]) >= (5, 25)

# per attention block: its row-parallel all-reduce forward, its input gradient's all-reduce backward, and:
AR, GAR = ("all_reduce", "all_reduce", "-"), ("grad_all_reduce", "-", "all_reduce")
GARL = ("grad_all_reduce_linears", "-", "all_reduce")  # the input gradient's, fused with the q/k/v projections
SPLIT_AG = ("split", "-", "all_gather")  # a weight block split by heads: its gradient all-gathered
EXPECTED = {
    "gemma2": {AR: 1, GARL: 1},
    "gemma3": {AR: 1, GARL: 1, GAR: 2},  # + the q_norm and k_norm weights' gradients (each rank sees its heads only)
    "gpt_neox": {AR: 1, GARL: 1},
    "bloom": {AR: 1, GARL: 1},  # + the ALiBi bias split by heads once (no gradient): checked below
    # parallel attention + MLP (`mlp_out += attn_out`, a sum of partials): one all-reduce, the layer's (below);
    # + k and v (one KV head, replicated) gradients; q rows split
    "falcon": {GAR: 3, SPLIT_AG: 1} if not FALCON_SPLITS else {GAR: 1, SPLIT_AG: 3},
    "phi3": {AR: 1, GAR: 1, SPLIT_AG: 3},  # q, k and v rows split (2 KV heads over 2 ranks)
    "granite": {AR: 1, GARL: 1},
    # parallel attention + MLP sharing one input: the shared input's gradient all-reduced once (attributed to the
    # attention, whose q projection comes first) and both partial outputs summed before one all-reduce (the layer's)
    "cohere": {GARL: 1},
}


@pytest.fixture
def parallelized(monkeypatch):
    """`run_equivalence` of a zoo family under megatron on tp=2, keeping the ParallelModule it made."""
    made = []
    real = autopar.parallelize

    def recording(*args, **kwargs):
        made.append(real(*args, **kwargs))
        return made[-1]

    monkeypatch.setattr(autopar, "parallelize", recording)

    def run(local_world, family):
        model, inputs, tol = FAMILIES[family]()
        with local_world(2):
            res = run_equivalence(model, inputs, (2,), ("tp",), plan="megatron")
        assert res.max_err() <= tol, (family, res.max_err(), tol)
        return res, made[-1]

    return run


@pytest.mark.parametrize("family", list(EXPECTED))
def test_megatron_shards_attention_by_heads_and_the_loss_by_vocab(local_world, parallelized, family):
    res, pm = parallelized(local_world, family)
    plan = res.plan
    forms = {(s.kind, s.form) for s in plan.strategies}
    assert {k for k, f in forms if f == "replicate"} <= {"norm"}, forms  # no attention, loss, linear replicated
    assert ("attention", "heads") in forms and ("loss", "vocab") in forms and ("embedding", "vocab") in forms
    assert not [n for n in plan.notes if "no sharding rule" in n], plan.notes
    attention = [s for s in plan.strategies if s.kind == "attention"]
    assert len(attention) == 2
    for s in attention:
        assert _attention_comms(plan, s.key) == Counter(EXPECTED[family]), (s.key, _attention_comms(plan, s.key))
        if family in ("cohere", "falcon"):
            layer = s.key.rsplit(".", 1)[0]
            assert Counter((c.fn, c.forward, c.backward) for c in plan.comms if c.module == layer) == Counter({AR: 1})
            assert not _attention_comms(plan, layer + ".mlp")
    # the cross-entropy is the vocab-parallel one, on logits sharded on the vocabulary
    (ce,) = [n for n in pm.graph_module.graph.nodes if n.target is O.vocab_parallel_cross_entropy_loss]
    assert ce.args[0].meta[M.PLACEMENTS] == (Shard(1),)
    # nothing is all-gathered forward (no fused QKV output, no attention input)
    assert not [c for c in plan.comms if c.forward == "all_gather"], plan.comms
    if family == "bloom":  # the ALiBi bias (b*heads, 1, s), split by heads like the scores, once for all layers
        (split,) = [n for n in pm.graph_module.graph.nodes if n.target is C.split]
        assert tuple(split.args[0].meta["val"].shape) == (16, 1, 16) and split.meta[M.COMM].backward == "-"
        assert split.meta[M.PLACEMENTS] == (_StridedShard(0, split_factor=4),)


def test_gemma2_tied_embedding_and_head_are_vocab_parallel(local_world, parallelized):
    res, pm = parallelized(local_world, "gemma2")
    params = dict(res.plan.params)
    assert params["m.lm_head.weight"] == params["m.model.embed_tokens.weight"] == "S(0)"
    assert not [n for n in res.plan.notes if "tied" in n and "replicate" in n]
    # the soft-capping runs on the vocab shard: div, tanh, mul between the LM head and the cross-entropy
    (ce,) = [n for n in pm.graph_module.graph.nodes if n.target is O.vocab_parallel_cross_entropy_loss]
    n, seen = ce.args[0], []
    while not (n.target is operator.getitem and n.args[0].target is C.grad_all_reduce_linears):  # the LM head
        assert n.meta[M.PLACEMENTS] in ((Shard(1),), (Shard(2),)), (n, n.meta[M.PLACEMENTS])
        seen.append(n.target)
        n = n.args[0]
    assert {aten.div.Tensor, aten.tanh.default, aten.mul.Tensor} <= set(seen)


@pytest.mark.parametrize("family", ["falcon", "phi3"])
def test_unequal_fused_qkv_weight_stays_whole_and_the_plan_says_so(local_world, parallelized, family):
    res, pm = parallelized(local_world, family)
    qkv = {"falcon": "query_key_value", "phi3": "qkv_proj"}[family]
    for fqn, pls in res.plan.params:
        if qkv in fqn:
            assert pls == "R", (fqn, pls)
        if fqn.endswith(("dense.weight", "o_proj.weight")) and "mlp" not in fqn:
            assert pls == "S(1)", (fqn, pls)
    notes = [n for n in res.plan.notes if "blocks of unequal size" in n]
    assert len(notes) == 2 and all("its weight stays replicated (held whole)" in n for n in notes)
    # the fused projection is gone: one projection per block (q, k, v), on a slice of the weight's rows
    from autopar.sites import module_path
    projections = [n for n in pm.graph_module.graph.nodes if n.op == "call_function" and module_path(n).endswith(qkv)
                   and n.target in (aten.linear.default, aten.matmul.default)]
    fused = {"falcon": 48, "phi3": 64}[family]
    assert len(projections) == 6 and all(n.meta["val"].shape[-1] < fused for n in projections)


# ----------------------------------------------------------------------------- the rules these structures need

def _shard(x: torch.Tensor, p, r: int, n: int) -> torch.Tensor:
    if is_shard(p):
        return _take_chunk(x, p.dim, n, r, p.split_factor if isinstance(p, _StridedShard) else 1)
    return x


def _assemble(locals_: list[torch.Tensor], p, n: int) -> torch.Tensor:
    """The global value of per-rank values placed `p` (partial gradients of an R input are summed)."""
    if isinstance(p, Partial):
        return sum(locals_)
    if isinstance(p, Replicate):
        for x in locals_[1:]:
            torch.testing.assert_close(x, locals_[0])
        return locals_[0]
    k = p.split_factor if isinstance(p, _StridedShard) else 1
    blocks = [x.chunk(k, p.dim) for x in locals_]
    return torch.cat([torch.cat([b[j] for b in blocks], p.dim) for j in range(k)], p.dim)


def _candidates(t: torch.Tensor, n: int) -> list:
    out = [R]
    for d, size in enumerate(t.shape):
        out += [Shard(d)] if size % n == 0 else []
        out += [_StridedShard(d, split_factor=k) for k in (2, 4) if size % (n * k) == 0]
    return out


def _build(target, args: tuple, kwargs: dict | None = None):
    """A one-op graph: (the op's node, its tensor input nodes, the tensors, a call on other tensors)."""
    kwargs = kwargs or {}
    flat, spec = torch.utils._pytree.tree_flatten((args, kwargs))
    tensors = [a for a in flat if isinstance(a, torch.Tensor)]
    g = fx.Graph()
    nodes = [g.placeholder(f"x{i}") for i in range(len(tensors))]
    for ph, t in zip(nodes, tensors):
        ph.meta["val"] = t

    def fill(values):
        it = iter(values)
        return torch.utils._pytree.tree_unflatten([next(it) if isinstance(a, torch.Tensor) else a for a in flat], spec)

    node_args, node_kwargs = fill(nodes)
    node = g.call_function(target, node_args, node_kwargs)
    node.meta["val"] = target(*args, **kwargs)

    def call(ts):
        a, k = fill(ts)
        return target(*a, **k)

    return node, nodes, tensors, call


def _rule(target, args: tuple, ins: list, n: int = 2):
    node, nodes, _, _ = _build(target, args)
    return RULES[target](node, nodes, ins, n)


def _check_rule(target, args: tuple, kwargs: dict | None = None, n: int = 2) -> int:
    """Every placement combination of the tensor inputs: the rule's required inputs and output, run per rank on
    local shards, give the global op's output, and (float inputs) its gradients, assembled per placement. Returns
    how many combinations shard the output (so a test can tell the rule is not replicate-only)."""
    node, nodes, tensors, call = _build(target, args, kwargs)
    grad_out = torch.randn_like(node.meta["val"])
    leaves = [t.detach().requires_grad_(t.is_floating_point()) for t in tensors]
    ref = call(leaves)
    ref.backward(grad_out)
    sharding = 0
    for ins in itertools.product(*[_candidates(t, n) for t in tensors]):
        req, out = RULES[target](node, nodes, list(ins), n)
        sharding += not isinstance(out, Replicate)
        outs, grads = [], [[] for _ in tensors]
        for r in range(n):
            local = [_shard(t, p, r, n).detach().requires_grad_(t.is_floating_point()) for t, p in zip(tensors, req)]
            y = call(local)
            outs.append(y.detach())
            y.backward(_shard(grad_out, out, r, n) if not isinstance(out, Partial) else grad_out)
            for i, x in enumerate(local):
                grads[i].append(x.grad)
        torch.testing.assert_close(_assemble(outs, out, n), ref.detach(), msg=f"{target} {ins} -> {req}, {out}")
        for i, (leaf, p) in enumerate(zip(leaves, req)):
            if leaf.grad is None:
                continue
            # an R input of a sharded or partial output gets partial gradients (the lowering all-reduces them)
            q = P if isinstance(p, Replicate) and not isinstance(out, Replicate) else p
            torch.testing.assert_close(_assemble(grads[i], q, n), leaf.grad, msg=f"grad {i} of {target} {ins}")
    return sharding


def test_rule_baddbmm_alibi_scores():
    g = torch.Generator().manual_seed(0)
    b1, b2 = torch.randn(8, 4, 6, generator=g, dtype=torch.float64), torch.randn(8, 6, 4, generator=g,
                                                                                 dtype=torch.float64)
    for bias in (torch.randn(8, 1, 4, generator=g, dtype=torch.float64),  # Bloom's alibi (b*heads, 1, s)
                 torch.randn(8, 4, 4, generator=g, dtype=torch.float64), torch.randn(4, generator=g, dtype=torch.float64)):
        assert _check_rule(aten.baddbmm.default, (bias, b1, b2), {"beta": 1.0, "alpha": 0.5}) > 0


def test_rule_bmm_takes_a_strided_batch_shard():
    g = torch.Generator().manual_seed(1)
    a, b = torch.randn(8, 4, 6, generator=g, dtype=torch.float64), torch.randn(8, 6, 2, generator=g, dtype=torch.float64)
    _check_rule(aten.bmm.default, (a, b))
    req, out = _rule(aten.bmm.default, (a, b), [_StridedShard(0, split_factor=4), R])
    assert req == [_StridedShard(0, split_factor=4)] * 2 and out == _StridedShard(0, split_factor=4)


def test_rule_numpy_T():
    g = torch.Generator().manual_seed(2)
    assert _check_rule(aten.numpy_T.default, (torch.randn(4, 6, generator=g, dtype=torch.float64),)) > 0


def test_rule_index_tensor():
    g = torch.Generator().manual_seed(3)
    x = torch.randn(4, 2, 6, 4, generator=g, dtype=torch.float64)
    for idx in ([None, None, torch.tensor([4])],  # Falcon's qkv[:, :, [-2]] (normalised)
                [None, torch.tensor([1, 0])], [None, None, torch.tensor([[1, 2], [3, 0]])],
                [torch.tensor([3, 1]), torch.tensor([0, 1])]):
        _check_rule(aten.index.Tensor, (x, idx))
    req, out = _rule(aten.index.Tensor, (x, [None, None, torch.tensor([[1, 2]])]), [Shard(3), R])
    assert (req, out) == ([Shard(3), R], Shard(4))  # after the indexed dim: shifted by the index's extra dim
    assert _rule(aten.index.Tensor, (x, [None, None, torch.tensor([1])]), [Shard(2), R]) == ([R, R], R)


@pytest.mark.parametrize("mesh", [(2, 2), (4, 2)])
def test_bloom_heads_on_a_data_and_model_mesh(local_world, mesh):
    """(b*heads, s, d) with the batch on the data axis and the heads (strided) on the model axis: the view back to
    (b, heads, s, s) keeps the heads sharded, also with one local batch row (4 over 4 data ranks)."""
    model, inputs, tol = FAMILIES["bloom"]()
    with local_world(mesh[0] * mesh[1]):
        res = run_equivalence(model, inputs, mesh, ("dp", "tp"), plan="megatron")
    assert res.max_err() <= tol, res.max_err()
    assert {s.form for s in res.plan.strategies if s.kind == "attention"} == {"heads"}
    assert not [c for c in res.plan.comms if c.forward == "all_gather"], res.plan.comms
    for s in res.plan.strategies:
        if s.kind == "attention":
            comms = _attention_comms(res.plan, s.key)
            assert comms == Counter({AR: 1, GARL: 1}), comms
