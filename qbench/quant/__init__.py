"""Quantisation: granularities, pure primitives, custom ops, schemes, fake-quant layers and ``quantize``.

Layers, each importing only the ones above it (torchao's layering):
``granularity`` (what shares a scale) -> ``primitives`` (pure math) -> ``ops`` (custom torch ops, per-device
kernels) -> ``schemes`` (named configurations) -> ``fake`` (fake-quant linear) -> ``apply`` (``quantize``).
Real integer kernels live in ``qbench.quant.kernels`` and are imported only for ``mode="real"``.

The names below import on first use (PEP 562): most of these modules import torch, and the command line reads
torch-free ones (``kv_options``) through this package without paying for it.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # type checkers see the lazy names as ordinary imports
    from qbench.quant.apply import model_bytes, quantize, select_layers
    from qbench.quant.fake import FakeQuantLinear, HadamardRotation
    from qbench.quant.granularity import (
        Granularity,
        PerAxis,
        PerBlock,
        PerGroup,
        PerTensor,
        PerToken,
        per_sequence,
    )
    from qbench.quant.ops import fake_quantize_activation
    from qbench.quant.primitives import QParams, choose_qparams, dequantize, fake_quantize
    from qbench.quant.primitives import quantize as quantize_tensor
    from qbench.quant.schemes import PAPER_SCHEMES, SCHEMES, QuantScheme, get_scheme

# lazy name -> (module, its name there)
_LAZY: dict[str, tuple[str, str]] = {
    **{n: ("qbench.quant.apply", n) for n in ("model_bytes", "quantize", "select_layers")},
    **{n: ("qbench.quant.fake", n) for n in ("FakeQuantLinear", "HadamardRotation")},
    **{
        n: ("qbench.quant.granularity", n)
        for n in ("Granularity", "PerAxis", "PerBlock", "PerGroup", "PerTensor", "PerToken", "per_sequence")
    },
    "fake_quantize_activation": ("qbench.quant.ops", "fake_quantize_activation"),
    **{
        n: ("qbench.quant.primitives", n)
        for n in ("QParams", "choose_qparams", "dequantize", "fake_quantize")
    },
    "quantize_tensor": ("qbench.quant.primitives", "quantize"),
    **{n: ("qbench.quant.schemes", n) for n in ("PAPER_SCHEMES", "SCHEMES", "QuantScheme", "get_scheme")},
}

__all__ = [
    "PAPER_SCHEMES",
    "SCHEMES",
    "FakeQuantLinear",
    "Granularity",
    "HadamardRotation",
    "PerAxis",
    "PerBlock",
    "PerGroup",
    "PerTensor",
    "PerToken",
    "QParams",
    "QuantScheme",
    "choose_qparams",
    "dequantize",
    "fake_quantize",
    "fake_quantize_activation",
    "get_scheme",
    "model_bytes",
    "per_sequence",
    "quantize",
    "quantize_tensor",
    "select_layers",
]


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        module, attribute = _LAZY[name]
        value = getattr(importlib.import_module(module), attribute)
        globals()[name] = value  # later lookups skip this hook
        return value
    raise AttributeError(f"module 'qbench.quant' has no attribute {name!r}")
