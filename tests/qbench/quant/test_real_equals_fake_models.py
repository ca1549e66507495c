"""Real kernels equal fake quantisation on whole models, not only on one layer: the same perplexity to ~1e-4
relative on our GPT-2 and Llama layouts and on a transformers GPT-2 (Conv1D layers), odd shapes and a single
token included; in bf16 the documented difference is bounded."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from models.hf import to_hf_model
from qbench.eval.adapters import logits
from qbench.quant import quantize
from qbench.quant.apply import real_kernels
from tests.qbench.conftest import micro_config, trained_like

# Every scheme with a real kernel of qbench's own (bitsandbytes' are compared with their definitions in
# test_kernels.py): W8A8 three ways, W8A16, int4 per channel and per group, int3/int2 packed, W4A8, and the
# rotation/smoothing baselines.
REAL_SCHEMES = [
    "absmax-fine",
    "absmax-moderate",
    "absmax-coarse",
    "absmax-fine:a=none",
    "zeropoint-int4",
    "zeropoint-int4-g32",
    "zeropoint-int3-g128",
    "zeropoint-int2-g64",
    "absmax-fine:w=4",  # W4A8
    "absmax-fine:w=4,group=32",
    "zeropoint-w4a8-g32",  # W4A8 with zero points (Q4_1-style)
    "hadamard-absmax-coarse",
    "smoothquant",
]


def _nll(model: nn.Module, ids: torch.Tensor) -> float:
    with torch.no_grad():
        out = logits(model, ids)[:, :-1].float()
    return F.cross_entropy(out.reshape(-1, out.size(-1)), ids[:, 1:].reshape(-1)).item()


def _models():
    gpt2 = trained_like(micro_config("gpt2"))
    llama = trained_like(micro_config("llama", attn="softmax1"))
    return {"ours-gpt2": gpt2, "ours-llama": llama, "transformers-gpt2-conv1d": to_hf_model(gpt2).eval()}


MODELS = _models()


@pytest.mark.parametrize("model_name", list(MODELS))
@pytest.mark.parametrize("scheme", REAL_SCHEMES)
def test_whole_model_real_equals_fake(model_name, scheme):
    model = MODELS[model_name]
    ids = torch.randint(0, 8192, (3, 32), generator=torch.Generator().manual_seed(1))
    calibration = torch.randint(0, 8192, (2, 32), generator=torch.Generator().manual_seed(2))
    kw = {"calibration": calibration} if scheme == "smoothquant" else {}
    fake = quantize(model, scheme, mode="fake", **kw)
    real = quantize(model, scheme, mode="real", **kw)
    ppl_fake, ppl_real = math.exp(_nll(fake, ids)), math.exp(_nll(real, ids))
    assert abs(ppl_real / ppl_fake - 1) < 1e-4, (ppl_fake, ppl_real)
    assert real_kernels(real), "no real kernel was used"


def _odd_mlp() -> nn.Module:
    torch.manual_seed(3)
    return nn.Sequential(nn.Linear(63, 37), nn.GELU(), nn.Linear(37, 5)).eval()


@pytest.mark.parametrize("tokens", [1, 17])
@pytest.mark.parametrize("scheme", [s for s in REAL_SCHEMES if s != "smoothquant"])
def test_odd_shapes_and_one_token(scheme, tokens):
    model = _odd_mlp()
    x = torch.randn(2, tokens, 63, generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        fake, real = quantize(model, scheme)(x), quantize(model, scheme, mode="real")(x)
    assert real.shape == fake.shape == (2, tokens, 5)
    assert (real - fake).abs().max() <= 1e-5 * fake.abs().max().clamp_min(1.0)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("scheme", ["absmax-fine", "absmax-coarse", "zeropoint-int4"])
def test_half_precision_models_stay_within_the_documented_difference(scheme, dtype):
    """In bf16/fp16, fake quantisation rounds its dequantised values to the model's dtype while the real
    kernels accumulate integers exactly and apply scales in float32: outputs differ by rounding to the half
    dtype, and an activation or output code can land one step apart. Measured on this toy (max / mean relative):
    bf16 absmax-fine 0.7 % / 0.7 %, absmax-coarse 1.9 % / 1.7 %; fp16 0.3 % / 0.1 % and 1.6 % / 0.5 %;
    zeropoint-int4 (weight-only) exact in both. Bounded here at max 3 %, mean 2 % (bf16) / 1 % (fp16)."""
    model = _odd_mlp().to(dtype)
    x = torch.randn(4, 9, 63, generator=torch.Generator().manual_seed(5)).to(dtype)
    with torch.no_grad():
        fake = quantize(model, scheme)(x).float()
        real = quantize(model, scheme, mode="real")(x).float()
    assert (real - fake).abs().max() / fake.abs().max() <= 3e-2
    assert (real - fake).abs().mean() / fake.abs().mean() <= (2e-2 if dtype == torch.bfloat16 else 1e-2)
