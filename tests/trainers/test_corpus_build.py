"""The corpus/tokenizer builder's parts, on synthetic inputs (offline), and the committed artefacts' provenance."""

import gzip
import io
import json

import pytest

from models.errors import UserError
from models.io import sha256_file
from models.tokenizer import TOKENIZER_DIR
from trainers import corpus_build as cb
from trainers.data import EMBEDDED_PATH


def test_normalize_text():
    raw = "\ufeffTitle  \r\n\r\n\r\n\r\nLine one\u00a0word\t\nLine two\n\n\n"
    assert cb.normalize_text(raw) == "Title\n\nLine one word\nLine two"


def test_strip_gutenberg():
    text = (
        "The Project Gutenberg EBook of X\nlicence...\n*** START OF THIS PROJECT GUTENBERG EBOOK X ***\n"
        "Body text.\n*** END OF THIS PROJECT GUTENBERG EBOOK X ***\nmore licence"
    )
    assert cb.strip_gutenberg(text).strip() == "Body text."
    assert cb.strip_gutenberg("no markers") == "no markers"


def test_html_to_text():
    assert cb.html_to_text("<strong>a:</strong> b &amp; c<br><br>d") == "a: b & c\n\nd"


def _dictd_encode(n: int) -> str:
    digits = ""
    while True:
        digits = chr(cb._DICTD_ALPHABET[n % 64]) + digits
        n //= 64
        if n == 0:
            return digits


def test_read_dictd_round_trip(tmp_path):
    entries = [
        ("00-database-info", "licence text\n"),
        ("apple", "apple\n   A fruit.\n   [1913 Webster]\n"),
        ("banana", "banana\n   See {apple}.\n"),
    ]
    blob, index = b"", []
    for word, text in entries:
        index.append(f"{word}\t{_dictd_encode(len(blob))}\t{_dictd_encode(len(text.encode()))}")
        blob += text.encode()
    index.append(f"Apple\t{_dictd_encode(len(entries[0][1]))}\t{_dictd_encode(len(entries[1][1]))}")  # alias
    (tmp_path / "d.index").write_text("\n".join(index) + "\n")
    (tmp_path / "d.dict.dz").write_bytes(gzip.compress(blob))
    got = list(cb.read_dictd(tmp_path / "d.index", tmp_path / "d.dict.dz"))
    assert [w for w, _ in got] == ["apple", "banana"]  # metadata skipped, shared entry read once
    assert [cb.clean_dict_entry(t) for _, t in got] == ["apple\nA fruit.", "banana\nSee apple."]


def test_chunk_entries_ids_and_sizes():
    entries = [(f"w{i:03d}", "x" * 100) for i in range(25)]
    docs = list(cb.chunk_entries(entries, "dict", target_chars=1000))
    assert [d.id for d in docs] == ["dict/w000", "dict/w010", "dict/w020"]
    assert "\n\n".join(d.text for d in docs) == "\n\n".join(t for _, t in entries)


def test_corpus_writer_is_deterministic_and_rejects_duplicate_ids():
    docs = [cb.Document("a/1", "a", "One", "first text"), cb.Document("a/2", "a", "Two", "second ünïcode")]
    outputs = []
    for _ in range(2):
        buf = io.BytesIO()
        writer = cb.CorpusWriter(buf, 9)
        for doc in docs:
            writer.write(doc)
        writer.gz.close()
        outputs.append(buf.getvalue())
    assert outputs[0] == outputs[1]
    lines = gzip.decompress(outputs[0]).decode().splitlines()
    assert json.loads(lines[1]) == {"id": "a/2", "source": "a", "title": "Two", "text": "second ünïcode"}
    with pytest.raises(ValueError, match="duplicate"):
        writer.write(docs[0])


def test_bytes_to_unicode_is_a_printable_bijection():
    table = cb.bytes_to_unicode()
    assert len(set(table.values())) == 256
    assert all(ch.isprintable() and not ch.isspace() for ch in table.values())
    assert table[ord("a")] == "a" and table[ord(" ")] == "Ġ"


def test_tiktoken_merges_follow_rank_order():
    ranks = {bytes([b]): b for b in range(256)}
    ranks |= {b"bc": 256, b"ab": 257, b"abc": 258}  # "abc" must come from a + bc: bc outranks ab
    vocab, merges = cb.tiktoken_to_vocab_merges(ranks)
    assert merges == [("b", "c"), ("a", "b"), ("a", "bc")]
    assert vocab["abc"] == 258 and vocab["Ġ"] == 32
    tok = cb.gpt2_tokenizer(ranks)
    assert tok.encode("abc").ids == [258]
    assert tok.encode("ab<|endoftext|>").ids == [257, 259]


def test_failed_download_command_is_a_user_error():
    with pytest.raises(UserError, match="could not download thing"):
        cb._run(["false"], "thing")


def test_committed_tokenizers_record_their_sources():
    bpe = json.loads((TOKENIZER_DIR / "bpe8192" / "provenance.json").read_text())
    assert bpe["corpus_sha256"] == sha256_file(EMBEDDED_PATH), (
        "rebuild: python -m trainers.corpus_build tokenizers"
    )
    gpt2 = json.loads((TOKENIZER_DIR / "gpt2" / "provenance.json").read_text())
    assert gpt2["file_sha256"] == cb.GPT2_RANKS_SHA256
    for name in ("bpe8192", "gpt2"):
        config = json.loads((TOKENIZER_DIR / name / "tokenizer_config.json").read_text())
        assert config["bos_token"] == config["eos_token"] == cb.EOT
