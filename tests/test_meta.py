"""Models built on the meta device, on real gloo processes: `parallelize` allocates only each rank's shards,
`autopar.load` fills them from Hugging Face safetensors (sharded with an index, or one file) or a
torch.distributed.checkpoint saved under another plan, `pm.init_weights()` runs the model's own
initialisation on the shards; non-persistent buffers (RoPE) are computed on each rank; running before either
is an error; each rank's memory while loading stays near its shards."""

from __future__ import annotations

import torch

from dist_harness import gloo_pool

TOL = 1e-5  # the Llama loss upcasts its logits to fp32 (tests/zoo.py)
LR = 0.1


# ----------------------------------------------------------------------------- models


def _llama_config(**sizes):
    import transformers
    cfg = dict(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
               num_key_value_heads=2, max_position_embeddings=64)
    cfg.update(sizes)
    return transformers.LlamaConfig(**cfg)


def _meta_llama(dtype=torch.float64, **sizes):
    import transformers
    import zoo
    old = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device("meta"):
            return zoo.LossWrap(transformers.LlamaForCausalLM(_llama_config(**sizes)))
    finally:
        torch.set_default_dtype(old)


def _mesh(shape):
    from torch.distributed.device_mesh import init_device_mesh
    return init_device_mesh("cpu", shape, mesh_dim_names=("dp", "tp")[-len(shape):])


def _step(pm, inputs):
    """Loss, every full gradient, and every full parameter after one SGD step."""
    loss = pm(**inputs) if isinstance(inputs, dict) else pm(*inputs)
    loss.backward()
    grads = {n: p.grad.full_tensor() for n, p in pm.named_parameters()}
    torch.optim.SGD(pm.parameters(), lr=LR).step()
    return float(loss), grads, {n: p.full_tensor() for n, p in pm.named_parameters()}


def _reference_step(model, inputs):
    loss = model(**inputs) if isinstance(inputs, dict) else model(*inputs)
    loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    torch.optim.SGD(model.parameters(), lr=LR).step()
    return float(loss), grads, {n: p.detach().clone() for n, p in model.named_parameters()}


def _assert_same(got, want, tol=TOL):
    (loss, grads, params), (rloss, rgrads, rparams) = got, want
    assert abs(loss - rloss) <= tol, (loss, rloss)
    assert set(grads) == set(rgrads), set(grads) ^ set(rgrads)
    for n in rgrads:
        err = (grads[n] - rgrads[n]).abs().max().item()
        assert err <= tol, f"grad {n}: {err}"
        err = (params[n] - rparams[n]).abs().max().item()
        assert err <= tol, f"param {n} after a step: {err}"


# ----------------------------------------------------------------------------- safetensors


def _init_report(pm):
    """Per parameter: its placements, its full value, and whether each rank's shard equals this rank's."""
    import torch.distributed as dist
    out = {}
    for n, p in pm.named_parameters():
        local = p.to_local().contiguous()
        gathered = [torch.empty_like(local) for _ in range(dist.get_world_size())]
        dist.all_gather(gathered, local)
        out[n] = (repr(p.placements), p.full_tensor().detach().clone(), [torch.equal(g, local) for g in gathered])
    return out


def _load_llama_job(path, other, shape):
    import time

    import autopar
    import zoo
    t0 = time.time()
    model = _meta_llama()
    inputs = zoo.causal_batch(0)
    pm = autopar.parallelize(model, _mesh(shape), inputs, plan="megatron")
    t1 = time.time()
    assert all(not p.to_local().is_meta for p in pm.parameters())
    held = sum(p.to_local().numel() for p in pm.parameters())
    try:
        pm(**inputs)
        raise AssertionError("forward before load ran on uninitialised shards")
    except RuntimeError as e:
        assert "autopar.load" in str(e) and "init_weights" in str(e), e
    try:
        autopar.load(pm, other)
        raise AssertionError("a checkpoint of another config loaded")
    except ValueError as e:
        refused = str(e)
    init = _init_report(pm.init_weights(seed=3)) if shape == (4,) else None
    t2 = time.time()
    autopar.load(pm, path)
    rope = pm.get_buffer("m.model.rotary_emb.inv_freq")
    t3 = time.time()
    out = _step(pm, inputs)
    log = f"parallelize {t1 - t0:.1f}s, init+load {t3 - t2:.1f}s, step {time.time() - t3:.1f}s"
    return held, rope, refused, init, out, log


