"""What a number format *is* — names, bit layouts, block sizes, valid bit widths — without its arithmetic.

Kept apart from ``formats.py`` (the rounding, in torch) so that the scheme registry, ``qbench ls schemes`` and
argument checking import no torch: listing 40 schemes should not cost a 3-second framework import. The element
and scaled formats are defined in ``formats.py``'s docstring (OFP8 rev 1.0; OCP MX v1.0 §5.3, §6.3; NVFP4).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

from models.errors import UserError, unknown_choice

if TYPE_CHECKING:
    import torch
    from torch import Tensor

E8M0_MIN_EXP, E8M0_MAX_EXP = -127, 127  # MX v1.0 §5.4.1
NVFP4_BLOCK_SCALE_MIN = 2.0**-6  # E4M3's smallest normal, torchao's E4M3_EPS (a test holds it to torch.finfo)
# NVFP4 recipe -> the lower clamp of the block scale before its E4M3 cast (formats.py's docstring)
NVFP4_RECIPES: dict[str, float] = {"nvidia": 0.0, "torchao": NVFP4_BLOCK_SCALE_MIN}
INT = "int"  # the default: integer grids (primitives.py)


def check_bits(bits: int) -> None:
    """Integer grids run from 2 to 8 bits (one line naming the bad value otherwise)."""
    if isinstance(bits, bool) or not isinstance(bits, int) or not 2 <= bits <= 8:
        raise UserError(f"bits={bits!r} is not supported; choose an integer from 2 to 8")


@dataclass(frozen=True)
class ElementFormat:
    """A small IEEE-like float: sign, ``exp_bits``, ``man_bits``, subnormals, saturating at ``max_normal``.

    ``dtype_name``: the torch dtype (``torch.<name>``) whose cast rounds to this format, when torch has one.
    """

    name: str
    exp_bits: int
    man_bits: int
    max_normal: float
    dtype_name: str | None = None

    @property
    def torch_dtype(self) -> torch.dtype | None:
        """The torch dtype whose cast rounds to this format (None: rounded by ``formats.round_to_minifloat``)."""
        if self.dtype_name is None:
            return None
        import torch

        return getattr(torch, self.dtype_name)

    @property
    def bits(self) -> int:
        return 1 + self.exp_bits + self.man_bits

    @property
    def bias(self) -> int:
        return 2 ** (self.exp_bits - 1) - 1

    @property
    def emax(self) -> int:
        """Exponent of the largest normal number: the spec's emax_elem (MX v1.0 §6.3)."""
        return math.floor(math.log2(self.max_normal))

    def values(self) -> Tensor:
        """All non-negative finite values, ascending (float64): the format's value table."""
        import torch

        m = torch.arange(2**self.man_bits, dtype=torch.float64) / 2**self.man_bits
        subnormal = m * 2.0 ** (1 - self.bias)
        normal = [(1 + m) * 2.0**e for e in range(1 - self.bias, self.emax + 1)]
        table = torch.cat([subnormal, *normal])
        return table[table <= self.max_normal]


E4M3 = ElementFormat("e4m3", 4, 3, 448.0, "float8_e4m3fn")
E5M2 = ElementFormat("e5m2", 5, 2, 57344.0, "float8_e5m2")
E3M2 = ElementFormat("e3m2", 3, 2, 28.0)
E2M3 = ElementFormat("e2m3", 2, 3, 7.5)
E2M1 = ElementFormat("e2m1", 2, 1, 6.0)
ELEMENTS = {f.name: f for f in (E4M3, E5M2, E3M2, E2M3, E2M1)}


@dataclass(frozen=True)
class NumberFormat:
    """A scheme-level format: an element format and how scales are shared.

    ``scaling``: ``"fp8"`` (one float32 scale per block of the scheme's granularity), ``"mx"`` (an E8M0 scale
    per ``block_size`` elements of the last dimension), ``"nv"`` (an E4M3 scale per block and a float32 scale
    per tensor). ``recipe``: for ``"nv"``, which block-scale rule (:data:`NVFP4_RECIPES`); None otherwise.
    """

    name: str
    element: ElementFormat
    scaling: str
    block_size: int | None
    label: str
    description: str
    recipe: str | None = None

    @property
    def bits(self) -> int:
        return self.element.bits


FORMATS: dict[str, NumberFormat] = {
    f.name: f
    for f in (
        NumberFormat("fp8-e4m3", E4M3, "fp8", None, "FP8-e4m3", "FP8 E4M3 (max 448), float32 scales"),
        NumberFormat("fp8-e5m2", E5M2, "fp8", None, "FP8-e5m2", "FP8 E5M2 (max 57344), float32 scales"),
        NumberFormat("mxfp8", E4M3, "mx", 32, "MXFP8", "OCP MX: E4M3 elements, E8M0 scale per 32"),
        NumberFormat("mxfp8-e5m2", E5M2, "mx", 32, "MXFP8-e5m2", "OCP MX: E5M2 elements, E8M0 scale per 32"),
        NumberFormat("mxfp6", E2M3, "mx", 32, "MXFP6", "OCP MX: E2M3 elements, E8M0 scale per 32"),
        NumberFormat("mxfp6-e3m2", E3M2, "mx", 32, "MXFP6-e3m2", "OCP MX: E3M2 elements, E8M0 scale per 32"),
        NumberFormat("mxfp4", E2M1, "mx", 32, "MXFP4", "OCP MX: E2M1 elements, E8M0 scale per 32"),
        NumberFormat(
            "nvfp4",
            E2M1,
            "nv",
            16,
            "NVFP4",
            "NVIDIA: E2M1 elements, E4M3 scale (subnormals allowed) per 16, fp32 per tensor",
            "nvidia",
        ),
        NumberFormat(
            "nvfp4-torchao",
            E2M1,
            "nv",
            16,
            "NVFP4-torchao",
            "NVFP4 with torchao's block scale, floored at E4M3's smallest normal 2^-6",
            "torchao",
        ),
    )
}


def get_format(name: str) -> NumberFormat:
    """The :class:`NumberFormat` called ``name`` (did-you-mean error otherwise; ``"int"`` is not one)."""
    if name not in FORMATS:
        raise unknown_choice("number format", name, [INT, *FORMATS])
    return FORMATS[name]
