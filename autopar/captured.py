"""The captured program: what `autopar.capture` hands to recognition, planning and lowering."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import fx
from torch.utils import _pytree as pytree


@dataclass
class Captured:
    gm: fx.GraphModule
    input_kinds: list[tuple[str, str, str | None]]  # (placeholder, kind, fqn/constant name) in call order
    param_fqns: dict[str, str]  # placeholder -> parameter fqn
    buffer_fqns: dict[str, str]  # placeholder -> buffer fqn
    constants: dict[str, torch.Tensor]  # placeholder -> lifted constant tensor
    user_inputs: list[str]  # placeholders of user inputs, in flattened call order
    in_spec: pytree.TreeSpec
    out_spec: pytree.TreeSpec
    num_user_outputs: int
    example_shapes: list[tuple | None]  # per flattened user input: shape of tensors, None otherwise
    notes: list[str] = field(default_factory=list)  # what capture had to do (opaque submodules)
    # the ids and class targets computed from the user inputs, checked before the program runs (`autopar.index_checks`)
    index_checks: object = None
    # the mixed-precision policy it was captured under (`autopar.precision.Precision`; parameters at param_dtype)
    precision: object = None
    master_dtype: object = None  # then: the floating parameters' dtype as the model holds them (the optimizer's)

    def placeholder(self, name: str) -> fx.Node:
        (node,) = self.gm.graph.find_nodes(op="placeholder", target=name)
        return node

    def fingerprint(self) -> str:
        """A digest of the graph's ops, shapes and dtypes, and of the parameter names: two captures of the
        same model on inputs of the same shapes agree; a saved plan names the graph it was made for."""
        import hashlib
        h = hashlib.sha256()
        for n in self.gm.graph.nodes:
            val = n.meta.get("val")
            shape = tuple(val.shape) if isinstance(val, torch.Tensor) else None
            dtype = str(val.dtype) if isinstance(val, torch.Tensor) else None
            h.update(f"{n.op}|{n.name}|{getattr(n.target, '__name__', n.target)}|{shape}|{dtype};".encode())
        for ph, fqn in sorted(self.param_fqns.items()):
            h.update(f"{ph}={fqn};".encode())
        return h.hexdigest()[:16]
