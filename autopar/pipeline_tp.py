"""Tensor parallelism inside a pipeline stage (issue #23): each stage's sub-graph planned and lowered by autopar.

`parallelize(model, mesh, inputs, plan="megatron", overrides={"pipeline": "1f1b@pp"})` on a (pp, tp) mesh: the
pipeline runtime (`autopar.pipeline_runtime`) cuts the captured graph into stages as for `dp`; here each stage's
`fx.GraphModule` (`_Split.stage_graph`) goes through the same path a captured model takes in
`autopar.parallelize`: it is made a `Captured` of its own (`stage_captured`: the activations it receives and the
user inputs it reads are its user inputs, its parameters, buffers and constants keep their placeholders and
names), recognised (`passes.pipeline.RECOGNISE`), planned with the named plan on the stage's sub-mesh (the mesh
without the pipeline axis; `autopar.planner.build_plan`), lowered (`passes.lower.lower_pass`) and run as an
`autopar.module.ParallelModule` on that sub-mesh (`TPStage`), which is what `PipelineStage` runs. Its contract is
ParallelModule's: every rank of the stage passes the whole (microbatch) inputs and gets the whole outputs, so the
activations p2p carries are plain local tensors replicated over tp that both sides agree on, and the gradients it
sends back are the whole input gradients (the lowering's collectives are autograd-correct: megatron's all-reduce of
a row-parallel output forward, of a column-parallel input's gradient backward). The last stage keeps the loss (its
sum form, weighed by the schedule's loss_fn as under `dp`).

Parameters are the stage ParallelModule's DTensors under their names, on the stage's sub-mesh with the placements
megatron gives them; on the ranks of other stages a DTensor on that stage's sub-mesh with the same placements and
no local data (as an owned expert weight). Every rank plans every stage (offline, no collective: the same plan on
every rank), so every rank knows every parameter's placements; only its own stages are lowered.

Not implemented (NotImplementedError, raised on every rank before any collective): a mesh with more than one axis
besides the pipeline axis (megatron's data axes with tensor parallelism inside a stage), a weight used by two
stages or at two places of a stage (tied weights), `zbv` (its split backward runs inside torch's schedule, not
through the stage program's autograd), and any stage plan whose placements leave a boundary value sharded (sequence
parallelism across a boundary: the plan's input placements must be replicated).
"""

from __future__ import annotations

import torch
from torch import fx, nn
from torch.utils import _pytree as pytree

TP_STAGE_PLANS = ("megatron",)


def check_tp_stage(value: str, plan: str, names: tuple, axis: str, form: str) -> None:
    """What tensor parallelism inside a stage does not run yet, refused before anything is built."""
    rest = [n for n in names if n != axis]
    if len(rest) != 1:
        raise NotImplementedError(
            f"override 'pipeline': {value!r} with plan={plan!r} on mesh axes {names}: tensor parallelism inside a "
            f"stage runs on exactly one axis besides {axis!r} (the stage's sub-mesh is its tp axis), got "
            f"{len(rest)} ({rest or 'none'}); data axes beside tensor parallelism in a stage (pp x dp x tp) are not "
            "implemented yet. Fix: a (pp, tp) mesh, or plan='dp' / 'fsdp' on (pp, dp).")
    if form == "zbv":
        raise NotImplementedError(
            f"override 'pipeline': {value!r} with plan={plan!r}: the zero-bubble schedule splits each stage's "
            "backward into input and weight gradients inside torch's schedule, which a tensor-parallel stage's "
            "collectives are not written for. Fix: '1f1b', 'gpipe' or 'interleaved-1f1b'.")


def stage_captured(captured, gm: fx.GraphModule, acts: list[str], user: list[str], state: list[str]):
    """Stage k's program as a `Captured` of its own: its placeholders in order (received activations, user
    inputs it reads, then its parameters, buffers and constants as the model's capture named them); its output a
    flat tuple (the activations for the next stage, or the loss)."""
    from autopar.captured import Captured
    gm = fx.GraphModule(gm, _copy_graph(gm))
    (out,) = [n for n in gm.graph.nodes if n.op == "output"]
    value = out.args[0]
    single = isinstance(value, fx.Node)
    outs = (value,) if single else tuple(value)
    out.args = (outs,)
    gm.recompile()
    kinds = {name: (kind, ref) for name, kind, ref in captured.input_kinds}
    inputs = [*acts, *user]
    input_kinds = [(n, "input", None) for n in inputs] + [(n, *kinds[n]) for n in state]
    phs = {n.name: n for n in gm.graph.nodes if n.op == "placeholder"}
    shapes = [tuple(phs[n].meta["val"].shape) for n in inputs]
    examples = tuple(torch.empty(s, dtype=phs[n].meta["val"].dtype, device="meta") for n, s in zip(inputs, shapes))
    _, in_spec = pytree.tree_flatten((examples, {}))
    out_examples = outs[0].meta["val"] if single else tuple(o.meta["val"] for o in outs)
    _, out_spec = pytree.tree_flatten(out_examples)
    return Captured(gm, input_kinds, {n: captured.param_fqns[n] for n in state if n in captured.param_fqns},
                    {n: captured.buffer_fqns[n] for n in state if n in captured.buffer_fqns},
                    {n: captured.constants[n] for n in state if n in captured.constants}, inputs, in_spec, out_spec,
                    len(outs), shapes, precision=captured.precision, master_dtype=captured.master_dtype)


