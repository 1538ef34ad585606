"""FSDP2's forward-input casts under `mp_policy`, and capture errors whose fix follows the error.

`fully_shard(module, mp_policy=MixedPrecisionPolicy(param_dtype=..., cast_forward_inputs=True))` casts the floating
(not complex) tensors among the module's forward arguments to param_dtype (`FSDPState._pre_forward` ->
`_cast_forward_inputs`), on the root and on every module it wraps. autopar does it on the root (`cast_inputs`) and on
each layer (`autopar.layers.layer_modules`, `autopar.precision.layer_input_casts`). The model here is Llama-like:
its root computes fp32 rotary tables (cos, sin) from an fp32 buffer and passes them to every block, which is what
torchtitan-style models do; without the per-layer casts its blocks mix fp32 and bf16 and the capture fails.

Asserted: where the casts sit in the lowered program (one per table per layer, at the layer's entry, nothing else
cast), also re-captured for another batch size; against FSDP2 itself on 2 gloo ranks (`fully_shard` per block and
the root, the same policy) autopar's fsdp and dp plans give the same loss, every gradient and every parameter after
an SGD step (measured: loss 4.8e-7, one fp32 ulp of the mean; gradients and parameters 0.0); the capture errors'
fixes for a dtype mismatch (with and without a policy, inputs cast or not), meta tensors and any other error.

The norms are written out (Llama's fp32 RMSNorm) and the loss is fp32: with `nn.RMSNorm`, which has no sharding
rule yet (issue 22), the plans all-gather the batch before each norm and run the linear after it on the whole batch
(its weight gradient rounded to bf16 once, not per rank): then the gradients differ from FSDP2's by up to 4.2e-4
(bf16 rounding), and a bf16 loss's mean by one bf16 ulp, which says nothing about the casts.
"""

from __future__ import annotations

import copy
import operator

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy

import autopar
from autopar.layers import find_layers
from dist_harness import gloo_pool
from passes.checkpoint import walk

BF16 = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
LR = 0.1
LAYERS = 2
aten = torch.ops.aten


def rotate(x, cos, sin):
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos + torch.cat((-x2, x1), dim=-1) * sin


class RMSNorm(nn.Module):
    """Llama's: normalised in fp32, returned in the input's dtype (written out: see the module docstring)."""

    def __init__(self, d: int):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(d))

    def forward(self, x):
        x32 = x.float()
        return (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + 1e-6)).type_as(x) * self.weight


