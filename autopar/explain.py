"""`Plan.explain(key=None)`: the recorded decisions (`autopar.plan.Decision`, made by `autopar.decide` at
planning time) as text. Pure formatting: nothing is planned or priced here.

    h.0.attn (attention; also h.1.attn: identical, solved once)
      chosen heads@tp: cheapest: the least estimated time of 4 possible candidates
        candidate          compute     comm        time        memory/device
        replicate          1.204 ms    0.000 ms    1.204 ms    40.0 MiB
      * heads@tp           0.301 ms    0.129 ms    0.430 ms    10.0 MiB
        ulysses@-          excluded: it takes a sequence axis; this plan has none (roles: tp model)
"""

from __future__ import annotations

from autopar.plan import Decision, _fmt_bytes


def explain(plan, key: str | None = None) -> str:
    if not plan.decisions:
        raise ValueError(f"plan {plan.name!r} records no candidates to explain (it was saved by an autopar without "
                         "explain, or built by hand). Fix: plan again with autopar.plan(...) or python -m autopar plan")
    if key is None:
        chosen = list(plan.decisions)
    else:
        chosen = [d for d in plan.decisions if key in d.keys]
        if not chosen:
            keys = [k for d in plan.decisions for k in d.keys]
            raise ValueError(f"explain({key!r}): no structure {key!r} in plan {plan.name!r}; keys: {', '.join(keys)}")
    return "\n\n".join(_one(d, key) for d in chosen)


def _one(d: Decision, key: str | None) -> str:
    head = key if key is not None else d.keys[0]
    others = [k for k in d.keys if k != head]
    lines = [f"{head} ({d.kind}" + (f"; also {_list(others)}: identical, solved once" if others else "") + ")",
             f"  chosen {d.chosen}: {d.decided_by}"]
    if not d.candidates:
        return "\n".join(lines)
    width = max(len("candidate"), *(len(r.label) for r in d.candidates))
    lines.append("    " + "candidate".ljust(width) + "  " + "  ".join(h.ljust(10) for h in
                                                                      ("compute", "comm", "time", "memory/device")))
    for r in d.candidates:
        mark = "  * " if r.label == d.chosen else "    "
        priced = not r.excluded or r.compute_s or r.comm_s or r.memory_bytes  # a role assignment over the limit
        cells = (fmt_time(r.compute_s), fmt_time(r.comm_s), fmt_time(r.compute_s + r.comm_s),
                 _fmt_bytes(r.memory_bytes)) if priced else ()
        line = mark + r.label.ljust(width) + "".join("  " + c.ljust(10) for c in cells)
        lines.append((line + ("  excluded: " + r.excluded if r.excluded else "")).rstrip())
    return "\n".join(lines)


def fmt_time(s: float) -> str:
    return f"{s * 1e3:.3f} ms" if s == 0 or s >= 1e-4 else f"{s * 1e6:.3f} us"


def _list(keys: list[str]) -> str:
    return ", ".join(keys) if len(keys) <= 4 else f"{', '.join(keys[:3])}, ... ({len(keys)} in all)"
