"""Out-of-range token ids and labels raise on every rank, as on one device.

One device raises `IndexError` when an embedding looks up an id outside [0, V) or a cross-entropy / NLL loss
meets a class target outside [0, C) other than `ignore_index`. In the parallel program the ids a rank sees are
its own share of the batch, so the rank that holds a bad id would raise alone and the others would wait in the
next collective. Instead, before the program runs, every rank evaluates the ids and targets exactly as the model
computes them from the inputs (the integer part of the captured graph that leads from the user inputs to each
embedding's indices and each loss's target: `IndexChecks`), on the whole batch, and raises one device's error.

- inputs="global": every rank holds the whole batch, so every rank raises the same error with no collective.
- inputs="local": each rank checks its own shard (repeated to the captured global batch, which the batch-wise
  ops of these few nodes treat row by row) and the verdict rides on the per-call agreement all-reduce
  (`autopar.agree.agree_on_call`), so every rank raises.

Ids computed from anything but the user inputs' integers (parameters, activations) are checked where they are
used, inside the program (`autopar.runtime.ops._check_ids`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import fx

aten = torch.ops.aten

_EMBEDDINGS = {aten.embedding.default: 1}  # op -> position of the indices
_LOSSES = {aten.cross_entropy_loss.default: 4, aten.nll_loss.default: 4, aten.nll_loss_nd.default: 4,
           aten.nll_loss_forward.default: 4, aten.nll_loss2d.default: 4}  # op -> position of ignore_index


@dataclass(frozen=True)
class Check:
    what: str  # "embedding" or "loss"
    bound: int  # ids must lie in [0, bound)
    ignore_index: int | None  # a loss's ignored target


class IndexChecks:
    """The sub-program from the user inputs to every embedding's ids and every loss's class targets."""

    def __init__(self, gm: fx.GraphModule, inputs: list[str], outputs: list[fx.Node], checks: list[Check]):
        graph = fx.Graph()
        env: dict[fx.Node, fx.Node] = {}
        needed = _ancestors(outputs)
        self.inputs = [ph for ph in inputs if any(n.op == "placeholder" and n.name == ph for n in needed)]
        for node in gm.graph.nodes:
            if node not in needed:
                continue
            env[node] = graph.placeholder(node.name) if node.op == "placeholder" else graph.node_copy(node, env.get)
        graph.output(tuple(env[o] for o in outputs))
        self.program = fx.GraphModule(gm, graph)
        self.checks = checks
        self._placed = False

    def __call__(self, values: dict[str, torch.Tensor]) -> str | None:
        """One device's error message for these inputs (placeholder name -> value), or None when they are valid."""
        args = [values[ph] for ph in self.inputs]
        if args and not self._placed:  # a meta-device model traced its factories (positions) on meta: run them here
            retarget_meta(self.program, args[0].device)
            self._placed = True
        with torch.no_grad():
            ids = self.program(*args)
        for t, check in zip(ids, self.checks):
            valid = t if check.ignore_index is None else t[t != check.ignore_index]
            if valid.numel() == 0:
                continue
            lo, hi = torch.aminmax(valid)
            if bool((lo < 0) | (hi >= check.bound)):  # one host sync
                if check.what == "embedding":
                    return "index out of range in self"  # F.embedding's words
                bad = valid[(valid < 0) | (valid >= check.bound)][0]
                return f"Target {int(bad)} is out of bounds."  # F.cross_entropy's words
        return None


def index_checks(gm: fx.GraphModule, user_inputs: list[str]) -> IndexChecks | None:
    """The checks of a captured graph: each embedding's indices and each loss's integer target that are computed
    from user inputs alone, through integer ops."""
    users = set(user_inputs)
    outputs, checks = [], []
    for node in gm.graph.nodes:
        if node.op != "call_function":
            continue
        if node.target in _EMBEDDINGS:
            ids, bound = node.args[_EMBEDDINGS[node.target]], node.args[0].meta["val"].shape[0]
            check = Check("embedding", bound, None)
        elif node.target in _LOSSES:
            ids, scores = node.args[1], node.args[0].meta["val"]
            if not _is_int(ids):
                continue  # probability targets
            ignore = node.args[_LOSSES[node.target]] if len(node.args) > _LOSSES[node.target] else \
                node.kwargs.get("ignore_index", -100)
            check = Check("loss", scores.shape[1] if scores.dim() > 1 else scores.shape[0], int(ignore))
        else:
            continue
        if isinstance(ids, fx.Node) and _from_user_integers(ids, users):
            outputs.append(ids)
            checks.append(check)
    return IndexChecks(gm, user_inputs, outputs, checks) if outputs else None


def retarget_meta(gm: fx.GraphModule, device: torch.device) -> None:
    """Factory calls and moves traced on the meta device (`arange(..., device=meta)`) run on `device`."""
    def retarget(a):
        return device if isinstance(a, torch.device) and a.type == "meta" else a

    for mod in gm.modules():  # checkpointed layers' bodies too (`passes.checkpoint`)
        if not isinstance(mod, fx.GraphModule):
            continue
        for node in mod.graph.nodes:
            if node.op == "call_function":
                node.args = torch.utils._pytree.tree_map(retarget, node.args)
                node.kwargs = torch.utils._pytree.tree_map(retarget, node.kwargs)
        mod.recompile()


def _is_int(node) -> bool:
    val = node.meta.get("val") if isinstance(node, fx.Node) else None
    return isinstance(val, torch.Tensor) and not val.is_floating_point() and not val.is_complex()


def _ancestors(nodes: list[fx.Node]) -> set[fx.Node]:
    seen, todo = set(), list(nodes)
    while todo:
        n = todo.pop()
        if n not in seen:
            seen.add(n)
            todo.extend(n.all_input_nodes)
    return seen


def _from_user_integers(node: fx.Node, users: set[str]) -> bool:
    """Every node `node` depends on is an integer tensor computed by a pure op from user-input placeholders."""
    for n in _ancestors([node]):
        if n.op == "placeholder":
            if n.name not in users:
                return False
        elif n.op != "call_function" or not _is_int(n) or not isinstance(n.target, torch._ops.OpOverload) \
                or n.target._schema.is_mutable:
            return False
    return True
