"""``card.md``: the card's sections as markdown tables, figures as PNG files beside it."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from qbench.eval.tolerance import tolerance_text
from qbench.studies.card.render.overview import (
    command_rows,
    comparison_table,
    definitions_table,
    summary_table,
)
from qbench.studies.card.render.sections import page_sections
from qbench.studies.card.render.table import Table
from qbench.studies.card.units import SIZE_UNIT


def _md_cell(text: str) -> str:
    """A table cell's text with its ``|`` escaped: "max |act|" unescaped is three cells, and a header with more
    cells than the delimiter row is no table on GitHub."""
    return text.replace("|", "\\|")


def _md_table(headers: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    lines = ["| " + " | ".join(map(_md_cell, headers)) + " |", "|" + "---|" * len(headers)]
    lines += ["| " + " | ".join(map(_md_cell, row)) + " |" for row in rows]
    return "\n".join(lines)


def _md(table: Table[Any]) -> str:
    return _md_table(table.headers, table.texts())


def markdown(card: Mapping[str, Any], figure_files: Mapping[str, str]) -> str:
    """The page: summary, each model's verdict and sections, the breaking-point curves, the comparison across
    models and the definitions; ``figure_files`` maps a figure's name to its PNG file beside the page."""
    parts = [f"# qbench card: {', '.join(m['name'] for m in card['models'])}", "", *_summary(card)]
    for i in range(len(card["models"])):
        parts += _model(card, i, figure_files)
    if "breaking-points" in figure_files:
        parts += [
            "## Breaking-point curves",
            "",
            f"![breaking points]({figure_files['breaking-points']})",
            "",
        ]
    if card.get("comparison"):
        table = comparison_table(card)
        parts += [f"## {table.title}", "", _md(table), "", table.caption, ""]
    parts += ["## Definitions", "", _md(definitions_table(card)), ""]
    parts += [
        f"Definitions in full: docs/metrics.md. Versions and commit: card.json (`env`). Created {card['created_utc']}.",
        "",
    ]
    return "\n".join(parts)


def _summary(card: Mapping[str, Any]) -> list[str]:
    summary = summary_table(card)
    parts = ["## Summary", ""]
    if summary.rows:
        parts += [_md(summary), ""]
    parts += [
        f"Budget {card['budget_contents']}; tolerance "
        f"{tolerance_text(card['tolerance_pct'], card.get('metric') or 'ppl')}. Sizes: {SIZE_UNIT}.",
        "",
    ]
    if card.get("comparison_lines"):
        parts += ["**Side by side**", "", *(f"- {line}" for line in card["comparison_lines"]), ""]
    commands = command_rows(card)
    if commands:
        parts += ["<details><summary>Commands</summary>", ""]
        parts += [f"- {what}: `{command}`" for what, command in commands]
        parts += ["", "</details>", ""]
    return parts


def _model(card: Mapping[str, Any], i: int, figure_files: Mapping[str, str]) -> list[str]:
    m = card["models"][i]
    parts = [f"## {m['name']}", "", "**Verdict**", "", *(f"- {line}" for line in m["verdict"]["lines"]), ""]
    for table in page_sections(card, i):
        parts += [f"### {table.title}", "", _md(table), ""]
        if table.caption:
            parts += [table.caption, ""]
        if table.figure and table.figure.name in figure_files:
            parts += [f"![{table.figure.alt}]({figure_files[table.figure.name]})", ""]
    if m.get("not_measured"):
        parts += ["### Not measured", "", *(f"- {line}" for line in m["not_measured"]), ""]
    return parts
