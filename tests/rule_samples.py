"""Hand-written sample arguments: for every op with an own rule, the ops the test models use, the ops of DTensor's
registry that no OpInfo sample reaches (`opinfo_samples.py` generates the rest), and the extra ops real graphs hold.

`samples_for(op)` gives the op's samples: several shapes, tensor-tensor and broadcasting operands,
python numbers and 0-d tensors as operands, keyword variants (`keepdim`, `dim=-1`, `alpha`),
integer and boolean tensors where the op takes them. Shapes are small and mix dims that divide
over 2 and 4 ranks with dims that do not (3, 6), so the check sees shardable and unshardable dims.
`Sample.worlds` adds an axis of 4 where the shapes allow it.

Values are fixed (seeded), fp64, and chosen so the op is smooth where it is evaluated (positive
inputs for log/sqrt/pow, no ties for max/sort/topk).
"""

from __future__ import annotations


import torch
import torch.nn.functional as F

from autopar.spec import R, Shard
from rule_check import Sample

aten = torch.ops.aten
f64 = torch.float64
SAMPLES: dict[object, list[Sample]] = {}


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


_SEED = [0]


def rand(*shape, pos: bool = False, dtype=f64) -> torch.Tensor:
    _SEED[0] += 1
    t = torch.randn(shape, generator=_gen(_SEED[0]), dtype=f64)
    if pos:
        t = t.abs() + 0.5
    return t.to(dtype)


def ints(*shape, high: int = 8, low: int = 0) -> torch.Tensor:
    _SEED[0] += 1
    return torch.randint(low, high, shape, generator=_gen(_SEED[0]))


def bools(*shape) -> torch.Tensor:
    _SEED[0] += 1
    return torch.rand(shape, generator=_gen(_SEED[0])) > 0.5


def add(*ops, make):
    """Register the samples `make(op)` returns for each op."""
    for op in ops:
        SAMPLES.setdefault(op, []).extend(make(op))


# ----------------------------------------------------------------------------- elementwise

UNARY_ANY = [aten.neg.default, aten.exp.default, aten.silu.default, aten.gelu.default, aten.relu.default,
             aten.tanh.default, aten.sigmoid.default, aten.cos.default, aten.sin.default, aten.abs.default,
             aten.erf.default, aten.clone.default, aten.alias.default, aten.contiguous.default, aten.detach.default,
             aten.square.default, aten.softplus.default, aten.expm1.default, aten.mish.default,
             aten.leaky_relu.default, aten.elu.default, aten.hardtanh.default, aten.relu6.default]
UNARY_POS = [aten.rsqrt.default, aten.sqrt.default, aten.log.default, aten.reciprocal.default, aten.log1p.default]

add(*UNARY_ANY, make=lambda op: [Sample(op, (rand(2, 4, 6),), worlds=(2, 4))])
add(*UNARY_POS, make=lambda op: [Sample(op, (rand(2, 4, 6, pos=True),), worlds=(2, 4))])
add(aten.gelu.default, make=lambda op: [Sample(op, (rand(4, 6),), {"approximate": "tanh"})])
add(aten.softplus.default, make=lambda op: [Sample(op, (rand(4, 6), 2.0, 1.0))])
add(aten.leaky_relu.default, make=lambda op: [Sample(op, (rand(4, 6), 0.2))])
add(aten.elu.default, make=lambda op: [Sample(op, (rand(4, 6), 0.5, 1.5, 1.0))])
add(aten.hardtanh.default, make=lambda op: [Sample(op, (rand(4, 6), -0.5, 0.5))])
add(aten.clone.default, make=lambda op: [Sample(op, (rand(4, 6),), {"memory_format": torch.contiguous_format})])

BINARY_TT = [aten.add.Tensor, aten.sub.Tensor, aten.mul.Tensor, aten.div.Tensor, aten.minimum.default,
             aten.maximum.default]


def _binary(op):
    out = [
        Sample(op, (rand(4, 6), rand(4, 6)), note="same shape", worlds=(2, 4)),
        Sample(op, (rand(2, 4, 6), rand(6)), note="broadcast last dim"),
        Sample(op, (rand(4, 1), rand(1, 6)), note="broadcast both"),
        Sample(op, (rand(4, 6), rand(4, 1, pos=True)), note="broadcast size-1 dim"),
        Sample(op, (rand(4, 6), torch.tensor(0.75, dtype=f64)), note="0-d tensor"),
    ]
    if op in (aten.minimum.default, aten.maximum.default):
        return out[:3]
    out += [Sample(op, (rand(4, 6), 1e-6), note="tensor + python number"),
            Sample(op, (rand(2, 4, 6), 2), note="python int")]
    if op in (aten.add.Tensor, aten.sub.Tensor):
        out += [Sample(op, (rand(4, 6), rand(4, 6)), {"alpha": 2.0}, note="alpha"),
                Sample(op, (ints(4, 6), ints(4, 6)), note="int tensors"),
                Sample(op, (rand(2, 4, 6), rand(4, 6)), note="P + P broadcast")]
    if op is aten.mul.Tensor:
        out += [Sample(op, (rand(4, 6), bools(4, 6)), note="float * bool"),
                Sample(op, (ints(4, 6), ints(4, 6)), note="int tensors")]
    return out


add(*BINARY_TT, make=_binary)
add(aten.add.Scalar, aten.sub.Scalar, aten.mul.Scalar, aten.div.Scalar,
    make=lambda op: [Sample(op, (rand(2, 4, 6), 1e-6), worlds=(2, 4)), Sample(op, (rand(4, 6), 3))])
