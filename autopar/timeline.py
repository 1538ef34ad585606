"""The step as the hardware runs it: compute and communication on streams, overlapped where dependencies allow.

A step is a list of `Task`s, each on a *stream* with a duration and the tasks it waits for. A stream runs its
tasks one at a time in the order given (as a CUDA stream, or NCCL's stream per process group, does); a task
starts when its stream is free and every task it waits for has ended (`simulate`). The step ends when every
stream has finished; the communication it *exposes* is what the compute stream does not cover:
makespan - compute busy time (`Schedule.exposed_comm_s`).

`step_tasks(pieces)` builds a training step from per-structure costs (`Piece`: one per structure, in forward
order; `piece` reads one from an `autopar.estimate.Cost`). Streams: "compute", and one per communicating mesh
axis: the parameters' synchronisation on the data axes (`Piece.sync_stream`) and a structure's own
collectives on its model axes (`Piece.critical_stream`). Forward, for each structure i:
- `gather i` (sync stream): FSDP's all-gather of its parameters; it waits for the forward of the structure two
  gathering structures back, so the gather of the next gathering structure runs while this one computes (FSDP2's
  prefetch, one unit ahead; structures that gather nothing, such as replicated norms between them, are not units);
- `fwd i` (compute, a third of its compute: forward = 1/3 of forward + backward): waits for `gather i` and
  for the previous structure's forward collectives;
- `fwd-comm i` (its critical stream, half its critical communication): tensor-parallel collectives, the loss'
  reductions; the next compute waits for them, so they are exposed.
Backward, last structure first:
- `regather i` (sync stream): ZeRO-3's all-gather of the parameters FSDP released after the forward, issued as
  FSDP2 issues it: the first one when the backward starts, then each regathering structure's in the pre-backward
  of the regathering structure after it in backward order (the next layer's prefetched while this one computes);
- `bwd i` (compute, two thirds, less `Piece.hidden_s`) after the later structure's `bwd-comm` and its own `regather`;
- `bwd-comm i` (the other half), after `bwd i`;
- `wgrad i` (compute, `hidden_s`): the weight gradients of its column-parallel linears, which run while their input
  gradient's reduction (part of `bwd-comm i`) is in flight (Megatron's async communication,
  `autopar.runtime.collectives.grad_all_reduce_linears`), so `hidden_s` of it is covered;
- `reduce i` (sync stream): its gradients' reduction (the data-parallel bucket share, FSDP's reduce-scatter),
  which waits only for its backward compute, so it overlaps the backward of the structures before it.
`optimizer` (compute, `optimizer_s`: `autopar.estimate.optimizer_step_s`) waits for every reduction: the last
ones are exposed. `step-gather` (sync stream, `Piece.step_gather_s` summed: ZeRO-1's all-gather of the parameters
after the step, one flat buffer, `autopar.forms.zero`) waits for the optimizer: the step returns after it, nothing
covers it. On one sync stream the tasks run in issue order, as NCCL runs a process group's collectives.

Contention (`contended`): a collective's NCCL kernels run on SMs the compute kernels then lack, so compute that
overlaps communication runs slower (`Cluster.overlap_slowdown`, measured: `cost_model.hardware`). The step is
simulated once, each compute task is stretched by `slowdown x` the fraction of it some communication overlapped,
and simulated again (one fixed-point step: stretching moves the overlap little).

`overlapped_s(cost)`: what one structure adds to the step in that steady state, for the ILP (a sum over
structures, linear in the choices): compute + critical communication - what its weight gradients cover + the part
of its gathers its forward does not cover + the part of its reductions and re-gathers its backward does not cover
+ its share of the optimizer step + its share of ZeRO-1's gather after it (whole: nothing overlaps it) + the slowdown
of the compute its synchronisation overlaps. (In the timeline a
gather hides behind the previous structure's forward and a reduction behind the next-earlier backward; per
structure, its own compute stands for that neighbour's: identical layers make them equal.)
The step's ends have no neighbour (`ends_s`, added by the ILP for the first and the last structure in forward
order when they gather, i.e. FSDP and ZeRO-2 candidates): the first structure's gather has no forward before it
(ZeRO-2's and FSDP's first gather after the step is exposed whole), its reduction is the step's last (only the
optimizer after it), and the last structure's re-gather is the backward's first (issued when it starts, not
prefetched). Without them the ILP priced the zero2 plan of tests/test_zero_ilp.py at 285.8 us against the
timeline's 332.1 (tests/test_zero_ends.py). Replicated parameters (dp, zero1) are left as `overlapped_s` prices
them: their bucket's fixed cost, which no structure holds, is counted exposed there and stands for the last
reduction (they agree within 1% on that model).

What the timeline leaves out: bucket boundaries inside a structure, the host (Python dispatch and kernel launches,
assumed to run ahead of the GPU: large kernels), and the pipeline bubble of pipeline parallelism (which autopar does
not do).
"""

