"""Public entry point: `parallelize(model, mesh, example_inputs) -> ParallelModule`.

capture -> recognise -> plan -> lower -> run (DESIGN.md §2).
"""

from __future__ import annotations

import dataclasses
import hashlib
import itertools
import math

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, distribute_tensor
from torch.utils import _pytree as pytree

from autopar.capture import Captured, capture, split_example_inputs
from autopar.mesh import MeshInfo, mesh_info
from autopar.plan import CommRow, Plan
from autopar.runtime.ops import advance_rng_stream, new_rng_stream
from autopar.planner import PLANS, build_plan
from autopar.spec import Shard, is_owned, placements_from_str
from passes import meta as M
from passes.context import PassContext
from passes.lower import LowerContext, collective_nodes, lower_pass
from passes.pipeline import RECOGNISE, run_passes


class ParallelModule(nn.Module):
    """The model as a distributed program: parameters are DTensors under their original names.

    `pm(*inputs)` takes the same global inputs as the model and returns the same outputs on every
    rank; after `backward()` every parameter's gradient is its full single-device gradient,
    sharded like the parameter. `pm.plan` is what was chosen; `pm.graph_module` is the rewritten
    local program, with every collective an explicit node.
    """

    def __init__(self, model: nn.Module, mesh: DeviceMesh, captured: Captured, plan: Plan, gm):
        super().__init__()
        self.plan = plan
        self._captured = captured
        self._mesh = mesh
        object.__setattr__(self, "_gm", gm)
        pls = plan.param_placements()
        # parameters: one DTensor per distinct tensor, registered under every original name
        made: dict[int, nn.Parameter] = {}
        for fqn, p in model.named_parameters(remove_duplicate=False):
            if id(p) not in made:
                placements = pls.get(fqn) or self._placement_of_alias(model, p, pls)
                data = p.detach()
                if isinstance(data, DTensor):
                    raise ValueError(f"parameter {fqn} is already a DTensor; pass the unparallelised model")
                value = owned_tensor(data, mesh, placements) if any(map(is_owned, placements)) else \
                    shard_tensor(data, mesh, placements)
                made[id(p)] = nn.Parameter(value, requires_grad=p.requires_grad)
            self._register(fqn, made[id(p)])
        for fqn, b in model.named_buffers(remove_duplicate=False):
            persistent = fqn.rsplit(".", 1)[-1] not in _non_persistent(model, fqn)
            self._register(fqn, b, buffer=True, persistent=persistent)
        # DCP and state_dict see fused-QKV weights (_StridedShard) replicated: a strided shard is not one
        # contiguous chunk per rank, which checkpoint planners require; loading slices them back.
        self._register_state_dict_hook(_strided_to_replicated)
        self._register_load_state_dict_pre_hook(_replicated_to_strided, with_module=True)
        self._feeds = []
        for ph, kind, name in captured.input_kinds:
            self._feeds.append((kind, name if kind != "constant" else captured.constants[ph]))

    @staticmethod
    def _placement_of_alias(model, p, pls):
        for fqn, q in model.named_parameters(remove_duplicate=False):
            if q is p and fqn in pls:
                return pls[fqn]
        raise AssertionError("parameter missing from the plan")

    def _register(self, fqn: str, value, buffer: bool = False, persistent: bool = True) -> None:
        *path, leaf = fqn.split(".")
        mod: nn.Module = self
        for part in path:
            if not hasattr(mod, part) or not isinstance(getattr(mod, part), nn.Module):
                mod.add_module(part, nn.Module())
            mod = getattr(mod, part)
        if buffer:
            mod.register_buffer(leaf, value, persistent=persistent)
        else:
            mod.register_parameter(leaf, value)

    def _lookup(self, fqn: str):
        mod = self
        *path, leaf = fqn.split(".")
        for part in path:
            mod = getattr(mod, part)
        return getattr(mod, leaf)

    @property
    def graph_module(self) -> torch.fx.GraphModule:
        return self._gm

    @property
    def mesh(self) -> DeviceMesh:
        return self._mesh

    def forward(self, *args, **kwargs):
        flat, spec = pytree.tree_flatten((args, kwargs))
        cap = self._captured
        if spec != cap.in_spec or len(flat) != len(cap.example_shapes):
            raise ValueError(
                "ParallelModule was captured for inputs structured like the example inputs "
                f"({cap.in_spec}), got {spec}. Fix: call it with the same positional/keyword inputs as "
                "example_inputs, or call autopar.parallelize again with new example inputs.")
        for i, (a, s) in enumerate(zip(flat, cap.example_shapes)):
            if s is not None and (not isinstance(a, torch.Tensor) or tuple(a.shape) != s):
                got = tuple(a.shape) if isinstance(a, torch.Tensor) else type(a).__name__
                raise ValueError(
                    f"input {i} has shape {got} but the model was parallelised for example inputs of shape {s}; "
                    "autopar specialises the program to the example shapes. Fix: call autopar.parallelize "
                    "again with example inputs of the new shape (e.g. one ParallelModule per sequence length).")
        it = iter(flat)
        feeds = []
        for kind, ref in self._feeds:
            if kind == "param":
                p = self._lookup(ref)
                feeds.append(p.to_local() if isinstance(p, DTensor) else p)
            elif kind == "buffer":
                feeds.append(self._lookup(ref))
            elif kind == "constant":
                feeds.append(ref)
            else:
                feeds.append(next(it))
        advance_rng_stream(self._rng_stream)
        outs = self._gm(*feeds)
        return pytree.tree_unflatten(list(outs)[: cap.num_user_outputs], cap.out_spec)


