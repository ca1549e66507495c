"""W4A8 (int4 absmax weights × int8 absmax activations): the C kernel against an integer reference written from
the definition, the layer against fake mode (C path and torch path), the scheme's dispatch and its errors."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from models.errors import UserError
from qbench.quant import quantize
from qbench.quant.fake import FakeQuantLinear, fake_quantize_weight
from qbench.quant.granularity import PerAxis, PerGroup
from qbench.quant.kernels import native
from qbench.quant.kernels.int8 import quantize_activation
from qbench.quant.kernels.w4a8 import Int4A8Linear
from qbench.quant.primitives import choose_qparams, fake_quantize
from qbench.quant.primitives import quantize as quantize_codes
from qbench.quant.schemes import get_scheme

needs_native = pytest.mark.skipif(not native.available(), reason="no C compiler: the torch path runs instead")


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).abs().max() / b.abs().max()).item()


def reference(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, group: int | None) -> torch.Tensor:
    """y = s_x · Σ_g s_g · Σ_{k∈g} c_k q_k + b, integer sums exact (int64), the rest in float64."""
    n, k = weight.shape
    granularity = PerAxis(0) if group is None else PerGroup(group)
    qp = choose_qparams(weight, 4, granularity, symmetric=True)
    codes = quantize_codes(weight, qp, 4, granularity, symmetric=True).long()  # [−7, 7]
    s_w = qp.scale.reshape(n, -1).double()
    q, s_x = quantize_activation(x[None], per_token=True)
    q, s_x = q[0].long(), s_x[0].double()  # (m, k), (m, 1)
    g = k if group is None else group
    sums = torch.stack([q[:, i : i + g] @ codes[:, i : i + g].T for i in range(0, k, g)], dim=-1)  # (m, n, G)
    return ((sums.double() * s_w).sum(-1) * s_x + bias.double()).float()


@needs_native
@pytest.mark.parametrize(
    ("m", "k", "n", "group"),
    [
        (1, 63, 37, None),  # odd K: every channel in the scalar tail
        (1, 200, 13, None),  # batch 1: four weight rows per pass, a K tail, one row left over
        (1, 768, 9, 64),  # rows of 384 bytes: the last width that takes four weight rows per pass
        (1, 1000, 13, None),  # longer rows: one weight row per pass, a K tail
        (1, 1024, 6, 64),
        (1, 256, 33, 64),
        (3, 2048, 9, None),
        (1, 96, 8, 32),  # K % 64 == 32: the last group is a tail group
        (16, 128, 5, 32),
        (4, 256, 33, 64),
        (2, 512, 16, 128),
        (17, 96, 37, 32),  # > 16 rows: the int16 panel GEMM, N tail
        (40, 256, 70, 64),
        (20, 2048, 40, None),
        (19, 65, 33, None),  # GEMM with odd K
    ],
)
def test_kernel_equals_integer_reference(m, k, n, group):
    torch.manual_seed(m * k + n)
    weight, bias = torch.randn(n, k), torch.randn(n)
    weight[0, :4] = weight[0].abs().max() * torch.tensor([1.0, -1.0, 1.0, -1.0])  # codes ±7
    x = torch.randn(m, k) * 2
    x[0, 1] = 40.0  # one outlier: q = ±127 next to small codes
    layer = Int4A8Linear.from_float(weight, bias, group)
    got = native.w4a8_forward(x, 1, layer.qweight, layer.scales, layer.bias)
    expected = reference(x, weight, bias, group)
    if group is None:  # per output channel: the integer sum and W8A8's epilogue, in float32 — exact
        q, s_x = quantize_activation(x[None], per_token=True)
        acc = q[0].int() @ (layer.dequantized_weight() / layer.scales).round().int().T
        assert torch.equal(got, (acc.float() * s_x[0]) * layer.scales.reshape(-1) + bias)
    assert rel_err(got, expected) < 1e-6


@pytest.mark.parametrize(("k", "group"), [(96, 48), (100, 32), (150, 64), (40, 64)])
def test_any_group_works_kernels_where_they_apply(k, group):
    """g = 48 has no C loop (torch path); 100 = 3·32 + 4 and 150 = 2·64 + 22 leave a shorter last group (zero
    padding, C path); g ≥ the row is per output channel."""
    torch.manual_seed(k)
    weight, bias = torch.randn(8, k), torch.randn(8)
    spec = get_scheme(f"absmax-fine:w=4,group={group}")
    assert isinstance(quantize(nn.Sequential(nn.Linear(k, 8)), spec, mode="real")[0], Int4A8Linear)
    layer = Int4A8Linear.from_float(weight, bias, group)
    fake = FakeQuantLinear(weight, bias, spec)
    expected_w = fake_quantize_weight(weight, 4, spec.weight_granularity_for(k), True)
    assert torch.equal(layer.dequantized_weight(), expected_w)
    x = torch.randn(3, 5, k)
    with torch.inference_mode():
        assert rel_err(layer(x), fake(x)) < 1e-5
    with pytest.raises(UserError, match="group_size=0 must be a positive"):
        Int4A8Linear.from_float(weight, bias, 0)


@needs_native
def test_c_entry_point_declines_groups_without_a_loop():
    layer = Int4A8Linear.from_float(torch.randn(8, 96), None, 32)
    x = torch.randn(2, 96)
    assert native.w4a8_forward(x, 1, layer.qweight, layer.scales, None) is not None
    assert native.w4a8_forward(x, 1, layer.qweight, torch.rand(8, 2), None) is None  # groups of 48


@pytest.mark.parametrize(
    "scheme", ["absmax-fine:w=4", "absmax-fine:w=4,group=32", "absmax-fine:w=4,group=64"]
)
@pytest.mark.parametrize("kernels_on", [True, False], ids=["C", "torch"])
def test_layer_equals_fake(scheme, kernels_on):
    torch.manual_seed(3)
    k, n = 192, 40
    weight, bias = torch.randn(n, k) * 0.1, torch.randn(n)
    spec = get_scheme(scheme)
    group = spec.weight_granularity.group_size if isinstance(spec.weight_granularity, PerGroup) else None
    real = Int4A8Linear.from_float(weight, bias, group)
    fake = FakeQuantLinear(weight, bias, spec)
    assert torch.equal(real.dequantized_weight(), fake_quantize(weight, 4, spec.weight_granularity, True))
    for lead in [(1,), (17,), (2, 5), (1, 1), (3, 12)]:
        x = torch.randn(*lead, k)
        with torch.inference_mode(), native.enabled(kernels_on):
            got, expected = real(x), fake(x)
        assert got.shape == expected.shape
        assert rel_err(got, expected) < 1e-5


def test_quantize_dispatches_w4a8_and_counts_bytes():
    model = nn.Sequential(nn.Linear(128, 64), nn.ReLU(), nn.Linear(64, 32))
    real = quantize(model, "absmax-fine:w=4,group=32", mode="real")
    layers = [m for m in real.modules() if isinstance(m, Int4A8Linear)]
    assert len(layers) == 2 and isinstance(model[0], nn.Linear)  # the float model is untouched
    first = layers[0]
    assert first.nbytes() == 64 * 128 // 2 + 64 * (128 // 32) * 4 + 64 * 4  # nibbles, scales, bias
    assert "W int4 absmax per group of 32, A int8 absmax per token" in repr(first)


@needs_native
def test_two_threads_equal_one():
    torch.manual_seed(6)
    layer = Int4A8Linear.from_float(torch.randn(37, 256), torch.randn(37), 64)
    outs = []
    previous = torch.get_num_threads()
    try:
        for threads in (1, 2):
            torch.set_num_threads(threads)
            outs.append(
                [
                    layer(torch.randn(rows, 256, generator=torch.Generator().manual_seed(rows)))
                    for rows in (1, 30)
                ]
            )
    finally:
        torch.set_num_threads(previous)
    assert all(torch.equal(a, b) for a, b in zip(*outs, strict=True))


# ------------------------------------------------------------------------------- zero-point codes (Q4_1-style)


def zero_point_reference(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, group: int | None):
    """y = s_x · Σ_g s_g · Σ_{k∈g} (u_k − z_g) q_k + b from the zeropoint formulas: integer sums exact (int64),
    the rest in float64."""
    n, k = weight.shape
    granularity = PerAxis(0) if group is None else PerGroup(group)
    qp = choose_qparams(weight, 4, granularity, symmetric=False)
    u = quantize_codes(weight, qp, 4, granularity, symmetric=False).long()  # [0, 15]
    g = k if group is None else group
    z = qp.zero_point.reshape(n, -1).long()  # (n, G)
    s_w = qp.scale.reshape(n, -1).double()
    q, s_x = quantize_activation(x[None], per_token=True)
    q, s_x = q[0].long(), s_x[0].double()
    sums = torch.stack(
        [q[:, i : i + g] @ (u[:, i : i + g] - z[:, i // g : i // g + 1]).T for i in range(0, k, g)], dim=-1
    )
    return ((sums.double() * s_w).sum(-1) * s_x + bias.double()).float()


@needs_native
@pytest.mark.parametrize(
    ("m", "k", "n", "group"),
    [
        (1, 63, 37, None),  # odd K, per output channel
        (1, 768, 9, 32),
        (1, 96, 8, 32),  # a tail group
        (4, 256, 33, 64),
        (2, 512, 300, 128),  # more outputs than one 256-wide block of the correction
        (17, 96, 37, 32),  # > 16 rows: the GEMM
        (20, 2048, 40, None),
    ],
)
def test_zero_point_kernel_equals_integer_reference(m, k, n, group):
    torch.manual_seed(m * k + n)
    weight, bias = torch.randn(n, k) + 0.3, torch.randn(n)  # a shifted row: zero points away from 8
    x = torch.randn(m, k) * 2
    x[0, 1] = 40.0
    layer = Int4A8Linear.from_float(weight, bias, group, symmetric=False)
    assert layer.zeros is not None and int(layer.zeros.min()) != int(layer.zeros.max())
    got = native.w4a8_forward(x, 1, layer.qweight, layer.scales, layer.bias, zero_term=layer.zero_term())
    assert rel_err(got, zero_point_reference(x, weight, bias, group)) < 1e-6
    # without the correction the loops compute the absmax reading of the same nibbles: the term is what differs
    plain = native.w4a8_forward(x, 1, layer.qweight, layer.scales, layer.bias)
    assert rel_err(plain, got) > 1e-3


@needs_native
@pytest.mark.parametrize("group", [None, 32, 64])
def test_zero_point_layer_equals_fake_and_its_paths_agree_bit_for_bit(group):
    """Every C path (the GEMV, the GEMM, the _int_mm prefill) adds the same correction in the same order: equal
    bit for bit at every row count; the torch path is fake mode's arithmetic. All equal fake mode to rounding."""
    from qbench.quant.kernels import paths

    torch.manual_seed(5)
    k, n = 192, 40
    weight, bias = torch.randn(n, k) * 0.1 + 0.05, torch.randn(n)
    spec = get_scheme("absmax-fine:w=4,sym=false" + ("" if group is None else f",group={group}"))
    fake = FakeQuantLinear(weight, bias, spec)
    real = Int4A8Linear.from_float(weight, bias, group, symmetric=False)
    gran = spec.weight_granularity_for(k)
    assert torch.equal(real.dequantized_weight(), fake_quantize(weight, 4, gran, False))
    for rows in (1, 5, 17, 40):
        x = torch.randn(rows, k)
        outs = {}
        for path in paths.offered("w4a8"):
            layer = Int4A8Linear.from_float(weight, bias, group, symmetric=False)
            with torch.inference_mode(), paths.force(path):
                outs[path] = layer(x)
            assert layer.last_path == path
        expected = fake(x)
        # an AVX2 build without VNNI sums g = 32 groups at decode in another float order (even groups, then odd:
        # native_avx2.c): its GEMV agrees with the other paths to rounding, every other path bit for bit
        reordered = {"c-gemv"} if group == 32 and native.isa() == "AVX2" and not native.vnni() else set()
        c_outs = [y for path, y in outs.items() if path not in {"torch", *reordered}]
        assert all(torch.equal(c_outs[0], y) for y in c_outs), rows
        assert all(rel_err(outs[p], c_outs[0]) < 1e-6 for p in reordered), rows
        assert all(rel_err(y, expected) < 1e-5 for y in outs.values()), rows


