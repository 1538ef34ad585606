"""Activation checkpointing levels: what a layer (`autopar.layers.Layer`) keeps from its forward for its backward.

| level       | kept for backward                                   | recomputed in backward               |
|-------------|-----------------------------------------------------|--------------------------------------|
| `none`      | whatever autograd saves in the layer                | nothing                              |
| `selective` | the layer's inputs, the outputs of every other      | every other op of the layer, and its |
|             | matmul (the 1st, 3rd, ...: mm, addmm, bmm) and SDPA | collectives (re-issued), the MoE     |
|             | (torchtitan's op-level SAC)                         | experts and ring attention whole     |
| `full`      | the layer's inputs                                  | the whole layer, its collectives too |

A level is not a structure form: a layer holds several structures (its attention, MLP, norms), each with its
own form, and takes one level besides. So the levels are a registry of their own (`LEVELS`), with the one-home
rule of the forms: no level's name is spelled outside this module (and the tests); the planner, solver,
lowering and plan read them off `LEVELS`.

Overrides name layers: `{"checkpoint": "selective"}` gives every layer a level; `{"checkpoint:layers.*":
"full"}` the layers whose module path matches the glob (`Layer.matches`: a glob over the path or a suffix of
whole components, or the layer's class name, `"checkpoint:LlamaBlock"`). Where several keys name one layer the
most specific wins, as for structures (`autopar.planner.specificity`; the bare `checkpoint` key is the least
specific). A named plan gives every other layer `none`; `auto` lets the ILP choose per layer class
(`autopar.solver`), priced by `price`.

Pricing (per layer, global bytes and forward work; the solver divides by the ranks the tokens are split over):
- saved bytes: `none` what autograd saves in the layer (`cost_model.memory.saved_activations`, by the layer's
  ops); `selective` the layer's inputs + every other matmul output + its attention outputs (SDPA's log-sum-exp
  too); `full` its inputs; a layer's inputs without a gradient (RoPE's tables) are kept once for all layers
  (`autopar.solver`);
- recompute: the forward work again of the recomputed ops (`full`: every op; `selective`: all but the saved
  ones), and the layer's forward collectives issued again (both levels recompute collectives: saving their
  outputs would keep a tensor per collective, and the re-issue is what the plan's `record_comms` shows);
- transient: in backward one layer at a time holds its recomputed tensors again (its `none` bytes less what the
  level keeps anyway): the largest over the checkpointed layers joins the peak.
"""

from __future__ import annotations

import operator
from dataclasses import dataclass, field

import torch
from torch import fx

from autopar.layers import Layer

aten = torch.ops.aten

KEY = "checkpoint"  # the override key: "checkpoint" (every layer) or "checkpoint:<glob or layer class>"


@dataclass(frozen=True)
class Level:
    name: str
    recomputes: bool  # the layer's ops run again in backward (under torch.utils.checkpoint)
    saves_matmuls: bool  # selective: matmul / attention outputs are kept, the rest recomputed
    what: str  # one line for plans and errors


NONE = Level("none", False, False, "autograd saves what it needs; nothing recomputed")
SELECTIVE = Level("selective", True, True, "keeps every other matmul output and attention outputs, recomputes the rest")
FULL = Level("full", True, False, "keeps the layer's inputs, recomputes the whole layer")
LEVELS: dict[str, Level] = {lv.name: lv for lv in (NONE, SELECTIVE, FULL)}
DEFAULT = NONE  # what a named plan gives a layer no override names


def level(name, where: str = "") -> Level:
    """The level called `name`; a ValueError (what, got, why, fix) for anything else."""
    if isinstance(name, str) and name in LEVELS:
        return LEVELS[name]
    raise ValueError(f"{where or 'checkpoint level'}: got {name!r}, which is not an activation checkpointing level. "
                     f"Levels: {', '.join(LEVELS)} ({'; '.join(f'{lv.name}: {lv.what}' for lv in LEVELS.values())}). "
                     f"Fix: e.g. {{{KEY!r}: 'selective'}} or {{'{KEY}:layers.*': 'full'}}")


def is_key(key) -> bool:
    return isinstance(key, str) and (key == KEY or key.startswith(KEY + ":"))


