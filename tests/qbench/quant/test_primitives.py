"""Primitives: exact definitions, fake == dequantise(quantise) exactly, the half-step error bound, edge cases."""

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from models.errors import UserError
from qbench.quant.granularity import PerAxis, PerGroup, PerTensor, PerToken
from qbench.quant.primitives import (
    block_sizes,
    blocked,
    choose_qparams,
    dequantize,
    fake_quantize,
    qrange,
    quantize,
    true_div,
)


@st.composite
def cases(draw):
    """(x, bits, granularity, symmetric): shapes of 1–3 dims, every granularity that fits, and the edge cases
    that break quantisers — all-zero tensors, a single huge outlier, constant tensors, tiny and huge scales."""
    shape = draw(st.lists(st.integers(1, 6), min_size=1, max_size=3))
    kind = draw(st.sampled_from(["gauss", "zeros", "outlier", "constant", "positive"]))
    gen = torch.Generator().manual_seed(draw(st.integers(0, 2**16)))
    x = torch.randn(shape, generator=gen) * 10.0 ** draw(st.integers(-6, 6))
    if kind == "zeros":
        x = torch.zeros(shape)
    elif kind == "outlier":
        x.view(-1)[draw(st.integers(0, x.numel() - 1))] = 1e4 * (x.abs().max() + 1)
    elif kind == "constant":
        x = torch.full(shape, draw(st.floats(-100, 100, width=32)))
    elif kind == "positive":
        x = x.abs() + 1.0
    group = draw(st.sampled_from([d for d in range(1, shape[-1] + 1) if shape[-1] % d == 0]))
    axis = draw(st.integers(-len(shape), len(shape) - 1))
    granularity = draw(st.sampled_from([PerTensor(), PerAxis(axis), PerToken(), PerGroup(group)]))
    return x, draw(st.integers(2, 8)), granularity, draw(st.booleans())


