"""Re-lowering: the same plan, lowered again for calls its program was not captured for.

torch.export specialises a captured program on more than the input shapes: on the dtypes of the inputs, the
values of non-tensor inputs (a `scale=3.0` keyword becomes the constant 3.0), train/eval mode (dropout on or
off, BatchNorm on batch or running statistics), the ambient autocast state (the graph's ops carry the dtypes
autocast gave them) and the parameters' dtypes. `guard_key` names all of these for one call; a
`ParallelModule` keeps one `Program` per key (`ParallelModule.max_programs`, least recently used dropped).

`relower` makes the program for a new key: it captures the model again under the call's conditions (from
`ParallelModule`'s meta copy of the model's structure, `autopar.weights.meta_copy`, which holds none of the model's
storage; factory calls traced on meta run on the mesh's device; on the CPU and under autocast, the copy's tensors
are allocated uninitialised on the device for that one capture, `_materialised`)
(its train flag, the ParallelModule's parameter and buffer dtypes; the caller's autocast is live), recognises
it, and plans it with every structure forced to the form the plan gave it (`replan`), then lowers it. Planning
uses a named plan (never the solver), so every rank derives the same program from the same call. A form whose
precondition fails for the new shapes (a sequence that no longer divides over the ranks) falls back to
`replicate` for that call, with a plan note. Parameters are shared by every program: a program that would
place a parameter otherwise than it is stored reads it redistributed (`Program.reshard`, noted in the plan).
"""

from __future__ import annotations

import contextlib
import glob
import warnings
from dataclasses import dataclass, field, replace

import torch
from torch import fx, nn
from torch.utils import _pytree as pytree

from autopar.capture import capture
from autopar.captured import Captured
from autopar.forms import form_of
from autopar.forms.replicate import Replicate
from autopar.index_checks import retarget_meta
from autopar.inputs import batch_dims, data_degree, global_example, local_arrivals
from autopar.mesh import MeshInfo
from autopar.plan import DirectiveKind, Plan
from autopar.precision import Precision, as_dtypes, capture_dtypes, cast_inputs, mark_captured
from autopar.planner import BATCH_NOTE_RE, build_plan, tie_placements
from autopar.sites import Kind, PassContext
from autopar.spec import Shard, fmt_placements, is_owned, placements_from_str
from autopar.forms import checkpoint as ckpt
from passes.lower import comm_rows, lower_context, lower_pass
from passes.pipeline import RECOGNISE, run_passes


@dataclass(frozen=True)
class Program:
    """One lowered program and how a call feeds it."""

    key: tuple
    captured: Captured
    plan: Plan
    gm: fx.GraphModule
    kw_order: tuple[str, ...]  # keyword inputs in the order the capture flattened them
    reshard: dict[str, tuple] = field(default_factory=dict)  # param fqn -> placements the program reads it in


def make_program(key: tuple, captured: Captured, plan: Plan, gm: fx.GraphModule,
                 stored: dict[str, str]) -> Program:
    """`stored`: every parameter fqn -> the placements it is stored in (the first plan's)."""
    kw_spec = captured.in_spec.child(1) if captured.in_spec.num_children == 2 else None
    kw_order = tuple(kw_spec.context) if kw_spec is not None and kw_spec.context else ()
    want = dict(plan.params)
    reshard = {}
    for fqn in captured.param_fqns.values():
        if want[fqn] == stored[fqn]:
            continue
        if any(map(is_owned, placements_from_str(want[fqn]) + placements_from_str(stored[fqn]))):
            raise NotImplementedError(
                f"parameter {fqn} is stored {stored[fqn]} (owned by some ranks only), but the program for these "
                f"inputs would place it {want[fqn]}: autopar cannot re-place expert-parallel parameters per call "
                "yet. Fix: call with inputs the plan's forms accept, or parallelize again for these inputs.")
        reshard[fqn] = placements_from_str(want[fqn])
    return Program(key, captured, plan, gm, kw_order, reshard)


# ----------------------------------------------------------------------------- the guard

def guard_key(args: tuple, kwargs: dict, *, training: bool, tensors, device_type: str) -> tuple:
    """Everything a capture specialises on, for one call: input structure, shapes and dtypes, non-tensor input
    values, the train flag, autocast state and the dtypes of the module's parameters and buffers (`tensors`).
    Keyword inputs count by name, not by order."""
    flat, spec = pytree.tree_flatten((tuple(args), dict(sorted(kwargs.items()))))
    leaves = []
    for i, a in enumerate(flat):
        if isinstance(a, torch.Tensor):
            leaves.append(("tensor", tuple(a.shape), a.dtype))
            continue
        try:
            hash(a)
        except TypeError:
            raise TypeError(
                f"input {i} (flattened) is a {type(a).__name__}, which is neither a tensor nor hashable: autopar "
                "captures a program per value of each non-tensor input and must compare them. Fix: pass it as a "
                "tensor, a number, a string or a tuple, or make the model read it from an attribute.") from None
        leaves.append(("value", type(a).__qualname__, a))
    autocast = tuple((d, torch.is_autocast_enabled(d), torch.get_autocast_dtype(d) if torch.is_autocast_enabled(d)
                      else None) for d in sorted({"cpu", device_type}))
    return (spec, tuple(leaves), bool(training), autocast, tuple(t.dtype for t in tensors))


