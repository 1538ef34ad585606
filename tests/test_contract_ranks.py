"""Ranks that disagree, or fail alone, raise the same error on every rank within the process-group timeout; and
inputs="global" | "local" (issue #10, items 3 and 4).

Every case runs on real gloo processes (the suite's shared `dist_harness.gloo_pool`, whose process group times out
collectives after 60 s): each rank returns what it raised and how long `parallelize` took, and the test asserts that
every rank raised the same error, with the same message, within 20 s (a rank left waiting for a peer that failed
alone would wait out the 60 s timeout). Before these checks
a rank that failed alone (planning happens on rank 0 only) left the others waiting in a collective until the
timeout, and ranks with different shapes computed wrong losses.
"""

from __future__ import annotations

import copy
import re
import time

import pytest
import torch
import torch.distributed as dist
from torch import nn

from dist_harness import gloo_pool

WITHIN_S = 20  # every rank answers within this; a hang waits out the pool's collective timeout (60 s) instead


def _pool(world: int):
    """The suite's shared pool of `world` ranks (a pool of its own would cost seconds to start)."""
    return gloo_pool(world)


def _pg_timeout_s() -> float:
    group = dist.distributed_c10d._get_default_group()
    return group._get_backend(torch.device("cpu")).options._timeout.total_seconds()


def _with_timeout(fn, *args):
    """Run `fn(*args)`; return (error type or "ok", message, seconds, the process group's timeout)."""
    start = time.monotonic()
    try:
        fn(*args)
        return ("ok", "", time.monotonic() - start, _pg_timeout_s())
    except Exception as e:  # noqa: BLE001 - compared across ranks by the test
        return (type(e).__name__, str(e), time.monotonic() - start, _pg_timeout_s())


_WARM = []


def _warm_up():
    """Imports and torch.export's first trace, once per worker: the clock measures parallelize, not start-up."""
    if not _WARM:
        import autopar
        from autopar.models import MLP
        autopar.plan(MLP(), {"dp": 2}, (torch.randn(4, 16), torch.randn(4, 16)), plan="dp")
        _WARM.append(True)


def _mesh(shape=(2,), names=("dp",)):
    from torch.distributed.device_mesh import init_device_mesh
    return init_device_mesh("cpu", shape, mesh_dim_names=names)


def _gpt(hidden=32, layers=2, batch=4, seed=0):
    from autopar.models import GPT, GPTConfig
    torch.manual_seed(0)
    model = GPT(GPTConfig(hidden=hidden, num_layers=layers))
    g = torch.Generator().manual_seed(seed)
    return model, (torch.randint(0, 128, (batch, 16), generator=g), torch.randint(0, 128, (batch, 16), generator=g))


# ----------------------------------------------------------------------------- the cases (run on every rank)
# Each builds its model, inputs and mesh, and returns the parallelize call that `run_case` times.

def shapes_differ():
    model, inputs = _gpt(batch=4 if dist.get_rank() == 0 else 2)
    import autopar
    return lambda: autopar.parallelize(model, _mesh(), inputs, plan="dp")


def models_differ():
    model, inputs = _gpt(hidden=32 if dist.get_rank() == 0 else 64)
    import autopar
    return lambda: autopar.parallelize(model, _mesh(), inputs, plan="dp")


def layers_differ():
    model, inputs = _gpt(layers=2 if dist.get_rank() == 0 else 3)
    import autopar
    return lambda: autopar.parallelize(model, _mesh(), inputs, plan="dp")


def options_differ():
    model, inputs = _gpt()
    import autopar
    return lambda: autopar.parallelize(model, _mesh(), inputs, plan="dp" if dist.get_rank() == 0 else "fsdp")


def ring_on_padded_hf_llama():
    import zoo
    from test_ring_hf import PaddedLossWrap
    import autopar
    model, inputs, _ = zoo.FAMILIES["llama"]()
    batch = {**inputs, "attention_mask": (inputs["labels"] != -100).long()}
    return lambda: autopar.parallelize(PaddedLossWrap(model.m), _mesh((2,), ("cp",)), batch, plan="dp",
                        overrides={"attention": "ring"})