def _has_strided(t) -> bool:
    from torch.distributed.tensor.placement_types import _StridedShard
    return isinstance(t, DTensor) and any(isinstance(p, _StridedShard) for p in t.placements)


def _strided_to_replicated(module, state_dict, prefix, local_metadata):
    for key, value in list(state_dict.items()):
        if _has_strided(value):
            full = value.full_tensor()
            state_dict[key] = DTensor.from_local(full, value.device_mesh, [Replicate()] * value.device_mesh.ndim,
                                                 run_check=False)
    return state_dict


def _replicated_to_strided(module, state_dict, prefix, local_metadata, strict, missing, unexpected, errors):
    for name, param in module.named_parameters():
        key = prefix + name
        if key in state_dict and _has_strided(param) and not _has_strided(state_dict[key]):
            value = state_dict[key]
            full = value.full_tensor() if isinstance(value, DTensor) else value
            state_dict[key] = shard_tensor(full.detach().to(param.dtype), param.device_mesh, param.placements,
                                           broadcast=False)


def shard_tensor(full: torch.Tensor, mesh: DeviceMesh, placements, broadcast: bool = True) -> DTensor:
    """A DTensor of `full` (rank 0's copy, broadcast) with `placements`, sliced locally (no scatter).

    Slicing here rather than in `distribute_tensor` gives `_StridedShard` the same layout on real
    process groups and under LocalTensorMode.
    """
    from autopar.runtime.collectives import _take_chunk
    from autopar.spec import is_shard

    if broadcast:
        local = distribute_tensor(full, mesh, [Replicate()] * mesh.ndim).to_local()  # broadcast from rank 0
    else:
        local = full
    for ax, p in enumerate(placements):
        if is_shard(p):
            k = getattr(p, "split_factor", 1)
            local = _take_chunk(local, p.dim, mesh.size(ax), mesh.get_local_rank(ax), k).clone()
    from torch.distributed._local_tensor import LocalTensor, enabled_local_tensor_mode
    lm = enabled_local_tensor_mode()
    if lm is not None and not isinstance(local, LocalTensor):
        # simulated ranks each own their copy (an in-place optimizer step must not run once per rank on one tensor)
        local = lm.rank_map(lambda r: local.detach().clone())
    return DTensor.from_local(local, mesh, placements, run_check=False, shape=full.shape, stride=full.stride())


_OWNER_MESHES: dict[tuple, DeviceMesh] = {}


def _owner_mesh(mesh: DeviceMesh, ax: int, owner: int) -> DeviceMesh:
    """The ranks whose coordinate on axis `ax` is `owner`, as a mesh over the other axes (every rank
    builds every such mesh, in the same order: creating a process group is collective)."""
    key = (id(mesh), ax, owner)
    if key not in _OWNER_MESHES:
        ranks = mesh.mesh.narrow(ax, owner, 1)
        names = list(mesh.mesh_dim_names or [f"axis{i}" for i in range(mesh.ndim)])
        if mesh.ndim > 1:
            ranks, names = ranks.squeeze(ax), names[:ax] + names[ax + 1:]
        else:
            names = [f"{names[0]}_owner"]
        _OWNER_MESHES[key] = DeviceMesh(mesh.device_type, ranks, mesh_dim_names=tuple(names))
    return _OWNER_MESHES[key]


