import json
import math

import pytest

from qbench.eval.harness import PAPER_SCHEMES
from qbench.eval.load import load_model
from qbench.eval.metrics import Protocol
from qbench.studies.score import robustness, score


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
    return out, lm, score(lm, Protocol(tokens=64, window=32, outlier_windows=2), output_path=out)


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
