"""Token files (``qbench data prepare c4``) offline: small local files in C4's json.gz layout stand in for the hub."""

from __future__ import annotations

import gzip
import json
from pathlib import Path

import numpy as np
import pytest
import torch

from models.errors import UserError
from models.io import sha256_file
from models.tokenizer import load_tokenizer, separator_id
from trainers.batches import shard_rows
from trainers.loop import train
from trainers.tokenfiles import (
    C4_VALIDATION,
    TokenFiles,
    TokenFileSampler,
    c4_train_shard,
    is_tokenfiles,
    prepare,
    shard_output,
)

from .helpers import EMBEDDED, micro_cfg, read_metrics
from .test_resume import assert_bit_identical

SHARDS = 3


def _write_c4(path: Path, docs: list[str]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with gzip.open(path, "wt", encoding="utf-8") as f:
        for i, text in enumerate(docs):
            row = {"text": text, "timestamp": "2019-04-25T12:57:54Z", "url": f"https://example.org/{i}"}
            f.write(json.dumps(row) + "\n")


@pytest.fixture(scope="module")
def mirror(tmp_path_factory) -> Path:
    """en/c4-train.0000{0..2}-of-01024.json.gz with 12 documents each, plus the first validation shard."""
    root = tmp_path_factory.mktemp("c4")
    with gzip.open(EMBEDDED, "rt", encoding="utf-8") as f:
        texts = [json.loads(line)["text"][:3000] for _, line in zip(range(SHARDS * 12 + 10), f)]
    for i in range(SHARDS):
        _write_c4(root / c4_train_shard(i), texts[12 * i : 12 * (i + 1)])
    _write_c4(root / C4_VALIDATION, texts[SHARDS * 12 :])
    return root


@pytest.fixture(scope="module")
def prepared(mirror, tmp_path_factory):
    """Two shards' worth of tokens: more than shard 0 holds."""
    out = tmp_path_factory.mktemp("tokens")
    one = prepare("c4", 1, out, tokenizer="bpe8192", local=mirror)
    first = one.manifest["train"]["tokens"]
    two = prepare("c4", first + 1, out, tokenizer="bpe8192", local=mirror)
    return out, one, two


def test_c4_file_names():
    assert c4_train_shard(3) == "en/c4-train.00003-of-01024.json.gz"


def test_prepare_takes_the_prefix_of_shards_it_needs(prepared, mirror):
    out, one, two = prepared
    assert [s["shard"] for s in one.manifest["train"]["shards"]] == [c4_train_shard(0)]
    assert [s["shard"] for s in two.manifest["train"]["shards"]] == [c4_train_shard(0), c4_train_shard(1)]
    assert two.tokenized == [c4_train_shard(1)]  # shard 0 was reused, not tokenised again
    assert is_tokenfiles(out) and TokenFiles.open(out / "manifest.json").verify() == []


def test_shard_holds_each_document_after_a_separator(prepared, mirror):
    out, _, two = prepared
    tok = load_tokenizer("bpe8192")
    with gzip.open(mirror / c4_train_shard(1), "rt", encoding="utf-8") as f:
        docs = [json.loads(line)["text"] for line in f]
    expected = [t for d in docs for t in [separator_id(tok), *tok(d, add_special_tokens=False)["input_ids"]]]
    shard = TokenFiles.open(out).train()[1]
    assert shard.dtype == np.uint16 and list(shard) == expected
    meta = two.manifest["train"]["shards"][1]
    assert meta["tokens"] == len(expected) and meta["documents"] == len(docs)
    assert meta["sha256"] == sha256_file(out / meta["file"])
    assert meta["source_sha256"] == sha256_file(mirror / c4_train_shard(1))
    assert two.manifest["validation"]["documents"] == 10
    assert two.manifest["tokenizer_fingerprint"] and two.manifest["train"]["tokens"] == sum(
        s["tokens"] for s in two.manifest["train"]["shards"]
    )


def test_resume_retokenises_only_a_missing_shard_and_gets_the_same_bytes(prepared, mirror, tmp_path):
    out, _, two = prepared
    copy = tmp_path / "copy"
    for meta in two.manifest["train"]["shards"]:
        for suffix in ("", ".json"):
            src = out / f"{meta['file']}{suffix}"
            (copy / src.relative_to(out)).parent.mkdir(parents=True, exist_ok=True)
            (copy / src.relative_to(out)).write_bytes(src.read_bytes())
    (copy / two.manifest["train"]["shards"][1]["file"]).unlink()  # as if killed while writing shard 1
    again = prepare("c4", two.manifest["tokens_requested"], copy, tokenizer="bpe8192", local=mirror)
    assert again.tokenized == [c4_train_shard(1), C4_VALIDATION]
    assert [s["sha256"] for s in again.manifest["train"]["shards"]] == [
        s["sha256"] for s in two.manifest["train"]["shards"]
    ]
    assert not list(copy.rglob("*.tmp"))


@pytest.mark.slow
def test_parallel_workers_write_the_same_files(prepared, mirror, tmp_path):
    _, _, two = prepared
    par = prepare(
        "c4", two.manifest["tokens_requested"], tmp_path, tokenizer="bpe8192", local=mirror, workers=2
    )

    def sums(manifest):
        return [(s["shard"], s["tokens"], s["sha256"]) for s in manifest["train"]["shards"]]

    assert sums(par.manifest) == sums(two.manifest)
    assert par.manifest["validation"]["sha256"] == two.manifest["validation"]["sha256"]


def test_asking_for_more_than_the_shards_hold_is_a_clear_error(prepared, mirror):
    out, _, _ = prepared
    with pytest.raises(UserError, match="2 C4 training shards hold"):
        prepare("c4", 10**9, out, tokenizer="bpe8192", local=mirror, max_shards=2)


def test_offline_hub_is_a_one_line_error(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(UserError, match="offline mode is set") as e:
        prepare("c4", 10, tmp_path, tokenizer="bpe8192")
    assert "\n" not in str(e.value)


def test_cli_prepare_offline_exits_2_with_one_line(tmp_path, monkeypatch, capsys):
    from qbench.cli import main

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    assert main(["data", "prepare", "c4", "--tokens", "1000", "--out", str(tmp_path)]) == 2
    err = capsys.readouterr().err.strip()
    assert "offline mode is set" in err and len(err.splitlines()) <= 2  # rich may wrap once


# ---------------------------------------------------------------------------------------------------- sampler


def _toy_shards() -> list[np.ndarray]:
    return [np.arange(start, start + n, dtype=np.uint16) for start, n in ((0, 100), (1000, 37), (2000, 64))]


def test_every_window_once_per_epoch_and_windows_never_cross_shards():
    sampler = TokenFileSampler(_toy_shards(), context=8, seed=3)  # span 9: 11 + 4 + 7 = 22 windows
    assert sampler.windows == 22
    firsts = [int(x[0]) for s in range(1, 12) for x in sampler.batch(s, 2)[0]]  # 11 steps × 2 = one epoch
    assert len(set(firsts)) == 22
    x, y = sampler.batch(1, 22)
    assert torch.equal(x[:, 1:], y[:, :-1]) and bool(((y - x) == 1).all())  # consecutive ids: one shard each
    second = [int(x[0]) for s in range(12, 23) for x in sampler.batch(s, 2)[0]]
    assert sorted(second) == sorted(firsts) and second != firsts  # epoch 2: the same windows, a new order


def test_order_is_a_function_of_seed_and_step_alone():
    a, b = TokenFileSampler(_toy_shards(), 8, seed=3), TokenFileSampler(_toy_shards(), 8, seed=3)
    for step in (5, 1, 17):  # any order of calls, fresh object: the same batch (what resume relies on)
        assert torch.equal(a.batch(step, 4)[0], b.batch(step, 4)[0])
    assert not torch.equal(a.batch(1, 4)[0], TokenFileSampler(_toy_shards(), 8, seed=4).batch(1, 4)[0])


@pytest.mark.parametrize("accum", [1, 2])
def test_one_and_two_ranks_see_the_same_windows_each_step(accum):
    sampler = TokenFileSampler(_toy_shards(), context=8, seed=0, bos_id=7)
    for step in range(1, 9):
        whole = sampler.batch(step, 4)[0]
        parts = [
            sampler.batch(step, 4, shard_rows(4, 2, rank, accum, micro))[0]
            for rank in range(2)
            for micro in range(accum)
        ]
        assert torch.equal(torch.cat(parts), whole)
        assert bool((whole[:, 0] == 7).all())


def test_training_from_token_files_resumes_bit_identically(prepared, tmp_path):
    out, _, _ = prepared
    cfg = micro_cfg(out, steps=6, eval_every=3, probe_every=3, ckpt_every=3)
    full, part = tmp_path / "full", tmp_path / "part"
    summary = train(cfg, full, progress=False)
    train(cfg, part, stop_at=3, progress=False)
    train(cfg, part, resume=True, progress=False)
    assert_bit_identical(full, part)
    assert [r["loss"] for r in read_metrics(full)[1:]] == [r["loss"] for r in read_metrics(part)[1:]]
    assert summary["complete"] and read_metrics(full)[-1]["mfu"] is None  # CPU: no peak
    assert read_metrics(full)[1]["tokens_per_s"] > 0 and 0 <= summary["optim_share"] < 1


def test_tokenizer_mismatch_is_refused(prepared, tmp_path):
    out, _, _ = prepared
    manifest = json.loads((out / "manifest.json").read_text())
    bad = tmp_path / "bad"
    bad.mkdir()
    for sub in ("train", "validation"):
        (bad / sub).symlink_to(out / sub)
    (bad / "manifest.json").write_text(json.dumps({**manifest, "tokenizer_fingerprint": "0" * 64}))
    with pytest.raises(UserError, match="tokenised with"):
        train(micro_cfg(bad), tmp_path / "run", progress=False)


def test_shard_output_names():
    assert (
        shard_output(Path("F"), "train", c4_train_shard(2)).as_posix()
        == "F/train/c4-train.00002-of-01024.bin"
    )


def test_evaluation_reads_the_validation_slice_of_a_token_folder(prepared):
    from trainers.data import default_split, token_stream

    out, _, _ = prepared
    assert default_split(out) == "validation"
    stream = token_stream(out, "validation", "bpe8192")
    assert np.array_equal(stream, TokenFiles.open(out).validation())
    with pytest.raises(UserError, match="tokenised with"):
        token_stream(out, "validation", "gpt2")
