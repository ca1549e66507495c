"""Stop / kill, then resume: the final weights are bit-identical to an uninterrupted run; corruption is caught."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from models.errors import UserError
from models.io import sha256_file
from trainers import state
from trainers.loop import train

from .helpers import MICRO_ARGS, REPO, micro_cfg, read_metrics, subprocess_env


def weights(out: Path) -> dict[str, torch.Tensor]:
    return load_file(str(out / "model.safetensors"))


def assert_bit_identical(a: Path, b: Path) -> None:
    wa, wb = weights(a), weights(b)
    assert wa.keys() == wb.keys()
    for name in wa:
        assert torch.equal(wa[name], wb[name]), name
    oa, ob = load_file(str(a / state.STATE_TENSORS)), load_file(str(b / state.STATE_TENSORS))
    assert oa.keys() == ob.keys() and all(torch.equal(oa[k], ob[k]) for k in oa)


def losses(out: Path) -> list[float]:
    return [r["loss"] for r in read_metrics(out) if "loss" in r]


@pytest.fixture(scope="module")
def reference(corpus, tmp_path_factory) -> Path:
    """An uninterrupted 8-step run of the paper recipe (OrthoAdam) with checkpoints every 2 steps."""
    out = tmp_path_factory.mktemp("reference")
    # Module-scoped, so it runs before the function-scoped conftest fixtures: set their thread count and cache.
    torch.set_num_threads(1)
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("QBENCH_CACHE", str(tmp_path_factory.getbasetemp() / "qbench-cache"))
        train(micro_cfg(corpus, ckpt_every=2), out, progress=False)
    return out


def test_stop_at_then_resume_is_bit_identical(corpus, reference, tmp_path):
    cfg = micro_cfg(corpus, ckpt_every=2)
    stopped = train(cfg, tmp_path, stop_at=3, progress=False)
    assert not stopped["complete"] and stopped["step"] == 3 and state.read_state(tmp_path)["step"] == 3
    done = train(cfg, tmp_path, resume=True, progress=False)
    assert done["complete"] and done["step"] == 8
    assert_bit_identical(reference, tmp_path)
    assert [r["step"] for r in read_metrics(tmp_path)] == list(range(9))
    assert losses(tmp_path) == losses(reference)


def test_metrics_log_is_cut_back_to_the_checkpoint(corpus, reference, tmp_path):
    cfg = micro_cfg(corpus, ckpt_every=2)
    train(cfg, tmp_path, stop_at=4, progress=False)
    with open(tmp_path / "metrics.jsonl", "a") as f:  # what a killed run logged after its last checkpoint
        f.write(json.dumps({"step": 5, "loss": 123.0}) + "\n" + '{"step": 6, "lo')
    train(cfg, tmp_path, resume=True, progress=False)
    assert [r["step"] for r in read_metrics(tmp_path)] == list(range(9))
    assert losses(tmp_path) == losses(reference)


@pytest.mark.slow
def test_kill_9_mid_run_then_resume_is_bit_identical(corpus, reference, tmp_path):
    """SIGKILL a CLI run right after its first checkpoint appears (at step 2 of 8, possibly mid-write of the
    next one), resume it with --resume, and compare with the uninterrupted run."""
    args = ["--preset", "tiny", "--recipe", "paper", *MICRO_ARGS, "--context", "32", "--batch-size", "4"]
    args += ["--steps", "8", "--data", str(corpus), "--eval-every", "4", "--eval-tokens", "256"]
    args += ["--probe-every", "4", "--probe-batch", "2", "--ckpt-every", "2", "--out", str(tmp_path)]
    proc = subprocess.Popen([sys.executable, "-m", "trainers", *args], cwd=REPO, env=subprocess_env(),
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)  # fmt: skip
    deadline = time.monotonic() + 120
    while not state.has_state(tmp_path) and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.005)
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait(timeout=30)
    assert proc.returncode == -signal.SIGKILL, "the run ended before it could be killed"
    killed_at = json.loads((tmp_path / state.STATE_JSON).read_text())["step"]
    assert killed_at < 8
    result = subprocess.run([sys.executable, "-m", "trainers", "--out", str(tmp_path), "--resume"], cwd=REPO,
                            env=subprocess_env(), capture_output=True, text=True, timeout=120)  # fmt: skip
    assert result.returncode == 0, result.stderr
    assert state.read_state(tmp_path)["step"] == 8 and not (tmp_path / state.STAGING).exists()
    assert_bit_identical(reference, tmp_path)
    assert losses(tmp_path) == losses(reference)


def test_resume_of_a_finished_run_changes_nothing(corpus, reference, tmp_path):
    shutil.copytree(reference, tmp_path, dirs_exist_ok=True)
    before = sha256_file(tmp_path / "model.safetensors")
    summary = train(micro_cfg(corpus, ckpt_every=2), tmp_path, resume=True, progress=False)
    assert summary["complete"] and sha256_file(tmp_path / "model.safetensors") == before
    assert len(read_metrics(tmp_path)) == 9


def test_resume_refuses_a_different_trajectory_but_allows_logging_changes(corpus, reference, tmp_path):
    shutil.copytree(reference, tmp_path, dirs_exist_ok=True)
    with pytest.raises(UserError, match=r"cannot resume .*lr: 0.004 -> 0.001"):
        train(micro_cfg(corpus, ckpt_every=2, lr=1e-3), tmp_path, resume=True, progress=False)
    train(micro_cfg(corpus, ckpt_every=3, eval_every=2), tmp_path, resume=True, progress=False)


@pytest.mark.parametrize("victim", ["model.safetensors", state.STATE_TENSORS, state.STATE_JSON])
def test_corrupt_checkpoint_on_resume_is_a_clear_error_and_nothing_is_overwritten(
    corpus, reference, tmp_path, victim
):
    cfg = micro_cfg(corpus, ckpt_every=2)
    train(cfg, tmp_path, stop_at=2, progress=False)
    path = tmp_path / victim
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF  # one flipped byte: valid-looking size, wrong content
    if victim == state.STATE_JSON:
        data = data[: len(data) // 2]  # a torn JSON file
    path.write_bytes(bytes(data))
    before = {p.name: sha256_file(p) for p in tmp_path.iterdir() if p.is_file()}
    with pytest.raises(UserError, match="corrupt"):
        train(cfg, tmp_path, resume=True, progress=False)
    assert {p.name: sha256_file(p) for p in tmp_path.iterdir() if p.is_file()} == before


def test_interrupted_checkpoint_write_is_rolled_forward_or_discarded(corpus, reference, tmp_path):
    # A complete staging folder (trainer_state.json written) whose files were moved only in part.
    run = tmp_path / "run"
    train(micro_cfg(corpus, ckpt_every=2), run, stop_at=2, progress=False)
    staging = run / state.STAGING
    shutil.copytree(reference, staging)
    (staging / "metrics.jsonl").unlink()
    # The crash came after the first move:
    os.replace(staging / "model.safetensors", run / "model.safetensors")
    assert state.recover(run) and not staging.exists()
    assert state.read_state(run)["step"] == 8  # every file vouched for by the new state matches
    # An incomplete staging folder (no trainer_state.json yet): deleted, the checkpoint in place untouched.
    shutil.copytree(reference, staging)
    (staging / state.STATE_JSON).unlink()
    before = sha256_file(run / "model.safetensors")
    assert not state.recover(run) and not staging.exists()
    assert sha256_file(run / "model.safetensors") == before and state.read_state(run)["step"] == 8


@pytest.mark.parametrize("optim", ["adamw", "rmsprop", "sgd", "sgd-momentum"])
def test_every_optimizer_state_round_trips_without_pickle(corpus, tmp_path, optim):
    cfg = micro_cfg(corpus, recipe="vanilla", optim=optim, steps=3, eval_every=3, probe_every=3, ckpt_every=3)
    train(cfg, tmp_path / "whole", progress=False)
    train(cfg, tmp_path / "split", stop_at=1, progress=False)
    train(cfg, tmp_path / "split", resume=True, progress=False)
    assert_bit_identical(tmp_path / "whole", tmp_path / "split")


def test_a_run_is_not_resumed_on_text_that_changed(tmp_path):
    """The same --data name can name other text (a local file edited; the embedded corpus cut into pieces): a
    resumed run would mix the two and say it trained on one."""
    import json

    from models.errors import UserError
    from trainers.loop import _check_same_text

    out = tmp_path / "run"
    out.mkdir()
    before = {"corpus": "embedded", "corpus_fingerprint": "a8ec7698025de58a8d7"}
    (out / "config.json").write_text(json.dumps({"provenance": {"training": {"data": {"train": before}}}}))
    _check_same_text(out, {"train": dict(before)})  # the same text: resumes
    with pytest.raises(UserError, match=r"cannot resume .*text that has changed.*embedded-whole"):
        _check_same_text(out, {"train": {**before, "corpus_fingerprint": "0acca4cd5f5a"}})
    (out / "config.json").write_text("{}")
    _check_same_text(out, {"train": before})  # a checkpoint that does not say: nothing to compare
