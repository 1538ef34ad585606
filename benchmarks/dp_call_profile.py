"""Where autopar's per-call CPU time goes under plan="dp" on a small model, against DDP and eager (issue #22 item 5).

Two gloo ranks, the torch.nn census's Conv2d + GroupNorm ConvNet (`common.census_model("convnet")`), each rank
passing its shard (inputs="local"). Rank 0 prints, as medians of interleaved rounds of this process's CPU time
(`time.process_time`: gloo's threads included): the forward and the backward of autopar, DDP and the eager model;
then the ParallelModule forward wrapper's pieces timed alone (the guard key, the per-call agreement with its
all-reduce, the parameters' `to_local`, a bare 3-int64 all-reduce for scale, the program without the wrapper).
`--cprofile` prints rank 0's cProfile (CPU timer) of autopar's forward + backward instead. `--below-autograd`
instead times, interleaved in one run, the same program with the runtime's functional collectives called below
autograd (`collectives._below_autograd`, the default) and as registered (their Python autograd kernel), beside DDP.
For an A/B of two checkouts, run this script with PYTHONPATH at each in turn (the script reads autopar from the path).

    python benchmarks/dp_call_profile.py [--rounds N] [--cprofile | --below-autograd]
"""

from __future__ import annotations

import copy
import cProfile
import io
import pstats
import statistics
import sys
import time

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.nn.parallel import DistributedDataParallel
from torch.utils import _pytree as pytree

import autopar
from autopar.agree import agree_on_call
try:
    from autopar.agree import SummedAgreement
except ImportError:  # a checkout before the agreement rode on the loss
    SummedAgreement = None
from autopar.dtensors import to_locals
from common import census_model, launch


def below_autograd_ab(rounds: int) -> None:
    """The A/B of `collectives._below_autograd`: one ParallelModule, its collectives' lookup table switched per step."""
    from autopar.runtime import collectives
    rank = dist.get_rank()
    model, batch, _, _ = census_model("convnet", 8)
    local = tuple(t.chunk(2)[rank] for t in batch)
    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("dp",))
    pm = autopar.parallelize(copy.deepcopy(model), mesh, local, plan="dp", inputs="local")
    ddp = DistributedDataParallel(copy.deepcopy(model))
    times: dict[str, list[tuple[float, float]]] = {"below autograd": [], "as registered": [], "DDP": []}

    def step(name: str) -> None:
        collectives._OPS.clear()  # refilled, below autograd, at the next lookup
        if name == "as registered":
            collectives._OPS.update({n: getattr(torch.ops._c10d_functional, n)
                                     for n in ("all_reduce", "all_reduce_", "wait_tensor")})
        m = ddp if name == "DDP" else pm
        c0 = time.process_time()
        loss = m(*local)
        c1 = time.process_time()
        loss.backward()
        times[name].append((c1 - c0, time.process_time() - c1))
        for p in m.parameters():
            p.grad = None

    for i in range(rounds + 3):
        for n in times:
            step(n)
        if i == 2:
            for v in times.values():
                v.clear()
    collectives._OPS.clear()
    if rank == 0:
        for n, v in times.items():
            f, b = (statistics.median(x[i] for x in v) * 1e3 for i in range(2))
            print(f"{n:16s} forward {f:6.2f} ms  backward {b:6.2f} ms  (CPU per step, median of {rounds} interleaved)")


def body(rounds: int, cprofile: bool, below: bool = False) -> None:
    if below:
        return below_autograd_ab(rounds)
    rank = dist.get_rank()
    model, batch, _, _ = census_model("convnet", 8)
    local = tuple(t.chunk(2)[rank] for t in batch)
    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("dp",))
    pm = autopar.parallelize(copy.deepcopy(model), mesh, local, plan="dp", inputs="local")
    models = {"autopar": pm, "DDP": DistributedDataParallel(copy.deepcopy(model)), "eager": copy.deepcopy(model)}
    if hasattr(pm, "_rides"):  # the A/B of the agreement riding on the loss: the same program, the agreement alone
        alone = autopar.parallelize(copy.deepcopy(model), mesh, local, plan="dp", inputs="local")
        alone._rides = lambda prog: False
        models = {"autopar": pm, "autopar, agreement alone": alone, **{n: m for n, m in models.items() if n != "autopar"}}
    times: dict[str, list[tuple[float, float, float, float]]] = {n: [] for n in models}

    def step(name: str) -> None:
        m = models[name]
        w0, c0 = time.perf_counter(), time.process_time()
        loss = m(*local)
        w1, c1 = time.perf_counter(), time.process_time()
        loss.backward()
        times[name].append((c1 - c0, time.process_time() - c1, w1 - w0, time.perf_counter() - w1))
        for p in m.parameters():
            p.grad = None

    for _ in range(3):
        for n in models:
            step(n)
    if cprofile:
        pr = cProfile.Profile(time.process_time)
        pr.enable()
        for _ in range(rounds):
            step("autopar")
        pr.disable()
        if rank == 0:
            out = io.StringIO()
            pstats.Stats(pr, stream=out).sort_stats("tottime").print_stats(40)
            print(out.getvalue())
        return
    for n in times:
        times[n].clear()
    for _ in range(rounds):
        for n in models:
            step(n)
    if rank == 0:
        for n, v in times.items():
            f, b, wf, wb = (statistics.median(x[i] for x in v) * 1e3 for i in range(4))
            print(f"{n:26s} forward {f:6.2f} ms  backward {b:6.2f} ms  (CPU per step, median of {rounds}); "
                  f"wall {wf:6.2f} / {wb:6.2f} ms")
    key = pm._key(local, {})
    prog = pm._programs[key]
    cap = prog.captured
    flat = pytree.tree_flatten((local, {}))[0]
    dts = list(pm.parameters())
    t3 = torch.zeros(3, dtype=torch.int64)

    def no_grad(f):
        def run():
            with torch.no_grad():
                f()
        return run

    pieces = {
        "guard key": lambda: pm._key(local, {}),
        "agreement (agree_on_call)": lambda: agree_on_call(key, mesh, None, wait=True),
        **({"agreement alone (SummedAgreement, waited)": lambda: SummedAgreement(key, mesh, None).alone()()}
           if SummedAgreement is not None else {}),
        "_check_inputs (index checks + agreement)": lambda: pm._check_inputs(key, cap, flat, wait=True),  # alone
        "bare all-reduce, 3 int64": lambda: dist.all_reduce(t3, op=dist.ReduceOp.MAX),
        "to_locals (14 parameters)": lambda: to_locals(dts),
        "program, no_grad (wrapper skipped)": no_grad(lambda: pm._run(prog, cap, flat)),
        "autopar forward, no_grad": no_grad(lambda: pm(*local)),
        "eager forward, no_grad": no_grad(lambda: models["eager"](*local)),
    }
    got: dict[str, list[float]] = {n: [] for n in pieces}
    for _ in range(rounds):
        for n, f in pieces.items():
            c0 = time.process_time()
            for _ in range(5):
                f()
            got[n].append((time.process_time() - c0) / 5)
    if rank == 0:
        for n, v in got.items():
            print(f"  {n:42s} {statistics.median(v) * 1e6:8.1f} us")


if __name__ == "__main__":
    args = sys.argv[1:]
    n = int(args[args.index("--rounds") + 1]) if "--rounds" in args else 30
    launch(body, 2, n, "--cprofile" in args, "--below-autograd" in args)
