"""A persistent pool of gloo worker processes for running real multi-process checks from pytest.

Why: starting ``world_size`` Python processes that each import torch and join a gloo process group
costs seconds (2.5-6 s for 4 ranks on a 2-core machine, depending on load). Paying that per test
makes distributed tests unaffordable, so :class:`GlooPool` spawns the workers once per world size
and then runs many small jobs on them (a job costs milliseconds).

What it does:

* ``GlooPool(world_size, pg_timeout_s=60)`` starts ``world_size`` fresh interpreters (``subprocess``, not ``fork``)
  running this file. Each one calls ``dist.init_process_group("gloo", ...)`` over a ``FileStore`` in a
  private temp dir (no port races), with ``TORCH_DISTRIBUTED_DEBUG=DETAIL``, ``OMP_NUM_THREADS=1`` and a
  collective timeout of ``pg_timeout_s`` (it cannot be changed later: the DETAIL wrapper ignores ``_set_pg_timeout``),
  then waits for jobs on a private socket pair. The repo root and ``tests/`` (plus the parent's
  ``sys.path``) are on the workers' ``sys.path``, so ``import autopar`` / ``import tests.x`` work.
* ``pool.run(fn, *args, **kwargs)`` runs ``fn(*args, **kwargs)`` on every rank and returns the
  per-rank results as a list ordered by rank. ``fn`` is a module-level function object or a
  ``"module:qualname"`` string; arguments and results must be picklable. Inside ``fn`` use
  ``torch.distributed`` (``dist.get_rank()``, collectives, ...) as usual. Every rank runs
  ``dist.barrier()`` after ``fn`` so jobs never overlap.
* If any rank raises, ``run`` raises :class:`DistJobError` (an ``AssertionError``) containing every
  failing rank's formatted traceback and that rank's output during the job. If ranks are still
  blocked ``error_grace_s`` seconds after another rank failed (typically waiting in a collective the
  failed rank never entered), or the job exceeds ``timeout``, their Python stacks are dumped
  (``faulthandler``) into the error, the workers are killed and the pool is marked *broken*: later
  ``run`` calls raise ``RuntimeError`` and :func:`gloo_pool` transparently spawns a replacement.
  A job in which a rank raised but every rank still passed the barrier leaves the pool usable.
* ``pool.close()`` (or leaving a ``with GlooPool(...)`` block) runs ``dist.barrier()`` and
  ``dist.destroy_process_group()`` in every worker and reaps them.

Jobs share the worker processes, so global state a job changes (RNG seed, default dtype, extra
process groups) is visible to later jobs on that pool; keep jobs self-contained.

Session-wide pools: ``gloo_pool(world_size, pg_timeout_s=60)`` returns a lazily created pool cached per world
size and timeout (replaced if broken); an ``atexit`` hook closes them. To close them at the end of the pytest session
instead (earlier, with errors reported by pytest), paste this into ``tests/conftest.py``::

    import pytest
    from dist_harness import close_all_pools

    @pytest.fixture(scope="session", autouse=True)
    def _close_gloo_pools():
        yield
        close_all_pools()

Example::

    def _check_allreduce():          # module level, so the workers can import it
        import torch, torch.distributed as dist
        t = torch.ones(2) * dist.get_rank()
        dist.all_reduce(t)
        return t

    def test_allreduce():
        results = gloo_pool(4).run(_check_allreduce)   # [tensor([6., 6.])] * 4
"""

from __future__ import annotations

import atexit
import json
import os
import pickle
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import traceback
from multiprocessing.connection import Connection, wait as _wait_readable
from pathlib import Path
from typing import Any, Callable

__all__ = ["DistJobError", "DistTimeoutError", "GlooPool", "gloo_pool", "close_all_pools"]

TESTS_DIR = Path(__file__).resolve().parent
REPO_ROOT = TESTS_DIR.parent

_PG_TIMEOUT_S = 60  # torch.distributed collective timeout inside the workers
_OUTPUT_TAIL_CHARS = 4000  # how much of a failing rank's job output goes into the error


class DistJobError(AssertionError):
    """A job failed on at least one rank. ``failures`` maps rank -> explanation (traceback, ...)."""

    def __init__(self, message: str, failures: dict[int, str] | None = None) -> None:
        super().__init__(message)
        self.failures: dict[int, str] = failures or {}


