"""MoE blocks: recognised on the module tree, verified on the example inputs, their experts captured as one op.

The spellings people write:

| spelling      | what is found                                                        | captured as |
|---------------|----------------------------------------------------------------------|-------------|
| `hf-stacked`  | a Hugging Face experts module: 3-D `gate_up_proj` (E, 2F, H) and `down_proj` (E, H, F), called as `experts(x, top_k_index, top_k_weights)` (Mixtral, Qwen2/3-MoE, OLMoE) | the experts call; the router and the auxiliary loss stay in the traced graph |
| `modulelist`  | a block with a router `nn.Linear(H, E)` and an `nn.ModuleList` of E identical expert modules, run by a Python loop (also the data-dependent `if tokens.numel() == 0: continue` loop that cannot be traced) | the experts' dispatch (below); the router and the losses stay in the traced graph |
| `grouped`     | a block with a router and a torchtitan-style `GroupedExperts` child: 3-D `w1` (E, F, H), `w2` (E, H, F), `w3` (E, F, H), grouped or looped matmuls over tokens sorted by expert | the experts' dispatch |

**The dispatch** (`passes/moe_dispatch.py`): the block's own forward is recorded on its example input, the
tokens `x`, chosen experts `idx` (T, k) and weights (T, k) the user's code computed are found, and the
computation of the experts on their routed tokens (the loop, or the sort and grouped call, and the
combination) is replaced — for the trace only — by `autopar::moe_experts(x, idx, weights)`. Everything
else (router, softmax or sigmoid, top-k or argmaxes, renormalisation, auxiliary and z-losses) is
traced as written, and its sharding follows the op rules (`passes/rules.py`: means over sharded tokens are
global sums divided by the global count, `histc`/`bincount` of sharded tokens partial sums reduced before
use, so a loss made of products of such means equals one device's).

**Canonical forms**, where the dispatch cannot be captured: the whole block replaced by router linear,
softmax and top-k (in either order, top-k weights renormalised or not, router in fp32 or not), then
`autopar::moe_experts`, then the outputs the block returns: `y`, `(y, aux_loss)` or `(y, router_logits)`, the
auxiliary loss being the switch load-balancing loss `E * sum_e mean_t(count_te) * mean_t(p_te)` (divided by k
for the Switch/Megatron normalisation).

Nothing is replaced on trust: the block (or experts module) runs eagerly on the example inputs and each
candidate — the captured dispatch first, then each canonical form — is compared with it, outputs and the
gradients of input and parameters. The first that matches is used; if none does, the module is left as it
is (traced as written, or opaque and replicated) and the capture notes say why.

Tensor-parallel experts (`forms/moe_tp.py`) need each expert parameter's FFN dim (`_ffn_dims`): known for
the stacked spellings, inferred from a ModuleList expert's shapes and checked numerically.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import inspect
import itertools
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import fx, nn

from autopar.runtime import moe as rt
from passes import moe_dispatch as D
from cost_model.hardware import dtype_name
from autopar.sites import MoeSite, PassContext

MOE_OP = torch.ops.autopar.moe_experts.default


@dataclass
class Found:
    path: str
    module: nn.Module
    level: str  # "experts" (HF experts module) or "block"
    spelling: str
    num_experts: int
    router: nn.Module | None = None
    experts: nn.Module | None = None  # the ModuleList or the GroupedExperts child
    expert_params: list[str] = field(default_factory=list)  # names on one expert (modulelist) or stacked names
    top_k_hint: int | None = None


# ----------------------------------------------------------------------------- detection

def _top_k_attr(*mods) -> int | None:
    for m in mods:
        for a in ("top_k", "num_experts_per_tok", "k", "topk"):
            v = getattr(m, a, None)
            if isinstance(v, int) and v > 0:
                return v
    return None


def _is_hf_experts(mod: nn.Module) -> bool:
    p = dict(mod.named_parameters(recurse=False))
    if set(p) != {"gate_up_proj", "down_proj"} or p["gate_up_proj"].dim() != 3 or p["down_proj"].dim() != 3:
        return False
    try:
        names = list(inspect.signature(mod.forward).parameters)
    except (TypeError, ValueError):
        return False
    return names[:3] == ["hidden_states", "top_k_index", "top_k_weights"] and hasattr(mod, "act_fn")


def _router_of(mod: nn.Module, num_experts: int, hidden: int | None):
    for name, child in mod.named_children():
        if isinstance(child, nn.Linear) and child.out_features == num_experts and \
                (hidden is None or child.in_features == hidden):
            return name, child
    return None


def find_moe_modules(model: nn.Module) -> list[Found]:
    found: list[Found] = []
    taken: list[str] = []
    for path, mod in model.named_modules():
        if any(path == t or path.startswith(t + ".") for t in taken):
            continue
        if _is_hf_experts(mod):
            E = mod.gate_up_proj.shape[0]
            found.append(Found(path, mod, "experts", "hf-stacked", E, expert_params=["gate_up_proj", "down_proj"]))
            taken.append(path)
            continue
        for cname, child in mod.named_children():
            if isinstance(child, nn.ModuleList) and len(child) > 1:
                kinds = {type(e) for e in child}
                shapes = {tuple((n, tuple(p.shape)) for n, p in e.named_parameters()) for e in child}
                if len(kinds) != 1 or len(shapes) != 1 or not next(iter(shapes)):
                    continue
                r = _router_of(mod, len(child), None)
                if r is None:
                    continue
                names = [n for n, _ in child[0].named_parameters()]
                found.append(Found(path, mod, "block", "modulelist", len(child), router=r[1], experts=child,
                                   expert_params=names, top_k_hint=_top_k_attr(mod, r[1])))
                taken.append(path)
                break
            p = dict(child.named_parameters(recurse=False))
            if {"w1", "w2", "w3"} <= set(p) and all(p[n].dim() == 3 for n in ("w1", "w2", "w3")):
                E = p["w1"].shape[0]
                r = _router_of(mod, E, p["w1"].shape[2])
                if r is None:
                    continue
                found.append(Found(path, mod, "block", "grouped", E, router=r[1], experts=child,
                                   expert_params=["w1", "w2", "w3"], top_k_hint=_top_k_attr(mod, r[1], child)))
                taken.append(path)
                break
    return found


# ----------------------------------------------------------------------------- canonical forms

@dataclass(frozen=True)
class Routing:
    top_k: int
    order: str  # "softmax_topk" | "topk_softmax"
    renorm: bool
    fp32: bool
    aux: str | None  # None | "hf" | "switch"
    output: str  # "y" | "y_aux" | "y_logits"


def _stacked(found: Found) -> list[torch.Tensor]:
    if found.spelling == "modulelist":
        per = [dict(e.named_parameters()) for e in found.experts]
        return [torch.stack([p[n] for p in per]) for n in found.expert_params]
    return [getattr(found.experts, n) for n in found.expert_params]


def canonical_block(found: Found, key: str, routing: Routing, op=None):
    """The block's forward in canonical form; `op` is the experts call (the custom op while tracing)."""
    op = op or (lambda k, x, idx, w, params: rt.moe_experts(x, idx, w, params, k))
    E = found.num_experts

    def forward(x):
        shape = x.shape
        xf = x.reshape(-1, shape[-1])
        logits = found.router(xf)
        scores = logits.float() if routing.fp32 else logits
        probs = F.softmax(scores, dim=-1)
        if routing.order == "softmax_topk":
            w, idx = torch.topk(probs, routing.top_k, dim=-1)
            if routing.renorm:
                w = w / w.sum(dim=-1, keepdim=True)
        else:
            top, idx = torch.topk(scores, routing.top_k, dim=-1)
            w = F.softmax(top, dim=-1)
        y = op(key, xf, idx, w.to(x.dtype), _stacked(found)).reshape(shape)
        if routing.output == "y":
            return y
        if routing.output == "y_logits":
            return y, logits
        frac = (idx.unsqueeze(-1) == torch.arange(E, device=idx.device)).to(probs.dtype).sum(1).mean(0)
        aux = E * (frac * probs.mean(0)).sum()
        if routing.aux == "switch":
            aux = aux / routing.top_k
        return y, aux

    return forward


