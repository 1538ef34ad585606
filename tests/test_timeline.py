"""autopar.timeline (the step simulated on a compute stream and one stream per communicating axis), the presets'
achieved rates (monotone in size), the mesh-axis -> topology mapping, and the estimate reporting exposed
communication from the timeline rather than a sum."""

from __future__ import annotations

import dataclasses

import pytest

from autopar import timeline as T
from autopar.estimate import Cost
from cost_model import analytical as A
from cost_model import hardware as H


# ------------------------------------------------------------------------------------- simulate
def test_streams_run_in_order_and_tasks_wait_for_dependencies():
    s = T.simulate([T.Task("a", "compute", 2.0), T.Task("c1", "net", 3.0, ("a",)), T.Task("b", "compute", 1.0),
                    T.Task("d", "compute", 1.0, ("c1",))])
    assert (s.start["a"], s.end["a"]) == (0.0, 2.0)
    assert (s.start["c1"], s.end["c1"]) == (2.0, 5.0)  # waits for a
    assert (s.start["b"], s.end["b"]) == (2.0, 3.0)  # same stream as a: after it; overlaps c1
    assert (s.start["d"], s.end["d"]) == (5.0, 6.0)  # waits for c1 (a dependency chain across streams)
    assert s.makespan_s == 6.0 and s.compute_s == 4.0 and s.comm_s == 3.0
    assert s.exposed_comm_s == pytest.approx(2.0)  # 3 s of comm, 1 s hidden behind b


def test_simulate_refuses_unknown_or_later_dependencies_and_bad_durations():
    with pytest.raises(ValueError, match="not listed before it"):
        T.simulate([T.Task("a", "compute", 1.0, ("b",)), T.Task("b", "compute", 1.0)])
    with pytest.raises(ValueError, match="listed twice"):
        T.simulate([T.Task("a", "compute", 1.0), T.Task("a", "net", 1.0)])
    with pytest.raises(ValueError, match=">= 0"):
        T.Task("a", "compute", -1.0)


# ------------------------------------------------------------------------------- a training step
def _layers(n, compute, **kw):
    return [T.Piece(key=f"l{i}", compute_s=compute, **kw) for i in range(n)]


def test_gradient_reductions_hide_behind_the_earlier_backward():
    # 4 layers of 3 s compute (1 fwd + 2 bwd); each reduction 1.5 s, issued when its backward ends
    s = T.step_schedule(_layers(4, 3.0, reduce_s=1.5))
    assert s.compute_s == pytest.approx(12.0) and s.comm_s == pytest.approx(6.0)
    # only the first layer's reduction (after the last backward) is exposed: exposed = comm - overlappable compute
    assert s.exposed_comm_s == pytest.approx(1.5)
    assert s.makespan_s == pytest.approx(13.5)
    for i in range(4):  # every reduction starts when its layer's backward is done, not before
        assert s.start[f"reduce l{i}"] >= s.end[f"bwd l{i}"]


def test_reductions_longer_than_the_backward_queue_up():
    # reductions of 5 s each against 2 s of backward per layer: the sync stream is the bottleneck
    s = T.step_schedule(_layers(3, 3.0, reduce_s=5.0))
    first_reduce = s.start["reduce l2"]  # the last layer's backward ends first
    assert s.makespan_s == pytest.approx(first_reduce + 15.0)
    assert s.exposed_comm_s == pytest.approx(s.makespan_s - 9.0)


def test_fsdp_gathers_prefetch_one_layer_ahead():
    # gathers of 0.5 s before each 1 s forward: only the first is exposed
    s = T.step_schedule(_layers(4, 3.0, gather_s=0.5))
    assert s.start["fwd l0"] == pytest.approx(0.5)
    assert s.exposed_comm_s == pytest.approx(0.5)
    # the gather of layer 2 waits for the forward of layer 0 (at most one gather in flight ahead)
    assert s.start["gather l2"] >= s.end["fwd l0"]
    # gathers longer than a layer's forward: the forward waits on each one
    slow = T.step_schedule(_layers(4, 3.0, gather_s=2.0))
    assert slow.start["fwd l3"] >= slow.end["gather l3"] and slow.exposed_comm_s > 2.0


