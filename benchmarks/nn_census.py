"""How autopar does on the torch.nn census (`tests/nn_census.py`), one row per model, every plan.

For every row and for `dp`, `fsdp` (`dp=2`), `megatron` (`tp=2`) and `auto` (`dp=2`, cluster "cpu"), on 2
simulated ranks (fake process group + `LocalTensorMode`, as `tests/test_nn_census.py`): whether the loss, every
gradient and every parameter after an SGD step equal one device's (fp64, 1e-10), and under `dp` and `fsdp` the
share of one device's forward + backward FLOPs one rank runs (`nn_census.FlopCount`, local shapes: of autopar's
program on a 1-rank mesh, whose decompositions it shares; the bound, 1/2 + 0.02, also holds for the matmul FLOPs
of the model on one device).

    python benchmarks/nn_census.py [--row NAME ...] [--plan dp fsdp megatron auto] [--markdown] [--verbose]
    python benchmarks/nn_census.py --ops       # the ATen ops of each row's captured graph

Columns: `exact` per plan (`yes`, `NO` with the worst value, `CRASH` with the error's first line), `FLOPs/rank`
under dp and fsdp (`*`: past the bound, or an op runs on the gathered batch), `ops` (distinct ATen ops in the captured graph), notes: the ops the dp /
fsdp plan gathers (its "replicated ...: no sharding rule" notes) and the row's own note (eval mode and why).
"""

from __future__ import annotations

import argparse
import os
import sys
import time
import traceback
import warnings

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
for _p in (ROOT, os.path.join(ROOT, "tests")):
    if _p not in sys.path:
        sys.path.insert(0, _p)

os.environ.setdefault("OMP_NUM_THREADS", "1")

import torch  # noqa: E402

torch.set_num_threads(1)
warnings.filterwarnings("ignore", message="Converting a tensor with requires_grad=True to a scalar")

from nn_census import (CENSUS, FLOP_PLANS, FLOP_SLACK, PLANS, TOL, WORLD, flop_problem, gathered, reference,  # noqa: E402
                       run_plan)


def _world(world: int):
    import contextlib

    from torch.distributed._local_tensor import LocalTensorMode

    from conftest import set_fake_world

    @contextlib.contextmanager
    def ranks():
        set_fake_world(world)
        with LocalTensorMode(world):
            yield
    return ranks()


def _first_line(e: BaseException) -> str:
    text = str(e).strip()
    return f"{type(e).__name__}: {text.splitlines()[0] if text else ''}"


def run_row(name: str, plans, verbose: bool) -> dict:
    row = {"name": name, "family": CENSUS[name].family, "note": CENSUS[name].note, "plans": {}, "ops": None}
    t0 = time.perf_counter()
    try:
        ref = reference(name, _world)
    except Exception as e:  # noqa: BLE001 - one crash must not stop the census
        row["plans"] = {p: {"status": "CRASH", "why": f"one device: {_first_line(e)}"} for p in plans}
        return row
    for plan in plans:
        cell = {"status": "CRASH", "why": "", "fraction": None, "gathered": []}
        try:
            run = run_plan(name, plan, ref, _world)
            row["ops"] = len(run.ops)
            row.setdefault("op_list", run.ops)
            off = run.off(TOL)
            cell["status"] = "ok" if not off else "NO"
            if off:
                k, v = max(off.items(), key=lambda kv: kv[1] if kv[1] == kv[1] else float("inf"))
                cell["why"] = f"{len(off)} values off, worst {k} {v:.1e}"
            cell["fraction"] = run.fraction
            cell["gathered"] = gathered(run.notes)
            if plan in FLOP_PLANS:
                cell["flops"] = flop_problem(run, ref)
            if verbose:
                print(f"  {name} {plan}: notes {run.notes}\n    forms {run.forms}\n    {cell.get('flops', '')}")
        except Exception as e:  # noqa: BLE001
            cell["why"] = _first_line(e)
            if verbose:
                traceback.print_exc()
        row["plans"][plan] = cell
    row["secs"] = time.perf_counter() - t0
    return row


