"""Hugging Face MoE models on the meta device: `parallelize` (the experts verified on a shrunken copy,
`passes/moe_shrunken.py`) and `autopar.load` of a checkpoint in Hugging Face's on-disk key layout (per-expert
`block_sparse_moe.experts.<e>.w1/w2/w3`, renamed and stacked as `from_pretrained` does), each rank reading only the
experts it owns; exact (fp64) against one device loaded from the same files with `from_pretrained`."""

from __future__ import annotations

import re

import torch

from dist_harness import gloo_pool

TOL = 1e-5  # Hugging Face Mixtral routes and computes its loss in fp32 (tests/zoo.py)
LR = 0.01


def _meta_moe_worker(path: str, family: str = "mixtral"):
    import re

    import torch.distributed as dist
    import transformers
    from torch.distributed.device_mesh import init_device_mesh

    import autopar
    import zoo
    from autopar.runtime.collectives import record_comms

    rank = dist.get_rank()
    ref, inputs, _ = getattr(zoo, family)()  # fp64, seeded
    cls = type(ref.m)
    if rank == 0:
        ref.m.save_pretrained(path)  # Hugging Face's on-disk layout (the reverse of from_pretrained's renames)
    dist.barrier()
    saved = cls.from_pretrained(path, dtype=torch.float64, experts_implementation="eager")
    ref = zoo.LossWrap(saved).eval()
    old = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    try:
        with torch.device("meta"):
            meta = zoo.LossWrap(cls(saved.config)).eval()
    finally:
        torch.set_default_dtype(old)
    mesh = init_device_mesh("cpu", (4,), mesh_dim_names=("ep",))
    pm = autopar.parallelize(meta, mesh, (inputs["input_ids"], inputs["labels"]), plan="dp",
                             overrides={"moe": "expert@ep"})
    import autopar.weights as weights
    opened, real_open = [], weights._open
    weights._open = lambda file, listed: (opened.append(file), real_open(file, listed))[1]
    try:
        autopar.load(pm, path)
    finally:
        weights._open = real_open
    import os
    n_files = len([f for f in os.listdir(path) if f.endswith(".safetensors")])
    with record_comms() as recs:
        loss = pm(inputs["input_ids"], inputs["labels"])
        loss.backward()
    rloss = ref(inputs["input_ids"], inputs["labels"])
    rloss.backward()
    grads = {n: float((p.grad.full_tensor() - dict(ref.named_parameters())[n].grad).abs().max())
             for n, p in pm.named_parameters()}
    torch.optim.AdamW(pm.parameters(), lr=LR).step()
    torch.optim.AdamW(ref.parameters(), lr=LR).step()
    params = {n: float((p.full_tensor() - dict(ref.named_parameters())[n]).abs().max())
              for n, p in pm.named_parameters()}
    counts: dict[str, int] = {}
    for r in recs:
        counts[f"{r.kind}.{r.pass_}"] = counts.get(f"{r.kind}.{r.pass_}", 0) + 1
    experts = {k: v for k, v in pm._bytes_read.items() if re.search(r"\.experts\.\d+\.", k)}
    keys = sorted(pm._bytes_read)
    notes = [n for n in pm.plan.notes if "shrunken copy" in n]
    # megatron on the same files (experts split on their FFN features: `moe: tp`), loss and gradients
    tp = autopar.parallelize(meta, init_device_mesh("cpu", (4,), mesh_dim_names=("tp",)),
                             (inputs["input_ids"], inputs["labels"]), plan="megatron")
    autopar.load(tp, path)
    loss_tp = tp(inputs["input_ids"], inputs["labels"])
    loss_tp.backward()
    saved2 = cls.from_pretrained(path, dtype=torch.float64, experts_implementation="eager")
    ref2 = zoo.LossWrap(saved2).eval()
    rloss2 = ref2(inputs["input_ids"], inputs["labels"])
    rloss2.backward()
    ref2_params = dict(ref2.named_parameters())
    tp_err = max([abs(float(loss_tp) - float(rloss2))] +
                 [float((p.grad.full_tensor() - ref2_params[n].grad).abs().max()) for n, p in tp.named_parameters()])
    return float(loss), float(rloss), grads, params, counts, experts, keys, notes, \
        {n for n, _ in ref.named_parameters()}, tp_err, tp.plan.table(), len(opened), n_files


