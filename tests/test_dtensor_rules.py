"""passes.dtensor_rules: DTensor's answers, translated into decisions the lowering can realise.

The numerical check of every derived rule is `test_rule_check.py::test_dtensor_rule`; these tests pin
the translation itself on one-node graphs: what is taken as is, what is rewritten into the lowering's
local form, and what falls back to replication (with the reason recorded).
"""

from __future__ import annotations

import torch
from torch import fx

import autopar  # noqa: F401
from autopar.spec import P, R, Shard, _StridedShard
from passes.dtensor_rules import derive, dtensor_rule, registered

aten = torch.ops.aten


def node_of(op, *args, **kwargs):
    """The op's node in a one-node graph whose placeholders carry the given tensors' shapes."""
    g = fx.Graph()
    tin = []

    def ph(a):
        if isinstance(a, torch.Tensor):
            p = g.placeholder(f"in{len(tin)}")
            p.meta["val"] = torch.empty_like(a, device="meta")
            tin.append(p)
            return p
        if isinstance(a, list):
            return [ph(x) for x in a]
        return a

    node = g.call_function(op, tuple(ph(a) for a in args), kwargs)
    out = op(*args, **kwargs)
    node.meta["val"] = [torch.empty_like(o, device="meta") for o in out] if isinstance(out, (list, tuple)) \
        else torch.empty_like(out, device="meta")
    return node, tin


def test_partial_plus_constant_is_reduced_first():
    node, tin = node_of(aten.add.Tensor, torch.randn(4, 6), 1e-6)
    assert dtensor_rule(node, tin, [P], 2) == ([R], R)


def test_sum_of_partials_stays_partial():
    node, tin = node_of(aten.add.Tensor, torch.randn(4, 6), torch.randn(4, 6))
    assert dtensor_rule(node, tin, [P, P], 2) == ([P, P], P)


def test_mean_over_a_sharded_dim_is_the_lowerings_sum_div():
    node, tin = node_of(aten.mean.dim, torch.randn(4, 6), [1])
    d = derive(node, tin, [Shard(1)], 2)
    assert (d.req, d.out) == ((Shard(1),), P) and "P(avg)" in d.dtensor and d.reason


def test_vocab_parallel_embedding_is_the_lowerings_masked_lookup():
    node, tin = node_of(aten.embedding.default, torch.randn(16, 8), torch.randint(0, 16, (2, 4)))
    assert dtensor_rule(node, tin, [Shard(0), R], 2) == ([Shard(0), R], P)
    node, tin = node_of(aten.embedding.default, torch.randn(16, 8), torch.randint(0, 16, (2, 4)), 0)
    assert dtensor_rule(node, tin, [Shard(0), R], 2) == ([Shard(0), R], P)  # the masked lookup keeps padding_idx


def test_partials_are_reduced_at_their_first_consumer():
    """DTensor keeps P through mul (P * R -> P); autopar reduces first, so that a value reduced for one consumer is
    not reduced again after another."""
    node, tin = node_of(aten.mul.Tensor, torch.randn(4, 6), torch.randn(4, 1))
    d = derive(node, tin, [P, R], 2)
    assert (d.req, d.out) == ((R, R), R) and "partial inputs reduced first" in d.reason
    node, tin = node_of(aten.add_.Tensor, torch.randn(4, 6), torch.randn(4, 6))
    assert dtensor_rule(node, tin, [P, P], 2) == ([P, P], P)  # a sum of partials (Falcon's mlp_out += attn_out)


def test_reshape_is_asked_as_view():
    """(b, heads, s, d) -> (b*heads, s, d) with heads sharded: a strided shard of the merged dim (Bloom), which
    DTensor's reshape strategy would gather."""
    node, tin = node_of(aten.reshape.default, torch.randn(4, 4, 16, 8), [16, 16, 8])
    assert dtensor_rule(node, tin, [Shard(1)], 2) == ([Shard(1)], _StridedShard(0, split_factor=4))


def test_where_with_a_python_scalar():
    node, tin = node_of(aten.where.ScalarOther, torch.rand(4, 6) > 0.5, torch.randn(2, 4, 6), -1e4)
    assert dtensor_rule(node, tin, [Shard(0), Shard(1)], 2) == ([Shard(0), Shard(1)], Shard(1))


def test_layout_does_not_matter():
    """The explicit attention's q @ k^T with q transposed (non-contiguous): DTensor's matmul decomposition fails on
    its strides, not on its placements."""
    q = torch.randn(4, 16, 4, 8).transpose(1, 2)
    node, tin = node_of(aten.matmul.default, q, torch.randn(4, 4, 8, 16))
    assert dtensor_rule(node, tin, [Shard(1), Shard(1)], 2) == ([Shard(1), Shard(1)], Shard(1))


def test_partial_max_falls_back_with_a_reason():
    node, tin = node_of(aten.amax.default, torch.randn(4, 6), [1])
    d = derive(node, tin, [Shard(1)], 2)
    assert (d.req, d.out) == ((R,), R) and "P(max)" in d.reason


def test_negative_scan_dim_is_normalised():
    """DTensor 2.13 keeps cumsum(x, -1) of x sharded on its last dim sharded (wrong); asked with dim 1 it
    replicates."""
    node, tin = node_of(aten.cumsum.default, torch.randn(4, 6), -1)
    assert dtensor_rule(node, tin, [Shard(1)], 2) == ([R], R)
    assert dtensor_rule(node, tin, [Shard(0)], 2) == ([Shard(0)], Shard(0))


def test_list_inputs_are_redistributed():
    node, tin = node_of(aten.cat.default, [torch.randn(4, 6), torch.randn(4, 2)], 1)
    req, out = dtensor_rule(node, tin, [R, Shard(0)], 2)
    assert req == [Shard(0), Shard(0)] and out == Shard(0)


def test_flatten_of_an_inner_shard_is_strided():
    node, tin = node_of(aten.view.default, torch.randn(4, 6), [24])
    assert dtensor_rule(node, tin, [Shard(1)], 2) == ([Shard(1)], _StridedShard(0, split_factor=4))


def test_multi_output_and_registration():
    node, tin = node_of(aten.topk.default, torch.randn(4, 6), 2)
    assert dtensor_rule(node, tin, [Shard(0)], 2) == ([Shard(0)], [Shard(0), Shard(0)])
    assert registered(aten.topk.default) == "strategy"
    assert registered(aten.linear.default) == "decomposition"
    assert registered(torch.ops.autopar.moe_experts.default) == "none"
