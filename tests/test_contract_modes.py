"""The user contract under modes: `pm.train()` / `pm.eval()`, changed non-tensor inputs, keyword inputs in
another order, `pm.to(dtype)`, autocast around `pm`, and BatchNorm, each against the single-device model (loss,
every gradient, every parameter after an SGD step; `equivalence.compare_step`), on simulated ranks.

Train-mode BatchNorm is refused (autopar.capture: batch statistics under data parallelism would need
SyncBatchNorm's cross-rank reduction), so no program here mutates a buffer; that is also why these tests may run
under LocalTensorMode, where one in-place buffer update would run once per simulated rank."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import init_device_mesh

import autopar
from autopar.models import GPT, GPTConfig
from autopar.runtime.collectives import grad_all_reduce_linears
from autopar.runtime.ops import parallel_dropout
from equivalence import compare_step

FP64 = 1e-10


def _gpt_inputs(batch=4, seq=16, vocab=128):
    return torch.randint(0, vocab, (batch, seq)), torch.randint(0, vocab, (batch, seq))


def _max(errs: dict[str, float]) -> float:
    return max(errs.values())


def _per_rank(t: torch.Tensor) -> list[torch.Tensor]:
    return [t._local_tensors[r] for r in sorted(t._local_tensors)]


def _dropouts(pm) -> int:
    """How many dropouts apply (train mode, p > 0) in the program the last call ran."""
    return sum(1 for n in pm.graph_module.graph.nodes if n.target is parallel_dropout
               or (n.target is torch.ops.aten.dropout.default and n.args[2] and n.args[1] > 0))


def test_eval_after_train_capture_turns_dropout_off_and_matches_the_eval_model(local_world, fp64):
    torch.manual_seed(0)
    ref = GPT(GPTConfig(dropout=0.3))
    x = _gpt_inputs()
    with local_world(4):
        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
        pm = autopar.parallelize(copy.deepcopy(ref), mesh, x, plan="megatron")
        assert pm.training and _dropouts(pm) == ref.cfg.num_layers
        pm.eval()
        ref.eval()
        assert _max(compare_step(pm, ref, x)) < FP64
        assert _dropouts(pm) == 0
        assert pm._model.training  # the model pm re-captures in eval mode is left as it was (train)
        # back to train mode: the train program again (cached), dropout on
        pm.train()
        a, b = pm(*x), pm(*x)
        assert float(a._local_tensors[0]) != float(b._local_tensors[0])
        assert len(pm.programs()) == 2, pm.programs()


def test_train_after_eval_capture_applies_dropout_with_train_semantics(local_world, fp64):
    """A dropout between two layers: in train mode every output element is 0 or the eval output / (1 - p), a
    fraction p of them 0, the same on every rank; and gradients equal the model's under that same mask."""
    torch.manual_seed(0)

    class Net(nn.Module):
        def __init__(self, p):
            super().__init__()
            self.fc, self.drop, self.head = nn.Linear(16, 64), nn.Dropout(p), nn.Linear(64, 8)

        def forward(self, x):
            h = self.drop(self.fc(x))
            return self.head(h).pow(2).mean(), h

    x = torch.randn(32, 16)
    for p in (0.0, 0.4):
        ref = Net(p).eval()
        with local_world(2):
            mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("tp",))
            pm = autopar.parallelize(copy.deepcopy(ref), mesh, (x,), plan="megatron")
            assert not pm.training
            assert _max(compare_step(pm, ref, (x,))) < FP64  # eval: exactly the eval model
            pm.train()
            loss, h = pm(x)
            with torch.no_grad():
                full = copy.deepcopy(ref).fc(x)
            for got in _per_rank(h):
                assert torch.equal(got, _per_rank(h)[0]), "every rank holds the same output"
            h0 = _per_rank(h)[0]
            kept = h0 != 0
            assert torch.allclose(h0[kept], full[kept] / (1 - p), atol=FP64)
            assert abs(float((~kept).float().mean()) - p) < 0.05
            if p == 0.0:
                assert kept.all()
            # the gradient is the model's under the same mask
            pm.zero_grad(set_to_none=True)
            loss.backward()
            ref_t = copy.deepcopy(ref)
            ref_t.zero_grad(set_to_none=True)
            with torch.distributed._local_tensor.maybe_disable_local_tensor_mode():
                ref_h = ref_t.fc(x) * kept / (1 - p)
                ref_loss = ref_t.head(ref_h).pow(2).mean()
                ref_loss.backward()
            assert max(float(v) for v in (loss - ref_loss.detach()).abs()._local_tensors.values()) < FP64
            for name, q in pm.named_parameters():
                err = (q.grad.full_tensor() - ref_t.get_parameter(name).grad).abs().max()
                assert max(float(v) for v in err._local_tensors.values()) < FP64, name


