"""Which text an evaluation scores (``--sample``): windows drawn across documents, or the stream's first windows —
the names, the default window and the words, with nothing heavier (the card's sentences read them; this module
imports no torch).

**Why a sample of documents.** A verdict is about the model, so its interval must describe variation across the
text a model meets, not across the windows of one speech. Consecutive windows from the start of the validation
stream (``first``, every record's protocol before sampling existed) put a 4,096-token budget of 2,048-token windows
inside one document: two windows, one degree of freedom (t = 12.7), an interval whose very width is random over
orders of magnitude. ``documents`` (the default of the qbench protocol) draws the windows across the split's
documents instead, stratified by source, as few per document as the budget allows
(``trainers.batches.document_windows``), and the intervals treat windows of one document as one cluster
(``qbench.eval.evidence.cluster_interval``).

**Enough clusters** (:func:`default_window`). The budget buys windows; at a budget of ``tokens`` the default window
is the largest power of two ≤ tokens / :data:`MIN_WINDOWS` (at least :data:`MIN_SAMPLED_WINDOW`, at most the
model's context and 2,048), so every budget scores ≥ 16 windows — 15 degrees of freedom, t = 2.13 — and on the
embedded corpus from 16 different documents of all three sources: 256-token windows at the card's quick budget
(4,096 tokens), 512 at standard, 2,048 at ``qbench run``'s 32,768. Quantisation damage does not need a 2,048-token
context to show (a weight or activation error acts at every position); a KV-cache error that grows with the
context does, and is measured at the context asked for with ``--window``.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

DOCUMENTS, FIRST = "documents", "first"
SAMPLES = (DOCUMENTS, FIRST)
MIN_WINDOWS = 16  # windows every budget scores by default: 15 degrees of freedom
MIN_SAMPLED_WINDOW = 128  # the shortest default window (a per-unit study's 512 tokens then scores 4)
MAX_WINDOW = 2048  # qbench.eval.adapters.MAX_DEFAULT_WINDOW (lm-evaluation-harness's cap), without torch


def sample_name(protocol: Mapping[str, Any]) -> str:
    """The sample a record's (or a card's) protocol used: its ``sample``, ``first`` for one from before it existed."""
    if isinstance(protocol.get("sampled"), Mapping) and "name" in protocol["sampled"]:
        return protocol["sampled"]["name"]  # a card's summary
    return protocol.get("sample") or FIRST


def default_window(tokens: int, context: int, sample: str) -> int:
    """The window when none is given: the model's context (at most :data:`MAX_WINDOW`); under the documents
    sample also at most the largest power of two ≤ tokens / :data:`MIN_WINDOWS`, and at least
    :data:`MIN_SAMPLED_WINDOW` (or the context, when that is shorter)."""
    window = min(context, MAX_WINDOW)
    if sample == DOCUMENTS:
        target = max(MIN_SAMPLED_WINDOW, 1 << max(0, (tokens // MIN_WINDOWS).bit_length() - 1))
        window = min(window, target)
    return window


def sample_text(protocol: Mapping[str, Any]) -> str:
    """What text a record scored, in words: ``16 windows of 256 tokens drawn across 16 documents of 3 sources
    (sotu 9, shakespeare 4, factbook 3; seed 0)`` or ``the first 2 windows of 2,048 tokens``."""
    windows, window = protocol.get("windows"), protocol.get("window")
    if sample_name(protocol) == FIRST:
        return (
            f"the first {windows} windows of {window:,} tokens" if windows and window else "the first windows"
        )
    sampled = protocol.get("sampled") or {}  # a record's, or a card's summary of it (sampled_summary)
    sources = sampled.get("sources") or {}
    seed = sampled.get("seed", protocol.get("sample_seed", 0))
    where = ", ".join(f"{name} {n}" for name, n in sources.items())
    return (
        f"{windows} windows of {window:,} tokens drawn across {sampled.get('documents')} documents of "
        f"{len(sources)} source{'s' if len(sources) != 1 else ''} ({where}; seed {seed})"
    )


def sampled_summary(protocol: Mapping[str, Any]) -> dict[str, Any]:
    """A documents-sample record's sample in brief (the card keeps this, not each window's place): its name, seed,
    the documents and the windows per source."""
    sampled = protocol.get("sampled") or {}
    return {
        "name": sample_name(protocol),
        "seed": protocol.get("sample_seed"),
        "documents": sampled.get("documents"),
        "sources": sampled.get("sources"),
        "window_documents": window_documents(protocol),
    }


def window_documents(protocol: Mapping[str, Any]) -> list[str] | None:
    """The document of each scored window, in the evidence's order (the intervals' clusters), from a record's
    protocol or a card's summary of it; None for the first windows (each window its own cluster)."""
    sampled = protocol.get("sampled") or {}
    if "window_documents" in sampled:
        return sampled["window_documents"]
    at = sampled.get("windows_at")
    return [w["document"] for w in at] if at else None


def scored_text(protocol: Mapping[str, Any]) -> str:
    """``4,096 tokens in 16 windows of 256 tokens drawn across 16 documents of 3 sources (…)``: the tokens a
    record (or a card's protocol) scored and where they came from — one wording for every caption."""
    tokens = protocol.get("tokens_scored")
    counted = f"{tokens:,} tokens" if isinstance(tokens, int) else "tokens"
    return f"{counted} in {sample_text(protocol)}"
