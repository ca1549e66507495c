import json
import re

import pytest

from models.errors import UserError
from qbench.eval.evidence import BEYOND, UNDECIDED, WITHIN
from qbench.eval.harness import record_path
from qbench.eval.metrics import Protocol
from qbench.quant.schemes import get_scheme
from qbench.studies.sweep import (
    SweepConfig,
    breaking_point,
    breaking_point_range,
    breaking_points,
    expected_records,
    format_breaking_point,
    format_change,
    parse_axes,
    parse_bits,
    plan,
    run_sweep,
    sweep_table,
    validate,
    within_tolerance,
    write_outputs,
)

W, B, U = WITHIN, BEYOND, UNDECIDED


def test_breaking_point_is_the_lowest_width_within_there_and_at_every_wider_one():
    assert breaking_point({8: W, 7: W, 6: W, 5: B, 4: B, 3: B, 2: B}) == 6
    assert breaking_point({8: W, 4: W, 2: W}) == 2  # nothing beyond


def test_a_lucky_noisy_cell_below_a_failure_does_not_lower_the_breaking_point():
    assert breaking_point({8: W, 7: W, 6: B, 5: W, 4: W, 3: B}) == 7


def test_breaking_point_is_none_when_the_widest_width_is_not_within():
    assert breaking_point({8: B, 7: W, 6: W}) is None
    assert breaking_point({8: U, 7: W}) is None  # undecided is never rounded into a pass


def test_undecided_cells_below_the_breaking_point_make_it_a_range():
    assert breaking_point_range({8: W, 7: W, 6: U, 5: U, 4: B}) == (7, 5)
    assert breaking_point_range({8: W, 6: U, 4: W, 2: B}) == (8, 4)
    assert breaking_point_range({8: W, 6: W, 4: B}) == (6, 6)
    assert format_breaking_point({"bits": 7, "possible_bits": 5, "lowest_swept": 2}) == "7 (5?)"
    assert format_breaking_point({"bits": None, "possible_bits": 8, "lowest_swept": 2}) == "none (8?)"
    assert format_breaking_point({"bits": 4, "possible_bits": 2, "lowest_swept": 2}) == "4 (≤2?)"


def test_a_cell_at_exactly_the_tolerance_passes():
    exact = (101.0 / 100.0 - 1) * 100  # how the harness computes +1 %: 1.0000000000000009 in floats
    assert exact > 1.0 and within_tolerance(exact, 1.0)
    assert within_tolerance((100.5 / 100.0 - 1) * 100, 0.5) and within_tolerance(0.0, 0.0)
    # the slack is 1e-9 relative, not a rounding of the tolerance: a millionth of a point over still fails
    assert not within_tolerance(1.000001, 1.0) and not within_tolerance(1.0 + 1e-8, 1.0)
    assert not within_tolerance(2.000001, 2.0) and not within_tolerance(1e-6, 0.0)
    assert not within_tolerance(None, 1.0) and not within_tolerance(float("nan"), 1.0)
    assert not within_tolerance(float("inf"), 1.0) and within_tolerance(-3.0, 1.0)


def test_changes_near_the_tolerance_show_the_digits_that_decide_them():
    exact = (101.0 / 100.0 - 1) * 100
    assert format_change(exact, 1.0) == "+1.000 %"  # passes, and shows as exactly the tolerance
    assert format_change(1.004, 1.0) == "+1.004 %"  # fails: two decimals (+1.00) would hide why
    assert format_change(1.0004, 1.0) == "+1.0004 %"  # +1.000 would read as a pass
    assert format_change(1.0000004, 1.0) == "+1.0000004 %"
    assert format_change(0.996, 1.0) == "+0.996 %"
    assert format_change(1.01, 1.0) == "+1.01 %" and format_change(21.6, 1.0) == "+21.60 %"
    assert format_change(-0.4, 1.0) == "-0.40 %" and format_change(2.0049, 2.0) == "+2.005 %"
    # a sweep.json from before intervals shows its point changes so, and decides nothing it cannot
    sweep = _synthetic_sweep(intervals=False)
    for c in sweep["cells"]:
        if (c["model"], c["axis"], c["bits"]) == ("vanilla", "all", 6):
            c["ppl_change_pct"] = exact
        if (c["model"], c["axis"], c["bits"]) == ("vanilla", "all", 4):
            c["ppl_change_pct"] = 1.0004
    sweep["breaking_points"] = breaking_points(sweep["cells"], 1.0)
    table = sweep_table(sweep)
    (row,) = [line for line in table.splitlines() if line.startswith("| vanilla ") and " all " in line]
    assert "+1.000 %" in row and "+1.0004 %" in row and row.rstrip(" |").endswith("none (≤2?)")


