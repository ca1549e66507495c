"""How the card prints numbers: signed percentages capped where a collapsed model's digits are noise, decimal
bytes and MB, shares."""

from __future__ import annotations

import math
from typing import Any

PCT_CAP = 1e4  # beyond ±10,000 % a change only says "broken": three significant digits say how broken


def signed(x: float) -> str:
    """``+1.23``, or ``+4.65e+23`` beyond ±10,000: the 24 digits of a collapsed model's change are noise that
    widens its table, not information."""
    return f"{x:+.2e}" if abs(x) >= PCT_CAP else f"{x:+.2f}"


def pct(x: float | None) -> str:
    return "NaN" if x is None else f"{signed(x)} %"


def num(x: Any, spec: str = ".3g") -> str:
    if x is None:
        return "-"
    if isinstance(x, float) and not math.isfinite(x):
        return str(x)
    if isinstance(x, bool):
        return "yes" if x else "no"
    if isinstance(x, int | float):
        return format(x, spec) if abs(x) < 1e4 else f"{x:,.0f}"
    return str(x)


def share_text(x: float | None) -> str:
    return "-" if x is None else f"{x:.1%}"


def decimal_bytes(n: int | None) -> str:
    """Decimal units (kB = 10³, MB = 10⁶, GB = 10⁹ bytes), as the card's captions state."""
    if not n:
        return "-"
    value = float(n)
    for unit in ("B", "kB", "MB", "GB"):
        if value < 1000 or unit == "GB":
            return f"{value:.0f} {unit}" if unit == "B" else f"{value:.2f} {unit}"
        value /= 1000
    return str(n)


def mb(n: int | None) -> str:
    """A size in MB (10⁶ bytes) for a column headed "(MB)", whatever its magnitude — ``decimal_bytes`` picks its own unit,
    which a header cannot state. Two decimals from 1 MB up; three significant digits below (a tiny model's KV
    cache: 0.238, not 0.24)."""
    if not n:
        return "-"
    value = n / 1e6
    if value >= 1:
        return f"{value:,.2f}"
    return f"{value:.{2 - math.floor(math.log10(value))}f}"  # 0.180, not .3g's 0.18


def mb_text(n: int | None) -> str:
    """``193.25 MB``: ``mb`` with its unit, for a size in prose or in a column without one."""
    return "-" if not n else f"{mb(n)} MB"


SIZE_UNIT = "MB = 10⁶ bytes"
