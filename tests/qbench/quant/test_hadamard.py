"""The Hadamard baseline's rotation is orthogonal and full-size for every dimension, and quantised
layers keep their rotations and scales in float32 through casts."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from qbench.quant import quantize
from qbench.quant.fake import FakeQuantLinear, HadamardRotation, transform_input, transform_weight
from qbench.quant.hadamard import paley_hadamard
from qbench.quant.schemes import QuantScheme


@pytest.mark.parametrize("order", [12, 20, 28, 44, 500])
def test_paley_matrices_are_hadamard(order):
    h = paley_hadamard(order)  # Paley I (12, 20, 44, 500) and II (28)
    assert h is not None and set(h.unique().tolist()) == {-1.0, 1.0}
    torch.testing.assert_close(h @ h.T, order * torch.eye(order, dtype=torch.float64), rtol=0, atol=0)


@pytest.mark.parametrize("dim", [768, 688, 1000, 1001, 4099 * 2 + 1])
def test_rotation_is_orthogonal_dense_and_keeps_x_wt(dim):
    rot = HadamardRotation(dim, seed=1)
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(16, dim, generator=gen, dtype=torch.float64).float()
    rx = rot(x)
    torch.testing.assert_close(rx @ rx.T, x @ x.T, rtol=1e-4, atol=1e-3)  # inner products kept: orthogonal
    basis = rot(torch.eye(dim)[:8])  # R e_i for a few i: every channel gets some of every input channel
    assert (basis.abs() > 1e-6).float().mean() > 0.99, rot
    w = torch.randn(24, dim, generator=gen)
    torch.testing.assert_close(
        transform_input(x, None, rot) @ transform_weight(w, None, rot).T, x @ w.T, rtol=1e-4, atol=2e-3
    )


def test_dimensions_with_a_paley_factor_are_true_hadamard_matrices():
    r = HadamardRotation(768, seed=0).matrix()  # 768 = 12 · 64: every entry ±1/√768
    torch.testing.assert_close(r.abs(), torch.full_like(r, 768**-0.5), rtol=0, atol=1e-6)
    torch.testing.assert_close(r @ r.T, torch.eye(768), rtol=0, atol=1e-5)


def _quantized(scheme: str, mode: str) -> tuple[nn.Module, torch.Tensor]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(48, 64), nn.ReLU(), nn.Linear(64, 48))
    x = torch.randn(2, 5, 48)
    calibration = x if scheme == "smoothquant" else None
    return quantize(model, scheme, mode=mode, calibration=calibration), x


@pytest.mark.parametrize(
    ("scheme", "mode"),
    [
        ("hadamard-absmax-coarse", "fake"),
        ("smoothquant", "fake"),
        ("absmax-fine", "real"),
        ("hadamard-absmax-coarse", "real"),
        ("hadamard-zeropoint-int4", "real"),
    ],
)
def test_casting_a_quantised_model_keeps_rotations_and_scales_float32(scheme, mode):
    qmodel, x = _quantized(scheme, mode)
    reference = qmodel(x)
    qmodel.to(torch.bfloat16)
    kept = {name: t.dtype for name, t in qmodel.named_buffers() if t.is_floating_point()}
    watched = [
        n
        for n in kept
        if n.rsplit(".", 1)[-1] in ("signs", "factor", "matrix", "input_scale", "w_scale", "scales")
    ]
    assert watched and all(kept[n] == torch.float32 for n in watched), kept
    y = qmodel(x.to(torch.bfloat16))
    assert y.dtype == torch.bfloat16
    torch.testing.assert_close(y.float(), reference, rtol=0.05, atol=0.05)  # bf16 activations, same layer


def test_float_layer_with_rotation_is_the_float_layer_after_a_cast():
    rot = HadamardRotation(48, seed=2)
    linear = nn.Linear(48, 8)
    scheme = QuantScheme(name="float-rotated", method="hadamard", weight_bits=None, act_bits=None)
    layer = FakeQuantLinear(linear.weight, linear.bias, scheme, rotation=rot).to(torch.float16)
    assert layer.rotation.signs.dtype == torch.float32 and layer.weight.dtype == torch.float16
    x = torch.randn(3, 48)
    torch.testing.assert_close(layer(x.half()).float(), linear(x), rtol=0, atol=2e-2)
