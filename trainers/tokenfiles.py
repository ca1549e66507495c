"""Token files for paper-length runs: C4 training shards tokenised into memory-mapped files with a manifest.

The paper's GPT2-130M ablations see ~5 B C4 tokens; one C4 training shard holds ~0.15 B GPT-2 tokens, so the
`c4` corpus of ``trainers.data`` (one shard) would be looped over ~35 times. ``qbench data prepare c4 --tokens N``
(:func:`prepare`) tokenises as many training shards as N needs, in shard order, into a folder::

    manifest.json                                  format, tokenizer + fingerprint, dtype, shards (name, source
                                                   sha256, tokens, documents, bytes, sha256 of the .bin), totals
    train/c4-train.00000-of-01024.bin (+ .json)    one flat uint16/uint32 file per shard: every document
    ...                                            preceded by the separator id, as ``trainers.data`` streams are
    validation/c4-validation.00000-of-00008.bin    the first 10 000 documents of C4's first validation shard
                                                   (the `c4` corpus's validation split, so perplexities agree)

Each shard is written atomically with its own ``.json`` (so an interrupted prepare loses at most the shards in
flight and a re-run skips the finished ones) by a pool of worker processes (``workers``), each downloading and
tokenising one shard at a time. The manifest is written when the shards are done and lists the smallest prefix
of shards, in order, that holds N tokens; a folder prepared for more serves a smaller N unchanged.

Training order (:class:`TokenFileSampler`): each shard is cut into non-overlapping windows of ``span`` tokens
(a shard's last < span tokens are dropped; windows never cross shards). The W windows of all shards, in a
permutation drawn by PCG64(SeedSequence([seed, epoch])), form one epoch; step s's global batch is positions
(s−1)·B … s·B−1 of the concatenated epochs. So no token is seen twice before every window was seen once, the
order is a function of (seed, step) only (a restart resumes exactly), and the global batch does not depend on
the number of processes: rank r takes its contiguous rows of it (``trainers.batches.shard_rows``), as with
the random-offset sampler.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import sys
import time
from collections.abc import Iterator
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass, field
from multiprocessing import get_all_start_methods, get_context
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import Tensor

from models.errors import UserError, unknown_choice
from models.io import atomic_output, atomic_write_json, sha256_file
from trainers.batches import cut_windows, window_span

FORMAT = 1
KIND = "qbench-tokenfiles"
MANIFEST = "manifest.json"
C4_REPO = "allenai/c4"
C4_TRAIN_SHARDS = 1024
C4_VALIDATION = "en/c4-validation.00000-of-00008.json.gz"
C4_VALIDATION_DOCS = 10_000  # as the `c4` corpus of trainers.data
SOURCES = ("c4",)


def c4_train_shard(index: int) -> str:
    """allenai/c4's file name of training shard ``index`` (0-based): ``en/c4-train.0000X-of-01024.json.gz``."""
    return f"en/c4-train.{index:05d}-of-{C4_TRAIN_SHARDS:05d}.json.gz"


def default_folder(source: str, tokenizer: str, cache_dir: str | os.PathLike | None = None) -> Path:
    from trainers.documents import cache_root

    return cache_root(cache_dir) / "tokenfiles" / f"{source}-{tokenizer}"


# ------------------------------------------------------------------------------------------------------------
# Where shards come from


@dataclass(frozen=True)
class ShardSource:
    """The hub (``local`` None: ``huggingface_hub.hf_hub_download`` of allenai/c4) or a local folder holding
    the same relative file names (a mirror, or tests' small files in C4's ``json.gz`` format)."""

    local: str | None = None
    repo: str = C4_REPO

    def fetch(self, filename: str) -> Path:
        if self.local is not None:
            path = Path(self.local) / filename
            if not path.is_file():
                raise UserError(f"{path} not found: the local C4 mirror has no {filename}")
            return path
        return _hub_download(self.repo, filename)

    def describe(self) -> str:
        return f"local:{Path(self.local).resolve()}" if self.local is not None else f"hub:{self.repo}"