class Block(nn.Module):
    def __init__(self, d: int, heads: int):
        super().__init__()
        self.heads = heads
        self.norm1, self.norm2 = RMSNorm(d), RMSNorm(d)
        self.qkv, self.o = nn.Linear(d, 3 * d, bias=False), nn.Linear(d, d, bias=False)
        self.up, self.down = nn.Linear(d, 2 * d, bias=False), nn.Linear(2 * d, d, bias=False)

    def forward(self, x, cos, sin):
        b, t, d = x.shape
        q, k, v = self.qkv(self.norm1(x)).view(b, t, 3, self.heads, d // self.heads).transpose(1, 3).unbind(2)
        a = F.scaled_dot_product_attention(rotate(q, cos, sin), rotate(k, cos, sin), v, is_causal=True)
        x = x + self.o(a.transpose(1, 2).reshape(b, t, d))
        return x + self.down(F.silu(self.up(self.norm2(x))))


class RopeLlama(nn.Module):
    """The root computes the fp32 rotary tables from its fp32 `inv_freq` buffer and passes them to each block."""

    def __init__(self, vocab=64, d=32, heads=4, layers=LAYERS):
        super().__init__()
        self.emb = nn.Embedding(vocab, d)
        self.layers = nn.ModuleList(Block(d, heads) for _ in range(layers))
        self.norm, self.head = RMSNorm(d), nn.Linear(d, vocab, bias=False)
        half = torch.arange(0, d // heads, 2).float() / (d // heads)
        self.register_buffer("inv_freq", 1.0 / 10000 ** half, persistent=False)

    def forward(self, tokens, labels):
        f = torch.outer(torch.arange(tokens.shape[1], dtype=torch.float32), self.inv_freq)
        angles = torch.cat((f, f), dim=-1)
        cos, sin = angles.cos(), angles.sin()
        x = self.emb(tokens)
        for layer in self.layers:
            x = layer(x, cos, sin)
        return F.cross_entropy(self.head(self.norm(x)).float().flatten(0, 1), labels.flatten())  # fp32 loss


def make_model():
    torch.manual_seed(0)
    return RopeLlama()


def model_inputs():
    g = torch.Generator().manual_seed(1)
    return torch.randint(0, 64, (4, 8), generator=g), torch.randint(0, 64, (4, 8), generator=g)


_CASTS = (aten.to.dtype, aten._to_copy.default)


def _parameter_side(n) -> bool:
    """A parameter or its collectives (an FSDP group's gather and prefetch, and the gathered values)."""
    from autopar.runtime import collectives as C
    from autopar.runtime import fsdp as Fs
    src = n.args[0] if n.target is operator.getitem else n
    return n.op == "placeholder" or src.target in C.COLLECTIVES or src.target in (Fs.fsdp_gather, Fs.fsdp_prefetch)


def _layer_inputs(gm, layer) -> dict:
    """The activations a layer's nodes read from outside it: {node: the layer's nodes that read it}."""
    nodes = {n.name: n for n in gm.graph.nodes}
    own, found = set(layer.nodes), {}
    for name in layer.nodes:
        for a in nodes[name].all_input_nodes:
            if a.name not in own and not _parameter_side(a) and isinstance(a.meta.get("val"), torch.Tensor):
                found.setdefault(a, []).append(nodes[name])
    return found


def _computing(gm, layer) -> list[str]:
    """A layer's nodes in graph order, its parameters' collectives left out."""
    nodes = {n.name: n for n in gm.graph.nodes}
    return [name for name in layer.nodes if not _parameter_side(nodes[name])]


def _assert_entry_casts(gm) -> None:
    """Layer by layer (`find_layers`): of the activations a layer reads from outside it, the fp32 ones (the root's
    cos and sin) are read only by casts to bf16 that are the layer's first nodes but for its parameters' gathers
    (FSDP2's pre-forward hook casts before the layer's forward runs), one per table per layer; the bf16 one (the
    hidden state: the embedding, then the previous block's output) is read as it is (`_cast_fp_tensor` leaves a
    tensor at param_dtype alone: no node). The tables have no other users."""
    layers = find_layers(gm)
    assert [l.path for l in layers] == [f"layers.{i}" for i in range(LAYERS)]
    tables = [n for n in gm.graph.nodes if n.target in (aten.cos.default, aten.sin.default)]
    assert len(tables) == 2 and all(t.meta["val"].dtype == torch.float32 for t in tables)
    entry_casts = []
    for layer in layers:
        ins = _layer_inputs(gm, layer)
        fp32 = {a: us for a, us in ins.items() if a.meta["val"].dtype == torch.float32}
        bf16 = {a: us for a, us in ins.items() if a.meta["val"].dtype == torch.bfloat16}
        assert set(fp32) == set(tables) and len(bf16) == 1 and len(ins) == 3, (layer.path, ins)
        for t, users in fp32.items():
            assert len(users) == 1 and users[0].target in _CASTS, (layer.path, t, users)
            cast = users[0]
            assert cast.meta["val"].dtype == torch.bfloat16, (layer.path, cast)
            assert cast.name in _computing(gm, layer)[:2], (layer.path, cast, _computing(gm, layer)[:4])
            entry_casts.append(cast)
        assert not any(u.target in _CASTS and u.meta["val"].dtype == torch.bfloat16 for us in bf16.values() for u in us)
    for t in tables:
        assert set(t.users) == {c for c in entry_casts if c.args[0] is t}


def test_layer_modules_are_the_graphs_layers():
    """The modules that get the casts (`layer_modules`, on the module tree) are the layers `find_layers` finds in
    the graph: the outermost numbered modules."""
    from autopar.capture import capture
    from autopar.layers import is_layer_path, layer_modules
    assert [is_layer_path(p) for p in ("layers.3", "model.layers.0", "layers.3.experts.1", "layers", "emb")] == \
           [True, True, False, False, False]
    model = make_model()
    c = capture(model, model_inputs(), {})
    assert [p for p, _ in layer_modules(model)] == [l.path for l in find_layers(c.gm)] == ["layers.0", "layers.1"]


def test_each_layer_casts_its_inputs_where_fully_shard_does(local_world):
    """The lowered fsdp program casts each layer's fp32 inputs at its entry (`_assert_entry_casts`), and so does
    the program re-captured for another batch size (`autopar.relower`). Without a policy nothing is cast there."""
    model, inputs = make_model(), model_inputs()
    with local_world(2):
        mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("dp",))
        pm = autopar.parallelize(model, mesh, inputs, plan="fsdp", mp_policy=BF16)
        _assert_entry_casts(pm.graph_module)
        pm(*(x[:2] for x in inputs))
        assert len(pm.programs()) == 2
        _assert_entry_casts(pm.graph_module)
        plain = autopar.parallelize(make_model(), mesh, inputs, plan="fsdp").graph_module
    plain_tables = [n for n in plain.graph.nodes if n.target in (aten.cos.default, aten.sin.default)]
    assert len(plain_tables) == 2 and all(u.target not in _CASTS for t in plain_tables for u in t.users)


# ----------------------------------------------------------------------------- against FSDP2 on gloo

def fsdp2_worker():
    """On each gloo rank: FSDP2 (`fully_shard` per block and the root, BF16) and autopar's fsdp and dp plans under
    BF16 on the same model and batch: per plan, the largest difference of the loss, each gradient, each parameter
    after one SGD step, and whether any dtype differs."""
    import torch.distributed as dist
    from torch.distributed.fsdp import fully_shard
    model, inputs = make_model(), model_inputs()
    world, rank = dist.get_world_size(), dist.get_rank()
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("dp",))
    ref = copy.deepcopy(model)
    for block in ref.layers:
        fully_shard(block, mesh=mesh, mp_policy=BF16)
    fully_shard(ref, mesh=mesh, mp_policy=BF16)
    ref_loss = ref(*(x.chunk(world)[rank] for x in inputs))  # FSDP2 takes each rank's own batch
    ref_loss.backward()  # FSDP2 averages the gradients over the ranks: the mean of the rank means
    ref_mean = ref_loss.detach().clone()
    dist.all_reduce(ref_mean)
    theirs = dict(ref.named_parameters())
    ref_grads = {n: p.grad.full_tensor() for n, p in theirs.items()}
    torch.optim.SGD(ref.parameters(), lr=LR).step()
    ref_after = {n: p.full_tensor() for n, p in theirs.items()}
    errs = {}
    for plan in ("fsdp", "dp"):
        pm = autopar.parallelize(copy.deepcopy(model), mesh, inputs, plan=plan, mp_policy=BF16)
        loss = pm(*inputs)
        loss.backward()
        errs[f"{plan} loss"] = abs(float(loss) - float(ref_mean) / world)
        for n, p in pm.named_parameters():
            errs[f"{plan} grad {n}"] = float((p.grad.full_tensor() - ref_grads[n]).abs().max())
            errs[f"{plan} dtype {n}"] = float(p.grad.dtype != theirs[n].grad.dtype or p.dtype != theirs[n].dtype)
        torch.optim.SGD(pm.parameters(), lr=LR).step()
        for n, p in pm.named_parameters():
            errs[f"{plan} param {n}"] = float((p.full_tensor() - ref_after[n]).abs().max())
        errs[f"{plan} parameters compared"] = float(set(dict(pm.named_parameters())) != set(theirs))
    return errs


