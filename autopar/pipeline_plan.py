"""Pipeline parallelism in a plan: the form, its axis, the microbatch count and the stage cut.

This is the contract between the planner (which chooses a pipeline, `cost_model.pipeline` prices it) and the
runtime (which cuts the captured graph into stages and runs them on `torch.distributed.pipelining`).

A pipeline over an axis of size p runs `p * v` *stages* (v: stages per rank; 1 for `gpipe`/`1f1b`, two or more for
`interleaved-1f1b`, 2 for the V-shaped `zbv`/`dualpipev`). Stage `k` holds the consecutive layers
`cut[k] .. cut[k+1] - 1` of the model's repeated layers (`autopar.layers.find_layers`, in forward order); the nodes
before the first layer (embedding) go with stage 0 and those after the last layer (final norm, head, loss) with the
last stage. Stage `k` runs on the rank whose coordinate on the axis is `stage_rank(k)`: round-robin for
`interleaved-1f1b` (k mod p), V-shaped for `zbv`/`dualpipev` (0..p-1 then p-1..0), k for the others — as torch's
schedules place them.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

PIPELINE_FORMS = ("gpipe", "1f1b", "interleaved-1f1b", "zbv", "dualpipev")
_V_SHAPED = ("zbv", "dualpipev")


@dataclass(frozen=True)
class PipelinePlan:
    form: str  # one of PIPELINE_FORMS
    axis: str  # the mesh axis the stages are spread over
    microbatches: int  # m: the batch is split into m equal microbatches
    stages_per_rank: int = 1  # v
    cut: tuple[int, ...] = ()  # p*v + 1 layer indices: stage k holds layers cut[k] .. cut[k+1]-1; cut[0] == 0

    def __post_init__(self):
        if self.form not in PIPELINE_FORMS:
            raise ValueError(f"pipeline form {self.form!r} is not one of {', '.join(PIPELINE_FORMS)}")
        if self.microbatches < 1:
            raise ValueError(f"pipeline microbatches must be at least 1, got {self.microbatches}")
        if self.form in _V_SHAPED and self.stages_per_rank != 2:
            raise ValueError(f"pipeline form {self.form!r} runs exactly 2 stages per rank, got "
                             f"stages_per_rank={self.stages_per_rank}")
        if self.form == "interleaved-1f1b" and self.stages_per_rank < 2:
            raise ValueError("pipeline form 'interleaved-1f1b' runs two or more stages per rank, got "
                             f"stages_per_rank={self.stages_per_rank} (use '1f1b' for one)")
        if self.form in ("gpipe", "1f1b") and self.stages_per_rank != 1:
            raise ValueError(f"pipeline form {self.form!r} runs one stage per rank, got "
                             f"stages_per_rank={self.stages_per_rank} (use 'interleaved-1f1b' for more)")
        if self.cut and (self.cut[0] != 0 or any(b <= a for a, b in zip(self.cut, self.cut[1:]))):
            raise ValueError(f"pipeline cut {self.cut} must start at 0 and increase strictly (every stage holds "
                             "at least one layer)")

    @property
    def label(self) -> str:
        return f"{self.form}@{self.axis}"

    def n_stages(self, p: int) -> int:
        return p * self.stages_per_rank

    def stage_rank(self, k: int, p: int) -> int:
        """The coordinate on the pipeline axis of the rank that runs stage k."""
        if self.form in _V_SHAPED:
            return k if k < p else 2 * p - 1 - k
        return k % p


def parse_pipeline(value: str, mesh_axes: tuple[str, ...]) -> tuple[str, str]:
    """'FORM@axis' -> (form, axis); a ValueError saying what is wrong and how to write it."""
    if not isinstance(value, str) or "@" not in value:
        raise ValueError(f"a pipeline override is 'FORM@axis' with FORM one of {', '.join(PIPELINE_FORMS)}, "
                         f"e.g. '1f1b@pp'; got {value!r}")
    form, axis = value.split("@", 1)
    if form not in PIPELINE_FORMS:
        raise ValueError(f"pipeline form {form!r} (in {value!r}) is not one of {', '.join(PIPELINE_FORMS)}")
    if axis not in mesh_axes:
        raise ValueError(f"pipeline axis {axis!r} (in {value!r}) is not an axis of the mesh "
                         f"({', '.join(mesh_axes)}): name the axis to pipeline over, e.g. "
                         f"mesh_dim_names=('pp', ...) and '{form}@pp'")
    return form, axis


def bubble_fraction(form: str, p: int, m: int, v: int = 1) -> float:
    """The idle share of a pipeline step with equal stage times: GPipe and 1F1B (p-1)/(m+p-1), interleaved 1F1B
    (p-1)/(v*m+p-1) (Narayanan et al. 2021, 2104.04473), zero-bubble V schedules 0 with equal F, B and W times
    (Qi et al. 2024, 2401.10241)."""
    if p <= 1:
        return 0.0
    if form in ("gpipe", "1f1b"):
        return (p - 1) / (m + p - 1)
    if form == "interleaved-1f1b":
        return (p - 1) / (v * m + p - 1)
    if form in _V_SHAPED:
        return 0.0
    raise ValueError(f"pipeline form {form!r} is not one of {', '.join(PIPELINE_FORMS)}")


def balanced_cut(costs: list[float], n_stages: int, first: float = 0.0, last: float = 0.0,
                 stage_layer_s: list[float] | None = None) -> tuple[int, ...]:
    """The cut of len(costs) consecutive layers into n_stages non-empty stages that minimises the largest stage
    cost, where stage 0 also pays `first` (embedding) and the last stage `last` (head and loss). Exact (dynamic
    programme over prefix sums, O(n_stages * L^2)); ties break toward earlier cuts. Returns n_stages+1 indices.
    `stage_layer_s`: per stage, a factor on its layers' costs (stages whose forms or checkpoint levels differ run the
    same layer at different speeds)."""
    return _balanced_cut(tuple(costs), n_stages, first, last,
                         tuple(stage_layer_s) if stage_layer_s is not None else None)


@functools.lru_cache(maxsize=256)  # the `auto` search prices one stage model under several schedules alike
def _balanced_cut(costs: tuple[float, ...], n_stages: int, first: float, last: float,
                  stage_layer_s: tuple[float, ...] | None) -> tuple[int, ...]:
    L = len(costs)
    if stage_layer_s is not None and len(stage_layer_s) != n_stages:
        raise ValueError(f"stage_layer_s has {len(stage_layer_s)} factors for {n_stages} stages")
    if n_stages < 1 or n_stages > L:
        raise ValueError(f"cannot cut {L} layers into {n_stages} pipeline stages (each stage needs at least one "
                         f"layer): use at most {L} stages, or fewer stages per rank")
    pre = [0.0]
    for c in costs:
        pre.append(pre[-1] + c)

    def seg(i, j, k):  # layers i..j-1 as stage k
        scale = stage_layer_s[k] if stage_layer_s is not None else 1.0
        return (pre[j] - pre[i]) * scale + (first if k == 0 else 0.0) + (last if k == n_stages - 1 else 0.0)

    INF = float("inf")
    # best[k][j]: min over cuts of layers 0..j-1 into k+1 stages of the max stage cost
    best = [[INF] * (L + 1) for _ in range(n_stages)]
    arg = [[0] * (L + 1) for _ in range(n_stages)]
    for j in range(1, L + 1):
        best[0][j] = seg(0, j, 0)
    for k in range(1, n_stages):
        for j in range(k + 1, L + 1):
            for i in range(k, j):
                c = max(best[k - 1][i], seg(i, j, k))
                if c < best[k][j] - 1e-15:
                    best[k][j], arg[k][j] = c, i
    cut, j = [L], L
    for k in range(n_stages - 1, 0, -1):
        j = arg[k][j]
        cut.append(j)
    cut.append(0)
    return tuple(reversed(cut))


# the forms autopar.pipeline_runtime runs (the others parse, plan and price, and raise there)
IMPLEMENTED = ("gpipe", "1f1b", "interleaved-1f1b", "zbv")


def check_form(form: str, value: str) -> None:
    """Raise NotImplementedError for a pipeline form the runtime does not run (yet)."""
    if form not in IMPLEMENTED:
        raise NotImplementedError(
            f"override 'pipeline': {value!r}: the {form!r} pipeline schedule is not implemented yet (issue #23); "
            f"implemented: {', '.join(IMPLEMENTED)}. Fix: use one of those, e.g. '1f1b@{value.split('@', 1)[1]}'.")
