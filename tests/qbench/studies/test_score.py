import argparse
import json
import math

import pytest

from models.errors import UserError
from qbench.eval.harness import PAPER_SCHEMES
from qbench.eval.load import load_model
from qbench.eval.metrics import Protocol
from qbench.studies.score import add_arguments, robustness, run, score


def test_robustness_is_the_inverse_geometric_mean_ratio():
    assert robustness([1.0, 1.0, 1.0]) == 1.0
    assert robustness([4.0, 1.0]) == pytest.approx(0.5)
    assert robustness([2.0, 0.5]) == pytest.approx(1.0)
    assert robustness([1.2, math.inf]) == 0.0  # a scheme that breaks the model
    assert robustness([]) is None
    assert robustness([1.1, 1.3]) < robustness([1.1, 1.2]) < robustness([1.0, 1.2])  # monotone


@pytest.fixture(scope="module")
def scored(ckpt_dir, tmp_path_factory):
    out = tmp_path_factory.mktemp("score")
    lm = load_model(str(ckpt_dir))
    return out, lm, score(lm, Protocol(tokens=62, window=32, outlier_windows=2), output_path=out)


def test_score_summarises_the_harness_records(scored):
    out, lm, result = scored
    assert list(result["schemes"]) == list(PAPER_SCHEMES)
    ratios = []
    for name, entry in result["schemes"].items():
        assert entry["status"] == "ok"
        assert entry["ppl_ratio"] == pytest.approx(entry["perplexity"] / result["fp_perplexity"])
        record = json.loads((out / lm.name / f"{name}__fake.json").read_text())  # the grid's layout
        assert record["metrics"]["ppl_ratio"] == entry["ppl_ratio"]
        ratios.append(entry["ppl_ratio"])
    expected = math.exp(-sum(map(math.log, ratios)) / len(ratios))
    assert result["robustness"] == pytest.approx(expected) and 0 < result["robustness"] < 1.5
    assert result["outliers"]["kurtosis_other"] > 3  # the fixture's planted outlier channel
    assert (out / lm.name / "fp.json").exists() and result["skipped"] == []


def test_bad_scheme_is_a_did_you_mean_error(ckpt_dir, tmp_path):
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    args = parser.parse_args(
        ["--ckpt", str(ckpt_dir), "--scheme", "absmax-fin", "--output-path", str(tmp_path)]
    )
    with pytest.raises(UserError, match="did you mean 'absmax-fine'"):
        run(args)
    assert not any(tmp_path.iterdir())  # refused before anything ran


def test_command_prints_and_writes_the_score(ckpt_dir, tmp_path, capsys):
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    argv = ["--ckpt", str(ckpt_dir), "--tokens", "62", "--scheme", "int4", "--no-attention"]
    run(parser.parse_args([*argv, "--output-path", str(tmp_path), "--json", str(tmp_path / "s.json")]))
    written = json.loads((tmp_path / "s.json").read_text())
    assert list(written["schemes"]) == ["zeropoint-int4"]
    assert f"robustness {written['robustness']:.4f}" in capsys.readouterr().out
