"""What recognition finds: typed sites, one frozen dataclass per kind, and the context passes share.

A *site* is one recognised structure of the captured graph, named by its module path (`key`), with
the graph node that anchors it and the parameter placeholders it owns by role. Composite sites
(attention, MLP, loss) hold the linear sites they cover as members. Sites are frozen: recognition
builds them once, everything after reads them (forms decide from their fields, the cost model
prices them, the planner assigns forms to them).

| kind        | anchor node                      | fields                                                    |
|-------------|----------------------------------|-----------------------------------------------------------|
| `linear`    | linear / addmm / mm / matmul     | weight layout (out dim), features, fused parts or slices  |
| `embedding` | aten.embedding                   | vocab, dim, padding_idx, max_norm, scale_grad_by_freq      |
| `attention` | SDPA (or the explicit 1st matmul)| heads, KV heads, head dim, sequence, mask, q/k/v/out linears|
| `mlp`       | its first column linear          | col / row linears, hidden features                        |
| `loss`      | cross_entropy_loss / mse_loss    | LM head linears, vocab, whether vocab-parallel applies    |
| `norm`      | layer_norm / the RMSNorm pow     | the normalised input, sequence dim and length             |
| `moe`       | autopar::moe_experts             | experts, top-k, tokens, FFN features, spelling            |
"""

from __future__ import annotations

import dataclasses
import enum
from dataclasses import dataclass, field
from typing import ClassVar

import torch
from torch import fx

from autopar.captured import Captured


class Kind(str, enum.Enum):
    """Kinds of recognised structure (an override key may name one)."""

    LINEAR = "linear"
    EMBEDDING = "embedding"
    ATTENTION = "attention"
    MLP = "mlp"
    LOSS = "loss"
    NORM = "norm"
    MOE = "moe"

    def __str__(self) -> str:
        return self.value


@dataclass(frozen=True, kw_only=True, eq=False)
class Site:
    """One recognised structure. Equality is identity (sites hold graph nodes)."""

    kind: ClassVar[Kind]
    key: str  # module path, e.g. "h.0.attn.qkv"; unique per site
    node: fx.Node
    params: tuple[tuple[str, str], ...] = ()  # (role, parameter placeholder), e.g. ("weight", "p_h_0_fc_weight")

    MEMBER_FIELDS: ClassVar[tuple[str, ...]] = ()

    @property
    def param(self) -> dict[str, str]:
        return dict(self.params)

    def members(self) -> list["LinearSite"]:
        """The linear sites a composite structure covers, each once."""
        out: list[LinearSite] = []
        for f in self.MEMBER_FIELDS:
            for m in getattr(self, f):
                if all(m is not o for o in out):
                    out.append(m)
        return out

    def all_params(self) -> set[str]:
        """Parameter placeholders of the structure and of its member layers."""
        names = {p for _, p in self.params}
        for m in self.members():
            names.update(p for _, p in m.params)
        return names

    def nodes(self) -> list[fx.Node]:
        """The anchor node and the members' nodes."""
        return list(dict.fromkeys([self.node] + [m.node for m in self.members()]))


@dataclass(frozen=True, kw_only=True, eq=False)
class LinearSite(Site):
    kind: ClassVar[Kind] = Kind.LINEAR
    out_dim: int  # the weight dim holding the output features (0 for nn.Linear, 1 for GPT-2's Conv1D)
    out_features: int
    in_features: int
    parts: int = 1  # a fused projection whose output is split into `parts` equal feature blocks (QKV, gate-up)
    head_interleaved: int = 0  # per-head fused QKV (GPT-NeoX, Bloom): head dim of each of the parts per head
    # a fused projection whose output is taken apart in contiguous feature blocks of any sizes (GQA/MQA fused QKV:
    # Phi-3's slices, Falcon's heads slice and KV index): (the node taking the block, first feature, end feature)
    part_slices: tuple[tuple[fx.Node, int, int], ...] = ()
    weight_shape: tuple[int, ...] = ()

    @property
    def input(self) -> fx.Node:
        """The activation the layer multiplies (x of x @ W)."""
        return self.node.args[1] if self.node.target is torch.ops.aten.addmm.default else self.node.args[0]


@dataclass(frozen=True, kw_only=True, eq=False)
class EmbeddingSite(Site):
    kind: ClassVar[Kind] = Kind.EMBEDDING
    vocab: int
    dim: int
    padding_idx: int | None = None
    max_norm: float | None = None
    scale_grad_by_freq: bool = False