def test_against_fsdp2_on_gloo():
    """autopar's fsdp and dp plans under BF16 = FSDP2 under BF16 on the RoPE-passing model: the same casts of the
    same fp32 tables at the same places, bf16 compute, fp32 gradient reductions (FSDP2 scales each rank's gradient by
    1/world before its fp32 reduction: a power of two, exact), so what can differ is the order of fp32 additions:
    held to 1e-6 absolute, far below bf16's resolution (one bf16 ulp at 1.0 is 2**-8 = 3.9e-3)."""
    for errs in gloo_pool(2).run(fsdp2_worker):
        assert max(errs.values()) <= 1e-6, sorted(errs.items(), key=lambda kv: -kv[1])[:5]


# ----------------------------------------------------------------------------- a capture error's fix


class OwnTables(RopeLlama):
    """Each block makes its own fp32 tables from an fp32 buffer: FSDP2 casts no buffer and nothing a block makes, so
    under bf16 parameters the block mixes dtypes, with FSDP2 as with autopar."""

    def __init__(self):
        super().__init__()
        for layer in self.layers:
            layer.register_buffer("inv_freq", self.inv_freq.clone(), persistent=False)
            layer.forward = self._own_tables(layer)

    @staticmethod
    def _own_tables(layer):
        def forward(x, cos, sin):
            f = torch.outer(torch.arange(x.shape[1], dtype=torch.float32), layer.inv_freq)
            angles = torch.cat((f, f), dim=-1)
            return Block.forward(layer, x, angles.cos(), angles.sin())
        return forward


