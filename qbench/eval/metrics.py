"""Evaluation metrics: token-level perplexity under one documented protocol, outlier and attention statistics
(definitions in ``models.stats``), and massive activations (Sun et al., 2024).

Perplexity protocol (token level, never word or byte level):
- text: the ``split`` of ``corpus`` (default: "validation" of a registered corpus, "all" of a user's own file or
  folder — ``trainers.data.default_split``), its texts cut into pieces of ≤ 16 kB, tokenised with the model's own
  tokenizer, each piece preceded by ``<|endoftext|>``, concatenated, with the index of where each piece sits
  (``trainers.data.token_stream``, ``stream_index``);
- windows (``sample``, ``qbench.eval.sampling``): ``documents`` (default) — ``tokens // window`` windows drawn
  across the split's documents, stratified by source, each inside one piece (``trainers.batches.document_windows``;
  the record's ``protocol.sampled`` says where each came from; the intervals cluster by document); ``first`` — the
  first ``tokens`` tokens of the stream, consecutive windows, each token scored once, the trainer's own cutter
  (``trainers.batches.validation_windows``: a checkpoint's validation perplexity during training and
  ``qbench run --sample first``'s float perplexity are the same number). Both score every position of
  non-overlapping windows of ``window`` input positions (default: the model's context, at most
  ``adapters.MAX_DEFAULT_WINDOW`` = 2,048 as lm-evaluation-harness caps it, and under ``documents`` at most tokens/16:
  ``sampling.default_window``), ``tokens_scored`` the exact count. With ``bos`` (default) the inputs are [BOS] +
  the next window−1 stream tokens and the targets the next ``window`` stream tokens (each sequence starts the way
  the models were trained); without it the inputs are ``window`` stream tokens and the targets the same shifted by
  one (a window's first token is context only);
- perplexity = exp(mean negative log-likelihood over the predicted tokens), accumulated in float64.
Batches never mix information: dynamic activation scales of the quantisation schemes are per sequence (see
``qbench.quant.schemes``), so the result does not depend on ``batch_size``.
A budget larger than the text (or than its pieces hold) is clamped to what exists; the record says
``tokens_clamped: true``.

``protocol="llama.cpp"`` (``--protocol llama.cpp``) is llama.cpp's ``llama-perplexity`` instead
(``qbench.eval.llamacpp_protocol``): the stream cut into consecutive chunks of ``window`` tokens (default 512,
its ``-c``), BOS replacing each chunk's first token (``--no-bos``: not), only the positions ``window/2`` …
``window − 2`` scored (each predicting the next chunk token), ``tokens`` the stream tokens the chunks cover
(``tokens // window`` chunks, its ``--chunks``). Perplexity, the per-token evidence, KL divergence and top-1 are
all of exactly those positions (``Windows.first``).
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from models.errors import UserError
from models.stats import OutlierAccumulator
from models.tokenizer import separator_id
from qbench.eval.adapters import forward_observed, logits, observe_any
from qbench.eval.llamacpp_protocol import (
    LLAMA_CPP,
    LLAMA_CPP_WINDOW,
    QBENCH,
    check_protocol,
    llama_cpp_record,
    llama_cpp_windows,
)
from qbench.eval.reference import ReferenceLogits
from qbench.eval.sampling import DOCUMENTS, FIRST, SAMPLES, default_window
from trainers.batches import SampledWindow, cut_windows, document_windows, validation_windows, window_span


@dataclass(frozen=True)
class Protocol:
    corpus: str = "embedded"
    split: str | None = None  # None: trainers.data.default_split(corpus), resolved here so records name it
    tokens: int = 32768
    window: int | None = None  # None: the model's context length
    bos: bool = True
    batch_size: int = 8
    outlier_windows: int = 8  # windows (from the start of the same text) for outlier/attention statistics
    # which positions are scored: "qbench" (every position of non-overlapping windows) or "llama.cpp" (the second
    # half of each chunk, as llama-perplexity: qbench.eval.llamacpp_protocol)
    protocol: str = "qbench"
    # where the windows come from: "documents" (drawn across the split's documents, stratified by source:
    # trainers.batches.document_windows) or "first" (consecutive windows from the stream's start, every record's
    # protocol before sampling existed; llama.cpp's chunking). None: documents, first under protocol llama.cpp
    sample: str | None = None
    sample_seed: int = 0  # the seed of the documents sample

    def __post_init__(self) -> None:
        check_protocol(self.protocol)
        if self.split is None:
            from trainers.data import default_split

            object.__setattr__(self, "split", default_split(self.corpus))
        if self.protocol == LLAMA_CPP and self.window is None:  # llama-perplexity's own default context (-c)
            object.__setattr__(self, "window", LLAMA_CPP_WINDOW)
        if self.sample is None:
            object.__setattr__(self, "sample", FIRST if self.protocol == LLAMA_CPP else DOCUMENTS)
        if self.sample not in SAMPLES:
            from models.errors import unknown_choice

            raise unknown_choice("--sample", self.sample, SAMPLES)
        if not 0 <= self.sample_seed < 2**63:  # numpy's SeedSequence takes non-negative integers only
            raise UserError(f"--sample-seed must be a non-negative integer, got {self.sample_seed}")
        if self.protocol == LLAMA_CPP and self.sample != FIRST:
            raise UserError(
                f"--sample {self.sample} with --protocol llama.cpp: llama-perplexity scores consecutive chunks "
                "from the start of the text; use --sample first (its default) or --protocol qbench"
            )

    def to_dict(self) -> dict[str, Any]:
        """The requested fields, as a record's ``protocol`` holds them. ``protocol`` is written only when it is not
        the default "qbench": records of the default protocol stay what they were before the option existed (their
        identity and reuse unchanged), and a record without the key reads as "qbench"
        (:func:`qbench.eval.llamacpp_protocol.protocol_name`). ``sample`` is always written (a record without it
        read the first windows: :func:`qbench.eval.sampling.sample_name`), ``sample_seed`` with documents only."""
        out = asdict(self)
        if out["protocol"] == QBENCH:
            del out["protocol"]
        if out["sample"] != DOCUMENTS:  # the seed draws nothing from the first windows
            del out["sample_seed"]
        return out


@dataclass
class Windows:
    ids: Tensor  # (N, W) long: the model's inputs
    # (N, S) long: the token each scored input position predicts — position ``first + k`` predicts
    # ``targets[:, k]``; S = W under the qbench protocol (every position), W − 1 − W/2 under llama.cpp's
    targets: Tensor
    scored_tokens: int  # stream tokens predicted across all windows
    available_tokens: int
    clamped: bool
    window: int
    scored_bytes: int | None = None  # UTF-8 bytes of the scored tokens' text (bits per byte); None: unknown
    first: int = 0  # the first scored input position (llama.cpp's ``first = n_ctx/2``; 0: every position)
    sampled: list[SampledWindow] | None = (
        None  # where each window was drawn (the documents sample); None: first
    )
    pieces: int = 0  # pieces of the split (the documents sample)

    @property
    def clusters(self) -> list[str] | None:
        """The document each window was cut from (the intervals' clusters); None: each window its own."""
        return None if self.sampled is None else [w.document for w in self.sampled]

    @property
    def every_position(self) -> bool:
        """Whether every input position is scored (the qbench protocol): the logits are used whole."""
        return self.first == 0 and self.targets.size(-1) == self.ids.size(-1)

    def scored(self, out: Tensor) -> Tensor:
        """The scored positions of ``out`` (B, W, …): all of it, or positions first … first + S − 1."""
        if self.every_position:
            return out
        return out[:, self.first : self.first + self.targets.size(-1)]


def scored_bytes(tokenizer: Any, targets: Tensor) -> int | None:
    """UTF-8 bytes of the text the scored tokens spell: each window's targets decoded without special tokens
    (the document separators spell no text), summed. A character split across two windows' boundary decodes as
    replacement characters, a few bytes per window at most. None when the tokenizer cannot decode."""
    try:
        return sum(len(tokenizer.decode(row.tolist(), skip_special_tokens=True).encode()) for row in targets)
    except Exception:  # a tokenizer without decode (a bare vocabulary): bits per byte is then not reported
        return None


def make_windows(tokenizer: Any, protocol: Protocol, context: int) -> Windows:
    """Cut the protocol's text into the evaluation windows (see the module docstring)."""
    from trainers.data import token_stream

    sample = protocol.sample or DOCUMENTS
    window = default_window(protocol.tokens, context, sample) if protocol.window is None else protocol.window
    if window > context:
        default = (
            " (--protocol llama.cpp's default, llama-perplexity's -c)"
            if protocol.protocol == LLAMA_CPP
            else ""
        )
        raise UserError(f"--window {window}{default} exceeds the model's context length {context}")
    if window < 2:
        raise UserError(f"--window must be at least 2 (a token and the one it predicts), got {window}")
    stream = token_stream(protocol.corpus, protocol.split, tokenizer)
    bos_id = separator_id(tokenizer) if protocol.bos else None
    first, sampled, pieces = 0, None, 0  # every position scored (qbench's protocol), the first windows
    if protocol.protocol == LLAMA_CPP:
        ids, targets, first = llama_cpp_windows(
            stream, window, bos_id, protocol.tokens, protocol.split, protocol.corpus
        )
    elif sample == DOCUMENTS:
        ids, targets, sampled, pieces = _document_windows(tokenizer, protocol, stream, window, bos_id)
    else:
        try:
            ids, targets = validation_windows(stream, window, bos_id, protocol.tokens)
        except UserError:
            raise UserError(
                f"the {protocol.split} split of {protocol.corpus!r} has {len(stream)} tokens, fewer than one "
                f"window of {window_span(window, protocol.bos)}; use a larger corpus or a smaller --window"
            ) from None
    clamped = protocol.tokens > len(stream) or (
        sampled is not None and len(sampled) < protocol.tokens // window
    )
    return Windows(
        ids,
        targets,
        targets.numel(),
        len(stream),
        clamped,
        window,
        scored_bytes(tokenizer, targets),
        first,
        sampled,
        pieces,
    )


def _document_windows(
    tokenizer: Any, protocol: Protocol, stream: Any, window: int, bos_id: int | None
) -> tuple[Tensor, Tensor, list[SampledWindow], int]:
    """The documents sample: ``tokens // window`` windows (at least one) drawn across the split's pieces."""
    import numpy as np

    from trainers.data import stream_index

    index = stream_index(stream, separator_id(tokenizer), str(protocol.corpus))
    span = window_span(window, protocol.bos)
    drawn = document_windows(index, span, max(1, protocol.tokens // window), protocol.sample_seed)
    if not drawn:
        longest = int(index.lengths.max()) if len(index) else 0
        raise UserError(
            f"no document of the {protocol.split} split of {protocol.corpus!r} holds a window of {span} tokens "
            f"(the longest holds {longest}); use a smaller --window, or --sample first to read the stream as "
            "one text"
        )
    ids, targets = cut_windows(stream, np.array([w.start for w in drawn]), window, bos_id)
    return ids, targets, drawn, len(index)


def protocol_record(
    protocol: Protocol, windows: Windows, tokenizer: Any, dtype: str | None
) -> dict[str, Any]:
    """The protocol as run: the requested fields plus what the text and the model turned them into."""
    from models.tokenizer import tokenizer_fingerprint

    record = {
        **protocol.to_dict(),
        "window": windows.window,
        "stride": window_span(
            windows.window, protocol.bos
        ),  # stream tokens from one window's start to the next
        "windows": len(windows.ids),
        "tokens_scored": windows.scored_tokens,
        "tokens_available": windows.available_tokens,
        "tokens_clamped": windows.clamped,
        "bytes_scored": windows.scored_bytes,
        "tokenizer_fingerprint": tokenizer_fingerprint(tokenizer),
        "dtype": dtype,
        "perplexity": "token-level, exp(mean NLL), non-overlapping windows",
    }
    if windows.sampled is not None:
        record.update(stride=None, sampled=sampled_record(windows))
    if protocol.protocol == LLAMA_CPP:
        record.update(llama_cpp_record(windows.window, windows.first, windows.targets.size(-1)))
    return record


def sampled_record(windows: Windows) -> dict[str, Any]:
    """Where the documents sample drew its windows: the counts, then each window's piece, document, source and
    token offset into the piece (in the windows' order — the order of the per-token evidence)."""
    drawn = windows.sampled or []
    sources: dict[str, int] = {}
    for w in drawn:
        sources[w.source] = sources.get(w.source, 0) + 1
    return {
        "rule": "trainers.batches.document_windows: stratified by source, one window per document in turn",
        "pieces": windows.pieces,
        "documents": len({w.document for w in drawn}),
        "sources": sources,
        "windows_at": [
            {"piece": w.piece, "document": w.document, "source": w.source, "offset": w.offset} for w in drawn
        ],
    }


# Bytes of float32 logits (or of attention maps) one forward pass may produce; the batch shrinks to fit, down to
# one window. The per-token statistics do not depend on the batch, only the peak memory does.
LOGITS_BUDGET = 512 * 2**20
ATTENTION_BUDGET = 256 * 2**20


def rows_within(batch_size: int, floats_per_row: int, budget: int) -> int:
    """The largest batch ≤ ``batch_size`` whose ``floats_per_row`` float32 values per window fit ``budget``."""
    return max(1, min(batch_size, budget // max(1, 4 * floats_per_row)))


def output_width(model: nn.Module) -> int:
    """The number of logits per token (the vocabulary the head scores)."""
    config = model.config
    width = getattr(config, "vocab_size", None) or getattr(config.get_text_config(), "vocab_size", None)
    return int(width or 1)


def forward_rows(
    model: nn.Module, batch_size: int, window: int, attention: bool = False, copies: int = 1
) -> int:
    """Windows per forward pass for the statistics: ``batch_size``, fewer when that batch's logits (``copies``
    of them: 2 when a float reference is scored beside) or, with ``attention``, one layer's attention maps would
    exceed :data:`LOGITS_BUDGET` (:data:`ATTENTION_BUDGET`)."""
    rows = rows_within(batch_size, copies * window * output_width(model), LOGITS_BUDGET)
    if attention:
        config = model.config
        heads = getattr(config, "num_attention_heads", None) or getattr(config, "n_head", None) or 1
        rows = min(rows, rows_within(batch_size, int(heads) * window * window, ATTENTION_BUDGET))
        need = 4 * rows * int(heads) * window * window * 3  # scores, probabilities and the softmax's float32
    else:
        need = 0
    need += 4 * copies * rows * window * output_width(model) + 8 * 3 * 256 * output_width(model)
    available = available_memory()
    if available is not None and need > available:
        # what the model holds: a quantised copy keeps codes and shared weights as buffers, not parameters
        from qbench.quant.apply import model_bytes

        held = model_bytes(model)
        what = f"logits over a {output_width(model):,}-token vocabulary" + (
            ", attention maps" if attention else ""
        )
        raise UserError(
            f"one forward pass of a {window}-token window needs ~{need / 2**30:.1f} GiB ({what}), "
            f"{available / 2**30:.1f} GiB available beside the model's {held / 2**30:.1f} GiB of weights; use a "
            "smaller --window (both scale with it), or load the model with --dtype bfloat16 to free half its weights"
        )
    return rows


def available_memory() -> int | None:
    """Memory this machine can still give (Linux ``MemAvailable``; else the free physical pages; None unknown)."""
    import os

    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (AttributeError, OSError, ValueError):
        return None


def token_nll(out: Tensor, targets: Tensor, chunk: int = 1024) -> Tensor:
    """Per-token NLL (float32) of ``targets`` (B, T) under logits ``out`` (B, T, V), flat, in token order.

    Computed ``chunk`` tokens at a time so that cross-entropy's log-softmax copy is of a chunk, not of the
    batch's whole (B, T, V) logits."""
    flat = out.reshape(-1, out.size(-1))
    goal = targets.reshape(-1)
    return torch.cat(
        [
            F.cross_entropy(flat[i : i + chunk].float(), goal[i : i + chunk], reduction="none")
            for i in range(0, goal.numel(), chunk)
        ]
    )


def token_comparison(out: Tensor, ref: Tensor, chunk: int = 256) -> tuple[Tensor, Tensor]:
    """Per-token KL divergence KL(P_ref ‖ P_out) over the full vocabulary and whether the two most likely next
    tokens agree, for logits ``out`` and ``ref`` (B, T, V): flat float32 and bool, in token order.

    Exact over the vocabulary, in the form that keeps float32 accurate. With d = out − ref (float32 subtracts
    nearby values exactly) and p = softmax(ref), the log-normalisers' difference is log Σ p·e^d, so
    KL = log Σ p·e^d − Σ p·d = log1p(Σ p·expm1(d − m) / Σ p) with m = Σ p·d / Σ p: no term is the difference
    of two log-softmaxes (whose float32 rounding, ~10⁻⁶ of a logit, would swamp a 10⁻⁶ divergence), and the
    sums are normalised by Σ p so softmax's own rounding cancels. Agrees with a float64 evaluation of
    Σ p·(log p − log q) per token within 10⁻⁶·(√KL + KL) — 10⁻³ relative at KL = 10⁻⁶ — from KL ≈ 0.4 down to
    5·10⁻⁹ (tests/qbench/eval/test_evidence.py), at a third of its cost. ``chunk`` tokens at a time, so the
    float32 temporaries are of a chunk (definitions: ``qbench.eval.evidence``)."""
    flat, base = out.reshape(-1, out.size(-1)), ref.reshape(-1, ref.size(-1))
    klds, same = [], []
    for i in range(0, flat.size(0), chunk):
        o, r = flat[i : i + chunk].float(), base[i : i + chunk].float()
        p = torch.softmax(r, dim=-1)
        d = o - r
        total = p.sum(-1, keepdim=True)
        mean = (p * d).sum(-1, keepdim=True) / total
        spread = (p * torch.expm1(d - mean)).sum(-1) / total.squeeze(-1)
        klds.append(torch.log1p(spread.double()).clamp_min(0.0).float())
        same.append(o.argmax(-1) == r.argmax(-1))
    return torch.cat(klds), torch.cat(same)


@torch.no_grad()
def scoring_rows(model: nn.Module, batch_size: int, window: int, reference: object = None) -> int:
    """Windows per forward pass of :func:`perplexity` (fewer than ``batch_size`` when its logits, and a
    reference's beside them, exceed :data:`LOGITS_BUDGET`): one rule for it and for whatever must see the same
    batches (``qbench.eval.prefix`` replays stored block outputs batch by batch)."""
    return forward_rows(model, batch_size, window, copies=1 if reference is None else 2)


@torch.no_grad()  # an evaluation: without it every forward pass kept its autograd graph (SmolLM2: 4.8 vs 1.6 GB)
def perplexity(
    model: nn.Module,
    windows: Windows,
    batch_size: int = 8,
    device: str = "cpu",
    reference: nn.Module | ReferenceLogits | None = None,
    keep: ReferenceLogits | None = None,
) -> dict[str, Any]:
    """Token-level perplexity of ``model`` on ``windows``: exp(total NLL / predicted tokens).

    Each token's NLL is computed in float32 and the sum is taken in float64. Why: a float32 sum over a batch
    (~10⁴ tokens of NLL ≈ 5–9) rounds at ~10⁻⁷ relative, the size of a small quantisation effect on a tiny or
    near-random model — two different models could then report the very same perplexity (seen: a 2-bit KV
    cell equal to float to the last digit on one CPU and not on another).

    Only the scored positions count (``windows.first`` on: under the llama.cpp protocol the second half of each
    chunk), for the NLL and for the comparison with a reference alike.

    Returns ``perplexity``, ``nll`` (mean), ``tokens`` and ``per_token``: ``nll`` (windows × scored positions,
    float32);
    with a ``reference`` (the float model of a quantised copy, or the store of its logits on these windows:
    ``qbench.eval.reference``) also ``kld`` and ``top1`` (:func:`token_comparison`), batch by batch beside the
    model's. ``keep``: a store this (float) model's logits are written to as they are computed.
    """
    total_nll, total_tokens = 0.0, 0
    rows = scoring_rows(model, batch_size, windows.window, reference)
    nll, kld, top1 = [], [], []
    for start in range(0, len(windows.ids), rows):
        batch = windows.ids[start : start + rows].to(device)
        targets = windows.targets[start : start + rows].to(device)
        out = logits(model, batch)
        token = token_nll(windows.scored(out), targets)
        total_nll += token.double().sum().item()
        total_tokens += targets.numel()
        nll.append(token.cpu().view(targets.shape))
        if keep is not None:
            keep.put(start, out)  # whole windows: the store is of the inputs, whatever positions are scored
        if reference is not None:
            ref = (
                reference.batch(start, batch)
                if isinstance(reference, ReferenceLogits)
                else logits(reference, batch)
            )
            k, same = token_comparison(windows.scored(out), windows.scored(ref))
            del ref
            kld.append(k.cpu().view(targets.shape))
            top1.append(same.cpu().view(targets.shape))
        del out
    mean_nll = total_nll / total_tokens
    ppl = math.exp(mean_nll) if math.isfinite(mean_nll) and mean_nll < 700 else float("inf")
    if math.isnan(mean_nll):
        ppl = float("nan")
    per_token = {"nll": torch.cat(nll)}
    if reference is not None:
        per_token["kld"], per_token["top1"] = torch.cat(kld), torch.cat(top1).to(torch.uint8)
    return {"perplexity": ppl, "nll": mean_nll, "tokens": total_tokens, "per_token": per_token}


class _AttentionSink(list):
    """Stands in for ``Observation.attention``: feeds each layer's probabilities to the accumulator and keeps
    nothing, so the statistics never hold every layer's O(T^2) attention maps at once."""

    def __init__(self, acc: OutlierAccumulator) -> None:
        super().__init__()
        self.acc = acc

    def append(self, probs: Tensor) -> None:  # type: ignore[override]
        self.acc.add_attention([probs])

    def extend(self, many) -> None:  # type: ignore[override]
        for probs in many:
            self.append(probs)


@torch.no_grad()
def outlier_metrics(
    model: nn.Module,
    windows: Windows,
    n_windows: int = 8,
    batch_size: int = 4,
    attention: bool = True,
    device: str = "cpu",
    hidden: list[list[Tensor]] | None = None,
) -> dict[str, Any]:
    """``models.stats`` statistics of the first ``n_windows`` windows, summary plus per-layer curves.
    ``hidden``: a list that receives each batch's block outputs, so :func:`massive_activations` can read them
    instead of running the windows again (:func:`joined_hidden`)."""
    acc = OutlierAccumulator()
    ids = windows.ids[:n_windows]
    rows = forward_rows(model, batch_size, ids.size(1), attention)
    for start in range(0, len(ids), rows):
        with observe_any(model, attention=attention) as obs:
            obs.attention = _AttentionSink(acc)  # reduce each layer's (B, nh, T, T) map as it arrives
            forward_observed(model, ids[start : start + rows].to(device), obs)
        acc.add_hidden(obs.hidden)
        if hidden is not None:
            hidden.append(list(obs.hidden))
    return {**acc.summary(), "per_layer": acc.per_layer(), "windows": len(ids)}


def joined_hidden(batches: list[list[Tensor]]) -> list[Tensor]:
    """Per layer, the block outputs of every batch joined along the window axis (as one pass would give them)."""
    return [torch.cat(parts) for parts in zip(*batches, strict=True)]


# ------------------------------------------------------------------------------------- massive activations

DELIMITERS = (".", ",", "\n", "\n\n", ";", ":")


def delimiter_ids(tokenizer: Any) -> set[int]:
    """Token ids counted as delimiters: the document separator and each of :data:`DELIMITERS` that is one token."""
    ids = {separator_id(tokenizer)}
    for text in DELIMITERS:
        encoded = tokenizer.encode(text, add_special_tokens=False)
        if len(encoded) == 1:
            ids.add(int(encoded[0]))
    return ids


MASSIVE_ABS = 100.0
MASSIVE_RATIO = 1000.0


@torch.no_grad()
def massive_activations(
    model: nn.Module,
    windows: Windows,
    n_windows: int = 8,
    top_k: int = 3,
    device: str = "cpu",
    delimiter_ids: set[int] | None = None,
    hidden: list[Tensor] | None = None,
) -> dict[str, Any]:
    """Sun et al.'s massive activations in each block's output over ``n_windows`` windows (``hidden``: those
    block outputs when a pass over the same windows already recorded them, e.g. :func:`outlier_metrics`').

    Per layer: the ``top_k`` largest |activation| and the median |activation| over all tokens and channels. An
    activation is *massive* when |x| > 100 and |x| > 1000 × that layer's median. Each massive activation is
    reported with its channel and position class: ``first`` (position 0), ``delimiter`` (a token in
    ``delimiter_ids``, e.g. the separator or ".", "\\n"), or ``other``. ``channels`` lists, per layer, the
    channels that hold a massive activation anywhere — the coordinates ``qbench intervene`` edits.
    """
    ids = windows.ids[:n_windows].to(device)
    if hidden is None:
        with observe_any(model) as obs:
            forward_observed(model, ids, obs)
        hidden = obs.hidden
    layers = []
    for index, h in enumerate(hidden):  # (B, T, C)
        mag = h.float().abs()
        top = torch.topk(mag.flatten(), top_k).values.tolist()
        median = mag.median().item()
        is_massive = (mag > MASSIVE_ABS) & (mag > MASSIVE_RATIO * median)
        where = is_massive.nonzero().tolist()  # [b, t, c]
        positions = {"first": 0, "delimiter": 0, "other": 0}
        for b, t, _c in where:
            kind = (
                "first"
                if t == 0
                else "delimiter"
                if delimiter_ids and int(ids[b, t]) in delimiter_ids
                else "other"
            )
            positions[kind] += 1
        layers.append(
            {
                "layer": index,
                "top": top,
                "median": median,
                "count": len(where),
                "channels": sorted({c for _, _, c in where}),
                "positions": positions,
            }
        )
    return {
        "threshold": {"abs": MASSIVE_ABS, "ratio_to_median": MASSIVE_RATIO},
        "windows": len(ids),
        "layers": layers,
        "total": sum(layer["count"] for layer in layers),
    }


# ------------------------------------------------------------------------------------- linear-layer ranges


@torch.no_grad()
def linear_ranges(
    model: nn.Module, windows: Windows, n_windows: int = 8, device: str = "cpu"
) -> dict[str, Any]:
    """What a per-tensor int8 quantiser sees at each linear layer, over the first ``n_windows`` windows.

    Per layer (every ``nn.Linear`` / ``Conv1D``, the LM head included and marked): the input's *crest factor*
    (max |x| / RMS(x) over all windows: with one scale per sequence the int8 step is up to crest/127 RMS, so a crest in the hundreds erases
    most of the input), the SQNR in dB of an absmax int8 round trip of the input with one scale per sequence
    (as the per-tensor schemes do), the input's raw kurtosis across channels per token averaged over tokens
    (``models.stats.raw_kurtosis``: 3 for a Gaussian; a few outlier channels make it large), its max |x|
    (``input_absmax``) and the weight's crest factor (one scale for the whole matrix). The summary takes the
    worst layer among those the schemes quantise by default (all but the LM head).
    """
    from models.stats import raw_kurtosis
    from qbench.quant.apply import is_linear, linear_weight, lm_head_names

    heads = lm_head_names(model)
    sums: dict[str, dict[str, float]] = {}

    def observe(name: str):
        def hook(_module: nn.Module, args: tuple, _out: Any) -> None:
            x = args[0].detach().float()
            per_sequence = tuple(range(1, x.dim()))
            step = x.abs().amax(dim=per_sequence, keepdim=True).clamp_min(1e-12) / 127
            s = sums.setdefault(
                name, {"absmax": 0.0, "sumsq": 0.0, "noise": 0.0, "count": 0, "kurt": 0.0, "tokens": 0}
            )
            kurt = raw_kurtosis(x)  # (B, T): each token's kurtosis across the C input channels
            s["kurt"] += kurt.sum().item()
            s["tokens"] += kurt.numel()
            s["absmax"] = max(s["absmax"], x.abs().max().item())
            s["sumsq"] += x.pow(2).sum().item()
            s["noise"] += (x - torch.round(x / step) * step).pow(2).sum().item()
            s["count"] += x.numel()

        return hook

    layers = {name: module for name, module in model.named_modules() if is_linear(module)}
    handles = [module.register_forward_hook(observe(name)) for name, module in layers.items()]
    try:
        ids = windows.ids[:n_windows]
        rows = forward_rows(model, len(ids), ids.size(1))
        for start in range(0, len(ids), rows):
            logits(model, ids[start : start + rows].to(device))
    finally:
        for handle in handles:
            handle.remove()
    per_layer = {}
    for name, s in sums.items():
        weight = linear_weight(layers[name])[0]
        if weight.is_meta:  # offloaded by a device map (qbench.eval.placement): read it from where it lives
            from qbench.quant.linears import is_conv1d
            from qbench.quant.offload import offloaded_tensor

            weight = offloaded_tensor(model, f"{name}.weight")
            weight = weight.t() if is_conv1d(layers[name]) else weight
        weight = weight.float()
        rms = math.sqrt(s["sumsq"] / max(s["count"], 1))
        per_layer[name] = {
            "lm_head": name in heads,
            "input_absmax": s["absmax"],
            "input_rms": rms,
            "input_crest": s["absmax"] / rms if rms > 0 else None,
            "input_int8_sqnr_db": 10 * math.log10(s["sumsq"] / s["noise"]) if s["noise"] > 0 else None,
            "input_kurtosis": s["kurt"] / max(s["tokens"], 1),
            "weight_crest": (weight.abs().max() / weight.pow(2).mean().sqrt().clamp_min(1e-30)).item(),
        }
    body = [v for v in per_layer.values() if not v["lm_head"]]

    def worst(key: str, pick: Any) -> float | None:
        values = [v[key] for v in body if v[key] is not None]
        return pick(values) if values else None

    return {
        "windows": min(n_windows, len(windows.ids)),
        "max_input_crest": worst("input_crest", max),
        "min_input_int8_sqnr_db": worst("input_int8_sqnr_db", min),
        "max_weight_crest": worst("weight_crest", max),
        "max_input_kurtosis": worst("input_kurtosis", max),
        "per_layer": per_layer,
    }


# ------------------------------------------------------------------------------------- per-head attention sink


class _PerHeadSink(list):
    """Stands in for ``Observation.attention``: reduces each layer's (B, nh, T, T) probabilities to per-head sums
    of the first-token statistics (``models.stats``' definitions, per head instead of over all heads)."""

    def __init__(self) -> None:
        super().__init__()
        self.layer = 0
        self.hits: list[Tensor] = []  # per layer: (nh,) queries whose largest weight is on key 0 (and > 0)
        self.mass: list[Tensor] = []  # per layer: (nh,) summed weight on key 0
        self.queries: list[int] = []  # per layer: queries per head

    def append(self, probs: Tensor) -> None:  # type: ignore[override]
        rows = probs[:, :, 1:, :].detach().float()  # queries q >= 1 (query 0 sees only itself)
        key0 = rows[..., 0]
        hits = ((key0 > 0) & (key0 >= rows.amax(-1))).sum(dim=(0, 2)).double().cpu()
        mass = key0.double().sum(dim=(0, 2)).cpu()
        n = key0.size(0) * key0.size(2)
        if self.layer < len(self.hits):
            self.hits[self.layer] += hits
            self.mass[self.layer] += mass
            self.queries[self.layer] += n
        else:
            self.hits.append(hits)
            self.mass.append(mass)
            self.queries.append(n)
        self.layer += 1

    def extend(self, many) -> None:  # type: ignore[override]
        for probs in many:
            self.append(probs)


@torch.no_grad()
def attention_sink_per_head(
    model: nn.Module, windows: Windows, n_windows: int = 8, batch_size: int = 4, device: str = "cpu"
) -> dict[str, Any]:
    """The attention sink per layer and head over the first ``n_windows`` windows: ``top1_share[l][h]`` = the share
    of head h's queries q ≥ 1 whose largest weight is on key 0 (and non-zero), ``mass[l][h]`` = its mean weight on
    key 0 — ``first_token_top1_share`` and ``first_token_mass`` (``models.stats``) before averaging over heads."""
    return _sink_per_head(model, windows, n_windows, batch_size, device)[0]


def attention_sink_and_massive_sites(
    model: nn.Module,
    windows: Windows,
    tokenizer: Any,
    n_windows: int = 8,
    batch_size: int = 4,
    device: str = "cpu",
    limit: int = 8,
) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """(:func:`attention_sink_per_head`, :func:`massive_activation_sites`) from one pass over the windows."""
    per_head, hidden = _sink_per_head(model, windows, n_windows, batch_size, device, keep_hidden=True)
    ids = windows.ids[:n_windows].to(device)
    return per_head, _massive_sites(joined_hidden(hidden), ids, tokenizer, limit)


@torch.no_grad()
def _sink_per_head(
    model: nn.Module,
    windows: Windows,
    n_windows: int,
    batch_size: int,
    device: str,
    keep_hidden: bool = False,
) -> tuple[dict[str, Any], list[list[Tensor]]]:
    sink = _PerHeadSink()
    ids = windows.ids[:n_windows]
    rows = forward_rows(model, batch_size, ids.size(1), attention=True)
    hidden: list[list[Tensor]] = []
    for start in range(0, len(ids), rows):
        sink.layer = 0
        with observe_any(model, attention=True) as obs:
            obs.attention = sink
            forward_observed(model, ids[start : start + rows].to(device), obs)
        if keep_hidden:
            hidden.append(list(obs.hidden))
    return {
        "windows": len(ids),
        "top1_share": [(h / n).tolist() if n else [] for h, n in zip(sink.hits, sink.queries, strict=True)],
        "mass": [(m / n).tolist() if n else [] for m, n in zip(sink.mass, sink.queries, strict=True)],
    }, hidden


@torch.no_grad()
def massive_activation_sites(
    model: nn.Module,
    windows: Windows,
    tokenizer: Any,
    n_windows: int = 8,
    device: str = "cpu",
    limit: int = 8,
) -> list[dict[str, Any]]:
    """Where the massive activations are (Sun et al.'s criterion, :data:`MASSIVE_ABS`, :data:`MASSIVE_RATIO`): per
    layer, the channels holding one, and the ``limit`` largest sites as (window, position, channel, value, token
    text) — the "which channels, which tokens" of :func:`massive_activations`' counts."""
    ids = windows.ids[:n_windows].to(device)
    with observe_any(model) as obs:
        forward_observed(model, ids, obs)
    return _massive_sites(obs.hidden, ids, tokenizer, limit)


def _massive_sites(hidden: list[Tensor], ids: Tensor, tokenizer: Any, limit: int) -> list[dict[str, Any]]:
    out = []
    for index, h in enumerate(hidden):
        mag = h.float().abs()
        median = mag.median().item()
        is_massive = (mag > MASSIVE_ABS) & (mag > MASSIVE_RATIO * median)
        where = is_massive.nonzero().tolist()
        where.sort(key=lambda s: -mag[s[0], s[1], s[2]].item())
        sites = [
            {
                "window": b,
                "position": t,
                "channel": c,
                "value": h[b, t, c].item(),
                "token": tokenizer.decode([int(ids[b, t])]),
            }
            for b, t, c in where[:limit]
        ]
        out.append(
            {
                "layer": index,
                "median": median,
                "count": len(where),
                "channels": sorted({c for _, _, c in where}),
                "positions": sorted({t for _, t, _ in where}),
                "sites": sites,
            }
        )
    return out
