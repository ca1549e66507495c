"""qbench: how well does a causal LM survive quantisation, and do softmax-1 and OrthoAdam help?

Importing qbench registers the ``softmax1`` attention function with transformers, so exported softmax-1 models
load with ``AutoModelForCausalLM.from_pretrained``. It does so when transformers itself is imported (at once if it
already is), so that ``import qbench`` stays free of torch and transformers, and ``qbench --help`` fast.

The Python API (``qbench.api``), imported on first use so that ``import qbench`` loads nothing more::

    qbench.load(ckpt) -> LoadedModel                      # .model, .tokenizer, .description
    qbench.quantize(model, scheme, mode="fake", exclude=()) -> a quantised copy
    qbench.evaluate(model_or_ckpt, scheme, ...) -> dict   # the record `qbench run` writes
"""

from __future__ import annotations

import importlib.abc
import itertools
import sys
from collections.abc import Sequence
from importlib.machinery import ModuleSpec
from types import ModuleType


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


def _register_softmax1() -> None:
    """``models.hf.register_softmax1``, which imports torch and transformers' modeling code: only ever called once
    transformers is imported anyway. A failure warns instead of raising, since it would otherwise surface as a
    failed ``import transformers``; loading a softmax-1 model still fails loudly (its config names ``softmax1``)."""
    try:
        from models.hf import register_softmax1

        register_softmax1()
    except Exception as e:  # any failure: warn, see above
        import warnings

        warnings.warn(f"qbench could not register softmax1 with transformers: {e}", stacklevel=2)


class _RegisterWhenTransformersLoads(importlib.abc.MetaPathFinder):
    """On ``sys.meta_path`` until transformers is imported: lets the other finders find the package, and has its
    loader register softmax-1 right after the package has run. Then it is gone, so it costs nothing afterwards."""

    def find_spec(
        self, fullname: str, path: Sequence[str] | None, target: ModuleType | None = None
    ) -> ModuleSpec | None:
        if fullname != "transformers":
            return None
        if self in sys.meta_path:
            sys.meta_path.remove(self)
        import importlib.util

        spec = importlib.util.find_spec(fullname)  # the real finders: this one has just left
        loader = spec.loader if spec is not None else None
        if loader is None or isinstance(loader, type) or not hasattr(loader, "exec_module"):
            # no loader instance of its own to wrap (patching a loader class would reach every module it
            # loads); qbench's own loading paths register explicitly anyway
            return spec
        exec_module = loader.exec_module

        def exec_then_register(module: ModuleType) -> None:
            try:
                exec_module(module)
            finally:
                del loader.exec_module  # the instance is left as it was found
            _register_softmax1()

        loader.exec_module = exec_then_register  # type: ignore[method-assign]  (this loader instance only)
        return spec


def _register_softmax1_with_transformers() -> None:
    if "transformers" in sys.modules:
        _register_softmax1()
    elif not any(isinstance(f, _RegisterWhenTransformersLoads) for f in sys.meta_path):
        sys.meta_path.insert(0, _RegisterWhenTransformersLoads())


try:
    from importlib import metadata

    try:
        __version__ = metadata.version("qbench")
    except metadata.PackageNotFoundError:  # running from a source tree that was never installed
        __version__ = "0+unknown"

    _register_softmax1_with_transformers()
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
