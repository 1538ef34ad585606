"""FSDP's all-gather of tensorwise float8 weights in fp8, 1 byte per element (torchao's
`enable_fsdp_float8_all_gather`; `autopar.runtime.float8.float8_linear_gathered`, `passes.lower.float8_linears_pass`):
each weight shard's amax all-reduced (MAX) over the data axis, the shard cast with the whole weight's scale,
gathered in fp8 and used as both GEMMs' weight operand; re-gathered in fp8 in backward (a resharded layer), its
gradient reduce-scattered in fp32. On 2 gloo ranks it equals the single-device float8 model (loss, every gradient,
the parameters after an SGD step; tolerance as tests/test_float8_runtime.py: fp32 summation order), and its
collectives are exactly the plain fsdp plan's with the float8 weights moved out of the flat layer groups into their
own fp8 gathers (1/4 of fp32's bytes), plus the amax all-reduces."""

from __future__ import annotations

import copy
from collections import Counter

import torch

from tests.dist_harness import gloo_pool
from tests.test_float8_runtime import FP8_AT_LEAST, TOL, _expected_amaxes, _reference, _step


def _run_gathered():
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    import autopar
    from autopar.models import Llama, LlamaConfig
    from autopar.runtime import collectives as C

    mesh = init_device_mesh("cpu", (dist.get_world_size(),), mesh_dim_names=("dp",))
    torch.manual_seed(0)
    model = Llama(LlamaConfig(vocab_size=64, seq_len=8, hidden=32, ffn_hidden=64, num_heads=4, num_kv_heads=2))
    tokens = torch.randint(0, 64, (4, 8), generator=torch.Generator().manual_seed(1))
    inputs = (tokens, tokens.roll(-1, 1))
    pm = autopar.parallelize(copy.deepcopy(model), mesh, inputs, plan="fsdp", float8="tensorwise")
    plain = autopar.parallelize(copy.deepcopy(model), mesh, inputs, plan="fsdp")
    names = [n for n, _ in pm.named_parameters()]
    with C.record_comms() as fp8_comms:
        loss, grads = _step(pm, list(pm.named_parameters()), inputs)
    with C.record_comms() as plain_comms:
        _step(plain, list(plain.named_parameters()), inputs)
    ref = _reference(model, pm.plan.float8)
    ref_params = [(n.replace(".lin.", "."), p) for n, p in ref.named_parameters()]
    ref_loss, ref_grads = _step(ref, ref_params, inputs)
    hp = copy.deepcopy(model)
    _, hp_grads = _step(hp, list(hp.named_parameters()), inputs)
    full = {n: p.full_tensor() if hasattr(p, "full_tensor") else p for n, p in pm.named_parameters()}
    full_grads = {n: g.full_tensor() if hasattr(g, "full_tensor") else g for n, g in grads.items()}
    after = dict(ref_params)
    rel = lambda a, b: float((a - b).abs().max() / b.abs().max().clamp(min=1e-30))  # noqa: E731
    rec = lambda rs: [(r.kind, r.axis, r.pass_, r.numel, r.dtype, r.send_bytes) for r in rs]  # noqa: E731
    return dict(
        float8=pm.plan.float8, loss=abs(float(loss) - float(ref_loss)) / abs(float(ref_loss)),
        grads=max(rel(full_grads[n], ref_grads[n]) for n in names),
        params=max(rel(full[n], after[n].detach()) for n in names),
        vs_hp=max(rel(full_grads[n], hp_grads[n]) for n in names),
        fp8=rec(fp8_comms), plain=rec(plain_comms), tokens=int(tokens.numel()), placements=dict(pm.plan.params),
        shapes={path: tuple(model.get_submodule(path).weight.shape) for path, _ in pm.plan.float8},
        layer_group=sum(p.numel() for n, p in model.named_parameters() if n.startswith("layers.0.")))


def test_fsdp_gathers_tensorwise_weights_in_fp8_exactly():
    from cost_model.analytical import send_bytes
    for r in gloo_pool(2).run(_run_gathered):
        assert len(r["float8"]) == 14 and {rc for _, rc in r["float8"]} == {"tensorwise"}
        assert r["loss"] <= TOL and r["grads"] <= TOL and r["params"] <= TOL, r
        assert r["vs_hp"] >= FP8_AT_LEAST, r  # really fp8
        weights = Counter(n * k for n, k in r["shapes"].values())  # numel of each float8 weight
        fp8 = [c for c in r["fp8"] if c[4] == "float8_e4m3fn"]
        # one fp8 all-gather per float8 weight forward and again backward, in 1 byte: 1/4 of fp32's, 1/2 of bf16's
        for pass_ in ("forward", "backward"):
            assert Counter(c[3] for c in fp8 if c[2] == pass_) == weights
        for kind, _, _, numel, _, sent in fp8:
            assert kind == "all_gather" and sent == round(send_bytes("all_gather", numel, 2)) \
                == round(send_bytes("all_gather", 4 * numel, 2)) / 4 == round(send_bytes("all_gather", 2 * numel, 2)) / 2
        # the rest: the plain plan's, each layer's flat group less its float8 weights, their gradients reduce-scattered
        # one by one (fp32), plus the amax all-reduces (a weight's on dp forward: its shard's)
        key = lambda c: c[:5]  # noqa: E731
        rest = Counter(key(c) for c in r["fp8"] if c[4] != "float8_e4m3fn")
        plain = Counter(key(c) for c in r["plain"])
        group, norms = r["layer_group"], r["layer_group"] - sum(n * k for n, k in r["shapes"].values()) // 2
        want = plain.copy()
        for pass_, kind in (("forward", "all_gather"), ("backward", "all_gather"), ("backward", "reduce_scatter")):
            want[(kind, "dp", pass_, group, "float32")] -= 2
            want[(kind, "dp", pass_, norms, "float32")] += 2
        for numel, count in weights.items():
            want[("reduce_scatter", "dp", "backward", numel, "float32")] += count
        want += _expected_amaxes(r, "tensorwise", "dp")
        want[("all_reduce", "dp", "forward", 1, "float32")] += 14
        assert +rest == +want, (sorted((rest - want).items()), sorted((want - rest).items()))


def test_lowered_plan_lists_the_fp8_gathers():
    """`plan(lower=True)`: each tensorwise float8 weight's gather is its own `fsdp_gather_fp8` row, 1 byte forward."""
    import autopar
    from autopar.models import Llama, LlamaConfig
    from cost_model.analytical import send_bytes
    model = Llama(LlamaConfig(vocab_size=64, seq_len=8, hidden=32, ffn_hidden=64, num_heads=4, num_kv_heads=2))
    tokens = torch.randint(0, 64, (4, 8))
    p = autopar.plan(model, {"dp": 2}, (tokens, tokens), plan="fsdp", cluster="h100", float8="tensorwise", lower=True)
    rows = {c.module: c for c in p.comms if c.fn == "fsdp_gather_fp8"}
    assert set(rows) == {path for path, _ in p.float8}
    for path, c in rows.items():
        numel = model.get_submodule(path).weight.numel()
        assert c.bytes_forward == round(send_bytes("all_gather", numel, 2)) and c.backward == "all_gather+reduce_scatter"