def _check_hub(what: str = f"{C4_REPO}'s files") -> str:
    from trainers.documents import _hub_offline

    need = f"`qbench data prepare c4` downloads {what} from the Hugging Face hub"
    if _hub_offline():
        raise UserError(
            f"{need}, but offline mode is set (HF_HUB_OFFLINE/HF_DATASETS_OFFLINE); use --from DIR"
        )
    return need


def _hub_download(repo: str, filename: str) -> Path:
    need = _check_hub(f"{repo}/{filename}")
    try:
        from huggingface_hub import hf_hub_download

        return Path(hf_hub_download(repo_id=repo, filename=filename, repo_type="dataset"))
    except ImportError as e:
        raise UserError(f"{need} with `huggingface_hub`, which is not installed ({e})") from None
    except Exception as e:  # connection, auth or hub errors: the hub is not usable from here
        raise UserError(f"{need}, which is not reachable ({type(e).__name__}: {str(e)[:160]})") from None


# ------------------------------------------------------------------------------------------------------------
# Tokenising one shard (runs in a worker process)


def _documents(path: Path, max_docs: int | None) -> Iterator[str]:
    from trainers.documents import read_jsonl

    for n, row in enumerate(read_jsonl(path)):
        if max_docs is not None and n >= max_docs:
            return
        yield row["text"]


def shard_output(folder: Path, split: str, filename: str) -> Path:
    return folder / split / (Path(filename).name.removesuffix(".json.gz") + ".bin")


@dataclass(frozen=True)
class TokenizerSpec:
    """What a worker needs to tokenise: the tokenizer.json text, the separator id, the dtype, the fingerprint.
    Resolved once in the parent, so workers never import transformers."""

    name: str
    json: str
    separator: int
    dtype: str
    fingerprint: str

    @classmethod
    def load(cls, name: str) -> TokenizerSpec:
        from models.tokenizer import load_tokenizer, separator_id, tokenizer_fingerprint
        from trainers.documents import stream_dtype

        tok = load_tokenizer(name)
        return cls(
            name,
            tok.backend_tokenizer.to_str(),
            separator_id(tok),
            stream_dtype(tok).name,
            tokenizer_fingerprint(tok),
        )


def tokenize_shard(
    source: ShardSource, filename: str, spec: TokenizerSpec, out: Path, max_docs: int | None = None
) -> dict[str, Any]:
    """Fetch ``filename``, tokenise its documents into ``out`` (atomically, ``out.json`` first); return the meta."""
    from tokenizers import Tokenizer

    from trainers.documents import BATCH_CHARS, _batches, _encode

    src = source.fetch(filename)
    backend = Tokenizer.from_str(spec.json)
    backend.no_padding()
    backend.no_truncation()
    sep, dtype = spec.separator, np.dtype(spec.dtype)
    counts = {"tokens": 0, "documents": 0, "bytes": 0}
    digest, start = hashlib.sha256(), time.perf_counter()
    with atomic_output(out) as f:
        for texts in _batches(_documents(src, max_docs), BATCH_CHARS):
            data = _encode(backend, texts, sep, dtype).tobytes()
            f.write(data)
            digest.update(data)
            counts["tokens"] += len(data) // dtype.itemsize
            counts["documents"] += len(texts)
            counts["bytes"] += sum(len(t.encode("utf-8")) for t in texts)
        if counts["documents"] == 0:
            raise UserError(f"{filename} has no documents")
        meta = {
            "shard": filename,
            "source_sha256": sha256_file(src),
            **counts,
            "sha256": digest.hexdigest(),
            "dtype": dtype.name,
            "tokenizer_fingerprint": spec.fingerprint,
            "seconds": round(time.perf_counter() - start, 3),
        }
        atomic_write_json(Path(f"{out}.json"), meta)  # before the .bin appears: a .bin always has its .json
    return meta


