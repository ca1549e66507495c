"""The card's tables across models: the summary first, the commands, the side-by-side comparison and the metrics'
definitions last."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from qbench.eval.tolerance import METRICS, interval_text, metric_heading, row_interval, value_text
from qbench.studies.card.render.formats import change_ci, status_text
from qbench.studies.card.render.table import Column, Record, Table
from qbench.studies.card.units import mb_text, num, pct, share_text


def _recommended_row(m: Record) -> Record | None:
    """The format row of the model's recommended format (its change and verdict), None without one."""
    rec = m["verdict"]["recommended"]
    return next((f for f in m["formats"] if rec and f["scheme"] == rec["scheme"]), None)


def _recommended(m: Record) -> str:
    rec = m["verdict"]["recommended"]
    return f"{rec['label']} `{rec['scheme']}`" if rec else "none within the tolerance"


def _size(m: Record) -> str:
    rec = m["verdict"]["recommended"]
    return f"{mb_text(rec['weight_bytes'])} ({share_text(rec['bytes_vs_bf16'])} of bf16)" if rec else "-"


def _verdict(m: Record) -> str:
    found = _recommended_row(m)
    return status_text(found) if found else f"{len(m['verdict'].get('undecided') or [])} undecided"


def _avoid(m: Record, metric: str = "ppl", tolerance: float | None = None) -> str:
    """How many formats to avoid and the worst one's damage: its change, on kld or top1 that metric's value."""
    avoid = m["verdict"].get("avoid") or []
    if not avoid:
        return "-"
    worst = avoid[0]
    if metric == "ppl":
        return f"{len(avoid)}: worst {worst['label']} ({pct(worst['ppl_change_pct'])})"
    row = next((f for f in m["formats"] if f["scheme"] == worst["scheme"]), {})
    return f"{len(avoid)}: worst {worst['label']} ({value_text(row_interval(row, metric)[0], metric, tolerance)})"


def _repair(m: Record, metric: str = "ppl", tolerance: float | None = None) -> str:
    """The repair's format, its change (on kld or top1 that metric's value, as the repair decided) and size."""
    repair = m["verdict"].get("repair")
    if not repair:
        return "-"
    value = (
        pct(repair["ppl_change_pct"])
        if metric == "ppl"
        else value_text(row_interval(repair, metric)[0], metric, tolerance)
    )
    return f"`{repair['scheme']}` {value}, {mb_text(repair.get('weight_bytes'))}" + (
        " (pays)" if repair.get("pays") else " (does not pay)"
    )


def summary_table(card: Mapping[str, Any]) -> Table[Record]:
    """The page's first table: per model its recommended format, size, change and verdict, what to avoid and
    whether a repair pays. The recommended scheme is keyed (the page names what card.json recommends). On a card
    decided on kld or top1 the change column shows that metric's interval, the one the verdict read."""
    metric, tolerance = card.get("metric") or "ppl", card.get("tolerance_pct")
    heading = "change" if metric == "ppl" else metric_heading(metric)
    columns: list[Column[Record]] = [
        Column("model", lambda m: m["name"]),
        Column("float ppl", lambda m: num(m["fp"]["perplexity"], ".4g")),
        Column(
            "recommended",
            _recommended,
            key="verdict.recommended.scheme",
            keyed=lambda m: bool(m["verdict"]["recommended"]),
            beside=True,
        ),
        Column("size", _size),
        Column(
            f"{heading} [95 % CI]",
            lambda m: change_ci(found, metric, tolerance) if (found := _recommended_row(m)) else "-",
        ),
        Column("verdict", _verdict),
        Column("avoid", lambda m: _avoid(m, metric, tolerance)),
        Column("repair", lambda m: _repair(m, metric, tolerance)),
    ]
    if any(m.get("llama_cpp") for m in card["models"]):  # cards without llama.cpp rows read as they did
        columns.append(Column("smallest llama.cpp within", _llama_cpp_within))
    return Table("Summary", columns, card["models"], path="models")


def _llama_cpp_within(m: Mapping[str, Any]) -> str:
    """The smallest llama.cpp file type decidedly within the tolerance, with its file size; "none" when no type
    measured passes, "-" where the model has no llama.cpp rows."""
    if not m.get("llama_cpp"):
        return "-"
    passing = [r for r in m["llama_cpp"] if r.get("verdict") == "within" and r.get("bytes")]
    best = min(passing, key=lambda r: r["bytes"], default=None)
    return "none" if best is None else f"{best['type']} ({mb_text(best['bytes'])})"


def command_rows(card: Mapping[str, Any]) -> list[tuple[str, str]]:
    """(what, command) pairs: the card's own command and each model's verdict commands."""
    out = []
    if card.get("command"):
        out.append(("this card", card["command"]))
    for m in card["models"]:
        for c in m["verdict"].get("commands") or []:
            out.append((f"{m['name']}: {c['what']}", c["command"]))
    return out


