"""The HTML report of a plan (`Plan.to_html(path)`, `ParallelModule.report(path)`, `python -m autopar plan --html`).

It reads a Plan and a graph and imports neither `autopar.plan` nor the lowering (Plan.to_html calls it).
One self-contained file (inline CSS and script, no network assets), searchable (a filter over every row):

- the plan table (`Plan.table_rows`) and the inputs' placements;
- identical layers in one row (`model.layers.{0..79}.self_attn  ×80`, `autopar.layer_rows`) in the plan table, the
  memory and step tables and the collectives (the plan table's every row also, folded away);
- memory per device: parameters, gradients, optimizer state, activations saved for backward and FSDP's
  gathered copies (`Estimate.sites`), in all as a bar against the limit, then per structure;
- the estimated step as a timeline: each structure's compute, then its communication on each mesh axis
  (`SiteEstimate.comm_axes`) and the local copies around it, laid out one after another (their sum); the step
  itself is the overlapped timeline's (`autopar.timeline`), and the exposed communication is stated;
- every collective of the lowered program with its bytes (`Plan.comms`), and, given the rewritten graph
  (`pm.graph_module`), the graph per structure with every collective node highlighted;
- why each form (`Plan.explanations`: each decision once).
"""

from __future__ import annotations

import html
from collections import defaultdict

from autopar.layer_rows import group_rows
from autopar.runtime.collectives import COLLECTIVES
from autopar.runtime.moe import moe_experts
from autopar.spec import fmt_placements
from passes import meta as M

PARTS = (("parameters", "parameters_bytes", "#4e79a7"), ("gradients", "gradients_bytes", "#59a14f"),
         ("optimizer state", "optimizer_bytes", "#edc948"), ("activations", "activations_bytes", "#e15759"),
         ("transients (FSDP gathers)", "transient_bytes", "#b07aa1"))
_AXIS_COLORS = ("#f28e2b", "#76b7b2", "#ff9da7", "#9c755f")
_COMPUTE_COLOR, _COPY_COLOR = "#4e79a7", "#bab0ac"


def write_report(path: str, plan, gm=None) -> None:
    with open(path, "w", encoding="utf-8") as f:
        f.write(render(plan, gm))


def render(plan, gm=None) -> str:
    """The report as one HTML string; `gm`: the rewritten local program (a ParallelModule's graph_module)."""
    mesh = ", ".join(f"{n}={s}" for n, s in plan.mesh)
    title = f"autopar plan {plan.name!r} on mesh ({mesh})"
    body = [f"<h1>{_e(title)}</h1>",
            f"<p class='summary'>{_e(plan.estimate.summary()) if plan.estimate else 'no estimate recorded'}</p>",
            "<p><input id='q' type='search' placeholder='search structures, nodes, collectives, forms' "
            "autofocus> <span id='hits'></span></p>",
            "<nav><a href='#plan'>plan</a> · <a href='#memory'>memory</a> · <a href='#step'>step</a> · "
            "<a href='#collectives'>collectives</a> · <a href='#graph'>graph</a> · <a href='#why'>why</a></nav>",
            _plan_section(plan), _memory_section(plan), _step_section(plan), _comms_section(plan),
            _graph_section(plan, gm), _why_section(plan)]
    return ("<!DOCTYPE html>\n<html lang='en'>\n<head>\n<meta charset='utf-8'>\n"
            f"<title>{_e(title)}</title>\n<style>{_CSS}</style>\n</head>\n<body>\n" + "\n".join(body)
            + f"\n<script>{_JS}</script>\n</body>\n</html>\n")


def _e(x) -> str:
    return html.escape(str(x), quote=True)


def _ms(s: float) -> str:
    return f"{s * 1e3:.3f} ms" if s == 0 or s >= 1e-4 else f"{s * 1e6:.2f} us"


# ----------------------------------------------------------------------------- sections

def _plan_section(plan) -> str:
    rows, full = plan.table_rows(full=False), plan.table_rows(full=True)
    out = ["<section id='plan'><h2>Plan</h2>", _table(rows)]
    if len(rows) < len(full):
        out.append("<p>A row ×N stands for N identical structures, one per layer (its numbers are each one's).</p>"
                   f"<details><summary>every structure ({len(full) - 1} rows)</summary>{_table(full)}</details>")
    if plan.inputs:
        out.append("<p>inputs: " + _e(", ".join(f"{k}={v}" for k, v in plan.inputs)) + "</p>")
    if plan.notes:
        out.append("<ul>" + "".join(f"<li class='f'>{_e(n)}</li>" for n in plan.notes) + "</ul>")
    return "\n".join(out) + "</section>"


