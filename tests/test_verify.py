"""`autopar.verify` and `python -m autopar verify`: a correct plan passes (GPT, a Hugging Face Llama, LocalTensorMode);
an injected bug fails naming the parameters it touches (a dropped gradient all-reduce, one gradient off by 1e-6
relative, a model modified by parallelize); a wrong replica on one rank of a real gloo run fails the CLI on
every rank (exit status 1)."""

from __future__ import annotations

import copy
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch.distributed.device_mesh import init_device_mesh

import autopar
import autopar.api
from autopar.models import GPT, MLP, GPTConfig
from autopar.verify import Check, VerifyReport, rtol_for
from dist_harness import gloo_pool
from verify_models import WRONG_PARAM, moe_top1

ROOT = Path(__file__).resolve().parent.parent


def _gpt(**cfg):
    torch.manual_seed(0)
    model = GPT(GPTConfig(**cfg)).double()
    g = torch.Generator().manual_seed(1)
    return model, (torch.randint(0, 128, (4, 16), generator=g), torch.randint(0, 128, (4, 16), generator=g))


def _tp2(local_world):
    return init_device_mesh("cpu", (2,), mesh_dim_names=("tp",))


def _failed(report: VerifyReport) -> set[tuple[str, str]]:
    return {(c.kind, c.name) for c in report.failures()}


def test_rtol_is_sqrt_eps():
    assert rtol_for(torch.float64) == pytest.approx(1.49e-8, rel=1e-2)
    assert rtol_for(torch.float32) == pytest.approx(3.45e-4, rel=1e-2)
    assert rtol_for(torch.bfloat16) == pytest.approx(8.84e-2, rel=1e-2)
    with pytest.raises(ValueError, match="kind"):
        Check(kind="grads", name="x", step=1, dtype="float64", diff=0.0, scale=1.0, limit=1.0, rtol=1.0)


def test_gpt_megatron_passes(local_world):
    model, inputs = _gpt()
    before = copy.deepcopy(model)
    with local_world(4):
        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
        report = autopar.verify(model, mesh, inputs, plan="megatron", steps=2)
    assert report.passed, report
    names = [n for n, _ in model.named_parameters()]
    assert len(report.checks) == 2 * (1 + 2 * len(names))  # per step: the loss, every gradient and parameter
    assert {c.name for c in report.checks if c.kind == "grad"} == set(names)
    assert max(report.loss_diffs()) < 1e-12
    assert report.tolerances == (("float64", rtol_for(torch.float64)),) and report.compute_dtype == "float64"
    assert all(c.scale > 0 for c in report.checks if c.kind == "grad")
    # lr 1e-2 moves every parameter with a gradient by far more than its rounding
    assert all(c.limit < 1e-3 * c.scale + 1e-12 or c.scale == 0 for c in report.checks if c.kind == "param")
    assert report.model_unchanged
    for (n, p), (_, q) in zip(model.named_parameters(), before.named_parameters()):
        assert torch.equal(p, q), n
    assert report.plan.startswith("plan 'megatron' on mesh (dp=2, tp=2)") and "heads@tp" in report.plan
    assert report.reference_time_s > 0 and report.parallel_time_s > 0 and report.parallelize_time_s > 0
    text = str(report)
    assert text.startswith("autopar.verify: PASSED") and "closest to their limit" in text
    table = report.table()
    assert all(n in table for n in names) and "FAIL" not in table
    assert len(report.worst(3)) == 3


def test_hf_llama_passes_at_the_fp32_tolerance(local_world):
    import zoo

    model, inputs, _ = zoo.FAMILIES["llama"]()
    with local_world(2):
        report = autopar.verify(model, _tp2(local_world), inputs, plan="megatron")
    assert report.passed, report
    # fp64 parameters, but the loss is computed on fp32 logits (and RMSNorm rounds to fp32): fp32's tolerance
    assert report.compute_dtype == "float32"
    assert report.tolerances == (("float64", rtol_for(torch.float32)),)
    assert "attention heads@tp" in report.plan
    assert max(c.rel for c in report.checks) < 1e-6


