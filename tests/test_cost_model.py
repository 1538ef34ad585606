"""The cost model: presets, cluster loading, mesh links, collective and roofline formulas, FLOPs per
fx node against FlopCounterMode, model-state and activation memory against exact counts and the
Korthikanti formula, JSON round trips, and the profiler on a 2-rank gloo world."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import Partial, Replicate, Shard
from torch.distributed.tensor.placement_types import _StridedShard
from torch.utils.flop_counter import FlopCounterMode

from autopar.capture import capture
from autopar.models import GPT, GPTConfig, Llama, LlamaConfig
from cost_model import analytical as A
from cost_model import hardware as H
from cost_model import memory as M

aten = torch.ops.aten


# ------------------------------------------------------------------------------------ hardware
def test_presets_carry_datasheet_numbers():
    h100, h200, a100 = H.PRESETS["h100"], H.PRESETS["h200"], H.PRESETS["a100"]
    assert h100.peak_flops["bfloat16"] == 989e12 and h100.memory_bytes_per_s == 3.35e12
    assert h100.device_memory_bytes == 80e9 and h100.intra_node.bytes_per_s == 450e9
    assert h200.peak_flops == h100.peak_flops and h200.memory_bytes_per_s == 4.8e12
    assert h200.device_memory_bytes == 141e9
    assert a100.peak_flops["bfloat16"] == 312e12 and a100.memory_bytes_per_s == 2.039e12
    assert a100.intra_node.bytes_per_s == 300e9 and a100.inter_node.bytes_per_s == 25e9
    assert h100.inter_node.bytes_per_s == h200.inter_node.bytes_per_s == 50e9
    for c in H.PRESETS.values():
        fp8 = {"float8_tensorwise", "float8_rowwise"} if c.name in ("h100", "h100_hbm2e", "h200") else set()
        assert set(c.peak_flops) == set(H.DTYPES) | fp8 and c.source  # fp8: the `_scaled_mm` of each recipe
        assert c.flops_efficiency == c.memory_efficiency == c.intra_node.efficiency == 1.0  # nothing baked in


def test_cluster_validates_and_round_trips_json():
    for c in H.PRESETS.values():
        assert H.Cluster.from_json(c.to_json()) == c
    measured = dataclasses.replace(H.PRESETS["cpu"], mesh_shape=(2, 1),
                                   axis_links=(H.Link(alpha_s=1e-5, bytes_per_s=2e9), None))
    assert H.Cluster.from_json(measured.to_json()) == measured
    with pytest.raises(ValueError, match="flops_efficiency"):
        dataclasses.replace(H.PRESETS["h100"], flops_efficiency=1.5)
    with pytest.raises(ValueError, match="axis_links"):
        dataclasses.replace(H.PRESETS["h100"], axis_links=(H.PRESETS["h100"].intra_node,))
    with pytest.raises(ValueError, match="bytes_per_s"):
        H.Link(alpha_s=0, bytes_per_s=0)
    with pytest.raises(ValueError, match="not an autopar cluster profile"):
        H.Cluster.from_json(json.dumps({"name": "x"}))


def test_load_cluster(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    assert H.load_cluster("H100") is H.PRESETS["h100"]
    c = H.PRESETS["a100"]
    assert H.load_cluster(c) is c
    with pytest.raises(ValueError, match=r"unknown cluster 'b300'.*'a100', 'cpu', 'h100', 'h100_hbm2e', 'h200'"):
        H.load_cluster("b300")
    with pytest.raises(ValueError, match="does not exist"):
        H.load_cluster(tmp_path / "missing.json")
    bad = tmp_path / "bad.json"
    bad.write_text("{}")
    with pytest.raises(ValueError, match="not a valid autopar profile"):
        H.load_cluster(bad)
    good = tmp_path / "prof.json"
    custom = dataclasses.replace(H.PRESETS["cpu"], name="mine")
    good.write_text(custom.to_json())
    assert H.load_cluster(good) == custom and H.load_cluster(str(good)) == custom
    # None: no cached profile -> the preset of this machine's device: cpu without CUDA, else by GPU name (an
    # unknown GPU plans with a100's and warns how to profile); a cached profile for the mesh wins
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    for gpu, preset in (("NVIDIA H100 80GB HBM3", "h100"), ("NVIDIA H200", "h200"), ("NVIDIA A100-SXM4-80GB", "a100")):
        monkeypatch.setattr(torch.cuda, "get_device_name", lambda *_, name=gpu: name)
        assert H.load_cluster(None, (2, 2)) is H.PRESETS[preset], gpu
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *_: "NVIDIA B300")
    with pytest.warns(UserWarning, match=r"no hardware preset for 'NVIDIA B300'.*autopar profile"):
        assert H.load_cluster(None, (2, 2)) is H.PRESETS["a100"]
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    fallback = H.load_cluster(None, (2, 2))
    assert fallback is H.PRESETS["cpu"]
    path = H.default_profile_path((2, 2))
    assert path == tmp_path / "cache" / "autopar" / "profile-cpu-2x2.json"
    path.parent.mkdir(parents=True)
    path.write_text(custom.to_json())
    assert H.load_cluster(None, (2, 2)) == custom
    assert H.load_cluster(None, (4,)) == custom  # same device, same number of ranks
    assert H.load_cluster(None, (8,)) is fallback


def test_axis_link_row_major_nodes():
    h100 = H.PRESETS["h100"]
    intra, inter = h100.intra_node, h100.inter_node
    assert [H.axis_link(h100, (8, 8), i) for i in range(2)] == [inter, intra]
    assert [H.axis_link(h100, (2, 4), i) for i in range(2)] == [intra, intra]
    assert [H.axis_link(h100, (2, 8), i) for i in range(2)] == [inter, intra]
    # across nodes, a group holding k GPUs of each node sends over their k NICs at once (at most NVLink's rate)
    assert [H.axis_link(h100, (4, 4, 4), i) for i in range(3)] == [
        inter, dataclasses.replace(inter, bytes_per_s=2 * inter.bytes_per_s), intra]
    assert H.axis_link(h100, (16,), 0) == dataclasses.replace(inter, bytes_per_s=8 * inter.bytes_per_s)
    assert H.axis_link(h100, (8,), -1) == intra
    with pytest.raises(ValueError, match="does not exist"):
        H.axis_link(h100, (8,), 1)
    fast = H.Link(alpha_s=1e-6, bytes_per_s=1e12)
    measured = dataclasses.replace(h100, mesh_shape=(8, 8), axis_links=(fast, None))
    assert H.axis_link(measured, (8, 8), 0) == fast  # measured on this mesh shape
    assert H.axis_link(measured, (8, 8), 1) == intra  # size-1/unmeasured axis: topology rule
    assert H.axis_link(measured, (4, 16), 0) == inter  # another mesh: topology rule (one GPU per node)
    assert H.axis_link(measured, (16, 4), 0) == dataclasses.replace(inter, bytes_per_s=2 * inter.bytes_per_s)


# ---------------------------------------------------------------------------------- analytical
LINK = H.Link(alpha_s=1e-5, bytes_per_s=1e9)


def test_collective_formulas():
    n, p = 8_000_000, 4
    assert A.send_bytes("all_reduce", n, p) == 2 * 3 / 4 * n
    assert A.send_bytes("all_gather", n, p) == A.send_bytes("reduce_scatter", n, p) == 3 / 4 * n
    assert A.send_bytes("all_to_all", n, p) == 3 / 4 * n and A.send_bytes("p2p", n, p) == n
    assert A.collective_time_s("all_reduce", n, p, LINK) == pytest.approx(1.5 * n / 1e9 + 6 * 1e-5)
    assert A.collective_time_s("all_gather", n, p, LINK) == pytest.approx(0.75 * n / 1e9 + 3 * 1e-5)
    assert A.collective_time_s("all_to_all", n, p, LINK) == pytest.approx(0.75 * n / 1e9 + 3 * 1e-5)
    assert A.collective_time_s("p2p", n, p, LINK) == pytest.approx(n / 1e9 + 1e-5)
    # a ring all-reduce is a reduce-scatter followed by an all-gather
    assert A.collective_time_s("all_reduce", n, p, LINK) == pytest.approx(
        A.collective_time_s("reduce_scatter", n, p, LINK) + A.collective_time_s("all_gather", n, p, LINK))
    assert A.collective_time_s("all_reduce", n, 1, LINK) == 0 == A.send_bytes("all_gather", n, 1)
    half = dataclasses.replace(LINK, efficiency=0.5)
    assert A.collective_time_s("p2p", n, 2, half) == pytest.approx(2 * n / 1e9 + 1e-5)
    with pytest.raises(ValueError, match="unknown collective 'broadcast'"):
        A.collective_time_s("broadcast", n, p, LINK)


def test_measured_table_interpolates():
    """A profile's table (seconds per collective inside a compute stream) replaces alpha-beta for its kinds and
    group size: log-log between measured sizes, flat below, the last segment's slope above."""
    rows = ((4, 1e-3), (4096, 1e-3), (2**20, 2e-3), (2**23, 9e-3))
    link = H.Link(alpha_s=1e-5, bytes_per_s=1e9, table={"all_reduce": rows}, table_group_size=2)
    assert A.collective_time_s("all_reduce", 1, 2, link) == 1e-3  # below the table: its smallest time
    assert A.collective_time_s("all_reduce", 2**20, 2, link) == pytest.approx(2e-3)  # a measured point
    assert A.collective_time_s("all_reduce", 2**21, 2, link) == pytest.approx(2e-3 * (9 / 2) ** (1 / 3))  # log-log
    slope = 7e-3 / (2**23 - 2**20)
    assert A.collective_time_s("all_reduce", 2**24, 2, link) == pytest.approx(9e-3 + slope * 2**23)
    # monotone in the size, as the table
    sizes = [2**k for k in range(0, 26)]
    times = [A.collective_time_s("all_reduce", n, 2, link) for n in sizes]
    assert times == sorted(times)
    # other kinds and other group sizes: alpha-beta
    assert A.collective_time_s("all_gather", 2**20, 2, link) == pytest.approx(2**19 / 1e9 + 1e-5)
    assert A.collective_time_s("all_reduce", 2**20, 4, link) == pytest.approx(1.5 * 2**20 / 1e9 + 6e-5)
    assert A.collective_time_s("all_reduce", 2**20, 1, link) == 0


