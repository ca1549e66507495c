"""Every repository path the README, the docs and the code's docstrings name exists, and nothing cites an
issue tracker's numbers (a reader of the repository cannot follow them)."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TOP = ("models", "trainers", "qbench", "tests", "docs", "results", "scripts")
PATH = re.compile(r"(?<![\w./-])((?:" + "|".join(TOP) + r")/[A-Za-z0-9_.\-/]*[A-Za-z0-9_/])")
# Paths that name what a command writes or a pattern, not a file of the repository
GENERATED = re.compile(
    r"[<>*{}]|/NAME|/OUT|results/gpu|/step-|results/recipes|results/reproduce|results/cards"
)


def texts() -> dict[Path, str]:
    files = [ROOT / "README.md", *(ROOT / "docs").glob("*.md"), *(ROOT / "results").rglob("README.md")]
    files += [ROOT / "pyproject.toml", ROOT / ".ci" / "run"]
    for top in ("models", "trainers", "qbench", "tests", "scripts"):
        files += (ROOT / top).rglob("*.py")
    return {f: f.read_text() for f in files}


def named_paths(text: str) -> set[str]:
    return {m.group(1).rstrip("/.") for m in PATH.finditer(text)}


def test_every_named_path_exists():
    missing = []
    for file, text in texts().items():
        for path in named_paths(text):
            if GENERATED.search(path) or path.split("/")[-1] in ("", "..."):
                continue
            if not (ROOT / path).exists():
                missing.append(f"{file.relative_to(ROOT)}: {path}")
    assert not missing, "\n".join(sorted(missing))


def test_nothing_cites_issue_numbers():
    tagged = [
        f"{file.relative_to(ROOT)}: {m.group(0)}"
        for file, text in texts().items()
        for m in re.finditer(r"\bissues? \d+(\.\d+)?\b", text, re.IGNORECASE)
    ]
    assert not tagged, tagged


def test_the_readme_command_table_lists_every_command():
    """A command missing from the README's table is a command a newcomer never finds."""
    from qbench.cli import COMMAND_MODULES

    readme = (ROOT / "README.md").read_text()
    table = readme[readme.index("## Commands") : readme.index("## Python API")]
    listed = set(re.findall(r"^\| `qbench ([a-z-]+)", table, flags=re.M))
    names = {__import__(f"qbench.cli.{m}", fromlist=["NAME"]).NAME for m in COMMAND_MODULES}
    assert names - listed == set(), f"commands missing from the README's table: {sorted(names - listed)}"
