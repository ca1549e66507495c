"""compare's cells are the numbers in the JSON records they come from (values, not only shapes)."""

from __future__ import annotations

import json
import math

import pytest

from qbench.cli import main
from qbench.eval.harness import GridSpec, run_grid
from qbench.eval.metrics import Protocol

SMALL = Protocol(tokens=32 * 4, batch_size=2, outlier_windows=2)


def _compare(argv, capsys):
    code = main(["compare", *map(str, argv)])
    out, err = capsys.readouterr()
    assert code == 0, err
    return out


@pytest.fixture
def results(ckpt_dir, tmp_path):
    out = tmp_path / "results"
    run_grid(
        GridSpec(
            models=[str(ckpt_dir)],
            schemes=["absmax-coarse", "zeropoint-int4", "absmax-fine"],
            modes=["fake"],
            protocol=SMALL,
            output_path=out,
        )
    )
    return out


def _files(out):
    return {p.name: p for p in out.rglob("*.json")}


def test_every_cell_equals_its_record(results, capsys):
    files = _files(results)
    # Make one cell non-finite and one unsupported, as the harness writes them.
    coarse = json.loads(files["absmax-coarse__fake.json"].read_text())
    coarse.update(status="nonfinite")
    coarse["metrics"].update(perplexity=None, ppl_change_pct=None)
    files["absmax-coarse__fake.json"].write_text(json.dumps(coarse))
    fine = json.loads(files["absmax-fine__fake.json"].read_text())
    fine.update(status="unsupported", error="no kernel")
    files["absmax-fine__fake.json"].write_text(json.dumps(fine))

    table = json.loads(_compare([results, "--format", "json"], capsys))
    (row,) = table["rows"]
    cells = dict(zip(table["headers"], row, strict=True))
    fp = json.loads(files["fp.json"].read_text())
    int4 = json.loads(files["zeropoint-int4__fake.json"].read_text())
    assert cells["fp"] == f"{fp['metrics']['perplexity']:.2f}"
    change = 100 * (int4["metrics"]["perplexity"] / fp["metrics"]["perplexity"] - 1)
    assert int4["metrics"]["ppl_change_pct"] == pytest.approx(change, abs=1e-9)
    low, high = int4["metrics"]["ppl_change_ci95"]
    assert cells["zeropoint-int4/fake"] == (
        f"{int4['metrics']['perplexity']:.2f} ({change:+.2f}% ±{(high - low) / 2:.2f}; "
        f"KLD {int4['metrics']['kld_mean']:.4f})"
    )
    assert cells["absmax-coarse/fake"] == "NaN" and cells["absmax-fine/fake"] == "n/a"
    assert cells["κ first"] == f"{fp['outliers']['kurtosis_first']:.3g}"
    assert cells["1st-token top-1"] == f"{fp['outliers']['first_token_top1_share']:.1%}"
    assert not math.isnan(fp["metrics"]["perplexity"])

    md = _compare([results, "--format", "md"], capsys)
    assert f"{int4['metrics']['perplexity']:.2f} ({change:+.2f}%" in md and " NaN " in md and " n/a " in md
    csv = _compare([results, "--format", "csv"], capsys)
    assert f"{int4['metrics']['perplexity']:.2f} ({change:+.2f}%" in csv.splitlines()[1]
    shown = _compare([results, "--format", "table"], capsys)
    assert f"{int4['metrics']['perplexity']:.2f}" in shown and f"({change:+.2f}%" in shown
    assert "WARNING" not in shown


def test_records_of_different_protocols_are_flagged(results, ckpt_dir, hf_gpt2_dir, capsys):
    run_grid(
        GridSpec(
            models=[str(hf_gpt2_dir)],
            schemes=["zeropoint-int4"],
            modes=["fake"],
            protocol=Protocol(tokens=32 * 2, batch_size=2, outlier_windows=2),
            output_path=results,
        )
    )
    table = json.loads(_compare([results, "--format", "json"], capsys))
    assert "different protocols" in table["caption"]
    rows = {row[0]: dict(zip(table["headers"], row, strict=True)) for row in table["rows"]}
    assert set(rows) == {ckpt_dir.name, hf_gpt2_dir.name}
    gpt2 = rows[hf_gpt2_dir.name]
    assert gpt2["absmax-coarse/fake"] == "-"  # a cell that was never evaluated is blank, not borrowed


def test_a_torn_or_malformed_record_is_skipped_with_a_one_line_warning(results, capsys):
    files = _files(results)
    torn = files["absmax-coarse__fake.json"]
    torn.write_text('{"record_version": 1, "model": ')
    stripped = files["zeropoint-int4__fake.json"]
    record = json.loads(stripped.read_text())
    del record["metrics"]["fp_perplexity"]
    stripped.write_text(json.dumps(record))
    code = main(["compare", str(results), "--format", "md"])
    out, err = capsys.readouterr()
    assert code == 0 and "Traceback" not in err
    warnings = [line for line in err.splitlines() if line.startswith("warning: skipped")]
    assert len(warnings) == 2
    assert any(str(torn) in w and "not valid JSON" in w for w in warnings)
    assert any(str(stripped) in w and "'fp_perplexity'" in w for w in warnings)
    assert "absmax-fine/fake" in out and "zeropoint-int4/fake" not in out  # the good records still shown


def test_one_model_under_two_protocols_gets_two_rows(ckpt_dir, results, capsys):
    first = json.loads(_files(results)["absmax-coarse__fake.json"].read_text())
    run_grid(
        GridSpec(
            models=[str(ckpt_dir)],
            schemes=["absmax-coarse"],
            protocol=Protocol(tokens=32 * 2, batch_size=2, outlier_windows=2),
            output_path=results,
        )
    )
    table = json.loads(_compare([results, "--format", "json"], capsys))
    labels = [row[0] for row in table["rows"]]
    assert sorted(labels) == [f"{ckpt_dir.name} [tokens=128]", f"{ckpt_dir.name} [tokens=64]"]
    # the first run's record is untouched; the second cell has a file of its own
    assert json.loads(_files(results)["absmax-coarse__fake.json"].read_text()) == first
    assert len([p for p in results.rglob("absmax-coarse__fake*.json")]) == 2