def expert_on_unrecognised_moe():
    model, inputs = _gpt()
    import autopar
    return lambda: autopar.parallelize(model, _mesh(), inputs, plan="dp", overrides={"moe": "expert"})


def memory_limit_too_small():
    model, inputs = _gpt()
    import autopar
    return lambda: autopar.parallelize(model, _mesh(), inputs, memory_limit=1024)


class RankOneUntraceable(nn.Module):
    """Traceable on rank 0; on rank 1 forward branches on a tensor value (a capture error on that rank only)."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x):
        if dist.get_rank() == 1 and x.sum() > 0:
            return self.fc(x).sum() * 2
        return self.fc(x).sum()


def capture_fails_on_rank1():
    import autopar
    torch.manual_seed(0)
    return lambda: autopar.parallelize(RankOneUntraceable(), _mesh(), (torch.randn(8, 4),), plan="dp")


def global_batches_differ():
    model, inputs = _gpt(seed=dist.get_rank())  # the DDP habit: each rank its own batch, inputs left "global"
    import autopar
    return lambda: autopar.parallelize(model, _mesh(), inputs, plan="dp")


def tp_ranks_pass_different_data():
    """dp x tp megatron, inputs="local": ranks 0 and 1 (dp 0, tp 0 and 1) pass different batches."""
    model, inputs = _gpt(seed=dist.get_rank())
    import autopar
    return lambda: autopar.parallelize(model, _mesh((2, 2), ("dp", "tp")), inputs, plan="megatron", inputs="local")


def bad_id_in_rank1s_rows():
    """inputs="global", dp: the bad id is in the rows rank 1 computes; every rank checks the whole batch."""
    model, (ids, labels) = _gpt()
    import autopar
    pm = autopar.parallelize(model, _mesh(), (ids, labels), plan="dp")
    bad = ids.clone()
    bad[3, 0] = 128
    return lambda: pm(bad, labels)


def bad_label_in_rank1s_local_batch():
    """inputs="local", dp: only rank 1's own batch holds the bad label; the verdict rides on the per-call check."""
    model, (ids, labels) = _gpt(seed=dist.get_rank())
    import autopar
    pm = autopar.parallelize(model, _mesh(), (ids, labels), plan="dp", inputs="local")
    bad = labels.clone()
    if dist.get_rank() == 1:
        bad[1, 2] = 200
    return lambda: pm(ids, bad)


def local_batch_shorter_on_rank1():
    """inputs="local": a call at which rank 1 passes a shorter batch (a DistributedSampler's last one). Rank 0 runs its
    lowered program, the call's agreement in flight until the program's first collective; rank 1 lowers a new one."""
    model, (ids, labels) = _gpt(seed=dist.get_rank())
    import autopar
    pm = autopar.parallelize(model, _mesh(), (ids, labels), plan="dp", inputs="local")
    pm(ids, labels).backward()
    n = 4 if dist.get_rank() == 0 else 2
    return lambda: pm(ids[:n], labels[:n])


def _parallel_then_own_batches(plan="megatron", names=("tp",), permute=False):
    """The DDP habit with inputs left "global": parallelize on one fixed example, then each rank calls with its own
    batch (a DistributedSampler's); `permute`: rank 1's batch is rank 0's rows swapped (equal sums)."""
    model, inputs = _gpt()
    import autopar
    pm = autopar.parallelize(model, _mesh((2,), names), inputs, plan=plan)
    pm(*inputs).backward()  # a call on equal batches passes
    ids, labels = _gpt(seed=dist.get_rank() + 1)[1]
    if permute:
        ids, labels = inputs[0].clone(), inputs[1].clone()
        if dist.get_rank() == 1:
            ids, labels = ids[[1, 0, 2, 3]], labels[[1, 0, 2, 3]]
    return pm, ids, labels


def global_call_batches_differ_under_tp():
    pm, ids, labels = _parallel_then_own_batches()
    return lambda: pm(ids, labels)


def global_call_batches_differ_under_dp():
    pm, ids, labels = _parallel_then_own_batches("dp", ("dp",))
    return lambda: pm(ids, labels).backward()


def global_call_rows_permuted():
    pm, ids, labels = _parallel_then_own_batches("dp", ("dp",), permute=True)
    return lambda: pm(ids, labels)


