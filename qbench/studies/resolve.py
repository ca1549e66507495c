"""``--resolve`` (``qbench card``, ``qbench sweep``): re-evaluate an *undecided* cell on more tokens until the
measurement decides it.

A verdict is undecided when the cell's 95 % interval straddles the tolerance (``qbench.eval.evidence.decide``).
More windows narrow the interval (as 1/√windows, at the cell's per-window spread), so the cell is evaluated again
at twice the tokens, and again, until its verdict is *within* or *beyond*, or the next budget would pass the cap
(``--resolve MAX_TOKENS``; by default 4 × the command's own budget: :data:`RESOLVE_FACTOR`), or the text has no
more tokens to give. Each re-evaluation is an ordinary cell of the larger protocol — its own record, float
baseline and per-token evidence beside the others, reused on a rerun — and the row that showed the undecided
cell now shows the decided one, with the tokens it took and the verdicts on the way (``resolved``).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from models.errors import UserError

# the default cap: this many times the command's own token budget (two doublings)
RESOLVE_FACTOR = 4


def resolve_cap(value: int | None, tokens: int) -> int | None:
    """The cap ``--resolve`` asks for: None (not asked), ``-1`` (asked without a value: RESOLVE_FACTOR × tokens)
    or the tokens given, which must be more than the budget it starts from."""
    if value is None:
        return None
    if value == -1:
        return RESOLVE_FACTOR * tokens
    if value <= tokens:
        raise UserError(
            f"--resolve {value}: the cap must be above the {tokens:,} tokens the cells start from "
            f"(e.g. --resolve {RESOLVE_FACTOR * tokens}, which --resolve alone means)"
        )
    return value


def _step(record: Mapping[str, Any], tolerance: float, metric: str) -> dict[str, Any]:
    from qbench.eval.evidence import decide

    d = decide(record, tolerance, metric)
    return {
        "tokens_scored": (record.get("protocol") or {}).get("tokens_scored"),
        "verdict": d.verdict,
        "value": d.value,
        "ci95": None if d.low is None else [d.low, d.high],
    }


def resolve(
    record: dict[str, Any],
    evaluate: Callable[[int], dict[str, Any]],
    tokens: int,
    cap: int,
    tolerance: float,
    metric: str = "ppl",
) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """(the record that decides, the steps taken): while ``record`` is undecided and twice ``tokens`` fits
    ``cap`` — the last step may stop at the cap itself — ``evaluate(t)`` the same cell at ``t`` tokens. Steps
    start with the undecided record; empty when it was decided already (nothing re-evaluated)."""
    from qbench.eval.evidence import UNDECIDED, decide

    steps: list[dict[str, Any]] = []
    while decide(record, tolerance, metric).verdict == UNDECIDED and tokens < cap:
        if not steps:
            steps.append(_step(record, tolerance, metric))
        scored = (record.get("protocol") or {}).get("tokens_scored") or 0
        tokens = min(2 * tokens, cap)
        record = evaluate(tokens)
        steps.append(_step(record, tolerance, metric))
        if ((record.get("protocol") or {}).get("tokens_scored") or 0) <= scored:
            break  # the text has no more tokens: more budget would score the same windows
    return record, steps


def describe(steps: list[dict[str, Any]]) -> str:
    """``undecided at 4,096 → within at 8,192 tokens``."""
    return " → ".join(f"{s['verdict']} at {s['tokens_scored']:,}" for s in steps) + " tokens"
