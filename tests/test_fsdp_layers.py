"""FSDP gathers grouped per layer (`autopar.runtime.fsdp`, `passes.lower.group_fsdp_gathers_pass`).

Per layer (and per group of parameters outside the layers): one all-gather forward of a flat buffer of its
shards, the next group's prefetched; under reshard (ZeRO-3, the default) one more all-gather backward and the
gathered weights dead after forward; under keep (`fsdp.keep_gathered`) none backward; one reduce-scatter of the
group's gradients backward. Numerics: loss, every gradient and every parameter after an SGD step against one
device, fp64, on LocalTensorMode and on gloo (the asynchronous reduce-scatter and prefetch path).
"""

from __future__ import annotations

import gc
import weakref

import pytest
import torch
from torch.distributed.device_mesh import init_device_mesh

import autopar
from autopar.forms import fsdp as fsdp_form
from autopar.models import Llama, LlamaConfig
from autopar.runtime import fsdp as F
from autopar.runtime.collectives import record_comms
from dist_harness import gloo_pool
from equivalence import run_equivalence

LAYERS = 3
CFG = LlamaConfig(vocab_size=64, seq_len=8, num_layers=LAYERS, num_heads=4, num_kv_heads=2, hidden=16, ffn_hidden=32)


def make_llama():
    return Llama(CFG)


def llama_inputs():
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, CFG.vocab_size, (4, CFG.seq_len), generator=g)
    return ids, torch.roll(ids, -1, 1)


def _groups(model) -> dict[str, int]:
    """Group label -> numel of its parameters (all of them FSDP-sharded on 2 ranks: every dim 0 is even)."""
    out: dict[str, int] = {}
    for n, p in model.named_parameters():
        if n.startswith("layers."):
            label = ".".join(n.split(".")[:2])
        else:
            label = f"(before layers.0)" if n.startswith("embed") else f"(after layers.{LAYERS - 1})"
        out[label] = out.get(label, 0) + p.numel()
    return out


def _plan(model, inputs, mesh, keep: str | None):
    plan = autopar.plan(model, mesh, inputs, plan="fsdp")
    return fsdp_form.keep_gathered(plan, keep) if keep else plan


def _check(res, model, tol=1e-10):
    names = {n for n, _ in model.named_parameters()}
    assert set(res.grad_err) == set(res.param_err) == names
    assert abs(res.loss - res.ref_loss) <= tol * max(1.0, abs(res.ref_loss)), (res.loss, res.ref_loss)
    assert max(res.grad_err.values()) <= tol, res.grad_err
    assert max(res.param_err.values()) <= tol, res.param_err


