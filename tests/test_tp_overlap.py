"""Tensor-parallel backward overlap (Megatron-LM's `LinearWithGradAccumulationAndAsyncCommunication`): the
column-parallel linears are fused with their input's collective (`grad_all_reduce_linears`, and
`regather_linears` under sequence parallelism), whose backward issues the input gradient's all-reduce (or
reduce-scatter) and computes the weight gradients while it runs.

Asserted: fp64 equivalence of megatron and megatron + SP on GPT and Llama (loss, every gradient, the parameters after
two AdamW steps) on simulated ranks and on 2 gloo ranks (where the collectives are really asynchronous); the exact
collectives (kinds, counts, bytes, in order) are those of the unfused lowering; and the overlap is real: with one
rank delayed, the other computes its weight gradients after issuing the reduction and before it completes.
"""

from __future__ import annotations

import dataclasses
import time
from collections import Counter

import pytest
import torch

from autopar.models import GPT, GPTConfig, Llama, LlamaConfig
from autopar.runtime import collectives as C
from dist_harness import gloo_pool
from equivalence import gloo_equivalence, run_equivalence

B, S, H, L = 4, 16, 32, 2
T = 2  # tensor-parallel degree
SP = {"norm": "sequence"}
MODELS = {"gpt": lambda: GPT(GPTConfig()), "llama": lambda: Llama(LlamaConfig())}


def _tokens():
    g = torch.Generator().manual_seed(1)
    return torch.randint(0, 128, (B, S), generator=g), torch.randint(0, 128, (B, S), generator=g)


def _fp64(name):
    torch.manual_seed(0)
    torch.set_default_dtype(torch.float64)
    try:
        return MODELS[name]()
    finally:
        torch.set_default_dtype(torch.float32)


def _expected_comms(sp: bool) -> Counter:
    """(kind, pass, numel, bytes sent) -> count for one step on T ranks, the collectives of the unfused lowering:
    per layer two column-parallel blocks and two row-parallel ones, plus the LM head (column-parallel), the
    vocab-parallel embedding's reduction and the vocab-parallel loss' three (b*s values each)."""
    stream, blocks = B * S * H, 2 * L + 1
    ring = lambda kind: round({"all_reduce": 2, "all_gather": 1, "reduce_scatter": 1}[kind] * (T - 1) / T  # noqa: E731
                              * stream * 8)
    loss = {("all_reduce", "forward", B * S, round(2 * (T - 1) / T * B * S * 8)): 3}
    if not sp:
        return Counter({("all_reduce", "forward", stream, ring("all_reduce")): blocks,  # row outputs + embedding
                        ("all_reduce", "backward", stream, ring("all_reduce")): blocks,  # column inputs' gradients
                        **loss})
    return Counter({("all_gather", "forward", stream, ring("all_gather")): blocks,  # into the column blocks
                    ("reduce_scatter", "forward", stream, ring("reduce_scatter")): blocks,  # out of the row blocks
                    ("reduce_scatter", "backward", stream, ring("reduce_scatter")): blocks,  # column input grads
                    ("all_gather", "backward", stream, ring("all_gather")): 2 * blocks,  # row grads, re-gathers
                    **loss})


def _check(res, ref, sp: bool) -> None:
    names = {n for n, _ in ref.named_parameters()}
    assert set(res.grad_err) == set(res.param_err) == names
    assert res.max_err() < 1e-10, (res.max_err(), {k: v for k, v in {**res.grad_err}.items() if v > 1e-10})
    sized = Counter((k, p, n, b) for k, _, p, n, b in res.comms if (k, p) != ("all_reduce", "backward") or not sp)
    assert sized == _expected_comms(sp), sized
    if sp:  # the norms' weights (sequence-parallel region), one bucket
        assert [r[0] for r in res.comms if r[2] == "backward" and r[0] == "all_reduce"] == ["all_reduce"]


@pytest.fixture(scope="module")
def local_runs(_fake_pg):
    """megatron and megatron + SP on GPT and Llama on 2 simulated ranks, two AdamW steps, once per module."""
    from conftest import _local_world
    out = {}
    for name in MODELS:
        for sp in (False, True):
            ref, x = _fp64(name), _tokens()
            with _local_world(T):
                res = run_equivalence(ref, x, (T,), ("tp",), plan="megatron", overrides=SP if sp else None,
                                      steps=2, lr=0.01, optimizer=torch.optim.AdamW)
            out[name, sp] = ref, res
    return out


