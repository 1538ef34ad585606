"""The estimate prices the collectives the runtime really issues: the number of collective steps and the
bytes of `Plan.estimate` against what one training step records (`record_comms`), for hand plans on 1-D and
2-D meshes, sequence forms (Megatron SP, Ulysses, ring) and MoE forms (tensor-parallel experts, experts
split on a model axis, expert parallelism on gloo); the block input of each structure; compute by op kind
with a profiled cluster."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from torch.distributed.device_mesh import init_device_mesh

import autopar
from autopar.api import _prepare
from autopar.estimate import OPTIMIZER_ACCESSES, gather_stats, mesh_costing
from autopar.forms import Candidate
from autopar.forms import fsdp as fsdp_form
from autopar.solver import site_cost
from autopar.models import GPT, GPTConfig, Llama, LlamaConfig
from autopar.runtime.collectives import record_comms
from cost_model import analytical as A
from cost_model import hardware as H
from dist_harness import gloo_pool

# alpha steps of each recorded collective on p ranks (`cost_model.analytical.COLLECTIVES`); a ring attention
# step is one send/receive
STEPS = {"all_reduce": lambda p: 2 * (p - 1), "all_gather": lambda p: p - 1, "reduce_scatter": lambda p: p - 1,
         "all_to_all": lambda p: p - 1, "p2p": lambda p: 1}
# every collective step costs 1 s and bytes are free: the estimated comm time counts collective steps
COUNTING = dataclasses.replace(H.PRESETS["cpu"], copy_bytes_per_s=1e30, intra_node=H.Link(alpha_s=1.0, bytes_per_s=1e30),
                               inter_node=H.Link(alpha_s=1.0, bytes_per_s=1e30))


def _gpt():
    torch.manual_seed(0)
    model = GPT(GPTConfig(num_layers=2))  # tied embeddings, a position embedding, SDPA
    ids = torch.zeros(8, 16, dtype=torch.long)
    return model, (ids, ids)


def _moe():
    """Llama with stacked (grouped) experts, 4 experts, top-2, 2 MoE layers. Each router's rows come in opposite
    pairs (expert 1 = -expert 0, 3 = -2), so every token picks one expert of {0, 1} and one of {2, 3}: on 2
    expert-parallel ranks the all-to-alls move exactly the balanced volume the estimate assumes."""
    torch.manual_seed(0)
    model = Llama(LlamaConfig(num_heads=4, num_kv_heads=2, attention="sdpa", moe_experts=4, moe_top_k=2,
                              moe_style="grouped"))
    for layer in model.layers:
        w = layer.mlp.router.weight
        with torch.no_grad():
            w[1], w[3] = -w[0], -w[2]
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 128, (8, 16), generator=g)
    return model, (ids, ids)


MODELS = {"gpt": _gpt, "moe": _moe}


def _recorded(local_world, mesh: dict[str, int], plan: str, overrides=None, model="gpt"):
    model, inputs = MODELS[model]()
    world = 1
    for s in mesh.values():
        world *= s
    with local_world(world):
        dm = init_device_mesh("cpu", tuple(mesh.values()), mesh_dim_names=tuple(mesh))
        pm = autopar.parallelize(model, dm, inputs, plan=plan, cluster=COUNTING, overrides=overrides)
        with record_comms() as recs:
            pm(*inputs).backward()
    return pm.plan, list(recs)


def _steps(recs, mesh: dict[str, int]) -> int:
    return sum(STEPS[r.kind](mesh[r.axis]) for r in recs)


CASES = [
    ({"dp": 2}, "dp", None, "gpt"), ({"dp": 4}, "fsdp", None, "gpt"), ({"tp": 2}, "megatron", None, "gpt"),
    ({"dp": 2, "tp": 2}, "dp", None, "gpt"), ({"dp": 2, "tp": 2}, "megatron", None, "gpt"),
    ({"dp": 2, "tp": 2}, "fsdp", None, "gpt"),
    # Megatron SP: gather into / scatter out of each block, the embedding reduce-scattered, the norms' and the
    # row-parallel biases' partial gradients summed in one bucket on tp
    ({"tp": 2}, "megatron", {"norm": "sequence"}, "gpt"), ({"tp": 4}, "megatron", {"norm": "sequence"}, "gpt"),
    ({"dp": 2, "tp": 2}, "megatron", {"norm": "sequence"}, "gpt"),
    # Ulysses and ring: their all-to-alls / K,V steps, and the position embedding split on the sequence (its
    # gradient all-gathered, not all-reduced)
    ({"sp": 2}, "dp", {"attention": "ulysses@sp"}, "gpt"), ({"sp": 4}, "dp", {"attention": "ulysses@sp"}, "gpt"),
    ({"dp": 2, "sp": 2}, "dp", {"attention": "ulysses@sp"}, "gpt"),
    ({"cp": 2}, "dp", {"attention": "ring@cp"}, "gpt"), ({"cp": 4}, "dp", {"attention": "ring@cp"}, "gpt"),
    ({"dp": 2, "cp": 2}, "dp", {"attention": "ring@cp"}, "gpt"),
    # experts' features (tp) or the experts (expert, tokens replicated on the axis) split on a model axis: the
    # output all-reduced forward, the input's and the routing weights' gradients backward
    ({"tp": 2}, "megatron", {"moe": "tp"}, "moe"), ({"dp": 2, "tp": 2}, "megatron", {"moe": "tp"}, "moe"),
    ({"tp": 2}, "megatron", {"moe": "expert@tp"}, "moe"),
]


@pytest.mark.parametrize("mesh,plan,overrides,model", CASES,
                         ids=[f"{'x'.join(f'{k}{v}' for k, v in m.items())}-{p}" + (f"-{list(o.values())[0]}" if o else "")
                              + f"-{mdl}" for m, p, o, mdl in CASES])
def test_estimate_prices_the_collectives_that_run(local_world, mesh, plan, overrides, model):
    """One bucketed all-reduce per data axis (not one per parameter), per-parameter all-gather and reduce-scatter
    under FSDP, the position embedding's output gradient reduced at the batch boundary, the loss scalars, the
    tensor-parallel activations, each sequence and MoE form's own collectives: the estimate counts the same
    collective steps the step runs, and the same bytes (up to biases kept whole under tensor parallelism with
    data parallelism: the estimate divides every parameter of a tensor-parallel block by t in the dp bucket)."""
    chosen, recs = _recorded(local_world, mesh, plan, overrides, model)
    assert chosen.estimate.comm_time_s == pytest.approx(_steps(recs, mesh)), \
        (plan, mesh, overrides, [(r.kind, r.axis, r.pass_, r.numel) for r in recs])
    sent = sum(r.send_bytes for r in recs)
    whole_biases = "dp" in mesh and "tp" in mesh and plan == "megatron"
    assert chosen.estimate.comm_bytes_per_step == pytest.approx(sent, rel=0.03 if whole_biases else 0, abs=8)


def ep_priced_and_recorded(shape: tuple[int, ...], names: tuple[str, ...]):
    """In a gloo worker: expert parallelism on `names[-1]` (tokens sharded there: all-to-all dispatch and combine
    with this step's splits, which LocalTensorMode cannot simulate). The estimate and this rank's records."""
    model, inputs = _moe()
    dm = init_device_mesh("cpu", shape, mesh_dim_names=names)
    pm = autopar.parallelize(model, dm, inputs, plan="dp", cluster=COUNTING, overrides={"moe": f"expert@{names[-1]}"})
    with record_comms() as recs:
        pm(*inputs).backward()
    assert all(s.form == "expert" for s in pm.plan.strategies if s.kind == "moe")
    return pm.plan.estimate.comm_time_s, pm.plan.estimate.comm_bytes_per_step, list(recs)


@pytest.mark.parametrize("shape,names", [((2,), ("ep",)), ((2, 2), ("dp", "ep"))])
def test_estimate_prices_expert_parallel_collectives_that_run(shape, names):
    """Per MoE layer: the row counts exchanged, tokens out and back forward, back and out backward (all-to-alls
    on ep); the rest as data parallelism. Routing is balanced by construction (`_moe`), so every rank sends what
    the estimate prices."""
    mesh = dict(zip(names, shape))
    results = gloo_pool(len(shape) * 2).run(ep_priced_and_recorded, shape, names)
    for rank, (est_steps, est_bytes, recs) in enumerate(results):
        a2a = [r for r in recs if r.kind == "all_to_all"]
        assert len(a2a) == 2 * 5, (rank, [(r.pass_, r.numel) for r in a2a])  # 3 forward + 2 backward per layer
        assert est_steps == pytest.approx(_steps(recs, mesh)), (rank, [(r.kind, r.axis, r.pass_, r.numel) for r in recs])
        assert est_bytes == pytest.approx(sum(r.send_bytes for r in recs), abs=8), rank


def test_block_input_is_the_first_column_layers_input():
    """The activation a block all-reduces under tensor parallelism is its input (b, s, h), also for an MLP,
    whose row layer's input is 4x larger."""
    model, inputs = _gpt()
    _, _, ctx = _prepare(model, {"tp": 2}, inputs, None)
    stats, _, _ = gather_stats(ctx)
    b, s, h = 8, 16, GPTConfig().hidden
    for site in ctx.sites:
        if site.kind in ("mlp", "attention", "loss"):
            assert stats[site.key].io_bytes == b * s * h * 4, site.key


def test_compute_by_op_kind_with_a_profiled_cluster():
    """With per-kind rates the compute estimate is the sum over the graph's nodes of their kind's time (3x forward)
    plus 3 overheads per op; tensor parallelism divides the work, not the op count."""
    model, inputs = _gpt()
    prof = dataclasses.replace(H.PRESETS["cpu"], peak_flops={"float32": 1e11}, sdpa_flops={"float32": 3e10},
                               vector_bytes_per_s=2e10, copy_bytes_per_s=4e10, op_overhead_s=1e-5)
    rep = autopar.plan(model, {"tp": 2}, inputs, plan="megatron", cluster=prof,
                       overrides={"embedding": "replicate", "loss": "replicate", "attention": "replicate",
                                  "mlp": "replicate"})
    _, captured, _ = _prepare(model, {"tp": 2}, inputs, None)
    expected = 0.0
    for n in captured.gm.graph.nodes:
        c = A.node_cost(n)
        if n.op == "call_function" and c.kind != "view":
            expected += A.kernel_time_s(c.kind, 3 * c.flops, 3 * c.bytes, "float32", prof, num_ops=3)
    # the step's compute also holds the optimizer step: foreach AdamW's passes over the model state (elementwise)
    def optimizer_s(p):
        state = sum(s.parameters_bytes + s.gradients_bytes + s.optimizer_bytes for s in p.estimate.sites)
        return A.kernel_time_s("vector", 0.0, OPTIMIZER_ACCESSES["adam"] * state, "float32", prof)

    assert 0 < optimizer_s(rep) < 0.2 * expected
    assert rep.estimate.compute_time_s == pytest.approx(expected + optimizer_s(rep))
    tp = autopar.plan(model, {"tp": 2}, inputs, plan="megatron", cluster=prof)
    overhead = 3 * 1e-5 * sum(1 for n in captured.gm.graph.nodes if n.op == "call_function"
                              and A.node_cost(n).kind != "view")
    layers = tp.estimate.compute_time_s - optimizer_s(tp)
    assert expected / 2 < layers < expected  # the work halves, the overhead does not
    assert layers == pytest.approx((expected - overhead) / 2 + overhead, rel=0.05)


def test_collectives_are_priced_after_the_compute_before_them():
    """A profiled link whose synchronisation grows one for one with the compute before a collective (sync table),
    and whose table is 1 ms at any size, measured after 1 ms: a collective after d seconds of compute costs d. A
    tensor-parallel block's two all-reduces follow its forward (1/3 of its compute) and its backward (2/3): they
    cost its compute. FSDP's gathers run back to back (free here) and its reduce-scatters share the backward."""
    flat = {kind: ((4.0, 1e-3), (2.0**30, 1e-3)) for kind in H.TABLE_KINDS}
    link = H.Link(alpha_s=1.0, bytes_per_s=1.0, table=flat, table_group_size=2, table_interval_s=1e-3,
                  sync_table=((0.0, 0.0), (1.0, 1.0)))
    model, inputs = _gpt()
    for names, data_axes, cand in ((("tp",), (), Candidate(form="tp", axes=("tp",))),
                                   (("dp",), ("dp",), Candidate(form="replicate", fsdp=True))):
        cluster = dataclasses.replace(H.PRESETS["cpu"], mesh_shape=(2,), axis_links=(link,))
        _, _, ctx = _prepare(model, dict.fromkeys(names, 2), inputs, None)
        stats, other, _ = gather_stats(ctx)
        mlp = next(s for s in ctx.sites if s.kind == "mlp")
        mc = mesh_costing(ctx, stats, other, names, (2,), data_axes, cluster)
        cost = site_cost(mlp, stats[mlp.key], cand, mc)
        # FSDP: its reduce-scatters follow the backward; its copies into and out of the flat buffers are compute too
        copies = fsdp_form.copy_s(mc, stats[mlp.key], 1) if cand.fsdp else 0.0
        assert copies > 0 or not cand.fsdp
        expected = cost.compute_s if cand.form == "tp" else 2 * (cost.compute_s - copies) / 3
        assert cost.compute_s > 0 and cost.comm_s == pytest.approx(expected), (cand, cost)


def test_vocab_parallel_cross_entropy_is_priced_as_the_runtime_runs_it():
    """aten's cross_entropy_loss moves its logits, and writes and reads back the log-probabilities (3x per
    forward node); the vocab-parallel runtime op makes VOCAB_CE_PASSES passes over the local fp32 logits forward and
    backward, and the loss site pays the difference."""
    from autopar.forms.vocab_loss import VOCAB_CE_PASSES, extra_bytes

    model, inputs = _gpt()
    _, _, ctx = _prepare(model, {"tp": 2}, inputs, None)
    stats, _, _ = gather_stats(ctx)
    loss = next(s for s in ctx.sites if s.kind == "loss")
    logits = loss.node.args[0].meta["val"]
    node = A.node_cost(loss.node)
    assert node.bytes >= 3 * logits.numel() * 4
    assert extra_bytes(stats[loss.key]) == VOCAB_CE_PASSES * logits.numel() * 4 - 3 * node.bytes
