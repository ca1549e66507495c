"""The KV-cache options' values, apart from :mod:`qbench.quant.kv` so that the command line can list them in its
``--help`` without importing torch."""

from __future__ import annotations

KV_BITS = (8, 6, 4, 3, 2)
GRANULARITIES = ("kivi", "per-token")  # the former --kv-granularity values, now KV-scheme names
# qbench.quant.kvschemes.KV_SCHEMES' names (a test holds them equal) and its NAME:key=value syntax
KV_SCHEME_NAMES = ("kivi", "per-token", "fp8-e4m3", "fp8-e5m2", "window")
KV_SCHEME_SYNTAX = (
    "NAME[:key=value,…], e.g. kivi:group=32,residual=128 | per-token:sym=false | fp8-e4m3:scale=0.5 | "
    "window:key_axis=token; every scheme also takes bits, keep_first, keep_sinks, rotate"
)
