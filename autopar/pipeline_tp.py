"""Tensor parallelism inside a pipeline stage (issue #23): each stage's sub-graph planned and lowered by autopar.

`parallelize(model, mesh, inputs, plan="megatron", overrides={"pipeline": "1f1b@pp"})` on a (pp, tp) mesh: the
pipeline runtime (`autopar.pipeline_runtime`) cuts the captured graph into stages as for `dp`; here each stage's
`fx.GraphModule` (`_Split.stage_graph`) goes through the same path a captured model takes in
`autopar.parallelize`: it is made a `Captured` of its own (`stage_captured`: the activations it receives and the
user inputs it reads are its user inputs, its parameters, buffers and constants keep their placeholders and
names), recognised (`passes.pipeline.RECOGNISE`), planned with the named plan on the stage's sub-mesh (the mesh
without the pipeline axis; `autopar.planner.build_plan`), lowered (`passes.lower.lower_pass`) and run as an
`autopar.module.ParallelModule` on that sub-mesh (`TPStage`), which is what `PipelineStage` runs. Its contract is
ParallelModule's: every rank of the stage passes the whole (microbatch) inputs and gets the whole outputs (under
plain megatron; sequence parallelism below keeps the boundary activations sharded), so the activations p2p carries
are plain local tensors replicated over tp that both sides agree on, and the gradients it
sends back are the whole input gradients (the lowering's collectives are autograd-correct: megatron's all-reduce of
a row-parallel output forward, of a column-parallel input's gradient backward; the received activations are
differentiated inputs of the stage's lowering, `LowerContext.grad_inputs`, so one consumed directly by
column-parallel work, as T5's encoder output by each decoder layer's cross-attention k/v, gets that f too). The last stage keeps the loss (its
sum form, weighed by the schedule's loss_fn as under `dp`).

Parameters are the stage ParallelModule's DTensors under their names, on the stage's sub-mesh with the placements
megatron gives them; on the ranks of other stages a DTensor on that stage's sub-mesh with the same placements and
no local data (as an owned expert weight). Every rank plans every stage (offline, no collective: the same plan on
every rank), so every rank knows every parameter's placements; only its own stages are lowered.

On a (pp, dp, tp) mesh (megatron: tensor parallel on the last axis the pipeline leaves, data parallel on dp) the
stage program runs on the tp line of this rank's (pp, dp) coordinate (`stage_meshes`), fed this data rank's rows;
the pipelined module's parameters are DTensors on the stage's (dp, tp) sub-mesh, [Replicate(), megatron's
placement], over the stage program's storage (`outer_parameter`), and `PipelineModule._sum_over_data` sums their
gradients over the dp sub-group (one bucket), as under plan='dp'; p2p runs along pp, between the stages of one
(dp, tp) coordinate.

A weight used by stages on several ranks (GPT-2's embedding and head) is one DTensor on their sharing mesh
([Replicate() over the sharing pipeline ranks, megatron's placement], `check_shared_placements`), its gradient
summed shard by shard over those ranks. `zbv` runs torch's split backward on the stage programs (exact; the weight
step re-runs each fused linear-and-reduce node, issuing its backward all-reduce a second time).

Megatron sequence parallelism across the boundaries: `overrides={"pipeline": "1f1b@pp", "norm": "sequence"}` (the
flat megatron plan's own request, `sp_overrides`) plans every stage with sequence-parallel norms on tp. What
crosses a boundary is then the sequence-sharded residual stream: each stage's received activation arrives in the
placement its own program first takes it to (`boundary_placements`: a trial propagation of the stage's plan;
`Shard(1)` on tp here) and is taken so (`lower_context(arrivals=)`, no collective), and the stage before leaves it
so (`LowerContext.output_placements`; a no-op after SP's reduce-scatter of the last row linear), so each tp rank
sends its own shard to the same tp rank of the next stage, 1/tp of the bytes (as `pipeline_estimate` prices it).
The first stage's embedding output is reduce-scattered onto the sequence and the last stage's final norm
all-gathered before the vocab-parallel head, as in the flat plan. Runs under gpipe, 1f1b and zbv
(tests/test_pipeline_tp_sp.py); on (pp, dp, tp) each data rank's tp line runs it on its own rows, the p2p between
the stages of one (dp, tp) coordinate carrying that tp rank's shard (checked against one device on 8 gloo ranks
under 1f1b, gpipe and zbv by `benchmarks/pp_dp_tp_gloo.py --case all`, its construction and collectives in
tests/test_pipeline_dtp_sp.py).

Not implemented (NotImplementedError, raised on every rank before any collective): a mesh with no axis besides the
pipeline axis, a weight used at two places of a stage under two names, a shared weight the stages place differently
or that two stages of one rank hold, a boundary value a stage's plan takes as a partial sum, sequence parallelism
on an axis other than tp.
"""

