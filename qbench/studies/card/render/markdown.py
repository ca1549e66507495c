"""``card.md``: the card's sections as markdown tables, figures as PNG files beside it."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from qbench.eval.evidence import tolerance_text
from qbench.studies.card.render.sections import (
    COMPARISON_CAPTION,
    command_rows,
    comparison_cell,
    definition_rows,
    page_sections,
    ship_text,
    summary_rows,
)
from qbench.studies.card.units import SIZE_UNIT


def _md_cell(text: str) -> str:
    """A table cell's text with its ``|`` escaped: "max |act|" unescaped is three cells, and a header with more
    cells than the delimiter row is no table on GitHub."""
    return text.replace("|", "\\|")


def _md_table(headers: list[str], rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(map(_md_cell, headers)) + " |", "|" + "---|" * len(headers)]
    lines += ["| " + " | ".join(map(_md_cell, row)) + " |" for row in rows]
    return "\n".join(lines)


def markdown(card: Mapping[str, Any], figure_files: Mapping[str, str]) -> str:
    parts = [f"# qbench card: {', '.join(m['name'] for m in card['models'])}", ""]
    summary = summary_rows(card)
    parts += ["## Summary", ""]
    if summary:
        headers = list(summary[0])
        parts += [_md_table(headers, [[r[h] for h in headers] for r in summary]), ""]
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
    for i, m in enumerate(card["models"]):
        parts += [
            f"## {m['name']}",
            "",
            "**Verdict**",
            "",
            *(f"- {line}" for line in m["verdict"]["lines"]),
            "",
        ]
        for title, headers, rows, caption in page_sections(card, m):
            parts += [f"### {title}", "", _md_table(headers, rows), ""]
            if caption:
                parts += [caption, ""]
            if title.startswith("Outlier") and f"outliers-{i}" in figure_files:
                parts += [f"![outlier profile]({figure_files[f'outliers-{i}']})", ""]
            if title.startswith("Attention") and f"attention-{i}" in figure_files:
                parts += [f"![attention sink]({figure_files[f'attention-{i}']})", ""]
        if m.get("not_measured"):
            parts += ["### Not measured", "", *(f"- {line}" for line in m["not_measured"]), ""]
    if "breaking-points" in figure_files:
        parts += [
            "## Breaking-point curves",
            "",
            f"![breaking points]({figure_files['breaking-points']})",
            "",
        ]
    if card.get("comparison"):
        names = [m["name"] for m in card["models"]]
        rows = [
            [
                c["section"],
                c["row"],
                *(comparison_cell(c, n) for n in names),
                c["more_robust"] or "-",
                ship_text(c),
            ]
            for c in card["comparison"]
        ]
        parts += [
            "## Side by side",
            "",
            _md_table(["section", "row", *names, "more robust", "better to ship"], rows),
            "",
            COMPARISON_CAPTION,
            "",
        ]
    parts += [
        "## Definitions",
        "",
        _md_table(["metric", "unit", "better", "definition"], definition_rows(card)),
        "",
    ]
    parts += [
        f"Definitions in full: docs/metrics.md. Versions and commit: card.json (`env`). Created {card['created_utc']}.",
        "",
    ]
    return "\n".join(parts)