def describe_key(key: tuple) -> str:
    _, leaves, training, autocast, _ = key
    shapes = ", ".join(f"{tuple(x[1])}" if x[0] == "tensor" else repr(x[2]) for x in leaves)
    on = [f"autocast({d}, {dt})" for d, enabled, dt in autocast if enabled]
    return f"inputs ({shapes}), {'train' if training else 'eval'} mode" + (", " + ", ".join(on) if on else "")


# ----------------------------------------------------------------------------- re-lowering

def relower(model: nn.Module, info: MeshInfo, plan: Plan, args: tuple, kwargs: dict, *, key: tuple,
            training: bool, tensors: dict[str, torch.Tensor], stored: dict[str, str], rng_stream: str,
            local_axes: tuple[str, ...] | None = None, meta_device: torch.device | None = None) -> Program:
    """Capture `model` again for one call (its mode set to `training`, its parameters and buffers taking the
    dtypes of `tensors`, fqn -> the ParallelModule's tensor), and lower `plan`'s forms for the new graph.
    `local_axes` (inputs="local"): the call passes this rank's shard of the batch over these data axes; the
    program is captured for the global batch and takes the shard as given. `meta_device`: the model lives on the
    meta device; the program's factory calls run on this device instead."""
    from torch.distributed._local_tensor import maybe_disable_local_tensor_mode
    precision = Precision.parse(plan.precision)
    args, kwargs = cast_inputs(precision, *plain_inputs(args, kwargs))
    with maybe_disable_local_tensor_mode(), _materialised(model, meta_device), \
            _as_called(model, training, tensors, precision):
        if local_axes is not None:
            args, kwargs = global_example(args, kwargs, data_degree(local_axes, info))
        captured = capture(model, args, kwargs)
    mark_captured(captured, model, precision)
    ctx = PassContext(captured)
    run_passes(captured.gm, ctx, RECOGNISE)
    new = tie_placements(replan(ctx, info, plan), model)
    for note in new.notes:
        if BATCH_NOTE_RE.match(note):  # runs correctly, but without data parallelism for these inputs: say so
            warnings.warn(f"autopar: {note}; this call's program computes the whole batch on every rank of those "
                          "axes. Fix: a batch size divisible by them (e.g. drop_last=True on the DataLoader)",
                          stacklevel=3)
    arrivals = local_arrivals(new, captured, info, local_axes)[0] if local_axes is not None else {}
    lctx = lower_context(new, captured, info, rng_stream=rng_stream, arrivals=arrivals)
    gm = lower_pass(captured.gm, lctx)
    if meta_device is not None:
        meta_to_device(gm, meta_device, captured)
    new = new.with_comms(comm_rows(gm, info), captured.notes + lctx.notes)
    prog = make_program(key, captured, new, gm, stored)
    notes = tuple(f"parameter {fqn} is stored {stored[fqn]} but this program reads it "
                  f"{fmt_placements(pls)}: redistributed at every call" for fqn, pls in prog.reshard.items())
    return replace(prog, plan=replace(new, notes=new.notes + notes))


def replan(ctx: PassContext, info: MeshInfo, plan: Plan) -> Plan:
    """`plan`'s forms, structure by structure, on a new capture of the same model; a form whose precondition
    fails on the new capture is replaced by `replicate`, with a note saying why."""
    sites = {s.key: s for s in ctx.sites}
    overrides, notes = {}, []
    for s in plan.strategies:
        site = sites.get(s.key)
        if site is None or site.kind.value != s.kind:
            notes.append(f"{s.kind} {s.key} ({s.label}) is not in the graph captured for these inputs")
            continue
        why = form_of(site.kind, s.form).precondition(site, tuple(info.axis(a).size for a in s.axes)) \
            if s.axes else None
        if why:
            notes.append(f"{s.kind} {s.key} replicated for these inputs, not {s.label}: {why}")
        overrides[_exact(s.key)] = Replicate.name if why else s.label
    for path, level in plan.checkpoint:  # the same activation checkpointing level per layer
        overrides[f"{ckpt.KEY}:{_exact(path)}"] = level
    base = plan.name if plan.name in ("megatron", "dp", "fsdp", "zero1", "zero2") else _named_like(plan)
    batch, shapes = input_batch(ctx.captured)
    new = build_plan(ctx, info, base, overrides, batch, input_shapes=shapes, data_axes=_data_axes(plan, info))
    kept = {d.node: d.value for d in plan.directives if d.kind is DirectiveKind.GATHER and d.value}
    # FSDP's gathers kept for backward stay kept (`fsdp.keep_gathered`), ZeRO-2's persistent stay persistent
    directives = tuple(replace(d, value=kept[d.node]) if d.kind is DirectiveKind.GATHER and d.node in kept else d
                       for d in new.directives)
    return replace(new, name=plan.name, notes=new.notes + tuple(notes), precision=plan.precision,
                   directives=directives)


