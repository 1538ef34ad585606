"""`autopar.runtime.local_step`: an optimizer step on DTensor parameters runs on their local tensors where exact.

A replicated parameter's local tensor is the global tensor, and a shard under an elementwise optimizer is the
shard of the step, so the step must be bitwise the step on the DTensors (parameters, and state: the same values,
DTensors where the DTensor step keeps DTensors), for torch's optimizers, single-tensor and foreach, on replicated
and (evenly and unevenly) sharded parameters; it must not run where it would not be exact or not see what the
step sees (a sharded parameter under an optimizer that is not torch's elementwise one, a `Partial` gradient, an
unmarked parameter, the first step, a closure, `differentiable`); a step that raises mid-swap is put back before
anything else reads the optimizer; a state tensor the step replaces out of place comes back a DTensor as it was.
And the `dp`, `fsdp` and `megatron` plans trained with AdamW match the single-device model (loss, every gradient,
every parameter after the steps) with the later steps swapped, on simulated ranks and (dp) on gloo ranks; a DCP
checkpoint of swapped steps resumes bit for bit.
"""

from __future__ import annotations

import functools

import pytest
import torch
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_tensor

from autopar.models import GPT, GPTConfig
from autopar.runtime import local_step
from dist_harness import gloo_pool
from equivalence import gloo_equivalence, run_equivalence

STEPS = 3


@pytest.fixture
def swaps(monkeypatch):
    """Every step's eligibility, as (optimizer, swapped?)."""
    local_step.install()
    taken = []
    original = local_step._eligible
    monkeypatch.setattr(local_step, "_eligible", lambda opt, *a: taken.append((opt, original(opt, *a))) or taken[-1][1])
    return taken


def _params(mesh, placements=None, mark=True):
    torch.manual_seed(1)
    values = [torch.randn(5, 4, dtype=torch.float64), torch.randn(4, dtype=torch.float64),
              torch.randn((), dtype=torch.float64)]
    placements = placements or [[Replicate()]] * len(values)
    params = [torch.nn.Parameter(distribute_tensor(v, mesh, pl)) for v, pl in zip(values, placements)]
    if mark:
        local_step.register(params)
    return params


def _train(params, opt, mesh, grads_seed=2, steps=STEPS, closure=None, grad_placements=None):
    torch.manual_seed(grads_seed)
    for _ in range(steps):
        for i, p in enumerate(params):
            g = torch.randn(p.shape, dtype=p.dtype)
            if grad_placements is not None:  # e.g. Partial: each rank's local is half the gradient
                p.grad = DTensor.from_local(g / 2, mesh, grad_placements[i], run_check=False)
            else:
                p.grad = distribute_tensor(g, mesh, p.placements)
        opt.step(closure) if closure is not None else opt.step()


def _locals(t: DTensor) -> list[torch.Tensor]:
    local = t._local_tensor
    return list(local._local_tensors.values()) if hasattr(local, "_local_tensors") else [local]


def _same(a, b) -> None:
    assert type(a) is type(b), (type(a), type(b))
    if isinstance(a, DTensor):
        assert a.placements == b.placements and a.shape == b.shape and a.dtype == b.dtype
        for x, y in zip(_locals(a), _locals(b)):
            assert torch.equal(x, y), (x, y)
    elif isinstance(a, torch.Tensor):
        assert torch.equal(a, b)
    else:
        assert a == b


def _same_run(run_a, run_b) -> None:
    (pa, oa), (pb, ob) = run_a, run_b
    for i, (a, b) in enumerate(zip(pa, pb)):
        _same(a.data, b.data)
        assert set(oa.state[a]) == set(ob.state[b])
        for k in oa.state[a]:
            _same(oa.state[a][k], ob.state[b][k])
        assert oa.param_groups[0]["params"][i] is a


def _swap_on_and_off(mesh, make_opt, placements=None, mark=True, train=_train):
    """The same parameters trained twice by `train(params, opt)`, the swap on, then off: [(params, opt)] x 2."""
    runs = []
    for on in (True, False):
        params = _params(mesh, placements, mark=mark)
        opt = make_opt(params)
        with local_step.enabled(on):
            train(params, opt)
        runs.append((params, opt))
    return runs


