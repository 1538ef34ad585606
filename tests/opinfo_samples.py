"""Rule-check samples generated from torch's OpInfo database (`common_methods_invocations.op_db`).

`opinfo_samples(ops)` maps each ATen overload of `ops` to `rule_check.Sample`s: every OpInfo's sample inputs
(cpu; float64 where the OpInfo supports it, else int64, else bool; its in-place variant too) are run under a
dispatch mode that records each ATen call at the top of the dispatcher (`_Recorder`): the overload hit, with its
arguments as they were at that point (tensors cloned contiguous). A call of a wanted overload becomes a sample of
that overload, whichever OpInfo made it (an OpInfo for `F.normalize` yields samples of `linalg_vector_norm`,
`clamp_min` and `div`). Which overload a sample hits is thus
observed, never guessed from a name.

Kept per overload: at most `PER_OP` samples, distinct by their argument signature (shapes, dtypes, python values),
small ones (`MAX_NUMEL` elements per tensor, no empty tensor), preferring samples with a dim that divides over 2
(something to shard). Deterministic: OpInfo sample inputs are seeded here (`torch.manual_seed` per OpInfo).

CompositeImplicitAutograd ops never reach a dispatch mode (they decompose above it), so they get no samples here:
those are the ops `passes.decompose` decomposes in the graph instead.
"""

from __future__ import annotations

import contextlib
import functools
import sys
import unittest
import warnings

import torch
from torch.utils import _pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode

from rule_check import Sample

PER_OP = 3
MAX_NUMEL = 2048
SAMPLES_PER_OPINFO = 12  # sample inputs read per OpInfo and variant


class _Recorder(TorchDispatchMode):
    """Records every ATen call that reaches the mode (its nested calls run below it and are not seen)."""

    def __init__(self, wanted: set):
        super().__init__()
        self.wanted = wanted
        self.calls: list[tuple] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in self.wanted:
            self.calls.append((func, _frozen(args), _frozen(kwargs)))
        return func(*args, **kwargs)


def _frozen(a):
    return pytree.tree_map_only(torch.Tensor, lambda t: t.detach().clone().contiguous(), a)


def _signature(args, kwargs) -> str:
    def one(x):
        if isinstance(x, torch.Tensor):
            return f"T{list(x.shape)}{x.dtype}"
        return repr(x)
    flat, spec = pytree.tree_flatten((args, kwargs))
    return ",".join(one(x) for x in flat) + str(spec)


def _usable(args, kwargs) -> bool:
    flat, _ = pytree.tree_flatten((args, kwargs))
    tensors = [x for x in flat if isinstance(x, torch.Tensor)]
    if not tensors:
        return False
    for t in tensors:
        if t.numel() == 0 or t.numel() > MAX_NUMEL or t.is_complex() or t.layout != torch.strided \
                or t.device.type != "cpu" or t.dtype in (torch.float16, torch.bfloat16):
            return False
    return not any(isinstance(x, torch.Generator) for x in flat)


def _shardable(args, kwargs) -> bool:
    flat, _ = pytree.tree_flatten((args, kwargs))
    return any(isinstance(x, torch.Tensor) and any(s % 2 == 0 for s in x.shape) for x in flat)


@functools.lru_cache(maxsize=1)
def _op_db():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        from torch.testing._internal.common_methods_invocations import op_db
    return tuple(op_db)


def opinfo_name(info) -> str:
    return f"{info.name}.{info.variant_test_name}" if info.variant_test_name else info.name


def _dtype(info) -> torch.dtype | None:
    """float64 where the OpInfo supports it, else int64, else bool (bitwise and logical ops)."""
    supported = info.supported_dtypes("cpu")
    return next((d for d in (torch.float64, torch.int64, torch.bool) if d in supported), None)


