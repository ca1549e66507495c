"""Under ``--metric kld`` or ``top1`` every display shows the interval a verdict was decided on, in that metric's unit,
and the tolerance in that unit: the sweep's table, caption and plot, ``compare --breaking-points``, ``score
--breaking-points``, the card's tables, lines and breaking-point figure, the repair's sentences. Never the
perplexity interval beside a KLD or top-1 verdict. Under ppl the texts are the ones they always were (the committed
cards re-render byte for byte: test_card_schema.py)."""

from __future__ import annotations

import csv
import io
import json
from dataclasses import replace

import pytest

from qbench.eval.evidence import decide, format_interval
from qbench.eval.tolerance import (
    deciding_interval,
    default_tolerance,
    interval_text,
    metric_heading,
    number_text,
    tolerance_text,
    value_text,
)

FAST = ["--tokens", "128", "--window", "32", "--no-attention"]
UNIT = {"kld": "nats", "top1": "%"}


# ------------------------------------------------------------------------------------------- the one formatter


def test_each_metric_reads_in_its_own_unit():
    # ppl: the texts every display printed before (the card's brackets, the sweep's ±)
    assert interval_text(0.97, [0.41, 1.53], "ppl") == "+0.97 % [+0.41, +1.53]"
    assert interval_text(0.97, [0.41, 1.53], "ppl", style="pm") == "+0.97 ±0.56"
    assert interval_text(4.65e23, [1e4, 5e23], "ppl") == "+4.65e+23 % [+1.00e+04, +5.00e+23]"
    assert interval_text(0.97, None, "ppl", style="pm") == "+0.97 (no interval)"
    assert interval_text(None, [0.1, 0.2], "ppl") == "NaN" == value_text(None, "ppl")
    # kld: nats, with the decimals its tolerance needs; top1: the share of tokens whose top-1 token changed, in %
    assert interval_text(0.0123, [0.0101, 0.0145], "kld", 0.01) == "KLD 0.0123 nats [0.0101, 0.0145]"
    assert interval_text(0.0123, [0.0101, 0.0145], "kld", 0.01, named=False) == "0.0123 nats [0.0101, 0.0145]"
    assert interval_text(0.0123, [0.0101, 0.0145], "kld", 0.01, style="pm") == "0.0123 ±0.0022 nats"
    assert interval_text(1.2e-5, [1e-5, 1.4e-5], "kld", 1e-4) == "KLD 0.000012 nats [0.000010, 0.000014]"
    assert interval_text(1.23, [0.8, 1.66], "top1", 1.0) == "1.23 % top-1 changed [0.80, 1.66]"
    assert interval_text(1.23, [0.8, 1.66], "top1", 1.0, style="pm") == "1.23 ±0.43 %"
    assert interval_text(0.0123, None, "kld", style="pm") == "0.0123 nats (no interval)"
    assert number_text(-1e-9, "kld") == "0.0000"  # an interval's end just below 0 reads 0, not -0
    # the tolerance reads as the values do
    assert (
        tolerance_text(0.01, "kld") == "KLD 0.01 nats" and tolerance_text(1.0, "top1") == "1 % top-1 changed"
    )
    assert metric_heading("kld") == "KLD (nats)" and metric_heading("top1") == "top-1 changed (%)"


def test_the_deciding_interval_is_the_one_decide_reads():
    record = {
        "status": "ok",
        "metrics": {
            "ppl_change_pct": 2.0,
            "ppl_change_ci95": [1.0, 3.0],
            "kld_mean": 0.02,
            "kld_mean_ci95": [0.015, 0.025],
            "top1_agreement": 0.97,
            "top1_agreement_ci95": [0.96, 0.98],
            "interval": {"windows": 8, "df": 7},
        },
    }
    for metric in ("ppl", "kld", "top1"):
        d = decide(record, default_tolerance(metric), metric)
        value, ci = deciding_interval(record["metrics"], metric)
        assert (d.value, d.low, d.high) == (value, *ci), metric
    value, ci = deciding_interval(record["metrics"], "top1")
    assert value == pytest.approx(3.0) and ci == pytest.approx([2.0, 4.0])  # disagreement, in %


# -------------------------------------------------------------------------- sweep, compare, score on a model


