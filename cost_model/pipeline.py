"""A pipeline step priced from its stages (issue #23, deliverable 3): the closed forms the planner composes.

A pipeline over an axis of size p runs n = p * v stages (`autopar.pipeline_plan`); m microbatches go through every
stage. Per microbatch, stage k takes `chunk_s[k]`: its layers' forward + backward (with the tensor-parallel
collectives no compute hides) plus its point-to-point traffic, one activation sent forward and its gradient sent
back per boundary (`p2p_s`). The schedule then takes (`pipeline_time`)

    pipe_s = m * max_r R_r + (sum_r R_r - max_r R_r) / v * (1, or 0 for the zero-bubble V schedules)

where R_r is the sum of the chunk times of the stages rank r runs (`PipelinePlan.stage_rank`). On equal stages this
is the closed form exactly: the idle share bubble_s / pipe_s is (p-1)/(m+p-1) for GPipe and 1F1B, (p-1)/(v*m+p-1)
for interleaved 1F1B (each chunk 1/v of a rank's layers), 0 for ZB-V / DualPipeV, whose F, B (input gradient) and W
(weight gradient) passes the cost model takes as equal: a stage's backward is twice its forward, B and W one forward
each (Qi et al. 2024, arXiv 2401.10241). With unequal stages the slowest rank sets the steady state and the others'
chunks the warm-up and drain: the "T = sum t_i + (B-1) max t_j" of Alpa's stage DP
(`alpa/pipeline_parallel/stage_construction.py`) with every stage counted on its rank and, interleaved, each warm-up
and drain step one chunk (1/v of a rank's layers). An event simulation of torch's own orders (forward 1/3 of a
chunk, backward 2/3) agrees: 1F1B on stages 33 and 42.4 ms, 4 microbatches, 202.6 ms both (the earlier
(m + p - 1) max t_k form: 212 ms; measured on gloo, benchmarks/pp_step_fidelity.py, the pipeline step was over-
predicted by it); interleaved [1, 3, 2, 1] on 2 ranks, m = 4: 17.33 simulated, 17.5 here (19 before).

After the last microbatch each rank reduces its parameters' gradients over the remaining data axes and steps its
optimizer (`tail_s`): the reduction overlaps the backward of the last microbatch (Megatron's `--overlap-grad-reduce`
reduces its buckets during the last microbatch only; torch's schedules reduce once per step as FSDP2's
`set_requires_gradient_sync(last)` does), the rest is exposed, then the optimizer step; FSDP's gathers overlap the
first microbatch's forward. The step is pipe_s + the largest rank's tail.

Memory (`in_flight`): a rank holds the saved activations of the microbatches it has run forward and not yet
backward. 1F1B: stage s holds min(m, p - s) (PipeDream-flush, Narayanan et al. 2021 §2.2.1); GPipe all m;
interleaved 1F1B: rank r runs 2(p - r - 1) + (v - 1) p warm-up chunk forwards before its first backward and holds
one more (Megatron-LM `get_forward_backward_func` / `forward_backward_pipelining_with_interleaving`:
num_warmup_microbatches; torch `ScheduleInterleaved1F1B`: warmup_ops), each chunk 1/v of the rank's layers, so
rank 0 holds p (1 + (p - 1) / (p v)) microbatches' worth, the paper's (1 + (p-1)/(pv)) factor; ZB-V holds p on every
rank, as 1F1B's first stage (Qi et al. 2024, Table 3: ZB-V peak activation memory p M_B). Capped by what exists:
m microbatches (m v chunks).

`in_flight` is the closed form the plan reports; the peak of the multi-stage schedules is priced by walking torch's
own order instead (`torch_order`, `backward_states`: the chunks held at each backward, which per stage weigh
differently, ZB-V's deferred W passes, the runtime's sends alive to the step's end).

Gradients accumulate over the microbatches (`in_flight_later`): a stage's gradients are allocated by its first
microbatch's backward and held until the optimizer step, so every later microbatch's backward starts with all of
them alive next to the activations then in flight: 1F1B's steady state still holds min(m, p - s) (when m > p - s,
else one fewer), GPipe m - 1. The rank's peak is the larger of its first backward's start (no gradient yet) and a
later one's (every gradient, `in_flight_later` microbatches); measured on gloo (benchmarks/memory_fidelity.py
--pipeline) this term is what 1F1B's peak lacked (measured / predicted 1.20-1.26 without it). A stage that sends
to a next one also holds its output for each microbatch in flight (torch's `PipelineStage` keeps it for the
backward) and the output gradient it receives (`autopar.pipeline_estimate.price_pipeline`).
"""

from __future__ import annotations

# the V-shaped zero-bubble forms (`autopar.pipeline_plan.PIPELINE_FORMS`, which validates every form; cost_model
# imports nothing of autopar)
_V_SHAPED = ("zbv", "dualpipev")
_FORMS = ("gpipe", "1f1b", "interleaved-1f1b", *_V_SHAPED)


def in_flight(form: str, p: int, m: int, v: int, rank: int) -> float:
    """The microbatches whose saved activations rank `rank` (0-based coordinate on the pipeline axis) holds at its
    peak, in units of one microbatch through all the layers the rank runs (see the module docstring)."""
    if form not in _FORMS:
        raise ValueError(f"pipeline form {form!r} is not one of {', '.join(_FORMS)}")
    if not 0 <= rank < p:
        raise ValueError(f"rank {rank} is not a coordinate of a pipeline axis of size {p}")
    if form == "gpipe":
        return float(m)
    if form == "1f1b":
        return float(min(m, p - rank))
    if form == "interleaved-1f1b":
        chunks = 2 * (p - rank - 1) + (v - 1) * p + 1
        return min(m * v, chunks) / v
    return float(min(m, p))  # zbv, dualpipev