add(aten.add.Scalar, aten.sub.Scalar, make=lambda op: [Sample(op, (rand(4, 6), 2.0, 3.0), note="alpha")])
add(aten.rsub.Scalar, make=lambda op: [Sample(op, (rand(2, 4, 6), 1.0)), Sample(op, (rand(4, 6), 1.0, 2.0))])
add(aten.pow.Tensor_Scalar, make=lambda op: [Sample(op, (rand(2, 4, 6), 2), worlds=(2, 4)),
                                             Sample(op, (rand(4, 6, pos=True), 0.5)),
                                             Sample(op, (rand(4, 6, pos=True), -1.0))])
add(aten.float_power.Tensor_Scalar, make=lambda op: [Sample(op, (rand(4, 6, pos=True), 2.5)),
                                                     Sample(op, (rand(4, 6, dtype=torch.float32), 2.0))])
add(aten.pow.Tensor_Tensor, make=lambda op: [Sample(op, (rand(4, 6, pos=True), rand(4, 6))),
                                             Sample(op, (rand(2, 4, 6, pos=True), rand(6)))])

COMPARE_T = [aten.eq.Tensor, aten.ne.Tensor, aten.lt.Tensor, aten.le.Tensor, aten.gt.Tensor, aten.ge.Tensor]
COMPARE_S = [aten.eq.Scalar, aten.ne.Scalar, aten.lt.Scalar, aten.le.Scalar, aten.gt.Scalar, aten.ge.Scalar]
add(*COMPARE_T, make=lambda op: [Sample(op, (rand(4, 6), rand(6))),
                                 Sample(op, (ints(4, 6, high=3), ints(4, 6, high=3)), note="int, with ties")])
add(*COMPARE_S, make=lambda op: [Sample(op, (rand(2, 4, 6), 0.0)), Sample(op, (ints(4, 6, high=3), 1))])

add(aten.__and__.Tensor, aten.__or__.Tensor, aten.bitwise_and.Tensor, aten.bitwise_or.Tensor,
    make=lambda op: [Sample(op, (bools(4, 6), bools(4, 6))), Sample(op, (bools(2, 4, 6), bools(6))),
                     Sample(op, (ints(4, 6), ints(4, 6)), note="int")])
add(aten.logical_not.default, make=lambda op: [Sample(op, (bools(4, 6),)), Sample(op, (rand(4, 6),))])
add(aten.logical_and.default, make=lambda op: [Sample(op, (bools(4, 6), bools(4, 6))),
                                               Sample(op, (rand(4, 6), bools(6)))])
add(aten.bitwise_not.default, make=lambda op: [Sample(op, (bools(4, 6),)), Sample(op, (ints(4, 6),))])

add(aten.zeros_like.default, aten.ones_like.default,
    make=lambda op: [Sample(op, (rand(4, 6),)), Sample(op, (rand(4, 6),), {"dtype": torch.int64})])
add(aten.full_like.default, make=lambda op: [Sample(op, (rand(4, 6), 2.5)),
                                             Sample(op, (ints(4, 6), 7), {"dtype": f64})])
add(aten.clamp.default, make=lambda op: [Sample(op, (rand(2, 4, 6), -0.5, 0.5), worlds=(2, 4)),
                                         Sample(op, (rand(4, 6),), {"max": 0.3})])

add(aten.to.dtype, make=lambda op: [Sample(op, (rand(4, 6), torch.float32)), Sample(op, (ints(4, 6), f64))])
add(aten.to.dtype_layout, make=lambda op: [Sample(op, (rand(4, 6),), {"dtype": torch.float32,
                                                                    "layout": torch.strided,
                                                                    "device": torch.device("cpu")})])
add(aten.to.device, make=lambda op: [Sample(op, (rand(4, 6), torch.device("cpu"), f64))])
add(aten._to_copy.default, make=lambda op: [Sample(op, (rand(4, 6),), {"dtype": torch.float32}),
                                            Sample(op, (rand(4, 6),))])
add(aten.type_as.default, make=lambda op: [Sample(op, (rand(4, 6), rand(2, dtype=torch.float32))),
                                           Sample(op, (ints(4, 6), rand(4, 6)))])
add(aten.dropout.default, make=lambda op: [
    Sample(op, (rand(4, 6), 0.5, False), note="eval"),
    Sample(op, (rand(4, 8), 0.0, True), note="p=0"),
    Sample(op, (rand(8, 8), 0.4, True), note="train", check="dropout"),
])
add(aten.masked_fill.Scalar, make=lambda op: [
    Sample(op, (rand(4, 6), bools(4, 6), -1e4)),
    Sample(op, (rand(2, 4, 6), bools(4, 1), 0.5), note="broadcast mask"),
    Sample(op, (rand(4, 6), bools(4, 6), float("-inf")), note="-inf"),
])
add(aten.masked_fill.Tensor, make=lambda op: [
    Sample(op, (rand(4, 6), bools(4, 6), torch.tensor(0.25, dtype=f64)), note="0-d value"),
])
add(aten.where.self, make=lambda op: [
    Sample(op, (bools(4, 6), rand(4, 6), rand(4, 6))),
    Sample(op, (bools(4, 1), rand(2, 4, 6), rand(6)), note="broadcast"),
    Sample(op, (bools(4, 6), rand(4, 6), torch.tensor(0.0, dtype=f64)), note="0-d other"),
])

