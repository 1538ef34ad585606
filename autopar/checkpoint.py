"""State-dict hooks: `torch.distributed.checkpoint` and `state_dict()` see fused-QKV weights, and
`load_state_dict` takes the full tensors a user already has.

A `_StridedShard` (a fused QKV weight sharded per q/k/v part) is not one contiguous chunk per rank,
which checkpoint planners require: `state_dict()` presents such a parameter replicated (its full
tensor), and loading slices it back into this rank's strided shard. Every other parameter is saved
as the DTensor it is (DCP reshards on load, e.g. into another plan or mesh).

Loading (`to_placements`): a plain full tensor (the single-device model's `state_dict()`, a
safetensors file) is sliced into the parameter's placements on every rank, as
`set_model_state_dict(..., full_state_dict=True)` does; each rank uses its own copy (no broadcast),
so every rank must load the same values. DTensors and plain tensors may be mixed in one dict; a
tensor of the wrong shape is left for `load_state_dict` to report.
"""

from __future__ import annotations

import torch
from torch.distributed.tensor import DTensor, Replicate

from autopar.dtensors import owned_tensor, shard_tensor
from autopar.spec import is_owned


def has_strided(t) -> bool:
    from torch.distributed.tensor.placement_types import _StridedShard
    return isinstance(t, DTensor) and any(isinstance(p, _StridedShard) for p in t.placements)


def strided_to_replicated(module, state_dict, prefix, local_metadata):
    """`state_dict` hook: strided shards as replicated DTensors."""
    for key, value in list(state_dict.items()):
        if has_strided(value):
            full = value.full_tensor()
            state_dict[key] = DTensor.from_local(full, value.device_mesh, [Replicate()] * value.device_mesh.ndim,
                                                 run_check=False)
    return state_dict


def to_placements(module, state_dict, prefix, local_metadata, strict, missing, unexpected, errors):
    """`load_state_dict` pre-hook: plain full tensors (and replicated values of strided parameters) sliced into
    this rank's shard of each DTensor parameter (an owned expert: whole on its owners, empty elsewhere)."""
    placements = module.plan.param_placements()
    for name, param in module.named_parameters(remove_duplicate=False):
        key = prefix + name
        value = state_dict.get(key)
        if not isinstance(param, DTensor) or value is None or not isinstance(value, torch.Tensor):
            continue
        if isinstance(value, DTensor) and not has_strided(param):
            continue  # a DTensor: loaded as it is (copy_ redistributes)
        # a strided parameter is always re-sliced from the full value: torch's `distribute_tensor` (what
        # `set_model_state_dict` calls) does not lay out a `_StridedShard` the way `shard_tensor` does everywhere
        if tuple(value.shape) != tuple(param.shape):
            continue  # load_state_dict reports the size mismatch
        full = value.full_tensor() if isinstance(value, DTensor) else value
        full = full.detach().to(dtype=param.dtype, device=param.to_local().device)
        pls = placements.get(name, param.placements)
        if any(map(is_owned, pls)):
            state_dict[key] = owned_tensor(full, module.mesh, pls, broadcast=False)
        else:
            state_dict[key] = shard_tensor(full, param.device_mesh, param.placements, broadcast=False)
