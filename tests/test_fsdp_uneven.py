"""FSDP of parameters whose dims do not divide over the data ranks (issue #24 item 5): sharded unevenly on dim 0, as
FSDP2 shards them (`autopar.forms.fsdp.shard_dim`: `torch.chunk`'s chunks, the last ranks' shorter or empty, padded to
the longest in the group's all-gather and reduce-scatter: `autopar.runtime.fsdp`), exact against one device on 4 gloo
ranks, its collectives counted with their padded sizes, its DCP checkpoint loaded into `dp` and back; zero1 (the
optimizer step on this rank's uneven chunk, `autopar.runtime.local_step`) and zero2 (fsdp's uneven shards) exact too,
their AdamW state the rank's rows."""

from __future__ import annotations

import copy

import torch
import torch.nn as nn
import torch.nn.functional as F

import autopar
from autopar.forms import fsdp as fsdp_form
from autopar.spec import shard_layout
from dist_harness import gloo_pool

WORLD = 4


class Odd(nn.Module):
    """Two repeated layers of Linear(7, 7) (their own FSDP groups, resharded and gathered again in backward), a head
    Linear(7, 5) and an output Linear(5, 3): no dim of any parameter divides over 4 ranks, nor over 2 (the shards of 7
    rows over 4 ranks are 2, 2, 2, 1; of 5: 2, 2, 1, 0; of 3: 1, 1, 1, 0)."""

    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleList([nn.Linear(7, 7) for _ in range(2)])
        self.head = nn.Linear(7, 5)
        self.out = nn.Linear(5, 3)

    def forward(self, x, y):
        for layer in self.layers:
            x = torch.tanh(layer(x))
        return F.mse_loss(self.out(torch.tanh(self.head(x))), y)


def _inputs():
    g = torch.Generator().manual_seed(1)
    return torch.randn(8, 7, generator=g, dtype=torch.float64), torch.randn(8, 3, generator=g, dtype=torch.float64)


def _check(path: str):
    """On each gloo rank: fsdp (uneven shards) against one device for 2 AdamW steps, fp64; then its DCP checkpoint
    loaded into a `dp` plan and back."""
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.device_mesh import init_device_mesh
    from equivalence import run_equivalence

    torch.manual_seed(0)
    ref = Odd().double()
    keep = copy.deepcopy(ref)
    res = run_equivalence(ref, _inputs(), (WORLD,), ("dp",), plan="fsdp", steps=2, lr=0.01,
                          optimizer=torch.optim.AdamW)
    out = dict(loss=(res.loss, res.ref_loss), grad=res.grad_err, param=res.param_err, comms=res.comms,
               local=res.local_numel, notes=list(res.plan.notes), params=dict(res.plan.params))
    # zero1 (the step on this rank's uneven chunk, its AdamW state at the chunk's size, the chunks all-gathered after)
    # and zero2 (fsdp's uneven shards, gathered copies kept between steps): exact as well
    for name in ("zero1", "zero2"):
        torch.manual_seed(0)
        made = []

        def adamw(params, lr):  # torch's own AdamW (a subclass is refused a sharded step), kept to read its state
            made.append(torch.optim.AdamW(params, lr=lr))
            return made[-1]

        z = run_equivalence(copy.deepcopy(keep), _inputs(), (WORLD,), ("dp",), plan=name, steps=2, lr=0.01,
                            optimizer=adamw)
        opt = made[-1]  # the parallel module's (the reference's is the first), over pm.parameters()
        names = [n for n, _ in keep.named_parameters()]
        out[name] = dict(loss=(z.loss, z.ref_loss), grad=z.grad_err, param=z.param_err, notes=list(z.plan.notes),
                         state={n: tuple(opt.state[p]["exp_avg"].to_local().shape)
                                for n, p in zip(names, opt.param_groups[0]["params"])})
    # DCP: an uneven fsdp state_dict saved, loaded into dp (replicated), and dp's loaded back into a fresh fsdp
    mesh = init_device_mesh("cpu", (WORLD,), mesh_dim_names=("dp",))
    fsdp = autopar.parallelize(copy.deepcopy(keep), mesh, _inputs(), plan="fsdp")
    dp = autopar.parallelize(copy.deepcopy(keep), mesh, _inputs(), plan="dp")
    with torch.no_grad():
        for p in fsdp.parameters():
            p.to_local().add_(dist.get_rank() + 1.0)  # every rank's shard changed: what dp must see whole
    want = {n: p.full_tensor() for n, p in fsdp.named_parameters()}
    dcp.save(fsdp.state_dict(), checkpoint_id=f"{path}/fsdp")
    state = dp.state_dict()
    dcp.load(state, checkpoint_id=f"{path}/fsdp")
    dp.load_state_dict(state)
    out["to_dp"] = max(float((p.full_tensor() - want[n]).abs().max()) for n, p in dp.named_parameters())
    with torch.no_grad():
        for p in dp.parameters():
            p.to_local().mul_(2.0)
    dcp.save(dp.state_dict(), checkpoint_id=f"{path}/dp")
    back = fsdp  # the fsdp module again, its shards zeroed: all it holds after the load is the checkpoint's
    with torch.no_grad():
        for p in back.parameters():
            p.to_local().zero_()
    state = back.state_dict()
    dcp.load(state, checkpoint_id=f"{path}/dp")
    back.load_state_dict(state)
    out["back"] = max(float((p.full_tensor() - 2 * want[n]).abs().max()) for n, p in back.named_parameters())
    out["back_local"] = {n: tuple(p.to_local().shape) for n, p in back.named_parameters()}
    return out


