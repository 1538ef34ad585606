"""Which explicit attention masks are the causal mask (`passes/masks.py`), and what the sequence forms say about
those that are not.

A small model calls SDPA with a mask built in its forward, each spelling in turn: recognition marks the site
`mask_causal` exactly when no input reaches the mask and its value (evaluated on the host) is the causal mask
of its shape, bool or additive; every other mask gets a note naming the reason (an input such as a padding
`attention_mask`, a parameter, a sliding window, a prefix, an all-true mask, a bias, a mask too large to
evaluate), which is the reason ring attention is refused with. A ring over a causal additive and a causal
bool mask matches one device in fp64 (the mask is dropped and the ring runs is_causal). The refusal texts:
"pad the sequence" accompanies only the sequence condition, in ring and Ulysses alike.
"""

from __future__ import annotations

import dataclasses
import re

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import autopar
from autopar.api import _prepare
from autopar.forms.ring import ring_precondition
from autopar.forms.ulysses import ulysses_precondition
from autopar.sites import AttentionSite
from equivalence import run_equivalence
from passes import masks

B, S, V, H, HEADS = 2, 16, 64, 32, 4
NEG = float("-inf")


def _pos(device):
    return torch.arange(S, device=device)


MASKS = {  # name -> (mask builder from (ids, attention_mask, params), causal?, note pattern)
    "bool-compare": (lambda ids, am, m: _pos(ids.device)[None, :] <= _pos(ids.device)[:, None], True, None),
    "bool-tril": (lambda ids, am, m: torch.ones(S, S, dtype=torch.bool, device=ids.device).tril(), True, None),
    "additive-inf": (lambda ids, am, m: torch.full((S, S), NEG, device=ids.device).triu(1), True, None),
    "additive-finfo-min": (lambda ids, am, m: torch.zeros(1, 1, S, S, device=ids.device).masked_fill(
        _pos(ids.device)[None, :] > _pos(ids.device)[:, None], torch.finfo(torch.get_default_dtype()).min),
        True, None),
    "sliding-4": (lambda ids, am, m: (_pos(ids.device)[None, :] <= _pos(ids.device)[:, None])
                  & (_pos(ids.device)[:, None] - _pos(ids.device)[None, :] < 4), False,
                  r"its mask is a sliding window of 4 tokens, not causal over the 16-token sequence"),
    "prefix-4": (lambda ids, am, m: (_pos(ids.device)[None, :] <= _pos(ids.device)[:, None])
                 | (_pos(ids.device)[None, :] < 4), False,
                 r"its mask lets positions attend to later positions \(a prefix or bidirectional mask\)"),
    "all-true": (lambda ids, am, m: torch.ones(S, S, dtype=torch.bool, device=ids.device), False,
                 r"its mask masks nothing"),
    "alibi": (lambda ids, am, m: -(_pos(ids.device)[:, None] - _pos(ids.device)[None, :]).double().clamp(min=0)
              + torch.full((S, S), NEG, device=ids.device).triu(1), False,
              r"carries values other than 0 and -inf \(a bias such as ALiBi\)"),
    "padding": (lambda ids, am, m: (_pos(ids.device)[None, :] <= _pos(ids.device)[:, None])[None, None]
                & am[:, None, None, :].bool(), False,
                r"its mask depends on input attention_mask \(padding\)"),
    "learned": (lambda ids, am, m: torch.full((S, S), NEG, device=ids.device).triu(1) + m.bias_scale * 0, False,
                r"its mask depends on parameter bias_scale"),
}


class MaskedLM(nn.Module):
    """Embedding -> one attention whose mask `MASKS[kind]` builds in forward -> tied-free head -> cross-entropy."""

    def __init__(self, kind: str):
        super().__init__()
        self.kind = kind
        self.emb = nn.Embedding(V, H)
        self.qkv = nn.Linear(H, 3 * H)
        self.o = nn.Linear(H, H)
        self.head = nn.Linear(H, V)
        self.bias_scale = nn.Parameter(torch.ones(()))

    def forward(self, ids, attention_mask, labels):
        x = self.emb(ids)
        q, k, v = self.qkv(x).view(B, S, 3, HEADS, H // HEADS).permute(2, 0, 3, 1, 4)
        mask = MASKS[self.kind][0](ids, attention_mask, self)
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        y = self.o(y.transpose(1, 2).reshape(B, S, H)) + x
        return F.cross_entropy(self.head(y).view(-1, V), labels.view(-1))


def _batch():
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, V, (B, S), generator=g)
    am = torch.ones(B, S, dtype=torch.long)
    am[1, 11:] = 0
    return {"ids": ids, "attention_mask": am, "labels": torch.randint(0, V, (B, S), generator=g)}


def _site(kind: str) -> AttentionSite:
    torch.manual_seed(0)
    _, _, ctx = _prepare(MaskedLM(kind), {"cp": 2}, _batch())
    (site,) = ctx.of_kind("attention")
    assert site.has_mask
    return site


@pytest.mark.parametrize("chunk", ["whole", "rows"])
@pytest.mark.parametrize("kind", list(MASKS))
def test_mask_is_causal_exactly_when_position_only_and_causal(kind, chunk, fp64, monkeypatch):
    """Held whole, or computed and checked a few rows at a time (as a long sequence's mask is)."""
    if chunk == "rows":
        monkeypatch.setattr(masks, "CHUNK_ELEMENTS", 3 * S)  # blocks of 3 rows (the last one shorter)
    _, causal, note = MASKS[kind]
    site = _site(kind)
    assert site.mask_causal is causal, site.mask_note
    if causal:
        assert site.mask_note == "" and ring_precondition(site, 2) is None
    else:
        assert re.search(note, site.mask_note), site.mask_note
        why = ring_precondition(site, 2)
        assert why.startswith(site.mask_note) and "Fix: 'ulysses', 'heads' or 'replicate'" in why, why
        assert "pad the sequence" not in why, why


