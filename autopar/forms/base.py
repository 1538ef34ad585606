"""What a form is, and the registry of forms.

A *form* is one way a recognised structure runs on the mesh. One module per form declares
everything about it (`Form`):

- `name` (the registry key, also what overrides and plans print), the `kinds` of site it applies to,
  and the `roles` of the mesh axes it uses, one set per axis it takes (heads: a model axis; ring: the
  sequence axis; expert: a data or a model axis; heads+ring: a model axis, then the sequence axis);
- `precondition(site, sizes)`: the reason it cannot apply on axes of these sizes (what to change
  included), or None;
- `placements(site, axes)`: what it does to the structure's parameters, per placeholder and mesh axis;
- `directives(site, axes)`: what lowering needs beyond placements (`autopar.plan.Directive`: a value's
  placement, a row-parallel output's placement, an attention's runtime mode, the experts' axis, a fused
  projection run per block), keyed by graph node names so that a saved plan lowers on its own;
- `notes(site, axes)`: what the plan says about the choice beyond its placements (a parameter it leaves whole);
- `cost(site, stats, cand, mc)`: time and memory per device, from `cost_model`'s collective and
  compute functions (`autopar.estimate` gathers the shape facts and the mesh);
- flags the planner and solver read instead of names: `tensor_parallel` (splits its block over a
  model axis, activations replicated in and out: what sequence parallelism wraps), `sequence`
  (takes the sequence sharded on its sequence axis), `hand_plans` (the named plans that pick it),
  `offered` (whether the solver offers it), `partial_output` (its output is partial sums: the lowering
  carries them through residual adds), `recomputed_whole` (selective checkpointing keeps nothing inside it).

The registry is keyed by (kind, name): `vocab` is one form for an embedding and another for a loss,
`tp` one for an MLP and another for MoE experts.

Data parallelism and FSDP are forms of the parameters over the data axes (`autopar.forms.dp`,
`autopar.forms.fsdp`); a candidate combines a structure form with one of them.

The planner, the solver and the API iterate `FORMS`; none of them names a form. A new form is one
new module (listed in `autopar/forms/__init__.py`) and its tests.
"""

from __future__ import annotations

import dataclasses
import enum
from dataclasses import dataclass
from typing import TYPE_CHECKING, ClassVar

from autopar.plan import Directive, form_label
from autopar.sites import Kind, Site
from autopar.spec import Placement

if TYPE_CHECKING:
    from autopar.estimate import Cost, MeshCosting, SiteStats


class Role(str, enum.Enum):
    """What a mesh axis does in a plan: the batch is split over DATA axes, structures over MODEL axes,
    the sequence over the SEQUENCE axis (at most one)."""

    DATA = "data"
    MODEL = "model"
    SEQUENCE = "sequence"


@dataclass(frozen=True, kw_only=True)
class Candidate:
    """One choice for one structure: a form on mesh axes, its parameters FSDP-sharded over the data axes or not."""

    form: str
    axes: tuple[str, ...] = ()
    fsdp: bool = False
    # the ZeRO stage of its parameters over the data axes (`autopar.forms.zero`): 0 (dp / fsdp as `fsdp` says),
    # 1 (zero1: replicated, the optimizer step sharded; fsdp False) or 2 (zero2: sharded, gathered copies persisting;
    # fsdp True)
    zero: int = 0
    # `float8="auto"` under `plan="auto"` (`autopar.float8`): the linears of the structure (indices into
    # `autopar.estimate.float8_members`) whose GEMMs run in fp8 under `float8_recipe`; () : none
    float8: tuple[int, ...] = ()
    float8_recipe: str = ""

    def __post_init__(self):
        assert self.zero in (0, 1, 2) and (self.zero != 1 or not self.fsdp) and (self.zero != 2 or self.fsdp), self
        assert bool(self.float8) == bool(self.float8_recipe), self

    @property
    def axis(self) -> str | None:
        return self.axes[0] if self.axes else None

    @property
    def label(self) -> str:
        return (form_label(self.form, self.axes) + (f"+zero{self.zero}" if self.zero else "+fsdp" if self.fsdp else "")
                + (f"+{self.float8_recipe}{list(self.float8)}" if self.float8 else ""))

    def without_float8(self) -> "Candidate":
        return dataclasses.replace(self, float8=(), float8_recipe="")