@pytest.mark.parametrize("metric", ["kld", "top1"])
def test_sweep_compare_and_score_show_the_deciding_interval_in_its_unit(
    metric, ckpt_dir, tmp_path, capsys, monkeypatch
):
    from qbench.cli import main
    from qbench.studies import plots

    drawn = []
    save = plots._save
    monkeypatch.setattr(plots, "_save", lambda fig, path: (drawn.append(fig), save(fig, path))[1])
    res, tolerance, unit = tmp_path / "res", default_tolerance(metric), UNIT[metric]
    assert (
        main(["run", "--ckpt", str(ckpt_dir), "--scheme", "absmax-coarse", "--output-path", str(res), *FAST])
        == 0
    )
    sweep_argv = ["sweep", "--ckpt", str(ckpt_dir), "--axes", "w", "--bits", "8,2", "--metric", metric]
    assert main([*sweep_argv, "--output-path", str(res / "sweep"), *FAST]) == 0
    capsys.readouterr()
    sweep = json.loads((res / "sweep" / "sweep.json").read_text())
    page = (res / "sweep" / "sweep.md").read_text()
    (row,) = [line for line in page.splitlines() if line.startswith("| ") and "absmax-coarse" in line]
    for cell in sweep["cells"]:
        d = cell["decision"]
        assert d["metric"] == metric
        shown = format_interval(d["value"], d["ci95"], cell["verdict"], metric, tolerance)
        assert f" {unit}" in shown and f"| {shown} " in row  # the verdict's own interval, with its unit
        ppl = format_interval(cell["ppl_change_pct"], cell["ppl_change_ci95"], cell["verdict"])
        assert ppl not in row  # never the perplexity interval beside this verdict
    assert f"breaking point (≤ {tolerance_text(tolerance, metric)})" in page
    assert (
        f"tolerance {tolerance_text(tolerance, metric)})" in page and "Perplexity change vs float" not in page
    )
    # the plot: each cell's value of the metric over bits, the tolerance line at the tolerance in that unit
    (fig,) = drawn
    (ax,) = fig.axes
    curve, _broken, line = ax.get_lines()
    by_bits = {c["bits"]: c["decision"]["value"] for c in sweep["cells"]}
    assert list(curve.get_xdata()) == [8, 2] and list(curve.get_ydata()) == [by_bits[8], by_bits[2]]
    assert list(line.get_ydata()) == [tolerance, tolerance]
    assert unit in ax.get_ylabel() and tolerance_text(tolerance, metric) in ax.get_ylabel()

    assert main(["compare", str(res), "--format", "csv", "--breaking-points"]) == 0
    header, values = csv.reader(io.StringIO(capsys.readouterr().out))
    row = dict(zip(header, values, strict=True))
    assert f"break absmax-coarse w (≤ {tolerance_text(tolerance, metric)})" in row
    (record_path,) = [p for p in res.glob("*/absmax-coarse__fake.json") if "sweep" not in p.parts]
    record = json.loads(record_path.read_text())
    shown = interval_text(*deciding_interval(record["metrics"], metric), metric, style="pm")
    assert f"({shown}; " in row["absmax-coarse/fake"] and f" {unit}" in shown

    score = ["score", "--ckpt", str(ckpt_dir), "--scheme", "int4", "--output-path", str(res), *FAST]
    assert main([*score, "--sweep", str(res / "sweep")]) == 0
    out = capsys.readouterr().out
    assert f"(≤ {tolerance_text(tolerance, metric)})" in out and f"(≤ {tolerance:g} %)" not in out


# --------------------------------------------------------------------------------------------------- the card


def _table(page: str, title: str) -> list[dict[str, str]]:
    """The rows of the markdown table under ``### title`` (or ``## title``), as {header: cell}."""
    lines = page.splitlines()
    start = next(i for i, line in enumerate(lines) if line.lstrip("#").strip() == title)
    rows = []
    for line in lines[start + 2 :]:
        if not line.startswith("|"):
            if rows:
                break
            continue
        cells = [c.strip().replace("\\|", "|") for c in line.strip("|").split(" | ")]
        rows.append(cells)
    header, _, *body = rows
    return [dict(zip(header, r, strict=True)) for r in body]