def _table(rows: list[tuple[str, ...]]) -> str:
    return ("<table><thead><tr>" + "".join(f"<th>{_e(h)}</th>" for h in rows[0]) + "</tr></thead><tbody>"
            + "".join("<tr class='f'>" + "".join(f"<td>{_e(c)}</td>" for c in r) + "</tr>" for r in rows[1:])
            + "</tbody></table>")


def _grouped_sites(sites, cells):
    """(site, its row's key: 'model.layers.{0..79}.mlp  ×80' for a group) per group of identical layers' sites, whose
    rows `cells(site)` agree."""
    rows = [(s.key, *cells(s)) for s in sites]
    return [(sites[pos], row[0]) for row, _, pos in group_rows(rows)]


def _memory_section(plan) -> str:
    est = plan.estimate
    out = ["<section id='memory'><h2>Memory per device (estimated)</h2>"]
    if est is None or not est.sites:
        return out[0] + "<p>This plan records no per-structure estimate (it was made by hand or saved by an " \
                        "older autopar): plan it again to see its memory.</p></section>"
    totals = {attr: sum(getattr(s, attr) for s in est.sites) for _, attr, _ in PARTS}
    total = sum(totals.values())
    limit = est.memory_limit_bytes
    on_scale = total >= limit / 20  # else the bar would be too thin to read: scale to the total
    scale = max(total, limit, 1) if on_scale else total * 1.05
    momentary = max((s.momentary_bytes for s in est.sites), default=0)
    out.append(f"<p>Peak {_fmt_bytes(est.memory_bytes_per_device)} of {_fmt_bytes(limit)} "
               f"({'fits' if est.fits else 'DOES NOT FIT'}): parameters, optimizer state and gathered copies, plus "
               f"the larger of the activations with the largest momentary buffer ({_fmt_bytes(momentary)}: the "
               f"loss' logit gradients) at the start of backward and the gradients at its end. The parts below, "
               f"each in full, add to {_fmt_bytes(total)}; "
               + ("the black line marks the limit." if on_scale else
                  f"the limit is {limit / max(total, 1):.0f}x the total, beyond the bar's right end.") + "</p>")
    out.append(_stack(totals, scale, limit=limit / scale if on_scale else None))
    out.append("<p class='legend'>" + " ".join(
        f"<span class='sw' style='background:{c}'></span>{_e(n)} {_fmt_bytes(totals[a])}" for n, a, c in PARTS)
        + "</p>")
    out.append("<p class='legend'>Activations are those each structure saves for backward, on this rank's share of "
               "the tokens; transients are FSDP's gathered copies of parameters (counted whole, as the cost model "
               "does); (other) is what no recognised structure holds (residuals, masks, unrecognised ops). Per "
               "structure, scaled to the largest structure (a longer bar is cut at the right end and says so):</p>")
    sizes = {s.key: sum(getattr(s, a) for _, a, _ in PARTS) for s in est.sites}
    biggest = max((v for k, v in sizes.items() if k != "(other)"), default=0) or max(sizes.values()) or 1
    out.append("<table class='bars'><tbody>")
    for s, key in _grouped_sites(est.sites, lambda s: [str(getattr(s, a)) for _, a, _ in PARTS]):
        parts = {a: getattr(s, a) for _, a, _ in PARTS}
        cut = f" <b>(bar cut: {sizes[s.key] / biggest:.1f}x the scale)</b>" if sizes[s.key] > biggest else ""
        out.append(f"<tr class='f'><td>{_e(key)}</td><td class='barcell'>{_stack(parts, biggest)}</td>"
                   f"<td>{_fmt_bytes(sizes[s.key])}{cut}</td><td>activations {_fmt_bytes(s.activations_bytes)}"
                   "</td></tr>")
    return "\n".join(out) + "</tbody></table></section>"


