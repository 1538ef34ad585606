"""What the pipeline test files share (tests/test_pipeline_*.py): the tiny Llama they build, the single-device
reference and its batch, the counters of a stage program's collectives and the schedule's p2p, the per-rank checks
of gradients, clipped gradients and stepped parameters against one device, and the check of every rank's errors.

A pipelined parameter is a DTensor on its stage's (sub-)mesh: on a rank outside that mesh it has no gradient and no
local values, so each rank checks the parameters of its own stages and `check` asserts that every parameter was
checked on some rank."""

from __future__ import annotations

import copy

import torch

TOL = 1e-10


def llama(**config):
    """A 2-layer Llama-style model (autopar.models.Llama): 4 heads, 2 kv heads; `config` overrides LlamaConfig."""
    from autopar.models import Llama, LlamaConfig
    return Llama(LlamaConfig(**{"num_layers": 2, "num_heads": 4, "num_kv_heads": 2, **config}))


def reference_and_batch(build, batch: int, seq: int, vocab: int = 128, *, ignored: bool = True):
    """(ref, model, tokens, labels): `build()` under seed 0, its deep copy to parallelize, and a (batch, seq) token
    batch and labels from generator seed 1; `ignored`: the first row's first 5 labels ignored (-100: spread unevenly
    over the microbatches and data ranks)."""
    torch.manual_seed(0)
    ref = build()
    model = copy.deepcopy(ref)
    g = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, vocab, (batch, seq), generator=g)
    labels = torch.randint(0, vocab, (batch, seq), generator=g)
    if ignored:
        labels[0, :5] = -100
    return ref, model, tokens, labels


def stage_grads(pm, refs: dict, errs: dict, key: str) -> list[str]:
    """errs[f"{key} {name}"]: the largest gradient error of each parameter of this rank's stages against `refs`
    (one device's named parameters); another stage's parameter holds no gradient and no local values. Returns the
    names checked. Every parameter of a pipelined module is a DTensor."""
    from torch.distributed.tensor import DTensor
    mine = []
    for n, p in pm.named_parameters():
        assert isinstance(p, DTensor)
        if p.device_mesh.get_coordinate() is None:  # another stage's
            assert p.grad is None and p.to_local().numel() == 0
            continue
        mine.append(n)
        errs[f"{key} {n}"] = float((p.grad.full_tensor() - refs[n].grad).abs().max())
    return mine


def clipped_grads(pm, ref, refs: dict, mine: list[str], errs: dict, clip: float) -> None:
    """errs["norm"]: the total gradient norm over every stage and shard against one device's, and
    errs[f"clipped grad {name}"] each of this rank's gradients after clipping both to `clip`."""
    errs["norm"] = abs(float(pm.clip_grad_norm_(clip)) - float(torch.nn.utils.clip_grad_norm_(ref.parameters(), clip)))
    for n, p in pm.named_parameters():
        if n in mine:
            errs[f"clipped grad {n}"] = float((p.grad.full_tensor() - refs[n].grad).abs().max())


def stepped_params(pm, refs: dict, mine: list[str], errs: dict, key: str) -> None:
    """errs[f"{key} {name}"]: the largest error of each of this rank's parameters (after an optimizer step)."""
    for n, p in pm.named_parameters():
        if n in mine:
            errs[f"{key} {n}"] = float((p.full_tensor() - refs[n].detach()).abs().max())


