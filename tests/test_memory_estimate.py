"""The memory estimate against what a training step holds (issue #11 items 1 and 7).

- Saved activations: `Plan.estimate`'s activations (plus FSDP's gathered parameters, kept for backward) against
  the unique storages `saved_tensors_hooks` see during a forward of the rewritten program, rank 0, for dp, fsdp,
  tensor parallelism, TP + sequence parallelism, Ulysses, ring (2 simulated ranks) and expert parallelism (2
  gloo ranks: its all-to-alls carry this step's uneven splits), on a GPT and a Llama-style model.
- What no structure holds (residual adds, RMS-norm pieces, the logits' flattening) is divided where its placement
  is sharded: the residual stream by sequence parallelism, the logits by vocab-parallel cross-entropy.
- The peak: parameters and optimizer state, plus the larger end of the backward (every saved activation and the
  largest momentary buffer, or every gradient); the solver's memory limit is that peak.
- Model state per parameter element: one rule (`cost_model.memory.state_bytes_per_element`).
"""

from __future__ import annotations

import pytest
import torch
from torch.distributed.device_mesh import init_device_mesh

import autopar
from autopar.api import _prepare
from autopar.estimate import CE_BACKWARD_BUFFERS, gather_stats, mesh_costing
from autopar.models import GPT, GPTConfig, Llama, LlamaConfig
from autopar.solver import InfeasibleError
from cost_model import hardware as H
from cost_model.memory import model_state_bytes, state_bytes_per_element
from dist_harness import gloo_pool
from memory_probe import SavedStorages, measured_step, predicted_saved_bytes

B, S, V, HID = 4, 32, 256, 32
PLANS = {"dp": ("dp", "dp", None), "fsdp": ("dp", "fsdp", None), "tp": ("tp", "megatron", None),
         "tp+sp": ("tp", "megatron", {"norm": "sequence"}), "ulysses": ("sp", "dp", {"attention": "ulysses@sp"}),
         "ring": ("cp", "dp", {"attention": "ring@cp"}), "ep": ("ep", "dp", {"moe": "expert@ep"})}


def _model(name: str):
    torch.manual_seed(0)
    if name == "gpt":
        return GPT(GPTConfig(vocab_size=V, seq_len=S, num_layers=2, num_heads=4, hidden=HID))
    moe = dict(moe_experts=4, moe_top_k=2, moe_style="grouped") if name == "moe" else {}
    return Llama(LlamaConfig(vocab_size=V, seq_len=S, num_layers=2, num_heads=4, num_kv_heads=2, hidden=HID,
                             ffn_hidden=2 * HID, attention="sdpa", **moe))


def _inputs():
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, V, (B, S), generator=g)
    return ids, torch.roll(ids, -1, dims=1)


# The estimate matches the saved storages to the byte but for the loss' two fp32 scalars the hooks see (8 bytes) and
# the rounding of each structure's bytes; and MoE routing, which the estimate takes as balanced (rank 0 gets what
# its router sends it: `TOLERANCE`).
TOLERANCE = {"ep": 0.1}


@pytest.mark.parametrize("model_name", ["gpt", "llama"])
@pytest.mark.parametrize("plan_name", ["dp", "fsdp", "tp", "tp+sp", "ulysses", "ring"])
def test_saved_bytes_match_saved_tensor_hooks(local_world, model_name, plan_name):
    axis, plan, overrides = PLANS[plan_name]
    model, x = _model(model_name), _inputs()
    with local_world(2):
        mesh = init_device_mesh("cpu", (2,), mesh_dim_names=(axis,))
        pm = autopar.parallelize(model, mesh, x, plan=plan, overrides=overrides)
        with SavedStorages(list(pm.parameters())) as saved:
            pm(*x)
    predicted = predicted_saved_bytes(pm.plan)
    sites = pm.plan.estimate.sites  # each structure's bytes are rounded down: up to 1 byte each
    assert predicted == pytest.approx(saved.bytes, abs=8 + len(sites)), \
        (plan_name, model_name, [(s.key, s.activations_bytes, s.transient_bytes) for s in pm.plan.estimate.sites])