def test_sync_grows_with_the_compute_before_a_collective():
    """The table was measured after table_interval_s of compute; after another interval the time moves by the
    sync table's difference (linear between intervals, flat beyond), never below zero."""
    rows = ((4, 1e-3), (2**20, 2e-3))
    link = H.Link(alpha_s=1e-5, bytes_per_s=1e9, table={"all_reduce": rows}, table_group_size=2, table_interval_s=1e-3,
                  sync_table=((0.0, 0.2e-3), (1e-3, 1e-3), (4e-3, 2e-3)))
    at = lambda n, d: A.collective_time_s("all_reduce", n, 2, link, interval_s=d)  # noqa: E731
    assert at(2**20, None) == at(2**20, 1e-3) == pytest.approx(2e-3)
    assert at(2**20, 4e-3) == pytest.approx(3e-3) and at(2**20, 2.5e-3) == pytest.approx(2.5e-3)
    assert at(2**20, 1.0) == pytest.approx(3e-3)  # flat beyond the longest interval measured
    assert at(2**20, 0.0) == pytest.approx(1.2e-3)  # back to back
    assert A.collective_time_s("all_gather", 2**20, 2, link, interval_s=4e-3) == pytest.approx(2**19 / 1e9 + 1e-5)
    with pytest.raises(ValueError, match="table_interval_s"):
        H.Link(alpha_s=0, bytes_per_s=1, table={"all_reduce": rows}, table_group_size=2, sync_table=((0.0, 1e-3),))
    with pytest.raises(ValueError, match="strictly increasing"):
        H.Link(alpha_s=0, bytes_per_s=1, table={"all_reduce": rows}, table_group_size=2, table_interval_s=1e-3,
               sync_table=((1e-3, 1e-3), (1e-3, 2e-3)))