class Form:
    """A form: see the module docstring. Subclasses set the class attributes and override the methods."""

    name: ClassVar[str]
    kinds: ClassVar[tuple[Kind, ...]]
    roles: ClassVar[tuple[frozenset[Role], ...]] = ()
    tensor_parallel: ClassVar[bool] = False
    sequence: ClassVar[bool] = False
    hand_plans: ClassVar[frozenset[str]] = frozenset()
    offered: ClassVar[bool] = True  # the solver offers it (colwise/rowwise are members' forms and overrides only)
    # its output (a row-parallel linear's, a vocab-parallel lookup's) is partial sums over its model axis, which
    # the lowering carries through residual adds of partial sums (`autopar.solver._carried`)
    partial_output: ClassVar[bool] = False
    # selective checkpointing keeps nothing inside it (`autopar.runtime.checkpoint.whole`: ring attention)
    recomputed_whole: ClassVar[bool] = False

    def row_linears(self, site: Site) -> list:
        """Tensor-parallel forms: the row-parallel linears whose outputs sequence parallelism reduce-scatters."""
        return []

    def precondition(self, site: Site, sizes: tuple[int, ...]) -> str | None:
        return None

    def placements(self, site: Site, axes: tuple[int, ...], sizes: tuple[int, ...]) -> dict[str, dict[int, Placement]]:
        """Parameter placeholder -> {mesh axis index: placement} (axes not named stay as they are)."""
        return {}

    def directives(self, site: Site, axes: tuple[str, ...]) -> list[Directive]:
        return []

    def plan_directives(self, site: Site, axes: tuple[str, ...], chosen: list[tuple[Site, "Form", Candidate]]
                        ) -> list[Directive]:
        """Directives this choice implies for other structures of the plan (`chosen`: every structure with its
        form and candidate), e.g. sequence parallelism reduce-scatters the tensor-parallel blocks' outputs."""
        return []

    def notes(self, site: Site, axes: tuple[str, ...]) -> list[str]:
        """What the plan should say about this choice beyond its placements (e.g. a parameter it leaves whole)."""
        return []

    def cost(self, site: Site, st: "SiteStats", cand: Candidate, mc: "MeshCosting") -> "Cost":
        raise NotImplementedError(f"form {self.name} has no cost model")

    def add_constraints(self, view, site: Site, cand: Candidate, var) -> None:
        """Constraints of choosing `cand` (the ILP variable `var`) for `site` beyond one-hot and memory,
        stated through `view` (`autopar.solver.ConstraintView`; forms never import the solver)."""


FORMS: dict[tuple[Kind, str], Form] = {}  # (kind, name) -> the form (one name may mean different forms per kind)


def register(cls: type[Form]) -> type[Form]:
    """Class decorator: one instance of the form in `FORMS` for each kind it applies to; a (kind, name)
    registers once."""
    form = cls()
    for kind in cls.kinds:
        if (kind, cls.name) in FORMS:
            raise ValueError(f"form {cls.name!r} for {kind} is registered twice "
                             f"({type(FORMS[kind, cls.name]).__module__} and {cls.__module__})")
        FORMS[kind, cls.name] = form
    return cls


def forms_for(kind: Kind) -> list[Form]:
    """The forms a kind of structure may take, in registration order (replicate first)."""
    return [f for (k, _), f in FORMS.items() if k is kind]


def form_names(kind: Kind) -> tuple[str, ...]:
    return tuple(f.name for f in forms_for(kind))


def form_of(kind: Kind, name: str) -> Form:
    try:
        return FORMS[kind, name]
    except KeyError:
        raise ValueError(f"{kind} has no form {name!r}; valid: {', '.join(form_names(kind))}") from None


def not_possible(site: Site, form: str, axes: tuple[str, ...], sizes: tuple[int, ...], why: str, mesh: str) -> str:
    where = ", ".join(f"{a!r} (size {s})" for a, s in zip(axes, sizes))
    return f"{site.kind} {site.key}: form {form!r} on mesh axis {where} of mesh {mesh} is not possible: {why}"
