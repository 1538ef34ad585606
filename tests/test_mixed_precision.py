"""Mixed precision as users specify it: `mp_policy=MixedPrecisionPolicy(...)` (`autopar.precision`).

The reference is one device doing exactly what the policy means: fp32 master parameters, a bf16 copy that computes
(forward and backward in bf16), its gradients cast to fp32 and summed there, an optimizer step on the masters.
For the data-parallel plans (dp, fsdp) the reference splits the batch as the plan does (two halves) and sums the two
halves' bf16 gradients in fp32, which is what a reduction in fp32 of the ranks' bf16 gradients is: the parallel run
then matches it to fp32 rounding (the only differences left are the order of fp32 additions in the loss' global
mean; achieved: 0.0 on every gradient and parameter, see `test_equivalence`). For megatron (TP on 2 ranks) each rank
computes a partial sum of the row-parallel matmuls in bf16, rounded to bf16 before the (bf16) all-reduce, as
Megatron-LM does: the run differs from the one-device bf16 run by bf16 rounding, so it is held to the accuracy of
that run itself: against the fp64 result, its error is within 1.5x the one-device bf16 run's error plus one bf16
ulp of the tensor's largest value (measured: see `test_equivalence`).

Asserted besides: the collectives' dtypes and bytes as run (`record_comms`: gathers in bf16, gradient reductions
in fp32) and as priced in the plan (`Plan.comms`), the masters stay fp32 and the optimizer steps them, the estimate's
state bytes (Adam, bf16 / fp32: 16 B per parameter), a plan runs only the policy it was made for, bad policy input,
and, on gloo, FSDP2's `fully_shard(mp_policy=...)`.
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy

import autopar
from autopar.models import GPT, GPTConfig
from autopar.runtime.collectives import record_comms
from dist_harness import gloo_pool

BF16 = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
LR = 0.1
BF16_ULP = 2.0 ** -8  # bf16 has 8 significant bits: one ulp relative to the value


def make_gpt():
    torch.manual_seed(0)
    return GPT(GPTConfig(vocab_size=128, seq_len=16, num_layers=2, num_heads=4, hidden=32))


def gpt_inputs():
    g = torch.Generator().manual_seed(1)
    return torch.randint(0, 128, (4, 16), generator=g), torch.randint(0, 128, (4, 16), generator=g)


def policy_step(model: nn.Module, inputs: tuple, num_shards: int, dtype=torch.bfloat16):
    """One device, the policy's meaning: fp32 masters (a copy of `model`), a `dtype` compute copy run on each of
    `num_shards` equal slices of the batch (its loss weighted 1/num_shards, a power of two: exact), the copy's
    gradients cast to fp32 and summed, one SGD step on the masters. (loss, {name: fp32 grad}, {name: master after})."""
    master = copy.deepcopy(model)
    compute = copy.deepcopy(model).to(dtype)
    grads = {n: torch.zeros_like(p) for n, p in master.named_parameters()}
    loss = 0.0
    for shard in zip(*(x.chunk(num_shards) for x in inputs)):
        compute.zero_grad()
        part = compute(*shard) / num_shards
        part.backward()
        loss += float(part)
        for n, p in compute.named_parameters():
            grads[n] += p.grad.to(grads[n].dtype)
    with torch.no_grad():
        after = {n: p - LR * grads[n] for n, p in master.named_parameters()}
    return loss, grads, after


def _value(t) -> float:
    """The largest over simulated ranks (LocalTensor) of a scalar tensor."""
    lt = getattr(t, "_local_tensors", None)
    return max(float(v) for v in lt.values()) if lt is not None else float(t)


_RUNS: dict = {}


def run_policy(local_world, plan: str, mesh_shape=(2,), names=("dp",)):
    """Parallelise the GPT under `BF16`, one step with SGD: (pm, loss, {name: grad}, {name: param after}, records,
    {name: (param dtype, local dtype, grad dtype)}). Run once per plan and mesh, shared by the tests that read it."""
    key = (plan, tuple(mesh_shape), tuple(names))
    if key not in _RUNS:
        _RUNS[key] = _run_policy(local_world, plan, mesh_shape, names)
    return _RUNS[key]


def _run_policy(local_world, plan, mesh_shape, names):
    model, inputs = make_gpt(), gpt_inputs()
    with local_world(int(torch.tensor(mesh_shape).prod())):
        mesh = init_device_mesh("cpu", mesh_shape, mesh_dim_names=names)
        pm = autopar.parallelize(model, mesh, inputs, plan=plan, mp_policy=BF16)
        opt = torch.optim.SGD(pm.parameters(), lr=LR)
        with record_comms() as recs:
            loss = pm(*inputs)
            loss.backward()
        grads = {n: p.grad.full_tensor() for n, p in pm.named_parameters()}
        dtypes = {n: (p.dtype, p.to_local().dtype, p.grad.dtype) for n, p in pm.named_parameters()}
        opt.step()
        after = {n: p.full_tensor() for n, p in pm.named_parameters()}
    return pm, loss, grads, after, recs, dtypes


def _max_abs(a, b) -> float:
    return _value((a - b).abs().max())


@pytest.mark.parametrize("plan", ["dp", "fsdp", "megatron"])
def test_equivalence(local_world, plan):
    names = ("tp",) if plan == "megatron" else ("dp",)
    pm, loss, grads, after, _, dtypes = run_policy(local_world, plan, names=names)
    model, inputs = make_gpt(), gpt_inputs()
    shards = 1 if plan == "megatron" else 2  # the batch as the plan splits it
    ref_loss, ref_grads, ref_after = policy_step(model, inputs, shards)
    assert set(grads) == set(ref_grads)
    # the masters: fp32, their gradients fp32, stepped by the optimizer (they moved, as the reference's did)
    assert all(d == (torch.float32,) * 3 for d in dtypes.values()), dtypes
    assert pm.plan.precision == "param_dtype=bfloat16 reduce_dtype=float32 output_dtype=None cast_forward_inputs=True"
    if plan != "megatron":
        errs = {"loss": abs(_value(loss) - ref_loss)} \
            | {f"grad {n}": _max_abs(g, ref_grads[n]) for n, g in grads.items()} \
            | {f"param {n}": _max_abs(p, ref_after[n]) for n, p in after.items()}
        # the same bf16 ops on the same rows, the same fp32 sums: equal up to fp32 rounding of the loss' mean
        assert max(errs.values()) <= 1e-6, sorted(errs.items(), key=lambda kv: -kv[1])[:5]
        return
    truth_loss, truth_grads, truth_after = policy_step(model, inputs, 1, dtype=torch.float64)
    assert abs(_value(loss) - truth_loss) <= 1.5 * abs(ref_loss - truth_loss) + BF16_ULP * abs(truth_loss)
    for n, g in grads.items():
        t = truth_grads[n]
        bound = 1.5 * float((ref_grads[n].double() - t).abs().max()) + BF16_ULP * float(t.abs().max())
        assert _max_abs(g.double(), t) <= bound, (n, _max_abs(g.double(), t), bound)
        p_bound = LR * bound + 1e-6  # the step's difference is LR times the gradient's, plus fp32 rounding
        assert _max_abs(after[n].double(), truth_after[n]) <= LR * float((ref_grads[n].double() - t).abs().max()) \
            * 1.5 + p_bound, n


def test_fsdp_on_two_axes(local_world):
    """fsdp over a (2, 2) mesh: each FSDP group (a layer's parameters, or those before / after the layers) is
    gathered as one flat buffer on one axis and then the other, in bf16 both times (forward, and again in backward for
    the resharded layers), and its gradients reduce-scattered as one fp32 buffer on both axes, so that no reduced
    gradient is rounded to bf16 on the way: the run equals the policy's one-device reference on the batch in four
    shards, as on one axis; the plan prices the bytes the run moves."""
    pm, loss, grads, after, recs, dtypes = run_policy(local_world, "fsdp", mesh_shape=(2, 2), names=("dp", "tp"))
    ref_loss, ref_grads, ref_after = policy_step(make_gpt(), gpt_inputs(), 4)
    assert all(d == (torch.float32,) * 3 for d in dtypes.values()), dtypes
    errs = {"loss": abs(_value(loss) - ref_loss)} | {f"grad {n}": _max_abs(g, ref_grads[n]) for n, g in grads.items()} \
        | {f"param {n}": _max_abs(p, ref_after[n]) for n, p in after.items()}
    assert max(errs.values()) <= 1e-6, sorted(errs.items(), key=lambda kv: -kv[1])[:5]
    assert {r.dtype for r in recs if r.kind == "all_gather"} == {"bfloat16"}
    assert {r.dtype for r in recs if r.pass_ == "backward" and r.kind != "all_gather"} == {"float32"}
    groups = [c for c in pm.plan.comms if c.fn == "fsdp_gather"]
    assert [c.module for c in groups] == ["(before h.0)", "h.0", "h.1", "(after h.1)"]
    assert [c.module for c in groups if "all_gather" in c.backward] == ["h.0", "h.1"]  # the layers, resharded
    assert len(_by(recs, "all_gather", "backward")) == 2 * 2  # per resharded layer, one per axis
    assert len(_by(recs, "reduce_scatter", "backward")) == 2 * len(groups)
    assert sum(r.send_bytes for r in recs if r.kind == "all_gather" and r.pass_ == "forward") \
        == sum(c.bytes_forward for c in pm.plan.comms if c.forward == "all_gather")
    assert sum(r.send_bytes for r in recs if r.pass_ == "backward") == sum(c.bytes_backward for c in pm.plan.comms)


def _by(recs, kind, pass_):
    return [r for r in recs if r.kind == kind and r.pass_ == pass_]


def test_dp_collectives(local_world):
    """dp: every gradient reduction of parameters is fp32 (the bucket, the positional embedding's included: its
    reduction moves from its output onto its weight, `replicated_reductions_to_parameters_pass`), priced so in the
    plan; forward reductions are the (fp32) loss' scalars."""
    pm, _, _, _, recs, _ = run_policy(local_world, "dp")
    back = _by(recs, "all_reduce", "backward")
    assert back and all(r.dtype == "float32" for r in back), back
    params = sum(p.numel() for p in pm.parameters())
    # one bucket holds every parameter's gradient, wpe's too (its output's gradient, 16x32, is not reduced)
    assert [r.numel for r in back] == [params]
    assert sum(r.send_bytes for r in back) == sum(c.bytes_backward for c in pm.plan.comms)
    # the loss's (sum, valid count), one all-reduce (`fuse_loss_count_pass`)
    assert [(r.dtype, r.numel) for r in _by(recs, "all_reduce", "forward")] == [("float32", 2)]
    assert {r.kind for r in recs} == {"all_reduce"}


def test_reduce_dtype_bf16(local_world):
    """reduce_dtype=bf16 (FSDP2's default when only param_dtype is given): the bucket is all-reduced in bf16 and the
    gradients come back fp32, each the bf16 sum of the ranks' bf16 gradients."""
    model, inputs = make_gpt(), gpt_inputs()
    with local_world(2):
        mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("dp",))
        pm = autopar.parallelize(model, mesh, inputs, plan="dp", mp_policy=MixedPrecisionPolicy(
            param_dtype=torch.bfloat16))
        with record_comms() as recs:
            pm(*inputs).backward()
        assert [r.dtype for r in _by(recs, "all_reduce", "backward")] == ["bfloat16"]  # one bucket, wpe's in it
        assert all(p.grad.dtype == torch.float32 for p in pm.parameters())
        grads = {n: p.grad.full_tensor() for n, p in pm.named_parameters()}
    compute = copy.deepcopy(make_gpt()).to(torch.bfloat16)
    halves = []
    for shard in zip(*(x.chunk(2) for x in inputs)):
        compute.zero_grad()
        (compute(*shard) / 2).backward()
        halves.append({n: p.grad.clone() for n, p in compute.named_parameters()})
    assert max(_max_abs(g, (halves[0][n] + halves[1][n]).float()) for n, g in grads.items()) == 0


