"""What shares a quantisation scale: small frozen values, as in torchao's ``PerTensor``/``PerAxis``/... .

Every granularity reduces to a *block*: a tuple with one entry per tensor dimension, where ``-1`` means "the whole
dimension" and ``k >= 1`` means "contiguous runs of k indices". All elements inside one block share one scale (and
zero point). The block form is what the primitives, the custom ops and the kernels consume, so a granularity is a
value inside a scheme, never a code path.

===================  ================================================  ==============================
granularity          one scale per                                     block of a (B, T, C) tensor
===================  ================================================  ==============================
``PerTensor()``      the whole tensor                                  (-1, -1, -1)
``PerAxis(axis)``    index along ``axis`` (PerAxis(0) of an (out, in)  (-1, -1, 1) for axis = -1
                     weight = per output channel)
``PerToken()``       row over the last dim (leading dims kept)         (1, 1, -1)
``PerGroup(g)``      g contiguous elements of the last dim             (1, 1, g)
``PerBlock(block)``  an explicit block (e.g. one per sequence)         ``block`` itself
===================  ================================================  ==============================

:func:`per_sequence` gives the form used for *activations*: no scale is ever shared across the leading (batch)
dimension, so results do not depend on how sequences are batched.

**One vocabulary** (:func:`unit`; scheme labels, layer descriptions, records, docs and error messages all use it):
``tensor``; ``sequence`` (an activation's per-tensor scale, computed per sequence); ``channel`` (a weight's
output channel, PerAxis(0) of (out, in); an activation's input channel, PerAxis(−1)); ``token``; ``g<N>`` (groups
of N along the input dimension); anything else by its label (``axis<k>``, ``block…``). In prose: "per channel",
"per token", "per group of N".
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

from models.errors import UserError, unknown_choice

WHOLE = -1  # a block entry meaning "the whole dimension"


@dataclass(frozen=True)
class PerTensor:
    """One scale for the whole tensor."""

    kind: ClassVar[str] = "per_tensor"

    def block(self, ndim: int) -> tuple[int, ...]:
        return (WHOLE,) * ndim

    @property
    def label(self) -> str:
        return "tensor"

    def to_dict(self) -> dict[str, Any]:
        return {"kind": self.kind}


@dataclass(frozen=True)
class PerAxis:
    """One scale per index along ``axis`` (reduced over every other dimension); negative axes count from the end."""

    axis: int
    kind: ClassVar[str] = "per_axis"

    def block(self, ndim: int) -> tuple[int, ...]:
        if not -ndim <= self.axis < ndim:
            raise UserError(f"PerAxis(axis={self.axis}) is out of range for a {ndim}-d tensor")
        axis = self.axis % ndim
        return tuple(1 if d == axis else WHOLE for d in range(ndim))

    @property
    def label(self) -> str:
        return f"axis{self.axis}"

    def to_dict(self) -> dict[str, Any]:
        return {"kind": self.kind, "axis": self.axis}


@dataclass(frozen=True)
class PerToken:
    """One scale per row over the last dimension; all leading dimensions are kept (a token of a (B, T, C) input)."""

    kind: ClassVar[str] = "per_token"

    def block(self, ndim: int) -> tuple[int, ...]:
        return (1,) * (ndim - 1) + (WHOLE,) if ndim else ()

    @property
    def label(self) -> str:
        return "token"

    def to_dict(self) -> dict[str, Any]:
        return {"kind": self.kind}


@dataclass(frozen=True)
class PerGroup:
    """One scale per ``group_size`` contiguous elements of the last dimension (which it must divide)."""

    group_size: int
    kind: ClassVar[str] = "per_group"

    def __post_init__(self) -> None:
        if not isinstance(self.group_size, int) or self.group_size < 1:
            raise UserError(
                f"PerGroup(group_size={self.group_size!r}): group_size must be a positive integer"
            )

    def block(self, ndim: int) -> tuple[int, ...]:
        if ndim == 0:
            raise UserError("PerGroup needs a tensor with at least one dimension")
        return (1,) * (ndim - 1) + (self.group_size,)

    @property
    def label(self) -> str:
        return f"g{self.group_size}"

    def to_dict(self) -> dict[str, Any]:
        return {"kind": self.kind, "group_size": self.group_size}


@dataclass(frozen=True)
class PerBlock:
    """An explicit block (``-1`` = whole dimension); its length must equal the tensor's number of dimensions."""

    block_size: tuple[int, ...]
    kind: ClassVar[str] = "per_block"

    def __post_init__(self) -> None:
        object.__setattr__(self, "block_size", tuple(int(b) for b in self.block_size))
        if any(b == 0 or b < WHOLE for b in self.block_size):
            raise UserError(f"PerBlock{self.block_size}: entries must be -1 (whole dim) or positive")

    def block(self, ndim: int) -> tuple[int, ...]:
        if len(self.block_size) != ndim:
            raise UserError(f"PerBlock{self.block_size} does not fit a {ndim}-d tensor")
        return self.block_size

    @property
    def label(self) -> str:
        return "block" + "x".join("all" if b == WHOLE else str(b) for b in self.block_size)

    def to_dict(self) -> dict[str, Any]:
        return {"kind": self.kind, "block_size": list(self.block_size)}


