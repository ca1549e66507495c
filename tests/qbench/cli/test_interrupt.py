"""Ctrl-C anywhere in ``qbench``: one line, exit status 130, no traceback — during a command, while the parser is
built, and while start-up is still importing torch."""

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
def test_ctrl_c_during_start_up_prints_one_line(tmp_path):
    """SIGINT half a second in, while ``import qbench`` is still loading torch (seconds on any machine); the
    interrupt may also land in main, which says the same."""
    child = subprocess.Popen(
        [sys.executable, "-m", "qbench", "ls", "presets"],
        stderr=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    time.sleep(0.5)
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
