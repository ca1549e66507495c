"""llama.cpp's file types that ``qbench`` scores as cells (``--scheme gguf:q4_k_m``), apart from
:mod:`qbench.quant.llamacpp` so that the scheme registry and ``qbench ls schemes`` list them without importing
torch or llama.cpp.

Each entry: the ``LLAMA_FTYPE_*`` number of llama.cpp's ``include/llama.h`` (what ``llama_model_quantize`` takes;
a test holds them equal to the installed ``llama_cpp``'s constants), the nominal weight bits, the block of weights
one scale covers, and what the type is (llama.cpp's ``ggml-common.h`` block layouts and its ``quantize`` tool's
mixes). A file type is a *mix*: llama.cpp chooses each tensor's type (``llama_tensor_get_type``) — the output
head and the token embedding usually Q6_K / a 4–8-bit type, some attention and FFN tensors of the mixes one or two
steps up, and a tensor whose rows are not a multiple of a k-quant's 256 falls back to a legacy type — so a cell's
record lists the tensor types actually written. On the CPU every quantised type multiplies against activations quantised to 8-bit blocks (its
``vec_dot_type``: Q8_0, Q8_1 or Q8_K), which the entries state as ``act_bits`` 8 in blocks of 32 or 256.

Types that need an importance matrix (IQ1_*, IQ2_*, IQ3_XXS, IQ3_XS, Q2_K_S), which qbench does not compute, and
the ternary, MoE and new 1–2-bit types (TQ1_0, TQ2_0, MXFP4_MOE, Q1_0, Q2_0, NVFP4) are not offered.
"""

from __future__ import annotations

from typing import NamedTuple


class GGUFType(NamedTuple):
    ftype: int  # LLAMA_FTYPE_* (llama.h)
    bits: int | None  # nominal weight bits; None for the float files
    block: int | None  # weights per scale (32 legacy and IQ4_NL, 256 k-quants and IQ4_XS); None for float
    act_block: int | None  # the block of the 8-bit activations it multiplies against on the CPU; None: float
    minimum: bool  # a block minimum (asymmetric: Q4_1, Q5_1, Q2_K, Q4_K, Q5_K) beside the scale
    description: str


GGUF_TYPES: dict[str, GGUFType] = {
    "F32": GGUFType(
        0, None, None, None, False, "float32 weights (llama.cpp's own kernels: the consistency baseline)"
    ),
    "F16": GGUFType(
        1,
        None,
        None,
        None,
        False,
        "float16 weights (norms float32); activations rounded to float16 for the dot product",
    ),
    "BF16": GGUFType(
        32,
        None,
        None,
        None,
        False,
        "bfloat16 weights (norms float32); activations rounded to bfloat16 for the dot product",
    ),
    "Q8_0": GGUFType(
        7, 8, 32, 32, False, "int8 symmetric blocks of 32, one fp16 scale (8.5 bits per weight)"
    ),
    "Q6_K": GGUFType(
        18, 6, 256, 256, False, "6-bit k-quant: super-blocks of 256, 16 sub-blocks of 16 with 8-bit scales"
    ),
    "Q5_K_M": GGUFType(
        17, 5, 256, 256, True, "5-bit k-quant mix (Q5_K; some layers' attn_v and ffn_down Q6_K)"
    ),
    "Q5_K_S": GGUFType(16, 5, 256, 256, True, "5-bit k-quant (Q5_K)"),
    "Q5_1": GGUFType(9, 5, 32, 32, True, "5-bit asymmetric blocks of 32 (fp16 scale and minimum)"),
    "Q5_0": GGUFType(8, 5, 32, 32, False, "5-bit symmetric blocks of 32 (fp16 scale)"),
    "Q4_K_M": GGUFType(
        15, 4, 256, 256, True, "4-bit k-quant mix (Q4_K; some layers' attn_v and ffn_down Q6_K)"
    ),
    "Q4_K_S": GGUFType(14, 4, 256, 256, True, "4-bit k-quant (Q4_K; some layers' attn_v and ffn_down Q5_K)"),
    "Q4_1": GGUFType(3, 4, 32, 32, True, "4-bit asymmetric blocks of 32 (fp16 scale and minimum)"),
    "Q4_0": GGUFType(2, 4, 32, 32, False, "4-bit symmetric blocks of 32 (fp16 scale)"),
    "IQ4_NL": GGUFType(25, 4, 32, 32, False, "4-bit non-linear codebook, blocks of 32 (fp16 scale)"),
    "IQ4_XS": GGUFType(
        30, 4, 256, 256, False, "4-bit non-linear codebook, super-blocks of 256 with 6-bit sub-scales"
    ),
    "Q3_K_L": GGUFType(
        13, 3, 256, 256, False, "3-bit k-quant mix (Q3_K; attn_v, attn_output and some ffn_down Q5_K)"
    ),
    "Q3_K_M": GGUFType(
        12, 3, 256, 256, False, "3-bit k-quant mix (Q3_K; attn_v, attn_output and some ffn_down Q4_K/Q5_K)"
    ),
    "Q3_K_S": GGUFType(11, 3, 256, 256, False, "3-bit k-quant (Q3_K)"),
    "IQ3_M": GGUFType(27, 3, 256, 256, False, "3-bit lattice codebook mix (IQ3_S; some tensors Q4_K)"),
    "IQ3_S": GGUFType(26, 3, 256, 256, False, "3-bit lattice codebook (IQ3_S), super-blocks of 256"),
    "Q2_K": GGUFType(
        10, 2, 256, 256, True, "2-bit k-quant mix (Q2_K; attn_v, attn_output and ffn_down Q3_K or Q4_K)"
    ),
}
GGUF_PREFIX = "gguf:"  # a scheme ``gguf:q4_k_m`` is llama.cpp's file type Q4_K_M


