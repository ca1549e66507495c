"""``card.html``: one self-contained page (inline styles, figures as base64 PNGs, no JavaScript) whose key numbers
carry ``data-key`` (their path in card.json) and ``data-value``, so a test or a reader can check it against card.json.
Which cells carry one is the tables' column specs' to say (:mod:`~.table`), the same specs card.md prints."""

from __future__ import annotations

import base64
import html as _html
import json
from collections.abc import Mapping
from typing import Any

from qbench.eval.tolerance import metric_axis_label, tolerance_text
from qbench.studies.card.render.figures import curve_metric
from qbench.studies.card.render.overview import (
    command_rows,
    comparison_table,
    definitions_table,
    summary_table,
)
from qbench.studies.card.render.sections import page_sections
from qbench.studies.card.render.table import Column, Table
from qbench.studies.card.units import SIZE_UNIT, num

_CSS = """
body{font:14px/1.45 system-ui,-apple-system,Segoe UI,Helvetica,Arial,sans-serif;margin:2em auto;max-width:72em;
color:#1b1b1b;padding:0 1em}
h1{font-size:1.6em}h2{border-bottom:2px solid #ccc;margin-top:2em}h3{margin-top:1.5em}
table{border-collapse:collapse;margin:.5em 0;font-size:.9em}td,th{border:1px solid #ccc;padding:2px 6px;
text-align:left;vertical-align:top}th{background:#f2f2f2}code{font-size:.95em}
.ok{color:#176b2c}.bad{color:#a11}.undecided{color:#946200}
.verdict{background:#f6f8e8;border-left:4px solid #8a3;padding:.3em 1em}.verdict li{margin:.2em 0}
#summary table{font-size:1em}details{margin:.5em 0}summary{cursor:pointer;color:#345}
details code{word-break:break-all}
figure{margin:1em 0}figure img{max-width:100%}figcaption{font-size:.85em;color:#555}
@media print{body{margin:0;max-width:none;font-size:11px}h2{page-break-before:always}h2:first-of-type{
page-break-before:auto}figure,table{page-break-inside:avoid}details>*{display:block}}
"""


def _e(text: Any) -> str:
    return _html.escape(str(text))


def _code(text: str) -> str:
    """Markdown's `code` spans as <code>, the rest escaped."""
    pieces = str(text).split("`")
    return "".join(f"<code>{_e(p)}</code>" if i % 2 else _e(p) for i, p in enumerate(pieces))


def _v(key: str, value: Any, text: str) -> str:
    """A key number: its card.json path and exact value beside the shown text."""
    return f'<span data-key="{_e(key)}" data-value="{_e(json.dumps(value))}">{_e(text)}</span>'


def _items(lines: list[str]) -> str:
    return "".join(f"<li>{_code(line)}</li>" for line in lines)


def _cell(table: Table[Any], column: Column[Any], j: int, row: Any) -> str:
    """One cell as its column's spec says: the number it shows keyed (wrapped, or beside a longer text), a
    verdict coloured, any other text with its `code` spans."""
    text = column.text(row)
    key = table.key(column, j, row)
    if key is not None:
        return _code(text) + _v(key.path, key.value, "") if column.beside else _v(key.path, key.value, text)
    if column.css is not None:
        return f'<span class="{column.css(row)}">{_e(text)}</span>'
    return _code(text)


def _table(table: Table[Any]) -> str:
    head = "".join(f"<th>{_e(h)}</th>" for h in table.headers)
    body = "".join(
        "<tr>" + "".join(f"<td>{_cell(table, c, j, row)}</td>" for c in table.columns) + "</tr>"
        for j, row in enumerate(table.rows)
    )
    return f"<table><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>"


def _figure(name: str, png: bytes | None, caption: str) -> str:
    if png is None:
        return ""
    data = base64.b64encode(png).decode()
    return (
        f'<figure id="fig-{_e(name)}"><img alt="{_e(caption)}" src="data:image/png;base64,{data}">'
        f"<figcaption>{_e(caption)}</figcaption></figure>"
    )


def html(card: Mapping[str, Any], figs: Mapping[str, bytes]) -> str:
    """The page: summary, each model's verdict and sections, the breaking-point curves, the comparison across
    models and the definitions; ``figs`` maps a figure's name to its PNG bytes, inlined."""
    names = ", ".join(m["name"] for m in card["models"])
    body = [f"<h1>qbench card: {_e(names)}</h1>", *_summary(card)]
    for i in range(len(card["models"])):
        body += _model(card, i, figs)
    if "breaking-points" in figs:
        body.append("<h2>Breaking-point curves</h2>")
        shown = curve_metric(card)
        what = "perplexity change" if shown == "ppl" else metric_axis_label(shown)
        body.append(_figure("breaking-points", figs["breaking-points"], f"{what} against bit width"))
    if card.get("comparison"):
        table = comparison_table(card)
        body += [f"<h2>{_e(table.title)}</h2>", _table(table), f"<p>{_code(table.caption)}</p>"]
    body += ["<h2>Definitions</h2>", _table(definitions_table(card))]
    body.append(
        f"<p>Definitions in full: docs/metrics.md in the qbench repository. Versions, commit and seed: card.json. Created {_e(card['created_utc'])}.</p>"
    )
    return (
        '<!DOCTYPE html>\n<html lang="en"><head><meta charset="utf-8"><title>qbench card: '
        f"{_e(names)}</title><style>{_CSS}</style></head><body>\n" + "\n".join(body) + "\n</body></html>\n"
    )


def _summary(card: Mapping[str, Any]) -> list[str]:
    tolerance = _v(
        "tolerance_pct",
        card["tolerance_pct"],
        tolerance_text(card["tolerance_pct"], card.get("metric") or "ppl"),
    )
    summary = summary_table(card)
    body = ['<section id="summary"><h2>Summary</h2>']
    if summary.rows:
        body.append(_table(summary))
    body.append(
        f"<p>Budget {_e(card['budget_contents'])}; tolerance {tolerance}. Sizes: {_e(SIZE_UNIT)}.</p>"
    )
    if card.get("comparison_lines"):
        body.append("<p><strong>Side by side</strong></p><ul>" + _items(card["comparison_lines"]) + "</ul>")
    commands = command_rows(card)
    if commands:
        body.append(
            "<details><summary>Commands</summary><ul>"
            + "".join(f"<li>{_e(what)}: <code>{_e(command)}</code></li>" for what, command in commands)
            + "</ul></details>"
        )
    body.append("</section>")
    return body


def _model(card: Mapping[str, Any], i: int, figs: Mapping[str, bytes]) -> list[str]:
    m = card["models"][i]
    fp = m["fp"]["perplexity"]
    body = [
        f'<h2 id="model-{i}">{_e(m["name"])}</h2>',
        '<div class="verdict"><strong>Verdict</strong><ul>' + _items(m["verdict"]["lines"]) + "</ul></div>",
        "<p>Float perplexity " + _v(f"models.{i}.fp.perplexity", fp, num(fp, ".4f")) + "</p>",
    ]
    for table in page_sections(card, i):
        body += [f"<h3>{_code(table.title)}</h3>", _table(table)]
        if table.caption:
            body.append(f"<p>{_code(table.caption)}</p>")
        if table.figure:  # an empty line where the figure was not drawn
            body.append(_figure(table.figure.name, figs.get(table.figure.name), table.figure.caption))
    if m.get("not_measured"):
        body += ["<h3>Not measured</h3>", "<ul>" + _items(m["not_measured"]) + "</ul>"]
    return body