def _data_axes(plan: Plan, info: MeshInfo) -> tuple[str, ...] | None:
    """The axes `plan` shards the batch over (an input's dim 0, or gathered parameters); None when nothing says
    (every input replicated and nothing gathered: the named plan's own choice then)."""
    axes = {d.axis for d in plan.directives if d.kind is DirectiveKind.GATHER}
    for _, pls in plan.inputs:
        axes |= {a for a, p in zip(info.names, placements_from_str(pls)) if p == Shard(0)}
    if not axes and any("does not divide over" in n for n in plan.notes):
        return None  # the example's batch did not divide: the data axes are the named plan's
    return tuple(a for a in info.names if a in axes)


def _named_like(plan: Plan) -> str:
    """The named plan whose data axes an `auto` (or hand-made) plan's forms imply: `fsdp` where parameters are
    gathered, `dp` where no structure takes a mesh axis, else `megatron`."""
    if any(d.kind is DirectiveKind.GATHER for d in plan.directives):
        return "fsdp"
    return "megatron" if any(s.axes for s in plan.strategies) else "dp"


def input_batch(captured: Captured) -> tuple[dict[str, int], dict[str, tuple]]:
    """Per user input: its batch size (`autopar.inputs.batch_dims`; 0 when it has none), and its shape."""
    flat_shapes = captured.example_shapes
    batch = dict(zip(captured.user_inputs, batch_dims(flat_shapes)))
    return batch, dict(zip(captured.user_inputs, flat_shapes))


def plain_inputs(args, kwargs):
    """Under LocalTensorMode, trace one simulated rank's copy: capture depends on shapes only, and the ranks'
    values are compared by `autopar.agree` at `parallelize`."""
    from torch.distributed._local_tensor import LocalTensor

    def plain(a):
        return a._local_tensors[min(a._local_tensors)] if isinstance(a, LocalTensor) else a

    return pytree.tree_map(plain, (args, kwargs))


def _exact(key: str) -> str:
    """An override key that matches the module path `key` alone (not as a glob, not as a kind name)."""
    escaped = glob.escape(key)
    if escaped in {k.value for k in Kind}:
        escaped = f"[{escaped[0]}]{escaped[1:]}"
    return escaped


@contextlib.contextmanager
def _as_called(model: nn.Module, training: bool, tensors: dict[str, torch.Tensor], precision=None):
    """`model` in mode `training`, its parameters and buffers of the dtypes of `tensors` (converted copies where
    they differ; the same tensor under every tied name), its floating parameters at the mixed-precision policy's
    `param_dtype` (`autopar.precision`), all restored afterwards."""
    modes = [(m, m.training) for m in model.modules()]
    model.train(training)
    try:
        with as_dtypes(model, {fqn: t.dtype for fqn, t in tensors.items()}), capture_dtypes(model, precision):
            yield
    finally:
        for m, was in modes:
            m.training = was


@contextlib.contextmanager
def _materialised(model: nn.Module, device: torch.device | None):
    """A meta model re-captured with its parameters and buffers allocated on `device`, uninitialised and never read
    (export traces on fake tensors), released when the capture ends, where meta would trace otherwise than the
    device: under autocast (which has no meta kernels: ops on meta keep their dtypes) and on the CPU (a forward's
    factory calls without a device make CPU tensors, which meet meta ones; there an untouched allocation is not
    resident). Elsewhere (a GPU, no autocast) the capture runs on meta, allocating nothing. Tied tensors stay tied."""
    if device is None or (device.type != "cpu" and not any(torch.is_autocast_enabled(d)
                                                           for d in {"cpu", device.type})):
        yield
        return
    made: dict[int, torch.Tensor] = {}
    saved = []
    for mod in model.modules():
        for store in (mod._parameters, mod._buffers):
            for name, t in store.items():
                if t is None or not t.is_meta:
                    continue
                if id(t) not in made:
                    new = torch.empty_like(t, device=device)
                    made[id(t)] = nn.Parameter(new, requires_grad=t.requires_grad) if isinstance(t, nn.Parameter) \
                        else new
                saved.append((store, name, t))
                store[name] = made[id(t)]
    try:
        yield
    finally:
        for store, name, t in saved:
            store[name] = t


def meta_to_device(gm, device, captured: Captured) -> None:
    """A meta-device model traces factory calls and moves (`arange(..., device=meta)`, `x.to(meta)`) on meta: the
    program runs them on the mesh's device."""
    lost = [name for name, c in captured.constants.items() if c.is_meta]
    if lost:
        raise NotImplementedError(
            f"the meta-device model's forward makes tensor constants on the meta device ({', '.join(lost)}), whose "
            "values no rank can know. Fix: build the model off the meta device, or make those tensors buffers.")
    retarget_meta(gm, device)
