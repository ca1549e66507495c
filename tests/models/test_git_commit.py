"""models.io.git_commit: '-dirty' means uncommitted changes to the source, not to generated results or docs."""

from __future__ import annotations

import shutil
import subprocess

import pytest

from models.io import git_commit

pytestmark = pytest.mark.skipif(shutil.which("git") is None, reason="needs git")


def _git(repo, *args: str) -> None:
    subprocess.run(["git", *args], cwd=repo, check=True, capture_output=True)


def test_only_source_changes_make_a_commit_dirty(tmp_path):
    repo = tmp_path / "repo"
    for path in ("models/io.py", "results/speed/README.md", "docs/speed.md", "pyproject.toml"):
        (repo / path).parent.mkdir(parents=True, exist_ok=True)
        (repo / path).write_text("v1\n")
    _git(repo, "init", "-q")
    _git(repo, "-c", "user.email=t@t", "-c", "user.name=t", "add", ".")
    _git(repo, "-c", "user.email=t@t", "-c", "user.name=t", "commit", "-qm", "v1")
    sha = subprocess.run(
        ["git", "rev-parse", "HEAD"], cwd=repo, capture_output=True, text=True
    ).stdout.strip()
    # each check from its own folder: git_commit is asked once per process and folder
    (repo / "results/speed/README.md").write_text("regenerated\n")
    (repo / "docs/speed.md").write_text("reworded\n")
    assert (
        git_commit(repo / "results") == sha
    )  # a regenerated table, a reworded doc: the code is the commit's
    (repo / "pyproject.toml").write_text("v2\n")
    assert git_commit(repo / "models") == sha + "-dirty"
    assert git_commit(tmp_path) is None  # outside any repository