def _calls(info, wanted: set) -> list[tuple]:
    """The wanted ATen calls made by an OpInfo's first sample inputs (function and in-place variant)."""
    out = []
    dtype = _dtype(info)
    if dtype is None:
        return out
    variants = [info.op] + ([info.inplace_variant] if info.inplace_variant is not None else [])
    for k, fn in enumerate(variants):
        torch.manual_seed(k)
        try:
            samples = info.sample_inputs("cpu", dtype, requires_grad=False)
            for i, s in enumerate(samples):
                if i >= SAMPLES_PER_OPINFO:
                    break
                rec = _Recorder(wanted)
                inp = s.input.clone() if (k and isinstance(s.input, torch.Tensor)) else s.input
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore")
                    with rec:
                        fn(inp, *s.args, **s.kwargs)
                out += rec.calls
        except Exception:  # noqa: BLE001  (an OpInfo whose samples do not run on cpu/float64 here: no samples)
            continue
    return out


@contextlib.contextmanager
def _no_test_fn_crawl():
    """torch's `extract_test_fn` (called by every `OpInfo.sample_inputs`, twice) crawls the whole call stack with
    `inspect.stack()` (which resolves every frame's module: ~0.1 s a call under pytest, 3/4 of the samples' cost)
    looking for a `unittest.TestCase` method; the samples here are drawn outside any TestCase (pytest functions,
    the sweep's script), where it returns None: it is replaced by that None while they are drawn (the samples'
    seeds, `SEED` when it is None, unchanged)."""
    from torch.testing._internal import common_utils
    from torch.testing._internal.opinfo import core
    assert not any(isinstance(f.f_locals.get("self"), unittest.TestCase) for f in _frames()), \
        "opinfo_samples inside a unittest.TestCase: extract_test_fn would find it (and seed by its name)"
    saved = common_utils.extract_test_fn, core.extract_test_fn
    common_utils.extract_test_fn = core.extract_test_fn = lambda: None
    try:
        yield
    finally:
        common_utils.extract_test_fn, core.extract_test_fn = saved


def _frames():
    f = sys._getframe(1)
    while f is not None:
        yield f
        f = f.f_back


@functools.lru_cache(maxsize=None)
def _all_calls(wanted: frozenset, infos: frozenset | None) -> dict:
    found: dict[object, dict[str, tuple]] = {}
    db = _op_db()
    with _no_test_fn_crawl():
        for info in db:
            if infos is not None and opinfo_name(info) not in infos:
                continue
            for func, args, kwargs in _calls(info, set(wanted)):
                if not _usable(args, kwargs):
                    continue
                found.setdefault(func, {}).setdefault(_signature(args, kwargs), (args, kwargs, opinfo_name(info)))
    return found


# Samples left out, with why: (op, OpInfo) -> why. Each is a sample at a point where the op's derivative is not
# defined, which a `Partial` input's summands (their sum rounds) lands on either side of; not a rule's error.
LEFT_OUT = {
    ("aten.clamp.default", "corrcoef"): (
        "clamps a correlation matrix to [-1, 1]: its diagonal is exactly 1, clamp's bound, where the gradient "
        "(1 inside, 0 outside) flips with the rounding of a partial input's sum"),
}
# Ops whose output is uninitialised memory: compared by shape and dtype only.
UNINITIALISED = {"empty_like", "new_empty", "new_empty_strided", "empty_strided", "empty"}


def opinfo_samples(ops, infos=None) -> dict[object, list[Sample]]:
    """Up to PER_OP OpInfo-derived samples for each op of `ops` that any OpInfo reaches (only the OpInfos named in
    `infos`, when given: the sources `passes.checked_ops` recorded, to regenerate a few ops' samples quickly)."""
    found = _all_calls(frozenset(ops), frozenset(infos) if infos is not None else None)
    out: dict[object, list[Sample]] = {}
    for op, by_sig in found.items():
        items = sorted(by_sig.values(), key=lambda v: not _shardable(v[0], v[1]))  # stable: keeps OpInfo order
        items = [v for v in items if (str(op), v[2]) not in LEFT_OUT]
        check = "shape" if op._schema.name.split("::")[1] in UNINITIALISED else "exact"
        out[op] = [Sample(op, args, kwargs, note=f"OpInfo {name}", check=check)
                   for args, kwargs, name in items[:PER_OP]]
    return out