class DistTimeoutError(DistJobError):
    """A job (or the pool start-up) did not finish within its timeout; the pool was killed."""


FnRef = Callable[..., Any] | str


def _fn_ref(fn: FnRef) -> str:
    """Turn ``fn`` into a ``"module:qualname"`` string that the workers can import."""
    if isinstance(fn, str):
        if ":" not in fn:
            raise ValueError(f"function reference {fn!r} must look like 'package.module:qualname'")
        return fn
    module = getattr(fn, "__module__", None)
    qualname = getattr(fn, "__qualname__", None)
    if not module or not qualname:
        raise TypeError(f"{fn!r} has no __module__/__qualname__; pass a module-level function")
    if "<locals>" in qualname or "<lambda>" in qualname:
        raise ValueError(
            f"{module}:{qualname} is a lambda or nested function; workers can only run functions "
            "importable by name, so define it at module level"
        )
    if module == "__main__":
        spec = getattr(sys.modules["__main__"], "__spec__", None)
        if spec is None or not spec.name:
            raise ValueError(
                f"{qualname} is defined in a script run as __main__, which workers cannot import; "
                "move it into a module"
            )
        module = spec.name
    return f"{module}:{qualname}"


def _resolve(ref: str) -> Callable[..., Any]:
    import importlib

    module_name, _, qualname = ref.partition(":")
    obj: Any = importlib.import_module(module_name)
    for part in qualname.split("."):
        obj = getattr(obj, part)
    return obj


def _tail(text: str, limit: int = _OUTPUT_TAIL_CHARS) -> str:
    return text if len(text) <= limit else f"[... {len(text) - limit} chars cut ...]\n{text[-limit:]}"