def finished_shard(out: Path, fingerprint: str) -> dict[str, Any] | None:
    """The meta of a shard already tokenised with this tokenizer (size checked; sha256 by :func:`verify`)."""
    try:
        meta = json.loads(Path(f"{out}.json").read_text())
        size = out.stat().st_size
    except (OSError, ValueError):
        return None
    if meta.get("tokenizer_fingerprint") != fingerprint:
        return None
    return meta if size == meta["tokens"] * np.dtype(meta["dtype"]).itemsize else None


# ------------------------------------------------------------------------------------------------------------
# Preparing a folder


@dataclass
class PrepareResult:
    folder: Path
    manifest: dict[str, Any]
    tokenized: list[str] = field(default_factory=list)  # shards tokenised by this call (the rest were reused)


def prepare(
    source: str,
    tokens: int,
    out: str | os.PathLike | None = None,
    *,
    tokenizer: str = "gpt2",
    workers: int = 1,
    local: str | os.PathLike | None = None,
    max_shards: int = C4_TRAIN_SHARDS,
    cache_dir: str | os.PathLike | None = None,
    log=None,
) -> PrepareResult:
    """Tokenise C4 training shards in order until they hold ≥ ``tokens`` tokens (+ the validation slice)."""
    if source not in SOURCES:
        raise unknown_choice("token-file source", source, SOURCES)
    if tokens < 1 or workers < 1:
        raise UserError(f"--tokens and --workers must be positive, got {tokens} and {workers}")
    src = ShardSource(str(local) if local is not None else None)
    if local is None:
        _check_hub()  # before anything slow: offline, this is the whole answer
    spec = TokenizerSpec.load(tokenizer)
    fingerprint = spec.fingerprint
    folder = Path(out) if out is not None else default_folder(source, tokenizer, cache_dir)
    say = log or (lambda msg: print(msg, file=sys.stderr, flush=True))
    result = PrepareResult(folder, {})
    val_out = shard_output(folder, "validation", C4_VALIDATION)
    with _pool(workers) as pool:
        pending_val = None
        if finished_shard(val_out, fingerprint) is None:
            pending_val = pool.submit(tokenize_shard, src, C4_VALIDATION, spec, val_out, C4_VALIDATION_DOCS)
        done = _train_shards(pool, src, folder, spec, tokens, workers, max_shards, say, result)
        if pending_val is not None:
            pending_val.result()
            result.tokenized.append(C4_VALIDATION)
    val = finished_shard(val_out, fingerprint)
    result.manifest = write_manifest(folder, source, src, tokenizer, fingerprint, done, val, tokens)
    return result


class _InProcess:
    """``ProcessPoolExecutor``'s submit/result for workers=1: no process start, easier tracebacks."""

    def submit(self, fn, *args):
        value = fn(*args)
        return type("Done", (), {"result": lambda self: value})()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def _pool(workers: int):
    """Worker processes: forked where the platform can (workers only run the tokenizers library, never torch,
    so forking a parent that loaded torch is safe, and saves each worker re-importing it), else spawned."""
    if workers == 1:
        return _InProcess()
    method = "fork" if "fork" in get_all_start_methods() else "spawn"
    return ProcessPoolExecutor(max_workers=workers, mp_context=get_context(method))


def _train_shards(pool, src, folder, spec, tokens, workers, max_shards, say, result):
    """Finished shard metas, a prefix in shard order holding ≥ ``tokens`` tokens; tokenises what is missing."""
    done: list[dict[str, Any]] = []
    index = 0
    while sum(m["tokens"] for m in done) < tokens:
        have = sum(m["tokens"] for m in done)
        per_shard = have / len(done) if done else None
        want = workers if per_shard is None else max(1, math.ceil((tokens - have) / per_shard))
        wave = list(range(index, min(index + want, max_shards)))
        if not wave:
            raise UserError(
                f"{max_shards} C4 training shards hold {have:,} tokens, fewer than the {tokens:,} asked for"
            )
        futures = {}
        for i in wave:
            name, out = c4_train_shard(i), shard_output(folder, "train", c4_train_shard(i))
            meta = finished_shard(out, spec.fingerprint)
            futures[i] = meta if meta is not None else pool.submit(tokenize_shard, src, name, spec, out)
        for i in wave:
            meta = futures[i] if isinstance(futures[i], dict) else futures[i].result()
            if not isinstance(futures[i], dict):
                result.tokenized.append(meta["shard"])
                say(f"tokenised {meta['shard']}: {meta['tokens']:,} tokens in {meta['seconds']:.0f} s")
            done.append(meta)
        index = wave[-1] + 1
    # The smallest prefix that holds `tokens`: a folder prepared for more serves a smaller request unchanged.
    total, prefix = 0, []
    for meta in done:
        if total >= tokens:
            break
        prefix.append(meta)
        total += meta["tokens"]
    return prefix


