"""What counts as a linear layer to quantise, and its weight as (out, in): ``nn.Linear`` and transformers' GPT-2
``Conv1D`` (stored transposed). A leaf of ``qbench.quant``, so that both ``apply`` and ``solve`` read layers one way."""

from __future__ import annotations

import sys

from torch import Tensor, nn


def is_conv1d(module: nn.Module) -> bool:
    """transformers' GPT-2 ``Conv1D``, checked without importing transformers (a model that has one imported it)."""
    pytorch_utils = sys.modules.get("transformers.pytorch_utils")
    return pytorch_utils is not None and isinstance(module, pytorch_utils.Conv1D)


def is_linear(module: nn.Module) -> bool:
    return isinstance(module, nn.Linear) or is_conv1d(module)


def linear_weight(module: nn.Module) -> tuple[Tensor, Tensor | None]:
    """(weight (out, in), bias) of an ``nn.Linear`` or a ``Conv1D`` (whose weight is stored (in, out))."""
    weight = module.weight.detach()
    return (weight.t() if is_conv1d(module) else weight), (
        None if module.bias is None else module.bias.detach()
    )
