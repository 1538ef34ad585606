"""Pipelines as a new user tries them, on models no other pipeline test uses (issue #23): Hugging Face zoo families
(tests/zoo.py) and torch.nn census networks (tests/nn_census.py), fp64, against one device: the global loss, every
gradient of each rank's stages, every parameter after one AdamW step (lr 0.01), within the family's tolerance
(zoo.py: TOL_FP32 for a causal LM, whose `ForCausalLMLoss` rounds the logits to fp32, and T5; 1e-10 otherwise;
the parameters after the step: `param_tol`).

Jobs (module level, for the gloo pools; each returns, per model, the worst error or the error raised):
* `_pp_dp(source, names)`: pp2, `plan="dp"`, `overrides={"pipeline": "1f1b@pp"}`, 2 microbatches, 2 ranks;
* `_pp_tp_sp(names)`: pp2 x tp2, `plan="megatron"`, `overrides={"pipeline": "1f1b@pp", "norm": "sequence"}`,
  4 ranks (Megatron sequence parallelism in every stage, the boundary crossing as each tp rank's sequence shard).

`benchmarks/pp_foreign.py` runs the whole table; the suite runs the cheapest rows (one job per pool).
"""

from __future__ import annotations

import torch

from dist_harness import gloo_pool

TOL_FP64 = 1e-10


def _build(source: str, name: str):
    """(model, args, kwargs, tol), fp64, seed 0."""
    torch.manual_seed(0)
    if source == "zoo":
        import zoo
        model, inputs, tol = getattr(zoo, name)()
        return model, (), dict(inputs), tol
    import nn_census as C
    model, inputs = C.CENSUS[name].build()
    return model, tuple(inputs), {}, TOL_FP64


def _against_one_device(source: str, name: str, mesh, plan: str, overrides: dict) -> dict:
    """One model pipelined on `mesh` against one device: {"worst": (what, error), "tol", "mine", "all"}, or
    {"raised": "Type: message"} where parallelize or the step raised (on every rank: a pipelined error is)."""
    import copy
    import autopar
    from pipeline_helpers import stage_grads, stepped_params
    old = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    try:
        ref, args, kwargs, tol = _build(source, name)
        model = copy.deepcopy(ref)
        inputs = kwargs if kwargs else args
        try:
            pm = autopar.parallelize(model, mesh, inputs, plan=plan, overrides=overrides,
                                     microbatches=2 if "pipeline" in overrides else None)
            loss = pm(*args, **kwargs)
            loss.backward()
        except (NotImplementedError, ValueError) as e:
            return {"raised": f"{type(e).__name__}: {e}"}
        ref_loss = ref(*args, **kwargs)
        ref_loss.backward()
        refs = dict(ref.named_parameters())
        errs = {"loss": abs(float(loss) - float(ref_loss))}
        mine = stage_grads(pm, refs, errs, "grad")
        torch.optim.AdamW(ref.parameters(), lr=0.01).step()
        torch.optim.AdamW(pm.parameters(), lr=0.01).step()
        stepped_params(pm, refs, mine, errs, "param")
        worst = {kind: max((kv for kv in errs.items() if kv[0].split()[0] == kind), key=lambda kv: kv[1])
                 for kind in ("loss", "grad", "param")}
        return {"worst": worst, "tol": tol, "mine": mine, "all": sorted(refs)}
    finally:
        torch.set_default_dtype(old)


def _quiet():
    import warnings
    warnings.filterwarnings("ignore")


def _pp_dp(source: str, names) -> dict:
    from torch.distributed.device_mesh import init_device_mesh
    _quiet()
    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("pp",))
    return {n: _against_one_device(source, n, mesh, "dp", {"pipeline": "1f1b@pp"}) for n in names}


def _pp_tp_sp(names) -> dict:
    from torch.distributed.device_mesh import init_device_mesh
    _quiet()
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("pp", "tp"))
    return {n: _against_one_device("zoo", n, mesh, "megatron", {"pipeline": "1f1b@pp", "norm": "sequence"})
            for n in names}


