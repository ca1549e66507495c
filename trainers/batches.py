"""Training windows with a data order fixed by a seed, the fixed validation set and probe batch, and evaluation
windows drawn across documents.

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

Validation: consecutive non-overlapping windows from the start of the validation stream (``--sample first`` of
docs/metrics.md), up to a token budget. Evaluation's default (``--sample documents``): windows drawn across the
documents of a split, stratified by source (:func:`document_windows`). Probe: ``n`` windows at evenly spaced offsets of the
validation stream — the fixed batch on which the outlier statistics are tracked during training.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor

from models.errors import UserError
from trainers.documents import DocumentIndex


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


@dataclass(frozen=True)
class SampledWindow:
    """One evaluation window drawn by :func:`document_windows`: it starts ``offset`` tokens into piece ``piece``
    (stream position ``start``), cut from ``document`` of ``source``."""

    piece: str
    document: str
    source: str
    offset: int
    start: int


def document_windows(index: DocumentIndex, span: int, n: int, seed: int) -> list[SampledWindow]:
    """``n`` non-overlapping windows of ``span`` stream tokens, each inside one piece, drawn across documents and
    stratified by source (fewer when the pieces cannot hold ``n``). The rule, seeded by ``seed`` alone:

    1. *Sources*: the windows are shared among the sources in proportion to the tokens their eligible pieces (those
       holding at least one window) hold — largest remainders, and at least one window per source when
       ``n`` ≥ the number of sources (so a small source is never left out); a source that cannot hold its share
       passes the rest to the others. While the documents can take the windows one each (n ≤ documents), what a
       source "can hold" is one window per document: independent documents matter more than exact proportions.
    2. *Documents*: within a source, documents in a seeded random order take one window each in turn, round after
       round, so no document holds more than ⌈share / documents⌉ windows — as few per document as the budget
       allows (one each at qbench's default budgets on the embedded corpus).
    3. *Position*: a document's window goes to one of its pieces (in turn, seeded order) at a slot drawn
       uniformly among the piece's ⌊length / span⌋ non-overlapping slots not yet taken; the piece's slots are
       shifted together by a uniform amount within the slack they leave — so any position can be scored.

    The windows come back in draw order: round-robin over the sources, so the first few (the outlier statistics'
    windows) already span every source."""
    rng = np.random.Generator(np.random.PCG64(np.random.SeedSequence([seed, span, n])))
    slots = index.lengths // span
    eligible = np.flatnonzero(slots > 0)
    by_source: dict[str, list[int]] = {}
    for i in eligible:
        by_source.setdefault(index.sources[i], []).append(int(i))
    shares = _shares({s: int(index.lengths[ix].sum()) for s, ix in by_source.items()}, n)
    # one window per document first: while the documents can hold the windows one each, a source gets at most as
    # many windows as it has documents (independent clusters matter more than exact proportions); else its slots
    documents = {s: len({index.documents[i] for i in ix}) for s, ix in by_source.items()}
    capacity = {s: int(slots[ix].sum()) for s, ix in by_source.items()}
    _spill(shares, documents if n <= sum(documents.values()) else capacity)
    drawn = {s: _draw_source(index, by_source[s], slots, span, shares[s], rng) for s in sorted(by_source)}
    order = sorted(drawn, key=lambda s: (-len(drawn[s]), s))
    out: list[SampledWindow] = []
    for k in range(max((len(w) for w in drawn.values()), default=0)):
        out.extend(drawn[s][k] for s in order if k < len(drawn[s]))
    return out


def _shares(tokens: dict[str, int], n: int) -> dict[str, int]:
    """``n`` split in proportion to ``tokens`` (largest remainders), at least 1 each when n ≥ len(tokens)."""
    sources = sorted(tokens)
    if not sources:
        return {}
    total = sum(tokens.values())
    floor_one = n >= len(sources)
    rest = n - (len(sources) if floor_one else 0)
    exact = {s: rest * tokens[s] / total for s in sources}
    shares = {s: int(exact[s]) + (1 if floor_one else 0) for s in sources}
    left = n - sum(shares.values())
    for s in sorted(sources, key=lambda s: (-(exact[s] - int(exact[s])), s))[:left]:
        shares[s] += 1
    return shares


def _spill(shares: dict[str, int], capacity: dict[str, int]) -> None:
    """Move what a source cannot hold to sources with room, largest room first (in place)."""
    extra = sum(max(0, shares[s] - capacity[s]) for s in shares)
    for s in shares:
        shares[s] = min(shares[s], capacity[s])
    for s in sorted(shares, key=lambda s: (-(capacity[s] - shares[s]), s)):
        take = min(extra, capacity[s] - shares[s])
        shares[s] += take
        extra -= take


def _draw_source(
    index: DocumentIndex, pieces: list[int], slots: np.ndarray, span: int, k: int, rng: np.random.Generator
) -> list[SampledWindow]:
    documents: dict[str, list[int]] = {}
    for i in pieces:
        documents.setdefault(index.documents[i], []).append(i)
    names = sorted(documents)
    names = [names[j] for j in rng.permutation(len(names))]
    free = {
        i: list(rng.permutation(int(slots[i]))) for i in pieces
    }  # each piece's untaken slots, drawn order
    # one shift per piece (not per window): the slack its slots leave, so its windows never overlap
    shift = {
        i: int(rng.integers(0, int(index.lengths[i]) - int(slots[i]) * span, endpoint=True)) for i in pieces
    }
    turn = {d: 0 for d in names}
    out: list[SampledWindow] = []
    while len(out) < k:
        progressed = False
        for d in names:
            if len(out) == k:
                break
            own = [i for i in documents[d] if free[i]]
            if not own:
                continue
            i = own[turn[d] % len(own)]
            turn[d] += 1
            offset = int(free[i].pop()) * span + shift[i]
            out.append(
                SampledWindow(index.ids[i], d, index.sources[i], offset, int(index.starts[i]) + offset)
            )
            progressed = True
        if not progressed:
            break
    return out