from __future__ import annotations

from dataclasses import dataclass, field

__all__ = ["Task", "Schedule", "simulate", "Piece", "piece", "step_tasks", "step_schedule", "contended",
           "overlapped_s", "ends_s", "steady_s"]

COMPUTE = "compute"


@dataclass(frozen=True)
class Task:
    """One piece of work on `stream` taking `duration_s`, started only after every task named in `after` ended."""

    name: str
    stream: str
    duration_s: float
    after: tuple[str, ...] = ()

    def __post_init__(self):
        if not self.duration_s >= 0:
            raise ValueError(f"task {self.name!r}: duration must be >= 0 seconds, got {self.duration_s}")


@dataclass
class Schedule:
    """When each task ran: `start[name]`, `end[name]`, and the streams' busy time."""

    start: dict[str, float] = field(default_factory=dict)
    end: dict[str, float] = field(default_factory=dict)
    busy: dict[str, float] = field(default_factory=dict)  # stream -> seconds of work

    @property
    def makespan_s(self) -> float:
        return max(self.end.values(), default=0.0)

    @property
    def compute_s(self) -> float:
        return self.busy.get(COMPUTE, 0.0)

    @property
    def comm_s(self) -> float:
        """All communication, on every stream (what a step without overlap would add)."""
        return sum(t for s, t in self.busy.items() if s != COMPUTE)

    @property
    def exposed_comm_s(self) -> float:
        """The communication no compute covers: makespan - compute."""
        return max(0.0, self.makespan_s - self.compute_s)


def simulate(tasks: list[Task]) -> Schedule:
    """Run `tasks` (each stream in list order) and return when each started and ended. A task may wait only for
    tasks listed before it (the list is a valid issue order); naming a later or unknown task is an error."""
    sched = Schedule()
    free: dict[str, float] = {}
    for t in tasks:
        if t.name in sched.end:
            raise ValueError(f"task {t.name!r} is listed twice; give each task its own name")
        missing = [a for a in t.after if a not in sched.end]
        if missing:
            raise ValueError(f"task {t.name!r} waits for {missing}, which are not listed before it. Fix: list tasks in "
                             "an order where every task comes after those it waits for")
        start = max([free.get(t.stream, 0.0)] + [sched.end[a] for a in t.after])
        sched.start[t.name], sched.end[t.name] = start, start + t.duration_s
        free[t.stream] = start + t.duration_s
        sched.busy[t.stream] = sched.busy.get(t.stream, 0.0) + t.duration_s
    return sched


@dataclass(frozen=True)
class Piece:
    """One structure of the step: its compute (forward + backward), critical communication (on
    `critical_stream`), and parameter synchronisation (gathers before its forward, reductions after its
    backward, on `sync_stream`)."""

    key: str
    compute_s: float
    critical_s: float = 0.0
    gather_s: float = 0.0
    reduce_s: float = 0.0
    regather_s: float = 0.0  # ZeRO-3: the parameters gathered again before its backward
    sync_stream: str = "data"
    critical_stream: str = "model"
    hidden_s: float = 0.0  # of critical_s' backward half: what its weight gradients cover (`Cost.hidden_s`)
    step_gather_s: float = 0.0  # ZeRO-1: its parameters' all-gather after the optimizer step (`Cost.step_gather_s`)

    def __post_init__(self):
        if not 0.0 <= self.hidden_s <= min(self.critical_s / 2, 2 * self.compute_s / 3) + 1e-15:
            raise ValueError(f"piece {self.key!r}: hidden_s must be within its backward communication and compute, "
                             f"got {self.hidden_s} (critical {self.critical_s}, compute {self.compute_s})")


