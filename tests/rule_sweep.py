"""The rule check on every op DTensor knows how to shard; writes `passes/checked_ops.py`, the ops it passed.

    PYTHONPATH=.:tests OMP_NUM_THREADS=1 python tests/rule_sweep.py [--ops aten.add.Tensor,...] [--write]

The ops swept (`sweep_ops`): every op of DTensor's strategy registry a captured forward graph can hold
(`passes.dtensor_rules.candidate_ops`), and the ops DTensor derives from their decomposition for which
`rule_samples.py` has hand-written samples (the composite ops models keep whole for the recognisers: `layer_norm`,
`matmul`, `softmax.int`...); not the ops with autopar's own rule (checked by `test_rule_check.py`). Other composite
ops (`rms_norm`, `group_norm`, ...) are decomposed in the graph instead (`passes.decompose`).

Each op is checked (`rule_check.check_case`: lowered with DTensor's derived rule, run on simulated ranks, fp64,
output and every input gradient against the op on full inputs) on its samples: generated from torch's OpInfo
database (`opinfo_samples.py`; axis of 2, at most `SWEEP_COMBOS` placement combinations each) and the hand-written
ones of `rule_samples.py` (at `rule_check.MAX_COMBOS`, on their axes). The op's rule is *checked* when every case
passes; one wrong case refuses it (`REFUSED`, with the case: the op stays without a rule, i.e. replicated or
decomposed, never trusted). An op with no sample is `UNSAMPLED` (no rule either).

`--write` regenerates `passes/checked_ops.py` (all ops: 5-9 minutes on a busy 2-core machine); `--update --ops ...`
re-checks some and keeps the other entries. In `make test`, `tests/test_rule_sweep.py` re-checks one of `CHUNKS`
parts of the committed ops (a different part each day, every part within CHUNKS days; `RULE_SWEEP_PART=k` picks
one, `RULECHECK_FULL=1` checks all), and `test_rule_check.py` that the committed lists name this torch's ops.
"""

from __future__ import annotations

import argparse
import collections
import pprint
import sys
import time
from pathlib import Path

import torch

import autopar  # noqa: F401
from passes import dtensor_rules as D
from passes.rules import OWN_RULES, RULES, op_named
from rule_check import Sample, check_case, combinations, rules_replaced
from rule_samples import EXTRA_OPS, SAMPLES, samples_for

SWEEP_COMBOS = 8  # placement combinations per OpInfo sample
CHECKED_FILE = Path(__file__).resolve().parents[1] / "passes" / "checked_ops.py"


def sweep_ops() -> list:
    ops = set(D.candidate_ops())
    ops |= {op for op in SAMPLES if op not in EXTRA_OPS and D.registered(op) == "decomposition"}
    return sorted((op for op in ops if op not in OWN_RULES), key=str)


def _mesh(n: int):
    from torch.distributed.device_mesh import init_device_mesh

    from autopar.mesh import mesh_info
    return mesh_info(init_device_mesh("cpu", (n,), mesh_dim_names=("tp",)))


def _derived_only(op):
    def rule_for(o):
        return D.dtensor_rule if o is op else RULES.get(o)
    rule_for.extra_ops = [op]
    return rule_for


def check_op(op, samples: list[Sample], local_world) -> tuple[int, list[str], list[str]]:
    """(cases run, failing case lines, samples skipped with why) for op under DTensor's derived rule."""
    ran, bad, skipped = 0, [], []
    by_world = collections.defaultdict(list)
    for s in samples:
        for n in s.worlds:
            by_world[n].append(s)
    with rules_replaced(_derived_only(op)):
        for n, group in sorted(by_world.items()):
            with local_world(n):
                info = _mesh(n)
                for s in group:
                    cap = SWEEP_COMBOS if s.note.startswith("OpInfo") else None
                    for i, pls in enumerate(combinations(s, n, cap)):
                        try:
                            o = check_case(s, pls, n, info, seed=i)
                        except Exception as e:  # noqa: BLE001  (the op itself fails on these full inputs)
                            skipped.append(f"{s.name}: the op on full inputs raised {type(e).__name__}: "
                                           f"{str(e).splitlines()[0][:120] if str(e) else ''}")
                            break
                        ran += 1
                        if not o.ok:
                            bad.append(o.line())
    return ran, bad, skipped