def _padded_numel(shapes) -> int:
    """Elements of a group's padded flat buffer gathered over WORLD ranks: each shard padded to the longest."""
    return sum(WORLD * fsdp_form.padded_rows(s[0], (WORLD,)) * (s[1] if len(s) > 1 else 1) for s in shapes)


def test_fsdp_uneven_shards_match_one_device_and_checkpoint(tmp_path):
    results = gloo_pool(WORLD).run(_check, str(tmp_path))
    shapes = {n: tuple(p.shape) for n, p in Odd().named_parameters()}
    layer = _padded_numel([(7, 7), (7,)])  # 4 x (2 x 7 + 2) = 64, of 56 real elements
    root = _padded_numel([(5, 7), (5,), (3, 5), (3,)])  # 4 x (2 x 7 + 2 + 1 x 5 + 1) = 88, of 58
    assert (layer, root) == (64, 88)
    sent = lambda n: 3 * n * 8 // 4  # a rank sends 3/4 of the padded fp64 buffer
    # per step: forward, each layer's group gathered, then the root group (head, out: kept gathered, as FSDP2's
    # root); the loss all-reduced; backward, the root's gradients reduce-scattered, layers.0 gathered again (layers.1,
    # the last forward, is still gathered), each layer's gradients reduce-scattered: every one at its padded size
    want = [("all_gather", "dp", "forward", layer, sent(layer))] * 2 + [
        ("all_gather", "dp", "forward", root, sent(root)), ("all_reduce", "dp", "forward", 1, 12),
        ("reduce_scatter", "dp", "backward", root, sent(root)), ("all_gather", "dp", "backward", layer, sent(layer)),
        ("reduce_scatter", "dp", "backward", layer, sent(layer)), ("reduce_scatter", "dp", "backward", layer,
                                                                    sent(layer))]
    for rank, r in enumerate(results):
        # every parameter sharded on dim 0, this rank's torch.chunk: 7 rows -> 2, 2, 2, 1; 5 -> 2, 2, 1, 0; 3 -> 1, 1, 1, 0
        assert r["params"] == {n: "S(0)" for n in shapes}, r["params"]
        rows = {n: len(torch.arange(s[0]).chunk(WORLD)[rank]) if rank < len(torch.arange(s[0]).chunk(WORLD)) else 0
                for n, s in shapes.items()}
        assert r["local"] == {n: rows[n] * (s[1] if len(s) > 1 else 1) for n, s in shapes.items()}, (rank, r["local"])
        assert r["back_local"] == {n: (rows[n], *s[1:]) for n, s in shapes.items()}, (rank, r["back_local"])
        assert any("head.weight (5, 7) is FSDP-sharded unevenly on dim 0 over 4 ranks: at most 2" in n
                   for n in r["notes"]), r["notes"]
        loss, ref = r["loss"]
        assert abs(loss - ref) <= 1e-12, (rank, loss, ref)
        assert set(r["grad"]) == set(r["param"]) == set(shapes)
        assert max(r["grad"].values()) <= 1e-12, (rank, r["grad"])
        assert max(r["param"].values()) <= 1e-12, (rank, r["param"])  # after 2 AdamW steps
        assert r["comms"] == want, (rank, r["comms"])
        assert r["to_dp"] == 0.0 and r["back"] == 0.0, (rank, r["to_dp"], r["back"])
        for name in ("zero1", "zero2"):  # AdamW's state on this rank: its rows of every parameter, no more
            z = r[name]
            assert abs(z["loss"][0] - z["loss"][1]) <= 1e-12, (name, rank, z["loss"])
            assert max(z["grad"].values()) <= 1e-12 and max(z["param"].values()) <= 1e-12, (name, rank, z)
            assert set(z["param"]) == set(shapes)
            assert z["state"] == {n: (rows[n], *s[1:]) for n, s in shapes.items()}, (name, rank, z["state"])
        assert any("head.weight (5, 7): its optimizer step is sharded unevenly (ZeRO-1) on dim 0" in n
                   for n in r["zero1"]["notes"]), r["zero1"]["notes"]