def test_link_table_validates_and_round_trips_json():
    rows = [[4, 1e-3], [1024, 1.5e-3]]
    link = H.Link(alpha_s=1e-5, bytes_per_s=1e9, table={"all_gather": rows}, table_group_size=2, table_interval_s=1e-3,
                  sync_table=[[0, 1e-4], [1e-3, 1e-3]])
    assert link.table == {"all_gather": ((4.0, 1e-3), (1024.0, 1.5e-3))} and link.sync_table == ((0, 1e-4), (1e-3, 1e-3))
    measured = dataclasses.replace(H.PRESETS["cpu"], mesh_shape=(2,), axis_links=(link,), sdpa_flops={"float32": 3e10},
                                   matmul_table={"float32": [[3e7, 8e10], [2e9, 1e11]]},
                                   vector_bytes_per_s=4e10, copy_bytes_per_s=5e10, op_overhead_s=2e-6)
    assert H.Cluster.from_json(measured.to_json()) == measured
    assert H.load_cluster("cpu").intra_node.table is None and H.PRESETS["cpu"].op_overhead_s is None
    with pytest.raises(ValueError, match="table_group_size"):
        H.Link(alpha_s=0, bytes_per_s=1, table={"all_gather": rows})
    with pytest.raises(ValueError, match="unknown collective 'p2p'"):
        H.Link(alpha_s=0, bytes_per_s=1, table={"p2p": rows}, table_group_size=2)
    with pytest.raises(ValueError, match="non-decreasing"):
        H.Link(alpha_s=0, bytes_per_s=1, table={"all_reduce": [[4, 2e-3], [8, 1e-3]]}, table_group_size=2)
    with pytest.raises(ValueError, match="strictly increasing"):
        H.Link(alpha_s=0, bytes_per_s=1, table={"all_reduce": [[8, 1e-3], [8, 2e-3]]}, table_group_size=2)
    with pytest.raises(ValueError, match="op_overhead_s"):
        dataclasses.replace(H.PRESETS["cpu"], op_overhead_s=-1.0)
    with pytest.raises(ValueError, match="matmul_table"):
        dataclasses.replace(H.PRESETS["cpu"], matmul_table={"float32": [[2e9, 1e11], [3e7, 8e10]]})


