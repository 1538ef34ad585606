"""Plan quality: the ILP's plan (`plan="auto"`) against the best hand plan (megatron, dp, fsdp),
all priced by the same cost model (`Plan.estimate`), over models x sequence lengths x cluster presets.

    python benchmarks/plan_quality.py [--quick]      # --quick: 4k and 32k only

Models (Hugging Face, on the meta device, bf16): a Llama-3-8B shape, a Llama-3.2-1B shape (tied
embeddings) and a GPT-2-medium shape (vocab 50257, which does not divide over 8 ranks, so its
embedding and loss cannot be vocab-parallel). Mesh {"dp": 8, "tp": 8}. Sequence lengths 4k, 32k, 128k.
Two global batches: 64 sequences (one per device under pure data parallelism, eight per
data-parallel rank under megatron: every subset of mesh axes divides it) and 8 (one per
data-parallel rank under megatron; it does not divide over all 64 devices, so the `dp` and `fsdp`
hand plans replicate their input, and an `auto` plan that picks both axes as data axes is invalid:
such plans are flagged and left out of the ratios).

For each cell:
- `auto` at the preset's memory (80 GB); when no plan fits, the planner's message, and `auto` again
  with no memory limit (its fastest plan, priced anyway);
- each hand plan, priced (whether or not it fits);
- ratio_free  = auto with no memory limit / the fastest hand plan   (goal <= 1: the hand plans are in
  the ILP's search space, so the ILP can only match or beat them);
- ratio_fit   = auto at 80 GB / the fastest hand plan that fits 80 GB (when both exist).

The model is captured once per (model, sequence) and planned for every cluster and plan from that
capture (`autopar.api._prepare` / `_resolve_plan`, what `autopar.plan` runs); one cell is checked
against a public `autopar.plan` call.
"""

from __future__ import annotations

import math
import os
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
for p in (ROOT, HERE):
    if p not in sys.path:
        sys.path.insert(0, p)

from planning import batch_split_ok, data_axes, forms, llama_meta  # noqa: E402

MESH = {"dp": 8, "tp": 8}
BATCHES = (64, 8)  # one sequence per device under pure data parallelism; one per data-parallel rank
SEQS = (4096, 32768, 131072)
CLUSTERS = ("h100", "a100")
HAND = ("megatron", "dp", "fsdp")
NO_LIMIT = 1e18


def gpt2_meta(seq: int, batch: int, *, layers=24, hidden=1024, heads=16, vocab=50257):
    import torch
    from transformers import GPT2Config, GPT2LMHeadModel
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    cfg = GPT2Config(vocab_size=vocab, n_positions=seq, n_embd=hidden, n_layer=layers, n_head=heads, use_cache=False)
    with torch.device("meta"):
        model = GPT2LMHeadModel(cfg).to(torch.bfloat16)
        ids = torch.zeros(batch, seq, dtype=torch.long)
    return model, {"input_ids": ids, "labels": ids}


def _llama1b(seq: int, batch: int):
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(vocab_size=128256, hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
                      num_attention_heads=32, num_key_value_heads=8, max_position_embeddings=seq, use_cache=False,
                      tie_word_embeddings=True)
    with torch.device("meta"):
        model = LlamaForCausalLM(cfg).to(torch.bfloat16)
        ids = torch.zeros(batch, seq, dtype=torch.long)
    return model, {"input_ids": ids, "labels": ids}


MODELS = {
    "llama3-8b": lambda seq, batch: llama_meta(32, 4096, 32, 8, 14336, 128256, seq, batch),
    "llama3.2-1b": _llama1b,
    "gpt2-medium": gpt2_meta,
}


def _plan(captured_state, name: str, cluster: str, memory_limit=None):
    from autopar import api
    info, captured, ctx = captured_state
    with api._local_tensor_off():
        return api._resolve_plan(name, ctx, info, None, captured, cluster, memory_limit)


def _ms(p) -> float:
    return p.estimate.step_time_s * 1e3


def _gib(p) -> float:
    return p.estimate.memory_bytes_per_device / 2**30