def canonical_experts(found: Found, key: str, op=None):
    op = op or (lambda k, x, idx, w, params: rt.moe_experts(x, idx, w, params, k))
    mod = found.module

    def forward(hidden_states, top_k_index, top_k_weights):
        return op(key, hidden_states, top_k_index, top_k_weights.to(hidden_states.dtype),
                  [mod.gate_up_proj, mod.down_proj])

    return forward


def _graph_op(k, x, idx, w, params):
    return torch.ops.autopar.moe_experts(k, x, idx, w, list(params))


# Tensor-parallel experts: where each stacked weight keeps the expert's hidden (FFN) features. HF's
# gate_up_proj is gate and up concatenated: two blocks, each split over the axis. A ModuleList expert is any
# module: its FFN dims are inferred from its parameters' shapes and checked (`_ffn_dims`).
_FFN_DIMS = {"hf-stacked": [(1, 2), (2, 1)], "grouped": [(1, 1), (2, 1), (1, 1)]}


def _half(p: torch.Tensor, d: int, k: int, i: int) -> torch.Tensor:
    """Half i of p's FFN features on dim d (k blocks, each halved)."""
    return torch.cat([torch.tensor_split(b, 2, d)[i] for b in p.chunk(k, d)], d)


def _ffn_dims(f: Found, fn, hidden: int) -> tuple[list[tuple[int, int]] | None, str]:
    """Where each expert parameter keeps the expert's FFN features (for tensor-parallel experts), or why they
    cannot be split: a ModuleList expert's 2-D weights must be (F, H) or (H, F) and its 1-D ones (F,) with one
    F != H; and (for a ModuleList expert or a GroupedExperts module's own forward) an expert on random rows must
    give the sum of what its two halves of the FFN features give."""
    if f.spelling == "hf-stacked":
        return _FFN_DIMS[f.spelling], ""
    if f.spelling == "grouped":
        dims = [(d - 1, k) for d, k in _FFN_DIMS["grouped"]]
        one = [getattr(f.experts, n)[0] for n in f.expert_params]
        if one[0].is_meta:  # planned as recognised (torchtitan's expert function)
            return _FFN_DIMS[f.spelling], ""
    else:
        one = [dict(f.experts[0].named_parameters())[n] for n in f.expert_params]
        dims, features = [], set()
        for n, p in zip(f.expert_params, one):
            if p.dim() == 2 and p.shape[1] == hidden != p.shape[0]:
                dims.append((0, 1))
            elif p.dim() == 2 and p.shape[0] == hidden != p.shape[1]:
                dims.append((1, 1))
            elif p.dim() == 1 and p.shape[0] != hidden:
                dims.append((0, 1))
            else:
                return None, (f"its expert's parameter {n} {tuple(p.shape)} has no dim of FFN features apart from "
                              f"the hidden size {hidden}")
            features.add(p.shape[dims[-1][0]])
        if len(features) != 1:
            return None, f"its expert's parameters have several FFN sizes ({sorted(features)})"
    if any(p.is_meta for p in one):
        return None, "splitting its experts is checked on real weights, and the model is on the meta device"
    x = torch.randn(6, hidden, generator=torch.Generator().manual_seed(2), dtype=torch.float64).to(one[0].dtype)
    with torch.no_grad():
        halves = [fn([_half(p, d, k, i) for p, (d, k) in zip(one, dims)], x) for i in (0, 1)]
        if not _close(halves[0] + halves[1], fn(one, x)):
            return None, "its expert's output is not the sum of what the two halves of its FFN features give"
    return ([(d + 1, k) for d, k in dims] if f.spelling == "grouped" else dims), ""