def test_roofline():
    h100 = H.PRESETS["h100"]
    assert A.compute_time_s(989e12, 0, "bfloat16", h100) == pytest.approx(1.0)  # compute bound
    assert A.compute_time_s(1e9, 3.35e12, torch.bfloat16, h100) == pytest.approx(1.0)  # memory bound
    assert A.compute_time_s(67e12, 1, "float32", h100) == pytest.approx(1.0)
    slow = dataclasses.replace(h100, flops_efficiency=0.5, memory_efficiency=0.25)
    assert A.compute_time_s(989e12, 0, "bfloat16", slow) == pytest.approx(2.0)
    assert A.compute_time_s(0, 3.35e12, "bfloat16", slow) == pytest.approx(4.0)
    assert A.compute_time_s(67e12, 0, "int64", h100) == pytest.approx(1.0)  # integer ops: the fp32 peak
    measured = dataclasses.replace(h100, peak_flops={"float32": 1e12})
    with pytest.raises(ValueError, match=r"no peak FLOP/s for dtype 'bfloat16'.*dtypes=\('bfloat16'"):
        A.compute_time_s(1, 0, "bfloat16", measured)


def test_kernel_time_by_op_kind():
    """Per-op-kind rates of a profile: each kind at its own rate plus the per-op overhead; a preset (no rates)
    and a kind without a rate fall back to the roofline."""
    cpu = H.PRESETS["cpu"]
    assert not A.has_kernel_rates(cpu)
    prof = dataclasses.replace(cpu, peak_flops={"float32": 1e11}, memory_bytes_per_s=1e11, sdpa_flops={"float32": 2e10},
                               vector_bytes_per_s=4e10, copy_bytes_per_s=8e10, op_overhead_s=2e-6)
    assert A.has_kernel_rates(prof)
    assert A.kernel_time_s("matmul", 1e11, 1e12, "float32", prof, num_ops=10) == pytest.approx(1 + 2e-5)
    assert A.kernel_time_s("sdpa", 2e10, 0, "float32", prof) == pytest.approx(1)
    assert A.kernel_time_s("vector", 1e12, 4e10, "float32", prof, num_ops=1) == pytest.approx(1 + 2e-6)
    assert A.kernel_time_s("memory", 0, 8e10, "float32", prof) == pytest.approx(1)
    bf16 = dataclasses.replace(prof, peak_flops={"float32": 1e11, "bfloat16": 4e11})  # no bf16 SDPA rate: roofline
    assert A.kernel_time_s("sdpa", 4e11, 0, "bfloat16", bf16) == pytest.approx(1)
    only_overhead = dataclasses.replace(cpu, op_overhead_s=1e-6)
    assert A.kernel_time_s("vector", 0, 2e10, "float32", only_overhead, num_ops=3) == pytest.approx(1 + 3e-6)
    with pytest.raises(ValueError, match="unknown op kind"):
        A.kernel_time_s("conv", 1, 1, "float32", prof)
    # matmul throughput by the size of one call: log-linear between measured sizes, flat outside
    sized = dataclasses.replace(prof, matmul_table={"float32": ((1e7, 5e10), (1e9, 1e11))})
    assert A.matmul_flops_per_s(sized, "float32", 1e8) == pytest.approx(7.5e10)
    assert A.matmul_flops_per_s(sized, "float32", 1e6) == 5e10 and A.matmul_flops_per_s(sized, "float32", 1e12) == 1e11
    assert A.matmul_flops_per_s(sized, "float32") == 1e11  # no size given: the peak
    assert A.kernel_time_s("matmul", 7.5e10, 0, "float32", sized, flops_per_call=1e8) == pytest.approx(1)
    node = A.NodeCost(flops=1e11, bytes=0, kind="matmul")
    assert node.time_s(prof, divisor=2) == pytest.approx(0.5 + 2e-6)
    assert node.time_s(cpu) == pytest.approx(1e11 / cpu.peak_flops["float32"])
    assert A.NodeCost().time_s(prof) == 0  # a view


MATMUL_OPS = set(A._MATMULS) | A._SDPA


