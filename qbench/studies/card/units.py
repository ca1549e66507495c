"""How the card prints numbers, the one set every page uses: signed percentages capped where a collapsed model's
digits are noise, decimal bytes and MB, shares, ratios, fixed decimals, and the change axis's tick labels.

Each returns ``-`` for a number that is absent (None), so a column reads the same for every missing cell."""

from __future__ import annotations

import math
from typing import Any

# beyond ±10,000 % a change only says "broken": three significant digits say how broken (the one rule of
# qbench.eval.tolerance, which writes every metric's values)
from qbench.eval.tolerance import PCT_CAP, number_text, value_text

SIZE_UNIT = "MB = 10⁶ bytes"


def signed(x: float) -> str:
    """``+1.23``, or ``+4.65e+23`` beyond ±10,000: the 24 digits of a collapsed model's change are noise that
    widens its table, not information."""
    return number_text(x)


def pct(x: float | None) -> str:
    """A change in percent, ``+0.97 %``; ``NaN`` where the change is not a number (card.json stores NaN as null)."""
    return value_text(x)


def num(x: Any, spec: str = ".3g") -> str:
    """Any identity or statistic value: ``spec`` below 10,000, thousands-separated integers above (a kurtosis of
    12,345 in ``.3g`` reads 1.23e+04); booleans as yes/no, other values as text."""
    if x is None:
        return "-"
    if isinstance(x, float) and not math.isfinite(x):
        return str(x)
    if isinstance(x, bool):
        return "yes" if x else "no"
    if isinstance(x, int | float):
        return format(x, spec) if abs(x) < 1e4 else f"{x:,.0f}"
    return str(x)


def fixed(x: float | None, digits: int) -> str:
    """``0.0507``: a fixed number of decimals, for values whose scale the column states (KLD in nats, a share)."""
    return "-" if x is None else f"{x:.{digits}f}"


def share_text(x: float | None, digits: int = 1) -> str:
    """``60.8%``: a fraction of a whole (of bf16, of the heads, of the reads)."""
    return "-" if x is None else f"{x:.{digits}%}"


def percent(x: float | None) -> str:
    """``89.2 %``: an agreement rate (top-1) in percent with its unit spaced, as docs/metrics.md writes it."""
    return "-" if x is None else f"{100 * x:.1f} %"


def ratio(x: float | None) -> str:
    """``2.32×``: a speed-up or a multiple."""
    return "-" if x is None else f"{x:.2f}×"


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


SUPERSCRIPT = str.maketrans("-0123456789", "⁻⁰¹²³⁴⁵⁶⁷⁸⁹")


def pct_tick(v: float) -> str:
    """A change axis's tick label: ``0 %``, ``2.5 %``, ``1,000 %``; from ±10,000 % (``PCT_CAP``, where the tables
    switch to three significant digits) a power of ten, ``10⁶ %`` (one glyph row, no mathtext)."""
    if v == 0:
        return "0 %"
    if abs(v) < PCT_CAP:
        return f"{v:,.6g} %"
    k = round(math.log10(abs(v)))
    sign = "−" if v < 0 else ""
    if math.isclose(abs(v), 10.0**k, rel_tol=1e-9):
        return f"{sign}10{str(k).translate(SUPERSCRIPT)} %"
    return f"{v:.2g} %"