def global_call_shapes_differ():
    pm, ids, labels = _parallel_then_own_batches("dp", ("dp",))
    n = 4 if dist.get_rank() == 0 else 2
    return lambda: pm(ids[:n], labels[:n])


def global_call_check_off():
    """pm.check_inputs = False: the ranks are trusted to agree; no check, no error (here they do not, and the loss is
    the mixture: the switch is the user's promise)."""
    pm, ids, labels = _parallel_then_own_batches()
    pm.check_inputs = False
    return lambda: pm(ids, labels)


def run_case(name):
    """Build the case's model and inputs, then time its parallelize call."""
    _warm_up()
    return _with_timeout(globals()[name]())


_PER_CALL = (r"^with inputs='global' \(the default\) every rank passes the same whole batch at every call.*different "
             r"values of input 'tokens': ranks \[0\] passed one value; ranks \[1\] passed another\..*Fix: if each "
             r"rank loads its own batch \(e.g. with a DistributedSampler, as for DDP\), pass inputs='local'.*"
             r"pm.check_inputs = False")

CASES = {
    # name: (world, error type, message pattern)
    "shapes_differ": (2, "RankMismatchError",
                      r"example input shapes: ranks \[0\] have 'input \[0\]\[0\]: \(4, 16\) torch.int64', ranks \[1\] "
                      r"have 'input \[0\]\[0\]: \(2, 16\) torch.int64'"),
    "models_differ": (2, "RankMismatchError",
                      r"(?s)parameters: ranks \[0\] have 'wte.weight: \(128, 32\) torch.float32', ranks \[1\] have "
                      r"'wte.weight: \(128, 64\) torch.float32'.*captured graph: ranks \[0\] have "
                      r"'placeholder p_wte_weight p_wte_weight \(128, 32\) torch.float32', ranks \[1\] have "
                      r"'placeholder p_wte_weight p_wte_weight \(128, 64\) torch.float32'"),
    "layers_differ": (2, "RankMismatchError",
                      r"parameters: ranks \[0\] have 'ln_f.weight: \(32,\) torch.float32', ranks \[1\] have "
                      r"'h.2.ln1.weight: \(32,\) torch.float32'"),
    "options_differ": (2, "RankMismatchError", r"plan arguments: ranks \[0\] have 'plan=\"dp\"', ranks \[1\] have "
                                               r"'plan=\"fsdp\"'"),
    "ring_on_padded_hf_llama": (2, "ValueError", r"form 'ring' on mesh axis 'cp' \(size 2\) is not possible: its mask "
                                                 r"depends on input attention_mask"),
    "expert_on_unrecognised_moe": (2, "ValueError", r"override 'moe' matches no recognised structure"),
    "memory_limit_too_small": (2, "InfeasibleError", r"(?s)no plan fits 1\.00 KiB.*Fix: raise memory_limit"),
    "capture_fails_on_rank1": (2, "CaptureError", r"could not capture RankOneUntraceable"),
    "global_batches_differ": (2, "RankMismatchError",
                              r"(?s)inputs='global'.*example input values: ranks \[0\] have 'input \[0\]\[0\]: "
                              r"\(4, 16\) torch.int64 sha \w+', ranks \[1\] have .*Fix: if each rank loads its own "
                              r"batch \(e.g. with a DistributedSampler, as for DDP\), pass inputs='local'"),
    "bad_id_in_rank1s_rows": (2, "IndexError", r"^index out of range in self$"),
    "bad_label_in_rank1s_local_batch": (2, "IndexError", r"rank 1's batch has a token id or label out of range"),
    "global_call_batches_differ_under_tp": (2, "RankMismatchError", _PER_CALL),
    "global_call_batches_differ_under_dp": (2, "RankMismatchError", _PER_CALL),
    "global_call_rows_permuted": (2, "RankMismatchError", _PER_CALL),
    "global_call_check_off": (2, "ok", r"^$"),
    "tp_ranks_pass_different_data": (4, "RankMismatchError",
                                     r"(?s)inputs='local'.*differ only on the tensor/sequence/expert axes.*ranks \[0\] "
                                     r"have .*ranks \[1\] have .*ranks \[2\] have .*ranks \[3\] have"),
}