@pytest.mark.parametrize("keep", [None, "*"])
def test_one_gather_per_layer_matches_one_device(local_world, fp64, keep):
    torch.manual_seed(0)
    model, inputs = make_llama(), llama_inputs()
    groups = _groups(model)
    with local_world(2):
        mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("dp",))
        plan = _plan(model, inputs, mesh, keep)
        res = run_equivalence(model, inputs, (2,), ("dp",), plan=plan)
    _check(res, model)
    nodes = [n for n in res.graph_module.graph.nodes if n.target is F.fsdp_gather]
    assert [n.args[4] for n in nodes] == list(groups), [n.args[4] for n in nodes]  # forward order
    assert [n.args[5] for n in nodes] == [bool(keep) or n.args[4].startswith("(") for n in nodes]
    # the next group's gather issued right after this one's, before its compute: every group but the first
    assert [n.args[1] is not None and n.args[1].target is F.fsdp_prefetch for n in nodes] == [False] + [True] * (
        len(nodes) - 1)
    order = {n: i for i, n in enumerate(res.graph_module.graph.nodes)}
    for a, b in zip(nodes, nodes[1:]):
        first_use = min(order[u] for item in a.users for u in item.users)
        assert order[a] < order[b.args[1]] < first_use, (a, b)
    # exact collectives: per group one all-gather forward, one reduce-scatter backward, one all-gather backward
    # per layer under reshard (the groups outside the layers are kept, as FSDP2's root), none under keep
    gathers = [c for c in res.comms if c[0] == "all_gather"]
    numels = list(groups.values())
    assert [c[3] for c in gathers if c[2] == "forward"] == numels
    again = [] if keep else [n for label, n in groups.items() if not label.startswith("(")]
    assert sorted(c[3] for c in gathers if c[2] == "backward") == sorted(again)
    assert sorted(c[3] for c in res.comms if c[0] == "reduce_scatter") == sorted(numels)
    assert all(c[4] == n * 8 // 2 for c in res.comms if c[0] in ("all_gather", "reduce_scatter") for n in [c[3]])
    assert {c[0] for c in res.comms} <= {"all_gather", "reduce_scatter", "all_reduce"}
    # the rest: the loss's (sum, count) all-reduced forward, as one (`fuse_loss_count_pass`)
    assert [(c[2], c[3]) for c in res.comms if c[0] == "all_reduce"] == [("forward", 2)], res.comms
    rows = [r for r in res.plan.comms if r.fn == "fsdp_gather"]
    assert [r.module for r in rows] == list(groups)
    assert [r.backward for r in rows] == ["reduce_scatter" if keep or r.module.startswith("(") else
                                          "all_gather+reduce_scatter" for r in rows]


def _gathered_buffers(monkeypatch) -> list:
    """Weak references to every buffer of gathered parameters the runtime makes."""
    refs = []
    views = F._full_views

    def spy(buf, shards, spec):
        refs.append(weakref.ref(buf))
        return views(buf, shards, spec)

    monkeypatch.setattr(F, "_full_views", spy)
    return refs


@pytest.mark.parametrize("keep", [None, "layers.1.*"])
def test_gathered_weights_released_after_forward(local_world, fp64, monkeypatch, keep):
    """Reshard: no layer's gathered buffer is alive between forward and backward, and saved tensors seen by hooks
    active around the call (an outer counter) are never views of one; keep (here layer 1 only): that layer's buffer
    is, saved through the outer hooks. The final norm and head stay gathered (FSDP2's root)."""
    torch.manual_seed(0)
    model, inputs = make_llama(), llama_inputs()
    refs = _gathered_buffers(monkeypatch)
    seen = []

    def pack(t):
        seen.append(weakref.ref(t._base if t._base is not None else t))
        return t

    with local_world(2):
        mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("dp",))
        pm = autopar.parallelize(model, mesh, inputs, plan=_plan(model, inputs, mesh, keep))
        refs.clear()
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            loss = pm(*inputs)
        gc.collect()
        alive = [r() is not None for r in refs]
        outer = {id(r()) for r in seen if r() is not None}
        held = [id(r()) in outer for r in refs if r() is not None]
        with record_comms() as recs:
            loss.backward()
    assert len(refs) == len(_groups(model)) and seen
    # groups: embedding (never saved), layers 0, 1, 2, final norm and head (kept, as FSDP2's root)
    assert alive == [i == 4 or (keep is not None and i == 2) for i in range(len(refs))], alive
    assert held == [True] * sum(alive)  # saved through the outer hooks, as any saved tensor
    assert sum(r.kind == "all_gather" and r.pass_ == "backward" for r in recs) == LAYERS - (keep is not None)
    for p in pm.parameters():
        assert p.grad is not None


def test_kept_gathers_stay_kept_when_inputs_change_shape(local_world, fp64):
    """A new input shape re-plans on a new capture (`autopar.relower.replan`): the layers the plan keeps gathered
    stay kept (no re-gather in backward), as in the first program."""
    torch.manual_seed(0)
    model, inputs = make_llama(), llama_inputs()
    with local_world(2):
        mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("dp",))
        pm = autopar.parallelize(model, mesh, inputs, plan=_plan(model, inputs, mesh, "layers.1.*"))
        counts = []
        for batch in (inputs, tuple(t[:2] for t in inputs)):  # the second shape is re-planned
            with record_comms() as recs:
                pm(*batch).backward()
            counts.append(sum(r.kind == "all_gather" and r.pass_ == "backward" for r in recs))
    assert counts == [LAYERS - 1, LAYERS - 1]


