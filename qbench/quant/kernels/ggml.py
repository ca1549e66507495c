"""llama.cpp's ggml quantisers through ctypes, from the library llama-cpp-python ships (``llama_cpp/lib``):
``ggml_quantize_chunk`` — the function ``llama_model_quantize`` calls for each tensor — so a mixed file's tensors
(``qbench.quant.llamacpp.quantize_tensor``) hold exactly the bytes llama.cpp's own quantize tool writes.

No source of ours is compiled here: the library is llama.cpp's, built by pip when ``qbench[llama-cpp]`` is
installed, and its C functions are plain (``ggml.h``)."""

from __future__ import annotations

import ctypes
from pathlib import Path
from typing import Any

from models.errors import UserError

_LIB: Any = None


def library() -> Any:
    """libggml-base, loaded once, its three functions typed."""
    global _LIB
    if _LIB is None:
        try:
            import llama_cpp
        except ImportError as e:
            raise UserError(
                f"llama.cpp's quantisers need llama-cpp-python: pip install 'qbench[llama-cpp]' ({e})"
            ) from None
        folder = Path(llama_cpp.__file__).parent / "lib"
        found = sorted(folder.glob("libggml-base.*")) + sorted(folder.glob("ggml-base.*"))
        if not found:
            raise UserError(
                f"llama-cpp-python's ggml library is not in {folder}: reinstall qbench[llama-cpp]"
            )
        lib = ctypes.CDLL(str(found[0]))
        i64 = ctypes.c_int64
        lib.ggml_quantize_chunk.restype = ctypes.c_size_t
        lib.ggml_quantize_chunk.argtypes = [
            ctypes.c_int,
            ctypes.c_void_p,
            ctypes.c_void_p,
            i64,
            i64,
            i64,
            ctypes.c_void_p,
        ]
        lib.ggml_row_size.restype = ctypes.c_size_t
        lib.ggml_row_size.argtypes = [ctypes.c_int, i64]
        lib.ggml_quantize_requires_imatrix.restype = ctypes.c_bool
        lib.ggml_quantize_requires_imatrix.argtypes = [ctypes.c_int]
        _LIB = lib
    return _LIB


def requires_imatrix(ggml_type: int) -> bool:
    return bool(library().ggml_quantize_requires_imatrix(ggml_type))


def quantize_rows(ggml_type: int, rows: Any) -> Any:
    """``rows`` (a C-contiguous float32 numpy array, rows × n) in ``ggml_type``: uint8, rows × row bytes, by
    ``ggml_quantize_chunk`` without an importance matrix (rows must be whole blocks: the caller checks)."""
    import numpy as np

    lib = library()
    count, n = rows.shape
    out = np.empty((count, lib.ggml_row_size(ggml_type, n)), dtype=np.uint8)
    written = lib.ggml_quantize_chunk(ggml_type, rows.ctypes.data, out.ctypes.data, 0, count, n, None)
    if written != out.nbytes:
        raise RuntimeError(f"ggml_quantize_chunk wrote {written} bytes, expected {out.nbytes}")
    return out


__all__ = ["library", "quantize_rows", "requires_imatrix"]
