"""Expert parallelism inside a pipeline stage (issue #23): each stage's MoE experts split over the stage's sub-mesh.

`parallelize(model, mesh, inputs, plan="dp", overrides={"pipeline": "1f1b@pp", "moe": "expert@ep"})` on a
(pp, ep) mesh. The axis besides the pipeline is a data axis (EP within DP, as `autopar.forms.expert` runs it on a
mesh without a pipeline): each rank of a stage's ep line takes its own rows of every microbatch
(`PipelineModule._local_batch`), and the stage's program is autopar's own lowering of that stage's sub-graph on the
ep line, as `autopar.pipeline_tp` does for megatron:

- **Planned on the group's microbatch.** The stage program is planned and lowered for the rows the whole ep line
  holds (the model captured once more on `ep x` the per-rank microbatch, cut where the pipeline's own capture is
  cut: `_Split(cut=)`), with plan='dp' and the user's `moe` override, so the experts are the `expert` form's
  (stacked weights `Shard(0)`: this rank's `E / ep` experts) and everything else replicated.
- **Boundaries stay on this rank's rows.** The stage's received activations and user inputs arrive as this rank's
  `Shard(0)` rows (`lower_context(arrivals=)`) and its outputs leave as the propagation placed them
  (`LowerContext.keep_outputs`): the activations for the next stage this rank's rows (`Shard(0)`), the last
  stage's loss this rank's part of the microbatch's sum (`Partial`). So p2p runs per ep coordinate between the
  stages, carrying `b_mb / ep` rows, and no stage boundary costs a collective; the loss parts are summed over the
  pipeline and ep axes once per call (`PipelineModule._sum_over_mesh`), as under plan='dp'.
- **Collectives in a stage**: the `expert` form's all-to-alls on the stage's ep sub-group, per microbatch and MoE
  layer: forward the split counts, the tokens out and back; backward the tokens' gradients out and back.
- **Gradients once per step.** The replicated weights' gradient all-reduces the lowering puts in each stage program
  (`grad_sync_bucket`, per microbatch) are taken out (`defer_param_grad_sync_pass`): each rank accumulates its own
  rows' part over the microbatches and `PipelineModule._sum_over_data` sums the replicated ones over ep in one
  bucket after the schedule (a sum of partial sums is the gradient: the microbatch losses are already weighed by
  the global count). The experts' gradients are whole on their owners after each backward all-to-all and are not
  summed.

Parameters are the stage ParallelModule's DTensors on the stage's ep sub-mesh (experts `Shard(0)`, the rest
`Replicate()`), empty DTensors with the same placements on the other stages' ranks, as under megatron.

Not implemented (NotImplementedError before any collective, on every rank): a mesh with more than one axis besides
the pipeline axis; an expert axis that is not that axis; a stage plan other than 'dp'; overrides other than `moe`;
ModuleList experts (`Owned` placements: each expert whole on one rank, which the pipeline's per-stage parameters do
not carry yet: use stacked (grouped) experts); `zbv`; tied weights; a model whose MoE adds an auxiliary loss to the
loss (the pipeline's loss rule, `_Split._loss_node`).
"""

from __future__ import annotations

import torch
from torch import fx, nn


def ep_stage_axis(value: str, plan, overrides: dict, names: tuple, axis: str, form: str) -> str | None:
    """The expert-parallel axis inside the stages when the overrides ask for one (`moe: expert@AXIS` next to
    `pipeline`), None when they ask for nothing besides the pipeline; refuses what does not run yet."""
    rest = {k: v for k, v in (overrides or {}).items() if k != "pipeline"}
    if not rest:
        return None
    moe = rest.pop("moe", None)
    if rest or not isinstance(moe, str) or not moe.startswith("expert@"):
        raise NotImplementedError(
            f"overrides {sorted((overrides or {}).keys())} with 'pipeline': {value!r}: inside a pipeline stage only "
            f"'moe': 'expert@AXIS' (expert parallelism on the axis besides {axis!r}) is implemented, got "
            f"{ {k: v for k, v in (overrides or {}).items() if k != 'pipeline'} }. Fix: drop the other overrides.")
    ep = moe.split("@", 1)[1]
    others = [n for n in names if n != axis]
    if others != [ep]:
        raise NotImplementedError(
            f"override 'moe': {moe!r} with 'pipeline': {value!r} on mesh axes {names}: expert parallelism inside a "
            f"stage runs on a (pipeline, expert) mesh, the expert axis being the one axis besides {axis!r}, got "
            f"{others or 'no other axis'}. Fix: a 2-D mesh ({axis!r}, {ep!r}).")
    if plan != "dp":
        raise NotImplementedError(
            f"override 'moe': {moe!r} with 'pipeline': {value!r} and plan={plan!r}: expert parallelism inside a stage "
            "runs with the stage's other weights data parallel (plan='dp'), not yet with fsdp or megatron there. "
            "Fix: plan='dp'.")
    if form == "zbv":
        raise NotImplementedError(
            f"override 'pipeline': {value!r} with expert parallelism in the stages: the zero-bubble schedule splits "
            "each stage's backward into input and weight gradients inside torch's schedule, which the stages' "
            "all-to-alls are not written for. Fix: '1f1b', 'gpipe' or 'interleaved-1f1b'.")
    return ep


