"""A probe of the card's surface: a transform that quantises nothing, a card or map of a
model with NaN weights, --calib-data on a budget that calibrates nothing, the tolerance's unit per metric, the KV
footer of ``qbench compare`` and the breaking points' unit. Micro models: seconds each."""

from __future__ import annotations

import json

import pytest
import torch

from models.checkpoint import save_checkpoint
from qbench.cli import main
from tests.qbench.conftest import micro_config, trained_like

FAST = ["--tokens", "64", "--window", "32", "--batch-size", "2"]


def _error(err: str) -> str:
    lines = [line for line in err.splitlines() if line.startswith("error:")]
    assert len(lines) == 1 and "Traceback" not in err, err
    return lines[0]


@pytest.fixture(scope="module")
def nan_ckpt(tmp_path_factory, tokenizer):
    model = trained_like(micro_config("llama"))
    with torch.no_grad():
        model.transformer.h[1].mlp.down_proj.weight[0, 0] = float("nan")
    path = tmp_path_factory.mktemp("nan") / "micro_nan"
    save_checkpoint(path, model, tokenizer, provenance={"training": None})
    return path


@pytest.mark.parametrize(
    "scheme",
    ["absmax-coarse:rotate=quarot,w=none,a=none,o=none", "smoothquant:w=none,a=none,o=none"],
)
def test_a_transform_that_quantises_nothing_is_refused_not_labelled(ckpt_dir, tmp_path, capsys, scheme):
    """Before: a record "quarot", status ok, change 0.0 — the float model under a label, nothing rotated."""
    out = tmp_path / "res"
    code = main(["run", "--ckpt", str(ckpt_dir), *FAST, "--scheme", scheme, "--output-path", str(out)])
    line = _error(capsys.readouterr().err)
    assert code == 2 and "would not apply" in line and "quantise nothing" in line
    assert not out.exists()


def test_the_plain_float_scheme_is_still_accepted():
    from qbench.quant.schemes import get_scheme

    assert get_scheme("absmax-coarse:w=none,a=none,o=none").label == "float"


def test_a_card_of_a_model_with_nan_weights_is_refused_before_any_cell(nan_ckpt, tmp_path, capsys):
    out = tmp_path / "card"
    code = main(["card", "--ckpt", str(nan_ckpt), "--tokens", "64", "--output-path", str(out)])
    line = _error(capsys.readouterr().err)
    assert code == 2 and "NaN/inf" in line and "transformer.h.1.mlp.down_proj.weight" in line
    assert not out.exists() or not list(out.rglob("*.json"))  # refused before the float cell


def test_a_sensitivity_map_of_a_model_with_nan_weights_is_refused(nan_ckpt, tmp_path, capsys):
    out = tmp_path / "sens"
    argv = [
        "sensitivity",
        "--ckpt",
        str(nan_ckpt),
        *FAST,
        "--scheme",
        "absmax-fine",
        "--output-path",
        str(out),
    ]
    code = main(argv)
    line = _error(capsys.readouterr().err)
    assert code == 2 and "NaN/inf" in line and "down_proj" in line


def test_the_float_model_that_cannot_be_scored_stops_a_study():
    from models.errors import UserError
    from qbench.eval.harness import refuse_unscorable

    refuse_unscorable("m", {"status": "ok"}, "a card")
    with pytest.raises(UserError, match=r"m: the float model cannot be scored \(perplexity is nan"):
        refuse_unscorable("m", {"status": "nonfinite", "error": "perplexity is nan"}, "a card")


def test_calib_data_on_a_budget_that_calibrates_nothing_is_refused(ckpt_dir, tmp_path, capsys):
    calib = tmp_path / "calib.txt"
    calib.write_text("some text " * 200)
    out = tmp_path / "card"
    code = main(["card", "--ckpt", str(ckpt_dir), "--calib-data", str(calib), "--output-path", str(out)])
    line = _error(capsys.readouterr().err)
    assert code == 2 and "--calib-data" in line and "'quick' calibrates nothing" in line and not out.exists()


def test_a_budget_with_calibrated_rows_takes_calib_data():
    from qbench.studies.card.config import CardConfig, calibrates

    assert calibrates(CardConfig(models=["m"], budget="standard"))  # GPTQ / AWQ / SmoothQuant rows
    assert not calibrates(CardConfig(models=["m"], budget="quick"))
    quick = CardConfig(models=["m"], budget="quick", kv_scheme="fp8-e4m3:scale=calib")
    assert calibrates(quick)  # a calibrated FP8 cache reads calibration windows


@pytest.mark.parametrize(
    ("metric", "tolerance", "valid"),
    [("top1", "150", "a share from 0 to 100"), ("kld", "-1", "a finite number ≥ 0"), ("ppl", "inf", "≥ 0")],
)
def test_the_tolerance_error_states_the_metrics_valid_range(
    ckpt_dir, tmp_path, capsys, metric, tolerance, valid
):
    argv = ["card", "--ckpt", str(ckpt_dir), "--metric", metric, "--tolerance", tolerance]
    code = main([*argv, "--output-path", str(tmp_path / "c")])
    line = _error(capsys.readouterr().err)
    assert code == 2 and f"--tolerance {float(tolerance):g} is out of range for --metric {metric}" in line
    assert valid in line
    assert "give ≥ 0" not in line or metric != "top1"


