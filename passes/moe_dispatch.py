"""The experts' dispatch inside a user's own MoE block, captured as `autopar::moe_experts`; everything else in
the block — router, top-k, routing weights, auxiliary losses — is kept as the user wrote it.

A ModuleList or GroupedExperts block (`passes/moe.py` finds it on the module tree) runs its experts in
Python on the tokens routed to them: `for e: tok = where(idx == e); out[tok] += w * expert_e(x[tok])`, or
tokens sorted by expert and one grouped call. That part is data-dependent (it cannot be traced) and it is
the only part expert parallelism changes. It is cut out of the block's forward in three steps:

1. **Record** (`record`): the block runs once eagerly on its example input under a `TorchFunctionMode` that
   logs every torch call as an `Entry` (tensor inputs and results as numbered *values*; a tensor written in
   place gets a new value); each call of an expert (a ModuleList expert's forward, the GroupedExperts
   forward) is one entry, its inside not logged.
2. **Split** (`find_split`): tensors the block computed — tokens `x` (T, H), chosen experts `idx` (T, k)
   (one tensor, or k columns of (T,)) and their weights (T, k) (one tensor, k columns, gathered from a
   (T, E) score, or none) — and a value `out` computed after the last expert call with
   `out == moe_experts(x, idx, weights)`. Each token's weights are solved by least squares on what the
   experts give for it, then looked up among the block's tensors. The *kept* entries are those the block's
   outputs and x, idx, weights need, reading `out` as a leaf; every other entry is the *dispatch*.
3. **Replay** (`replay_forward`): the block's own forward runs under a mode that runs each kept entry,
   answers each dispatch entry with what it returned in the recording (so the loop's Python control flow
   goes as recorded, no data-dependent op reaches the trace and the experts do not run), and hands kept
   entries that read `out` the value `moe_experts(x, idx, weights)` instead.

The caller verifies a split before using it (`passes.moe`): the replayed block must reproduce the block's
outputs and the gradients of its input and parameters on the example input and on a perturbed copy whose
routing differs (a kept call that depended on a value the dispatch computed from the data would get the
example's value on the copy). A dispatch that writes into a tensor it did not create, or experts whose
outputs are used for anything but `out`, give no split.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass, field
from typing import Callable

import torch
from torch import nn
from torch.overrides import TorchFunctionMode
from torch.utils import _pytree as pytree

GROUPED_CALL = -1  # Entry.expert of the one call of a GroupedExperts module
TENSOR = object()  # a tensor's place among a recorded result's leaves
_SOLVE_TOKENS, _SOLVE_FEATURES = 256, 256  # the weights are solved on at most these tokens and output features
_MAX_VERIFIED = 6  # splits verified (each runs the block forward and backward twice) before giving up


class Diverged(RuntimeError):
    """The replayed block made a different sequence of torch calls than the recorded one."""


_TENSOR_PROPERTIES = {"T", "mT", "H", "mH", "data", "grad", "real", "imag"}


def _metadata(func) -> bool:
    """A property that is not a tensor (x.shape, x.device, x.requires_grad): no entry; read as is in every run
    (fake tensors answer `device` without a torch-function call, so it cannot be counted in the stream)."""
    return type(func).__name__ == "method-wrapper" and \
        getattr(getattr(func, "__self__", None), "__name__", None) not in _TENSOR_PROPERTIES


def _fname(func) -> str:
    if type(func).__name__ == "method-wrapper":  # a property getter (x.T): name the property
        return f"get {getattr(getattr(func, '__self__', None), '__name__', repr(func))}"
    mod, name = getattr(func, "__module__", None), getattr(func, "__qualname__", None) or getattr(func, "__name__", None)
    return f"{mod}.{name}" if name else repr(func)


def _shaped(t: torch.Tensor, shape: tuple[int, ...]) -> torch.Tensor:
    return t if tuple(t.shape) == shape else t.reshape(shape)


def _tensors(tree) -> list[torch.Tensor]:
    return [t for t in pytree.tree_leaves(tree) if isinstance(t, torch.Tensor)]


# ----------------------------------------------------------------------------- 1. record

@dataclass
class Entry:
    name: str  # the torch function, "expert <e>" or "experts" (the grouped call)
    ins: list[int]  # values of its tensor arguments, in flattened order
    outs: list[int]  # values of its tensor results, flattened (an argument returned as is keeps its value)
    out_objs: list[int]  # the recorded tensor object of each result (identity: in-place results are their input)
    spec: pytree.TreeSpec  # its result, flattened
    leaves: list  # the result's leaves, tensors as TENSOR
    writes: list[tuple[int, int]] = field(default_factory=list)  # (old value, new value) of tensors written in place
    expert: int | None = None  # the expert called (GROUPED_CALL: all of them, grouped)


@dataclass
class Recording:
    entries: list[Entry] = field(default_factory=list)
    snapshot: list[torch.Tensor] = field(default_factory=list)  # value -> its tensor when it was made
    producer: list[int | None] = field(default_factory=list)  # value -> entry index (None: from outside)
    deps: list[list[int]] = field(default_factory=list)  # value -> values it was computed from
    obj: list[int] = field(default_factory=list)  # value -> recorded object
    inputs: list[int] = field(default_factory=list)  # the block's tensor arguments, flattened
    outputs: list[int] = field(default_factory=list)  # the block's tensor results, flattened

    def final(self) -> dict[int, int]:
        """Recorded object -> its last value."""
        last: dict[int, int] = {}
        for v, o in enumerate(self.obj):
            last[o] = v
        return last


class _Recorder(TorchFunctionMode):
    def __init__(self):
        super().__init__()
        self.rec = Recording()
        self.objects: dict[int, torch.Tensor] = {}  # recorded object -> the tensor (kept alive: ids stay unique)
        self.current: dict[int, int] = {}  # recorded object -> its current value
        self.version: dict[int, int] = {}
        self.busy = False  # inside an expert: its calls are not entries

    def value_of(self, t: torch.Tensor) -> int:
        o = id(t)
        if o in self.objects:
            return self.current[o]
        return self._new(t, None, [])

    def _new(self, t: torch.Tensor, producer: int | None, deps: list[int]) -> int:
        o = id(t)
        self.objects[o], self.version[o] = t, t._version
        v = len(self.rec.snapshot)
        self.rec.snapshot.append(t.detach().clone())
        self.rec.producer.append(producer)
        self.rec.deps.append(deps)
        self.rec.obj.append(o)
        self.current[o] = v
        return v

    def _log(self, name: str, args, out, expert: int | None):
        n = len(self.rec.entries)
        ins = [self.value_of(t) for t in _tensors(args)]
        writes = []
        for o, t in list(self.objects.items()):
            if t._version != self.version[o]:  # written in place (directly or through a view)
                old = self.current[o]
                writes.append((old, self._new(t, n, ins + [old])))
        leaves, spec = pytree.tree_flatten(out)
        outs, objs = [], []
        for i, t in enumerate(leaves):
            if isinstance(t, torch.Tensor):
                outs.append(self.current[id(t)] if id(t) in self.objects else self._new(t, n, ins))
                objs.append(id(t))
                leaves[i] = TENSOR
        self.rec.entries.append(Entry(name, ins, outs, objs, spec, leaves, writes, expert))

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if not self.busy and not _metadata(func):
            self.busy = True
            try:
                self._log(_fname(func), (args, kwargs), out, None)
            finally:
                self.busy = False
        return out

    def expert_call(self, e: int, fn, args, kwargs):
        if self.busy:
            return fn(*args, **kwargs)
        self.busy = True  # the expert's calls, and reading tensor attributes here, are not entries
        try:
            for t in _tensors((args, kwargs)):
                self.value_of(t)  # made before the call
            out = fn(*args, **kwargs)
            self._log("experts" if e == GROUPED_CALL else f"expert {e}", (args, kwargs), out, e)
        finally:
            self.busy = False
        return out


class _intercept_experts:
    """While active, each expert's forward (or the grouped experts' forward) goes through `mode.expert_call`."""

    def __init__(self, experts: list[nn.Module], grouped: bool, mode):
        self.mods = [(GROUPED_CALL if grouped else e, m) for e, m in enumerate(experts)]
        self.mode = mode

    def __enter__(self):
        self.saved = [m.__dict__.get("forward") for _, m in self.mods]  # an instance forward of its own, if any
        for e, m in self.mods:
            fn = m.forward
            m.forward = lambda *a, _e=e, _fn=fn, **k: self.mode.expert_call(_e, _fn, a, k)

    def __exit__(self, *exc):
        for (_, m), saved in zip(self.mods, self.saved):
            if saved is None:
                del m.forward
            else:
                m.forward = saved


def record(forward: Callable, args: tuple, experts: list[nn.Module], grouped: bool) -> Recording:
    """Run `forward(*args)` once eagerly (no grad), logging its torch calls and its experts' calls."""
    mode = _Recorder()
    mode.rec.inputs = [mode.value_of(t) for t in _tensors(args)]
    with torch.no_grad(), _intercept_experts(experts, grouped, mode), mode:
        out = forward(*args)
    mode.rec.outputs = [mode.value_of(t) for t in _tensors(out)]
    return mode.rec


