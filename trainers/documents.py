"""What both the corpora (``trainers.data``) and their builder (``trainers.corpus_build``) stand on: the cache
folder, the embedded corpus file, JSONL reading, the pieces long texts are cut into, the rule that splits pieces
into train and validation, and the index of where each piece sits in a token stream.

**Pieces.** A corpus text longer than :data:`PIECE_CHARS` (16,384 characters) is cut into pieces of at most that
many characters, at the last blank line before the limit (else the last line break, else exactly at the limit):
:func:`pieces`. The split is drawn per piece (:func:`split_of` of the piece's id), so a long play or speech
contributes pieces to both splits but train and validation never share a piece. Why: with whole texts the
embedded corpus's 2 % validation split held 8 documents (one of them a 174 kB play), and an evaluation of a few
thousand tokens read one speech; with pieces it holds ~30 pieces of ~30 different texts from all three sources, so
evaluation windows can be drawn across documents (``trainers.batches.document_windows``). A piece keeps the id of
the text it was cut from as its ``document``: pieces of one text share their topic and style, and the intervals
treat them as one cluster (``qbench.eval.evidence.cluster_interval``).

A leaf of ``trainers`` (it imports only ``models``), so the builder and the corpora import it and not each other.
"""

from __future__ import annotations

import gzip
import hashlib
import json
import os
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal, NamedTuple

import numpy as np

from models.errors import UserError

VALIDATION_PER_MILLE = 20  # ~2 % of documents
PIECE_CHARS = 16384  # the longest piece of a corpus text (characters); see the module docstring
EMBEDDED_PATH = Path(__file__).resolve().parent / "corpus" / "embedded.jsonl.gz"


def cache_root(cache_dir: str | os.PathLike | None = None) -> Path:
    """``cache_dir``, else ``$QBENCH_CACHE``, else ``~/.cache/qbench``."""
    return Path(cache_dir or os.environ.get("QBENCH_CACHE") or Path.home() / ".cache" / "qbench").expanduser()


def split_of(doc_id: str) -> Literal["train", "validation"]:
    """'validation' iff int(sha256(id)[:8 bytes], big-endian) % 1000 < 20, else 'train'."""
    bucket = int.from_bytes(hashlib.sha256(doc_id.encode("utf-8")).digest()[:8], "big") % 1000
    return "validation" if bucket < VALIDATION_PER_MILLE else "train"


def validation_ids(ids: Iterable[str]) -> set[str]:
    """The ids of the validation documents: :func:`split_of`, except that a corpus of two or more documents
    where no id hashes into validation (small local corpora) gives up the one with the smallest hash."""
    ids = list(ids)
    chosen = {i for i in ids if split_of(i) == "validation"}
    if not chosen and len(ids) >= 2:
        chosen = {min(ids, key=lambda i: hashlib.sha256(i.encode("utf-8")).digest())}
    return chosen


class Entry(NamedTuple):
    """One piece of a corpus: its ``id`` (what the split hashes), the ``document`` it was cut from (the id of the
    whole text: the cluster of the intervals), its ``source`` (what the window sampler stratifies by) and text."""

    id: str
    document: str
    source: str
    text: str


def pieces(text: str, limit: int | None = PIECE_CHARS) -> list[str]:
    """``text`` cut into pieces of at most ``limit`` characters: at the last blank line before the limit, else the
    last line break, else at the limit; the break itself is dropped, whitespace-only pieces too. ``None``: whole.
    Where every cut is at a blank line, ``"\\n\\n".join(pieces(text)) == text``."""
    if limit is None or len(text) <= limit:
        return [text] if text.strip() else []
    out, start = [], 0
    while len(text) - start > limit:
        end = start + limit
        cut = text.rfind("\n\n", start + 1, end)
        step = 2
        if cut < 0:
            cut, step = text.rfind("\n", start + 1, end), 1
        if cut < 0:
            cut, step = end, 0
        if text[start:cut].strip():
            out.append(text[start:cut])
        start = cut + step
    if text[start:].strip():
        out.append(text[start:])
    return out


def cut_entries(doc_id: str, source: str, text: str, limit: int | None = PIECE_CHARS) -> Iterator[Entry]:
    """The pieces of one text as entries: the first keeps the text's id (a text that fits in one piece is what it
    was, on the same side of the split), the k-th (k ≥ 1) is ``<id>#k``."""
    for k, piece in enumerate(pieces(text, limit)):
        yield Entry(doc_id if k == 0 else f"{doc_id}#{k}", doc_id, source, piece)


