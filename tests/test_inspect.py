"""Inspecting plans: `python -m autopar plan` (a factory and a Hugging Face config, on the meta device),
`Plan.explain` (every candidate and what decided the choice: cheapest, an override, the memory limit, a
coupling, a precondition), and the HTML report (`Plan.to_html`, `pm.report`): well-formed, self-contained,
every structure and every collective in it."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from html.parser import HTMLParser
from pathlib import Path

import pytest
import torch

import autopar
from autopar.api import _prepare
from autopar.planner import build_plan
from autopar.relower import input_batch
from autopar.__main__ import main
from autopar.cli_plan import load_factory, parse_mesh, parse_size
from examples.plan_llama import llama, tiny

ROOT = Path(__file__).resolve().parents[1]


def _cli(*args: str, cwd=ROOT) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{ROOT / 'tests'}", "OMP_NUM_THREADS": "1"}
    return subprocess.run([sys.executable, "-m", "autopar", "plan", *args], cwd=cwd, env=env, capture_output=True,
                          text=True, timeout=240)


def _rows(text: str, key: str) -> list[str]:
    """The explain block of `key`: its lines."""
    block = next(b for b in text.split("\n\n") if b.splitlines()[0].startswith(key + " ("))
    return block.splitlines()


# ----------------------------------------------------------------------------- the CLI

def test_cli_plan_from_a_factory(tmp_path, capsys):
    out, page = tmp_path / "plan.json", tmp_path / "report.html"
    r = _cli("--model", "examples.plan_llama:tiny", "--mesh", "dp=2,tp=2", "--cluster", "h100", "--plan", "megatron",
             "--batch", "4", "--seq", "32", "--memory-limit", "80GB", "--out", str(out), "--html", str(page),
             "--explain", "layers.0.attn")
    assert r.returncode == 0, r.stderr
    for stage in ("build", "capture", "recognise", "solve", "lower"):  # one progress line per stage, with seconds
        assert re.search(rf"^\[autopar plan\] {stage}: [0-9.]+ s", r.stderr, re.M), r.stderr
    plan = autopar.Plan.load(str(out))
    assert plan.table() in r.stdout  # the table printed is the plan saved
    assert plan.mesh == (("dp", 2), ("tp", 2)) and plan.estimate.memory_limit_bytes == 80 * 10**9
    assert {s.key: s.label for s in plan.strategies}["layers.0.attn"] == "heads@tp"
    assert plan.comms and plan.comm_counts()["all_reduce.forward"] > 0  # lowered: the collectives are listed
    assert plan.explain("layers.0.attn") in r.stdout
    assert "hand plan megatron: picks heads@tp" in r.stdout
    _check_report(page.read_text(), plan)
    # the saved plan, given back to the CLI for the same model: checked against it and printed the same
    capsys.readouterr()
    assert main(["plan", "--model", "examples.plan_llama:tiny", "--mesh", "dp=2,tp=2", "--cluster", "h100",
                 "--batch", "4", "--seq", "32", "--plan", str(out), "--quiet"]) == 0
    again = capsys.readouterr()
    assert again.err == "" and plan.table() in again.out


def test_cli_plan_from_a_hugging_face_config(tmp_path, capsys):
    """A Llama config file: built on the meta device (nothing materialised), held as users train it (ids and
    labels in, `.loss` out), planned by the ILP; parameters keep their checkpoint names. The command's main()
    in-process (the entry point's own subprocess is the test above: a second one only re-imported torch)."""
    from transformers import LlamaConfig

    cfg = tmp_path / "config.json"
    LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, max_position_embeddings=64).to_json_file(str(cfg))
    out = tmp_path / "plan.json"
    rc = main(["plan", "--hf", str(cfg), "--mesh", "dp=2,tp=2", "--cluster", "h100", "--batch", "4", "--seq", "32",
               "--out", str(out), "--explain"])
    r = capsys.readouterr()
    assert rc == 0, r.err
    plan = autopar.Plan.load(str(out))
    keys = {s.key for s in plan.strategies}
    assert {"model.layers.0.self_attn", "model.layers.1.mlp", "model.embed_tokens"} <= keys, keys
    assert "lm_head.weight" in dict(plan.params) and "model.layers.0.self_attn.q_proj.weight" in dict(plan.params)
    for d in plan.decisions:  # --explain without a key: every structure, each with what decided it
        assert f"{d.keys[0]} ({d.kind}" in r.out and d.decided_by in r.out
    assert plan.name == "auto" and "ILP optimal" in r.out


