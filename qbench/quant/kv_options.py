"""The KV-cache options' values, apart from :mod:`qbench.quant.kv` so that the command line can list them in its
``--help`` without importing torch."""

from __future__ import annotations

KV_BITS = (8, 6, 4, 3, 2)
GRANULARITIES = ("kivi", "per-token")