def test_tensor_parallel_collectives_are_exposed():
    s = T.step_schedule(_layers(4, 3.0, critical_s=0.4))
    assert s.exposed_comm_s == pytest.approx(4 * 0.4) and s.makespan_s == pytest.approx(12 + 1.6)
    # the next compute waits for the collective of the previous structure
    assert s.start["fwd l1"] == pytest.approx(s.end["fwd-comm l0"])


def test_zero3_regathers_run_on_the_data_stream_one_layer_ahead_of_the_backward():
    # 4 layers of 3 s compute (2 s backward each), re-gathers of 0.5 s and reduce-scatters of 1 s on one data stream
    s = T.step_schedule(_layers(4, 3.0, regather_s=0.5, reduce_s=1.0))
    fwd_end = s.end["fwd l3"]
    # the first re-gather is not prefetched: the last layer's backward waits for it
    assert s.start["regather l3"] == pytest.approx(fwd_end) and s.start["bwd l3"] == pytest.approx(fwd_end + 0.5)
    # the next layer's is issued with it (prefetch), so it is ready before that layer's backward starts
    assert s.start["regather l2"] == pytest.approx(fwd_end + 0.5) and s.end["regather l2"] <= s.start["bwd l2"]
    for i in (1, 0):  # each later one is issued when the backward of the layer two later ends (FSDP2's order) ...
        assert s.start[f"regather l{i}"] >= s.end[f"bwd l{i + 2}"]
        assert s.start[f"bwd l{i}"] >= s.end[f"regather l{i}"]  # ... and its layer's backward waits for it
    # issue order on the one stream: a layer's reduce-scatter before the re-gather prefetched after its backward
    assert s.start["regather l1"] >= s.end["reduce l3"]
    # only the first re-gather and the last reduce-scatter are exposed
    assert s.exposed_comm_s == pytest.approx(0.5 + 1.0)
    # re-gathers longer than a layer's backward: the backward waits on each
    slow = T.step_schedule(_layers(4, 3.0, regather_s=3.0))
    assert slow.start["bwd l0"] == pytest.approx(slow.end["regather l0"])
    assert slow.exposed_comm_s == pytest.approx(3.0 + 3 * (3.0 - 2.0))  # the first, then 1 s more than each backward


def test_the_optimizer_step_follows_the_last_reduction_on_the_compute_stream():
    s = T.step_schedule(_layers(3, 3.0, reduce_s=1.5), optimizer_s=0.25)
    assert s.start["optimizer"] == pytest.approx(max(s.end[f"reduce l{i}"] for i in range(3)))
    assert s.compute_s == pytest.approx(9.25) and s.makespan_s == pytest.approx(s.end["optimizer"])
    assert s.exposed_comm_s == pytest.approx(1.5)  # the last reduction, before the optimizer step


def test_compute_overlapped_by_communication_runs_slower():
    pieces = _layers(4, 3.0, reduce_s=1.0)
    quiet, busy = T.step_schedule(pieces), T.step_schedule(pieces, overlap_slowdown=0.2)
    # reductions of l3, l2, l1 overlap the backward of l2, l1, l0 (1 s of each 2 s): each stretched by 0.2 x 1 s
    assert busy.compute_s == pytest.approx(quiet.compute_s + 3 * 0.2)
    assert busy.end["bwd l0"] == pytest.approx(quiet.end["bwd l0"] + 3 * 0.2)
    # compute nothing overlaps is not stretched: the forward, and everything without communication
    assert busy.end["fwd l3"] == pytest.approx(quiet.end["fwd l3"])
    alone = _layers(4, 3.0)
    assert T.step_schedule(alone, overlap_slowdown=0.2).makespan_s == pytest.approx(12.0)
    # exposed (waited-for) communication overlaps no compute: nothing to stretch
    tp = _layers(2, 3.0, critical_s=1.0)
    assert T.step_schedule(tp, overlap_slowdown=0.5).compute_s == pytest.approx(6.0)


