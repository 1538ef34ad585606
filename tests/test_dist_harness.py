"""Tests for tests/dist_harness.py: real gloo collectives on pooled worker processes.

The ``_job_*`` functions run inside the workers (they import this module by name), so they must stay
at module level and cheap to import.
"""

from __future__ import annotations

import os
import sys
import time

import pytest
from dist_harness import REPO_ROOT, TESTS_DIR, DistJobError, DistTimeoutError, GlooPool, gloo_pool


# ---------------------------------------------------------------------- jobs (run on every rank)


def _job_rank_info() -> dict[str, object]:
    import torch
    import torch.distributed as dist

    return {
        "rank": dist.get_rank(),
        "world": dist.get_world_size(),
        "backend": dist.get_backend(),
        "pid": os.getpid(),
        "env": {k: os.environ.get(k) for k in ("RANK", "WORLD_SIZE", "OMP_NUM_THREADS", "TORCH_DISTRIBUTED_DEBUG")},
        "threads": torch.get_num_threads(),
    }


def _job_all_reduce() -> tuple[list[float], list[float]]:
    import torch
    import torch.distributed as dist

    r = dist.get_rank()
    total = torch.tensor([r + 1.0, 10.0 * r])
    dist.all_reduce(total)
    biggest = torch.tensor([float(r), -float(r)])
    dist.all_reduce(biggest, op=dist.ReduceOp.MAX)
    return total.tolist(), biggest.tolist()


def _a2a_split(src: int, dst: int) -> int:
    """Rows rank ``src`` sends to rank ``dst``: uneven and asymmetric (src->dst != dst->src)."""
    return src + 2 * dst + 1


def _a2a_value(src: int, dst: int, i: int) -> float:
    return 1000.0 * src + 100.0 * dst + i


def _job_all_to_all_uneven() -> list[float]:
    import torch
    import torch.distributed as dist

    r, w = dist.get_rank(), dist.get_world_size()
    in_splits = [_a2a_split(r, d) for d in range(w)]
    out_splits = [_a2a_split(s, r) for s in range(w)]
    inp = torch.tensor([_a2a_value(r, d, i) for d in range(w) for i in range(in_splits[d])])
    out = torch.empty(sum(out_splits))
    dist.all_to_all_single(out, inp, output_split_sizes=out_splits, input_split_sizes=in_splits)
    return out.tolist()


def _job_scaled(x: int, *, scale: int) -> int:
    import torch.distributed as dist

    return x * scale + dist.get_rank()


def _job_raise_on_rank(bad_rank: int) -> int:
    import torch.distributed as dist

    if dist.get_rank() == bad_rank:
        print(f"rank {bad_rank} is about to fail")
        raise ValueError(f"boom from rank {dist.get_rank()}")
    return dist.get_rank()


def _job_raise_before_collective() -> list[float]:
    import torch
    import torch.distributed as dist

    if dist.get_rank() == 1:
        raise ValueError("rank 1 skips the all_reduce")
    t = torch.ones(3)
    dist.all_reduce(t)  # never matched by rank 1
    return t.tolist()


def _job_die_on_rank(bad_rank: int) -> None:
    import torch.distributed as dist

    if dist.get_rank() == bad_rank:
        os._exit(3)


def _job_sleep(seconds: float) -> None:
    time.sleep(seconds)


def _job_import_paths() -> dict[str, object]:
    import importlib.util

    return {
        "sys_path": list(sys.path),
        "tests.dist_harness": importlib.util.find_spec("tests.dist_harness") is not None,
        "autopar": importlib.util.find_spec("autopar") is not None,
    }


# ---------------------------------------------------------------------- tests


@pytest.fixture(params=[2, 4], ids=lambda w: f"world{w}")
def pool(request: pytest.FixtureRequest) -> GlooPool:
    return gloo_pool(request.param)


def test_results_are_ordered_by_rank(pool: GlooPool) -> None:
    w = pool.world_size
    infos = pool.run(_job_rank_info)
    assert [i["rank"] for i in infos] == list(range(w))
    assert {i["world"] for i in infos} == {w}
    assert {i["backend"] for i in infos} == {"gloo"}
    assert [i["pid"] for i in infos] == pool.pids and len(set(pool.pids)) == w
    for r, info in enumerate(infos):
        assert info["env"] == {"RANK": str(r), "WORLD_SIZE": str(w), "OMP_NUM_THREADS": "1",
                               "TORCH_DISTRIBUTED_DEBUG": "DETAIL"}
        assert info["threads"] == 1
    assert gloo_pool(w) is pool  # cached: spawned once per world size


def test_all_reduce(pool: GlooPool) -> None:
    w = pool.world_size
    expected = ([w * (w + 1) / 2, 10.0 * w * (w - 1) / 2], [w - 1.0, 0.0])
    assert pool.run(_job_all_reduce) == [expected] * w


def test_all_to_all_single_uneven_splits(pool: GlooPool) -> None:
    w = pool.world_size
    results = pool.run(_job_all_to_all_uneven)
    for r, got in enumerate(results):
        expected = [_a2a_value(s, r, i) for s in range(w) for i in range(_a2a_split(s, r))]
        assert got == expected, f"rank {r}"
    assert len({len(got) for got in results}) == w  # every rank received a different amount


