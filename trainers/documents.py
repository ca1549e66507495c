"""What both the corpora (``trainers.data``) and their builder (``trainers.corpus_build``) stand on: the cache
folder, the embedded corpus file, JSONL reading, and the rule that splits documents into train and validation.

A leaf of ``trainers`` (it imports only ``models``), so the builder and the corpora import it and not each other.
"""

from __future__ import annotations

import gzip
import hashlib
import json
import os
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any, Literal

import numpy as np

from models.errors import UserError

VALIDATION_PER_MILLE = 20  # ~2 % of documents
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


def _batches(texts: Iterable[str], max_chars: int) -> Iterator[list[str]]:
    batch: list[str] = []
    size = 0
    for text in texts:
        batch.append(text)
        size += len(text)
        if size >= max_chars:
            yield batch
            batch, size = [], 0
    if batch:
        yield batch


def _encode(backend, texts: list[str], sep: int, dtype: np.dtype) -> np.ndarray:
    encodings = backend.encode_batch_fast(texts, add_special_tokens=False)
    pieces = [np.array([sep], dtype)]
    for i, enc in enumerate(encodings):
        if i:
            pieces.append(pieces[0])
        pieces.append(np.asarray(enc.ids, dtype=dtype))
    return np.concatenate(pieces)
