"""A packed KV cache's storage: integer codes with their scales (FP8 bytes with a scalar scale), dequantised on read.

``pack(quantizer, x, values, offset)`` turns positions of a (B, H, n, D) key or value tensor that the scheme has
made final into a :class:`Packed` — the bytes a deployed cache would hold — and ``Packed.dequantize()`` gives back
exactly what the fake path (``KVSchemeQuantizer.quantize_keys/values``) computes, so a model generating through
``models.kvcache.PackedKVCache`` produces the fake cache's logits bit for bit. Storage per scheme:

- ``kivi``: codes of b bits (2 and 4 bits packed 4 and 2 to a byte, 8 bits one byte, 3 and 6 bits one byte each —
  unpacked), plus per group a float32 scale and minimum (KIVI's kernels store fp16; float32 keeps the fake and
  packed paths identical), keys one (scale, min) per G tokens × channel, values per token × G channels.
- ``per-token``: llama.cpp's blocks — codes (packed as above; q8_0 int8) plus an fp16 d (and an fp16 min for
  q{b}_1) per block of 32 values: q8_0 34 bytes, q4_0 18 bytes, q4_1 20 bytes per 32 values, as block_q8_0 /
  block_q4_0 / block_q4_1 in ggml-common.h.
- ``fp8-*``: one float8 byte per value and one float32 scale per layer (vLLM's k_scale / v_scale).

Kept positions (``keep_first``, sinks) and the ``window`` scheme (whose ranges change as the window grows) have no
packed form here: :func:`pack` refuses them.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Any

import torch
from torch import Tensor

from models.errors import UserError
from qbench.quant.formats import E4M3, E5M2
from qbench.quant.hadamard import rotate_rows
from qbench.quant.primitives import TINY, check_finite, true_div

FP8_ELEMENTS = {"fp8-e4m3": E4M3, "fp8-e5m2": E5M2}


def _fp16(x: Tensor) -> Tensor:
    """A scale as llama.cpp stores it (GGML_FP32_TO_FP16) and reads it back."""
    return x.to(torch.float16).float()


def ggml_codes(xb: Tensor, bits: int, symmetric: bool) -> tuple[Tensor, Tensor, Tensor | None]:
    """llama.cpp's reference block quantisers over the last dim of ``xb`` (one block per row): the codes q (as
    float32 integers: q8_0 signed, q{b}_0 and q{b}_1 in 0 … 2^b − 1), the block scale d and (q{b}_1) the block
    minimum, both as stored: fp16. Module docstring."""
    xf = xb.float()
    if symmetric and bits == 8:  # quantize_row_q8_0_ref
        amax = xf.abs().amax(-1, keepdim=True)
        check_finite((-amax, amax), "KV-cache quantisation")
        d = true_div(amax, 127)
        inv = torch.where(d != 0, 1.0 / d, torch.zeros_like(d))
        return torch.trunc(xf * inv + torch.sign(xf) * 0.5), d.half(), None  # roundf: half away from zero
    levels = 2**bits - 1
    if symmetric:  # quantize_row_q4_0_ref / q5_0: d = m / −2^(b−1), m the signed value of largest magnitude
        half = 2 ** (bits - 1)
        m = xf.gather(-1, xf.abs().argmax(-1, keepdim=True))
        check_finite((-m.abs(), m.abs()), "KV-cache quantisation")
        d = true_div(m, -half)
        inv = torch.where(d != 0, 1.0 / d, torch.zeros_like(d))
        return torch.floor(xf * inv + (half + 0.5)).clamp_max(levels), d.half(), None
    lo, hi = xf.amin(-1, keepdim=True), xf.amax(-1, keepdim=True)  # quantize_row_q4_1_ref / q5_1
    check_finite((lo, hi), "KV-cache quantisation")
    d = true_div(hi - lo, levels)
    inv = torch.where(d != 0, 1.0 / d, torch.zeros_like(d))
    return torch.floor((xf - lo) * inv + 0.5).clamp(0, levels), d.half(), lo.half()


def ggml_dequantize(q: Tensor, d: Tensor, m: Tensor | None, bits: int, symmetric: bool) -> Tensor:
    """dequantize_row_q8_0 / q{b}_0 / q{b}_1 in float32: q·d, (q − 2^(b−1))·d, q·d + m."""
    q = q.float()
    if symmetric and bits == 8:
        return q * d.float()
    if symmetric:
        return (q - 2 ** (bits - 1)) * d.float()
    return q * d.float() + m.float()


def ggml_quantize_blocks(xb: Tensor, bits: int, symmetric: bool) -> Tensor:
    """:func:`ggml_codes` then :func:`ggml_dequantize`: a block row as llama.cpp's cache gives it back."""
    return ggml_dequantize(*ggml_codes(xb, bits, symmetric), bits, symmetric)


