"""What the probe tests of the command line share: run a command in-process, and check a refusal is one line."""

from __future__ import annotations

from qbench.cli import main


def run(argv, capsys) -> tuple[int, str, str]:
    code = main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return code, out, err


def refused(argv, capsys, *needles: str) -> str:
    """``argv`` exits 2 with one error line holding every needle, and no traceback."""
    code, _, err = run(argv, capsys)
    errors = [line for line in err.splitlines() if line.startswith("error:")]
    assert code == 2, (code, err)
    assert len(errors) == 1 and "Traceback" not in err, err
    line = errors[0]
    for needle in needles:
        assert needle in line, line
    return line
