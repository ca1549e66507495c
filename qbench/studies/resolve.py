"""``--resolve`` (``qbench card``, ``qbench sweep``): re-evaluate an *undecided* cell on more tokens until the
measurement decides it.

A verdict is undecided when the cell's 95 % interval straddles the tolerance (``qbench.eval.evidence.decide``).
More windows narrow the interval (as 1/√windows, at the cell's per-window spread), so the cell is evaluated again
at twice the tokens, and again, until its verdict is *within* or *beyond*, or the next budget would pass the cap
(``--resolve MAX_TOKENS``; by default 4 × the command's own budget: :data:`RESOLVE_FACTOR`), or the text has no
more tokens to give. Each re-evaluation is an ordinary cell of the larger protocol — its own record, float
baseline and per-token evidence beside the others, reused on a rerun — and the row that showed the undecided
cell now shows the decided one, with the tokens it took and the verdicts on the way (``resolved``).

**One error rate over all the looks.** Testing the same cell again at the 95 % level whenever it stays undecided
would call a cell whose true change sits exactly at the tolerance *within* more often than 2.5 % (6.0 % with the
default cap, 8.7 % with a 16× cap, simulated: ``tests/qbench/studies/test_resolve_error_rate.py``). The looks are
known before the first one — :func:`planned_looks`: the budget, twice it, … and the cap itself last, K of them — so
the one-sided 2.5 % is split over them (Bonferroni, ``qbench.eval.evidence.Look``): every look, the first
included, decides on the interval mean ± t(1 − 0.025/K, n − 1) · sd/√n of its n windows. Over all its looks such a
cell is then called within at most 2.5 % of the time, whatever the looks' correlation (the larger budgets hold the
smaller ones' windows) and whether or not every look is taken. A cell decided at the first look keeps its record
as it is (decided at 0.025/K, it is decided alike at 95 %); a re-evaluated one's record carries its last look
(``sequential``: in memory only) and each step says its look, the alpha it spent and the interval it decided on.
Without ``--resolve`` nothing changes: every cell is decided once, at 95 %.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
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


def planned_looks(tokens: int, cap: int) -> list[int]:
    """The token budgets ``--resolve`` may evaluate a cell at, in order: ``tokens``, twice it, … while below
    ``cap``, the last one the cap itself (``[4096, 8192, 16384]`` for the default cap of 4 × 4,096). Their number
    is the K the one-sided alpha is split over; a cap at or below ``tokens`` plans one look, the plain decision."""
    looks = [tokens]
    while looks[-1] < cap:
        looks.append(min(2 * looks[-1], cap))
    return looks


def _step(decision: Any, record: Mapping[str, Any]) -> dict[str, Any]:
    """One look as a row's ``resolved`` lists it: the tokens, the verdict at the look's level, the change and its
    95 % interval, and the look (``sequential``: the rule, the look, the one-sided alpha it spent, the critical t
    and the interval that decided it: ``qbench.eval.tolerance.Sequential``)."""
    return {
        "tokens_scored": (record.get("protocol") or {}).get("tokens_scored"),
        "verdict": decision.verdict,
        "value": decision.value,
        "ci95": None if decision.low is None else [decision.low, decision.high],
        "sequential": None if decision.sequential is None else dict(decision.sequential),
    }


def resolve(
    record: dict[str, Any],
    evaluate: Callable[[int], dict[str, Any]],
    tokens: int,
    cap: int,
    tolerance: float,
    metric: str = "ppl",
) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """(the record that decides, the steps taken): the looks of :func:`planned_looks`, each deciding at the
    one-sided 0.025 / K (module docstring); while ``record`` is undecided at its look, ``evaluate(t)`` the same
    cell at the next look's ``t`` tokens. Steps start with the first look; empty when it decided already (nothing
    re-evaluated: the record is returned as it is). A re-evaluated cell's record comes back as a copy carrying its
    last look (``sequential``), so every verdict read from it (``qbench.eval.evidence.decide``) is that look's."""
    from qbench.eval.evidence import UNDECIDED, Look, decide

    looks = planned_looks(tokens, cap)
    look = Look.planned(1, len(looks))
    decision = decide(record, tolerance, metric, look)
    if decision.verdict != UNDECIDED or len(looks) == 1:
        return record, []
    steps = [_step(decision, record)]
    for k, budget in enumerate(looks[1:], start=2):
        scored = (record.get("protocol") or {}).get("tokens_scored") or 0
        record = evaluate(budget)
        look = Look.planned(k, len(looks))
        decision = decide(record, tolerance, metric, look)
        steps.append(_step(decision, record))
        if decision.verdict != UNDECIDED:
            break
        if ((record.get("protocol") or {}).get("tokens_scored") or 0) <= scored:
            break  # the text has no more tokens: more budget would score the same windows
    return {**record, "sequential": look.to_dict()}, steps


def describe(steps: list[dict[str, Any]]) -> str:
    """``undecided at 4,096 → within at 8,192 tokens``."""
    return " → ".join(f"{s['verdict']} at {s['tokens_scored']:,}" for s in steps) + " tokens"


def rule_text(steps: Sequence[Mapping[str, Any]]) -> str:
    """The rule the looks of ``steps`` were decided by, in words (empty for steps from before the rule, which
    hold no alpha): ``each look at a one-sided α of 0.025/3 = 0.0083 (Bonferroni over the 3 planned looks), so a
    cell exactly at the tolerance is called within at most 2.5 % of the time over all its looks``."""
    look = next((s["sequential"] for s in steps if s.get("sequential")), None)
    if look is None:
        return ""
    looks, alpha, total = look["looks"], look["alpha_one_sided"], look["alpha_total"]
    return (
        f"each look at a one-sided α of {total:g}/{looks} = {alpha:.2g} (Bonferroni over the {looks} planned "
        f"looks), so a cell exactly at the tolerance is called within at most {100 * total:g} % of the time over "
        "all its looks"
    )