def test_overlapped_s_per_structure():
    c = Cost(compute_s=3.0, comm_s=2.5, comm_bytes=0, memory_bytes=0, gather_s=0.5, reduce_s=1.5)
    assert c.critical_s == pytest.approx(0.5) and c.time_s == pytest.approx(5.5)
    assert T.overlapped_s(c) == pytest.approx(3.5)  # gather under 1 s fwd, reduction under 2 s bwd: hidden
    big = dataclasses.replace(c, comm_s=6.0, gather_s=2.0, reduce_s=3.5)
    assert T.overlapped_s(big) == pytest.approx(3.0 + 0.5 + 1.0 + 1.5)
    # a re-gather shares the backward with the reductions: the same overlapped time as when reduce_s held it
    split = dataclasses.replace(big, reduce_s=2.5, regather_s=1.0)
    assert split.critical_s == pytest.approx(big.critical_s) and T.overlapped_s(split) == pytest.approx(T.overlapped_s(big))


def test_optimizer_step_is_memory_bound_over_the_local_state():
    from autopar.estimate import OPTIMIZER_ACCESSES, optimizer_step_s
    h100 = H.PRESETS["h100"]
    held = Cost(compute_s=1.0, comm_s=0.0, comm_bytes=0, memory_bytes=16e9 + 5e9, act_bytes=4e9, transient_bytes=1e9)
    # 1e9 fp32 parameters with AdamW: 16 GB of state, foreach AdamW's 21 accesses of 4 bytes each per element
    assert OPTIMIZER_ACCESSES["adamw"] * 16 == 84
    assert optimizer_step_s([held], "adamw", h100) == pytest.approx(84e9 / h100.vector_bytes_per_s)
    assert optimizer_step_s([held], "sgd", h100) < optimizer_step_s([held], "adam", h100)


# ----------------------------------------------------------------------------- achieved rates
@pytest.mark.parametrize("name", ["h100", "h100_hbm2e", "h200", "a100"])
def test_preset_rates_rise_with_size_below_the_peak(name):
    c = H.PRESETS[name]
    assert A.has_kernel_rates(c)
    for dtype in ("bfloat16", "float16"):
        rates = [A.matmul_flops_per_s(c, dtype, 10.0 ** e) for e in range(6, 17)]
        assert all(b > a for a, b in zip(rates, rates[1:])), rates
        assert rates[-1] < c.peak_flops[dtype] and rates[-1] > 0.75 * c.peak_flops[dtype]  # MAMF: 80-87%
        attn = [A.sdpa_flops_per_s(c, dtype, s) for s in (256, 1024, 4096, 16384, 131072)]
        assert all(b > a for a, b in zip(attn, attn[1:])) and attn[-1] < rates[-1], attn
    assert A.matmul_flops_per_s(c, "bfloat16", 1e6) < 0.2 * c.peak_flops["bfloat16"]  # a tiny matmul is latency
    # elementwise kernels at the measured D2D-copy fraction of HBM; compute slowed under overlapped communication
    assert c.vector_bytes_per_s == pytest.approx(c.memory_bytes_per_s * 2903 / 3350) == c.copy_bytes_per_s
    assert c.overlap_slowdown == pytest.approx(0.189)


