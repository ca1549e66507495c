"""Tables from result records — a pure function of the JSON files, never edited by hand.

``compare`` layout (torchao-style: the float baseline first, then each scheme with its change in %):
rows = models; columns = fp perplexity, then one per (scheme, mode) "ppl (+x.x %)"; then the float model's
outlier columns (kurtosis first/other token, max |activation|, first-token top-1 share). A caption states the
evaluation protocol, so a table copied elsewhere still says what it measured. Beside breaking points decided on
``--metric kld`` or ``top1`` (``qbench compare --breaking-points``), each cell shows that metric's interval, in its
unit (``qbench.eval.tolerance.interval_text``), before the perplexity change.
"""

from __future__ import annotations

import csv
import io
import json
import sys
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from models.errors import UserError, unknown_choice
from qbench.eval.metric_registry import COMPARE_COLUMNS, format_value
from qbench.eval.metric_registry import metric as registered
from qbench.eval.sampling import scored_text
from qbench.eval.tolerance import DEFAULT_METRIC, check_metric, deciding_interval, interval_text

FORMATS = ("table", "md", "csv", "latex", "json")
# (record key, header) of the float model's outlier columns, from the metric registry
OUTLIER_COLUMNS = tuple((key, registered(key).label) for key in COMPARE_COLUMNS)


def read_records(folder: Path) -> list[dict[str, Any]]:
    """All records under ``folder`` (a model's result folder, or a folder of those).

    A ``qbench sweep`` folder below ``folder`` (one holding ``sweep.json``) is left out: its dozens of
    bit-width cells are read through its own table, and ``compare --breaking-points`` summarises them. So is a
    ``qbench sensitivity`` folder below it (``sensitivity.json``: one cell per unit, each with most layers kept
    in float; a card holds one under ``sensitivity/``). Naming such a folder itself reads its records.
    """
    records = []
    studies = [*folder.rglob("sweep.json"), *folder.rglob("sensitivity.json")]
    sweeps = [p.parent for p in studies if p.parent != folder]
    for path in sorted(folder.rglob("*.json")):
        if any(path.is_relative_to(s) for s in sweeps):
            continue
        try:
            record = json.loads(path.read_text())
        except (ValueError, UnicodeDecodeError):
            _skip(path, "not valid JSON (a torn or hand-edited result file?)")
            continue
        if not (isinstance(record, dict) and "record_version" in record):
            continue  # another kind of JSON (sweep.json, a speed file): not a record
        problem = malformed(record)
        if problem:
            _skip(path, problem)
            continue
        records.append(record)
    return records


# What every table reads from a record; a record missing one is skipped with a warning, not a traceback.
REQUIRED = {
    "model": ("name",),
    "scheme": ("name",),
    "metrics": ("perplexity", "fp_perplexity", "ppl_change_pct"),
    "protocol": ("corpus", "split", "tokens_scored", "window", "stride", "bos", "dtype"),
}


def malformed(record: dict[str, Any]) -> str | None:
    """What a record lacks for the tables (None: nothing)."""
    if not isinstance(record.get("mode"), str):
        return "no 'mode'"
    for key, fields in REQUIRED.items():
        block = record.get(key)
        if not isinstance(block, dict):
            return f"no {key!r} block"
        missing = [f for f in fields if f not in block]
        if missing:
            return f"its {key!r} block lacks {', '.join(map(repr, missing))}"
    return None


def _skip(path: Path, why: str) -> None:
    sys.stderr.write(f"warning: skipped {path}: {why}\n")


def _model_key(model: dict[str, Any]) -> tuple[str, str]:
    """(display name, what tells two models of that name apart: their path, else their weights' fingerprint)."""
    return model["name"], str(model.get("path") or model.get("fingerprint") or model["name"])


def cell_key(record: dict[str, Any]) -> str:
    """A record's column: ``fp`` or ``<scheme>/<mode>``, with ``[float: PATTERNS]`` when layers were excluded."""
    if record["scheme"]["name"] == "fp":
        return "fp"
    exclude = record["scheme"].get("exclude") or []
    kept = f" [float: {', '.join(exclude)}]" if exclude else ""
    seed = record.get("seed")
    seeded = f" [seed={seed}]" if seed not in (0, None) else ""  # seed 0 is every command's default
    return f"{record['scheme']['name']}/{record['mode']}{kept}{seeded}"


# The fields that tell two evaluations of one model apart in a table's row label: the requested protocol, the
# dtype, and the weights (a folder retrained in place keeps its path, not its fingerprint).
_ROW_PROTOCOL = ("corpus", "split", "tokens", "window", "bos", "dtype", "weights")