INPLACE_T = [aten.div_.Tensor, aten.mul_.Tensor, aten.add_.Tensor, aten.sub_.Tensor]
add(*INPLACE_T, make=lambda op: [Sample(op, (rand(4, 6), rand(4, 6, pos=True))),
                                 Sample(op, (rand(2, 4, 6), rand(6, pos=True)), note="broadcast"),
                                 Sample(op, (rand(4, 6), 2.0), note="python number")])
add(aten.div_.Scalar, aten.mul_.Scalar, make=lambda op: [Sample(op, (rand(4, 6), 3.0))])

# ----------------------------------------------------------------------------- views

add(aten.view.default, aten.reshape.default, aten._unsafe_view.default, make=lambda op: [
    Sample(op, (rand(4, 6), [24]), worlds=(2, 4)),
    Sample(op, (rand(4, 6), [2, 2, 6]), worlds=(2, 4)),
    Sample(op, (rand(2, 4, 6), [8, 6])),
    Sample(op, (rand(2, 4, 6), [2, 24]), note="merge inner dims"),
    Sample(op, (rand(8, 6), [2, 4, 6])),
    Sample(op, (rand(4, 6), [-1, 3])),
    Sample(op, (rand(8, 6), [2, 4, 6]), note="split a strided dim", strided=2),
    Sample(op, (rand(24), [4, 6]), note="strided flat", strided=4),
    Sample(op, (rand(2, 4, 8), [2, 4, 2, 4]), note="split heads", worlds=(2, 4)),
])
add(aten.flatten.using_ints, make=lambda op: [Sample(op, (rand(2, 4, 6), 1, 2)), Sample(op, (rand(2, 4, 6), 0, -1)),
                                              Sample(op, (rand(2, 4, 6), 0, 1), worlds=(2, 4))])
add(aten.unflatten.int, make=lambda op: [Sample(op, (rand(4, 24), 1, [4, 6])), Sample(op, (rand(8, 6), 0, [2, 4])),
                                         Sample(op, (rand(8, 6), -2, [4, -1]))])
add(aten.unsqueeze.default, make=lambda op: [Sample(op, (rand(4, 6), 1)), Sample(op, (rand(4, 6), -1)),
                                             Sample(op, (rand(4, 6), 0))])
add(aten.squeeze.dim, make=lambda op: [Sample(op, (rand(4, 1, 6), 1)), Sample(op, (rand(4, 6), 1), note="no-op")])
add(aten.squeeze.default, make=lambda op: [Sample(op, (rand(4, 1, 6),))])
add(aten.squeeze.dims, make=lambda op: [Sample(op, (rand(4, 1, 6, 1), [1, 3])), Sample(op, (rand(4, 1, 6), [-2]))])
add(aten.view_as.default, aten.reshape_as.default, make=lambda op: [
    Sample(op, (rand(4, 6), rand(24))), Sample(op, (rand(2, 4, 6), rand(8, 6)))])
add(aten.expand.default, make=lambda op: [
    Sample(op, (rand(4, 1), [4, 6])), Sample(op, (rand(6), [4, 6])), Sample(op, (rand(4, 1, 6), [-1, 2, -1])),
    Sample(op, (rand(4, 6), [2, 4, 6]), note="new leading dim"),
])
add(aten.transpose.int, make=lambda op: [Sample(op, (rand(2, 4, 6), 0, 2), worlds=(2, 4)),
                                         Sample(op, (rand(2, 4, 6), -1, -2))])
add(aten.swapaxes.default, make=lambda op: [Sample(op, (rand(2, 4, 6), 0, 1))])
add(aten.permute.default, make=lambda op: [Sample(op, (rand(2, 4, 6), [2, 0, 1])),
                                           Sample(op, (rand(2, 4, 6), [-1, 1, 0]))])
add(aten.t.default, make=lambda op: [Sample(op, (rand(4, 6),)), Sample(op, (rand(4),), note="1-D")])
add(aten.select.int, make=lambda op: [Sample(op, (rand(4, 6, 2), 1, 2)), Sample(op, (rand(4, 6, 2), -1, 0)),
                                      Sample(op, (rand(4, 6), 0, -1))])
add(aten.slice.Tensor, make=lambda op: [
    Sample(op, (rand(4, 8), 1, 2, 6)),
    Sample(op, (rand(4, 8), 0, 0, 9223372036854775807), note="full"),
    Sample(op, (rand(4, 8), 1, 0, None, 2), note="step 2"),
    Sample(op, (rand(4, 8), -1, 2, -1), note="negative dim and end"),
    Sample(op, (rand(4, 8), 1, -4), note="negative start"),
    Sample(op, (rand(4, 8), 0, 0, 4), note="exact full range"),
])
add(aten.split.Tensor, make=lambda op: [
    Sample(op, (rand(4, 6), 2, 0)), Sample(op, (rand(4, 6), 3, 1)), Sample(op, (rand(4, 8), 2, -1)),
    Sample(op, (rand(4, 6), 4, 1), note="uneven pieces"),
    Sample(op, (rand(2, 12), 4, 1), note="fused QKV", strided=3),
])
add(aten.split_with_sizes.default, make=lambda op: [
    Sample(op, (rand(4, 6), [2, 4], 1)), Sample(op, (rand(8, 6), [4, 4])),
    Sample(op, (rand(2, 12), [4, 4, 4], 1), note="fused QKV", strided=3),
])
add(aten.chunk.default, make=lambda op: [Sample(op, (rand(4, 6), 2, 1)), Sample(op, (rand(4, 6), 3, -1)),
                                         Sample(op, (rand(2, 12), 3, 1), note="fused QKV", strided=3)])
