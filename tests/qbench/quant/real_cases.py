"""Every real layer class in the configurations the contract and dispatch tests run (not a test module).

Shapes are odd on purpose: 37 output channels (no multiple of 4, 16 or 32: the kernels' row blocks have
tails), 200 input channels (K % 64 = 8 and K % 32 = 8: the vector loops have scalar tails), and groups that
do not tile every loop; int4 zeropoint and int8 weight-only groups must divide K, so those run at K = 256.
"""

from __future__ import annotations

import dataclasses
from typing import NamedTuple

import torch

from qbench.quant.fake import FakeQuantLinear, HadamardRotation
from qbench.quant.granularity import PerTensor
from qbench.quant.kernels import make_real_linear
from qbench.quant.schemes import QuantScheme, get_scheme

OUT, IN = 37, 200


class Case(NamedTuple):
    id: str
    scheme: QuantScheme
    kind: str  # paths.KINDS, or "bnb"
    in_features: int = IN
    out_features: int = OUT
    transform: str | None = None  # "smooth": a SmoothQuant input scale; "hadamard": a rotation
    float_exact: bool = False  # its torch path (and c-dequant) runs fake mode's very arithmetic: bit for bit


def _replace(name: str, **changes: object) -> QuantScheme:
    return dataclasses.replace(get_scheme(name), **changes)


CASES = [
    Case("w8a8-channel-token", get_scheme("absmax-fine"), "w8a8"),
    Case("w8a8-channel-sequence", _replace("absmax-fine", act_granularity=PerTensor()), "w8a8"),
    Case("w8a8-tensor-sequence", get_scheme("absmax-moderate"), "w8a8"),
    Case("w8a8-tensor-out8", get_scheme("absmax-coarse"), "w8a8"),
    Case("w8a8-smoothquant", get_scheme("smoothquant"), "w8a8", transform="smooth"),
    Case(
        "w8a8-hadamard-out8",
        get_scheme("hadamard-absmax-coarse"),
        "w8a8",
        in_features=256,
        transform="hadamard",
    ),
    Case("w4a8-channel", get_scheme("absmax-w4a8"), "w4a8", float_exact=True),
    Case("w4a8-g32", get_scheme("absmax-w4a8-g32"), "w4a8", float_exact=True),
    Case("w4a8-zp-g32", get_scheme("zeropoint-w4a8-g32"), "w4a8", float_exact=True),
    Case("w4a8-zp-channel", get_scheme("zeropoint-w4a8"), "w4a8", float_exact=True),
    Case(
        "w4a8-channel-sequence",
        _replace("absmax-w4a8", act_granularity=PerTensor()),
        "w4a8",
        float_exact=True,
    ),
    Case("int4-zp-channel", get_scheme("zeropoint-int4"), "w4", float_exact=True),
    Case("int4-zp-g128", get_scheme("zeropoint-int4-g128"), "w4", in_features=256, float_exact=True),
    # 64 outputs, g128: a shape torch's int4pack kernel takes (bf16 input)
    Case("int4-zp-g128-64x256", get_scheme("zeropoint-int4-g128"), "w4", 256, 64, float_exact=True),
    Case(
        "int4-zp-hadamard",
        get_scheme("hadamard-zeropoint-int4"),
        "w4",
        256,
        transform="hadamard",
        float_exact=True,
    ),
    Case("int3-g128", get_scheme("zeropoint-int3-g128"), "lowbit", float_exact=True),
    Case("int2-g64", get_scheme("zeropoint-int2-g64"), "lowbit", float_exact=True),
    Case("int4-absmax-channel", get_scheme("absmax-fine:w=4,a=none"), "lowbit", float_exact=True),
    Case("w8-zp-channel", get_scheme("zeropoint-int4:w=8"), "w8", float_exact=True),
    Case("w8-zp-g64", get_scheme("zeropoint-int4-g64:w=8"), "w8", in_features=256, float_exact=True),
    Case("w8-absmax-channel", get_scheme("absmax-fine:a=none"), "w8", float_exact=True),
]
BNB_CASES = [
    Case("bnb-nf4", get_scheme("bnb-nf4"), "bnb"),
    # 64 × 256: the shape bitsandbytes repacks for its bf16 CPU kernel on CPUs with AVX512-BF16
    Case("bnb-nf4-64x256", get_scheme("bnb-nf4"), "bnb", in_features=256, out_features=64),
    Case("llm-int8", get_scheme("llm-int8"), "bnb"),
]


def build(case: Case, seed: int = 0) -> tuple[torch.nn.Module, FakeQuantLinear]:
    """(real layer, fake layer) of one random float weight and bias."""
    g = torch.Generator().manual_seed(seed)
    weight = torch.randn(case.out_features, case.in_features, generator=g) * 0.05
    bias = torch.randn(case.out_features, generator=g) * 0.1
    extra: dict[str, object] = {}
    if case.transform == "smooth":
        extra["input_scale"] = torch.rand(case.in_features, generator=g) + 0.5
    elif case.transform == "hadamard":
        extra["rotation"] = HadamardRotation(case.in_features, seed=seed)
    return make_real_linear(weight, bias, case.scheme, **extra), FakeQuantLinear(
        weight, bias, case.scheme, **extra
    )


def inputs(rows: int, in_features: int, seed: int = 1) -> torch.Tensor:
    """(rows, in) activations with a few large channels, like a transformer's."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, in_features, generator=g)
    x[:, 3] *= 8.0
    return x


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    """max |a − b| relative to the output scale max |b| (0 for empty outputs)."""
    if b.numel() == 0:
        return 0.0
    return ((a.float() - b.float()).abs().max() / b.float().abs().max().clamp_min(1e-30)).item()