def test_an_undecided_cell_is_shown_as_such_and_never_passes():
    sweep = _synthetic_sweep()
    for c in sweep["cells"]:
        if (c["model"], c["axis"], c["bits"]) == ("vanilla", "all", 6):
            c.update(ppl_change_pct=0.97, ppl_change_ci95=[0.41, 1.53], verdict=UNDECIDED)
    sweep["breaking_points"] = breaking_points(sweep["cells"], 1.0)
    table = sweep_table(sweep)
    (row,) = [line for line in table.splitlines() if line.startswith("| vanilla ") and " all " in line]
    assert "+0.97 ±0.56 ?" in row and row.rstrip(" |").endswith("8 (6?)")
    _assert_table_matches(table, sweep)


def _cell(model, family, axis, bits, change, status="ok"):
    return {
        "model": model,
        "family": family,
        "axis": axis,
        "bits": bits,
        "ppl_change_pct": change,
        "ppl_ratio": None if change is None else 1 + change / 100,
        "status": status,
        "eval_vs_float": 1.2,
    }


def _synthetic_sweep(intervals=True):
    cells = []
    for model, scale in (("vanilla", 1.0), ("paper", 0.2)):
        for b, change in zip((8, 6, 4, 2), (0.02, 0.8, 21.6, 400.0), strict=True):
            cells.append(_cell(model, "absmax-coarse", "all", b, change * scale))
        for b, change in zip((8, 6, 4, 2), (0.0, 0.1, 3.0, None), strict=True):
            cells.append(_cell(model, "fp", "kv", b, change, "ok" if change is not None else "nonfinite"))
    for c in cells if intervals else []:  # narrow intervals: each verdict is its point change's
        if c["status"] == "ok":
            ci = [c["ppl_change_pct"] - 0.05, c["ppl_change_pct"] + 0.05]
            c.update(ppl_change_ci95=ci, verdict=WITHIN if ci[1] <= 1.0 else BEYOND)
        else:
            c["verdict"] = BEYOND
    protocol = {"corpus": "embedded", "split": "validation", "tokens_scored": 8191, "window": 128}
    return {
        "command": "qbench sweep --ckpt vanilla --ckpt paper",
        "tolerance_pct": 1.0,
        "bits": [8, 6, 4, 2],
        "models": {m: {"fp_perplexity": 300.0, "protocol": protocol} for m in ("vanilla", "paper")},
        "cells": cells,
        "breaking_points": breaking_points(cells, 1.0),
        "skipped": [],
    }


def test_breaking_points_per_model_family_axis_and_their_display():
    sweep = _synthetic_sweep()
    found = {(p["model"], p["axis"]): p for p in sweep["breaking_points"]}
    assert found["vanilla", "all"]["bits"] == 6 and found["paper", "all"]["bits"] == 6  # paper: 4 bits +4.3 %
    assert found["vanilla", "kv"]["bits"] == 6  # 4 bits +3 %, 2 bits NaN
    assert all(p["tolerance_pct"] == 1.0 for p in found.values())
    assert format_breaking_point({"bits": None, "lowest_swept": 2}) == "none"
    assert format_breaking_point({"bits": 2, "lowest_swept": 2}) == "≤2"
    assert format_breaking_point({"bits": 4, "lowest_swept": 2}) == "4"


