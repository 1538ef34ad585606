"""Errors a user can act on (issue #10): every mistake below raises what went wrong, what was given, why and
the fix, before any work is wasted; the one case that used to fail inside autopar (a tied weight used transposed)
now runs and matches the single-device model."""

from __future__ import annotations

import copy
import dataclasses
import json
import math
import re

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Replicate, distribute_tensor

import autopar
from autopar.models import MLP
from autopar.plan import Directive, DirectiveKind, Plan
from autopar.units import fmt_bytes, parse_bytes
from cost_model import hardware as H
from equivalence import run_equivalence

MESH = {"tp": 2}
PLAN_FIX = r"Fix: re-plan.*save"


def _mlp():
    torch.manual_seed(0)
    return MLP(), (torch.randn(8, 16), torch.randn(8, 16))


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """A megatron plan of the MLP on MESH, saved: (path, its JSON as a dict)."""
    model, inputs = _mlp()
    path = tmp_path_factory.mktemp("plans") / "mlp.json"
    autopar.plan(model, MESH, inputs, plan="megatron").save(str(path))
    return path, json.loads(path.read_text())


def _write(tmp_path, text: str):
    path = tmp_path / "plan.json"
    path.write_text(text)
    return str(path)


# ----------------------------------------------------------------------------- plan names

def test_unknown_plan_name_lists_the_names_and_says_a_path_must_exist():
    model, inputs = _mlp()
    with pytest.raises(ValueError, match=r"plan 'nonsense' is neither a plan name \('auto', 'megatron', 'dp', "
                                         r"'fsdp', 'zero1', 'zero2'\) nor an existing file\. Fix: give one of the "
                                         r"names.*must exist"):
        autopar.plan(model, MESH, inputs, plan="nonsense")
    with pytest.raises(ValueError, match=r"did you mean 'megatron'\?"):
        autopar.plan(model, MESH, inputs, plan="Megatron")
    with pytest.raises(TypeError, match=r"plan must be one of 'auto', 'megatron', 'dp', 'fsdp', 'zero1', 'zero2', a "
                                        r"Plan or the path of a saved plan; got int 3"):
        autopar.plan(model, MESH, inputs, plan=3)


# ----------------------------------------------------------------------------- saved plans

def test_saved_plan_loads_and_round_trips(saved):
    path, _ = saved
    model, inputs = _mlp()
    loaded = Plan.load(str(path))
    assert Plan.from_json(loaded.to_json()) == loaded
    assert autopar.plan(model, MESH, inputs, plan=str(path)).params == loaded.params


def test_garbage_plan_file_names_the_file_and_the_fix(tmp_path):
    path = _write(tmp_path, "hello world")
    with pytest.raises(ValueError, match=rf"plan file '{path}' is not a valid autopar plan: not valid JSON: Expecting "
                                         rf"value at line 1, column 1.*{PLAN_FIX}"):
        Plan.load(path)