def expert_parallel_saved_and_peak() -> tuple[float, float, float, float]:
    """In a gloo worker: expert parallelism (tokens sharded on the axis, uneven all-to-alls), saved bytes and the
    peak of live storages of a training step (after a warm-up step, so Adam's state exists), with the estimate's."""
    model, x = _model("moe"), _inputs()
    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("ep",))
    pm = autopar.parallelize(model, mesh, x, plan="dp", overrides={"moe": "expert@ep"})
    saved, live = measured_step(pm, x, torch.optim.Adam(pm.parameters()))
    return saved.bytes, predicted_saved_bytes(pm.plan), live.peak, pm.plan.estimate.memory_bytes_per_device


def test_expert_parallel_saved_bytes_and_peak():
    """The experts' saved rows (input, gate, SiLU, up, product, output per routed row) on both ranks: routing is
    not balanced per rank, so within 10%; the peak within 15% (issue #11's bound for the peak)."""
    for measured, predicted, peak, peak_est in gloo_pool(2).run(expert_parallel_saved_and_peak):
        assert predicted == pytest.approx(measured, rel=TOLERANCE["ep"])
        assert peak_est == pytest.approx(peak, rel=0.15)


def test_stream_outside_structures_is_divided_by_sequence_parallelism(local_world):
    """Residual adds and the RMS norms' pieces are no structure's nodes: they are charged to the norms (the
    residual stream), so sequence parallelism divides them by t; with tensor parallelism alone they stay whole.
    Nothing batch-sized is left in '(other)' (only what does not depend on the batch: the rotary tables)."""
    model, x = _model("llama"), _inputs()
    _, _, ctx = _prepare(model, {"tp": 2}, x, None)
    stats, other, _ = gather_stats(ctx)
    assert other.saved_bytes == sum(t.numel() * t.element_size() for t in x)  # the saved ids and labels
    assert other.saved_unbatched_bytes == other.saved_unbatched_seq_bytes == 2 * S * (HID // 4) * 4  # cos, sin
    stream = B * S * HID * 4
    norms = [s for s in ctx.of_kind("norm")]
    # per layer two RMS norms: input (the stream), fp32 rstd, x * rstd, the weighted output; plus the final norm's
    assert sum(stats[s.key].saved_bytes for s in norms) == pytest.approx(len(norms) * (3 * stream + B * S * 4))
    est = {}
    for name, overrides in (("tp", None), ("sp", {"norm": "sequence"})):
        plan = autopar.plan(model, {"tp": 2}, x, plan="megatron", overrides=overrides, cluster="cpu")
        est[name] = {s.key: s.activations_bytes for s in plan.estimate.sites}
    for s in norms:
        assert est["sp"][s.key] == pytest.approx(est["tp"][s.key] / 2, abs=1)
    assert est["sp"]["loss"] == est["tp"]["loss"]  # vocab-parallel either way: the log-probabilities / t


def test_logits_outside_structures_are_divided_by_vocab_parallel_loss():
    """The flattened logits cross-entropy saves (fp32 log-probabilities) are outside every structure: the loss owns
    them, vocab-parallel divides them by t."""
    model, x = _model("gpt"), _inputs()
    est = {name: {s.key: s.activations_bytes for s in autopar.plan(model, {"tp": 2}, x, plan="megatron", cluster="cpu",
                                                                   overrides=overrides).estimate.sites}
           for name, overrides in (("replicate", {"loss": "replicate"}), ("vocab", None))}
    logits, tokens = B * S * V * 4, B * S
    # replicated: the log-probabilities; vocab-parallel: its share of them and two 1-byte masks per token (the
    # targets are user inputs: '(other)')
    assert est["replicate"]["loss"] == logits
    assert est["vocab"]["loss"] == logits / 2 + 2 * tokens


def _peak(e) -> float:
    held = sum(s.parameters_bytes + s.optimizer_bytes + s.transient_bytes for s in e.sites)
    return held + max(sum(s.activations_bytes for s in e.sites) + max(s.momentary_bytes for s in e.sites),
                      sum(s.gradients_bytes for s in e.sites))


def test_peak_is_held_plus_the_larger_end_of_backward():
    """The estimate's memory is parameters + optimizer state + max(saved activations + the largest momentary buffer,
    gradients); the largest momentary buffer is the loss' two fp32 logit gradients (aten's cross-entropy), or four
    under vocab-parallel cross-entropy, divided as the logits are."""
    model, x = _model("gpt"), _inputs()
    logits = B * S * V * 4
    for plan, mesh, momentary in (("dp", {"dp": 2}, CE_BACKWARD_BUFFERS * logits / 2),
                                  ("megatron", {"tp": 2}, 4 * logits / 2)):
        e = autopar.plan(model, mesh, x, plan=plan, cluster="cpu").estimate
        assert max(s.momentary_bytes for s in e.sites) == momentary
        assert e.memory_bytes_per_device == pytest.approx(_peak(e), abs=4 * len(e.sites))
        assert e.memory_bytes_per_device > sum(s.parameters_bytes + s.optimizer_bytes + s.activations_bytes
                                               for s in e.sites) + momentary - 4 * len(e.sites)


def test_solver_memory_limit_is_the_peak():
    """The ILP's memory constraint is the same peak: the plan it returns under a limit fits that limit including
    the momentary buffer, and a limit below the least peak (the free plan's activations and momentary buffer
    included) raises InfeasibleError naming the least memory."""
    model, x = _model("gpt"), _inputs()
    free = autopar.plan(model, {"dp": 2, "tp": 2}, x, cluster="cpu").estimate
    assert free.memory_bytes_per_device == pytest.approx(_peak(free), abs=4 * len(free.sites))
    limit = int(free.memory_bytes_per_device * 0.9)
    try:  # without recompute (the levels' saved bytes are no structure's: `_peak` sums the structures')
        fit = autopar.plan(model, {"dp": 2, "tp": 2}, x, cluster="cpu", memory_limit=limit,
                           overrides={"checkpoint": "none"}).estimate
    except InfeasibleError as e:
        assert e.least_bytes > limit
    else:
        assert fit.memory_bytes_per_device <= limit and fit.memory_bytes_per_device == pytest.approx(
            _peak(fit), abs=4 * len(fit.sites))
    with pytest.raises(InfeasibleError) as e:
        autopar.plan(model, {"dp": 2, "tp": 2}, x, cluster="cpu", memory_limit=1024)
    least = e.value.least_bytes
    assert least > 1024
    # the least memory named is what the least plan needs, not a bound no plan reaches: a limit of it fits
    fit = autopar.plan(model, {"dp": 2, "tp": 2}, x, cluster="cpu", memory_limit=least + 2048).estimate
    assert 0.95 * least <= fit.memory_bytes_per_device <= least + 2048  # the ILP rounds each part up to KiB


def test_optimizer_state_per_element():
    """Adam: fp32 parameters 4 + 4 + 2·4 = 16 bytes; 16-bit parameters with an fp32 master copy and fp32 moments
    2 + 2 + 4 + 8 = 16 (ZeRO's K = 12); fp32 gradients of 16-bit parameters (a reduce dtype) add 2; SGD holds no
    state. The estimate follows the same rule (one home): a bf16 model trained as it is (no `mp_policy`) keeps
    bf16 states, 2 + 2 + 2·2 = 8 bytes (what torch.optim allocates); under a policy, fp32 masters (16)."""
    assert state_bytes_per_element(torch.float32).total == 16
    bf16 = state_bytes_per_element(torch.bfloat16, optimizer="adamw")
    assert (bf16.param, bf16.grad, bf16.optimizer, bf16.total) == (2, 2, 12, 16)
    assert state_bytes_per_element(torch.bfloat16, torch.bfloat16, torch.float32).total == 18
    assert state_bytes_per_element(torch.float16, master_weights=False).total == 8
    assert state_bytes_per_element(torch.float32, optimizer="sgd").total == 8
    with pytest.raises(ValueError, match="unknown optimizer 'lion'"):
        state_bytes_per_element(torch.float32, optimizer="lion")
    model, x = _model("llama"), _inputs()
    model = model.to(torch.bfloat16)
    _, _, ctx = _prepare(model, {"dp": 2}, x, None)
    stats, other, _ = gather_stats(ctx)
    mc = mesh_costing(ctx, stats, other, ("dp",), (2,), ("dp",), H.PRESETS["h100"])
    assert mc.state_factor() == 4 and mc.grad_share() == mc.param_share() == 2 / 8
    e = autopar.plan(model, {"dp": 2}, x, plan="dp", cluster="h100").estimate
    numel = sum(p.numel() for p in model.parameters())
    state = model_state_bytes(dict(model.named_parameters()), master_weights=False)
    assert sum(s.optimizer_bytes for s in e.sites) == pytest.approx(state.optimizer_bytes, abs=4 * len(e.sites)) \
        == pytest.approx(4 * numel, abs=4 * len(e.sites))
    assert sum(s.parameters_bytes for s in e.sites) == pytest.approx(2 * numel, abs=4 * len(e.sites))
