"""scripts/gpu-check's CPU side: the dry run passes, says so in one line and writes its JSON summary."""

from __future__ import annotations

import json
import os
from pathlib import Path

from qbench.studies import gpu_check

REPO = Path(__file__).resolve().parents[3]


def test_script_is_executable_and_runs_the_module():
    script = REPO / "scripts" / "gpu-check"
    assert os.access(script, os.X_OK)
    assert "qbench.studies.gpu_check" in script.read_text()


def test_dry_run_passes_and_writes_a_summary(tmp_path, capsys):
    out = tmp_path / "summary.json"
    assert gpu_check.main(["--dry-run", "--out", str(out)]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == "gpu-check: --dry-run: running the CPU-side self-test only"
    assert lines[-1].startswith("gpu-check: 3/3 checks passed on cpu")
    summary = json.loads(out.read_text())
    assert summary["dry_run"] and summary["all_passed"] and summary["device"] == "cpu"
    checks = {c["name"]: c for c in summary["checks"]}
    assert set(checks) == {"softmax1-fused-cpu", "flops-formula", "train-micro-cpu"}
    train = checks["train-micro-cpu"]["details"]
    assert train["steady_tokens_per_s"] > 0 and train["mfu"] is None  # no CPU peak: MFU n/a
    assert train["throughput"]["flops_per_token"] > 0


def test_a_failing_check_fails_the_run(tmp_path, monkeypatch):
    def broken(checks, work):
        checks.run("always-fails", lambda: gpu_check._assert(False, "planted failure"))

    monkeypatch.setattr(gpu_check, "cpu_checks", broken)
    out = tmp_path / "s.json"
    assert gpu_check.main(["--dry-run", "--out", str(out)]) == 1
    (check,) = json.loads(out.read_text())["checks"]
    assert not check["ok"] and "planted failure" in check["error"]
