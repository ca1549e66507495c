"""compare's cells are the numbers in the JSON records they come from (values, not only shapes)."""

from __future__ import annotations

import json
import math

import pytest

from qbench.cli import main
from qbench.eval.harness import GridSpec, run_grid
from qbench.eval.metrics import Protocol

SMALL = Protocol(tokens=31 * 4, batch_size=2, outlier_windows=2)


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
    assert cells["zeropoint-int4/fake"] == f"{int4['metrics']['perplexity']:.2f} ({change:+.2f}%)"
    assert cells["absmax-coarse/fake"] == "NaN" and cells["absmax-fine/fake"] == "n/a"
    assert cells["κ first"] == f"{fp['outliers']['kurtosis_first']:.3g}"
    assert cells["1st-token top-1"] == f"{fp['outliers']['first_token_top1_share']:.1%}"
    assert not math.isnan(fp["metrics"]["perplexity"])

    md = _compare([results, "--format", "md"], capsys)
    assert f"{int4['metrics']['perplexity']:.2f} ({change:+.2f}%)" in md and " NaN " in md and " n/a " in md
    csv = _compare([results, "--format", "csv"], capsys)
    assert f"{int4['metrics']['perplexity']:.2f} ({change:+.2f}%)" in csv.splitlines()[1]
    shown = _compare([results, "--format", "table"], capsys)
    assert f"{int4['metrics']['perplexity']:.2f}" in shown and f"({change:+.2f}%)" in shown
    assert "WARNING" not in shown


def test_records_of_different_protocols_are_flagged(results, ckpt_dir, hf_gpt2_dir, capsys):
    run_grid(
        GridSpec(
            models=[str(hf_gpt2_dir)],
            schemes=["zeropoint-int4"],
            modes=["fake"],
            protocol=Protocol(tokens=31 * 2, batch_size=2, outlier_windows=2),
            output_path=results,
        )
    )
    table = json.loads(_compare([results, "--format", "json"], capsys))
    assert "different protocols" in table["caption"]
    rows = {row[0]: dict(zip(table["headers"], row, strict=True)) for row in table["rows"]}
    assert set(rows) == {ckpt_dir.name, hf_gpt2_dir.name}
    gpt2 = rows[hf_gpt2_dir.name]
    assert gpt2["absmax-coarse/fake"] == "-"  # a cell that was never evaluated is blank, not borrowed


def test_a_torn_record_is_a_one_line_error(results, capsys):
    next(iter(_files(results).values())).write_text('{"record_version": 1, "model": ')
    code = main(["compare", str(results), "--format", "md"])
    err = capsys.readouterr().err
    assert code == 2 and "not valid JSON" in err and "Traceback" not in err