def check_type(type_name: str) -> str:
    """``q4_k_m`` -> ``Q4_K_M``; an unknown type fails in one line naming the valid ones (did-you-mean)."""
    from models.errors import unknown_choice

    name = str(type_name).strip().upper()
    if name not in GGUF_TYPES:
        raise unknown_choice("llama.cpp file type", name, GGUF_TYPES)
    return name


def scheme_name(type_name: str) -> str:
    """``Q4_K_M`` -> ``gguf:q4_k_m``."""
    return GGUF_PREFIX + type_name.lower()


# ------------------------------------------------------------------ one tensor's type (a mixed file)


class TensorType(NamedTuple):
    ggml: int  # enum ggml_type (ggml.h; gguf-py's GGMLQuantizationType, a test holds them equal)
    block: int  # weights per block: a row's length must be a multiple of it
    block_bytes: int  # bytes one block takes (ggml-common.h's block_* sizes)


# The ggml types one tensor of a mixed file can take (``gguf:f16:ffn_down=q6_k``), written by llama.cpp's own
# quantiser (``ggml_quantize_chunk``, what ``llama_model_quantize`` calls per tensor, without an importance
# matrix). The k-quants need rows that are whole super-blocks of 256 (llama.cpp's quantize tool falls back to a
# legacy type for other rows; here such a tensor is refused in one line). Bits per weight: 8·block_bytes / block.
TENSOR_TYPES: dict[str, TensorType] = {
    "F32": TensorType(0, 1, 4),
    "F16": TensorType(1, 1, 2),
    "BF16": TensorType(30, 1, 2),
    "Q8_0": TensorType(8, 32, 34),
    "Q6_K": TensorType(14, 256, 210),
    "Q5_K": TensorType(13, 256, 176),
    "Q5_1": TensorType(7, 32, 24),
    "Q5_0": TensorType(6, 32, 22),
    "Q4_K": TensorType(12, 256, 144),
    "Q4_1": TensorType(3, 32, 20),
    "Q4_0": TensorType(2, 32, 18),
    "IQ4_NL": TensorType(20, 32, 18),
    "IQ4_XS": TensorType(23, 256, 136),
    "Q3_K": TensorType(11, 256, 110),
    "Q2_K": TensorType(10, 256, 84),
}
FLOAT_BASES = ("F32", "F16", "BF16")  # the type of every tensor a mixed file's spec does not name