def test_a_mask_too_large_to_evaluate_stays_unproved_with_a_note(fp64, monkeypatch):
    monkeypatch.setattr(masks, "CHUNK_ELEMENTS", 3 * S)
    monkeypatch.setattr(masks, "MAX_ELEMENTS", 100)
    site = _site("bool-compare")
    assert not site.mask_causal
    assert re.fullmatch(r"its mask is built from positions only, but checking that it is causal needs a 16x16 value "
                        r"\(le\w*, aten\.le\.Tensor\), more than recognition evaluates \(48 elements at once, 100 by "
                        r"blocks of rows of elementwise ops\)", site.mask_note), site.mask_note
    monkeypatch.setattr(masks, "MAX_ELEMENTS", 1 << 20)
    monkeypatch.setattr(masks, "_ROWWISE", masks._ROWWISE - {torch.ops.aten.le.Tensor})
    site = _site("bool-compare")  # an op not computed by rows makes a value larger than a block
    assert not site.mask_causal and "(le" in site.mask_note, site.mask_note


def test_a_mask_on_the_meta_device_is_evaluated_on_the_host():
    torch.manual_seed(0)
    with torch.device("meta"):
        model = MaskedLM("additive-inf")
    batch = {k: v.to("meta") for k, v in _batch().items()}
    _, _, ctx = _prepare(model, {"cp": 2}, batch)
    (site,) = ctx.of_kind("attention")
    assert site.mask_causal, site.mask_note


@pytest.mark.parametrize("kind", ["additive-inf", "bool-compare", "additive-finfo-min"])
def test_ring_over_a_causal_mask_matches_one_device_and_drops_the_mask(local_world, fp64, kind):
    torch.manual_seed(0)
    ref, batch = MaskedLM(kind), _batch()
    (site,) = _prepare(ref, {"cp": 2}, batch)[2].of_kind("attention")
    mask_nodes = {n.name for n in masks._ancestors(site.node.args[3]) if n.op == "call_function"}
    with local_world(2):
        res = run_equivalence(ref, batch, (2,), ("cp",), plan="dp", overrides={"attention": "ring@cp"}, steps=2)
    lowered = {n.name for n in res.graph_module.graph.nodes}
    assert mask_nodes and not mask_nodes & lowered, mask_nodes & lowered  # the mask is dead after the rewrite
    assert set(res.grad_err) == {n for n, _ in ref.named_parameters()} - {"bias_scale"}
    assert res.max_err() < 1e-10, res.max_err()
    assert [s.form for s in res.plan.strategies if s.kind == "attention"] == ["ring"]
    assert res.comm_counts["p2p.forward"] == 1 and res.comm_counts["p2p.backward"] == 2, res.comm_counts


def test_forcing_ring_over_a_padding_mask_says_why(local_world, fp64):
    torch.manual_seed(0)
    model, batch = MaskedLM("padding"), _batch()
    with local_world(2):
        from torch.distributed.device_mesh import init_device_mesh
        mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("cp",))
        with pytest.raises(ValueError, match=r"form 'ring' on mesh axis 'cp' \(size 2\).*is not possible: its mask "
                                             r"depends on input attention_mask \(padding\); ring attention supports "
                                             r"is_causal or no mask\. Fix: 'ulysses', 'heads' or 'replicate'"):
            autopar.parallelize(model, mesh, batch, plan="dp", overrides={"attention": "ring"})
        pm = autopar.parallelize(model, mesh, batch, plan="dp", overrides={"attention": "ulysses"})
    assert [s.form for s in pm.plan.strategies if s.kind == "attention"] == ["ulysses"]


def _fake_site(**kw) -> AttentionSite:
    base = dict(key="attn", node=None, spelling="sdpa", heads=4, kv_heads=4, head_dim=8, seq_len=16)
    return AttentionSite(**{**base, **kw})


CONDITIONS = {  # (form's precondition, site fields, axis size, whether the sequence condition fails)
    "ring-explicit": (ring_precondition, dict(spelling="explicit"), 2, False),
    "ring-mask": (ring_precondition, dict(has_mask=True, mask_note="its mask depends on input attention_mask"), 2,
                  False),
    "ring-dropout": (ring_precondition, dict(dropout=0.1), 2, False),
    "ring-sequence": (ring_precondition, dict(seq_len=12), 4, True),
    "ulysses-explicit": (ulysses_precondition, dict(spelling="explicit"), 2, False),
    "ulysses-heads": (ulysses_precondition, dict(heads=3, kv_heads=3), 2, False),
    "ulysses-kv": (ulysses_precondition, dict(heads=6, kv_heads=3), 2, False),
    "ulysses-sequence": (ulysses_precondition, dict(seq_len=15), 2, True),
}


@pytest.mark.parametrize("name", list(CONDITIONS))
def test_each_condition_has_its_own_reason_and_fix(name):
    check, fields, size, sequence = CONDITIONS[name]
    why = check(_fake_site(**fields), size)
    assert why and "Fix:" in why, why
    assert ("pad the sequence" in why) is sequence, why
    assert why.count("Fix:") == 1, why
    assert check(dataclasses.replace(_fake_site(**fields), **{k: v for k, v in _fake_site().__dict__.items()
                                                              if k in fields}), size) is None
