"""The parallel model users hold: `ParallelModule`, and how its parameters become DTensors.

`pm(*inputs)` takes the same global inputs as the model and returns the same outputs on every rank;
parameters keep their fully-qualified names (tied weights stay tied) and are DTensors with the plan's
placements (`shard_tensor`; a ModuleList expert under expert parallelism lives whole on the ranks that
own it, `owned_tensor`); buffers are registered as they were. The rewritten local program runs on the
local shards.

A model on the meta device gets only this rank's shards, allocated uninitialised (`empty_like_placed`), and its
non-persistent buffers computed (`autopar.weights.compute_buffers`); until `autopar.load` or `init_weights`
fills every parameter and persistent buffer, `forward` raises.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor
from torch.utils import _pytree as pytree

from autopar.captured import Captured
from autopar.checkpoint import replicated_to_strided, strided_to_replicated
from autopar.plan import Plan
from autopar.runtime.ops import advance_rng_stream
from autopar.dtensors import empty_like_placed, mesh_device, owned_tensor, shard_tensor
from autopar.weights import compute_buffers, init_weights, is_meta_model
from autopar.spec import is_owned


class ParallelModule(nn.Module):
    """The model as a distributed program: parameters are DTensors under their original names.

    `pm(*inputs)` takes the same global inputs as the model and returns the same outputs on every
    rank; after `backward()` every parameter's gradient is its full single-device gradient,
    sharded like the parameter. `pm.plan` is what was chosen; `pm.graph_module` is the rewritten
    local program, with every collective an explicit node.
    """

    def __init__(self, model: nn.Module, mesh: DeviceMesh, captured: Captured, plan: Plan, gm, rng_stream: str):
        super().__init__()
        self.plan = plan
        self._captured = captured
        self._mesh = mesh
        object.__setattr__(self, "_gm", gm)
        pls = plan.param_placements()
        # parameters: one DTensor per distinct tensor, registered under every original name
        made: dict[int, nn.Parameter] = {}
        # a meta-device model: each rank allocates only its shards, filled by `autopar.load` or `init_weights`
        self._unfilled: set[str] = set()
        object.__setattr__(self, "_source", model if is_meta_model(model) else None)
        computed = compute_buffers(model, mesh_device(mesh)) if self._source is not None else {}
        for fqn, p in model.named_parameters(remove_duplicate=False):
            if id(p) not in made:
                placements = pls.get(fqn) or self._placement_of_alias(model, p, pls)
                data = p.detach()
                if isinstance(data, DTensor):
                    raise ValueError(f"parameter {fqn} is already a DTensor; pass the unparallelised model")
                if data.is_meta:
                    value = empty_like_placed(data, mesh, placements)
                    self._unfilled.add(fqn)
                else:
                    value = owned_tensor(data, mesh, placements) if any(map(is_owned, placements)) else \
                        shard_tensor(data, mesh, placements)
                made[id(p)] = nn.Parameter(value, requires_grad=p.requires_grad)
            self._register(fqn, made[id(p)])
        for fqn, b in model.named_buffers(remove_duplicate=False):
            persistent = fqn.rsplit(".", 1)[-1] not in _non_persistent(model, fqn)
            if b.is_meta and persistent:  # filled from the checkpoint like a parameter
                b = torch.empty_like(b, device=mesh_device(mesh))
                self._unfilled.add(fqn)
            elif b.is_meta:
                b = computed[fqn]
            self._register(fqn, b, buffer=True, persistent=persistent)
        # DCP and state_dict see fused-QKV weights (_StridedShard) replicated: a strided shard is not one
        # contiguous chunk per rank, which checkpoint planners require; loading slices them back.
        self._register_state_dict_hook(strided_to_replicated)
        self._register_load_state_dict_pre_hook(replicated_to_strided, with_module=True)
        self._register_load_state_dict_pre_hook(_mark_loaded, with_module=True)
        self._rng_stream = rng_stream
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

    def init_weights(self, seed: int = 0) -> "ParallelModule":
        """Initialise a meta-built model's shards with the model's own initialisation (Hugging Face
        `_init_weights`, else each submodule's `reset_parameters` / `init_weights`), on the shards: equal in
        distribution to initialising on one device, not bit for bit (see `autopar.weights`)."""
        init_weights(self, seed)
        return self

    @property
    def graph_module(self) -> torch.fx.GraphModule:
        return self._gm

    @property
    def mesh(self) -> DeviceMesh:
        return self._mesh

    def forward(self, *args, **kwargs):
        if self._unfilled:
            raise RuntimeError(
                f"ParallelModule was built from a meta-device model and {len(self._unfilled)} of its parameters and "
                f"buffers (e.g. {sorted(self._unfilled)[:3]}) hold uninitialised memory. Fix: fill them first with "
                "autopar.load(pm, checkpoint_dir) or pm.init_weights().")
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


def _non_persistent(model: nn.Module, fqn: str) -> set[str]:
    mod = model
    for part in fqn.split(".")[:-1]:
        mod = getattr(mod, part)
    return set(getattr(mod, "_non_persistent_buffers_set", ()))




def _mark_loaded(module, state_dict, prefix, *_):
    """`load_state_dict` pre-hook: what a state dict supplies is no longer uninitialised."""
    module._unfilled -= {k[len(prefix):] for k in state_dict if k.startswith(prefix)}