# ----------------------------------------------------------------------------- verification

def _tol(dtype) -> tuple[float, float]:
    return {torch.float64: (1e-9, 1e-11), torch.float32: (1e-4, 1e-6)}.get(dtype, (2e-2, 2e-2))


def _flat(out) -> list[torch.Tensor]:
    from torch.utils import _pytree as pytree
    return [t for t in pytree.tree_leaves(out) if isinstance(t, torch.Tensor)]


def _compare(mod: nn.Module, fn, args: tuple, params: list[nn.Parameter]) -> str | None:
    """None if fn(*args) matches mod(*args) in outputs and in gradients of floating inputs and parameters."""
    def run(f):
        xs = [a.detach().clone().requires_grad_(a.is_floating_point()) if isinstance(a, torch.Tensor) else a
              for a in args]
        outs = _flat(f(*xs))
        return xs, outs

    xs_ref, ref = run(mod)
    if not ref:
        return "it returns no tensor"
    xs_can, got = run(fn)
    if len(got) != len(ref):
        return f"it returns {len(ref)} tensors, the canonical form {len(got)}"
    for i, (a, b) in enumerate(zip(ref, got)):
        if a.shape != b.shape:
            return f"output {i} has shape {tuple(a.shape)}, the canonical form {tuple(b.shape)}"
        rtol, atol = _tol(a.dtype)
        if not torch.allclose(a.to(b.dtype), b, rtol=rtol, atol=atol):
            return f"output {i} differs by {float((a.to(b.dtype) - b).abs().max()):.3g}"
    wrt_ref = [x for x in xs_ref if isinstance(x, torch.Tensor) and x.requires_grad]
    wrt_can = [x for x in xs_can if isinstance(x, torch.Tensor) and x.requires_grad]
    gen = torch.Generator().manual_seed(0)
    cot = [torch.randn(t.shape, generator=gen, dtype=torch.float64).to(t.dtype) for t in ref]

    def grads(outs, xs):
        pairs = [(o, c) for o, c in zip(outs, cot) if o.requires_grad]
        if not pairs:
            return []
        # backward(inputs=...), not autograd.grad: under a FlopCounterMode (its module hooks) autograd.grad on leaves
        # raises, and a user counting a step that re-captures the model must not crash; the parameters' own
        # gradients are put back afterwards
        wrt, saved = xs + params, [p.grad for p in params]
        try:
            for t in wrt:
                t.grad = None
            torch.autograd.backward([o for o, _ in pairs], [c for _, c in pairs], inputs=wrt)
            return [t.grad for t in wrt]
        finally:
            for p, g in zip(params, saved):
                p.grad = g

    g_ref, g_can = grads(ref, wrt_ref), grads(got, wrt_can)
    names = [f"input {i}" for i in range(len(wrt_ref))] + [f"parameter {i}" for i in range(len(params))]
    for name, a, b in zip(names, g_ref, g_can):
        if (a is None) != (b is None) and not ((a is None and b.abs().max() == 0) or (b is None and a.abs().max() == 0)):
            return f"the gradient of {name} is missing on one side"
        if a is not None and b is not None:
            rtol, atol = _tol(a.dtype)
            if not torch.allclose(a, b.to(a.dtype), rtol=rtol * 10, atol=atol * 10):
                return f"the gradient of {name} differs by {float((a - b.to(a.dtype)).abs().max()):.3g}"
    return None


