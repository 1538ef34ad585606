"""Pipeline parallelism at run time (issue #23, `autopar.pipeline_runtime`) on real gloo processes, fp64.

Every case trains one step of the pipelined model next to the single-device model on every rank: the loss (the
global loss, on every rank), every parameter's gradient (each on the ranks of its stage; every parameter checked
on some rank) and every parameter after an AdamW step. The p2p sends of the schedule are counted (count and bytes
per microbatch and boundary) by wrapping `torch.distributed.pipelining.schedules._batch_p2p`, through which torch's
schedules issue every send and receive.
"""

from __future__ import annotations

import pytest
import torch

from dist_harness import gloo_pool
from pipeline_helpers import TOL, check, clipped_grads, llama, stage_grads, stepped_params


def _llama(layers: int):
    return llama(num_layers=layers)


class Twice(torch.nn.Module):
    """Blocks that use their weight twice, and a mean-squared-error loss."""

    def __init__(self, layers: int = 4, dim: int = 8):
        super().__init__()
        self.blocks = torch.nn.ModuleList(torch.nn.Linear(dim, dim) for _ in range(layers))

    def forward(self, x, y):
        for b in self.blocks:
            x = x + b(torch.tanh(b(x)))
        return torch.nn.functional.mse_loss(x, y)


class Skip(torch.nn.Module):
    """Every block also reads the input projection x0 (a value that depends on parameters): under 4 stages x0
    crosses every boundary, passed through stages 1 and 2 to stage 3."""

    def __init__(self, layers: int = 4, dim: int = 8):
        super().__init__()
        self.inp = torch.nn.Linear(dim, dim)
        self.blocks = torch.nn.ModuleList(torch.nn.Linear(dim, dim) for _ in range(layers))

    def forward(self, x, y):
        x0 = torch.tanh(self.inp(x))
        x = x0
        for i, b in enumerate(self.blocks):
            x = torch.tanh(b(x)) + (x0 if i in (0, len(self.blocks) - 1) else 0)
        return torch.nn.functional.mse_loss(x, y)


class Smoothed(torch.nn.Module):
    """Token classification with a weighted, label-smoothed cross-entropy (class weights from a buffer)."""

    def __init__(self, weighted: bool = True, smoothing: float = 0.1, layers: int = 4, dim: int = 16,
                 classes: int = 128):
        super().__init__()
        self.embed = torch.nn.Embedding(classes, dim)
        self.blocks = torch.nn.ModuleList(torch.nn.Linear(dim, dim) for _ in range(layers))
        self.head = torch.nn.Linear(dim, classes)
        self.smoothing = smoothing
        g = torch.Generator().manual_seed(2)
        self.register_buffer("class_weight", torch.rand(classes, generator=g) + 0.5 if weighted else None)

    def forward(self, tokens, labels):
        x = self.embed(tokens)
        for b in self.blocks:
            x = x + torch.tanh(b(x))
        logits = self.head(x)
        return torch.nn.functional.cross_entropy(logits.flatten(0, 1), labels.flatten(), weight=self.class_weight,
                                                 label_smoothing=self.smoothing)


def _gpt():
    from autopar.models import GPT, GPTConfig
    return GPT(GPTConfig(num_layers=2))


def _model(name):
    if isinstance(name, int):
        return _llama(name)
    return {"twice": Twice, "skip": Skip, "gpt": _gpt, "weighted smoothed": Smoothed,
            "smoothed": lambda: Smoothed(weighted=False), "weighted": lambda: Smoothed(smoothing=0.0)}[name]()


def _batch(batch: int = 8, ignored: bool = True):
    g = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, 128, (batch, 16), generator=g)
    labels = torch.randint(0, 128, (batch, 16), generator=g)
    if ignored:  # ignored labels spread unevenly over the microbatches (and data-parallel ranks)
        labels[0, :11] = -100
        labels[1, 3:] = -100
        labels[batch - 1, :2] = -100
    return tokens, labels


class _P2P:
    """Records (op, numel, bytes) of every p2p op the schedules issue."""

    def __enter__(self):
        import torch.distributed.pipelining.schedules as S
        self.ops, self._orig = [], S._batch_p2p

        def wrapped(ops, desc=None):
            for op in ops:
                self.ops.append((op.op.__name__, op.tensor.numel(), op.tensor.numel() * op.tensor.element_size()))
            return self._orig(ops, desc)
        S._batch_p2p = wrapped
        return self

    def __exit__(self, *exc):
        import torch.distributed.pipelining.schedules as S
        S._batch_p2p = self._orig


