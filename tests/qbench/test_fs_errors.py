"""Filesystem errors end with one line, never a traceback, and lose nothing written before."""

from __future__ import annotations

import errno
import json
from pathlib import Path

import pytest

from qbench.cli import main

FAST = ["--tokens", "64", "--window", "32", "--batch-size", "2", "--scheme", "absmax-fine"]


def run(argv, capsys):
    code = main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return code, out, err


def _one_error_line(err: str) -> str:
    lines = [line for line in err.splitlines() if line.startswith("error:")]  # progress lines may precede it
    assert len(lines) == 1 and "Traceback" not in err and err.rstrip().endswith(lines[0]), err
    return lines[0]


def test_output_path_under_an_existing_file(ckpt_dir, tmp_path, capsys):
    blocker = tmp_path / "results.txt"
    blocker.write_text("mine\n")
    code, _, err = run(["run", "--ckpt", ckpt_dir, *FAST, "--output-path", blocker / "sub"], capsys)
    assert code == 2 and str(blocker) in _one_error_line(err)
    assert blocker.read_text() == "mine\n"


def test_export_onto_an_existing_file(ckpt_dir, tmp_path, capsys):
    target = tmp_path / "model.bin"
    target.write_bytes(b"keep")
    code, _, err = run(["export", ckpt_dir, target], capsys)
    assert code == 2 and str(target) in _one_error_line(err) and target.read_bytes() == b"keep"
    code, _, err = run(["export", ckpt_dir, target / "inside"], capsys)  # a folder under a file
    assert code == 2 and str(target) in _one_error_line(err) and target.read_bytes() == b"keep"


@pytest.mark.parametrize("code_", [errno.ENOSPC, errno.EROFS, errno.EACCES])
def test_full_or_read_only_disk_keeps_earlier_records(ckpt_dir, tmp_path, capsys, monkeypatch, code_):
    out = tmp_path / "res"
    assert run(["run", "--ckpt", ckpt_dir, *FAST, "--output-path", out], capsys)[0] == 0
    before = {p: p.read_bytes() for p in out.rglob("*.json")}
    assert len(before) >= 2
    real_write = Path.write_bytes

    def failing_write(self, data):  # the disk fills (or turns read-only) on the next record
        if self.name.endswith(".tmp"):
            raise OSError(code_, __import__("os").strerror(code_), str(self))
        return real_write(self, data)

    monkeypatch.setattr(Path, "write_bytes", failing_write)
    code, _, err = run(["run", "--ckpt", ckpt_dir, *FAST[:-1], "absmax-coarse", "--output-path", out], capsys)
    line = _one_error_line(err)
    assert code == 2 and str(out) in line and __import__("os").strerror(code_) in line
    assert {p: p.read_bytes() for p in out.rglob("*.json")} == before  # nothing earlier lost or torn
    assert not list(out.rglob("*.tmp")) and all(json.loads(b) for b in before.values())


def test_a_full_disk_that_names_no_file_is_named_by_the_writer(ckpt_dir, tmp_path, capsys, monkeypatch):
    """A write to an open file (ENOSPC from ``write``) carries no file name; the line names the file being
    written, never "?"."""
    out = tmp_path / "res"

    def failing_write(self, data):
        raise OSError(errno.ENOSPC, __import__("os").strerror(errno.ENOSPC))

    monkeypatch.setattr(Path, "write_bytes", failing_write)
    code, _, err = run(["run", "--ckpt", ckpt_dir, *FAST, "--output-path", out], capsys)
    line = _one_error_line(err)
    assert code == 2 and str(out) in line and "?:" not in line and "No space left" in line
    assert not list(out.rglob("*.tmp"))


def test_run_prints_its_peak_memory(ckpt_dir, tmp_path, capsys):
    code, out, _ = run(["run", "--ckpt", ckpt_dir, *FAST, "--output-path", tmp_path / "res"], capsys)
    assert code == 0 and "peak memory" in out and "GiB" in out
