"""The training loop on a micro model: schedule, batches, logging, probes, accumulation, guards, the CLI."""

from __future__ import annotations

import itertools
import json
import math

import numpy as np
import pytest
import torch

from models.checkpoint import load_checkpoint
from models.errors import UserError
from trainers import loop
from trainers.__main__ import main
from trainers.batches import WindowSampler, probe_windows, shard_rows, validation_windows
from trainers.loop import TrainConfig, TrainingDiverged, lr_at, train
from trainers.state import read_state

from .helpers import MICRO_ARGS, micro_cfg, read_metrics, run_cli

# ------------------------------------------------------------------------------------------------------------
# Schedule and batches


def test_lr_schedule_warmup_then_cosine_to_floor():
    cfg = TrainConfig(steps=100, warmup=10, lr=1e-3, min_lr_ratio=0.1)
    lrs = [lr_at(s, cfg) for s in range(1, 101)]
    assert lrs[0] == pytest.approx(1e-4) and lrs[9] == pytest.approx(1e-3)
    assert all(a < b for a, b in itertools.pairwise(lrs[:10]))  # warmup rises
    assert all(a >= b for a, b in itertools.pairwise(lrs[9:]))  # cosine falls
    assert lrs[-1] == pytest.approx(1e-4)
    assert lr_at(55, cfg) == pytest.approx(1e-4 + 0.5 * 9e-4)  # halfway through the cosine


def test_default_budget_and_tokens_round_up():
    assert TrainConfig().total_steps == loop.DEFAULT_STEPS
    cfg = TrainConfig(tokens=16 * 128 * 3 + 1)  # tiny: 16 windows x 128 tokens per step
    assert cfg.total_steps == 4 and cfg.warmup_steps == 0
    with pytest.raises(UserError, match="steps or tokens"):
        TrainConfig(steps=3, tokens=100)


def test_sampler_is_a_function_of_seed_and_step():
    tokens = np.arange(1000, dtype=np.uint16)
    a, b = WindowSampler(tokens, 16, seed=1), WindowSampler(tokens, 16, seed=1)
    assert torch.equal(a.batch(5, 8)[0], b.batch(5, 8)[0])
    assert not torch.equal(a.batch(5, 8)[0], a.batch(6, 8)[0])
    assert not torch.equal(a.batch(5, 8)[0], WindowSampler(tokens, 16, seed=2).batch(5, 8)[0])
    x, y = a.batch(3, 8)
    assert x.shape == y.shape == (8, 16) and x.dtype == torch.int64
    assert torch.equal(x[:, 1:], y[:, :-1]) and torch.equal(y - x, torch.ones_like(x))  # consecutive ids


def test_bos_window_layout():
    tokens = np.arange(10, 510, dtype=np.uint16)
    x, y = WindowSampler(tokens, 8, seed=0, bos_id=0).batch(0, 4)
    assert (x[:, 0] == 0).all() and (y != 0).all()  # BOS opens every window and is never a target
    assert torch.equal(x[:, 1:], y[:, :-1])  # x = [BOS] + the first 7 of the 8 target tokens
    assert torch.equal(y[:, 1:] - y[:, :-1], torch.ones(4, 7, dtype=torch.int64))


def test_shards_and_micro_batches_tile_the_global_batch():
    rows = [shard_rows(12, 2, r, 3, m) for r in range(2) for m in range(3)]
    assert [(s.start, s.stop) for s in rows] == [(i * 2, i * 2 + 2) for i in range(6)]
    with pytest.raises(UserError, match="divisible"):
        shard_rows(10, 2, 0, 3, 0)


def test_validation_and_probe_windows_are_fixed():
    tokens = np.arange(1, 101, dtype=np.uint16)
    x, _ = validation_windows(tokens, 10, None, max_tokens=35)
    assert x.shape == (3, 10) and x[1, 0] == 12  # non-overlapping spans of 11 from the start
    assert validation_windows(tokens, 10, None, max_tokens=10**6)[0].shape == (9, 10)
    p = probe_windows(tokens, 10, 0, 4)
    assert p.shape == (4, 10) and (p[:, 0] == 0).all() and p[-1, -1] == 99
    with pytest.raises(UserError, match="fewer than one window"):
        validation_windows(tokens[:5], 10, None, 100)


# ------------------------------------------------------------------------------------------------------------
# Training


def test_micro_run_logs_probes_and_checkpoints(corpus, tmp_path):
    summary = train(micro_cfg(corpus), tmp_path, progress=False)
    assert summary["complete"] and summary["step"] == 8 and summary["tokens"] == 8 * 4 * 32
    records = read_metrics(tmp_path)
    assert [r["step"] for r in records] == list(range(9))
    assert "loss" not in records[0] and {"val_loss", "probe"} <= set(records[0])
    for r in records[1:]:
        assert {"lr", "loss", "grad_norm", "tokens_per_s", "step_s", "optim_s"} <= set(r)
        assert ("val_loss" in r) == ("probe" in r) == (r["step"] % 4 == 0)
    probe = records[-1]["probe"]
    assert {"kurtosis_first", "kurtosis_other", "max_abs", "first_token_top1_share"} <= set(probe)
    assert records[-1]["val_loss"] < records[0]["val_loss"] < math.log(8192) + 0.5
    ckpt = load_checkpoint(tmp_path)
    assert (
        ckpt.config.attn == "softmax1" and ckpt.config.norm == "rmsnorm_single" and ckpt.config.n_layer == 2
    )
    training = ckpt.provenance["training"]
    assert training["config"]["recipe"] == "paper" and training["optimizer"] == "orthoadam"
    assert training["summary"]["step"] == 8 and training["data"]["train"]["tokens"] > 10_000
    assert read_state(tmp_path)["step"] == 8


