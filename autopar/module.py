"""The parallel model users hold: `ParallelModule`, and how its parameters become DTensors.

`pm(*inputs)` takes the same global inputs as the model (with `parallelize(..., inputs="local")`, each
data-parallel rank's own shard of the batch) and returns the same outputs on every rank; every call agrees with the
other ranks on its shapes and, under inputs="global", on its values (`autopar.agree.agree_on_call`: one small
all-reduce left in flight until the program's first collective; `pm.check_inputs = False` skips the values;
under inputs="local" on a 1-D mesh `autopar.agree.SummedAgreement`, riding on the loss's all-reduce);
parameters keep their fully-qualified names (tied weights stay tied) and are DTensors with the plan's
placements (`shard_tensor`; a ModuleList expert under expert parallelism lives whole on the ranks that
own it, `owned_tensor`); buffers are registered as they were. Making one installs DTensor's fast path for
pointwise ops with Python-number arguments (`autopar.runtime.scalar_ops`), which optimizers issue per parameter. The rewritten local program runs on the
local shards.

The program is specialised on what the capture saw (`autopar.relower`): input shapes and dtypes, non-tensor
input values, train/eval mode, autocast state, parameter dtypes. A call that differs in any of these (another
sequence length or batch size, `pm.eval()`, `pm.to(torch.bfloat16)`, a changed `scale=` keyword, autocast on)
re-captures the model (from a meta copy of its structure) and lowers the same plan's forms for it, once; the programs are cached
per guard key, at most `ParallelModule.max_programs` (8) of them, least recently used dropped. Every program
reads the same parameters.

A model on the meta device gets only this rank's shards, allocated uninitialised (`empty_like_placed`), and its
non-persistent buffers computed (`autopar.weights.compute_buffers`); until `autopar.load` or `init_weights`
fills every parameter and persistent buffer, `forward` raises.
"""

from __future__ import annotations

from collections import OrderedDict

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor
from torch.distributed._functional_collectives import AsyncCollectiveTensor
from torch.utils import _pytree as pytree

from autopar.agree import SummedAgreement, agree_on_call, one_process
from autopar.inputs import batch_dims, data_degree
from autopar.capture import split_example_inputs
from autopar.captured import Captured
from autopar.checkpoint import strided_to_replicated, to_placements
from autopar.mesh import mesh_info, resolve_axis
from autopar.plan import GATHER_PERSIST, DirectiveKind, Plan
from autopar.precision import Precision, cast_inputs, cast_outputs
from autopar.relower import Program, describe_key, guard_key, make_program, relower
from autopar.replaced import mark_replaced
from autopar.runtime.collectives import after_backward, before_next_collective, ride_on_loss, settle_pending
from autopar.runtime.fsdp import fsdp_step, persist_versions
from autopar.runtime.ops import advance_rng_stream, riding_loss_axis
from autopar.runtime import local_step, scalar_ops
from autopar.dtensors import empty_like_placed, mesh_device, owned_tensor, shard_tensor, to_locals
from autopar.weights import compute_buffers, init_weights, is_meta_model, meta_copy
from autopar.spec import is_owned
from passes.moe import find_moe_modules



def register_at(root: nn.Module, fqn: str, value, *, buffer: bool = False, persistent: bool = True,
                replace: bool = False) -> None:
    """Put a parameter (or buffer) under its dotted name on `root`, making plain `nn.Module` parents as needed, so
    that the user's names survive on a rebuilt module. `replace`: overwrite an existing parameter entry as is (a
    DTensor of another type than `nn.Parameter`)."""
    *path, leaf = fqn.split(".")
    mod = root
    for part in path:
        if not hasattr(mod, part) or not isinstance(getattr(mod, part), nn.Module):
            mod.add_module(part, nn.Module())
        mod = getattr(mod, part)
    if buffer:
        mod.register_buffer(leaf, value, persistent=persistent)
    elif replace:
        mod._parameters[leaf] = value
    else:
        mod.register_parameter(leaf, value)

