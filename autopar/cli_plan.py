"""`python -m autopar plan`: plan a model offline, on the meta device (nothing is allocated or run).

    python -m autopar plan --model pkg.module:factory --mesh dp=8,tp=8 --cluster h100
    python -m autopar plan --hf config.json --mesh dp=8,tp=8 --cluster h100 --batch 16 --seq 8192 \\
        [--memory-limit 80GB] [--plan auto|megatron|dp|fsdp|PATH] [--override KEY=FORM ...] \\
        [--out plan.json] [--html report.html] [--explain [KEY]] [--full]

`--model pkg.module:factory`: `factory()` returns `(model, example_inputs)` (called with `batch=` / `seq=`
when those are given); the model may be on the meta device. `--hf CONFIG.json`: a Hugging Face config
file; the model is built on the meta device with `AutoModelForCausalLM.from_config` and held the way
users train it, `m(input_ids, labels=labels).loss` (parameters keep their checkpoint names), on (batch, seq) token ids. Prints a progress line
per stage (capture, recognise, solve, lower) to stderr, then the plan table (with the collectives the lowered
program inserts, unless --no-lower) and its estimate.
"""

from __future__ import annotations

import argparse
import importlib
import inspect
import json
import sys
import time

from autopar.units import parse_bytes

ALL = "*"  # --explain without a key: every structure


