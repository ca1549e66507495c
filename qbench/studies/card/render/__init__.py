"""The card's pages, from card.json alone: they format and draw, and compute no number.

Every table is a :class:`~.table.Table` of column specs, built once and rendered by both pages:

- :mod:`~.table` — ``Column`` (header, the cell's text, the card.json number it shows) and ``Table``;
- :mod:`~.sections` — one model's tables in page order (identity, outliers, linear inputs, attention, breaking
  points, where it breaks), with :mod:`~.formats` (the formats, and the cells every measured row shares) and
  :mod:`~.kv` (the KV cache); :mod:`~.overview` — the tables across models (summary, comparison, definitions);
- :mod:`~.markdown` and :mod:`~.html` — the two pages; the HTML keys the numbers the specs name;
- :mod:`~.figures` — the PNGs.

Numbers are printed by :mod:`qbench.studies.card.units` only. This package imports neither ``decide``,
``measure``, ``build`` nor ``words``: a page shows what card.json holds."""