def cells_by_model(records: Iterable[dict[str, Any]]) -> dict[str, dict[str, dict[str, Any]]]:
    """{row label: {column: record}}, in first-seen order. A row is one model under one protocol: labelled by
    the model's name, by its path when two models of one name (e.g. step-02000 of two runs) are in the records,
    and with the protocol fields that differ (``[tokens=512]``) when one model was evaluated under several — so
    no record silently hides another."""
    rows: dict[tuple[str, str, str], dict[str, dict]] = {}
    for r in records:
        fields = {**(r.get("protocol") or {}), "weights": (r["model"].get("fingerprint") or "")[:10] or None}
        protocol = json.dumps({k: fields.get(k) for k in _ROW_PROTOCOL}, sort_keys=True)
        rows.setdefault((*_model_key(r["model"]), protocol), {})[cell_key(r)] = r
    by_model = [(name, identity) for name, identity, _ in rows]
    labels = {}
    for name, identity, protocol in rows:
        unique = len({i for n, i in by_model if n == name}) == 1
        label = name if unique else identity
        if by_model.count((name, identity)) > 1:
            fields = json.loads(protocol)
            others = [json.loads(p) for n, i, p in rows if (n, i) == (name, identity) and p != protocol]
            differ = [k for k in _ROW_PROTOCOL if any(o[k] != fields[k] for o in others)]
            label += " [" + ", ".join(f"{k}={fields[k]}" for k in differ) + "]"
        labels[(name, identity, protocol)] = label
    return {labels[key]: cells for key, cells in rows.items()}


def _cell(record: dict[str, Any], metric: str = DEFAULT_METRIC) -> str:
    """A record's cell: its perplexity, then in parentheses the change with its interval and the KLD; on another
    ``metric`` (a kld or top1 sweep's breaking points beside it) that metric's value and interval first, in its
    unit, then the perplexity change."""
    m = record["metrics"]
    if record.get("status") == "unsupported":
        return "n/a"
    if m.get("perplexity") is None:
        return "NaN"
    if record["scheme"]["name"] == "fp":
        return f"{m['perplexity']:.2f}"
    if metric != DEFAULT_METRIC:
        value, interval = deciding_interval(m, metric)
        shown = interval_text(value, interval, metric, style="pm")
        return f"{m['perplexity']:.2f} ({shown}; {m['ppl_change_pct']:+.2f}%)"
    ci = m.get("ppl_change_ci95")
    spread = f" ±{(ci[1] - ci[0]) / 2:.2f}" if ci else "" if "kld_mean" in m else ", no interval"
    kld = f"; KLD {m['kld_mean']:.4f}" if m.get("kld_mean") is not None else ""
    return f"{m['perplexity']:.2f} ({m['ppl_change_pct']:+.2f}%{spread}{kld})"


def comparison(
    records: Iterable[dict[str, Any]],
    extra: dict[str, dict[str, str]] | None = None,
    metric: str = DEFAULT_METRIC,
) -> tuple[list[str], list[list[str]], str]:
    """(headers, rows, caption) of the comparison table; ``extra`` adds columns {row label: {header: text}}
    (e.g. breaking points from ``qbench.studies.sweep.breaking_point_columns``); ``metric``: which interval the
    cells show (:func:`_cell`) — the one the breaking points beside them were decided on."""
    check_metric(metric)
    records = list(records)
    if not records:
        raise UserError("no result records to compare")
    columns = sorted(dict.fromkeys(cell_key(r) for r in records if cell_key(r) != "fp"), key=_column_order)
    extra = extra or {}
    extra_headers = list(dict.fromkeys(h for cols in extra.values() for h in cols))
    headers = ["model", "fp", *columns, *(label for _, label in OUTLIER_COLUMNS), *extra_headers]
    rows = []
    for label, cells in cells_by_model(records).items():
        fp = cells.get("fp")
        outliers = fp["outliers"] if fp else {}
        row = [
            label,
            _cell(fp) if fp else "-",
            *(_cell(cells[c], metric) if c in cells else "-" for c in columns),
        ]
        row += [format_value(key, outliers.get(key)) for key, _ in OUTLIER_COLUMNS]
        row += [extra.get(label, {}).get(h, "-") for h in extra_headers]
        rows.append(row)
    return headers, rows, caption(records, metric)


def _column_order(column: str) -> tuple[int, int, str, str]:
    """Registry order (the paper's schemes first, then the baselines; ``fp+kv…`` first), each scheme's KV-cache
    variants (``+kv4``) after it from wide to narrow, fake before real."""
    from qbench.quant.schemes import SCHEMES

    scheme, mode = column.rsplit("/", 1)
    base, _, kv = scheme.partition("+kv")
    base, names = base.removesuffix("+head"), SCHEMES.names()
    index = -1 if base == "fp" else names.index(base) if base in names else len(names)
    kv_bits = int(kv.split("-")[0]) if kv[:1].isdigit() else 99  # no KV quantisation first
    return (index, -kv_bits, scheme, mode)