def cell(state, cluster: str) -> dict:
    from autopar.solver import InfeasibleError

    r = {"hand": {}}
    for h in HAND:
        r["hand"][h] = _plan(state, h, cluster)
    try:
        r["auto"] = _plan(state, "auto", cluster)
        r["infeasible"] = None
    except InfeasibleError as e:
        r["auto"] = None
        r["infeasible"] = str(e)
    r["free"] = _plan(state, "auto", cluster, NO_LIMIT)
    # a plan whose data axes do not divide the batch replicates its input, so its estimate (which divides
    # the work by the data-parallel degree) is not its cost: such plans are left out of the comparison
    valid = [h for h in HAND if batch_split_ok(r["hand"][h])]
    best = min(valid, key=lambda h: _ms(r["hand"][h])) if valid else None
    fitting = [h for h in valid if r["hand"][h].estimate.fits]
    best_fit = min(fitting, key=lambda h: _ms(r["hand"][h])) if fitting else None
    r["best"], r["best_fit"] = best, best_fit
    r["free_ok"] = batch_split_ok(r["free"])
    r["auto_ok"] = r["auto"] is not None and batch_split_ok(r["auto"])
    r["ratio_free"] = _ms(r["free"]) / _ms(r["hand"][best]) if best and r["free_ok"] else None
    r["ratio_fit"] = _ms(r["auto"]) / _ms(r["hand"][best_fit]) if r["auto_ok"] and best_fit else None
    return r


def _bd(p) -> str:
    e = p.estimate
    return (f"{e.step_time_s * 1e3:.1f} ms = compute {e.compute_time_s * 1e3:.1f} + comm {e.comm_time_s * 1e3:.1f}, "
            f"{e.memory_bytes_per_device / 2**30:.1f} GiB")


def main() -> None:
    from autopar import api

    quick = "--quick" in sys.argv
    seqs = SEQS[:2] if quick else SEQS
    t_start = time.perf_counter()
    rows = []
    checked = False
    for batch in BATCHES:
        for mname, make in MODELS.items():
            for seq in seqs:
                model, inputs = make(seq, batch)
                t0 = time.perf_counter()
                state = api._prepare(model, MESH, inputs, None)
                cap_s = time.perf_counter() - t0
                for cl in CLUSTERS:
                    t0 = time.perf_counter()
                    r = cell(state, cl)
                    r.update(model=mname, seq=seq, cluster=cl, batch=batch, capture_s=cap_s,
                             plan_s=time.perf_counter() - t0)
                    rows.append(r)
                    _print_cell(r)
                    if not checked:  # the shortcut plans exactly what the public call plans
                        import autopar
                        pub = autopar.plan(model, MESH, inputs, plan="megatron", cluster=cl)
                        assert abs(pub.estimate.step_time_s - r["hand"]["megatron"].estimate.step_time_s) < 1e-12
                        checked = True
    for batch in BATCHES:
        _summary([r for r in rows if r["batch"] == batch], batch)
    free = [r["ratio_free"] for r in rows if r["ratio_free"] is not None]
    fit = [r["ratio_fit"] for r in rows if r["ratio_fit"] is not None]
    invalid = [r for r in rows if not r["free_ok"] or (r["auto"] is not None and not r["auto_ok"])]
    gm = lambda xs: math.exp(sum(map(math.log, xs)) / len(xs))  # noqa: E731
    print()
    print(f"RATIO plan_quality_auto_free_over_best_hand_max = {max(free):.3f} (goal <= 1.0; geometric mean "
          f"{gm(free):.3f}, min {min(free):.3f}, {len(free)} cells with valid plans)")
    if fit:
        print(f"RATIO plan_quality_auto_80GB_over_best_fitting_hand_max = {max(fit):.3f} (goal <= 1.0; geometric "
              f"mean {gm(fit):.3f}, min {min(fit):.3f}, {len(fit)} cells where both fit)")
    print(f"cells where auto chose data axes that do not divide the batch (invalid plan, left out above): "
          f"{len(invalid)} of {len(rows)}")
    print(f"total time {time.perf_counter() - t_start:.0f} s")