class Scaled(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(16, 32), nn.Linear(32, 16)

    def forward(self, x, y, scale=2.0, act="gelu"):
        h = getattr(F, act)(self.fc1(x)) * scale
        return F.mse_loss(self.fc2(h), y)


def test_changed_non_tensor_keyword_is_a_new_program_not_the_captured_value(local_world, fp64):
    torch.manual_seed(0)
    ref = Scaled()
    x, y = torch.randn(8, 16), torch.randn(8, 16)
    with local_world(2):
        mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("tp",))
        pm = autopar.parallelize(copy.deepcopy(ref), mesh, {"x": x, "y": y, "scale": 2.0}, plan="megatron")
        for scale, act in ((3.0, "gelu"), (2.0, "relu"), (2.0, "gelu"), (3.0, "gelu")):
            assert _max(compare_step(pm, ref, {"x": x, "y": y, "scale": scale, "act": act})) < FP64
        # the example's key plus three: (3.0, gelu), (2.0, relu) and (2.0, gelu) spelt out (another structure)
        assert len(pm.programs()) == 4, pm.programs()
        # an unhashable non-tensor input cannot be guarded: a clear error
        with pytest.raises(TypeError, match=r"neither a tensor nor hashable.*Fix"):
            pm(x=x, y=y, scale=2.0, act=object.__new__(type("Opaque", (), {"__hash__": None})))


def test_keyword_inputs_in_another_order_are_accepted(local_world, fp64):
    torch.manual_seed(0)
    ref = Scaled()
    x, y = torch.randn(8, 16), torch.randn(8, 16)
    with local_world(2):
        mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("dp",))
        pm = autopar.parallelize(copy.deepcopy(ref), mesh, {"x": x, "y": y, "scale": 2.0}, plan="dp")
        assert _max(compare_step(pm, ref, {"scale": 2.0, "y": y, "x": x})) < FP64
        assert _max(compare_step(pm, ref, {"y": y, "x": x, "scale": 2.0})) < FP64
        assert len(pm.programs()) == 1, "the same inputs by name: the same program"


def _bf16_close(errs: dict[str, float], ref: nn.Module, tol: float = 3e-2) -> None:
    scale = max(float(p.detach().abs().max()) for p in ref.parameters())
    bad = {k: v for k, v in errs.items() if v > tol * max(1.0, scale)}
    assert not bad, bad


def test_to_bfloat16_recaptures_and_matches_the_bf16_model(local_world):
    torch.manual_seed(0)
    ref = GPT(GPTConfig())
    x = _gpt_inputs()
    with local_world(4):
        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
        pm = autopar.parallelize(copy.deepcopy(ref), mesh, x, plan="megatron")
        pm.to(torch.bfloat16)
        ref.to(torch.bfloat16)
        assert {p.dtype for p in pm.parameters()} == {torch.bfloat16}
        errs = compare_step(pm, ref, x, lr=0.01)
        weights = [n for n in pm.graph_module.graph.nodes if n.op == "placeholder" and n.name == "p_h_0_fc_weight"]
        assert weights and weights[0].meta["val"].dtype == torch.bfloat16, "the program was captured in bf16"
        assert errs["loss"] < 2e-2 * 5  # loss ~4.85 in fp32 (the model computes its loss in fp32)
        _bf16_close(errs, ref)
        assert len(pm.programs()) == 2


def test_autocast_around_pm_matches_the_model_under_autocast(local_world):
    torch.manual_seed(0)
    ref = GPT(GPTConfig())
    x = _gpt_inputs()

    def bf16():
        return torch.autocast("cpu", dtype=torch.bfloat16)

    with local_world(2):
        mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("tp",))
        pm = autopar.parallelize(copy.deepcopy(ref), mesh, x, plan="megatron")
        assert _max(compare_step(pm, ref, x, lr=0.01)) < 1e-5  # fp32, autocast off
        errs = compare_step(pm, ref, x, lr=0.01, context=bf16)
        # the column-parallel linears (fused with their input's collective, `grad_all_reduce_linears`)
        linear = next(n for n in pm.graph_module.graph.nodes if n.target is grad_all_reduce_linears)
        assert linear.meta["val"][0].dtype == torch.bfloat16, "captured under autocast"
        assert errs["loss"] < 2e-2 * 5
        _bf16_close(errs, ref)
        assert any("autocast(cpu, torch.bfloat16)" in p for p in pm.programs()), pm.programs()
        assert len(pm.programs()) == 2


class BNNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc, self.bn, self.head = nn.Linear(16, 32), nn.BatchNorm1d(32), nn.Linear(32, 4)

    def forward(self, x, y):
        return F.mse_loss(self.head(F.relu(self.bn(self.fc(x)))), y)


@pytest.mark.parametrize("plan", ["dp", "megatron"])
def test_batchnorm_in_eval_mode_matches_and_train_mode_raises(local_world, fp64, plan):
    torch.manual_seed(0)
    ref = BNNet()
    with torch.no_grad():  # running statistics that are not the defaults
        ref.bn.running_mean.uniform_(-1, 1)
        ref.bn.running_var.uniform_(0.5, 2)
    ref.eval()
    x, y = torch.randn(8, 16), torch.randn(8, 4)
    stats = {k: v.clone() for k, v in ref.bn.named_buffers()}
    with local_world(2):
        mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("dp",) if plan == "dp" else ("tp",))
        pm = autopar.parallelize(copy.deepcopy(ref), mesh, (x, y), plan=plan)
        for _ in range(2):
            assert _max(compare_step(pm, ref, (x, y))) < FP64
        assert all(torch.equal(pm.get_buffer(f"bn.{k}"), v) for k, v in stats.items()), "running stats read only"
        pm.train()
        with pytest.raises(NotImplementedError, match=r"BatchNorm bn runs in train mode.*SyncBatchNorm.*Fix: .*eval"):
            pm(x, y)
        with pytest.raises(NotImplementedError, match=r"BatchNorm bn runs in train mode"):
            autopar.parallelize(copy.deepcopy(ref).train(), mesh, (x, y), plan=plan)
