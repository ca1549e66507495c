"""What a tolerance applies to (``--metric``) and how it reads, with nothing else: the tolerance in its unit, and
the value and 95 % interval a verdict on each metric was computed from as every table, sentence and figure shows
them (:func:`interval_text`). The card's sentences (``qbench.studies.card.words``) need them without the tensors
:mod:`qbench.eval.evidence` computes with, so this module imports no torch. :mod:`qbench.eval.evidence` re-exports
the names it always did."""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from typing import Any, TypedDict

LEVEL = 0.95  # every interval qbench reports
# The one-sided error rate of one verdict: a cell exactly at the tolerance is called *within* (its interval's upper
# end at or below the tolerance) at most this often — --resolve's looks share it (qbench.eval.evidence.Look).
ALPHA = (1 - LEVEL) / 2

# What a tolerance applies to (``--metric``), in that metric's unit, and its default.
METRICS = {
    "ppl": ("perplexity change", "%", 1.0),
    "kld": ("mean KL divergence from the float model", "nats", 0.01),
    "top1": ("tokens whose most likely next token changed", "%", 1.0),
}
DEFAULT_METRIC = "ppl"


def check_metric(metric: str) -> str:
    if metric not in METRICS:
        from models.errors import unknown_choice

        raise unknown_choice("metric", metric, tuple(METRICS))
    return metric


def default_tolerance(metric: str) -> float:
    return METRICS[check_metric(metric)][2]


def tolerance_text(tolerance: float, metric: str = DEFAULT_METRIC) -> str:
    """A tolerance in words with its unit: ``1 %`` (perplexity change), ``KLD 0.01 nats``, ``1 % top-1 changed``."""
    return _with_unit(f"{tolerance:g}", metric)


# ------------------------------------------------------------------------------------- the deciding interval
#
# What a verdict was computed from, and how every display (sweep and compare tables, the card's lines, tables and
# figures, sweep.png) shows it: the one place that knows each metric's value, unit and decimals. Under ppl these
# are the texts the displays always printed.

# A change beyond ±10,000 % only says "broken": three significant digits say how broken (the card's tables).
PCT_CAP = 1e4

# (a table column's heading, an axis label) of each metric's values
_HEADINGS = {
    "ppl": ("change", "perplexity change (%)"),
    "kld": ("KLD (nats)", "mean KL divergence from the float model (nats)"),
    "top1": ("top-1 changed (%)", "tokens whose top-1 token changed (%)"),
}
_MIN_DECIMALS = {"ppl": 2, "kld": 4, "top1": 2}


def deciding_interval(metrics: Mapping[str, Any], metric: str = DEFAULT_METRIC) -> tuple[Any, Any]:
    """(value, 95 % interval) of a record's ``metrics`` block that a verdict on ``metric`` reads, in the metric's
    unit: the perplexity change and ``ppl_change_ci95`` (%), ``kld_mean`` and ``kld_mean_ci95`` (nats), or the
    share of tokens whose top-1 token changed, 100 · (1 − ``top1_agreement``), and its interval (%). None where
    the record has none."""
    if check_metric(metric) == "ppl":
        return metrics.get("ppl_change_pct"), metrics.get("ppl_change_ci95")
    if metric == "kld":
        return metrics.get("kld_mean"), metrics.get("kld_mean_ci95")
    agree, ci = metrics.get("top1_agreement"), metrics.get("top1_agreement_ci95")
    value = None if agree is None else 100 * (1 - agree)
    return value, None if ci is None else [100 * (1 - ci[1]), 100 * (1 - ci[0])]


def row_interval(row: Mapping[str, Any], metric: str = DEFAULT_METRIC) -> tuple[Any, Any]:
    """(value, 95 % interval) a table row (a sweep cell, a card row or curve point, a repair: what
    ``qbench.eval.evidence.row_fields`` adds) was decided on: on ppl its change and ``ppl_change_ci95``, as the
    tables always read them; on kld or top1 its ``decision`` (None, None where it has none on that metric)."""
    if check_metric(metric) == DEFAULT_METRIC:
        return row.get("ppl_change_pct"), row.get("ppl_change_ci95")
    decision = row.get("decision") or {}
    if decision.get("metric") == metric:
        return decision.get("value"), decision.get("ci95")
    return None, None


