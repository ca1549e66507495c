"""Writing a card: ``card.json``, ``card.md`` and ``card.html`` (with its figures) atomically, and reading one back."""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any

FIGURE_FILE = re.compile(r"card-(outliers-\d+|attention-\d+|breaking-points)\.png")


def write_card(card: Mapping[str, Any], out: Path) -> dict[str, Path]:
    """card.json, card.md and card.html (figures inline; PNG copies beside for card.md), each atomically; then
    the figure files of an earlier card that this page no longer shows are removed (none is left stale)."""
    from models.io import atomic_write_bytes, atomic_write_json, atomic_write_text
    from qbench.studies.card.render import figures, html, markdown

    out = Path(out)
    pngs = figures.figures(card)
    paths = {"json": out / "card.json", "md": out / "card.md", "html": out / "card.html"}
    files = {n: f"card-{n}.png" for n in pngs}
    for name, png in pngs.items():
        atomic_write_bytes(out / files[name], png)
    atomic_write_json(paths["json"], card)
    atomic_write_text(paths["md"], markdown.markdown(card, files))
    atomic_write_text(paths["html"], html.html(card, pngs))
    for stale in out.glob("card-*.png"):
        if FIGURE_FILE.fullmatch(stale.name) and stale.name not in files.values():
            stale.unlink(missing_ok=True)
    return paths


def read_card(path: str | Path) -> dict[str, Any]:
    path = Path(path)
    return json.loads((path / "card.json" if path.is_dir() else path).read_text())