def test_meta_mixtral_expert_parallel_loads_hf_layout_experts_on_owners(tmp_path):
    results = gloo_pool(4).run(_meta_moe_worker, str(tmp_path))
    for rank, (loss, rloss, grads, params, counts, experts, keys, notes, names, tp_err, table, opened, n_files) \
            in enumerate(results):
        # each file opened at most three times (its keys listed, the plain tensors, the stacked experts), not once
        # per expert tensor (24 here)
        assert opened <= 3 * n_files, (rank, opened, n_files)
        assert tp_err <= TOL, (rank, tp_err)  # megatron: loss and every gradient
        assert re.search(r"mlp\.experts.*moe +tp@tp +gate_up_proj=SS\(1,2\), down_proj=S\(2\)", table), table
        assert abs(loss - rloss) <= TOL, (rank, loss, rloss)
        assert set(grads) == set(params) == names
        bad = {n: e for n, e in {**grads, **{f"{k} (after AdamW)": v for k, v in params.items()}}.items()
               if not e <= TOL}
        assert not bad, f"rank {rank}: differs from one device: {bad}"
        # the checkpoint is in the per-expert layout from_pretrained converts: 2 layers x 4 experts x w1/w2/w3
        assert any(".block_sparse_moe.experts.0.w1.weight" in k for k in keys), keys[:5]
        assert len(experts) == 2 * 4 * 3, sorted(experts)
        # ep4 over 4 experts: rank r owns expert r of each layer and reads it whole; nothing of the others
        for key, read in experts.items():
            e = int(key.split(".experts.")[1].split(".")[0])
            assert (read > 0) == (e == rank), (rank, key, read)
        owned = [v for k, v in experts.items() if f".experts.{rank}." in k]
        assert owned and all(v == owned[0] for v in owned[:2])
        assert len(notes) == 2, notes  # both layers' experts verified on a shrunken copy
        # per MoE layer: counts, tokens out, tokens back forward; tokens out and back backward
        assert counts.get("all_to_all.forward") == 3 * 2 and counts.get("all_to_all.backward") == 2 * 2, counts
    assert all(r[4] == results[0][4] for r in results)


def _meta_notes(family: str, experts_implementation: str | None = "eager", break_it: bool = False):
    """The capture notes of `family` from the zoo built on the meta device (fp32 unless eager: fp64)."""
    import transformers

    import autopar  # noqa: F401 - before passes.moe (autopar's own import order)
    import zoo
    from passes.moe import recognise_moe_modules
    model, inputs, _ = getattr(zoo, family)()
    config = model.m.config
    config._experts_implementation = experts_implementation
    with torch.device("meta"):
        meta = zoo.LossWrap(type(model.m)(config).to(torch.float64 if experts_implementation == "eager" else
                                                     torch.float32))
    if break_it:  # experts whose gate and up halves are swapped: not what autopar's canonical form computes
        for layer in meta.m.model.layers:
            experts = getattr(layer.mlp, "experts", None)
            if experts is not None:
                cls = type(experts)

                def swapped(self, hidden_states, top_k_index, top_k_weights, _cls=cls):
                    g, u = self.gate_up_proj.chunk(2, dim=1)
                    saved = self.gate_up_proj
                    self.gate_up_proj = torch.nn.Parameter(torch.cat([u, g], 1))
                    try:
                        return _cls.forward(self, hidden_states, top_k_index, top_k_weights)
                    finally:
                        self.gate_up_proj = saved
                experts.forward = swapped.__get__(experts)
    notes: list[str] = []
    del transformers
    recognise_moe_modules(meta, (), {k: v.to("meta") for k, v in inputs.items()}, notes)
    return notes


def test_shrunken_copy_verifies_mixtral_qwen3_deepseek_and_catches_a_wrong_experts_module():
    """In one process: the experts modules of three families on meta are verified on shrunken copies (the eager
    loop: by calls at two sizes; grouped_mm: by the exported graphs), and experts computing something else are
    left as written with the reason."""
    for family, layers in (("mixtral", 2), ("qwen3_moe", 2), ("deepseek_v3", 1)):
        notes = _meta_notes(family)
        assert sum("verified on a shrunken copy" in n for n in notes) == layers, (family, notes)
    notes = _meta_notes("mixtral", "grouped_mm")
    assert sum("verified on a shrunken copy" in n for n in notes) == 2, notes
    notes = _meta_notes("mixtral", break_it=True)
    assert notes and all("left as written (replicated)" in n and "shrunken copy" in n and "differs" in n
                         for n in notes), notes
