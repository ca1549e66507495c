"""Where commands write: ``init`` and ``export`` never write into a folder that is not empty without --overwrite,
and ``--ckpt .`` files its results under the folder's real name."""

from __future__ import annotations

import json

import pytest

from qbench.cli import main


def _cli(argv, capsys):
    code = main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return code, out, err


@pytest.fixture
def occupied(tmp_path):
    folder = tmp_path / "occupied"
    folder.mkdir()
    (folder / "notes.txt").write_text("mine")
    return folder


def test_init_refuses_a_folder_that_is_not_empty(occupied, capsys):
    code, _, err = _cli(["init", "--preset", "tiny", "--output-path", occupied], capsys)
    assert code == 2 and str(occupied) in err and "--overwrite" in err and len(err.strip().splitlines()) == 1
    assert not (occupied / "config.json").exists()
    code, _, _ = _cli(["init", "--preset", "tiny", "--output-path", occupied, "--overwrite"], capsys)
    assert (
        code == 0 and (occupied / "config.json").is_file() and (occupied / "notes.txt").read_text() == "mine"
    )


def test_export_refuses_a_folder_that_is_not_empty(ckpt_dir, occupied, tmp_path, capsys):
    code, _, err = _cli(["export", ckpt_dir, occupied], capsys)
    assert code == 2 and str(occupied) in err and "--overwrite" in err and len(err.strip().splitlines()) == 1
    assert not (occupied / "config.json").exists()
    code, _, err = _cli(["export", ckpt_dir, "--output-path", ckpt_dir], capsys)  # over its own source
    assert code == 2 and "--overwrite" in err
    code, _, _ = _cli(["export", ckpt_dir, "--output-path", occupied, "--overwrite"], capsys)
    assert code == 0 and "model_type" in json.loads((occupied / "config.json").read_text())
    code, _, err = _cli(["export", ckpt_dir, tmp_path / "a", "--output-path", tmp_path / "b"], capsys)
    assert code == 2 and "two output paths" in err
    code, _, err = _cli(["export", ckpt_dir], capsys)
    assert code == 2 and "--output-path" in err


def test_export_gguf_writes_one_file_and_never_over_another(ckpt_dir, tokenizer, tmp_path, capsys):
    pytest.importorskip("gguf")
    from models.checkpoint import save_checkpoint
    from qbench.eval.load import load_model
    from tests.qbench.conftest import micro_config, trained_like

    out = tmp_path / "model.gguf"
    code, _, err = _cli(
        ["export", ckpt_dir, out, "--format", "gguf"], capsys
    )  # softmax-1: no llama.cpp graph
    assert code == 2 and "softmax1" in err and not out.exists()
    ckpt_dir = tmp_path / "micro_llama"
    save_checkpoint(ckpt_dir, trained_like(micro_config("llama")), tokenizer, provenance={"training": None})
    code, printed, _ = _cli(["export", ckpt_dir, out, "--format", "gguf"], capsys)
    assert code == 0 and out.is_file() and "MiB" in printed
    assert load_model(str(out)).description["gguf"]["file_type"] == "ALL_F32"  # transformers reads it back
    before = out.stat().st_mtime_ns
    code, _, err = _cli(["export", ckpt_dir, "--output-path", out, "--format", "gguf"], capsys)
    assert code == 2 and "--overwrite" in err and out.stat().st_mtime_ns == before
    code, _, _ = _cli(["export", ckpt_dir, out, "--format", "gguf", "--overwrite"], capsys)
    assert code == 0
    code, _, err = _cli(["export", ckpt_dir, tmp_path / "model.bin", "--format", "gguf"], capsys)
    assert code == 2 and "ending in .gguf" in err
    code, _, err = _cli(["export", ckpt_dir, tmp_path / "x", "--format", "ggfu"], capsys)
    assert code == 2 and "did you mean 'gguf'" in err


def test_ckpt_dot_is_named_after_the_folder(ckpt_dir, tmp_path, monkeypatch, capsys):
    from qbench.eval.load import load_model

    monkeypatch.chdir(ckpt_dir)
    assert load_model(".").name == ckpt_dir.name
    monkeypatch.chdir(ckpt_dir / "..")
    assert load_model(f"{ckpt_dir.name}/../{ckpt_dir.name}").name == ckpt_dir.name
    monkeypatch.chdir(ckpt_dir)
    out = tmp_path / "r"
    argv = [
        "run",
        "--ckpt",
        ".",
        "--scheme",
        "absmax-coarse",
        "--tokens",
        62,
        "--no-attention",
        "--output-path",
        out,
    ]
    code, _, _ = _cli(argv, capsys)
    assert code == 0 and {p.name for p in out.iterdir()} == {ckpt_dir.name}
