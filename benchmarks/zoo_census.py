"""How autopar does on the Hugging Face zoo (`tests/zoo.py`), one row per family and plan.

For every family and for `plan="megatron"` (tensor parallel on a 1-D mesh `tp=2`) and `plan="fsdp"`
(`dp=2`), on 2 simulated ranks (fake process group + `LocalTensorMode`, as `tests/conftest.py`), the
equivalence check of `tests/equivalence.run_equivalence` (loss, every gradient, every parameter after an
SGD step against the single-device model) prints one row:

    family  plan  status  max err  held  repl  time  forms

* status: `ok`; `WRONG` (no error, but the loss, a gradient or a parameter after the step is off by more
  than the family's tolerance, or not finite); `CRASH` (an exception: its type and first line).
* max err: the largest absolute error over the loss, every gradient and every parameter after the step.
* held: sum of this rank's local parameter elements / sum of the global ones (tied weights once).
* time: seconds for the row (building the model, parallelising, one step of both).
* forms: per structure kind the forms `pm.plan.strategies` gave, e.g. `attention: heads x2, mlp: tp x2`.
* repl: how many plan notes mention replication.

    python benchmarks/zoo_census.py [--family NAME ...] [--plan megatron|fsdp ...] [--verbose] [--no-cache]
    python benchmarks/zoo_census.py --ops     # every ATen op in any zoo graph (after autopar.capture)
    python benchmarks/zoo_census.py --fp32    # per family: fp32 values computed from parameters
"""

from __future__ import annotations

import argparse
import os
import sys
import time
import traceback
import warnings
from collections import Counter

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
for _p in (ROOT, os.path.join(ROOT, "tests")):
    if _p not in sys.path:
        sys.path.insert(0, _p)

os.environ.setdefault("OMP_NUM_THREADS", "1")

import torch  # noqa: E402

torch.set_num_threads(1)
# equivalence.py reads float(ref_loss) of a loss that requires grad: harmless, and once per row
warnings.filterwarnings("ignore", message="Converting a tensor with requires_grad=True to a scalar")

from zoo import FAMILIES  # noqa: E402

PLANS = ("megatron", "fsdp")
MESH_NAMES = {"megatron": ("tp",), "fsdp": ("dp",)}
WORLD = 2


def _first_line(e: BaseException) -> str:
    text = str(e).strip()
    return f"{type(e).__name__}: {text.splitlines()[0] if text else ''}"


def forms_summary(plan) -> str:
    """`attention: heads x2, mlp: tp x2, embedding: vocab, loss: vocab` (the count when more than one)."""
    by_kind: dict[str, Counter] = {}
    for s in plan.strategies:
        by_kind.setdefault(s.kind, Counter())[s.form] += 1
    order = ["embedding", "attention", "mlp", "moe", "norm", "loss", "linear"]
    kinds = sorted(by_kind, key=lambda k: order.index(k) if k in order else len(order))
    parts = []
    for k in kinds:
        forms = " ".join(f"{f} x{n}" if n > 1 else f for f, n in sorted(by_kind[k].items()))
        parts.append(f"{k}: {forms}")
    return ", ".join(parts)


def replication_notes(plan) -> list[str]:
    return [n for n in plan.notes if "replicat" in n.lower()]


def set_world(world: int) -> None:
    from conftest import set_fake_world
    set_fake_world(world)


def cache_off(model) -> None:
    """`use_cache = False` in every Hugging Face config inside the model (what autopar's capture does for a
    top-level HF model only): shows what hides behind the KV-cache crash of a wrapped model."""
    for m in model.modules():
        cfg = getattr(m, "config", None)
        if getattr(cfg, "use_cache", None):
            cfg.use_cache = False


