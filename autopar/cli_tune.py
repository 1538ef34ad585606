"""`torchrun --nproc-per-node N -m autopar tune --model pkg.module:factory [--mesh 2x2 --mesh-names dp,tp]
[--top-k 8] [--steps 10] [--warmup 3] [--microbatches M] [--out plan.json] [--cluster PATH] [--no-cache] [--quiet]`.

`factory()` returns `(model, example_inputs)`, the same on every rank (seed it). The command joins the process
group torchrun set up (nccl on GPUs, gloo otherwise; a single process without torchrun is a 1-rank world), builds
the mesh (`autopar.cli_verify`'s world and mesh handling), runs `autopar.tune` with a progress bar per candidate
on rank 0, prints the table of every candidate (predicted before and after calibration, measured, peak memory)
and writes the fastest plan with `--out` (load it with `parallelize(..., plan="plan.json")`; a pipelined one runs
its pipeline again). On a mesh with a pipeline axis (`--mesh-names pp,...`) the pipelines the estimate ranks best
are measured too; `--microbatches M` fixes their microbatch count. Exit status 0 when a plan was measured, 1 when
every candidate was skipped.
"""

from __future__ import annotations

import argparse


def add_parser(sub) -> None:
    """Register `tune` on the `python -m autopar` subparsers."""
    p = sub.add_parser("tune", help="measure the best candidate plans on this mesh and keep the fastest",
                       description=__doc__.split("\n\n")[1].replace("\n", " "))
    p.add_argument("--model", required=True, help="pkg.module:factory, a function returning (model, example_inputs)")
    p.add_argument("--mesh", help="mesh shape over the world, e.g. 2x2 (default: 1-D over all ranks)")
    p.add_argument("--mesh-names", help="comma-separated axis names, e.g. dp,tp (default: dp for 1-D, else axis0,...)")
    p.add_argument("--top-k", type=int, default=8, help="the ILP's best distinct plans to measure (default: 8)")
    p.add_argument("--steps", type=int, default=10, help="timed training steps per candidate (default: 10)")
    p.add_argument("--warmup", type=int, default=3, help="untimed steps per candidate first (default: 3)")
    p.add_argument("--microbatches", type=int, help="the pipeline candidates' microbatch count on a mesh with a "
                                                    "pipeline axis (default: each count the estimate tries)")
    p.add_argument("--cluster", help="the cluster profile (JSON) to price with and calibrate (default: this "
                                     "machine's)")
    p.add_argument("--out", help="write the fastest plan as JSON")
    p.add_argument("--no-cache", action="store_true", help="measure even when a tuned result is cached")
    p.add_argument("--quiet", action="store_true", help="no progress bars")
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from autopar.cli_verify import _load, _mesh_names, build, mesh_shape, on_device, world
    from autopar.tune import tune

    factory = _load(args.model, "--model")
    with world():
        shape = mesh_shape(args.mesh, dist.get_world_size())
        names = _mesh_names(args.mesh_names, len(shape))
        model, inputs, device = on_device(*build(factory, args.model))
        mesh = init_device_mesh(device, shape, mesh_dim_names=names)
        try:
            result = tune(model, mesh, inputs, top_k=args.top_k, steps=args.steps, warmup=args.warmup,
                          cache=not args.no_cache, progress=not args.quiet, cluster=args.cluster,
                          microbatches=args.microbatches)
        except ValueError as e:
            raise SystemExit(f"python -m autopar tune: {e}") from None
        measured = any(c.measured_s is not None for c in result.candidates)
        if dist.get_rank() == 0:
            print(result.table(), flush=True)
            if measured:
                print(f"fastest: {result.fastest.name}", flush=True)
                if args.out:
                    result.plan.save(args.out)
                    print(f"wrote {args.out}", flush=True)
            if result.calibration_path:
                print(f"calibration: {result.calibration_path}", flush=True)
    return 0 if measured else 1
