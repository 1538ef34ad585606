"""The structure the code keeps: one home per form, registries that refuse a second entry, no import cycles,
and plans that lower on their own (and refuse a graph they were not made for)."""

from __future__ import annotations

import ast
import copy
import dataclasses
from pathlib import Path

import networkx as nx
import pytest
import torch
from torch.distributed.device_mesh import init_device_mesh

import autopar
from autopar.forms import FORMS, form_names
from autopar.forms.base import Form, register
from autopar.models import GPT, GPTConfig
from autopar.plan import Directive, DirectiveKind, Plan
from autopar.sites import Kind

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("autopar", "passes", "cost_model")


def _sources():
    for pkg in PACKAGES:
        for path in sorted((ROOT / pkg).rglob("*.py")):
            yield path, ast.parse(path.read_text())


def _docstrings(tree: ast.AST) -> set[int]:
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and node.body:
            first = node.body[0]
            if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant):
                out.add(id(first.value))
    return out


def test_no_form_name_is_spelled_outside_its_own_module():
    """The planner, solver, estimate, lowering and API read forms off the registry: a string literal equal to a
    structure form's name (outside docstrings and messages) appears only in autopar/forms/."""
    names = {f.name for f in FORMS.values()}
    found = []
    for path, tree in _sources():
        if path.parent.name == "forms":
            continue
        docs = _docstrings(tree)
        messages = {id(v) for n in ast.walk(tree) if isinstance(n, ast.JoinedStr) for v in ast.walk(n)}
        for node in ast.walk(tree):
            if isinstance(node, ast.Constant) and node.value in names and id(node) not in docs \
                    and id(node) not in messages:
                found.append(f"{path.relative_to(ROOT)}:{node.lineno}: {node.value!r}")
    assert not found, "form names spelled outside autopar/forms:\n" + "\n".join(found)


def test_every_kind_has_replicate_first_and_forms_register_once():
    for kind in Kind:
        assert form_names(kind)[0] == "replicate", kind
    with pytest.raises(ValueError, match="registered twice"):
        @register
        class Again(Form):  # noqa: F841 - the second "heads" for attention is refused
            name = "heads"
            kinds = (Kind.ATTENTION,)


def test_rules_and_local_forms_register_once():
    from passes.local_forms import local_form
    from passes.rules import register as register_rule
    with pytest.raises(ValueError, match="registered twice"):
        register_rule(torch.ops.aten.add.Tensor)(lambda *a: None)
    with pytest.raises(ValueError, match="registered twice"):
        local_form(torch.ops.aten.embedding.default)(lambda *a: None)


def _imports(path: Path, mod: str, known: set[str]) -> set[str]:
    tree = ast.parse(path.read_text())
    skip = {id(s) for n in ast.walk(tree) if isinstance(n, ast.If) and "TYPE_CHECKING" in ast.dump(n.test)
            for s in ast.walk(n)}
    pkg = mod if path.name == "__init__.py" else mod.rpartition(".")[0]
    out = set()
    for node in ast.walk(tree):
        if id(node) in skip:
            continue
        names = []
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = pkg.split(".")
                base = ".".join(parts[: len(parts) - node.level + 1] + ([base] if base else []))
            names = [base] + [f"{base}.{a.name}" for a in node.names]
        for n in names:
            while n and n not in known:
                n = n.rpartition(".")[0]
            if n and n != mod:
                out.add(n)
    return out


def test_no_import_cycles_counting_imports_inside_functions():
    """The rule of ../shared/tools/cycles.py, enforced where CI runs."""
    mods = {}
    for pkg in PACKAGES:
        for path in (ROOT / pkg).rglob("*.py"):
            mod = ".".join(path.relative_to(ROOT).with_suffix("").parts)
            mods[mod.removesuffix(".__init__")] = path
    g = nx.DiGraph()
    for mod, path in mods.items():
        for dep in _imports(path, mod, set(mods)):
            if mod.startswith(dep + ".") and mods[dep].name == "__init__.py":
                continue  # a module importing its own package's __init__ is not a design cycle
            g.add_edge(mod, dep)
    cycles = list(nx.simple_cycles(g))
    assert not cycles, "import cycles: " + "; ".join(" -> ".join(c + c[:1]) for c in cycles)


# ----------------------------------------------------------------------------- plans lower on their own

def _gpt():
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=128, seq_len=16, num_layers=2, num_heads=4, hidden=32))
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 128, (4, 16), generator=g)
    return model, (ids, torch.roll(ids, -1, 1))


def test_a_saved_plan_lowers_on_its_own_and_refuses_another_graph(local_world, tmp_path):
    """A plan saved to JSON carries placements, directives (keyed by graph names) and the graph's fingerprint:
    loaded into a fresh process-free parallelize it gives the same program; a directive naming a node the graph
    lacks, or a plan made for other input shapes, is an error that says so."""
    model, inputs = _gpt()
    with local_world(2):
        mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("tp",))
        pm = autopar.parallelize(copy.deepcopy(model), mesh, inputs, plan="megatron", overrides={"norm": "sequence"})
        path = tmp_path / "plan.json"
        pm.plan.save(str(path))
        loaded = Plan.load(str(path))
        assert any(d.kind is DirectiveKind.HINT for d in loaded.directives), loaded.directives
        assert any(d.kind is DirectiveKind.ROW_OUTPUT for d in loaded.directives), loaded.directives
        again = autopar.parallelize(copy.deepcopy(model), mesh, inputs, plan=str(path))
        assert again.plan.comms == pm.plan.comms and again.plan.params == pm.plan.params
        assert str(again.graph_module.code) == str(pm.graph_module.code)
        bad = dataclasses.replace(loaded, graph="", directives=loaded.directives + (
            Directive(kind=DirectiveKind.HINT, node="no_such_node", axis="tp", value="S(1)"),))
        with pytest.raises(ValueError, match=r"no_such_node.*re-plan"):
            autopar.parallelize(copy.deepcopy(model), mesh, inputs, plan=bad)
        other = (inputs[0][:, :8], inputs[1][:, :8])
        with pytest.raises(ValueError, match=r"made for another graph.*re-plan"):
            autopar.parallelize(copy.deepcopy(model), mesh, other, plan=loaded)