@dataclass(frozen=True, kw_only=True, eq=False)
class AttentionSite(Site):
    kind: ClassVar[Kind] = Kind.ATTENTION
    MEMBER_FIELDS: ClassVar[tuple[str, ...]] = ("q", "k", "v", "out")
    spelling: str  # "sdpa" | "explicit"
    heads: int
    kv_heads: int
    head_dim: int
    seq_len: int
    has_mask: bool = False
    mask_causal: bool = False  # the mask is built from positions only and is causal (treated as is_causal)
    mask_note: str = ""  # why a mask is not usable by sequence forms
    unfused_why: str = ""  # explicit spelling: why it was not fused into SDPA (what sequence forms would need)
    dropout: float = 0.0
    causal: bool = False
    q: tuple[LinearSite, ...] = ()
    k: tuple[LinearSite, ...] = ()
    v: tuple[LinearSite, ...] = ()
    out: tuple[LinearSite, ...] = ()


@dataclass(frozen=True, kw_only=True, eq=False)
class MlpSite(Site):
    kind: ClassVar[Kind] = Kind.MLP
    MEMBER_FIELDS: ClassVar[tuple[str, ...]] = ("col", "row")
    col: tuple[LinearSite, ...] = ()
    row: tuple[LinearSite, ...] = ()
    features: int = 0


@dataclass(frozen=True, kw_only=True, eq=False)
class LossSite(Site):
    kind: ClassVar[Kind] = Kind.LOSS
    MEMBER_FIELDS: ClassVar[tuple[str, ...]] = ("head",)
    loss: str  # "cross_entropy" | "mse"
    head: tuple[LinearSite, ...] = ()
    vocab: int | None = None
    vocab_why: str | None = None  # why vocab-parallel cross-entropy does not apply (None: it does)


@dataclass(frozen=True, kw_only=True, eq=False)
class NormSite(Site):
    kind: ClassVar[Kind] = Kind.NORM
    input: fx.Node
    seq_dim: int
    seq_len: int


@dataclass(frozen=True, kw_only=True, eq=False)
class MoeSite(Site):
    kind: ClassVar[Kind] = Kind.MOE
    spec_key: str  # the registered ExpertsSpec (autopar.runtime.moe)
    spelling: str
    num_experts: int
    top_k: int
    tokens: int
    hidden: int
    ffn_features: int | None
    ffn_dims: tuple[tuple[int, int], ...] | None  # per entry of `params`: (dim, blocks) of its FFN features
    stacked: bool  # experts stored stacked (E, ...) rather than as a ModuleList
    expert_numel: int
    itemsize: int
    dtype: str
    ffn_why: str = ""  # why its experts' FFN features cannot be split (no `ffn_dims`)


SITE_TYPES: dict[Kind, type[Site]] = {t.kind: t for t in (LinearSite, EmbeddingSite, AttentionSite, MlpSite,
                                                          LossSite, NormSite, MoeSite)}


@dataclass
class PassContext:
    """What recognition passes share: the captured program and the sites found so far."""

    captured: Captured
    sites: list[Site] = field(default_factory=list)

    def of_kind(self, kind: Kind | str) -> list[Site]:
        kind = Kind(kind)
        return [s for s in self.sites if s.kind is kind]

    def add(self, site: Site) -> Site:
        """Register a site under a unique key (a second site at one module path gets `#1`, `#2`, ...)."""
        keys = {s.key for s in self.sites}
        key, i = site.key, 1
        while key in keys:
            key = f"{site.key}#{i}"
            i += 1
        if key != site.key:
            site = dataclasses.replace(site, key=key)
        site.node.meta["autopar_kind"] = site.kind.value
        self.sites.append(site)
        return site

    def planning_sites(self) -> list[Site]:
        """Composite structures, then the linears no composite covers: the units a plan assigns forms to."""
        composite = [s for s in self.sites if s.kind is not Kind.LINEAR]
        covered = {id(m) for s in composite for m in s.members()}
        return composite + [s for s in self.of_kind(Kind.LINEAR) if id(s) not in covered]


def module_path(node: fx.Node) -> str:
    stack = node.meta.get("nn_module_stack")
    if not stack:
        return ""
    return list(stack.values())[-1][0]
