"""A user's evaluation file is evaluated whole by default; registered corpora keep their split."""

from __future__ import annotations

import argparse

import numpy as np
import pytest

from models.tokenizer import separator_id
from qbench.cli.args import add_model_arguments, protocol_from_args
from qbench.eval.metrics import Protocol, make_windows, protocol_record


@pytest.fixture(scope="module")
def long_file(tmp_path_factory):
    """~190 KB of distinct paragraphs: cut into ~64 KB documents, of which the hash split keeps few or one."""
    rng = np.random.default_rng(0)
    words = ["union", "state", "people", "congress", "liberty", "law", "trade", "war", "peace", "treaty"]
    paragraphs = [" ".join(rng.choice(words, 60)) + f" ({n})." for n in range(450)]
    path = tmp_path_factory.mktemp("user") / "mine.txt"
    path.write_text("\n\n".join(paragraphs), encoding="utf-8")
    return path


def _whole_file_tokens(path, tokenizer) -> int:
    """An independent count: each ≤ 16 kB piece tokenised alone, plus one separator per piece."""
    from trainers.data import LocalCorpus

    docs = [text for _, text in LocalCorpus(path).items()]
    return sum(len(tokenizer(d, add_special_tokens=False)["input_ids"]) + 1 for d in docs)


def test_a_users_file_is_evaluated_whole_by_default(long_file, tokenizer):
    protocol = Protocol(corpus=str(long_file), tokens=10**9, window=32, sample="first")
    assert protocol.split == "all"
    windows = make_windows(tokenizer, protocol, context=32)
    total = _whole_file_tokens(long_file, tokenizer)
    assert windows.available_tokens == total > 30_000
    assert windows.scored_tokens == (total // 32) * 32  # every whole window of the file, clamped budget
    record = protocol_record(protocol, windows, tokenizer, "float32")
    assert record["split"] == "all" and record["tokens_available"] == total and record["tokens_clamped"]
    assert windows.ids[0, 0] == separator_id(tokenizer)
    # drawn across documents: every whole window each piece holds (a window never crosses a piece), each piece its
    # own document
    from trainers.data import LocalCorpus

    sampled = make_windows(tokenizer, Protocol(corpus=str(long_file), tokens=10**9, window=32), context=32)
    pieces = [text for _, text in LocalCorpus(long_file).items()]
    held = sum(len(tokenizer(d, add_special_tokens=False)["input_ids"]) // 32 for d in pieces)
    assert len(sampled.ids) == held and sampled.clamped and len(set(sampled.clusters)) == len(pieces) > 8


def test_split_is_explicit_and_tokens_still_cap(long_file, tokenizer):
    total = _whole_file_tokens(long_file, tokenizer)
    val = make_windows(tokenizer, Protocol(corpus=str(long_file), split="validation", window=32), context=32)
    train = make_windows(tokenizer, Protocol(corpus=str(long_file), split="train", window=32), context=32)
    assert 0 < val.available_tokens < total and val.available_tokens + train.available_tokens == total
    capped = make_windows(tokenizer, Protocol(corpus=str(long_file), tokens=32 * 5, window=32), context=32)
    assert capped.scored_tokens == 32 * 5 and not capped.clamped


def test_registered_corpora_keep_their_validation_split():
    assert Protocol().split == "validation" and Protocol(corpus="embedded").to_dict()["split"] == "validation"
    assert Protocol(corpus="embedded", split="all").split == "all"


def test_cli_split_option(long_file):
    parser = argparse.ArgumentParser()
    add_model_arguments(parser)
    args = parser.parse_args(["--ckpt", "x", "--data", str(long_file)])
    assert protocol_from_args(args).split == "all"
    args = parser.parse_args(["--ckpt", "x", "--data", str(long_file), "--split", "validation"])
    assert protocol_from_args(args).split == "validation"
    assert protocol_from_args(parser.parse_args(["--ckpt", "x"])).split == "validation"
    with pytest.raises(SystemExit):
        parser.parse_args(["--ckpt", "x", "--split", "test"])