def test_uneven_shards_are_priced_padded():
    """The planner's bytes per rank of an uneven parameter: ceil(dim 0 / d) rows (`fsdp.priced_stats`)."""
    from autopar.estimate import SiteStats
    from autopar.spec import R
    assert fsdp_form.shard_dim((7, 7), [R], [4]) == 0 and fsdp_form.shard_dim((6, 8), [R], [4]) == 1
    assert fsdp_form.shard_dim((3,), [R], [4]) == 0 and fsdp_form.shard_dim((), [R], [4]) is None
    assert fsdp_form.shard_dim((7, 7), [R], [4], uneven=False) is None
    assert shard_layout(5, (4,)) == ((0, 2), (2, 2), (4, 1), (5, 0))
    assert shard_layout(5, (2, 2)) == ((0, 2), (2, 1), (3, 1), (4, 1))  # DTensor's nested chunks
    st = SiteStats()
    for name, shape in {"w": (7, 7), "b": (3,), "e": (8, 7)}.items():
        st.add_param(name, torch.empty(shape, dtype=torch.float64), True)
    sharded, whole = fsdp_form.priced_stats(st, (4,), {}).fsdp_parts()
    assert not whole.param_facts
    # per rank: 2 of w's rows, 1 of b's, 2 of e's; times 4 ranks
    assert sharded.param_bytes / 4 == 8 * (2 * 7 + 1 + 2 * 7), sharded.param_bytes


def test_fsdp_uneven_nested_over_two_data_axes(local_world, fp64):
    """On a (2, 2) mesh of two data axes the shards nest as DTensor's (Shard(0), Shard(0)): 5 rows -> 3, 2 on the
    outer axis, then 2, 1 and 1, 1 (not torch.chunk's 2, 2, 1, 0 over 4), padded to 2 per rank; exact on 4 simulated
    ranks (LocalTensorMode), 2 AdamW steps, the padded group gathered innermost axis first."""
    from equivalence import run_equivalence
    torch.manual_seed(0)
    ref, inputs = Odd().double(), _inputs()
    with local_world(4):
        res = run_equivalence(ref, inputs, (2, 2), ("dp", "dq"), plan="fsdp", steps=2, lr=0.01,
                              optimizer=torch.optim.AdamW)
    assert max(res.grad_err.values()) <= 1e-12 and max(res.param_err.values()) <= 1e-12, res
    assert abs(res.loss - res.ref_loss) <= 1e-12, (res.loss, res.ref_loss)
    local = {n: k.node._local_ints if isinstance(k, torch.SymInt) else k for n, k in res.local_numel.items()}
    assert local["head.weight"] == {0: 2 * 7, 1: 7, 2: 7, 3: 7} and local["out.bias"] == {0: 1, 1: 1, 2: 1, 3: 0}
    root = _padded_numel([(5, 7), (5,), (3, 5), (3,)])  # 4 ranks x 22 padded elements, as on one axis of 4
    assert ("all_gather", "dq", "forward", root // 2, root // 2 * 8 // 2) in res.comms, res.comms
    assert ("all_gather", "dp", "forward", root, root * 8 // 2) in res.comms, res.comms
    assert ("reduce_scatter", "dp", "backward", root, root * 8 // 2) in res.comms, res.comms
