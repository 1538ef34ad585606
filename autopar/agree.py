"""Every rank runs the same plan and the same random streams: agreement across ranks.

- `solve_on_rank0`: rank 0 plans; the plan is broadcast, so every rank lowers exactly the same one.
- `agree_across_ranks`: a hash of the plan compared with one small all-reduce (MAX of the hash and of its
  negation: equal on every rank iff all hashes agree); a mismatch raises on every rank, never hangs.
- `agreed_seed`: the dropout stream's seed, rank 0's draw broadcast.

One process simulating every rank (LocalTensorMode) or the fake backend shares everything by construction.
"""

from __future__ import annotations

import hashlib

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from autopar.plan import Plan


def _local_tensor_off():
    from torch.distributed._local_tensor import maybe_disable_local_tensor_mode
    return maybe_disable_local_tensor_mode()


def _one_process() -> bool:
    from torch.distributed._local_tensor import local_tensor_mode
    return (not dist.is_initialized() or dist.get_world_size() == 1 or local_tensor_mode() is not None
            or dist.get_backend() == "fake")


def _device(mesh: DeviceMesh) -> str:
    return "cuda" if mesh.device_type == "cuda" else "cpu"


def solve_on_rank0(make_plan) -> Plan:
    """Rank 0 plans; the plan is broadcast so every rank runs exactly the same one."""
    with _local_tensor_off():
        if _one_process():
            return make_plan()
        box = [make_plan().to_json() if dist.get_rank() == 0 else None]
        dist.broadcast_object_list(box, src=0)
        return Plan.from_json(box[0])


def agree_across_ranks(plan: Plan, mesh: DeviceMesh) -> None:
    """Every rank must run the same plan: compare a hash of it, raise on mismatch (never hang)."""
    if _one_process():
        return
    digest = int(hashlib.sha256(plan.to_json().encode()).hexdigest()[:12], 16)
    mine = torch.tensor([digest, -digest], dtype=torch.int64, device=_device(mesh))
    got = mine.clone()
    dist.all_reduce(got, op=dist.ReduceOp.MAX)
    if got[0] != digest or -got[1] != digest:
        raise RuntimeError(
            f"rank {dist.get_rank()}: ranks computed different plans (hash {digest:x} here); every rank must "
            "call parallelize with the same model, mesh, example input shapes and options.")


def agreed_seed(mesh: DeviceMesh) -> int:
    """A dropout seed that every rank agrees on (rank 0's draw, broadcast)."""
    with _local_tensor_off():
        seed = torch.randint(0, 2**31 - 1, (1,))
    if not _one_process():
        seed = seed.to(_device(mesh))
        dist.broadcast(seed, src=0)
    return int(seed.item())