def test_llama_from_safetensors_tp4_and_2x2(tmp_path):
    """A seeded Llama saved as sharded safetensors (with its index) equals, loaded into a meta-built model
    parallelised at tp4 and at dp2 x tp2, the single-device model loaded from the same files (loss, every
    gradient, every parameter after an SGD step). Before loading, the same model refuses to run and refuses a
    checkpoint of another config; at tp4 `init_weights` (HF `_init_weights`) runs first."""
    import transformers
    import zoo
    torch.manual_seed(0)
    path, other = tmp_path / "llama", tmp_path / "llama3"
    with zoo._fp64():
        transformers.LlamaForCausalLM(_llama_config()).save_pretrained(path, max_shard_size="40KB")
        transformers.LlamaForCausalLM(_llama_config(num_hidden_layers=3)).save_pretrained(other)
    assert (path / "model.safetensors.index.json").exists()
    assert len(list(path.glob("*.safetensors"))) > 2
    with zoo._fp64():
        ref = zoo.LossWrap(transformers.LlamaForCausalLM.from_pretrained(path, dtype=torch.float64))
    inputs = zoo.causal_batch(0)
    want = _reference_step(ref, inputs)
    full = sum(p.numel() for p in ref.parameters())
    std = _llama_config().initializer_range
    for shape in [(4,), (2, 2)]:
        results = gloo_pool(4).run(_load_llama_job, str(path), str(other), shape)
        for held, rope, refused, init, got, log in results:
            print(shape, log)
            # its shards (k/v are replicated: 2 KV heads on 4 ranks), not the model
            assert held < {4: 0.35, 2: 0.55}[shape[-1]] * full, (shape, held, full)
            assert torch.equal(rope, ref.m.model.rotary_emb.inv_freq)
            assert "unexpected ['model.layers.2." in refused and "Fix:" in refused, refused
            _assert_same(got, want)
        if shape == (4,):
            _check_init(results[0][3], lambda name, full: _ones(name, full) if "norm" in name else std)


def _ones(name, full):
    assert torch.equal(full, torch.ones_like(full)), name


def _gpt_inputs():
    g = torch.Generator().manual_seed(1)
    return torch.randint(0, 128, (4, 16), generator=g), torch.randint(0, 128, (4, 16), generator=g)


def _load_gpt_job(path):
    import autopar
    from autopar.models import GPT, GPTConfig
    with torch.device("meta"):
        model = GPT(GPTConfig())
    pm = autopar.parallelize(model, _mesh((4,)), _gpt_inputs(), plan="megatron")
    qkv = pm.get_parameter("h.0.attn.qkv.weight")
    assert "_StridedShard" in repr(qkv.placements), qkv.placements
    assert pm.get_parameter("lm_head.weight") is pm.get_parameter("wte.weight")
    init = _init_report(pm.init_weights(seed=3))
    autopar.load(pm, path)
    return init, _step(pm, _gpt_inputs())


def test_fused_qkv_and_tied_weights_from_one_safetensors_file(tmp_path):
    """A fused QKV weight (`_StridedShard`: one read per q/k/v part) and a tied embedding (saved once, as
    Hugging Face saves it) load from a single `model.safetensors`. Before that, `init_weights` runs each plain
    module's `reset_parameters` on the shards, fans from the global shape: nn.Linear weights
    U(-1/sqrt(fan_in), 1/sqrt(fan_in)), nn.Embedding N(0, 1), LayerNorm ones."""
    from safetensors.torch import save_file

    from autopar.models import GPT, GPTConfig
    torch.manual_seed(0)
    model = GPT(GPTConfig())
    state = {k: v for k, v in model.state_dict().items() if k != "lm_head.weight"}
    save_file(state, str(tmp_path / "model.safetensors"))
    want = _reference_step(model, _gpt_inputs())
    results = gloo_pool(4).run(_load_gpt_job, str(tmp_path))
    for _, got in results:
        _assert_same(got, want)

    def std_of(name, full):
        if name.endswith(("qkv.weight", "proj.weight", "fc.weight", "out.weight")):
            return 1 / full.shape[1] ** 0.5 / 3 ** 0.5
        if name.endswith("wte.weight"):
            return 1.0
        if name.startswith("ln") or ".ln" in name:
            assert torch.equal(full, torch.ones_like(full) if name.endswith("weight") else torch.zeros_like(full))
        return None

    _check_init(results[0][0], std_of)


# ----------------------------------------------------------------------------- a file bad on one rank


def _save_two_shards(model, path):
    """`model`'s state as two safetensors files and their index, as save_pretrained shards it."""
    import json

    from safetensors.torch import save_file
    path.mkdir()
    state = {k: v for k, v in model.state_dict().items() if k != "lm_head.weight"}
    keys = sorted(state)
    files = {"model-00001-of-00002.safetensors": keys[::2], "model-00002-of-00002.safetensors": keys[1::2]}
    for f, ks in files.items():
        save_file({k: state[k] for k in ks}, str(path / f))
    index = {"metadata": {}, "weight_map": {k: f for f, ks in files.items() for k in ks}}
    (path / "model.safetensors.index.json").write_text(json.dumps(index))


