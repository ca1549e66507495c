"""torchrun + DDP on the CPU (gloo): 2 processes follow the loss curve of 1 process with the same global batch."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from trainers import distributed
from trainers.loop import train
from trainers.state import read_state

from .helpers import MICRO_ARGS, REPO, micro_cfg, read_metrics, subprocess_env


def test_single_process_needs_no_process_group(monkeypatch):
    monkeypatch.delenv("RANK", raising=False)
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    ctx = distributed.setup("cpu")
    assert (ctx.rank, ctx.world_size, ctx.is_main, ctx.distributed) == (0, 1, True, False)
    model = torch.nn.Linear(2, 2)
    assert distributed.wrap(model, ctx) is model
    t = torch.tensor(3.0)
    assert distributed.all_reduce_mean(t, ctx) is t and distributed.all_true(True, ctx)
    assert not torch.distributed.is_initialized()


@pytest.mark.slow
def test_two_cpu_processes_match_one_process(corpus, tmp_path):
    """OrthoAdam (the paper recipe) under DDP with gradient accumulation (no_sync on the first micro-batch)."""
    steps, single, ddp = 4, tmp_path / "single", tmp_path / "ddp"
    cfg = micro_cfg(corpus, steps=steps, eval_every=2, probe_every=2, ckpt_every=2)
    train(cfg, single, progress=False)
    args = ["--preset", "tiny", "--recipe", "paper", *MICRO_ARGS, "--context", "32", "--batch-size", "4"]
    args += ["--grad-accum", "2", "--steps", str(steps), "--data", str(corpus), "--eval-every", "2"]
    args += ["--eval-tokens", "256", "--probe-every", "2", "--probe-batch", "2", "--ckpt-every", "2"]
    launcher = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2"]
    result = subprocess.run([*launcher, "-m", "trainers", *args, "--out", str(ddp)], cwd=REPO,
                            env=subprocess_env(), capture_output=True, text=True, timeout=180)  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    one, two = read_metrics(single), read_metrics(ddp)
    assert [r["step"] for r in two] == list(range(steps + 1))  # rank 0 alone wrote the log
    curves = [
        (a["step"], a["loss"], b["loss"], a["grad_norm"], b["grad_norm"]) for a, b in zip(one[1:], two[1:])
    ]
    for a, b in zip(one[1:], two[1:]):
        assert b["loss"] == pytest.approx(a["loss"], rel=1e-4), curves
    assert two[-1]["val_loss"] == pytest.approx(one[-1]["val_loss"], rel=1e-4)
    state = read_state(ddp)
    assert state["world_size"] == 2 and state["config"]["grad_accum"] == 2 and state["step"] == steps
    assert result.stderr.count("done: step 4/4") == 1  # one summary line, from rank 0