def owned_tensor(full: torch.Tensor, mesh: DeviceMesh, placements) -> DTensor:
    """A parameter that lives whole on the ranks owning it (`Owned` on one axis): a DTensor on their
    sub-mesh (replicated there), empty on every other rank, which therefore holds 1/ep of the experts."""
    from torch.distributed._local_tensor import local_tensor_mode
    if local_tensor_mode() is not None:
        from autopar.runtime.moe import OWNED_NEEDS_PROCESSES
        raise NotImplementedError(OWNED_NEEDS_PROCESSES)
    (ax,) = [i for i, p in enumerate(placements) if is_owned(p)]
    owner = placements[ax].owner
    local = distribute_tensor(full, mesh, [Replicate()] * mesh.ndim).to_local()  # rank 0's copy everywhere
    sub = _owner_mesh(mesh, ax, owner)
    rest = [p for i, p in enumerate(placements) if i != ax] or [Replicate()]
    if any(not isinstance(p, Replicate) for p in rest):
        raise NotImplementedError(f"an owned expert weight must be replicated on the other mesh axes, got {placements}")
    if mesh.get_local_rank(ax) != owner:
        local = local.new_empty(0)
    return DTensor.from_local(local.clone(), sub, rest, run_check=False, shape=full.shape, stride=full.stride())


def _non_persistent(model: nn.Module, fqn: str) -> set[str]:
    mod = model
    for part in fqn.split(".")[:-1]:
        mod = getattr(mod, part)
    return set(getattr(mod, "_non_persistent_buffers_set", ()))


