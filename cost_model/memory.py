"""Per-device memory: parameters, gradients, optimizer state, and activations saved for backward.

Model state, per parameter of global numel N on a mesh (`param_state_bytes`, `model_state_bytes`):
- local numel: each tensor dim d is split over the mesh axes whose placement is `Shard(d)` or
  `_StridedShard(d, ...)`; the busiest rank holds `ceil(size_d / prod(axis sizes))` of it, so
  local numel = N / prod(sizes of the sharded axes) when the sizes divide. `Replicate` and
  `Partial` axes hold everything (placements are `torch.distributed.tensor`'s, as in autopar.spec).
- parameters: local numel · itemsize(dtype).
- gradients (trainable parameters): the same as the parameter (DTensor gradients keep the
  parameter's dtype and placements), or the reduce dtype when one is given.
- optimizer: `OPTIMIZER_STATES[optimizer]` states per element (adam/adamw 2, sgd_momentum 1,
  sgd 0). With `master_weights=True` (the default) a 16-bit parameter also has an fp32 master copy
  (4 bytes) and its states are fp32 (mixed-precision Adam: 2 + 2 + 12 = 16 bytes per element,
  ZeRO's K = 12). Otherwise states take the parameter's dtype (what `torch.optim` does).
  `state_bytes_per_element(param dtype, compute dtype, reduce dtype, optimizer)` is the one rule: the
  estimate's `MeshCosting.state_factor` and `param_state_bytes` both read it.

Activations (`saved_activations`, `activation_bytes`): what autograd keeps from the forward for the
backward, read off the forward fx graph (the planner's estimate gives each to the structure whose
form decides its placement and models the step's peak: `autopar.estimate`). Rules:
- a value requires grad when it depends on a placeholder whose `meta["val"].requires_grad`
  (the parameters); only ops with an input that requires grad save anything.
- saved inputs per op: products (`linear`, `mm`, `bmm`, `matmul`, `addmm`, `baddbmm`, `mul`)
  save each operand the other's gradient needs (an operand is saved when the other requires
  grad); `div` saves the divisor (and the dividend when the divisor requires grad);
  SDPA saves q, k, v, its output and an fp32 log-sum-exp (b·heads·s_q·4 bytes, flash-style);
  softmax/log_softmax and the `SAVES_OUTPUT` ops (relu, sigmoid, tanh, exp, rsqrt, sqrt) save
  their output; layer/RMS norms save their input plus fp32 statistics (mean and rstd, 8 bytes
  per normalised row; rstd only for RMS), and their weight and bias; `SAVES_INPUT` ops (gelu, silu, pow, sin, cos, log,
  erf, abs, ...) save their input; cross-entropy saves its target and fp32-sized log-probabilities (its input's
  size); dropout with p > 0 in training saves a 1-byte mask per element; masked_fill/where
  save the mask; `SAVES_NOTHING` ops (add, sub, neg, sum, mean, cat, casts, copies, views, the
  collectives autopar's lowering inserts, ...) save nothing; `regather_linears` (linears on an
  all-gathered input) saves the input's shard (and the weights), `grad_all_reduce_linears` its input;
  any other op conservatively saves all its tensor inputs.
- a saved view is charged to its storage root (the node whose output it aliases), once: q, k
  and v split out of one fused QKV projection cost the projection's output, once. `ALIASES`
  (autopar's `grad_all_reduce` and `placement_hint`, identity forward) are views too, and so are the
  items of a `TUPLE_ALIASES` op (`grad_sync_bucket`: each item its input).
  Placeholders (parameters, buffers, user inputs) are not activations and are not charged.
- with `mesh_shape`, a saved tensor on a node with `meta["autopar_placements"]` (a tuple of
  placements per mesh axis) costs its bytes / prod(sizes of the axes where it is sharded).

Cross-check (tests/test_cost_model.py): Korthikanti et al. (2205.05198) give
`sbh·(34 + 5as/h)` bytes per GPT layer with 16-bit activations and 1-byte dropout masks. For a
GPT layer with flash-style SDPA (no s² terms: `5as²b` becomes the `4asb` fp32 log-sum-exp), the
rules above give exactly their `34sbh` with dropout, `32sbh` without the two dropout masks, plus
the layer norms' statistics (16sb).
"""

from __future__ import annotations

import math
import operator
from collections.abc import Mapping
from dataclasses import dataclass

import torch
from torch import fx
from torch.distributed.tensor import Shard
from torch.distributed.tensor.placement_types import Placement, _StridedShard

