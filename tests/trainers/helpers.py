"""Shared helpers of the trainer tests: a micro model config, the CLI in a subprocess, the metrics log."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from trainers.loop import TrainConfig

REPO = Path(__file__).resolve().parents[2]
EMBEDDED = REPO / "trainers" / "corpus" / "embedded.jsonl.gz"
# A 2-layer d=64 model of the tiny preset (vocab 8192), 32-token windows: ~60 ms per step on one core.
MICRO = {"n_layer": 2, "d_model": 64, "n_head": 2, "d_ff": 128}
MICRO_ARGS = [arg for k, v in MICRO.items() for arg in ("--set", f"{k}={v}")]


def micro_cfg(corpus: Path, **changes) -> TrainConfig:
    base = dict(
        preset="tiny",
        recipe="paper",
        switches=dict(MICRO),
        context=32,
        batch_size=4,
        steps=8,
        data=str(corpus),
        eval_every=4,
        eval_tokens=256,
        probe_every=4,
        probe_batch=2,
        ckpt_every=4,
    )
    return TrainConfig(**{**base, **changes})


def read_metrics(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def subprocess_env() -> dict[str, str]:
    """The test's environment for a child run: same token cache, one thread (bit-equal to the tests' runs)."""
    return {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}


def run_cli(args: list[str], timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "trainers", *args],
        cwd=REPO,
        env=subprocess_env(),
        capture_output=True,
        text=True,
        timeout=timeout,
    )
