"""Decisions on records, no sentences: the attention-sink reading, which format to repair and the size it must beat,
and which model the comparison finds more robust."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

from qbench.studies.card.sizes import deployed_bytes, float_size

# Gu et al. 2024 ("When Attention Sink Emerges in Language Models", ICLR 2025) count a head as a sink when its mean
# attention weight on the first token exceeds ε = 0.3 (their Sink_ε: the share of such heads).
SINK_EPSILON = 0.3


# "No sink" up to this many times uniform attention's share: a randomly initialised gpt2-130m measures 1.0×, the
# sink-free demo models 0.7-1.6× (mean weight and top-1 share); a strict "above uniform" called the random one a sink.
SINK_CHANCE_MARGIN = 2.0


def sink_heads_share(head_mass: Sequence[Sequence[float]] | None) -> float | None:
    """Gu et al.'s Sink_ε: the share of (layer, head) pairs whose mean weight on key 0 exceeds :data:`SINK_EPSILON`
    (None without per-head weights)."""
    flat = [v for row in head_mass or () for v in row if v is not None]
    return sum(v > SINK_EPSILON for v in flat) / len(flat) if flat else None


def sink_verdict(
    mass: float | None, top1: float | None, chance: float | None, heads_share: float | None = None
) -> str | None:
    """``"sink"`` when some head puts more than :data:`SINK_EPSILON` of its attention on key 0 (``heads_share`` >
    0: Gu et al.'s criterion; without per-head weights, the mean weight over all heads reaching it); ``"no sink"``
    when both the mean weight and the top-1 share stay within :data:`SINK_CHANCE_MARGIN` × uniform causal
    attention's (``chance``); otherwise ``"weak"``: clearly above chance, no head a sink."""
    if chance is None or mass is None:
        return None
    if (heads_share or 0) > 0 or mass > SINK_EPSILON:
        return "sink"
    limit = SINK_CHANCE_MARGIN * chance
    if mass <= limit and (top1 is None or top1 <= limit):
        return "no sink"
    return "weak"


def repair_targets(
    formats: Sequence[Mapping[str, Any]],
    fp: Mapping[str, Any],
    profile: Mapping[str, Any],
    tolerance: float,
    metric: str = "ppl",
    source_bytes: int | None = None,
) -> list[Mapping[str, Any]]:
    """The formats a repair could pay for, in the order the card tries them: the formats decidedly beyond the
    tolerance that are smaller (deployed bytes) than what must be beaten (:func:`size_to_beat`), smallest first. A repair keeps layers in float, so it
    only adds bytes: a format not already smaller than the smallest passing one (or, with none, than the model in
    bf16 or a smaller block-quantised source file) could never pay, and the smallest candidate is the repair
    that would save the most if it reaches the tolerance."""
    from qbench.eval.evidence import BEYOND, decide

    limit, _ = size_to_beat(formats, fp, profile, tolerance, metric, source_bytes)
    sized = [(r, deployed_bytes(r["scheme"], fp, profile)) for r in formats if r.get("status") == "ok"]
    # decidedly beyond only: an undecided format may pass as it is (more tokens decide it: --resolve), and a
    # repair of a format that already lowers perplexity could only keep everything in float
    failing = [
        (b, i, r)
        for i, (r, b) in enumerate(sized)
        if b and decide(r, tolerance, metric).verdict == BEYOND and (limit is None or b < limit)
    ]
    return [x[2] for x in sorted(failing, key=lambda x: x[:2])]


def size_to_beat(
    formats: Sequence[Mapping[str, Any]],
    fp: Mapping[str, Any],
    profile: Mapping[str, Any],
    tolerance: float,
    metric: str = "ppl",
    source_bytes: int | None = None,
) -> tuple[int | None, str]:
    """(bytes, what) a repaired format must be smaller than to pay: the smallest of the formats within the
    tolerance, the whole model in bf16 (what a deployment falls back to; its own damage not measured here) and,
    for a source file whose weights are already block-quantised (a Q4_1 GGUF: ``source_bytes``), that file — it is
    the card's reference, so it has no damage of its own to beat."""
    options = [
        (b, f"`{r['scheme']['name']}`, which passes as it is")
        for r in formats
        if r.get("status") == "ok"
        and _within(r, tolerance, metric)
        and (b := deployed_bytes(r["scheme"], fp, profile))
    ]
    fp_bytes = fp.get("model_bytes") or 0
    if fp_bytes:
        options.append((fp_bytes * 2 // float_size(fp), "the model in bf16"))
    if source_bytes:
        options.append(
            (source_bytes, "the source file itself, already block-quantised (the card's reference)")
        )
    if not options:
        return None, "the model in bf16"
    return min(options, key=lambda o: o[0])


def worst_beyond(
    formats: Sequence[Mapping[str, Any]], tolerance: float, metric: str = "ppl"
) -> Mapping[str, Any] | None:
    """The format record decidedly beyond the tolerance with the largest perplexity change (NaN/inf first)."""
    from qbench.eval.evidence import BEYOND, decide

    beyond = [
        r
        for r in formats
        if r.get("status") == "nonfinite"
        or (r.get("status") == "ok" and decide(r, tolerance, metric).verdict == BEYOND)
    ]
    if not beyond:
        return None
    return max(beyond, key=lambda r: math.inf if r.get("status") != "ok" else r["metrics"]["ppl_change_pct"])


def _within(record: Mapping[str, Any], tolerance: float, metric: str = "ppl") -> bool:
    """Whether a record is *within* the tolerance of ``metric``: its 95 % interval's upper end ≤ tolerance
    (undecided is not)."""
    from qbench.eval.evidence import decide

    return decide(record, tolerance, metric).within


def least_of(values: Mapping[str, float]) -> str | None:
    """The one model with the smallest value; None on a tie."""
    best = min(values.values(), default=None)
    winners = [k for k, v in values.items() if v == best]
    return winners[0] if len(winners) == 1 else None


def more_robust_change(found: Mapping[str, Mapping[str, Any] | None]) -> str | None:
    """The model a row (a format, a KV setting) hurts *decidedly* least, on the card's ``--metric``: None when
    every model is within the tolerance (nothing to choose); else the one model whose 95 % interval lies wholly
    below every other model's (a decrease counts as no damage: intervals are clamped at 0; a failed or missing
    cell is the worst); None when the intervals overlap — the measurement cannot tell the models apart, and a
    point estimate would pick one by noise."""
    from qbench.eval.evidence import WITHIN

    if all(r is not None and r.get("verdict") == WITHIN for r in found.values()):
        return None

    def bounds(row: Mapping[str, Any] | None) -> tuple[float, float]:
        decision = (row or {}).get("decision") or {}
        value, ci = decision.get("value"), decision.get("ci95")
        if row is None or row.get("status") != "ok" or value is None:
            return math.inf, math.inf
        low, high = ci if ci else (-math.inf, math.inf)  # no interval: it could be anywhere
        return max(low, 0.0), max(high, 0.0)

    spans = {name: bounds(row) for name, row in found.items()}
    best = min(spans, key=lambda n: spans[n][1])
    if all(spans[best][1] < spans[other][0] for other in spans if other != best):
        return best
    return None


def _decidedly_below(a: Sequence[float] | None, b: Sequence[float] | None) -> bool | None:
    """Whether per-window mean NLLs ``a`` lie decidedly below ``b`` on the same windows: the 95 % interval of the
    paired differences (windows as clusters, ``qbench.eval.evidence.cluster_interval``) wholly below 0. None when
    the two were not measured on the same windows or give no interval (one window)."""
    import torch

    from qbench.eval.evidence import cluster_interval

    if not a or not b or len(a) != len(b):
        return None
    interval = cluster_interval(torch.tensor(a, dtype=torch.float64) - torch.tensor(b, dtype=torch.float64))
    return None if interval is None else interval[2] < 0


def below_others_float(
    quantised: Mapping[str, float | None],
    floats: Mapping[str, float | None],
    windows: Mapping[str, tuple[Sequence[float] | None, Sequence[float] | None]] | None = None,
) -> dict[str, list[str]]:
    """Absolute quality beside relative damage: {model: the other models whose *float* perplexity is decidedly
    above this model's quantised one} — a more damaged model can still be the better one to ship. Decided on the
    same windows (same tokenizer, same tokens: the card refuses models whose tokenizers differ) by the paired
    interval of ``windows`` ({model: (quantised per-window NLL, float per-window NLL)}); without them (records
    before per-token evidence), by the point values."""
    out = {}
    for name, q in quantised.items():
        if q is None:
            continue
        if windows is None:  # no per-window evidence: the point values, as cards before it said
            others = [o for o, f in floats.items() if o != name and f is not None and q < f]
        else:
            others = [
                o
                for o in floats
                if o != name and o in windows and _decidedly_below(windows[name][0], windows[o][1])
            ]
        if others:
            out[name] = others
    return out


def better_to_ship(
    windows: Mapping[str, tuple[Sequence[float] | None, Sequence[float] | None]],
) -> str | None:
    """The one model whose quantised per-window NLL lies decidedly below every other model's quantised one (paired
    over the same windows): the better model to ship in that format, whatever either lost to quantisation."""
    for name, (q, _) in windows.items():
        others = [o for o in windows if o != name]
        if others and all(_decidedly_below(q, windows[o][0]) for o in others):
            return name
    return None


STATISTIC_FACTOR = (
    2.0  # a float statistic carries no interval: only a model at most half the others' is named
)


def clearly_least(values: Mapping[str, float]) -> str | None:
    """The model whose statistic is at most 1/:data:`STATISTIC_FACTOR` of every other's (outlier statistics
    carry no interval here, so small differences name nobody); None otherwise."""
    best = least_of(values)
    if best is None:
        return None
    others = [v for k, v in values.items() if k != best]
    return best if all(values[best] * STATISTIC_FACTOR <= v for v in others) else None