class RootMixes(nn.Module):
    """Its own forward attends with float64 values from a buffer to fp32 queries and keys: wrong without autopar."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 4)
        self.register_buffer("values", torch.ones(8, 4, dtype=torch.float64))

    def forward(self, x):
        h = self.fc(x)
        return F.scaled_dot_product_attention(h, h, self.values).sum()


class Branchy(nn.Module):
    """A submodule that branches on a tensor value (not traceable) and, run eagerly, multiplies mismatched shapes."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x):
        return self.fc(x) @ torch.ones(3, 3) if x.sum() > 0 else self.fc(x)


class HasBranchy(nn.Module):
    def __init__(self):
        super().__init__()
        self.sub = Branchy()

    def forward(self, x):
        return self.sub(x).sum()


def _capture_error(model, inputs, policy=None) -> str:
    with pytest.raises(autopar.CaptureError) as info:
        autopar.plan(model, {"dp": 2}, inputs, plan="dp", mp_policy=policy)
    return str(info.value)


def test_inputs_not_cast_fix_names_cast_forward_inputs():
    """cast_forward_inputs=False: the blocks get the fp32 tables; the fix is the policy's cast (FSDP2's default)."""
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, cast_forward_inputs=False)
    msg = _capture_error(make_model(), model_inputs(), policy)
    assert msg.startswith("autopar could not capture RopeLlama: submodule layers.0 fails on the example inputs, "
                          "traced and eagerly: RuntimeError: Expected query, key, and value to have the same dtype"), msg
    assert "submodule layers.0 mixes bfloat16 and float32 tensors" in msg
    assert "mp_policy has cast_forward_inputs=False, so inputs keep their dtype. Fix: leave cast_forward_inputs " \
           "True (FSDP2's default" in msg
    assert "meta" not in msg


def test_table_made_in_a_layer_fix_says_cast_it_there():
    """Under BF16 a table a block makes from its own fp32 buffer is not an input: nothing casts it (FSDP2 neither)."""
    msg = _capture_error(OwnTables(), model_inputs(), BF16)
    assert "submodule layers.0 mixes bfloat16 and float32 tensors where one dtype is needed: under mp_policy the " \
           "parameters compute in bfloat16 (param_dtype)" in msg, msg
    assert "a tensor made inside a layer in another dtype (from an fp32 buffer, or with an explicit dtype=)" in msg
    assert "Fix: cast it to the parameters' dtype where it meets them (e.g. `cos.to(q.dtype)`)" in msg
    assert "meta" not in msg


def test_dtype_mismatch_without_policy():
    """No policy, the model's own forward mixes fp32 and fp64: the trace fails there, and the fix is the model's."""
    msg = _capture_error(RootMixes(), (torch.randn(8, 4),))
    assert msg.startswith("autopar could not capture RootMixes with torch.export (non-strict): RuntimeError: "), msg
    assert msg.endswith("Fix: RootMixes mixes float32 and float64 tensors where one dtype is needed, and fails the "
                        "same way without autopar: make them agree where they meet (e.g. `t.to(x.dtype)`)."), msg
    assert "control flow" not in msg


def test_meta_model_fix_is_real_inputs():
    """A meta-device model whose untraceable submodule must be run eagerly: meta tensors cannot run it."""
    with torch.device("meta"):
        model = HasBranchy()
    msg = _capture_error(model, (torch.randn(8, 4),))
    assert "submodule sub is not traceable" in msg and "failed too" in msg, msg
    assert msg.endswith("Fix: pass real (not meta) example inputs and parameters: an untraceable submodule is run "
                        "once eagerly to record its outputs, which meta tensors cannot do."), msg


def test_other_eager_failure_fix_is_that_error():
    """Real tensors, a submodule that neither traces nor runs (a shape mismatch): the fix names the submodule and
    the error it raised, not meta tensors."""
    x = torch.ones(8, 4)  # sum > 0: the branch with the mismatched matmul
    msg = _capture_error(HasBranchy(), (x,))
    assert "running it eagerly on the example inputs to capture it as an opaque node failed too: RuntimeError: " \
           "mat1 and mat2 shapes cannot be multiplied (8x4 and 3x3)" in msg, msg
    assert msg.endswith("Fix: make sub run on the example inputs (eagerly it raised the error above), or make it "
                        "traceable (no branching on tensor values, .item() or nonzero()) so that it is not an "
                        "opaque node."), msg
    assert "meta" not in msg