def param_tol(tol: float) -> float:
    """The parameters' tolerance after the AdamW step: the gradients' for an fp64-exact family; 10x it for a
    family whose loss rounds the logits to fp32 (zoo.TOL_FP32): AdamW's first step is lr * g / (|g| + eps), so a
    gradient an fp32 ulp off (~1e-8 here) moves a parameter whose gradient is near eps by up to ~1e-5 (Qwen2 under
    the flat megatron plan with sequence-parallel norms on tp4, no pipeline: 6.6e-6)."""
    return tol if tol <= TOL_FP64 else 10 * tol


def summarise(results: list[dict]) -> dict:
    """Per model, over the ranks: ("exact", {kind: (worst error, where)} for the loss, the gradients and the
    parameters after the step) within tolerance with every parameter checked on some rank, ("raised", text)
    where every rank raised, else ("WRONG", ...)."""
    out = {}
    for name in results[0]:
        rows = [r[name] for r in results]
        if all("raised" in r for r in rows):
            out[name] = ("raised", rows[0]["raised"])
            continue
        if any("raised" in r for r in rows):
            out[name] = ("WRONG", "raised on some ranks only", [r.get("raised") for r in rows])
            continue
        worst = {kind: max((r["worst"][kind] for r in rows), key=lambda kv: kv[1])[::-1]
                 for kind in ("loss", "grad", "param")}
        seen = set().union(*(r["mine"] for r in rows))
        tol = rows[0]["tol"]
        ok = worst["loss"][0] <= tol and worst["grad"][0] <= tol and worst["param"][0] <= param_tol(tol) \
            and seen == set(rows[0]["all"])
        out[name] = ("exact" if ok else "WRONG", worst, rows[0]["tol"])
    return out



def test_t5_decoder_stage_reduces_its_received_encoder_output_gradient():
    """A received activation consumed directly by column-parallel work: T5 on pp2 x tp2 megatron with
    sequence-parallel stages, stage 1 (the decoder, built here as rank 2 of a fake world of 4) receives the encoder's
    output, which each decoder layer's cross-attention k/v linears take with no norm between. Its gradient must go
    back to stage 0 whole: Megatron's f on it (here joined with the norms' gradients in one tp bucket), not each tp
    rank's partial (it was: the encoder's gradients 4.4e-2 off). The run against one device: benchmarks/pp_foreign.py
    (t5, pp2 x tp2: exact to 4e-14)."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard
    import autopar
    from autopar.runtime import collectives as C
    from conftest import _clear_dtensor_sharding_cache
    import zoo
    _quiet()
    if dist.is_initialized():
        dist.destroy_process_group()
        _clear_dtensor_sharding_cache()
    dist.init_process_group("fake", rank=2, world_size=4)
    old = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    try:
        torch.manual_seed(0)
        model, inputs, _ = zoo.t5()
        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("pp", "tp"))
        pm = autopar.parallelize(model, mesh, inputs, plan="megatron",
                                 overrides={"pipeline": "1f1b@pp", "norm": "sequence"}, microbatches=2)
        assert pm.local_stages == [1]
        cap, *_, (arrivals, _) = pm._tp[1]
        received = cap.user_inputs[:len(cap.user_inputs) - len(pm._stage_modules[1].user)]
        assert len(received) == 2, received  # the encoder's output and the decoder's embedded inputs
        sharded = [n for n in received if n in arrivals]
        assert [arrivals[n] for n in sharded] == [(Shard(1),)]  # the embedded inputs: the sequence shard
        (memory,) = [n for n in received if n not in arrivals]  # the encoder's output, whole
        gm = pm._stage_modules[1].pm.graph_module
        (ph,) = [n for n in gm.graph.nodes if n.op == "placeholder" and n.name == memory]
        users = list(ph.users)
        assert users and all(u.target in (C.grad_all_reduce, C.grad_sync_bucket) for u in users), \
            [(u.name, u.target) for u in users]
        assert all(str(u.args[1]).startswith("tp") for u in users if u.target is C.grad_all_reduce)
    finally:
        torch.set_default_dtype(old)
        dist.destroy_process_group()
        _clear_dtensor_sharding_cache()

def test_census_transformer_encoder_pipelined_matches_one_device():
    results = gloo_pool(2).run(_pp_dp, "census", ["transformer_encoder"])
    row = summarise(results)["transformer_encoder"]
    assert row[0] == "exact" and row[2] == TOL_FP64, row