def run_row(family: str, plan: str, verbose: bool, no_cache: bool = False) -> dict:
    from torch.distributed._local_tensor import LocalTensorMode

    import autopar
    from equivalence import run_equivalence

    row = {"family": family, "plan": plan, "status": "CRASH", "err": None, "held": None, "forms": "",
           "repl": None, "why": ""}
    t0 = time.perf_counter()
    res = None
    made = []  # the ParallelModule, kept so that a row crashing after planning still shows its plan
    parallelize = autopar.parallelize

    def recording(*args, **kwargs):
        made.append(parallelize(*args, **kwargs))
        return made[-1]

    try:
        model, inputs, tol = FAMILIES[family]()
        if no_cache:
            cache_off(model)
        row["tol"] = tol
        global_numel = sum(p.numel() for p in model.parameters())  # tied weights once
        set_world(WORLD)
        autopar.parallelize = recording
        with LocalTensorMode(WORLD):
            res = run_equivalence(model, inputs, (WORLD,), MESH_NAMES[plan], plan=plan)
        err = res.max_err()
        row["err"] = err
        row["held"] = sum(res.local_numel.values()) / global_numel
        row["status"] = "ok" if err <= tol else "WRONG"  # NaN is WRONG too
        if row["status"] == "WRONG":
            worst = sorted(((v, k) for k, v in {**{"loss": abs(res.loss - res.ref_loss)}, **res.grad_err,
                                                   **{f"{k} (after step)": v for k, v in res.param_err.items()}}.items()
                            if not v <= tol), reverse=True)
            row["why"] = f"{len(worst)} values off; worst: " + ", ".join(f"{k} {v:.1e}" for v, k in worst[:3])
    except Exception as e:  # noqa: BLE001 - one crash must not stop the census
        row["why"] = _first_line(e)
        if verbose:
            traceback.print_exc()
    finally:
        autopar.parallelize = parallelize
    row["secs"] = time.perf_counter() - t0
    plan_ = res.plan if res is not None else made[-1].plan if made else None
    if plan_ is not None:
        row["forms"] = forms_summary(plan_)
        row["repl"] = len(replication_notes(plan_))
        if res is None and made:
            pm = made[-1]
            row["held"] = sum(p.to_local().numel() for p in pm.parameters()) / global_numel
        if verbose:
            print(plan_.table())
            if row["status"] == "WRONG":
                for k, v in sorted(res.grad_err.items(), key=lambda kv: -kv[1])[:10]:
                    print(f"  grad {k}: {v:.3e}")
    return row


def fmt_row(r: dict) -> str:
    err = "-" if r["err"] is None else f"{r['err']:.1e}"
    held = "-" if r["held"] is None else f"{r['held']:.3f}"
    repl = "-" if r["repl"] is None else str(r["repl"])
    line = (f"{r['family']:<12} {r['plan']:<9} {r['status']:<6} {err:>8} {held:>6} {repl:>5} {r['secs']:>6.1f}s  "
            f"{r['forms']}")
    if r["why"]:
        line += f"\n{'':<12} {'':<9} -> {r['why'][:300]}"
    return line


def markdown(rows: list[dict]) -> str:
    """The README's model table: per family, the forms megatron gives each kind of structure, the share of the
    parameters each of the 2 ranks holds under megatron and fsdp, and whether both equal one device."""
    by = {(r["family"], r["plan"]): r for r in rows}
    out = ["| family | megatron: forms per structure | held per rank, megatron / fsdp | loss, grads, step = one device |",
           "|---|---|---|---|"]
    for fam in dict.fromkeys(r["family"] for r in rows):
        mg, fs = by.get((fam, "megatron")), by.get((fam, "fsdp"))
        forms = ", ".join(part for part in (mg["forms"] if mg else "").split(", ")
                          if not part.startswith(("norm:", "linear:")))
        held = " / ".join("-" if r is None or r["held"] is None else f"{r['held']:.2f}" for r in (mg, fs))
        ok = "yes" if all(r is not None and r["status"] == "ok" for r in (mg, fs)) else "NO"
        out.append(f"| {fam} | {forms} | {held} | {ok} |")
    return "\n".join(out)