def _unit(bits: int) -> tuple[int, int]:
    """(codes, bytes) of the smallest whole-byte unit of ``bits``-bit codes: 2 → (4, 1), 3 → (8, 3), 4 → (2, 1)."""
    codes = 8 // math.gcd(8, bits)
    return codes, codes * bits // 8


def _pack_bits(q: Tensor, bits: int) -> Tensor:
    """Integer codes 0 … 2^b − 1 -> uint8, packed densely along the last dim in whole-byte units (b = 2: 4 codes a
    byte; 3: 8 codes in 3 bytes, as KIVI's and llama.cpp's 3-bit layouts are dense; 4: 2 a byte), code i of a unit
    at bits b·i … b·i + b − 1 of its little-endian bytes; one code a byte for b ≥ 8 or when the unit does not
    divide the last dim."""
    q = q.to(torch.uint8)
    if bits >= 8:
        return q
    per, nbytes = _unit(bits)
    if q.size(-1) % per:
        return q
    q = q.reshape(*q.shape[:-1], q.size(-1) // per, per).to(torch.int64)
    shifts = torch.arange(per, dtype=torch.int64, device=q.device) * bits
    word = (q << shifts).sum(-1, keepdim=True)  # a unit is at most 56 bits (b = 7): int64 holds it
    out = (word >> (8 * torch.arange(nbytes, dtype=torch.int64, device=q.device))) & 0xFF
    return out.to(torch.uint8).reshape(*q.shape[:-2], -1)


def _unpack_bits(packed: Tensor, bits: int, last: int) -> Tensor:
    if bits >= 8 or packed.size(-1) == last:
        return packed
    per, nbytes = _unit(bits)
    units = packed.reshape(*packed.shape[:-1], -1, nbytes).to(torch.int64)
    word = (units << (8 * torch.arange(nbytes, dtype=torch.int64, device=packed.device))).sum(
        -1, keepdim=True
    )
    q = (word >> (bits * torch.arange(per, dtype=torch.int64, device=packed.device))) & (2**bits - 1)
    return q.to(torch.uint8).reshape(*packed.shape[:-1], last)


@dataclass
class Packed:
    """One packed range of cache positions: ``codes`` (uint8/int8/float8), ``scale`` and ``zero`` as stored."""

    kind: str  # "minmax" (KIVI eq. 1), "ggml", "fp8"
    codes: Tensor
    scale: Tensor
    zero: Tensor | None
    bits: int
    symmetric: bool
    shape: tuple[int, ...]  # (B, H, n, D) of the positions
    grouped: tuple[int, ...]  # the shape codes are quantised in (before bit packing)
    layout: str  # how ``grouped`` maps back to (B, H, n, D): "bhnd" or "rows" (per-token rows)
    dtype: torch.dtype
    # rotate=true: the codes hold k·Rᵀ (QuaRot's cache), read back as Q(k·Rᵀ)·R; R's seed (None: not rotated)
    rotation_seed: int | None = None

    @property
    def nbytes(self) -> int:
        """Bytes this range takes in the cache: codes, scales and minima (fp8: the layer's one scale, a
        parameter of the layer rather than of the range, is not counted)."""
        extra = 0 if self.zero is None else self.zero.numel() * self.zero.element_size()
        scale = 0 if self.kind == "fp8" else self.scale.numel() * self.scale.element_size()
        return self.codes.numel() * self.codes.element_size() + scale + extra

    def extend(self, other: Packed) -> Packed:
        """This range followed by ``other`` (the next positions, packed the same way) as one range."""
        axis = 1 if self.layout == "rows" else 2  # the position (or group) axis of codes, scale and zero
        B, H, n, D = self.shape
        grouped = list(self.grouped)
        grouped[axis] += other.grouped[axis]
        return Packed(
            self.kind,
            torch.cat([self.codes, other.codes], dim=axis),
            self.scale if self.kind == "fp8" else torch.cat([self.scale, other.scale], dim=axis),
            None if self.zero is None else torch.cat([self.zero, other.zero], dim=axis),
            self.bits,
            self.symmetric,
            (B, H, n + other.shape[2], D),
            tuple(grouped),
            self.layout,
            self.dtype,
            self.rotation_seed,
        )

    def dequantize(self) -> Tensor:
        x = self._stored()
        if self.rotation_seed is not None:
            x = rotate_rows(x, self.rotation_seed, inverse=True)
        return x.to(self.dtype)

    def _stored(self) -> Tensor:
        """The dequantised codes (B, H, n, D), float32, in the basis they were stored in."""
        B, H, n, D = self.shape
        if self.kind == "fp8":
            return self.codes.float() * self.scale
        if self.layout == "kivi-k":  # codes packed along each group's tokens: (B, H, m, D, G)
            q = _unpack_bits(self.codes, self.bits, self.grouped[-2]).transpose(-1, -2)
        elif self.codes.dtype == torch.uint8:
            q = _unpack_bits(self.codes, self.bits, self.grouped[-1])
        else:
            q = self.codes
        q = q.reshape(self.grouped)
        if self.kind == "minmax":
            x = q.float().mul_(self.scale).add_(self.zero)
        else:
            x = ggml_dequantize(q, self.scale, self.zero, self.bits, self.symmetric)
        if self.layout == "rows":
            return x.reshape(B, n, H, D).transpose(1, 2)
        return x.reshape(B, H, n, D)


def _minmax_codes(x: Tensor, bits: int, dim: int) -> tuple[Tensor, Tensor, Tensor]:
    """KIVI eq. 1's codes with float32 (scale, min), the same arithmetic as ``kvschemes.minmax_quantize``."""
    xf = x.float()
    lo, hi = xf.amin(dim, keepdim=True), xf.amax(dim, keepdim=True)
    check_finite((lo, hi), "KV-cache quantisation")
    qmax = 2**bits - 1
    scale = true_div(hi - lo, qmax).clamp_min(TINY)
    return (xf - lo).div_(scale).round_().clamp_(0, qmax), scale, lo


def pack(quantizer: Any, x: Tensor, values: bool, offset: int = 0) -> Packed:
    """The packed form of all positions of ``x`` (B, H, n, D), absolute positions offset … offset + n − 1, which
    the scheme has made final (for KIVI keys: whole groups)."""
    c, name = quantizer.config, quantizer.scheme.name
    if c.keep_first or c.keep_sinks or name == "window":
        raise UserError(
            f"the packed KV cache does not hold {c.label}: kept positions and the window scheme have no packed "
            "form (use the fake cache, Transformer.new_cache())"
        )
    if c.rotate:  # the cache holds k·Rᵀ (QuaRot); Packed.dequantize rotates back
        seed = quantizer.rotation_seed
        packed = _pack(quantizer, rotate_rows(x, seed), values, offset)
        return replace(packed, dtype=x.dtype, rotation_seed=seed)
    return _pack(quantizer, x, values, offset)


def _pack(quantizer: Any, x: Tensor, values: bool, offset: int) -> Packed:
    c, name = quantizer.config, quantizer.scheme.name
    B, H, n, D = x.shape
    if name in FP8_ELEMENTS:
        s = quantizer._fp8_scale(values)
        element = FP8_ELEMENTS[name]
        codes = (x.float() / s).clamp(-element.max_normal, element.max_normal).to(element.torch_dtype)
        return Packed(
            "fp8", codes, torch.tensor(s), None, 8, True, (B, H, n, D), (B, H, n, D), "bhnd", x.dtype
        )
    if name == "per-token":
        if (H * D) % c.block:
            raise UserError(
                f"the packed per-token cache needs rows of {H}×{D} values in whole blocks of {c.block}"
            )
        rows = x.transpose(1, 2).reshape(B, n, H * D // c.block, c.block)
        q, d, m = ggml_codes(rows, c.bits, c.sym)
        signed = c.sym and c.bits == 8
        codes = q.to(torch.int8) if signed else _pack_bits(q, c.bits)
        return Packed("ggml", codes, d, m, c.bits, c.sym, (B, H, n, D), tuple(rows.shape), "rows", x.dtype)
    if not values:  # KIVI keys: per channel over groups of G tokens (offset and n are multiples of G)
        G = c.group
        if offset % G or n % G:
            raise ValueError(
                f"KIVI keys are packed in whole groups of {G}, got positions {offset}…{offset + n - 1}"
            )
        grouped = x.reshape(B, H, n // G, G, D)
        q, scale, lo = _minmax_codes(grouped, c.bits, -2)
        codes = _pack_bits(q.transpose(-1, -2), c.bits)  # pack along the group's tokens
        return Packed(
            "minmax", codes, scale, lo, c.bits, False, (B, H, n, D), tuple(grouped.shape), "kivi-k", x.dtype
        )
    G = c.group if D % c.group == 0 else D  # KIVI values: per token, groups of G channels
    grouped = x.reshape(B, H, n, D // G, G)
    q, scale, lo = _minmax_codes(grouped, c.bits, -1)
    return Packed(
        "minmax",
        _pack_bits(q, c.bits),
        scale,
        lo,
        c.bits,
        False,
        (B, H, n, D),
        tuple(grouped.shape),
        "bhnd",
        x.dtype,
    )