# ----------------------------------------------------------------------------- 2. split

@dataclass(frozen=True)
class Source:
    """How a (T, k) tensor of the experts call is made from the block's values."""

    kind: str  # "value" (one tensor), "columns" (k tensors of T), "gather" (a (T, E) tensor at idx), "ones"
    values: tuple[int, ...] = ()

    def build(self, live: Callable[[int], torch.Tensor], T: int, k: int, idx: torch.Tensor | None = None,
              like: torch.Tensor | None = None) -> torch.Tensor:
        if self.kind == "value":
            return _shaped(live(self.values[0]), (T, k))
        if self.kind == "columns":
            return torch.stack([_shaped(live(v), (T,)) for v in self.values], dim=1)
        if self.kind == "gather":
            scores = live(self.values[0])
            return _shaped(scores, (T, scores.shape[-1])).gather(1, idx)
        return torch.ones(T, k, dtype=like.dtype, device=like.device)


@dataclass(frozen=True)
class Split:
    x: int  # the tokens, (T, H) once flattened
    idx: Source
    weights: Source
    out: int  # the value moe_experts(x, idx, weights) stands for
    kept: frozenset[int]  # entries run at replay (the rest are answered from the recording)
    tokens: int
    top_k: int
    hidden: int


def _ancestors(rec: Recording, values, stop: int | None = None) -> set[int]:
    seen, stack = set(), list(values)
    while stack:
        v = stack.pop()
        if v in seen or v == stop:
            continue
        seen.add(v)
        stack += rec.deps[v]
    return seen