from cost_model.analytical import _bound_args, _is_view, _SDPA
from cost_model.hardware import dtype_name

__all__ = [
    "OPTIMIZER_STATES", "MemoryBytes", "StateBytes", "state_bytes_per_element", "zero_state_bytes_per_element",
    "shard_factor", "local_numel",
    "param_state_bytes", "model_state_bytes",
    "SavedTensor", "saved_activations", "activation_bytes",
]

PLACEMENTS_KEY = "autopar_placements"  # passes.meta.PLACEMENTS
OPTIMIZER_STATES = {"adam": 2, "adamw": 2, "sgd": 0, "sgd_momentum": 1}
_FP32_BYTES = 4


@dataclass(frozen=True, kw_only=True)
class MemoryBytes:
    param_bytes: int = 0
    grad_bytes: int = 0
    optimizer_bytes: int = 0
    activation_bytes: int = 0

    @property
    def total_bytes(self) -> int:
        return self.param_bytes + self.grad_bytes + self.optimizer_bytes + self.activation_bytes

    def __add__(self, other: "MemoryBytes") -> "MemoryBytes":
        return MemoryBytes(param_bytes=self.param_bytes + other.param_bytes,
                           grad_bytes=self.grad_bytes + other.grad_bytes,
                           optimizer_bytes=self.optimizer_bytes + other.optimizer_bytes,
                           activation_bytes=self.activation_bytes + other.activation_bytes)


def _check_mesh(placements: tuple[Placement, ...], mesh_shape: tuple[int, ...]) -> None:
    if placements and len(placements) != len(mesh_shape):
        raise ValueError(f"placements {placements} give {len(placements)} mesh axes but the mesh shape "
                         f"{tuple(mesh_shape)} has {len(mesh_shape)}; give one placement per mesh axis")


def shard_factor(placements: tuple[Placement, ...], mesh_shape: tuple[int, ...]) -> int:
    """prod(sizes of the mesh axes where the value is sharded)."""
    _check_mesh(placements, mesh_shape)
    return math.prod(s for p, s in zip(placements, mesh_shape) if isinstance(p, (Shard, _StridedShard)))