def sweep(ops, local_world, log=print) -> dict:
    from opinfo_samples import opinfo_samples

    start = time.time()
    generated = opinfo_samples(ops)
    log(f"OpInfo samples for {len(generated)} of {len(ops)} ops in {time.time() - start:.0f} s")
    result = {"checked": {}, "refused": {}, "unsampled": [], "cases": 0}
    for k, op in enumerate(ops):
        samples = list(generated.get(op, [])) + samples_for(op)
        if not samples:
            result["unsampled"].append(str(op))
            continue
        t = time.time()
        ran, bad, skipped = check_op(op, samples, local_world)
        result["cases"] += ran
        sources = tuple(sorted({s.note[len("OpInfo "):] for s in generated.get(op, []) if s.note}))
        if bad:
            result["refused"][str(op)] = f"{len(bad)} of {ran} cases wrong, e.g. {bad[0].splitlines()[0][:300]}"
        elif not ran:
            result["unsampled"].append(str(op))
        else:
            result["checked"][str(op)] = sources
        log(f"[{k + 1}/{len(ops)}] {op}: {ran} cases, {len(bad)} wrong, {len(skipped)} samples skipped "
            f"({time.time() - t:.1f} s)")
    result["seconds"] = time.time() - start
    return result


def write(result: dict, path: Path = CHECKED_FILE) -> None:
    text = (
        '"""The ops whose DTensor-derived sharding rule passed the rule check (generated by tests/rule_sweep.py '
        '--write; do not edit).\n\n'
        '`CHECKED`: op -> the OpInfo entries its generated samples came from (empty: hand-written samples only,\n'
        '`tests/rule_samples.py`). `passes.rules` gives these ops `passes.dtensor_rules.dtensor_rule`.\n'
        '`REFUSED`: op -> the check\'s first wrong case: no rule (replicated, or decomposed by `passes.decompose`).\n'
        '`UNSAMPLED`: ops of the sweep without any sample (no rule either).\n"""\n\n'
        f"CHECKED = {pprint.pformat(dict(sorted(result['checked'].items())), width=116, sort_dicts=True)}\n\n"
        f"REFUSED = {pprint.pformat(dict(sorted(result['refused'].items())), width=116, sort_dicts=True)}\n\n"
        f"UNSAMPLED = {pprint.pformat(tuple(sorted(result['unsampled'])), width=116)}\n")
    path.write_text(text)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--ops", default="")
    ap.add_argument("--write", action="store_true")
    ap.add_argument("--update", action="store_true", help="with --ops: replace those ops' entries in the committed "
                    "lists, keep the others")
    args = ap.parse_args()
    from conftest import _local_world

    torch.set_default_dtype(torch.float64)
    ops = sweep_ops()
    if args.ops:
        ops = [op for op in ops if str(op) in args.ops.split(",")]
    result = sweep(ops, _local_world, log=lambda s: print(s, flush=True))
    print(f"\n{len(result['checked'])} checked, {len(result['refused'])} refused, {len(result['unsampled'])} without "
          f"samples; {result['cases']} cases in {result['seconds']:.0f} s")
    for op, why in sorted(result["refused"].items()):
        print(f"refused {op}: {why}")
    if args.update:
        from passes import checked_ops as C
        names = {str(op) for op in ops}
        old = {"checked": {k: v for k, v in C.CHECKED.items() if k not in names},
               "refused": {k: v for k, v in C.REFUSED.items() if k not in names},
               "unsampled": [k for k in C.UNSAMPLED if k not in names]}
        for key in old:
            old[key] = ({**old[key], **result[key]} if isinstance(old[key], dict) else old[key] + result[key])
        write(old)
    elif args.write:
        write(result)


if __name__ == "__main__":
    sys.exit(main())


# ----------------------------------------------------------------------------- make test: the committed lists

CHUNKS = 8  # `make test` re-checks one part a day (tests/test_rule_sweep.py)


def chunk(k: int) -> list[str]:
    """The k-th (1-based) of CHUNKS round-robin parts of the committed ops with OpInfo samples, checked and refused."""
    from passes.checked_ops import CHECKED, REFUSED

    names = sorted([n for n, src in CHECKED.items() if src] + list(REFUSED))
    return names[k - 1::CHUNKS]


def _sources(names) -> set[str]:
    from passes.checked_ops import CHECKED

    return {s for n in names for s in CHECKED.get(n, ())}


_GENERATED: dict = {}


def recheck(name: str, k: int, local_world):
    """Re-run the sweep's check of one committed op: (cases run, failing lines); OpInfo samples only (the
    hand-written ones are `test_rule_check.py`'s), generated from the sources recorded for its chunk."""
    from opinfo_samples import opinfo_samples
    from passes.checked_ops import REFUSED

    if k not in _GENERATED:
        names = chunk(k)
        ops = [op_named(n) for n in names]
        refused = {op_named(n) for n in names if n in REFUSED}
        # a refused op's samples: from every OpInfo (its sources are not recorded), only if the chunk has one
        _GENERATED[k] = opinfo_samples([op for op in ops if op not in refused], infos=_sources(names))
        if refused:
            _GENERATED[k].update(opinfo_samples(refused))
    op = op_named(name)
    samples = _GENERATED[k].get(op, []) + (samples_for(op) if name in REFUSED else [])
    ran, bad, _ = check_op(op, samples, local_world)
    return ran, bad