def test_table_and_plot_are_generated_from_the_json(tmp_path):
    sweep = _synthetic_sweep()
    paths = write_outputs(sweep, tmp_path)
    assert paths["png"].stat().st_size > 10_000 and paths["png"].read_bytes()[:4] == b"\x89PNG"
    assert json.loads(paths["json"].read_text()) == sweep
    _assert_table_matches(paths["md"].read_text(), sweep)


def _assert_table_matches(text: str, sweep: dict) -> None:
    """Every change in the markdown table equals its JSON cell (to the decimals shown), and so does every breaking
    point."""
    lines = [line for line in text.splitlines() if line.startswith("| ") and "---" not in line]
    header = [h.strip() for h in lines[0].strip("|").split("|")]
    cells = {(c["model"], c["family"], c["axis"], c["bits"]): c for c in sweep["cells"]}
    points = {(p["model"], p["family"], p["axis"]): p for p in sweep["breaking_points"]}
    assert len(lines) - 1 == len(points)
    for line in lines[1:]:
        row = dict(zip(header, (v.strip() for v in line.strip("|").split("|")), strict=True))
        key = (row["model"], row["family"], row["axis"])
        for b in sweep["bits"]:
            cell = cells.get((*key, b))
            if cell is None:
                assert row[f"{b} bit"] == "-"
            elif cell["status"] == "nonfinite":
                assert row[f"{b} bit"] == "NaN"
            elif "verdict" in cell:  # the change ± its interval's half-width, and the verdict's mark
                text = re.fullmatch(r"([+-]\d+\.\d\d) ±(\d+\.\d\d)( \?| ✗)?", row[f"{b} bit"])
                assert float(text.group(1)) == round(cell["ppl_change_pct"], 2)
                low, high = cell["ppl_change_ci95"]
                assert float(text.group(2)) == round((high - low) / 2, 2)
                assert (text.group(3) or "") == {WITHIN: "", UNDECIDED: " ?", BEYOND: " ✗"}[cell["verdict"]]
            else:  # at least 2 decimals, and enough to pass or fail as the cell itself does
                text = re.fullmatch(r"([+-]\d+\.(\d\d+)) %", row[f"{b} bit"])
                value, decimals = float(text.group(1)), len(text.group(2))
                assert value == round(cell["ppl_change_pct"], decimals)
                tol = sweep["tolerance_pct"]
                assert within_tolerance(value, tol) == within_tolerance(cell["ppl_change_pct"], tol)
        (bp_header,) = [h for h in header if h.startswith("breaking point")]
        assert row[bp_header] == format_breaking_point(points[key])


def test_axes_and_bits_parsing_and_errors():
    assert parse_axes("w,all") == ["w", "all"] and parse_axes(["w", "kv,w"]) == ["w", "kv"]
    assert parse_bits("8-2") == [8, 7, 6, 5, 4, 3, 2] and parse_bits("4,8,6") == [8, 6, 4]
    with pytest.raises(UserError, match="did you mean 'all'"):
        parse_axes("al")
    with pytest.raises(UserError, match="out of range"):
        parse_bits("9,4")
    with pytest.raises(UserError, match="bad bit width"):
        parse_bits("eight")


def test_plan_keeps_the_family_bits_on_other_axes_and_skips_float_tensors():
    cells, skipped = plan(["absmax-coarse", "zeropoint-int4"], ["w", "a", "all"], [8, 4])
    schemes = {(c.curve.family, c.curve.axis, c.bits): c.scheme for c in cells}
    assert schemes["absmax-coarse", "w", 8] == "absmax-coarse"  # the family itself: its cell is shared
    assert schemes["absmax-coarse", "w", 4] == "absmax-coarse:w=4"
    assert schemes["absmax-coarse", "a", 4] == "absmax-coarse:a=4"
    assert schemes["absmax-coarse", "all", 4] == "absmax-coarse:w=4,a=4,o=4"
    assert schemes["zeropoint-int4", "w", 8] == "zeropoint-int4:w=8"
    assert schemes["zeropoint-int4", "all", 4] == "zeropoint-int4"
    assert ("zeropoint-int4", "a", 8) not in schemes
    assert skipped == ["zeropoint-int4 a: zeropoint-int4 keeps that tensor in float"]