class ParallelModule(nn.Module):
    """The model as a distributed program: parameters are DTensors under their original names.

    `pm(*inputs)` takes the same global inputs as the model and returns the same outputs on every
    rank; after `backward()` every parameter's gradient is its full single-device gradient,
    sharded like the parameter. `pm.plan` is what was chosen; `pm.graph_module` is the rewritten
    local program, with every collective an explicit node (both of the program the last call ran).

    `pm.train()` / `pm.eval()`, `pm.to(dtype)`, autocast around `pm`, other input shapes and other values of
    non-tensor inputs behave as on the model: each new combination re-captures the model (a meta copy of its
    structure, `autopar.weights.meta_copy`; not a submodule) in that mode and with those dtypes, and lowers the same
    plan's forms for it (`autopar.relower`). At most `max_programs` programs are kept (least recently used
    dropped); a call that needs a new one pays a capture and a lowering.

    `pm` keeps no reference to the model's parameters or buffers (nor do its programs): the parameters were copied
    into `pm`'s shards, and the user's own reference is the only one left, so `del model` frees the unsharded copy
    (FSDP2's `fully_shard` frees it by replacing the parameters in place; `parallelize` returns a new module and
    leaves the model as it was, for comparisons and a single-device run). Tested in tests/test_release.py. Not yet
    for a model with MoE blocks (kept, to verify their canonical form on real weights at each re-capture), nor for
    an opaque submodule's parameters (held by `autopar.runtime.opaque`'s registry).
    """

    max_programs: int = 8
    # inputs="global": every call checks that every rank passed the same values (a digest of each tensor input in
    # the call's all-reduce, left in flight); False skips that check where the ranks are known to agree
    check_inputs: bool = True

    def __init__(self, model: nn.Module, mesh: DeviceMesh, captured: Captured, plan: Plan, gm, rng_stream: str,
                 example_inputs=None, local: tuple | None = None):
        super().__init__()
        scalar_ops.install()  # optimizers' `p.mul_(0.9)` on the DTensor parameters: on the local shard directly
        self._mesh = mesh
        self._owners: dict[str, tuple[nn.Module, str]] = {}  # fqn -> (owning submodule, name): `_lookup`
        # re-captured for new call conditions; not a submodule. A meta copy of the structure: pm holds no reference
        # to the model's parameter storage, so the user's own reference is the only one (`del model` frees it)
        # (not yet for a model with MoE blocks: capture verifies their canonical form by running them on real weights)
        object.__setattr__(self, "_model", model if is_meta_model(model) or find_moe_modules(model)
                           else meta_copy(model))
        pls = plan.param_placements()
        # parameters: one DTensor per distinct tensor, registered under every original name
        made: dict[int, nn.Parameter] = {}
        # a meta-device model: each rank allocates only its shards, filled by `autopar.load` or `init_weights`
        self._unfilled: set[str] = set()
        object.__setattr__(self, "_source", model if is_meta_model(model) else None)
        computed = compute_buffers(model, mesh_device(mesh)) if self._source is not None else {}
        for fqn, p in model.named_parameters(remove_duplicate=False):
            if id(p) not in made:
                placements = pls.get(fqn) or self._placement_of_alias(model, p, pls)
                data = p.detach()
                if isinstance(data, DTensor):
                    raise ValueError(f"parameter {fqn} is already a DTensor; pass the unparallelised model")
                if data.is_meta:
                    value = empty_like_placed(data, mesh, placements)
                    self._unfilled.add(fqn)
                else:
                    value = owned_tensor(data, mesh, placements) if any(map(is_owned, placements)) else \
                        shard_tensor(data, mesh, placements)
                made[id(p)] = nn.Parameter(value, requires_grad=p.requires_grad)
            self._register(fqn, made[id(p)])
        for fqn, b in model.named_buffers(remove_duplicate=False):
            persistent = fqn.rsplit(".", 1)[-1] not in _non_persistent(model, fqn)
            if b.is_meta and persistent:  # filled from the checkpoint like a parameter
                b = torch.empty_like(b, device=mesh_device(mesh))
                self._unfilled.add(fqn)
            elif b.is_meta:
                b = computed[fqn]
            self._register(fqn, b, buffer=True, persistent=persistent)
        # DCP and state_dict see fused-QKV weights (_StridedShard) replicated: a strided shard is not one
        # contiguous chunk per rank, which checkpoint planners require; loading slices them back, and slices
        # plain full tensors (the single-device model's state dict) into place.
        local_step.install()  # an optimizer step on replicated parameters runs on their local tensors
        local_step.register(made.values())
        _shard_steps(plan, mesh, self)  # ZeRO-1: the optimizer steps each marked parameter's chunk
        self._register_state_dict_hook(strided_to_replicated)
        self._register_load_state_dict_pre_hook(to_placements, with_module=True)
        self._register_load_state_dict_pre_hook(_mark_loaded, with_module=True)
        mark_replaced(model, self)
        self._rng_stream = rng_stream
        # inputs="local": the data axes over which each rank passes its own shard of the batch
        self._local_axes = local[0] if local is not None else None
        self.train(model.training)
        self._plan = plan  # the plan every re-lowering takes its forms from
        self._precision = Precision.parse(plan.precision)  # mixed precision: inputs and outputs cast per call
        self._stored = dict(plan.params)  # every parameter's placements, whatever program runs
        self._persists = any(d.kind is DirectiveKind.GATHER and d.value == GATHER_PERSIST for d in plan.directives)
        self._programs: OrderedDict[tuple, Program] = OrderedDict()
        self._riding: dict[tuple, bool] = {}  # program key -> whether the call's agreement rides on its loss
        self._summed_agreement: bool | None = None  # `_summed`, decided at the first call
        args, kwargs = split_example_inputs(example_inputs) if example_inputs is not None else (None, None)
        key = self._key(args, kwargs) if args is not None else None
        self._current = self._keep(make_program(key, captured, plan, gm, self._stored))

    @staticmethod
    def _placement_of_alias(model, p, pls):
        for fqn, q in model.named_parameters(remove_duplicate=False):
            if q is p and fqn in pls:
                return pls[fqn]
        raise AssertionError("parameter missing from the plan")

    def _register(self, fqn: str, value, buffer: bool = False, persistent: bool = True) -> None:
        register_at(self, fqn, value, buffer=buffer, persistent=persistent)

    def _lookup(self, fqn: str):
        """The parameter or buffer `fqn` (its owning submodule found once: every call feeds every parameter). Not
        cached while dynamo traces: a dict mutated inside the traced frame is a guard, and the first compiled calls
        (before the eager ones filled it) recompiled each time it grew."""
        owner = self._owners.get(fqn)
        if owner is None:
            mod = self
            *path, leaf = fqn.split(".")
            for part in path:
                mod = getattr(mod, part)
            owner = (mod, leaf)
            if not torch.compiler.is_compiling():
                self._owners[fqn] = owner
        return getattr(*owner)

    def init_weights(self, seed: int = 0) -> "ParallelModule":
        """Initialise a meta-built model's shards with the model's own initialisation (Hugging Face
        `_init_weights`, else each submodule's `reset_parameters` / `init_weights`), on the shards: equal in
        distribution to initialising on one device, not bit for bit (see `autopar.weights`)."""
        init_weights(self, seed)
        return self

    @property
    def graph_module(self) -> torch.fx.GraphModule:
        return self._current.gm

    @property
    def plan(self) -> Plan:
        return self._current.plan

    @property
    def mesh(self) -> DeviceMesh:
        return self._mesh

    def report(self, path: str) -> None:
        """`Plan.to_html` with the rewritten graph per structure, every collective highlighted (`autopar.report`)."""
        from autopar.report import write_report
        write_report(path, self.plan, self.graph_module)

    def forward(self, *args, **kwargs):
        if self._unfilled:
            raise RuntimeError(
                f"ParallelModule was built from a meta-device model and {len(self._unfilled)} of its parameters and "
                f"buffers (e.g. {sorted(self._unfilled)[:3]}) hold uninitialised memory. Fix: fill them first with "
                "autopar.load(pm, checkpoint_dir) or pm.init_weights().")
        key = self._key(args, kwargs)
        prog = self._programs.get(key)
        if prog is None:
            prog = self._keep(relower(
                self._model, mesh_info(self._mesh), self._plan, args, kwargs,
                key=key, training=self.training, tensors=self._tensors(), stored=self._stored,
                rng_stream=self._rng_stream, local_axes=self._local_axes,
                meta_device=mesh_device(self._mesh)))  # `_model` is on the meta device
        self._programs.move_to_end(key)
        self._current = prog
        flat, spec = pytree.tree_flatten(cast_inputs(self._precision, args, {k: kwargs[k] for k in prog.kw_order}))
        cap = prog.captured
        assert spec == cap.in_spec, f"inputs {spec} do not flatten as captured ({cap.in_spec})"
        # resharding is a collective
        settle = self._check_inputs(key, cap, flat, wait=bool(prog.reshard), ride=self._rides(prog))
        if settle is not None:  # the ranks' agreement on this call completes before the call's first collective
            before_next_collective(settle)
        try:
            outs = self._run(prog, cap, flat)
        except BaseException:
            settle_pending(failed=True)
            raise
        settle_pending()
        return cast_outputs(self._precision, pytree.tree_unflatten(list(outs)[: cap.num_user_outputs], cap.out_spec))

    def _run(self, prog: Program, cap: Captured, flat: list):
        """The program on this call's inputs, the parameters' local tensors fed through one autograd node."""
        it = iter(flat)
        feeds, at, dts = [], [], []
        for ph, kind, ref in cap.input_kinds:
            if kind == "param":
                p = self._lookup(ref)
                if ref in prog.reshard:
                    p = p.redistribute(self._mesh, prog.reshard[ref])
                if isinstance(p, DTensor):
                    at.append(len(feeds))
                    dts.append(p)
                feeds.append(p)
            elif kind == "buffer":
                feeds.append(self._lookup(ref))
            elif kind == "constant":
                feeds.append(cap.constants[ph])
            else:
                feeds.append(next(it))
        for i, local in zip(at, to_locals(dts)):
            feeds[i] = local
        advance_rng_stream(self._rng_stream)
        if torch.is_grad_enabled():
            after_backward(self._plain_grads)
        versions = {id(p._local_tensor): p._version for p in dts} if self._persists else {}
        # FSDP groups resharded after forward: their saved parameters re-gathered backward; ZeRO-2's persisted groups
        # gathered again only after their DTensors or shards changed
        with fsdp_step(prog.gm), persist_versions(versions):
            return prog.gm(*feeds)

    def _plain_grads(self) -> None:
        """After a backward whose data-parallel buckets were reduced asynchronously: each gradient's local tensor,
        reduced by now, as a plain tensor (not an AsyncCollectiveTensor)."""
        for p in self.parameters():
            g = p.grad
            local = g._local_tensor if isinstance(g, DTensor) else g
            if isinstance(local, AsyncCollectiveTensor):
                local = local.wait()
                # the same spec (the waited tensor is the one the wrapper held: same shape and strides), built
                # directly: `DTensor.from_local` is an autograd function, tens of microseconds per parameter
                p.grad = DTensor(local, g._spec, requires_grad=False) if isinstance(g, DTensor) else local

    def _rides(self, prog: Program) -> bool:
        """Whether this call's agreement can ride on `prog`'s loss all-reduce (`SummedAgreement`): several processes,
        a 1-D mesh over the whole world (the loss's axis is the agreement's group), inputs="local" (no value digests
        to carry), no parameter resharded first (a collective), not compiling, and the program's first fused loss
        pair all-reduced on that axis before any other collective (`ops.riding_loss_axis`)."""
        if not self._summed or prog.reshard or torch.compiler.is_compiling():
            return False
        rides = self._riding.get(prog.key)
        if rides is None:
            axis = riding_loss_axis(prog.gm)
            rides = axis is not None and resolve_axis(axis).group_name == self._mesh.get_group(0).group_name
            self._riding[prog.key] = rides
            while len(self._riding) > max(8, self.max_programs):
                self._riding.pop(next(iter(self._riding)))
        return rides

    @property
    def _summed(self) -> bool:
        """The per-call agreement is a `SummedAgreement` (riding on the loss where it can, else alone): under
        inputs="local" on a 1-D mesh spanning every process. Else `agree_on_call`'s all-reduce."""
        if self._summed_agreement is None:
            self._summed_agreement = (self._local_axes is not None and self._mesh.ndim == 1 and not one_process()
                                      and self._mesh.size() == dist.get_world_size())
        return self._summed_agreement

    @torch._dynamo.disable  # under torch.compile(pm) too: host-side checks and an all-reduce left in flight, as eager
    def _check_inputs(self, key: tuple, cap: Captured, flat: list, wait: bool = True, ride: bool = False):
        """Out-of-range ids and labels raise one device's `IndexError` on every rank (`autopar.index_checks`), and the
        ranks agree on the call in one all-reduce (`autopar.agree.agree_on_call`): on its shapes, and under
        inputs="global" (unless `check_inputs` is off) on a digest of every tensor input's values, as each rank must
        pass the same batch. `wait=False`: that all-reduce is left in flight where it can be (no error here); the
        function that settles it is returned."""
        error = None
        values = dict(zip(cap.user_inputs, flat))
        if cap.index_checks is not None:
            checked = values
            if self._local_axes is not None:
                # this rank's shard, repeated to the global batch the program expects: only the inputs the checks
                # read (the ids and labels, not the images), batched as `global_example` batches the whole call
                copies = data_degree(self._local_axes, mesh_info(self._mesh))
                dims = batch_dims([tuple(v.shape) if isinstance(v, torch.Tensor) else None for v in values.values()])
                read = set(cap.index_checks.inputs)
                checked = {n: v.repeat(copies, *[1] * (v.dim() - 1)) if d and copies > 1 else v
                           for (n, v), d in zip(values.items(), dims) if n in read}
            error = cap.index_checks(checked)
        if self._local_axes is not None and self._summed:
            agreement = SummedAgreement(key, self._mesh, error)
            if ride and error is None:
                ride_on_loss(agreement)  # checked where the loss's pair is summed, before any result is returned
                return None
            settle = agreement.alone()
            if wait or error is not None:
                settle()
                return None
            return settle
        if self._local_axes is not None:
            return agree_on_call(key, self._mesh, error, wait=wait)
        if self.check_inputs:
            tensors = {n: v for n, v in values.items() if isinstance(v, torch.Tensor)}
            return agree_on_call(key, self._mesh, error, wait=wait, values=tensors)
        if error is not None:
            raise IndexError(error)
        return None

    def _key(self, args, kwargs) -> tuple:
        return guard_key(args, kwargs, training=self.training, tensors=(*self.parameters(), *self.buffers()),
                         device_type=self._mesh.device_type)

    def _tensors(self) -> dict[str, torch.Tensor]:
        return dict(self.named_parameters(remove_duplicate=False)) | dict(self.named_buffers(remove_duplicate=False))

    def _keep(self, prog: Program) -> Program:
        """Cache `prog` under its key, dropping the least recently used beyond `max_programs`."""
        self._programs[prog.key] = prog
        while len(self._programs) > max(1, self.max_programs):
            self._programs.popitem(last=False)
        return prog

    def programs(self) -> list[str]:
        """The cached programs, least recently used first: what each was captured for."""
        return [describe_key(k) if k is not None else "the example inputs" for k in self._programs]