def write_manifest(folder, source, src, tokenizer, fingerprint, shards, validation, requested) -> dict:
    manifest = {
        "kind": KIND,
        "format": FORMAT,
        "source": source,
        "origin": src.describe(),
        "tokenizer": tokenizer,
        "tokenizer_fingerprint": fingerprint,
        "dtype": shards[0]["dtype"],
        "tokens_requested": requested,
        "train": {
            "tokens": sum(m["tokens"] for m in shards),
            "documents": sum(m["documents"] for m in shards),
            "shards": [
                {**m, "file": f"train/{shard_output(folder, 'train', m['shard']).name}"} for m in shards
            ],
        },
        "validation": {
            **validation,
            "file": f"validation/{shard_output(folder, 'validation', validation['shard']).name}",
        },
    }
    atomic_write_json(folder / MANIFEST, manifest)
    return manifest


# ------------------------------------------------------------------------------------------------------------
# Reading


def is_tokenfiles(path: str | os.PathLike) -> bool:
    """Whether ``path`` is a prepared token-file folder (or its manifest.json)."""
    p = Path(path)
    manifest = p if p.name == MANIFEST else p / MANIFEST
    try:
        return json.loads(manifest.read_text()).get("kind") == KIND
    except (OSError, ValueError, AttributeError):
        return False


@dataclass(frozen=True)
class TokenFiles:
    """A prepared folder: the manifest and read-only memory maps of its shards."""

    folder: Path
    manifest: dict[str, Any]

    @classmethod
    def open(cls, path: str | os.PathLike) -> TokenFiles:
        p = Path(path)
        folder = p.parent if p.name == MANIFEST else p
        if not is_tokenfiles(folder):
            raise UserError(f"{folder} is not a token-file folder (no {MANIFEST}); run `qbench data prepare`")
        manifest = json.loads((folder / MANIFEST).read_text())
        if manifest["format"] != FORMAT:
            raise UserError(
                f"{folder} has token-file format {manifest['format']}, this qbench reads {FORMAT}"
            )
        return cls(folder, manifest)

    def _map(self, meta: dict[str, Any]) -> np.memmap:
        path = self.folder / meta["file"]
        arr = np.memmap(path, dtype=np.dtype(meta["dtype"]), mode="r")
        if len(arr) != meta["tokens"]:
            raise UserError(
                f"{path} holds {len(arr)} tokens, the manifest says {meta['tokens']}: re-run prepare"
            )
        return arr

    def train(self) -> list[np.memmap]:
        return [self._map(m) for m in self.manifest["train"]["shards"]]

    def validation(self) -> np.memmap:
        return self._map(self.manifest["validation"])

    def stream(self, split: str, tok) -> np.memmap:
        """What ``trainers.data.token_stream`` returns for this folder (so evaluation can name it as a corpus):
        ``validation`` — and ``all``, evaluation's default for a named path — the held-out validation slice;
        ``train`` the first training shard (e.g. SmoothQuant's calibration windows)."""
        from models.tokenizer import tokenizer_fingerprint

        self.check_tokenizer(tokenizer_fingerprint(tok), str(tok.name_or_path))
        return self.train()[0] if split == "train" else self.validation()

    def fingerprint(self) -> str:
        """sha256 over the shards' own sha256 sums, in order: equal fingerprints, equal training data."""
        sums = [m["sha256"] for m in self.manifest["train"]["shards"]] + [
            self.manifest["validation"]["sha256"]
        ]
        return hashlib.sha256("|".join(sums).encode()).hexdigest()

    def check_tokenizer(self, fingerprint: str, name: str) -> None:
        if self.manifest["tokenizer_fingerprint"] != fingerprint:
            raise UserError(
                f"{self.folder} was tokenised with {self.manifest['tokenizer']!r}, not the model's tokenizer "
                f"{name!r}: prepare it with --tokenizer {name}"
            )

    def verify(self) -> list[str]:
        """The files whose sha256 differs from the manifest's (empty: all intact)."""
        metas = [*self.manifest["train"]["shards"], self.manifest["validation"]]
        return [m["file"] for m in metas if sha256_file(self.folder / m["file"]) != m["sha256"]]

    def summary(self) -> dict[str, Any]:
        m = self.manifest
        return {
            "token_files": str(self.folder),
            "fingerprint": self.fingerprint(),
            "shards": len(m["train"]["shards"]),
            "train_tokens": m["train"]["tokens"],
            "validation_tokens": m["validation"]["tokens"],
            "tokenizer_fingerprint": m["tokenizer_fingerprint"],
        }


