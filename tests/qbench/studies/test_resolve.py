"""``--resolve``: an undecided cell is re-evaluated at doubling tokens until decided, at the cap, or out of text;
the sweep's and the card's rows then show the deciding evaluation and the steps it took."""

from __future__ import annotations

import json

import pytest

from models.errors import UserError
from qbench.eval.evidence import UNDECIDED, decide
from qbench.studies.resolve import RESOLVE_FACTOR, describe, resolve, resolve_cap


def _record(tokens: int, change: float, half: float) -> dict:
    return {
        "status": "ok",
        "protocol": {"tokens_scored": tokens, "window": 32},
        "metrics": {
            "ppl_change_pct": change,
            "ppl_change_ci95": [change - half, change + half],
            "ln_ppl_ratio": change / 100,
            "interval": {"windows": tokens // 32},
        },
    }


def test_resolve_doubles_until_decided_or_capped_or_out_of_text():
    asked: list[int] = []

    def narrowing(tokens: int) -> dict:  # the interval halves with every doubling
        asked.append(tokens)
        return _record(tokens, 1.2, 0.8 * 128 / tokens)

    start = _record(128, 1.2, 0.8)  # [0.4, 2.0] straddles 1 %
    final, steps = resolve(start, narrowing, 128, 4096, 1.0)
    # 256: [0.8, 1.6]; 512: [1.0, 1.4] (its lower end at the tolerance is not above it); 1024: [1.1, 1.3]
    assert asked == [256, 512, 1024] and decide(final, 1.0).verdict == "beyond"
    assert [s["verdict"] for s in steps] == ["undecided", "undecided", "undecided", "beyond"]
    assert (
        describe(steps) == "undecided at 128 → undecided at 256 → undecided at 512 → beyond at 1,024 tokens"
    )
    asked.clear()
    final, steps = resolve(start, narrowing, 128, 300, 1.0)  # the cap stops it, the last step at the cap
    assert asked == [256, 300] and len(steps) == 3
    asked.clear()
    final, steps = resolve(start, lambda t: asked.append(t) or _record(128, 1.2, 0.8), 128, 4096, 1.0)
    assert asked == [256] and decide(final, 1.0).verdict == UNDECIDED  # the text had no more tokens
    decided = _record(128, 5.0, 0.5)
    assert resolve(decided, narrowing, 128, 4096, 1.0) == (decided, [])  # nothing to resolve


def test_the_cap_is_above_the_start():
    assert resolve_cap(None, 4096) is None
    assert resolve_cap(-1, 4096) == RESOLVE_FACTOR * 4096
    assert resolve_cap(10000, 4096) == 10000
    with pytest.raises(UserError, match="--resolve 4096: the cap must be above the 4,096 tokens"):
        resolve_cap(4096, 4096)


def _undecided_tolerance(cell: dict) -> float:
    """A tolerance at the cell's own point change: its interval straddles it (undecided) at any budget."""
    return cell["ppl_change_pct"]


def test_sweep_resolve_re_evaluates_the_undecided_cells(ckpt_dir, tmp_path):
    from qbench.eval.metrics import Protocol
    from qbench.studies.sweep import SweepConfig, run_sweep

    base = dict(
        models=[str(ckpt_dir)],
        axes=["w"],
        bits=[4],
        protocol=Protocol(tokens=64, window=32, batch_size=2, outlier_windows=1),
        attention=False,
    )
    first = run_sweep(SweepConfig(**base, output_path=tmp_path / "a"))
    (cell,) = first["cells"]
    tolerance = _undecided_tolerance(cell)
    assert decide_row(cell, tolerance) == UNDECIDED
    swept = run_sweep(
        SweepConfig(**base, output_path=tmp_path / "b", tolerance=tolerance, resolve_tokens=256)
    )
    (row,) = swept["cells"]
    steps = row["resolved"]
    assert [s["tokens_scored"] for s in steps] == [64, 128, 256][: len(steps)] and len(steps) >= 2
    assert row["verdict"] == steps[-1]["verdict"] and (row["verdict"] != UNDECIDED or len(steps) == 3)
    stored = json.loads((tmp_path / "b" / row["record"]).read_text())
    assert stored["protocol"]["tokens_scored"] == steps[-1]["tokens_scored"]
    assert "--resolve: 1 undecided cell(s)" in (tmp_path / "b" / "sweep.md").read_text()


def decide_row(row: dict, tolerance: float) -> str:
    return decide(
        {
            "status": row["status"],
            "metrics": {"ppl_change_pct": row["ppl_change_pct"], "ppl_change_ci95": row["ppl_change_ci95"]},
        },
        tolerance,
    ).verdict


def test_card_resolve_shows_the_deciding_evaluation(ckpt_dir, tmp_path):
    from dataclasses import replace

    from qbench.studies.card.config import CardConfig
    from qbench.studies.card.measure import run_card

    # the first windows: on them the micro model's first format loses a little (the tolerance below is its change)
    cfg = CardConfig(
        models=[str(ckpt_dir)], budget="quick", output_path=tmp_path / "a", tokens=64, sample="first"
    )
    plain = run_card(cfg)
    first = plain["models"][0]["formats"][0]
    tolerance = first["ppl_change_pct"]
    cfg = replace(cfg, output_path=tmp_path / "b", tolerance=tolerance, resolve_tokens=256)
    card = run_card(cfg)
    row = card["models"][0]["formats"][0]
    assert row["resolved"] and row["resolved"][0]["tokens_scored"] == 64
    assert row["tokens_scored"] == row["resolved"][-1]["tokens_scored"] > 64
    assert card["resolve_tokens"] == 256
    page = (tmp_path / "b" / "card.md").read_text()
    assert f"@ {row['tokens_scored']:,} tokens" in page and "--resolve" in page


def test_every_look_keeps_the_first_looks_window():
    """The default window grows with the budget (qbench.eval.sampling.default_window): a look at twice the
    tokens must score twice the windows of the same length, or it would add no cluster to the interval."""
    from qbench.studies.card.config import CardConfig
    from qbench.studies.card.measure import _resolve_row

    asked: list[tuple[int, int]] = []

    def evaluate(tokens: int, window: int) -> dict:
        asked.append((tokens, window))
        record = _record(tokens, 1.2, 0.8 * 128 / tokens)
        record["protocol"]["window"] = window
        return {**record, "cell_id": f"c{tokens}"}

    start = {**_record(128, 1.2, 0.8), "cell_id": "c128"}
    start["protocol"]["window"] = 256
    cfg = CardConfig(models=["m"], budget="quick", tokens=128, tolerance=1.0, resolve_tokens=4096)
    _resolve_row(cfg, start, {}, evaluate)
    assert asked and {w for _, w in asked} == {256}
