"""The metric registry names every number a record holds, and the tables and the docs read it."""

from __future__ import annotations

import pytest

from models.errors import UserError
from qbench.eval.harness import GridSpec, run_grid
from qbench.eval.metric_registry import COMPARE_COLUMNS, METRICS, UNIT_STATISTICS, markdown_table, metric
from qbench.eval.metrics import Protocol
from qbench.eval.report import OUTLIER_COLUMNS
from qbench.studies.sensitivity import STATISTICS


def test_every_registered_metric_is_in_a_real_record(ckpt_dir, tmp_path):
    spec = GridSpec(
        models=[str(ckpt_dir)],
        schemes=["absmax-coarse"],
        protocol=Protocol(tokens=64, batch_size=2, outlier_windows=2),
        output_path=tmp_path,
    )
    fp, cell = run_grid(spec)
    for m in METRICS:
        if m.block == "linear_ranges":
            layer = next(iter(fp["linear_ranges"]["per_layer"].values()))
            assert m.key in layer, m.key
        elif m.block == "metrics":
            assert m.key in cell["metrics"], m.key
        else:
            assert m.key in fp[m.block], m.key


def test_tables_read_the_registry():
    assert [key for key, _ in OUTLIER_COLUMNS] == list(COMPARE_COLUMNS)
    assert all(label == metric(key).label for key, label in OUTLIER_COLUMNS)
    assert STATISTICS is UNIT_STATISTICS and set(UNIT_STATISTICS.values()) <= {m.key for m in METRICS}
    with pytest.raises(UserError, match="did you mean 'max_abs'"):
        metric("max_abz")


def test_docs_metrics_page_holds_the_registry_table():
    from pathlib import Path

    page = (Path(__file__).parents[3] / "docs" / "metrics.md").read_text()
    start, end = "<!-- metric-registry:start -->\n", "<!-- metric-registry:end -->"
    assert page[page.index(start) + len(start) : page.index(end)] == markdown_table()