def test_zero_point_schemes_dispatch_and_count_bytes():
    model = nn.Sequential(nn.Linear(128, 64), nn.ReLU(), nn.Linear(64, 32))
    for name, group in (("zeropoint-w4a8-g32", 32), ("w4a8-zp", None)):
        real = quantize(model, name, mode="real")
        first = next(m for m in real.modules() if isinstance(m, Int4A8Linear))
        assert isinstance(model[0], nn.Linear) and first.zeros is not None
        groups = 128 // (group or 128)
        # nibbles, scales + zero points, bias, and the kernels' (groups, out) float32 term s · (8 − z)
        stored = 64 * 128 // 2 + 64 * groups * (4 + 1) + 64 * 4 + 64 * groups * 4
        assert first.nbytes() == stored
        with torch.inference_mode():
            y = real(torch.randn(2, 128))
        assert torch.isfinite(y).all() and first.nbytes() == stored
        assert "W int4 zeropoint" in repr(first)


@needs_native
def test_zero_point_term_follows_replaced_or_edited_tensors():
    """The kernels' derived s · (8 − z) term is rebuilt when scales or zero points are replaced or edited in
    place: the C path keeps equal to the torch path (fake mode's arithmetic on the stored codes)."""
    torch.manual_seed(9)
    layer = Int4A8Linear.from_float(torch.randn(48, 128) + 0.5, None, 32, symmetric=False)
    other = Int4A8Linear.from_float(torch.randn(48, 128) - 0.5, None, 32, symmetric=False)
    x = torch.randn(1, 128)
    with torch.no_grad():
        layer(x)
        layer.scales, layer.zeros, layer.qweight = (
            other.scales.clone(),
            other.zeros.clone(),
            other.qweight.clone(),
        )
        assert rel_err(layer(x), layer._torch_forward(x, True)) < 1e-5
        layer.scales.mul_(2)
        assert rel_err(layer(x), layer._torch_forward(x, True)) < 1e-5
        layer.zeros.data = torch.randint_like(layer.zeros, 0, 16)  # a swapped storage keeps its version
        assert rel_err(layer(x), layer._torch_forward(x, True)) < 1e-5
