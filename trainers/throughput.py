"""Training throughput: FLOPs per token, the peak table of accelerators, and model FLOPs utilisation (MFU).

MFU (PaLM, Chowdhery et al. 2022, appendix B) is the share of the hardware's peak spent on the model's own
FLOPs — recomputation, padding and kernel overheads do not count:

    MFU = tokens_per_second × flops_per_token / (peak_flops_per_device × devices)

    flops_per_token = 6·N + 12·L·d·T

- ``6·N``: a matmul weight of N_w entries costs 2·N_w FLOPs per token forward and 4·N_w backward (gradients
  with respect to inputs and to weights). N is every ``nn.Linear`` weight, counted once: the attention and MLP
  projections and the LM head (for tied embeddings the head *is* the token embedding; an embedding lookup is not
  a matmul and is not counted). Biases, norms, activations and the softmax are left out (PaLM's convention).
- ``12·L·d·T``: attention's two matmuls (QKᵀ and PV) cost 2·T·d each per token and layer forward (L layers,
  model width d = heads × head size, T the window length), ×3 with the backward. As in PaLM this counts the full
  T×T score matrix, not the causal half a flash kernel actually computes, and ignores softmax-1's extra key.

Peaks (:data:`PEAK_TFLOPS`) are the vendors' dense (no 2:4 sparsity) tensor-core figures per device: bf16 for
bf16 autocast, TF32 for float32 training on CUDA. A CPU has no entry: its MFU is reported as n/a unless
``QBENCH_PEAK_TFLOPS`` gives a peak (the same override works for a GPU missing from the table).
"""

from __future__ import annotations

import os
from typing import Any

import torch
from torch import nn

from models.io import cpu_model

# name fragment of torch.cuda.get_device_name -> (bf16 dense TFLOPS, TF32 dense TFLOPS); first match wins, so the
# more specific names come first (H100 NVL / PCIe before H100; A100 before A10).
PEAK_TFLOPS: dict[str, tuple[float, float]] = {
    "B200": (2250.0, 1100.0),
    "H200": (989.4, 494.7),
    "H100 NVL": (835.5, 417.5),
    "H100 PCIe": (756.0, 378.0),
    "H100": (989.4, 494.7),  # SXM5
    "H800": (989.4, 494.7),
    "A100": (312.0, 156.0),
    "L40S": (362.1, 183.0),
    "L4": (121.0, 60.0),
    "A10": (125.0, 62.5),
}
PEAK_ENV = "QBENCH_PEAK_TFLOPS"


def matmul_parameters(model: nn.Module) -> int:
    """N of the formula: the entries of every ``nn.Linear`` weight, a shared (tied) weight once."""
    weights = {id(m.weight): m.weight for m in model.modules() if isinstance(m, nn.Linear)}
    return sum(w.numel() for w in weights.values())


def flops_per_token(model: nn.Module, n_layer: int, d_model: int, window: int) -> int:
    """Training FLOPs per predicted token: 6·N + 12·L·d·T (see the module docstring)."""
    return 6 * matmul_parameters(model) + 12 * n_layer * d_model * window


def peak_tflops(device: torch.device, bf16: bool) -> tuple[float | None, str]:
    """(peak TFLOPS per device, where it came from); (None, reason) when unknown, e.g. on a CPU."""
    if os.environ.get(PEAK_ENV):
        return float(os.environ[PEAK_ENV]), f"${PEAK_ENV}"
    if device.type != "cuda":
        return None, "n/a (CPU: no peak table entry; set $QBENCH_PEAK_TFLOPS)"
    name = torch.cuda.get_device_name(device)
    for fragment, (bf16_peak, tf32_peak) in PEAK_TFLOPS.items():
        if fragment in name:
            kind = "bf16" if bf16 else "tf32"
            return (bf16_peak if bf16 else tf32_peak), f"{fragment} {kind} dense (table)"
    return None, f"n/a ({name} is not in the peak table; set ${PEAK_ENV})"


def mfu(tokens_per_s: float, flops_token: int, peak: float | None, devices: int = 1) -> float | None:
    """Model FLOPs utilisation in [0, 1], or None without a peak."""
    if peak is None or tokens_per_s <= 0:
        return None
    return tokens_per_s * flops_token / (peak * 1e12 * devices)


def describe(model: nn.Module, n_layer: int, d_model: int, window: int, device, bf16: bool) -> dict[str, Any]:
    """What a run records once: N, FLOPs per token and the peak it divides by."""
    peak, source = peak_tflops(device, bf16)
    return {
        "formula": "6*N + 12*n_layer*d_model*T per token (PaLM appendix B)",
        "matmul_parameters": matmul_parameters(model),
        "flops_per_token": flops_per_token(model, n_layer, d_model, window),
        "device_name": torch.cuda.get_device_name(device) if device.type == "cuda" else cpu_model(),
        "peak_tflops": peak,
        "peak_source": source,
    }
