"""Real quantised linear layers: what ``quantize(model, scheme, mode="real")`` puts in place of each linear.

``make_real_linear(weight, bias, scheme, input_scale=, rotation=)`` takes the same arguments as
``FakeQuantLinear`` and computes the same function with real low-precision storage and kernels. Which layer a
scheme gets is decided by one registry, :data:`REAL_KERNELS`: an ordered list of :class:`RealKernel` entries —
what it covers, its layer class, its kernels and a predicate on the scheme — the first entry whose
predicate holds builds the layer. ``qbench ls schemes`` (its real-kernel column), ``qbench env``, ``qbench speed``
and the table in docs/schemes.md (:func:`kernels_table`; a test keeps the page equal to it) are generated from
it. Adding an integer format with a real kernel: write the layer (on :class:`~.base.RealLinear`), its kernel and
its builder (in the layer's file; ``dispatch.BUILDERS`` names it), add one entry in ``registry.py``, and test it against fake mode.

The kernel tree: every compiled or GPU kernel of qbench lives in this package (a layout test holds it so).
``native_ref.c`` / ``native_avx2.c`` / ``native.c`` (+ ``native.h``) are the real layers' C library — portable
reference loops, AVX2 loops, and the entry points choosing between them at build time; ``native.py`` loads it
(``build.py``: the one compiler lookup) and wraps it; ``_ops.py`` registers the wrappers as ``torch.ops.qbench``
custom ops so compiled models keep them; ``paths.py`` decides which kernel a layer runs. ``fake_quant.c`` +
``fake_cpu.py`` and ``triton_fake.py`` serve ``qbench::fake_quantize`` (``qbench.quant.ops``).

Anything else (another bit width, per-input-channel activation scales, an asymmetric or group-wise int8 weight
with int8 activations)
has no integer kernel here and raises :class:`UserError` — run it with ``mode="fake"``. ``weight`` is always
(out, in); the caller transposes GPT-2 ``Conv1D`` weights.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

# Names resolve lazily (PEP 562): ``qbench ls schemes`` reads the registry without importing torch and the layers.
_EXPORTS = {
    "REAL_KERNELS": "registry",
    "RealKernel": "registry",
    "PATH_LAYERS": "registry",
    "NATIVE_LAYERS": "registry",
    "PACKED_BITS": "registry",
    "real_kernel_for": "registry",
    "kernels_table": "registry",
    "make_real_linear": "dispatch",
    "kernel_paths": "dispatch",
    "available_backends": "dispatch",
    "Int8Linear": "int8",
    "int_mm": "int8",
    "Int4Linear": "int4",
    "pack_int4": "int4",
    "unpack_int4": "int4",
    "LowBitLinear": "lowbit",
    "pack_bits": "lowbit",
    "unpack_bits": "lowbit",
    "Int4A8Linear": "w4a8",
}
__all__ = [
    "NATIVE_LAYERS",
    "PACKED_BITS",
    "PATH_LAYERS",
    "REAL_KERNELS",
    "Int4A8Linear",
    "Int4Linear",
    "Int8Linear",
    "LowBitLinear",
    "RealKernel",
    "available_backends",
    "int_mm",
    "kernel_paths",
    "kernels_table",
    "make_real_linear",
    "pack_bits",
    "pack_int4",
    "real_kernel_for",
    "unpack_bits",
    "unpack_int4",
]

if TYPE_CHECKING:
    from qbench.quant.kernels.dispatch import available_backends, kernel_paths, make_real_linear
    from qbench.quant.kernels.int4 import Int4Linear, pack_int4, unpack_int4
    from qbench.quant.kernels.int8 import Int8Linear, int_mm
    from qbench.quant.kernels.lowbit import LowBitLinear, pack_bits, unpack_bits
    from qbench.quant.kernels.registry import (
        NATIVE_LAYERS,
        PACKED_BITS,
        PATH_LAYERS,
        REAL_KERNELS,
        RealKernel,
        kernels_table,
        real_kernel_for,
    )
    from qbench.quant.kernels.w4a8 import Int4A8Linear


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module 'qbench.quant.kernels' has no attribute {name!r}")
    return getattr(importlib.import_module(f"qbench.quant.kernels.{_EXPORTS[name]}"), name)
