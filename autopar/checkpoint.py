"""State-dict hooks that let `torch.distributed.checkpoint` and `state_dict()` see fused-QKV weights.

A `_StridedShard` (a fused QKV weight sharded per q/k/v part) is not one contiguous chunk per rank,
which checkpoint planners require: `state_dict()` presents such a parameter replicated (its full
tensor), and loading slices it back into this rank's strided shard. Every other parameter is saved
as the DTensor it is (DCP reshards on load, e.g. into another plan or mesh).
"""

from __future__ import annotations

from torch.distributed.tensor import DTensor, Replicate

from autopar.dtensors import shard_tensor


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


def replicated_to_strided(module, state_dict, prefix, local_metadata, strict, missing, unexpected, errors):
    """`load_state_dict` pre-hook: a replicated (or plain) value of a strided parameter sliced back."""
    for name, param in module.named_parameters():
        key = prefix + name
        if key in state_dict and has_strided(param) and not has_strided(state_dict[key]):
            value = state_dict[key]
            full = value.full_tensor() if isinstance(value, DTensor) else value
            state_dict[key] = shard_tensor(full.detach().to(param.dtype), param.device_mesh, param.placements,
                                           broadcast=False)
