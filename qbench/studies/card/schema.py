"""The version of ``card.json``'s shape."""

from __future__ import annotations

CARD_VERSION = 1