# What a spec key names: a kind of tensor in every block (llama.cpp's GGUF names), a block (``blk.3``), one tensor
# (``blk.3.ffn_down``), or the embedding / head. GPT-2 files fuse q, k, v into ``attn_qkv``.
TENSOR_KINDS = (
    "attn_q",
    "attn_k",
    "attn_v",
    "attn_qkv",
    "attn_output",
    "ffn_gate",
    "ffn_up",
    "ffn_down",
)
TENSOR_GLOBALS = ("token_embd", "output", "position_embd")


def tensor_type_bits(type_name: str) -> float:
    """Bits per weight of one tensor type (Q4_K: 4.5, Q8_0: 8.5)."""
    t = TENSOR_TYPES[type_name]
    return 8 * t.block_bytes / t.block


def check_tensor_type(type_name: str) -> str:
    """``q4_k`` -> ``Q4_K``; an unknown one (``q4_k_m`` is a file type, not a tensor type) fails in one line."""
    from models.errors import unknown_choice

    name = str(type_name).strip().upper()
    if name not in TENSOR_TYPES:
        raise unknown_choice("llama.cpp tensor type", name, TENSOR_TYPES)
    return name


def check_tensor_key(key: str) -> str:
    """A spec key as written (``ffn_down``, ``blk.3``, ``blk.3.attn_v``, ``token_embd``), or a one-line error."""
    from models.errors import UserError, unknown_choice

    key = key.strip()
    parts = key.split(".")
    if parts[0] == "blk":
        if len(parts) not in (2, 3) or not parts[1].isdigit():
            raise UserError(f"tensor key {key!r}: write a block as blk.N or one tensor as blk.N.<kind>")
        if len(parts) == 3 and parts[2] not in TENSOR_KINDS:
            raise unknown_choice("tensor kind", parts[2], TENSOR_KINDS)
        return key
    if key not in TENSOR_KINDS + TENSOR_GLOBALS:
        raise unknown_choice("tensor key", key, (*TENSOR_KINDS, *TENSOR_GLOBALS, "blk.N", "blk.N.<kind>"))
    return key


def key_matches(key: str, tensor_name: str) -> bool:
    """Does ``key`` name the GGUF tensor ``tensor_name`` (``blk.3.ffn_down.weight``)?"""
    stem = tensor_name.removesuffix(".weight")
    parts = stem.split(".")
    if key.startswith("blk."):
        return stem == key or (stem.startswith(key + ".") and key.count(".") == 1)
    return (parts[-1] == key and parts[0] == "blk") or stem == key


def parse_tensor_spec(spec: str) -> tuple[tuple[str, str], ...]:
    """``attn_v=q6_k,ffn_down=q4_k`` -> ((key, TYPE), …), checked; a tensor named twice (the same key, or a
    tensor two keys both name, such as ``ffn_down`` and ``blk.3.ffn_down``) is refused when the file is written
    (where the tensors are known); here a key given twice is."""
    from models.errors import UserError

    out: dict[str, str] = {}
    for item in spec.split(","):
        key, sep, value = item.partition("=")
        if not sep or not key.strip() or not value.strip():
            raise UserError(f"tensor spec {spec!r}: write key=type pairs, e.g. attn_v=q6_k,ffn_down=q4_k")
        key = check_tensor_key(key)
        if key in out:
            raise UserError(f"tensor spec {spec!r} names {key!r} twice; give each once")
        out[key] = check_tensor_type(value)
    return tuple(sorted(out.items()))


__all__ = [
    "FLOAT_BASES",
    "GGUF_PREFIX",
    "GGUF_TYPES",
    "TENSOR_TYPES",
    "GGUFType",
    "TensorType",
    "check_tensor_key",
    "check_tensor_type",
    "check_type",
    "key_matches",
    "parse_tensor_spec",
    "scheme_name",
    "tensor_type_bits",
]
