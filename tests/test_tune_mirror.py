"""Mirror images (`autopar.tune.mirror`: a plan with two mesh axes of the same size swapped): they lower to the same
collectives, renamed, with the same numerics; and tune treats two axes as interchangeable (measures a plan and its
mirror image once) only where the cost model prices them alike (`autopar.tune._interchangeable`)."""

from __future__ import annotations

import dataclasses

import pytest

import autopar
from autopar.api import _prepare
from autopar.tune import _interchangeable, _signature, _signatures, mirror
from cost_model.hardware import Calibration, Link, load_cluster
from equivalence import run_equivalence
from test_tune import MESH, tiny

SWAP = {"dp": "tp", "tp": "dp"}


def test_a_mirror_image_runs_the_same_collectives_on_the_other_axis(local_world, fp64):
    model, inputs = tiny()
    megatron = autopar.plan(model, MESH, inputs, plan="megatron")
    image = mirror(megatron, SWAP)
    assert dict(image.inputs) == {"tokens": "RS(0)", "labels": "RS(0)"}  # the batch over tp, heads over dp
    assert {s.key: s.axes for s in image.strategies if s.axes}["h.0.attn"] == ("dp",)
    assert mirror(image, SWAP) == megatron
    assert _signature(image) != _signature(megatron) and _signature(image) in _signatures(megatron, [SWAP])
    runs = {}
    with local_world(4):
        for name, plan in (("megatron", megatron), ("mirror", image)):
            runs[name] = res = run_equivalence(model, inputs, (2, 2), ("dp", "tp"), plan=plan)
            assert res.max_err() < 1e-10, (name, res.grad_err, res.param_err)
    a, b = runs["megatron"], runs["mirror"]
    renamed = [(kind, SWAP[axis], pass_, numel, nbytes) for kind, axis, pass_, numel, nbytes in a.comms]
    assert a.comms != b.comms and b.comms == renamed  # the same collectives, in order, sizes, on the other axis
    assert {axis for kind, axis, pass_, *_ in a.comms if pass_ == "forward"} == {"tp", "dp"}
    assert b.graph_counts == a.graph_counts and b.local_numel == a.local_numel
    rows = lambda plan, swap: [dataclasses.replace(c, axis=swap.get(c.axis, c.axis)) for c in plan.comms]  # noqa: E731
    assert rows(b.plan, {}) == rows(a.plan, SWAP) and len(a.plan.comms) == sum(a.graph_counts.values())


def test_mirror_takes_a_swap_of_axes_of_one_size():
    model, inputs = tiny()
    plan = autopar.plan(model, MESH, inputs, plan="megatron")
    for bad in ({"dp": "cp", "cp": "dp"}, {"dp": "tp"}):
        with pytest.raises(ValueError, match="not a swap of mesh axes of equal size.*Fix"):
            mirror(plan, bad)


def test_axes_are_interchangeable_only_where_the_cost_model_prices_them_alike():
    model, inputs = tiny()
    info, _, _ = _prepare(model, MESH, inputs)
    cpu = load_cluster("cpu", info.sizes)
    assert _interchangeable(info, cpu) == [SWAP]  # a preset, both axes within one node: one link
    assert _interchangeable(info, dataclasses.replace(cpu, gpus_per_node=2)) == []  # dp crosses nodes
    # a profile measures a link per axis: the gloo loopback of one host measured ~1.9x apart in latency and ~1.8x in
    # bandwidth by noise on a loaded machine (the 2 x 2 profile of benchmarks/tune.py); priced apart, measured apart
    fast, slow = Link(alpha_s=1e-3, bytes_per_s=7e8), Link(alpha_s=1.9e-3, bytes_per_s=3.9e8)
    measured = lambda *links: dataclasses.replace(cpu, mesh_shape=(2, 2), axis_links=links)  # noqa: E731
    assert _interchangeable(info, measured(slow, fast)) == []
    assert _interchangeable(info, measured(fast, fast)) == [SWAP]
    # a calibration that scales the axes apart (collectives, latency per collective, synchronisation)
    for cal in (Calibration(axes=(1.0, 1.3), mesh_shape=(2, 2)), Calibration(latency=(0.0, 1e-3), mesh_shape=(2, 2)),
                Calibration(axes=(1.2, 1.2), sync=(1.0, 2.0), mesh_shape=(2, 2))):
        assert _interchangeable(info, dataclasses.replace(cpu, calibration=cal)) == [], cal
    alike = Calibration(axes=(1.2, 1.2), sync=(0.5, 0.5), latency=(1e-3, 1e-3), mesh_shape=(2, 2))
    assert _interchangeable(info, dataclasses.replace(cpu, calibration=alike)) == [SWAP]
