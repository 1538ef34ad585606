"""The estimate prices the collectives the runtime really issues: the number of collective steps and the
bytes of `Plan.estimate` against what one training step records (`record_comms`), for hand plans on 1-D and
2-D meshes; the block input of each structure; compute by op kind with a profiled cluster."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from torch.distributed.device_mesh import init_device_mesh

import autopar
from autopar.api import _prepare
from autopar.estimate import gather_stats, mesh_costing
from autopar.forms import Candidate
from autopar.solver import site_cost
from autopar.models import GPT, GPTConfig
from autopar.runtime.collectives import record_comms
from cost_model import analytical as A
from cost_model import hardware as H

STEPS = {"all_reduce": lambda p: 2 * (p - 1), "all_gather": lambda p: p - 1, "reduce_scatter": lambda p: p - 1,
         "all_to_all": lambda p: p - 1}
# every collective step costs 1 s and bytes are free: the estimated comm time counts collective steps
COUNTING = dataclasses.replace(H.PRESETS["cpu"], copy_bytes_per_s=1e30, intra_node=H.Link(alpha_s=1.0, bytes_per_s=1e30),
                               inter_node=H.Link(alpha_s=1.0, bytes_per_s=1e30))


def _gpt():
    torch.manual_seed(0)
    model = GPT(GPTConfig(num_layers=2))  # tied embeddings, a position embedding, SDPA
    ids = torch.zeros(8, 16, dtype=torch.long)
    return model, (ids, ids)


def _recorded(local_world, mesh: dict[str, int], plan: str):
    model, inputs = _gpt()
    world = 1
    for s in mesh.values():
        world *= s
    with local_world(world):
        dm = init_device_mesh("cpu", tuple(mesh.values()), mesh_dim_names=tuple(mesh))
        pm = autopar.parallelize(model, dm, inputs, plan=plan, cluster=COUNTING)
        with record_comms() as recs:
            pm(*inputs).backward()
    return pm.plan, list(recs)


@pytest.mark.parametrize("mesh,plan", [({"dp": 2}, "dp"), ({"dp": 4}, "fsdp"), ({"tp": 2}, "megatron"),
                                       ({"dp": 2, "tp": 2}, "dp"), ({"dp": 2, "tp": 2}, "megatron"),
                                       ({"dp": 2, "tp": 2}, "fsdp")])
def test_estimate_prices_the_collectives_that_run(local_world, mesh, plan):
    """One bucketed all-reduce per data axis (not one per parameter), per-parameter all-gather and reduce-scatter
    under FSDP, the position embedding's output gradient reduced at the batch boundary, the loss scalars, the
    tensor-parallel activations: the estimate counts the same collective steps the step runs, and the same bytes
    (up to biases kept whole under tensor parallelism)."""
    chosen, recs = _recorded(local_world, mesh, plan)
    sizes = dict(mesh)
    steps = sum(STEPS[r.kind](sizes[r.axis]) for r in recs)
    assert chosen.estimate.comm_time_s == pytest.approx(steps), (plan, mesh, [(r.kind, r.axis, r.numel) for r in recs])
    sent = sum(r.send_bytes for r in recs)
    assert chosen.estimate.comm_bytes_per_step == pytest.approx(sent, rel=0.03, abs=8)


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
    assert rep.estimate.compute_time_s == pytest.approx(expected)
    tp = autopar.plan(model, {"tp": 2}, inputs, plan="megatron", cluster=prof)
    overhead = 3 * 1e-5 * sum(1 for n in captured.gm.graph.nodes if n.op == "call_function"
                              and A.node_cost(n).kind != "view")
    assert expected / 2 < tp.estimate.compute_time_s < expected  # the work halves, the overhead does not
    assert tp.estimate.compute_time_s == pytest.approx((expected - overhead) / 2 + overhead, rel=0.05)


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
        expected = cost.compute_s if cand.form == "tp" else 2 * cost.compute_s / 3
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
