"""Ctrl-C anywhere in ``qbench``: one line, exit status 130, no traceback — during a command, while the parser is
built, while start-up is still importing, and while a command imports torch."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

import qbench
from qbench import cli

ROOT = Path(qbench.__file__).resolve().parents[1]


def _interrupt(*args, **kwargs):
    raise KeyboardInterrupt


@pytest.mark.parametrize("where", ["command", "parser"])
def test_an_interrupted_command_is_one_line_and_exit_130(where, monkeypatch, capsys):
    if where == "command":
        monkeypatch.setitem(cli.COMMANDS, "env", _interrupt)
    else:
        monkeypatch.setattr(cli, "build_parser", _interrupt)
    assert cli.main(["env"]) == 130
    captured = capsys.readouterr()
    lines = captured.err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("qbench: interrupted") and "Traceback" not in captured.err


@pytest.mark.parametrize(
    "argv, orig_argv, exits",
    [
        (["/venv/bin/qbench", "run"], ["/venv/bin/python", "/venv/bin/qbench", "run"], True),
        (["-m"], ["python", "-m", "qbench", "run"], True),  # runpy importing the package
        (["-m"], ["python", "-mqbench"], True),
        (["/venv/bin/pytest"], ["python", "/venv/bin/pytest"], False),
        (["-c"], ["python", "-c", "import qbench"], False),
    ],
)
def test_an_interrupted_import_exits_only_the_cli(argv, orig_argv, exits, monkeypatch, capsys):
    monkeypatch.setattr(sys, "argv", argv)
    monkeypatch.setattr(sys, "orig_argv", orig_argv)
    if exits:
        with pytest.raises(SystemExit) as exit_:
            qbench._exit_if_cli_interrupted()
        assert exit_.value.code == 130 and capsys.readouterr().err == "qbench: interrupted\n"
    else:
        qbench._exit_if_cli_interrupted()  # returns: the importer's own KeyboardInterrupt is re-raised
        assert capsys.readouterr().err == ""


@pytest.mark.skipif(sys.platform == "win32", reason="SIGINT to a child process is a POSIX signal")
def test_ctrl_c_while_a_command_imports_torch_prints_one_line(tmp_path):
    """A real SIGINT while ``qbench env`` imports torch (start-up imports none, nor does ``ls``; commands import it
    on first use, for seconds). A stand-in torch, first on the path, says when its import has begun and then blocks, so the
    signal lands inside that import on any machine, however fast."""
    started = tmp_path / "torch-import-started"
    (tmp_path / "torch").mkdir()
    (tmp_path / "torch" / "__init__.py").write_text(
        f"import pathlib, time\npathlib.Path({str(started)!r}).touch()\ntime.sleep(120)\n"
    )
    child = subprocess.Popen(
        [sys.executable, "-m", "qbench", "env"],
        cwd=tmp_path,  # first on the path: the stand-in torch
        env={**os.environ, "PYTHONPATH": str(ROOT)},
        stderr=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        # a test run started in the background (`cmd &` in a script) ignores SIGINT, and children inherit that:
        # Python then installs no KeyboardInterrupt handler. A user's terminal delivers it; so does this child.
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )
    deadline = time.monotonic() + 60
    while not started.exists() and child.poll() is None and time.monotonic() < deadline:
        time.sleep(0.02)
    assert started.exists(), child.communicate(timeout=60)[1]
    child.send_signal(signal.SIGINT)
    _, err = child.communicate(timeout=60)
    assert child.returncode == 130, err
    assert len(err.strip().splitlines()) == 1 and err.startswith("qbench: interrupted"), err


def test_an_interrupt_inside_a_string_exec_during_start_up_exits_130(tmp_path):
    """Deterministic start-up interrupt: a stand-in ``models`` package (first on the path) raises it from a string
    ``exec``, as dataclasses run one while modules import. CPython remembers an interrupt raised there and, under
    ``python -m``, would end the process by SIGINT (status -2) although it was handled."""
    (tmp_path / "models").mkdir()
    (tmp_path / "models" / "__init__.py").write_text("exec('raise KeyboardInterrupt')\n")
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    result = subprocess.run(
        [sys.executable, "-m", "qbench", "ls", "presets"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
    )
    assert (result.returncode, result.stderr) == (130, "qbench: interrupted\n")
