"""`torchrun --nproc-per-node N -m autopar verify --model pkg.module:factory [--mesh 2x2 --mesh-names dp,tp]
[--plan megatron] [--override moe=expert@ep ...] [--steps 1] [--lr 0.01] [--dtype float64] [--loss-fn pkg.module:fn] [--rtol R]`.

`factory()` returns `(model, example_inputs)`, the same on every rank (seed it). The command joins the process
group torchrun set up (nccl on GPUs, gloo otherwise; a single process without torchrun is a 1-rank world),
builds the mesh, runs `autopar.verify` and prints the report on rank 0. Exit status: 0 when the check passed,
1 when it failed (every rank gets the same report, so every rank exits alike).
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import math
import os

_DTYPES = ("float64", "float32", "bfloat16", "float16")


def add_parser(sub) -> None:
    """Register `verify` on the `python -m autopar` subparsers."""
    p = sub.add_parser("verify", help="check a plan against the single-device model before a long job",
                       description=__doc__.split("\n\n")[1].replace("\n", " "))
    p.add_argument("--model", required=True, help="pkg.module:factory, a function returning (model, example_inputs)")
    p.add_argument("--mesh", help="mesh shape over the world, e.g. 2x2 (default: 1-D over all ranks)")
    p.add_argument("--mesh-names", help="comma-separated axis names, e.g. dp,tp (default: dp for 1-D, else axis0,...)")
    p.add_argument("--plan", default="auto", help="a named plan (megatron, dp, fsdp, auto, ...) or a saved plan's "
                                                  "JSON path (default: auto)")
    p.add_argument("--override", action="append", default=[], metavar="KEY=FORM",
                   help="a plan override, e.g. moe=expert@ep or h.0.mlp=tp@tp (repeatable; see autopar.parallelize)")
    p.add_argument("--steps", type=int, default=1, help="SGD steps to compare (default: 1)")
    p.add_argument("--lr", type=float, default=1e-2, help="SGD learning rate (default: 0.01)")
    p.add_argument("--dtype", choices=_DTYPES, help="cast the model's parameters and floating inputs to this dtype")
    p.add_argument("--loss-fn", help="pkg.module:fn with fn(output) -> scalar loss, when forward does not return it")
    p.add_argument("--rtol", type=float, help="relative tolerance (default: sqrt(eps) of the compute dtype)")
    p.add_argument("--table", action="store_true", help="also print every check and the plan's table")
    p.set_defaults(run=run)


def _load(spec: str, what: str):
    mod_name, sep, attr = spec.partition(":")
    if not sep or not mod_name or not attr:
        raise SystemExit(f"{what} {spec!r}: expected pkg.module:function")
    try:
        mod = importlib.import_module(mod_name)
    except ImportError as e:
        raise SystemExit(f"{what} {spec!r}: cannot import {mod_name!r} ({e}); is its directory on PYTHONPATH?") from None
    try:
        return getattr(mod, attr)
    except AttributeError:
        raise SystemExit(f"{what} {spec!r}: module {mod_name!r} has no {attr!r}") from None


def _overrides(items: list[str]) -> dict[str, str] | None:
    out = {}
    for item in items:
        key, sep, form = item.partition("=")
        if not sep or not key.strip() or not form.strip():
            raise SystemExit(f"--override {item!r}: expected KEY=FORM, e.g. moe=expert@ep")
        out[key.strip()] = form.strip()
    return out or None


def mesh_shape(text: str | None, world: int) -> tuple[int, ...]:
    """`--mesh 2x4` (or `2,4`): the mesh's sizes, whose product is the world size; None: one axis."""
    if text is None:
        return (world,)
    try:
        shape = tuple(int(x) for x in text.lower().replace(",", "x").split("x"))
    except ValueError:
        raise SystemExit(f"--mesh {text!r}: expected sizes such as 2x4") from None
    if math.prod(shape) != world:
        raise SystemExit(f"--mesh {text!r} has {math.prod(shape)} devices but the world has {world} ranks; "
                         f"give sizes whose product is {world}")
    return shape


def _mesh_names(text: str | None, ndim: int) -> tuple[str, ...]:
    if text is None:
        return ("dp",) if ndim == 1 else tuple(f"axis{i}" for i in range(ndim))
    names = tuple(n.strip() for n in text.split(","))
    if len(names) != ndim or not all(names) or len(set(names)) != ndim:
        raise SystemExit(f"--mesh-names {text!r}: give {ndim} distinct comma-separated names, one per mesh axis")
    return names


@contextlib.contextmanager
def world():
    """The process group torchrun set up, initialised here when it is not yet (and destroyed afterwards)."""
    import torch
    import torch.distributed as dist

    if dist.is_initialized():
        yield
        return
    if "RANK" not in os.environ:  # a single process without torchrun: a 1-rank world
        os.environ.setdefault("RANK", "0")
        os.environ.setdefault("WORLD_SIZE", "1")
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", "29518")
    cuda = torch.cuda.is_available()
    if cuda:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    dist.init_process_group("nccl" if cuda else "gloo")
    try:
        yield
        dist.barrier()  # no rank tears its group down while another still uses it
    finally:
        dist.destroy_process_group()


def build(factory, spec: str):
    """(model, example_inputs) from a `--model` factory, or exit saying what it returned instead."""
    built = factory()
    if not (isinstance(built, tuple) and len(built) == 2):
        raise SystemExit(f"--model {spec!r}: the factory must return (model, example_inputs), got "
                         f"{type(built).__name__}{f' of {len(built)} items' if isinstance(built, tuple) else ''}")
    return built


def on_device(model, inputs):
    """The model and inputs on this rank's device (CUDA where there is one, else CPU), and that device's type."""
    import torch
    device = "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cuda":
        from torch.utils import _pytree as pytree
        model = model.to(device)
        inputs = pytree.tree_map(lambda a: a.to(device) if isinstance(a, torch.Tensor) else a, inputs)
    return model, inputs, device


def _cast(model, inputs, dtype_name: str):
    import torch
    from torch.utils import _pytree as pytree

    dtype = getattr(torch, dtype_name)
    model = model.to(dtype)
    return model, pytree.tree_map(lambda a: a.to(dtype) if isinstance(a, torch.Tensor) and a.is_floating_point()
                                  else a, inputs)


def run(args: argparse.Namespace) -> int:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from autopar.verify import verify

    factory = _load(args.model, "--model")
    loss_fn = _load(args.loss_fn, "--loss-fn") if args.loss_fn else None
    with world():
        shape = mesh_shape(args.mesh, dist.get_world_size())
        names = _mesh_names(args.mesh_names, len(shape))
        model, inputs = build(factory, args.model)
        if args.dtype:
            model, inputs = _cast(model, inputs, args.dtype)
        model, inputs, device = on_device(model, inputs)
        mesh = init_device_mesh(device, shape, mesh_dim_names=names)
        report = verify(model, mesh, inputs, plan=args.plan, overrides=_overrides(args.override), steps=args.steps, lr=args.lr, loss_fn=loss_fn,
                        rtol=args.rtol)
        if dist.get_rank() == 0:
            print(report, flush=True)
            if args.table:
                print(report.table())
                print(report.plan_table, flush=True)
    return 0 if report.passed else 1
