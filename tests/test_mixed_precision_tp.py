"""Mixed precision on the tensor axis (issue #24, deliverable 6): under `mp_policy` (bf16 compute, fp32 reductions)
tensor-parallel activations and their gradients travel in the compute dtype; only the data-axis gradient reduction
is in `reduce_dtype`.

(a) the estimate: a megatron plan of the fp32 model under the policy prices the tensor axis exactly as the same model
held in bf16 (2 bytes per element: `blocks.tensor_parallel_volume_bytes` of the bf16 block input), and the data axis'
gradient all-reduce at 4 bytes per element (twice the bf16 model's);
(b) the runtime, on 4 gloo ranks (dp 2 x tp 2): the collectives recorded on "tp" are bf16, but for the vocab-parallel
cross-entropy's three fp32 per-token reductions (the model upcasts its logits); those on "dp" in backward (the
gradient bucket) are fp32, forward ones the fp32 loss scalars; the plan's rows (`Plan.comms`) price the bytes run;
loss, every gradient and every parameter after an SGD step within `test_mixed_precision`'s megatron tolerance
(against fp64: 1.5x the one-device bf16 run's error plus one bf16 ulp of the largest value).
"""

from __future__ import annotations

import torch

import autopar
from autopar.forms import blocks
from cost_model.analytical import send_bytes
from dist_harness import gloo_pool
from test_mixed_precision import BF16, BF16_ULP, LR, gpt_inputs, make_gpt, policy_step

HIDDEN, SEQ, BATCH, LAYERS = 32, 16, 4, 2  # make_gpt / gpt_inputs


def _sites(plan, axis):
    return {s.key: dict(s.comm_axes).get(axis, 0.0) for s in plan.estimate.sites}


def test_estimate_tp_bytes_in_compute_dtype():
    _estimate_extra_bytes()


def _estimate_extra_bytes() -> float:
    """On tp 2 alone the policy's plan sends what the bf16 model's sends (the tensor axis only), less than the fp32
    model's; each layer's attention and MLP pay the bf16 formula's seconds on tp; on dp 2 x tp 2 the policy adds
    exactly the data axis' gradient all-reduce in fp32 over bf16, and nothing on tp."""
    inputs = gpt_inputs()
    mixed = autopar.plan(make_gpt(), {"tp": 2}, inputs, plan="megatron", mp_policy=BF16)
    bf16 = autopar.plan(make_gpt().to(torch.bfloat16), {"tp": 2}, inputs, plan="megatron")
    fp32 = autopar.plan(make_gpt(), {"tp": 2}, inputs, plan="megatron")
    assert mixed.estimate.comm_bytes_per_step == bf16.estimate.comm_bytes_per_step
    assert mixed.estimate.comm_bytes_per_step < fp32.estimate.comm_bytes_per_step
    # the layers' share: attention + MLP, each two all-reduces of the bf16 block input (B, S, H)
    layer_bytes = LAYERS * 2 * blocks.tensor_parallel_volume_bytes(BATCH * SEQ * HIDDEN * 2, 2)
    fp32_layer_bytes = LAYERS * 2 * blocks.tensor_parallel_volume_bytes(BATCH * SEQ * HIDDEN * 4, 2)
    assert fp32.estimate.comm_bytes_per_step - mixed.estimate.comm_bytes_per_step >= fp32_layer_bytes - layer_bytes
    assert _sites(mixed, "tp") == _sites(bf16, "tp")
    assert all(t > 0 for k, t in _sites(mixed, "tp").items() if ".attn" in k or ".mlp" in k)

    mesh = {"dp": 2, "tp": 2}
    mixed2 = autopar.plan(make_gpt(), mesh, inputs, plan="megatron", mp_policy=BF16)
    bf16_2 = autopar.plan(make_gpt().to(torch.bfloat16), mesh, inputs, plan="megatron")
    assert _sites(mixed2, "tp") == _sites(bf16_2, "tp")
    # the extra bytes are the dp bucket's, 2 more per element: checked against the bucket run in
    # `test_megatron_dp_tp_on_gloo`
    return mixed2.estimate.comm_bytes_per_step - bf16_2.estimate.comm_bytes_per_step