def _expanded_scale(x, qp, granularity):
    sizes = block_sizes(x.shape, granularity)
    kept = [v for n, b in zip(x.shape, sizes) for v in (n // b, 1)]
    return (qp.scale.reshape(kept) * torch.ones_like(blocked(x, sizes))).reshape(x.shape)


@settings(max_examples=60, deadline=None)
@given(cases())
def test_fake_quantize_equals_dequantize_of_quantize_exactly(case):
    x, bits, g, symmetric = case
    qp = choose_qparams(x, bits, g, symmetric)
    q = quantize(x, qp, bits, g, symmetric)
    assert torch.equal(fake_quantize(x, bits, g, symmetric), dequantize(q, qp, g, x.dtype))


@settings(max_examples=60, deadline=None)
@given(cases())
def test_codes_in_range_and_error_at_most_half_a_step(case):
    x, bits, g, symmetric = case
    x0 = x.clone()
    qp = choose_qparams(x, bits, g, symmetric)
    q = quantize(x, qp, bits, g, symmetric)
    qmin, qmax = qrange(bits, symmetric)
    assert q.dtype == (torch.int8 if symmetric else torch.uint8)
    assert int(q.min()) >= qmin and int(q.max()) <= qmax
    assert (qp.zero_point is None) == symmetric
    err = (fake_quantize(x, bits, g, symmetric) - x).abs()
    half_step = _expanded_scale(x, qp, g) / 2
    assert bool((err <= half_step * (1 + 1e-5) + 1e-30).all())  # every element lies inside its block's range
    assert torch.equal(x, x0)  # pure: the input is never modified


def test_absmax_formula_by_hand():
    x = torch.tensor([[1.0, -2.0, 0.4], [0.0, 0.0, 0.0]])
    qp = choose_qparams(x, 8, PerAxis(0), symmetric=True)
    assert torch.equal(qp.scale, torch.tensor([[2.0 / 127], [torch.finfo(torch.float32).tiny]]))
    expected = torch.round(x[0] / (2.0 / 127)) * (2.0 / 127)
    y = fake_quantize(x, 8, PerAxis(0), symmetric=True)
    assert torch.equal(y[0], expected)
    assert torch.equal(y[1], torch.zeros(3))  # an all-zero group quantises to zeros, no NaN


def test_zeropoint_formula_by_hand():
    x = torch.tensor([0.5, 1.0, 3.0])  # range [min(x, 0), max(x, 0)] = [0, 3]: s = 3/15, z = 0
    qp = choose_qparams(x, 4, PerTensor(), symmetric=False)
    assert torch.allclose(qp.scale, torch.tensor([0.2])) and int(qp.zero_point) == 0
    x = torch.tensor([-1.0, 2.0])  # s = 3/15, z = round(1/0.2) = 5
    qp = choose_qparams(x, 4, PerTensor(), symmetric=False)
    assert int(qp.zero_point) == 5
    assert quantize(x, qp, 4, PerTensor(), symmetric=False).tolist() == [0, 15]


def test_per_channel_outlier_row_leaves_other_rows_unchanged():
    w = torch.randn(8, 64, generator=torch.Generator().manual_seed(0))
    w_outlier = w.clone()
    w_outlier[3, 5] = 1000.0
    per_channel = fake_quantize(w, 8, PerAxis(0), True), fake_quantize(w_outlier, 8, PerAxis(0), True)
    others = [r for r in range(8) if r != 3]
    assert torch.equal(per_channel[0][others], per_channel[1][others])
    # per tensor, the outlier inflates everyone's step: the other rows' error grows by orders of magnitude
    err_tensor = (fake_quantize(w_outlier, 8, PerTensor(), True) - w_outlier)[others].abs().mean()
    err_channel = (per_channel[1] - w_outlier)[others].abs().mean()
    assert err_tensor > 50 * err_channel


def test_low_precision_input_uses_float32_scales():
    x = torch.randn(4, 32, generator=torch.Generator().manual_seed(1)).to(torch.bfloat16)
    qp = choose_qparams(x, 8, PerToken(), True)
    assert qp.scale.dtype == torch.float32
    y = fake_quantize(x, 8, PerToken(), True)
    assert y.dtype == torch.bfloat16
    assert torch.equal(y, fake_quantize(x.float(), 8, PerToken(), True).to(torch.bfloat16))


@pytest.mark.parametrize("bits", [1, 9, 0, 4.0, True])
def test_bad_bits(bits):
    with pytest.raises(UserError, match="bits"):
        fake_quantize(torch.ones(3), bits, PerTensor(), True)


def test_non_float_input_is_a_user_error():
    with pytest.raises(UserError, match="floating-point"):
        fake_quantize(torch.ones(3, dtype=torch.int32), 8, PerTensor(), True)


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")])
@pytest.mark.parametrize("symmetric", [True, False])
def test_non_finite_input_is_a_clear_error(bad, symmetric):
    x = torch.ones(2, 4)
    x[1, 2] = bad
    with pytest.raises(ValueError, match="NaN or inf"):
        fake_quantize(x, 8, PerTensor(), symmetric)
    with pytest.raises(ValueError, match="NaN or inf"):
        choose_qparams(x, 8, PerAxis(0), symmetric)


def test_group_that_does_not_tile_is_a_user_error():
    with pytest.raises(UserError, match="does not tile"):
        fake_quantize(torch.ones(2, 6), 8, PerGroup(4), True)


def test_group_scales_have_the_block_grid_shape():
    w = torch.randn(4, 12)
    assert choose_qparams(w, 4, PerGroup(3), False).scale.shape == (4, 4)
    assert choose_qparams(w, 8, PerAxis(0), True).scale.shape == (4, 1)
    assert choose_qparams(torch.randn(2, 3, 5), 8, PerToken(), True).scale.shape == (2, 3, 1)


def test_true_div_is_ieee_division():
    # the reference the CUDA branch must reproduce: float32 x / d correctly rounded (numpy), which x · (1/d) —
    # what CUDA torch does for a Python divisor — misses for about a third of inputs when d = 3
    x = torch.randn(100_000, generator=torch.Generator().manual_seed(0))
    want = torch.from_numpy(x.numpy() / np.float32(3))
    assert torch.equal(true_div(x, 3), want)
    assert not torch.equal(x * (1 / 3), want)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("bits", [2, 4, 8])
@pytest.mark.parametrize("symmetric", [True, False])
@pytest.mark.parametrize("granularity", [PerTensor(), PerToken(), PerGroup(32)])
def test_fake_quantize_on_cuda_is_bit_exact_with_cpu(bits, symmetric, granularity):
    x = torch.randn(8, 256, generator=torch.Generator().manual_seed(bits)) * 3 + 0.25
    assert torch.equal(
        fake_quantize(x.cuda(), bits, granularity, symmetric).cpu(),
        fake_quantize(x, bits, granularity, symmetric),
    )
    q = choose_qparams(x.cuda(), bits, granularity, symmetric)
    assert torch.equal(q.scale.cpu(), choose_qparams(x, bits, granularity, symmetric).scale)
