"""Expert parallelism of MoE blocks whose router and auxiliary losses no canonical form knows: only the experts'
dispatch is captured (`passes/moe_dispatch.py`), the user's router, top-k and losses stay traced as written.

Blocks (each with ModuleList experts run in a Python loop and with stacked GroupedExperts on sorted tokens):
- `gshard`: top-2 by two argmaxes, the two gates renormalised, load-balancing loss from the first choice only;
- `sigmoid`: sigmoid scores, top-2 renormalised, balance loss from `histc` counts and normalised scores;
- `zloss`: softmax top-2 (not renormalised), router z-loss plus a load-balancing loss from `one_hot` counts.
Every auxiliary loss is a product of means over tokens: taken per shard it differs from one device (asserted),
so the fp64 equivalence under expert and data parallelism (gloo, 2 and 4 ranks) checks they are global.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from dist_harness import gloo_pool

E, H, FFN, K = 4, 16, 24, 2
TOL = 1e-10


class Expert(nn.Module):
    def __init__(self):
        super().__init__()
        self.gate = nn.Linear(H, FFN, bias=False)
        self.up = nn.Linear(H, FFN, bias=False)
        self.down = nn.Linear(FFN, H, bias=False)

    def forward(self, x):
        return self.down(F.silu(self.gate(x)) * self.up(x))


class GroupedExperts(nn.Module):
    """Stacked experts on tokens sorted by expert (torchtitan's spelling)."""

    def __init__(self):
        super().__init__()
        self.w1 = nn.Parameter(torch.randn(E, FFN, H) / math.sqrt(H))
        self.w2 = nn.Parameter(torch.randn(E, H, FFN) / math.sqrt(FFN))
        self.w3 = nn.Parameter(torch.randn(E, FFN, H) / math.sqrt(H))

    def forward(self, x, num_tokens_per_expert):
        outs = []
        for e, part in enumerate(torch.split(x, num_tokens_per_expert.tolist(), dim=0)):
            outs.append((F.silu(part @ self.w1[e].T) * (part @ self.w3[e].T)) @ self.w2[e].T)
        return torch.cat(outs, dim=0)


class UserMoE(nn.Module):
    """What is common to the blocks: a router, experts in either spelling, the user's own dispatch code."""

    def __init__(self, stacked: bool):
        super().__init__()
        self.router = nn.Linear(H, E, bias=False)
        self.experts = GroupedExperts() if stacked else nn.ModuleList(Expert() for _ in range(E))

    def dispatch(self, x, idx, w):
        """y[t] = sum_j w[t, j] * expert_{idx[t, j]}(x[t]), as users write it."""
        if isinstance(self.experts, GroupedExperts):
            order = torch.argsort(idx.reshape(-1), stable=True)
            counts = torch.bincount(idx.reshape(-1), minlength=E)
            token = order // idx.shape[1]
            y = self.experts(x[token], counts) * w.reshape(-1)[order, None]
            return torch.zeros_like(x).index_add(0, token, y)
        out = torch.zeros_like(x)
        for e, expert in enumerate(self.experts):
            token, slot = torch.where(idx == e)
            if token.numel() == 0:
                continue
            out.index_add_(0, token, expert(x[token]) * w[token, slot, None])
        return out


class GShardMoE(UserMoE):
    def route(self, xf):
        gates = torch.softmax(self.router(xf), dim=-1)
        i1 = torch.argmax(gates, dim=-1)
        m1 = F.one_hot(i1, E).to(gates.dtype)
        i2 = torch.argmax(gates.masked_fill(m1.bool(), float("-inf")), dim=-1)
        return gates, m1, i1, i2

    def forward(self, x):
        b, s, h = x.shape
        xf = x.reshape(-1, h)
        gates, m1, i1, i2 = self.route(xf)
        g1 = gates.gather(1, i1[:, None]).squeeze(1)
        g2 = gates.gather(1, i2[:, None]).squeeze(1)
        denom = g1 + g2
        g1, g2 = g1 / denom, g2 / denom
        aux = E * (gates.mean(0) * m1.mean(0)).sum()  # GShard: the first choice only
        if isinstance(self.experts, GroupedExperts):
            y = self.dispatch(xf, torch.stack([i1, i2], 1), torch.stack([g1, g2], 1))
        else:  # per expert, each choice on its own
            y = torch.zeros_like(xf)
            for e, expert in enumerate(self.experts):
                for sel, g in ((i1, g1), (i2, g2)):
                    token = torch.nonzero(sel == e).squeeze(1)
                    if token.numel():
                        y[token] += g[token, None] * expert(xf[token])
        return y.reshape(b, s, h), aux

    def routing(self, xf):
        _, _, i1, i2 = self.route(xf)
        return torch.stack([i1, i2], 1)


class SigmoidMoE(UserMoE):
    def forward(self, x):
        b, s, h = x.shape
        xf = x.reshape(-1, h)
        scores = torch.sigmoid(self.router(xf))
        w, idx = torch.topk(scores, K, dim=-1)
        w = w / w.sum(dim=-1, keepdim=True)
        frac = torch.histc(idx.to(scores.dtype), bins=E, min=0, max=E - 1) / (xf.shape[0] * K)
        aux = E * (frac * (scores / scores.sum(-1, keepdim=True)).mean(0)).sum()
        return self.dispatch(xf, idx, w).reshape(b, s, h), aux

    def routing(self, xf):
        return torch.topk(torch.sigmoid(self.router(xf)), K, dim=-1).indices


class ZLossMoE(UserMoE):
    def forward(self, x):
        b, s, h = x.shape
        xf = x.reshape(-1, h)
        logits = self.router(xf)
        z = torch.logsumexp(logits, dim=-1).square().mean()
        probs = torch.softmax(logits, dim=-1)
        w, idx = torch.topk(probs, K, dim=-1)  # not renormalised
        frac = F.one_hot(idx, E).to(probs.dtype).sum(1).mean(0)
        aux = E * (frac * probs.mean(0)).sum() + 0.1 * z
        return self.dispatch(xf, idx, w).reshape(b, s, h), aux

    def routing(self, xf):
        return torch.topk(torch.softmax(self.router(xf), -1), K, dim=-1).indices


class Net(nn.Module):
    def __init__(self, block: nn.Module):
        super().__init__()
        self.inp = nn.Linear(8, H)
        self.moe = block
        self.out = nn.Linear(H, 8)

    def forward(self, x, target):
        y, aux = self.moe(self.inp(x))
        return F.mse_loss(self.out(y), target) + 0.5 * aux


BLOCKS = {"gshard": GShardMoE, "sigmoid": SigmoidMoE, "zloss": ZLossMoE}
CASES = [f"{b}-{s}" for b in BLOCKS for s in ("modulelist", "stacked")]


def make(case: str) -> Net:
    block, spelling = case.split("-")
    return Net(BLOCKS[block](stacked=spelling == "stacked"))


def inputs():
    g = torch.Generator().manual_seed(3)
    return torch.randn(4, 8, 8, generator=g), torch.randn(4, 8, 8, generator=g)


def _built(case: str) -> Net:
    torch.manual_seed(list(BLOCKS).index(case.split("-")[0]))  # each block routes its own way
    return make(case)


# ----------------------------------------------------------------------------- recognition, in one process

USER_OPS = {"gshard": {"argmax", "one_hot", "gather", "masked_fill"}, "sigmoid": {"sigmoid", "histc", "topk"},
            "zloss": {"logsumexp", "one_hot", "topk"}}


@pytest.mark.parametrize("case", CASES)
def test_user_router_kept_and_one_experts_node(case, fp64):
    from autopar.capture import capture

    cap = capture(_built(case), inputs(), {})
    ops = [n for n in cap.gm.graph.nodes if n.op == "call_function"]
    moe = [n for n in ops if n.target is torch.ops.autopar.moe_experts.default]
    assert len(moe) == 1
    names = {getattr(n.target, "__name__", "").split(".")[0] for n in ops}
    assert USER_OPS[case.split("-")[0]] <= names, names  # the user's router and losses, as written
    assert not names & {"nonzero", "where", "index_add", "index_add_", "argsort", "bincount", "split_with_sizes",
                        "index_put_", "index_put"}, names  # no dispatch op left
    if case == "gshard-modulelist":  # (T, 2) experts stacked from the two argmax columns
        idx = moe[0].args[2]
        assert idx.target is torch.ops.aten.stack.default
        assert [a.target for a in idx.args[0]] == [torch.ops.aten.argmax.default] * 2
    note = [n for n in cap.notes if n.startswith("MoE moe")]
    assert len(note) == 1 and "kept as written" in note[0] and "top-2" in note[0], cap.notes


def test_aux_losses_taken_per_shard_would_differ(fp64):
    """The equivalence below can fail: each block's auxiliary loss averaged over 2 or 4 token shards is not
    its loss on all tokens (by far more than the tolerance)."""
    x, _ = inputs()
    for case in CASES[::2]:
        net = _built(case)
        h = net.inp(x)
        whole = float(net.moe(h)[1])
        for shards in (2, 4):
            per_shard = sum(float(net.moe(part)[1]) for part in h.chunk(shards)) / shards
            assert abs(per_shard - whole) > 1e-4, (case, shards, per_shard, whole)


@pytest.mark.parametrize("block", list(BLOCKS))
def test_user_aux_loss_global_under_dp_local(block, local_world, fp64):
    """Data parallel on 4 simulated ranks, stacked experts: the user's aux ops have rules (nothing of theirs
    is gathered) and the loss, every gradient and the parameters after a step match one device."""
    from equivalence import run_equivalence

    ref, batch = _built(f"{block}-stacked"), inputs()
    with local_world(4):
        res = run_equivalence(ref, batch, (4,), ("dp",), plan="dp", steps=2)
    assert res.max_err() <= TOL, res.max_err()
    gathered = [n for n in res.plan.notes if "no sharding rule" in n]
    assert not gathered, gathered


# ----------------------------------------------------------------------------- expert parallel on gloo


def ep_equivalence(mesh_shape, names):
    """In a gloo worker: every case under `expert@ep` with the batch over all axes; errors, the all-to-alls
    and the rows each rank's routing sends off-rank."""
    import torch.distributed as dist

    from equivalence import run_equivalence

    torch.set_default_dtype(torch.float64)
    try:
        out = {}
        rank = dist.get_rank()
        ep = mesh_shape[names.index("ep")]
        shards = math.prod(mesh_shape)
        for case in CASES:
            ref = _built(case)
            x, target = inputs()
            res = run_equivalence(ref, (x, target), mesh_shape, names, plan="dp", overrides={"moe": "expert@ep"},
                                  steps=2)
            stepped = _built(case)  # the routing of the last (second) step: after one SGD step
            opt = torch.optim.SGD(stepped.parameters(), lr=0.1)
            stepped(x, target).backward()
            opt.step()
            with torch.no_grad():
                xf = stepped.inp(x).reshape(-1, H)
                idx = stepped.moe.routing(xf)
            T = xf.shape[0]
            owner = idx // (E // ep)  # expert-axis coordinate owning each chosen expert
            tokens = torch.arange(T).chunk(shards)  # rank-major batch shards: the ep coordinate is the inner one
            me = rank % ep
            mine = owner[tokens[rank]]
            group = [rank - me + j for j in range(ep)]
            to_me = sum(int((owner[tokens[r]] == me).sum()) for r in group if r != rank)
            out[case] = dict(max_err=res.max_err(), grad_err=res.grad_err, param_err=res.param_err,
                             idle=res.idle, elsewhere=res.elsewhere, counts=res.comm_counts, comms=res.comms,
                             sent_rows=int((mine != me).sum()), received_rows=to_me, local_tokens=len(tokens[rank]),
                             notes=[n for n in res.plan.notes if "no sharding rule" in n or n.startswith("MoE")])
        return out
    finally:
        torch.set_default_dtype(torch.float32)


def _check_ep(results, mesh_shape, names):
    ep = mesh_shape[names.index("ep")]
    figures = {}
    for case in CASES:
        for rank, all_res in enumerate(results):
            r = all_res[case]
            assert r["max_err"] <= TOL, (case, rank, r["max_err"], r["grad_err"], r["param_err"])
            assert "kept as written" in " ".join(r["notes"]), r["notes"]
            assert not [n for n in r["notes"] if "no sharding rule" in n], r["notes"]
            # one MoE layer: forward counts, tokens out, tokens back; backward tokens out, tokens back
            assert r["counts"].get("all_to_all.forward") == 3 and r["counts"].get("all_to_all.backward") == 2, \
                r["counts"]
            a2a = [c for c in r["comms"] if c[0] == "all_to_all"]
            assert [c[2] for c in a2a] == ["forward"] * 3 + ["backward"] * 2, a2a
            counts, out_f, back_f, back_b, out_b = a2a  # backward runs the combine's first
            row = H * 8
            assert counts[3] == E and counts[4] == (E - E // ep) * 8, counts
            assert out_f[4] == r["sent_rows"] * row and back_f[4] == r["received_rows"] * row, (out_f, back_f, r)
            assert back_b[4] == r["sent_rows"] * row and out_b[4] == r["received_rows"] * row, (back_b, out_b, r)
            formula = K * r["local_tokens"] * H * (ep - 1) / ep * 8
            figures.setdefault(case, []).append((r["max_err"], out_f[4], back_f[4], formula))
        assert set().union(*(set(res[case]["grad_err"]) | res[case]["idle"] for res in results)) == \
            {n for n, _ in _built_names(case)}
    return figures


def _built_names(case):
    old = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    try:
        return list(_built(case).named_parameters())
    finally:
        torch.set_default_dtype(old)


@pytest.mark.parametrize("mesh_shape,names", [((2,), ("ep",)), ((2, 2), ("dp", "ep"))], ids=["ep2", "dp2xep2"])
def test_user_blocks_expert_parallel_gloo(mesh_shape, names):
    world = math.prod(mesh_shape)
    results = gloo_pool(world).run(ep_equivalence, mesh_shape, names)
    figures = _check_ep(results, mesh_shape, names)
    for case, per_rank in figures.items():  # shown with -s: the measured figures
        print(mesh_shape, case, "max err", max(f[0] for f in per_rank), "token a2a bytes out/back per rank",
              [f[1:3] for f in per_rank], "uniform-routing formula", per_rank[0][3])


# ----------------------------------------------------------------------------- not routed: stays replicated


class SoftMoE(nn.Module):
    """Every expert on every token, weighted by a sigmoid of the router: nothing is routed."""

    def __init__(self):
        super().__init__()
        self.router = nn.Linear(H, E, bias=False)
        self.experts = nn.ModuleList(Expert() for _ in range(E))

    def forward(self, x):
        w = torch.sigmoid(self.router(x))
        return sum(w[..., e, None] * expert(x) for e, expert in enumerate(self.experts)), w.mean()


def make_soft():
    return Net(SoftMoE())


def test_soft_moe_stays_replicated_with_the_reason(local_world, fp64):
    import autopar
    from equivalence import run_equivalence

    torch.manual_seed(0)
    plan = autopar.plan(make_soft(), {"dp": 2}, inputs(), plan="dp")
    why = [n for n in plan.notes if n.startswith("MoE moe")]
    assert len(why) == 1 and "left as written (replicated)" in why[0], plan.notes
    assert "every expert runs on all 32 tokens: nothing is routed to it" in why[0], why
    assert not [s for s in plan.strategies if s.kind == "moe"]
    with pytest.raises(ValueError, match="nothing is routed"):
        autopar.plan(make_soft(), {"dp": 2}, inputs(), plan="dp", overrides={"moe": "expert"})
    torch.manual_seed(0)
    ref, batch = make_soft(), inputs()
    with local_world(2):
        res = run_equivalence(ref, batch, (2,), ("dp",), plan="dp", steps=2)
    assert res.max_err() <= TOL, res.max_err()


# ----------------------------------------------------------------------------- megatron: ModuleList experts split too


def test_modulelist_experts_tensor_parallel_local(local_world, fp64):
    """Under megatron a ModuleList block takes `tp` like stacked experts: every expert's FFN features split
    (gate/up on dim 0, down on dim 1), each rank runs its half of every expert on every token and one
    all-reduce sums the halves; loss, every gradient and the parameters after a step match one device."""
    from equivalence import run_equivalence

    ref, batch = _built("gshard-modulelist"), inputs()
    with local_world(2):
        res = run_equivalence(ref, batch, (2,), ("tp",), plan="megatron", steps=2)
    assert res.max_err() <= TOL, res.max_err()
    assert [(s.key, s.label) for s in res.plan.strategies if s.kind == "moe"] == [("moe", "tp@tp")]
    full = dict(_built_names("gshard-modulelist"))
    experts = {n for n in full if ".experts." in n}
    assert len(experts) == 3 * E and all(res.local_numel[n] * 2 == full[n].numel() for n in experts)
    moe_rows = [c for c in res.plan.comms if c.module == "moe"]
    assert [c.fn for c in moe_rows if c.forward == "all_reduce"] == ["all_reduce"], moe_rows  # the halves summed
    assert "all_to_all" not in " ".join(res.comm_counts), res.comm_counts


def test_modulelist_experts_that_cannot_split_say_why(fp64):
    """Experts whose weights are square (FFN size = hidden size) have no FFN dim to find: replicated, and the
    megatron note says which parameter."""
    import autopar
    from test_moe import make_sigmoid_net, sigmoid_inputs

    torch.manual_seed(0)
    plan = autopar.plan(make_sigmoid_net(), {"tp": 2}, sigmoid_inputs(), plan="megatron")
    why = [n for n in plan.notes if n.startswith("moe moe replicated")]
    assert why == ["moe moe replicated, not tp@tp: its experts (modulelist) cannot be split on their FFN features: "
                   "its expert's parameter weight (16, 16) has no dim of FFN features apart from the hidden size 16. "
                   "Fix: 'expert' (expert parallel) or 'replicate'"], plan.notes


class GeluExperts(GroupedExperts):
    """Stacked experts computing their own formula (not torchtitan's SwiGLU): run through the module itself."""

    def forward(self, x, num_tokens_per_expert):
        outs = []
        for e, part in enumerate(torch.split(x, num_tokens_per_expert.tolist(), dim=0)):
            outs.append((F.gelu(part @ self.w1[e].T) + part @ self.w3[e].T) @ self.w2[e].T)
        return torch.cat(outs, dim=0)


def make_gelu_experts():
    torch.manual_seed(4)
    block = ZLossMoE(stacked=True)
    block.experts = GeluExperts()
    return Net(block)


@pytest.mark.parametrize("plan,axis", [("dp", "dp"), ("megatron", "tp")])
def test_grouped_experts_of_their_own_formula(plan, axis, local_world, fp64):
    """The grouped module's own forward is the expert function (called with one expert's weights); under
    megatron its FFN features split (checked: the two halves sum to the expert), and both plans match."""
    from autopar.capture import capture
    from equivalence import run_equivalence

    ref, batch = make_gelu_experts(), inputs()
    cap = capture(ref, batch, {})
    assert sum(n.target is torch.ops.autopar.moe_experts.default for n in cap.gm.graph.nodes) == 1
    assert any("kept as written" in n for n in cap.notes), cap.notes
    with local_world(2):
        res = run_equivalence(ref, batch, (2,), (axis,), plan=plan, steps=2)
    assert res.max_err() <= TOL, res.max_err()
    if plan == "megatron":
        assert [s.label for s in res.plan.strategies if s.kind == "moe"] == ["tp@tp"]
        assert res.local_numel["moe.experts.w1"] * 2 == E * FFN * H


# ----------------------------------------------------------------------------- more spellings of the dispatch


class OldMixtralMoE(nn.Module):
    """transformers 4.x `MixtralSparseMoeBlock`: one-hot expert mask, `torch.where` per expert, fp32 router."""

    def __init__(self):
        super().__init__()
        self.gate = nn.Linear(H, E, bias=False)
        self.experts = nn.ModuleList(Expert() for _ in range(E))
        self.top_k = K

    def forward(self, hidden_states):
        b, s, h = hidden_states.shape
        hidden_states = hidden_states.view(-1, h)
        router_logits = self.gate(hidden_states)
        routing_weights = F.softmax(router_logits, dim=1, dtype=torch.float)
        routing_weights, selected_experts = torch.topk(routing_weights, self.top_k, dim=-1)
        routing_weights /= routing_weights.sum(dim=-1, keepdim=True)
        routing_weights = routing_weights.to(hidden_states.dtype)
        final = torch.zeros((b * s, h), dtype=hidden_states.dtype, device=hidden_states.device)
        expert_mask = F.one_hot(selected_experts, num_classes=E).permute(2, 1, 0)
        for expert_idx in range(E):
            idx, top_x = torch.where(expert_mask[expert_idx])
            current_state = hidden_states[None, top_x].reshape(-1, h)
            current = self.experts[expert_idx](current_state) * routing_weights[top_x, idx, None]
            final.index_add_(0, top_x, current.to(hidden_states.dtype))
        return final.reshape(b, s, h), router_logits.square().mean()


class SharedExpertMoE(nn.Module):
    """Weights read from the router's probabilities inside the loop (no (T, k) weights tensor), a shared expert
    added to the routed ones, `view_as` back."""

    def __init__(self):
        super().__init__()
        self.router = nn.Linear(H, E, bias=False)
        self.experts = nn.ModuleList(Expert() for _ in range(E))
        self.shared = Expert()

    def forward(self, x):
        xf = x.flatten(0, 1)
        probs = torch.softmax(self.router(xf), -1)
        idx = torch.topk(probs, K, -1).indices
        out = torch.zeros_like(xf)
        for e in range(E):
            token = (idx == e).any(-1).nonzero().squeeze(-1)
            if token.numel() == 0:
                continue
            out[token] = out[token] + probs[token, e, None] * self.experts[e](xf[token])
        return (out + self.shared(xf)).view_as(x), E * (probs.mean(0) ** 2).sum()


@pytest.mark.parametrize("block", [OldMixtralMoE, SharedExpertMoE])
def test_more_dispatch_spellings(block, local_world, fp64):
    from autopar.capture import capture
    from equivalence import run_equivalence

    torch.manual_seed(5)
    ref, batch = Net(block()), inputs()
    cap = capture(ref, batch, {})
    moe = [n for n in cap.gm.graph.nodes if n.target is torch.ops.autopar.moe_experts.default]
    assert len(moe) == 1 and any("kept as written" in n for n in cap.notes), cap.notes
    if block is SharedExpertMoE:  # weights gathered from the (T, E) probabilities at the chosen experts
        assert moe[0].args[3].target is torch.ops.aten.gather.default
    with local_world(2):
        res = run_equivalence(ref, batch, (2,), ("dp",), plan="dp", steps=2)
    assert res.max_err() <= TOL, res.max_err()


class TracesOtherwiseMoE(ZLossMoE):
    """Calls one more op on real tensors than on the fake ones of the trace: its replay cannot follow the trace."""

    def forward(self, x):
        if type(x) is torch.Tensor:
            x = x * 1.0
        return super().forward(x)


def test_replacement_that_does_not_trace_falls_back_with_a_note(fp64):
    from autopar.capture import capture

    torch.manual_seed(0)
    cap = capture(Net(TracesOtherwiseMoE(stacked=False)), inputs(), {})
    assert not [n for n in cap.gm.graph.nodes if n.target is torch.ops.autopar.moe_experts.default]
    notes = [n for n in cap.notes if n.startswith("MoE moe") or n.startswith("moe ")]
    assert len(notes) == 2, cap.notes
    assert "replacement did not trace (Diverged: " in notes[1] and "opaque node" in notes[0], notes