def local_numel(shape: tuple[int, ...], placements: tuple[Placement, ...] = (),
                mesh_shape: tuple[int, ...] = ()) -> int:
    """Elements on the busiest rank: each dim ceil-divided by the sizes of the axes sharding it."""
    _check_mesh(placements, mesh_shape)
    dims = [int(s) for s in shape]
    for p, size in zip(placements, mesh_shape):
        if isinstance(p, (Shard, _StridedShard)):
            d = p.dim % len(dims)
            dims[d] = -(-dims[d] // size)
    return math.prod(dims)


def _itemsize(dtype) -> int:
    return getattr(torch, dtype_name(dtype)).itemsize


@dataclass(frozen=True, kw_only=True)
class StateBytes:
    """Bytes per parameter element held from step to step (`state_bytes_per_element`)."""

    param: int  # the parameter as stored
    grad: int  # its gradient
    optimizer: int  # optimizer states, and the fp32 master copy of a 16-bit parameter

    @property
    def total(self) -> int:
        return self.param + self.grad + self.optimizer


def state_bytes_per_element(param_dtype, compute_dtype=None, reduce_dtype=None, optimizer: str = "adam", *,
                            master_weights: bool = True) -> StateBytes:
    """Parameter, gradient and optimizer bytes per parameter element: the one rule for model state (module
    docstring). `param_dtype`: the parameters as the model stores them; `compute_dtype`: what forward and
    backward run in (a `MixedPrecisionPolicy`'s `param_dtype`; None: the stored dtype); `reduce_dtype`: what
    gradients are reduced and kept in (None: the compute dtype). A 16-bit floating parameter trained with
    `master_weights` has an fp32 master copy and fp32 states (mixed-precision Adam: 2 + 2 + 4 + 2·4 = 16
    bytes, ZeRO's K = 12); otherwise states take the parameter's dtype (what `torch.optim` does)."""
    if optimizer not in OPTIMIZER_STATES:
        raise ValueError(f"unknown optimizer {optimizer!r}; expected one of {sorted(OPTIMIZER_STATES)}. Fix: pass "
                         "one of those (the optimizer's state per element decides the memory)")
    size = _itemsize(param_dtype)
    grad = _itemsize(reduce_dtype or compute_dtype or param_dtype)
    master = master_weights and size == 2 and getattr(torch, dtype_name(param_dtype)).is_floating_point
    state_size = _FP32_BYTES if master else size
    return StateBytes(param=size, grad=grad,
                      optimizer=OPTIMIZER_STATES[optimizer] * state_size + (_FP32_BYTES if master else 0))


def zero_state_bytes_per_element(stage: int, num_ranks: int, *, param_bytes: float, grad_bytes: float,
                                 master_bytes: float, optimizer_bytes: float) -> float:
    """ZeRO's static model state per parameter element on each of `num_ranks` data ranks (Rajbhandari et al.,
    1910.02054 §5; Megatron-LM's distributed optimizer, `docs/.../dist_optimizer.md`), from the bytes per element of
    the parameter copy that compute reads (P), its gradient (G), the master copy the optimizer updates when it is not
    that parameter (M: 4 for fp32 masters of 16-bit parameters, 0 otherwise) and the optimizer's states (K):

    | stage | what is sharded            | bytes per element      |
    |-------|----------------------------|------------------------|
    | 0     | nothing (DDP)              | P + G + M + K          |
    | 1     | optimizer state (P_os)     | P + G + (M + K) / d    |
    | 2     | + gradients (P_os+g)       | P + (G + M + K) / d    |
    | 3     | + parameters (P_os+g+p)    | (P + G + M + K) / d    |

    The paper's fp16 mixed precision with Adam (P = G = 2, M + K = 12): 16, 4 + 12/d, 2 + 14/d, 16/d; Megatron's bf16
    parameters with fp32 gradients (P = 2, G = 4, M = 4, K = 8) under its distributed optimizer (stage 1): 6 + 12/d.
    autopar's own plans hold the parts `autopar.forms.zero` says."""
    if stage not in (0, 1, 2, 3):
        raise ValueError(f"ZeRO stage must be 0 (DDP), 1, 2 or 3, got {stage!r}")
    if not isinstance(num_ranks, int) or num_ranks < 1:
        raise ValueError(f"num_ranks must be a positive int (the data-parallel degree), got {num_ranks!r}")
    parts = (param_bytes, grad_bytes, master_bytes + optimizer_bytes)  # stage s shards the last s of them
    whole = {0: 3, 1: 2, 2: 1, 3: 0}[stage]
    return sum(parts[:whole]) + sum(parts[whole:]) / num_ranks


def param_state_bytes(shape: tuple[int, ...], dtype, placements: tuple[Placement, ...] = (),
                      mesh_shape: tuple[int, ...] = (), *, optimizer: str = "adam",
                      master_weights: bool = True, requires_grad: bool = True) -> MemoryBytes:
    """Parameter, gradient and optimizer bytes of one parameter on the busiest rank (module docstring)."""
    per = state_bytes_per_element(dtype, optimizer=optimizer, master_weights=master_weights)
    n = local_numel(shape, placements, mesh_shape)
    if not requires_grad:
        return MemoryBytes(param_bytes=n * per.param)
    return MemoryBytes(param_bytes=n * per.param, grad_bytes=n * per.grad, optimizer_bytes=n * per.optimizer)


def model_state_bytes(params: Mapping[str, torch.Tensor], placements: Mapping[str, tuple[Placement, ...]] | None = None,
                      mesh_shape: tuple[int, ...] = (), *, optimizer: str = "adam",
                      master_weights: bool = True) -> MemoryBytes:
    """Sum of `param_state_bytes` over `params` (e.g. `dict(model.named_parameters())`, meta tensors fine).

    `placements` maps a parameter name to its placements; a name missing from it is replicated."""
    placements = placements or {}
    total = MemoryBytes()
    for name, p in params.items():
        pls = tuple(placements.get(name, ()))
        total += param_state_bytes(tuple(p.shape), p.dtype, pls, mesh_shape if pls else (), optimizer=optimizer,
                                   master_weights=master_weights, requires_grad=p.requires_grad)
    return total


# ---------------------------------------------------------------------------------- activations
aten = torch.ops.aten


@dataclass(frozen=True, kw_only=True)
class SavedTensor:
    bytes: int  # global bytes
    node: fx.Node  # whose meta["autopar_placements"] say how it is sharded
    why: str  # the op that saves it


_PRODUCTS = {"linear", "mm", "bmm", "matmul", "addmm", "baddbmm", "mul"}
SAVES_OUTPUT = {"relu", "sigmoid", "tanh", "exp", "rsqrt", "sqrt", "softmax", "_softmax", "log_softmax",
                "_log_softmax", "reciprocal"}
SAVES_INPUT = {"gelu", "silu", "pow", "sin", "cos", "log", "erf", "abs", "leaky_relu", "elu", "mish",
               "hardswish", "log1p", "clamp", "clamp_min", "clamp_max", "square", "softplus", "amax", "amin",
               "max", "min", "prod", "norm", "linalg_vector_norm", "var", "std"}
SAVES_NOTHING = {"add", "sub", "rsub", "neg", "sum", "mean", "cat", "stack", "to", "_to_copy", "clone", "copy",
                 "contiguous", "reshape", "view", "flatten", "unflatten", "expand", "alias", "zeros_like",
                 "ones_like", "full_like", "empty_like", "detach", "split", "chunk", "unbind", "select",
                 "slice", "transpose", "permute", "unsqueeze", "squeeze", "t", "pad", "constant_pad_nd",
                 "repeat", "repeat_interleave", "triu", "tril", "_assert_tensor_metadata", "type_as",
                 # autopar.runtime.collectives inserted by the lowering (their outputs are new tensors)
                 "all_reduce", "all_gather", "all_gather_rs", "reduce_scatter", "all_to_all"}
# autopar's column-parallel linears fused with their input's collective -> the position of their weights (a tuple)
_FUSED_LINEARS = {"regather_linears": 4, "grad_all_reduce_linears": 2}
# functions whose forward returns an alias of their first input (identity forward)
ALIASES = {"grad_all_reduce", "placement_hint"}
# functions whose forward returns aliases of the tensors of their first argument, a tuple (item i of its input i)
TUPLE_ALIASES = {"grad_sync_bucket"}
_NORMS = {"layer_norm": 2, "native_layer_norm": 2, "rms_norm": 1, "_fused_rms_norm": 1,
          "group_norm": 2, "native_group_norm": 2}  # fp32 statistics per normalised row


def _name(node: fx.Node) -> str:
    schema = getattr(node.target, "_schema", None)
    return schema.name.split("::")[-1] if schema is not None else str(getattr(node.target, "__name__", node.target))


def _storage_root(node: fx.Node) -> fx.Node:
    """The node whose output `node`'s value aliases (itself when it is not a view)."""
    while node.op == "call_function":
        if node.target is operator.getitem:
            src = node.args[0]
            if isinstance(src, fx.Node) and src.op == "call_function" and _name(src) in TUPLE_ALIASES:
                node = src.args[0][node.args[1]]
                continue
            if not (isinstance(src, fx.Node) and src.op == "call_function" and _is_view(src)):
                return node
            node = src
        elif (_is_view(node) or _name(node) in ALIASES) and isinstance(node.args[0], fx.Node):
            node = node.args[0]
        else:
            return node
    return node


def _tensor_bytes(node: fx.Node) -> int:
    val = node.meta.get("val")
    vals = val if isinstance(val, (tuple, list)) else [val]
    return sum(v.numel() * v.element_size() for v in vals if isinstance(v, torch.Tensor))


def _requires_grad(gm: fx.GraphModule) -> set[fx.Node]:
    needs = set()
    for node in gm.graph.nodes:
        val = node.meta.get("val")
        if node.op == "placeholder":
            if isinstance(val, torch.Tensor) and val.requires_grad:
                needs.add(node)
        elif node.op == "call_function":
            floating = any(isinstance(v, torch.Tensor) and v.is_floating_point()
                           for v in (val if isinstance(val, (tuple, list)) else [val]))
            if floating and any(a in needs for a in node.all_input_nodes):
                needs.add(node)
    return needs


def _tensor_args(node: fx.Node) -> list[fx.Node]:
    return [a for a in node.all_input_nodes if isinstance(a.meta.get("val"), torch.Tensor)]


def _saved_by(node: fx.Node, needs: set[fx.Node]) -> list[tuple[fx.Node, int | None]]:
    """(node whose value is saved, extra bytes or None for the value itself) for one op."""
    name = _name(node)
    args = _tensor_args(node)
    if name in _PRODUCTS:
        operands = [a for a in node.args[:3] if isinstance(a, fx.Node)]
        if name in ("addmm", "baddbmm"):
            operands = operands[1:3]
        elif len(operands) > 2 or name == "linear":
            operands = operands[:2]  # linear(x, w, b): the bias' gradient needs nothing
        out = []
        for i, a in enumerate(operands):
            others = operands[:i] + operands[i + 1:]
            if any(o in needs for o in others):
                out.append((a, None))
        return out
    if name in _FUSED_LINEARS:  # linears fused with their input's collective: they keep the input (regather_linears:
        # its shard, all-gathered again backward) for the weight gradients, the weights for the input gradient
        x, weights = node.args[0], node.args[_FUSED_LINEARS[name]]
        return ([(x, None)] if any(w in needs for w in weights) else []) + \
            ([(w, None) for w in weights] if x in needs else [])
    if node.target in _SDPA:
        a = _bound_args(node)
        q = a["query"].meta["val"]
        lse = math.prod(int(x) for x in q.shape[:-1]) * _FP32_BYTES
        return [(a["query"], None), (a["key"], None), (a["value"], None), (node, None), (node, lse)]
    if name == "div":
        divisor = node.args[1] if isinstance(node.args[1], fx.Node) else None
        out = [(divisor, None)] if divisor is not None else []
        if divisor is not None and divisor in needs and isinstance(node.args[0], fx.Node):
            out.append((node.args[0], None))
        return out
    if name in SAVES_OUTPUT:
        return [(node, None)]
    if name in _NORMS:
        x = node.args[0]
        val = x.meta["val"]
        shape = node.args[1] if name in ("layer_norm", "native_layer_norm", "rms_norm", "_fused_rms_norm") else [1]
        rows = val.numel() // max(1, math.prod(int(s) for s in shape))
        affine = [(a, None) for a in node.args[2:4] if isinstance(a, fx.Node)]  # weight and bias (parameters)
        return [(x, None), (node, _NORMS[name] * _FP32_BYTES * rows)] + affine
    if name in SAVES_INPUT:
        return [(args[0], None)] if args else []
    if name in ("cross_entropy_loss", "nll_loss", "nll_loss_forward"):
        logits = node.args[0].meta["val"]
        target = [(node.args[1], None)] if isinstance(node.args[1], fx.Node) else []  # nll_loss' backward reads it
        return [(node.args[0], logits.numel() * max(_FP32_BYTES, logits.element_size()))] + target
    if name in ("dropout", "native_dropout"):
        a = _bound_args(node)
        if a.get("p", 0) and a.get("train", True):
            return [(node, node.args[0].meta["val"].numel())]  # 1-byte mask
        return []
    if name in ("masked_fill", "where"):
        masks = [a for a in args if a.meta["val"].dtype == torch.bool]
        return [(m, None) for m in masks]
    if name in ("embedding", "index_select", "gather", "index", "scatter", "scatter_add"):
        return [(a, None) for a in args if not a.meta["val"].is_floating_point()]
    if name in SAVES_NOTHING or name in ALIASES or name in TUPLE_ALIASES or node.target is operator.getitem \
            or _is_view(node):
        return []
    return [(a, None) for a in args]  # unknown op: conservatively, every tensor input


def saved_activations(gm: fx.GraphModule, inputs: frozenset[str] | set[str] = frozenset()) -> dict[object, SavedTensor]:
    """What autograd saves for backward, keyed by storage root (or (node, why) for extra buffers). `inputs`:
    placeholders (user inputs: token ids, labels) charged when saved, as the other placeholders are not."""
    needs = _requires_grad(gm)
    saved: dict[object, SavedTensor] = {}
    for node in gm.graph.nodes:
        if node.op != "call_function" or not any(a in needs for a in node.all_input_nodes):
            continue
        for value, extra in _saved_by(node, needs):
            if extra is not None:
                saved[(node, "extra", len(saved))] = SavedTensor(bytes=int(extra), node=value, why=_name(node))
                continue
            root = _storage_root(value)
            if (root.op != "call_function" and root.name not in inputs) or root in saved:
                continue  # placeholders are parameters/buffers (and inputs unless asked for), not activations
            saved[root] = SavedTensor(bytes=_tensor_bytes(root), node=root, why=_name(node))
    return saved


def _node_shard_factor(node: fx.Node, mesh_shape: tuple[int, ...] | None) -> int:
    pls = node.meta.get(PLACEMENTS_KEY)
    if mesh_shape is None or pls is None:
        return 1
    if isinstance(pls, list):  # multi-output op: the first output's placements
        pls = pls[0]
    return shard_factor(tuple(pls), tuple(mesh_shape))


def activation_bytes(gm: fx.GraphModule, mesh_shape: tuple[int, ...] | None = None) -> int:
    """Bytes saved for backward on one device: sum over `saved_activations`, each / its shard factor."""
    return sum(-(-s.bytes // _node_shard_factor(s.node, mesh_shape)) for s in saved_activations(gm).values())