def test_two_data_axes(local_world, fp64):
    """FSDP over dp x dp2: one gather per group and axis (the innermost first), one reduce-scatter per group and
    axis (the outermost first), numerics as on one device."""
    torch.manual_seed(0)
    model, inputs = make_llama(), llama_inputs()
    groups = _groups(model)
    with local_world(4):
        res = run_equivalence(model, inputs, (2, 2), ("dp", "dp2"), plan="fsdp")
    _check(res, model)
    fwd = [(c[1], c[3]) for c in res.comms if c[0] == "all_gather" and c[2] == "forward"]
    assert fwd == [x for n in groups.values() for x in (("dp2", n // 2), ("dp", n))], fwd
    rs = [(c[1], c[3]) for c in res.comms if c[0] == "reduce_scatter"]
    assert sorted(rs) == sorted(x for n in groups.values() for x in (("dp", n), ("dp2", n // 2))), rs


def test_param_and_reduce_dtypes(local_world):
    """`param_dtype` casts the shards before the gather; `reduce_dtype` the gradients before the reduce-scatter,
    cast back to the shards' dtype after."""
    with local_world(2):
        from autopar.mesh import resolve_axis
        mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("dp",))
        key = None
        from autopar.mesh import mesh_info
        key = mesh_info(mesh).axes[0].key
        torch.manual_seed(0)
        full_a, full_b = torch.randn(4, 3, dtype=torch.float64), torch.randn(3, 4, dtype=torch.float64)
        a = resolve_axis(key)
        shards = tuple(torch.nn.Parameter(_local(x, d, a)) for x, d in ((full_a, 0), (full_b, 1)))
        outs = F.fsdp_gather(shards, None, (key,), (0, 1), "g", True, torch.float32, torch.float32)
        assert [o.dtype for o in outs] == [torch.float32] * 2
        from equivalence import _worst
        assert _worst((outs[0].double() - full_a).abs().max()) <= 1e-6
        assert _worst((outs[1].double() - full_b).abs().max()) <= 1e-6
        (outs[0].sum() * 3 + (outs[1] * 2).sum()).backward()
        assert [s.grad.dtype for s in shards] == [torch.float64] * 2
        # each rank's gradient of the full parameter summed over 2 ranks, this rank's chunk
        assert _worst((shards[0].grad - 6).abs().max()) == 0 and _worst((shards[1].grad - 4).abs().max()) == 0


def _local(x, dim, axis):
    from autopar.runtime.collectives import _raw_split
    return _raw_split(x, dim, axis)


def gloo_worker(keep):
    torch.manual_seed(0)
    torch.set_default_dtype(torch.float64)
    try:
        import torch.distributed as dist
        from autopar.runtime import collectives as C
        model, inputs = make_llama(), llama_inputs()
        mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("dp",))
        ran, original = [], C._after_backward
        C._after_backward = lambda: (ran.append(1), original())  # the asynchronous reduce-scatters' end of backward
        try:
            res = run_equivalence(model, inputs, (2,), ("dp",), plan=_plan(model, inputs, mesh, keep), steps=2)
        finally:
            C._after_backward = original
        res.plan = res.graph_module = None
        return res, len(ran), dist.get_rank()
    finally:
        torch.set_default_dtype(torch.float32)


@pytest.mark.parametrize("keep", [None, "*"])
def test_gloo_async_matches_one_device(keep):
    torch.manual_seed(0)
    model = make_llama()
    groups = _groups(model)
    for res, ran, _ in gloo_pool(2).run(gloo_worker, keep):
        _check(res, model)
        assert ran >= 2  # the reduce-scatters ran asynchronously, waited for at the end of each backward
        assert res.comm_counts["reduce_scatter.backward"] == len(groups)
        assert res.comm_counts["all_gather.forward"] == len(groups)
        assert res.comm_counts.get("all_gather.backward", 0) == (0 if keep else LAYERS)