def _routings(found: Found, out) -> list[Routing]:
    flat = _flat(out)
    if len(flat) == 1:
        outputs = [("y", None)]
    elif len(flat) == 2 and flat[1].dim() == 0:
        outputs = [("y_aux", "switch"), ("y_aux", "hf")]
    elif len(flat) == 2 and flat[1].dim() == 2 and flat[1].shape[-1] == found.num_experts:
        outputs = [("y_logits", None)]
    else:
        return []
    ks = [found.top_k_hint] if found.top_k_hint else list(range(1, min(found.num_experts, 4) + 1))
    out = []
    for k, (output, aux), (order, renorm), fp32 in itertools.product(
            ks, outputs, [("softmax_topk", True), ("softmax_topk", False), ("topk_softmax", False)], [False, True]):
        out.append(Routing(k, order, renorm, fp32, aux, output))
    return out


@dataclass
class Verified:
    found: Found
    key: str
    forward: object  # the canonical forward with the graph op, patched in while tracing
    routing: Routing | None


def _record(model: nn.Module, mods: dict[str, nn.Module], args: tuple, kwargs: dict) -> dict[str, tuple]:
    seen: dict[str, tuple] = {}

    def hook(path):
        def h(m, a, k, o):
            if path not in seen:
                seen[path] = (tuple(x.detach().clone() if isinstance(x, torch.Tensor) else x for x in a), dict(k), o)
        return h

    handles = [m.register_forward_hook(hook(p), with_kwargs=True) for p, m in mods.items()]
    try:
        with torch.no_grad():
            model(*args, **kwargs)
    finally:
        for h in handles:
            h.remove()
    return seen


def _perturbed(args: tuple) -> tuple:
    """The block's input moved by half its spread: another routing of the same tokens."""
    x = args[0]
    g = torch.Generator(device=x.device).manual_seed(1)
    noise = torch.randn(x.shape, generator=g, dtype=torch.float64, device=x.device).to(x.dtype)
    return (x + 0.5 * float(x.detach().float().std()) * noise, *args[1:])


