"""``qbench sensitivity`` end to end: its repair, applied with ``qbench run --exclude``, gives the same perplexity."""

import json

import pytest

from models.checkpoint import save_checkpoint
from qbench.cli import main
from tests.qbench.conftest import planted_model

SCHEME = "absmax-fine:agran=tensor"  # per-channel weights, per-sequence activations


@pytest.fixture(scope="module")
def planted_ckpt(tmp_path_factory, tokenizer):
    path = tmp_path_factory.mktemp("sens-cli") / "planted"
    save_checkpoint(path, planted_model(), tokenizer, provenance={"training": None})
    return path


def test_repair_equals_a_separate_run_with_its_excludes(planted_ckpt, tmp_path, capsys):
    out = tmp_path / "sens"
    argv = ["--ckpt", str(planted_ckpt), "--scheme", SCHEME, "--tokens", "128"]
    assert main(["sensitivity", *argv, "--tolerance", "0.1", "--top", "3", "--out", str(out)]) == 0
    result = json.loads((out / "sensitivity.json").read_text())
    repair = result["repair"]
    assert repair["exclude"] == ["transformer.h.1.mlp.down_proj"]
    assert result["protocol"]["window"] == 32 and result["command"].startswith("qbench sensitivity")
    printed = capsys.readouterr().out
    assert "transformer.h.1.mlp.down_proj" in printed and "Spearman" in printed
    excludes = [a for name in repair["exclude"] for a in ("--exclude", name)]
    run = ["run", *argv, *excludes, "--output-path", str(tmp_path / "run"), "--no-attention"]
    assert main(run) == 0
    (record,) = [json.loads(p.read_text()) for p in (tmp_path / "run").rglob("*.json") if p.name != "fp.json"]
    assert record["scheme"]["exclude"] == repair["exclude"]
    assert record["metrics"]["perplexity"] == repair["ppl"]
    assert record["metrics"]["ppl_change_pct"] == repair["ppl_change_pct"]


def test_bad_options_are_one_line_errors(planted_ckpt, capsys):
    assert main(["sensitivity", "--ckpt", str(planted_ckpt), "--scheme", "absmax-corse"]) == 2
    assert "did you mean 'absmax-coarse'" in capsys.readouterr().err
    assert (
        main(["sensitivity", "--ckpt", str(planted_ckpt), "--scheme", "absmax-coarse", "--by", "blok"]) == 2
    )
    assert "did you mean 'block'" in capsys.readouterr().err
