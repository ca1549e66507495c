"""A table as column specs: the one description the markdown and the HTML page both render.

A column says its header, how a cell's text is read from the row, and — where the cell shows a card.json number —
that number's path within the row. Markdown prints the text; the HTML page prints the same text and, from the
same spec, wraps it in ``data-key``/``data-value`` (the number's full path and exact value). A column added or
moved therefore keys its own cells: no renderer counts positions."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from functools import reduce
from typing import Any, Generic, TypeVar

Row = TypeVar("Row")
Record = Mapping[str, Any]  # one row of card.json: a format, a KV row, a model, a comparison row


def _always(row: Any) -> bool:
    return True


@dataclass(frozen=True)
class Column(Generic[Row]):
    """One column of a table whose rows are ``Row``s."""

    header: str
    text: Callable[[Row], str]
    """The cell as markdown text (`` `code` `` spans allowed), read from the row."""
    key: str | None = None
    """The card.json number the cell shows, as a dotted path within the row (``perplexity``,
    ``verdict.recommended.scheme``); None where the cell is no single number of card.json."""
    keyed: Callable[[Row], bool] = _always
    """Whether this row's cell shows that number: a format the model did not run shows "-", not its null."""
    beside: bool = False
    """The text is more than the number (the summary's "label `scheme`"): the key follows the text as an empty
    span instead of wrapping it, so the page still names the scheme card.json holds."""
    css: Callable[[Row], str] | None = None
    """A class on the cell's text: the verdict's colour (``ok``, ``bad``, ``undecided``)."""


@dataclass(frozen=True)
class Key:
    """A number a cell shows: its full card.json path and its exact value (the HTML's data-key / data-value)."""

    path: str
    value: Any


@dataclass(frozen=True)
class Figure:
    """The figure shown after a table (figures.py draws it under ``name``)."""

    name: str  # its key in ``figures()``: ``outliers-0``
    alt: str  # markdown's alt text
    caption: str  # the HTML figure's caption


@dataclass(frozen=True)
class Table(Generic[Row]):
    """A titled table with its caption; ``path`` is where its rows sit in card.json (``models.0.formats``: row
    ``j`` is ``models.0.formats.j``), None for a table whose rows are not one card.json list (no data-keys)."""

    title: str
    columns: Sequence[Column[Row]]
    rows: Sequence[Row]
    caption: str = ""
    path: str | None = None
    figure: Figure | None = None

    @property
    def headers(self) -> list[str]:
        return [c.header for c in self.columns]

    def texts(self) -> list[list[str]]:
        """Every cell's text, row by row: the markdown table."""
        return [[c.text(row) for c in self.columns] for row in self.rows]

    def key(self, column: Column[Row], j: int, row: Row) -> Key | None:
        """The number row ``j``'s cell in ``column`` shows, or None."""
        if column.key is None or self.path is None or not column.keyed(row):
            return None
        value = reduce(lambda node, part: node[part], column.key.split("."), row)
        return Key(f"{self.path}.{j}.{column.key}", value)


def item(i: int) -> Callable[[Sequence[str]], str]:
    """A column of a table whose rows are already text: the row's ``i``-th string."""
    return lambda row: row[i]


def text_columns(headers: Sequence[str]) -> list[Column[Sequence[str]]]:
    """The columns of a table whose rows are lists of text, one per header."""
    return [Column(h, item(i)) for i, h in enumerate(headers)]
