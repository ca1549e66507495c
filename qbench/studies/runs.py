"""Training runs launched from qbench (``demo``, ``reproduce``): subprocesses of ``python -m trainers`` (or
``torchrun ... -m trainers`` for several GPUs), several at a time if asked, each with a progress bar read from
its ``metrics.jsonl``. A run whose folder already holds a trainer state is resumed — a finished run resumes to
nothing — so an interrupted ``demo`` or ``reproduce`` continues where it stopped.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from models.errors import UserError

# the corpus the training studies (demo, recipes) train on and score by default: trainers.data.DEFAULT_CORPUS,
# named here so that their parsers import no trainer code
DEFAULT_DATA = "embedded"


@dataclass(frozen=True)
class TrainRun:
    name: str
    out: Path
    steps: int  # the whole schedule (warmup + cosine)
    args: tuple[str, ...] = field(default_factory=tuple)  # trainer options besides --out/--steps/--resume
    stop_at: int | None = None  # end after this step (a prefix of the schedule; None: the whole schedule)

    @property
    def end_step(self) -> int:
        return self.steps if self.stop_at is None else min(self.stop_at, self.steps)

    def command(self, nproc_per_node: int = 1) -> list[str]:
        from trainers.state import has_state

        launcher = [sys.executable, "-m", "trainers"]
        if nproc_per_node > 1:
            launcher = [
                sys.executable,
                "-m",
                "torch.distributed.run",
                "--standalone",
                f"--nproc_per_node={nproc_per_node}",
                "-m",
                "trainers",
            ]
        resume = ["--resume"] if has_state(self.out) else []
        return [
            *launcher,
            "--out",
            str(self.out),
            "--steps",
            str(self.steps),
            *(["--stop-at", str(self.stop_at)] if self.stop_at is not None else []),
            "--no-progress",
            *self.args,
            *resume,
        ]


def last_step(metrics: Path) -> int:
    """The step of the last line of a metrics.jsonl (0 when there is none yet)."""
    try:
        with open(metrics, "rb") as f:
            f.seek(max(0, os.path.getsize(metrics) - 4096))
            lines = f.read().decode("utf-8", "replace").strip().splitlines()
        return int(json.loads(lines[-1])["step"]) if lines else 0
    except (OSError, ValueError, KeyError, IndexError):
        return 0


def _start(run: TrainRun, threads: int | None, nproc_per_node: int) -> tuple[subprocess.Popen, Any]:
    run.out.parent.mkdir(parents=True, exist_ok=True)
    env = dict(os.environ)
    if threads:
        env["OMP_NUM_THREADS"] = str(threads)
    # glibc returns every freed large tensor to the OS and page-faults it back in on the next step; keeping the
    # heap makes a tiny-preset step ~7 % faster here (1,513 -> 1,612 tokens/s, one thread, AMD EPYC Zen 4)
    env.setdefault("MALLOC_MMAP_MAX_", "0")
    env.setdefault("MALLOC_TRIM_THRESHOLD_", str(1 << 40))
    log = open(run.out.parent / f"{run.out.name}.train.log", "a")  # noqa: SIM115 (closed when the run ends)
    return subprocess.Popen(run.command(nproc_per_node), env=env, stdout=log, stderr=log), log


def _error_line(log: str) -> str | None:
    """The trainer's own one-line reason (its last ``error:`` line), so a failed run says why where it is reported."""
    try:
        lines = Path(log).read_text(errors="replace").splitlines()
    except OSError:
        return None
    return next(
        (line.removeprefix("error: ") for line in reversed(lines) if line.startswith("error: ")), None
    )


def train_runs(
    runs: list[TrainRun], console: Any, parallel: int = 1, threads: int | None = None, nproc_per_node: int = 1
) -> float:
    """Run ``runs``, ``parallel`` at a time (``threads`` torch threads each); returns the wall time in seconds."""
    from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn

    start = time.perf_counter()
    pending, active, failed = list(runs), {}, []
    columns = (
        TextColumn("{task.description}"),
        BarColumn(),
        TextColumn("{task.completed}/{task.total} steps"),
        TimeElapsedColumn(),
        TimeRemainingColumn(),
    )
    with Progress(*columns, console=console) as progress:
        tasks = {run.name: progress.add_task(f"train {run.name:<20}", total=run.end_step) for run in runs}
        while pending or active:
            while pending and len(active) < parallel:
                run = pending.pop(0)
                active[run.name] = (run, *_start(run, threads, nproc_per_node))
            for name, (run, proc, log) in list(active.items()):
                progress.update(tasks[name], completed=last_step(run.out / "metrics.jsonl"))
                if proc.poll() is not None:
                    log.close()
                    del active[name]
                    if proc.returncode != 0:
                        reason = _error_line(log.name)
                        failed.append(
                            f"{name} (exit {proc.returncode}{f': {reason}' if reason else ''}; see {log.name})"
                        )
            time.sleep(0.5)
    if failed:
        raise UserError(f"training failed: {', '.join(failed)}")
    for run in runs:
        check_trained(run)
    return time.perf_counter() - start


def check_trained(run: TrainRun) -> None:
    """Refuse a run folder whose training went past ``run.end_step``: a finished run resumes to nothing, so a
    smaller ``stop_at`` in the same folder would otherwise hand on a model of another step under this one's name."""
    from trainers.state import read_state

    step = read_state(run.out, verify=False)["step"]
    if step != run.end_step:
        raise UserError(
            f"{run.out} holds a run at step {step}, not {run.end_step}: train into another folder "
            "(e.g. --ckpt-root) for this budget"
        )


def data_description(cfg: Any) -> str:
    """What a training study's description (table.md, the first line printed) adds for a corpus or sample other
    than the defaults, so its output says how it was made: ``, data embedded-whole, sample first``. ``cfg``:
    ``qbench demo``'s or ``qbench recipes``' config."""
    parts = [f"data {cfg.data}"] if cfg.data != DEFAULT_DATA else []
    if cfg.sample is not None:
        parts.append(f"sample {cfg.sample}")
    if cfg.sample_seed != 0 and cfg.sample != "first":  # the seed draws nothing from the first windows
        parts.append(f"sample seed {cfg.sample_seed}")
    return "".join(f", {p}" for p in parts)


def check_data(data: str) -> None:
    """Refuse an unknown ``--data`` before anything is trained, with the corpus registry's one-line did-you-mean
    error (``trainers.data.get_corpus``); a registered name or an existing path passes without building anything
    (``mix`` builds itself on first use, ``c4`` streams from the hub)."""
    from trainers.data import CORPORA, get_corpus

    if data not in CORPORA and not Path(data).exists():
        get_corpus(data)  # raises the error