def piece(key: str, cost, sync_stream: str = "data", critical_stream: str = "model") -> Piece:
    """A `Piece` from an `autopar.estimate.Cost` (its `gather_s`, `reduce_s`, `hidden_s` and the rest of `comm_s`)."""
    return Piece(key=key, compute_s=cost.compute_s, critical_s=cost.critical_s, gather_s=cost.gather_s,
                 reduce_s=cost.reduce_s, regather_s=cost.regather_s, sync_stream=sync_stream,
                 critical_stream=critical_stream, hidden_s=cost.hidden_s, step_gather_s=cost.step_gather_s)


def step_tasks(pieces: list[Piece], optimizer_s: float = 0.0) -> list[Task]:
    """The tasks of one training step over `pieces` in forward order, then the optimizer step (module docstring)."""
    tasks: list[Task] = []
    prev: tuple[str, ...] = ()
    gathering: list[str] = []  # the structures that gather, in forward order: prefetch counts these, not the norms
    for p in pieces:
        gather = ()
        if p.gather_s > 0:
            wait = (f"fwd {gathering[-2]}",) if len(gathering) >= 2 else ()
            tasks.append(Task(f"gather {p.key}", p.sync_stream, p.gather_s, wait))
            gather = (f"gather {p.key}",)
            gathering.append(p.key)
        tasks.append(Task(f"fwd {p.key}", COMPUTE, p.compute_s / 3, prev + gather))
        prev = (f"fwd {p.key}",)
        if p.critical_s > 0:
            tasks.append(Task(f"fwd-comm {p.key}", p.critical_stream, p.critical_s / 2, prev))
            prev = (f"fwd-comm {p.key}",)
    backward = pieces[::-1]
    regathering = [p for p in backward if p.regather_s > 0]  # FSDP2's prefetch counts these, in backward order
    issued: set[str] = set()

    def regather(p: Piece, wait: tuple[str, ...]) -> None:
        if p.key not in issued:
            issued.add(p.key)
            tasks.append(Task(f"regather {p.key}", p.sync_stream, p.regather_s, wait))

    reduces = []
    for p in backward:
        if p.regather_s > 0:
            regather(p, prev)  # the first one (not prefetched): when the backward reaches it
            k = regathering.index(p)
            if k + 1 < len(regathering):  # prefetch the next one while this one computes
                regather(regathering[k + 1], prev)
        own = (f"regather {p.key}",) if p.regather_s > 0 else ()
        tasks.append(Task(f"bwd {p.key}", COMPUTE, 2 * p.compute_s / 3 - p.hidden_s, prev + own))
        bwd = (f"bwd {p.key}",)
        computed = bwd  # the end of its backward compute
        if p.hidden_s > 0:  # the weight gradients, while the input gradient's reduction (bwd-comm) runs
            tasks.append(Task(f"wgrad {p.key}", COMPUTE, p.hidden_s, bwd))
            computed = (f"wgrad {p.key}",)
        if p.reduce_s > 0:
            tasks.append(Task(f"reduce {p.key}", p.sync_stream, p.reduce_s, computed))
            reduces.append(f"reduce {p.key}")
        prev = computed
        if p.critical_s > 0:
            tasks.append(Task(f"bwd-comm {p.key}", p.critical_stream, p.critical_s / 2, bwd))
            prev = computed + (f"bwd-comm {p.key}",)
    if optimizer_s > 0:
        tasks.append(Task("optimizer", COMPUTE, optimizer_s, prev + tuple(reduces)))
        prev, reduces = ("optimizer",), []
    step_gather = sum(p.step_gather_s for p in pieces)
    if step_gather > 0:  # ZeRO-1: one flat all-gather after the step (`autopar.runtime.local_step`)
        tasks.append(Task("step-gather", pieces[0].sync_stream, step_gather, prev + tuple(reduces)))
    return tasks