def _descendants(rec: Recording, values) -> set[int]:
    users: dict[int, list[int]] = {}
    for v, ds in enumerate(rec.deps):
        for d in ds:
            users.setdefault(d, []).append(v)
    seen, stack = set(), list(values)
    while stack:
        v = stack.pop()
        if v not in seen:
            seen.add(v)
            stack += users.get(v, [])
    return seen


def _num_rows(t: torch.Tensor) -> int:
    return t.numel() // t.shape[-1] if t.dim() else 1


def _rows(t: torch.Tensor, h: int) -> set[bytes]:
    flat = t.detach().contiguous().reshape(-1, h)
    b = flat.view(torch.uint8).reshape(flat.shape[0], -1).numpy()
    return {r.tobytes() for r in b}


def _tol(dtype) -> tuple[float, float]:
    return {torch.float64: (1e-7, 1e-9), torch.float32: (1e-4, 1e-5)}.get(dtype, (3e-2, 3e-2))


def capacity_keep(idx: torch.Tensor, num_experts: int, capacity_factor: float | None) -> torch.Tensor:
    """(T, k) mask of the assignments experts keep: each its first ceil(cf*T*k/E) in (token, choice) order."""
    if capacity_factor is None:
        return torch.ones_like(idx, dtype=torch.bool)
    T, k = idx.shape
    cap = math.ceil(capacity_factor * T * k / num_experts)
    onehot = torch.nn.functional.one_hot(idx.reshape(-1), num_experts)
    pos = (onehot.cumsum(0) - onehot).gather(1, idx.reshape(-1, 1)).reshape(T, k)
    return pos < cap