@pytest.mark.parametrize("case", list(CASES))
def test_every_rank_raises_the_same_error_within_the_timeout(case):
    world, kind, pattern = CASES[case]
    results = _pool(world).call(run_case, (case,), timeout=120)
    kinds, messages, seconds, timeouts = zip(*results)
    assert set(timeouts) == {_pool(world).pg_timeout_s}, timeouts
    assert set(kinds) == {kind}, results
    assert len(set(messages)) == 1, f"ranks raised different messages: {messages}"
    assert re.search(pattern, messages[0]), messages[0]
    assert timeouts[0] > WITHIN_S, timeouts  # a rank that waited for a failed peer would not answer within WITHIN_S
    assert max(seconds) < WITHIN_S, f"ranks took {seconds} s (process-group timeout {timeouts[0]} s)"


@pytest.mark.parametrize("case", ["local_batch_shorter_on_rank1", "global_call_shapes_differ"])
def test_ranks_passing_different_shapes_at_a_call_all_raise(case):
    """The per-call agreement is left in flight while the program runs up to its first collective: ranks passing
    different shapes still raise, every one, before any collective of the program starts (no hang, no wrong loss),
    under inputs="local" (a short last shard) and "global" alike."""
    results = _pool(2).call(run_case, (case,), timeout=120)
    kinds, messages, seconds, timeouts = zip(*results)
    assert set(kinds) == {"RankMismatchError"}, results
    assert all(re.search(r"the ranks differ at this call", m) for m in messages), messages
    assert "(4, 16)" in messages[0] and "(2, 16)" in messages[1], messages  # each rank names its own shapes
    assert max(seconds) < WITHIN_S < timeouts[0], (seconds, timeouts)


def test_a_pending_agreement_runs_once_before_the_next_collective():
    """`collectives._c10d`, through which the runtime issues every collective, runs a pending agreement first, once,
    even when it raises; `settle_pending` runs it if no collective did."""
    from autopar.runtime import collectives as C
    ran = []
    C.before_next_collective(lambda: ran.append("first"))
    assert ran == []
    C._c10d.all_reduce
    C._c10d.wait_tensor
    assert ran == ["first"]

    def mismatch():
        raise RuntimeError("ranks differ")

    C.before_next_collective(mismatch)
    with pytest.raises(RuntimeError, match="ranks differ"):
        C._c10d.all_gather_into_tensor
    assert C._c10d.all_gather_into_tensor.args == (torch.ops._c10d_functional.all_gather_into_tensor,)  # below autograd
    C.before_next_collective(lambda: ran.append("at the end"))
    C.settle_pending()
    C.settle_pending()
    assert ran == ["first", "at the end"]


def test_input_digests_tell_apart_permuted_and_equal_sum_batches():
    """The per-call digest (inputs="global"): equal tensors agree; rows swapped, values moved between positions with
    the same sum, one bit flipped, or another dtype's bits differ; token ids, floats, bool and bf16 alike."""
    from autopar.agree import input_digests
    ids = torch.randint(0, 128, (4, 16), generator=torch.Generator().manual_seed(0))
    x = torch.randn(4, 8, generator=torch.Generator().manual_seed(1))
    same = input_digests([ids.clone(), x.clone()])
    assert torch.equal(input_digests([ids, x]), same) and same.dtype == torch.int64 and same.shape == (4,)
    moved = ids.clone()
    moved[0, 0], moved[0, 1] = moved[0, 0] + 1, moved[0, 1] - 1  # the same sum
    flipped = x.clone()
    flipped.view(torch.int32)[0, 0] ^= 1
    for other in ([ids[[1, 0, 2, 3]], x], [moved, x]):  # equal plain sums: the weighted sum tells them apart
        got = input_digests(other)
        assert got[0] == same[0] and got[1] != same[1] and torch.equal(got[2:], same[2:]), (got, same)
    assert not torch.equal(input_digests([ids, flipped])[2:], same[2:])
    assert torch.equal(input_digests([ids, x.T.contiguous().T]), same)  # the same values in another layout
    mask = torch.rand(4, 16, generator=torch.Generator().manual_seed(2)) > 0.5
    assert not torch.equal(input_digests([mask]), input_digests([mask.flip(0)]))
    half = x.to(torch.bfloat16)
    assert torch.equal(input_digests([half]), input_digests([half.clone()]))


