"""Pipelining models no pipeline test was written for: torch.nn census rows (`tests/nn_census.py`) on pp2 under
`1f1b`, 2 gloo ranks, fp64, against one device: the loss, every gradient of each rank's stage, every parameter
after an SGD step. The U-Net's skip connections cross the stage boundary as channel slices of a concatenation
(strided activations and gradients: once "input tensor has to be contiguous" / a stride mismatch in torch's
stage check); the encoder-decoder passes its memory through the decoder's stage; a 2-row microbatch of an LSTM
once crashed capture (`passes.batch_local`). One pool job runs every row."""

from __future__ import annotations

from dist_harness import gloo_pool

ROWS = ("unet", "transformer", "vit", "rmsnorm_llama")


def _rows(names):
    import copy
    import warnings

    import torch
    from torch.distributed.device_mesh import init_device_mesh

    import autopar
    import nn_census as C

    warnings.filterwarnings("ignore")
    old = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    worst = {}
    try:
        mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("pp",))
        for name in names:
            torch.manual_seed(0)
            model, inputs = C.CENSUS[name].build()
            ref = copy.deepcopy(model)
            ref_loss = ref(*inputs)
            ref_loss.backward()
            pm = autopar.parallelize(model, mesh, inputs, plan="dp", overrides={"pipeline": "1f1b@pp"}, microbatches=2)
            loss = pm(*inputs)
            loss.backward()
            errs = {"loss": float((loss.detach() - ref_loss.detach()).abs())}
            refs = dict(ref.named_parameters())
            mine = {n: p for n, p in pm.named_parameters() if p.to_local().numel()}  # this rank's stage
            assert mine, f"{name}: no parameter on rank {torch.distributed.get_rank()}"
            for n, p in mine.items():
                errs[f"grad {n}"] = float("inf") if p.grad is None else float((p.grad.to_local() - refs[n].grad).abs().max())
            torch.optim.SGD(pm.parameters(), lr=0.1).step()
            torch.optim.SGD(ref.parameters(), lr=0.1).step()
            for n, p in mine.items():
                errs[f"param {n}"] = float((p.to_local() - refs[n].detach()).abs().max())
            worst[name] = (len(mine), max(errs.items(), key=lambda kv: kv[1]))
    finally:
        torch.set_default_dtype(old)
    return worst


def test_census_rows_pipelined_match_one_device():
    results = gloo_pool(2).run(_rows, ROWS)
    for rank, worst in enumerate(results):
        for name in ROWS:
            count, (what, err) = worst[name]
            assert err < 1e-10, f"rank {rank}, {name}: {what} differs by {err:.2e}"
    for name in ROWS:  # every parameter on exactly one stage here (no tied weights in these rows)
        assert results[0][name][0] > 0 and results[1][name][0] > 0, name