@dataclass
class _Search:
    """The failure that got furthest, for the note."""

    stage: int = -1
    why: str = ""
    verified: int = 0

    def fail(self, stage: int, why: str) -> None:
        if stage >= self.stage:
            self.stage, self.why = stage, why


def find_split(rec: Recording, *, num_experts: int, all_experts: Callable[[torch.Tensor], torch.Tensor],
               capacity_factor: float | None, verify: Callable[[Split], str | None]) -> tuple[Split | None, str]:
    """The first split whose replay `verify` accepts, or None and why none was found.

    `all_experts(x)` (T, H) -> (E, T, H_out): every expert on every token (for solving the weights).
    """
    E = num_experts
    calls = [i for i, e in enumerate(rec.entries) if e.expert is not None]
    if not calls:
        return None, "its experts are never called in its forward"
    first, last = calls[0], calls[-1]
    if any(not rec.entries[i].ins or not rec.entries[i].outs for i in calls):
        return None, "an expert is called without a tensor argument or result"
    h = rec.snapshot[rec.entries[first].ins[0]].shape[-1]
    h_out = rec.snapshot[rec.entries[first].outs[0]].shape[-1]
    rows_in = [rec.snapshot[rec.entries[i].ins[0]] for i in calls]
    counts = _received(rec, calls, E)
    search = _Search()
    final = rec.final()
    expert_outs = _descendants(rec, [v for i in calls for v in rec.entries[i].outs])
    feeding = _ancestors(rec, [v for i in calls for v in rec.entries[i].ins])
    for x, T in _token_candidates(rec, feeding, first, h, rows_in):
        if len(calls) == E and all(_num_rows(r) == T for r in rows_in):
            search.fail(0, f"every expert runs on all {T} tokens: nothing is routed to it")
            continue
        S, F_ = min(T, _SOLVE_TOKENS), min(h_out, _SOLVE_FEATURES)  # the weights are solved on a sample
        with torch.no_grad():
            fx = all_experts(rec.snapshot[x].reshape(T, h)[:S])[..., :F_].to(torch.float64)  # (E, S, F_)
        outs = [v for v in range(len(rec.snapshot)) if v in expert_outs and rec.producer[v] is not None
                and rec.producer[v] > last and rec.snapshot[v].is_floating_point()
                and rec.snapshot[v].numel() == T * h_out][:8]
        if not outs:
            search.fail(1, f"no value after its last expert call has the {T} x {h_out} elements of the experts' "
                           "combined output")
            continue
        idxs = _index_candidates(rec, final, T, E, counts, capacity_factor, last)
        if not idxs:
            search.fail(2, f"no integer tensor it computes (T x k, or k of T) holds experts whose token counts are "
                           f"those its experts received ({counts if counts is not None else 'unknown'})")
            continue
        for (isrc, idx), out in itertools.product(idxs, outs):
            target = rec.snapshot[out].reshape(T, h_out)[:S, :F_].to(torch.float64)
            A = fx[idx[:S], torch.arange(S)[:, None]].transpose(1, 2)  # (S, F_, k): expert idx[t, j] on token t
            w_hat = torch.linalg.lstsq(A, target.unsqueeze(-1)).solution.squeeze(-1)  # (S, k)
            rtol, atol = _tol(rec.snapshot[out].dtype)
            scale = float(target.abs().max()) or 1.0
            if not torch.allclose((A @ w_hat.unsqueeze(-1)).squeeze(-1), target, rtol=rtol, atol=atol * scale):
                search.fail(3, "its combined output is not a weighted sum of its experts on their tokens")
                continue
            keep = capacity_keep(idx, E, capacity_factor)[:S].to(torch.float64)
            wsrcs = _weight_candidates(rec, final, T, S, E, idx, w_hat, keep, A, target, rtol, atol * scale, last)
            if not wsrcs:
                search.fail(4, "no tensor it computes holds the weights its experts' outputs are scaled by")
                continue
            for wsrc in wsrcs:
                split, why = _split(rec, x, isrc, wsrc, out, T, idx.shape[1], h, calls, final)
                if split is None:
                    search.fail(5, why)
                    continue
                if search.verified == _MAX_VERIFIED:
                    return None, search.why
                search.verified += 1
                why = verify(split)
                if why is None:
                    return split, ""
                search.fail(6, f"the block with its dispatch replaced differs: {why}")
    return None, search.why or "no tokens tensor feeds its experts"


