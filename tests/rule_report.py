"""Compare the rule table with DTensor's derived rule on every op, op by op, and check both.

The table (`passes.rules.RULES`, "autopar" below) holds DTensor-derived entries and autopar's own; for a derived
entry both columns agree, so the comparison says something for the ops that keep an own rule (why they do) and for
the ops without a rule (`rule_samples.EXTRA_OPS`: what DTensor would answer, the evidence for adding one).
Ops of the table with hand-written samples only; the derived rules of every other op of DTensor's registry are
checked by the sweep (`rule_sweep.py`, whose committed report is `passes/checked_ops.py`).

    PYTHONPATH=.:tests OMP_NUM_THREADS=1 python tests/rule_report.py [--ops aten.add.Tensor,...] [--out FILE]

For every op of `passes.rules.RULES` and `rule_samples.EXTRA_OPS`, every sample and every placement
combination of `rule_check.combinations` (axes of 2, and 4 where a sample asks): both decisions (an op
without an autopar rule is replicated), both checked numerically (`rule_check.check_case`), and where
they differ, which moves fewer elements. Prints a markdown table per op, then every failing case and
DTensor's fallback reasons. Takes a few minutes on 2 cores (DTensor's decomposition-based propagation
is slow for SDPA).

Communication (`comm`) is counted in elements each rank sends (ring algorithms), forward and
backward, for the collectives the lowering inserts to meet the required input placements (with the
gradient reduction of R inputs consumed into a non-R output) plus the reduction a Partial output still
owes; whose output stays sharded (work and memory split) is counted apart.
"""

from __future__ import annotations

import argparse
import collections
import sys
import time

import torch
from torch.distributed._local_tensor import maybe_disable_local_tensor_mode

import autopar  # noqa: F401
from autopar.spec import Partial, Replicate, Shard, _StridedShard, fmt
from passes import dtensor_rules as D
from passes.rules import RULES, replicate_rule
from rule_check import build_graph, check_case, combinations, rules_replaced, _global
from rule_samples import EXTRA_OPS, samples_for


def _move(have, want, numel: int, n: int) -> float:
    """Elements each rank sends, forward and backward, to take a value of `numel` elements from `have`
    to `want` (the lowering's collective pairs, autopar.runtime.collectives)."""
    if have == want:
        return 0.0
    shard = (Shard, _StridedShard)
    if isinstance(have, Partial):  # all-reduce (bwd identity) / reduce-scatter (bwd all-gather)
        return 2 * (n - 1) / n * numel if isinstance(want, Replicate) else 2 * (n - 1) / n * numel
    if isinstance(have, shard) and isinstance(want, Replicate):  # all-gather (bwd: local chunk)
        return (n - 1) / n * numel
    if isinstance(have, shard):  # all-to-all, both ways
        return 2 * (n - 1) / n / n * numel
    return (n - 1) / n * numel  # R -> S: a local slice forward, an all-gather backward


def comm(decision, tin, ins, node, n: int) -> float:
    """What a decision costs: the collectives that meet its required input placements (forward and
    backward, with the gradient all-reduce of R inputs consumed into a non-R output) plus the
    reduction a Partial output still owes (a reduce-scatter at least). A sharded output costs nothing
    here, a replicated one neither (its work was done on every rank)."""
    req, out = decision
    outs = out if isinstance(out, (list, tuple)) else [out]
    vals = node.meta["val"] if isinstance(node.meta["val"], (list, tuple)) else [node.meta["val"]]
    total = 0.0
    for t, have, want in zip(tin, ins, req):
        v = t.meta["val"]
        total += _move(have, want, v.numel(), n)
        if isinstance(want, Replicate) and v.dtype.is_floating_point and any(not isinstance(o, Replicate) for o in outs):
            total += 2 * (n - 1) / n * v.numel()  # grad_all_reduce
    for o, v in zip(outs, vals):
        if isinstance(v, torch.Tensor) and isinstance(o, Partial):
            total += 2 * (n - 1) / n * v.numel()
    return total


def _sharded(decision) -> bool:
    out = decision[1]
    return any(isinstance(o, (Shard, _StridedShard)) for o in (out if isinstance(out, (list, tuple)) else [out]))


