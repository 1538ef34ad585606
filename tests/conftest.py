"""Session fixtures shared by the tests.

* ``local_world(W)``: a context manager that simulates ``W`` ranks in this one process: it makes sure
  the default process group is the ``fake`` backend with world size ``W`` (re-initialising it when
  a test needs another world size; autopar rejects meshes smaller than the world) and enters
  ``LocalTensorMode(W)``. Build models and inputs *outside* the ``with`` block (parameters created
  inside it would be per-rank ``LocalTensor``s).
* ``fp64``: the default dtype is float64 for the duration of a test (restored afterwards).
* The gloo worker pools made by ``dist_harness.gloo_pool`` are closed at the end of the session.
* After collection the objects alive (torch, autopar, the test modules) are frozen out of the cyclic garbage collector
  and it runs less often: FX graphs and DTensor specs churn many small objects, and the default thresholds spent
  ~10% of a LocalTensorMode test's CPU time re-scanning the imported modules.
* The longest test files run first (``LONGEST_FIRST``): ``make test`` hands whole files to 2 workers in collection
  order (``--dist loadfile --no-loadscope-reorder``), so a long file never starts last and runs alone at the end.
"""

from __future__ import annotations

import contextlib
import gc
import os

import pytest
import torch
import torch.distributed as dist

from dist_harness import close_all_pools

# One intra-op thread per test process: `make test` runs 2 xdist workers on 2 cores, and torch's default (a thread per
# core) oversubscribed them: OpenMP's idle threads spin between the small ops these tests run, which tripled the CPU
# time of a LocalTensorMode file (45 s against 15 s user for the same tests, measured). Subprocesses (gloo pools,
# torchrun) inherit the variable; they set it themselves too.
os.environ.setdefault("OMP_NUM_THREADS", "1")
torch.set_num_threads(1)


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


# The slowest files, slowest first: each file alone, CPU seconds measured on 2026-12-02 (a loaded machine; gloo pools
# spawned per file), ~ where its run timed out or was estimated from its tests. A rough order: refresh it when a file
# grows. Scheduling the longest jobs first keeps the two workers' finishing times close; files not named run
# afterwards, in their order.
LONGEST_FIRST = (
    "test_zoo.py",  # ~200 (timed out after 59 of its 64 tests)
    "test_equivalence_local.py",  # ~120 (timed out after 60 of its 65 tests)
    "test_sequence_parallel.py",  # not measured: estimated from its tests
    "test_checkpoint_levels.py",  # 84
    "test_estimate.py",  # 79
    "test_contract_ranks.py",  # 66
    "test_moe.py",  # not measured: estimated from its tests
    "test_fsdp_layers.py",  # 55
    "test_equivalence_gloo.py",  # 53
    "test_planning_shapes.py",  # 53
    "test_two_axis_attention.py",  # not measured: estimated from its tests
    "test_verify.py",  # 46
    "test_tune.py",  # not measured: estimated from its tests
    "test_solver.py",  # 41
    "test_shapes.py",  # 41
    "test_published_runs.py",  # 39
    "test_meta.py",  # not measured: estimated from its tests
    "test_contract_data.py",  # 34
    "test_inspect.py",  # 34
    "test_memory_estimate.py",  # 31
    "test_mixed_precision.py",  # not measured: estimated from its tests
    "test_sharding.py",  # 27
    "test_grad_buckets.py",  # 27
)


def pytest_collection_finish(session):
    gc.collect()
    gc.freeze()  # what is alive now lives for the whole session: never scan it again
    gc.set_threshold(10_000, 10, 10)  # default (700, 10, 10); a full collection still follows every ~10^6 allocations


def pytest_unconfigure(config):
    gc.unfreeze()  # let interpreter shutdown collect them as usual (else extension modules report leaked objects)


def pytest_collection_modifyitems(items):
    rank = {name: i for i, name in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))  # stable: each file's tests keep their order


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