class _AllReduces:
    """Records (numel, group size) of every all-reduce."""

    def __enter__(self):
        import torch.distributed as dist
        self.calls, self._orig = [], dist.all_reduce

        def wrapped(t, *a, group=None, **k):
            self.calls.append((t.numel(), dist.get_world_size(group)))
            return self._orig(t, *a, group=group, **k)
        dist.all_reduce = wrapped
        return self

    def __exit__(self, *exc):
        import torch.distributed as dist
        dist.all_reduce = self._orig


class _FSDPComms:
    """Records (kind, numel of the full buffer, group size) of FSDP2's all-gathers and reduce-scatters (torch 2.13
    issues them as `dist.all_gather_single` / `dist.reduce_scatter_single`, `_fsdp_collectives`)."""

    def __enter__(self):
        import torch.distributed as dist
        self.calls = []
        self._orig = {k: getattr(dist, k) for k in ("all_gather_single", "reduce_scatter_single")}

        def wrap(kind, orig):
            def wrapped(output, input, *a, group=None, **k):
                full = output if kind == "all_gather_single" else input
                self.calls.append((kind, full.numel(), dist.get_world_size(group)))
                return orig(output, input, *a, group=group, **k)
            return wrapped
        for k, f in self._orig.items():
            setattr(dist, k, wrap(k, f))
        return self

    def __exit__(self, *exc):
        import torch.distributed as dist
        for k, f in self._orig.items():
            setattr(dist, k, f)


def _equivalence(form: str, layers: int, mesh_shape, names, microbatches: int, batch: int = 8, scale: float = 1.0,
                 stages_per_rank=None, clip: float | None = None, plan: str = "dp", param_dtype: str | None = None):
    """On each rank: loss, gradient and AdamW-step errors against one device, the p2p ops of the step and the
    parameters this rank checked."""
    import copy
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    import autopar

    torch.manual_seed(0)
    torch.set_default_dtype(torch.float64)
    try:
        ref = _model(layers)
        model = copy.deepcopy(ref)
        tokens, labels = _batch(batch) if layers not in ("twice", "skip") else \
            (torch.randn(batch, 8), torch.randn(batch, 8))
        mesh = init_device_mesh("cpu", mesh_shape, mesh_dim_names=names)
        mp = None
        if param_dtype is not None:  # FSDP2's policy: compute and gathers in param_dtype, reductions too
            from torch.distributed.fsdp import MixedPrecisionPolicy
            mp = MixedPrecisionPolicy(param_dtype=getattr(torch, param_dtype), reduce_dtype=getattr(torch, param_dtype))
        pm = autopar.parallelize(model, mesh, (tokens, labels), plan=plan,
                                 overrides={"pipeline": f"{form}@pp"}, microbatches=microbatches,
                                 stages_per_rank=stages_per_rank, mp_policy=mp)
        assert [n for n, _ in pm.named_parameters()] == [n for n, _ in ref.named_parameters()]
        ref_loss = ref(tokens, labels)
        ref_loss.backward()
        for q in ref.parameters():  # the contract: (c * loss).backward() gives c times the gradient (the model's
            q.grad.mul_(scale)      # attention softmax runs in fp32: backpropagating c * loss there differs at 1e-9)
        with _P2P() as rec, _AllReduces() as reduces, _FSDPComms() as fsdp:
            loss = pm(tokens, labels)
        (scale * loss).backward()
        errs = {"loss": abs(float(loss) - float(ref_loss))}
        with torch.no_grad(), _FSDPComms() as fsdp_no_grad:  # forward only, on this schedule too
            errs["no_grad loss"] = abs(float(pm(tokens, labels)) - float(ref_loss))
        refs = dict(ref.named_parameters())
        mine = stage_grads(pm, refs, errs, "grad")
        if clip is not None:  # the total norm, and each gradient after clipping
            clipped_grads(pm, ref, refs, mine, errs, clip)
        torch.optim.AdamW(ref.parameters(), lr=0.01).step()
        torch.optim.AdamW(pm.parameters(), lr=0.01).step()
        stepped_params(pm, refs, mine, errs, "param")
        steady = {}
        if plan != "dp":  # a second step from the stepped shards: the gathered weights must be the new ones
            ref.zero_grad()
            ref(tokens, labels).backward()
            pm.zero_grad()
            with _FSDPComms() as fsdp2:
                loss2 = pm(tokens, labels)
            loss2.backward()
            # a step after a step (the one before followed a forward-only call)
            pm.zero_grad()
            with _P2P() as rec3, _AllReduces() as reduces3, _FSDPComms() as fsdp3:
                loss3 = pm(tokens, labels)
            loss3.backward()
            steady = {"p2p": rec3.ops, "reduces": reduces3.calls, "fsdp": fsdp3.calls, "fsdp after eval": fsdp2.calls}
            for n, p in pm.named_parameters():
                if n in mine:
                    errs[f"step 2 grad {n}"] = float((p.grad.full_tensor() - refs[n].grad).abs().max())
        return {"errs": errs, "p2p": rec.ops, "reduces": reduces.calls, "mine": mine, "cut": pm.plan.pipeline.cut,
                "fsdp": fsdp.calls, "fsdp_no_grad": fsdp_no_grad.calls, "steady": steady,
                "grad_dtypes": sorted({str(p.grad.dtype) for n, p in pm.named_parameters() if n in mine}),
                "stages": pm.local_stages,
                "rank": dist.get_rank(), "all": sorted(refs)}
    finally:
        torch.set_default_dtype(torch.float32)


