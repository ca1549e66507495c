"""qbench: how well does a causal LM survive quantisation, and do softmax-1 and OrthoAdam help?

Importing qbench registers the ``softmax1`` attention function with transformers, so exported softmax-1 models
load with ``AutoModelForCausalLM.from_pretrained``.

The Python API (``qbench.api``), imported on first use so that ``import qbench`` loads nothing more::

    qbench.load(ckpt) -> LoadedModel                      # .model, .tokenizer, .description
    qbench.quantize(model, scheme, mode="fake", exclude=()) -> a quantised copy
    qbench.evaluate(model_or_ckpt, scheme, ...) -> dict   # the record `qbench run` writes
"""

from __future__ import annotations

from importlib import metadata

try:
    __version__ = metadata.version("qbench")
except metadata.PackageNotFoundError:  # running from a source tree that was never installed
    __version__ = "0+unknown"

from models.hf import register_softmax1

register_softmax1()

_API = ("quantize", "load", "evaluate")
__all__ = [*_API, "__version__"]


def __getattr__(name: str):
    """``qbench.quantize``/``load``/``evaluate``, imported lazily (PEP 562): the harness and the quantisers stay
    unimported until used."""
    if name in _API:
        from qbench import api

        return getattr(api, name)
    raise AttributeError(f"module 'qbench' has no attribute {name!r}")