# kld at a tolerance the 2-bit format exceeds on these models: a format to avoid, its map and a repair, all said in
# nats; top1 keeps every format within (a near-random micro model's top-1 token barely moves)
@pytest.mark.parametrize(("metric", "tolerance"), [("kld", 1e-6), ("top1", 1.0)])
def test_the_card_shows_the_deciding_interval_in_its_unit(
    metric, tolerance, ckpt_dir, hf_llama_dir, tmp_path, monkeypatch
):
    from qbench.studies import card
    from qbench.studies.card.config import CardConfig
    from qbench.studies.card.measure import run_card
    from qbench.studies.card.plan import BUDGETS
    from qbench.studies.card.render.figures import _breaking_point_figure
    from qbench.studies.card.rows import kv_axis
    from qbench.studies.card.units import pct
    from qbench.studies.plots import _pyplot

    formats = ("absmax-coarse", "absmax-coarse:w=2,a=2,o=2")
    small = replace(BUDGETS["quick"], formats=formats, kv_rows=(card.KVRow("kivi", 4), card.KVRow("kivi", 2)))
    monkeypatch.setitem(BUDGETS, "quick", small)
    cfg = CardConfig(
        models=[str(ckpt_dir), str(hf_llama_dir)],
        output_path=tmp_path,
        tokens=64,
        tolerance=tolerance,
        metric=metric,
    )
    result = run_card(cfg)
    page = (tmp_path / "card.md").read_text()
    limit, heading, unit = (
        tolerance_text(tolerance, metric),
        f"{metric_heading(metric)} [95 % CI]",
        UNIT[metric],
    )

    def shown(row: dict, named: bool = False) -> str:
        d = row["decision"]
        assert d["metric"] == metric
        return interval_text(d["value"], d["ci95"], metric, tolerance, named=named)

    def ppl_bracket(row: dict) -> str:
        low, high = row["ppl_change_ci95"]
        return f"[{low:+.2f}, {high:+.2f}]"

    summary = _table(page, "Summary")
    for i, m in enumerate(result["models"]):
        section = page.split(f"## {m['name']}\n", 1)[1]
        # the format and KV tables: the change alone, then the deciding interval with its unit, then the verdict
        for title, rows in (("Deployable formats", m["formats"]), ("KV cache", m["kv"]["rows"])):
            table = _table(section, title)
            assert len(table) == len(rows) and f"≤ {limit}" in table[0]
            for row, line in zip(rows, table, strict=True):
                assert line[heading] == shown(row) and shown(row).split(" [")[0].endswith(unit)
                assert line["change"] == pct(row["ppl_change_pct"]) and "[" not in line["change"]
        # the verdict's lines say the deciding interval in its unit, never the perplexity interval
        lines = " ".join(m["verdict"]["lines"])
        assert limit in lines
        for row in m["formats"]:
            assert ppl_bracket(row) not in lines
            if row["label"] in lines:
                assert (
                    shown(row, named=True) in lines
                    or value_text(row["decision"]["value"], metric, tolerance) in lines
                )
        # the breaking points: each KV curve point's value of the metric
        (kv_point,) = _table(section, "Breaking points")
        curve = [r for r in m["kv"]["rows"] if kv_axis(r["scheme"], r["keep_sinks"]) == kv_point["axis"]]
        expected = "  ".join(
            f"{r['bits']}:{number_text(r['decision']['value'], metric, tolerance)}" for r in curve
        )
        assert len(curve) == 2 and kv_point[f"curve (bits:{metric_heading(metric)})"] == expected
        # the summary's interval is the recommended (or no) format's deciding one
        rec = m["verdict"]["recommended"]
        found = next((f for f in m["formats"] if rec and f["scheme"] == rec["scheme"]), None)
        assert summary[i][heading] == (shown(found) if found else "-")
        if metric == "kld":  # the 2-bit format is beyond: avoided, mapped and repaired, all in nats
            assert m["verdict"]["avoid"] and m["sensitivity"] and "Repair of" in lines
            repair = m["verdict"]["repair"]
            assert (
                f"→ {interval_text(repair['decision']['value'], repair['decision']['ci95'], metric, tolerance)}"
                in lines
            )
        if m["sensitivity"]:  # the repair the card shows, on the metric it was decided on
            repair = m["sensitivity"]["repair"]
            assert repair["decision"]["metric"] == metric
            caption = section.split("### Where it breaks", 1)[1]
            assert (
                interval_text(repair["decision"]["value"], repair["decision"]["ci95"], metric, tolerance)
                in caption
            )
    # side by side: each model's deciding interval first, then its change
    side = {r["row"]: r for r in _table(page, "Side by side") if r["section"] == "formats"}
    for m in result["models"]:
        for f in m["formats"]:
            assert side[f["label"]][m["name"]].startswith(
                f"{shown(f, named=True)}; {pct(f['ppl_change_pct'])}"
            )
    # the figure: the curve points' values of the metric, the tolerance line at the tolerance
    curves = [(m["name"], b) for m in result["models"] for b in m["breaking_points"] if b["curve"]]
    fig = _breaking_point_figure(_pyplot(), result, curves)
    panels = {ax.get_title(): ax for ax in fig.axes if ax.get_visible()}
    for name, b in curves:
        ax = panels[f"{b['family']} {b['axis']}"]
        values = [v["decision"]["value"] for v in b["curve"].values()]
        assert any(list(line.get_ydata()) == values for line in ax.get_lines()), name
        assert any(list(line.get_ydata()) == [tolerance, tolerance] for line in ax.get_lines())
        assert unit in ax.get_ylabel()
    assert any(t.get_text() == f"tolerance {limit}" for legend in fig.legends for t in legend.get_texts())
    assert "against bit width" in (tmp_path / "card.html").read_text()


# --------------------------------------------------------------------------------------- the repair's words


def test_a_repair_on_kld_is_said_in_nats_and_one_on_ppl_as_before():
    from qbench.studies.sensitivity import repair_texts

    base = {"tolerance_pct": 0.01, "quantised_ppl_change_pct": 5.0, "ppl_change_pct": 0.5}
    assert repair_texts({**base, "metric": "ppl", "tolerance_pct": 1.0}) == ("+5.000 %", "+0.500 %")
    kld = {
        **base,
        "metric": "kld",
        "decision": {"metric": "kld", "value": 0.004, "ci95": [0.003, 0.005]},
        "quantised_decision": {"metric": "kld", "value": 0.05, "ci95": [0.04, 0.06]},
    }
    assert repair_texts(kld) == (
        "KLD 0.0500 nats (perplexity +5.000 %)",
        "KLD 0.0040 nats [0.0030, 0.0050] (perplexity +0.500 %)",
    )
