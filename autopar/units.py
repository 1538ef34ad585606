"""Sizes in bytes, as users write them and as messages print them.

`parse_bytes(value, name)` reads a size a user passed (`memory_limit=`): an int or float number of
bytes, or a string with a unit, `"80GB"`, `"80 GiB"`, `"512MB"`, `"1.5TB"`. Units follow SI and IEC:
`KB`/`MB`/`GB`/`TB`/`PB` are powers of 1000 (datasheets: an H100 has 80 GB = 80e9 bytes), `KiB`/`MiB`/
`GiB`/`TiB`/`PiB` powers of 1024; `B` or no unit is bytes; case does not matter. `None` and `"auto"`
mean "not given" (the cluster's device memory). NaN, infinities, zero and negative sizes, unknown
units and other types are refused, saying what was expected.

`fmt_bytes(n)` prints a size in the largest binary unit under which it is at least 1 (B, KiB, MiB,
GiB, TiB) with three significant digits: `512 B`, `1.50 KiB`, `12.3 MiB`, `80.0 GiB`.
"""

from __future__ import annotations

import math
import re

__all__ = ["parse_bytes", "fmt_bytes", "UNITS"]

UNITS = {"b": 1, **{p + "b": 1000 ** (i + 1) for i, p in enumerate("kmgtp")},
         **{p + "ib": 1024 ** (i + 1) for i, p in enumerate("kmgtp")}}
_SIZE = re.compile(r"^\s*([0-9]*\.?[0-9]+(?:e[+-]?[0-9]+)?)\s*([a-z]*)\s*$", re.IGNORECASE)
_EXAMPLES = "e.g. 80e9, \"80GB\" (80·10^9 bytes), \"80 GiB\" (80·2^30 bytes), \"512MB\" or \"auto\""


def parse_bytes(value, name: str = "memory_limit") -> int | None:
    """A size in bytes from an int, a float or a string with a unit; None for None and "auto"."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float, str)):
        raise TypeError(f"{name} must be a number of bytes or a size string ({_EXAMPLES}); got "
                        f"{type(value).__name__} {value!r}")
    if isinstance(value, str):
        if value.strip().lower() == "auto":
            return None
        m = _SIZE.match(value)
        unit = m.group(2).lower() if m else ""
        if not m or unit not in UNITS and unit:
            raise ValueError(f"{name}={value!r} is not a size: expected a number and one of the units "
                             f"{', '.join(_UNIT_NAMES)} ({_EXAMPLES})")
        number = float(m.group(1)) * UNITS[unit or "b"]
    else:
        number = float(value)
    if not math.isfinite(number) or number <= 0:
        raise ValueError(f"{name} must be a positive, finite number of bytes, got {value!r}; give the memory "
                         f"per device ({_EXAMPLES}), or leave it None to use the cluster's device memory")
    if number < 1:
        raise ValueError(f"{name}={value!r} is less than one byte; sizes are in bytes ({_EXAMPLES})")
    return int(number)


_UNIT_NAMES = ("B", "KB", "MB", "GB", "TB", "PB", "KiB", "MiB", "GiB", "TiB", "PiB")


def fmt_bytes(n: float) -> str:
    """`512 B`, `1.50 KiB`, `12.3 MiB`, `80.0 GiB`: three significant digits in the fitting binary unit."""
    sign, v = ("-" if n < 0 else ""), abs(float(n))
    if v < 1024:
        return f"{sign}{v:.0f} B"
    for unit in ("KiB", "MiB", "GiB", "TiB"):
        v /= 1024
        if v < 1024 or unit == "TiB":
            break
    digits = 0 if v >= 99.95 else 1 if v >= 9.995 else 2
    return f"{sign}{v:.{digits}f} {unit}"
