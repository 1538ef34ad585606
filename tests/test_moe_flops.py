"""Per-rank compute of an MoE model: each rank runs 1/world of the single-device FLOPs (issue #12 item 5).

Hugging Face Mixtral from the zoo (4 experts, top-2, 2 layers, fp64) on 2 real gloo ranks, each process
counting its own forward+backward with `FlopCounterMode` (so the counts are of this rank's local shapes),
against the same counter around the single-device model:

* `plan="dp"`: the experts are replicated and run on this rank's half of the tokens: every rank counts
  exactly half the single-device FLOPs (router included: it runs on the rank's tokens too);
* `moe: expert`: the tokens go to the rank that owns their expert (all-to-all), so a rank runs the non-expert
  half plus the assignments routed to its own experts, known exactly from the single-device routing: the two
  ranks sum to the single-device count (nothing runs twice: no recomputation in backward, no dense or padded
  expert matmul); the spread between ranks is the batch's routing imbalance (about 0.6% here; each rank
  within 1.10x of single/world).
* The first step after `parallelize` counts what the second does: verifying the MoE blocks (an eager run of
  each experts module, forward and backward, on the example tokens) happens once, inside `parallelize` or a
  call that re-captures the model for a new condition (here: switching to train mode), never per step; and
  counting such a call with `FlopCounterMode` works (its module hooks used to break the verification's
  gradient call).

The baseline must see the experts: Hugging Face's default experts implementation runs `aten._grouped_mm`, for
which `FlopCounterMode` has no formula (it counts 0), so per-rank / single-device reads about 1.67 for `dp` on
this model (the issue's "1.69x": the experts' FLOPs are missing from the denominator, not run twice). The zoo
builds Mixtral with eager experts (F.linear per expert); `GROUPED_MM_FLOPS` gives the counter a formula for the
default implementation, and the same ratios hold under it (`test_default_experts_implementation_...`).

A block autopar cannot capture at all (an MoE routing on a data-dependent Python branch) runs as one replicated
opaque node: its forward now runs once per step (the opaque custom op ran it under no_grad and again in backward;
FlopCounterMode cannot see inside a custom op, so only the module's call count shows it).
"""

from __future__ import annotations

import copy

import torch
from torch import nn
from torch.distributed.device_mesh import init_device_mesh

import autopar
from dist_harness import gloo_pool

WORLD = 2
IMBALANCE = 1.10  # expert parallel: a rank's FLOPs / (single-device / world), routing imbalance of this batch


def _grouped_mm_flops(a, b, *args, out_val=None, **kwargs) -> int:
    """aten._grouped_mm: 2D x 3D (rows grouped by expert), 2D x 2D (the weight gradient, grouped over the
    contracted dim), 3D x 2D, 3D x 3D (batched)."""
    a, b = a.shape, b.shape
    if len(a) == 2 and len(b) == 2:
        return 2 * a[0] * a[1] * b[1]
    if len(a) == 2:
        return 2 * a[0] * a[1] * b[2]
    if len(b) == 2:
        return 2 * a[1] * a[2] * b[1]
    return 2 * a[0] * a[1] * a[2] * b[2]


_grouped_mm_flops._get_raw = True  # FlopCounterMode hands it the tensors (it reads their shapes itself)
GROUPED_MM_FLOPS = {torch.ops.aten._grouped_mm: _grouped_mm_flops}


def _flops(fn, mapping=None) -> int:
    from torch.utils.flop_counter import FlopCounterMode
    fc = FlopCounterMode(display=False, custom_mapping=mapping or {})
    with fc:
        fn()
    return fc.get_total_flops()


def _experts_modules(model) -> list:
    return [m for n, m in model.named_modules() if n.endswith("mlp.experts")]


def per_rank_flops(plans, dtype: str = "fp64", relower: bool = False) -> dict:
    """In a gloo worker: the single-device FLOPs of one forward+backward, the routing (assignments per expert
    per layer), and for each (name, plan, overrides) in `plans` this rank's FLOPs of its first two steps (and, with
    `relower`, of the train-mode call that re-captures the model and of the train step after it)."""
    from torch.distributed.device_mesh import init_device_mesh

    import autopar
    import zoo

    torch.manual_seed(0)
    torch.set_default_dtype(torch.float64)
    try:
        model, inputs, _ = zoo.FAMILIES["mixtral"]()
        mapping = None
        if dtype == "fp32":  # Hugging Face's default: fp32 weights, experts through aten._grouped_mm
            model = model.float()
            model.m.config._experts_implementation = "grouped_mm"
            mapping = GROUPED_MM_FLOPS
        ref = copy.deepcopy(model)
        routed = []
        hooks = [m.register_forward_hook(lambda m, a, o: routed.append(
            torch.bincount(a[1].reshape(-1), minlength=m.gate_up_proj.shape[0]).tolist())) for m in _experts_modules(ref)]
        single = _flops(lambda: ref(**inputs).backward(), mapping)
        for h in hooks:
            h.remove()
        gate_up, down = _experts_modules(ref)[0].gate_up_proj, _experts_modules(ref)[0].down_proj
        out = {"single": single, "routed": routed, "row_flops": 3 * 2 * (gate_up[0].numel() + down[0].numel()),
               "blind": _flops(lambda: copy.deepcopy(model)(**inputs).backward())}
        mesh = init_device_mesh("cpu", (WORLD,), mesh_dim_names=("dp",))
        for name, plan, overrides in plans:
            pm = autopar.parallelize(copy.deepcopy(model), mesh, inputs, plan=plan, overrides=overrides)
            steps = [_flops(lambda: pm(**inputs).backward(), mapping) for _ in range(2)]
            if relower:
                pm.train()
                steps += [_flops(lambda: pm(**inputs).backward(), mapping) for _ in range(2)]
            out[name] = steps
        return out
    finally:
        torch.set_default_dtype(torch.float32)