class GlooPool:
    """``world_size`` gloo worker processes that run jobs on demand; see the module docstring."""

    def __init__(
        self,
        world_size: int,
        *,
        timeout: float = 120.0,
        startup_timeout: float = 120.0,
        error_grace_s: float = 10.0,
        pg_timeout_s: float = _PG_TIMEOUT_S,
    ) -> None:
        if world_size < 1:
            raise ValueError(f"world_size must be >= 1, got {world_size}")
        self.world_size = world_size
        self.timeout = timeout
        self.error_grace_s = error_grace_s
        self.pg_timeout_s = pg_timeout_s
        self.broken: str | None = None  # reason, once the pool can no longer run jobs
        self._closed = False
        self._procs: list[subprocess.Popen[bytes]] = []
        self._conns: list[Connection] = []
        self._tmpdir = Path(tempfile.mkdtemp(prefix=f"gloo-pool-w{world_size}-"))
        self._logs = [self._tmpdir / f"rank{r}.log" for r in range(world_size)]
        try:
            self._spawn()
            self._startup(startup_timeout)
        except BaseException:
            self._kill("start-up failed")
            raise

    # ------------------------------------------------------------------ public API

    @property
    def pids(self) -> list[int]:
        return [p.pid for p in self._procs]

    def run(self, fn: FnRef, /, *args: Any, **kwargs: Any) -> list[Any]:
        """Run ``fn(*args, **kwargs)`` on every rank; return the results ordered by rank."""
        return self.call(fn, args, kwargs)

    def call(
        self,
        fn: FnRef,
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
        *,
        timeout: float | None = None,
    ) -> list[Any]:
        """Like :meth:`run`, with an explicit per-job ``timeout`` (seconds, default ``self.timeout``)."""
        self._check_usable()
        ref = _fn_ref(fn)
        # Pickle once, before sending anything: an unpicklable argument must not reach only some ranks.
        message = pickle.dumps(("run", ref, pickle.dumps((tuple(args), dict(kwargs or {})))))
        offsets = [log.stat().st_size if log.exists() else 0 for log in self._logs]
        self._send_all(message, what=f"job {ref}")
        timeout = self.timeout if timeout is None else timeout
        msgs, dead, timed_out = self._gather(2, timeout)

        barrier_failed = any(len(got) == 2 and got[1][1] is not None for got in msgs)
        results: list[Any] = [None] * self.world_size
        failures: dict[int, str] = {}
        for r, got in enumerate(msgs):
            notes = []
            if got and got[0][0] == "err":
                notes.append(got[0][1])
            elif got:
                try:
                    results[r] = pickle.loads(got[0][1])
                except Exception:
                    notes.append("Unpickling the result in the parent failed:\n" + traceback.format_exc())
            if len(got) == 2 and got[1][1] is not None:
                notes.append("The dist.barrier() or the process-group check after the job failed:\n" + got[1][1])
            if r in dead:
                notes.append(f"The worker process died (exit code {dead[r]}).")
            elif not got:
                notes.append(
                    f"Did not finish within {timeout:g} s" if timed_out else
                    f"Had not finished {self.error_grace_s:g} s after another rank failed (probably blocked "
                    "in a collective that the failed rank never entered)"
                )
                notes[-1] += "; its Python stacks are in its output below."
            elif len(got) == 1 and not barrier_failed:
                notes.append("Finished the job but never got through the dist.barrier() after it.")
            if notes:
                failures[r] = "\n".join(notes)
        out_of_sync = [r for r, got in enumerate(msgs) if len(got) < 2 or got[1][1] is not None]
        if out_of_sync:
            self.broken = f"job {ref} left ranks {out_of_sync} out of sync"
            self._dump_stacks([r for r, got in enumerate(msgs) if not got and r not in dead])

        if not failures:
            return results
        report = self._report(failures, offsets)
        if self.broken:
            self._kill(self.broken)
            report += f"\n\nThe pool is now broken ({self.broken}) and its workers were killed."
        cls = DistTimeoutError if timed_out else DistJobError
        raise cls(f"job {ref} failed on ranks {sorted(failures)} of world_size {self.world_size}:\n{report}", failures)

    def close(self, timeout: float = 60.0) -> None:
        """``dist.barrier()`` + ``dist.destroy_process_group()`` on every rank, then reap the workers."""
        if self._closed:
            return
        if self.broken:
            self._kill(self.broken)
            return
        try:
            self._send_all(pickle.dumps(("close",)), what="close")
            msgs, dead, _ = self._gather(1, timeout)
            hung = [r for r, m in enumerate(msgs) if not m and r not in dead]
            errors = {r: m[0][1] for r, m in enumerate(msgs) if m and m[0][1] is not None}
            errors.update({r: f"exited with code {c}" for r, c in dead.items()})
            errors.update({r: f"did not shut down within {timeout:g} s" for r in hung})
            for proc in self._procs:
                try:
                    proc.wait(timeout=60)  # interpreter shutdown takes seconds on a loaded machine
                except subprocess.TimeoutExpired:
                    errors.setdefault(self._procs.index(proc), "did not exit after destroy_process_group()")
            if errors:
                details = "\n".join(f"--- rank {r} ---\n{e}" for r, e in sorted(errors.items()))
                raise DistJobError(f"closing GlooPool(world_size={self.world_size}) failed:\n{details}", errors)
        finally:
            self._kill("closed")

    def __enter__(self) -> GlooPool:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        state = f"broken: {self.broken}" if self.broken else "closed" if self._closed else "ready"
        return f"GlooPool(world_size={self.world_size}, {state}, pids={self.pids})"

    # ------------------------------------------------------------------ internals

    def _spawn(self) -> None:
        env = dict(os.environ)
        env.update(
            OMP_NUM_THREADS="1",
            TORCH_DISTRIBUTED_DEBUG="DETAIL",
            PYTHONUNBUFFERED="1",
            GLOO_POOL_SYS_PATH=json.dumps([str(REPO_ROOT), str(TESTS_DIR), *sys.path]),
            GLOO_POOL_PARENT_PID=str(os.getpid()),
            WORLD_SIZE=str(self.world_size),
            LOCAL_WORLD_SIZE=str(self.world_size),
        )
        init_file = self._tmpdir / "filestore"
        for r in range(self.world_size):
            parent_sock, child_sock = socket.socketpair()
            env.update(RANK=str(r), LOCAL_RANK=str(r))
            with open(self._logs[r], "wb") as log:
                proc = subprocess.Popen(
                    [sys.executable, str(Path(__file__).resolve()), str(r), str(self.world_size),
                     str(child_sock.fileno()), str(init_file), str(self.pg_timeout_s)],
                    env=env, cwd=str(REPO_ROOT), stdin=subprocess.DEVNULL, stdout=log,
                    stderr=subprocess.STDOUT, pass_fds=(child_sock.fileno(),),
                )
            child_sock.close()
            self._procs.append(proc)
            self._conns.append(Connection(parent_sock.detach()))

    def _startup(self, timeout: float) -> None:
        msgs, dead, timed_out = self._gather(1, timeout)
        hung = [r for r, m in enumerate(msgs) if not m and r not in dead]
        failures = {r: m[0][1] for r, m in enumerate(msgs) if m and m[0][0] == "err"}
        failures.update({r: f"worker exited with code {c} during start-up" for r, c in dead.items()})
        failures.update({r: f"did not join the process group within the start-up time" for r in hung})
        if failures:
            self._dump_stacks(hung)
            report = self._report(failures, [0] * self.world_size)
            cls = DistTimeoutError if timed_out else DistJobError
            raise cls(f"GlooPool(world_size={self.world_size}) failed to start:\n{report}", failures)

    def _check_usable(self) -> None:
        if self._closed and not self.broken:
            raise RuntimeError(f"GlooPool(world_size={self.world_size}) is closed")
        if self.broken:
            raise RuntimeError(
                f"GlooPool(world_size={self.world_size}) is broken ({self.broken}); create a new pool "
                "(gloo_pool() does this automatically)"
            )

    def _send_all(self, message: bytes, what: str) -> None:
        for r, conn in enumerate(self._conns):
            try:
                conn.send_bytes(message)
            except OSError as e:
                code = self._procs[r].poll()
                self.broken = f"could not send {what} to rank {r} ({e}; exit code {code})"
                report = self._report({r: self.broken}, [0] * self.world_size)
                self._kill(self.broken)
                raise DistJobError(f"GlooPool(world_size={self.world_size}) lost a worker:\n{report}") from e

    def _gather(self, n_msgs: int, timeout: float) -> tuple[list[list[tuple]], dict[int, int | None], bool]:
        """Collect up to ``n_msgs`` replies per rank. Returns (replies per rank, dead rank -> exit code,
        whether ``timeout`` expired). After any failure, stop waiting ``error_grace_s`` later; after a
        fatal one (a death or a failed barrier) also stop as soon as every live rank sent its first reply."""
        msgs: list[list[tuple]] = [[] for _ in range(self.world_size)]
        dead: dict[int, int | None] = {}
        deadline = time.monotonic() + timeout
        grace_deadline = float("inf")
        fatal = False
        rank_of = {id(c): r for r, c in enumerate(self._conns)}
        while True:
            live = [r for r in range(self.world_size) if r not in dead]
            pending = [r for r in live if len(msgs[r]) < n_msgs]
            now = time.monotonic()
            if not pending or (fatal and all(msgs[r] for r in live)):
                return msgs, dead, False
            if now >= min(deadline, grace_deadline):
                return msgs, dead, now >= deadline
            for conn in _wait_readable([self._conns[r] for r in pending], min(deadline, grace_deadline) - now):
                r = rank_of[id(conn)]
                try:
                    msg = pickle.loads(conn.recv_bytes())
                except (EOFError, OSError):
                    try:
                        dead[r] = self._procs[r].wait(timeout=5)
                    except subprocess.TimeoutExpired:
                        dead[r] = None
                    fatal = True
                else:
                    msgs[r].append(msg)
                    failed = msg[0] == "err" or (msg[0] in ("synced", "closed") and msg[1] is not None)
                    fatal = fatal or (failed and msg[0] == "synced")
                    if not failed:
                        continue
                grace_deadline = min(grace_deadline, time.monotonic() + self.error_grace_s)

    def _dump_stacks(self, ranks: list[int]) -> None:
        """Ask still-running workers to write their Python stacks (faulthandler) into their logs."""
        sizes = {}
        for r in ranks:
            if self._procs[r].poll() is None and hasattr(signal, "SIGUSR1"):
                try:
                    sizes[r] = self._logs[r].stat().st_size
                    os.kill(self._procs[r].pid, signal.SIGUSR1)
                except OSError:
                    pass
        deadline = time.monotonic() + 2.0
        while sizes and time.monotonic() < deadline:  # wait until every signalled rank wrote something
            time.sleep(0.05)
            sizes = {r: n for r, n in sizes.items() if self._logs[r].stat().st_size == n}
        time.sleep(0.05)  # let the last frames land

    def _report(self, failures: dict[int, str], offsets: list[int]) -> str:
        parts = []
        for r in sorted(failures):
            parts.append(f"===== rank {r} =====\n{failures[r].strip()}")
            try:
                with open(self._logs[r], "rb") as f:
                    f.seek(offsets[r])
                    output = f.read().decode(errors="replace").strip()
            except OSError:
                output = ""
            if output:
                parts.append(f"----- rank {r} output during the job -----\n{_tail(output)}")
        return "\n".join(parts)

    def _kill(self, reason: str) -> None:
        if self._closed:
            return
        self._closed = True
        if reason != "closed":
            self.broken = self.broken or reason
        for proc in self._procs:
            if proc.poll() is None:
                proc.kill()
        for proc in self._procs:
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                pass
        for conn in self._conns:
            conn.close()
        shutil.rmtree(self._tmpdir, ignore_errors=True)

    def __del__(self) -> None:
        try:
            self._kill("garbage collected")
        except Exception:
            pass