def test_dropped_gradient_all_reduce_fails_upstream(local_world, monkeypatch):
    """One Megatron `f` (identity forward, all-reduce backward; fused with its column-parallel linears) loses its
    all-reduce: the second one backward reaches, at the input of the last block's MLP (the first is the
    vocab-parallel loss's). The gradient that leaves that MLP is partial, so every parameter upstream of it is wrong
    and the ones after it are right."""
    from autopar.runtime import collectives

    backward, real = collectives._AllReduceLinears.backward, collectives._c10d
    calls = []

    class NoAllReduce:  # the functional collectives, the all-reduce an identity
        def __getattr__(self, op):
            return (lambda t, *args: t) if op == "all_reduce" else getattr(real, op)

    def drops_the_second(ctx, *grads):
        calls.append(grads[0].shape)
        if len(calls) != 2:
            return backward(ctx, *grads)
        monkeypatch.setattr(collectives, "_c10d", NoAllReduce())
        try:
            return backward(ctx, *grads)
        finally:
            monkeypatch.setattr(collectives, "_c10d", real)

    monkeypatch.setattr(collectives._AllReduceLinears, "backward", staticmethod(drops_the_second))
    model, inputs = _gpt()
    with local_world(2):
        report = autopar.verify(model, _tp2(local_world), inputs, plan="megatron")
    assert len(calls) == 5  # the loss, then each block's MLP and attention, last block first
    assert not report.passed and report.model_unchanged
    right = {"h.1.fc.weight", "h.1.fc.bias", "h.1.out.weight", "h.1.out.bias", "ln_f.weight", "ln_f.bias"}
    wrong = {n for n, _ in model.named_parameters()} - right  # h.1.ln2 and everything before it (wte: embedding)
    assert _failed(report) == {(k, n) for n in wrong for k in ("grad", "param")}, str(report)
    assert str(report).startswith("autopar.verify: FAILED") and "FAIL" in report.table()
    assert min(c.rel for c in report.failures()) > 0.1  # a wrong plan is far past any rounding (1e-14 here)


def test_one_gradient_off_by_1e_6_is_named(local_world, monkeypatch):
    parallelize = autopar.api.parallelize
    bad = "h.0.attn.qkv.weight"

    def off(*args, **kwargs):
        pm = parallelize(*args, **kwargs)
        pm.get_parameter(bad).register_hook(lambda g: g * (1 + 1e-6))
        return pm

    monkeypatch.setattr(autopar.api, "parallelize", off)
    model, inputs = _gpt()
    with local_world(2):
        report = autopar.verify(model, _tp2(local_world), inputs, plan="megatron")
    assert not report.passed
    assert _failed(report) == {("grad", bad), ("param", bad)}
    worst = report.worst(1)[0]
    assert worst.name == bad and worst.rel == pytest.approx(1e-6, rel=1e-3)


def test_a_model_modified_by_parallelize_fails(local_world, monkeypatch):
    parallelize = autopar.api.parallelize

    def touches(model, *args, **kwargs):
        pm = parallelize(model, *args, **kwargs)
        with torch.no_grad():
            model.ln_f.bias.add_(1.0)
        return pm

    monkeypatch.setattr(autopar.api, "parallelize", touches)
    model, inputs = _gpt()
    with local_world(2):
        report = autopar.verify(model, _tp2(local_world), inputs, plan="megatron")
    assert not report.model_unchanged and not report.passed
    assert all(c.passed for c in report.checks)
    assert any("ln_f.bias" in n for n in report.notes), report.notes


def test_dropout_in_training_mode_is_checked_in_eval_mode(local_world):
    model, inputs = _gpt(dropout=0.1)
    assert model.training
    with local_world(2):
        report = autopar.verify(model, _tp2(local_world), inputs, plan="megatron")
    assert report.passed, report
    assert any("eval mode" in n for n in report.notes)
    assert model.training  # restored


def test_output_must_be_a_scalar_or_loss_fn(local_world):
    torch.manual_seed(0)
    model = MLP().double()
    x = torch.randn(8, 16, dtype=torch.float64)
    with local_world(2):
        mesh = _tp2(local_world)
        with pytest.raises(ValueError, match=r"returned a tensor of shape \(8, 16\).*loss_fn"):
            autopar.verify(model, mesh, (x,), plan="megatron")
        report = autopar.verify(model, mesh, (x,), plan="megatron", loss_fn=lambda out: (out ** 2).mean())
    assert report.passed, report