add(aten.unbind.int, make=lambda op: [Sample(op, (rand(2, 4, 6), 1)), Sample(op, (rand(2, 4, 6),)),
                                      Sample(op, (rand(2, 4, 6), -1))])
add(aten.cat.default, make=lambda op: [
    Sample(op, ([rand(4, 6), rand(4, 2)], 1)), Sample(op, ([rand(4, 6), rand(2, 6)],)),
    Sample(op, ([rand(2, 4, 2), rand(2, 4, 2), rand(2, 4, 4)], -1)),
    Sample(op, ([rand(4, 6), ints(4, 2)], 1), note="mixed dtypes"),
])
add(aten.stack.default, make=lambda op: [
    Sample(op, ([rand(4, 6), rand(4, 6)],)), Sample(op, ([rand(4, 6), rand(4, 6)], 1)),
    Sample(op, ([rand(4, 6), rand(4, 6), rand(4, 6)], -1)),
])
add(aten.broadcast_tensors.default, make=lambda op: [
    Sample(op, ([rand(4, 1), rand(1, 6)],)), Sample(op, ([rand(4, 6), rand(4, 6)],)),
    Sample(op, ([rand(2, 4, 6), rand(6)],)),
])

# ----------------------------------------------------------------------------- matmuls

add(aten.linear.default, make=lambda op: [
    Sample(op, (rand(2, 4, 6), rand(8, 6))),
    Sample(op, (rand(2, 4, 6), rand(8, 6), rand(8)), note="bias"),
    Sample(op, (rand(4, 8), rand(8, 8), rand(8)), worlds=(2, 4), note="bias"),
    Sample(op, (rand(4, 12), rand(4, 12)), note="strided weight", strided=2),
])
add(aten.mm.default, make=lambda op: [Sample(op, (rand(4, 6), rand(6, 8)), worlds=(2, 4)),
                                      Sample(op, (rand(4, 12), rand(12, 4)), note="strided", strided=2)])
add(aten.addmm.default, make=lambda op: [
    Sample(op, (rand(8), rand(4, 6), rand(6, 8))),
    Sample(op, (rand(4, 8), rand(4, 6), rand(6, 8)), note="2-D bias"),
    Sample(op, (rand(1, 8), rand(4, 6), rand(6, 8)), note="(1, n) bias"),
    Sample(op, (rand(8), rand(4, 6), rand(6, 8)), {"beta": 0.5, "alpha": 2.0}),
])
add(aten.matmul.default, make=lambda op: [
    Sample(op, (rand(2, 4, 6), rand(6, 8))), Sample(op, (rand(4, 6), rand(6, 8))),
    Sample(op, (rand(2, 4, 6), rand(2, 6, 8)), note="batched"),
    Sample(op, (rand(2, 1, 4, 6), rand(3, 6, 8)), note="broadcast batch"),
    Sample(op, (rand(6), rand(6, 8)), note="vector @ matrix"),
    Sample(op, (rand(2, 4, 6), rand(6)), note="matrix @ vector"),
    Sample(op, (rand(2, 4, 8, 4), rand(2, 4, 4, 8)), note="attention scores", worlds=(2, 4)),
])
add(aten.bmm.default, make=lambda op: [Sample(op, (rand(2, 4, 6), rand(2, 6, 8)), worlds=(2, 4))])
add(aten.outer.default, make=lambda op: [Sample(op, (rand(4), rand(6))), Sample(op, (rand(8), rand(4)), worlds=(4,))])

# ----------------------------------------------------------------------------- reductions

add(aten.sum.dim_IntList, aten.mean.dim, make=lambda op: [
    Sample(op, (rand(2, 4, 6), [1]), worlds=(2, 4)), Sample(op, (rand(2, 4, 6), [1], True)),
    Sample(op, (rand(2, 4, 6), [-1])), Sample(op, (rand(2, 4, 6), [0, 2], True)),
    Sample(op, (rand(2, 4, 6), [1]), {"dtype": f64}), Sample(op, (rand(4, 6), None), note="all dims"),
])
add(aten.sum.default, aten.mean.default, make=lambda op: [Sample(op, (rand(2, 4, 6),), worlds=(2, 4))])
add(aten.sum.dim_IntList, make=lambda op: [Sample(op, (ints(4, 6), [1]), note="int")])
add(aten.amax.default, aten.amin.default, make=lambda op: [
    Sample(op, (rand(2, 4, 6), [1])), Sample(op, (rand(2, 4, 6), [0, 1], True)), Sample(op, (rand(4, 6),))])

ALONG = [aten.softmax.int, aten.log_softmax.int]
add(*ALONG, make=lambda op: [Sample(op, (rand(2, 4, 6), -1), worlds=(2, 4)), Sample(op, (rand(2, 4, 6), 1)),
                             Sample(op, (rand(4, 6), 0, f64), note="dtype")])
add(aten._softmax.default, aten._log_softmax.default,
    make=lambda op: [Sample(op, (rand(2, 4, 6), -1, False)), Sample(op, (rand(2, 4, 6), 1, False))])