def parse_overrides(overrides: dict | None, layers: list[Layer], specificity) -> dict[str, Level]:
    """Layer path -> the level an override forces (`checkpoint` keys only; the most specific key wins,
    `specificity` is the planner's); errors say what, got, why, fix."""
    winner: dict[str, tuple[tuple, str, Level]] = {}
    for key, value in (overrides or {}).items():
        if not is_key(key):
            continue
        glob = key[len(KEY) + 1:] if key != KEY else ""
        lv = level(value, f"override {key!r}")
        if key.startswith(KEY + ":") and not glob:
            raise ValueError(f"override {key!r}: the layer glob after '{KEY}:' is empty. Fix: {{{KEY!r}: "
                             f"{value!r}}} for every layer, or '{KEY}:<module-path glob or layer class>'")
        matched = [la for la in layers if not glob or la.matches(glob)]
        if not matched:
            found = ", ".join(dict.fromkeys(la.path for la in layers[:6])) + (", ..." if len(layers) > 6 else "")
            classes = ", ".join(dict.fromkeys(la.cls for la in layers))
            raise ValueError(
                f"override {key!r} matches no layer" + (f": the layers are {found} (class {classes})" if layers else
                                                        ": this model has no repeated layers (modules in a "
                                                        "ModuleList/Sequential), the unit of checkpointing")
                + f". Fix: a module-path glob such as '{KEY}:layers.*', a layer class, or {KEY!r} for every layer")
        spec = (-1, 0) if not glob else specificity(glob)
        for la in matched:
            prev = winner.get(la.path)
            if prev is None or spec > prev[0]:
                winner[la.path] = (spec, key, lv)
            elif spec == prev[0] and lv != prev[2]:
                raise ValueError(f"overrides {prev[1]!r}: {prev[2].name!r} and {key!r}: {lv.name!r} both name layer "
                                 f"{la.path} and are equally specific, so neither wins. Fix: drop one, or name the "
                                 f"layer by its exact path ('{KEY}:{la.path}')")
    return {path: lv for path, (_, _, lv) in winner.items()}


# ----------------------------------------------------------------------------- what the runtime keeps

def matmul_ops() -> frozenset:
    """The matmuls, of which `selective` keeps every other output (the 1st, 3rd, ... of a layer's forward)."""
    return frozenset({aten.mm.default, aten.addmm.default, aten.bmm.default, aten.baddbmm.default,
                      aten.linear.default, aten.matmul.default})


def keeps_matmul(count: int) -> bool:
    """Whether `selective` keeps the output of a layer's `count`-th matmul (from 1): torchtitan's op-level SAC
    keeps every other one (`mm_count % 2`), recomputing the rest, which halves the matmul outputs kept for a
    quarter of the matmul work again."""
    return count % 2 == 1


def saved_ops() -> frozenset:
    """The ops whose outputs `selective` keeps (`autopar.runtime.checkpoint`'s policy, and `price`): the matmuls
    (every other one: `keeps_matmul`) and SDPA. Not the MoE experts: lowering runs them as a Python function
    (`autopar.runtime.moe.moe_experts`) whose matmuls depend on the routing, recomputed whole
    (`passes.checkpoint`), its token all-to-alls re-issued."""
    ops = set(matmul_ops())
    from cost_model.analytical import _SDPA
    ops |= set(_SDPA)
    for name in ("_flash_attention_forward", "_efficient_attention_forward", "_grouped_mm"):
        if hasattr(aten, name):
            ops.add(getattr(aten, name).default)
    return frozenset(ops)


# ----------------------------------------------------------------------------- pricing

@dataclass
class LayerPrice:
    """One layer at every level, global (whole batch): bytes kept for backward, forward nodes recomputed."""

    saved: dict[str, float] = field(default_factory=dict)  # level -> bytes kept
    recomputed: dict[str, list[fx.Node]] = field(default_factory=dict)  # level -> nodes run again in backward
    work: dict = field(default_factory=dict)  # level -> `SiteStats` of its recomputed nodes (`cost`, read once)
    kept: dict[str, float] = field(default_factory=dict)  # selective: node name -> the bytes it keeps of that op
    inputs: list[fx.Node] = field(default_factory=list)  # the activations the layer reads from outside (kept)
    # the inputs without a gradient (tables, masks: one storage every layer reads): name -> (bytes, whether an op
    # of the layer saves it without recompute)
    tables: dict[str, tuple[float, bool]] = field(default_factory=dict)

    def transient(self, lv: Level) -> float:
        """What recomputing the layer holds again during its backward (beyond what the level keeps)."""
        return max(0.0, self.saved[NONE.name] - self.saved[lv.name]) if lv.recomputes else 0.0


def _bytes(node: fx.Node) -> float:
    v = node.meta.get("val")
    vals = v if isinstance(v, (tuple, list)) else [v]
    return float(sum(x.numel() * x.element_size() for x in vals if isinstance(x, torch.Tensor)))