class _AlwaysDropout(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(8, 8)

    def forward(self, x):
        return self.lin(torch.nn.functional.dropout(x, 0.5, training=True)).sum()


def test_bad_arguments(local_world):
    model, inputs = _gpt()
    with local_world(2):
        mesh = _tp2(local_world)
        with pytest.raises(ValueError, match="steps must be a positive int"):
            autopar.verify(model, mesh, inputs, steps=0)
        with pytest.raises(ValueError, match="lr must be a positive number"):
            autopar.verify(model, mesh, inputs, lr=-1)
        with pytest.raises(ValueError, match="meta device"):
            autopar.verify(GPT(GPTConfig()).to("meta"), mesh, inputs)
        with pytest.raises(ValueError, match="even in eval mode"):
            autopar.verify(_AlwaysDropout().eval(), mesh, (torch.randn(4, 8),))
    # the fake backend without LocalTensorMode computes no values
    with local_world(2):
        mesh = _tp2(local_world)
    with pytest.raises(ValueError, match="'fake' backend"):
        autopar.verify(model, mesh, inputs, plan="megatron")


# ----------------------------------------------------------------------------- the command line, on gloo

def _torchrun(factory: str, *extra: str) -> subprocess.Popen:
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=f"{ROOT}{os.pathsep}{ROOT / 'tests'}")
    torchrun = Path(sys.executable).with_name("torchrun")
    return subprocess.Popen([str(torchrun), "--standalone", "--nproc-per-node", "2", "-m", "autopar", "verify",
                             "--model", f"verify_models:{factory}", "--mesh", "2", *extra], cwd=ROOT, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)


def _job_cli(argv: list[str]):
    """`python -m autopar ...`'s main() on this pool rank (its process group already joined, as under torchrun):
    (exit status, stdout)."""
    import contextlib
    import io

    from autopar.__main__ import main

    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        rc = main(argv)
    return rc, out.getvalue()


def test_cli_passes_on_gloo():
    """Expert parallelism over a ModuleList: each expert's weights live on its owner only (the other rank holds
    none), and the last expert receives no token; both ranks run the check, rank 0 prints it. The `verify`
    command's main() runs on the shared 2-rank gloo pool (what torchrun runs after joining the group, without
    starting 2 more interpreters); the entry point itself is the failing command line's test below."""
    outs = gloo_pool(2).run(_job_cli, ["verify", "--model", "verify_models:moe_top1", "--mesh", "2", "--mesh-names",
                                       "ep", "--plan", "dp", "--override", "moe=expert@ep", "--steps", "2", "--table"])
    assert [o[0] for o in outs] == [0, 0], outs
    assert outs[1][1] == ""  # rank 0 only prints
    stdout = outs[0][1]
    assert stdout.count("autopar.verify: PASSED: plan 'dp' on mesh (ep=2)") == 1
    assert "moe expert@ep x2" in stdout and "2 SGD step(s)" in stdout
    model, _ = moe_top1()
    names = [n for n, _ in model.named_parameters()]
    assert f"{2 * (1 + 2 * len(names))} checks" in stdout and ", 0 failed" in stdout
    rows = [line.split() for line in stdout.splitlines() if line[:1] in "12" and len(line.split()) >= 7]
    assert {r[1] for r in rows if r[1] != "loss"} == set(names)  # --table: every parameter, both steps
    assert all(r[6] == "ok" for r in rows)
    assert "Plan 'dp' on mesh (ep=2)" in stdout  # and the plan's table


def test_cli_fails_when_one_rank_is_wrong():
    """The real entry point: `torchrun -m autopar verify`, the ranks exiting with the failure status."""
    proc = _torchrun("gpt_wrong_on_rank1", "--mesh-names", "tp", "--plan", "megatron")
    try:
        # a guard, not a budget: 5 s quiet; on 2 cores with another job running (load 12, a CPU hog) this launch of
        # three fresh interpreters took past 150 s with the verdict already printed (2026-12-07), so 150 s failed a
        # run that was only slow
        stdout, stderr = proc.communicate(timeout=400)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    out = subprocess.CompletedProcess(proc.args, proc.returncode, stdout, stderr)
    assert out.returncode != 0
    assert "autopar.verify: FAILED" in out.stdout, out.stdout + out.stderr
    assert f"grad {WRONG_PARAM}:" in out.stdout and "(rel 0.5)" in out.stdout
    assert "exitcode  : 1" in out.stderr  # the ranks exited with the failure status, not a crash
    assert "Traceback" not in out.stdout
