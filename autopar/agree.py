"""Every rank runs the same program, or every rank raises the same error: agreement across ranks.

A rank that raises alone leaves the others waiting in the next collective until the process group times out; ranks
that captured different models or shapes lower different programs, which hang or compute wrong numbers. So
`parallelize` meets the other ranks at two points, and each lets every rank through or raises the same error on
every rank:

- `agree_on(step, describe, mesh)`: every rank runs `step` (capture and recognition), then ONE all-gather of a
  fixed-size int64 row per rank: [failed, a digest per fingerprint part, a digest of the example input values, one
  of the unbatched inputs' values]. A failure on any rank raises that rank's error on every rank; parts that differ
  raise on every rank a `RankMismatchError` naming the ranks, the part and the first thing that differs. Those
  details travel in a second all-gather that a rank enters only once the first told every rank it is needed.
- `agree_on_success(step, mesh, doing)`: every rank runs `step` (`autopar.load` reading its checkpoint files),
  then one all-gather of a failed flag per rank: a failure on any rank raises that rank's error on every rank,
  before any rank goes on to a collective the failed rank would never reach.
- `solve_on_rank0`: rank 0 plans; the plan, or rank 0's error, is broadcast (one broadcast).
- `check_input_values`: inputs="global": every rank passed the same example values; inputs="local": the ranks of
  one data-parallel rank (differing only on non-data axes) passed the same values, and the unbatched inputs are the
  same everywhere. Decided on the digests gathered by `agree_on`: no collective unless they differ.
- `agreed_seed`: the dropout stream's seed, rank 0's draw broadcast.
- `agree_on_call`: at every call of the ParallelModule, one small all-reduce, left in flight until the program's
  first collective: the call's shapes agree, no rank holds an out-of-range id, and under inputs="global" every rank
  passed the same values (`input_digests` of every tensor input).
- `SummedAgreement`: the same agreement under inputs="local" on a 1-D mesh, as an exact SUM of fp64 integers that
  rides on the loss's (sum, count) all-reduce where that is the call's first collective (one forward
  synchronisation), and is all-reduced alone on the same group otherwise.

The fingerprint parts (`PARTS`): the mesh (axis names, sizes, rank layout), the plan arguments (plan, overrides,
memory_limit, cluster, inputs), the parameters and buffers (names, shapes, dtypes), the example inputs (structure,
shapes, dtypes) and the captured graph (`Captured.fingerprint`, then every node's op, shape and dtype).

One process simulating every rank (LocalTensorMode, or the fake backend) shares everything but the example values
by construction; under LocalTensorMode each simulated rank's values are compared the same way.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import pickle
from collections import OrderedDict
from dataclasses import dataclass
from typing import Callable

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh
from torch.utils import _pytree as pytree

from autopar.plan import Plan

PARTS = ("mesh", "plan arguments", "parameters", "example input shapes", "captured graph")
VALUES, UNBATCHED = "example input values", "unbatched example input values"


class RankMismatchError(ValueError):
    """The ranks called `parallelize` with different models, inputs or options."""


def _local_tensor_off():
    from torch.distributed._local_tensor import maybe_disable_local_tensor_mode
    return maybe_disable_local_tensor_mode()


def _one_process() -> bool:
    from torch.distributed._local_tensor import local_tensor_mode
    return (not dist.is_initialized() or dist.get_world_size() == 1 or local_tensor_mode() is not None
            or dist.get_backend() == "fake")


def one_process() -> bool:
    """One process plays every rank (LocalTensorMode, the fake backend) or there is one rank: no agreement to run."""
    return _one_process()


def _device(mesh: DeviceMesh) -> str:
    return "cuda" if mesh.device_type == "cuda" else "cpu"


# ----------------------------------------------------------------------------- the fingerprint

@dataclass(frozen=True)
class Fingerprint:
    """What one rank called `parallelize` with, as readable items per part (the digests compare them)."""

    parts: dict[str, tuple[str, ...]]  # PARTS, VALUES and UNBATCHED -> items

    def row(self) -> list[int]:
        return [_digest(self.parts[p]) for p in (*PARTS, VALUES, UNBATCHED)]


def _digest(items) -> int:
    return int.from_bytes(hashlib.sha256("\n".join(items).encode()).digest()[:8], "little") >> 1


def _stable(x) -> str:
    """A description that is equal on every rank for equal arguments (no object addresses)."""
    if isinstance(x, Plan):
        return f"Plan {x.name!r} (sha {hashlib.sha256(x.to_json().encode()).hexdigest()[:12]})"
    if dataclasses.is_dataclass(x) and not isinstance(x, type):
        x = dataclasses.asdict(x)
    return json.dumps(x, sort_keys=True, default=lambda o: os.fspath(o) if isinstance(o, os.PathLike)
                      else getattr(o, "__dict__", type(o).__name__))


def _leaf(a) -> str:
    """A non-tensor input: its value if plain (no object addresses), else its type."""
    if a is None or isinstance(a, (bool, int, float, str)):
        return f"{type(a).__name__} {a!r:.60}"
    return type(a).__name__


def _values(t, rank: int | None) -> str:
    local = getattr(t, "_local_tensors", None)
    if local is not None:  # LocalTensor: this simulated rank's value
        t = local[rank if rank is not None else min(local)]
    t = t.detach()
    if t.device.type == "meta":
        return "meta"
    data = t.cpu().contiguous().reshape(-1).view(torch.uint8)
    return hashlib.sha256(data.numpy().tobytes()).hexdigest()[:16]


def fingerprints(model, mesh: DeviceMesh, args: tuple, kwargs: dict, captured, arguments: dict, batched: list[int],
                 ranks: list[int | None]) -> list[Fingerprint]:
    """The fingerprint of each of `ranks` (simulated ranks under LocalTensorMode, whose example values differ; None:
    this process's rank). `batched`: per flattened input, whether it is batched (`inputs.batch_dims`)."""
    names = tuple(mesh.mesh_dim_names or ())
    parts = {"mesh": (f"{mesh.device_type} mesh {tuple(mesh.shape)} axes {names}", f"ranks {mesh.mesh.tolist()}"),
             "plan arguments": tuple(f"{k}={_stable(v)}" for k, v in arguments.items())}
    parts["parameters"] = tuple(
        [f"{n}: {tuple(p.shape)} {p.dtype}{'' if p.requires_grad else ' frozen'}"
         for n, p in model.named_parameters(remove_duplicate=False)]
        + [f"buffer {n}: {tuple(b.shape)} {b.dtype}" for n, b in model.named_buffers(remove_duplicate=False)])
    flat = pytree.tree_flatten_with_path((args, kwargs))[0]
    shapes = [f"input {pytree.keystr(path)}: " + (f"{tuple(a.shape)} {a.dtype}" if isinstance(a, torch.Tensor)
                                                    else _leaf(a)) for path, a in flat]
    parts["example input shapes"] = tuple(shapes)
    graph = []
    for n in captured.gm.graph.nodes:
        val = n.meta.get("val")
        shape = f" {tuple(val.shape)} {val.dtype}" if isinstance(val, torch.Tensor) else ""
        graph.append(f"{n.op} {n.name} {getattr(n.target, '__name__', n.target)}{shape}")
    parts["captured graph"] = (*graph, f"fingerprint {captured.fingerprint()}")
    out = []
    for rank in ranks:
        values = [s + (f" sha {_values(a, rank)}" if isinstance(a, torch.Tensor) else "")
                  for s, (_, a) in zip(shapes, flat)]
        out.append(Fingerprint({**parts, VALUES: tuple(values),
                                UNBATCHED: tuple(v for v, b in zip(values, batched) if not b)}))
    return out


# ----------------------------------------------------------------------------- agreeing

@dataclass
class Agreement:
    """Every rank's digests (`rows[rank]`, in `Fingerprint.row` order) and this process's fingerprints."""

    rows: list[list[int]]
    mine: list[Fingerprint]  # one per rank when one process plays every rank, else this rank's

    def differ(self, part: str, ranks: list[int] | None = None) -> bool:
        column = _COLUMNS.index(part)
        return len({self.rows[r][column] for r in (ranks if ranks is not None else range(len(self.rows)))}) > 1

    def items(self, parts: list[str]) -> list[dict[str, tuple[str, ...]]]:
        """Every rank's items of `parts`. A collective: every rank calls it, on a mismatch every rank has seen."""
        if len(self.mine) == len(self.rows):
            return [{p: fp.parts[p] for p in parts} for fp in self.mine]
        with _local_tensor_off():
            out: list = [None] * len(self.rows)
            dist.all_gather_object(out, {p: self.mine[0].parts[p] for p in parts})
        return out


_COLUMNS = (*PARTS, VALUES, UNBATCHED)


def agree_on(step: Callable, describe: Callable, mesh: DeviceMesh):
    """Run `step()` here, then agree with every rank: returns (its result, the `Agreement`), or raises on every rank
    the error of the first rank whose step failed, or `RankMismatchError` where the fingerprints differ.
    `describe(result, ranks)` gives the `Fingerprint` of each of `ranks` (simulated ranks, or [None]: this rank)."""
    error = result = None
    try:
        result = step()
        if _one_process():
            from torch.distributed._local_tensor import local_tensor_mode
            world = dist.get_world_size() if dist.is_initialized() else 1
            mine = describe(result, list(range(world))) if local_tensor_mode() is not None else \
                describe(result, [None]) * world
        else:
            mine = describe(result, [None])
    except Exception as e:  # noqa: BLE001 - every rank raises it below
        if _one_process():
            raise
        error, mine = e, []
    if _one_process():
        return result, Agreement([fp.row() for fp in mine], mine)
    with _local_tensor_off():
        row = torch.tensor([1] + [0] * len(_COLUMNS) if error else [0, *mine[0].row()], dtype=torch.int64,
                           device=_device(mesh))
        rows = [torch.empty_like(row) for _ in range(dist.get_world_size())]
        dist.all_gather(rows, row)
        rows = [r.tolist() for r in rows]
    failed = [r for r, row in enumerate(rows) if row[0]]
    if failed:
        _raise_everywhere(error, failed, len(rows), "while capturing the model")
    agreement = Agreement([row[1:] for row in rows], mine)
    differ = [p for p in PARTS if agreement.differ(p)]
    if differ:
        raise mismatch_error(agreement, differ)
    return result, agreement


def agree_on_success(step: Callable, mesh: DeviceMesh, doing: str):
    """Run `step()` here, then one all-gather of a failed flag (one int64 per rank): returns its result where every
    rank succeeded, else raises on every rank the error of the first rank that failed (`doing` says when, in the
    note naming the failed ranks). A rank that fails waits for no one: it reaches the all-gather at once."""
    if _one_process():
        return step()
    error = result = None
    try:
        result = step()
    except Exception as e:  # noqa: BLE001 - every rank raises it below
        error = e
    with _local_tensor_off():
        flag = torch.tensor([int(error is not None)], dtype=torch.int64, device=_device(mesh))
        flags = [torch.empty_like(flag) for _ in range(dist.get_world_size())]
        dist.all_gather(flags, flag)
    failed = [r for r, f in enumerate(flags) if int(f.item())]
    if failed:
        _raise_everywhere(error, failed, len(flags), doing)
    return result


def _raise_everywhere(error: BaseException | None, failed: list[int], world: int, doing: str):
    """Every rank raises the first failing rank's error: the same type and message (its traceback stays there)."""
    first = failed[0]
    with _local_tensor_off():
        box: list = [None] * world
        dist.all_gather_object(box, _portable(error) if error is not None else None)
    err = box[first]
    original = error is not None and type(err) is type(error) and str(err) == str(error)
    note = (f"autopar: rank{'s' if len(failed) > 1 else ''} {_ranks(failed)} of {world} raised this {doing}"
            + (f"; rank {first}'s error is raised on every rank, so none waits for the others" if world > 1 else ""))
    if original and dist.get_rank() == first:
        error.add_note(note)
        raise error
    err.add_note(note)
    raise err from error


def _portable(e: BaseException) -> BaseException:
    """`e` if it survives pickling with its type and message, else a RuntimeError saying what it was."""
    try:
        copy = pickle.loads(pickle.dumps(e))
        if type(copy) is type(e) and str(copy) == str(e):
            return copy
    except Exception:  # noqa: BLE001 - replaced below
        pass
    return RuntimeError(f"{type(e).__name__}: {e}")


def _ranks(ranks: list[int]) -> str:
    return str(ranks) if len(ranks) <= 8 else f"[{', '.join(map(str, ranks[:8]))}, ... ({len(ranks)} ranks)]"


def _groups(agreement: Agreement, part: str, ranks: list[int]) -> list[list[int]]:
    column = _COLUMNS.index(part)
    by: dict[int, list[int]] = {}
    for r in ranks:
        by.setdefault(agreement.rows[r][column], []).append(r)
    return list(by.values())


def _first_difference(a: tuple[str, ...], b: tuple[str, ...]) -> tuple[str, str]:
    for x, y in zip(a, b):
        if x != y:
            return repr(x), repr(y)
    n = min(len(a), len(b))
    more = lambda items: repr(items[n]) if len(items) > n else f"nothing more ({len(items)} items)"  # noqa: E731
    return more(a), more(b)


def _mismatch(agreement: Agreement, parts: list[str], ranks: list[int]) -> str:
    """Which ranks differ from which, in which part, and the first item that differs (the same text on every rank)."""
    items = agreement.items(parts)
    lines = []
    for part in parts:
        groups = _groups(agreement, part, ranks)
        for g in groups[1:4]:
            a, b = _first_difference(items[groups[0][0]][part], items[g[0]][part])
            lines.append(f"  {part}: ranks {_ranks(groups[0])} have {a}, ranks {_ranks(g)} have {b}")
        if len(groups) > 4:
            lines.append(f"  {part}: ... and {len(groups) - 4} more groups of ranks")
    return "\n".join(lines)


def mismatch_error(agreement: Agreement, parts: list[str]) -> RankMismatchError:
    lines = _mismatch(agreement, parts, list(range(len(agreement.rows))))
    return RankMismatchError(
        "autopar.parallelize: the ranks passed different arguments, so they would run different programs (and "
        f"hang, or train on wrong numbers):\n{lines}\nFix: call parallelize on every rank with the same model (same "
        "config and layers), mesh, options and example input shapes; build the model from the same code and config "
        "on every rank.")


def check_input_values(agreement: Agreement, groups: list[list[int]] | None = None) -> None:
    """inputs="global" (`groups` None): every rank passed the same example values. inputs="local": every list of
    `groups` (the ranks of one data-parallel rank) passed the same values, and the unbatched inputs agree everywhere."""
    world = list(range(len(agreement.rows)))
    if groups is None:
        if agreement.differ(VALUES):
            raise RankMismatchError(
                "autopar.parallelize(inputs='global'): the ranks passed different example inputs, but with "
                "inputs='global' (the default) every rank passes the same whole batch and autopar splits it:\n"
                + _mismatch(agreement, [VALUES], world) + "\nFix: if each rank loads its own batch (e.g. with a "
                "DistributedSampler, as for DDP), pass inputs='local'; otherwise give every rank the same inputs "
                "(same data, same seed).")
        return
    bad = [g for g in groups if agreement.differ(VALUES, g)]
    if bad:
        raise RankMismatchError(
            "autopar.parallelize(inputs='local'): ranks that hold the same data-parallel shard (they differ only on "
            "the tensor/sequence/expert axes) passed different example inputs:\n"
            + "\n".join(_mismatch(agreement, [VALUES], g) for g in bad)
            + "\nFix: the ranks of one data-parallel group must pass the same batch; shard the data over the data "
            "axes only (e.g. DistributedSampler(num_replicas=<data-parallel size>, rank=<data-parallel rank>)).")
    if agreement.differ(UNBATCHED):
        raise RankMismatchError(
            "autopar.parallelize(inputs='local'): inputs without the batch dimension (dim 0 differs from the first "
            "input's) are used whole on every rank, but the ranks passed different values:\n"
            + _mismatch(agreement, [UNBATCHED], world)
            + "\nFix: pass the same unbatched inputs on every rank, or give them the batch dimension.")


# ----------------------------------------------------------------------------- planning and seeding

def solve_on_rank0(make_plan) -> Plan:
    """Rank 0 plans; the plan is broadcast so every rank runs exactly the same one. If planning fails, rank 0's
    error is broadcast instead and raised on every rank."""
    with _local_tensor_off():
        if _one_process():
            return make_plan()
        box, error = [None], None
        if dist.get_rank() == 0:
            try:
                box = [("plan", make_plan().to_json())]
            except Exception as e:  # noqa: BLE001 - raised on every rank below
                error, box = e, [("error", _portable(e))]
        dist.broadcast_object_list(box, src=0)
    kind, value = box[0]
    if kind == "plan":
        return Plan.from_json(value)
    note = "autopar: rank 0 raised this while planning (only rank 0 plans); it is raised on every rank"
    if error is not None and type(value) is type(error) and str(value) == str(error):
        error.add_note(note)
        raise error
    value.add_note(note)
    raise value


def agree_on_call(key: tuple, mesh: DeviceMesh, error: str | None = None, *, wait: bool = True,
                  values: dict[str, torch.Tensor] | None = None):
    """At every call, one small all-reduce: the ranks pass inputs of the same shapes, dtypes and non-tensor values,
    and none holds an out-of-range id or label (`error`: one device's IndexError message for this rank's inputs, from
    `autopar.index_checks`). Ranks passing different shapes (a DistributedSampler's short last batch) would lower
    different programs and wait in mismatched collectives, and a bad id raised on its rank alone would leave the
    others waiting: both raise on every rank instead.

    `values` (inputs="global": every rank must pass the same whole batch): the tensor inputs by name; their digests
    (`input_digests`) ride in the same all-reduce, and ranks that passed different values raise `RankMismatchError`
    on every rank, naming the first input that differs and which ranks passed which. inputs="local" passes none
    (each data-parallel rank passes its own shard): 24 bytes.

    `wait=False` (a call whose program is already lowered, with no error of its own): the all-reduce is issued and
    a function returned that waits for it and raises as above; the caller runs it before this call's next
    collective (`autopar.runtime.collectives.before_next_collective`), so the agreement's latency overlaps the
    program's work up to its first collective. Returns None once settled."""
    if _one_process():
        if error is not None:
            raise IndexError(error)
        return None
    digest = _key_digest(key)
    rank = dist.get_rank()
    device = _device(mesh)
    names = list(values or {})
    same_batch = values is not None  # inputs="global"
    head = [digest, -digest, rank + 1 if error is not None else 0]
    if names:
        data = input_digests(list(values.values())).to(device)
        mine_t = torch.cat([torch.tensor(head, dtype=torch.int64, device=device), data, -data])
        got = mine_t.clone()
    else:  # inputs="local": the header alone, built once from Python ints (no cat, clone or read-back of `mine`)
        data = ()
        got = torch.tensor(head, dtype=torch.int64, device=device)
    work = dist.all_reduce(got, op=dist.ReduceOp.MAX, async_op=True)

    def settle() -> None:
        work.wait()
        g = got.tolist()
        m = mine_t.tolist() if names else head
        if g[0] != digest or -g[1] != digest:
            raise _shapes_differ(rank, key, same_batch)
        n = len(data)
        if n and (g[3:3 + n] != m[3:3 + n] or [-x for x in g[3 + n:]] != m[3:3 + n]):
            raise _values_differ(names, data)
        if g[2]:
            if same_batch and error is not None:  # the same batch on every rank: every rank's error is one device's
                raise IndexError(error)
            e = IndexError(f"rank {g[2] - 1}'s batch has a token id or label out of range (one device raises "
                           "IndexError there); every rank stops at this call")
            if error is not None:
                e.add_note(f"rank {rank}: {error}")  # one device's words, on the rank whose batch holds it
            raise e

    if wait or error is not None:
        settle()
        return None
    return settle


# ----------------------------------------------------------------------------- the call's agreement, summed

# The row each rank contributes to a summed agreement (fp64, every entry an integer, every sum exact below 2^53):
# [loss sum, valid count, index errors, sum of (rank + 1) of those, forward failures, sum of (rank + 1) of those,
# *the guard key's digest]. The loss's two entries are zero where the agreement does not ride on the loss.
_SUM, _COUNT, _INDEX, _INDEX_RANKS, _FAILED, _FAILED_RANKS, _WORDS = range(7)
_DIGEST_BITS = 62


def _bits_per_word(world: int) -> int:
    """Digest bits per fp64 entry: bit b of the digest is digit b of the entry in base world + 1, so the sum over
    the ranks of each digit (at most `world`) never carries into the next, and the whole sum stays below 2^53."""
    n = 0
    while (world + 1) ** (n + 1) <= 2**53:
        n += 1
    return n


def _digest_words(digest: int, world: int) -> list[float]:
    n, base = _bits_per_word(world), world + 1
    words = []
    for start in range(0, _DIGEST_BITS, n):
        bits = range(start, min(start + n, _DIGEST_BITS))
        words.append(float(sum(((digest >> b) & 1) * base ** (b - start) for b in bits)))
    return words


class SummedAgreement:
    """The per-call agreement of `agree_on_call` carried by a SUM all-reduce of fp64 integers (`_WORDS` layout above)
    on the mesh's one axis, so that it can ride on the loss's (sum, count) all-reduce
    (`autopar.runtime.ops.cross_entropy_sum_count`) where that is the call's first collective: one forward
    synchronisation of the ranks, as DDP's forward has none of its own. Exact: every rank contributes, per digest
    word, digits 0 or 1 (`_digest_words`), so the ranks passed the same shapes iff every summed word is `world` times
    this rank's; the flags are counts. Where it does not ride (no such loss, an error found before the program runs,
    a collective first) the same row is all-reduced alone, on the same group, so every rank's first collective of
    the call is this all-reduce, whichever path its program takes."""

    def __init__(self, key: tuple, mesh: DeviceMesh, error: str | None):
        self.key, self.error = key, error
        self.group = mesh.get_group(0)
        self.world, self.rank = dist.get_world_size(self.group), dist.get_rank()
        self._device = _device(mesh)
        at = (key, self.world, self.rank, error is not None, self._device)
        cached = _ROWS.get(at)
        if cached is None:
            words = _digest_words(_key_digest(key), self.world)
            flags = [1.0, self.rank + 1.0] if error is not None else [0.0, 0.0]
            row = [0.0, 0.0, *flags, 0.0, 0.0, *words]
            cached = _ROWS[at] = (row, torch.tensor(row[_INDEX:], dtype=torch.float64, device=self._device))
            while len(_ROWS) > 64:
                _ROWS.popitem(last=False)
        self.row, self._payload = cached

    def payload(self) -> torch.Tensor:
        """The row after the loss's two entries, to append to this rank's (sum, count) (fp64; kept per key and
        never written: the loss path concatenates it)."""
        return self._payload

    def alone(self, failed: bool = False):
        """The row all-reduced by itself (the loss's entries zero); returns the function that waits and checks.
        `failed`: this rank's program raised before its first collective: the other ranks are told (they raise
        too, never summing a loss this rank did not add)."""
        row = self.row if not failed else [*self.row[:_FAILED], 1.0, self.rank + 1.0, *self.row[_WORDS:]]
        got = torch.tensor(row, dtype=torch.float64, device=self._device)
        work = dist.all_reduce(got, op=dist.ReduceOp.SUM, group=self.group, async_op=True)

        def settle() -> None:
            work.wait()
            if not failed:
                self.check(got.tolist())
        return settle

    def check(self, got: list[float]) -> None:
        """Raise, on every rank alike, if the summed row says the ranks differ or one failed."""
        mine, w = self.row, self.world
        if any(g != w * m for g, m in zip(got[_WORDS:], mine[_WORDS:])):
            raise _shapes_differ(self.rank, self.key, same_batch=False)
        if got[_FAILED]:
            ranks = int(got[_FAILED_RANKS]) - 1
            who = f"rank {ranks}" if got[_FAILED] == 1 else f"{int(got[_FAILED])} ranks"
            raise RuntimeError(f"{who} raised an error in this call's forward (its traceback is there), before the "
                               "call's first collective; every rank stops at this call rather than reduce without it")
        if got[_INDEX]:
            first = int(got[_INDEX_RANKS]) - 1
            who = (f"rank {first}'s batch has" if got[_INDEX] == 1 else f"{int(got[_INDEX])} ranks' batches have")
            e = IndexError(f"{who} a token id or label out of range (one device raises IndexError there); every "
                           "rank stops at this call")
            if self.error is not None:
                e.add_note(f"rank {self.rank}: {self.error}")
            raise e


# (guard key, world, rank, error, device) -> the row and its payload tensor, a few kept
_ROWS: "OrderedDict[tuple, tuple[list[float], torch.Tensor]]" = OrderedDict()


def _shapes_differ(rank: int, key: tuple, same_batch: bool) -> RankMismatchError:
    must = ("with inputs='global' (the default) every rank must pass the same inputs" if same_batch else
            "with inputs='local' every rank must pass a shard of the same shapes, dtypes and non-tensor values")
    return RankMismatchError(
        f"rank {rank}: {must}" +
        f" at each call, but the ranks differ at this call (this rank: {key[1]}). "
        + ("A DistributedSampler's last batch is shorter when the dataset does not divide. Fix: drop_last=True "
           "on the sampler or DataLoader, or pad the last batch." if not same_batch else
           "Fix: give every rank the same whole batch, or, if each rank loads its own batch (e.g. with a "
           "DistributedSampler, as for DDP), pass inputs='local' to parallelize."))


_KEY_DIGESTS: "OrderedDict[tuple, int]" = OrderedDict()  # guard key -> `_digest([repr(key)])`, a few kept


def _key_digest(key: tuple) -> int:
    """`_digest([repr(key)])`, computed once per guard key (a step's key repeats at every call; its repr and sha256
    are the same each time)."""
    d = _KEY_DIGESTS.get(key)
    if d is None:
        d = _KEY_DIGESTS[key] = _digest([repr(key)])
        while len(_KEY_DIGESTS) > 64:
            _KEY_DIGESTS.popitem(last=False)
    return d


_WEIGHTS: "OrderedDict[tuple, torch.Tensor]" = OrderedDict()  # (numel, device) -> per-position weights, a few kept
_BITS = {8: torch.int64, 4: torch.int32, 2: torch.int16, 1: torch.uint8}


def _weights(numel: int, device: torch.device) -> torch.Tensor:
    key = (numel, str(device))
    w = _WEIGHTS.get(key)
    if w is None:
        g = torch.Generator().manual_seed(0x5EED)  # the same weights on every rank
        w = (torch.randint(-2**62, 2**62, (numel,), generator=g, dtype=torch.int64) | 1).to(device)
        _WEIGHTS[key] = w
        while len(_WEIGHTS) > 16:
            _WEIGHTS.popitem(last=False)
    _WEIGHTS.move_to_end(key)
    return w


def input_digests(tensors: list[torch.Tensor]) -> torch.Tensor:
    """Two int64s per tensor, computed on its device without a host sync: the sum of its elements' bit patterns,
    and their sum weighted by a fixed pseudo-random odd int64 per position, both modulo 2^64 (exact, so equal
    tensors give equal digests whatever the reduction order), masked to 62 bits. Any dtype (token ids, floats,
    bool); the weighted sum tells apart batches whose rows or values are permuted, which the plain sum does not."""
    parts = []
    for t in tensors:
        flat = t.detach().reshape(-1)
        if flat.is_complex():
            flat = torch.view_as_real(flat).reshape(-1)
        bits = (flat.to(torch.uint8) if flat.dtype == torch.bool else flat.view(_BITS[flat.element_size()]))
        bits = bits.to(torch.int64)
        parts += [bits.sum(), (bits * _weights(bits.numel(), bits.device)).sum()]
    if not parts:
        return torch.zeros(0, dtype=torch.int64)
    return torch.stack(parts) & (2**62 - 1)


def _values_differ(names: list[str], data: torch.Tensor) -> RankMismatchError:
    """The ranks' digests, gathered (every rank saw the mismatch in the all-reduce, so every rank is here): which
    input differs first, and which ranks passed which value of it."""
    with _local_tensor_off():
        rows = [torch.empty_like(data) for _ in range(dist.get_world_size())]
        dist.all_gather(rows, data)
    rows = [r.tolist() for r in rows]
    first = next(i for i in range(len(names)) if len({tuple(r[2 * i:2 * i + 2]) for r in rows}) > 1)
    by: dict[tuple, list[int]] = {}
    for r, row in enumerate(rows):
        by.setdefault(tuple(row[2 * first:2 * first + 2]), []).append(r)
    groups = list(by.values())
    told = "; ".join(f"ranks {_ranks(g)} passed {'one value' if i == 0 else 'another'}"
                     for i, g in enumerate(groups[:4])) + ("; ..." if len(groups) > 4 else "")
    return RankMismatchError(
        "with inputs='global' (the default) every rank passes the same whole batch at every call and "
        f"autopar splits it, but at this call the ranks passed different values of input {names[first]!r}: {told}. "
        "Each rank would compute on its share of a different batch, a mixture no single batch gives. Fix: if each "
        "rank loads its own batch (e.g. with a DistributedSampler, as for DDP), pass inputs='local' to parallelize; "
        "otherwise give every rank the same batch (same data order and seed). To skip this check where the ranks are "
        "known to agree: pm.check_inputs = False.")


def agreed_seed(mesh: DeviceMesh) -> int:
    """A dropout seed that every rank agrees on (rank 0's draw, broadcast)."""
    with _local_tensor_off():
        seed = torch.randint(0, 2**31 - 1, (1,))
    if not _one_process():
        seed = seed.to(_device(mesh))
        dist.broadcast(seed, src=0)
    return int(seed.item())