def exact_step(ref, pm, batch, *, nonempty: bool = False) -> tuple[dict, list[str]]:
    """One training step of `pm` against `ref` (one device): errs["loss"], f"grad {name}" of every parameter of this
    rank's stages (`nonempty`: only those with local values), f"param {name}" after one AdamW step (lr 0.01).
    Returns (errs, the names checked)."""
    errs = {}
    loss = pm(*batch)
    loss.backward()
    ref_loss = ref(*batch)
    ref_loss.backward()
    errs["loss"] = abs(float(loss) - float(ref_loss))
    refs = dict(ref.named_parameters())
    mine = [n for n, p in pm.named_parameters() if p.device_mesh.get_coordinate() is not None
            and (not nonempty or p._local_tensor.numel())]
    for n, p in pm.named_parameters():
        if n in mine:
            errs[f"grad {n}"] = float((p.grad.full_tensor() - refs[n].grad).abs().max())
    torch.optim.AdamW(ref.parameters(), lr=0.01).step()
    torch.optim.AdamW(pm.parameters(), lr=0.01).step()
    stepped_params(pm, refs, mine, errs, "param")
    return errs, mine


def pp_dp_tp_step(build, overrides: dict, batch: int, seq: int, microbatches: int, eager):
    """The 8-rank job tests/test_pipeline_dtp.py and tests/test_pipeline_dtp_sp.py share: `build()`'s reference and
    copy (`reference_and_batch`), the copy under plan="megatron" with `overrides` on a (pp=2, dp=2, tp=2) mesh, its
    parameter names checked, one step against one device with the call recorded by `Count` and `eager()` (the
    eager all-reduces), errs: the loss, every gradient of this rank's stages (`stage_grads`) and every parameter
    after one AdamW step (lr 0.01). Returns (ref, pm, mesh, tokens, labels, errs, mine, count, eager record)."""
    from torch.distributed.device_mesh import init_device_mesh
    import autopar
    ref, model, tokens, labels = reference_and_batch(build, batch, seq)
    mesh = init_device_mesh("cpu", (2, 2, 2), mesh_dim_names=("pp", "dp", "tp"))
    pm = autopar.parallelize(model, mesh, (tokens, labels), plan="megatron", overrides=overrides,
                             microbatches=microbatches)
    assert [n for n, _ in pm.named_parameters()] == [n for n, _ in ref.named_parameters()]
    refs = dict(ref.named_parameters())
    opt_ref = torch.optim.AdamW(ref.parameters(), lr=0.01)
    opt = torch.optim.AdamW(pm.parameters(), lr=0.01)
    errs = {}
    ref_loss = ref(tokens, labels)
    ref_loss.backward()
    with Count() as c, eager() as rec:
        loss = pm(tokens, labels)
    loss.backward()
    errs["loss"] = abs(float(loss) - float(ref_loss))
    mine = stage_grads(pm, refs, errs, "grad")
    opt_ref.step()
    opt.step()
    stepped_params(pm, refs, mine, errs, "param")
    return ref, pm, mesh, tokens, labels, errs, mine, c, rec


def held(pm) -> dict:
    """name -> full value, of the parameters whose (sub-)mesh includes this rank."""
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor
    out = {}
    for n, p in pm.named_parameters():
        if isinstance(p, DTensor):
            if dist.get_rank() not in p.device_mesh.mesh.flatten().tolist():
                continue
            p = p.full_tensor()
        out[n] = p.detach().clone()
    return out


def check(results):
    """Every rank's errors <= TOL, and every parameter checked on some rank."""
    seen = set()
    for r in results:
        bad = {k: v for k, v in r["errs"].items() if not v <= TOL}
        assert not bad, f"rank {r['rank']}: {bad}"
        seen |= set(r["mine"])
    assert seen == set(results[0]["all"]), "some parameter was checked on no rank"


class Count:
    """Records (op, numel, group size) of the all-reduces the stage programs issue (autopar's functional
    collectives, `torch.distributed._functional_collectives`) and the p2p ops of torch's schedules."""

    def __enter__(self):
        import torch.distributed.pipelining.schedules as S_
        import torch.distributed._functional_collectives as F  # noqa: F401  (registers the functional ops)
        self.p2p, self.reduces = [], []
        self._p2p, self._ar = S_._batch_p2p, torch.ops._c10d_functional.all_reduce.default
        orig_p2p = self._p2p

        def p2p(ops, desc=None):
            for op in ops:
                self.p2p.append((op.op.__name__, op.tensor.numel() * op.tensor.element_size()))
            return orig_p2p(ops, desc)
        S_._batch_p2p = p2p
        self._mode = _Reduces(self.reduces).__enter__()
        return self

    def __exit__(self, *exc):
        import torch.distributed.pipelining.schedules as S_
        S_._batch_p2p = self._p2p
        self._mode.__exit__(*exc)