def _expert_fn(f: Found, rec: D.Recording):
    """The function of one expert the runtime calls (`ExpertsSpec.expert_fn`), checked on every recorded expert
    call: a ModuleList expert's own module with another expert's parameters; for GroupedExperts, torchtitan's
    `w2(silu(w1 x) * w3 x)` or, if that is not what it computes, the module itself called with one expert."""
    calls = [e for e in rec.entries if e.expert is not None]
    if f.spelling == "modulelist":
        fn = rt.module_expert(f.experts[0], f.expert_params)
        per = [[dict(m.named_parameters())[n] for n in f.expert_params] for m in f.experts]
        for e in calls:
            got = fn(per[e.expert], rec.snapshot[e.ins[0]])
            if not _close(got, rec.snapshot[e.outs[0]]):
                return None, (f"expert {e.expert} is not its first expert's module run with its parameters "
                              "(a buffer or attribute differs)")
        return fn, ""
    stacked = [getattr(f.experts, n) for n in f.expert_params]
    rows, counts = rec.snapshot[calls[0].ins[0]], next(
        (rec.snapshot[v] for v in calls[0].ins[1:] if rec.snapshot[v].shape == (f.num_experts,)
         and not rec.snapshot[v].is_floating_point()), None)
    if len(calls) != 1 or counts is None:
        return rt.grouped_expert(getattr(f.experts, "act_fn", F.silu)), ""
    for fn in (rt.grouped_expert(getattr(f.experts, "act_fn", F.silu)),
               rt.grouped_module_expert(f.experts, f.expert_params, counts.dtype)):
        spec = rt.ExpertsSpec(f.path, f.num_experts, 0, list(f.expert_params), fn, f.spelling)
        if _close(rt._run_grouped(spec, stacked, rows, counts.tolist()), rec.snapshot[calls[0].outs[0]]):
            return fn, ""
    return None, "its grouped experts, run one expert at a time on their rows, do not give what its call gives"


def _close(a: torch.Tensor, b: torch.Tensor) -> bool:
    rtol, atol = _tol(b.dtype)
    return a.shape == b.shape and bool(torch.allclose(a.to(b.dtype), b, rtol=rtol, atol=atol))


def _capture_dispatch(f: Found, spec: rt.ExpertsSpec, key: str, args: tuple, params: list[nn.Parameter]):
    """The block with its own forward kept and only its experts' dispatch captured (`passes.moe_dispatch`),
    verified; or None and why not."""
    experts = list(f.experts) if f.spelling == "modulelist" else [f.experts]
    grouped = f.spelling == "grouped"
    forward = f.module.forward
    try:
        rec = D.record(forward, args, experts, grouped)
    except Exception as e:  # noqa: BLE001 - any failure of the user's forward under recording is a reason
        return None, f"its forward could not be recorded: {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
    if not any(e.expert is not None for e in rec.entries):
        return None, "its experts are never called in its forward"
    with torch.no_grad():
        fn, why = _expert_fn(f, rec)
    if fn is None:
        return None, why
    spec_fn = spec.expert_fn
    spec.expert_fn = fn

    def all_experts(x):
        stacked = _stacked(f)
        return torch.stack([fn([p[e] for p in stacked], x) for e in range(f.num_experts)])

    def eager_op(x, idx, w):
        return rt.moe_experts(x, idx, w, _stacked(f), key)

    def verify(split: D.Split) -> str | None:
        spec.top_k = split.top_k
        replay = D.replay_forward(forward, rec, split, experts, grouped, eager_op)
        try:
            why = _compare(f.module, replay, args, params)
            if why is None:
                why = _compare(f.module, replay, _perturbed(args), params)
                why = why and f"on an input routed differently, {why}"
        except D.Diverged as e:
            why = f"replaying it diverges: {e}"
        except Exception as e:  # noqa: BLE001 - a replay that breaks (e.g. on the input routed differently) is a reason
            why = f"replaying it fails: {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
        return why

    split, why = D.find_split(rec, num_experts=f.num_experts, all_experts=all_experts,
                              capacity_factor=spec.capacity_factor, verify=verify)
    if split is None:
        spec.expert_fn = spec_fn
        return None, why
    spec.top_k = split.top_k

    def graph_op(x, idx, w):
        return _graph_op(key, x, idx, w, _stacked(f))

    return Verified(f, key, D.replay_forward(forward, rec, split, experts, grouped, graph_op), None), ""


