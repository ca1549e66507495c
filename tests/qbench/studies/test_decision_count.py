"""How many verdicts a sweep or a card makes, and the false *within* calls they could make were every row exactly
at the tolerance (``qbench.eval.tolerance.decisions_block``): sweep.json's and each card model's ``decisions``,
the sweep's caption and the card's verdict say it; a sweep or card from before says nothing new."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest

from qbench.eval.evidence import ALPHA, Look, decide
from qbench.eval.tolerance import decision_count, decisions_block, decisions_text
from qbench.studies.card import build as card_build
from qbench.studies.card.render.formats import format_table
from qbench.studies.card.upgrade import missing_keys, mistyped_keys, unknown_keys
from qbench.studies.card.words import decisions_line
from qbench.studies.sweep import decisions_caption, sweep_caption

ROOT = Path(__file__).resolve().parents[3]
CARD = ROOT / "results" / "cards" / "smollm2-135m-standard"  # a card with a sweep beside it


def _row(record: str | None, status: str = "ok", ci: list[float] | None = (0.1, 0.9)) -> dict:
    return {"record": record, "status": status, "decision": {"ci95": None if ci is None else list(ci)}}


def test_each_record_tested_on_an_interval_counts_once():
    rows = [
        _row("m/a.json"),
        _row("m/a.json"),  # the sweep's widest cell, shared by its curves: one test
        _row("m/b.json"),
        _row("m/c.json", status="nonfinite"),  # beyond by its status: no interval, no false within
        _row("m/d.json", ci=None),  # no interval (one window): never within
        _row(None),  # no record path: a row of its own
        _row(None),
    ]
    assert decision_count(rows) == 4
    block = decisions_block(4)
    assert block == {"count": 4, "alpha_one_sided": ALPHA, "expected_false_within_max": 4 * ALPHA}
    text = decisions_text(decisions_block(48), 1.0, "ppl", "cells")
    assert text == (
        "48 verdicts against 1 % (cells), each at a one-sided 2.5 % (a --resolve row over all its looks): were "
        "every one exactly at the tolerance, at most 1.2 of them would be called within on average (48 × 0.025: "
        "an upper bound on the expected false *within* calls)."
    )


def test_the_sweep_says_how_many_verdicts_only_when_it_counted_them():
    sweep = json.loads((CARD / "sweep.json").read_text())
    sweep.pop("decisions", None)  # as a sweep.json written before verdicts were counted
    assert decisions_caption(sweep) == ""  # a sweep.json from before: as it was
    before = sweep_caption(sweep)
    count = decision_count(sweep["cells"])
    assert count == len({c["record"] for c in sweep["cells"]}) < len(sweep["cells"])  # the shared widest cell
    counted = {**sweep, "decisions": decisions_block(count)}
    line = decisions_caption(counted)
    assert line.startswith(f"Decisions: {count} verdicts against 1 % (cells, each record once)")
    assert line in sweep_caption(counted) and sweep_caption(counted).replace(f" {line}", "") == before
    assert decisions_caption({**sweep, "decisions": decisions_block(1)}) == ""  # one verdict: nothing to add


def test_a_card_counts_its_rows_and_its_breaking_points_cells_once_each():
    card = json.loads((CARD / "card.json").read_text())
    sweep = json.loads((CARD / "sweep.json").read_text())
    m = card["models"][0]
    decisions = card_build._decisions(m["formats"], m["kv"], sweep, m["name"])
    formats = {f["record"] for f in m["formats"] if f["status"] == "ok" and f["decision"]["ci95"]}
    kv = {r["record"] for r in m["kv"]["rows"] if r["status"] == "ok" and r["decision"]["ci95"]}
    cells = {c["record"] for c in sweep["cells"] if c["status"] == "ok" and c["decision"]["ci95"]}
    assert decisions["count"] == len(formats | kv | cells) < len(formats) + len(kv) + len(cells)
    assert decisions["expected_false_within_max"] == pytest.approx(decisions["count"] * 0.025)
    assert card_build._decisions(m["formats"], m["kv"], None, m["name"])["count"] == len(formats | kv)
    # the shape declares it (absent from the committed cards: optional), and a look's block with it
    m["decisions"] = decisions
    look = {**Look.planned(2, 3).to_dict(), "df": 15, "critical_t": 2.7, "interval": [0.4, 1.6]}
    m["formats"][0]["resolved"] = [
        {"tokens_scored": 64, "verdict": "undecided", "value": 1.0, "ci95": [0.5, 1.5]},  # a step from before
        {"tokens_scored": 128, "verdict": "beyond", "value": 1.0, "ci95": [0.5, 1.5], "sequential": look},
    ]
    assert unknown_keys(card) == [] and missing_keys(card) == [] and mistyped_keys(card) == []
    m["decisions"] = [decisions]
    assert mistyped_keys(card) == ["models.0.decisions"]


def test_the_card_says_it_in_its_verdict_and_the_rule_in_the_formats_caption():
    card = json.loads((CARD / "card.json").read_text())
    m = card["models"][0]
    decisions = decisions_block(40)
    line = decisions_line(decisions, 1.0)
    assert line.startswith(
        "Decisions: 40 verdicts against 1 % (format and KV rows and the breaking points' cells"
    )
    assert "at most 1 of them would be called within on average (40 × 0.025: an upper bound" in line
    assert decisions_line(decisions_block(1), 1.0) is None and decisions_line(None, 1.0) is None
    lines = card_build.verdict_section(m["formats"], None, 1.0)["lines"]
    assert card_build.verdict_section(m["formats"], None, 1.0, decisions=decisions)["lines"] == [*lines, line]
    # the caption states the rule when the steps hold it; a card from before reads as it did
    before = format_table(m, 0, "1 %").caption
    old = copy.deepcopy(m)
    old["formats"][0]["resolved"] = [
        {"tokens_scored": 64, "verdict": "within", "value": 0.1, "ci95": [0, 0.2]}
    ]
    caption = format_table(old, 0, "1 %").caption
    assert "--resolve" in caption and "--resolve" not in before and "Bonferroni" not in caption
    new = copy.deepcopy(old)
    new["formats"][0]["resolved"][0]["sequential"] = Look.planned(2, 3).to_dict()
    caption = format_table(new, 0, "1 %").caption
    assert "Each look at a one-sided α of 0.025/3 = 0.0083 (Bonferroni over the 3 planned looks)" in caption
    assert "at most 2.5 % of the time over all its looks" in caption


def test_a_sweep_with_resolve_decides_at_its_looks_and_counts_its_verdicts(ckpt_dir, tmp_path):
    from qbench.eval.metrics import Protocol
    from qbench.studies.sweep import SweepConfig, run_sweep

    base = dict(
        models=[str(ckpt_dir)],
        axes=["w"],
        bits=[8, 4],
        protocol=Protocol(tokens=64, window=32, batch_size=2, outlier_windows=1),
        attention=False,
    )
    first = run_sweep(SweepConfig(**base, output_path=tmp_path / "a"))
    assert first["decisions"] == decisions_block(decision_count(first["cells"]))
    tolerance = first["cells"][-1]["ppl_change_pct"]  # the 4-bit cell's own change: undecided at every look
    swept = run_sweep(
        SweepConfig(**base, output_path=tmp_path / "b", tolerance=tolerance, resolve_tokens=256)
    )
    row = swept["cells"][-1]
    steps = row["resolved"]
    looks = [s["sequential"] for s in steps]
    assert [s["look"] for s in looks] == list(range(1, len(steps) + 1)) and len(steps) >= 2
    assert all(s["rule"] == "bonferroni" and s["looks"] == 3 for s in looks)  # 64, 128, 256 tokens
    assert all(s["alpha_one_sided"] == pytest.approx(ALPHA / 3) for s in looks)
    assert row["verdict"] == steps[-1]["verdict"] and "sequential" not in row["decision"]
    stored = json.loads((tmp_path / "b" / row["record"]).read_text())
    assert "sequential" not in stored  # the look lives in the row's steps, never in the record on disk
    assert decide(stored, tolerance).sequential is None
    assert swept["decisions"]["count"] == decision_count(swept["cells"]) == 2
    page = (tmp_path / "b" / "sweep.md").read_text()
    assert "(Bonferroni over the 3 planned looks)" in page
    assert "Decisions: 2 verdicts against" in page and "(2 × 0.025: an upper bound" in page