add(aten.cumsum.default, make=lambda op: [Sample(op, (rand(2, 4, 6), 1)), Sample(op, (rand(2, 4, 6), -1)),
                                          Sample(op, (ints(4, 6), 0), {"dtype": torch.int64}, note="int")])
add(aten.diff.default, make=lambda op: [
    Sample(op, (rand(4, 6),)), Sample(op, (rand(4, 6), 1, 0)), Sample(op, (rand(4, 6), 2, -1)),
    Sample(op, (rand(4, 6), 1, -1, rand(4, 1)), note="prepend"),
])
add(aten.layer_norm.default, make=lambda op: [
    Sample(op, (rand(2, 4, 6), [6], rand(6), rand(6), 1e-5), worlds=(2, 4)),
    Sample(op, (rand(2, 4, 6), [6])),
    Sample(op, (rand(2, 4, 6), [4, 6], rand(4, 6), None, 1e-5), note="2 normalized dims"),
])
add(aten.pad.default, make=lambda op: [
    Sample(op, (rand(2, 4, 6), [1, 2])), Sample(op, (rand(2, 4, 6), [1, 1, 2, 0]), {"value": 0.5}),
    Sample(op, (rand(2, 4, 6), [1, 1], "reflect"), note="reflect"),
])
add(aten.constant_pad_nd.default, make=lambda op: [
    Sample(op, (rand(2, 4, 6), [1, 1], 0.5)), Sample(op, (rand(2, 4, 6), [-1, -1]), note="crop"),
])

# ----------------------------------------------------------------------------- embedding, attention, losses

add(aten.embedding.default, make=lambda op: [
    Sample(op, (rand(16, 8), ints(2, 4, high=16)), worlds=(2, 4)),
    Sample(op, (rand(16, 6), ints(6, high=16))),
    Sample(op, (rand(16, 8), torch.tensor([[0, 3, 0, 9], [15, 0, 8, 1]]), 0), note="padding_idx"),
])


def _sdpa_ref(q, k, v, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False):
    return F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask, dropout_p=dropout_p, is_causal=is_causal,
                                          scale=scale, enable_gqa=enable_gqa)


add(aten.scaled_dot_product_attention.default, make=lambda op: [
    Sample(op, (rand(2, 4, 8, 4), rand(2, 4, 8, 4), rand(2, 4, 8, 4)), worlds=(2, 4)),
    Sample(op, (rand(2, 4, 8, 4), rand(2, 4, 8, 4), rand(2, 4, 8, 4)), {"is_causal": True}, note="causal"),
    Sample(op, (rand(2, 4, 8, 4), rand(2, 4, 8, 4), rand(2, 4, 8, 4), rand(2, 1, 8, 8)), note="float mask"),
    Sample(op, (rand(2, 4, 8, 4), rand(2, 4, 8, 4), rand(2, 4, 8, 4), torch.ones(8, 8, dtype=torch.bool).tril()),
           note="bool mask"),
    Sample(op, (rand(2, 4, 8, 4), rand(2, 2, 8, 4), rand(2, 2, 8, 4)), {"enable_gqa": True, "scale": 0.3},
           note="GQA", worlds=(2, 4)),
])


def _ce_targets(n, classes, ignore=0):
    t = ints(n, high=classes)
    if ignore:
        t[:ignore] = -100
    return t


add(aten.cross_entropy_loss.default, make=lambda op: [
    Sample(op, (rand(8, 16), _ce_targets(8, 16)), worlds=(2, 4)),
    Sample(op, (rand(8, 16), _ce_targets(8, 16, ignore=3), None, 1, -100), note="ignore_index"),
    Sample(op, (rand(8, 16), _ce_targets(8, 16), None, 0), note="reduction none"),
    Sample(op, (rand(8, 16), _ce_targets(8, 16), None, 2), note="reduction sum"),
    Sample(op, (rand(8, 16), _ce_targets(8, 16), None, 1, -100, 0.1), note="label smoothing"),
    Sample(op, (rand(8, 16), _ce_targets(8, 16), rand(16, pos=True)), note="class weights", no_grad=(2,)),
    Sample(op, (rand(2, 16, 4), ints(2, 4, high=16)), note="(N, C, d) input"),
    Sample(op, (rand(8, 16), rand(8, 16).softmax(-1)), note="probability targets"),
])
add(aten.mse_loss.default, make=lambda op: [
    Sample(op, (rand(4, 6), rand(4, 6))), Sample(op, (rand(4, 6), rand(4, 6), 0)),
    Sample(op, (rand(4, 6), rand(4, 6), 2)), Sample(op, (rand(2, 4, 6), rand(2, 4, 6)), worlds=(2, 4)),
])
add(aten.topk.default, make=lambda op: [Sample(op, (rand(4, 6), 2)), Sample(op, (rand(4, 6), 2, 0)),
                                        Sample(op, (rand(2, 4, 6), 3, -1, False))])
add(aten.sort.default, make=lambda op: [Sample(op, (rand(4, 6),)), Sample(op, (rand(4, 6), 0, True))])
add(aten.sort.stable, make=lambda op: [Sample(op, (rand(4, 6),), {"stable": True, "dim": 0}),
                                       Sample(op, (rand(4, 6),), {"stable": True})])
add(aten.histc.default, make=lambda op: [Sample(op, (rand(4, 6), 5, -2.0, 2.0)),
                                         Sample(op, (rand(4, 6), 4), note="range from the data")])
