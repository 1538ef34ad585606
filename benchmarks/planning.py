"""Planning (issue #11 item 7): does `autopar.plan(..., plan="auto")` find a plan that fits, as fast as the best
hand plan that fits, in time? For each shape, in a fresh process: `auto` (timed: the first plan of the process,
imports done, nothing traced yet), then every hand plan (`megatron`, `fsdp`) at every activation checkpointing
level (`{"checkpoint": "none" | "selective" | "full"}` overrides), all on the H100 preset at its default memory
limit (80 GB), the model torchtitan's Llama 3 (`llama_tt_meta`: causal flash SDPA, untied output) built whole on
the meta device in bf16, global batch = dp.

    python benchmarks/planning.py [--quick]      # --quick: the 8B 8k shape only
    python benchmarks/planning.py --pipeline     # auto on {"pp": 16, "dp": 128, "tp": 8}, 126 layers (issue #23)

Shapes: Llama-3-8B at 8k on {"dp": 8, "tp": 8}; 8B at 128k on {"dp": 2, "tp": 8}; 70B at 8k on {"dp": 64, "tp": 8}.
The table: shape, does auto fit, its peak (GiB), its step (ms), the best fitting hand plan and its level, its step,
auto / best hand, planning seconds (wall clock, and the process' CPU seconds: on a shared machine the wall clock
waits for a core), and auto's checkpoint level per layer class. Every step is the plan's own estimate
(`Plan.estimate.step_time_s`: the step's timeline), the one `auto` ranks its candidates by (its '(re-ranked)'
decision, printed per shape: the ILP's best distinct solutions and the hand plans, each at that estimate). The hand
plans are planned on one capture of the model (the same plans `autopar.plan` gives, without capturing each again). A hand plan whose batch does not
divide over its data axes (fsdp shards over dp x tp = 64 ranks, batch 8) replicates its input, so it is not the
plan its estimate prices: it is listed, not compared. When nothing fits, the peak's breakdown says why.

Goals: planning_<shape> fits = yes, auto / best fitting hand plan <= 1.0, planned in <= 10 s (8B) and <= 30 s
(70B) on this machine (2 cores, shared).
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

LLAMA_8B = dict(layers=32, hidden=4096, heads=32, kv_heads=8, ffn=14336, vocab=128256)
LLAMA_70B = dict(layers=80, hidden=8192, heads=64, kv_heads=8, ffn=28672, vocab=128256)
SHAPES = {  # issue #11: name: (shape, sequence, mesh, global batch = dp, goal seconds)
    "8b_8k": (LLAMA_8B, 8192, {"dp": 8, "tp": 8}, 8, 10.0),
    "8b_128k": (LLAMA_8B, 131072, {"dp": 2, "tp": 8}, 2, 10.0),
    "70b_8k": (LLAMA_70B, 8192, {"dp": 64, "tp": 8}, 64, 30.0),
}
HAND_PLANS = ("megatron", "fsdp")
LEVELS = ("none", "selective", "full")  # autopar.forms.checkpoint.LEVELS, as overrides name them
GIB = 2**30


def llama_tt_meta(shape: dict, seq: int, batch: int, layers: int | None = None):
    """torchtitan's Llama 3 as autopar.models.Llama (RMSNorm, RoPE, GQA, SwiGLU, untied output, fp32 loss) with
    causal SDPA (torchtitan calls `F.scaled_dot_product_attention(..., is_causal=True)`: flash attention skips
    the masked half; the HF model's explicit mask would price the full square), on meta in bf16."""
    import torch
    from autopar.models import Llama, LlamaConfig

    cfg = LlamaConfig(vocab_size=shape["vocab"], seq_len=seq, num_layers=layers or shape["layers"],
                      num_heads=shape["heads"], num_kv_heads=shape["kv_heads"], hidden=shape["hidden"],
                      ffn_hidden=shape["ffn"], rope_theta=500000.0, norm_eps=1e-5, attention="sdpa",
                      moe_experts=shape.get("experts", 0), moe_top_k=shape.get("top_k", 2), moe_style="grouped")
    with torch.device("meta"):
        model = Llama(cfg).to(torch.bfloat16)
        ids = torch.zeros(batch, seq, dtype=torch.long)
    return model, (ids, ids)


def llama_meta(layers: int, hidden: int, heads: int, kv_heads: int, ffn: int, vocab: int, seq: int, batch: int):
    """A Hugging Face LlamaForCausalLM on the meta device in bf16, and its (meta) keyword inputs."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    cfg = LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=ffn, num_hidden_layers=layers,
                      num_attention_heads=heads, num_key_value_heads=kv_heads, max_position_embeddings=seq,
                      use_cache=False)
    with torch.device("meta"):
        model = LlamaForCausalLM(cfg).to(torch.bfloat16)
        ids = torch.zeros(batch, seq, dtype=torch.long)
    return model, {"input_ids": ids, "labels": ids}


def data_axes(p) -> tuple[str, ...]:
    """The mesh axes the plan splits the batch over: the solver's choice for "auto" (from its note),
    else the axes its inputs are sharded on (dim 0)."""
    from autopar.spec import placements_from_str
    m = re.search(r"data axes (\(.*?\))", p.estimate.solver if p.estimate else "")
    if m:
        return tuple(re.findall(r"'(\w+)'", m.group(1)))
    axes = set()
    for _, pl in p.inputs:
        for (name, _), x in zip(p.mesh, placements_from_str(pl)):
            if getattr(x, "dim", None) == 0:
                axes.add(name)
    return tuple(n for n, _ in p.mesh if n in axes)


def batch_split_ok(p) -> bool:
    """False when the plan's data axes do not divide the batch (the input is then replicated, yet the
    estimate divides the work by the data-parallel degree): the build notes 'input ... replicated'."""
    return not any(n.startswith("input ") and "does not divide" in n for n in p.notes)


def forms(p) -> str:
    """Forms per kind, e.g. 'attention heads@tp+fsdp x32, mlp tp@tp+fsdp x32' (+fsdp: some parameter of the
    structure is sharded on a mesh axis other than its form's axis, i.e. over data axes)."""
    from autopar.spec import placements_from_str
    counts: dict[str, int] = {}
    for s in p.strategies:
        fsdp = any(getattr(x, "dim", None) is not None and name not in s.axes
                   for _, pl in s.params for (name, _), x in zip(p.mesh, placements_from_str(pl)))
        label = f"{s.kind} {s.label}" + ("+fsdp" if fsdp else "")
        counts[label] = counts.get(label, 0) + 1
    return ", ".join(f"{k} x{v}" for k, v in counts.items())


def levels_by_class(p) -> str:
    """The plan's checkpoint level per layer class, e.g. 'Block: full' (layers of one class at several levels:
    each level with its count)."""
    counts: dict[str, dict[str, int]] = {}
    for path, level in p.checkpoint:
        cls = path.rsplit(".", 1)[0] if path.rsplit(".", 1)[-1].isdigit() else path
        counts.setdefault(cls, {}).setdefault(level, 0)
        counts[cls][level] += 1
    return "; ".join(f"{cls}.*: " + ", ".join(f"{lv}" + (f" x{n}" if len(lv_n) > 1 else "") for lv, n in lv_n.items())
                     for cls, lv_n in counts.items()) or "-"


def peak_terms(p) -> str:
    """The peak's breakdown per device (GiB, `autopar.estimate.peak_bytes`): what is held all step (parameters and
    optimizer state, FSDP's kept gathers) plus the larger end of the backward: its start (saved activations after the
    checkpoint levels, the loss' momentary buffers) or its end (gradients and a bucket being reduced); the rest of the
    peak is that end."""
    e = p.estimate
    held = sum(s.parameters_bytes + s.optimizer_bytes for s in e.sites)
    gathered = sum(s.transient_bytes for s in e.sites)
    grads = sum(s.gradients_bytes for s in e.sites)
    momentary = max((s.momentary_bytes for s in e.sites), default=0)
    rest = e.memory_bytes_per_device - held - gathered
    return (f"held {held / GIB:.1f} + FSDP gathered {gathered / GIB:.1f} + the backward's larger end {rest / GIB:.1f} "
            f"(momentary {momentary / GIB:.1f}, gradients {grads / GIB:.1f}) = {e.memory_bytes_per_device / GIB:.1f} GiB")


def shape_row(name: str, hand_plans=HAND_PLANS, levels=LEVELS, *, capture_once: bool = False) -> dict:
    """Plan shape `name` with auto (timed: `autopar.plan`, capture included) and every hand plan at every checkpoint
    level (module docstring). `capture_once` (the tests): auto planned on the hand plans' capture, its seconds
    the capture's and the plan's."""
    import autopar
    from autopar.api import _prepare, _resolve_plan
    from autopar.solver import InfeasibleError

    shape, seq, mesh, batch, goal = SHAPES[name]
    model, inputs = llama_tt_meta(shape, seq, batch)
    out = {"name": name, "mesh": mesh, "batch": batch, "seq": seq, "goal": goal,
           "params": sum(v.numel() for v in model.parameters())}
    t0, c0 = time.perf_counter(), time.process_time()
    if capture_once:
        info, captured, ctx = _prepare(model, mesh, inputs)
    try:
        p = (_resolve_plan("auto", ctx, info, None, captured, "h100") if capture_once else
             autopar.plan(model, mesh, inputs, plan="auto", cluster="h100"))
    except InfeasibleError as e:
        out.update(plan_s=time.perf_counter() - t0, plan_cpu_s=time.process_time() - c0, infeasible=str(e),
                   least_gib=e.least_bytes / GIB)
        p = None
    else:
        e = p.estimate
        out.update(plan_s=time.perf_counter() - t0, plan_cpu_s=time.process_time() - c0, infeasible=None, fits=e.fits,
                   mem_gib=e.memory_bytes_per_device / GIB,
                   step_s=e.step_time_s, forms=forms(p), levels=levels_by_class(p), batch_ok=batch_split_ok(p),
                   terms=peak_terms(p), table_has_levels="checkpoint" in p.table().splitlines()[1])
    hands = []
    # the hand plans on one capture of the same model (`autopar.plan` captures each time; the plans are the same)
    if not capture_once:
        info, captured, ctx = _prepare(model, mesh, inputs)
    for hand in hand_plans:
        for level in levels:
            h = _resolve_plan(hand, ctx, info, {"checkpoint": level}, captured, "h100")
            e = h.estimate
            hands.append({"plan": hand, "level": level, "fits": e.fits, "batch_ok": batch_split_ok(h),
                          "step_s": e.step_time_s, "mem_gib": e.memory_bytes_per_device / GIB, "terms": peak_terms(h)})
    out["hands"] = hands
    out["load"] = os.getloadavg()[0]
    if p is not None:  # what auto was ranked against (its '(re-ranked)' decision): each hand plan's own estimate
        out["ranked"] = reranked(p)
    fitting = [h for h in hands if h["fits"] and h["batch_ok"]]
    out["best_hand"] = min(fitting, key=lambda h: h["step_s"]) if fitting else None
    return out


def reranked(p) -> dict:
    """auto's '(re-ranked)' decision: the candidate it took, and every candidate's estimated step (ms; None where it
    was excluded: over the memory limit, or a batch that does not divide)."""
    from autopar.planner import RERANKED_KEY
    d = next((d for d in p.decisions if d.keys == (RERANKED_KEY,)), None)
    if d is None:
        return {"chosen": None, "steps": {}}
    return {"chosen": d.chosen, "by": d.decided_by,
            "steps": {r.label: None if r.excluded else (r.compute_s + r.comm_s) * 1e3 for r in d.candidates}}


def fmt_table(rows: list[dict]) -> list[str]:
    head = ("shape", "auto fits?", "auto peak GiB", "auto step ms", "best hand plan", "its step ms", "auto/best",
            "planned s (CPU s)", "auto's checkpoint levels")
    body = []
    for r in rows:
        b = r["best_hand"]
        auto_ok = not r["infeasible"] and r["fits"] and r["batch_ok"]
        body.append((f"{r['name']} {r['mesh']}", "yes" if auto_ok else "NO",
                     f"{r['mem_gib']:.1f}" if not r["infeasible"] else f"(least {r['least_gib']:.0f})",
                     f"{r['step_s'] * 1e3:.0f}" if not r["infeasible"] else "-",
                     f"{b['plan']} + {b['level']}" if b else "none fits",
                     f"{b['step_s'] * 1e3:.0f}" if b else "-",
                     f"{r['step_s'] / b['step_s']:.3f}" if b and not r["infeasible"] else "-",
                     f"{r['plan_s']:.1f} ({r['plan_cpu_s']:.1f})", r.get("levels", "-")))
    widths = [max(len(x[i]) for x in [head] + body) for i in range(len(head))]
    return ["| " + " | ".join(c.ljust(w) for c, w in zip(x, widths)) + " |" for x in [head] + body]


def _one(name: str) -> dict:
    return shape_row(name)


LLAMA_405B = dict(layers=126, hidden=16384, heads=128, kv_heads=8, ffn=53248, vocab=128256)
# Mixtral 8x22B: 56 layers, 8 experts top-2 (autopar.models.Llama with grouped experts: Mixtral's block shape).
MIXTRAL_8X22B = dict(layers=56, hidden=6144, heads=48, kv_heads=8, ffn=16384, vocab=32768, experts=8, top_k=2)
# DeepSeek-V3's size as a Llama-shaped stand-in: 61 layers, 256 routed experts top-8 of width 2048, 128 heads;
# not its MLA attention, shared expert or first 3 dense layers (a plain Llama block of its widths).
DEEPSEEK_V3 = dict(layers=61, hidden=7168, heads=128, kv_heads=128, ffn=2048, vocab=129280, experts=256, top_k=8)
# issue #25 item 1: planning time per stage against depth, meshes up to 16,384 ranks (no pipeline axis: the
# unpipelined auto plan, the part whose capture grows with depth).
STAGE_SHAPES = {
    "8b_8k_64": (LLAMA_8B, 8192, {"dp": 8, "tp": 8}, 8),
    "70b_8k_512": (LLAMA_70B, 8192, {"dp": 64, "tp": 8}, 64),
    "405b_8k_16384": (LLAMA_405B, 8192, {"dp": 2048, "tp": 8}, 2048),
    "mixtral_8x22b_4k_512": (MIXTRAL_8X22B, 4096, {"dp": 64, "tp": 8}, 64),
    "deepseek_v3_4k_2048": (DEEPSEEK_V3, 4096, {"dp": 256, "tp": 8}, 256),
}


def stage_row(name: str, full: bool = False) -> dict:
    """`autopar.plan(plan="auto")` on one STAGE_SHAPES shape, in this process: wall seconds and each stage's
    seconds as `progress` reports them (capture, recognise, solve)."""
    import autopar
    if full:  # the baseline: every layer captured (autopar.repeated off)
        import autopar.prepare
        autopar.prepare.capture_repeated = lambda *a, **k: None
    shape, seq, mesh, batch = STAGE_SHAPES[name]
    model, inputs = llama_tt_meta(shape, seq, batch)
    stages: dict[str, float] = {}
    t0, c0 = time.perf_counter(), time.process_time()
    p = autopar.plan(model, mesh, inputs, plan="auto", cluster="h100",
                     progress=lambda s, d: stages.__setitem__(s, stages.get(s, 0.0) + d))
    wall, cpu = time.perf_counter() - t0, time.process_time() - c0
    t1 = time.perf_counter()  # lowering on fake tensors (the collectives `parallelize` would issue), not in `wall`
    autopar.plan(model, mesh, inputs, plan="megatron", cluster="h100", lower=True,
                 progress=lambda s, d: stages.__setitem__("megatron " + s, d))
    stages["megatron lowered, total"] = time.perf_counter() - t1
    copies = any("planned on copies of" in n for n in p.notes)
    return dict(name=name, layers=shape["layers"], ranks=_ranks(mesh), wall_s=wall, cpu_s=cpu, stages=stages,
                copies=copies)


def _ranks(mesh: dict) -> int:
    n = 1
    for v in mesh.values():
        n *= v
    return n


def stages_main() -> None:
    """`python benchmarks/planning.py --stages [--full]`: one fresh process per STAGE_SHAPES shape; `--full`: the
    baseline, every layer captured (without `autopar.repeated`'s copies)."""
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    for name in STAGE_SHAPES:
        proc = subprocess.run([sys.executable, os.path.abspath(__file__), "--stage-one", name]
                              + (["--full"] if "--full" in sys.argv else []), env=env,
                              capture_output=True, text=True)
        lines = [x for x in proc.stdout.splitlines() if x.startswith("JSON ")]
        if proc.returncode or not lines:
            sys.exit(f"planning {name} failed:\n{proc.stdout}\n{proc.stderr[-4000:]}")
        r = json.loads(lines[0][5:])
        st = ", ".join(f"{k} {v:.2f} s" for k, v in r["stages"].items())
        print(f"STAGES planning_{name}: {r['layers']} layers on {r['ranks']} ranks "
              f"({'layers captured once' if r.get('copies') else 'every layer captured'}): auto wall {r['wall_s']:.1f} s "
              f"({r['cpu_s']:.1f} s CPU; {st}), goal <= 10 s, {os.cpu_count()} CPU cores, load average "
              f"{os.getloadavg()[0]:.1f}", flush=True)


# issue #23 deliverable 4: `auto` on a mesh with a pipeline axis (the outer search over schedule, microbatches, cut
# and every stage's forms and checkpoint levels, the ILP inside each stage), Llama 3 405B's shape, 16,384 ranks,
# Llama 3's 2,048 sequences of 8k per step.
PIPELINE_SHAPES = {
    "405b_8k_pp16": (LLAMA_405B, 8192, {"pp": 16, "dp": 128, "tp": 8}, 2048),
}


def pipeline_row(name: str) -> dict:
    """`autopar.plan(plan="auto")` on one PIPELINE_SHAPES shape, in this process: wall and CPU seconds, the plan."""
    import autopar
    shape, seq, mesh, batch = PIPELINE_SHAPES[name]
    model, inputs = llama_tt_meta(shape, seq, batch)
    t0, c0 = time.perf_counter(), time.process_time()
    p = autopar.plan(model, mesh, inputs, plan="auto", cluster="h100")
    wall, cpu = time.perf_counter() - t0, time.process_time() - c0
    (d,) = [d for d in p.decisions if d.kind == "pipeline"] or [None]
    return dict(name=name, layers=shape["layers"], ranks=_ranks(mesh), wall_s=wall, cpu_s=cpu,
                chosen=d.chosen if d else "no decision", decided_by=d.decided_by if d else "",
                pipeline=p.pipeline.label if p.pipeline else None,
                microbatches=p.pipeline.microbatches if p.pipeline else None,
                step_s=p.estimate.step_time_s, fits=p.estimate.fits,
                memory_gib=p.estimate.memory_bytes_per_device / GIB, candidates=len(d.candidates) if d else 0)


def pipeline_main() -> None:
    """`python benchmarks/planning.py --pipeline`: one fresh process per PIPELINE_SHAPES shape."""
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    for name in PIPELINE_SHAPES:
        proc = subprocess.run([sys.executable, os.path.abspath(__file__), "--pipeline-one", name], env=env,
                              capture_output=True, text=True)
        lines = [x for x in proc.stdout.splitlines() if x.startswith("JSON ")]
        if proc.returncode or not lines:
            sys.exit(f"planning {name} failed:\n{proc.stdout}\n{proc.stderr[-4000:]}")
        r = json.loads(lines[0][5:])
        print(f"PIPELINE planning_{name}: {r['layers']} layers on {r['ranks']} ranks: auto wall {r['wall_s']:.1f} s "
              f"({r['cpu_s']:.1f} s CPU), goal <= 10 s; chose {r['chosen']} ({r['microbatches']} microbatches), "
              f"step {r['step_s'] * 1e3:.0f} ms, {r['memory_gib']:.1f} GiB per device "
              f"({'fits' if r['fits'] else 'DOES NOT FIT'}), {r['candidates']} candidates; {os.cpu_count()} CPU "
              f"cores, load average {os.getloadavg()[0]:.1f}", flush=True)
        print(f"  decided by: {r['decided_by']}", flush=True)


def main() -> None:
    if len(sys.argv) > 2 and sys.argv[1] == "--stage-one":
        print("JSON " + json.dumps(stage_row(sys.argv[2], "--full" in sys.argv)), flush=True)
        return
    if "--stages" in sys.argv:
        stages_main()
        return
    if len(sys.argv) > 2 and sys.argv[1] == "--pipeline-one":
        print("JSON " + json.dumps(pipeline_row(sys.argv[2])), flush=True)
        return
    if "--pipeline" in sys.argv:
        pipeline_main()
        return
    if len(sys.argv) > 2 and sys.argv[1] == "--one":
        print("JSON " + json.dumps(_one(sys.argv[2])), flush=True)
        return
    names = ["8b_8k"] if "--quick" in sys.argv else list(SHAPES)
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    rows = []
    for name in names:
        proc = subprocess.run([sys.executable, os.path.abspath(__file__), "--one", name], env=env,
                              capture_output=True, text=True)
        lines = [x for x in proc.stdout.splitlines() if x.startswith("JSON ")]
        if proc.returncode or not lines:
            sys.exit(f"planning {name} failed:\n{proc.stdout}\n{proc.stderr[-4000:]}")
        r = json.loads(lines[0][5:])
        rows.append(r)
        print(f"== {name}: Llama-3 shape ({r['params'] / 1e9:.2f} B parameters), mesh {r['mesh']}, global batch "
              f"{r['batch']} x {r['seq']} tokens, h100 (80 GB)")
        if r["infeasible"]:
            print(f"  auto: INFEASIBLE after {r['plan_s']:.1f} s: {r['infeasible']}")
        else:
            print(f"  auto: {r['forms']}; checkpoint {r['levels']}; {r['step_s'] * 1e3:.0f} ms, {r['terms']}"
                  f" ({'fits' if r['fits'] else 'DOES NOT FIT'}); plan table shows the checkpoint level per "
                  f"structure: {'yes' if r['table_has_levels'] else 'NO'}")
        for h in r["hands"]:
            why = "" if h["batch_ok"] else " (batch does not divide over its data axes: input replicated, not compared)"
            print(f"  {h['plan']} + {h['level']}: {h['step_s'] * 1e3:.0f} ms, {h['terms']} "
                  f"({'fits' if h['fits'] else 'DOES NOT FIT'}){why}")
        if r.get("ranked", {}).get("chosen"):
            rk = r["ranked"]
            print(f"  auto re-ranked: took {rk['chosen']} ({rk['by']}); candidates (ms): "
                  + ", ".join(f"{k} {'-' if v is None else f'{v:.1f}'}" for k, v in rk["steps"].items()))
    print()
    for line in fmt_table(rows):
        print(line)
    print()
    for r in rows:
        b = r["best_hand"]
        fits = not r["infeasible"] and r["fits"] and r["batch_ok"]
        vs = ("no hand plan fits" if b is None else "auto INFEASIBLE" if r["infeasible"] else
              f"auto/best hand ({b['plan']} + {b['level']}) = {r['step_s'] / b['step_s']:.3f}, goal <= 1.0")
        print(f"RATIO planning_{r['name']} fits = {'yes' if fits else 'no'} ({vs}; planned in {r['plan_s']:.1f} s, "
              f"{r['plan_cpu_s']:.1f} s of CPU, goal {r['goal']:.0f} s, {os.cpu_count()} CPU cores, load average "
              f"{r['load']:.1f})")


if __name__ == "__main__":
    main()