class TokenFileSampler:
    """Training windows from token files without repetition within an epoch; same interface as
    ``trainers.batches.WindowSampler`` (``batch(step, batch_size, rows)``). See the module docstring."""

    def __init__(self, shards: list[np.ndarray], context: int, seed: int, bos_id: int | None = None) -> None:
        self.shards, self.context, self.seed, self.bos_id = shards, context, seed, bos_id
        self.span = window_span(context, bos_id is not None)
        counts = np.array([len(s) // self.span for s in shards], dtype=np.int64)
        self.windows = int(counts.sum())
        if self.windows == 0:
            raise UserError(f"the token files hold no window of {self.span} tokens; use a shorter --context")
        self._starts = np.concatenate([[0], np.cumsum(counts)])  # first global window index of each shard
        self._order: dict[int, np.ndarray] = {}

    def order(self, epoch: int) -> np.ndarray:
        """Epoch ``epoch``'s permutation of the global window indices (cached: the last two epochs)."""
        if epoch not in self._order:
            rng = np.random.Generator(np.random.PCG64(np.random.SeedSequence([self.seed, epoch])))
            self._order = {e: o for e, o in self._order.items() if e == epoch - 1}
            self._order[epoch] = rng.permutation(self.windows)
        return self._order[epoch]

    def window_ids(self, step: int, batch_size: int) -> np.ndarray:
        """Global window indices of step ``step``'s (1-based) global batch: positions (step−1)·B … step·B−1."""
        positions = np.arange((step - 1) * batch_size, step * batch_size, dtype=np.int64)
        epochs, within = np.divmod(positions, self.windows)
        return np.array([self.order(int(e))[w] for e, w in zip(epochs, within)], dtype=np.int64)

    def locate(self, window: int) -> tuple[int, int]:
        """(shard index, token offset) of global window ``window``."""
        shard = int(np.searchsorted(self._starts, window, side="right")) - 1
        return shard, int(window - self._starts[shard]) * self.span

    def batch(self, step: int, batch_size: int, rows: slice = slice(None)) -> tuple[Tensor, Tensor]:
        """``(x, y)`` for ``rows`` of the global batch of ``step``."""
        xs, ys = [], []
        for w in self.window_ids(step, batch_size)[rows]:
            shard, offset = self.locate(int(w))
            x, y = cut_windows(self.shards[shard], np.array([offset]), self.context, self.bos_id)
            xs.append(x)
            ys.append(y)
        return torch.cat(xs), torch.cat(ys)

    def epochs(self, steps: int, batch_size: int) -> float:
        """How many passes over the windows ``steps`` steps make (> 1: some windows repeat)."""
        return steps * batch_size / self.windows