def census(families, plans, verbose: bool, no_cache: bool = False, as_markdown: bool = False) -> None:
    print(f"{'family':<12} {'plan':<9} {'status':<6} {'max err':>8} {'held':>6} {'repl':>5} {'time':>7}  forms")
    t0 = time.perf_counter()
    rows = []
    for fam in families:
        for plan in plans:
            r = run_row(fam, plan, verbose, no_cache)
            rows.append(r)
            print(fmt_row(r), flush=True)
    counts = Counter(r["status"] for r in rows)
    print(f"\n{len(rows)} rows: " + ", ".join(f"{k} {v}" for k, v in sorted(counts.items()))
          + f"; total wall time {time.perf_counter() - t0:.1f} s")
    if as_markdown:
        print("\n" + markdown(rows))


# ----------------------------------------------------------------------------- graph surveys

def captured_graph(family: str):
    from autopar.capture import capture
    model, inputs, _ = FAMILIES[family]()
    return capture(model, (), inputs)


def op_census(families) -> None:
    """Every call_function target in the captured graphs (the models as users hold them: KV cache on), with
    how many families use it and whether `passes.rules` has a rule for it (without one, the op is replicated:
    its sharded inputs are gathered)."""
    users: dict[str, set[str]] = {}
    failed = {}
    for fam in families:
        try:
            gm = captured_graph(fam).gm
        except Exception as e:  # noqa: BLE001
            failed[fam] = _first_line(e)
            continue
        for n in gm.graph.nodes:
            if n.op == "call_function":
                users.setdefault(str(n.target), set()).add(fam)
    from passes.rules import RULES
    ruled = {str(t) for t in RULES}
    print(f"{'op':<48} {'families':>8}  rule  used by")
    for op, fams in sorted(users.items(), key=lambda kv: (-len(kv[1]), kv[0])):
        shown = ", ".join(sorted(fams)) if len(fams) < len(families) else "(all)"
        print(f"{op:<48} {len(fams):>8}  {'yes' if op in ruled or op.startswith('<built-in') else 'NO ':<4}  {shown}")
    print(f"\n{len(users)} distinct ops over {len(families) - len(failed)} captured families")
    for fam, why in failed.items():
        print(f"capture failed: {fam}: {why}")


def fp32_census(families) -> None:
    """Per family, the fp32 values computed from a parameter (where an fp64 model rounds to fp32)."""
    for fam in families:
        try:
            cap = captured_graph(fam)
        except Exception as e:  # noqa: BLE001
            print(f"{fam}: capture failed: {_first_line(e)}")
            continue
        gm = cap.gm
        dep = set(cap.param_fqns)
        hits = []
        for n in gm.graph.nodes:
            if n.op == "placeholder":
                continue
            if any(a.name in dep for a in n.all_input_nodes):
                dep.add(n.name)
                v = n.meta.get("val")
                if isinstance(v, torch.Tensor) and v.dtype == torch.float32 and \
                        all(getattr(a.meta.get("val"), "dtype", None) != torch.float32 for a in n.all_input_nodes):
                    stack = n.meta.get("nn_module_stack") or {}
                    path = list(stack.values())[-1][0] if stack else ""
                    hits.append(f"{n.target} in {path or '<top>'}")
        print(f"{fam:<12} {len(hits):>3} fp32 casts of parameter-dependent values: "
              + (", ".join(dict.fromkeys(hits)) if hits else "none (fp64 end to end)"))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--family", nargs="*", choices=list(FAMILIES), help="only these families")
    ap.add_argument("--plan", nargs="*", choices=list(PLANS), help="only these plans")
    ap.add_argument("--verbose", action="store_true", help="plan table and notes, full tracebacks")
    ap.add_argument("--no-cache", action="store_true",
                    help="turn use_cache off in every config inside the model first (the workaround for the "
                         "KV-cache crash; shows what hides behind it)")
    ap.add_argument("--ops", action="store_true", help="list every ATen op in the captured zoo graphs")
    ap.add_argument("--fp32", action="store_true", help="per family: parameter-dependent values rounded to fp32")
    ap.add_argument("--markdown", action="store_true", help="also print the README's model table")
    args = ap.parse_args()
    families = args.family or list(FAMILIES)
    if args.ops:
        op_census(families)
        return
    if args.fp32:
        fp32_census(families)
        return
    census(families, args.plan or list(PLANS), args.verbose, args.no_cache, args.markdown)


if __name__ == "__main__":
    main()