# ---------------------------------------------------------------------- session-wide pools

_POOLS: dict[tuple[int, float], GlooPool] = {}
_ATEXIT_REGISTERED = False


def gloo_pool(world_size: int, pg_timeout_s: float = _PG_TIMEOUT_S) -> GlooPool:
    """The session's pool for ``world_size`` (and process-group timeout ``pg_timeout_s``), created on first use
    and re-created if it broke."""
    global _ATEXIT_REGISTERED
    key = (world_size, pg_timeout_s)
    pool = _POOLS.get(key)
    if pool is None or pool.broken or pool._closed:
        if not _ATEXIT_REGISTERED:
            atexit.register(close_all_pools)
            _ATEXIT_REGISTERED = True
        pool = _POOLS[key] = GlooPool(world_size, pg_timeout_s=pg_timeout_s)
    return pool


def close_all_pools() -> None:
    """Close every pool made by :func:`gloo_pool`, all at once (each waits for its workers' exit); failures are
    reported as warnings, not raised."""
    import threading
    import warnings

    pools = list(_POOLS.values())
    _POOLS.clear()
    errors: list[str] = []

    def close(pool: GlooPool) -> None:
        try:
            pool.close()
        except Exception as e:  # noqa: BLE001 - shutting down; report and continue
            errors.append(f"closing {pool!r} failed: {e}")

    threads = [threading.Thread(target=close, args=(pool,)) for pool in pools]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for error in errors:
        warnings.warn(error, RuntimeWarning, stacklevel=2)