def _stack(parts: dict[str, int], scale: float, limit: float | None = None) -> str:
    colors = {a: c for _, a, c in PARTS}
    names = {a: n for n, a, _ in PARTS}
    segs = "".join(f"<div class='seg' style='width:{100 * v / scale:.4f}%;background:{colors[a]}' "
                   f"title='{_e(names[a])}: {_fmt_bytes(v)}'></div>" for a, v in parts.items() if v > 0)
    mark = f"<div class='limit' style='left:{100 * limit:.4f}%'></div>" if limit is not None else ""
    return f"<div class='stack'>{segs}{mark}</div>"


def _step_section(plan) -> str:
    est = plan.estimate
    out = ["<section id='step'><h2>Estimated step</h2>"]
    if est is None or not est.sites:
        return out[0] + "<p>This plan records no per-structure estimate.</p></section>"
    axes = [a for a, _ in plan.mesh if any(a == x for s in est.sites for x, _ in s.comm_axes)]
    lanes = ["compute"] + [f"communication {a}" for a in axes] + ["local copies"]
    color = {"compute": _COMPUTE_COLOR, "local copies": _COPY_COLOR}
    color.update({f"communication {a}": _AXIS_COLORS[i % len(_AXIS_COLORS)] for i, a in enumerate(axes)})
    segs: dict[str, list[str]] = defaultdict(list)
    total = sum(s.compute_s + s.comm_s for s in est.sites) or 1.0
    t = 0.0
    for s in est.sites:
        by_axis = dict(s.comm_axes)
        pieces = [("compute", s.compute_s)] + [(f"communication {a}", by_axis.get(a, 0.0)) for a in axes]
        pieces.append(("local copies", max(0.0, s.comm_s - sum(by_axis.values()))))
        for lane, d in pieces:
            if d > 0:
                segs[lane].append(f"<div class='seg' style='left:{100 * t / total:.4f}%;width:{100 * d / total:.4f}%;"
                                  f"background:{color[lane]}' title='{_e(s.key)}: {lane} {_ms(d)}'></div>")
            t += d
    exposed = est.comm_time_s if est.exposed_comm_s is None else est.exposed_comm_s
    out.append(f"<p>{_ms(est.step_time_s)} per step: compute {_ms(est.compute_time_s)}, communication "
               f"{_ms(est.comm_time_s)}, of which {_ms(exposed)} exposed (the step's timeline overlaps parameter "
               "synchronisation with compute: `autopar.timeline`). Each structure in plan order (forward and "
               "backward together): its compute, then its communication on each mesh axis, then the local copies "
               "around its collectives, laid out sequentially here (their sum is compute + all communication). A "
               "structure's time on an axis is its communication time less the same with that axis' links free. "
               "Hover a bar for the structure.</p>")
    out.append("<div class='timeline'>")
    for lane in lanes:
        busy = sum(d for d in _lane_sum(est.sites, lane, axes))
        out.append(f"<div class='lane'><div class='lname'>{_e(lane)} <small>{_ms(busy)}</small></div>"
                   f"<div class='ltrack'>{''.join(segs[lane])}</div></div>")
    out.append("</div><table><thead><tr><th>structure</th><th>compute</th>"
               + "".join(f"<th>comm {_e(a)}</th>" for a in axes) + "<th>local copies</th><th>total</th></tr></thead><tbody>")
    for s, key in _grouped_sites(est.sites, lambda s: [repr((s.compute_s, s.comm_s, s.comm_axes))]):
        by_axis = dict(s.comm_axes)
        copies = max(0.0, s.comm_s - sum(by_axis.values()))
        out.append(f"<tr class='f'><td>{_e(key)}</td><td>{_ms(s.compute_s)}</td>"
                   + "".join(f"<td>{_ms(by_axis.get(a, 0.0))}</td>" for a in axes)
                   + f"<td>{_ms(copies)}</td><td>{_ms(s.compute_s + s.comm_s)}</td></tr>")
    return "\n".join(out) + "</tbody></table></section>"


def _lane_sum(sites, lane: str, axes):
    for s in sites:
        by_axis = dict(s.comm_axes)
        if lane == "compute":
            yield s.compute_s
        elif lane == "local copies":
            yield max(0.0, s.comm_s - sum(by_axis.values()))
        else:
            yield by_axis.get(lane.removeprefix("communication "), 0.0)