def megatron_worker():
    """On each gloo rank of dp 2 x tp 2: megatron under BF16, one forward + backward recorded, one SGD step."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from autopar.runtime.collectives import record_comms
    model, inputs = make_gpt(), gpt_inputs()
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    pm = autopar.parallelize(model, mesh, inputs, plan="megatron", mp_policy=BF16)
    opt = torch.optim.SGD(pm.parameters(), lr=LR)
    with record_comms() as recs:
        loss = pm(*inputs)
        loss.backward()
    grads = {n: p.grad.full_tensor().double() for n, p in pm.named_parameters()}
    dtypes = {(p.dtype, p.grad.dtype) for p in pm.parameters()}
    opt.step()
    after = {n: p.full_tensor().double() for n, p in pm.named_parameters()}
    rows = [(c.module, c.fn, c.axis, c.bytes_forward, c.bytes_backward) for c in pm.plan.comms]
    return {"recs": [(r.kind, r.axis, r.pass_, r.numel, r.send_bytes, r.dtype) for r in recs], "rows": rows,
            "loss": float(loss), "grads": grads, "after": after, "dtypes": dtypes, "rank": dist.get_rank()}


def test_megatron_dp_tp_on_gloo():
    """dp 2 x tp 2 on gloo under BF16: tp collectives in bf16 (the activations of each row-parallel output and each
    column-parallel input gradient, (B/2, S, H) per rank), fp32 on tp only inside the vocab-parallel cross-entropy;
    the dp gradient bucket in fp32; the estimate's extra bytes under the policy are that bucket's 2 more bytes per
    element; numerics within the megatron mixed-precision tolerance."""
    results = gloo_pool(4).run(megatron_worker)
    extra = _estimate_extra_bytes()
    model, inputs = make_gpt(), gpt_inputs()
    _, ref_grads, _ = policy_step(model, inputs, 2)  # the batch in two halves (dp), bf16 compute, fp32 sums
    ref_loss, _, _ = policy_step(model, inputs, 1)
    truth_loss, truth_grads, truth_after = policy_step(model, inputs, 1, dtype=torch.float64)
    local_tokens = BATCH // 2 * SEQ
    for res in results:
        recs = res["recs"]
        tp = [r for r in recs if r[1] == "tp"]
        dp = [r for r in recs if r[1] == "dp"]
        acts = [r for r in tp if r[5] == "bfloat16"]
        assert sorted(r[:4] for r in acts) == sorted(
            [("all_reduce", "tp", "forward", local_tokens * HIDDEN)] * 5
            + [("all_reduce", "tp", "backward", local_tokens * HIDDEN)] * 5), tp
        assert all(r[4] == 2 * r[3] for r in acts)  # bf16, ring all-reduce on 2 ranks: 2 bytes per element
        assert sorted((r[2], r[3], r[5]) for r in tp if r not in acts) == [("forward", local_tokens, "float32")] * 3
        bucket = [r for r in dp if r[2] == "backward"]
        assert bucket and all(r[0] == "all_reduce" and r[5] == "float32" for r in bucket), dp
        assert all(r[5] == "float32" and r[3] == 1 for r in dp if r[2] == "forward"), dp  # the loss' scalars
        # as priced: the rows' bytes are what ran
        # as priced in the plan's rows (`Plan.comms`): the bytes run on each axis (on tp the activations': the
        # cross-entropy's reductions are the loss form's own, priced by `vocab_loss`, not rows)
        assert sum(b + c for _, _, a, b, c in res["rows"] if a == "tp") == sum(r[4] for r in acts), res["rows"]
        assert sum(c for _, _, a, _, c in res["rows"] if a == "dp") == sum(r[4] for r in bucket), res["rows"]
        # the estimate's extra bytes under the policy: every dp gradient reduction's elements (the bucket's and
        # wpe's output gradient at the batch boundary, `SiteStats.boundary_reduce_bytes`) at 4 bytes instead of 2,
        # sent once each on 2 ranks (ring all-reduce: 2(p-1)/p of them); less the row-parallel biases' halves
        # (attn.proj.bias, out.bias: whole on tp, but priced / t with their block's weights by
        # `blocks.tensor_parallel`'s param_split, for every dtype alike)
        row_biases = sum(p.numel() for n, p in model.named_parameters() if n.endswith(("attn.proj.bias", "out.bias")))
        reduced = sum(r[3] for r in bucket) - row_biases // 2
        assert extra == send_bytes("all_reduce", reduced * 2, 2), (extra, bucket)
        assert res["dtypes"] == {(torch.float32, torch.float32)}
        assert abs(res["loss"] - truth_loss) <= 1.5 * abs(ref_loss - truth_loss) + BF16_ULP * abs(truth_loss)
        for n, g in res["grads"].items():
            t = truth_grads[n]
            ref_err = float((ref_grads[n].double() - t).abs().max())
            bound = 1.5 * ref_err + BF16_ULP * float(t.abs().max())
            assert float((g - t).abs().max()) <= bound, (n, float((g - t).abs().max()), bound)
            assert float((res["after"][n] - truth_after[n]).abs().max()) <= LR * bound + 1e-6, n
