"""The top-level Python API: qbench.quantize / load / evaluate, imported lazily."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

import qbench
from models import UserError

SMALL = {"tokens": 64, "window": 32, "batch_size": 2, "attention": False}


def test_import_qbench_stays_light():
    """``import qbench`` must not pull the harness or the quantisers; touching qbench.quantize does."""
    code = (
        "import sys, qbench\n"
        "heavy = [m for m in ('qbench.api', 'qbench.eval.harness', 'qbench.quant') if m in sys.modules]\n"
        "assert not heavy, heavy\n"
        "assert callable(qbench.quantize) and 'qbench.api' in sys.modules\n"
        "print('ok')\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0 and "ok" in result.stdout, result.stderr[-2000:]
    with pytest.raises(AttributeError, match="no attribute 'nope'"):
        qbench.nope  # noqa: B018


def test_quantize_and_load_at_the_top_level(ckpt_dir):
    lm = qbench.load(ckpt_dir)
    q = qbench.quantize(lm.model, "absmax-coarse", mode="fake", exclude=["transformer.h.0.*"])
    assert q is not lm.model
    kinds = {type(m).__name__ for name, m in q.named_modules() if name.startswith("transformer.h.1.")}
    assert "FakeQuantLinear" in kinds
    assert not any(
        type(m).__name__ == "FakeQuantLinear"
        for n, m in q.named_modules()
        if n.startswith("transformer.h.0.")
    )


def test_evaluate_returns_the_harness_record(ckpt_dir, tmp_path, monkeypatch):
    from qbench.eval.harness import GridSpec, run_grid
    from qbench.eval.metrics import Protocol

    monkeypatch.chdir(tmp_path)  # evaluate without output_path writes nothing anywhere
    record = qbench.evaluate(str(ckpt_dir), "absmax-coarse", **SMALL)
    assert not any(tmp_path.iterdir())
    grid = run_grid(
        GridSpec(
            models=[str(ckpt_dir)],
            schemes=["absmax-coarse"],
            protocol=Protocol(tokens=64, window=32, batch_size=2),
            output_path=tmp_path / "grid",
            attention=False,
        )
    )
    assert record["metrics"] == grid[1]["metrics"] and record["protocol"] == grid[1]["protocol"]
    assert record["scheme"] == grid[1]["scheme"] and record["model"] == grid[1]["model"]
    fp = qbench.evaluate(qbench.load(ckpt_dir), None, **SMALL)
    assert fp["metrics"] == grid[0]["metrics"]


def test_evaluate_an_in_memory_model_needs_its_tokenizer(ckpt_dir, tokenizer):
    lm = qbench.load(ckpt_dir)
    with pytest.raises(UserError, match="needs tokenizer"):
        qbench.evaluate(lm.model, "absmax-fine", **SMALL)
    record = qbench.evaluate(lm.model, "absmax-fine", tokenizer=tokenizer, name="mine", **SMALL)
    assert record["model"]["kind"] == "in-memory" and record["model"]["name"] == "mine"
    assert record["metrics"]["perplexity"] == pytest.approx(
        qbench.evaluate(str(ckpt_dir), "absmax-fine", **SMALL)["metrics"]["perplexity"], rel=0, abs=0
    )
    assert torch.is_tensor(next(lm.model.parameters()))