def test_llama8b_flops_match_flop_counter():
    """Llama-3-8B shapes on meta, S=4096: matmul FLOPs equal FlopCounterMode's, node by node summed; one layer
    extrapolated to 32 gives the 70.27 TFLOP forward of notes/testing-on-cpu.md §4.3."""
    cfg = LlamaConfig(vocab_size=128256, seq_len=4096, num_layers=1, num_heads=32, num_kv_heads=8, hidden=4096,
                      ffn_hidden=14336)
    with torch.device("meta"):
        model = Llama(cfg)
        tokens = torch.zeros(1, 4096, dtype=torch.long)
    gm = capture(model, (tokens, tokens), {}).gm
    total = layer = 0
    for node in gm.graph.nodes:
        if node.op == "call_function" and node.target in MATMUL_OPS:
            flops = A.node_cost(node).flops
            total += flops
            layer += flops if "layers.0" in str(node.meta["nn_module_stack"]) else 0
    with FlopCounterMode(display=False) as counter:
        model(tokens, tokens)
    assert total == counter.get_total_flops()
    assert (total - layer + 32 * layer) / 1e12 == pytest.approx(70.27, abs=0.01)


def test_gpt_flops_match_flop_counter():
    """Linears as FlopCounterMode counts them (addmm/mm, bias not counted); SDPA as its math path on meta
    (full square), halved for is_causal."""
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=64, seq_len=16, num_layers=2, num_heads=4, hidden=32))
    tokens = torch.randint(0, 64, (3, 16))
    gm = capture(model, (tokens, tokens), {}).gm
    linear = sum(A.node_cost(n).flops for n in gm.graph.nodes if n.target is aten.linear.default)
    sdpa = [n for n in gm.graph.nodes if n.target is aten.scaled_dot_product_attention.default]
    with FlopCounterMode(display=False) as counter:
        model(tokens, tokens)  # CPU SDPA is not counted by FlopCounterMode: only the linears
    assert linear == counter.get_total_flops()
    q = torch.empty(3, 4, 16, 8, device="meta")
    with FlopCounterMode(display=False) as counter:
        F.scaled_dot_product_attention(q, q, q)
    assert [A.node_cost(n).flops for n in sdpa] == [counter.get_total_flops() // 2] * 2


def test_node_bytes():
    model = Llama(LlamaConfig())
    tokens = torch.zeros(2, 16, dtype=torch.long)
    gm = capture(model, (tokens, tokens), {}).gm
    by_name = {n.name: n for n in gm.graph.nodes}
    for node in gm.graph.nodes:
        cost = A.node_cost(node)
        if node.op != "call_function":
            assert cost == A.NodeCost()
        elif node.target in (aten.view.default, aten.transpose.int, aten.expand.default, aten.unsqueeze.default):
            assert cost == A.NodeCost(), node
    emb = by_name["embedding"]
    assert A.node_cost(emb) == A.NodeCost(bytes=2 * 2 * 16 * 32 * 4 + 2 * 16 * 8, dtype="float32", kind="memory")
    # the GQA repeat: reshape of an expanded (non-contiguous) tensor copies
    reshape = by_name["reshape"]
    assert A.node_cost(reshape).bytes == (2 * 2 * 16 * 8 + 2 * 4 * 16 * 8) * 4  # reads 2 KV heads, writes 4
    assert A.node_cost(reshape).kind == "memory"
    silu = by_name["silu"]
    assert A.node_cost(silu) == A.NodeCost(flops=2 * 16 * 64, bytes=2 * 2 * 16 * 64 * 4, dtype="float32",
                                           kind="vector")
    kinds = {n.target: A.node_cost(n).kind for n in gm.graph.nodes if n.op == "call_function"}
    assert kinds[aten.linear.default] == kinds[aten.matmul.default] == "matmul"
    assert kinds[aten.softmax.int] == kinds[aten.silu.default] == "vector" and kinds[aten.cat.default] == "memory"


def test_form_volumes_match_collectives():
    """Each form's volume formula (its own module) is the sum of the collectives DESIGN.md §3 lists for it."""
    from autopar.forms import blocks, dp, expert, fsdp, ring, sequence_norm, ulysses, vocab_embedding, vocab_loss
    b, s, h, h_kv, t = 2, 64, 32, 16, 4
    ar = A.send_bytes("all_reduce", b * s * h, t)
    assert 2 * blocks.tensor_parallel_volume_bytes(b * s * h, t) == pytest.approx(4 * ar)  # attention + MLP
    assert sequence_norm.layer_volume_bytes(b, s, h, t, 1) == pytest.approx(
        6 * A.send_bytes("all_gather", b * s * h, t) + 4 * A.send_bytes("reduce_scatter", b * s * h, t))
    assert vocab_loss.volume_bytes(b * s, t) == pytest.approx(3 * A.send_bytes("all_reduce", 4 * b * s, t))
    assert vocab_embedding.volume_bytes(b * s * h, t) == pytest.approx(ar)
    local = b * (s // t)  # tokens per rank before the seq -> heads all-to-all
    a2a = sum(A.send_bytes("all_to_all", local * x, t) for x in (h, h_kv, h_kv, h))  # q, k, v, o
    assert ulysses.layer_volume_bytes(b, s, h, h_kv, t, 1, backward=False) == pytest.approx(a2a)
    steps = (t - 1) * A.send_bytes("p2p", 2 * b * (s // t) * h_kv, t)  # K and V blocks
    assert ring.layer_volume_bytes(b, s, h_kv, t, 1, backward=False) == pytest.approx(steps)
    assert ring.layer_volume_bytes(b, s, h_kv, t, 4) == pytest.approx(3 * 4 * steps)  # fp32: K,V + dK,dV backward
    assert ring.layer_volume_bytes(b, s, h_kv, t, 2, ring.accumulator_itemsize(torch.bfloat16)) == \
        pytest.approx(2 * steps + 2 * steps + 4 * steps)  # bf16 K,V; fp32 dK,dV accumulators
    assert expert.layer_volume_bytes(1024, 2, h, t, 1) == pytest.approx(4 * A.send_bytes("all_to_all", 2 * 1024 * h, t))
    assert dp.volume_bytes(1000, t) == A.send_bytes("all_reduce", 1000, t)
    assert fsdp.volume_bytes(1000, t) == pytest.approx(2 * A.send_bytes("all_gather", 1000, t))


# -------------------------------------------------------------------------------------- memory
def test_param_state_bytes_exact():
    shape = (64, 32)
    n = 64 * 32
    fp32 = M.param_state_bytes(shape, "float32")
    assert (fp32.param_bytes, fp32.grad_bytes, fp32.optimizer_bytes) == (4 * n, 4 * n, 8 * n)
    mixed = M.param_state_bytes(shape, torch.bfloat16)  # bf16 + fp32 master + 2 fp32 states: ZeRO's K=12
    assert (mixed.param_bytes, mixed.grad_bytes, mixed.optimizer_bytes) == (2 * n, 2 * n, 12 * n)
    assert mixed.total_bytes == 16 * n
    plain = M.param_state_bytes(shape, torch.bfloat16, master_weights=False)  # torch.optim: bf16 states
    assert plain.optimizer_bytes == 4 * n
    assert M.param_state_bytes(shape, "float32", optimizer="sgd").optimizer_bytes == 0
    assert M.param_state_bytes(shape, "float32", optimizer="sgd_momentum").optimizer_bytes == 4 * n
    frozen = M.param_state_bytes(shape, "float32", requires_grad=False)
    assert frozen == M.MemoryBytes(param_bytes=4 * n)
    # sharding: dim 0 over the axis of size 4 of a (2, 4) mesh; both axes; strided; uneven (ceil)
    mesh = (2, 4)
    assert M.local_numel(shape, (Replicate(), Shard(0)), mesh) == n // 4
    assert M.local_numel(shape, (Shard(1), Shard(0)), mesh) == n // 8
    assert M.local_numel(shape, (Shard(0), Shard(0)), mesh) == n // 8
    assert M.local_numel(shape, (_StridedShard(0, split_factor=3), Partial()), mesh) == n // 2
    assert M.local_numel((10, 3), (Replicate(), Shard(0)), mesh) == 3 * 3
    assert M.param_state_bytes(shape, "float32", (Replicate(), Shard(0)), mesh).total_bytes == 16 * n // 4
    with pytest.raises(ValueError, match="unknown optimizer 'lion'"):
        M.param_state_bytes(shape, "float32", optimizer="lion")
    with pytest.raises(ValueError, match="one placement per mesh axis"):
        M.local_numel(shape, (Shard(0),), mesh)


def test_model_state_bytes_against_torch_optim():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.Linear(32, 8))
    opt = torch.optim.Adam(model.parameters())
    model(torch.randn(4, 16)).sum().backward()
    opt.step()
    real_state = sum(t.numel() * t.element_size() for s in opt.state.values() for t in s.values()
                     if torch.is_tensor(t) and t.dim() > 0)  # Adam's step counters are 0-d
    params = dict(model.named_parameters())
    got = M.model_state_bytes(params)
    numel = sum(p.numel() for p in params.values())
    assert got.optimizer_bytes == real_state == 8 * numel
    assert got.param_bytes == got.grad_bytes == sum(p.grad.numel() * 4 for p in params.values())
    # ZeRO-3 / FSDP on 4 ranks: every parameter sharded on dim 0 -> 16 Ψ / 4 (all dims divide)
    sharded = M.model_state_bytes(params, {k: (Shard(0),) for k in params}, (4,))
    assert sharded.total_bytes == 16 * numel // 4


def _gpt_activation_bytes(num_layers: int, dropout: float) -> int:
    cfg = GPTConfig(vocab_size=256, seq_len=64, num_layers=num_layers, num_heads=4, hidden=64, dropout=dropout)
    model = GPT(cfg).to(torch.bfloat16)
    tokens = torch.zeros(2, 64, dtype=torch.long)
    return M.activation_bytes(capture(model, (tokens, tokens), {}).gm)


@pytest.mark.parametrize("dropout", [0.0, 0.1])
def test_gpt_layer_activations_match_korthikanti(dropout):
    """Korthikanti et al.: sbh(34 + 5as/h) bytes per layer, 16-bit activations. Our GPT layer uses SDPA
    (flash-style: no s² softmax/dropout terms; an fp32 log-sum-exp of 4asb bytes instead of 5as²b) and has
    one dropout (after the attention projection; none after the MLP), so the terms that apply are
    sbh(34 - 2 + masks) + 4asb, plus the two layer norms' fp32 mean/rstd (16sb), which the formula omits.
    The estimate matches that exactly, and Korthikanti's own 34sbh + 4asb within 6%."""
    s, b, h, a = 64, 2, 64, 4
    per_layer = _gpt_activation_bytes(2, dropout) - _gpt_activation_bytes(1, dropout)
    masks = 1 if dropout else 0
    assert per_layer == s * b * h * (34 - 2 + masks) + 4 * a * s * b + 16 * s * b
    assert per_layer == pytest.approx(34 * s * b * h + 4 * a * s * b, rel=0.06)


def test_tensor_parallel_activations_match_korthikanti(_fake_pg):
    """With autopar's megatron plan (t=2) lowered, placements on the nodes shard what TP shards:
    Korthikanti's sbh(10 + 24/t + 5as/(ht)) with the 2 dropout-mask terms removed from the 10 and the
    flash log-sum-exp 4asb/t for 5as²b/t, plus the layer norms' statistics 16sb (replicated)."""
    import autopar
    from torch.distributed.device_mesh import init_device_mesh

    _fake_pg(2)
    mesh = init_device_mesh("cpu", (2,))
    s, b, h, a, t = 64, 2, 64, 4, 2

    def act(num_layers):
        model = GPT(GPTConfig(vocab_size=256, seq_len=s, num_layers=num_layers, num_heads=a, hidden=h))
        tokens = torch.zeros(b, s, dtype=torch.long)
        pm = autopar.parallelize(model.to(torch.bfloat16), mesh, (tokens, tokens), plan="megatron")
        return M.activation_bytes(pm.graph_module, (t,))

    per_layer = act(2) - act(1)
    assert per_layer == s * b * h * (10 - 2 + 24 // t) + 4 * a * s * b // t + 16 * s * b


def test_sequence_parallel_activations_match_korthikanti(_fake_pg):
    """Megatron SP (t=2) lowered: every activation a layer saves is 1/t, the column-parallel linears' inputs
    included (they keep the shard and re-gather it backward: `regather_linears`). Korthikanti's sbh·34/t less the
    2 dropout-mask terms, the flash log-sum-exp 4asb/t, and the layer norms' statistics 16sb/t."""
    import autopar
    from torch.distributed.device_mesh import init_device_mesh

    _fake_pg(2)
    mesh = init_device_mesh("cpu", (2,))
    s, b, h, a, t = 64, 2, 64, 4, 2

    def act(num_layers):
        model = GPT(GPTConfig(vocab_size=256, seq_len=s, num_layers=num_layers, num_heads=a, hidden=h))
        tokens = torch.zeros(b, s, dtype=torch.long)
        pm = autopar.parallelize(model.to(torch.bfloat16), mesh, (tokens, tokens), plan="megatron",
                                 overrides={"norm": "sequence"})
        assert [n.target.__name__ for n in pm.graph_module.graph.nodes if "regather" in str(n.target)] == \
            ["regather_linears"] * (2 * num_layers + 1)
        return M.activation_bytes(pm.graph_module, (t,))

    per_layer = act(2) - act(1)
    assert per_layer == (s * b * h * (34 - 2) + 4 * a * s * b + 16 * s * b) // t


def test_saved_activations_charge_views_once():
    """q, k, v are views of one fused QKV output: charged once, as that output."""
    model = GPT(GPTConfig(num_layers=1))
    tokens = torch.zeros(2, 16, dtype=torch.long)
    saved = M.saved_activations(capture(model, (tokens, tokens), {}).gm)
    qkv = [k for k, v in saved.items() if v.why == "scaled_dot_product_attention" and isinstance(k, torch.fx.Node)
           and k.target is aten.linear.default]
    assert len(qkv) == 1 and saved[qkv[0]].bytes == 2 * 16 * 3 * 32 * 4


# ------------------------------------------------------------------------------------- profile
def _profile_job(path: str) -> str:
    from torch.distributed.device_mesh import init_device_mesh

    from autopar.profile import profile

    mesh = init_device_mesh("cpu", (2,))
    cluster = profile(mesh, path, sizes=(64, 128), message_bytes=(4, 2**14, 2**18), memory_bytes=2**22,
                      kernel_bytes=2**16, repeats=2, iters=3, progress=False)
    return cluster.to_json()


def test_profile_on_gloo(tmp_path):
    from dist_harness import gloo_pool

    path = tmp_path / "prof.json"
    results = gloo_pool(2).run("test_cost_model:_profile_job", str(path))
    assert results[0] == results[1]  # every rank returns the same cluster
    cluster = H.load_cluster(path)
    assert H.Cluster.from_json(results[0]) == cluster
    assert cluster.mesh_shape == (2,) and cluster.axis_links[0] is not None
    assert set(cluster.peak_flops) == {"float32"} and cluster.peak_flops["float32"] > 1e8
    assert cluster.memory_bytes_per_s > 1e8 and cluster.intra_node == cluster.axis_links[0]
    link = cluster.axis_links[0]
    assert 0 <= link.alpha_s < 0.1 and link.bytes_per_s > 1e6
    assert H.axis_link(cluster, (2,), 0) == link
    # collectives measured in situ: every kind, the sizes as the cost model counts them, non-decreasing
    assert link.table_group_size == 2 and set(link.table) == set(H.TABLE_KINDS)
    assert [n for n, _ in link.table["all_reduce"]] == [4, 2**14, 2**18]
    assert [n for n, _ in link.table["all_gather"]] == [8, 2**14, 2**18]  # a whole element per rank
    for rows in link.table.values():
        times = [t for _, t in rows]
        assert times == sorted(times) and all(0 <= t < 1 for t in times)
    assert A.collective_time_s("all_reduce", 2**14, 2, link) == link.table["all_reduce"][1][1]
    # synchronisation after 0 (back to back), 1, 4 and 16 matmuls; the table's interval is one matmul's
    intervals, syncs = zip(*link.sync_table)
    assert len(intervals) == 4 and intervals[0] == 0 and link.table_interval_s == intervals[1] > 0
    assert list(syncs) == sorted(syncs) and list(intervals) == sorted(intervals)
    # per-op-kind compute
    assert set(cluster.sdpa_flops) == {"float32"} and cluster.sdpa_flops["float32"] > 1e7
    assert cluster.vector_bytes_per_s > 1e7 and cluster.copy_bytes_per_s > 1e7
    assert 0 < cluster.op_overhead_s < 1e-3 and A.has_kernel_rates(cluster)
    sizes, rates = zip(*cluster.matmul_table["float32"])
    assert sizes == (2 * 64**3, 2 * 128**3) and max(rates) == cluster.peak_flops["float32"]


def test_monotone_table():
    from autopar.profile import _monotone

    assert _monotone([1.0, 2.0, 3.0]) == [1.0, 2.0, 3.0]
    assert _monotone([1.0, 3.0, 2.0, 4.0]) == [1.0, 2.5, 2.5, 4.0]  # a violating pair pools to its mean
    assert _monotone([5.0, 1.0, 1.0]) == [7 / 3] * 3


def test_profile_sync_intervals_measured_out_of_order_still_make_a_link():
    """On a busy host the sync table's compute intervals can come out out of order (4 matmuls timed under 1: a
    fresh clone's `make test` hit it); the profile makes them increasing so the Link it builds is valid."""
    from autopar.profile import _increasing, _monotone
    from cost_model.hardware import Link
    measured = [0.0, 0.000242, 0.000207, 0.000975]
    intervals = _increasing(_monotone(measured))
    assert all(b > a for a, b in zip(intervals, intervals[1:])), intervals
    table = {"all_reduce": ((4.0, 1e-4), (16384.0, 2e-4))}
    Link(alpha_s=1e-5, bytes_per_s=1e9, table=table, table_group_size=2, table_interval_s=intervals[1],
         sync_table=tuple(zip(intervals, [0.0054, 0.0058, 0.0058, 0.0063])))
    with pytest.raises(ValueError, match="strictly increasing"):  # what the unrepaired intervals did
        Link(alpha_s=1e-5, bytes_per_s=1e9, table=table, table_group_size=2, table_interval_s=measured[1],
             sync_table=tuple(zip(measured, [0.0054, 0.0058, 0.0058, 0.0063])))