# ---------------------------------------------------------------------- worker process


def _worker_main(rank: int, world_size: int, fd: int, init_file: str, pg_timeout_s: float = _PG_TIMEOUT_S) -> int:
    conn = Connection(fd)

    def reply(*msg: Any) -> None:
        sys.stdout.flush()
        sys.stderr.flush()
        conn.send_bytes(pickle.dumps(msg))

    _die_with_parent()  # note: tied to the parent *thread* that spawned us (prctl semantics)
    import faulthandler

    faulthandler.enable()  # hard crashes print a stack into the log
    if hasattr(signal, "SIGUSR1"):
        faulthandler.register(signal.SIGUSR1, all_threads=True)  # parent's "where are you stuck?"
    for p in reversed(json.loads(os.environ.get("GLOO_POOL_SYS_PATH", "[]"))):
        if p not in sys.path:
            sys.path.insert(1, p)
    try:
        from datetime import timedelta

        import torch.distributed as dist

        dist.init_process_group(
            "gloo", init_method=f"file://{init_file}", rank=rank, world_size=world_size,
            timeout=timedelta(seconds=pg_timeout_s),
        )
    except BaseException:
        reply("err", traceback.format_exc())
        return 1
    reply("ready", os.getpid())

    while True:
        try:
            msg = pickle.loads(conn.recv_bytes())
        except (EOFError, OSError):
            return 0  # parent went away
        if msg[0] == "close":
            error = None
            try:
                dist.barrier()
                dist.destroy_process_group()
            except BaseException:
                error = traceback.format_exc()
            reply("closed", error)  # flushes this rank's output first
            # Leave at once: the interpreter's own shutdown (torch, autopar and what jobs imported) takes seconds
            # per rank on a loaded machine, and the pool waits for every rank's exit.
            os._exit(0 if error is None else 1)
        _, ref, payload = msg
        groups = _groups()
        try:
            args, kwargs = pickle.loads(payload)
            result = pickle.dumps(_resolve(ref)(*args, **kwargs))
            outcome: tuple[str, Any] = ("ok", result)
        except BaseException:
            outcome = ("err", traceback.format_exc())
        if _destroyed_since(groups):
            _forget_destroyed_groups()
        try:
            reply(*outcome)  # before the barrier, so the parent hears about failures even if it hangs
            try:
                dist.barrier()
                synced = _groups_in_step(world_size)
            except BaseException:
                synced = traceback.format_exc()
            reply("synced", synced)
        except OSError:
            return 0  # parent went away


