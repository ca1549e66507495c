"""The committed tokenizers: GPT-2's real ids, the BPE's round trip, name resolution and fingerprints."""

import pytest

from models.errors import UserError
from models.tokenizer import (
    DEFAULT_TOKENIZER,
    TOKENIZER_DIR,
    TOKENIZERS,
    load_tokenizer,
    separator_id,
    tokenizer_fingerprint,
)

TEXTS = [
    "Hello world",
    "  leading spaces, trailing spaces  \n\n\ttabs and\r\nCRLF",
    "naïve café — 東京 🤗 ∑ x² ‰",
    "Four score and seven years ago our fathers brought forth on this continent a new nation.",
    "def f(x):\n    return x ** 2  # squares\n",
    "",
]


@pytest.fixture(scope="module")
def gpt2():
    return load_tokenizer("gpt2")


@pytest.fixture(scope="module")
def bpe():
    return load_tokenizer("bpe8192")


def test_gpt2_matches_openai_ids(gpt2):
    assert gpt2.encode("Hello world") == [15496, 995]
    # GPT-2 facts any copy of its vocabulary has: " the" 262, " and" 290, "," 11, "." 13.
    assert gpt2.encode(" the, and.") == [262, 11, 290, 13]
    assert len(gpt2) == 50257
    assert separator_id(gpt2) == 50256 == gpt2.eos_token_id == gpt2.bos_token_id
    assert gpt2.encode("a<|endoftext|>b") == [64, 50256, 65]


@pytest.mark.parametrize("name", ["gpt2", "bpe8192"])
def test_round_trip(name, gpt2, bpe):
    tok = {"gpt2": gpt2, "bpe8192": bpe}[name]
    for text in TEXTS:
        ids = tok.encode(text)
        assert tok.decode(ids) == text
        assert max(ids, default=0) < len(tok)


def test_bpe8192_vocabulary(bpe):
    assert len(bpe) == 8192
    assert bpe.convert_ids_to_tokens(0) == "<|endoftext|>"
    assert separator_id(bpe) == 0 == bpe.bos_token_id == bpe.eos_token_id
    assert bpe.encode("<|endoftext|>") == [0]
    # Trained on English prose: common words are single tokens, so text compresses well below 1 token/byte.
    text = TEXTS[3]
    assert len(bpe.encode(text)) < len(text.encode()) / 3


def test_names_aliases_paths_and_errors(gpt2):
    assert DEFAULT_TOKENIZER in TOKENIZERS
    assert load_tokenizer("r50k_base").encode("Hello world") == [15496, 995]
    assert load_tokenizer(str(TOKENIZER_DIR / "gpt2")).encode("Hello world") == [15496, 995]
    with pytest.raises(UserError, match=r"unknown tokenizer 'gtp2' \(did you mean 'gpt2'\?\)"):
        load_tokenizer("gtp2")


def test_folder_without_tokenizer_is_a_user_error(tmp_path):
    with pytest.raises(UserError, match="cannot load a tokenizer"):
        load_tokenizer(tmp_path)


def test_fingerprint_identifies_the_tokenizer(gpt2, bpe):
    assert tokenizer_fingerprint(gpt2) == tokenizer_fingerprint(load_tokenizer("gpt2"))
    assert tokenizer_fingerprint(gpt2) != tokenizer_fingerprint(bpe)
    before = tokenizer_fingerprint(bpe)
    bpe("some text to truncate", truncation=True, max_length=2)  # may leave truncation state behind
    assert tokenizer_fingerprint(bpe) == before
