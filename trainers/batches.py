"""Training windows with a data order fixed by a seed, plus the fixed validation set and probe batch.

A window is ``span`` consecutive ids of a token stream, cut into inputs ``x = w[:-1]`` and targets ``y = w[1:]``:

- ``bos=False``: ``w = stream[o : o + context + 1]`` — ``context`` inputs and ``context`` targets; the first input
  is whatever token sits at ``o`` (mid-document, usually).
- ``bos=True``: ``w = [BOS] + stream[o : o + context]`` — a start token (``<|endoftext|>``) opens every window, so
  ``x = [BOS] + context − 1 stream tokens`` and the targets are the ``context`` stream tokens; the model never has
  to predict BOS. The fixed first token is what lets an attention sink form at position 0 (measured on the tiny presets: results/emergence/).

Training offsets: step ``s`` draws the global batch's ``batch_size`` offsets uniformly from ``[0, N − span]``
with numpy's PCG64 seeded by ``SeedSequence([seed, s])``. The sampler's whole state is therefore
``(seed, step)``: resuming needs the step alone, no pickled RNG; a data-parallel rank or a gradient-accumulation
micro-batch takes a contiguous row slice of the same global batch, so 1 process and K processes see the same
data. Windows may overlap and repeat (sampling with replacement), as in nanoGPT.

Validation: consecutive non-overlapping windows from the start of the validation stream (the perplexity
protocol of docs/metrics.md), up to a token budget. Probe: ``n`` windows at evenly spaced offsets of the
validation stream — the fixed batch on which the outlier statistics are tracked during training.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor

from models.errors import UserError


def window_span(context: int, bos: bool) -> int:
    """Stream tokens one window takes: context + 1 without BOS, context with it (BOS is the extra one)."""
    return context if bos else context + 1


def cut_windows(
    tokens: np.ndarray, offsets: np.ndarray, context: int, bos_id: int | None
) -> tuple[Tensor, Tensor]:
    """``(x, y)`` int64 tensors of shape (len(offsets), context) for windows starting at ``offsets``."""
    span = window_span(context, bos_id is not None)
    rows = np.stack([np.asarray(tokens[o : o + span], dtype=np.int64) for o in offsets])  # (B, span)
    if bos_id is not None:
        rows = np.concatenate([np.full((len(offsets), 1), bos_id, dtype=np.int64), rows], axis=1)
    w = torch.from_numpy(rows)  # (B, context + 1)
    return w[:, :-1].contiguous(), w[:, 1:].contiguous()


def _check_length(tokens: np.ndarray, span: int, what: str) -> None:
    if len(tokens) < span:
        raise UserError(
            f"the {what} token stream has {len(tokens)} tokens, fewer than one window ({span}); "
            "use a larger corpus or a shorter --context"
        )


@dataclass(frozen=True)
class WindowSampler:
    """Random training windows: step ``s`` of seed ``seed`` always gives the same global batch."""

    tokens: np.ndarray
    context: int
    seed: int
    bos_id: int | None = None

    def __post_init__(self) -> None:
        _check_length(self.tokens, self.span, "training")

    @property
    def span(self) -> int:
        return window_span(self.context, self.bos_id is not None)

    def offsets(self, step: int, batch_size: int) -> np.ndarray:
        """The global batch's window offsets at ``step``: uniform on [0, N − span], drawn by
        PCG64(SeedSequence([seed, step]))."""
        rng = np.random.Generator(np.random.PCG64(np.random.SeedSequence([self.seed, step])))
        return rng.integers(0, len(self.tokens) - self.span, size=batch_size, endpoint=True)

    def batch(self, step: int, batch_size: int, rows: slice = slice(None)) -> tuple[Tensor, Tensor]:
        """``(x, y)`` for ``rows`` of the global batch of ``step`` (a rank's or a micro-batch's slice)."""
        return cut_windows(self.tokens, self.offsets(step, batch_size)[rows], self.context, self.bos_id)


def shard_rows(batch_size: int, world_size: int, rank: int, accum: int, micro: int) -> slice:
    """Rows of the global batch that micro-batch ``micro`` of rank ``rank`` takes: contiguous, equal slices."""
    if batch_size % (world_size * accum):
        raise UserError(
            f"batch size {batch_size} is not divisible by processes × grad-accum = {world_size} × {accum}"
        )
    per_micro = batch_size // (world_size * accum)
    start = (rank * accum + micro) * per_micro
    return slice(start, start + per_micro)


def validation_windows(
    tokens: np.ndarray, context: int, bos_id: int | None, max_tokens: int
) -> tuple[Tensor, Tensor]:
    """Consecutive non-overlapping windows from the stream's start, as many as fit in ``max_tokens`` predicted
    tokens (at least one, at most what the stream holds)."""
    span = window_span(context, bos_id is not None)
    _check_length(tokens, span, "validation")
    n = max(1, min(max_tokens // context, len(tokens) // span))
    return cut_windows(tokens, np.arange(n) * span, context, bos_id)


def probe_windows(tokens: np.ndarray, context: int, bos_id: int | None, n: int) -> Tensor:
    """The probe batch's inputs: ``n`` windows at evenly spaced offsets over the whole stream, (n, context)."""
    span = window_span(context, bos_id is not None)
    _check_length(tokens, span, "validation")
    offsets = np.linspace(0, len(tokens) - span, num=n).astype(np.int64)
    return cut_windows(tokens, offsets, context, bos_id)[0]