def _agree_across_ranks(plan: Plan, mesh: DeviceMesh) -> None:
    """Every rank must run the same plan: compare a hash of it, raise on mismatch (never hang)."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return
    from torch.distributed._local_tensor import local_tensor_mode
    if local_tensor_mode() is not None:
        return  # one process simulates every rank: the plan is shared by construction
    digest = int(hashlib.sha256(plan.to_json().encode()).hexdigest()[:12], 16)
    mine = torch.tensor([digest, -digest], dtype=torch.int64,
                        device="cuda" if mesh.device_type == "cuda" else "cpu")
    got = mine.clone()
    dist.all_reduce(got, op=dist.ReduceOp.MAX)
    if got[0] != digest or -got[1] != digest:
        raise RuntimeError(
            f"rank {dist.get_rank()}: ranks computed different plans (hash {digest:x} here); every rank must "
            "call parallelize with the same model, mesh, example input shapes and options.")


def _prepare(model, mesh, example_inputs, overrides):
    info = mesh_info(mesh)
    if overrides is not None and not isinstance(overrides, dict):
        raise TypeError(f"overrides must be a dict {{key: form}}, got {type(overrides).__name__}")
    args, kwargs = split_example_inputs(example_inputs)
    args, kwargs = _plain_inputs(args, kwargs)
    from torch.distributed._local_tensor import maybe_disable_local_tensor_mode
    with maybe_disable_local_tensor_mode():  # tracing runs on fake tensors, never on simulated ranks
        captured = capture(model, args, kwargs)
    ctx = PassContext(captured)
    run_passes(captured.gm, ctx, RECOGNISE)
    return info, captured, ctx


def plan(model: nn.Module, mesh, example_inputs, *, plan="auto", cluster=None, memory_limit=None,
         overrides=None) -> Plan:
    """Plan without running anything: `mesh` may be a DeviceMesh or axis sizes such as {"dp": 8, "tp": 8},
    and the model may live on the meta device. Returns the Plan with its cost estimate."""
    info, captured, ctx = _prepare(model, mesh, example_inputs, overrides)
    with _local_tensor_off():
        chosen = _resolve_plan(plan, ctx, info, overrides, captured, cluster, memory_limit)
    return _tie_placements(chosen, model).with_comms((), captured.notes)


def parallelize(model: nn.Module, mesh: DeviceMesh, example_inputs, *, plan="auto", overrides=None, cluster=None,
                memory_limit=None) -> ParallelModule:
    """Turn a single-device model into a distributed program on `mesh`; see DESIGN.md §1."""
    if isinstance(mesh, dict):
        raise TypeError("parallelize needs a DeviceMesh (it runs the model); use autopar.plan(...) to plan for a "
                        "mesh given as axis sizes")
    info, captured, ctx = _prepare(model, mesh, example_inputs, overrides)
    chosen = _solve_on_rank0(lambda: _resolve_plan(plan, ctx, info, overrides, captured, cluster, memory_limit))
    chosen = _tie_placements(chosen, model)
    _agree_across_ranks(chosen, mesh)
    placements = {}
    fqn_pls = chosen.param_placements()
    for ph, fqn in captured.param_fqns.items():  # an owned expert is, in the graph, S(0) of the stacked experts
        placements[ph] = tuple(Shard(0) if is_owned(p) else p for p in fqn_pls[fqn])
    placements.update(chosen.input_placements())
    data_axes = tuple(i for i in range(len(info.names))
                      if any(getattr(p[i], "dim", None) == 0 for p in chosen.input_placements().values()))
    stream = f"pm{next(_STREAMS)}"
    new_rng_stream(stream, _agreed_seed(mesh))
    hints, modes = _sequence_hints(chosen, ctx, info)
    zigzag = tuple(sorted({ax for m in modes.values() for ax, mode in m.items() if mode == "ring"}))
    sites = {s.key: s for s in ctx.sites}
    moe_axes = {sites[st.key].node.name: info.names.index(st.axis) for st in chosen.strategies
                if st.kind == "moe" and st.form == "expert" and st.key in sites}
    experts = {ph for st in chosen.strategies if st.kind == "moe" and st.form == "expert" and st.key in sites
               for ph in sites[st.key].params.values()}
    lctx = LowerContext(info, placements, set(captured.user_inputs), rng_stream=stream, gather_param_axes=data_axes,
                        hints=hints, attention_modes=modes, zigzag_axes=zigzag, moe_axes=moe_axes,
                        keep_sharded=experts)
    gm = lower_pass(captured.gm, lctx)
    comms = []
    for n in collective_nodes(gm):
        c = n.meta[M.COMM]
        comms.append(CommRow(module=c.module, fn=c.fn, axis=c.axis, forward=c.forward, backward=c.backward,
                             bytes_forward=c.bytes_forward, bytes_backward=c.bytes_backward))
    comms += _moe_comms(gm, info)
    chosen = chosen.with_comms(comms, captured.notes + lctx.notes)
    pm = ParallelModule(model, mesh, captured, chosen, gm)
    pm._rng_stream = stream
    return pm


def _moe_comms(gm, info: MeshInfo) -> list[CommRow]:
    """The all-to-alls inside expert-parallel MoE nodes (issued at run time with this step's splits):
    tokens out and back, forward and backward, priced for uniform routing (k*T*h*(ep-1)/ep each)."""
    from autopar.mesh import resolve_axis
    from autopar.runtime.moe import moe_experts, spec_of
    rows = []
    for n in gm.graph.nodes:
        if n.op != "call_function" or n.target is not moe_experts or n.args[6] != "a2a":
            continue
        x, idx, key, axis = n.args[0], n.args[1], n.args[4], resolve_axis(n.args[5])
        t, h = x.meta["val"].shape
        local_t = t // math.prod(info.sizes[i] for i, a in enumerate(info.axes) if a.key in n.args[7])
        ep, k = axis.size, idx.meta["val"].shape[-1]
        b = round(2 * k * local_t * h * x.meta["val"].element_size() * (ep - 1) / ep)
        rows.append(CommRow(module=spec_of(key).path, fn="moe_all_to_all", axis=axis.name,
                            forward="all_to_all x2 (+counts)", backward="all_to_all x2", bytes_forward=b,
                            bytes_backward=b))
    return rows


def _sequence_hints(chosen: Plan, ctx: PassContext, info: MeshInfo):
    """Where the plan wants activations sharded on the sequence: norm inputs (Megatron SP), and the
    Ulysses attentions (all-to-all to heads before, back to the sequence after)."""
    from autopar.spec import Shard
    sites = {s.key: s for s in ctx.sites}
    hints: dict[str, dict[int, object]] = {}
    modes: dict[str, dict[int, str]] = {}
    for st in chosen.strategies:
        site = sites.get(st.key)
        if site is None or st.axis is None:
            continue
        ax = info.names.index(st.axis)
        if st.kind == "norm" and st.form == "sequence":
            hints.setdefault(site.info["input"].name, {})[ax] = Shard(site.info["seq_dim"])
        elif st.kind == "attention" and st.form == "ulysses":
            modes.setdefault(site.node.name, {})[ax] = "ulysses"
            hints.setdefault(site.node.name, {})[ax] = Shard(2)  # (b, heads, s, d) back to the sequence
        elif st.kind == "attention" and st.form == "ring":
            modes.setdefault(site.node.name, {})[ax] = "ring"
    # Megatron SP: the row-parallel outputs of tensor-parallel blocks on a sequence-parallel axis are
    # reduce-scattered onto the sequence (before their bias), not all-reduced
    sp_axes = {st.axis for st in chosen.strategies if st.kind == "norm" and st.form == "sequence"}
    for st in chosen.strategies:
        site = sites.get(st.key)
        if site is None or st.axis not in sp_axes:
            continue
        rows = site.info["out"] if st.kind == "attention" and st.form == "heads" else \
            site.info["row"] if st.kind == "mlp" and st.form == "tp" else []
        for lin in rows:
            seq_dim = 1 if len(lin.node.meta["val"].shape) >= 3 else None
            if seq_dim is not None:
                hints.setdefault("row:" + lin.node.name, {})[info.names.index(st.axis)] = Shard(seq_dim)
    return hints, modes


def _local_tensor_off():
    from torch.distributed._local_tensor import maybe_disable_local_tensor_mode
    return maybe_disable_local_tensor_mode()


def _solve_on_rank0(make_plan) -> Plan:
    """Rank 0 plans; the plan is broadcast so every rank runs exactly the same one."""
    from torch.distributed._local_tensor import local_tensor_mode
    with _local_tensor_off():
        if not dist.is_initialized() or dist.get_world_size() == 1 or local_tensor_mode() is not None \
                or dist.get_backend() == "fake":
            return make_plan()
        box = [make_plan().to_json() if dist.get_rank() == 0 else None]
        dist.broadcast_object_list(box, src=0)
        return Plan.from_json(box[0])


_STREAMS = itertools.count()


def _agreed_seed(mesh: DeviceMesh) -> int:
    """A dropout seed that every rank agrees on (rank 0's draw, broadcast)."""
    from torch.distributed._local_tensor import local_tensor_mode, maybe_disable_local_tensor_mode
    with maybe_disable_local_tensor_mode():
        seed = torch.randint(0, 2**31 - 1, (1,))
    if dist.is_initialized() and dist.get_world_size() > 1 and local_tensor_mode() is None:
        seed = seed.to("cuda" if mesh.device_type == "cuda" else "cpu")
        dist.broadcast(seed, src=0)
    return int(seed.item())


def _plain_inputs(args, kwargs):
    """Inputs are global (the same on every rank): under LocalTensorMode, trace rank 0's copy."""
    from torch.distributed._local_tensor import LocalTensor

    def plain(a):
        if isinstance(a, LocalTensor):
            return a.reconcile()  # raises if the simulated ranks disagree
        return a

    return pytree.tree_map(plain, (args, kwargs))


def _tie_placements(plan: Plan, model: nn.Module) -> Plan:
    """Tied parameters (one tensor, several names) share one placement: the one the graph uses."""
    groups: dict[int, list[str]] = {}
    for fqn, p in model.named_parameters(remove_duplicate=False):
        groups.setdefault(id(p), []).append(fqn)
    pls = dict(plan.params)
    replicated = "R" * len(plan.mesh)
    for names in groups.values():
        chosen = {pls[n] for n in names if n in pls and pls[n] != replicated}
        if len(chosen) > 1:
            raise ValueError(f"tied parameters {names} were given different placements {sorted(chosen)}; "
                             "give the structures that share them compatible forms")
        if chosen:
            for n in names:
                pls[n] = next(iter(chosen))
    return dataclasses.replace(plan, params=tuple(pls.items()))


def _resolve_plan(plan, ctx, info: MeshInfo, overrides, captured, cluster=None, memory_limit=None) -> Plan:
    if isinstance(plan, str) and plan in PLANS:
        batch = {}
        flat_shapes = captured.example_shapes
        first = next((s for s in flat_shapes if s), None)
        for ph, s in zip(captured.user_inputs, flat_shapes):
            batch[ph] = s[0] if s and first and len(s) >= 1 and s[0] == first[0] else 0
        shapes = dict(zip(captured.user_inputs, flat_shapes))
        return build_plan(ctx, info, plan, overrides, batch, cluster=cluster, memory_limit=memory_limit,
                          input_shapes=shapes)
    if isinstance(plan, str):
        plan = Plan.load(plan)
    if not isinstance(plan, Plan):
        raise TypeError(f"plan must be one of {PLANS}, a Plan or a path to a saved plan; got {plan!r}")
    if overrides:
        raise ValueError(f"overrides apply to the named plans {PLANS}; edit a saved Plan directly")
    if tuple(plan.mesh) != tuple(zip(info.names, info.sizes)):
        raise ValueError(f"the plan was made for mesh {plan.mesh}, but this mesh is "
                         f"{tuple(zip(info.names, info.sizes))}; re-plan for this mesh")
    missing = set(captured.param_fqns.values()) - set(dict(plan.params))
    if missing:
        raise ValueError(f"the plan has no placement for parameters {sorted(missing)[:5]}; it was made for another model")
    return plan
