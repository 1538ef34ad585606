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
later ones; it carries biases), which the sequence forms' preconditions report. Evaluation is
bounded (`MAX_ELEMENTS` per intermediate value); a larger mask is left unproved, with a note.
"""

from __future__ import annotations

import dataclasses

import torch
from torch import fx

from autopar.captured import Captured
from autopar.sites import AttentionSite, Kind, PassContext

aten = torch.ops.aten
MAX_ELEMENTS = 1 << 26  # largest intermediate value the evaluation materialises (bool: 64 MiB)


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


def evaluate_mask(mask: fx.Node, captured: Captured) -> torch.Tensor | str:
    """The value of a position-only mask, computed on the CPU; or why it cannot be computed."""
    nodes = _ancestors(mask)
    why = _inputs_reaching(nodes, captured)
    if why:
        return why
    env: dict[fx.Node, object] = {}
    for n in nodes:
        val = n.meta.get("val")
        if isinstance(val, torch.Tensor) and val.numel() > MAX_ELEMENTS:
            return (f"its mask is built from positions only, but evaluating it to check that it is causal needs a "
                    f"{'x'.join(map(str, val.shape))} value ({n.name}), more than the {MAX_ELEMENTS} elements "
                    "recognition evaluates")
        if n.op not in ("placeholder", "call_function"):
            return f"its mask is computed by {n.op} {n.target}, which recognition does not evaluate"
        try:
            if n.op == "placeholder":  # a lifted constant
                env[n] = captured.constants[n.name].to("cpu")
                continue
            args, kwargs = torch.utils._pytree.tree_map(
                lambda a: env[a] if isinstance(a, fx.Node) else a, (n.args, n.kwargs))
            kwargs = {k: _on_cpu(v) if k == "device" else v for k, v in kwargs.items()}
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


def describe_mask(value: torch.Tensor) -> tuple[bool, str]:
    """(causal, why not) of an evaluated mask (..., s_q, s_k)."""
    keep = _keep(value)
    if isinstance(keep, str):
        return False, keep
    s_q, s_k = keep.shape[-2:]
    if s_q != s_k:
        return False, f"its mask is {s_q}x{s_k} (queries x keys): not self-attention over one sequence"
    i = torch.arange(s_q).unsqueeze(1)
    j = torch.arange(s_k).unsqueeze(0)
    causal = j <= i
    if bool((keep == causal).all()):
        return True, ""
    if bool(keep.all()):
        return False, "its mask masks nothing (bidirectional attention written as an explicit all-true mask)"
    if bool((keep & ~causal).any()):
        return False, "its mask lets positions attend to later positions (a prefix or bidirectional mask), not causal"
    if not bool(keep.any(-1).all()):
        return False, "its mask leaves some query positions nothing to attend to, not causal"
    width = int(keep.sum(-1).max())
    if bool((keep == (causal & (i - j < width))).all()):
        return False, f"its mask is a sliding window of {width} tokens, not causal over the {s_q}-token sequence"
    return False, "its mask, built from positions only, differs from the causal mask (e.g. between batch rows)"


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