def in_flight_later(form: str, p: int, m: int, v: int, rank: int) -> float:
    """The microbatches in flight on rank `rank` when a backward other than its first starts (the gradients then
    all allocated): as many as at the first when a forward remains to refill the one just freed (f < m), else one
    chunk fewer; 0 when there is no later backward (m v == 1)."""
    f = in_flight(form, p, m, v, rank)
    if m * v <= 1:
        return 0.0
    return f if f < m else f - 1.0 / v


def pipeline_time(form: str, p: int, m: int, chunk_s: list[float], rank_of: list[int]) -> tuple[float, float]:
    """(pipe_s, bubble_s) of m microbatches through the stages whose per-microbatch times are `chunk_s` (p2p
    included), stage k on rank `rank_of[k]` (module docstring). bubble_s is the slowest rank's idle time."""
    if len(chunk_s) != len(rank_of) or not chunk_s:
        raise ValueError(f"one time per stage and one rank per stage, got {len(chunk_s)} times, {len(rank_of)} ranks")
    per_rank = [0.0] * p
    for t, r in zip(chunk_s, rank_of):
        per_rank[r] += t
    busy = m * max(per_rank)
    v = len(chunk_s) / p
    bubble = 0.0 if form in _V_SHAPED or p <= 1 else (sum(per_rank) - max(per_rank)) / v
    return busy + bubble, bubble


def tail_s(reduce_s: float, gather_s: float, optimizer_s: float, rank_compute_s: float) -> float:
    """What a rank adds after its last microbatch: the gradient reduction not hidden by that microbatch's backward
    (2/3 of its forward + backward compute `rank_compute_s`), the FSDP gathers not hidden by the first microbatch's
    forward (1/3), and its optimizer step."""
    return (max(0.0, reduce_s - 2 / 3 * rank_compute_s) + max(0.0, gather_s - 1 / 3 * rank_compute_s)
            + optimizer_s)


def torch_order(form: str, p: int, m: int, v: int, rank: int) -> list[tuple[str, int, int]] | None:
    """Rank `rank`'s compute actions, in order, as torch's schedule class for `form` runs them: (type 'F', 'B', 'I'
    (input gradient) or 'W' (weight gradient), stage, microbatch). Read from the class's own
    `_calculate_single_rank_operations` (the order every rank computes in its constructor, here without stages), so
    the memory model follows the schedule torch runs; None for the forms whose in-flight count is the closed form
    above (gpipe, 1f1b) or that torch does not run with these arguments."""
    from types import SimpleNamespace

    try:
        from torch.distributed.pipelining import schedules as ts
    except ImportError:  # pragma: no cover - torch without distributed
        return None
    if form == "interleaved-1f1b":
        rounds = max(1, m // p)
        ns = SimpleNamespace(pp_group_size=p, _n_microbatches=m, num_stages=p * v, n_local_stages=v, rank=rank,
                             number_of_rounds=rounds, microbatches_per_round=m // rounds)
        fn = ts.ScheduleInterleaved1F1B._calculate_single_rank_operations
    elif form == "zbv" and v == 2:
        ns = SimpleNamespace(pp_group_size=p, _n_microbatches=m, num_stages=p * v, n_local_stages=v, rank=rank)
        fn = ts.ScheduleZBVZeroBubble._calculate_single_rank_operations
    else:
        return None
    try:
        ops = fn(ns, rank)
    except Exception:  # noqa: BLE001 - a torch whose private schedule builder changed: the closed form stands
        return None
    names = {ts._ComputationType.FORWARD: "F", ts._ComputationType.FULL_BACKWARD: "B",
             ts._ComputationType.BACKWARD_INPUT: "I", ts._ComputationType.BACKWARD_WEIGHT: "W"}
    out = []
    for a in ops:
        if a is None or a.computation_type not in names:
            continue
        out.append((names[a.computation_type], a.stage_index, a.microbatch_index))
    return out


def backward_states(order: list[tuple[str, int, int]], rank_of: list[int] | None = None
                    ) -> list[tuple[dict, dict, bool, int]]:
    """At the start of every backward pass (B, I or W) of a rank's `order` (`torch_order`): (per stage, the
    microbatches whose saved activations it holds: forwarded, not yet through B or W; per stage, those whose input
    gradient is done and weight gradient not (the zero-bubble split: torch's `stage_backward_input` keeps the graph
    and the gradients at the weights' ops for the W pass); whether a backward already ran, so that the gradients
    are allocated; the boundary tensors alive: each stage output (all stages but the last, `rank_of[k]` its rank)
    from its forward until its backward, or until the step ends when it was sent to another rank, and each input
    gradient sent to another rank until the step ends: torch's `_PipelineScheduleRuntime` waits for its sends only
    after the last action, so a sent tensor lives as long)."""
    n = len(rank_of) if rank_of is not None else 0
    held: dict[int, int] = {}
    pending: dict[int, int] = {}
    states, grads, outputs = [], False, 0
    for kind, k, _ in order:
        cross_out = rank_of is not None and k < n - 1 and rank_of[k + 1] != rank_of[k]
        if kind == "F":
            held[k] = held.get(k, 0) + 1
            outputs += rank_of is not None and k < n - 1
            continue
        states.append((dict(held), dict(pending), grads, outputs))
        if kind in ("B", "I") and rank_of is not None and k > 0 and rank_of[k - 1] != rank_of[k]:
            outputs += 1
        if kind == "I":
            pending[k] = pending.get(k, 0) + 1
            continue
        if kind == "W":
            pending[k] -= 1
        held[k] -= 1
        outputs -= rank_of is not None and k < n - 1 and not cross_out
        grads = True
    return states
