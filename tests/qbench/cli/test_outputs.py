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
    assert code == 2 and "two output folders" in err
    code, _, err = _cli(["export", ckpt_dir], capsys)
    assert code == 2 and "--output-path" in err


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
