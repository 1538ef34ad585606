"""Ring attention over a context-parallel axis, zigzag layout (autopar.runtime.ring_attention).

Under LocalTensorMode (p simulated ranks, fp64): `zigzag_unshard(ring_attention(zigzag_shard(q), ...))`
equals `F.scaled_dot_product_attention` on the full tensors, forward and the gradients of q, k, v,
for p in {2, 4}, causal and not, batch 2, 3 heads, GQA with fewer KV heads than ranks, Dv != D.

Communication, derived from the schedule (DESIGN.md §3 ring row), never copied from output:
* forward: p-1 ring steps, each sends this rank's K,V block: B*Hkv*(S/p)*(D+Dv) elements;
* backward: p-1 K,V steps again plus p-1 steps of the dK,dV accumulator (same element count, in
  the accumulation dtype); nothing else inside ring attention;
* zigzag_unshard of the output: one all-gather forward; zigzag_shard of q, k, v: one all-gather each
  backward.

The zigzag schedule (which rows of q and of the visiting K,V block a step computes) is checked by
brute force against the causal mask of the global positions, for p = 1..6. Real gloo runs (2 and 4
processes) check the all_to_all_single ring transfers on a real process group.
"""

from __future__ import annotations

from collections import Counter

import pytest
import torch
import torch.nn.functional as F

from autopar.mesh import mesh_info
from autopar.runtime.collectives import record_comms
from autopar.runtime.ring_attention import (
    ring_attention,
    zigzag_positions,
    zigzag_schedule,
    zigzag_shard,
    zigzag_unshard,
)


def _inputs(b, h, hkv, s, d, dv, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(b, h, s, d, generator=g, dtype=torch.float64).to(dtype)
    k = torch.randn(b, hkv, s, d, generator=g, dtype=torch.float64).to(dtype)
    v = torch.randn(b, hkv, s, dv, generator=g, dtype=torch.float64).to(dtype)
    w = torch.randn(b, h, s, dv, generator=g, dtype=torch.float64).to(dtype)  # loss = sum(out * w)
    return q, k, v, w


def _ranks(t: torch.Tensor) -> list[torch.Tensor]:
    """Every simulated rank's value of a LocalTensor (or the tensor itself)."""
    lt = getattr(t, "_local_tensors", None)
    return list(lt.values()) if lt is not None else [t]


def _max_err(t: torch.Tensor, ref: torch.Tensor) -> float:
    return max(float((x - ref).abs().max()) for x in _ranks(t))


def _run_ring(cp_axis, q, k, v, w, causal, impl=None):
    """Shard, ring attention, unshard, loss; returns (out, grads, forward records, backward records)."""
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    with record_comms() as fwd:
        shards = [zigzag_shard(t, 2, cp_axis) for t in leaves]
        out = zigzag_unshard(ring_attention(*shards, cp_axis, causal=causal, impl=impl), 2, cp_axis)
    with record_comms() as bwd:
        grads = torch.autograd.grad((out * w).sum(), leaves)
    return out, grads, list(fwd), list(bwd)


def _reference(q, k, v, w, causal):
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    out = F.scaled_dot_product_attention(*leaves, is_causal=causal, enable_gqa=True)
    grads = torch.autograd.grad((out * w).sum(), leaves)
    return out.detach(), grads


def _cp_axis(world: int):
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("cp",))
    return mesh_info(mesh).axis("cp")


# ----------------------------------------------------------------------------- LocalTensorMode

CONFIGS = [  # (p, causal, heads (H, Hkv), Dv)
    (2, True, (3, 3), 8),
    (2, False, (3, 1), 8),
    (2, True, (3, 1), 5),
    (4, True, (3, 3), 8),
    (4, False, (3, 3), 5),
    (4, True, (6, 2), 8),     # GQA, 2 KV heads < 4 ranks
    (4, True, (3, 1), 8),     # MQA
]


@pytest.mark.parametrize("p,causal,heads,dv", CONFIGS,
                         ids=[f"p{p}-{'causal' if c else 'full'}-h{h[0]}kv{h[1]}-dv{dv}" for p, c, h, dv in CONFIGS])