def _exact(cell) -> str:
    if cell is None:
        return "-"
    return {"ok": "yes", "NO": "NO", "CRASH": "CRASH"}[cell["status"]]


def _fraction(cell) -> str:
    if cell is None or cell.get("fraction") is None:
        return "-"
    f = cell["fraction"]
    return f"{f:.3f}" + (" *" if f > 1 / WORLD + FLOP_SLACK or cell.get("flops") or cell.get("gathered") else "")


def _notes(row) -> str:
    gathered = list(dict.fromkeys(op for p in FLOP_PLANS for op in (row["plans"].get(p) or {}).get("gathered", [])))
    parts = [f"gathered: {', '.join(gathered)}"] if gathered else []
    if row["note"]:
        parts.append(row["note"])
    return "; ".join(parts)


def fmt_row(row, plans) -> str:
    exact = " ".join(f"{_exact(row['plans'].get(p)):>5}" for p in plans)
    fr = " ".join(f"{_fraction(row['plans'].get(p)):>7}" for p in FLOP_PLANS if p in plans)
    line = f"{row['family']:<11} {row['name']:<22} {row.get('ops') or '-':>4} {exact}  {fr}  {row.get('secs', 0):5.1f}s"
    for p in plans:
        cell = row["plans"].get(p) or {}
        if cell.get("why"):
            line += f"\n{'':<34} {p}: {cell['why'][:300]}"
        if cell.get("flops"):
            line += f"\n{'':<34} {p}: {cell['flops'][:300]}"
    return line


def markdown(rows, plans) -> str:
    head = ("| family | model | ops | exact: " + " / ".join(plans) + " | FLOPs per rank: "
            + " / ".join(p for p in FLOP_PLANS if p in plans) + " | notes |")
    out = [head, "|---|---|---|---|---|---|"]
    for r in rows:
        exact = " / ".join(_exact(r["plans"].get(p)) for p in plans)
        fr = " / ".join(_fraction(r["plans"].get(p)) for p in FLOP_PLANS if p in plans)
        out.append(f"| {r['family']} | {r['name']} | {r.get('ops') or '-'} | {exact} | {fr} | {_notes(r)} |")
    return "\n".join(out)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--row", nargs="*", choices=list(CENSUS), help="only these rows")
    ap.add_argument("--plan", nargs="*", choices=list(PLANS), help="only these plans")
    ap.add_argument("--markdown", action="store_true", help="also print the README's table")
    ap.add_argument("--ops", action="store_true", help="list the ATen ops of each row's captured graph")
    ap.add_argument("--verbose", action="store_true", help="plan notes and forms, full tracebacks")
    args = ap.parse_args()
    names = args.row or list(CENSUS)
    plans = args.plan or list(PLANS)
    if args.ops:
        plans = plans[:1]
    print(f"{'family':<11} {'model':<22} {'ops':>4} " + " ".join(f"{p:>5}"[:5] for p in plans) + "  "
          + " ".join(f"{p + ' FL':>7}" for p in FLOP_PLANS if p in plans) + "   time")
    t0 = time.perf_counter()
    rows = []
    for name in names:
        row = run_row(name, plans, args.verbose)
        rows.append(row)
        print(fmt_row(row, plans), flush=True)
        if args.ops:
            print(f"{'':<34} {', '.join(row.get('op_list', []))}")
    cells = [c for r in rows for c in r["plans"].values()]
    exact = sum(c["status"] == "ok" for c in cells)
    parallel = sum(1 for r in rows for p in FLOP_PLANS if p in plans and (r["plans"].get(p) or {}).get("fraction")
                   is not None and not r["plans"][p].get("flops") and not r["plans"][p].get("gathered"))
    print(f"\n{len(rows)} rows: exact in {exact} of {len(cells)} runs; data parallel (within the FLOP bound, nothing "
          f"gathered) in {parallel} of {sum(1 for r in rows for p in FLOP_PLANS if p in plans)} dp/fsdp runs; "
          f"total wall time {time.perf_counter() - t0:.1f} s")
    if args.markdown:
        print("\n" + markdown(rows, plans))


if __name__ == "__main__":
    main()