OPTIMIZERS = {
    "AdamW": functools.partial(torch.optim.AdamW, lr=1e-2, weight_decay=0.1, foreach=False),
    "AdamW foreach": functools.partial(torch.optim.AdamW, lr=1e-2, weight_decay=0.1, foreach=True),
    "Adam amsgrad": functools.partial(torch.optim.Adam, lr=1e-2, amsgrad=True, foreach=False),
    "SGD momentum": functools.partial(torch.optim.SGD, lr=1e-2, momentum=0.9, nesterov=True, foreach=False),
    "RMSprop": functools.partial(torch.optim.RMSprop, lr=1e-2, momentum=0.5, foreach=False),
    "Adagrad": functools.partial(torch.optim.Adagrad, lr=1e-2, foreach=False),
}


SHARDED = [[Shard(0)], [Shard(0)], [Replicate()]]  # 5 rows over 2 ranks (uneven), 4 elements (even); a 0-dim one


@pytest.mark.parametrize("layout", ["replicated", "sharded"])
@pytest.mark.parametrize("name", OPTIMIZERS)
def test_steps_are_bitwise_the_dtensor_steps(local_world, swaps, name, layout):
    make = OPTIMIZERS[name]
    with local_world(2):
        mesh = init_device_mesh("cpu", (2,))
        runs = _swap_on_and_off(mesh, make, SHARDED if layout == "sharded" else None,
                                train=lambda params, opt: _train(params, opt, mesh))
        _same_run(*runs)
        took = [s for o, s in swaps if o is runs[0][1]]
        # Adagrad makes its state when constructed: every step swaps; the others from the second step on
        assert took == ([True] * STEPS if name == "Adagrad" else [False] + [True] * (STEPS - 1)), took
        assert not any(s for o, s in swaps if o is runs[1][1])
        sd = runs[0][1].state_dict()  # keyed by index, DTensors as torch keeps them
        assert isinstance(sd["state"][0][next(k for k in sd["state"][0] if k != "step")], DTensor)


def test_the_swap_is_what_the_optimizer_sees(local_world, swaps):
    """Inside a swapped step (the optimizer's own hooks) the groups hold plain local tensors with their
    gradients; after it, the DTensors again, with their gradients untouched."""
    with local_world(2):
        mesh = init_device_mesh("cpu", (2,))
        params = _params(mesh)
        opt = torch.optim.AdamW(params, lr=1e-2, foreach=False)
        seen = []
        opt.register_step_post_hook(lambda o, a, k: seen.append(
            [(type(p), p.grad is not None and type(p.grad)) for p in o.param_groups[0]["params"]]))
        _train(params, opt, mesh, steps=2)
        assert all(t is DTensor and g is DTensor for t, g in seen[0])
        assert all(t is not DTensor and g is not False and g is not DTensor for t, g in seen[1])
        assert all(isinstance(p, DTensor) and isinstance(p.grad, DTensor) for p in opt.param_groups[0]["params"])
        assert all(p._local_tensor.grad is None for p in params)


class _MyAdamW(torch.optim.AdamW):
    """Not torch's AdamW: a subclass may do anything in its step (a norm across elements, say)."""


@pytest.mark.parametrize("case", ["sharded, not torch's", "partial gradient", "unmarked", "closure"])
def test_not_swapped_where_it_would_not_be_exact(local_world, swaps, case):
    with local_world(2):
        mesh = init_device_mesh("cpu", (2,))
        make = _MyAdamW if case.startswith("sharded") else torch.optim.AdamW
        runs = _swap_on_and_off(
            mesh, lambda params: make(params, lr=1e-2, foreach=False), SHARDED if case.startswith("sharded") else None,
            mark=case != "unmarked", train=lambda params, opt: _train(
                params, opt, mesh, closure=(lambda: None) if case == "closure" else None,
                grad_placements=[[Partial()]] * 3 if case == "partial gradient" else None))
        _same_run(*runs)
        assert [s for o, s in swaps if o is runs[0][1]] == [False] * STEPS


