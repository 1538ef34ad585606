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
* The longest test files run first (``FILE_SECONDS``, measured; a file not named there is estimated from its number
  of tests): ``make test`` hands whole files to 2 workers in collection order (``--dist loadfile
  --no-loadscope-reorder``), so a long file never starts last and runs alone at the end.
* Torch runs one intra-op thread in each test process (see below).
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


# Seconds per file (its tests' durations summed, `--durations=0` of a `make test` run on 2026-12-04, a loaded machine):
# the files run longest first. Refresh it when a file grows. A file not named here is estimated at
# UNNAMED_SECONDS_PER_TEST per test (over the suite's mean, on purpose: a short file started early costs nothing, a
# long one started last runs alone at the end).
FILE_SECONDS = {
    "test_sequence_parallel.py": 185,  # 213 before 2026-12-07 (8 tests fewer: 51.5 -> 44.6 s alone, scaled)
    "test_checkpoint_levels.py": 165,  # +20: the dp x tp recompute cases (4 simulated ranks; 4 offline plans)
    "test_rule_check.py": 120,
    "test_zoo.py": 160,
    "test_tune.py": 50,  # 96 before 2026-12-07: the CLI test runs main() on the 4-rank pool (58 -> 9 s); +4 s: k-best mirror test lists 16 plans; -5: memory-limit model 64 -> 16 MiB (30.4 -> 27.4 s alone)
    "test_pipeline_dtp.py": 10,  # one fake-PG build of pp2 x dp2 x tp2: 5 s alone, 9 s at load 15 (2026-12-07)
    "test_pipeline_tp.py": 20,  # one 4-rank case (pp2 x tp2, 2 steps); most of it is the 4-rank pool start
    "test_pipeline_tp_errors.py": 13,  # one 4-rank job, 13 s at load 26 (2026-12-07), the 4-rank pool started
    "test_pipeline_ep.py": 12,  # pp2 x ep2 on the 4-rank pool: 4 s warm, 55 s at load 24-35 with the pool start (2026-12-07)
    "test_pipeline_tp_sp.py": 22,  # 1f1b (2 steps) + zbv + refusals, 4-rank pool: 24 s with its start, load 7 (2026-12-07)
    "test_pipeline_tp_forms.py": 15,  # two 4-rank jobs (tied GPT, zbv): 19.7 s with the pool start, load ~20 (2026-12-07)
    "test_pipeline_errors.py": 30,  # 21-40 s alone at load 5-8 (2026-12-07); all but ~3 s of it starts the 2- and 4-rank pools
    "test_pipeline_runtime.py": 95,  # measured at load 8-11 on 2 cores; ~60 s of it starts the 2- and 4-rank pools
    "test_two_axis_attention.py": 68,  # 95 before 2026-12-07 (4 runs fewer: 27.7 -> 19.8 s alone, scaled)
    "test_equivalence_local.py": 90,
    "test_moe_dispatch.py": 86,
    "test_estimate.py": 73,
    "test_contract_compile.py": 100,  # 170 before 2026-12-07 (1-layer GPT: 75 -> 56 s alone, quiet; 132 s in a busy
    # make test's junit, scaled); inductor compiles cold on a clean clone
    "test_nn_census.py": 70,  # not from that run: 58-72 CPU s alone (2026-12-04, 39 rows x 4 plans + 1-rank programs)
    "test_moe.py": 58,  # 63 before 2026-12-07 (mixtral-ep4 dropped: 4.8 of 57.7 s alone, scaled)
    "test_precision_inputs.py": 38,  # not from that run: measured alone, 2026-12-04 (a gloo test against FSDP2)
    "test_batch_local.py": 35,  # not from that run: measured alone, 2026-12-04 (one gloo test)
    "test_pipeline_cost.py": 30,
    "test_pipeline_memory.py": 20,
    "test_pipeline_memory_schedules.py": 25,  # one 2-rank job (interleaved, zbv), one 4-rank job (fsdp stages)
    "test_pipeline_census.py": 15,
    "test_tune_pipeline.py": 30,
    "test_pipeline_dcp.py": 12,  # measured 8 s alone (2026-12-07), the 2-rank pool started  # measured 19 s alone (2026-12-07), most of it tune measuring every hand plan  # measured 7 s alone with the 2-rank pool started (2026-12-07)
    "test_pipeline_forms.py": 100,  # measured alone, 2026-12-06: 61-76 s before the mp_policy case (+44 s alone; mostly the 4-rank pool starting)
    "test_pipeline_auto.py": 165,  # measured at load 12-14 on 2 cores (2026-12-06), the 2- and 4-rank pools started
    "test_rule_sweep.py": 34,  # 2026-12-07 at load 25-35: 76 -> 34 s wall, 18.6 -> 13.7 CPU s (part 6; the first case drew the part's OpInfo samples through torch's stack crawl: 24 -> 3 s)
    "test_verify.py": 45,  # 60 before 2026-12-07: one torchrun instead of two at once (36 s -> 10 + 9 s), 42 s alone
    "test_recognition.py": 57,
    "test_meta.py": 60,
    "test_meta_moe.py": 30,  # 2026-12-07 at load 19: the 4-rank job 24 s cold (pool started, workers importing transformers), 4 s warm; 80 s alone with the pool start; the in-process check 4 s
    "test_load_conversions.py": 8,  # 2026-12-07: Dinov2 SwiGLU save/load under fsdp and megatron on the 2-rank pool
    "test_release.py": 30,  # measured 2026-12-06: 21 s (8-12 s per plan: four parallelize each, a 42 MB model)
    "test_solver.py": 44,
    "test_shapes.py": 36,
    "test_ring_hf.py": 36,
    "test_tp_overlap.py": 34,
    "test_dist_harness.py": 30,
    "test_model_ops.py": 29,
    "test_fsdp_layers.py": 24,
    "test_zero.py": 92,  # 100 before 2026-12-07 (4 ZeRO jobs fewer, ~5 s of job time); not from that run: 2026-12-06 under load, ~55 s of it starting the 2- and 4-rank gloo pools
    "test_zero_memory.py": 10,  # not from that run: 2026-12-06, plans on dict meshes (no processes)
    "test_dp_memory.py": 12,  # not from that run: 2026-12-07, 13 offline plans on dict meshes
    "test_zero_auto.py": 15,  # not from that run: 2026-12-07, 4 offline auto plans + one 2-rank gloo run
    "test_zero_ilp.py": 15,  # 2026-12-07 estimate: 4 offline plans + one 2-rank gloo run of a mixed zero1/fsdp plan
    "test_zero_ends.py": 5,  # 2026-12-07 estimate: one offline zero2 plan (no processes)
    "test_sharding.py": 24,
    "test_local_step.py": 23,
    "test_inspect.py": 36,  # 40 before 2026-12-07: the HF-config CLI test runs main() in-process (6.4 -> 2.7 s alone)
    "test_mixed_precision.py": 22,
    "test_mixed_precision_tp.py": 30,
    "test_collectives.py": 20,
    "test_published_runs.py": 30,
    "test_float8_plan.py": 22,  # the torchtitan bf16/float8 pairs priced offline (11 s)
    "test_float8_kernel.py": 2,
    "test_float8_ilp.py": 5,  # the ILP's per-class fp8 against an exhaustive search, offline (3 s)
    "test_float8_runtime.py": 12,  # dp, fsdp, megatron x2 on the shared 2-rank pool (2-3 s each)
    "test_float8_fsdp_gather.py": 8,  # fsdp tensorwise with the fp8 all-gather on the shared 2-rank pool
    "test_float8_torchao_model.py": 2,
    "test_contract_data.py": 19,
    "test_tune_mirror.py": 18,
    "test_contract_modes.py": 18,
    "test_memory_estimate.py": 17,
    "test_block_attention_kernel.py": 17,
    "test_contract_ranks.py": 14,
    "test_moe_flops.py": 13,
    "test_dp_overhead.py": 11,
    "test_agree_rides.py": 8,  # one 2-rank gloo job: a small head's calls, riding, mismatched, failing
    "test_loss_count_fused.py": 8,  # one 2-rank gloo job: 2 dp steps of a 2-layer head
    "test_attention_masks.py": 10,
    "test_autoplan.py": 9,
    "test_grad_buckets.py": 9,
    "test_reduce_transient.py": 6,
    "test_equivalence_gloo.py": 6,
    "test_errors.py": 6,
    "test_moe_permute_kernel.py": 6,
    "test_checkpoint.py": 5,
    "test_planning_shapes.py": 4,
    "test_repeated_capture.py": 8,
    "test_fake_mesh.py": 4,
    "test_numerics_modes.py": 4,
    "test_ring_attention.py": 4,
    "test_capture.py": 3,
    "test_cost_model.py": 3,
    "test_structure.py": 2,
    "test_embedding_forms.py": 2,
    "test_fsdp_units.py": 2,
    "test_dtensor_rules.py": 1,
    "test_contract_errors.py": 1,
    "test_timeline.py": 1,
    "test_layers.py": 1,
    "test_fsdp_dims.py": 1,
    "test_solver_tight.py": 4,  # 2026-12-07: 1.5 s call, 5 s with imports, load 25 (2 offline plans of a meta GPT)
    "test_fsdp_uneven.py": 14,  # 2026-12-07: the 4-rank job 4.4 s (fsdp, zero1, zero2, DCP); 13-20 s alone under load, starting the pool
    "test_scalar_ops.py": 1,
    "test_to_locals.py": 1,
}
UNNAMED_SECONDS_PER_TEST = 2.0
LONGEST_FIRST = tuple(FILE_SECONDS)  # the named files, slowest first (kept for readers of the old name)


def pytest_collection_finish(session):
    gc.collect()
    gc.freeze()  # what is alive now lives for the whole session: never scan it again
    gc.set_threshold(10_000, 10, 10)  # default (700, 10, 10); a full collection still follows every ~10^6 allocations


def pytest_unconfigure(config):
    gc.unfreeze()  # let interpreter shutdown collect them as usual (else extension modules report leaked objects)


def pytest_collection_modifyitems(items):
    count: dict[str, int] = {}
    for item in items:
        count[item.path.name] = count.get(item.path.name, 0) + 1
    seconds = {name: FILE_SECONDS.get(name, UNNAMED_SECONDS_PER_TEST * n) for name, n in count.items()}
    items.sort(key=lambda item: -seconds[item.path.name])  # stable: each file's tests keep their order


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
