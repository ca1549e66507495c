"""Corpora, the split by document, and cached token streams (all on tmp caches; no network)."""

import itertools
import json
from pathlib import Path

import numpy as np
import pytest

from models.errors import UserError
from models.io import sha256_file
from models.tokenizer import load_tokenizer
from trainers import data
from trainers.data import (
    CORPORA,
    EMBEDDED_PATH,
    JsonlCorpus,
    get_corpus,
    load_documents,
    split_of,
    token_stream,
    validation_ids,
)

PARAGRAPH = "The quick brown fox jumps over the lazy dog, and then it rests. " * 6


@pytest.fixture(scope="module")
def bpe():
    return load_tokenizer("bpe8192")


@pytest.fixture()
def local_corpus(tmp_path):
    """A folder of 60 short .txt/.md documents plus a .jsonl file of 3 documents."""
    root = tmp_path / "texts"
    (root / "sub").mkdir(parents=True)
    for i in range(40):
        (root / f"doc{i:02d}.txt").write_text(f"Document {i}. {PARAGRAPH}")
    for i in range(20):
        (root / "sub" / f"note{i:02d}.md").write_text(f"# Note {i}\n\n{PARAGRAPH}")
    (root / "extra.jsonl").write_text("".join(json.dumps({"text": f"json doc {i}"}) + "\n" for i in range(3)))
    (root / "ignored.bin").write_bytes(b"\x00\x01")
    return root


def test_split_is_a_fixed_hash_of_the_id():
    ids = [f"doc-{i}" for i in range(20_000)]
    val = [i for i in ids if split_of(i) == "validation"]
    assert 0.015 < len(val) / len(ids) < 0.025
    assert [split_of(i) for i in ids[:500]] == [split_of(i) for i in ids[:500]]
    assert validation_ids(ids) == set(val)


def test_tiny_corpus_still_gets_one_validation_document():
    ids = ["a", "b", "c"]
    assert all(split_of(i) == "train" for i in ids)  # the hash alone would leave validation empty
    assert len(validation_ids(ids)) == 1
    assert validation_ids(["only"]) == set()


def test_embedded_corpus_matches_its_manifest():
    manifest = json.loads(EMBEDDED_PATH.with_name("embedded.manifest.json").read_text())
    assert manifest["sha256"] == sha256_file(EMBEDDED_PATH)
    assert 4e6 < EMBEDDED_PATH.stat().st_size < 10e6
    assert manifest["split"]["validation_bytes"] >= 200_000
    from trainers.corpus_build import split_summary

    assert (
        manifest["split"] == split_summary(EMBEDDED_PATH)[0]
    )  # the pieces' split, as reading the file cuts it
    assert {s["name"] for s in manifest["sources"]} >= {"sotu", "shakespeare"}


def test_embedded_validation_holds_many_documents_of_every_source():
    corpus = get_corpus("embedded")
    entries = list(corpus.split_entries("validation"))
    assert all(len(e.text) <= data.PIECE_CHARS for e in entries)
    sources = {e.source for e in entries}
    assert sources == {"sotu", "shakespeare", "factbook"}
    assert len({e.document for e in entries}) >= 16  # the whole-text split held 8
    # no piece is in both splits, and the pieces of one text may fall on either side
    train_ids = {e.id for e in corpus.split_entries("train")}
    assert not train_ids & {e.id for e in entries}
    assert any(e.document != e.id for e in entries)


def test_whole_text_corpus_keeps_the_old_split():
    whole = get_corpus("embedded-whole")
    val = list(whole.split_entries("validation"))
    assert len(val) == 8 and all(
        e.id == e.document for e in val
    )  # the 8 documents records before pieces read
    assert val[0].id == "sotu/1842-Tyler-1"


def test_embedded_split_is_disjoint_by_document():
    corpus = get_corpus("embedded")
    items = list(corpus.items())
    val = validation_ids(i for i, _ in items)
    train_texts, val_texts = list(corpus.documents("train")), list(corpus.documents("validation"))
    assert len(train_texts) + len(val_texts) == len(items)
    assert [t for i, t in items if i in val] == val_texts
    assert not set(train_texts) & set(val_texts)
    assert sum(len(t) for t in val_texts) >= 200_000
    assert list(load_documents("default", "validation")) == val_texts  # alias, same order every time


def test_local_folder_corpus(local_corpus):
    train = list(load_documents(str(local_corpus), "train"))
    val = list(load_documents(local_corpus, "validation"))
    assert len(train) + len(val) == 63  # .bin ignored
    assert val and not set(train) & set(val)
    assert "json doc 0" in train + val