def test_fsdp_collectives(local_world):
    """fsdp: one all-gather per FSDP group (the embedding before the layers, each layer, the final norm after them),
    its shards cast to bf16 before it (bf16 bytes); each layer (resharded after forward) gathered again in backward, in
    bf16; one fp32 reduce-scatter per group; run and plan agree on the bytes."""
    pm, _, _, _, recs, _ = run_policy(local_world, "fsdp")
    sizes = {n: p.numel() for n, p in pm.named_parameters()}
    group = {label: sum(k for n, k in sizes.items() if n.startswith(prefix))
             for label, prefix in [("(before h.0)", "wte."), ("h.0", "h.0."), ("h.1", "h.1."), ("(after h.1)", "ln_f.")]}
    assert sum(group.values()) == sum(sizes.values()) - sizes["wpe.weight"]
    gathers, scatters = _by(recs, "all_gather", "forward"), _by(recs, "reduce_scatter", "backward")
    regathers = _by(recs, "all_gather", "backward")
    assert all(r.dtype == "bfloat16" for r in gathers + regathers), gathers + regathers
    assert all(r.dtype == "float32" for r in scatters), scatters
    # every group's gather in forward order; wpe is gathered by itself (reduced where its output meets the batch)
    assert [r.numel for r in gathers] == [sizes["wpe.weight"], *group.values()]
    assert [r.numel for r in regathers] == [group["h.1"], group["h.0"]]  # backward order
    assert [r.numel for r in scatters] == [group[k] for k in ("(after h.1)", "h.1", "h.0", "(before h.0)")]
    assert [(r.dtype, r.numel) for r in _by(recs, "all_reduce", "backward")] == [("float32", 16 * 32)]
    # ring all-gather: each rank sends (p-1)/p of the gathered tensor: 2 bytes per element at p=2, half of that
    assert all(r.send_bytes == 2 * r.numel // 2 for r in gathers + regathers)
    assert all(r.send_bytes == 4 * r.numel // 2 for r in scatters)
    rows = {c.module: c for c in pm.plan.comms if c.fn == "fsdp_gather"}
    assert list(rows) == list(group)
    assert all(rows[k].bytes_forward == group[k] for k in group)  # 2 bytes per element, half of it sent
    assert all(rows[k].bytes_backward == 2 * group[k] + (group[k] if k.startswith("h.") else 0) for k in group)
    assert sum(r.send_bytes for r in regathers + scatters) == sum(c.bytes_backward for c in rows.values())


def test_megatron_collectives(local_world):
    """megatron: the activations' all-reduces (forward after row-parallel linears, backward before column-parallel
    ones) run in bf16, as the model computes; fp32 only inside the vocab-parallel cross-entropy, whose logits the
    model upcasts (max, sum of exponentials, target logit per token); the plan prices the activations at 2 bytes."""
    pm, _, _, _, recs, _ = run_policy(local_world, "megatron", names=("tp",))
    tokens = 4 * 16
    assert [(r.pass_, r.numel) for r in recs if r.dtype == "float32"] == [("forward", tokens)] * 3
    acts = [r for r in recs if r.dtype == "bfloat16"]
    assert sorted((r.kind, r.pass_, r.numel) for r in acts) == sorted(
        [("all_reduce", "forward", tokens * 32)] * 5 + [("all_reduce", "backward", tokens * 32)] * 5)
    assert sum(r.send_bytes for r in acts) == pm.plan.comm_bytes_per_step()  # 2 bytes per element


def test_adam_state_bytes_and_compute_dtype():
    """The estimate prices the masters: Adam under bf16 / fp32 holds 16 B per parameter (fp32 parameter, fp32
    gradient, two fp32 moments), as an fp32 model does, not the 8 B of the bf16 graph's parameters; compute at bf16."""
    from autopar.estimate import state_bytes_per_element
    assert state_bytes_per_element(torch.float32, torch.bfloat16, torch.float32, "adam") == 16
    assert state_bytes_per_element(torch.float32, torch.bfloat16, torch.bfloat16, "sgd") == 8
    model = nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 64))
    x = torch.randn(8, 64)
    numel = sum(p.numel() for p in model.parameters())

    def state(plan):
        return sum(s.parameters_bytes + s.gradients_bytes + s.optimizer_bytes for s in plan.estimate.sites) / numel

    mixed = autopar.plan(model, {"dp": 2}, (x,), plan="dp", mp_policy=BF16)
    assert state(mixed) == pytest.approx(16, abs=0.01)
    assert state(autopar.plan(model, {"dp": 2}, (x,), plan="dp")) == pytest.approx(16, abs=0.01)
    assert state(autopar.plan(copy.deepcopy(model).to(torch.bfloat16), {"dp": 2}, (x.bfloat16(),),
                              plan="dp")) == pytest.approx(8, abs=0.01)
    # compute at bf16's rate (H100: 989 vs 67 TFLOP/s), activations in bf16, gradients reduced in fp32 bytes
    # (large enough that the presets' achieved matmul rates are near their best: small calls pay a fixed cost)
    with torch.device("meta"):
        big, xb = nn.Sequential(nn.Linear(8192, 8192), nn.ReLU(), nn.Linear(8192, 8192)), torch.randn(8192, 8192)
    full, half = (autopar.plan(big, {"dp": 2}, (xb,), plan="dp", cluster="h100", mp_policy=mp) for mp in (None, BF16))
    compute, acts = (lambda p: sum(s.compute_s for s in p.estimate.sites)), \
        (lambda p: sum(s.activations_bytes for s in p.estimate.sites))
    assert compute(half) < compute(full) / 10
    assert acts(half) == acts(full) / 2
    assert half.estimate.comm_bytes_per_step == full.estimate.comm_bytes_per_step


