"""Fake quantisation as one custom torch op: defined once, a kernel per device (the bitsandbytes layering).

``torch.ops.qbench.fake_quantize(Tensor x, int bits, bool symmetric, int[] block) -> Tensor``

``block`` is a granularity's block form (``granularity.block(x.ndim)``: ``-1`` = whole dimension, ``k`` = runs of
k); every block shares one scale. That one op covers every granularity the schemes use — per tensor
``[-1, -1]``, per output channel ``[1, -1]``, per token ``[1, 1, -1]``, per group ``[1, g]``, per sequence
``[1, -1, -1]`` — symmetric (absmax) or asymmetric (zeropoint). It equals ``primitives.fake_quantize`` exactly
(tests hold it so, on every path below).

Registrations:

- fake (meta) kernel: a contiguous tensor of ``x``'s shape and dtype, so the op traces under
  ``torch.compile(fullgraph=True)``;
- autograd: straight-through estimator — the gradient passes unchanged (nothing is clipped by absmax, and a
  clipped zeropoint edge is at most one step away);
- CPU: for fp32 tensors whose blocks are contiguous rows (per tensor, channel, token, group, sequence) a fused C
  kernel (``kernels/fake_cpu.py``, built on first use in ~0.2 s; ≥ 80 % of a plain copy's bandwidth against ~35 %
  for the torch code); otherwise, or without a C compiler, or with ``QBENCH_NATIVE=0`` /
  ``set_cpu_fast_path(False)``, the pure-torch primitive;
- CUDA: a Triton kernel when ``triton`` is importable and the layout is rows (``kernels/triton_fake.py``), else the
  same torch code on CUDA tensors. NaN/inf input raises ``ValueError`` on the torch paths (the check costs one
  reduction over the small scale tensor); the Triton path skips it to avoid a host synchronisation, and
  non-finite input then gives non-finite output.
"""

from __future__ import annotations

import contextlib
import functools
import math
from collections.abc import Iterator

import torch
from torch import Tensor

from qbench.quant.granularity import Granularity, PerBlock, per_sequence
from qbench.quant.primitives import block_sizes, check_bits, check_input, non_finite_error
from qbench.quant.primitives import fake_quantize as reference_fake_quantize

# "enabled" None: decided on first use by the one switch of the compiled kernels (kernels/build.py: QBENCH_NATIVE,
# or the older QBENCH_FAST_FAKE_QUANT) — read lazily: importing qbench.quant.kernels here would import this module.
_FAST_CPU = {"enabled": None, "min_numel": 1 << 12}


def set_cpu_fast_path(enabled: bool, min_numel: int = 1 << 12) -> None:
    """Use the fused C kernel (``kernels/fake_cpu.py``) for fp32 row layouts of at least ``min_numel`` elements."""
    _FAST_CPU.update(enabled=bool(enabled), min_numel=int(min_numel))


@contextlib.contextmanager
def cpu_fast_path(enabled: bool, min_numel: int = 1 << 12) -> Iterator[None]:
    """:func:`set_cpu_fast_path` for the duration of a block; the previous setting comes back afterwards."""
    previous = dict(_FAST_CPU)
    set_cpu_fast_path(enabled, min_numel)
    try:
        yield
    finally:
        _FAST_CPU.update(previous)


def rows_view(x: Tensor, sizes: tuple[int, ...]) -> Tensor | None:
    """``x`` as (R, L) with one block per row, when its blocks are contiguous runs of memory; else None.

    True when every dimension before the first non-1 block entry has block 1 and every dimension after it is
    whole: then each block is ``sizes[j] * prod(shape[j+1:])`` consecutive elements of a contiguous tensor.
    """
    if not x.is_contiguous() or x.numel() == 0:
        return None
    j = next((d for d, b in enumerate(sizes) if b != 1), x.ndim)
    if any(sizes[d] != x.shape[d] for d in range(j + 1, x.ndim)):
        return None
    return x.view(-1, math.prod(sizes[j:]))