from __future__ import annotations

import torch
from torch import fx, nn
from torch.utils import _pytree as pytree

TP_STAGE_PLANS = ("megatron",)


def check_tp_stage(value: str, plan: str, names: tuple, axis: str, form: str) -> None:
    """What tensor parallelism inside a stage does not run yet, refused before anything is built."""
    rest = [n for n in names if n != axis]
    if len(rest) not in (1, 2):
        raise NotImplementedError(
            f"override 'pipeline': {value!r} with plan={plan!r} on mesh axes {names}: tensor parallelism inside a "
            f"stage runs on the last axis besides {axis!r} (with at most one data axis before it: pp x tp or "
            f"pp x dp x tp), got {len(rest)} other axes ({rest or 'none'}). Fix: a (pp, tp) or (pp, dp, tp) mesh.")


def check_shared_placements(groups, captured, split, planned: dict, plan: str) -> None:
    """A weight used by several stages (GPT-2's embedding tied to its head) is one tensor on each of their ranks,
    its gradient parts summed over them per tensor-parallel shard (`PipelineModule._sum_over_sharing_stages`): that
    needs every such stage's plan to place it alike (megatron: the vocab-parallel embedding and the column-parallel
    head both shard it on the vocabulary, `Shard(0)`). Refused otherwise, before anything is built. `groups`: per
    parameter tensor, (its names, its placeholders) (`pipeline_runtime._param_groups`)."""
    for names, phs in groups:
        used = [ph for ph in phs if captured.placeholder(ph).users]
        stages = sorted({k for ph in used for k in split.stages_of[ph]})
        if len(stages) < 2:
            continue
        fqn = captured.param_fqns[used[0]]
        placed = {k: tuple(planned[k][2].param_placements()[fqn]) for k in stages}
        if len(set(placed.values())) > 1:
            raise NotImplementedError(
                f"override 'pipeline' with plan={plan!r}: parameter {names[0]!r} is used by stages {stages}, whose "
                f"plans place it differently ({', '.join(f'stage {k}: {v}' for k, v in placed.items())}); a weight "
                "shared by stages is summed over them shard by shard, which needs one placement. Fix: plan='dp', "
                "or untie the weight.")


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


def stage_meshes(mesh, ax: int) -> tuple[list, list]:
    """Per coordinate o of the pipeline axis `ax`: (the stage's sub-mesh, the tensor-parallel mesh its program is
    lowered on here). On (pp, tp) both are the tp line at o. On (pp, dp, tp) the sub-mesh is the (dp, tp) mesh at o,
    on which the pipelined module's parameters live ([Replicate(), megatron's placement]: one copy per data rank),
    and the stage program runs on the tp line at (o, this rank's dp coordinate): each data rank runs megatron on
    its own rows, and the gradients are summed over the dp sub-group afterwards (`PipelineModule._sum_over_data`),
    as under plan='dp'. Collective: every rank builds every coordinate's sub-mesh and every (o, d) tp line, in
    coordinate order (`autopar.dtensors._owner_mesh`, cached by layout)."""
    from autopar.dtensors import _owner_mesh, owner_meshes
    subs = owner_meshes(mesh, ax)
    if subs[0].ndim == 1:
        return subs, subs
    d_ax = 0  # the (dp, tp) sub-mesh: dp first (megatron: tensor parallel on the last axis the pipeline leaves)
    lines = [[_owner_mesh(sub, d_ax, d) for d in range(sub.size(d_ax))] for sub in subs]
    names = list(mesh.mesh_dim_names)
    dp_name = [n for n in names if n != names[ax]][0]
    me = mesh.get_local_rank(names.index(dp_name))
    return subs, [line[me] for line in lines]