def _received(rec: Recording, calls: list[int], E: int) -> list[int] | None:
    """Rows each expert received, where the calls say (ModuleList calls; a grouped call's (E,) counts)."""
    got = [0] * E
    for i in calls:
        e = rec.entries[i]
        if e.expert == GROUPED_CALL:
            rows = _num_rows(rec.snapshot[e.ins[0]])
            for v in e.ins[1:]:
                c = rec.snapshot[v]
                if not c.is_floating_point() and c.shape == (E,) and int(c.sum()) == rows:
                    return c.tolist()
            return None
        got[e.expert] += _num_rows(rec.snapshot[e.ins[0]])
    return got


def _token_candidates(rec: Recording, feeding: set[int], first: int, h: int, rows_in):
    """Values the experts' input rows are all taken from (fewest rows first; one per row count)."""
    wanted = set().union(*(_rows(r, h) for r in rows_in))
    found, seen_t = [], set()
    for v in sorted(feeding, key=lambda v: -(rec.producer[v] if rec.producer[v] is not None else -1)):
        s = rec.snapshot[v]
        p = rec.producer[v]
        if (p is not None and p >= first) or not s.is_floating_point() or s.dim() == 0 or s.shape[-1] != h:
            continue
        T = s.numel() // h
        if T in seen_t or not wanted <= _rows(s, h):
            continue
        seen_t.add(T)
        found.append((v, T))
    return sorted(found, key=lambda c: c[1])


def _index_candidates(rec, final, T, E, counts, capacity_factor, last) -> list[tuple[Source, torch.Tensor]]:
    mats, cols = [], []
    for v, s in enumerate(rec.snapshot):
        p = rec.producer[v]
        if p is None or p > last or final[rec.obj[v]] != v or s.is_floating_point() or s.dtype == torch.bool \
                or s.numel() == 0 or int(s.min()) < 0 or int(s.max()) >= E:
            continue
        if s.numel() == T:
            cols.append(v)
        elif s.numel() % T == 0 and s.shape[-1] == s.numel() // T <= E:
            mats.append(v)
    found = []

    def ok(idx: torch.Tensor) -> bool:
        if counts is None:
            return True
        keep = capacity_keep(idx, E, capacity_factor)
        return torch.bincount(idx[keep], minlength=E).tolist() == list(counts)

    for v in mats:
        idx = rec.snapshot[v].reshape(T, -1).long()
        if ok(idx):
            found.append((Source("value", (v,)), idx))
    for k in range(1, min(E, 4) + 1):
        for combo in itertools.combinations(cols[-8:], k):
            idx = torch.stack([rec.snapshot[v].reshape(T).long() for v in combo], 1)
            if ok(idx):
                found.append((Source("columns", combo), idx))
    return found[:6]