def _copy_graph(gm: fx.GraphModule) -> fx.Graph:
    g = fx.Graph()
    env: dict = {}
    for n in gm.graph.nodes:
        env[n] = g.node_copy(n, env.__getitem__)
        env[n].meta = dict(n.meta)
    return g


def plan_stage(cap, sub_mesh, plan: str):
    """Recognise and plan one stage on its sub-mesh with the named plan, as `autopar.parallelize` does for a captured
    model (`_resolve_plan`); offline, the same on every rank. Returns (the PassContext, MeshInfo, Plan)."""
    import dataclasses
    from autopar.inputs import batch_dims
    from autopar.mesh import mesh_info
    from autopar.planner import build_plan, check_batch
    from autopar.sites import PassContext
    from passes.pipeline import RECOGNISE, run_passes
    info = mesh_info(sub_mesh, part=True)
    ctx = PassContext(cap)
    run_passes(cap.gm, ctx, RECOGNISE)
    batch = dict(zip(cap.user_inputs, batch_dims(cap.example_shapes)))
    shapes = dict(zip(cap.user_inputs, cap.example_shapes))
    made = build_plan(ctx, info, plan, None, batch, input_shapes=shapes)
    made = dataclasses.replace(made, precision=cap.precision.spec() if cap.precision else "")
    check_batch(made)
    for name, pls in made.input_placements().items():
        if any(not p.is_replicate() for p in pls):
            raise NotImplementedError(
                f"tensor parallelism inside a pipeline stage: plan {plan!r} places the stage input {name!r} as "
                f"{tuple(pls)}; a value crossing a stage boundary sharded (sequence parallelism across a boundary) "
                "is not implemented yet: p2p carries values replicated over the stage's sub-mesh. Fix: plan='dp'.")
    return info, made


def _holder(cap, tensors: dict[str, torch.Tensor], buffers: dict[str, torch.Tensor], device) -> nn.Module:
    """An nn.Module with the stage's parameters and buffers under their model names (the stage ParallelModule's
    source: it copies them into its DTensors)."""
    from autopar.module import register_at
    root = nn.Module()
    for fqn in cap.param_fqns.values():
        register_at(root, fqn, nn.Parameter(tensors[fqn].detach().to(device).clone()))
    for fqn in cap.buffer_fqns.values():
        register_at(root, fqn, buffers[fqn].detach().to(device).clone(), buffer=True)
    return root


class TPStage(nn.Module):
    """One stage as `PipelineStage` runs it, `forward(*received, **user_inputs)`: autopar's ParallelModule of the
    stage's program on the stage's sub-mesh (`self.pm`), fed the whole microbatch on every rank of the stage."""

    def __init__(self, cap, info, plan, sub_mesh, user: list[str], tensors, buffers, device, rng_stream: str):
        super().__init__()
        from autopar.module import ParallelModule
        from autopar.planner import tie_placements
        from passes.lower import lower_context, lower_pass
        holder = _holder(cap, tensors, buffers, device)
        plan = tie_placements(plan, holder)
        lctx = lower_context(plan, cap, info, rng_stream=rng_stream, arrivals={})
        gm = lower_pass(cap.gm, lctx)
        examples = tuple(torch.empty(s, dtype=cap.placeholder(n).meta["val"].dtype, device=device)
                         for n, s in zip(cap.user_inputs, cap.example_shapes))
        self.pm = ParallelModule(holder, sub_mesh, cap, plan, gm, rng_stream, example_inputs=examples)
        self.pm.check_inputs = False  # the pipeline checks the batch once per call, on the whole mesh
        self.user = user

    def forward(self, *received, **inputs):
        out = self.pm(*received, *(inputs[n] for n in self.user))
        if isinstance(out, tuple):
            return tuple(o.contiguous() for o in out)
        return out.contiguous()


__all__ = ["TP_STAGE_PLANS", "TPStage", "check_tp_stage", "plan_stage", "stage_captured"]