def _torch_impl(x: Tensor, bits: int, symmetric: bool, block: list[int]) -> Tensor:
    return reference_fake_quantize(x, bits, PerBlock(tuple(block)), symmetric).contiguous()


@torch.library.custom_op("qbench::fake_quantize", mutates_args=())
def fake_quantize_op(x: Tensor, bits: int, symmetric: bool, block: list[int]) -> Tensor:
    """Fake-quantise ``x`` with one scale per block (see the module docstring); any device, pure torch."""
    return _torch_impl(x, bits, symmetric, block)


@fake_quantize_op.register_kernel("cpu")
def _cpu_impl(x: Tensor, bits: int, symmetric: bool, block: list[int]) -> Tensor:
    check_input(x, "fake_quantize")
    check_bits(bits)
    if _FAST_CPU["enabled"] is None:
        from qbench.quant.kernels.build import switched_on

        _FAST_CPU["enabled"] = switched_on("QBENCH_FAST_FAKE_QUANT")
    if _FAST_CPU["enabled"] and x.dtype == torch.float32 and x.numel() >= _FAST_CPU["min_numel"]:
        rows = rows_view(x, block_sizes(x.shape, PerBlock(tuple(block))))
        result = None if rows is None else _fake_cpu().fake_quantize_rows(rows, bits, symmetric)
        if result is not None:
            y, non_finite = result
            if non_finite:
                raise non_finite_error("fake_quantize")
            return y.view(x.shape)
    return _torch_impl(x, bits, symmetric, block)


@fake_quantize_op.register_kernel("cuda")
def _cuda_impl(x: Tensor, bits: int, symmetric: bool, block: list[int]) -> Tensor:
    check_input(x, "fake_quantize")
    check_bits(bits)
    rows = rows_view(x, block_sizes(x.shape, PerBlock(tuple(block))))
    if rows is not None and triton_available() and x.dtype in (torch.float32, torch.float16, torch.bfloat16):
        from qbench.quant.kernels import triton_fake  # on first CUDA use: triton is optional and slow to load

        return triton_fake.fake_quantize_rows(rows, bits, symmetric).view(x.shape)
    return _torch_impl(x, bits, symmetric, block)


@fake_quantize_op.register_fake
def _fake_impl(x: Tensor, bits: int, symmetric: bool, block: list[int]) -> Tensor:
    check_bits(bits)
    return x.new_empty(x.shape)


def _straight_through(ctx, grad: Tensor) -> tuple[Tensor | None, ...]:
    return grad, None, None, None


fake_quantize_op.register_autograd(_straight_through)


def _fake_cpu():
    """The C kernel's module, imported on first use (``qbench.quant.kernels`` imports this module's users)."""
    from qbench.quant.kernels import fake_cpu

    return fake_cpu


@functools.cache
def triton_available() -> bool:
    """Whether ``triton`` is installed (it is optional: ~1 GB, only useful with a GPU); imported only where the
    kernels are (``kernels/triton_fake.py``)."""
    from importlib.util import find_spec

    return find_spec("triton") is not None


def fake_quantize(x: Tensor, bits: int, granularity: Granularity, symmetric: bool) -> Tensor:
    """The op with a granularity value: equal to ``primitives.fake_quantize(x, bits, granularity, symmetric)``."""
    return torch.ops.qbench.fake_quantize(x, bits, symmetric, list(granularity.block(x.ndim)))


def fake_quantize_activation(x: Tensor, bits: int, granularity: Granularity, symmetric: bool) -> Tensor:
    """Fake-quantise an activation without sharing a scale across sequences (``granularity.per_sequence``)."""
    return fake_quantize(x, bits, per_sequence(granularity, x.ndim), symmetric)


__all__ = [
    "fake_quantize",
    "fake_quantize_activation",
    "fake_quantize_op",
    "rows_view",
    "set_cpu_fast_path",
    "triton_available",
]
