"""The original model released (issue #25): after `parallelize`, the ParallelModule holds no reference to the
model's parameter storage (it keeps a meta copy of the structure to re-capture from, `autopar.weights.meta_copy`),
so the user's own reference is the only one and `del model` frees it. FSDP2's `fully_shard` frees the unsharded
parameters by replacing them in place; `parallelize` returns a new module and leaves the model as it was (tests and
users compare against it), so releasing it is the user's `del model`.

Measured on 2 gloo ranks with a model of 42 MB of fp32 parameters, for dp and fsdp: every original parameter is
collected after `del model` + `gc.collect()`; the tensor storage alive on a rank (every gc-visible tensor's
storage, counted once) grew by the rank's shards and at most 10% more; the resident set size grew by at most 10%
more than the shards, over a baseline taken after one warm-up parallelize (torch.export's and autopar's caches);
then a training step and a step on another batch size (a re-capture from the meta copy) match one device."""

from __future__ import annotations

import gc
import os
import weakref

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from dist_harness import gloo_pool
from equivalence import compare_step

HIDDEN, LAYERS = 1024, 10  # 10 x (1024 x 1024 + 1024) + head: 42 MB of fp32 parameters
FP32 = 1e-5


class Stack(nn.Module):
    def __init__(self, hidden=HIDDEN, layers=LAYERS):
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(hidden, hidden) for _ in range(layers))
        self.head = nn.Linear(hidden, 8)

    def forward(self, x, y):
        for layer in self.layers:
            x = torch.relu(layer(x))
        return F.cross_entropy(self.head(x), y)


def _inputs(batch, hidden=HIDDEN):
    g = torch.Generator().manual_seed(batch)
    return torch.randn(batch, hidden, generator=g), torch.randint(0, 8, (batch,), generator=g)


def _storage_bytes() -> int:
    """Bytes of every distinct non-meta storage behind a gc-visible plain tensor (a DTensor counted by its local one)."""
    seen: dict[int, int] = {}
    for obj in gc.get_objects():
        if type(obj) not in (torch.Tensor, nn.Parameter) or obj.is_meta:  # DTensors, fake tensors: not storage
            continue
        s = obj.untyped_storage()
        seen[s.data_ptr()] = max(seen.get(s.data_ptr(), 0), s.nbytes())
    return sum(seen.values())


def _rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _fixed_mmap_threshold():
    """Large tensors (over 128 KiB) from mmap, returned to the OS when freed: glibc otherwise raises the threshold
    after the first free of an mmapped block and serves later ones from the heap, whose freed pages stay resident
    in fragments, so RSS would measure the allocator's history rather than what is alive."""
    import ctypes
    try:
        ctypes.CDLL("libc.so.6").mallopt(-3, 128 * 1024)  # M_MMAP_THRESHOLD: fixed from now on
    except (OSError, AttributeError):
        pass


def _settle():
    gc.collect()
    try:  # return freed heap pages to the OS so that RSS reflects what is alive
        import ctypes
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass


def released_after_parallelize(plan: str) -> dict:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    import autopar
    mesh = init_device_mesh("cpu", (dist.get_world_size(),), mesh_dim_names=("dp",))
    x = _inputs(8)
    _fixed_mmap_threshold()
    autopar.parallelize(Stack(hidden=64, layers=2), mesh, _inputs(8, 64), plan=plan)  # warm-up: caches, imports
    with torch.device("meta"):
        small = Stack(hidden=64, layers=2)
    autopar.parallelize(small, mesh, _inputs(8, 64), plan=plan)
    # autopar's own: what parallelize of the same structure on the meta device keeps (its shards are allocated
    # uninitialised, never touched, so not resident)
    _settle()
    rss0 = _rss()
    with torch.device("meta"):
        meta = Stack()
    pm = autopar.parallelize(meta, mesh, x, plan=plan)
    _settle()
    own = _rss() - rss0
    del pm, meta
    _settle()
    storage0, rss0 = _storage_bytes(), _rss()
    torch.manual_seed(0)
    model = Stack()
    model_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    originals = [weakref.ref(p) for p in model.parameters()]
    pm = autopar.parallelize(model, mesh, x, plan=plan)
    kept = sum(r() is not None for r in originals)  # before del: the user's reference keeps them
    del model
    _settle()
    shards = sum(p.to_local().untyped_storage().nbytes() for p in pm.parameters())
    out = {"model": model_bytes, "shards": shards, "own": own, "alive_before_del": kept,
           "alive": sum(r() is not None for r in originals),
           "storage": _storage_bytes() - storage0, "rss": _rss() - rss0}
    torch.manual_seed(0)
    ref = Stack()
    out["errs"] = [max(compare_step(pm, ref, x).values()),
                   max(compare_step(pm, ref, _inputs(4)).values())]  # another batch: re-captured from the meta copy
    out["programs"] = len(pm.programs())
    return out


@pytest.mark.parametrize("plan", ["dp", "fsdp"])
def test_parallelize_keeps_no_reference_to_the_original_parameters(plan):
    results = gloo_pool(2).run(released_after_parallelize, plan)
    for r in results:
        assert r["model"] > 40e6, r
        assert r["shards"] == (r["model"] if plan == "dp" else r["model"] // 2), r  # 42 MB: divides evenly
        assert r["alive_before_del"] == 2 * LAYERS + 2, r
        assert r["alive"] == 0, r
        assert r["shards"] <= r["storage"] <= 1.1 * r["shards"], r
        assert r["own"] < 0.1 * r["shards"], r
        assert r["rss"] <= 1.1 * (r["shards"] + r["own"]), r
        assert max(r["errs"]) < FP32, r
        assert r["programs"] == 2, r


def test_meta_copy_keeps_the_structure_and_none_of_the_storage():
    from autopar.weights import meta_copy

    class Tied(nn.Module):
        def __init__(self):
            super().__init__()
            self.emb = nn.Embedding(10, 4)
            self.out = nn.Linear(4, 10, bias=False)
            self.out.weight = self.emb.weight
            self.register_buffer("scale", torch.ones(4), persistent=False)
            self.mask = torch.tril(torch.ones(3, 3))  # a plain tensor attribute: a constant of the forward
            self.frozen = nn.Parameter(torch.zeros(2), requires_grad=False)

    model = Tied()
    model.emb.weight.grad = torch.ones_like(model.emb.weight)
    copy = meta_copy(model)
    assert all(p.is_meta for p in copy.parameters()) and all(b.is_meta for b in copy.buffers())
    assert copy.out.weight is copy.emb.weight  # tied stays tied
    assert copy.emb.weight.grad is None and not copy.frozen.requires_grad
    assert "scale" in copy._non_persistent_buffers_set
    assert copy.mask is model.mask  # shared, not copied
    assert [(n, p.shape, p.dtype) for n, p in copy.named_parameters()] == \
        [(n, p.shape, p.dtype) for n, p in model.named_parameters()]
    assert not any(p.is_meta for p in model.parameters())  # the model is left as it was