def test_grad_accumulation_matches_one_big_batch(corpus, tmp_path):
    one = train(micro_cfg(corpus, steps=3, recipe="vanilla"), tmp_path / "a", progress=False)
    two = train(micro_cfg(corpus, steps=3, recipe="vanilla", grad_accum=2), tmp_path / "b", progress=False)
    la = [r["loss"] for r in read_metrics(tmp_path / "a")[1:]]
    lb = [r["loss"] for r in read_metrics(tmp_path / "b")[1:]]
    assert la == pytest.approx(lb, rel=1e-5) and one["val_loss"] == pytest.approx(two["val_loss"], rel=1e-4)


def test_refuses_a_folder_holding_another_run(corpus, tmp_path):
    train(micro_cfg(corpus, steps=2), tmp_path, progress=False)
    with pytest.raises(UserError, match=r"different configuration \(lr\).*--resume.*--overwrite"):
        train(micro_cfg(corpus, steps=2, lr=1e-3), tmp_path, progress=False)
    with pytest.raises(UserError, match="the same configuration"):
        train(micro_cfg(corpus, steps=2), tmp_path, progress=False)
    summary = train(micro_cfg(corpus, steps=2, lr=1e-3), tmp_path, overwrite=True, progress=False)
    assert summary["complete"] and read_state(tmp_path)["config"]["lr"] == 1e-3
    assert len(read_metrics(tmp_path)) == 3  # the old log is gone


def test_non_finite_loss_stops_and_keeps_last_checkpoint(corpus, tmp_path, monkeypatch):
    real, calls = loop.lm_loss, []

    def loss_that_explodes(model, x, y):
        calls.append(1)
        loss = real(model, x, y)
        return loss * float("nan") if len(calls) > 5 else loss  # training calls 1..5 are steps 1..5

    monkeypatch.setattr(loop, "lm_loss", loss_that_explodes)
    cfg = micro_cfg(corpus, ckpt_every=2, eval_every=100, eval_tokens=32)
    with pytest.raises(TrainingDiverged, match=r"diverged at step 5.*checkpoint \(step 4\) is kept"):
        train(cfg, tmp_path, progress=False)
    assert read_state(tmp_path)["step"] == 4
    assert load_checkpoint(tmp_path).provenance["training"]["summary"]["step"] == 4


def test_bf16_on_cpu_is_refused(corpus, tmp_path):
    with pytest.raises(UserError, match="CUDA-only"):
        train(micro_cfg(corpus, dtype="bfloat16", device="cpu"), tmp_path, progress=False)


# ------------------------------------------------------------------------------------------------------------
# CLI


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--preset", "tinny"], "unknown preset 'tinny' (did you mean 'tiny'?)"),
        (["--recipe", "softmax1-orthoadm"], "(did you mean 'softmax1-orthoadam'?)"),
        (["--optim", "adamv"], "unknown optimizer 'adamv' (did you mean 'adamw'?)"),
        (["--attn", "softmax2"], "unknown value for attn 'softmax2' (did you mean"),
        (["--set", "n_layers=2"], "did you mean 'n_layer'?"),
        (["--set", "n_layer"], "--set expects FIELD=VALUE"),
        ([], "--out is required"),
    ],
)
def test_cli_bad_input_is_one_line_exit_2(args, message, tmp_path, capsys):
    out = [] if not args else ["--out", str(tmp_path / "o")]
    assert main([*args, *out]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and message in err and err.count("\n") == 1
    assert not (tmp_path / "o" / "metrics.jsonl").exists()


def test_cli_list(capsys):
    assert main(["--list"]) == 0
    text = capsys.readouterr().out
    assert "softmax1-orthoadam" in text and "sgd-momentum" in text and "embedded" in text


def test_cli_trains_with_overrides(corpus, tmp_path, capsys):
    args = ["--preset", "tiny", "--recipe", "softmax1-orthoadam", "--norm", "rmsnorm", "--optim", "adamw"]
    args += [*MICRO_ARGS, "--context", "32", "--batch-size", "2", "--steps", "2", "--data", str(corpus)]
    assert main([*args, "--out", str(tmp_path), "--no-bos", "--json", "--eval-tokens", "64"]) == 0
    summary = json.loads(capsys.readouterr().out)
    assert summary["complete"] and summary["tokens"] == 2 * 2 * 32
    cfg = read_state(tmp_path)["config"]
    assert cfg["switches"]["norm"] == "rmsnorm" and cfg["optim"] == "adamw" and cfg["bos"] is False
    ckpt = load_checkpoint(tmp_path)
    assert (ckpt.config.attn, ckpt.config.norm) == ("softmax1", "rmsnorm")
    assert ckpt.provenance["training"]["optimizer"] == "adamw"


def test_python_dash_m_trainers_subprocess(tmp_path):
    """The module entry point itself: exit status and the one-line error, in a fresh interpreter."""
    result = run_cli(["--out", str(tmp_path), "--recipe", "papr"], timeout=60)
    assert result.returncode == 2
    assert (
        result.stderr.strip().splitlines() == [result.stderr.strip()]
        and "did you mean 'paper'" in result.stderr
    )