def test_plan_keeps_its_policy(local_world):
    """A plan made under one policy runs only under that policy: saved and loaded it keeps it; given without it (or
    with another) it raises, saying which."""
    model, inputs = make_gpt(), gpt_inputs()
    made = autopar.plan(model, {"dp": 2}, inputs, plan="dp", mp_policy=BF16)
    assert autopar.Plan.from_json(made.to_json()).precision == made.precision
    assert f"mixed precision: {made.precision}" in made.table()
    fp32 = autopar.plan(model, {"dp": 2}, inputs, plan="dp")
    assert fp32.precision == "" and fp32.graph != made.graph  # the graph captured under bf16 is another program
    with local_world(2):
        mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("dp",))
        with pytest.raises(ValueError, match="was made for mixed precision param_dtype=bfloat16.*mp_policy gives none"):
            autopar.parallelize(copy.deepcopy(model), mesh, inputs, plan=made)
        other = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.bfloat16)
        with pytest.raises(ValueError, match="reduce_dtype=float32.*mp_policy gives param_dtype=bfloat16 "
                                             "reduce_dtype=bfloat16"):
            autopar.parallelize(copy.deepcopy(model), mesh, inputs, plan=made, mp_policy=other)
        pm = autopar.parallelize(copy.deepcopy(model), mesh, inputs, plan=made, mp_policy=BF16)
        assert pm.plan.precision == made.precision


