import gzip
import json
from pathlib import Path

import pytest

from qbench.cli import main
from qbench.studies.reproduce import table2, table3

EMBEDDED = Path(__file__).resolve().parents[3] / "trainers" / "corpus" / "embedded.jsonl.gz"


@pytest.fixture
def small_corpus(tmp_path):
    path = tmp_path / "corpus.jsonl"
    with gzip.open(EMBEDDED, "rt") as f, open(path, "w") as out:
        for _, line in zip(range(60), f):
            doc = json.loads(line)
            out.write(json.dumps({"id": doc["id"], "text": doc["text"][:6000]}) + "\n")
    return path


@pytest.mark.slow
def test_reproduce_trains_evaluates_and_writes_the_paper_tables(small_corpus, tmp_path, capsys):
    argv = [
        "reproduce",
        "--preset",
        "tiny",
        "--recipes",
        "vanilla",
        "softmax1-orthoadam",
        "--steps",
        "2",
        "--parallel",
        "2",
        "--data",
        str(small_corpus),
        "--eval-tokens",
        "254",
        "--ckpt-root",
        str(tmp_path / "ckpts"),
        "--output-path",
        str(tmp_path / "results"),
    ]
    assert main(argv) == 0
    table2_md = (tmp_path / "results" / "table2.md").read_text()
    table3_md = (tmp_path / "results" / "table3.md").read_text()
    assert "vanilla" in table2_md and "softmax1-orthoadam" in table2_md and "κ first" in table2_md
    assert "absmax-coarse/fake" in table3_md and "zeropoint-int4/fake" in table3_md
    assert "Made by `qbench reproduce" in table2_md
    # A second run reuses the finished training and every finished cell.
    capsys.readouterr()
    assert main(argv) == 0
    assert capsys.readouterr().out.count("(reused)") == 10  # 2 models × (fp + 4 schemes)


def test_tables_follow_the_paper_layout():
    fp = {
        "scheme": {"name": "fp"},
        "mode": "float",
        "model": {"name": "m"},
        "metrics": {"perplexity": 20.0, "ppl_change_pct": 0.0},
        "outliers": {
            "first_token_top1_share": 0.5,
            "kurtosis_first": 100.0,
            "kurtosis_other": 4.0,
            "max_abs_first": 900.0,
            "max_abs_other": 10.0,
        },
    }
    q = {
        "scheme": {"name": "absmax-coarse"},
        "mode": "fake",
        "model": {"name": "m"},
        "metrics": {"perplexity": 30.0, "ppl_change_pct": 50.0},
    }
    headers, rows = table2([fp, q])
    assert rows == [["m", "20.00", "50.0", "100.00", "4.00", "900.0", "10.0"]]
    headers, rows = table3([fp, q])
    assert headers == ["model", "fp", "absmax-coarse/fake"] and rows == [["m", "20.00", "30.00 (+50.00%)"]]