def test_a_family_with_its_own_bits_has_them_replaced_on_the_swept_axis():
    cells, _ = plan(["absmax-coarse:w=4", "absmax-coarse:W=4,a=6"], ["w", "all"], [8, 4, 2])
    names = {(c.curve.family, c.curve.axis, c.bits): get_scheme(c.scheme).name for c in cells}
    assert names["absmax-coarse:w=4", "w", 8] == "absmax-coarse"  # w=4 replaced by 8: the plain family
    assert names["absmax-coarse:w=4", "w", 4] == "absmax-coarse:w=4"
    assert names["absmax-coarse:w=4", "w", 2] == "absmax-coarse:w=2"
    assert names["absmax-coarse:w=4", "all", 2] == "absmax-coarse:a=2,o=2,w=2"
    # the family's other overrides stay: a=6 on the w axis, and the swept key spelled W= is replaced too
    assert names["absmax-coarse:W=4,a=6", "w", 8] == "absmax-coarse:a=6"
    assert names["absmax-coarse:W=4,a=6", "w", 2] == "absmax-coarse:a=6,w=2"
    assert names["absmax-coarse:W=4,a=6", "all", 8] == "absmax-coarse"
    cfg = SweepConfig(models=["m"], families=["absmax-coarse:w=4"], axes=["w", "all"], bits=[8, 4])
    assert len(validate(cfg)) == 4  # every scheme builds: no "override key 'w' is given twice"
    # w=8 on both axes is absmax-coarse itself, all=4 is a=4,o=4,w=4: the float baseline and 3 schemes
    assert expected_records(cfg) == 1 + 3


MICRO = Protocol(tokens=64, window=32, outlier_windows=2)


def test_a_sweep_writes_one_record_per_cell_and_a_rerun_reuses_them_all(ckpt_dir, tmp_path):
    out = tmp_path / "sweep"
    cfg = SweepConfig(
        models=[str(ckpt_dir)],
        axes=["w", "o", "all", "kv"],
        bits=[8, 4, 2],
        kv_keep_first=[1],
        kv_keep_sinks=[1],
        kv_granularity="kivi:group=8,residual=8",  # the default residual (128) covers a 32-token window
        protocol=MICRO,
        output_path=out,
    )
    seen: list[tuple[str, bool]] = []
    sweep = run_sweep(cfg, on_record=lambda r, reused: seen.append((r["scheme"]["name"], reused)))
    assert len(sweep["cells"]) == 6 * 3  # (axes w, o, all, kv, kv-keep1, kv-sinks1) x bits
    unique = {c["scheme"] for c in sweep["cells"]}
    assert len(unique) == 3 * 2 + 1 + 3 * 3  # the 8-bit cell of every axis is absmax-coarse itself
    records = sorted((out / ckpt_dir.name).glob("*__fake.json"))
    assert records == sorted(record_path(out, ckpt_dir.name, s, "fake") for s in unique)
    for cell in sweep["cells"]:
        record = json.loads((out / cell["record"]).read_text())
        assert record["metrics"]["ppl_change_pct"] == cell["ppl_change_pct"]
        assert record["scheme"]["name"] == cell["scheme"]
    assert {c["scheme"] for c in sweep["cells"] if c["bits"] == 4} == {
        "absmax-coarse:w=4",
        "absmax-coarse:o=4",
        "absmax-coarse:a=4,o=4,w=4",
        "fp+kv4-g8r8",
        "fp+kv4-g8r8-keep1",
        "fp+kv4-g8r8-sinks1",
    }
    kv = {c["axis"]: c["kv"] for c in sweep["cells"] if c["bits"] == 2 and c["family"] == "fp"}
    assert (kv["kv"]["bits"], kv["kv"]["keep_first"], kv["kv-keep1"]["keep_first"]) == (2, 0, 1)
    assert (kv["kv-sinks1"]["keep_sinks"], kv["kv-sinks1"]["keep_first"]) == (1, 0)
    assert not any(reused for name, reused in seen if name != "fp")
    written = json.loads((out / "sweep.json").read_text())
    assert written["tolerance_pct"] == 1.0 and written["env"]["git_commit"] == sweep["env"]["git_commit"]
    assert written["models"][ckpt_dir.name]["protocol"]["tokens_scored"] == 64
    assert (out / "sweep.png").read_bytes()[:4] == b"\x89PNG"
    _assert_table_matches((out / "sweep.md").read_text(), written)

    seen.clear()
    again = run_sweep(cfg, on_record=lambda r, reused: seen.append((r["scheme"]["name"], reused)))
    quantised = [reused for name, reused in seen if name != "fp"]
    assert quantised and all(quantised)  # every cell reused
    assert [c["ppl_change_pct"] for c in again["cells"]] == [c["ppl_change_pct"] for c in sweep["cells"]]


