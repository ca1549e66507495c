"""qbench: how well does a causal LM survive quantisation, and do softmax-1 and OrthoAdam help?

Importing qbench registers the ``softmax1`` attention function with transformers, so exported softmax-1 models
load with ``AutoModelForCausalLM.from_pretrained``.

The Python API (``qbench.api``), imported on first use so that ``import qbench`` loads nothing more::

    qbench.load(ckpt) -> LoadedModel                      # .model, .tokenizer, .description
    qbench.quantize(model, scheme, mode="fake", exclude=()) -> a quantised copy
    qbench.evaluate(model_or_ckpt, scheme, ...) -> dict   # the record `qbench run` writes
"""

from __future__ import annotations

import itertools
import sys


def _exit_if_cli_interrupted() -> None:
    """Ctrl-C while the ``qbench`` command is still importing (torch and transformers take seconds): one line and
    exit status 130 instead of a traceback through the import machinery. Called from an ``except
    KeyboardInterrupt``; a program that merely imports qbench gets its KeyboardInterrupt back (the caller re-raises).
    """
    if _started_as_cli():
        sys.stderr.write("qbench: interrupted\n")
        _forget_interrupt()
        raise SystemExit(130)


def _forget_interrupt() -> None:
    """Make a handled Ctrl-C exit with the status we choose. CPython remembers a KeyboardInterrupt raised inside any
    string ``exec`` (dataclasses and namedtuples build their methods that way, so an import is often in one) and,
    under ``python -m``, turns the exit into death by SIGINT even when the interrupt was caught; a string ``exec``
    that completes clears that memory."""
    exec("None")  # a constant string: the string form is the point


def _started_as_cli() -> bool:
    """Whether this process is the ``qbench`` console script or ``python -m qbench``."""
    argv = getattr(sys, "argv", None) or [""]
    if argv[0].replace("\\", "/").rsplit("/", 1)[-1] in ("qbench", "qbench.exe"):
        return True
    modules = ("qbench", "qbench.cli")
    orig = getattr(sys, "orig_argv", [])  # argv[0] is "-m" while runpy imports the package: read the original
    return any(f"-m{m}" in orig for m in modules) or any(
        a == "-m" and b in modules for a, b in itertools.pairwise(orig)
    )


try:
    from importlib import metadata

    try:
        __version__ = metadata.version("qbench")
    except metadata.PackageNotFoundError:  # running from a source tree that was never installed
        __version__ = "0+unknown"

    from models.hf import register_softmax1

    register_softmax1()
except KeyboardInterrupt:
    _exit_if_cli_interrupted()
    raise

_API = ("quantize", "load", "evaluate")
__all__ = [*_API, "__version__"]


def __getattr__(name: str):
    """``qbench.quantize``/``load``/``evaluate``, imported lazily (PEP 562): the harness and the quantisers stay
    unimported until used."""
    if name in _API:
        from qbench import api

        return getattr(api, name)
    raise AttributeError(f"module 'qbench' has no attribute {name!r}")