def _comms_section(plan) -> str:
    out = ["<section id='collectives'><h2>Collectives</h2>"]
    if not plan.comms:
        out.append("<p>This plan lists no collectives: it was not lowered (autopar.plan(..., lower=False), "
                   "python -m autopar plan --no-lower) or needs none.</p>")
        return "\n".join(out) + "</section>"
    out.append(f"<p>{len(plan.comms)} collectives, {_fmt_bytes(plan.comm_bytes_per_step())} sent per rank per step "
               "(forward + backward), from the lowered program.</p>")
    out.append("<p>Identical collectives of identical layers in one row, ×N: N collectives, the bytes each one's.</p>")
    out.append("<table><thead><tr><th>module</th><th>function</th><th>axis</th><th>forward</th><th>backward</th>"
               "<th>bytes forward</th><th>bytes backward</th></tr></thead><tbody>")
    rows = [(c.module or "(inputs)", c.fn, c.axis, c.forward, c.backward, _fmt_bytes(c.bytes_forward),
             _fmt_bytes(c.bytes_backward)) for c in plan.comms]
    for row, _, _ in group_rows(rows):
        out.append("<tr class='f comm'>" + "".join(f"<td>{_e(c)}</td>" for c in row) + "</tr>")
    return "\n".join(out) + "</tbody></table></section>"


def _graph_section(plan, gm) -> str:
    out = ["<section id='graph'><h2>Rewritten graph per structure</h2>"]
    if gm is None:
        out.append("<p>No graph here: Plan.to_html shows the plan's collectives (above). "
                   "pm.report(path) on the ParallelModule that autopar.parallelize returns adds the rewritten "
                   "local program, every collective node highlighted.</p>")
        return "\n".join(out) + "</section>"
    groups = _group_nodes(plan, gm)
    comms = sum(1 for nodes in groups.values() for _, c in nodes if c)
    out.append(f"<p>{sum(len(v) for v in groups.values())} nodes, {comms} collective nodes (highlighted, with the "
               "bytes each rank sends forward / backward). After each node: its global shape and its placement on each mesh "
               "axis.</p>")
    for key, nodes in groups.items():
        n_comm = sum(1 for _, c in nodes if c)
        out.append(f"<details class='f'{' open' if n_comm else ''}><summary>{_e(key)} <small>{len(nodes)} nodes"
                   + (f", {n_comm} collectives" if n_comm else "") + "</small></summary>")
        out += nodes_html(nodes)
        out.append("</details>")
    return "\n".join(out) + "</section>"


def nodes_html(nodes) -> list[str]:
    return [f"<div class='f node{' comm' if c else ''}'>{line}{c}</div>" for line, c in nodes]


def _group_nodes(plan, gm) -> dict[str, list[tuple[str, str]]]:
    """Graph nodes by the structure whose module (or member) path holds them, else their top-level module:
    (escaped line, escaped collective note or '')."""
    scopes = sorted(((k, s.key) for s in plan.strategies for k in (s.key, *s.members)), key=lambda x: -len(x[0]))
    from passes.checkpoint import walk
    comm = {n for n in walk(gm) if n.op == "call_function" and n.target in COLLECTIVES}
    groups: dict[str, list[tuple[str, str]]] = {}
    for n in walk(gm):  # checkpointed layers' nodes in place of their call
        path = _module_path(n)
        if n in comm:
            path = n.meta[M.COMM].module or path
        key = next((k for scope, k in scopes if path == scope or path.startswith(scope + ".")), None) \
            if path else None
        if key is None:
            key = ".".join(path.split(".")[:2]) if path else f"({n.op})"
        note = ""
        if n in comm:
            c = n.meta[M.COMM]
            note = (f" <span class='cb'>{_e(c.forward)} forward / {_e(c.backward)} backward on {_e(c.axis)}: "
                    f"{_fmt_bytes(c.bytes_forward)} / {_fmt_bytes(c.bytes_backward)}</span>")
        elif n.op == "call_function" and n.target is moe_experts and n.args[6] == "a2a":
            note = " <span class='cb'>all_to_all dispatch and combine inside (see the collectives table)</span>"
        groups.setdefault(key, []).append((_node_line(n, _placements(n)), note))
    return groups


def _placements(n) -> str:
    pls = n.meta.get(M.PLACEMENTS)
    if pls is None:
        return "-"
    return ",".join(fmt_placements(p) for p in pls) if isinstance(pls, list) else fmt_placements(pls)