def test_cli_plan_errors_say_what_to_fix(tmp_path):
    with pytest.raises(SystemExit, match="cannot load 'nope' from 'examples.plan_llama'"):
        main(["plan", "--model", "examples.plan_llama:nope", "--mesh", "dp=2"])
    with pytest.raises(SystemExit, match="MLP takes no batch argument; drop --batch"):
        load_factory("autopar.models:MLP", 8, None)
    with pytest.raises(SystemExit, match=r"MLP\(\) must return \(model, example_inputs\), got MLP"):
        load_factory("autopar.models:MLP", None, None)
    with pytest.raises(SystemExit, match="no structure 'layers.9.attn'.*layers.0.attn"):
        main(["plan", "--model", "examples.plan_llama:tiny", "--mesh", "dp=2", "--explain", "layers.9.attn",
              "--quiet", "--no-lower"])
    with pytest.raises(SystemExit, match="override 'attention': unknown form 'rows'"):
        main(["plan", "--model", "examples.plan_llama:tiny", "--mesh", "tp=2", "--override", "attention=rows"])
    bad = tmp_path / "c.json"
    bad.write_text(json.dumps({"hidden_size": 8}))
    with pytest.raises(SystemExit, match="has no 'model_type'"):
        main(["plan", "--hf", str(bad), "--mesh", "dp=2"])


def test_cli_arguments():
    assert parse_mesh("dp=8,tp=8") == {"dp": 8, "tp": 8}
    assert parse_size("80GB") == 80 * 10**9 and parse_size("76GiB") == 76 * 2**30 and parse_size("1e9") == 10**9
    for bad in ("8x8", "dp=0", "dp=2,dp=2"):
        with pytest.raises(SystemExit, match="--mesh"):
            parse_mesh(bad)
    with pytest.raises(SystemExit, match="--memory-limit='80 parsecs' is not a size"):
        parse_size("80 parsecs")


# ----------------------------------------------------------------------------- explain

def test_explain_names_every_candidate_and_the_cheapest():
    model, inputs = tiny()
    plan = autopar.plan(model, {"dp": 2, "tp": 2}, inputs, cluster="h100")
    assert autopar.Plan.from_json(plan.to_json()) == plan
    text = plan.explain()
    for d in plan.decisions:
        rows = _rows(text, d.keys[0])
        assert len(rows) == 3 + len(d.candidates)  # every candidate, in the solver's order
        assert all(line[4:].startswith(c.label + " ") for line, c in zip(rows[3:], d.candidates))
        assert rows[1] == f"  chosen {d.chosen}: {d.decided_by}"
        assert sum(line.startswith("  * ") for line in rows) == 1
    attn = next(d for d in plan.decisions if "layers.0.attn" in d.keys)
    assert attn.keys == ("layers.0.attn", "layers.1.attn")  # identical layers: solved once, explained once
    possible = [c for c in attn.candidates if not c.excluded]
    chosen = next(c for c in possible if c.label == attn.chosen)
    assert attn.decided_by.startswith("cheapest")
    assert all(chosen.step_s <= c.step_s for c in possible)
    assert "replicate" in {c.label for c in possible} and {c.label.split("@")[0] for c in attn.candidates} >= {"heads"}
    with pytest.raises(ValueError, match="no structure 'nope'"):
        plan.explain("nope")


def test_explain_an_override():
    model, inputs = tiny()
    plan = autopar.plan(model, {"tp": 2}, inputs, cluster="h100", overrides={"attention": "replicate"})
    rows = _rows(plan.explain("layers.0.attn"), "layers.0.attn")
    assert rows[1] == "  chosen replicate: override: forced to replicate"
    heads = next(line for line in rows if line[4:].startswith("heads@tp "))
    assert "excluded" not in heads and ("KiB" in heads or "MiB" in heads)  # the forms it could have taken are priced