def _weight_candidates(rec, final, T, S, E, idx, w_hat, keep, A, target, rtol, atol, last) -> list[Source]:
    """Sources of the (T, k) weights that reproduce the combined output on the S solved tokens."""
    k = idx.shape[1]

    def reproduces(w: torch.Tensor) -> bool:
        y = (A @ (w[:S].to(torch.float64) * keep).unsqueeze(-1)).squeeze(-1)
        return bool(torch.allclose(y, target, rtol=rtol, atol=atol))

    usable = [v for v, s in enumerate(rec.snapshot)
              if rec.producer[v] is not None and rec.producer[v] <= last and final[rec.obj[v]] == v
              and s.is_floating_point() and s.numel() in (T, T * k, T * E)]
    found = []
    for v in usable:
        s = rec.snapshot[v]
        if s.numel() == T * k and s.shape[-1] == k and reproduces(s.reshape(T, k)):
            found.append(Source("value", (v,)))
        if s.numel() == T * E and s.shape[-1] == E and reproduces(s.reshape(T, E).gather(1, idx)):
            found.append(Source("gather", (v,)))
    per_col = []
    for j in range(k):
        col = [v for v in usable if rec.snapshot[v].numel() == T and torch.allclose(
            rec.snapshot[v].reshape(T)[:S].to(torch.float64) * keep[:, j], w_hat[:, j], rtol=1e-3, atol=1e-5)]
        per_col.append(col[-3:])
    for combo in itertools.product(*per_col):
        if len(set(combo)) == k and reproduces(torch.stack([rec.snapshot[v].reshape(T) for v in combo], 1)):
            found.append(Source("columns", combo))
    if reproduces(torch.ones(T, k, dtype=torch.float64)):
        found.append(Source("ones"))
    return found[:3]


def _split(rec, x, isrc, wsrc, out, T, k, h, calls, final) -> tuple[Split | None, str]:
    seeds = {x, *isrc.values, *wsrc.values, *[v for v in rec.outputs if v != out]}
    kept = {rec.producer[v] for v in _ancestors(rec, seeds, stop=out) if rec.producer[v] is not None}
    if rec.producer[out] in kept:
        return None, "the call that makes its combined output makes something else it returns"
    if any(i in kept for i in calls):
        return None, "it uses its experts' outputs for more than their weighted sum"
    made_in_dispatch = {v for v, p in enumerate(rec.producer) if p is not None and p not in kept}
    first_value: dict[int, int] = {}
    for v, o in enumerate(rec.obj):
        first_value.setdefault(o, v)
    for n, e in enumerate(rec.entries):
        if n in kept:
            continue
        for old, _ in e.writes:
            if first_value[rec.obj[old]] not in made_in_dispatch:
                return None, (f"its dispatch ({e.name}) writes into a tensor it did not create "
                              f"(shape {tuple(rec.snapshot[old].shape)})")
    for v in (x, *isrc.values, *wsrc.values):
        if final[rec.obj[v]] != v:
            return None, f"a tensor of its routing (shape {tuple(rec.snapshot[v].shape)}) is written after use"
    return Split(x, isrc, wsrc, out, frozenset(kept), T, k, h), ""


# ----------------------------------------------------------------------------- 3. replay

ExpertsOp = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]  # (x, idx, weights) -> y (T, H)


