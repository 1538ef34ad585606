"""Sequence and context forms, measured: bytes each rank sends per step, counted where autopar's
collectives are issued (every all-gather / reduce-scatter / all-to-all / ring step), against the
volume formulas of DESIGN.md §3 (each form's module in autopar.forms); and activation memory saved for backward
per rank, tensor parallel vs tensor + sequence parallel, against Korthikanti et al. (2205.05198): what
saved_tensors_hooks see (unique storages of rank 0), the whole model with and without the parameters, and per
layer (the difference between L and L/2 layers) against Korthikanti's terms for this layer.

Runs in one process on simulated ranks (LocalTensorMode), 4 ranks, fp32, a 4-layer GPT without
dropout (SDPA attention, so no s^2 score term). Only the per-layer collectives of the form are
compared (the embedding, loss and gradient reductions are reported separately).

    python benchmarks/sequence_forms.py
"""

from __future__ import annotations

import copy
from collections import defaultdict

import torch
import torch.distributed as dist
from torch.distributed._local_tensor import LocalTensorMode
from torch.distributed.device_mesh import init_device_mesh

import autopar
from autopar.models import GPT, GPTConfig
from autopar.runtime.collectives import record_comms
from autopar.forms import blocks, sequence_norm, ulysses
from autopar.forms import ring as ring_form

P, B, S, H, L, HEADS = 4, 2, 256, 128, 4, 8


def _model(layers: int = L):
    torch.manual_seed(0)
    return GPT(GPTConfig(vocab_size=512, seq_len=S, num_layers=layers, num_heads=HEADS, hidden=H))


def _inputs():
    g = torch.Generator().manual_seed(0)
    return torch.randint(0, 512, (B, S), generator=g), torch.randint(0, 512, (B, S), generator=g)


def _storage(t: torch.Tensor):
    """Rank 0's storage of a (local) tensor: (address, bytes)."""
    lt = getattr(t, "_local_tensors", None)
    local = lt[0] if lt is not None else t
    return local.untyped_storage().data_ptr(), local.untyped_storage().nbytes()


def measure(plan: str, overrides: dict, axis: str, layers: int = L):
    """(bytes sent per collective kind, bytes saved for backward on rank 0 (unique storages, parameters
    included), of which activations (parameters excluded), the collective records)."""
    model, x = _model(layers), _inputs()
    saved: dict[int, int] = {}

    def pack(t):
        ptr, nbytes = _storage(t)
        saved[ptr] = nbytes
        return t

    with LocalTensorMode(P):
        mesh = init_device_mesh("cpu", (P,), mesh_dim_names=(axis,))
        pm = autopar.parallelize(copy.deepcopy(model), mesh, x, plan=plan, overrides=overrides)
        params = {_storage(p.to_local())[0] for p in pm.parameters()}
        with record_comms() as recs:
            with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
                loss = pm(*x)
            loss.backward()
    per_layer = defaultdict(float)
    for r in recs:
        per_layer[r.kind] += r.send_bytes
    acts = sum(n for ptr, n in saved.items() if ptr not in params)
    return per_layer, sum(saved.values()), acts, recs