def test_relowered_program_keeps_the_policy(local_world):
    """Another batch size re-captures the model: under the same policy (bf16 compute, fp32 gradients), and an
    output_dtype is applied to every call's outputs."""
    model, (tokens, labels) = make_gpt(), gpt_inputs()
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32, output_dtype=torch.float64)
    with local_world(2):
        mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("dp",))
        pm = autopar.parallelize(model, mesh, (tokens, labels), plan="fsdp", mp_policy=policy)
        loss = pm(tokens[:2], labels[:2])
        assert loss.dtype == torch.float64 and len(pm.programs()) == 2
        with record_comms() as recs:
            loss.backward()
        assert {r.dtype for r in recs if r.kind == "reduce_scatter"} == {"float32"}
        assert all(p.grad.dtype == torch.float32 for p in pm.parameters())
    ref_loss, ref_grads, _ = policy_step(make_gpt(), (tokens[:2], labels[:2]), 2)
    assert abs(_value(loss) - ref_loss) <= 1e-6
    assert max(_max_abs(p.grad.full_tensor(), ref_grads[n]) for n, p in pm.named_parameters()) <= 1e-6


@pytest.mark.parametrize("policy, error, match", [
    ("bf16", TypeError, "mp_policy must be a torch.distributed.fsdp.MixedPrecisionPolicy, got str"),
    (MixedPrecisionPolicy(param_dtype=torch.int8), ValueError, r"mp_policy.param_dtype must be a floating dtype.*"
                                                                 r"got torch.int8"),
    (MixedPrecisionPolicy(reduce_dtype=torch.float8_e4m3fn), ValueError, "mp_policy.reduce_dtype must be a floating"),
])
def test_bad_policy(policy, error, match):
    model = nn.Linear(4, 4)
    with pytest.raises(error, match=match):
        autopar.plan(model, {"dp": 2}, (torch.randn(2, 4),), plan="dp", mp_policy=policy)


