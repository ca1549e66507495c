"""Interleaved timing, shared by ``qbench speed``'s sections (``speed``, ``kvspeed``): every repeat runs each
candidate once, round-robin, so a noisy neighbour or a clock change hits all candidates alike."""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import Any


def time_interleaved(fns: Sequence[Callable[[], Any]], repeats: int) -> list[list[float]]:
    """Seconds per call: each repeat calls every function once, in order (round-robin). No warm-up here."""
    times: list[list[float]] = [[] for _ in fns]
    for _ in range(repeats):
        for fn, out in zip(fns, times):
            start = time.perf_counter()
            fn()
            out.append(time.perf_counter() - start)
    return times