def _bad_file_job(dirs):
    """Load from this rank's copy of the checkpoint (`dirs[case][rank]`): each bad case is raised on every rank,
    within seconds; then the good copy loads and the model runs."""
    import time

    import torch.distributed as dist

    import autopar
    from autopar.models import GPT, GPTConfig
    rank = dist.get_rank()
    with torch.device("meta"):
        model = GPT(GPTConfig())
    pm = autopar.parallelize(model, _mesh((2,)), _gpt_inputs(), plan="megatron")
    seen = {}
    for case in ("missing", "corrupt"):
        t0 = time.time()
        try:
            autopar.load(pm, dirs[case][rank])
            raise AssertionError(f"the {case} file loaded")
        except (FileNotFoundError, ValueError) as e:
            seen[case] = (type(e).__name__, str(e), list(getattr(e, "__notes__", [])), time.time() - t0)
        try:  # nothing was marked filled on any rank: every rank refuses alike (none runs into a collective alone)
            pm(*_gpt_inputs())
            raise AssertionError("ran after a failed load")
        except RuntimeError as e:
            assert "autopar.load" in str(e), e
    autopar.load(pm, dirs["good"][rank])
    return seen, _step(pm, _gpt_inputs())


def test_a_file_missing_or_corrupt_on_one_rank_raises_on_every_rank(tmp_path):
    """Each rank reads its own copy of a two-file checkpoint (as on two nodes). Rank 1's copy lacks a file, then
    holds a truncated one: both ranks raise rank 1's error (which names rank 1 and the file) within seconds,
    instead of rank 0 waiting in the next collective; the module still refuses to run on both; the good copy
    then loads and trains exactly."""
    import shutil

    from autopar.models import GPT, GPTConfig
    torch.manual_seed(0)
    model = GPT(GPTConfig())
    good = tmp_path / "good"
    _save_two_shards(model, good)
    bad = "model-00002-of-00002.safetensors"
    dirs = {"good": [str(good)] * 2}
    for case in ("missing", "corrupt"):
        copy = tmp_path / case
        shutil.copytree(good, copy)
        if case == "missing":
            (copy / bad).unlink()
        else:
            data = (copy / bad).read_bytes()
            (copy / bad).write_bytes(data[:len(data) // 2])
        dirs[case] = [str(good), str(copy)]
    want = _reference_step(model, _gpt_inputs())
    results = gloo_pool(2).call(_bad_file_job, (dirs,), timeout=90)
    for rank, (seen, got) in enumerate(results):
        for case, kind in (("missing", "FileNotFoundError"), ("corrupt", "ValueError")):
            name, msg, notes, seconds = seen[case]
            assert name == kind, (rank, case, name, msg)
            assert "on rank 1" in msg and str(tmp_path / case / bad) in msg and "Fix:" in msg, (rank, msg)
            assert ("missing" if case == "missing" else "corrupt or truncated") in msg, msg
            assert any("rank [1] of 2 raised this in autopar.load" in n for n in notes), (rank, notes)
            assert seconds < 10, (rank, case, seconds)  # no rank waited out the process group's timeout
        _assert_same(got, want)


# ----------------------------------------------------------------------------- DCP under another plan


def _dcp_job(path):
    import torch.distributed.checkpoint as dcp

    import autopar
    from autopar.models import GPT, GPTConfig
    torch.manual_seed(0)
    saved = autopar.parallelize(GPT(GPTConfig()), _mesh((4,)), _gpt_inputs(), plan="megatron")
    dcp.save(saved.state_dict(), checkpoint_id=path)
    with torch.device("meta"):
        model = GPT(GPTConfig())
    pm = autopar.parallelize(model, _mesh((4,)), _gpt_inputs(), plan="fsdp")
    autopar.load(pm, path)
    return _step(pm, _gpt_inputs())


def test_dcp_checkpoint_saved_under_another_plan(tmp_path):
    """A DCP checkpoint saved from a megatron ParallelModule loads into a meta-built fsdp one."""
    from autopar.models import GPT, GPTConfig
    torch.manual_seed(0)
    want = _reference_step(GPT(GPTConfig()), _gpt_inputs())
    for got in gloo_pool(4).run(_dcp_job, str(tmp_path / "ckpt")):
        _assert_same(got, want)


# ----------------------------------------------------------------------------- init_weights


def _check_init(params, std_of):
    for n, (placements, full, same) in params.items():
        assert torch.isfinite(full).all(), n
        # replicas agree; different shards of one parameter are drawn independently
        assert all(same) if "Shard" not in placements else not all(same), (n, placements, same)
        want = std_of(n, full)
        if want is not None:
            assert abs(full.std().item() - want) < 0.15 * want, (n, full.std().item(), want)


# ----------------------------------------------------------------------------- what is refused


def _refusals_job():
    import autopar

    class Rope(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = torch.nn.Linear(8, 8)
            self.register_buffer("table", torch.arange(8.0), persistent=False)

        def forward(self, x):
            return (self.lin(x) * self.table).sum()

    with torch.device("meta"):
        model = Rope()
    try:
        autopar.parallelize(model, _mesh((4,)), (torch.randn(4, 8),), plan="megatron")
    except NotImplementedError as e:
        return str(e)
    raise AssertionError("a meta buffer nobody can compute was accepted")


def test_uncomputable_meta_buffer_is_refused():
    for msg in gloo_pool(4).run(_refusals_job):
        assert "buffer table" in msg and "Fix:" in msg, msg


# ----------------------------------------------------------------------------- memory


def _rss_job(path):
    import ctypes
    import gc

    import autopar
    import zoo

    def status(field):
        for line in open("/proc/self/status"):
            if line.startswith(field):
                return int(line.split()[1]) * 1024
        raise AssertionError(field)

    gc.collect()
    ctypes.CDLL("libc.so.6").malloc_trim(0)  # on the shared pool: freed heap of earlier jobs back to the OS, so
    # that `load` cannot grow into memory already resident (the peak below would read too low)
    model = _meta_llama(dtype=torch.float32, **_BIG)
    inputs = {k: v[:, :8] for k, v in zoo.causal_batch(0).items()}
    start = status("VmRSS:")
    pm = autopar.parallelize(model, _mesh((4,)), inputs, plan="megatron")  # imports, capture, planning, shards
    gc.collect()
    before = status("VmRSS:")
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # reset the peak (VmHWM) to the current RSS
    autopar.load(pm, path)
    shards = sum(p.to_local().numel() * p.to_local().element_size() for p in pm.parameters())
    return status("VmHWM:") - before, before - start, shards, float(pm(**inputs))


_BIG = dict(vocab_size=16384, hidden_size=768, intermediate_size=2048, num_hidden_layers=2, num_attention_heads=12,
            num_key_value_heads=12)


def test_peak_memory_per_rank_while_loading_tp4(tmp_path):
    """Each of 4 ranks' peak RSS while `load` runs grows by less than half the model's bytes above what it
    held before (its shards, allocated but untouched, are a quarter of the model, plus replicated k/v and norms;
    the checkpoint is read in slices, one file mapped at a time)."""
    import transformers
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(_llama_config(**_BIG))
    full_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    assert full_bytes > 100 * 2**20, full_bytes
    model.save_pretrained(tmp_path, max_shard_size="32MB")
    del model
    results = gloo_pool(4).call(_rss_job, (str(tmp_path),), timeout=300)  # the shared pool: no 4 fresh imports
    for rank, (grown, parallelize_grown, shards, loss) in enumerate(results):
        print(f"rank {rank}: peak RSS growth while loading {grown / 2**20:.1f} MiB = {grown / full_bytes:.3f} x the "
              f"model's {full_bytes / 2**20:.1f} MiB ({grown / shards:.2f} x its shards' {shards / 2**20:.1f} MiB); "
              f"parallelize (imports, capture, plan) grew it by {parallelize_grown / 2**20:.1f} MiB")
        assert grown < 0.5 * full_bytes, (rank, grown, full_bytes)
        assert 0 < loss < 20, loss


def test_meta_moe_and_simulated_ranks_are_refused(local_world):
    """What is not supported yet raises, saying so: a meta MoE model (its rewrite is verified on real weights)
    and a meta model on simulated ranks (each would need its own shard shape)."""
    import pytest

    import autopar
    from autopar.models import GPT, GPTConfig, Llama, LlamaConfig
    with torch.device("meta"):
        moe = Llama(LlamaConfig(moe_experts=4))
        gpt = GPT(GPTConfig())
    inputs = _gpt_inputs()
    with local_world(4):
        mesh = _mesh((4,))
        with pytest.raises(NotImplementedError, match="MoE blocks .* not supported yet.*Fix:"):
            autopar.parallelize(moe, mesh, inputs, plan="megatron")
        with pytest.raises(NotImplementedError, match="LocalTensorMode.*Fix:"):
            autopar.parallelize(gpt, mesh, inputs, plan="megatron")
