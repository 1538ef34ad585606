"""The planner's float8 decision: which linears run their GEMMs in fp8, and under which recipe.

`float8=` on `autopar.plan` / `autopar.parallelize` (`autopar.forms.float8.OPTIONS`):

- `None` (the default): every linear in the model's dtype.
- `"tensorwise"` / `"rowwise"`: that recipe on every linear (`nn.Linear`: an `aten.linear` node) but the output head
  (the linears a loss reads: torchtitan keeps `output` in high precision), as torchtitan's float8 converter
  converts them (`filter_fqns=["output"]`; `linears(..., rule=False)`).
- `"auto"` on `plan="auto"`: a binary per linear class inside the ILP, solved under each recipe (`IN_ILP`,
  `set_offer`, `autopar.solver.float8_variants`): priced with the form, so tensor parallelism's effect is weighed per
  linear; the `(float8)` decision lists each recipe's plan and each class's fp8 linears with the time they save.
- `"auto"` on a named plan: per linear, each recipe where it pays (`linears`: torchao's rule,
  `autopar.forms.float8.pays`: the GEMMs' saving beats the scaling's traffic, on the linear's shapes on one rank: its tokens over every rank of the
  mesh, the least a rank computes; small KxN linears fail it), then the plan priced under each recipe (and under
  none), the least estimated step that fits winning; the `(float8)` decision lists each with its step
  (`Plan.explain`). A recipe whose scaling the plan's forms make expensive (rowwise under tensor parallelism: each
  rank casts the replicated activations whole) loses there.

The choice lives in the Plan (`Plan.float8`: (linear, recipe) pairs), the estimate prices it
(`autopar.estimate.apply_float8`, `autopar.forms.blocks.float8_cost`, FSDP's gathers in 1 byte under tensorwise).
"""

from __future__ import annotations

import math

from autopar.sites import Kind, PassContext
import autopar.forms.float8 as f8

DECISION_KEY = "(float8)"

# Why the per-linear choice is made before the solve, and where that is exact (`Plan.explain` says it). A linear's
# fp8 gain is (nearly) separable from the ILP when its form leaves its K and N whole (dp, fsdp, zero1/2: the rank runs
# (M / ranks, K, N) whatever else is chosen, the rule decides on exactly that shape; only the small amax
# all-reduces, which the rule leaves out and the estimate prices, depend on the axes) and the memory limit does not
# see the choice (only FSDP's fp8 copies kept for backward, in 1 byte). It is not
# exact under tensor parallelism: the form divides K or N (a rowwise share can turn `skinny`), the replicated input
# is cast whole and amaxes are all-reduced on the tensor axis; those interactions are weighed per recipe (the plan
# is solved under each recipe's per-linear choice and the best kept), not per linear: a linear the rule keeps in
# fp8 on whole shapes stays fp8 under a TP form. That is the named plans' path: `auto`
# decides per linear class inside the ILP (`IN_ILP`).
SEPARABLE = ("the per-linear rule decides on the rank's own shape where a linear's form keeps its K and N whole "
             "(dp, fsdp, zero) and the memory limit barely sees fp8 (only FSDP's kept fp8 copies, 1 byte), so it is "
             "separable "
             "from the solve there (its amax all-reduces are priced by the estimate, not by the rule); under tensor "
             "parallelism the form's effect (skinny rowwise shares, whole casts, tp amaxes) is weighed per recipe, "
             "not per linear")


def heads(ctx: PassContext) -> set[str]:
    """The linears a loss reads (the output head): kept in high precision."""
    return {lin.key for s in ctx.of_kind(Kind.LOSS) for lin in s.head}


def linears(ctx: PassContext, recipe: str, cluster, world: int, *, rule: bool = True) -> dict[str, str]:
    """{linear key: recipe} for the `nn.Linear`s but the output head; `rule`: only where `recipe` pays on one of
    `world` ranks (module docstring)."""
    import torch

    from autopar.estimate import float8_shapes
    skip = heads(ctx)
    out = {}
    for lin in ctx.of_kind(Kind.LINEAR):
        if lin.key in skip or lin.node.meta.get("val") is None or lin.node.target is not torch.ops.aten.linear.default:
            continue
        m, k, n = float8_shapes(lin)
        dtype = str(lin.node.meta["val"].dtype).removeprefix("torch.")
        if not rule or f8.pays(m / world, k, n, recipe, cluster, dtype):
            out[lin.key] = recipe
    return out


IN_ILP = ("fp8 a binary per linear class in the ILP (identical layers' linears share it, as their forms), solved "
          "under each recipe: each candidate form of a structure beside its fp8 variant, the linears whose fp8 makes "
          "the structure's time less under that form (`solver.float8_variants`: the recipe's `_scaled_mm` rate, the "
          "casts as the form splits them, the amax all-reduces on the axes splitting their dims, FSDP's 1-byte "
          "gathers under tensorwise), so a linear whose fp8 pays under dp can stay bf16 under tensor parallelism; "
          "the hand plans it is re-ranked with take each structure's variant where it pays; the least estimated step "
          "that fits among the recipes; the rows after the recipes: per class, its linears in fp8 and the time that "
          "saves per structure")


def set_offer(ctx: PassContext, offer: dict[str, str]) -> None:
    """The linears ({key: recipe}) the ILP may run in fp8, deciding per class (`autopar.solver.float8_variants`)."""
    ctx.float8_offer = dict(offer)


def given(ctx: PassContext, pairs) -> dict[str, str]:
    """{linear key: recipe} for a choice given as ((module path, recipe), ...) (a torchao-converted model's,
    `autopar.torchao_float8`), each path an `nn.Linear` of the captured model (an `aten.linear`), else ValueError."""
    import torch
    keys = {lin.key for lin in ctx.of_kind(Kind.LINEAR) if lin.node.target is torch.ops.aten.linear.default}
    missing = [p for p, _ in pairs if p not in keys]
    if missing:
        raise ValueError(f"float8 linears {missing[:3]}{' ...' if len(missing) > 3 else ''}: no linear of the "
                         "captured model (an aten.linear at that module path) is there, so autopar cannot run them "
                         "in fp8. Why: a torchao Float8Linear whose forward was replaced or wrapped, or a path "
                         "that is not in the model. Fix: convert the model's nn.Linear modules with "
                         "convert_to_float8_training and pass that model unchanged")
    return dict(pairs)


def set_choice(ctx: PassContext, chosen: dict[str, str]) -> None:
    """The linears the estimate prices in fp8 (`autopar.estimate.apply_float8`)."""
    ctx.float8 = dict(chosen)


def world_size(sizes) -> int:
    return math.prod(sizes)