def test_args_kwargs_and_string_references(pool: GlooPool) -> None:
    w = pool.world_size
    assert pool.run(_job_scaled, 3, scale=2) == [6 + r for r in range(w)]
    assert pool.run(f"{__name__}:_job_scaled", 1, scale=10) == [10 + r for r in range(w)]
    assert pool.run("os:getpid") == pool.pids


def test_rank_exception_surfaces_traceback_and_pool_survives(pool: GlooPool) -> None:
    w, pids = pool.world_size, pool.pids
    with pytest.raises(DistJobError) as info:
        pool.run(_job_raise_on_rank, w - 1)
    message = str(info.value)
    assert set(info.value.failures) == {w - 1}
    assert f"failed on ranks [{w - 1}] of world_size {w}" in message
    assert f"===== rank {w - 1} =====\nTraceback (most recent call last):" in message
    assert "in _job_raise_on_rank" in message
    assert f"ValueError: boom from rank {w - 1}" in message
    assert f"rank {w - 1} is about to fail" in message  # the rank's printed output is included
    # Every rank still reached the post-job barrier, so the same workers keep serving jobs.
    assert not pool.broken
    assert pool.run(_job_scaled, 1, scale=1) == list(range(1, w + 1))
    assert gloo_pool(w) is pool and pool.pids == pids


def test_bad_functions_and_arguments_are_rejected_before_dispatch() -> None:
    pool = gloo_pool(2)

    def nested() -> None: ...

    with pytest.raises(ValueError, match="nested function"):
        pool.run(nested)
    with pytest.raises(ValueError, match="lambda"):
        pool.run(lambda: None)
    with pytest.raises(Exception, match="pickle|Pickl"):
        pool.run(_job_scaled, lambda: 0, scale=1)
    with pytest.raises(DistJobError, match="ModuleNotFoundError: No module named 'no_such_module'"):
        pool.run("no_such_module:fn")
    assert not pool.broken and pool.run(_job_scaled, 0, scale=0) == [0, 1]


def test_workers_can_import_repo_and_tests() -> None:
    for info in gloo_pool(2).run(_job_import_paths):
        assert str(REPO_ROOT) in info["sys_path"] and str(TESTS_DIR) in info["sys_path"]
        assert info["tests.dist_harness"] and info["autopar"]


def test_desynchronised_collective_breaks_pool_then_respawns() -> None:
    pool = gloo_pool(2)
    start = time.monotonic()
    with pytest.raises(DistJobError) as info:
        pool.run(_job_raise_before_collective)
    # DETAIL debug mode detects the mismatch at once: no waiting out error_grace_s (10 s) or timeouts.
    assert time.monotonic() - start < 8
    message = str(info.value)
    assert "ValueError: rank 1 skips the all_reduce" in message
    assert "Detected mismatch between collectives" in message
    assert "The pool is now broken" in message
    assert pool.broken
    with pytest.raises(RuntimeError, match="is broken"):
        pool.run(_job_scaled, 0, scale=0)
    fresh = gloo_pool(2)
    assert fresh is not pool and fresh.run(_job_scaled, 0, scale=0) == [0, 1]


def test_dead_worker_is_reported() -> None:
    with GlooPool(2, error_grace_s=2) as pool:
        with pytest.raises(DistJobError, match=r"(?s)rank 1 =====.*died \(exit code 3\)"):
            pool.run(_job_die_on_rank, 1)
        assert pool.broken


def test_hanging_job_times_out_with_stack_dump() -> None:
    with GlooPool(1) as pool:
        with pytest.raises(DistTimeoutError) as info:
            pool.call(_job_sleep, (600,), timeout=1)
        message = str(info.value)
        assert "Did not finish within 1 s" in message
        assert "in _job_sleep" in message  # faulthandler stack of the stuck rank
        with pytest.raises(RuntimeError, match="is broken"):
            pool.run(_job_sleep, 0)


def test_close_shuts_workers_down_cleanly() -> None:
    pool = GlooPool(2)
    procs = list(pool._procs)
    with pool:
        assert pool.run(_job_scaled, 1, scale=1) == [1, 2]
    assert [p.returncode for p in procs] == [0, 0]
    with pytest.raises(RuntimeError, match="is closed"):
        pool.run(_job_scaled, 1, scale=1)


def _job_group_on_rank0_only() -> None:
    import torch.distributed as dist

    # What a `new_group` that only rank 0 made leaves behind (a real one would block until its store barrier times
    # out): rank 0's group counter one ahead, so the two ranks would name their next group differently.
    if dist.get_rank() == 0:
        dist.distributed_c10d._world.group_count += 1


def test_a_job_creating_groups_on_some_ranks_only_fails_by_name() -> None:
    """The census for collective group creation (a pipeline job once built a mesh on some ranks only, and a later
    job's `new_group` hung in another test file): the job that desynchronises the group counters fails itself."""
    pool = gloo_pool(2)
    with pytest.raises(DistJobError) as info:
        pool.run(_job_group_on_rank0_only)
    message = str(info.value)
    assert "different numbers of process groups (per rank: [" in message and "_job_group_on_rank0_only" in message
    assert pool.broken
    assert gloo_pool(2).run(_job_scaled, 1, scale=2) == [2, 3]