def outer_parameter(inner, sub_mesh):
    """The pipelined module's parameter for a stage parameter `inner` (a DTensor on the stage's tp mesh): itself on
    (pp, tp); on (pp, dp, tp) a DTensor on the stage's (dp, tp) sub-mesh, [Replicate(), *inner's placements], over
    the same local storage (the optimizer's in-place step on it is the stage program's weight)."""
    from torch.distributed.tensor import DTensor, Replicate
    if inner.device_mesh is sub_mesh:
        return inner
    extra = sub_mesh.ndim - inner.device_mesh.ndim
    local = inner._local_tensor.detach()
    dt = DTensor.from_local(local, sub_mesh, [Replicate()] * extra + list(inner.placements), run_check=False,
                            shape=inner.shape, stride=inner.stride())
    param = nn.Parameter(dt, requires_grad=True)
    assert param._local_tensor.data_ptr() == inner._local_tensor.data_ptr()
    return param


def sp_overrides(value: str, plan: str, overrides: dict | None, names: tuple, axis: str) -> dict:
    """The overrides a megatron stage takes (`plan_stage`): Megatron sequence parallelism, asked for as the flat
    megatron plan takes it, `norm: sequence` (or `sequence@TP`, TP the tensor axis: the last axis the pipeline
    leaves), next to `pipeline`; {} when not asked. Any other override is left to the caller (`pipeline_ep`
    refuses what it does not run)."""
    from autopar.forms.sequence_norm import SequenceNorm
    sp = SequenceNorm.name
    norm = (overrides or {}).get("norm")
    if norm is None:
        return {}
    tp = [n for n in names if n != axis][-1]
    if norm not in (sp, f"{sp}@{tp}"):
        raise NotImplementedError(
            f"override 'norm': {norm!r} with 'pipeline': {value!r} and plan={plan!r} on mesh axes {names}: inside a "
            f"tensor-parallel stage the norms are replicated (megatron) or sequence-parallel on the tensor axis "
            f"{tp!r} ({sp!r} or '{sp}@{tp}'), not {norm!r}. Fix: 'norm': {sp!r}, or drop it.")
    return {"norm": sp}


def boundary_placements(cap, info, plan, acts: list[str]) -> dict[str, tuple]:
    """How stage k's received activations `acts` cross the boundary into it, by name (those left out: replicated
    over the stage's sub-mesh, as under plain megatron): each in the placement stage k's own program first takes
    it to. Found by a trial propagation of stage k's plan (the lowering up to `propagate_pass`, offline, on a copy
    of its graph) with the activation arriving replicated: where every use of it is a slice to one sharded
    placement P (Megatron SP: the residual stream `Shard(1)` on tp, for the norm and the residual add), P is the
    boundary placement. Stage k takes the activation so (`TPStage`: arrivals and its input placement P, no
    collective, each tp rank holds its own shard) and stage k-1 leaves it so (`LowerContext.output_placements`:
    a no-op where its propagation placed it so already, Megatron SP's reduce-scatter after the last row linear),
    so the two sides agree by construction and p2p carries each tp rank's shard to the same tp rank of the next
    stage: 1/tp of the bytes. Offline, the same on every rank (every rank plans every stage)."""
    from passes import meta as M
    from passes.lower import LOWER, lower_context, propagate_pass
    from autopar.runtime import collectives as C
    from passes.pipeline import run_passes
    gm = fx.GraphModule(cap.gm, _copy_graph(cap.gm))
    lctx = lower_context(plan, cap, info)
    gm = run_passes(gm, lctx, LOWER[:LOWER.index(propagate_pass) + 1])
    phs = {n.name: n for n in gm.graph.nodes if n.op == "placeholder"}
    out = {}
    for name in acts:
        users = list(phs[name].users)
        pls = {tuple(u.meta.get(M.PLACEMENTS, ())) for u in users if u.target is C.split}
        if not users or len(pls) != 1 or any(u.target is not C.split for u in users):
            continue
        (placed,) = pls
        if len(placed) == len(info.sizes) and all(p.is_shard() or p.is_replicate() for p in placed):
            out[name] = placed
    return out