def _check(results, relower: bool) -> None:
    single = results[0]["single"]
    routed = results[0]["routed"]  # per layer: assignments per expert on one device
    row = results[0]["row_flops"]  # one assignment's expert FLOPs, forward and backward
    E = len(routed[0])
    experts = row * sum(map(sum, routed))  # one expert run per assignment, forward and backward
    assert all(r["single"] == single and r["routed"] == routed for r in results)
    rest = single - experts  # embeddings, attention projections, routers, lm head: split with the tokens
    assert rest % WORLD == 0 and single % WORLD == 0
    for r in results:  # dp: half the tokens, all experts replicated: exactly half
        assert r["dp"][:2] == [single // WORLD] * 2, (r["dp"], single)
    mine = [row * sum(counts[e] for counts in routed for e in range(rank * E // WORLD, (rank + 1) * E // WORLD))
            for rank in range(WORLD)]
    for rank, r in enumerate(results):  # expert parallel: half the rest, plus the assignments to its own experts
        assert r["ep"][:2] == [rest // WORLD + mine[rank]] * 2, (rank, r["ep"], rest // WORLD + mine[rank])
        assert r["ep"][0] <= IMBALANCE * single / WORLD, (rank, r["ep"][0] / (single / WORLD))
    assert sum(r["ep"][0] for r in results) == single  # nothing runs twice
    if relower:  # the call that re-captures for train mode verifies again, once; the train step after it does not
        for r in results:
            assert r["dp"][2] > r["dp"][0] and r["dp"][3] == r["dp"][0], r["dp"]


def test_moe_per_rank_flops_are_one_over_world():
    plans = [("dp", "dp", None), ("ep", "dp", {"moe": "expert"})]
    results = gloo_pool(WORLD).run(per_rank_flops, plans, "fp64", True)
    _check(results, relower=True)
    # the default counter without a formula for grouped matmuls: the fp64 eager experts are seen (mm)
    assert results[0]["blind"] == results[0]["single"]


def test_default_experts_implementation_per_rank_flops_are_one_over_world():
    """fp32 with Hugging Face's default `grouped_mm` experts: the counter needs `GROUPED_MM_FLOPS` to see them;
    without it the single-device count misses every expert FLOP (the per-rank ratio reads ~1.67, not 0.5)."""
    plans = [("dp", "dp", None), ("ep", "dp", {"moe": "expert"})]
    results = gloo_pool(WORLD).run(per_rank_flops, plans, "fp32", False)
    _check(results, relower=False)
    r = results[0]
    experts = r["row_flops"] * sum(map(sum, r["routed"]))
    assert r["blind"] == r["single"] - experts  # aten._grouped_mm counts 0 FLOPs without a formula


# ----------------------------------------------------------------------------- an opaque block runs its forward once

class _Untraceable(nn.Module):
    """Routing on a data-dependent Python branch (an MoE autopar cannot capture takes this road): torch.export
    cannot trace it, so it becomes one opaque node, replicated."""

    def __init__(self):
        super().__init__()
        self.up, self.down = nn.Linear(16, 32), nn.Linear(32, 16)

    def forward(self, x):
        h = self.up(x)
        if h.sum() > 0:
            h = torch.relu(h)
        return self.down(h)


class _WithUntraceable(nn.Module):
    def __init__(self):
        super().__init__()
        self.inp, self.blk, self.head = nn.Linear(16, 16), _Untraceable(), nn.Linear(16, 1)

    def forward(self, x, y):
        return ((self.head(self.blk(self.inp(x))) - y) ** 2).mean()


def test_opaque_block_forward_runs_once_per_step(local_world, fp64):
    """The opaque node's custom op runs its module under no_grad and recomputes it in backward; the lowered node
    calls the module under autograd instead: one forward per step (it ran twice), same numerics."""
    from equivalence import run_equivalence

    torch.manual_seed(0)
    ref = _WithUntraceable()
    inputs = (torch.randn(8, 16), torch.randn(8, 1))
    with local_world(2):
        res = run_equivalence(ref, inputs, (2,), ("dp",), plan="dp", steps=1)
        assert any(n.startswith("blk captured as one opaque node") for n in res.plan.notes), res.plan.notes
        assert res.max_err() < 1e-12, res
        model = copy.deepcopy(ref)
        pm = autopar.parallelize(model, init_device_mesh("cpu", (2,), mesh_dim_names=("dp",)), inputs, plan="dp")
        calls = []
        handle = model.blk.register_forward_hook(lambda *a: calls.append(1))  # the module the opaque node runs
        try:
            pm(*inputs).backward()
        finally:
            handle.remove()
    assert len(calls) == 1, f"the opaque block's forward ran {len(calls)} times in one step"