# ----------------------------------------------------------------------------- FSDP2 on gloo

def fsdp2_worker():
    """On each gloo rank: autopar's fsdp plan and FSDP2 (`fully_shard` per block and the root, same policy) on the
    same GPT and batch: the largest difference of the loss, the gradients and the parameters after one SGD step."""
    import torch.distributed as dist
    from torch.distributed.fsdp import fully_shard
    model, inputs = make_gpt(), gpt_inputs()
    mesh = init_device_mesh("cpu", (dist.get_world_size(),), mesh_dim_names=("dp",))
    pm = autopar.parallelize(copy.deepcopy(model), mesh, inputs, plan="fsdp", mp_policy=BF16)
    ref = copy.deepcopy(model)
    for block in ref.h:
        fully_shard(block, mesh=mesh, mp_policy=BF16)
    fully_shard(ref, mesh=mesh, mp_policy=BF16)
    rank = dist.get_rank()
    shard = tuple(x.chunk(dist.get_world_size())[rank] for x in inputs)  # FSDP2 takes each rank's own batch
    errs = {}
    opts = [torch.optim.SGD(pm.parameters(), lr=LR), torch.optim.SGD(ref.parameters(), lr=LR)]
    loss = pm(*inputs)
    loss.backward()
    ref_loss = ref(*shard)
    ref_loss.backward()  # FSDP2 averages the gradients over the ranks: the mean of the rank means
    ref_mean = ref_loss.detach().clone()
    dist.all_reduce(ref_mean)
    errs["loss"] = abs(float(loss) - float(ref_mean) / dist.get_world_size())
    theirs = dict(ref.named_parameters())
    for n, p in pm.named_parameters():
        g = theirs[n].grad
        errs[f"grad {n}"] = float((p.grad.full_tensor() - g.full_tensor()).abs().max())
        errs[f"dtype {n}"] = float(p.grad.dtype != g.dtype or p.dtype != theirs[n].dtype)
    for o in opts:
        o.step()
    for n, p in pm.named_parameters():
        errs[f"param {n}"] = float((p.full_tensor() - theirs[n].full_tensor()).abs().max())
    return errs


