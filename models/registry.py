"""A named registry with aliases and did-you-mean errors (lm-evaluation-harness style).

One registry per kind of thing (presets, schemes, corpora, recipes, optimisers); the CLI's choices and
``qbench ls`` read the registry, so no list of names is written twice.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Generic, TypeVar

from models.errors import unknown_choice

T = TypeVar("T")


class Registry(Generic[T]):
    """Maps canonical names (and aliases) to entries, each with a one-line description."""

    def __init__(self, kind: str) -> None:
        self.kind = kind
        self._entries: dict[str, T] = {}
        self._descriptions: dict[str, str] = {}
        self._aliases: dict[str, str] = {}

    def register(self, name: str, entry: T, description: str = "", aliases: tuple[str, ...] = ()) -> T:
        for key in (name, *aliases):
            if key in self._entries or key in self._aliases:
                raise ValueError(f"{self.kind} {key!r} is already registered")
        self._entries[name] = entry
        self._descriptions[name] = description
        for alias in aliases:
            self._aliases[alias] = name
        return entry

    def decorator(self, name: str, description: str = "", aliases: tuple[str, ...] = ()) -> Callable[[T], T]:
        """``@REGISTRY.decorator("name")`` registers the decorated object under ``name``."""
        return lambda entry: self.register(name, entry, description, aliases)

    def canonical(self, name: str) -> str:
        """The canonical name for ``name`` or an alias; a did-you-mean :class:`UserError` otherwise."""
        if name in self._entries:
            return name
        if name in self._aliases:
            return self._aliases[name]
        raise unknown_choice(self.kind, name, [*self._entries, *self._aliases])

    def get(self, name: str) -> T:
        return self._entries[self.canonical(name)]

    def describe(self, name: str) -> str:
        return self._descriptions[self.canonical(name)]

    def aliases_of(self, name: str) -> list[str]:
        canonical = self.canonical(name)
        return [alias for alias, target in self._aliases.items() if target == canonical]

    def names(self) -> list[str]:
        return list(self._entries)

    def __contains__(self, name: object) -> bool:
        return name in self._entries or name in self._aliases

    def __iter__(self) -> Iterator[str]:
        return iter(self._entries)

    def __len__(self) -> int:
        return len(self._entries)