def test_not_swapped_when_differentiable(local_world):
    """(torch's `differentiable=True` step cannot run on leaf parameters: only the refusal is checked.)"""
    with local_world(2):
        mesh = init_device_mesh("cpu", (2,))
        params = _params(mesh)
        opt = torch.optim.AdamW(params, lr=1e-2, foreach=False)
        _train(params, opt, mesh, steps=1)
        assert local_step._eligible(opt, (opt,), {})
        opt.param_groups[0]["differentiable"] = True
        assert not local_step._eligible(opt, (opt,), {})


class _Raises(torch.optim.AdamW):
    """AdamW whose step raises after its update, once."""

    fail = False

    def step(self, closure=None):
        out = super().step(closure)
        if self.fail:
            self.fail = False
            raise RuntimeError("boom")
        return out


class _Halves(torch.optim.Optimizer):
    """Keeps a state tensor it replaces out of place every step (not in place as torch's optimizers do)."""

    def __init__(self, params):
        super().__init__(params, {})

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            for p in group["params"]:
                st = self.state[p]
                st["buf"] = st["buf"] * 0.5 + p.grad if "buf" in st else p.grad.clone()
                p.sub_(st["buf"], alpha=0.1)


def test_a_step_that_raises_is_put_back(local_world, swaps):
    with local_world(2):
        mesh = init_device_mesh("cpu", (2,))

        def train(params, opt):
            _train(params, opt, mesh, steps=1)
            opt.fail = True
            with pytest.raises(RuntimeError, match="boom"):
                _train(params, opt, mesh, steps=1, grads_seed=3)
            sd = opt.state_dict()  # put back first
            assert all(p is q for p, q in zip(opt.param_groups[0]["params"], params))
            assert {id(p) for p in opt.state} == {id(p) for p in params}
            assert all(isinstance(v["exp_avg"], DTensor) for v in sd["state"].values())
            _train(params, opt, mesh, steps=1, grads_seed=4)

        runs = _swap_on_and_off(mesh, lambda params: _Raises(params, lr=1e-2, foreach=False), train=train)
        _same_run(*runs)
        # the first step unswapped, the later ones swapped (a subclass calling super().step() runs the hooks twice
        # per step where torch has hooked AdamW.step too)
        took = [s for o, s in swaps if o is runs[0][1]]
        assert took[0] is False and took[-1] is True and took == sorted(took), took


def test_state_replaced_out_of_place_comes_back_a_dtensor(local_world, swaps):
    with local_world(2):
        mesh = init_device_mesh("cpu", (2,))
        runs = _swap_on_and_off(mesh, _Halves, train=lambda params, opt: _train(params, opt, mesh))
        _same_run(*runs)
        assert [s for o, s in swaps if o is runs[0][1]] == [False] + [True] * (STEPS - 1)


def _gpt():
    return GPT(GPTConfig(vocab_size=64, seq_len=8, num_layers=2, num_heads=2, hidden=16, dropout=0.0))


def _tokens():
    tokens = torch.randint(0, 64, (4, 8))
    return tokens, torch.roll(tokens, -1, dims=1)


# eps 1e-3: the key projection's bias has no gradient in exact arithmetic (softmax ignores a shift of every score
# by the same amount), so its gradient is rounding noise, ~1e-17, which AdamW with eps 1e-8 scales up to steps of
# ~1e-11 whose sign is the noise's, on the single device and on the ranks alike (with the swap on or off)
ADAMW = functools.partial(torch.optim.AdamW, weight_decay=0.1, eps=1e-3, foreach=False)


def _check(res) -> None:
    assert res.grad_err and res.param_err
    assert abs(res.loss - res.ref_loss) < 1e-12, (res.loss, res.ref_loss)
    assert max(res.grad_err.values()) < 1e-12, res.grad_err
    assert max(res.param_err.values()) < 1e-12, res.param_err


