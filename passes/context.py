"""What recognition passes share: the sites they find, in a `PassContext`."""

from __future__ import annotations

from dataclasses import dataclass, field

from torch import fx

from autopar.capture import Captured


@dataclass
class Site:
    """One recognised structure: a linear, embedding, attention or loss, named by module path."""

    kind: str
    key: str  # module path, e.g. "h.0.attn.qkv"; unique per site
    node: fx.Node
    params: dict[str, str] = field(default_factory=dict)  # role ("weight", "bias") -> parameter placeholder
    info: dict = field(default_factory=dict)

    MEMBER_ROLES = ("q", "k", "v", "out", "col", "row", "head")

    def members(self) -> list["Site"]:
        """The linear sites a composite structure covers (attention's q/k/v/out, an MLP's layers, a
        loss's LM head), each once."""
        out: list[Site] = []
        for role in self.MEMBER_ROLES:
            for m in self.info.get(role, []):
                if all(m is not o for o in out):
                    out.append(m)
        return out

    def all_params(self) -> set[str]:
        """Parameter placeholders of the structure and of its member layers."""
        names = set(self.params.values())
        for m in self.members():
            names.update(m.params.values())
        return names


@dataclass
class PassContext:
    captured: Captured
    sites: list[Site] = field(default_factory=list)

    def of_kind(self, kind: str) -> list[Site]:
        return [s for s in self.sites if s.kind == kind]

    def add(self, site: Site) -> Site:
        keys = {s.key for s in self.sites}
        base, i = site.key, 1
        while site.key in keys:
            site.key = f"{base}#{i}"
            i += 1
        site.node.meta["autopar_kind"] = site.kind
        self.sites.append(site)
        return site


def module_path(node: fx.Node) -> str:
    stack = node.meta.get("nn_module_stack")
    if not stack:
        return ""
    return list(stack.values())[-1][0]


# ops that move or rename data without mixing features across positions: recognisers see through them
import torch  # noqa: E402

aten = torch.ops.aten
TRANSPARENT = {
    aten.view.default, aten.reshape.default, aten._unsafe_view.default, aten.transpose.int, aten.permute.default,
    aten.contiguous.default, aten.clone.default, aten.to.dtype, aten.to.dtype_layout, aten._to_copy.default,
    aten.alias.default, aten.flatten.using_ints, aten.unflatten.int, aten.unsqueeze.default, aten.expand.default,
    aten.slice.Tensor, aten.dropout.default, aten.squeeze.dim,
}