def main() -> None:
    dist.init_process_group("fake", rank=0, world_size=P)
    e = 4  # fp32
    print(f"GPT {L} layers, b={B} s={S} h={H} heads={HEADS}, {P} simulated ranks, fp32")
    rows = []
    # Megatron TP: per layer 2 all-reduces forward + 2 backward of b*s*h
    tp, tp_mem, tp_act, tp_recs = measure("megatron", {}, "tp")
    layer_ar = sum(r.send_bytes for r in tp_recs if r.kind == "all_reduce" and r.numel == B * S * H)
    # + once per model: the vocab-parallel embedding's forward all-reduce, the LM head input's backward one
    rows.append(("tensor parallel (all-reduce of b*s*h)", layer_ar,
                 L * 2 * blocks.tensor_parallel_volume_bytes(B * S * H * e, P) + 2 * 2 * (P - 1) / P * B * S * H * e))
    sp, sp_mem, sp_act, sp_recs = measure("megatron", {"norm": "sequence"}, "tp")
    layer_sp = sum(r.send_bytes for r in sp_recs if r.kind in ("all_gather", "reduce_scatter") and r.numel == B * S * H)
    # the block inputs/outputs: 4 per layer each way, and the 2 re-gathers backward; the embedding reduce-scatter
    # and the LM-head gather add 2 more each way, and the LM head's re-gather 1
    rows.append(("Megatron SP (all-gather + reduce-scatter of b*s*h)", layer_sp,
                 L * sequence_norm.layer_volume_bytes(B, S, H, P, e) + 5 * (P - 1) / P * B * S * H * e))
    uly, _, _, uly_recs = measure("dp", {"attention": "ulysses"}, "sp")
    a2a = sum(r.send_bytes for r in uly_recs if r.kind == "all_to_all")
    rows.append(("Ulysses (all-to-all seq<->heads)", a2a, L * ulysses.layer_volume_bytes(B, S, H, H, P, e)))
    ring, _, _, ring_recs = measure("dp", {"attention": "ring"}, "cp")
    p2p = sum(r.send_bytes for r in ring_recs if r.kind == "p2p")
    rows.append(("Ring attention (K/V steps, dK/dV)", p2p, L * ring_form.layer_volume_bytes(B, S, H, P, e)))
    for name, got, want in rows:
        print(f"RATIO bytes {name}: measured {got / 2**20:.3f} MiB, formula {want / 2**20:.3f} MiB, "
              f"measured/formula = {got / want:.3f}")
    # activation memory per rank (tensors autograd saved for backward), TP vs TP+SP
    a = HEADS
    kor_tp = S * B * H * (10 + 24 / P + 5 * a * S / (H * P))
    kor_sp = S * B * H / P * (34 + 5 * a * S / H)
    print(f"saved for backward per rank, whole model, parameters included: TP {tp_mem / 2**20:.2f} MiB, TP+SP "
          f"{sp_mem / 2**20:.2f} MiB, ratio SP/TP = {sp_mem / tp_mem:.3f}")
    print(f"activations per rank, whole model (parameters excluded): TP {tp_act / 2**20:.2f} MiB, TP+SP "
          f"{sp_act / 2**20:.2f} MiB, ratio SP/TP = {sp_act / tp_act:.3f}")
    # per layer: the difference between L and L/2 layers, over L/2
    half = L // 2
    tp_layer = (tp_act - measure("megatron", {}, "tp", half)[2]) / (L - half)
    sp_layer = (sp_act - measure("megatron", {"norm": "sequence"}, "tp", half)[2]) / (L - half)
    # Korthikanti's terms for this layer: no dropout (no masks), flash-style SDPA (no s^2 terms; an fp32
    # log-sum-exp of a*s*b per rank), plus the two layer norms' fp32 mean/rstd (16sb bytes): in elements of
    # e = 4 bytes, TP sbh(4 + 12/t) + 4sb + 2as b/(t e/4), SP (sbh 16 + 4sb + 2asb/(e/4))/t
    e = 4
    form_tp = S * B * H * (4 + 12 / P) * e + 16 * S * B + 4 * a * S * B / P
    form_sp = (S * B * H * 16 * e + 16 * S * B + 4 * a * S * B) / P
    print(f"activations per rank per layer: TP {tp_layer / 2**20:.3f} MiB, TP+SP {sp_layer / 2**20:.3f} MiB, "
          f"ratio SP/TP = {sp_layer / tp_layer:.3f}")
    print(f"RATIO activations per layer SP/TP: measured {sp_layer / tp_layer:.3f}, Korthikanti for this layer (no "
          f"dropout, flash SDPA: TP sbh(8 + 24/t), SP 32sbh/t, 16-bit units; plus norm statistics and the "
          f"log-sum-exp) {form_sp / form_tp:.3f}, measured/formula = {(sp_layer / tp_layer) / (form_sp / form_tp):.3f}; "
          f"bytes measured/formula: TP {tp_layer / form_tp:.3f}, SP {sp_layer / form_sp:.3f}")
    print(f"Korthikanti per layer (16-bit, with dropout masks and s^2 scores): TP {kor_tp / 2**20:.2f} MiB, "
          f"TP+SP {kor_sp / 2**20:.2f} MiB, ratio {kor_sp / kor_tp:.3f}; without the 5as/h score terms "
          f"(flash attention): ratio {(34 / P) / (10 + 24 / P):.3f}; without those and the dropout masks "
          f"{(32 / P) / (8 + 24 / P):.3f}")
    print("note: SP keeps each column-parallel linear's input sharded for backward and re-gathers it there "
          "(`regather_linears`), as Megatron does: one all-gather of b*s*h more per such linear, backward")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