def metric_heading(metric: str = DEFAULT_METRIC) -> str:
    """A table column of ``metric``'s values: ``change`` (perplexity, %), ``KLD (nats)``, ``top-1 changed (%)``."""
    return _HEADINGS[check_metric(metric)][0]


def metric_axis_label(metric: str = DEFAULT_METRIC) -> str:
    """A figure axis of ``metric``'s values, with its unit."""
    return _HEADINGS[check_metric(metric)][1]


def decimals(metric: str, tolerance: float | None = None) -> int:
    """The decimals a value of ``metric`` is shown with: 2 for a change in %, 4 for nats, and more where the
    tolerance is finer (two beyond its leading digit: KLD 1e-4 nats shows 6), so a value reads against it."""
    least = _MIN_DECIMALS[check_metric(metric)]
    if metric == "ppl" or not tolerance or tolerance <= 0 or not math.isfinite(tolerance):
        return least
    return max(least, 2 - math.floor(math.log10(tolerance)))


def number_text(
    x: float, metric: str = DEFAULT_METRIC, tolerance: float | None = None, cap: bool = True
) -> str:
    """A value of ``metric`` without its unit: a perplexity change signed (``+0.97``; with ``cap`` three
    significant digits from ±:data:`PCT_CAP`, ``+4.65e+23``), a KLD or a top-1 share with :func:`decimals`."""
    if check_metric(metric) == "ppl":
        return f"{x:+.2e}" if cap and abs(x) >= PCT_CAP else f"{x:+.2f}"
    text = f"{x:.{decimals(metric, tolerance)}f}"
    return text.removeprefix("-") if float(text) == 0 else text  # an interval's end at -1e-9 is 0, not -0


def _with_unit(number: str, metric: str, named: bool = True) -> str:
    if check_metric(metric) == "ppl":
        return f"{number} %"
    if metric == "kld":
        return f"KLD {number} nats" if named else f"{number} nats"
    return f"{number} % top-1 changed" if named else f"{number} %"


def value_text(
    x: float | None, metric: str = DEFAULT_METRIC, tolerance: float | None = None, named: bool = True
) -> str:
    """A value of ``metric`` in words with its unit, as :func:`tolerance_text` writes the tolerance: ``+0.97 %``,
    ``KLD 0.0123 nats``, ``1.23 % top-1 changed``; not ``named`` (a table column whose heading names the metric)
    ``0.0123 nats``, ``1.23 %``. ``NaN`` where there is no number (card.json's null)."""
    if x is None:
        return "NaN"
    return _with_unit(number_text(x, metric, tolerance), metric, named)


def ends_text(
    ci: Sequence[float], metric: str = DEFAULT_METRIC, tolerance: float | None = None, cap: bool = True
) -> str:
    """An interval's ends in the metric's numbers: ``[+0.41, +1.53]``, ``[0.0101, 0.0145]``."""
    return f"[{number_text(ci[0], metric, tolerance, cap)}, {number_text(ci[1], metric, tolerance, cap)}]"