def recognise_moe_modules(model: nn.Module, args: tuple, kwargs: dict, notes: list[str]) -> list[Verified]:
    """Find MoE blocks, verify a canonical form of each on the example inputs; notes say what and why."""
    found = find_moe_modules(model)
    if not found:
        return []
    real = all(not t.is_meta for t in model.parameters())
    seen = _record(model, {f.path: f.module for f in found}, args, kwargs) if real else {}
    out = []
    for f in found:
        spec_fn = {"hf-stacked": lambda: rt.gated_hf_expert(f.module.act_fn),
                   "grouped": lambda: rt.grouped_expert(getattr(f.experts, "act_fn", F.silu)),
                   "modulelist": lambda: rt.module_expert(f.experts[0], f.expert_params)}[f.spelling]
        spec = rt.ExpertsSpec(f.path, f.num_experts, 0, list(f.expert_params), spec_fn(), f.spelling,
                              capacity_factor=getattr(f.module, "capacity_factor", None) if f.level == "block" else None)
        key = rt.register(spec, f.module)
        params = list(f.module.parameters())
        if not real and f.level == "experts":  # a meta model: verified on a shrunken copy (passes.moe_shrunken)
            from passes.moe_shrunken import owner_config, verify_shrunken
            spec.top_k = _meta_top_k(model, f, owner_config(model, f.path))
            why = verify_shrunken(f, model, spec.top_k, functools.partial(_check_copy, f))
            if why is None:
                notes.append(f"MoE {f.path} ({f.spelling}, {f.num_experts} experts, top-{spec.top_k}) on the meta "
                             "device: verified on a shrunken copy built with the same code and config (small sizes, "
                             "random weights) and checked to compute as it does")
                out.append(Verified(f, key, canonical_experts(f, key, _graph_op), None))
            else:
                notes.append(f"MoE {f.path} ({f.spelling}) left as written (replicated): the model is on the meta "
                             f"device, and autopar's expert-parallel form could not be verified on a shrunken copy: "
                             f"{why}")
            continue
        if not real:  # planning on meta: nothing can run; routing details do not change the cost
            notes.append(f"MoE {f.path} ({f.spelling}) not verified: the model is on the meta device; it is planned "
                         "as recognised, and verified when parallelised with real parameters")
            # a block: assumed to return y alone (a block returning a loss too must be planned with real weights)
            spec.top_k = f.top_k_hint or 2
            guess = Routing(spec.top_k, "softmax_topk", True, False, None, "y")
            out.append(Verified(f, key, canonical_block(f, key, guess, _graph_op), guess))
            continue
        if f.path not in seen:
            notes.append(f"MoE {f.path} ({f.spelling}) left as written: it did not run on the example inputs")
            continue
        a, kw, o = seen[f.path]
        if kw:
            notes.append(f"MoE {f.path} left as written: it is called with keyword arguments ({', '.join(kw)})")
            continue
        if f.level == "experts":
            spec.top_k = a[1].shape[-1]
            why = _compare(f.module, canonical_experts(f, key), a, params)
            if why is None:
                out.append(Verified(f, key, canonical_experts(f, key, _graph_op), None))
            else:
                notes.append(f"MoE {f.path} ({f.spelling}) left as written (replicated): autopar's expert-parallel "
                             f"form does not reproduce it on the example inputs: {why}")
            continue
        if len(a) != 1 or not isinstance(a[0], torch.Tensor):
            notes.append(f"MoE {f.path} left as written: its forward takes {len(a)} inputs, not one tensor")
            continue
        v, dispatch_why = _capture_dispatch(f, spec, key, a, params)
        if v is not None:
            notes.append(f"MoE {f.path} ({f.spelling}, {f.num_experts} experts, top-{spec.top_k}"
                         f"{f', capacity factor {spec.capacity_factor:g}' if spec.capacity_factor is not None else ''}) "
                         "verified on the example inputs: its own router and auxiliary losses are kept as written, "
                         "its experts' dispatch is captured as autopar::moe_experts")
            out.append(v)
            continue
        why, chosen = "no routing form matched", None
        for routing in _routings(f, o):
            spec.top_k = routing.top_k
            why = _compare(f.module, canonical_block(f, key, routing), a, params)
            if why is None:
                chosen = routing
                break
        if chosen is None:
            notes.append(f"MoE {f.path} ({f.spelling}) left as written (replicated): autopar cannot capture how it "
                         f"dispatches tokens to its experts ({dispatch_why}), and no canonical form of its routing "
                         f"reproduces it on the example inputs (last difference: {why})")
            continue
        spec.top_k = chosen.top_k
        notes.append(f"MoE {f.path} ({f.spelling}, {f.num_experts} experts, top-{chosen.top_k}, {chosen.order}"
                     f"{', renormalised' if chosen.renorm else ''}"
                     f"{f', capacity factor {spec.capacity_factor:g}' if spec.capacity_factor is not None else ''}{', aux ' + chosen.aux if chosen.aux else ''}) "
                     "verified on the example inputs in a canonical form (its dispatch could not be captured: "
                     f"{dispatch_why})")
        out.append(Verified(f, key, canonical_block(f, key, chosen, _graph_op), chosen))
    for v in out:
        spec = rt.spec_of(v.key)
        hidden = v.found.router.in_features if v.found.router is not None else None
        spec.ffn_dims, spec.ffn_why = _ffn_dims(v.found, spec.expert_fn, hidden)
    return out