def plan_stage(cap, sub_mesh, plan: str, overrides: dict | None = None):
    """Recognise and plan one stage on its sub-mesh with the named plan and `overrides` (`sp_overrides`), as
    `autopar.parallelize` does for a captured model (`_resolve_plan`); offline, the same on every rank. Returns
    (MeshInfo, Plan). The received activations' placements in the plan are how they cross the boundary
    (`boundary_placements`)."""
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
    made = build_plan(ctx, info, plan, dict(overrides) if overrides else None, batch, input_shapes=shapes)
    made = dataclasses.replace(made, precision=cap.precision.spec() if cap.precision else "")
    check_batch(made)
    return info, made


def local_shape(shape: tuple, placements: tuple, sizes: tuple) -> tuple:
    """A value's local shape on a mesh of `sizes` under `placements` (the plan checked that each shard divides)."""
    out = list(shape)
    for p, n in zip(placements, sizes):
        if p.is_shard():
            assert out[p.dim] % n == 0, (shape, placements, sizes)
            out[p.dim] //= n
    return tuple(out)


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

    def __init__(self, cap, info, plan, sub_mesh, user: list[str], tensors, buffers, device, rng_stream: str,
                 arrivals: dict | None = None, leaves: list | None = None):
        """`arrivals`: received activation -> the placements it crosses the boundary in (its local shard arrives;
        `boundary_placements`), else replicated; `leaves`: per output, the placements it leaves in for the next
        stage (the next stage's arrivals; None: replicated, as the loss)."""
        super().__init__()
        from autopar.module import ParallelModule
        from autopar.planner import tie_placements
        from passes.lower import lower_context, lower_pass
        holder = _holder(cap, tensors, buffers, device)
        plan = tie_placements(plan, holder)
        arrivals = dict(arrivals or {})
        lctx = lower_context(plan, cap, info, rng_stream=rng_stream, arrivals=arrivals)
        lctx.placements.update(arrivals)  # taken as they arrive: no slice (nor a gather) at the placeholder
        # the received activations' gradients go back to the stage before, whole: one consumed directly by
        # column-parallel work (T5's encoder output by each decoder layer's cross-attention k/v) gets Megatron's f
        received = cap.user_inputs[:len(cap.user_inputs) - len(user)]
        lctx.grad_inputs = {n for n in received if cap.placeholder(n).meta["val"].dtype.is_floating_point}
        if leaves is not None and any(pls is not None for pls in leaves):
            from torch.distributed.tensor import Replicate
            lctx.output_placements = tuple(tuple(pls) if pls is not None else (Replicate(),) * len(info.sizes)
                                           for pls in leaves)
        gm = lower_pass(cap.gm, lctx)
        shapes = [local_shape(s, arrivals[n], info.sizes) if n in arrivals else s
                  for n, s in zip(cap.user_inputs, cap.example_shapes)]
        examples = tuple(torch.empty(s, dtype=cap.placeholder(n).meta["val"].dtype, device=device)
                         for n, s in zip(cap.user_inputs, shapes))
        # what this stage receives (the zbv forward-only walk's receive buffers): local shards
        self.in_metas = [(s, e.dtype) for s, e in zip(shapes, examples)][:len(cap.user_inputs) - len(user)]
        (out,) = [n for n in cap.gm.graph.nodes if n.op == "output"]
        vals = [o.meta["val"] for o in out.args[0]]
        # what this stage sends on (the stand-ins of a failed computation have these shapes): local shards
        self.out_metas = [(local_shape(tuple(v.shape), pls, info.sizes) if pls is not None else tuple(v.shape),
                           v.dtype) for v, pls in zip(vals, leaves or [None] * len(vals))]
        self.pm = ParallelModule(holder, sub_mesh, cap, plan, gm, rng_stream, example_inputs=examples)
        self.pm.check_inputs = False  # the pipeline checks the batch once per call, on the whole mesh
        self.user = user

    def forward(self, *received, **inputs):
        out = self.pm(*received, *(inputs[n] for n in self.user))
        if isinstance(out, tuple):
            return tuple(o.contiguous() for o in out)
        return out.contiguous()


__all__ = ["TP_STAGE_PLANS", "TPStage", "boundary_placements", "check_tp_stage", "local_shape", "outer_parameter",
           "plan_stage", "sp_overrides", "stage_captured", "stage_meshes"]