COMPARISON_CAPTION = (
    "More robust: the model whose change is decidedly smaller (its 95 % interval wholly below the others'); for "
    "a breaking point the lower one; for an outlier statistic (no interval) the one at most half the others'. "
    "Better to ship: the model whose quantised perplexity is decidedly lower than every other model's quantised "
    "one — paired over the same windows, whatever each lost to quantisation; each cell also names the models whose "
    "*float* perplexity it is decidedly below. KV rows give the quantised perplexity at the KV section's window "
    "(its change against the float model at that window). - : the measurement does not tell them apart."
)


def comparison_caption(metric: str = "ppl") -> str:
    """:data:`COMPARISON_CAPTION`; on kld or top1 the rows' "more robust" compares that metric's intervals, and each
    format or KV cell leads with that metric's value and interval."""
    if metric == "ppl":
        return COMPARISON_CAPTION
    name, unit, _ = METRICS[metric]
    return COMPARISON_CAPTION.replace(
        "the model whose change is decidedly smaller",
        f"the model whose {name} ({unit}, the verdicts' metric) is decidedly smaller",
    ).replace(
        "KV rows give",
        f"Format and KV cells give the {name} with its 95 % interval, then the perplexity change. KV rows give",
    )


def ship_text(c: Record) -> str:
    """The comparison's absolute verdict: decided for format and float rows only."""
    return (c.get("better_to_ship") or "-") if c["section"] in ("float", "formats") else ""


def comparison_cell(c: Record, name: str, metric: str = "ppl", tolerance: float | None = None) -> str:
    """One model's value in a comparison row, as its section reads: a change with its quantised perplexity, a
    float perplexity, a breaking point, a statistic. On kld or top1 a format or KV cell leads with that metric's
    value and interval (the row's ``decision``), then the change."""
    v = c["values"].get(name)
    decided = (c.get("decision") or {}).get(name)
    if metric != "ppl" and decided and c["section"] in ("formats", "kv") and not isinstance(v, str):
        shown = interval_text(*row_interval({"decision": decided}, metric), metric, tolerance)
        return f"{shown}; {_ppl_cell(c, name, v)}"
    if isinstance(v, str) and c["section"] == "kv":  # a row that model could not measure: "skipped"
        return v
    if c["section"] == "kv" and name in c.get("missing", ()):  # a row that model's card did not run
        return "-"
    if c["section"] == "float":
        return "-" if v is None else f"ppl {v:.2f}"
    return _ppl_cell(c, name, v)


def _ppl_cell(c: Record, name: str, v: Any) -> str:
    if c["section"] == "formats" and (c.get("perplexity") or {}).get(name) is not None:
        text = f"{pct(v)} (ppl {c['perplexity'][name]:.2f})"  # relative damage and absolute quality
        below = (c.get("below_others_float") or {}).get(name)
        return text + (f", below {', '.join(below)} in float" if below else "")
    if c["section"] == "kv" and (c.get("perplexity") or {}).get(name) is not None:
        return f"{pct(v)} (ppl {c['perplexity'][name]:.2f})"  # at the KV window (its own float baseline)
    if c["section"] in ("formats", "kv"):
        return pct(v)
    if c["section"] == "breaking points":
        return "-" if v is None else str(v)
    if c["row"] == "1st-token top-1":
        return share_text(v)
    return num(v)


def comparison_table(card: Mapping[str, Any]) -> Table[Record]:
    """Every compared row, a column per model, the more robust model and the one better to ship."""

    metric, tolerance = card.get("metric") or "ppl", card.get("tolerance_pct")

    def model(name: str) -> Column[Record]:
        return Column(name, lambda c: comparison_cell(c, name, metric, tolerance))

    columns: list[Column[Record]] = [
        Column("section", lambda c: c["section"]),
        Column("row", lambda c: c["row"]),
        *(model(m["name"]) for m in card["models"]),
        Column("more robust", lambda c: c["more_robust"] or "-"),
        Column("better to ship", ship_text),
    ]
    return Table("Side by side", columns, card.get("comparison") or [], comparison_caption(metric))


def definitions_table(card: Mapping[str, Any]) -> Table[tuple[str, Record]]:
    columns: list[Column[tuple[str, Record]]] = [
        Column("metric", lambda kv: f"`{kv[0]}` ({kv[1]['label']})"),
        Column("unit", lambda kv: kv[1]["unit"] or "–"),
        Column("better", lambda kv: kv[1]["better"]),
        Column("definition", lambda kv: kv[1]["definition"]),
    ]
    return Table("Definitions", columns, list(card["metrics"].items()))