def _kv_record(scheme: str, bits: int) -> dict:
    from qbench.quant.kv import KVConfig

    kv = KVConfig(bits, scheme, 0, 0).to_dict()
    protocol = {"corpus": "embedded", "split": "validation", "tokens_scored": 64, "window": 32, "stride": 32}
    return {"kv": kv, "scheme": {"name": "fp"}, "protocol": {**protocol, "bos": True, "dtype": "float32"}}


def test_the_compare_footer_describes_each_kv_scheme_from_its_record():
    """Before: one fixed sentence ("keys per channel over the scored window") for every cache, KIVI's streaming
    groups included."""
    from qbench.eval.report import caption

    text = caption([_kv_record("kivi", 2), _kv_record("per-token", 4)])
    assert "over the scored window" not in text
    assert "KIVI streaming" in text and "groups of G" in text
    assert "q8_0/q4_0/q4_1" in text  # the per-token blocks' own description
    assert caption([{**_kv_record("kivi", 2), "kv": None}]).count("KV cache") == 0


def test_breaking_points_of_a_kld_sweep_are_in_nats():
    from qbench.studies.sweep import breaking_point_columns, describe_breaking_points

    point = {"model": "m", "family": "absmax-coarse", "axis": "w", "bits": 4, "possible_bits": 4}
    point |= {"decided": True, "widest": 8, "lowest_swept": 2, "tolerance_pct": 0.05, "metric": "kld"}
    line = describe_breaking_points([point])
    assert "KLD 0.05 nats" in line and "%" not in line
    (header,) = breaking_point_columns({"breaking_points": [point], "metric": "kld"})["m"]
    assert "nats" in header and "%" not in header
    ppl = {**point, "metric": "ppl", "tolerance_pct": 1.0}
    assert describe_breaking_points([ppl]).endswith("(≤ 1 %)")


def test_a_kld_sweep_table_heads_its_breaking_point_in_nats():
    from qbench.studies.sweep import sweep_table

    point = {"model": "m", "family": "absmax-coarse", "axis": "w", "bits": None, "possible_bits": None}
    point |= {"decided": True, "widest": 8, "lowest_swept": 8, "tolerance_pct": 0.05, "metric": "kld"}
    sweep = {"tolerance_pct": 0.05, "metric": "kld", "bits": [8], "breaking_points": [point], "cells": []}
    assert "breaking point (≤ KLD 0.05 nats)" in sweep_table(sweep)


def test_score_refuses_a_metric_it_would_ignore(ckpt_dir, tmp_path, capsys):
    """Before: ``score --metric kld`` without --breaking-points ran and ignored the metric."""
    out = tmp_path / "res"
    code = main(["score", "--ckpt", str(ckpt_dir), *FAST, "--metric", "kld", "--output-path", str(out)])
    line = _error(capsys.readouterr().err)
    assert code == 2 and "--metric kld decides breaking points only" in line and not out.exists()


def test_score_refuses_a_tolerance_unlike_its_sweep_files(ckpt_dir, tmp_path, capsys):
    sweep = tmp_path / "sweep.json"
    sweep.write_text(json.dumps({"breaking_points": [], "metric": "ppl", "tolerance_pct": 1.0}))
    argv = ["score", "--ckpt", str(ckpt_dir), *FAST, "--sweep", str(sweep), "--tolerance", "2"]
    code = main([*argv, "--output-path", str(tmp_path / "res")])
    line = _error(capsys.readouterr().err)
    assert code == 2 and "decided its breaking points with --metric ppl --tolerance 1" in line


def test_the_full_cards_speed_record_times_prefill_only(ckpt_dir, tmp_path, monkeypatch):
    """Before: run_speed's KV-cache section ran (minutes of KV generation) and its records were thrown away."""
    from qbench.eval.load import load_model
    from qbench.studies import card, speed
    from qbench.studies.card import profile as card_profile

    calls = []
    monkeypatch.setattr(speed, "run_speed", lambda **kw: calls.append(kw) or [])
    cfg = card.CardConfig(models=[str(ckpt_dir)], budget="full", output_path=tmp_path)
    lm = load_model(str(ckpt_dir))
    fp = {"model": {"fingerprint": "x"}}
    record = card_profile.speed_record(cfg, lm, fp, ["absmax-fine"])
    assert record is not None and record["records"] == []
    (kw,) = calls
    assert kw["kv"] is False and kw["generate"] is False and kw["layer"] is False


@pytest.mark.parametrize(("text", "needle"), [(b"", "holds 0 tokens"), (b"\x00\x01bin", "binary file")])
def test_run_refuses_calibration_text_that_holds_no_window(ckpt_dir, tmp_path, capsys, text, needle):
    """Before: the GPTQ cell was recorded "unsupported" after the float evaluation, with exit status 0."""
    calib, out = tmp_path / "calib.txt", tmp_path / "res"
    calib.write_bytes(text)
    argv = [
        "run",
        "--ckpt",
        str(ckpt_dir),
        *FAST,
        "--scheme",
        "zeropoint-int4:algo=gptq",
        "--calib-data",
        str(calib),
    ]
    code = main([*argv, "--output-path", str(out)])
    line = _error(capsys.readouterr().err)
    assert code == 2 and f"--calib-data '{calib}'" in line and needle in line and not out.exists()
