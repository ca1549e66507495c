"""What a tolerance applies to (``--metric``) and how it reads, with nothing else: the card's sentences
(``qbench.studies.card.words``) need them without the tensors :mod:`qbench.eval.evidence` computes with, so this
module imports no torch. :mod:`qbench.eval.evidence` re-exports every name here."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
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
    if check_metric(metric) == "ppl":
        return f"{tolerance:g} %"
    if metric == "kld":
        return f"KLD {tolerance:g} nats"
    return f"{tolerance:g} % top-1 changed"


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