H, S = 32, 16  # hidden, sequence


@pytest.mark.parametrize("form", ["gpipe", "1f1b"])
def test_pp2_matches_one_device_and_sends_one_activation_per_microbatch(form):
    m, batch = 4, 8
    results = gloo_pool(2).run(_equivalence, form, 4, (2,), ("pp",), m, batch)
    check(results)
    assert results[0]["cut"] == (0, 2, 4)
    mb_bytes = batch // m * S * H * 8
    # stage 0 sends each microbatch's hidden state and receives its gradient; the rotary tables are recomputed
    assert sorted(results[0]["p2p"]) == sorted([("isend", mb_bytes // 8, mb_bytes)] * m
                                               + [("irecv", mb_bytes // 8, mb_bytes)] * m)
    assert sorted(results[1]["p2p"]) == sorted([("irecv", mb_bytes // 8, mb_bytes)] * m
                                               + [("isend", mb_bytes // 8, mb_bytes)] * m)


@pytest.mark.parametrize("model", ["weighted smoothed", "smoothed", "weighted"])
def test_cross_entropy_with_class_weights_and_label_smoothing_combines_exactly(model):
    # ignored labels and weights spread unevenly over the 4 microbatches: each microbatch's sum is weighed by the
    # batch's (weighted) valid count, which a mean per microbatch would get wrong
    results = gloo_pool(2).run(_equivalence, "gpipe", model, (2,), ("pp",), 4, 8)
    check(results)


def test_five_layers_on_two_stages_and_a_scaled_loss():
    m, batch = 2, 4
    results = gloo_pool(2).run(_equivalence, "1f1b", 5, (2,), ("pp",), m, batch, 3.0)
    check(results)
    assert results[0]["cut"] == (0, 3, 5)  # the head's FLOPs weigh on the last stage
    assert results[0]["stages"] == [0] and results[1]["stages"] == [1]
    # the ranks' agreement on the call (digests of the batch), then the global loss: one scalar over the pipeline
    assert results[0]["reduces"] == results[1]["reduces"] == [(_agreement(batch), 2), (1, 2)]


@pytest.mark.parametrize("model", [4, "gpt"])
def test_pp2_x_dp2_matches_one_device(model):
    m, batch = 2, 8
    results = gloo_pool(4).run(_equivalence, "1f1b", model, (2, 2), ("pp", "dp"), m, batch, clip=0.05)
    check(results)
    numel = {r["rank"]: sum(_numel(model, n) for n in r["mine"]) for r in results}
    mb_bytes = batch // (2 * m) * S * H * 8
    for r in results:
        # the agreement, the loss over pp and dp, then the stage's gradients in one bucket over dp (and GPT's
        # tied embedding and head summed over pp)
        tied = [(128 * H, 2)] if model == "gpt" else []
        assert r["reduces"] == [(_agreement(batch), 4), (1, 2), (1, 2), (numel[r["rank"]], 2)] + tied, r["reduces"]
        assert sorted(r["p2p"]) == sorted([("irecv", mb_bytes // 8, mb_bytes)] * m
                                          + [("isend", mb_bytes // 8, mb_bytes)] * m)


@pytest.mark.parametrize("form", ["gpipe", "1f1b"])
def test_pp4_matches_one_device(form):
    m, batch = 4, 8
    results = gloo_pool(4).run(_equivalence, form, 4, (4,), ("pp",), m, batch)
    check(results)
    assert results[0]["cut"] == (0, 1, 2, 3, 4) and [r["stages"] for r in results] == [[0], [1], [2], [3]]
    mb = batch // m * S * H
    for r in results:  # an end stage talks to one neighbour, a middle one to two
        peers = 1 if r["rank"] in (0, 3) else 2
        assert sorted(r["p2p"]) == sorted([("irecv", mb, 8 * mb)] * peers * m + [("isend", mb, 8 * mb)] * peers * m)
        assert r["reduces"] == [(_agreement(batch), 4), (1, 4)]


def _agreement(batch: int) -> int:
    """The numel of `autopar.agree.agree_on_call`'s all-reduce for this batch: a key digest pair and an error slot,
    then the inputs' digests and their negation."""
    from autopar.agree import input_digests
    return 3 + 2 * input_digests(list(_batch(batch))).numel()


def _numel(model, name: str) -> int:
    return dict(_model(model).named_parameters())[name].numel()


def test_interleaved_1f1b_two_stages_per_rank():
    m, batch = 4, 8
    results = gloo_pool(2).run(_equivalence, "interleaved-1f1b", 4, (2,), ("pp",), m, batch, 1.0, 2)
    check(results)
    assert results[0]["cut"] == (0, 1, 2, 3, 4)
    assert results[0]["stages"] == [0, 2] and results[1]["stages"] == [1, 3]  # round-robin, as torch places them
    mb = batch // m * S * H
    # three boundaries (0->1, 1->2, 2->3), each crossed by every microbatch's activation and then its gradient
    for r in results:
        assert sorted(r["p2p"]) == sorted([("irecv", mb, 8 * mb)] * 3 * m + [("isend", mb, 8 * mb)] * 3 * m)


def test_zbv_zero_bubble_v_shaped():
    m, batch = 4, 8
    results = gloo_pool(2).run(_equivalence, "zbv", 4, (2,), ("pp",), m, batch, 1.0, 2)
    check(results)
    assert results[0]["stages"] == [0, 3] and results[1]["stages"] == [1, 2]  # V-shaped
    mb = batch // m * S * H
    # boundaries 0->1 and 2->3 cross ranks; 1->2 stays on rank 1 (no p2p)
    for r in results:
        assert sorted(r["p2p"]) == sorted([("irecv", mb, 8 * mb)] * 2 * m + [("isend", mb, 8 * mb)] * 2 * m)


def test_mse_loss_and_a_weight_used_twice():
    # 1f1b: exact (the mean over all microbatches' elements); zbv refuses it (torch's split backward)
    check(gloo_pool(2).run(_equivalence, "1f1b", "twice", (2,), ("pp",), 2, 4))
    for r in gloo_pool(2).run(_error, "twice", (2,), ("pp",), "zbv@pp", 2):
        assert r[0] == "NotImplementedError" and "'blocks.0.weight' is used 2 times" in r[1], r


def test_a_weight_tied_across_stages():
    # GPT's embedding is its output head: stage 0 looks it up, stage 1 projects with it; each holds it, the two
    # gradient parts are summed over the pipeline axis, and both ranks step it alike
    m, batch = 2, 4
    results = gloo_pool(2).run(_equivalence, "1f1b", "gpt", (2,), ("pp",), m, batch, clip=0.05)
    check(results)
    for r in results:
        assert "wte.weight" in r["mine"]
        # the agreement, the loss, then the tied weight's gradient (128 x 32) over the pipeline axis
        assert r["reduces"] == [(_agreement(batch), 2), (1, 2), (128 * 32, 2)], r["reduces"]


def test_a_value_passed_through_stages():
    m, batch = 2, 4
    results = gloo_pool(2).run(_equivalence, "interleaved-1f1b", "skip", (2,), ("pp",), m, batch, 1.0, 2)
    check(results)
    rows = batch // m * 8
    # x and x0 cross each of the 3 boundaries forward, their gradients backward (x0's passed back through
    # stages 2 and 1): each rank sends and receives 2 tensors x 3 boundaries x m microbatches
    for r in results:
        assert sorted(r["p2p"]) == sorted([("irecv", rows, 8 * rows)] * 2 * 3 * m
                                          + [("isend", rows, 8 * rows)] * 2 * 3 * m)


def _contract(plan: str = "dp", mesh_shape=(2,), names=("pp",), batch: int = 4):
    """The call contract beyond one step: no backward leaves no gradient; no_grad and eval run forward only (no
    gradient sent back) and return the global loss; two calls then two backwards accumulate; state_dict keeps the
    model's keys and load_state_dict takes the single-device model's; an out-of-range id, or ranks passing different
    batches, raise on every rank."""
    import copy
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    import autopar

    torch.manual_seed(0)
    torch.set_default_dtype(torch.float64)
    try:
        ref = _llama(2)
        model = copy.deepcopy(ref)
        tokens, labels = _batch(batch)
        mesh = init_device_mesh("cpu", mesh_shape, mesh_dim_names=names)
        pm = autopar.parallelize(model, mesh, (tokens, labels), plan=plan, overrides={"pipeline": "1f1b@pp"},
                                 microbatches=2)
        ref_loss = ref(tokens, labels)
        ref_loss.backward()
        out = {"keys": list(pm.state_dict()) == list(model.state_dict())}
        loss = pm(tokens, labels)  # never backpropagated
        out["unused"] = (all(p.grad is None for p in pm.parameters()), abs(float(loss) - float(ref_loss)))
        del loss
        with torch.no_grad(), _P2P() as rec:
            loss = pm(tokens, labels)
        out["no_grad"] = (loss.grad_fn is None, abs(float(loss) - float(ref_loss)), sorted({op for op, *_ in rec.ops}))
        pm.eval()
        with _P2P() as rec:
            loss = pm(tokens, labels)
        out["eval"] = (loss.grad_fn is None, abs(float(loss) - float(ref_loss)), sorted({op for op, *_ in rec.ops}),
                       all(p.grad is None for p in pm.parameters()))
        pm.train()
        a, b = pm(tokens, labels), pm(tokens, labels)
        a.backward()
        b.backward()
        refs = dict(ref.named_parameters())
        out["twice"] = max(float((p.grad.full_tensor() - 2 * refs[n].grad).abs().max())
                           for n, p in pm.named_parameters() if p.device_mesh.get_coordinate() is not None)
        bad, other = tokens.clone(), tokens.clone()
        bad[3, 5] = 999  # out of the vocabulary: stage 0 alone would raise, stage 1 would wait for its activation
        other[0, 0] = (other[0, 0] + dist.get_rank()) % 128  # rank 1 passes another batch
        for name, t in (("bad", bad), ("other", other)):
            try:
                pm(t, labels)
                out[name] = None
            except Exception as e:  # noqa: BLE001 - returned to the test
                out[name] = (type(e).__name__, str(e))
        out["after"] = abs(float(pm(tokens, labels)) - float(ref_loss))  # nothing left waiting
        other = _llama(2)  # other weights, loaded from a single-device state dict into the stages
        pm.load_state_dict(other.state_dict())
        with torch.no_grad():
            out["loaded"] = abs(float(pm(tokens, labels)) - float(other(tokens, labels)))
        return out
    finally:
        torch.set_default_dtype(torch.float32)


def test_backward_releases_the_gradients_no_grad_or_eval_run_forward_only_and_bad_calls_raise_everywhere():
    for rank, r in enumerate(gloo_pool(2).run(_contract)):
        assert r["keys"]
        assert r["unused"][0] and r["unused"][1] <= TOL
        assert r["no_grad"][0] and r["no_grad"][1] <= TOL
        assert r["eval"][0] and r["eval"][1] <= TOL and r["eval"][3]
        # forward only: stage 0 only sends, stage 1 only receives
        assert r["no_grad"][2] == r["eval"][2] == (["isend"] if rank == 0 else ["irecv"])
        assert r["twice"] <= TOL
        # checked before any stage runs, raised on every rank
        assert r["bad"][0] == "IndexError" and "index out of range" in r["bad"][1], r["bad"]
        assert r["other"][0] == "RankMismatchError" and "every rank passes the same whole batch" in r["other"][1]
        assert r["after"] <= TOL
        assert r["loaded"] <= TOL


def _error(model: str, mesh_shape, names, value: str, microbatches, batch: int = 8, plan="dp"):
    """The message every rank raised, by type."""
    from torch.distributed.device_mesh import init_device_mesh
    import autopar
    from autopar.models import GPT, GPTConfig

    torch.manual_seed(0)
    m = _llama(1) if model == "llama1" else _llama(2) if model == "llama2" else Twice() if model == "twice" else \
        GPT(GPTConfig())
    inputs = (torch.randn(batch, 8), torch.randn(batch, 8)) if model == "twice" else _batch(batch)
    mesh = init_device_mesh("cpu", mesh_shape, mesh_dim_names=names)
    try:
        autopar.parallelize(m, mesh, inputs, plan=plan, overrides={"pipeline": value},
                            microbatches=microbatches)
    except Exception as e:  # noqa: BLE001 - returned to the test
        return type(e).__name__, str(e)
    return None


@pytest.mark.parametrize("case, expected", [
    (("llama2", (2,), ("pp",), "1f1b@pp", 3), ("ValueError", r"batch of 8 rows does not split into 3 microbatches.*"
                                                              r"Fix: choose microbatches")),
    (("llama2", (2,), ("pp",), "gpipe@pp", 4, 6), ("ValueError", r"batch of 6 rows does not split into 4 "
                                                                 r"microbatches")),
    (("llama1", (2,), ("pp",), "1f1b@pp", 2), ("ValueError", r"runs 2 stages .* has 1 repeated layer\(s\) "
                                                             r"\(layers\.0\).*Fix")),
    (("llama2", (2,), ("dp",), "1f1b@pp", 2), ("ValueError", r"pipeline axis 'pp'.*not an axis of the mesh \(dp\)")),
    (("llama2", (2,), ("pp",), "dualpipev@pp", 2), ("NotImplementedError", r"'dualpipev' pipeline schedule is not "
                                                                       r"implemented")),
])
def test_clear_errors_on_every_rank(case, expected):
    import re
    for r in gloo_pool(2).run(_error, *case):
        assert r is not None and r[0] == expected[0] and re.search(expected[1], r[1], re.S), r


ZOO = ("llama", "gpt2", "gpt_neox", "bert", "vit")  # decoders (gpt2: tied embedding and head), an encoder, images


def _zoo(families):
    """Per family as users hold it (tests/zoo.py: fp64, the loss a module returns), under 1f1b on pp2: the loss,
    every gradient and every parameter after an AdamW step against one device, within the family's tolerance."""
    import copy
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor
    import autopar
    import zoo

    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("pp",))
    out = {}
    for family in families:
        torch.manual_seed(0)
        ref, inputs, tol = getattr(zoo, family)()
        pm = autopar.parallelize(copy.deepcopy(ref), mesh, inputs, plan="dp", overrides={"pipeline": "1f1b@pp"},
                                 microbatches=2)
        ref(**inputs).backward()
        loss = pm(**inputs)
        loss.backward()
        errs = {"loss": abs(float(loss) - float(ref(**inputs)))}
        refs = dict(ref.named_parameters())
        mine = [n for n, p in pm.named_parameters() if p.device_mesh.get_coordinate() is not None]
        for n, p in pm.named_parameters():
            assert isinstance(p, DTensor)
            if n in mine:
                errs[f"grad {n}"] = float((p.grad.full_tensor() - refs[n].grad).abs().max())
        torch.optim.AdamW(ref.parameters(), lr=0.01).step()
        torch.optim.AdamW(pm.parameters(), lr=0.01).step()
        stepped_params(pm, refs, mine, errs, "param")
        out[family] = {"bad": {k: v for k, v in errs.items() if not v <= tol}, "mine": mine, "all": sorted(refs)}
    return out


def test_five_zoo_families_under_1f1b():
    results = gloo_pool(2).run(_zoo, ZOO)
    for family in ZOO:
        assert not any(r[family]["bad"] for r in results), (family, [r[family]["bad"] for r in results])
        assert set(results[0][family]["mine"]) | set(results[1][family]["mine"]) == set(results[0][family]["all"])