def add_parser(sub) -> None:
    p = sub.add_parser("plan", help="plan a model offline (meta device) and print the plan and its estimate",
                       description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--model", metavar="PKG.MODULE:FACTORY", help="a factory returning (model, example_inputs)")
    src.add_argument("--hf", metavar="CONFIG.json", help="a Hugging Face causal-LM config file")
    p.add_argument("--mesh", required=True, help="mesh axis sizes, e.g. dp=8,tp=8")
    p.add_argument("--cluster", help="hardware preset (h100, h200, a100, cpu) or a profile JSON (default: this "
                                     "machine's)")
    p.add_argument("--batch", type=int, help="global batch (--hf default: 8)")
    p.add_argument("--seq", type=int, help="sequence length (--hf default: 2048, at most the config's positions)")
    p.add_argument("--dtype", help="--hf: parameter dtype (default: the config's dtype, else float32)")
    p.add_argument("--memory-limit", help="per-device memory, e.g. 80GB, 76GiB or bytes (default: the cluster's)")
    p.add_argument("--plan", default="auto", help="auto (the ILP), megatron, dp, fsdp, or a saved plan's path")
    p.add_argument("--override", action="append", default=[], metavar="KEY=FORM",
                   help="force a form, e.g. attention=heads@tp or 'layers.*.mlp=replicate' (repeatable)")
    p.add_argument("--microbatches", type=int, help="microbatches of a pipelined plan (--override "
                   "pipeline=1f1b@pp, or auto on a mesh with a pp axis); a pipelined plan is not lowered offline "
                   "(autopar.parallelize runs it)")
    p.add_argument("--out", help="write the plan as JSON")
    p.add_argument("--html", help="write a self-contained HTML report")
    p.add_argument("--explain", nargs="?", const=ALL, metavar="KEY",
                   help="print every candidate of structure KEY (all structures without KEY) and what decided it")
    p.add_argument("--no-lower", action="store_true",
                   help="skip lowering (then the plan lists no collectives; faster on very large models)")
    p.add_argument("--full", action="store_true",
                   help="list every structure's row (default: identical layers in one row, e.g. layers.{0..79}.mlp ×80)")
    p.add_argument("--quiet", action="store_true", help="no progress lines")


def run(args: argparse.Namespace) -> int:
    import autopar

    mesh = parse_mesh(args.mesh)
    limit = parse_size(args.memory_limit) if args.memory_limit else None
    overrides = dict(_parse_override(o) for o in args.override) or None
    say = (lambda *a: None) if args.quiet else (lambda msg: print(f"[autopar plan] {msg}", file=sys.stderr,
                                                                  flush=True))
    t0 = time.perf_counter()
    model, inputs = load_hf(args.hf, args.batch, args.seq, args.dtype) if args.hf else \
        load_factory(args.model, args.batch, args.seq)
    say(f"build: {time.perf_counter() - t0:.1f} s ({_count(model)} parameters)")
    try:  # the user's mistakes are ValueErrors that say what to fix: print them, not a traceback
        from autopar.pipeline_estimate import PIPELINE_AXIS_NAMES
        pipelined = bool(overrides and "pipeline" in overrides) or args.microbatches is not None or (
            args.plan == "auto" and any(a in PIPELINE_AXIS_NAMES for a in mesh))
        plan = autopar.plan(model, mesh, inputs, plan=args.plan, cluster=args.cluster, memory_limit=limit,
                            overrides=overrides, lower=not args.no_lower and not pipelined,
                            progress=lambda stage, s: say(f"{stage}: {s:.1f} s"), microbatches=args.microbatches)
        explained = plan.explain(None if args.explain == ALL else args.explain) if args.explain else ""
    except (ValueError, NotImplementedError) as e:
        raise SystemExit(f"python -m autopar plan: {e}") from None
    print(plan.table(full=args.full))
    if args.out:
        plan.save(args.out)
        print(f"wrote {args.out}")
    if args.html:
        plan.to_html(args.html)
        print(f"wrote {args.html}")
    if explained:
        print()
        print(explained)
    return 0


# ----------------------------------------------------------------------------- arguments

def parse_mesh(text: str) -> dict[str, int]:
    """'dp=8,tp=8' -> {'dp': 8, 'tp': 8}."""
    out = {}
    for part in text.split(","):
        name, eq, size = part.strip().partition("=")
        if not eq or not name.isidentifier() or not size.strip().isdigit() or int(size) < 1:
            raise SystemExit(f"--mesh {text!r}: expected named axis sizes such as dp=8,tp=8 (got {part.strip()!r})")
        if name in out:
            raise SystemExit(f"--mesh {text!r} names axis {name!r} twice")
        out[name] = int(size)
    return out




def parse_size(text: str) -> int | None:
    """`--memory-limit`: '80GB' -> 80e9 bytes, '76GiB' -> 76 * 2**30, '1e9' -> bytes, 'auto' -> None
    (`autopar.units.parse_bytes`); a bad size exits with its message."""
    try:
        return parse_bytes(text, "--memory-limit")
    except (TypeError, ValueError) as e:
        raise SystemExit(str(e)) from None


def _parse_override(text: str) -> tuple[str, str]:
    key, eq, form = text.partition("=")
    if not eq or not key or not form:
        raise SystemExit(f"--override {text!r}: expected KEY=FORM, e.g. attention=heads@tp")
    return key, form


# ----------------------------------------------------------------------------- models

def load_factory(spec: str, batch: int | None, seq: int | None):
    """'pkg.module:factory' -> factory(batch=?, seq=?) -> (model, example_inputs)."""
    mod_name, colon, fn_name = spec.partition(":")
    if not colon or not mod_name or not fn_name:
        raise SystemExit(f"--model {spec!r}: expected pkg.module:factory")
    try:
        fn = getattr(importlib.import_module(mod_name), fn_name)
    except (ImportError, AttributeError) as e:
        raise SystemExit(f"--model {spec!r}: cannot load {fn_name!r} from {mod_name!r}: {e}") from None
    kwargs = {k: v for k, v in (("batch", batch), ("seq", seq)) if v is not None}
    params = inspect.signature(fn).parameters
    missing = [k for k in kwargs if k not in params and not any(p.kind is p.VAR_KEYWORD for p in params.values())]
    if missing:
        raise SystemExit(f"--model {spec!r}: {fn_name} takes no {', '.join(missing)} argument; drop "
                         f"{', '.join('--' + k for k in missing)} or add the parameter to the factory")
    got = fn(**kwargs)
    if not (isinstance(got, tuple) and len(got) == 2):
        raise SystemExit(f"--model {spec!r}: {fn_name}() must return (model, example_inputs), got "
                         f"{type(got).__name__}")
    return got


def load_hf(path: str, batch: int | None, seq: int | None, dtype: str | None):
    """A causal LM from a config file, on the meta device, held as `m(input_ids, labels=labels).loss`."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    try:
        with open(path) as f:
            raw = json.load(f)
    except (OSError, json.JSONDecodeError) as e:
        raise SystemExit(f"--hf {path!r}: cannot read the config JSON: {e}") from None
    if "model_type" not in raw:
        raise SystemExit(f"--hf {path!r}: the config has no 'model_type' (save it with config.to_json_file)")
    config = AutoConfig.for_model(raw.pop("model_type"), **raw)
    name = dtype or getattr(config, "dtype", None) or "float32"
    dt = name if isinstance(name, torch.dtype) else getattr(torch, str(name).removeprefix("torch."), None)
    if not isinstance(dt, torch.dtype):
        raise SystemExit(f"--dtype {name!r}: not a torch dtype (e.g. bfloat16, float32)")
    positions = getattr(config, "max_position_embeddings", None) or 2048
    batch, seq = batch or 8, seq or min(2048, positions)

    with torch.device("meta"):
        model = _with_loss(AutoModelForCausalLM, config)._from_config(config, dtype=dt)
        ids = torch.zeros(batch, seq, dtype=torch.long)
    return model, (ids, ids)


def _with_loss(auto, config):
    """The config's causal-LM class, called the way users train it: `m(input_ids, labels=labels).loss` (a
    subclass, not a wrapper, so that structures and parameters keep the names of the model's checkpoints)."""
    base = auto._model_mapping[type(config)]

    class WithLoss(base):
        def forward(self, input_ids, labels):
            return super().forward(input_ids=input_ids, labels=labels).loss

    WithLoss.__name__ = WithLoss.__qualname__ = base.__name__ + "Loss"
    return WithLoss


def _count(model) -> str:
    n = sum(p.numel() for p in model.parameters())
    return f"{n / 1e9:.2f} B" if n >= 1e9 else f"{n / 1e6:.1f} M"