@pytest.mark.parametrize("sp", [False, True], ids=["tp", "tp+sp"])
@pytest.mark.parametrize("name", list(MODELS))
def test_matches_one_device_with_the_same_collectives(local_runs, name, sp):
    ref, res = local_runs[name, sp]
    _check(res, ref, sp)
    # every column-parallel block is one fused node: Llama's q/k/v and gate/up share one all-reduce
    fused = "regather_linears" if sp else "grad_all_reduce_linears"
    assert res.graph_counts[fused] == 2 * L + 1, res.graph_counts
    assert {"grad_all_reduce", "all_gather_rs", "all_gather"}.isdisjoint(res.graph_counts), res.graph_counts
    nodes = [n for n in res.graph_module.graph.nodes if getattr(n.target, "__name__", "") == fused]
    weights = sorted(len(n.args[4 if sp else 2]) for n in nodes)
    assert weights == ([1] * (2 * L + 1) if name == "gpt" else [1] + [2] * L + [3] * L), weights
    # the plan's rows say what runs (all but the loss' three reductions, which run inside its op)
    counts = Counter(f"{k}.{p}" for k, _, p, _, _ in res.comms)
    counts["all_reduce.forward"] -= 3
    assert res.plan.comm_counts() == {k: n for k, n in counts.items() if n}, res.plan.comm_counts()


def test_unfused_lowering_records_the_same_collectives_in_order(local_runs, monkeypatch, _fake_pg):
    """Without `async_column_linears_pass` (the linears after a plain `grad_all_reduce`): the same collectives, in
    the same order, and the same numbers."""
    from conftest import _local_world
    from passes import lower
    monkeypatch.setattr(lower, "LOWER", [p for p in lower.LOWER if p is not lower.async_column_linears_pass])
    ref, x = _fp64("llama"), _tokens()
    with _local_world(T):
        res = run_equivalence(ref, x, (T,), ("tp",), plan="megatron", steps=2, lr=0.01,
                              optimizer=torch.optim.AdamW)
    assert "grad_all_reduce_linears" not in res.graph_counts and res.graph_counts["grad_all_reduce"] == 2 * L + 1
    fused = local_runs["llama", False][1]
    assert res.comms == fused.comms
    assert res.loss == fused.loss and res.grad_err.keys() == fused.grad_err.keys()


@pytest.mark.parametrize("sp", [True], ids=["tp+sp"])  # megatron alone: tests/test_contract_modes.py
def test_autocast_runs_the_fused_backward_in_the_forward_dtype(local_world, sp):
    """Under autocast the fused linears' backward matmuls run in bf16 as autocast's would, and the input gradient is
    reduced in the input's dtype (fp32), as the unfused graph reduced it: the model under autocast, to bf16
    tolerance."""
    from torch.distributed.device_mesh import init_device_mesh
    import autopar
    from equivalence import compare_step

    torch.manual_seed(0)
    ref, x = Llama(LlamaConfig()), _tokens()
    with local_world(T):
        pm = autopar.parallelize(Llama(LlamaConfig()), init_device_mesh("cpu", (T,), mesh_dim_names=("tp",)), x,
                                 plan="megatron", overrides=SP if sp else None)
        pm.load_state_dict(ref.state_dict())
        with C.record_comms() as recs:
            errs = compare_step(pm, ref, x, lr=0.01, context=lambda: torch.autocast("cpu", dtype=torch.bfloat16))
    scale = max(float(p.detach().abs().max()) for p in ref.parameters())
    assert max(errs.values()) < 3e-2 * max(1.0, scale), {k: v for k, v in errs.items() if v > 3e-2}
    reduced = [r for r in recs if r.pass_ == "backward" and r.kind == ("reduce_scatter" if sp else "all_reduce")
               and r.numel == B * S * H]
    assert len(reduced) == 2 * L + 1 and {r.dtype for r in reduced} == {"float32"}, reduced


def _gloo_cases() -> list:
    out = []
    for name in MODELS:
        for sp in (False, True):
            res = gloo_equivalence(MODELS[name], _tokens, (T,), ("tp",), plan="megatron",
                                   overrides=SP if sp else None, steps=2, optimizer=torch.optim.AdamW)
            out.append((name, sp, res))
    return out