def test_explain_a_precondition():
    """6 heads do not divide over 4 ranks: heads@tp is listed, excluded, with the precondition's reason."""
    model, inputs = llama(4, 32, layers=1, hidden=96, heads=6, kv_heads=2, ffn=128, vocab=256, dtype=torch.float32)
    plan = autopar.plan(model, {"tp": 4}, inputs, cluster="h100", plan="megatron")
    line = next(x for x in plan.explain("layers.0.attn").splitlines() if x.strip().startswith("heads@tp"))
    assert "excluded: 6 heads do not divide over 4 ranks. Fix:" in line
    assert "megatron" in next(d for d in plan.decisions if "layers.0.attn" in d.keys).decided_by


def test_explain_memory_limit_binding():
    """Without a limit nothing is split or recomputed (the fastest); under a limit the ILP recomputes the layers
    (activation checkpointing: the cheapest memory lever on this model) though not recomputing is faster: the
    explanation says the limit decided it."""
    # enough tokens that splitting the vocabulary costs more than the optimizer step it saves on the replicated state
    model, inputs = llama(8, 128, layers=2, hidden=256, heads=4, kv_heads=2, ffn=512, vocab=2048, dtype=torch.float32)
    free = autopar.plan(model, {"dp": 2}, inputs, cluster="h100")
    assert {s.form for s in free.strategies} == {"replicate"} and {lv for _, lv in free.checkpoint} <= {"none"}
    limit = int(free.estimate.memory_bytes_per_device * 0.8)
    # the ILP's own plan (not re-ranked: under this limit the fsdp hand plan is faster, and `auto` would be it)
    info, captured, ctx = _prepare(model, {"dp": 2}, inputs)
    batch, shapes = input_batch(captured)
    plan = build_plan(ctx, info, "auto", None, batch, cluster="h100", input_shapes=shapes, memory_limit=limit,
                      rerank=False)
    assert plan.estimate.fits and plan.estimate.memory_bytes_per_device <= limit
    d = next(d for d in plan.decisions if d.keys[0] == "layers.0")
    assert d.chosen != "none" and d.decided_by.startswith("the ILP, memory limit binding: none takes less time")
    rows = {c.label: c for c in d.candidates}
    assert rows["none"].step_s < rows[d.chosen].step_s and rows["none"].memory_bytes > rows[d.chosen].memory_bytes
    assert "memory limit binding" in plan.explain("layers.0")


def test_explain_a_coupling():
    """Sequence-parallel norms (forced) need tensor-parallel blocks: attention takes heads though replicating it
    is cheaper for this small model, and the explanation names the constraint."""
    model, inputs = tiny()
    plan = autopar.plan(model, {"tp": 2}, inputs, cluster="h100", overrides={"norm": "sequence"})
    attn = next(d for d in plan.decisions if "layers.0.attn" in d.keys)
    assert attn.chosen == "heads@tp"
    assert attn.decided_by == ("coupling: cheaper replicate ruled out: a sequence-parallel norm needs every "
                               "attention and MLP tensor parallel on its axis")


def test_explain_needs_recorded_candidates():
    model, inputs = tiny()
    plan = autopar.plan(model, {"dp": 2}, inputs, cluster="h100")
    old = json.loads(plan.to_json())
    del old["decisions"]  # a plan saved before explain existed still loads, and says what to do
    with pytest.raises(ValueError, match="records no candidates to explain"):
        autopar.Plan.from_json(json.dumps(old)).explain()


# ----------------------------------------------------------------------------- the report

class _Page(HTMLParser):
    """Collects tags (checking that every element closes in order), text, and link/asset references."""

    VOID = {"meta", "input", "br", "hr", "img", "link"}

    def __init__(self):
        super().__init__()
        self.stack, self.text, self.refs, self.comm_nodes, self.errors = [], [], [], 0, []

    def handle_starttag(self, tag, attrs):
        attrs = dict(attrs)
        self.refs += [v for k, v in attrs.items() if k in ("src", "href") and v and not v.startswith("#")]
        if tag == "div" and "comm" in (attrs.get("class") or "").split() and "node" in attrs.get("class", ""):
            self.comm_nodes += 1
        if tag not in self.VOID:
            self.stack.append(tag)

    def handle_endtag(self, tag):
        if not self.stack or self.stack[-1] != tag:
            self.errors.append(f"</{tag}> closes {self.stack[-1:]}")
        else:
            self.stack.pop()

    def handle_data(self, data):
        self.text.append(data)