# What the parentheses hold on each metric (the rest of the caption is the same).
_PARENTHESES = {
    "ppl": "change vs fp in parentheses, ± the half-width of its 95 % interval (paired; documents as clusters where the windows were drawn across documents, else windows), and "
    'the mean KL divergence from the float model per token (nats; "no interval": a record from before '
    "per-token evidence)",
    "kld": "in parentheses the mean KL divergence from the float model per token in nats, ± the half-width of its "
    "95 % interval (documents or windows as clusters; the breaking points' metric), then the perplexity change vs fp "
    '("no interval": a record from before per-token evidence)',
    "top1": "in parentheses the share of tokens whose most likely next token differs from the float model's, in %, "
    "± the half-width of its 95 % interval (documents or windows as clusters; the breaking points' metric), then the "
    'perplexity change vs fp ("no interval": a record from before per-token evidence)',
}


def caption(records: list[dict[str, Any]], metric: str = DEFAULT_METRIC) -> str:
    protocols = {
        json.dumps({k: v for k, v in r["protocol"].items() if k != "tokenizer_fingerprint"}, sort_keys=True)
        for r in records
    }
    p = records[0]["protocol"]
    text = (
        f"Token-level perplexity on {p['corpus']}/{p['split']}: {scored_text(p)}, "
        f"BOS {'on' if p['bos'] else 'off'}, {p['dtype']}; "
        f"{_PARENTHESES[check_metric(metric)]}. Outliers: raw kurtosis across channels of each block's output "
        "(first token / others), max |activation|, share of queries ≥ 1 whose top-1 key is token 0."
    )
    if len(protocols) > 1:
        text += " WARNING: the records were made with different protocols (window/tokens differ per model)."
    excluded = sorted({p for r in records for p in (r["scheme"].get("exclude") or [])})
    if excluded:
        text += f" Layers kept in float (--exclude): {', '.join(excluded)}."
    text += _kv_footer(records)
    return text


def _kv_footer(records: list[dict[str, Any]]) -> str:
    """What each KV-cache label in the table means, from the records' own descriptions (each record says how its
    cache was quantised; a fixed sentence here described one scheme and went stale when the default changed)."""
    described: dict[str, str] = {}
    for r in records:
        kv = r.get("kv") or {}
        if kv:
            label = kv.get("label") or f"kv{kv.get('bits')}"
            text = kv.get("description") or "KV cache quantised (no description recorded)"
            described.setdefault(label, f"{text}; keys {kv.get('keys', '?')}; values {kv.get('values', '?')}")
    if not described:
        return ""
    parts = "; ".join(f"+{label}: {text}" for label, text in sorted(described.items()))
    return f" KV cache ({parts}). -keepK: positions < K kept in float."


def render(
    records: Iterable[dict[str, Any]],
    fmt: str = "md",
    extra: dict[str, dict[str, str]] | None = None,
    metric: str = DEFAULT_METRIC,
) -> str:
    """The comparison as markdown, CSV, LaTeX or JSON text (``table`` is printed by the CLI with rich)."""
    if fmt not in FORMATS:
        raise unknown_choice("format", fmt, FORMATS)
    records = list(records)
    headers, rows, text = comparison(records, extra, metric)
    if fmt == "json":
        return json.dumps({"caption": text, "headers": headers, "rows": rows}, indent=2)
    if fmt == "csv":
        buf = io.StringIO()
        writer = csv.writer(buf)
        writer.writerow(headers)
        writer.writerows(rows)
        return buf.getvalue()
    from tabulate import tabulate

    # Cells are already formatted text: no number parsing (it would print "NaN" as "nan" and re-round values).
    style = dict(disable_numparse=True, colalign=("left",) + ("right",) * (len(headers) - 1))
    if fmt == "latex":
        body = tabulate(rows, headers, tablefmt="latex_booktabs", **style)
        return f"% {text}\n{body}"
    return f"{tabulate(rows, headers, tablefmt='github', **style)}\n\n{text}\n"


def rich_table(
    records: Iterable[dict[str, Any]],
    title: str = "qbench comparison",
    extra: dict[str, dict[str, str]] | None = None,
    metric: str = DEFAULT_METRIC,
):
    from rich.table import Table

    headers, rows, text = comparison(list(records), extra, metric)
    table = Table(title=title, caption=text, title_justify="left", caption_justify="left")
    for i, h in enumerate(headers):
        table.add_column(
            h, justify="left" if i == 0 else "right", style="bold" if i == 0 else None, min_width=len(h)
        )
    for row in rows:
        table.add_row(*row)
    return table