def step_schedule(pieces: list[Piece], optimizer_s: float = 0.0, overlap_slowdown: float = 0.0) -> Schedule:
    """The step's schedule: `simulate(step_tasks(pieces, optimizer_s))`, compute contended by the communication
    it overlaps (`contended`) when `overlap_slowdown` > 0."""
    tasks = step_tasks(pieces, optimizer_s)
    sched = simulate(tasks)
    return simulate(contended(tasks, sched, overlap_slowdown)) if overlap_slowdown > 0 else sched


def contended(tasks: list[Task], sched: Schedule, slowdown: float) -> list[Task]:
    """`tasks` with each compute task stretched by `slowdown` x the fraction of it that communication (any other
    stream) overlapped in `sched` (module docstring)."""
    comm = sorted((sched.start[t.name], sched.end[t.name]) for t in tasks if t.stream != COMPUTE and t.duration_s > 0)
    busy: list[list[float]] = []  # the union of the communication intervals
    for a, b in comm:
        if busy and a <= busy[-1][1]:
            busy[-1][1] = max(busy[-1][1], b)
        else:
            busy.append([a, b])
    import bisect
    starts, ends = [x for x, _ in busy], [y for _, y in busy]
    out = []
    for t in tasks:
        if t.stream == COMPUTE and t.duration_s > 0:
            a, b = sched.start[t.name], sched.end[t.name]
            # only the intervals that overlap [a, b] (sorted, disjoint): the others add exactly 0.0, so the sum is
            # the one over all of them, bit for bit, without the tasks x intervals scan (planning at 100+ layers)
            lo, hi = bisect.bisect_right(ends, a), bisect.bisect_left(starts, b)
            covered = sum(max(0.0, min(b, y) - max(a, x)) for x, y in busy[lo:hi])
            t = Task(t.name, t.stream, t.duration_s * (1 + slowdown * covered / t.duration_s), t.after)
        out.append(t)
    return out


def overlapped_s(cost) -> float:
    """What one structure adds to the step with its parameter synchronisation overlapped (module docstring):
    the ILP's objective per candidate."""
    fwd, bwd = cost.compute_s / 3, 2 * cost.compute_s / 3
    behind = min(cost.gather_s, fwd) + min(cost.reduce_s + cost.regather_s, bwd)  # compute communication overlaps
    return (cost.compute_s + cost.critical_s - cost.hidden_s + max(0.0, cost.gather_s - fwd)
            + max(0.0, cost.reduce_s + cost.regather_s - bwd) + cost.optimizer_s + cost.step_gather_s
            + cost.overlap_slowdown * behind)


def ends_s(cost, *, first: bool, last: bool) -> float:
    """What the step's ends add to `overlapped_s(cost)` for the structure that runs `first` in forward order (its
    gather not hidden behind a forward; its reduction the step's last: nothing but the optimizer after it) or `last`
    (its re-gather the backward's first, not prefetched): the synchronisation `overlapped_s` hid that the timeline
    exposes, less the contention `overlapped_s` charged for hiding it (module docstring). 0 for a structure that
    gathers nothing (replicated parameters: `overlapped_s` stands as it is)."""
    if not (first or last) or cost.gather_s <= 0:
        return 0.0
    fwd, bwd = cost.compute_s / 3, 2 * cost.compute_s / 3
    hid = min(cost.reduce_s + cost.regather_s, bwd)
    still = min((0.0 if first else cost.reduce_s) + (0.0 if last else cost.regather_s), bwd)
    exposed = (min(cost.gather_s, fwd) if first else 0.0) + hid - still
    return exposed * (1 - cost.overlap_slowdown)


def steady_s(costs) -> float:
    """The ILP's step over the structures' `costs` in forward order: each one's `overlapped_s` and the ends'
    `ends_s` (what no structure holds is priced apart: `overlapped_s` of it)."""
    if not costs:
        return 0.0
    return (sum(overlapped_s(c) for c in costs) + ends_s(costs[0], first=True, last=len(costs) == 1)
            + (ends_s(costs[-1], first=False, last=True) if len(costs) > 1 else 0.0))