def _check_report(page: str, plan, gm=None) -> _Page:
    p = _Page()
    p.feed(page)
    p.close()
    assert not p.errors and not p.stack, (p.errors, p.stack)
    assert not p.refs and "http://" not in page and "https://" not in page  # self-contained
    text = "".join(p.text)
    for s in plan.strategies:
        assert s.key in text and s.label in text
    for site in plan.estimate.sites:
        assert site.key in text
    for c in plan.comms:  # every collective row, with its bytes
        assert re.search(re.escape(c.fn) + r"\s*" + re.escape(c.axis), text), c
    assert text.count("* ") >= len(plan.decisions)  # the explanation of every decision
    for section in ("Memory per device", "Estimated step", "Collectives", "Rewritten graph"):
        assert section in text
    return p


def test_plan_to_html(tmp_path):
    model, inputs = tiny()
    plan = autopar.plan(model, {"dp": 2, "tp": 2}, inputs, cluster="h100", plan="megatron", lower=True)
    assert plan.comms
    plan.to_html(str(tmp_path / "p.html"))
    page = (tmp_path / "p.html").read_text()
    _check_report(page, plan)
    assert "pm.report(path)" in page  # no graph here: it says where the graph is
    # the memory bars give the estimate's peak (held + the larger end of backward), the timeline the step
    e = plan.estimate
    held = sum(s.parameters_bytes + s.optimizer_bytes + s.transient_bytes for s in e.sites)
    ends = (sum(s.activations_bytes for s in e.sites) + max(s.momentary_bytes for s in e.sites),
            sum(s.gradients_bytes for s in e.sites))
    assert held + max(ends) == pytest.approx(e.memory_bytes_per_device, abs=len(e.sites) * 4)
    assert sum(s.compute_s + s.comm_s for s in e.sites) + e.optimizer_s + e.contention_s == \
        pytest.approx(e.compute_time_s + e.comm_time_s)
    assert e.optimizer_s > 0  # the optimizer step: on the compute stream after the last reduction
    assert e.step_time_s == pytest.approx(e.compute_time_s + e.exposed_comm_s)  # the step's timeline
    assert all(sum(t for _, t in s.comm_axes) <= s.comm_s + 1e-15 for s in e.sites)


def test_pm_report_shows_the_graph_and_every_collective(local_world, tmp_path):
    from torch.distributed.device_mesh import init_device_mesh

    from autopar.models import GPT, GPTConfig
    from passes.lower import collective_nodes

    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=64, seq_len=16, num_layers=2, num_heads=4, hidden=32))
    ids = torch.randint(0, 64, (4, 16))
    with local_world(4):
        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
        pm = autopar.parallelize(model, mesh, (ids, ids), plan="megatron")
        pm.report(str(tmp_path / "pm.html"))
    page = (tmp_path / "pm.html").read_text()
    p = _check_report(page, pm.plan, pm.graph_module)
    nodes = collective_nodes(pm.graph_module)
    assert p.comm_nodes == len(nodes) == len(pm.plan.comms) > 0  # every collective node highlighted
    for n in nodes:
        assert f">{n.name}</code>" in page


# ----------------------------------------------------------------------------- identical layers, one row

def _many_layers(layers=12):
    from autopar.models import GPT, GPTConfig
    with torch.device("meta"):
        model = GPT(GPTConfig(num_layers=layers))
    ids = torch.zeros(4, 16, dtype=torch.long)
    return model, (ids, ids)