def show(decision) -> str:
    req, out = decision
    outs = out if isinstance(out, (list, tuple)) else [out]
    return f"req {','.join(fmt(p) for p in req)} -> {','.join(fmt(p) for p in outs)}"


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--ops", default="")
    ap.add_argument("--out", default="")
    args = ap.parse_args()
    from torch.distributed.device_mesh import init_device_mesh

    from autopar.mesh import mesh_info
    from conftest import _local_world

    torch.set_default_dtype(torch.float64)
    ops = [op for op in RULES if samples_for(op)] + [op for op in EXTRA_OPS if op not in RULES]
    if args.ops:
        ops = [op for op in ops if str(op) in args.ops.split(",")]
    ops.sort(key=str)
    stats: dict = collections.defaultdict(collections.Counter)
    fails: dict = collections.defaultdict(list)
    reasons: dict = collections.defaultdict(collections.Counter)
    examples: dict = collections.defaultdict(list)

    def everywhere(op):
        return D.dtensor_rule
    everywhere.extra_ops = EXTRA_OPS
    start = time.time()
    for n in (2, 4):
        with _local_world(n):
            info = mesh_info(init_device_mesh("cpu", (n,), mesh_dim_names=("tp",)))
            for op in ops:
                own = RULES.get(op, replicate_rule)
                for sample in samples_for(op):
                    if n not in sample.worlds:
                        continue
                    with maybe_disable_local_tensor_mode():
                        gm, _ = build_graph(sample, _global(sample, [t.clone() for t in sample.tensors]))
                    node = next(x for x in gm.graph.nodes if x.op == "call_function" and x.target is op)
                    tin = _flat_tensor_args(node)
                    for i, pls in enumerate(combinations(sample, n)):
                        s = stats[op]
                        s["combos"] += 1
                        try:
                            mine = own(node, tin, list(pls), n)
                        except Exception:  # noqa: BLE001  (e.g. addmm's row-parallel assert: the lowering
                            mine = None    # decomposes that node before asking the rule)
                        d = D.derive(node, tin, list(pls), n)
                        theirs = (list(d.req), list(d.out) if isinstance(d.out, tuple) else d.out)
                        if d.reason:
                            reasons[op][d.reason[:110]] += 1
                        else:
                            s["dtensor as is"] += 1
                        if mine is not None and _norm(mine) != _norm(theirs):
                            s["differ"] += 1
                            cm, ct = comm(mine, tin, pls, node, n), comm(theirs, tin, pls, node, n)
                            key = "dtensor cheaper" if ct < cm else "autopar cheaper" if cm < ct else "same comm"
                            s[key] += 1
                            if _sharded(theirs) != _sharded(mine):
                                s["dtensor output sharded" if _sharded(theirs) else "autopar output sharded"] += 1
                            if len(examples[op]) < 4:
                                examples[op].append(f"{sample.name} n={n} in=({','.join(fmt(p) for p in pls)}): "
                                                    f"autopar {show(mine)} [{cm:.0f}]; dtensor {show(theirs)} "
                                                    f"[{ct:.0f}]" + (f" ({d.reason[:60]})" if d.reason else ""))
                        o = check_case(sample, pls, n, info, seed=i)
                        if not o.ok:
                            s["autopar fails"] += 1
                            fails[("autopar", op)].append(o.line())
                        with rules_replaced(everywhere):
                            o = check_case(sample, pls, n, info, seed=i)
                        if not o.ok:
                            s["dtensor fails"] += 1
                            fails[("dtensor", op)].append(o.line() + f"\n      dtensor: {d.dtensor}")
    lines = [f"checked in {time.time() - start:.0f} s", "",
             "| op | DTensor knows it by | combos | autopar fails | DTensor-derived fails | DTensor answer used | "
             "decisions differ | DTensor cheaper | autopar cheaper | same comm | only DTensor's output sharded | "
             "only autopar's output sharded |", "|" + "---|" * 12]
    for op in ops:
        s = stats[op]
        lines.append(f"| {op} {'(no autopar rule)' if op not in RULES else ''} | {D.registered(op)} | {s['combos']} | "
                     f"{s['autopar fails']} | {s['dtensor fails']} | {s['dtensor as is']} | {s['differ']} | "
                     f"{s['dtensor cheaper']} | {s['autopar cheaper']} | {s['same comm']} | "
                     f"{s['dtensor output sharded']} | {s['autopar output sharded']} |")
    lines += ["", "## failures"]
    for (who, op), items in sorted(fails.items(), key=lambda kv: (kv[0][0], str(kv[0][1]))):
        lines.append(f"### {who}: {op} ({len(items)})")
        lines += ["  " + x for x in items]
    lines += ["", "## DTensor-derived rule: why not DTensor's answer as is"]
    for op in ops:
        for why, k in reasons[op].most_common():
            lines.append(f"- {op}: {k}x {why}")
    lines += ["", "## where the decisions differ (examples; [elements moved per rank])"]
    for op in ops:
        for e in examples[op]:
            lines.append(f"- {e}")
    text = "\n".join(lines)
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text + "\n")


def _norm(decision):
    req, out = decision
    outs = tuple(out) if isinstance(out, (list, tuple)) else (out,)
    return tuple(req), outs


def _flat_tensor_args(node):
    from torch.utils import _pytree as pytree

    flat, _ = pytree.tree_flatten((node.args, node.kwargs))
    return [a for a in flat if isinstance(a, torch.fx.Node) and isinstance(a.meta.get("val"), torch.Tensor)]


if __name__ == "__main__":
    sys.exit(main())
