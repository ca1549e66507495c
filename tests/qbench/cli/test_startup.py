"""Start-up stays light: building the parser, every ``--help``, ``--version`` and the torch-free ``ls`` listings import
neither torch nor transformers (seconds on two cores), and ``import qbench`` still registers softmax-1 with
transformers, once transformers is imported. Each check runs in a fresh interpreter, since this one has long
imported both; the checks assert the modules loaded, never the time (timings on a shared machine are noise)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import qbench

ROOT = Path(qbench.__file__).resolve().parents[1]
HEAVY = ("torch", "transformers")


def _python(*args: str, timeout: int = 120) -> subprocess.CompletedProcess:
    """This checkout's code in a fresh interpreter (first on the path, ahead of any installed copy)."""
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    return subprocess.run(
        [sys.executable, *args], cwd=ROOT, capture_output=True, text=True, timeout=timeout, env=env
    )


def test_building_the_parser_imports_neither_torch_nor_transformers():
    script = (
        "import sys\n"
        "from qbench.cli import build_parser\n"
        "build_parser()\n"
        f"print(sorted(m for m in {HEAVY!r} if m in sys.modules))\n"
    )
    result = _python("-c", script)
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.strip() == "[]"


# the commands that only print: argv -> the exit status (a help or --version exits through SystemExit(0))
LIGHT = [
    ["--help"],
    ["--version"],
    ["run", "--help"],
    ["grid", "--help"],
    ["sensitivity", "--help"],
    ["score", "--help"],
    ["lm-eval", "--help"],
    ["ls", "presets"],
    ["ls", "corpora"],
    ["ls", "recipes"],
    ["ls", "results", "--output-path", "EMPTY"],  # an empty folder: the test's tmp_path
]


def test_help_version_and_light_listings_import_neither_torch_nor_transformers(tmp_path):
    """One interpreter runs them in turn and names the first command after which a heavy module is loaded."""
    light = [[str(tmp_path) if a == "EMPTY" else a for a in argv] for argv in LIGHT]
    script = (
        "import sys\n"
        "from qbench.cli import main\n"
        f"for argv in {light!r}:\n"
        "    try:\n"
        "        code = main(argv)\n"
        "    except SystemExit as e:\n"
        "        code = e.code\n"
        "    assert code in (0, None), (argv, code)\n"
        f"    heavy = [m for m in {HEAVY!r} if m in sys.modules]\n"
        "    assert not heavy, (argv, heavy)\n"
        "print('ok')\n"
    )
    result = _python("-c", script)
    assert result.returncode == 0 and result.stdout.strip().endswith("ok"), result.stderr[-2000:]


def test_qbench_help_as_a_command_loads_no_heavy_module():
    """``python -m qbench --help``, the console script's path: the modules it imported, read from -X importtime."""
    result = _python("-X", "importtime", "-m", "qbench", "--help")
    assert result.returncode == 0 and "usage: qbench" in result.stdout, result.stderr[-2000:]
    imported = {
        line.rsplit("|", 1)[-1].strip()
        for line in result.stderr.splitlines()
        if line.startswith("import time:")
    }
    assert "qbench.cli" in imported  # the timing lines were read at all
    assert not {m for m in imported if m.split(".")[0] in HEAVY}


def test_importing_transformers_after_qbench_registers_softmax1():
    script = (
        "import sys\n"
        "import qbench\n"
        "assert 'transformers' not in sys.modules\n"
        "import transformers\n"
        "from transformers.masking_utils import AttentionMaskInterface\n"
        "assert 'softmax1' in transformers.AttentionInterface._global_mapping\n"
        "assert 'softmax1_eager' in transformers.AttentionInterface._global_mapping\n"
        "assert 'softmax1' in AttentionMaskInterface._global_mapping\n"
        "assert not [f for f in sys.meta_path if type(f).__module__ == 'qbench'], sys.meta_path\n"
        "print('ok')\n"
    )
    result = _python("-c", script)
    assert result.returncode == 0 and result.stdout.strip().endswith("ok"), result.stderr[-2000:]


def test_importing_qbench_after_transformers_registers_softmax1_at_once():
    script = (
        "import sys\n"
        "import transformers\n"
        "import qbench\n"
        "assert 'softmax1' in transformers.AttentionInterface._global_mapping\n"
        "assert not [f for f in sys.meta_path if type(f).__module__ == 'qbench'], sys.meta_path\n"
        "print('ok')\n"
    )
    result = _python("-c", script)
    assert result.returncode == 0 and result.stdout.strip().endswith("ok"), result.stderr[-2000:]
