"""``qbench card``: one page per model — outliers, attention sink, deployable formats, breaking points, KV cache,
where it breaks and the repair, and a verdict — built from the harness's records.

    result = run_card(CardConfig(models=["ckpts/vanilla"], budget="quick", output_path=Path("card")))
    # -> card/card.json, card/card.md, card/card.html (+ the records under card/<model>/)

The package reads one way, each module importing only those above it:

- :mod:`~.plan` — the catalogue: formats, KV rows and budgets (standard library only: ``qbench card --help``);
- :mod:`~.config` — :class:`CardConfig`, its checks, and the one place a config becomes a grid or sweep spec;
- :mod:`~.measure` — :func:`run_card` = write(build(measure(cfg))): every number is a harness cell
  (``qbench.eval.harness.run_grid``) under ``output_path`` in the grid's layout, so ``qbench run --output-path
  DIR`` with the same protocol reuses the card's cells and the card reuses theirs; an interrupted card resumes and a
  re-run evaluates nothing. The breaking points are ``qbench sweep``'s, the repair ``qbench sensitivity``'s;
  :mod:`~.profile` measures what no cell holds (attention per head, massive activations, architecture, speed);
  each model's records arrive as one :class:`~.result.ModelResult`;
- :mod:`~.sizes` (bytes) ← :mod:`~.decide` and :mod:`~.compare` (decisions as dataclasses, no sentences) ←
  :mod:`~.words` (every sentence) ← :mod:`~.rows` and :mod:`~.repair` (card.json's rows and repair section) ←
  :mod:`~.build` (:func:`build_card`, a pure function from the records to ``card.json``'s dict);
- :mod:`~.schema` declares that dict's shape, :mod:`~.upgrade` reads any version this qbench knows;
- :mod:`~.render` — markdown, HTML and figures from ``card.json`` alone (they compute no number); :mod:`~.write`
  writes the three pages atomically and re-renders a written card (``qbench card --from-json``).
"""

from __future__ import annotations

from typing import Any

from qbench.studies.card.config import CardConfig, validate
from qbench.studies.card.plan import (
    BUDGETS,
    FORMATS,
    KV_KEEP_SINKS,
    KV_MIN_WINDOW,
    Budget,
    Format,
    KVRow,
    budget,
)


def __getattr__(name: str) -> Any:
    """The rest imports torch when first used, not when ``qbench card --help`` reads the budgets (PEP 562)."""
    if name in ("Progress", "run_card"):
        from qbench.studies.card import measure

        return getattr(measure, name)
    if name == "build_card":
        from qbench.studies.card.build import build_card

        return build_card
    if name in ("write_card", "read_card"):
        from qbench.studies.card import write

        return getattr(write, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = [
    "BUDGETS",
    "FORMATS",
    "KV_KEEP_SINKS",
    "KV_MIN_WINDOW",
    "Budget",
    "CardConfig",
    "Format",
    "KVRow",
    "Progress",
    "budget",
    "build_card",
    "read_card",
    "run_card",
    "validate",
    "write_card",
]
