"""The per-call agreement rides on the loss's (sum, count) all-reduce (`autopar.agree.SummedAgreement`).

Under `dp` with inputs="local" on a 1-D mesh, the call's agreement (the ranks' shapes agree, no rank holds a bad label,
none failed) is no longer an all-reduce of its own before the program: its row (fp64 integers, summed exactly) is
appended to the loss's (sum, count) pair, so the forward synchronises the ranks once, as the loss alone did. One
2-rank gloo job asserts, on a small head in fp64 against one device:

- the forward's collectives: that one all-reduce of 2 + 4 + 2 entries, and no agreement all-reduced alone;
- the loss, every gradient and the parameters after an SGD step equal one device's on the global batch;
- a call at which rank 1 passes a shorter batch raises `RankMismatchError` on both ranks (rank 0 detects it in the
  summed row at its loss, rank 1 in the same all-reduce), and no loss is returned; the next call is exact again;
- a call whose program raises on rank 1 before the loss: rank 1 raises its own error, rank 0 a RuntimeError naming
  rank 1 (it does not return a loss summed without rank 1's share);
- a bad label on rank 1 only: both raise `IndexError` naming rank 1.
"""

from __future__ import annotations

import copy

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import init_device_mesh

import autopar
from autopar.runtime.collectives import record_comms
from dist_harness import gloo_pool


class Head(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(6, 8), nn.Linear(8, 5)

    def forward(self, x, y):
        return F.cross_entropy(self.b(torch.tanh(self.a(x))), y)


def _batch(step: int):
    g = torch.Generator().manual_seed(step)
    return torch.randn(8, 6, generator=g, dtype=torch.float64), torch.randint(0, 5, (8,), generator=g)


def _outcome(fn) -> tuple[str, str]:
    try:
        fn()
    except Exception as e:  # noqa: BLE001 - reported to the test
        return type(e).__name__, str(e)
    return "ok", ""


def rides_worker() -> dict:
    import torch.distributed as dist
    import autopar.agree as A
    rank = dist.get_rank()
    torch.manual_seed(0)
    ref = Head().double()
    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("dp",))
    mine = lambda t: t[4 * rank:4 * rank + 4]  # noqa: E731
    x, y = _batch(0)
    pm = autopar.parallelize(copy.deepcopy(ref), mesh, (mine(x), mine(y)), plan="dp", inputs="local")
    out: dict = {}
    alone = []
    issue = A.SummedAgreement.alone
    A.SummedAgreement.alone = lambda self, failed=False: (alone.append(failed), issue(self, failed))[1]
    try:
        with record_comms() as comms:
            loss = pm(mine(x), mine(y))
        out["forward"] = [(r.kind, r.numel, r.dtype) for r in comms]
        out["alone"] = list(alone)
        loss.backward()
        ref_loss = ref(x, y)
        ref_loss.backward()
        err = {"loss": abs(loss.item() - ref_loss.item())}
        err["grad"] = max((dict(pm.named_parameters())[n].grad.full_tensor() - p.grad).abs().max().item()
                          for n, p in ref.named_parameters())
        for m in (pm, ref):
            with torch.no_grad():
                for p in m.parameters():
                    p -= 0.1 * p.grad
                    p.grad = None
        err["param"] = max((dict(pm.named_parameters())[n].full_tensor() - p).abs().max().item()
                           for n, p in ref.named_parameters())
        out["err"] = err

        n = 4 if rank == 0 else 2
        out["short"] = _outcome(lambda: pm(mine(x)[:n], mine(y)[:n]))
        x1, y1 = _batch(1)
        out["again"] = abs(pm(mine(x1), mine(y1)).item() - ref(x1, y1).item())

        run = pm._run
        if rank == 1:
            def failing(*args):
                raise ValueError("boom on rank 1")
            pm._run = failing
        alone.clear()
        out["failed"] = _outcome(lambda: pm(mine(x), mine(y)))
        out["alone_failed"] = list(alone)
        pm._run = run

        bad = mine(y).clone()
        if rank == 1:
            bad[2] = 7
        out["bad_label"] = _outcome(lambda: pm(mine(x), bad))
        out["after"] = abs(pm(mine(x1), mine(y1)).item() - ref(x1, y1).item())
    finally:
        A.SummedAgreement.alone = issue
    return out


def test_the_agreement_rides_on_the_loss_and_still_stops_every_rank():
    r0, r1 = gloo_pool(2).run(rides_worker)
    for r in (r0, r1):
        assert r["forward"] == [("all_reduce", 2 + 4 + 2, "float64")], r["forward"]
        assert r["alone"] == [], r["alone"]  # no agreement all-reduced by itself: it rode
        assert max(r["err"].values()) <= 1e-12, r["err"]
        assert r["short"][0] == "RankMismatchError" and "the ranks differ at this call" in r["short"][1], r["short"]
        assert r["again"] <= 1e-12 and r["after"] <= 1e-12, r
        assert r["bad_label"][0] == "IndexError", r["bad_label"]
        assert "rank 1's batch has a token id or label out of range" in r["bad_label"][1], r["bad_label"]
    assert "(4, 6)" in r0["short"][1] and "(2, 6)" in r1["short"][1], (r0["short"], r1["short"])
    assert r1["failed"] == ("ValueError", "boom on rank 1"), r1["failed"]
    assert r1["alone_failed"] == [True], r1  # it told rank 0, in the all-reduce rank 0's loss waits in
    assert r0["failed"][0] == "RuntimeError" and r0["failed"][1].startswith("rank 1 raised an error in this call's "
                                                                            "forward"), r0["failed"]
    assert r0["alone_failed"] == [], r0
