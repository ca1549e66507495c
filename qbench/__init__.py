"""qbench: how well does a causal LM survive quantisation, and do softmax-1 and OrthoAdam help?

Importing qbench registers the ``softmax1`` attention function with transformers, so exported softmax-1 models
load with ``AutoModelForCausalLM.from_pretrained``.
"""

from __future__ import annotations

from importlib import metadata

try:
    __version__ = metadata.version("qbench")
except metadata.PackageNotFoundError:  # running from a source tree that was never installed
    __version__ = "0+unknown"

from models.hf import register_softmax1

register_softmax1()