def test_identical_layers_read_as_one_row():
    """12 identical GPT layers under megatron: the table (print(plan)) gives each of a layer's structures one row,
    `h.{0..11}.attn  ×12`, whose cells are every layer's (the index set aside); table(full=True) every row. A layer
    forced otherwise stands alone and splits the range; the ranges read as runs."""
    from autopar.layer_rows import group_rows, index_range, layer_index
    assert index_range([3, 0, 1, 2, 5, 7, 8, 9]) == "{0..3,5,7..9}" and index_range([0, 1]) == "{0,1}"
    assert layer_index("model.layers.17.mlp.experts.3") == ("model.layers.", 17) and layer_index("lm_head") is None
    model, inputs = _many_layers()
    plan = autopar.plan(model, {"tp": 2}, inputs, cluster="h100", plan="megatron")
    grouped, full = plan.table(), plan.table(full=True)
    assert str(plan) == grouped
    keys = [s.key for s in plan.strategies]
    per_layer = [k for k in keys if k.startswith("h.0.")]
    assert len(per_layer) >= 4 and all(f"h.{i}.{k[4:]}" in keys for k in per_layer for i in range(12))
    rows = plan.table_rows(full=False)
    assert len(rows) == len(plan.table_rows(full=True)) - 11 * len(per_layer)
    modules = [r[0] for r in rows[1:]]
    for k in per_layer:
        assert f"h.{{0..11}}.{k[len('h.0.'):]}  ×12" in modules, modules
    assert not any(m.startswith(("h.0.", "h.5.")) for m in modules)
    # a grouped row is every layer's row with the layer's index written as the range
    full_rows = {r[0]: r for r in plan.table_rows(full=True)[1:]}
    for r in rows[1:]:
        if "×12" not in r[0]:
            assert full_rows[r[0]] == r
            continue
        for i in range(12):
            mine = full_rows[r[0].split("  ×")[0].replace("{0..11}", str(i))]
            assert tuple(c.replace(f"h.{i}.", "h.{0..11}.") for c in mine[1:]) == r[1:], (i, mine, r)
    assert "×12" in grouped and "full=True" in grouped and not any("×" in c for r in plan.table_rows() for c in r)
    assert all(k in full for k in keys)
    # one layer forced otherwise: its own rows, and the others' range skips it
    odd = autopar.plan(model, {"tp": 2}, inputs, cluster="h100", plan="megatron",
                       overrides={"h.4.attn": "replicate"})
    modules = [r[0] for r in odd.table_rows(full=False)[1:]]
    assert "h.{0..3,5..11}.attn  ×11" in modules and "h.4.attn" in modules, modules
    assert [r for r, n, _ in group_rows([("a.1.x", "1"), ("a.2.x", "1"), ("a.3.x", "2")])] == \
        [("a.{1,2}.x  ×2", "1"), ("a.3.x", "2")]


def test_cli_full_lists_every_row(capsys):
    assert main(["plan", "--model", "examples.plan_llama:tiny", "--mesh", "tp=2", "--cluster", "h100", "--plan",
                 "megatron", "--quiet", "--no-lower"]) == 0
    grouped = capsys.readouterr().out
    assert main(["plan", "--model", "examples.plan_llama:tiny", "--mesh", "tp=2", "--cluster", "h100", "--plan",
                 "megatron", "--quiet", "--no-lower", "--full"]) == 0
    full = capsys.readouterr().out
    assert "layers.{0,1}.attn  ×2" in grouped and "layers.1.attn" not in grouped
    assert "layers.0.attn" in full and "layers.1.attn" in full and "×2" not in full


def test_report_groups_layers_and_explains_each_decision_once(tmp_path):
    """An 8-layer GPT planned under a tight memory limit (below zero1's and zero2's, which win where they fit): FSDP
    keeps the layers' gathered weights, and the layers' checkpoint decision names the same layers. The report's why section gives each decision once (each
    appeared twice, once per decision naming the layer); its plan, memory, step and collectives tables give the
    identical layers one row, and the plan table's every row stays in the page (folded)."""
    from autopar.models import GPT, GPTConfig
    with torch.device("meta"):
        model = GPT(GPTConfig(num_layers=8, hidden=64, seq_len=64))
    ids = torch.zeros(8, 64, dtype=torch.long)
    plan = autopar.plan(model, {"dp": 2, "tp": 2}, (ids, ids), cluster="h100", memory_limit=7_000_000)
    kinds = [d.kind for d in plan.decisions]
    assert "FSDP gathers" in kinds and any(k.startswith("checkpoint") for k in kinds), kinds
    plan.to_html(str(tmp_path / "p.html"))
    page = (tmp_path / "p.html").read_text()
    p = _check_report(page, plan)
    text = "".join(p.text)
    texts = plan.explanations()
    assert len(texts) >= len(plan.decisions)
    for d, t in zip(plan.decisions, texts):
        assert text.count(t.splitlines()[0]) == 1, (d.kind, t.splitlines()[0])
    why = text[text.index("Why each form"):]
    assert why.count("h.0 (") == 2, why  # the checkpoint and the FSDP-gather decisions: once each
    assert text.count("h.{0..7}.attn  ×8") >= 3  # plan, memory and step tables
    assert "every structure (" in text and "h.7.attn" in text
    assert "activation checkpointing: h.{0..7}  ×8: " in plan.table()  # the layers as a range, not 3 and a count