def _check_copy(f: Found, copy: nn.Module, key: str, args: tuple) -> str | None:
    """Why a materialised copy of experts module `f` differs from its canonical form on `args`, or None."""
    found = dataclasses.replace(f, module=copy)
    return _compare(copy, canonical_experts(found, key), args, list(copy.parameters()))


def _meta_top_k(model: nn.Module, f: Found, config) -> int:
    """Experts per token of a Hugging Face experts module on the meta device (its block's or router's `top_k`, else
    the config's `num_experts_per_tok`): the routing of the shrunken copy it is verified on."""
    parent = model.get_submodule(f.path.rsplit(".", 1)[0]) if "." in f.path else model
    k = _top_k_attr(parent, *parent.children()) or getattr(config, "num_experts_per_tok", None)
    return min(k if isinstance(k, int) and k > 0 else 2, f.num_experts)


@contextlib.contextmanager
def canonical_forwards(verified: list[Verified]):
    """While tracing, each verified module runs its canonical form (with the graph op)."""
    for v in verified:
        v.found.module.forward = v.forward
    try:
        yield
    finally:
        for v in verified:
            del v.found.module.forward


# ----------------------------------------------------------------------------- graph recognition

def recognise_moe_pass(gm: fx.GraphModule, ctx: PassContext) -> fx.GraphModule:
    for node in gm.graph.nodes:
        if node.op != "call_function" or node.target is not MOE_OP:
            continue
        key, x, idx, w, params = node.args
        spec = rt.spec_of(key)
        roles = []
        for name, p in zip(spec.param_names, params):
            if p.op == "placeholder":
                roles.append((name, p.name))
            elif p.target is torch.ops.aten.stack.default:  # ModuleList experts stacked in the graph
                roles += [(f"{i}.{name}", q.name) for i, q in enumerate(p.args[0]) if q.op == "placeholder"]
        t, h = x.meta["val"].shape
        stacked = all(p.op == "placeholder" for p in params)
        ffn, dims, why = None, None, spec.ffn_why
        if spec.ffn_dims and stacked:
            dims = tuple(spec.ffn_dims)
            ffn = params[0].meta["val"].shape[dims[0][0]] // dims[0][1]
        elif spec.ffn_dims and len(roles) == spec.num_experts * len(spec.param_names):  # ModuleList: per expert
            by_name = dict(zip(spec.param_names, spec.ffn_dims))
            dims = tuple(by_name[role.split(".", 1)[1]] for role, _ in roles)
            first = params[0].args[0][0].meta["val"]  # expert 0's first parameter
            ffn = first.shape[dims[0][0]] // dims[0][1]
        elif spec.ffn_dims:
            why = "its experts' parameters are not all graph inputs"
        ctx.add(MoeSite(key=spec.path, node=node, params=tuple(roles), spec_key=key, spelling=spec.spelling,
                        num_experts=spec.num_experts, top_k=idx.meta["val"].shape[-1], tokens=t, hidden=h,
                        ffn_features=ffn, ffn_dims=dims, ffn_why=why,
                        stacked=stacked, expert_numel=sum(p.meta["val"].numel() for p in params),
                        itemsize=x.meta["val"].element_size(), dtype=dtype_name(x.meta["val"].dtype)))
    return gm
