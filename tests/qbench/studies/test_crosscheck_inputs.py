"""``scripts/crosscheck_inputs.py`` writes the very windows a qbench cell calibrates and is scored on: another tool
that scores EVAL's marked positions gets qbench's own float NLL, and CALIB is the cell's calibration sample."""

from __future__ import annotations

import importlib.util
import json
import math
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

import qbench

ROOT = Path(__file__).resolve().parents[3]


def _script():
    spec = importlib.util.spec_from_file_location(
        "crosscheck_inputs", ROOT / "scripts" / "crosscheck_inputs.py"
    )
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_written_windows_reproduce_qbench_numbers(ckpt_dir, tmp_path):
    out = tmp_path / "x"
    argv = ["--ckpt", str(ckpt_dir), "--scheme", "zeropoint-int4:algo=gptq", "--tokens", "256"]
    assert _script().main([*argv, "--calib-tokens", "96", "--output-path", str(out)]) == 0
    ev, cal = load_file(out / "eval.safetensors"), load_file(out / "calib.safetensors")
    meta = json.loads((out / "windows.json").read_text())
    assert cal["ids"].shape == (3, 32) and meta["calibration"]["windows"] == 3  # 96 tokens: 3 windows of 32
    # score EVAL as a foreign tool would: -log p(ids[t] | ids[:t]) at the marked positions
    lm = qbench.load(str(ckpt_dir))
    with torch.no_grad():
        logits = lm.model(ev["ids"][:, :-1]).float()
    logp = torch.log_softmax(logits, -1).gather(-1, ev["ids"][:, 1:, None])[..., 0]
    nll = -logp[ev["scored"][:, 1:]].mean().item()
    record = qbench.evaluate(str(ckpt_dir), None, tokens=256, attention=False)
    assert math.exp(nll) == pytest.approx(record["metrics"]["perplexity"], rel=1e-5)
    assert int(ev["scored"].sum()) == record["metrics"]["tokens"]


def test_a_bad_scheme_is_one_line(ckpt_dir, tmp_path, capsys):
    code = _script().main(
        ["--ckpt", str(ckpt_dir), "--scheme", "zeropiont-int4", "--output-path", str(tmp_path)]
    )
    assert code == 2 and "did you mean" in capsys.readouterr().err