@pytest.mark.parametrize("plan,axis", [("dp", "dp"), ("fsdp", "dp"), ("megatron", "tp")])
def test_adamw_matches_the_single_device_model(local_world, fp64, swaps, plan, axis):
    """Loss, every gradient at the last step, every parameter after it, with the later steps run locally
    (replicated parameters under dp, shards under fsdp, both under megatron)."""
    torch.manual_seed(0)
    ref, inputs = _gpt(), _tokens()
    with local_world(2):
        res = run_equivalence(ref, inputs, (2,), (axis,), plan=plan, steps=STEPS, lr=1e-2, optimizer=ADAMW)
    _check(res)
    mine = [s for o, s in swaps if any(isinstance(p, DTensor) for p in o.param_groups[0]["params"]) or s]
    assert mine == [False] + [True] * (STEPS - 1), mine


def _on_and_off(*args):
    """gloo worker: the equivalence run with the swap on (and how many steps swapped), then off."""
    taken, original = [], local_step._eligible
    local_step._eligible = lambda opt, *a: taken.append(original(opt, *a)) or taken[-1]
    try:
        on = gloo_equivalence(*args)
    finally:
        local_step._eligible = original
    with local_step.enabled(False):
        off = gloo_equivalence(*args)
    return on, off, sum(taken)


def test_dp_adamw_on_gloo_ranks():
    for on, off, swapped in gloo_pool(2).run(_on_and_off, _gpt, _tokens, (2,), ("dp",), "dp", None, STEPS, ADAMW):
        assert swapped == STEPS - 1
        _check(on)
        assert (on.loss, on.grad_err, on.param_err) == (off.loss, off.grad_err, off.param_err)


def _resume_from_checkpoint(path: str):
    """gloo worker: AdamW on the dp plan, two steps (the second swapped), the model and optimizer saved with DCP
    (`get_state_dict`), loaded into a fresh ParallelModule and optimizer (`set_state_dict`); then both take the
    same steps. Returns the largest difference of their parameters, the resumed optimizer's state types, and
    whether its later steps were swapped."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
    import autopar
    torch.manual_seed(0)
    ref, inputs = _gpt(), _tokens()
    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("dp",))

    def make():
        pm = autopar.parallelize(ref, mesh, inputs, plan="dp")
        return pm, ADAMW(pm.parameters(), lr=1e-2)

    def step(pm, opt):
        pm(*inputs).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    a, opt_a = make()
    for _ in range(2):
        step(a, opt_a)
    model_sd, optim_sd = get_state_dict(a, opt_a)
    dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=path)
    b, opt_b = make()
    step(b, opt_b)  # different values and state, overwritten by the load
    model_sd, optim_sd = get_state_dict(b, opt_b)
    state = {"model": model_sd, "optim": optim_sd}
    dcp.load(state, checkpoint_id=path)
    set_state_dict(b, opt_b, model_state_dict=state["model"], optim_state_dict=state["optim"])
    taken, original = [], local_step._eligible
    local_step._eligible = lambda opt, *args: taken.append(original(opt, *args)) or taken[-1]
    try:
        for _ in range(2):
            step(a, opt_a)
            step(b, opt_b)
    finally:
        local_step._eligible = original
    diff = max(float((p.full_tensor() - q.full_tensor()).abs().max()) for p, q in zip(a.parameters(), b.parameters()))
    kinds = {type(v).__name__ for st in opt_b.state.values() for k, v in st.items() if k != "step"}
    return diff, kinds, taken


def test_a_checkpoint_of_swapped_steps_resumes_exactly(tmp_path):
    """DCP sees the optimizer state of swapped steps as DTensors (as torch keeps it), and a run resumed from it
    continues bit for bit as the uninterrupted one, its steps swapped again."""
    for diff, kinds, taken in gloo_pool(2).run(_resume_from_checkpoint, str(tmp_path / "ckpt")):
        assert diff == 0.0, diff
        assert kinds == {"DTensor"}, kinds
        assert taken == [True] * 4, taken