def plan_ep_stage(cap, sub_mesh, overrides: dict):
    """Recognise and plan one stage (captured on the ep line's microbatch) on its ep sub-mesh: plan='dp' with the
    `moe` override; offline, the same on every rank. Returns (MeshInfo, Plan). Refuses ModuleList experts and a
    plan that does not split every batched stage input over ep."""
    import dataclasses
    from torch.distributed.tensor import Shard
    from autopar.inputs import batch_dims
    from autopar.mesh import mesh_info
    from autopar.planner import build_plan, check_batch
    from autopar.sites import PassContext
    from autopar.spec import is_owned
    from passes.pipeline import RECOGNISE, run_passes
    info = mesh_info(sub_mesh, part=True)
    ctx = PassContext(cap)
    run_passes(cap.gm, ctx, RECOGNISE)
    batched = dict(zip(cap.user_inputs, batch_dims(cap.example_shapes)))
    shapes = dict(zip(cap.user_inputs, cap.example_shapes))
    moe = {"moe": overrides["moe"]}
    made = build_plan(ctx, info, "dp", moe, batched, input_shapes=shapes)
    made = dataclasses.replace(made, precision=cap.precision.spec() if cap.precision else "")
    check_batch(made)
    owned = [fqn for fqn, pls in made.param_placements().items() if any(map(is_owned, pls))]
    if owned:
        raise NotImplementedError(
            f"override 'moe': {overrides['moe']!r} inside a pipeline stage: experts held in an nn.ModuleList "
            f"({owned[0]} and {len(owned) - 1} more) are each placed whole on one rank (Owned), which the pipeline's "
            "per-stage parameters do not carry yet. Fix: stacked expert weights (one (E, ...) parameter per "
            "projection, e.g. autopar.models.LlamaConfig(moe_style='grouped')), or no pipeline.")
    placed = made.input_placements()
    for name, b in batched.items():
        pls = tuple(placed.get(name, ()))
        if b and pls != (Shard(0),):
            raise NotImplementedError(
                f"expert parallelism inside a pipeline stage: plan 'dp' places the stage input {name!r} as {pls}, "
                "not split on its batch over the expert axis; each rank of a stage passes on its own rows only. "
                "Fix: a batch (per microbatch) that divides over the expert axis.")
    return info, made


def defer_param_grad_sync_pass(gm: fx.GraphModule, params: set[str]) -> fx.GraphModule:
    """Take the data-parallel gradient reductions of parameters out of a stage program: each `grad_sync_bucket` /
    `grad_all_reduce` whose inputs are all parameter placeholders becomes the identity, so the program leaves each
    rank's own part of those gradients (the pipeline sums them once after the schedule). A reduction of anything
    else stays (it is part of the microbatch's backward)."""
    import operator
    from autopar.runtime import collectives as C
    for node in list(gm.graph.nodes):
        if node.op != "call_function":
            continue
        if node.target is C.grad_sync_bucket:
            xs = node.args[0]
            if not all(isinstance(x, fx.Node) and x.op == "placeholder" and x.name in params for x in xs):
                continue
            for user in list(node.users):
                assert user.target is operator.getitem, user
                user.replace_all_uses_with(xs[user.args[1]])
                gm.graph.erase_node(user)
            gm.graph.erase_node(node)
        elif node.target is C.grad_all_reduce:
            x = node.args[0]
            if isinstance(x, fx.Node) and x.op == "placeholder" and x.name in params:
                node.replace_all_uses_with(x)
                gm.graph.erase_node(node)
    gm.graph.lint()
    gm.recompile()
    return gm


def _local_shape(shape: tuple, batched: int, ep: int) -> tuple:
    return (shape[0] // ep, *shape[1:]) if batched else tuple(shape)


class EPStage(nn.Module):
    """One stage as `PipelineStage` runs it, `forward(*received, **user_inputs)`: autopar's ParallelModule of the
    stage's program on the stage's ep sub-mesh, fed this rank's rows of the microbatch and returning this rank's
    rows of the activations (or its part of the loss)."""

    def __init__(self, cap, info, plan, sub_mesh, user: list[str], tensors, buffers, device, rng_stream: str):
        super().__init__()
        from torch.distributed.tensor import Partial, Shard
        from autopar.inputs import batch_dims, local_arrivals
        from autopar.module import ParallelModule
        from autopar.pipeline_tp import _holder
        from autopar.planner import tie_placements
        from passes import meta as M
        from passes.lower import lower_context, lower_pass
        holder = _holder(cap, tensors, buffers, device)
        plan = tie_placements(plan, holder)
        (axis,) = info.names
        arrivals, _ = local_arrivals(plan, cap, info, (axis,))
        lctx = lower_context(plan, cap, info, rng_stream=rng_stream, arrivals=arrivals)
        lctx.keep_outputs = True
        gm = lower_pass(cap.gm, lctx)
        (out,) = [n for n in gm.graph.nodes if n.op == "output"]
        for o in out.args[0]:  # our invariant: activations on this rank's rows, the loss a partial sum
            pls = tuple(o.meta[M.PLACEMENTS])
            assert len(pls) == 1 and (pls[0] == Shard(0) or isinstance(pls[0], Partial)), (o.name, pls)
        defer_param_grad_sync_pass(gm, set(cap.param_fqns))
        ep = info.sizes[0]
        dims = batch_dims(cap.example_shapes)
        examples = tuple(torch.empty(_local_shape(s, b, ep), dtype=cap.placeholder(n).meta["val"].dtype,
                                     device=device)
                         for n, s, b in zip(cap.user_inputs, cap.example_shapes, dims))
        self.pm = ParallelModule(holder, sub_mesh, cap, plan, gm, rng_stream, example_inputs=examples)
        self.pm.check_inputs = False  # the pipeline checks the batch once per call, on the whole mesh
        self.user = user

    def forward(self, *received, **inputs):
        out = self.pm(*received, *(inputs[n] for n in self.user))
        if isinstance(out, tuple):
            return tuple(o.contiguous() for o in out)
        return out.contiguous()


__all__ = ["EPStage", "defer_param_grad_sync_pass", "ep_stage_axis", "plan_ep_stage"]
