"""Attention masks: which explicit masks are the causal mask (recognition).

Under `torch.export`, Hugging Face causal LMs build their mask explicitly (`create_causal_mask` /
`sdpa_mask` trace to arange, comparisons, index, `&`, expand) and pass it to SDPA instead of
`is_causal=True`. `recognise_masks_pass` decides, for every SDPA site with a mask, whether that mask
is the causal mask, and records it on the site (`AttentionSite.mask_causal`, `mask_note`):

- *position-only*: no graph input reaches the mask (no user input, parameter or buffer; lifted
  constants are allowed, their values are known) and no op on the way draws random numbers. Then
  the mask is a function of the graph's static shapes alone.
- *proved causal*: the mask subgraph is evaluated on the host (`evaluate_mask`; devices moved to
  the CPU, so a model planned on the meta device is checked too) and compared with the causal mask
  of its shape, `keep[..., i, j] == (j <= i)`, on every batch row and head. A bool mask keeps where
  True; an additive mask keeps where 0 and masks where `-inf` or at most half its dtype's lowest
  value (Hugging Face masks with `torch.finfo(dtype).min`; every causal row keeps its diagonal, so
  such a value's softmax weight is exactly 0). The captured graph is specialised to the example
  inputs' shapes, and so is every plan made for it: the proof holds for every call the plan lowers.

A mask that is not both keeps `mask_causal=False` and a note saying why (an input reaches it, e.g.
a padding `attention_mask`; it is a sliding window narrower than the sequence; it lets positions see
later ones; it carries biases), which the sequence forms' preconditions report.

Evaluation is bounded. A value larger than `CHUNK_ELEMENTS` made by an op that broadcasts elementwise
(comparisons, logical ops, arithmetic, `where`, `masked_fill`, casts, `expand`: how the (b, 1, s, s)
mask is formed from index vectors) is never held whole: it is computed a block of query rows (its
second-to-last dim) at a time, and the comparison runs block by block (about 5 ns per mask element on
one CPU core: 2.6 s for Hugging Face Llama's 8x1x8192x8192 mask). A large value made by any other op,
or a mask of more than `MAX_ELEMENTS`, is left unproved, with a note.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Callable, Iterator

import torch
from torch import fx
from torch.utils import _pytree as pytree

from autopar.captured import Captured
from autopar.sites import AttentionSite, Kind, PassContext

aten = torch.ops.aten
CHUNK_ELEMENTS = 1 << 24  # a larger value is computed and checked a block of rows at a time
MAX_ELEMENTS = 1 << 31  # the largest value the evaluation computes (in blocks): b·s² of a mask, s = 32k at b = 2
_FACTORIES = {aten.full.default: 0, aten.ones.default: 0, aten.zeros.default: 0,  # op -> index of its size argument
              aten.new_full.default: 1, aten.new_ones.default: 1, aten.new_zeros.default: 1}
# ops whose output rows (second-to-last dim) come from the matching rows of their inputs (broadcasting, casts,
# expand), from their size alone (factories), or from the matching rows offset on the diagonal (triu, tril)
_ROWWISE = {aten.le.Tensor, aten.lt.Tensor, aten.ge.Tensor, aten.gt.Tensor, aten.eq.Tensor, aten.ne.Tensor,
            aten.le.Scalar, aten.lt.Scalar, aten.ge.Scalar, aten.gt.Scalar, aten.eq.Scalar, aten.ne.Scalar,
            aten.__and__.Tensor, aten.__or__.Tensor, aten.bitwise_and.Tensor, aten.bitwise_or.Tensor,
            aten.logical_and.default, aten.logical_or.default, aten.logical_not.default, aten.bitwise_not.default,
            aten.add.Tensor, aten.sub.Tensor, aten.mul.Tensor, aten.div.Tensor, aten.neg.default, aten.abs.default,
            aten.clamp.default, aten.clamp_min.default, aten.clamp_max.default, aten.minimum.default,
            aten.maximum.default, aten.where.self,
            aten.masked_fill.Scalar, aten.masked_fill.Tensor, aten.to.dtype, aten.to.dtype_layout,
            aten._to_copy.default, aten.clone.default, aten.alias.default, aten.expand.default,
            aten.triu.default, aten.tril.default, *_FACTORIES}


@dataclass(frozen=True)
class _Rows:
    """A value too large to hold: `rows(r0, r1)` computes rows r0:r1 of its second-to-last dim."""

    shape: tuple[int, ...]
    rows: Callable[[int, int], torch.Tensor]


def _rows_of(a, r0: int, r1: int):
    """Rows r0:r1 of an operand broadcast against a value of at least 2 dims."""
    if isinstance(a, _Rows):
        return a.rows(r0, r1)
    if isinstance(a, torch.Tensor) and a.dim() >= 2 and a.shape[-2] != 1:
        return a[..., r0:r1, :]
    return a


def _row_op(n: fx.Node, args, kwargs, shape: tuple[int, ...]) -> _Rows:
    def rows(r0, r1):
        a, k = pytree.tree_map(lambda x: _rows_of(x, r0, r1), (args, kwargs))
        a = list(a)
        if n.target is aten.expand.default or n.target in _FACTORIES:  # the block's rows
            i = _FACTORIES.get(n.target, 1)
            a[i] = [*a[i][:-2], r1 - r0, a[i][-1]]
        elif n.target in (aten.triu.default, aten.tril.default):  # row i of the block is row r0 + i
            a = [a[0], (a[1] if len(a) > 1 else k.pop("diagonal", 0)) + r0]
        return n.target(*a, **k)
    return _Rows(shape, rows)


def _blocks(shape: tuple[int, ...]) -> Iterator[tuple[int, int]]:
    """Row blocks of a value of `shape` of about CHUNK_ELEMENTS each."""
    step = max(1, CHUNK_ELEMENTS // max(1, math.prod(shape[:-2]) * shape[-1]))
    for r0 in range(0, shape[-2], step):
        yield r0, min(r0 + step, shape[-2])


def _ancestors(node: fx.Node) -> list[fx.Node]:
    """`node` and every node it depends on, in graph order."""
    seen, stack = set(), [node]
    while stack:
        n = stack.pop()
        if n in seen:
            continue
        seen.add(n)
        stack.extend(n.all_input_nodes)
    return [n for n in node.graph.nodes if n in seen]


def _inputs_reaching(nodes: list[fx.Node], captured: Captured) -> str | None:
    """Why the mask is not position-only (an input, parameter or buffer reaches it), or None."""
    users = [n.name for n in nodes if n.op == "placeholder" and n.name in captured.user_inputs]
    if users:
        padding = " (padding)" if any("mask" in u for u in users) else ""
        return f"its mask depends on input {', '.join(users)}{padding}"
    params = [captured.param_fqns[n.name] for n in nodes if n.op == "placeholder" and n.name in captured.param_fqns]
    if params:
        return f"its mask depends on parameter {', '.join(params)}"
    buffers = [captured.buffer_fqns.get(n.name, n.name) for n in nodes
               if n.op == "placeholder" and n.name not in captured.constants]
    if buffers:
        return f"its mask reads buffer {', '.join(buffers)}, whose values recognition does not read"
    random = [n.name for n in nodes if n.op == "call_function" and isinstance(n.target, torch._ops.OpOverload)
              and torch.Tag.nondeterministic_seeded in n.target.tags]
    if random:
        return f"its mask draws random numbers ({', '.join(random)})"
    return None


def _on_cpu(x):
    if isinstance(x, torch.device) or (isinstance(x, str) and x in ("meta", "cuda") or str(x).startswith("cuda:")):
        return torch.device("cpu")
    return x


def evaluate_mask(mask: fx.Node, captured: Captured) -> torch.Tensor | _Rows | str:
    """The value of a position-only mask, computed on the CPU (held whole, or by blocks of rows: `_Rows`); or
    why it cannot be computed."""
    nodes = _ancestors(mask)
    why = _inputs_reaching(nodes, captured)
    if why:
        return why
    env: dict[fx.Node, object] = {}
    for n in nodes:
        if n.op not in ("placeholder", "call_function"):
            return f"its mask is computed by {n.op} {n.target}, which recognition does not evaluate"
        val = n.meta.get("val")
        try:
            if n.op == "placeholder":  # a lifted constant
                env[n] = captured.constants[n.name].to("cpu")
                continue
            args, kwargs = pytree.tree_map(lambda a: env[a] if isinstance(a, fx.Node) else a, (n.args, n.kwargs))
            kwargs = {k: _on_cpu(v) if k == "device" else v for k, v in kwargs.items()}
            big = isinstance(val, torch.Tensor) and val.numel() > CHUNK_ELEMENTS
            if big and (val.numel() > MAX_ELEMENTS or n.target not in _ROWWISE or val.dim() < 2):
                return (f"its mask is built from positions only, but checking that it is causal needs a "
                        f"{'x'.join(map(str, val.shape))} value ({n.name}, {n.target}), more than recognition "
                        f"evaluates ({CHUNK_ELEMENTS} elements at once, {MAX_ELEMENTS} by blocks of rows of "
                        "elementwise ops)")
            if big:
                env[n] = _row_op(n, args, kwargs, tuple(val.shape))
            elif any(isinstance(a, _Rows) for a in pytree.tree_leaves((args, kwargs))):
                return f"its mask reduces a value too large to evaluate at once ({n.name}, {n.target})"
            else:
                env[n] = n.target(*args, **kwargs)
        except Exception as e:  # noqa: BLE001 - e.g. a constant on the meta device: the mask stays unproved
            return f"its mask could not be evaluated ({n.name}: {type(e).__name__}: {str(e).splitlines()[0]})"
    return env[mask]


def _keep(value: torch.Tensor) -> torch.Tensor | str:
    """Where the mask lets a query attend (bool), or why the mask is not a pure mask."""
    if value.dtype is torch.bool:
        return value
    if not value.is_floating_point():
        return f"its mask has dtype {value.dtype}, neither bool nor an additive float mask"
    keep = value == 0
    masked = (value == float("-inf")) | (value <= torch.finfo(value.dtype).min / 2)
    if not (keep | masked).all():
        return "its additive mask carries values other than 0 and -inf (a bias such as ALiBi), not only a mask"
    return keep


def describe_mask(value: torch.Tensor | _Rows) -> tuple[bool, str]:
    """(causal, why not) of an evaluated mask (..., s_q, s_k), checked a block of rows at a time."""
    shape = tuple(value.shape)
    s_q, s_k = shape[-2:]
    if s_q != s_k:
        return False, f"its mask is {s_q}x{s_k} (queries x keys): not self-attention over one sequence"
    j = torch.arange(s_k)

    def blocks():  # (keep, causal, i - j) per block of rows
        for r0, r1 in _blocks(shape):
            keep = _keep(_rows_of(value, r0, r1))
            if isinstance(keep, str):
                raise _NotAMask(keep)
            i = torch.arange(r0, r1).unsqueeze(1)
            yield keep, j <= i, i - j

    try:
        if all(bool((keep == c).all()) for keep, c, _ in blocks()):  # stops at the first block that differs
            return True, ""
        all_keep, later, empty, width = True, False, False, 0  # why not: a second pass
        for keep, c, _ in blocks():
            all_keep &= bool(keep.all())
            later |= bool((keep & ~c).any())
            empty |= not bool(keep.any(-1).all())
            width = max(width, int(keep.sum(-1).max()))
        if all_keep:
            return False, "its mask masks nothing (bidirectional attention written as an explicit all-true mask)"
        if later:
            return False, "its mask lets positions attend to later positions (a prefix or bidirectional mask), not causal"
        if empty:
            return False, "its mask leaves some query positions nothing to attend to, not causal"
        if all(bool((keep == (c & (d < width))).all()) for keep, c, d in blocks()):
            return False, f"its mask is a sliding window of {width} tokens, not causal over the {s_q}-token sequence"
        return False, "its mask, built from positions only, differs from the causal mask (e.g. between batch rows)"
    except _NotAMask as e:
        return False, str(e)


class _NotAMask(Exception):
    """An additive mask carries a bias, or a mask has a dtype that is not a mask's."""


def analyse_mask(mask: fx.Node, captured: Captured) -> tuple[bool, str]:
    """(mask_causal, mask_note) of an SDPA mask argument."""
    value = evaluate_mask(mask, captured)
    if isinstance(value, str):
        return False, value
    return describe_mask(value)


def recognise_masks_pass(gm: fx.GraphModule, ctx: PassContext) -> fx.GraphModule:
    """Fill `mask_causal` / `mask_note` of every SDPA attention site that takes a mask (each mask analysed once:
    the layers of a model share one)."""
    found: dict[fx.Node, tuple[bool, str]] = {}
    for idx, site in enumerate(ctx.sites):
        if site.kind is not Kind.ATTENTION or not site.has_mask or site.spelling != "sdpa":
            continue
        assert isinstance(site, AttentionSite)
        mask = site.node.args[3]
        if mask not in found:
            found[mask] = analyse_mask(mask, ctx.captured)
        causal, note = found[mask]
        ctx.sites[idx] = dataclasses.replace(site, mask_causal=causal, mask_note=note)
    return gm
