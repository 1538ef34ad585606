"""FSDP units beyond the layers (`autopar.layers.fsdp_units`): an `nn.LSTM` outside any numbered layer is a unit of
its own, as FSDP2 users wrap it (`fully_shard(model.lstm)`): its parameters gathered as one group, prefetched after
the embedding's, resharded after forward and gathered again in backward, reduce-scattered as soon as its backward is
done; the embedding before it and the head after it are the root's groups (kept, as FSDP2's root). The estimate
groups the parameters as lowering does. Numerics: loss, every gradient, the parameters after a step, fp64.
"""

from __future__ import annotations

import torch
from torch.distributed.device_mesh import init_device_mesh

from autopar.api import _prepare
from autopar.estimate import fsdp_groups
from autopar.runtime import fsdp as F
from equivalence import run_equivalence
import nn_census


def test_lstm_is_its_own_fsdp_unit(local_world, fp64):
    g = torch.Generator().manual_seed(1)
    torch.manual_seed(0)
    model, inputs = nn_census.lstm_lm(g, vocab=64, dim=16, layers=2, batch=4, seq=8)
    numel = {n: p.numel() for n, p in model.named_parameters()}
    groups = {"(before lstm)": numel["embed.weight"],
              "lstm": sum(v for n, v in numel.items() if n.startswith("lstm.")),
              "(after lstm)": numel["head.weight"] + numel["head.bias"]}
    with local_world(2):
        res = run_equivalence(model, inputs, (2,), ("dp",), plan="fsdp")
        mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("dp",))
        _, captured, _ = _prepare(model, mesh, inputs)
    assert set(res.grad_err) == set(res.param_err) == set(numel)
    assert abs(res.loss - res.ref_loss) <= 1e-10 * max(1.0, abs(res.ref_loss)), (res.loss, res.ref_loss)
    assert max(res.grad_err.values()) <= 1e-10, res.grad_err
    assert max(res.param_err.values()) <= 1e-10, res.param_err
    nodes = [n for n in res.graph_module.graph.nodes if n.target is F.fsdp_gather]
    assert [n.args[4] for n in nodes] == list(groups)  # forward order
    assert [n.args[5] for n in nodes] == [True, False, True]  # the LSTM resharded, the root's groups kept
    assert [n.args[1] is not None and n.args[1].target is F.fsdp_prefetch for n in nodes] == [False, True, True]
    # exact collectives: per group one all-gather forward and one reduce-scatter backward; the LSTM's gathered
    # again in backward; the loss's (sum, count) all-reduced together forward; nothing else
    gathers = [c for c in res.comms if c[0] == "all_gather"]
    assert [c[3] for c in gathers if c[2] == "forward"] == list(groups.values()), gathers
    assert [c[3] for c in gathers if c[2] == "backward"] == [groups["lstm"]], gathers
    assert sorted(c[3] for c in res.comms if c[0] == "reduce_scatter") == sorted(groups.values()), res.comms
    assert sorted((c[0], c[2], c[3]) for c in res.comms if c[0] not in ("all_gather", "reduce_scatter")) == \
        [("all_reduce", "forward", 2)], res.comms
    # the estimate's groups are lowering's: each parameter priced with its group's bytes, the LSTM's gathered again
    facts = fsdp_groups(captured.gm, set(captured.param_fqns))
    label = {n: ("lstm" if n.startswith("lstm.") else "(before lstm)" if n.startswith("embed") else "(after lstm)")
             for n in numel}
    assert len(facts) == len(numel)
    for ph, (nbytes, again) in facts.items():
        name = next(n for n in numel if ph.replace("p_", "", 1) == n.replace(".", "_"))
        assert nbytes == groups[label[name]] * 8 and again == (label[name] == "lstm"), (ph, nbytes, again)