def test_gloo_matches_one_device_with_the_same_collectives():
    """On 2 gloo ranks the reductions run asynchronously under the weight gradients: same numbers, same collectives."""
    for rank_results in gloo_pool(T).run(_gloo_cases):
        for name, sp, res in rank_results:
            _check(res, _fp64(name), sp)


# ---------------------------------------------------------------------------------------------- the overlap is real

DELAY_S = 0.4


def _overlap_events(sp: bool) -> dict:
    """Forward + backward of Llama under megatron (+ SP) on this rank, overlapped and not; rank 1 sleeps DELAY_S
    before its first input gradient in each backward. Returns this rank's backward events (what, seconds) for each."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import DeviceMesh
    import autopar
    from equivalence import loss_of

    # a process group of its own without TORCH_DISTRIBUTED_DEBUG=DETAIL's wrapper (the pool's setting), which checks
    # every collective's shapes across the ranks synchronously before issuing it
    level = dist.get_debug_level()
    dist.set_debug_level(dist.DebugLevel.OFF)
    try:
        group = dist.new_group(list(range(T)), backend="gloo")
    finally:
        dist.set_debug_level(level)
    torch.manual_seed(0)
    pm = autopar.parallelize(Llama(LlamaConfig()), DeviceMesh.from_group(group, "cpu", mesh_dim_names=("tp",)),
                             _tokens(), plan="megatron", overrides=SP if sp else None)
    events, on = [], [False]
    saved = (C._c10d, C._wait, C._param_grads, C._input_grad, C.OVERLAP[0])

    class Issuing:  # the functional collectives, each issue logged
        def __getattr__(self, op):
            fn = getattr(saved[0], op)

            def issue(*a, **k):
                if on[0] and op != "wait_tensor":
                    events.append((f"issue {op}", time.perf_counter()))
                return fn(*a, **k)
            return issue

    def wait(t):
        out = saved[1](t)
        if on[0]:
            events.append(("wait", time.perf_counter()))
        return out

    def param_grads(*a):
        events.append(("weight grads start", time.perf_counter()))
        out = saved[2](*a)
        events.append(("weight grads end", time.perf_counter()))
        return out

    def input_grad(*a):
        if dist.get_rank() == 1 and not any(e[0] == "delayed" for e in events):
            events.append(("delayed", time.perf_counter()))
            time.sleep(DELAY_S)
        return saved[3](*a)

    out = {}
    C._c10d, C._wait, C._param_grads, C._input_grad = Issuing(), wait, param_grads, input_grad
    try:
        for overlap in (True, False):
            C.OVERLAP[0] = overlap
            events.clear()
            loss = loss_of(pm(*_tokens()))
            dist.barrier()
            on[0] = True
            loss.backward()
            on[0] = False
            out[overlap] = list(events)
    finally:
        C._c10d, C._wait, C._param_grads, C._input_grad, C.OVERLAP[0] = saved
        dist.destroy_process_group(group)
    return out


def _first_fused_backward(events: list, reduction: str) -> tuple[float, float, float, float]:
    """(issue of the input gradient's reduction, weight gradients start and end, the wait for that reduction) of the
    first fused backward on rank 0 (the LM head's)."""
    i = next(i for i, e in enumerate(events) if e[0] == "weight grads start")
    issue = max(t for what, t in events[:i] if what == f"issue {reduction}")
    end = events[i + 1][1]
    assert events[i + 1][0] == "weight grads end", events
    waits = [t for what, t in events if what == "wait" and t >= issue]
    return issue, events[i][1], end, waits


@pytest.mark.parametrize("sp", [False, True], ids=["tp", "tp+sp"])
def test_weight_gradients_run_while_the_reduction_is_in_flight(sp):
    """Rank 1 is DELAY_S late into its first input gradient, so rank 0's reduction of that gradient cannot complete
    before then. Overlapped, rank 0 computes the weight gradients right after issuing it, and only then waits; the
    sequential path (`OVERLAP[0] = False`) waits for the reduction before the weight gradients."""
    reduction = "reduce_scatter_tensor" if sp else "all_reduce"
    runs = gloo_pool(T).run(_overlap_events, sp)[0]
    for overlap, events in runs.items():
        issue, start, end, waits = _first_fused_backward(events, reduction)
        done = min(t for t in waits if t >= issue + 0.5 * DELAY_S)  # the wait that blocked on rank 1
        if overlap:
            assert end < issue + 0.5 * DELAY_S <= done, (issue, start, end, done, events)
        else:
            assert done <= start, (issue, start, end, done, events)


# ---------------------------------------------------------------------------------------------- the estimate

def test_timeline_hides_the_backward_collective_behind_the_weight_gradients():
    """4 layers of 3 s compute and 0.4 s tensor-parallel collectives (0.2 forward, 0.2 backward), 0.15 s of whose
    backward half runs under the weight gradients: only 0.05 s of it is exposed, and per structure the ILP's
    `overlapped_s` says the same."""
    from autopar import timeline as TL
    from autopar.estimate import Cost
    pieces = [TL.Piece(key=f"l{i}", compute_s=3.0, critical_s=0.4, hidden_s=0.15) for i in range(4)]
    s = TL.step_schedule(pieces)
    assert s.compute_s == pytest.approx(12.0)
    assert s.exposed_comm_s == pytest.approx(4 * (0.2 + 0.05))
    for i in range(4):
        assert s.start[f"wgrad l{i}"] == pytest.approx(s.start[f"bwd-comm l{i}"]) == pytest.approx(s.end[f"bwd l{i}"])
    for i in range(3, 0, -1):  # the next backward waits for both
        assert s.start[f"bwd l{i - 1}"] == pytest.approx(max(s.end[f"wgrad l{i}"], s.end[f"bwd-comm l{i}"]))
    cost = Cost(compute_s=3.0, comm_s=0.4, comm_bytes=0, memory_bytes=0, hidden_s=0.15)
    assert TL.overlapped_s(cost) * 4 == pytest.approx(s.makespan_s)
    synced = TL.step_schedule([dataclasses.replace(p, reduce_s=0.5) for p in pieces])
    for i in range(4):  # a structure's gradients are ready once its weight gradients are
        assert synced.start[f"reduce l{i}"] == pytest.approx(synced.end[f"wgrad l{i}"])
    with pytest.raises(ValueError, match="hidden_s must be within"):
        TL.Piece(key="x", compute_s=3.0, critical_s=0.2, hidden_s=0.15)


def test_estimate_hides_part_of_each_column_linear_collective(monkeypatch):
    """megatron on the issue's Llama shape, priced for H100s: every tensor-parallel block and the vocab-parallel loss
    hide part of their backward collective under their column-parallel weight gradients; the step is that much
    shorter than with none hidden, and still compute + exposed communication."""
    import autopar
    from autopar.forms import blocks

    cfg = LlamaConfig(vocab_size=2048, seq_len=256, num_layers=4, num_heads=8, num_kv_heads=4, hidden=512,
                      ffn_hidden=1536)
    with torch.device("meta"):
        model = Llama(cfg).to(torch.bfloat16)
        ids = torch.zeros(8, 256, dtype=torch.long)
    covered = []
    cover = blocks.weight_grad_cover_s
    monkeypatch.setattr(blocks, "weight_grad_cover_s", lambda *a: covered.append(cover(*a)) or covered[-1])
    e = autopar.plan(model, {"tp": 8}, (ids, ids), plan="megatron", cluster="h100").estimate
    assert len(covered) >= 2 * cfg.num_layers + 1 and all(c > 0 for c in covered), covered
    monkeypatch.setattr(blocks, "weight_grad_cover_s", lambda *a: 0.0)
    none = autopar.plan(model, {"tp": 8}, (ids, ids), plan="megatron", cluster="h100").estimate
    # the same work; the weight gradients now run under the reduction, so they pay the slowdown of compute that
    # communication overlaps (`Cluster.overlap_slowdown`: `Estimate.contention_s`)
    assert e.compute_time_s - e.contention_s == pytest.approx(none.compute_time_s - none.contention_s)
    assert e.comm_time_s == pytest.approx(none.comm_time_s) and e.contention_s > none.contention_s
    assert none.exposed_comm_s - e.exposed_comm_s > 0.05 * none.exposed_comm_s, (none.exposed_comm_s, e.exposed_comm_s)
    assert none.step_time_s > e.step_time_s
    assert none.step_time_s - e.step_time_s == pytest.approx(
        (none.exposed_comm_s - e.exposed_comm_s) - (e.contention_s - none.contention_s), rel=1e-6)
    assert e.step_time_s == pytest.approx(e.compute_time_s + e.exposed_comm_s, rel=1e-9)
