"""``qbench.studies.runs``: how a training run is started."""

from __future__ import annotations

import subprocess

from qbench.studies import runs


def test_a_run_starts_with_its_threads_and_a_kept_heap(monkeypatch, tmp_path):
    """One thread per run when asked, and glibc's heap kept (no page faults for every freed tensor), unless the
    caller's environment already says otherwise."""
    seen = {}

    def popen(command, env, stdout, stderr):
        seen.update(env)
        return "process"

    monkeypatch.setattr(subprocess, "Popen", popen)
    monkeypatch.setenv("MALLOC_TRIM_THRESHOLD_", "7")
    run = runs.TrainRun("vanilla", tmp_path / "vanilla", 10, ("--preset", "tiny"))
    process, log = runs._start(run, threads=1, nproc_per_node=1)
    log.close()
    assert process == "process" and seen["OMP_NUM_THREADS"] == "1"
    assert seen["MALLOC_MMAP_MAX_"] == "0" and seen["MALLOC_TRIM_THRESHOLD_"] == "7"
