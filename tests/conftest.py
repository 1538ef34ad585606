"""Session fixtures shared by the tests.

* ``local_world(W)``: a context manager that simulates ``W`` ranks in this one process: it makes sure
  the default process group is the ``fake`` backend with world size ``W`` (re-initialising it when
  a test needs another world size; autopar rejects meshes smaller than the world) and enters
  ``LocalTensorMode(W)``. Build models and inputs *outside* the ``with`` block (parameters created
  inside it would be per-rank ``LocalTensor``s).
* ``fp64``: the default dtype is float64 for the duration of a test (restored afterwards).
* The gloo worker pools made by ``dist_harness.gloo_pool`` are closed at the end of the session.
"""

from __future__ import annotations

import contextlib

import pytest
import torch
import torch.distributed as dist

from dist_harness import close_all_pools


def set_fake_world(world_size: int) -> None:
    """The default process group: the fake backend, rank 0, `world_size` ranks."""
    if dist.is_initialized():
        if dist.get_backend() == "fake" and dist.get_world_size() == world_size and dist.get_rank() == 0:
            return
        dist.destroy_process_group()
        _clear_dtensor_sharding_cache()
    dist.init_process_group("fake", rank=0, world_size=world_size)


def _clear_dtensor_sharding_cache() -> None:
    """DTensor caches sharding propagation keyed by DeviceMesh equality, which ignores the mesh's process
    groups: once the world is re-created, a cached result could hand a DTensor a mesh of an earlier world
    whose groups no longer exist (seen as "Could not resolve the process group registered under the name
    N", depending on which tests ran before)."""
    from torch.distributed.tensor import DTensor

    DTensor._op_dispatcher.sharding_propagator.propagate_op_sharding.cache_clear()
    if hasattr(torch._C, "_clear_DTensor_sharding_propagator_cache"):  # the C++ dispatch fast path's cache
        torch._C._clear_DTensor_sharding_propagator_cache()


@contextlib.contextmanager
def _local_world(world_size: int):
    from torch.distributed._local_tensor import LocalTensorMode

    set_fake_world(world_size)
    with LocalTensorMode(world_size) as mode:
        yield mode


@pytest.fixture(scope="session")
def _fake_pg():
    yield set_fake_world
    if dist.is_initialized():
        dist.destroy_process_group()


@pytest.fixture
def local_world(_fake_pg):
    """`with local_world(W): ...` runs the block on W simulated ranks (fake PG + LocalTensorMode)."""
    return _local_world


@pytest.fixture
def fp64():
    old = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    try:
        yield
    finally:
        torch.set_default_dtype(old)


@pytest.fixture(scope="session", autouse=True)
def _close_gloo_pools():
    yield
    close_all_pools()