def _summary(rows, batch) -> None:
    print()
    print(f"== summary: mesh {MESH}, global batch {batch}; estimated step times (ms) under the cost model")
    print(f"{'model':<12} {'seq':>6} {'clus':<5} {'auto@80GB':>10} {'auto free':>10} {'megatron':>10} {'dp':>10} "
          f"{'fsdp':>10} {'best hand':>9} {'ratio_free':>10} {'ratio_fit':>9}  auto's plan")
    for r in rows:
        def t(p):
            return f"{_ms(p):.0f}{'' if p.estimate.fits else '*'}{'' if batch_split_ok(p) else '!'}"
        auto = t(r["auto"]) if r["auto"] else "none fits"
        fr = f"{r['ratio_free']:.3f}" if r["ratio_free"] is not None else "invalid"
        fit = f"{r['ratio_fit']:.3f}" if r["ratio_fit"] is not None else ("invalid" if r["auto"] and not r["auto_ok"]
                                                                          else "n/a")
        chosen = r["auto"] or r["free"]
        print(f"{r['model']:<12} {r['seq'] // 1024:>5}k {r['cluster']:<5} {auto:>10} {t(r['free']):>10} "
              f"{t(r['hand']['megatron']):>10} {t(r['hand']['dp']):>10} {t(r['hand']['fsdp']):>10} "
              f"{r['best'] or '-':>9} {fr:>10} {fit:>9}  {forms(chosen)}; data axes {data_axes(chosen)}")
    print("(* does not fit 80 GB per device; ! data axes do not divide the batch: the input is replicated, the "
          "estimate is not the plan's cost. 'auto@80GB': the ILP at the preset's memory; 'auto free': no memory "
          "limit; ratio_free = auto free / fastest valid hand plan; ratio_fit = auto@80GB / fastest valid hand plan "
          "that fits)")
    only_auto = [r for r in rows if r["auto_ok"] and not r["best_fit"]]
    print("cells where auto fits 80 GB and no valid hand plan does: " + str(len(only_auto)) + " (" +
          (", ".join(f"{r['model']} {r['seq'] // 1024}k {r['cluster']}" for r in only_auto) or "-") + ")")
    print(f"cells where no plan fits 80 GB: {sum(1 for r in rows if not r['auto'])} of {len(rows)}")


def _print_cell(r) -> None:
    print(f"== {r['model']} seq {r['seq']} batch {r['batch']} on {r['cluster']} (capture {r['capture_s']:.1f} s, 4 plans "
          f"{r['plan_s']:.1f} s)")
    if r["infeasible"]:
        print(f"  auto at 80 GB: {r['infeasible'].split(': the least')[0].split(' on mesh')[0]}; least memory "
              f"{r['infeasible'].split('needs is ')[1].split(' per device')[0]}")
    else:
        print(f"  auto:      {_bd(r['auto'])}  [{forms(r['auto'])}; data axes {data_axes(r['auto'])}]")
    print(f"  auto free: {_bd(r['free'])}  [{forms(r['free'])}; data axes {data_axes(r['free'])}]")
    for h in HAND:
        p = r["hand"][h]
        print(f"  {h:<9}  {_bd(p)}{'' if p.estimate.fits else ' (does not fit)'}"
              f"{'' if batch_split_ok(p) else ' (INVALID: batch does not divide over its data axes)'}")
    if not r["free_ok"] or (r["auto"] is not None and not r["auto_ok"]):
        print("  auto's plan is INVALID: its data axes do not divide the batch")
    print("  " + (f"ratio_free {r['ratio_free']:.3f} (best valid hand {r['best']})" if r["ratio_free"] else
                  "ratio_free n/a") +
          (f", ratio_fit {r['ratio_fit']:.3f} (best fitting hand {r['best_fit']})" if r["ratio_fit"] else ""),
          flush=True)


if __name__ == "__main__":
    main()