add(aten.bincount.default, make=lambda op: [Sample(op, (ints(8, high=5),), {"minlength": 8}),
                                            Sample(op, (ints(8, high=5),), note="length from the data"),
                                            Sample(op, (torch.tensor([0, 1, 0, 1, 4, 3, 4, 2]),),
                                                   note="shards of different lengths"),
                                            Sample(op, (ints(8, high=5), rand(8)), note="weights")])


def _moe_samples(op):
    from autopar.runtime import moe as rt

    E, K, T, H, Fd = 4, 2, 8, 6, 4
    spec = rt.ExpertsSpec("rulecheck.moe", E, K, ["w1", "w2", "w3"], rt.grouped_expert(F.silu), "grouped",
                          ffn_dims=[(1, 1), (2, 1), (1, 1)])
    key = rt.register(spec, torch.nn.Identity())
    idx = torch.stack([torch.randperm(E, generator=_gen(100 + t))[:K] for t in range(T)])
    args = (key, rand(T, H), idx, rand(T, K, pos=True), [rand(E, Fd, H), rand(E, H, Fd), rand(E, Fd, H)])

    def ref(key, x, idx, w, params):
        return rt.moe_experts(x, idx, w, list(params), key)

    tp = (R, R, R, Shard(1), Shard(2), Shard(1))
    return [Sample(op, args, ref=ref, note="grouped experts"),
            Sample(op, args, ref=ref, note="tensor-parallel experts, data-parallel tokens",
                   only=[tp, (Shard(0), Shard(0), Shard(0), Shard(1), Shard(2), Shard(1)),
                         (Shard(0), Shard(0), Shard(0), R, R, R)])]


add(torch.ops.autopar.moe_experts.default, make=_moe_samples)

# ----------------------------------------------------------------------------- factories

add(aten.arange.default, make=lambda op: [Sample(op, (8,), {"dtype": f64}), Sample(op, (6,))])
add(aten.arange.start, make=lambda op: [Sample(op, (2, 10), {"dtype": f64})])
add(aten.arange.start_step, make=lambda op: [Sample(op, (0, 12, 3))])
add(aten.ones.default, aten.zeros.default, make=lambda op: [Sample(op, ([4, 6],), {"dtype": f64})])
add(aten.full.default, make=lambda op: [Sample(op, ([4, 6], 2.5), {"dtype": f64})])
add(aten.empty.memory_format, make=lambda op: [Sample(op, ([4, 6],), {"dtype": f64}, check="shape")])
add(aten.scalar_tensor.default, make=lambda op: [Sample(op, (3.5,), {"dtype": f64})])
# of another size (replicated), and of x's own size (placed as x is: its size made local)
add(aten.new_ones.default, aten.new_zeros.default, make=lambda op: [Sample(op, (rand(4, 6), [2, 3])),
                                                                    Sample(op, (rand(4, 6), [4, 6]))])
add(aten.new_full.default, make=lambda op: [Sample(op, (rand(4, 6), [3], 1.5)), Sample(op, (rand(4, 6), [4, 6], 1.5))])
add(aten.new_empty.default, make=lambda op: [Sample(op, (rand(4, 6), [2, 4]), check="shape"),
                                             Sample(op, (rand(4, 6), [4, 6]), check="shape")])
add(aten.tril.default, aten.triu.default, make=lambda op: [
    Sample(op, (rand(4, 6),)), Sample(op, (rand(2, 4, 6), -1)), Sample(op, (rand(4, 4), 1))])
add(aten.lift_fresh_copy.default, make=lambda op: [Sample(op, (rand(4, 6),))])


# ----------------------------------------------------------------------------- indexing, repeats, convolutions, writes

add(aten.index.Tensor, make=lambda op: [
    Sample(op, (rand(8, 6), [ints(3, high=8)]), note="rows"),
    Sample(op, (rand(2, 4, 6), [None, ints(2, 3, high=4)]), note="dim 1, 2-D index"),
    Sample(op, (rand(4, 6), [ints(4, high=4), ints(4, high=6)]), note="two indices"),
    Sample(op, (rand(4, 2, 6, 4), [None, None, torch.tensor([4])]), note="Falcon's KV index"),
])
add(aten.index_select.default, make=lambda op: [Sample(op, (rand(8, 6), 0, ints(4, high=8))),
                                                Sample(op, (rand(2, 4, 6), -1, ints(4, high=6)))])
add(aten.gather.default, make=lambda op: [Sample(op, (rand(4, 6), 1, ints(4, 3, high=6))),
                                          Sample(op, (rand(4, 6), 0, ints(2, 6, high=4)))])
add(aten.scatter.src, aten.scatter_.src,
    make=lambda op: [Sample(op, (rand(4, 6), 1, torch.stack([torch.randperm(6, generator=_gen(7 + r))[:2]
                                                             for r in range(4)]), rand(4, 2)))])
add(aten.scatter.value, aten.scatter_.value, make=lambda op: [
    Sample(op, (rand(4, 6), 1, ints(4, 2, high=6), 1.0)),
    Sample(op, (torch.zeros(8, 4, dtype=f64), 1, ints(8, 2, high=4), 1), note="DeepSeek's group mask")])
add(aten.where.ScalarOther, make=lambda op: [Sample(op, (bools(4, 6), rand(4, 6), -1e4)),
                                             Sample(op, (bools(4, 1), rand(2, 4, 6), 0.0), note="broadcast")])