def _fmt_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return str(n)


def _module_path(n) -> str:
    stack = n.meta.get("nn_module_stack")
    if not stack:
        return ""
    return list(stack.values())[-1][0]


def _node_line(n, placements: str) -> str:
    target = getattr(n.target, "__name__", None) if n.op == "call_function" else None
    target = target or str(n.target)
    args = ", ".join(_arg(a) for a in n.args)
    if len(args) > 200:
        args = args[:200] + " ..."
    val = n.meta.get("val")
    shape = f" : {tuple(val.shape)}" if hasattr(val, "shape") else ""
    return (f"<code>{_e(n.name)}</code> = {_e(n.op)} <b>{_e(target)}</b>({_e(args)}){_e(shape)}"
            f" <span class='pl'>{_e(placements)}</span>")


def _arg(a) -> str:
    if hasattr(a, "name") and hasattr(a, "op"):
        return "%" + a.name
    if isinstance(a, (list, tuple)):
        inner = ", ".join(_arg(x) for x in a)
        return f"[{inner}]" if isinstance(a, list) else f"({inner})"
    return repr(a)


def _why_section(plan) -> str:
    out = ["<section id='why'><h2>Why each form</h2>"]
    if not plan.decisions:
        out.append("<p>This plan records no candidates (saved by an older autopar or built by hand).</p>")
        return "\n".join(out) + "</section>"
    out.append("<p>Every form each structure could take, priced per device by the cost model; * marks the one "
               "chosen.</p>")
    for text in plan.explanations():
        out.append(f"<pre class='f'>{_e(text)}</pre>")
    return "\n".join(out) + "</section>"


_CSS = """
body{font:14px/1.4 system-ui,sans-serif;margin:1.5em;color:#222}
h1{font-size:1.3em} h2{font-size:1.1em;margin-top:1.6em;border-bottom:1px solid #ccc}
table{border-collapse:collapse;margin:.5em 0} th,td{border:1px solid #ddd;padding:2px 6px;text-align:left;
vertical-align:top;font-size:12px} th{background:#f3f3f3}
.summary{background:#f7f7f7;padding:.5em} #q{width:30em;padding:4px}
.stack{position:relative;height:18px;background:#eee;display:flex;min-width:300px;overflow:hidden}
.stack .seg{flex:none}
.stack .seg{height:100%} .limit{position:absolute;top:0;bottom:0;margin-left:-2px;border-left:2px solid #000}
.bars .barcell{width:50%} .legend{font-size:12px} .sw{display:inline-block;width:10px;height:10px;margin:0 3px 0 10px}
.timeline{border:1px solid #ccc;padding:4px} .lane{display:flex;align-items:center;margin:2px 0}
.lname{width:16em;font-size:12px} .ltrack{position:relative;flex:1;height:16px;background:#f5f5f5}
.ltrack .seg{position:absolute;top:0;height:100%;min-width:1px}
details{margin:2px 0} summary{cursor:pointer} .node{font:12px monospace;white-space:pre-wrap;padding-left:1em}
.node.comm{background:#fff3c4;border-left:3px solid #e15759} .cb{color:#b00;font-weight:bold}
.pl{color:#777} pre{background:#fafafa;border:1px solid #eee;padding:.5em;font-size:12px;overflow-x:auto}
.hidden{display:none}
"""

_JS = """
(function(){
  var q=document.getElementById('q'), hits=document.getElementById('hits');
  q.addEventListener('input', function(){
    var t=q.value.toLowerCase(), n=0;
    document.querySelectorAll('.f').forEach(function(el){
      var show=!t || el.textContent.toLowerCase().indexOf(t)>=0;
      el.classList.toggle('hidden', !show); if(show && t){n++;}
      if(show && t && el.tagName==='DETAILS'){el.open=true;}
    });
    document.querySelectorAll('details.f').forEach(function(d){
      var s=d.querySelector('summary');
      if(t && s.textContent.toLowerCase().indexOf(t)>=0){
        d.querySelectorAll('.node').forEach(function(x){x.classList.remove('hidden');});
      }
      if(t && d.querySelector('.node:not(.hidden)')){d.classList.remove('hidden'); d.open=true;}
    });
    hits.textContent = t ? n+' matches' : '';
  });
})();
"""