def test_bad_family_fails_before_any_model_loads(tmp_path):
    cfg = SweepConfig(models=["no/such/model"], families=["absmax-coarse:w=9"], output_path=tmp_path / "s")
    with pytest.raises(UserError, match="w='9'"):
        run_sweep(cfg)
    assert not (tmp_path / "s").exists()


def test_sweep_command_then_compare_and_score_show_the_breaking_points(ckpt_dir, tmp_path, capsys):
    from qbench.cli import main

    res, fast = tmp_path / "res", ["--tokens", "64", "--window", "32", "--no-attention"]
    assert (
        main(["run", "--ckpt", str(ckpt_dir), "--scheme", "absmax-coarse", "--output-path", str(res), *fast])
        == 0
    )
    argv = [
        "sweep",
        "--ckpt",
        str(ckpt_dir),
        "--axes",
        "w",
        "--bits",
        "8,2",
        "--output-path",
        str(res / "sweep"),
    ]
    assert main([*argv, *fast]) == 0
    out = capsys.readouterr().out
    assert "of fp" in out and "breaking point" in out  # times as ratios, then the table
    sweep = json.loads((res / "sweep" / "sweep.json").read_text())
    (point,) = sweep["breaking_points"]
    shown = format_breaking_point(point)

    assert main(["compare", str(res), "--format", "csv", "--breaking-points"]) == 0
    header, row = capsys.readouterr().out.strip().splitlines()
    assert "absmax-coarse/fake" in header and "@" not in header  # the sweep's own cells stay out
    assert header.endswith("break absmax-coarse w (≤ 1 %)") and row.endswith(f",{shown}")

    score = ["score", "--ckpt", str(ckpt_dir), "--scheme", "int4", "--output-path", str(res), *fast]
    assert main([*score, "--sweep", str(res / "sweep"), "--json", str(tmp_path / "s.json")]) == 0
    assert f"absmax-coarse w: {shown} bits" in capsys.readouterr().out
    assert json.loads((tmp_path / "s.json").read_text())["breaking_points"] == [point]


def test_sweep_command_with_a_family_that_sets_the_swept_axis(ckpt_dir, tmp_path):
    from qbench.cli import main

    out = tmp_path / "sweep"
    argv = ["sweep", "--ckpt", str(ckpt_dir), "--family", "absmax-coarse:w=4", "--axes", "w", "--bits", "8,4"]
    assert main([*argv, "--output-path", str(out), "--tokens", "64", "--window", "32", "--no-attention"]) == 0
    cells = json.loads((out / "sweep.json").read_text())["cells"]
    assert [(c["bits"], c["scheme"]) for c in cells] == [(8, "absmax-coarse"), (4, "absmax-coarse:w=4")]


def test_the_kv_axis_takes_its_own_widths_from_kv_bits():
    from qbench.studies.sweep import plan

    cells, _ = plan(["absmax-coarse"], ["kv"], [8, 7, 6], kv_bits=[4, 2])
    assert [c.bits for c in cells] == [4, 2]  # not 8 and 6, the KV widths among --bits
    cells, _ = plan(["absmax-coarse"], ["kv"], [8, 7, 6])
    assert [c.bits for c in cells] == [8, 6]
    with pytest.raises(UserError, match="--kv-bits 5 is not a KV-cache width"):
        plan(["absmax-coarse"], ["kv"], [8], kv_bits=[5])


