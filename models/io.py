"""Atomic file writes and provenance (versions, git commit) shared by checkpoints and results."""

from __future__ import annotations

import functools
import hashlib
import json
import os
import platform
import subprocess
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import IO, Any


def _umask_mode() -> int:
    """The mode a plain ``open(..., "w")`` would give: mkstemp's files are 0600, too strict for results."""
    umask = os.umask(0)
    os.umask(umask)
    return 0o666 & ~umask


def atomic_write_bytes(path: str | os.PathLike, data: bytes) -> None:
    """Write ``data`` to ``path`` so that a reader sees the old file or the new one, never a torn one."""
    with atomic_path(path) as tmp:
        tmp.write_bytes(data)


def atomic_write_text(path: str | os.PathLike, text: str) -> None:
    atomic_write_bytes(path, text.encode("utf-8"))


def atomic_write_json(path: str | os.PathLike, obj: Any) -> None:
    atomic_write_text(path, json.dumps(obj, indent=2, sort_keys=False, default=_json_default) + "\n")


def _json_default(obj: Any) -> Any:
    if isinstance(obj, Path):
        return str(obj)
    if hasattr(obj, "item"):  # numpy / torch scalars
        return obj.item()
    raise TypeError(f"not JSON serialisable: {type(obj).__name__}")


def sha256_file(path: str | os.PathLike, chunk: int = 1 << 20) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()


def git_commit(cwd: str | os.PathLike | None = None) -> str | None:
    """The commit of the qbench source tree (with '-dirty' for uncommitted changes to it), or None outside git.

    The source is every tracked file outside ``results/`` and ``docs/``: generated tables and prose cannot change a
    number, and a script that regenerates ``results/`` (``results/speed/run.sh``) rewrites tracked files as it
    goes, which would otherwise mark every record after its first as dirty.
    Asked once per process and folder: the code that runs is the code imported at the start, and a grid writes
    a record per cell (two git calls each cost ~0.2 s, a tenth of a small cell).
    """
    return _git_commit(str(Path(cwd) if cwd else Path(__file__).resolve().parent))


# git pathspecs from the repository's top: everything but the generated results and the docs
SOURCE_PATHSPEC = (":(top)", ":(top,exclude)results", ":(top,exclude)docs")


@functools.cache
def _git_commit(cwd: str) -> str | None:
    try:
        sha = subprocess.run(
            ["git", "rev-parse", "HEAD"], cwd=cwd, capture_output=True, text=True, timeout=5, check=True
        ).stdout.strip()
        dirty = subprocess.run(
            ["git", "status", "--porcelain", "--untracked-files=no", "--", *SOURCE_PATHSPEC],
            cwd=cwd,
            capture_output=True,
            text=True,
            timeout=5,
            check=True,
        ).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return None
    return sha + ("-dirty" if dirty else "")


def software_versions() -> dict[str, str | None]:
    """Versions of the packages whose behaviour a number depends on (None where not installed); read once."""
    return dict(_software_versions())


@functools.cache
def _software_versions() -> dict[str, str | None]:
    from importlib import metadata

    versions: dict[str, str | None] = {"python": platform.python_version()}
    for pkg in (
        "qbench",
        "torch",
        "transformers",
        "tokenizers",
        "datasets",
        "bitsandbytes",
        "lm_eval",
        "numpy",
    ):
        try:
            versions[pkg] = metadata.version(pkg.replace("_", "-"))
        except metadata.PackageNotFoundError:
            versions[pkg] = None
    return versions


@contextmanager
def atomic_path(path: str | os.PathLike) -> Iterator[Path]:
    """Yield a temporary path beside ``path``; on success it replaces ``path`` atomically, on error it is removed.

    For writers that insist on a file name (``safetensors.torch.save_file``, ``np.save``).
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    os.close(fd)
    try:
        yield Path(tmp)
        with open(tmp, "rb+") as f:
            os.fsync(f.fileno())
        os.chmod(tmp, _umask_mode())
        os.replace(tmp, path)
    except OSError as e:
        Path(tmp).unlink(missing_ok=True)
        # a write to an open file (a full disk) names no file: name the one being written
        if e.filename is None:
            raise type(e)(e.errno, e.strerror or str(e), str(path)) from e
        raise
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


@contextmanager
def atomic_output(path: str | os.PathLike) -> Iterator[IO[bytes]]:
    """A binary file object whose contents appear at ``path`` only when the block completes."""
    with atomic_path(path) as tmp, open(tmp, "wb") as f:
        yield f


def cuda_fp32_matmul() -> str:
    """How CUDA computes float32 matmuls here: "tf32" or "ieee" — part of a CUDA record, since TF32 rounds each
    input to a 10-bit mantissa (~1e-3 relative: larger than most differences a fake-quantised cell is read for).

    TF32 is on when torch allows it or when the environment forces it: ``TORCH_ALLOW_TF32_CUBLAS_OVERRIDE=1``
    (set by NVIDIA's PyTorch containers) overrides torch's flag; ``NVIDIA_TF32_OVERRIDE=0`` turns it off in
    cuBLAS whatever torch says."""
    import torch

    if os.environ.get("NVIDIA_TF32_OVERRIDE") == "0":
        return "ieee"
    if os.environ.get("TORCH_ALLOW_TF32_CUBLAS_OVERRIDE") == "1":
        return "tf32"
    precision = getattr(torch.backends.cuda.matmul, "fp32_precision", None)  # torch ≥ 2.9's spelling
    if precision in ("ieee", "tf32"):
        return precision
    return "tf32" if torch.backends.cuda.matmul.allow_tf32 else "ieee"


def cpu_model() -> str:
    """The processor's marketing name (Linux /proc/cpuinfo), else what platform reports."""
    import platform

    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()