def _shard_steps(plan: Plan, mesh: DeviceMesh, pm: "ParallelModule") -> None:
    """The plan's `SHARD_STEP` directives (ZeRO-1, `autopar.forms.zero`) marked on the parameters
    (`local_step.shard_step`): per parameter its data mesh dims and tensor dim."""
    from autopar.mesh import mesh_info, resolve_axis
    names = mesh_info(mesh).names
    steps: dict[str, tuple[list[int], int]] = {}
    for d in plan.directives:
        if d.kind is DirectiveKind.SHARD_STEP:
            dims, dim = steps.setdefault(d.node, ([], int(d.value)))
            if int(d.value) != dim:
                raise ValueError(f"plan {plan.name!r} shards the step of {d.node} on two dims ({dim}, {d.value}); "
                                 "re-plan")
            dims.append(names.index(d.axis))
    for fqn, (dims, dim) in steps.items():
        local_step.shard_step(pm.get_parameter(fqn), tuple(dims), dim)


def _non_persistent(model: nn.Module, fqn: str) -> set[str]:
    mod = model
    for part in fqn.split(".")[:-1]:
        mod = getattr(mod, part)
    return set(getattr(mod, "_non_persistent_buffers_set", ()))




def _mark_loaded(module, state_dict, prefix, *_):
    """`load_state_dict` pre-hook: what a state dict supplies is no longer uninitialised."""
    module._unfilled -= {k[len(prefix):] for k in state_dict if k.startswith(prefix)}