def dp_worker():
    """On each gloo rank (the data-parallel buckets are all-reduced asynchronously there): the dp plan under BF16 and
    under bf16 reductions against the policy's one-device reference on the batch in two halves."""
    import torch.distributed as dist
    model, inputs = make_gpt(), gpt_inputs()
    mesh = init_device_mesh("cpu", (dist.get_world_size(),), mesh_dim_names=("dp",))
    errs = {}
    for name, policy in (("fp32", BF16), ("bf16", MixedPrecisionPolicy(param_dtype=torch.bfloat16))):
        pm = autopar.parallelize(copy.deepcopy(model), mesh, inputs, plan="dp", mp_policy=policy)
        with record_comms() as recs:
            pm(*inputs).backward()
        errs[f"{name} reduced in"] = {r.dtype for r in recs if r.pass_ == "backward"}
        errs[f"{name} grad dtypes"] = {p.grad.dtype for p in pm.parameters()}
        grads = {n: p.grad.full_tensor() for n, p in pm.named_parameters()}
        if name == "fp32":
            _, ref, _ = policy_step(model, inputs, 2)
            errs["fp32 max error"] = max(float((g - ref[n]).abs().max()) for n, g in grads.items())
    return errs


def test_dp_on_gloo():
    """On real processes the dp buckets are all-reduced asynchronously: under BF16 in fp32 and equal to the policy's
    reference; under bf16 reductions in bf16, the gradients cast back to fp32 when the reduction is waited for."""
    for errs in gloo_pool(2).run(dp_worker):
        assert errs["fp32 reduced in"] == {"float32"} and errs["bf16 reduced in"] == {"bfloat16"}, errs
        assert errs["fp32 grad dtypes"] == errs["bf16 grad dtypes"] == {torch.float32}, errs
        assert errs["fp32 max error"] <= 1e-6, errs


def test_against_fsdp2_on_gloo():
    """autopar's fsdp plan under BF16 = FSDP2 under BF16 (bf16 gathers and compute, fp32 reduce-scatter, fp32
    sharded gradients): FSDP2 scales each rank's gradient by 1/world before its fp32 reduction (a power of two:
    exact), so the only differences are fp32 additions of the loss' mean (achieved: max error printed on failure)."""
    for errs in gloo_pool(2).run(fsdp2_worker):
        assert max(errs.values()) <= 1e-6, sorted(errs.items(), key=lambda kv: -kv[1])[:5]