def interval_text(
    value: float | None,
    ci: Sequence[float] | None,
    metric: str = DEFAULT_METRIC,
    tolerance: float | None = None,
    style: str = "bracket",
    named: bool = True,
) -> str:
    """A value with its 95 % interval, in the metric's unit.

    ``bracket`` (sentences and the card's tables): ``+0.97 % [+0.41, +1.53]``, ``KLD 0.0123 nats [0.0101,
    0.0145]``, ``1.23 % top-1 changed [0.80, 1.66]`` (not ``named``, in a column whose heading names the metric:
    ``0.0123 nats [0.0101, 0.0145]``, ``1.23 % [0.80, 1.66]``); the value alone without an interval.
    ``pm`` (the sweep's and compare's cells): the value ± the interval's half-width, ``+0.97 ±0.56`` (a change
    in %, as the captions say), ``0.0123 ±0.0022 nats``, ``1.23 ±0.43 %``; ``(no interval)`` without one.
    ``NaN`` where there is no value (``pm``: no finite one)."""
    if value is None:
        return "NaN"
    if style == "bracket":
        text = value_text(value, metric, tolerance, named)
        return f"{text} {ends_text(ci, metric, tolerance)}" if ci else text
    if style != "pm":
        raise ValueError(f"interval style {style!r}: bracket or pm")
    if not math.isfinite(value):
        return "NaN"
    text = number_text(value, metric, tolerance, cap=False)
    if ci:
        text += f" ±{(ci[1] - ci[0]) / 2:.{decimals(metric, tolerance)}f}"
    if metric != "ppl":  # a change's % the captions say
        text += f" {METRICS[metric][1]}"
    return text if ci else f"{text} (no interval)"


class RowDecision(TypedDict):
    """A row's verdict on one metric as sweep.json and card.json hold it (``qbench.eval.evidence.Decision.to_dict``;
    what :func:`row_interval` reads)."""

    metric: str
    value: float | None
    ci95: list[float] | None
    verdict: str
    tokens_to_decide: int | None
    reason: str | None


class Sequential(TypedDict):
    """The look of ``--resolve`` that decided a row (``qbench.eval.evidence.Look``, with its interval): the rule,
    the look of the planned ones, the one-sided alpha it spent of ``alpha_total``, and the interval it decided on
    (t at 1 − alpha with ``df`` degrees of freedom). card.json's steps hold it."""

    rule: str
    look: int
    looks: int
    alpha_one_sided: float
    alpha_total: float
    df: int
    critical_t: float
    interval: list[float]


class Decisions(TypedDict):
    """:func:`decisions_block`: a sweep's or a card model's verdicts and the false *within* calls they could make."""

    count: int
    alpha_one_sided: float
    expected_false_within_max: float


def decision_count(rows: Iterable[Mapping[str, Any]]) -> int:
    """How many of ``rows`` (sweep cells, card rows: ``qbench.eval.evidence.row_fields``'s ``decision``) were tested
    against the tolerance on an interval — a row that ran (status ok) with one; a record shown in several rows
    (the sweep's widest cell, shared by its curves; a format the card also sweeps) once, by its ``record``."""
    seen: set[Any] = set()
    for i, row in enumerate(rows):
        if row.get("status", "ok") != "ok" or (row.get("decision") or {}).get("ci95") is None:
            continue
        seen.add(row.get("record") or ("row", i))
    return len(seen)


def decisions_block(count: int) -> dict[str, Any]:
    """``decisions`` of a sweep.json or a card's model section: ``count`` verdicts, each calling a row exactly at the
    tolerance *within* at most :data:`ALPHA` of the time (one-sided; a --resolve row over all its looks), so were
    every row at the tolerance, at most count × ALPHA false *within* calls would be expected — an upper bound: a
    row truly beyond is called within less often, one truly within cannot be called so falsely."""
    return {"count": count, "alpha_one_sided": ALPHA, "expected_false_within_max": count * ALPHA}


def decisions_text(
    block: Mapping[str, Any], tolerance: float, metric: str = DEFAULT_METRIC, what: str = ""
) -> str:
    """``decisions_block`` in one sentence: ``48 verdicts against 1 % (…), each at a one-sided 2.5 % (a --resolve
    row over all its looks): were every one exactly at the tolerance, at most 1.2 of them would be called within
    on average (48 × 0.025: an upper bound on the expected false *within* calls).``"""
    count, alpha = block["count"], block["alpha_one_sided"]
    return (
        f"{count} verdicts against {tolerance_text(tolerance, metric)}{f' ({what})' if what else ''}, each at a "
        f"one-sided {100 * alpha:g} % (a --resolve row over all its looks): were every one exactly at the "
        f"tolerance, at most {block['expected_false_within_max']:.2g} of them would be called within on average "
        f"({count} × {alpha:g}: an upper bound on the expected false *within* calls)."
    )