# ----------------------------------------------------------------------------- inputs="local": the numbers

def local_equivalence(shape, names, plan, steps=2, lr=0.1):
    """Each data-parallel rank passes its own rows of one global batch (inputs="local"); compare with one device on
    the whole batch: loss, every gradient, every parameter after each SGD step (fp64)."""
    import autopar
    from autopar.inputs import data_groups
    from passes.lower import collective_nodes

    torch.set_default_dtype(torch.float64)
    try:
        ref, (ids, labels) = _gpt(batch=8)
        model = copy.deepcopy(ref)
        mesh = _mesh(shape, names)
        dp = shape[0]
        (group,) = [i for i, g in enumerate(data_groups(mesh, ("dp",), names)) if dist.get_rank() in g]
        rows = slice(group * 8 // dp, (group + 1) * 8 // dp)
        local = (ids[rows], labels[rows])
        pm = autopar.parallelize(model, mesh, local, plan=plan, inputs="local")
        ref_opt, opt = torch.optim.SGD(ref.parameters(), lr=lr), torch.optim.SGD(pm.parameters(), lr=lr)
        errs = {"loss": [], "grad": [], "param": []}
        for _ in range(steps):
            ref_opt.zero_grad()
            opt.zero_grad()
            ref_loss = ref(ids, labels)
            ref_loss.backward()
            loss = pm(*local)
            loss.backward()
            errs["loss"].append(abs(float(loss) - float(ref_loss)))
            refs = dict(ref.named_parameters())
            errs["grad"].append({n: float((p.grad.full_tensor() - refs[n].grad).abs().max())
                                 for n, p in pm.named_parameters()})
            ref_opt.step()
            opt.step()
            errs["param"].append({n: float((p.full_tensor() - refs[n]).abs().max()) for n, p in pm.named_parameters()})
        sliced = sorted(u.target.__name__ for n in pm.graph_module.graph.find_nodes(op="placeholder")
                        if n.name in pm._current.captured.user_inputs for u in n.users)
        # a short last batch on rank 0 only: every rank raises at that call instead of lowering another program
        short = 1 if dist.get_rank() == 0 else 8 // dp
        bad_shape = _with_timeout(pm, ids[:short], labels[:short])
        twin = autopar.parallelize(copy.deepcopy(ref), mesh, (ids, labels), plan=plan)  # inputs="global"
        twin_sliced = sorted(u.target.__name__ for n in twin.graph_module.graph.find_nodes(op="placeholder")
                             if n.name in twin._current.captured.user_inputs for u in n.users)
        return errs, (sliced, twin_sliced), bad_shape, tuple(pm.plan.inputs), len(collective_nodes(pm.graph_module))
    finally:
        torch.set_default_dtype(torch.float32)


@pytest.mark.parametrize("world,shape,names,plan", [(2, (2,), ("dp",), "dp"),
                                                    (4, (2, 2), ("dp", "tp"), "megatron")])
def test_local_inputs_match_one_device_on_the_global_batch(world, shape, names, plan):
    results = _pool(world).run(local_equivalence, shape, names, plan)
    for rank, (errs, sliced, bad_shape, inputs, _) in enumerate(results):
        assert len(errs["loss"]) == 2 and max(errs["loss"]) < 1e-12, (rank, errs["loss"])
        for step in ("grad", "param"):
            for per_param in errs[step]:
                assert len(per_param) == 28 and max(per_param.values()) < 1e-12, (rank, step, per_param)
        # each rank's shard is used as given: no input is sliced in the graph; global inputs are, by `split`
        local_users, global_users = sliced
        assert "split" not in local_users and global_users.count("split") == 2, (rank, sliced)
        # the batch is split over dp only; the plan is made for the global batch
        assert [p for _, p in inputs] == (["S(0)"] * 2 if world == 2 else ["S(0)R"] * 2), inputs
        kind, message, *_ = bad_shape
        assert kind == "RankMismatchError" and re.search(
            r"with inputs='local' every rank must pass a shard of the same shapes.*Fix: drop_last=True", message), \
            message
    assert len({r[4] for r in results}) == 1


def test_inputs_mode_is_checked(local_world):
    import autopar
    from torch.distributed.device_mesh import init_device_mesh

    model, inputs = _gpt()
    with local_world(2):
        mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("dp",))
        with pytest.raises(ValueError, match=r"inputs must be 'global' .* or 'local' .*; got 'locale'"):
            autopar.parallelize(model, mesh, inputs, inputs="locale")


