"""Identical layers read as one row: `model.layers.{0..79}.self_attn  ×80`.

A 70B plan lists each of its 80 layers' structures one by one: 400+ rows that repeat the same placements and
collectives. `group_rows` folds rows (tuples of cells, one of them a module path) that are equal once their layer
index is set aside: the index is the path's first all-digit component (`model.layers.7.mlp` -> `model.layers.`,
7), and a row's signature is every cell with that layer's path prefix (`model.layers.7`, as a whole path
component, wherever it appears: the parameter names of a structure whose key is no module) written with a
placeholder. Rows of one signature become one, at the place of its first, with the indices as a range
(`{0..79}`, `{1..3,5}`) and `×N` after the path (N: how many rows it stands for). A row whose path has no index,
or whose signature no other row shares, stays as it is. The numbers of a grouped row are those of each row it
stands for (they are equal), not their sum.

Used by `Plan.table` (`full=True`: every row), the HTML report (`autopar.report`) and the CLI.
"""

from __future__ import annotations

import re

_SLOT = "\x00"  # the layer index's place in a signature (no cell holds it)
_INDEX = re.compile(r"(?:^|\.)(\d+)(?=\.|$)")


def layer_index(path: str) -> tuple[str, int] | None:
    """(the path up to its first all-digit component, that component), e.g. ('model.layers.', 7); or None."""
    m = _INDEX.search(path)
    if m is None:
        return None
    return path[:m.start(1)], int(m.group(1))


def _signature(row: tuple[str, ...], key: int, prefix: str, index: int) -> tuple[str, ...]:
    """`row` with the layer's path prefix written with the placeholder: in the key, and in the other cells where
    it stands as a path (a top-level index, `0.attn` of a Sequential, only in the key: `0` also reads as a number)."""
    pattern = re.compile(rf"(?<![\w.]){re.escape(prefix)}{index}(?![\w])")
    return tuple(pattern.sub(prefix + _SLOT, cell) if i == key or prefix else cell for i, cell in enumerate(row))


def index_range(indices: list[int]) -> str:
    """'{0..79}', '{0..3,5,7..9}': sorted distinct indices, runs of 3 or more as a..b."""
    xs = sorted(set(indices))
    parts, i = [], 0
    while i < len(xs):
        j = i
        while j + 1 < len(xs) and xs[j + 1] == xs[j] + 1:
            j += 1
        if j - i >= 2:
            parts.append(f"{xs[i]}..{xs[j]}")
        else:
            parts += [str(x) for x in xs[i:j + 1]]
        i = j + 1
    return "{" + ",".join(parts) + "}"


def group_rows(rows: list[tuple[str, ...]], key: int = 0) -> list[tuple[tuple[str, ...], int, int]]:
    """`rows` with identical layers folded (see the module docstring): (row, how many rows it stands for, the
    position of its first row in `rows`), in the order of each group's first row. Column `key` holds the path."""
    groups: dict[tuple, list] = {}  # signature -> [first row, its position, indices]
    order: list[tuple] = []
    for pos, row in enumerate(rows):
        found = layer_index(row[key])
        if found is None:
            sig = ("row", pos)
            groups[sig] = [row, pos, []]
        else:
            sig = ("layer", found[0], _signature(row, key, *found))
            if sig not in groups:
                groups[sig] = [row, pos, []]
            groups[sig][2].append(found[1])
            if len(groups[sig][2]) > 1:
                continue
        order.append(sig)
    out = []
    for sig in order:
        first, pos, indices = groups[sig]
        if len(indices) <= 1:
            out.append((first, 1, pos))
            continue
        _, prefix, cells = sig
        span = index_range(indices)
        row = tuple(c.replace(prefix + _SLOT, prefix + span) for c in cells)
        out.append((row[:key] + (f"{row[key]}  ×{len(indices)}",) + row[key + 1:], len(indices), pos))
    return out