def test_single_long_file_is_cut_into_documents(tmp_path):
    path = tmp_path / "book.txt"
    path.write_text("\n\n".join(f"Paragraph {i}. {PARAGRAPH}" for i in range(3000)))
    items = list(get_corpus(path).items())
    assert len(items) > 10 and all(len(t) <= data.PIECE_CHARS for _, t in items)
    assert "\n\n".join(t for _, t in items) == path.read_text()
    assert list(load_documents(path, "validation"))


def test_unknown_corpus_and_split_are_user_errors():
    with pytest.raises(UserError, match=r"unknown corpus 'embeded' \(did you mean 'embedded'\?\).*path"):
        get_corpus("embeded")
    with pytest.raises(UserError, match="unknown split 'test'"):
        list(load_documents("embedded", "test"))
    assert {"embedded", "mix", "c4"} <= set(CORPORA)


def test_c4_offline_is_a_user_error(monkeypatch):
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    with pytest.raises(UserError, match="hub"):
        next(load_documents("c4", "validation"))


def test_token_stream_layout(local_corpus, tmp_path, bpe):
    stream = token_stream(local_corpus, "train", bpe, cache_dir=tmp_path / "cache")
    docs = list(load_documents(local_corpus, "train"))
    assert stream.dtype == np.uint16
    starts = np.flatnonzero(np.asarray(stream) == 0)
    assert stream[0] == 0 and len(starts) == len(docs)  # one separator before each document
    pieces = np.split(np.asarray(stream), starts[1:])
    assert [bpe.decode(p[1:]) for p in pieces] == docs
    info = json.loads(Path(f"{stream.filename}.json").read_text())
    assert info["tokens"] == len(stream) and info["documents"] == len(docs)


def test_token_stream_cache_hit_and_keys(local_corpus, tmp_path, bpe, monkeypatch):
    cache = tmp_path / "cache"
    first = np.array(token_stream(local_corpus, "validation", bpe, cache_dir=cache))

    def fail(*args, **kwargs):
        raise AssertionError("tokenised again instead of reading the cache")

    monkeypatch.setattr(data, "write_stream", fail)
    again = token_stream(local_corpus, "validation", "bpe8192", cache_dir=cache)
    assert np.array_equal(first, again)
    monkeypatch.undo()

    gpt2 = token_stream(local_corpus, "validation", "gpt2", cache_dir=cache)
    assert gpt2.filename != again.filename and gpt2[0] == 50256
    before = token_stream(local_corpus, "train", bpe, cache_dir=cache).filename
    (local_corpus / "doc00.txt").write_text("changed")  # new content, new key
    assert token_stream(local_corpus, "train", bpe, cache_dir=cache).filename != before
    assert len(list((cache / "tokens").glob("*.bin"))) == 4
    assert not list((cache / "tokens").glob("*.tmp"))


def test_cache_dir_from_environment(monkeypatch, tmp_path):
    monkeypatch.setenv("QBENCH_CACHE", str(tmp_path / "env-cache"))
    assert data.cache_root() == tmp_path / "env-cache"
    assert data.cache_root(tmp_path / "explicit") == tmp_path / "explicit"


def test_empty_split_is_a_user_error(tmp_path, bpe):
    (tmp_path / "one.txt").write_text("a single short document")
    with pytest.raises(UserError, match="no validation documents"):
        token_stream(tmp_path / "one.txt", "validation", bpe, cache_dir=tmp_path / "cache")


def test_jsonl_corpus_fingerprint_is_the_file_hash_and_the_piece_size(tmp_path):
    path = tmp_path / "c.jsonl"
    path.write_text(json.dumps({"id": "x", "text": "hello"}) + "\n")
    assert JsonlCorpus("c", path, piece_chars=None).fingerprint() == sha256_file(path)
    assert JsonlCorpus("c", path).fingerprint() not in (
        sha256_file(path),
        JsonlCorpus("c", path, 8).fingerprint(),
    )
    assert list(JsonlCorpus("c", path).items()) == [("x", "hello")]


def test_fetch_mix_rejects_unknown_sources(tmp_path):
    with pytest.raises(UserError, match=r"unknown mix source 'devel' \(did you mean 'devil'\?\)"):
        data.fetch_mix(tmp_path, sources=["devel"])


