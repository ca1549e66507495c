"""The side by side of several models, decided, no sentences: for each row (float perplexity, a format, a KV row, a
breaking point, an outlier statistic) which model is more robust and which is better to ship (:class:`ComparisonRow`),
and what the rows say together (:class:`Findings`), from the models' sections as card.json holds them."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from qbench.eval.metric_registry import BY_KEY
from qbench.eval.sampling import window_documents

Model = Mapping[str, Any]  # one model's section of card.json
# {model: (quantised per-window mean NLL, float per-window mean NLL)}: what the paired intervals compare
Windows = Mapping[str, tuple[Sequence[float] | None, Sequence[float] | None]]


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


def _decidedly_below(
    a: Sequence[float] | None, b: Sequence[float] | None, clusters: Sequence[str] | None = None
) -> bool | None:
    """Whether per-window mean NLLs ``a`` lie decidedly below ``b`` on the same windows: the 95 % interval of the
    paired differences (their documents ``clusters``, else the windows, as clusters:
    ``qbench.eval.evidence.cluster_interval``) wholly below 0. None when the two were not measured on the same
    windows or give no interval (one cluster)."""
    import torch

    from qbench.eval.evidence import cluster_interval

    if not a or not b or len(a) != len(b):
        return None
    if clusters is not None and len(clusters) != len(a):
        clusters = None  # not the windows these were measured on
    difference = torch.tensor(a, dtype=torch.float64) - torch.tensor(b, dtype=torch.float64)
    interval = cluster_interval(difference, clusters=clusters)
    return None if interval is None else interval[2] < 0


def below_others_float(
    quantised: Mapping[str, float | None],
    floats: Mapping[str, float | None],
    windows: Windows | None = None,
    clusters: Sequence[str] | None = None,
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
                if o != name and o in windows and _decidedly_below(windows[name][0], windows[o][1], clusters)
            ]
        if others:
            out[name] = others
    return out


def better_to_ship(windows: Windows, clusters: Sequence[str] | None = None) -> str | None:
    """The one model whose quantised per-window NLL lies decidedly below every other model's quantised one (paired
    over the same windows): the better model to ship in that format, whatever either lost to quantisation."""
    for name, (q, _) in windows.items():
        others = [o for o in windows if o != name]
        if others and all(_decidedly_below(q, windows[o][0], clusters) for o in others):
            return name
    return None


# A float statistic carries no interval: only a model at most half the others' is named.
STATISTIC_FACTOR = 2.0


def clearly_least(values: Mapping[str, float]) -> str | None:
    """The model whose statistic is at most 1/:data:`STATISTIC_FACTOR` of every other's (outlier statistics
    carry no interval here, so small differences name nobody); None otherwise."""
    best = least_of(values)
    if best is None:
        return None
    others = [v for k, v in values.items() if k != best]
    return best if all(values[best] * STATISTIC_FACTOR <= v for v in others) else None


# ---------------------------------------------------------------------------------------------------- the rows


@dataclass(frozen=True)
class ComparisonRow:
    """One row side by side: ``values`` per model (a change, a breaking point's text, a statistic) and the model
    :func:`compare` finds more robust (None: nothing tells them apart). A section holds the further fields of
    :data:`FIELDS`; the others stay None and are not written."""

    section: str  # "float", "formats", "kv", "breaking points" or "outliers"
    row: str  # its label
    scheme: str | None  # a format row's scheme
    values: Mapping[str, Any]
    more_robust: str | None
    perplexity: Mapping[str, float | None] | None = None  # each model's quantised perplexity
    below_others_float: Mapping[str, list[str]] | None = (
        None  # model -> others whose float ppl is decidedly above
    )
    better_to_ship: str | None = None  # the model decidedly better quantised (float: in float)
    missing: list[str] | None = None  # models whose budget has no such KV row ("-", not NaN)
    # on a card decided on kld or top1, each model's decision in a format or KV row: what "more robust" compared
    # and the page shows (None on ppl, whose change the values hold)
    decision: Mapping[str, Any] | None = None


# The fields each section holds beyond section/row/scheme/values/more_robust, in card.json's order.
FIELDS = {
    "float": ("better_to_ship",),
    "formats": ("perplexity", "below_others_float", "better_to_ship"),
    "kv": ("perplexity", "missing"),
    "breaking points": (),
    "outliers": (),
}


def compare(models: Sequence[Model]) -> list[ComparisonRow]:
    """The same rows side by side. ``more_robust``: for a format or KV row the model with the decidedly smaller
    damage (:func:`more_robust_change`), for a breaking point the lower one (``none`` is the worst), for a float
    statistic whose registry direction is ``lower`` the clearly lower value; None when nothing tells them apart."""
    floats = {m["name"]: m["fp"]["perplexity"] for m in models}
    return [
        _float_row(models, floats),
        *_format_rows(models, floats),
        *_kv_rows(models),
        *_breaking_point_rows(models),
        *_statistic_rows(models),
    ]


def _decisions(found: Mapping[str, Mapping[str, Any] | None]) -> dict[str, Any] | None:
    """Each model's decision in a row (None for a model without the row), where the rows were decided on kld or
    top1; None on ppl (the row's values are the perplexity changes it was decided on)."""
    decisions = {name: None if row is None else row.get("decision") for name, row in found.items()}
    metrics = {d.get("metric") for d in decisions.values() if d}
    return None if not metrics or metrics == {"ppl"} else decisions


def _window_nll(model: Model, row: Mapping[str, Any] | None) -> Sequence[float] | None:
    """The per-window mean NLL of ``row`` (the float record or a format row) of ``model``, if measured."""
    return (model.get("window_nll") or {}).get((row or {}).get("cell_id") or "")


def _clusters(models: Sequence[Model]) -> list[str] | None:
    """The document of each window when every model scored the same documents sample (else each window alone)."""
    found = [window_documents(m["protocol"]) for m in models]
    return found[0] if found and all(f == found[0] for f in found) else None


def _float_row(models: Sequence[Model], floats: Mapping[str, float]) -> ComparisonRow:
    windows = {m["name"]: (_window_nll(m, m["fp"]), None) for m in models}
    better = better_to_ship(windows, _clusters(models)) if all(q for q, _ in windows.values()) else None
    return ComparisonRow("float", "float perplexity", None, floats, None, better_to_ship=better)


def _format_rows(models: Sequence[Model], floats: Mapping[str, float]) -> list[ComparisonRow]:
    """A row per format any model measured: its change per model, relative damage (more robust) beside absolute
    quality (below the others' float, better to ship), decided on the paired windows where every model has them."""
    rows, clusters = [], _clusters(models)
    for scheme in dict.fromkeys(f["scheme"] for m in models for f in m["formats"]):
        found = {m["name"]: next((f for f in m["formats"] if f["scheme"] == scheme), None) for m in models}
        quantised = {k: None if f is None else f["perplexity"] for k, f in found.items()}
        per_window = {m["name"]: (_window_nll(m, found[m["name"]]), _window_nll(m, m["fp"])) for m in models}
        evidence = per_window if all(q and f for q, f in per_window.values()) else None
        rows.append(
            ComparisonRow(
                "formats",
                next(f["label"] for f in found.values() if f is not None),
                scheme,
                {k: None if f is None else f["ppl_change_pct"] for k, f in found.items()},
                more_robust_change(found),
                perplexity=quantised,
                below_others_float=below_others_float(quantised, floats, evidence, clusters),
                better_to_ship=better_to_ship(evidence, clusters) if evidence else None,
                decision=_decisions(found),
            )
        )
    return rows


def _kv_rows(models: Sequence[Model]) -> list[ComparisonRow]:
    """A row per KV setting (scheme, bits, sinks kept) any model measured; a row one model skipped names no more
    robust model."""

    def key(r: Mapping[str, Any]) -> tuple[Any, ...]:
        return r["scheme"], r["bits"], r["keep_sinks"]

    rows = []
    for k in dict.fromkeys(key(r) for m in models for r in m["kv"]["rows"]):
        found = {m["name"]: next((r for r in m["kv"]["rows"] if key(r) == k), None) for m in models}
        _, bits, keep = k
        skipped = {n for n, r in found.items() if r is not None and r["status"] == "skipped"}
        values = {
            n: "skipped" if n in skipped else None if r is None else r["ppl_change_pct"]
            for n, r in found.items()
        }
        name = next(r["scheme_name"] for r in found.values() if r is not None)
        rows.append(
            ComparisonRow(
                "kv",
                f"KV {name} {bits} bit" + (f", {keep} sink(s) kept" if keep else ""),
                None,
                values,
                None if skipped else more_robust_change(found),
                # quantised perplexity beside each change (at the KV section's window, against the float there)
                perplexity={
                    n: None if r is None or n in skipped else r.get("perplexity") for n, r in found.items()
                },
                missing=[n for n, r in found.items() if r is None],
                decision=_decisions(found),
            )
        )
    return rows


def _breaking_point_rows(models: Sequence[Model]) -> list[ComparisonRow]:
    """A row per breaking-point curve: the lower breaking point is more robust (none found counts as the worst)."""
    rows = []
    for family, axis in dict.fromkeys((b["family"], b["axis"]) for m in models for b in m["breaking_points"]):
        found = {
            m["name"]: next(
                (x for x in m["breaking_points"] if (x["family"], x["axis"]) == (family, axis)), None
            )
            for m in models
        }
        bits = {k: math.inf if b is None or b["bits"] is None else b["bits"] for k, b in found.items()}
        values = {k: None if b is None else b["text"] for k, b in found.items()}
        rows.append(ComparisonRow("breaking points", f"break {family} {axis}", None, values, least_of(bits)))
    return rows


def _statistic_rows(models: Sequence[Model]) -> list[ComparisonRow]:
    """A row per outlier statistic: a lower-is-better one measured for every model names the clearly lowest."""
    start = all(m["protocol"].get("bos", True) for m in models)
    rows = []
    for key in ("kurtosis_first", "kurtosis_other", "max_abs", "first_token_top1_share"):
        values = {m["name"]: m["outliers"]["summary"].get(key) for m in models}
        known = {k: v for k, v in values.items() if v is not None}
        lower = BY_KEY[key].better == "lower" and len(known) == len(values)
        label = "κ start token" if key == "kurtosis_first" and start else BY_KEY[key].label
        rows.append(ComparisonRow("outliers", label, None, values, clearly_least(known) if lower else None))
    return rows


# ------------------------------------------------------------------------------------------------ the findings


@dataclass(frozen=True)
class TradeOff:
    """A format where the model that loses less to quantisation (``robust``) is still the worse one to ship."""

    row: str
    robust: str
    better: str
    perplexity_better: float
    perplexity_robust: float


@dataclass(frozen=True)
class BetterToShip:
    """A model decidedly better to ship quantised, and in which format rows."""

    model: str
    rows: tuple[str, ...]


@dataclass(frozen=True)
class BelowFloat:
    """A model whose quantised perplexity lies decidedly below the ``others``' float one, in these format rows."""

    model: str
    others: tuple[str, ...]
    rows: tuple[str, ...]


@dataclass(frozen=True)
class Findings:
    """What the rows say together, in the order the card says it: which model is better in float, where relative
    damage and absolute quality disagree, which model is better to ship in which formats, and which quantised
    model stays below another's float perplexity (where it is not already the one better to ship)."""

    better_in_float: tuple[str, ...]
    trade_offs: tuple[TradeOff, ...]
    better_to_ship: tuple[BetterToShip, ...]
    below_float: tuple[BelowFloat, ...]
    formats: int  # the format rows compared


def findings(rows: Sequence[ComparisonRow]) -> Findings:
    """The :class:`Findings` of :func:`compare`'s rows, formats with the same finding grouped."""
    formats = [c for c in rows if c.section == "formats"]
    trade_offs = []
    ship: dict[str, list[str]] = {}
    below: dict[tuple[str, tuple[str, ...]], list[str]] = {}
    for c in formats:
        robust, best = c.more_robust, c.better_to_ship
        if best:
            ship.setdefault(best, []).append(c.row)
        if robust and best and robust != best:
            ppl = c.perplexity or {}
            trade_offs.append(TradeOff(c.row, robust, best, ppl[best], ppl[robust]))
        for name, others in (c.below_others_float or {}).items():
            if name != best:
                below.setdefault((name, tuple(others)), []).append(c.row)
    return Findings(
        better_in_float=tuple(c.better_to_ship for c in rows if c.section == "float" and c.better_to_ship),
        trade_offs=tuple(trade_offs),
        better_to_ship=tuple(BetterToShip(m, tuple(labels)) for m, labels in ship.items()),
        below_float=tuple(BelowFloat(m, others, tuple(labels)) for (m, others), labels in below.items()),
        formats=len(formats),
    )
