"""Writing a card: ``card.json``, ``card.md`` and ``card.html`` (with its figures) atomically; reading one back
(upgraded to this qbench's version, :func:`~qbench.studies.card.upgrade.upgrade`); and re-rendering a written card
from its card.json alone (:func:`rerender`, ``qbench card --from-json``)."""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any

FIGURE_FILE = re.compile(r"card-(outliers-\d+|attention-\d+|breaking-points)\.png")


def write_card(card: Mapping[str, Any], out: Path) -> dict[str, Path]:
    """card.json, card.md and card.html (figures inline; PNG copies beside for card.md), each atomically, once
    all of them are rendered (a page that fails to render leaves the folder as it was); then the figure files of
    an earlier card that this page no longer shows are removed (none is left stale)."""
    from models.io import atomic_write_bytes, atomic_write_json, atomic_write_text
    from qbench.studies.card.render import figures, html, markdown

    out = Path(out)
    pngs = figures.figures(card)
    paths = {"json": out / "card.json", "md": out / "card.md", "html": out / "card.html"}
    files = {n: f"card-{n}.png" for n in pngs}
    page, md = html.html(card, pngs), markdown.markdown(card, files)
    for name, png in pngs.items():
        atomic_write_bytes(out / files[name], png)
    atomic_write_json(paths["json"], card)
    atomic_write_text(paths["md"], md)
    atomic_write_text(paths["html"], page)
    for stale in out.glob("card-*.png"):
        if FIGURE_FILE.fullmatch(stale.name) and stale.name not in files.values():
            stale.unlink(missing_ok=True)
    return paths


def card_file(path: str | Path) -> Path:
    """The card.json that ``path`` names: the file itself, or card.json in the folder; UserError (one line) when
    there is none."""
    from models.errors import UserError

    path = Path(path)
    file = path / "card.json" if path.is_dir() else path
    if not file.is_file():
        where = f"{path} holds no card.json" if path.is_dir() else f"{path} does not exist"
        raise UserError(f"{where}: give a card's folder or its card.json (what `qbench card` wrote)")
    if file.name != "card.json":
        raise UserError(f"{path} is not a card.json: give a card's folder or its card.json")
    return file


def read_card(path: str | Path) -> dict[str, Any]:
    """The card at ``path`` (its folder or its card.json), upgraded to this qbench's version; a card this qbench
    cannot read (another version, not JSON) is a one-line UserError naming the file."""
    from models.errors import UserError
    from qbench.studies.card.upgrade import upgrade

    file = card_file(path)
    try:
        card = json.loads(file.read_text())
    except (ValueError, UnicodeDecodeError) as e:
        raise UserError(f"{file} is not JSON ({str(e).splitlines()[0]}): not a card qbench wrote") from None
    return upgrade(card, file)


def rerender(path: str | Path) -> dict[str, Path]:
    """card.md, card.html and the figures of the card at ``path`` again, from its card.json alone (no model
    loaded, no cell evaluated), with card.json rewritten at this qbench's version (atomically; upgraded, nothing
    else in it changed). Nothing is written when the card cannot be read. Returns what was written (as
    :func:`write_card`), the figures under their names."""
    file = card_file(path)
    card = read_card(file)
    paths = write_card(card, file.parent)
    figures = sorted(p for p in file.parent.glob("card-*.png") if FIGURE_FILE.fullmatch(p.name))
    return {**paths, **{p.stem.removeprefix("card-"): p for p in figures}}
