"""``card.html``: one self-contained page (inline styles, figures as base64 PNGs, no JavaScript) whose key numbers
carry ``data-key`` (their path in card.json) and ``data-value``, so a test or a reader can check it against card.json."""

from __future__ import annotations

import base64
import html as _html
import json
from collections.abc import Mapping
from typing import Any

from qbench.eval.evidence import tolerance_text
from qbench.studies.card.render.sections import (
    COMPARISON_CAPTION,
    change_ci,
    command_rows,
    comparison_cell,
    definition_rows,
    format_cells,
    kv_cells,
    page_sections,
    ran_text,
    ship_text,
    status_text,
    summary_rows,
    verdict_class,
)
from qbench.studies.card.units import SIZE_UNIT, mb, num

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


def _html_table(headers: list[str], rows: list[list[str]], raw: bool = False) -> str:
    head = "".join(f"<th>{_e(h)}</th>" for h in headers)
    body = "".join(
        "<tr>" + "".join(f"<td>{c if raw else _code(c)}</td>" for c in row) + "</tr>" for row in rows
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


def _key_rows(m: Mapping[str, Any], i: int) -> dict[str, list[list[str]]]:
    """The tables whose numbers carry data-key: formats and KV (the verdict's inputs)."""
    formats = []
    for j, f in enumerate(m["formats"]):
        cells = [_code(c) for c in format_cells(f, m)]
        if ran_text(f):  # a row not run keeps its "-"
            cells[2] = _v(f"models.{i}.formats.{j}.perplexity", f["perplexity"], num(f["perplexity"], ".4f"))
            cells[3] = _v(f"models.{i}.formats.{j}.ppl_change_pct", f["ppl_change_pct"], change_ci(f))
        cells[4] = f'<span class="{verdict_class(f)}">{_e(status_text(f))}</span>'
        cells[7] = _v(f"models.{i}.formats.{j}.weight_bytes", f["weight_bytes"], mb(f["weight_bytes"]))
        formats.append(cells)
    memory = m["kv"].get("memory")
    kv = []
    for j, r in enumerate(m["kv"]["rows"]):
        cells = [_code(c) for c in kv_cells(r, memory)]
        cells[4] = _v(f"models.{i}.kv.rows.{j}.perplexity", r["perplexity"], num(r["perplexity"], ".4f"))
        cells[5] = _v(f"models.{i}.kv.rows.{j}.ppl_change_pct", r["ppl_change_pct"], change_ci(r))
        cells[6] = f'<span class="{verdict_class(r)}">{_e(status_text(r))}</span>'
        kv.append(cells)
    return {"Deployable formats": formats, "KV cache": kv}


def html(card: Mapping[str, Any], figs: Mapping[str, bytes]) -> str:
    names = ", ".join(m["name"] for m in card["models"])
    body = [f"<h1>qbench card: {_e(names)}</h1>"]
    summary = summary_rows(card)
    tolerance = _v(
        "tolerance_pct",
        card["tolerance_pct"],
        tolerance_text(card["tolerance_pct"], card.get("metric") or "ppl"),
    )
    body.append('<section id="summary"><h2>Summary</h2>')
    if summary:
        headers = list(summary[0])
        rows = []
        for i, r in enumerate(summary):
            cells = [_code(r[h]) for h in headers]
            rec = card["models"][i]["verdict"]["recommended"]
            if rec:
                cells[2] += _v(f"models.{i}.verdict.recommended.scheme", rec["scheme"], "")
            rows.append(cells)
        body.append(_html_table(headers, rows, raw=True))
    body.append(
        f"<p>Budget {_e(card['budget_contents'])}; tolerance {tolerance}. Sizes: {_e(SIZE_UNIT)}.</p>"
    )
    if card.get("comparison_lines"):
        body.append(
            "<p><strong>Side by side</strong></p><ul>"
            + "".join(f"<li>{_code(line)}</li>" for line in card["comparison_lines"])
            + "</ul>"
        )
    commands = command_rows(card)
    if commands:
        body.append(
            "<details><summary>Commands</summary><ul>"
            + "".join(f"<li>{_e(what)}: <code>{_e(command)}</code></li>" for what, command in commands)
            + "</ul></details>"
        )
    body.append("</section>")
    for i, m in enumerate(card["models"]):
        body.append(f'<h2 id="model-{i}">{_e(m["name"])}</h2>')
        body.append(
            '<div class="verdict"><strong>Verdict</strong><ul>'
            + "".join(f"<li>{_code(line)}</li>" for line in m["verdict"]["lines"])
            + "</ul></div>"
        )
        body.append(
            "<p>Float perplexity "
            + _v(f"models.{i}.fp.perplexity", m["fp"]["perplexity"], num(m["fp"]["perplexity"], ".4f"))
            + "</p>"
        )
        keyed = _key_rows(m, i)
        for title, headers, rows, caption in page_sections(card, m):
            body.append(f"<h3>{_code(title)}</h3>")
            if title in keyed:
                body.append(_html_table(headers, keyed[title], raw=True))
            else:
                body.append(_html_table(headers, rows))
            if caption:
                body.append(f"<p>{_code(caption)}</p>")
            if title.startswith("Outlier"):
                body.append(
                    _figure(
                        f"outliers-{i}", figs.get(f"outliers-{i}"), f"{m['name']}: outlier profile per layer"
                    )
                )
            if title.startswith("Attention"):
                body.append(
                    _figure(
                        f"attention-{i}",
                        figs.get(f"attention-{i}"),
                        f"{m['name']}: attention sink per layer and head",
                    )
                )
        if m.get("not_measured"):
            body.append("<h3>Not measured</h3>")
            body.append("<ul>" + "".join(f"<li>{_code(line)}</li>" for line in m["not_measured"]) + "</ul>")
    if "breaking-points" in figs:
        body.append("<h2>Breaking-point curves</h2>")
        body.append(
            _figure("breaking-points", figs["breaking-points"], "perplexity change against bit width")
        )
    if card.get("comparison"):
        names_list = [m["name"] for m in card["models"]]
        rows = [
            [
                c["section"],
                c["row"],
                *(comparison_cell(c, n) for n in names_list),
                c["more_robust"] or "-",
                ship_text(c),
            ]
            for c in card["comparison"]
        ]
        body.append("<h2>Side by side</h2>")
        body.append(_html_table(["section", "row", *names_list, "more robust", "better to ship"], rows))
        body.append(f"<p>{_code(COMPARISON_CAPTION)}</p>")
    body.append("<h2>Definitions</h2>")
    body.append(_html_table(["metric", "unit", "better", "definition"], definition_rows(card)))
    body.append(
        f"<p>Definitions in full: docs/metrics.md in the qbench repository. Versions, commit and seed: card.json. Created {_e(card['created_utc'])}.</p>"
    )
    return (
        '<!DOCTYPE html>\n<html lang="en"><head><meta charset="utf-8"><title>qbench card: '
        f"{_e(names)}</title><style>{_CSS}</style></head><body>\n" + "\n".join(body) + "\n</body></html>\n"
    )
