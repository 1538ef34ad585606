"""Command line: `torchrun --nproc-per-node N -m autopar profile [--out PATH] [--mesh 2x4] [--dtypes ...]`;
`python -m autopar plan ...` plans a model offline (`autopar.cli_plan`);
`torchrun ... -m autopar verify --model pkg.module:factory ...` (see `autopar.cli_verify`);
`torchrun ... -m autopar tune --model pkg.module:factory ...` (see `autopar.cli_tune`).

`profile` measures the mesh (see `autopar.profile`) and writes the JSON profile that
`cost_model.load_cluster` reads. It joins the process group torchrun set up (initialising it
with nccl on GPUs, gloo otherwise, when it is not initialised yet) and builds a mesh over the
whole world: 1-D by default, or the shape given by --mesh.
"""

from __future__ import annotations

import argparse
import sys

from autopar import cli_plan
from autopar.cli_verify import mesh_shape, world
from autopar.units import fmt_bytes as _fmt_bytes


def _profile(args: argparse.Namespace) -> int:
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from autopar.profile import profile

    with world():
        device = "cuda" if torch.cuda.is_available() else "cpu"
        mesh = init_device_mesh(device, mesh_shape(args.mesh, dist.get_world_size()))
        dtypes = tuple(d.strip() for d in args.dtypes.split(",") if d.strip())
        cluster = profile(mesh, args.out, dtypes=dtypes, progress=not args.quiet)
        if dist.get_rank() == 0:
            from cost_model.hardware import default_profile_path

            where = args.out or default_profile_path(tuple(mesh.shape))
            print(f"wrote {where}")
            for dt, f in cluster.peak_flops.items():
                print(f"  matmul {dt}: {f / 1e12:.3f} TFLOP/s")
            print(f"  memory copy: {cluster.memory_bytes_per_s / 1e9:.2f} GB/s")
            for dt, rows in (cluster.matmul_table or {}).items():
                print(f"  matmul {dt} by size: " + ", ".join(f"{round((f / 2) ** (1 / 3))}^3 {r / 1e12:.3f}"
                                                             for f, r in rows) + " TFLOP/s")
            for dt, f in (cluster.sdpa_flops or {}).items():
                print(f"  attention {dt} (forward + backward): {f / 1e12:.3f} TFLOP/s")
            print(f"  elementwise/reduction ops: {cluster.vector_bytes_per_s / 1e9:.2f} GB/s, data movement ops: "
                  f"{cluster.copy_bytes_per_s / 1e9:.2f} GB/s, overhead {cluster.op_overhead_s * 1e6:.2f} us per op")
            for i, link in enumerate(cluster.axis_links):
                if link is not None:
                    print(f"  axis {i} ({mesh.shape[i]} ranks): alpha {link.alpha_s * 1e6:.1f} us, "
                          f"{link.bytes_per_s / 1e9:.3f} GB/s per rank")
                    for kind, rows in (link.table or {}).items():
                        print(f"    {kind} in situ: " + ", ".join(f"{_fmt_bytes(n)} {t * 1e3:.2f} ms" for n, t in rows))
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m autopar", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("profile", help="measure this mesh and write a JSON cluster profile")
    p.add_argument("--out", help="where to write the JSON (default: the cache path load_cluster looks at)")
    p.add_argument("--mesh", help="mesh shape over the world, e.g. 2x4 (default: 1-D over all ranks)")
    p.add_argument("--dtypes", default="float32", help="comma-separated matmul dtypes (default: float32)")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    from autopar import cli_verify
    cli_verify.add_parser(sub)
    from autopar import cli_tune
    cli_tune.add_parser(sub)
    cli_plan.add_parser(sub)
    args = parser.parse_args(argv)
    if args.command == "profile":
        return _profile(args)
    if args.command == "plan":
        return cli_plan.run(args)
    if hasattr(args, "run"):
        return args.run(args)
    return 2


if __name__ == "__main__":
    sys.exit(main())