def read_jsonl(path: Path) -> Iterator[dict]:
    """JSON objects, one per non-empty line, of a ``.jsonl`` or ``.jsonl.gz`` file."""
    opener = gzip.open if path.name.endswith(".gz") else open
    with opener(path, "rt", encoding="utf-8") as f:
        n = 0
        try:
            for n, line in enumerate(f, 1):
                if line.strip():
                    try:
                        doc = json.loads(line)
                    except json.JSONDecodeError as e:
                        raise UserError(f"{path}:{n} is not a JSON object: {e}") from None
                    if not isinstance(doc, dict):
                        raise UserError(
                            f"{path}:{n} is {type(doc).__name__}, not a JSON object with a 'text'"
                        )
                    yield doc
        except UnicodeDecodeError as e:
            raise UserError(
                f"{path}: line {n + 1} is not UTF-8 text (byte {e.start} of the read block); convert the file"
            ) from None


# ------------------------------------------------------------------------------------------------------------
# Encoding documents into token arrays (trainers.data's cached streams and trainers.tokenfiles' shards)

BATCH_CHARS = 1 << 20  # text per encode_batch call: big enough to keep the Rust threads busy


def _hub_offline() -> bool:
    return any(
        os.environ.get(v, "").lower() in ("1", "true", "yes", "on")
        for v in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE", "TRANSFORMERS_OFFLINE")
    )


def stream_dtype(tok: Any) -> np.dtype:
    """uint16 when every id fits in 16 bits, else uint32."""
    return np.dtype(np.uint16 if len(tok) <= 1 << 16 else np.uint32)


def _batches(items: Iterable[Any], max_chars: int, text: Callable[[Any], str] = str) -> Iterator[list[Any]]:
    """``items`` in lists holding about ``max_chars`` characters of ``text(item)`` each (texts, or entries)."""
    batch: list[Any] = []
    size = 0
    for item in items:
        batch.append(item)
        size += len(text(item))
        if size >= max_chars:
            yield batch
            batch, size = [], 0
    if batch:
        yield batch


def _encode(backend, texts: list[str], sep: int, dtype: np.dtype) -> np.ndarray:
    return encode_lengths(backend, texts, sep, dtype)[0]


def encode_lengths(backend, texts: list[str], sep: int, dtype: np.dtype) -> tuple[np.ndarray, list[int]]:
    """The texts as one array, each preceded by ``sep``, and each text's token count."""
    encodings = backend.encode_batch_fast(texts, add_special_tokens=False)
    parts = [np.array([sep], dtype)]
    lengths = []
    for i, enc in enumerate(encodings):
        if i:
            parts.append(parts[0])
        parts.append(np.asarray(enc.ids, dtype=dtype))
        lengths.append(len(enc.ids))
    return np.concatenate(parts), lengths


# ------------------------------------------------------------------------------------------------------------
# Where each piece sits in a token stream (trainers.data writes it beside the stream; evaluation samples from it)

INDEX_FORMAT = 1


@dataclass(frozen=True)
class DocumentIndex:
    """The pieces of a token stream, in stream order: piece ``i`` is ``stream[starts[i] : starts[i] + lengths[i]]``
    (its text tokens, after the separator that precedes it), cut from ``documents[i]`` of ``sources[i]``."""

    ids: tuple[str, ...]
    documents: tuple[str, ...]
    sources: tuple[str, ...]
    starts: np.ndarray  # int64
    lengths: np.ndarray  # int64

    def __len__(self) -> int:
        return len(self.ids)

    def to_json(self) -> dict[str, Any]:
        return {
            "format": INDEX_FORMAT,
            "ids": list(self.ids),
            "documents": list(self.documents),
            "sources": list(self.sources),
            "starts": self.starts.tolist(),
            "lengths": self.lengths.tolist(),
        }

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> DocumentIndex:
        return cls(
            tuple(data["ids"]),
            tuple(data["documents"]),
            tuple(data["sources"]),
            np.asarray(data["starts"], dtype=np.int64),
            np.asarray(data["lengths"], dtype=np.int64),
        )

    @classmethod
    def from_separators(cls, stream: np.ndarray, sep: int, name: str) -> DocumentIndex:
        """The index of a stream that has none on disk (a ``qbench data prepare`` folder): a piece between each
        two separators, each its own document, all of one source ``name``; ids ``<name>@<token offset>``."""
        where = np.flatnonzero(np.asarray(stream) == sep).astype(np.int64)
        starts = where + 1
        ends = np.append(where[1:], len(stream)).astype(np.int64)
        keep = ends > starts
        starts, lengths = starts[keep], (ends - starts)[keep]
        ids = tuple(f"{name}@{int(s)}" for s in starts)
        return cls(ids, ids, (name,) * len(ids), starts, lengths)


def index_path(stream_path: str | os.PathLike) -> Path:
    """``<stream>.docs.json``: the :class:`DocumentIndex` of the token stream at ``stream_path``."""
    return Path(f"{stream_path}.docs.json")
