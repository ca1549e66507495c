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


def test_render_writes_the_summary_as_markdown_beside_it(tmp_path, monkeypatch, capsys):
    def mixed(checks, work):
        checks.run("int-mm", lambda: {"shapes_exact": 3, "cublas_refused_padded_mkn": [[40, 64, 48]]})
        checks.run("always-fails", lambda: gpu_check._assert(False, "planted failure"))

    monkeypatch.setattr(gpu_check, "cpu_checks", mixed)
    out = tmp_path / "s.json"
    assert gpu_check.main(["--dry-run", "--output-path", str(out)]) == 1
    assert gpu_check.main(["--render", str(out)]) == 0
    md = (tmp_path / "s.md").read_text()
    assert "**1/2 checks passed**" in md
    assert "| int-mm" in md and "40×64×48" in md
    assert "FAIL" in md and "planted failure" in md
    assert gpu_check.main(["--render", str(tmp_path / "missing.json")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "missing.json" in err[0]