def test_h100_matmul_and_attention_sources():
    h100 = H.PRESETS["h100"]
    assert A.matmul_flops_per_s(h100, "bfloat16", 1e16) == pytest.approx(794.5e12, rel=1e-3)  # MAMF
    # FlashAttention-2's 335 TFLOP/s (its count: backward 2.5x forward) in autopar's (2x) count
    assert A.sdpa_flops_per_s(h100, "bfloat16", 2**20) == pytest.approx(335e12 * 3 / 3.5, rel=1e-3)
    # the 96 GB HBM2e part: FlashAttention at the same fraction of its (lower) bf16 peak as the matmuls
    hbm2e = H.PRESETS["h100_hbm2e"]
    assert A.sdpa_flops_per_s(hbm2e, "bfloat16", 2**20) == pytest.approx(335e12 * 912 / 989 * 3 / 3.5, rel=1e-3)
    # a profile's single measured attention rate wins over no table; a table by length over nothing
    prof = dataclasses.replace(H.PRESETS["cpu"], sdpa_flops={"float32": 3e10})
    assert A.sdpa_flops_per_s(prof, "float32", 4096) == 3e10 and A.sdpa_flops_per_s(H.PRESETS["cpu"], "float32") is None
    with pytest.raises(ValueError, match="sdpa_table"):
        dataclasses.replace(h100, sdpa_table={"bfloat16": ((1024, 1e14), (512, 1e14))})


def test_all_reduce_latency_ring_or_tree():
    ring = H.Link(alpha_s=1e-5, bytes_per_s=1e9)
    nccl = dataclasses.replace(ring, tree_all_reduce=True)
    assert A.collective_time_s("all_reduce", 0, 64, ring) == pytest.approx(2 * 63 * 1e-5)
    assert A.collective_time_s("all_reduce", 0, 64, nccl) == pytest.approx(2 * 6 * 1e-5)  # 2 log2 p
    assert A.collective_time_s("all_reduce", 0, 2, nccl) == pytest.approx(2 * 1e-5)
    # the bandwidth term is the ring's; all-gather stays a ring
    assert A.collective_time_s("all_reduce", 10**9, 64, nccl) - A.collective_time_s("all_reduce", 0, 64, nccl) == \
        pytest.approx(2 * 63 / 64)
    assert A.collective_time_s("all_gather", 0, 64, nccl) == pytest.approx(63 * 1e-5)


# ---------------------------------------------------------------------------------- topology
def test_mesh_axes_map_to_nodes():
    h100 = H.PRESETS["h100"]
    intra, inter = h100.intra_node, h100.inter_node
    bw = lambda mesh, i: H.axis_link(h100, mesh, i).bytes_per_s  # noqa: E731
    # inner axes within a node of 8 GPUs: NVLink; outer axes across nodes: the network
    assert H.axis_link(h100, (8, 8), 1) == intra and bw((8, 8), 0) == inter.bytes_per_s
    assert H.axis_link(h100, (2, 4), 0) == intra  # 2 x 4 = 8 ranks: one node
    # a group with k GPUs in each node uses k NICs: FSDP over 128 -> 8 x 50 GB/s; never above NVLink
    assert bw((128,), 0) == 8 * inter.bytes_per_s and bw((32, 4), 0) == 2 * inter.bytes_per_s
    assert bw((64, 2), 0) == 4 * inter.bytes_per_s
    wide = dataclasses.replace(h100, inter_node=dataclasses.replace(inter, bytes_per_s=100e9))
    assert H.axis_link(wide, (128,), 0).bytes_per_s == intra.bytes_per_s


# ------------------------------------------------------------------------------ the estimate
def test_estimate_reports_the_timeline():
    import torch

    import autopar
    from autopar.models import GPT, GPTConfig

    cfg = GPTConfig(vocab_size=512, seq_len=256, num_layers=4, num_heads=8, hidden=512)
    with torch.device("meta"):
        model = GPT(cfg).to(torch.bfloat16)
        ids = torch.zeros(16, 256, dtype=torch.long)
    for name in ("dp", "fsdp"):
        e = autopar.plan(model, {"dp": 16}, (ids, ids), plan=name, cluster="h100").estimate
        assert e.exposed_comm_s is not None and 0 <= e.exposed_comm_s <= e.comm_time_s * (1 + 1e-9)
        assert e.step_time_s == pytest.approx(e.compute_time_s + e.exposed_comm_s, rel=1e-9)
        assert e.step_time_s < e.compute_time_s + e.comm_time_s  # some communication is hidden
        assert "exposed" in e.summary()