add(aten.where.ScalarSelf, make=lambda op: [Sample(op, (bools(4, 6), 0.5, rand(4, 6)))])
add(aten.clamp.Tensor, make=lambda op: [Sample(op, (rand(4, 6), rand(6) - 0.5, rand(4, 1) + 0.5))])
add(aten.min.other, aten.max.other, make=lambda op: [Sample(op, (rand(4, 6), rand(4, 6))),
                                                     Sample(op, (ints(2, 4, 6), ints(6)), note="int, broadcast")])
add(aten.baddbmm.default, make=lambda op: [
    Sample(op, (rand(2, 4, 8), rand(2, 4, 6), rand(2, 6, 8))),
    Sample(op, (rand(2, 1, 8), rand(2, 4, 6), rand(2, 6, 8)), {"beta": 0.5, "alpha": 2.0}, note="alibi-like"),
    Sample(op, (rand(8, 1, 4), rand(8, 4, 6), rand(8, 6, 4)), note="Bloom's (b*heads) scores", strided=4),
])
add(aten.numpy_T.default, make=lambda op: [Sample(op, (rand(2, 4, 6),))])
add(aten.repeat.default, make=lambda op: [Sample(op, (rand(4, 6), [2, 1])), Sample(op, (rand(4, 6), [1, 1, 2]))])
add(aten.repeat_interleave.self_int, make=lambda op: [Sample(op, (rand(4, 6), 2, 1)),
                                                      Sample(op, (rand(2, 4, 3), 2, -1), note="GPT-J's rotary")])
add(aten.argmax.default, aten.argmin.default, make=lambda op: [
    Sample(op, (rand(4, 6), 1)), Sample(op, (rand(2, 4, 6), -1, True)), Sample(op, (rand(4, 6),))])
add(aten.logsumexp.default, make=lambda op: [Sample(op, (rand(2, 4, 6), [-1])), Sample(op, (rand(2, 4, 6), [0, 1]))])
add(aten.one_hot.default, make=lambda op: [Sample(op, (ints(4, 6, high=5), 5))])
add(aten.conv2d.default, make=lambda op: [
    Sample(op, (rand(2, 3, 8, 8), rand(4, 3, 2, 2), rand(4), [2, 2]), note="patch embedding"),
    Sample(op, (rand(2, 4, 6, 6), rand(4, 4, 3, 3), None, [1, 1], [1, 1]), note="3x3, padding"),
])
add(aten.convolution.default, make=lambda op: [
    Sample(op, (rand(2, 3, 8, 8), rand(4, 3, 2, 2), rand(4), [2, 2], [0, 0], [1, 1], False, [0, 0], 1)),
    Sample(op, (rand(2, 4, 8), rand(4, 1, 3), None, [1], [2], [1], False, [0], 4), note="causal depthwise conv1d"),
])
# in-place writes: the checked output is the op's (the written tensor, as the graph's later uses read it)
add(aten.copy_.default, make=lambda op: [Sample(op, (rand(4, 6), rand(4, 6))),
                                         Sample(op, (rand(2, 4, 6), rand(6)), note="broadcast source"),
                                         Sample(op, (ints(4, 6), ints(4, 6)), note="int")])
add(aten.fill_.Scalar, make=lambda op: [Sample(op, (rand(4, 6), 0.5))])
add(aten.fill_.Tensor, make=lambda op: [Sample(op, (rand(4, 6), torch.tensor(0.5, dtype=f64))),
                                        Sample(op, (ints(4), torch.tensor(3)), note="T5's start token")])
add(aten.masked_fill_.Scalar, make=lambda op: [Sample(op, (rand(4, 6), bools(4, 6), 0.0)),
                                               Sample(op, (ints(4, 6, low=-2), ints(4, 6) > 3, 0), note="int")])
add(aten.detach_.default, make=lambda op: [Sample(op, (rand(4, 6),))])


# ----------------------------------------------------------------------------- registry ops OpInfo does not reach

# Ops of DTensor's registry that torch.nn models produce but no OpInfo sample reaches (in-place activations of
# `inplace=True` modules, scalar overloads, 1-d pooling, batch norm's ATen forms): hand-written samples, checked
# by the sweep (`rule_sweep.py`) and by `test_rule_check.py`.
add(aten.relu_.default, aten.gelu_.default, aten.square_.default, aten.selu.default, aten.selu_.default,
    aten.relu6_.default, aten.positive.default,
    make=lambda op: [Sample(op, (rand(2, 4, 6),), worlds=(2, 4))])
add(aten.hardtanh_.default, make=lambda op: [Sample(op, (rand(4, 6), -0.5, 0.5))])
add(aten.clamp_max.default, aten.clamp_max_.default, make=lambda op: [Sample(op, (rand(4, 6), 0.3))])
add(aten.clip.default, aten.clip_.default, make=lambda op: [Sample(op, (rand(4, 6), -0.5, 0.5))])
add(aten.sub_.Scalar, make=lambda op: [Sample(op, (rand(4, 6), 0.5))])
add(aten.eq_.Scalar, aten.ne_.Scalar, aten.lt_.Scalar, aten.le_.Scalar, aten.gt_.Scalar, aten.ge_.Scalar,
    make=lambda op: [Sample(op, (rand(4, 6), 0.0))])