def test_truncated_plan_file_says_where_it_stops(tmp_path, saved):
    text = saved[0].read_text()
    path = _write(tmp_path, text[: len(text) // 2])
    model, inputs = _mlp()
    with pytest.raises(ValueError, match=rf"plan file '{path}' is not a valid autopar plan: not valid JSON: .* at "
                                         rf"line \d+, column \d+ \(a truncated or hand-edited file\?\).*{PLAN_FIX}"):
        autopar.plan(model, MESH, inputs, plan=path)


@pytest.mark.parametrize("edit, message", [
    (lambda d: d.pop("params"), r"field 'params' is missing"),
    (lambda d: d.pop("mesh"), r"field 'mesh' is missing"),
    (lambda d: d.update(params=5), r"field 'params' must be a list, got int 5"),
    (lambda d: d["params"].__setitem__(0, ["fc1.weight"]),
     r"params\[0\] must be a \[name, placements\] pair such as .*, got list \[\"fc1.weight\"\]"),
    (lambda d: d["params"].__setitem__(0, ["fc1.weight", "XYZ"]),
     r"plan entry 'fc1.weight': cannot parse placements 'XYZ': expected one placement per mesh axis"),
    (lambda d: d["params"].__setitem__(0, ["fc1.weight", "S(0)R"]),
     r"plan entry 'fc1.weight' has placements 'S\(0\)R' for 2 axes, but the plan's mesh .* has 1"),
    (lambda d: d["strategies"][0].update(form=5), r"field 'strategies\[0\] \(loss\)\.form' must be a str, got int 5"),
    (lambda d: d["strategies"][0].update(colour="red"), r"field 'strategies\[0\] \(loss\)' has the unknown field "
                                                          r"'colour'"),
    (lambda d: d.update(directives=[{"kind": "bogus", "node": "x", "axis": "tp"}]),
     r"field 'directives\[0\] \(x\)\.kind' is str 'bogus', not a directive kind \(hint, row_output"),
    (lambda d: d.update(mesh=[["tp", "two"]]), r"mesh\[0\] must be an \[axis name, size\] pair"),
    (lambda d: d["estimate"].pop("fits"), r"field 'estimate\.fits' is missing"),
])
def test_malformed_plan_fields_are_named(tmp_path, saved, edit, message):
    d = copy.deepcopy(saved[1])
    edit(d)
    path = _write(tmp_path, json.dumps(d))
    with pytest.raises(ValueError, match=rf"plan file '{path}' is not a valid autopar plan: {message}.*{PLAN_FIX}"):
        Plan.load(path)


def test_plan_of_another_model_names_the_parameters(saved):
    torch.manual_seed(0)
    other = nn.Sequential(nn.Linear(16, 16))
    with pytest.raises(ValueError, match=rf"plan file '{saved[0]}' has no placement for this model's parameters "
                                         r"0\.bias, 0\.weight and places parameters it does not have, fc1\.bias, "
                                         r"fc1\.weight, fc2\.bias, fc2\.weight: it was made for another model\. "
                                         r"Fix: re-plan"):
        autopar.plan(other, MESH, (torch.randn(8, 16),), plan=str(saved[0]))


def test_plan_with_an_extra_unknown_parameter_entry_names_it(tmp_path, saved):
    """A hand edit that adds a placement for a parameter the model does not have is refused like the others (every
    other entry matching the model)."""
    d = copy.deepcopy(saved[1])
    d["params"].append(["fc3.weight", d["params"][0][1]])
    path = _write(tmp_path, json.dumps(d))
    model, inputs = _mlp()
    with pytest.raises(ValueError, match=rf"plan file '{path}' places parameters this model does not have, "
                                         r"fc3\.weight \(its other entries match the model\).*Fix: re-plan"):
        autopar.plan(model, MESH, inputs, plan=path)


def test_plan_for_another_graph_or_mesh_names_the_file(saved):
    model, _ = _mlp()
    with pytest.raises(ValueError, match=rf"plan file '{saved[0]}' was made for another graph \(fingerprint \w+; this "
                                         r"model on these inputs captures as \w+\).*Fix: re-plan"):
        autopar.plan(model, MESH, (torch.randn(4, 16), torch.randn(4, 16)), plan=str(saved[0]))
    with pytest.raises(ValueError, match=rf"plan file '{saved[0]}' was made for mesh \(\('tp', 2\),\), but this mesh "
                                         r"is \(\('tp', 4\),\)\. Fix: re-plan"):
        autopar.plan(model, {"tp": 4}, _mlp()[1], plan=str(saved[0]))


def test_plan_with_an_unknown_form_names_the_structure(tmp_path, saved):
    d = copy.deepcopy(saved[1])
    next(s for s in d["strategies"] if s["kind"] == "mlp")["form"] = "diagonal"
    path = _write(tmp_path, json.dumps(d))
    model, inputs = _mlp()
    with pytest.raises(ValueError, match=rf"plan file '{path}': structure '\{{fc1,fc2\}}' has kind 'mlp' and form "
                                         r"'diagonal', which autopar does not know.*Fix: re-plan"):
        autopar.plan(model, MESH, inputs, plan=path)


@pytest.mark.parametrize("fqn, placements, why", [
    ("fc1.weight", "S(2)", r"it has no dim 2"),
    ("fc1.bias", "S(-1)", r"it has no dim -1"),
    ("fc1.weight", "P", r"a parameter or input is never a partial sum"),
    ("fc1.weight", "O(3)", r"axis 'tp' has no rank 3"),
    ("fc2.bias", "SS(0,3)", r"dim 0 does not split into 3 blocks, each split over 2 ranks"),
])
def test_given_plan_placements_are_checked_against_the_shapes(saved, fqn, placements, why):
    """Hand-edited placements used to fail inside lowering (IndexError, ZeroDivisionError, 'no collective turns R
    into P')."""
    model, inputs = _mlp()
    plan = Plan.load(str(saved[0]))
    bad = dataclasses.replace(plan, params=tuple((k, placements if k == fqn else v) for k, v in plan.params))
    shape = tuple(dict(model.named_parameters())[fqn].shape)
    with pytest.raises(ValueError, match=rf"the given Plan places parameter '{fqn}' of shape {re.escape(str(shape))} "
                                         rf"as '{re.escape(placements)}' on mesh \(\('tp', 2\),\): {why}\. "
                                         r"Fix: re-plan"):
        autopar.plan(model, MESH, inputs, plan=bad)


def test_given_plan_directives_are_checked_by_lowering(local_world, saved):
    model, inputs = _mlp()
    plan = Plan.load(str(saved[0]))
    with local_world(2):
        mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("tp",))
        bad = dataclasses.replace(plan, directives=(Directive(kind=DirectiveKind.ATTENTION, node="relu", axis="tp",
                                                              value="sideways"),))
        with pytest.raises(ValueError, match=r"plan 'megatron': its attention directive for 'relu' on axis 'tp' has "
                                             r"the value 'sideways', which lowering cannot use: 'sideways' is not a "
                                             r"valid AttentionMode\. Fix: re-plan"):
            autopar.parallelize(copy.deepcopy(model), mesh, inputs, plan=bad)
        bad = dataclasses.replace(plan, directives=(Directive(kind=DirectiveKind.EXPERTS, node="relu", axis="tp"),))
        with pytest.raises(ValueError, match=r"experts directive for graph node 'relu', which is not a MoE experts "
                                             r"node.*Fix: re-plan"):
            autopar.parallelize(copy.deepcopy(model), mesh, inputs, plan=bad)


# ----------------------------------------------------------------------------- cluster profiles

def test_corrupted_cached_profile_warns_with_its_path_and_falls_back_to_the_preset(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    cached = H.default_profile_path((2,))
    cached.parent.mkdir(parents=True)
    preset = H._preset_for_this_machine()
    text = preset.to_json()
    for broken, why in ((text[: len(text) // 2], r"not valid JSON \(.* at line \d+, column \d+; a truncated file\?\)"),
                        (json.dumps({**json.loads(text), "intra_node": None}),
                         r"its fields do not make a Cluster: .*must be a mapping, not NoneType"),
                        (json.dumps({k: v for k, v in json.loads(text).items() if k != "inter_node"}),
                         r"field 'inter_node' is missing")):
        cached.write_text(broken)
        with pytest.warns(UserWarning, match=rf"the cached cluster profile '{cached}' is not a valid autopar profile "
                                             rf"\({why}\); planning with the '{preset.name}' preset instead\. Fix: "
                                             r"measure again .*autopar profile.*or delete the file"):
            assert H.load_cluster(None, (2,)) is preset
    model, inputs = _mlp()
    with pytest.warns(UserWarning, match=rf"cached cluster profile '{cached}'"):
        p = autopar.plan(model, MESH, inputs, plan="megatron")
    assert p.estimate.cluster == preset.name


def test_cluster_of_the_wrong_type_lists_what_is_accepted():
    model, inputs = _mlp()
    with pytest.raises(TypeError, match=r"cluster must be a preset name \('a100', 'cpu', 'h100', 'h100_hbm2e', 'h200'\), a path to "
                                        r"a JSON profile .* a Cluster, or None .*; got int 42"):
        autopar.plan(model, MESH, inputs, cluster=42)


def test_explicit_bad_profile_names_the_file_and_the_fix(tmp_path):
    path = tmp_path / "prof.json"
    path.write_text("{")
    with pytest.raises(ValueError, match=rf"cluster profile '{path}' is not a valid autopar profile: not valid JSON.*"
                                         r"Fix: write it again with .*autopar profile --out"):
        H.load_cluster(path)


# ----------------------------------------------------------------------------- memory_limit

@pytest.mark.parametrize("given, want", [
    (1024, 1024), (2.5e9, 2_500_000_000), ("80GB", 80 * 10**9), ("80 GiB", 80 * 2**30), ("512MB", 512 * 10**6),
    ("1.5TB", 1_500_000_000_000), ("4 kib", 4096), ("100", 100), ("2e3 B", 2000), ("auto", None), (None, None),
])
def test_memory_limit_sizes(given, want):
    assert parse_bytes(given) == want


@pytest.mark.parametrize("given, error, message", [
    (math.nan, ValueError, r"memory_limit must be a positive, finite number of bytes, got nan.*\"80GB\".*or leave it "
                           r"None"),
    (math.inf, ValueError, r"positive, finite number of bytes, got inf"),
    (-5, ValueError, r"positive, finite number of bytes, got -5"),
    (0, ValueError, r"positive, finite number of bytes, got 0"),
    ("80 parsecs", ValueError, r"memory_limit='80 parsecs' is not a size: expected a number and one of the units B, "
                               r"KB, MB, GB, TB, PB, KiB, MiB, GiB, TiB, PiB"),
    ("lots", ValueError, r"memory_limit='lots' is not a size"),
    ([80], TypeError, r"memory_limit must be a number of bytes or a size string .*; got list \[80\]"),
    (True, TypeError, r"got bool True"),
])
def test_memory_limit_refused_with_what_was_expected(given, error, message):
    with pytest.raises(error, match=message):
        parse_bytes(given)


def test_memory_limit_strings_reach_the_plan():
    model, inputs = _mlp()
    assert autopar.plan(model, MESH, inputs, memory_limit="1GB").estimate.memory_limit_bytes == 10**9
    auto = autopar.plan(model, MESH, inputs, memory_limit="auto", cluster="h100")
    assert auto.estimate.memory_limit_bytes == H.PRESETS["h100"].device_memory_bytes
    with pytest.raises(ValueError, match=r"memory_limit must be a positive, finite number of bytes, got nan"):
        autopar.plan(model, MESH, inputs, memory_limit=math.nan)


# ----------------------------------------------------------------------------- sizes in messages

def test_sizes_print_in_fitting_units():
    assert [fmt_bytes(n) for n in (0, 512, 1536, 12.3 * 2**20, 80 * 2**30, 3 * 2**40, 2**30 - 1)] == \
        ["0 B", "512 B", "1.50 KiB", "12.3 MiB", "80.0 GiB", "3.00 TiB", "1024 MiB"]


def test_infeasible_memory_prints_small_sizes_in_fitting_units():
    model, inputs = _mlp()
    with pytest.raises(autopar.InfeasibleError, match=r"no plan fits 1\.00 KiB per device on mesh \(tp=2\): the "
                                                      r"least memory any plan needs is \d+(\.\d+)? KiB per device.*"
                                                      r"Fix: raise memory_limit") as e:
        autopar.plan(model, MESH, inputs, memory_limit="1KiB")
    assert e.value.limit_bytes == 1024 and 1024 < e.value.least_bytes < 2**20
    fits = autopar.plan(model, MESH, inputs, memory_limit="1 MiB")
    assert f"of {fmt_bytes(2**20)} (fits)" in fits.table() and "1.00 MiB" in fits.table()


# ----------------------------------------------------------------------------- models autopar cannot take

def test_parallelizing_a_parallel_module_again_says_pass_the_original(local_world):
    model, inputs = _mlp()
    with local_world(2):
        mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("tp",))
        pm = autopar.parallelize(model, mesh, inputs, plan="megatron")
        for call in (autopar.parallelize, autopar.plan):
            with pytest.raises(TypeError, match=r"the model is a ParallelModule, the result of autopar\.parallelize: "
                                                r"autopar parallelises a single-device model once\. Fix: pass the "
                                                r"original model to parallelize.*pm\.plan shows"):
                call(pm, mesh, inputs)
        wrapped = nn.Sequential(pm)
        with pytest.raises(TypeError, match=r"^0 is a ParallelModule"):
            autopar.parallelize(wrapped, mesh, inputs)


def test_model_holding_dtensors_is_refused_before_capture(local_world):
    model, inputs = _mlp()
    with local_world(2):
        mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("tp",))
        for name, p in list(model.named_parameters()):
            mod, leaf = name.rsplit(".", 1)
            setattr(model.get_submodule(mod), leaf, nn.Parameter(distribute_tensor(p.detach(), mesh, [Replicate()])))
        with pytest.raises(ValueError, match=r"the model already holds DTensors \(fc1\.weight, fc1\.bias, fc2\.weight, "
                                             r"\.\.\.; 4 in all\): it was parallelised before.*Fix: pass the model "
                                             r"before it was parallelised"):
            autopar.parallelize(model, mesh, inputs)


def test_meta_model_under_simulated_ranks_says_to_use_processes_and_plan_does(local_world):
    """Meta-device models are parallelised on real processes (tests/test_meta.py); simulated ranks cannot hold
    per-rank shard shapes of an unmaterialised model, and say so."""
    with torch.device("meta"):
        model = MLP()
    inputs = _mlp()[1]
    with local_world(2):
        mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("tp",))
        with pytest.raises(NotImplementedError, match=r"parallelising a meta-device model under LocalTensorMode "
                                                      r"\(simulated ranks\) is not supported.*Fix: run on real "
                                                      r"processes"):
            autopar.parallelize(model, mesh, inputs)
    meta_inputs = tuple(torch.empty(8, 16, device="meta") for _ in range(2))
    assert autopar.plan(model, MESH, meta_inputs, plan="megatron").strategies


def test_model_and_override_keys_of_the_wrong_type():
    model, inputs = _mlp()
    with pytest.raises(TypeError, match=r"model must be a torch\.nn\.Module, got NoneType"):
        autopar.plan(None, MESH, inputs)
    with pytest.raises(TypeError, match=r"override keys are a kind \(linear, .*\) or a module-path glob such as "
                                        r"'h\.\*\.attn', got int 5"):
        autopar.plan(model, MESH, inputs, overrides={5: "colwise"})


# ----------------------------------------------------------------------------- a tied weight used transposed

class TiedTransposed(nn.Module):
    """An autoencoder whose decoder is the encoder's weight transposed (`F.linear(h, enc.weight.t(), bias)`)."""

    def __init__(self, dim: int = 8, hidden: int = 16):
        super().__init__()
        self.enc = nn.Linear(dim, hidden)
        self.dec_bias = nn.Parameter(torch.randn(dim))

    def forward(self, x, y):
        h = torch.relu(self.enc(x))
        return F.mse_loss(F.linear(h, self.enc.weight.t(), self.dec_bias), y)


def test_tied_weight_used_transposed_matches_one_device(local_world, fp64):
    """The transposed use of the column-parallel encoder weight is row-parallel: its bias is added once after the
    all-reduce (it used to fail inside autopar, then ran with both operands all-gathered)."""
    torch.manual_seed(0)
    model = TiedTransposed()
    inputs = (torch.randn(4, 8), torch.randn(4, 8))
    with local_world(2):
        r = run_equivalence(model, inputs, (2,), ("tp",), plan="megatron")
    assert [(s.kind, s.label) for s in r.plan.strategies] == [("loss", "replicate"), ("mlp", "tp@tp")]
    assert dict(r.plan.params) == {"enc.weight": "S(0)", "enc.bias": "S(0)", "dec_bias": "R"}
    assert set(r.grad_err) == set(r.param_err) == {"enc.weight", "enc.bias", "dec_bias"}
    assert r.max_err() < 1e-12, (r.grad_err, r.param_err)
    # one all-reduce of the (4, 8) fp64 output, ring: 2(p-1)/p * 256 B sent per rank
    assert r.comms == [("all_reduce", "tp", "forward", 32, 256)]
    assert r.graph_counts == {"all_reduce": 1} and r.plan.comm_counts() == {"all_reduce.forward": 1}