def test_the_kv_axis_default_follows_the_window():
    from qbench.quant.kv import KVConfig
    from qbench.studies.sweep import default_kv_scheme

    assert default_kv_scheme(1024) == "kivi"
    assert KVConfig(2, default_kv_scheme(128)).residual == 32 < 128  # R = 128 would quantise nothing
    assert default_kv_scheme(32) == "per-token"


def test_several_kv_schemes_and_sink_protection_each_get_their_curves():
    """One sweep compares KV-cache schemes: every scheme gets kv / kv-keepK / kv-sinksK curves named after it,
    the FP8 caches only at 8 bits (the width they store)."""
    schemes = ["kivi:group=32,residual=32", "per-token", "fp8-e4m3"]
    cells, skipped = plan(["absmax-coarse"], ["kv"], [8, 4, 2], [1], None, schemes, [1])
    axes = {c.curve.axis: [x.bits for x in cells if x.curve == c.curve] for c in cells}
    assert axes["kv (per-token)"] == axes["kv-sinks1 (kivi:group=32,residual=32)"] == [8, 4, 2]
    assert axes["kv-keep1 (fp8-e4m3)"] == axes["kv-sinks1 (fp8-e4m3)"] == [8]
    assert len(axes) == 3 * 3 and not skipped
    sinks = next(c for c in cells if c.curve.axis == "kv-sinks1 (per-token)")
    assert (sinks.curve.keep_first, sinks.curve.keep_sinks, sinks.curve.kv_scheme) == (0, 1, "per-token")
    # one scheme: the curves keep their plain names, as before
    cells, _ = plan(["absmax-coarse"], ["kv"], [4], [1], None, ["per-token"], [2])
    assert [c.curve.axis for c in cells] == ["kv", "kv-keep1", "kv-sinks2"]
    _, skipped = plan(["absmax-coarse"], ["kv"], [4], (), None, ["fp8-e5m2"])
    assert skipped == ["kv (fp8-e5m2): stores 8 bits only, and 8 is not swept"]
    with pytest.raises(UserError, match="--kv-keep-sinks must be ≥ 0"):
        plan(["absmax-coarse"], ["kv"], [4], (), None, [None], [-1])


@pytest.mark.parametrize(("metric", "default"), [("kld", 0.01), ("top1", 1.0)])
def test_sweep_metric_decides_on_that_metric_with_its_default_tolerance(metric, default, ckpt_dir, tmp_path):
    from qbench.cli import main
    from qbench.eval.evidence import decide

    out = tmp_path / "sweep"
    argv = ["sweep", "--ckpt", str(ckpt_dir), "--axes", "w", "--bits", "8,2", "--metric", metric]
    argv += ["--tokens", "128", "--window", "32", "--no-attention", "--output-path", str(out)]
    assert main(argv) == 0
    sweep = json.loads((out / "sweep.json").read_text())
    assert sweep["metric"] == metric and sweep["tolerance_pct"] == default
    for cell in sweep["cells"]:
        record = json.loads((out / cell["record"]).read_text())
        assert cell["verdict"] == decide(record, default, metric).verdict
    assert all(p["metric"] == metric for p in sweep["breaking_points"])
    assert main([*argv[:-1], str(tmp_path / "bad"), "--tolerance", "-1"]) == 2


def test_sweep_takes_the_calibration_flags_every_command_takes():
    """--calib-data / --calib-tokens reach the sweep's grids (calibrated schemes and fp8 scale=calib KV cells)."""
    from qbench.cli import build_parser
    from qbench.cli.sweep import sweep_config
    from qbench.quant.calibrate import CalibrationData
    from qbench.studies.sweep import _grid_spec

    args = build_parser().parse_args(
        ["sweep", "--ckpt", "m", "--calib-data", "embedded", "--calib-tokens", "256", "--tokens", "64"]
    )
    cfg = sweep_config(args)
    assert cfg.calibration == CalibrationData("embedded", 256)
    assert _grid_spec(cfg, ["m"], ["absmax-coarse"]).calibration == CalibrationData("embedded", 256)
