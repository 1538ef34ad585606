"""ZeRO-1 and ZeRO-2 (`autopar.forms.zero`) on gloo ranks: exact against one device with AdamW over 3 steps, with
and without gradient accumulation (two backward calls per step), d in {2, 4}, fp64; the exact collectives of each
step; the optimizer state measured at 1/d per rank; a DCP checkpoint of the sharded state loaded into another plan;
and the refusals (an optimizer that cannot step a chunk)."""

from __future__ import annotations

import pytest
import torch
from torch.distributed.device_mesh import init_device_mesh

from autopar.models import Llama, LlamaConfig
from dist_harness import gloo_pool
from train_helpers import grad_error, param_error

LAYERS = 2
CFG = LlamaConfig(vocab_size=64, seq_len=8, num_layers=LAYERS, num_heads=4, num_kv_heads=2, hidden=16, ffn_hidden=32)
BATCH = 8  # two microbatches of 4 rows: divide over 4 ranks
STEPS = 3
TOL = 1e-10


def _batches():
    g = torch.Generator().manual_seed(1)
    out = []
    for _ in range(STEPS):
        ids = torch.randint(0, CFG.vocab_size, (BATCH, CFG.seq_len), generator=g)
        out.append((ids, torch.roll(ids, -1, 1)))
    return out


def _groups(model) -> dict[str, int]:
    """zero2's FSDP group label -> numel of its parameters."""
    out: dict[str, int] = {}
    for n, p in model.named_parameters():
        if n.startswith("layers."):
            label = ".".join(n.split(".")[:2])
        else:
            label = "(before layers.0)" if n.startswith("embed") else f"(after layers.{LAYERS - 1})"
        out[label] = out.get(label, 0) + p.numel()
    return out


def _state_numel(opt) -> tuple[int, int]:
    """(elements of the exp_avg / exp_avg_sq state this rank holds, elements of those states' full shapes)."""
    local = full = 0
    for st in opt.state.values():
        for k in ("exp_avg", "exp_avg_sq"):
            v = st[k]
            local += v._local_tensor.numel() if hasattr(v, "_local_tensor") else v.numel()
            full += v.numel()
    return local, full