class _Reduces(torch.utils._python_dispatch.TorchDispatchMode):
    def __init__(self, out):
        super().__init__()
        self.out = out

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = str(func.overloadpacket).split(".")[-1]
        if "_c10d_functional" in str(func) and name in ("all_reduce", "all_reduce_", "all_gather_into_tensor",
                                                          "reduce_scatter_tensor", "all_to_all_single"):
            self.out.append((name, args[0].numel()))
        return func(*args, **(kwargs or {}))


def train_steps(ref, pm, batch: tuple, errs: dict, *, steps: int = 2, counter=Count, clip: float | None = None):
    """`steps` AdamW steps (lr 0.01) of `ref` (one device) and `pm` side by side on `batch`. Each step: errs
    f"loss {step}", `pm`'s forward recorded by `counter()`, f"grad {step} {name}" (`stage_grads`), then this
    generator yields (step, the counter, the names checked) before the optimizer steps; on the last step with `clip`
    the norm and clipped gradients (`clipped_grads`); after the step f"param {step} {name}" (`stepped_params`)."""
    refs = dict(ref.named_parameters())
    opt_ref = torch.optim.AdamW(ref.parameters(), lr=0.01)
    opt = torch.optim.AdamW(pm.parameters(), lr=0.01)
    for step in range(steps):
        opt_ref.zero_grad()
        opt.zero_grad()
        ref_loss = ref(*batch)
        ref_loss.backward()
        with counter() as c:
            loss = pm(*batch)
        loss.backward()
        errs[f"loss {step}"] = abs(float(loss) - float(ref_loss))
        mine = stage_grads(pm, refs, errs, f"grad {step}")
        yield step, c, mine
        if clip is not None and step == steps - 1:  # the total norm over every stage and shard, clipped gradients
            clipped_grads(pm, ref, refs, mine, errs, clip)
        opt_ref.step()
        opt.step()
        stepped_params(pm, refs, mine, errs, f"param {step}")


def pp_tp_train(build, form: str, batch: int, seq: int, microbatches: int, *, tp: int = 2, overrides=None,
                clip: float | None = None):
    """The setup tests/test_pipeline_tp.py and tests/test_pipeline_tp_sp.py share, on 2 x `tp` gloo ranks:
    `build()`'s reference and copy (`reference_and_batch`), the copy under plan="megatron" on a (pp, tp) mesh with
    `form`@pp (and `overrides`), its parameter names checked against the reference's, then `train_steps` (fp64 is the
    caller's). Returns (ref, pm, tokens, labels, errs, counts, mine, placements): counts each step's (p2p, reduces),
    placements those of this rank's parameters at the first step."""
    from torch.distributed.device_mesh import init_device_mesh
    import autopar

    ref, model, tokens, labels = reference_and_batch(build, batch, seq)
    mesh = init_device_mesh("cpu", (2, tp), mesh_dim_names=("pp", "tp"))
    pm = autopar.parallelize(model, mesh, (tokens, labels), plan="megatron",
                             overrides={"pipeline": f"{form}@pp", **(overrides or {})}, microbatches=microbatches)
    assert [n for n, _ in pm.named_parameters()] == [n for n, _ in ref.named_parameters()]
    errs, counts, placements, mine = {}, [], {}, []
    for step, c, mine in train_steps(ref, pm, (tokens, labels), errs, clip=clip):
        counts.append((c.p2p, c.reduces))
        if step == 0:
            placements = {n: str(tuple(p.placements)) for n, p in pm.named_parameters() if n in mine}
    return ref, pm, tokens, labels, errs, counts, mine, placements