def _groups() -> tuple[int, set[str]]:
    """How many process groups were ever created, and the names of those alive."""
    import torch.distributed as dist

    world = dist.distributed_c10d._world
    return world.group_count, set(world.pg_names.values())


def _groups_in_step(world_size: int) -> str | None:
    """After a job: whether the ranks agree on the process groups that exist (None) or an explanation. Creating a
    group is collective and names it by a per-rank counter: a job that made a group (a `new_group`, a `DeviceMesh`)
    on some ranks only, or different groups on different ranks, leaves the counters apart or one name meaning
    different ranks, and some later job's `new_group` waits forever for peers registering under another name (or
    talks to the wrong ones). This makes the job that did it fail, by name, at once."""
    import torch.distributed as dist

    world = dist.distributed_c10d._world
    mine = (world.group_count, {name: sorted(world.pg_group_ranks[pg]) for pg, name in world.pg_names.items()
                                if pg in world.pg_group_ranks})
    every: list = [None] * world_size
    dist.all_gather_object(every, mine)
    counts = [c for c, _ in every]
    if len(set(counts)) > 1:
        return (f"The ranks have created different numbers of process groups (per rank: {counts}): this job made a "
                "process group (dist.new_group, a DeviceMesh) on some ranks and not on others. Group creation is "
                "collective; a later one would hang.")
    seen: dict[str, tuple[int, list[int]]] = {}
    for r, (_, groups) in enumerate(every):
        for name, ranks in groups.items():
            first = seen.setdefault(name, (r, ranks))
            if first[1] != ranks:
                return (f"Process group {name!r} is ranks {first[1]} on rank {first[0]} but {ranks} on rank {r}: this "
                        "job created different groups on different ranks (each rank must create every group, members "
                        "or not, in the same order).")
            for m in ranks:
                if every[m][1].get(name) != ranks:
                    return (f"Process group {name!r} is ranks {ranks} on rank {r} but "
                            f"{every[m][1].get(name)} on rank {m}: this job created different groups on different "
                            "ranks under one name (each rank must create every group, in the same order).")
    return None


def _destroyed_since(before: tuple[int, set[str]]) -> bool:
    """Whether a group alive then, or created since, is gone."""
    count, names = before
    now_count, now_names = _groups()
    return bool(names - now_names) or len(now_names - names) < now_count - count


def _forget_destroyed_groups() -> None:
    """A job destroyed a process group (e.g. a mesh's own `dist.new_group`): DTensor's sharding propagation cache is
    keyed by DeviceMesh equality, which ignores the mesh's groups, so a later job's equal mesh could be handed a
    cached result naming the destroyed group ("Could not resolve the process group registered under the name N",
    depending on which jobs ran before on this pool). Clear it, as tests/conftest.py does for the fake world."""
    import torch
    from torch.distributed.tensor import DTensor

    DTensor._op_dispatcher.sharding_propagator.propagate_op_sharding.cache_clear()
    if hasattr(torch._C, "_clear_DTensor_sharding_propagator_cache"):  # the C++ dispatch fast path's cache
        torch._C._clear_DTensor_sharding_propagator_cache()


def _die_with_parent() -> None:
    """Linux: get SIGKILLed when the parent dies, so a crashed pytest never leaves workers behind."""
    if not sys.platform.startswith("linux"):
        return
    try:
        import ctypes

        PR_SET_PDEATHSIG = 1
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    except Exception:
        return
    if os.getppid() != int(os.environ.get("GLOO_POOL_PARENT_PID", os.getppid())):
        os._exit(1)  # the parent died before prctl took effect


if __name__ == "__main__":
    _rank, _world, _fd, _init, _pg_timeout = sys.argv[1:6]
    sys.exit(_worker_main(int(_rank), int(_world), int(_fd), _init, float(_pg_timeout)))