def test_ring_attention_matches_sdpa(local_world, p, causal, heads, dv):
    b, (h, hkv), d = 2, heads, 8
    s = 4 * p  # c = 2 tokens per chunk
    q, k, v, w = _inputs(b, h, hkv, s, d, dv, torch.float64)
    out_ref, grads_ref = _reference(q, k, v, w, causal)
    with local_world(p):
        out, grads, fwd, bwd = _run_ring(_cp_axis(p), q, k, v, w, causal)
    assert _max_err(out, out_ref) < 1e-12
    for name, g, g_ref in zip("qkv", grads, grads_ref):
        assert all(x.shape == g_ref.shape for x in _ranks(g)), name
        assert _max_err(g, g_ref) < 1e-12, f"d{name}: {_max_err(g, g_ref)}"

    kv_numel = b * hkv * (s // p) * (d + dv)
    step = ("p2p", kv_numel, kv_numel * 8)
    assert [(r.kind, r.numel, r.send_bytes) for r in fwd if r.kind == "p2p"] == [step] * (p - 1)
    assert [(r.kind, r.numel, r.send_bytes) for r in bwd if r.kind == "p2p"] == [step] * (2 * (p - 1))
    assert {r.axis for r in fwd + bwd} == {"cp"}
    assert all(r.pass_ == "forward" for r in fwd) and all(r.pass_ == "backward" for r in bwd)
    assert Counter(r.kind for r in fwd) == {"p2p": p - 1, "all_gather": 1}
    assert Counter(r.kind for r in bwd) == {"p2p": 2 * (p - 1), "all_gather": 3}


def check_ring_on_local_world(p, *, causal, heads, dtype, impl=None) -> float:
    """Max error of ring attention (out and grads) vs SDPA on p simulated ranks; sets up its own world."""
    import sys

    sys.path.insert(0, str(__import__("pathlib").Path(__file__).resolve().parent))
    from torch.distributed._local_tensor import LocalTensorMode

    from conftest import set_fake_world

    h, hkv = heads
    q, k, v, w = _inputs(2, h, hkv, 4 * p, 8, 8, dtype)
    out_ref, grads_ref = _reference(q, k, v, w, causal)
    set_fake_world(p)
    with LocalTensorMode(p):
        out, grads, _, _ = _run_ring(_cp_axis(p), q, k, v, w, causal, impl=impl)
    assert out.dtype == dtype and all(g.dtype == dtype for g in grads)  # pitfall 14
    return max([_max_err(out, out_ref)] + [_max_err(g, r) for g, r in zip(grads, grads_ref)])


def test_fp32_keeps_dtype(_fake_pg):
    assert check_ring_on_local_world(2, causal=True, heads=(3, 1), dtype=torch.float32) < 1e-5


def _zigzag_pos(seq_len: int, p: int, r: int) -> torch.Tensor:
    chunks = torch.arange(seq_len).chunk(2 * p)
    return torch.cat([chunks[r], chunks[2 * p - 1 - r]])


@pytest.mark.parametrize("p", range(1, 7))
def test_zigzag_schedule_is_the_causal_mask(p):
    """Brute force: for every rank and step, the rows the schedule computes (and their block mask)
    are exactly the allowed (query, key) pairs of the causal mask on global positions."""
    c = 3
    s = 2 * c * p
    for r in range(p):
        q_pos = _zigzag_pos(s, p, r)
        for step in range(p):
            src = (r - step) % p
            allowed = _zigzag_pos(s, p, src)[None, :] <= q_pos[:, None]  # (2c, 2c)
            q_rows, kv_rows, block_causal = zigzag_schedule(step, r, causal=True)
            qs = {"all": slice(None), "second": slice(c, None)}[q_rows]
            ks = {"all": slice(None), "first": slice(None, c)}[kv_rows]
            expected = torch.zeros(2 * c, 2 * c, dtype=torch.bool)
            n_q, n_k = len(range(2 * c)[qs]), len(range(2 * c)[ks])
            block = torch.ones(n_q, n_k, dtype=torch.bool)
            expected[qs, ks] = block.tril() if block_causal else block
            assert torch.equal(allowed, expected), (p, r, step, q_rows, kv_rows, block_causal)
            if step:
                assert int(allowed.sum()) == 2 * c * c  # balanced: every later step is 2c x c scores
            assert zigzag_schedule(step, r, causal=False) == ("all", "all", False)


def test_zigzag_layout_round_trip_and_positions(local_world):
    p, s = 4, 16
    x = torch.arange(2 * s, dtype=torch.float64).view(1, 2, s).requires_grad_()
    with local_world(p):
        cp = _cp_axis(p)
        shard = zigzag_shard(x, -1, cp)
        pos = zigzag_positions(s, cp)
        back = zigzag_unshard(shard, -1, cp)
        (gx,) = torch.autograd.grad((back * back).sum(), x)
    for r, (sh, ps) in enumerate(zip(_ranks(shard), _ranks(pos))):
        assert torch.equal(ps, _zigzag_pos(s, p, r))
        assert torch.equal(sh[0, 0], ps.double()) and torch.equal(sh[0, 1], ps.double() + s)
    assert all(torch.equal(t, x.detach()) for t in _ranks(back))
    assert all(torch.equal(t, 2 * x.detach()) for t in _ranks(gx))


def test_bad_layouts_are_rejected(local_world):
    with local_world(2):
        cp = _cp_axis(2)
        with pytest.raises(ValueError, match="not divisible by 2\\*2"):
            zigzag_shard(torch.zeros(1, 1, 6, 4), 2, cp)
        with pytest.raises(ValueError, match="odd"):
            ring_attention(*(torch.zeros(1, 1, 3, 4) for _ in range(3)), cp, causal=True)
        with pytest.raises(ValueError, match="not divisible by 2\\*2"):
            zigzag_positions(10, cp)


# ----------------------------------------------------------------------------- real processes (gloo)

def gloo_ring_check(causal: bool) -> dict:
    """On each gloo rank: ring attention vs SDPA (fp64, GQA) and what was sent; module level for the pool."""
    import torch.distributed as dist

    p = dist.get_world_size()
    q, k, v, w = _inputs(2, 3, 1, 4 * p, 8, 8, torch.float64, seed=3)
    out_ref, grads_ref = _reference(q, k, v, w, causal)
    out, grads, fwd, bwd = _run_ring(_cp_axis(p), q, k, v, w, causal)
    return {
        "err": max([_max_err(out, out_ref)] + [_max_err(g, r) for g, r in zip(grads, grads_ref)]),
        "p2p": (sum(r.kind == "p2p" for r in fwd), sum(r.kind == "p2p" for r in bwd)),
    }


@pytest.mark.parametrize("world,causal", [(2, True), (2, False), (4, True)],
                         ids=["world2-causal", "world2-full", "world4-causal"])
def test_ring_attention_on_gloo(world, causal):
    """world 2: rank r+1 == r-1; world 4: each step sends to one peer and receives from another."""
    from dist_harness import gloo_pool

    results = gloo_pool(world).run("test_ring_attention:gloo_ring_check", causal)
    for rank, res in enumerate(results):
        assert res["err"] < 1e-12, (rank, res)
        assert res["p2p"] == (world - 1, 2 * (world - 1)), (rank, res)