def test_simulated_ranks_with_different_global_inputs_raise(local_world):
    """Under LocalTensorMode the simulated ranks' example values are compared the same way."""
    import autopar
    from torch.distributed._local_tensor import LocalTensor
    from torch.distributed.device_mesh import init_device_mesh

    model, (ids, labels) = _gpt()
    with local_world(2):
        mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("dp",))
        per_rank = LocalTensor({0: ids, 1: ids.flip(0)})
        with pytest.raises(autopar.RankMismatchError, match=r"(?s)inputs='global'.*ranks \[0\] have 'input "
                                                                  r"\[0\]\[0\]: \(4, 16\) torch.int64 sha"):
            autopar.parallelize(model, mesh, (per_rank, labels), plan="dp")


def test_local_inputs_on_simulated_ranks(local_world, fp64):
    """inputs="local" under LocalTensorMode on dp x tp: each simulated rank passes its data-parallel rank's rows. The
    first capture guesses all 4 ranks split the batch; megatron splits it over dp only, so the model is captured
    again for the global batch of 2 x 4 rows. Loss, every gradient and every parameter after an SGD step match one
    device on the whole batch."""
    import autopar
    from torch.distributed._local_tensor import LocalTensor
    from torch.distributed.device_mesh import init_device_mesh

    ref, (ids, labels) = _gpt(batch=8)
    model = copy.deepcopy(ref)

    def own_rows(t):  # ranks 0, 1 hold dp shard 0; ranks 2, 3 dp shard 1
        return LocalTensor({r: t[(r // 2) * 4:(r // 2 + 1) * 4] for r in range(4)})

    with local_world(4):
        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
        local = (own_rows(ids), own_rows(labels))
        pm = autopar.parallelize(model, mesh, local, plan="megatron", inputs="local")
        assert pm._current.captured.example_shapes == [(8, 16), (8, 16)] and dict(pm.plan.inputs) == {
            "tokens": "S(0)R", "labels": "S(0)R"}
        opt = torch.optim.SGD(pm.parameters(), lr=0.1)
        loss = pm(*local)
        loss.backward()
        grads = {n: p.grad.full_tensor() for n, p in pm.named_parameters()}
        opt.step()
        params = {n: p.full_tensor() for n, p in pm.named_parameters()}
    ref_loss = ref(ids, labels)
    ref_loss.backward()
    refs = dict(ref.named_parameters())
    worst = lambda t: max(float(v.abs().max()) for v in t._local_tensors.values())  # noqa: E731
    assert worst(loss.detach() - ref_loss.detach()) < 1e-12
    assert set(grads) == set(refs) and max(worst(g - refs[n].grad) for n, g in grads.items()) < 1e-12
    torch.optim.SGD(ref.parameters(), lr=0.1).step()
    assert max(worst(p - refs[n].detach()) for n, p in params.items()) < 1e-12


def test_local_inputs_unbatched_input_must_agree(local_world):
    """An input without the batch dim is used whole by every rank: under inputs="local" it must still agree."""
    import autopar
    from torch.distributed._local_tensor import LocalTensor
    from torch.distributed.device_mesh import init_device_mesh

    class Scaled(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(4, 4)

        def forward(self, x, scale):
            return (self.fc(x) * scale).sum()

    torch.manual_seed(0)
    x = torch.randn(6, 4)  # the batch: 6 rows; scale (4,) has no batch dim
    with local_world(2):
        mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("dp",))
        scale = LocalTensor({0: torch.ones(4), 1: torch.full((4,), 2.0)})
        with pytest.raises(autopar.RankMismatchError, match=r"(?s)inputs without the batch dimension.*ranks \[0\] have "
                                                            r"'input \[0\]\[1\]: \(4,\) torch.float32 sha"):
            autopar.parallelize(Scaled(), mesh, (LocalTensor({0: x, 1: x + 1}), scale), plan="dp", inputs="local")