Granularity = PerTensor | PerAxis | PerToken | PerGroup | PerBlock
_KINDS: dict[str, type] = {cls.kind: cls for cls in (PerTensor, PerAxis, PerToken, PerGroup, PerBlock)}


def granularity_from_dict(d: dict[str, Any]) -> Granularity:
    """Inverse of ``to_dict``: ``{"kind": "per_axis", "axis": 0}`` -> ``PerAxis(0)``."""
    kind = d.get("kind")
    if kind not in _KINDS:
        raise unknown_choice("granularity kind", str(kind), _KINDS)
    fields = {k: v for k, v in d.items() if k != "kind"}
    if "block_size" in fields:
        fields["block_size"] = tuple(fields["block_size"])
    return _KINDS[kind](**fields)


def check_granularity(what: str, granularity: object, choices: tuple[Granularity, ...]) -> Granularity:
    """``granularity`` when it is one of ``choices``; else the one-line error naming it and them (a kernel serves
    a closed set, and an old string spelling such as ``"per_token"`` must fail loudly, not fall to a default)."""
    if granularity not in choices:
        raise UserError(
            f"{what} {granularity!r} is not supported; choose from: {', '.join(map(repr, choices))}"
        )
    return granularity


def per_sequence(granularity: Granularity, ndim: int) -> Granularity:
    """The granularity applied to an activation of ``ndim`` dims: never share a scale across sequences.

    For ``ndim >= 3`` (a (B, T, ..., C) activation) the block's first entry is forced to 1, so per-tensor becomes
    one scale per sequence (per batch element over (T, C)) and per-channel becomes one scale per (sequence,
    channel). PerToken and PerGroup never cross rows and are returned unchanged. A 1-d or 2-d input is one
    sequence (its first dimension is tokens, not a batch) and is returned unchanged.
    """
    if ndim < 3:
        return granularity
    block = granularity.block(ndim)
    if block[0] == 1:
        return granularity
    return PerBlock((1, *block[1:]))


def is_static_granularity(granularity: Granularity) -> bool:
    """Per tensor or per (last-axis) channel: the granularities a calibrated (static) scale can have."""
    return isinstance(granularity, PerTensor) or (isinstance(granularity, PerAxis) and granularity.axis == -1)


def unit(granularity: Granularity, role: str) -> str:
    """What one scale covers, in the project's one vocabulary (module docstring); ``role`` is ``"weight"``
    (an (out, in) matrix), ``"act"`` or ``"out"`` (activations: (..., channels), a per-tensor scale is per
    sequence)."""
    if role not in ("weight", "act", "out"):
        raise ValueError(f"role {role!r}: weight, act or out")
    if isinstance(granularity, PerAxis) and granularity.axis == (0 if role == "weight" else -1):
        return "channel"
    if isinstance(granularity, PerTensor) and role != "weight":
        return "sequence"
    return granularity.label