def price(gm: fx.GraphModule, layer: Layer) -> LayerPrice:
    """`LayerPrice` of `layer` in the captured graph `gm` (module docstring)."""
    from cost_model.memory import _requires_grad, _saved_by, _storage_root
    by_name = {n.name: n for n in gm.graph.nodes}
    nodes = [by_name[n] for n in layer.nodes if n in by_name]
    inside = set(nodes)
    needs = _requires_grad(gm)
    none: dict[object, float] = {}
    for n in nodes:
        if not any(a in needs for a in n.all_input_nodes):
            continue
        for value, extra in _saved_by(n, needs):
            if extra is not None:
                none[(n, len(none))] = float(extra)
                continue
            root = _storage_root(value)
            if root.op == "call_function":
                none.setdefault(root, _bytes(root))
    # the layer's activations (its inputs on the gradient's path: the residual stream); inputs without a gradient
    # (RoPE's tables, masks) are one storage every layer reads, kept as long without recompute (an op of the layer
    # saves them, counted outside the layer's structures, which no level frees): they cost a level nothing
    inputs = {a for n in nodes for a in n.all_input_nodes
              if a not in inside and a.op == "call_function" and isinstance(a.meta.get("val"), torch.Tensor)
              and a in needs}
    in_bytes = sum(_bytes(a) for a in inputs)
    keep, mms = saved_ops(), matmul_ops()
    kept, count = [], 0
    for n in nodes:  # the layer's forward order: the runtime's policy counts its matmuls as they run
        if n.target in mms:
            count += 1
            if not keeps_matmul(count):
                continue
        if n.target in keep:
            kept.append(n)
    kept_set = set(kept)
    out = LayerPrice()
    # a kept op's outputs: its value, and what its kernel returns beside it that its backward reads (SDPA's
    # log-sum-exp, `cost_model.memory._saved_by`'s extra bytes of the node itself)
    for n in kept:
        if n.target is not operator.getitem:
            out.kept[n.name] = _bytes(n) + sum(float(x) for v, x in _saved_by(n, needs) if v is n and x is not None)
    out.saved[NONE.name] = float(sum(none.values()))
    out.saved[FULL.name] = float(in_bytes)
    out.saved[SELECTIVE.name] = float(in_bytes + sum(out.kept.values()))
    out.inputs = sorted(inputs, key=lambda a: a.name)
    saved_here = {v for v, x in (e for n in nodes for e in _saved_by(n, needs)) if x is None}
    out.tables = {a.name: (_bytes(a), a in saved_here) for n in nodes for a in n.all_input_nodes
                  if a not in inside and a.op == "call_function" and isinstance(a.meta.get("val"), torch.Tensor)
                  and a not in needs}
    out.recomputed[NONE.name] = []
    out.recomputed[FULL.name] = nodes
    out.recomputed[SELECTIVE.name] = [n for n in nodes if n not in kept_set]
    return out


__all__ = ["KEY", "Level", "LEVELS", "NONE", "SELECTIVE", "FULL", "DEFAULT", "level", "is_key", "parse_overrides",
           "saved_ops", "matmul_ops", "keeps_matmul", "LayerPrice", "price"]


# ----------------------------------------------------------------------------- the solver's terms

@dataclass(eq=False)  # a group is itself (a dict key)
class Group:
    """Layers that take one level: one layer class (`Layer.cls`), or those of it an override forces alike."""

    cls: str
    layers: list[Layer]
    price: LayerPrice
    forced: Level | None = None

    @property
    def levels(self) -> list[Level]:
        return [self.forced] if self.forced is not None else list(LEVELS.values())

    def holds(self, site_key: str) -> bool:
        return any(site_key == la.path or site_key.startswith(la.path + ".") for la in self.layers)


def groups(gm: fx.GraphModule, layers: list[Layer], forced: dict[str, Level]) -> list[Group]:
    """The layers grouped by class and forced level, each priced once (layers of a class are alike)."""
    out: dict[tuple, Group] = {}
    prices = gm.meta.setdefault("autopar_layer_prices", {})  # priced once per graph as it is (plans share them)
    for la in layers:
        lv = forced.get(la.path)
        key = (la.cls, lv.name if lv else None)
        if key not in out:
            at = (la.path, la.nodes, len(gm.graph.nodes))
            if at not in prices:
                prices[at] = price(gm, la)
            out[key] = Group(cls=la.cls, layers=[], price=prices[at], forced=lv)
        out[key].layers.append(la)
    return list(out.values())


def cost(group: Group, lv: Level, mc, model_degree: int):
    """What `lv` costs the group's layers together, per device (`autopar.estimate.Cost`): `compute_s` the forward
    of the recomputed ops again, `memory_bytes` = `act_bytes` the saved bytes it changes against `none`
    (negative: saved), `transient_bytes` the recompute of one layer in backward. Saved bytes and recompute time
    are divided by the ranks the tokens are split over and by the model axes (`model_degree`: as if every
    structure split them, as the tensor-parallel forms split the matmuls that hold most of both; a structure left
    whole on a model axis saves more and recomputes slower than this). The solver prices the saved bytes per
    placement instead (`autopar.solver.CheckpointTerms.saved_under`: the structures' own saved bytes freed, the
    layers' inputs kept, divided as the norms' form divides them), and the collectives it issues again, knowing the
    forms."""
    from autopar.estimate import Cost, SiteStats, compute_s
    n = len(group.layers)
    st = group.price.work.get(lv.name)
    if st is None:
        st = group.price.work[lv.name] = SiteStats()
        for node in group.price.recomputed[lv.name]:
            st.add_node(node)
    split = mc.dp * model_degree
    recompute = compute_s(st, split, mc.cluster) / 3 if lv.recomputes else 0.0  # compute_s is forward + backward
    delta = n * (group.price.saved[lv.name] - group.price.saved[NONE.name]) / split
    return Cost(compute_s=n * recompute, comm_s=0.0, comm_bytes=0.0, memory_bytes=delta, act_bytes=delta,
                transient_bytes=group.price.transient(lv) / split)