def train_worker(plan: str, d: int, accumulate: bool, shape: tuple[int, ...] | None = None, overrides=None):
    """gloo worker: the same Llama on one device and under `plan` on d ranks, AdamW, STEPS steps, each of one batch
    or (accumulate) of its two halves' backwards. Returns the largest errors, the collectives of each step, and the
    state elements held. `shape`: a mesh of that shape (axes dp, dp2 or tp: every axis a data axis, but those
    `overrides` give structures)."""
    import autopar
    from autopar.runtime.collectives import record_comms
    torch.manual_seed(0)
    torch.set_default_dtype(torch.float64)
    try:
        ref = Llama(CFG)
        model = Llama(CFG)
        model.load_state_dict(ref.state_dict())
        batches = _batches()
        micro = [tuple(t[: BATCH // 2] for t in b) for b in batches] if accumulate else None
        shape = shape or (d,)
        mesh = init_device_mesh("cpu", shape, mesh_dim_names=("dp", "tp" if overrides else "dp2")[:len(shape)])
        pm = autopar.parallelize(model, mesh, micro[0] if accumulate else batches[0], plan=plan, overrides=overrides)
        opt = torch.optim.AdamW(pm.parameters(), lr=1e-2, weight_decay=0.1)
        ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2, weight_decay=0.1)
        errs = {"loss": 0.0, "grad": 0.0, "param": 0.0}
        steps = []
        for batch in batches:
            parts = [tuple(t[:BATCH // 2] for t in batch), tuple(t[BATCH // 2:] for t in batch)] if accumulate \
                else [batch]
            ref_opt.zero_grad(set_to_none=True)
            opt.zero_grad(set_to_none=True)
            with record_comms() as recs:
                for part in parts:
                    ref_loss = ref(*part)
                    ref_loss.backward()
                    loss = pm(*part)
                    loss.backward()
                    errs["loss"] = max(errs["loss"], float((loss.detach() - ref_loss.detach()).abs()))
                errs["grad"] = max(errs["grad"], grad_error(ref, pm))
                ref_opt.step()
                opt.step()
            errs["param"] = max(errs["param"], param_error(ref, pm))
            steps.append([(r.kind, r.axis, r.pass_, r.numel) for r in recs])
        numel = sum(p.numel() for p in ref.parameters())
        return errs, steps, _state_numel(opt), numel, _groups(ref)
    finally:
        torch.set_default_dtype(torch.float32)


def _check_numerics(errs):
    assert errs["loss"] <= TOL and errs["grad"] <= TOL and errs["param"] <= TOL, errs


def _expected_zero2(groups: dict[str, int], parts: int) -> list[tuple]:
    """zero2's collectives of one step: per group an all-gather in the step's first forward (the gather after the
    previous step, or the first ever), one reduce-scatter per group in every backward; the loss's sum and valid
    count all-reduced together in every forward (`passes.lower.fuse_loss_count_pass`)."""
    out = []
    for i in range(parts):
        out += [("all_gather", "dp", "forward", n) for n in groups.values()] if i == 0 else []
        out += [("all_reduce", "dp", "forward", 2)]
        out += [("reduce_scatter", "dp", "backward", n) for n in groups.values()]
    return out


# Each plan runs both sizes and both accumulation settings, crossed: d sets the shard sizes, accumulation the count
# of backward passes per step, independently (zero1 takes the other two pairs, so every pair runs once).
@pytest.mark.parametrize("d,accumulate", [(2, False), (4, True)])
def test_zero2_matches_one_device(d, accumulate):
    for errs, steps, (local, full), numel, groups in gloo_pool(d).run(train_worker, "zero2", d, accumulate):
        _check_numerics(errs)
        assert local * d == full == 2 * numel, (local, full, numel)  # Adam's two states, 1/d on each rank
        parts = 2 if accumulate else 1
        for recs in steps:
            # exact collectives, order-free within a pass (groups reduce in backward order)
            assert sorted(recs) == sorted(_expected_zero2(groups, parts)), recs
            # the gather of the step's parameters happens in the first forward only
            first = next(i for i, r in enumerate(recs) if r[2] == "backward")
            assert all(r[0] != "all_gather" for r in recs[first:]), recs


def _expected_zero1(numel: int, parts: int, recs) -> None:
    """zero1's collectives of one step: dp's gradient buckets all-reduced in every backward (their sizes as dp's:
    summing to every parameter's numel), the loss's (sum, count) pair in every forward, and one all-gather of every
    parameter in the step."""
    backward = [r for r in recs if r[2] == "backward"]
    assert {r[0] for r in backward} == {"all_reduce"}, backward
    assert sum(r[3] for r in backward) == parts * numel, (backward, numel)
    assert sorted(r for r in recs if r[2] == "forward") == [("all_reduce", "dp", "forward", 2)] * parts
    assert [r for r in recs if r[2] == "step"] == [("all_gather", "dp", "step", numel)]
    assert [r[2] for r in recs][-1] == "step"


@pytest.mark.parametrize("d,accumulate", [(2, True), (4, False)])  # (crossed with zero2's: see there)
def test_zero1_matches_one_device(d, accumulate):
    for errs, steps, (local, full), numel, _ in gloo_pool(d).run(train_worker, "zero1", d, accumulate):
        _check_numerics(errs)
        assert local * d == full == 2 * numel, (local, full, numel)
        for recs in steps:
            _expected_zero1(numel, 2 if accumulate else 1, recs)


def test_two_data_axes():
    """zero1 and zero2 over dp x dp2 (2 x 2): exact as on one device, the state 1/4 per rank; zero1 gathers after
    the step on each axis (the innermost first, then the outermost on the buffer gathered so far), zero2 gathers each
    group per axis in the forward and reduce-scatters it per axis in the backward."""
    for plan in ("zero1", "zero2"):
        for errs, steps, (local, full), numel, groups in gloo_pool(4).run(train_worker, plan, 4, False, (2, 2)):
            _check_numerics(errs)
            assert local * 4 == full == 2 * numel, (plan, local, full, numel)
            for recs in steps:
                if plan == "zero1":
                    assert [r for r in recs if r[2] == "step"] == [("all_gather", "dp2", "step", numel // 2),
                                                                   ("all_gather", "dp", "step", numel)], recs
                else:
                    fwd = sorted((r[1], r[3]) for r in recs if r[0] == "all_gather")
                    assert fwd == sorted(x for n in groups.values() for x in (("dp2", n // 2), ("dp", n))), fwd
                    rs = sorted((r[1], r[3]) for r in recs if r[0] == "reduce_scatter")
                    assert rs == sorted(x for n in groups.values() for x in (("dp", n), ("dp2", n // 2))), rs


MEGATRON_TP = {"attention": "heads@tp", "mlp": "tp@tp"}


@pytest.mark.parametrize("plan", ["zero1", "zero2"])
def test_with_tensor_parallelism(plan):
    """Megatron's tensor parallelism on tp with ZeRO over dp (2 x 2; zero1 is Megatron's distributed optimizer): exact
    as on one device; the optimizer state of the tensor-parallel weights 1/4 per rank (1/2 over tp, 1/2 of that over
    dp), of the others (norms, embedding, head) 1/2; zero1 gathers after the step on dp only."""
    for errs, steps, (local, full), numel, _ in gloo_pool(4).run(train_worker, plan, 2, True, (2, 2), MEGATRON_TP):
        _check_numerics(errs)
        tp_numel = LAYERS * (4 * CFG.hidden * CFG.hidden * 3 // 4 + 3 * CFG.hidden * CFG.ffn_hidden)
        assert local == 2 * (tp_numel // 4 + (numel - tp_numel) // 2), (local, numel, tp_numel)
        for recs in steps:
            assert all(r[1] == "dp" for r in recs if r[0] in ("all_gather", "reduce_scatter") or r[2] == "step"), recs
            assert any(r[1] == "tp" for r in recs), recs  # tensor parallelism's all-reduces


def checkpoint_worker(path: str, plan: str, other: str):
    """gloo worker: two AdamW steps under `plan`, the model and the (sharded) optimizer state saved with DCP
    (`get_state_dict`), loaded into a fresh model under `other` (`set_state_dict`); then both take the same two steps.
    Returns the largest difference of their parameters, and the placements the saved and the loaded states had."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
    import autopar
    torch.manual_seed(0)
    torch.set_default_dtype(torch.float64)
    try:
        ref = Llama(CFG)
        batches = _batches()
        mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("dp",))

        def make(name, seed):
            torch.manual_seed(seed)
            model = Llama(CFG)
            pm = autopar.parallelize(model, mesh, batches[0], plan=name)
            return pm, torch.optim.AdamW(pm.parameters(), lr=1e-2, weight_decay=0.1)

        def step(pm, opt, batch):
            pm(*batch).backward()
            opt.step()
            opt.zero_grad(set_to_none=True)

        a, opt_a = make(plan, 0)
        for b in batches[:2]:
            step(a, opt_a, b)
        model_sd, optim_sd = get_state_dict(a, opt_a)
        saved = {str(v.placements) for st in optim_sd["state"].values() for k, v in st.items() if k != "step"}
        dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=path)
        b_pm, opt_b = make(other, 7)
        step(b_pm, opt_b, batches[2])  # other values and state, overwritten by the load
        model_sd, optim_sd = get_state_dict(b_pm, opt_b)
        state = {"model": model_sd, "optim": optim_sd}
        dcp.load(state, checkpoint_id=path)
        set_state_dict(b_pm, opt_b, model_state_dict=state["model"], optim_state_dict=state["optim"])
        loaded = {str(v.placements) for st in opt_b.state.values() for k, v in st.items() if k != "step"}
        for b in batches[1:]:
            step(a, opt_a, b)
            step(b_pm, opt_b, b)
        diff = max(float((p.full_tensor() - q.full_tensor()).abs().max())
                   for p, q in zip(a.parameters(), b_pm.parameters()))
        del ref
        return diff, saved, loaded
    finally:
        torch.set_default_dtype(torch.float32)


@pytest.mark.parametrize("plan,other", [("zero1", "dp"), ("zero2", "zero1"), ("zero1", "zero2")])
def test_sharded_state_checkpoint_loads_into_another_plan(tmp_path, plan, other):
    """DCP saves zero1's and zero2's optimizer state as the shards they are (Shard(0) on the data axis), and it loads
    into another plan's (replicated under dp; zero2's sharded parameters into zero1's replicated ones, and back: a
    load rewrites zero2's shards, so its persisted gathered copies are gathered again) that then trains exactly as
    the uninterrupted run."""
    for diff, saved, loaded in gloo_pool(2).run(checkpoint_worker, str(tmp_path / "ckpt"), plan, other):
        assert diff <= 1e-12, diff
        assert saved == {"(Shard(dim=0),)"}, saved
        assert loaded == ({"(Replicate(),)"} if other == "dp" else {"(Shard(dim=0),)"}), loaded


def refusal_worker():
    """gloo worker: zero1's parameters stepped by an optimizer that cannot step a chunk as the whole (LBFGS-like:
    not one of torch's elementwise ones), or with the local step disabled: the step raises, saying why."""
    import autopar
    from autopar.runtime import local_step

    class MyAdam(torch.optim.Adam):  # a subclass may do anything: not trusted elementwise
        pass

    torch.manual_seed(0)
    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("dp",))
    batch = _batches()[0]
    pm = autopar.parallelize(Llama(CFG), mesh, batch, plan="zero1")
    errors = []
    for make, ctx in ((lambda: MyAdam(pm.parameters()), None), (lambda: torch.optim.AdamW(pm.parameters()), False)):
        opt = make()
        pm(*batch).backward()
        try:
            if ctx is None:
                opt.step()
            else:
                with local_step.enabled(False):
                    opt.step()
        except RuntimeError as e:
            errors.append(str(e))
        opt.zero_grad()
    return errors


def test_zero1_refuses_a_step_it_cannot_shard():
    for errors in gloo_pool(2).run(refusal_worker):
        assert len(errors) == 2, errors
        assert "MyAdam is not one of torch's elementwise optimizers" in errors[0], errors[0]
        assert "the local step is disabled" in errors[1], errors[1]
        assert all("plan 'zero1'" in e and "Fix:" in e for e in errors)


def mixed_worker(plan: str, like: str):
    """gloo worker: an fp32 model under `mp_policy` (bf16 compute and gathers, fp32 reductions), AdamW, three steps
    under `plan` and under the plan it refines (`like`: the same collectives in the same dtypes), the last step on
    half the batch (other shapes: both re-lowered). Returns the largest difference of their parameters and losses,
    and the dtypes of zero2's persisted gathered copies."""
    import autopar
    from torch.distributed.fsdp import MixedPrecisionPolicy
    from autopar.forms import fsdp as fsdp_form
    from autopar.runtime import fsdp as F
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("dp",))
    batches = _batches()
    batches[-1] = tuple(t[: BATCH // 2] for t in batches[-1])
    runs = []
    for name in (plan, like):
        torch.manual_seed(0)
        model = Llama(CFG)
        if name == "fsdp-keep":
            name = fsdp_form.keep_gathered(autopar.plan(model, mesh, batches[0], plan="fsdp", mp_policy=mp), "*")
        pm = autopar.parallelize(model, mesh, batches[0], plan=name, mp_policy=mp)
        opt = torch.optim.AdamW(pm.parameters(), lr=1e-2, weight_decay=0.1)
        losses = []
        for b in batches:
            loss = pm(*b)
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            losses.append(float(loss))
        runs.append(([p.full_tensor() for p in pm.parameters()], losses))
        if name == "zero2":  # this model's groups (the worker's earlier models may linger until collected)
            mine = {id(p._local_tensor) for p in pm.parameters()}
            dtypes = [str(buf.dtype).removeprefix("torch.") for key, (_, _, buf) in F._PERSISTED.items() if key in mine]
    diff = max(float((a - b).abs().max()) for a, b in zip(runs[0][0], runs[1][0]))
    return diff, max(abs(a - b) for a, b in zip(runs[0][1], runs[1][1])), dtypes if plan == "zero2" else None


@pytest.mark.parametrize("plan,like", [("zero1", "dp"), ("zero2", "fsdp-keep")])
def test_mixed_precision_trains_as_the_plan_it_refines(plan, like):
    """Under bf16 compute with fp32 masters and reductions, zero1 trains bit for bit as dp (the same buckets, the
    elementwise step on chunks), zero2 as fsdp with every layer kept gathered (the same groups, gathered in bf16,
    reduced in fp32), through a re-lowering for other shapes; zero2's persisted copies are bf16 (param_dtype)."""
    for diff, loss_diff, dtypes in gloo_pool(2).run(mixed_worker, plan, like):
        assert diff == 0.0 and loss_diff == 0.0, (diff, loss_diff)
        if plan == "zero2":
            assert dtypes == ["bfloat16"] * (LAYERS + 2), dtypes  # embedding, each layer, final norm + head