class _Replayer(TorchFunctionMode):
    def __init__(self, rec: Recording, split: Split, experts_op: ExpertsOp):
        super().__init__()
        self.rec, self.split, self.experts_op = rec, split, experts_op
        self.i = 0
        self.live: dict[int, torch.Tensor] = {}  # value -> the tensor standing for it in this run
        self.obj_live: dict[int, torch.Tensor] = {}  # recorded object -> the tensor standing for it
        self.shadows: dict[int, torch.Tensor] = {}  # recorded object -> the recorded tensor answering for it
        self.stand_in: dict[int, torch.Tensor] = {}  # id(shadow of out) -> y
        self.y: torch.Tensor | None = None
        self.computing_y = False

    def _next(self, name: str) -> tuple[int, Entry]:
        n = self.i
        if n >= len(self.rec.entries):
            raise Diverged(f"it makes more calls than when recorded (call {n}: {name})")
        e = self.rec.entries[n]
        if e.name != name:
            raise Diverged(f"call {n} is {name}, recorded as {e.name}")
        self.i += 1
        return n, e

    def _value(self, v: int) -> torch.Tensor:
        if v not in self.live:
            raise Diverged(f"a tensor of its routing (value {v}) was not computed in the replay")
        return self.live[v]

    def y_value(self) -> torch.Tensor:
        if self.y is None:
            s = self.split
            x = _shaped(self._value(s.x), (s.tokens, s.hidden))
            idx = s.idx.build(self._value, s.tokens, s.top_k)
            w = s.weights.build(self._value, s.tokens, s.top_k, idx, like=x)
            out = self.rec.snapshot[s.out]
            self.computing_y = True  # the experts op may call the expert modules: not entries of the block
            try:
                y = self.experts_op(x, idx, w)
            finally:
                self.computing_y = False
            self.y = _shaped(y if y.dtype == out.dtype else y.to(out.dtype), tuple(out.shape))
        return self.y

    def _arg(self, v: int, a: torch.Tensor) -> torch.Tensor:
        if id(a) in self.stand_in:
            return self.stand_in[id(a)]
        if v == self.split.out:
            self.stand_in[id(a)] = self.y_value()
            return self.stand_in[id(a)]
        if any(a is t for t in self.shadows.values()):
            raise Diverged(f"a kept call reads a value of the dispatch (value {v})")
        return a

    def _answer(self, e: Entry):
        """A dispatch entry's recorded result: its tensors as recorded (the same tensor for the same object)."""
        tensors = iter([self.obj_live[o] if o in self.obj_live else self.shadows.setdefault(o, self.rec.snapshot[v])
                        for v, o in zip(e.outs, e.out_objs)])
        return pytree.tree_unflatten([next(tensors) if leaf is TENSOR else leaf for leaf in e.leaves], e.spec)

    def _bind(self, e: Entry, args, out) -> None:
        for v, t in zip(e.ins, _tensors(args)):
            self.obj_live.setdefault(self.rec.obj[v], t)
        for v, o, t in zip(e.outs, e.out_objs, _tensors(out)):
            self.live[v] = t
            self.obj_live[o] = t
        for _, new in e.writes:
            o = self.rec.obj[new]
            if o in self.obj_live:
                self.live[new] = self.obj_live[o]

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if _metadata(func):
            return func(*args, **kwargs)
        n, e = self._next(_fname(func))
        if n not in self.split.kept:
            return self._answer(e)
        leaves, spec = pytree.tree_flatten((args, kwargs))
        j = 0
        for i, a in enumerate(leaves):
            if isinstance(a, torch.Tensor):
                leaves[i] = self._arg(e.ins[j], a)
                j += 1
        args, kwargs = pytree.tree_unflatten(leaves, spec)
        out = func(*args, **kwargs)
        self._bind(e, (args, kwargs), out)
        return out

    def expert_call(self, ex: int, fn, args, kwargs):
        if self.computing_y:
            return fn(*args, **kwargs)
        n, e = self._next("experts" if ex == GROUPED_CALL else f"expert {ex}")
        return self._answer(e)


def replay_forward(forward: Callable, rec: Recording, split: Split, experts: list[nn.Module], grouped: bool,
                   experts_op: ExpertsOp) -> Callable:
    """`forward` with its dispatch replaced by `experts_op(x, idx, weights)` (see the module docstring)."""

    def run(*args):
        mode = _Replayer(rec, split, experts_op)
        for v, t in zip(rec.inputs, _tensors(args)):
            mode.live[v] = t
            mode.obj_live[rec.obj[v]] = t
        with _intercept_experts(experts, grouped, mode), mode:
            out = forward(*args)
        if mode.i != len(rec.entries):
            raise Diverged(f"it makes {mode.i} calls, {len(rec.entries)} when recorded")
        leaves, spec = pytree.tree_flatten(out)
        j = 0
        for i, t in enumerate(leaves):
            if isinstance(t, torch.Tensor):
                leaves[i] = mode._arg(rec.outputs[j], t)
                j += 1
        return pytree.tree_unflatten(leaves, spec)

    return run
