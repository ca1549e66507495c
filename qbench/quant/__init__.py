"""Quantisation: granularities, pure primitives, custom ops, schemes, fake-quant layers and ``quantize``.

Layers, each importing only the ones above it (torchao's layering):
``granularity`` (what shares a scale) -> ``primitives`` (pure math) -> ``ops`` (custom torch ops, per-device
kernels) -> ``schemes`` (named configurations) -> ``fake`` (fake-quant linear) -> ``apply`` (``quantize``).
Real integer kernels live in ``qbench.quant.kernels`` and are imported only for ``mode="real"``.
"""

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