@pytest.mark.slow
def test_fetch_mix_one_small_source(tmp_path):
    """Downloads dict-devil (~180 KB) from Debian; skipped only where apt-get is missing or no mirror answers.

    Any other failure (a parser error, a wrong manifest, a package that moved) fails the test.
    """
    import shutil

    if shutil.which("apt-get") is None or shutil.which("dpkg-deb") is None:
        pytest.skip("apt-get/dpkg-deb not installed")
    try:
        path = data.fetch_mix(tmp_path, sources=["devil"])
    except UserError as e:
        unreachable = ("Temporary failure resolving", "Could not resolve", "Failed to fetch", "Network is")
        if any(s in str(e) for s in unreachable):
            pytest.skip(f"no Debian mirror reachable here: {e}")
        raise
    manifest = json.loads((path.parent / "manifest.json").read_text())
    assert manifest["sha256"] == sha256_file(path)
    (source,) = manifest["sources"]
    assert source["package"] == "dict-devil" and source["version"] and source["documents"] >= 3
    texts = [t for _, t in JsonlCorpus("devil", path).items()]
    assert any("CYNIC, n." in t for t in texts)
    assert data.fetch_mix(tmp_path, sources=["devil"]) == path  # built once


def test_pieces_cut_at_blank_lines_then_lines_then_anywhere():
    from trainers.documents import pieces

    text = "\n\n".join(f"para {i} " + "x" * 90 for i in range(50))  # ~100-character paragraphs
    cut = pieces(text, 1000)
    assert all(len(p) <= 1000 for p in cut) and "\n\n".join(cut) == text
    assert all(len(p) > 800 for p in cut[:-1])  # the last blank line before the limit, not the first
    lines = "\n".join("y" * 50 for _ in range(100))  # no blank line: cut at a line break
    assert all(len(p) <= 1000 for p in pieces(lines, 1000)) and "\n".join(pieces(lines, 1000)) == lines
    solid = "z" * 2500  # no break at all: cut at the limit
    assert pieces(solid, 1000) == ["z" * 1000, "z" * 1000, "z" * 500]
    assert pieces("short", 1000) == ["short"] and pieces("  \n ", 1000) == []
    assert pieces(solid, None) == [solid]


def test_stream_index_locates_every_piece(local_corpus, tmp_path, bpe):
    stream = token_stream(local_corpus, "all", bpe, cache_dir=tmp_path / "cache")
    index = data.stream_index(stream, 0)
    entries = list(get_corpus(local_corpus).split_entries("all"))
    assert list(index.ids) == [e.id for e in entries]
    for i, entry in enumerate(entries):
        start, length = int(index.starts[i]), int(index.lengths[i])
        assert stream[start - 1] == 0  # the separator before each piece
        assert bpe.decode(np.asarray(stream[start : start + length]).tolist()) == entry.text
    # a stream with no index on disk (a prepared folder's shard): found from its separators, the same places
    found = data.stream_index(np.asarray(stream), 0)
    assert np.array_equal(found.starts, index.starts) and np.array_equal(found.lengths, index.lengths)
    assert index.sources[0] == "doc00.txt" and index.documents[0] == index.ids[0]


def _index(lengths, sources, documents=None):
    from trainers.documents import DocumentIndex

    lengths = np.asarray(lengths, dtype=np.int64)
    starts = np.cumsum(np.concatenate([[1], lengths[:-1] + 1]))
    ids = tuple(f"p{i}" for i in range(len(lengths)))
    return DocumentIndex(ids, tuple(documents or ids), tuple(sources), starts, lengths)


def test_document_windows_spread_across_documents_and_sources():
    from trainers.batches import document_windows

    sources = ["a"] * 12 + ["b"] * 6 + ["c"] * 2
    index = _index([1000] * 12 + [700] * 6 + [300] * 2, sources)
    drawn = document_windows(index, 256, 16, seed=0)
    assert len(drawn) == 16 and len({w.document for w in drawn}) == 16  # one per document while they last
    counts = {s: sum(w.source == s for w in drawn) for s in "abc"}
    assert counts["c"] >= 1 and counts["a"] > counts["b"] > 0  # every source, roughly by its tokens
    assert {w.source for w in drawn[:3]} == {"a", "b", "c"}  # draw order: round-robin over the sources
    for w in drawn:  # inside its piece, at its stream position
        i = index.ids.index(w.piece)
        assert 0 <= w.offset <= index.lengths[i] - 256 and w.start == index.starts[i] + w.offset
    assert document_windows(index, 256, 16, seed=0) == drawn  # seeded
    assert document_windows(index, 256, 16, seed=1) != drawn


def test_document_windows_never_overlap_and_clamp_to_what_the_text_holds():
    from trainers.batches import document_windows

    index = _index([1000, 520, 100], ["a", "a", "b"], ["d0", "d0", "d1"])
    drawn = document_windows(index, 256, 50, seed=3)
    assert len(drawn) == 3 + 2  # ⌊1000/256⌋ + ⌊520/256⌋ slots; the 100-token piece holds none
    starts = sorted(w.start for w in drawn)
    assert all(b - a >= 256 for a, b in itertools.pairwise(starts))
    assert {w.document for w in drawn} == {"d0"}
    assert document_windows(index, 2048, 4, seed=0) == []