add(aten.isfinite.default, make=lambda op: [Sample(op, (rand(4, 6),))])
add(aten.pow.Scalar, make=lambda op: [Sample(op, (2.0, rand(4, 6)))])
add(aten.float_power.Tensor_Tensor, make=lambda op: [Sample(op, (rand(4, 6, pos=True), rand(4, 6)))])
add(aten.true_divide.Tensor, make=lambda op: [Sample(op, (rand(4, 6), rand(4, 6, pos=True)))])
add(aten.div.Scalar_mode, make=lambda op: [Sample(op, (rand(4, 6) * 4, 3.0), {"rounding_mode": "floor"})])
add(aten.bitwise_and.Scalar, aten.bitwise_or.Scalar, aten.bitwise_xor.Scalar,
    make=lambda op: [Sample(op, (ints(4, 6), 3))])
add(aten.fmod.Scalar, make=lambda op: [Sample(op, (rand(4, 6) * 4, 1.5))])
add(aten.remainder.Scalar_Tensor, make=lambda op: [Sample(op, (3.0, rand(4, 6, pos=True)))])
add(aten.avg_pool1d.default, make=lambda op: [Sample(op, (rand(4, 6, 8), [2]))])
add(aten.adaptive_avg_pool1d.default, make=lambda op: [Sample(op, (rand(4, 6, 8), [4]))])
add(aten.adaptive_max_pool1d.default, make=lambda op: [Sample(op, (rand(4, 6, 8), [4]))])
add(aten.max_pool1d_with_indices.default, make=lambda op: [Sample(op, (rand(4, 6, 8), [2]))])
add(aten.native_batch_norm.default, make=lambda op: [
    Sample(op, (rand(2, 4, 5, 6), rand(4), rand(4), None, None, True, 0.1, 1e-5), note="training, no running stats",
           worlds=(2, 4)),
    Sample(op, (rand(1, 8, 5), None, None, None, None, True, 0.1, 1e-5), note="instance norm's: (1, N*C, L)"),
])
add(aten._native_batch_norm_legit_no_training.default, make=lambda op: [
    Sample(op, (rand(4, 6, 5), rand(6), rand(6), rand(6), rand(6, pos=True), 0.1, 1e-5), note="eval",
           no_grad=(3, 4))])
add(aten.slice_scatter.default, make=lambda op: [Sample(op, (rand(4, 6), rand(4, 2), 1, 0, 2))])
add(aten.diag.default, make=lambda op: [Sample(op, (rand(4, 4),))])
# what `rms_norm`'s composite kernel calls on CUDA (on CPU it decomposes into pow/mean/rsqrt/mul)
add(aten._fused_rms_norm.default, make=lambda op: [Sample(op, (rand(2, 4, 6), [6], rand(6), 1e-6), worlds=(2, 4)),
                                                   Sample(op, (rand(4, 6), [6], None, None))])


# ----------------------------------------------------------------------------- ops without a rule

# Ops that real graphs may hold (or that are common in models) with no entry in `passes.rules.RULES`: autopar
# replicates them. `test_rule_check.test_dtensor_rule` checks what DTensor would answer for them (RULECHECK_FULL=1),
# the evidence for adding one to the table.
EXTRA_OPS: list = []


def extra(*ops, make):
    for op in ops:
        if op not in EXTRA_OPS:
            EXTRA_OPS.append(op)
    add(*ops, make=make)


extra(aten.max.dim, make=lambda op: [Sample(op, (rand(4, 6), 1)), Sample(op, (rand(2, 4, 6), 0, True))])
extra(aten.rms_norm.default, make=lambda op: [Sample(op, (rand(2, 4, 6), [6], rand(6), 1e-6)),
                                              Sample(op, (rand(2, 4, 6), [4, 6]))])
extra(aten.native_layer_norm.default, make=lambda op: [Sample(op, (rand(2, 4, 6), [6], rand(6), rand(6), 1e-5))])
extra(aten.group_norm.default, make=lambda op: [Sample(op, (rand(2, 4, 6), 2, rand(4), rand(4), 1e-5))])
extra(aten.concat.default, aten.concatenate.default, make=lambda op: [Sample(op, ([rand(4, 6), rand(4, 2)], 1))])
extra(aten.expand_as.default, make=lambda op: [Sample(op, (rand(4, 1), rand(4, 6)))])
extra(aten.var_mean.correction, make=lambda op: [Sample(op, (rand(2, 4, 6), [-1]), {"correction": 0, "keepdim": True})])
extra(aten.var.correction, make=lambda op: [Sample(op, (rand(2, 4, 6), [1]), {"correction": 1})])
extra(aten.linalg_vector_norm.default, make=lambda op: [Sample(op, (rand(2, 4, 6), 2.0, [-1], True))])
extra(aten.einsum.default, make=lambda op: [Sample(op, ("bij,bjk->bik", [rand(2, 4, 6), rand(2, 6, 8)]))])
extra(aten.roll.default, make=lambda op: [Sample(op, (rand(4, 6), [1], [1]))])
extra(aten.flip.default, make=lambda op: [Sample(op, (rand(4, 6), [0]))])
extra(aten.cumprod.default, make=lambda op: [Sample(op, (rand(2, 4, 6, pos=True), -1))])
extra(aten.max.default, aten.min.default, make=lambda op: [Sample(op, (rand(4, 6),))])
extra(aten.prod.dim_int, make=lambda op: [Sample(op, (rand(4, 6, pos=True), 1))])


def samples_for(op) -> list[Sample]:
    return SAMPLES.get(op, [])
