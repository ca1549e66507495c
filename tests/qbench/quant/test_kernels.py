"""Real kernels equal the fake-quant path: int8 (integer GEMM), int4 (packed), bitsandbytes."""

from __future__ import annotations

import dataclasses
import sys

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

from models.errors import UserError
from qbench.quant.apply import real_kernels
from qbench.quant.fake import FakeQuantLinear, HadamardRotation
from qbench.quant.granularity import PerAxis, PerGroup, PerTensor, PerToken
from qbench.quant.kernels import available_backends, make_real_linear
from qbench.quant.kernels.int4 import Int4Linear, pack_int4, unpack_int4
from qbench.quant.kernels.int8 import EXACT_FLOAT_K, Int8Linear, float_int_mm, int_mm, pad_for_cublas
from qbench.quant.primitives import fake_quantize
from qbench.quant.schemes import SCHEMES, QuantScheme


def sqnr_db(ref: torch.Tensor, approx: torch.Tensor) -> float:
    return (10 * torch.log10(ref.pow(2).sum() / (ref - approx).pow(2).sum())).item()


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    """max |a − b| relative to the output scale max |b|."""
    return ((a - b).abs().max() / b.abs().max()).item()


@pytest.fixture
def layer():
    torch.manual_seed(0)
    weight, bias = torch.randn(48, 64) * 0.1, torch.randn(48)
    x = torch.randn(3, 9, 64)
    x[0, 2, 5] = 40.0  # an outlier, so per-token and per-sequence scales differ
    return weight, bias, x


def int8_scheme(act, out_bits, weight_granularity, method="rtn") -> QuantScheme:
    return QuantScheme(
        "test-int8",
        method=method,
        weight_bits=8,
        weight_granularity=weight_granularity,
        act_bits=8,
        act_granularity=act,
        out_bits=out_bits,
    )


# ------------------------------------------------------------------------------------------------- int8


@pytest.mark.parametrize("act", [PerToken(), PerTensor()], ids=["per_token", "per_tensor"])
@pytest.mark.parametrize("out_bits", [None, 8], ids=["float_out", "out8"])
@pytest.mark.parametrize("weight_granularity", [PerAxis(0), PerTensor()], ids=["w_channel", "w_tensor"])
@pytest.mark.parametrize("transform", ["none", "smooth", "rotate", "both"])
def test_int8_equals_fake_module(layer, act, out_bits, weight_granularity, transform):
    weight, bias, x = layer
    method = {"none": "rtn", "smooth": "smoothquant", "rotate": "hadamard", "both": "smoothquant"}[transform]
    scheme = int8_scheme(act, out_bits, weight_granularity, method)
    kw = {}
    if transform in ("smooth", "both"):
        kw["input_scale"] = torch.rand(64) + 0.5
    if transform in ("rotate", "both"):
        kw["rotation"] = HadamardRotation(64, seed=1)
    real = make_real_linear(weight, bias, scheme, **kw)
    fake = FakeQuantLinear(weight, bias, scheme, **kw)
    assert isinstance(real, Int8Linear)
    for inp in (x, x[1]):  # (B, T, C) and a single (T, C) sequence
        assert rel_err(real(inp), fake(inp)) < 1e-5


def test_int8_weight_codes_equal_primitives(layer):
    weight, bias, _ = layer
    for granularity in (PerAxis(0), PerTensor()):
        m = Int8Linear.from_float(weight, bias, weight_granularity=granularity)
        assert torch.equal(m.dequantized_weight(), fake_quantize(weight, 8, granularity, True))
        assert m.qweight_t.dtype == torch.int8 and m.qweight_t.shape == (64, 48)


def test_int8_and_w4a8_take_granularity_objects_and_name_a_bad_one(layer):
    from qbench.quant.kernels.w4a8 import Int4A8Linear

    weight, bias, _ = layer
    choices = r"choose from: PerToken\(\), PerTensor\(\)$"
    with pytest.raises(UserError, match=r"activation granularity 'per_token' is not supported; " + choices):
        Int8Linear.from_float(weight, bias, act="per_token")  # the old string spelling
    with pytest.raises(UserError, match=r"weight granularity PerGroup\(group_size=16\) is not supported"):
        Int8Linear.from_float(weight, bias, weight_granularity=PerGroup(16))
    with pytest.raises(UserError, match=r"Int4A8Linear activation granularity PerAxis\(axis=-1\)"):
        Int4A8Linear.from_float(weight, bias, act=PerAxis(-1))
    m = Int8Linear.from_float(weight, bias, weight_granularity=PerAxis(-2), act=PerTensor())
    assert torch.equal(m.dequantized_weight(), Int8Linear.from_float(weight, bias).dequantized_weight())
    assert "A int8 absmax per sequence" in repr(m)


@pytest.mark.parametrize("act", [PerToken(), PerTensor()], ids=["per_token", "per_tensor"])
@pytest.mark.parametrize("out_quant", [False, True])
def test_int8_batching_invariance(layer, act, out_quant):
    weight, bias, x = layer
    m = Int8Linear.from_float(weight, bias, act=act, out_quant=out_quant)
    batched = m(x[:2])
    assert torch.equal(batched[0], m(x[0:1])[0]) and torch.equal(batched[1], m(x[1]))


def test_int8_per_tensor_scale_is_per_sequence(layer):
    weight, bias, x = layer
    m = Int8Linear.from_float(weight, bias, act=PerTensor())
    # sequence 0 holds the outlier; a scale shared across the batch would coarsen sequence 1
    one_scale = fake_quantize(x, 8, PerTensor(), True) @ m.dequantized_weight().T + bias
    assert not torch.allclose(m(x)[1], one_scale[1], rtol=0, atol=1e-3)


def test_int8_sqnr_floor(layer):
    weight, bias, x = layer
    ref = F.linear(x, weight, bias)
    assert sqnr_db(ref, Int8Linear.from_float(weight, bias, act=PerToken())(x)) > 35
    assert sqnr_db(ref, Int8Linear.from_float(weight, bias, act=PerTensor(), out_quant=True)(x)) > 20


def test_int8_dtype_and_shape(layer):
    weight, bias, x = layer
    m = Int8Linear.from_float(weight, bias)
    y = m(x.to(torch.bfloat16))
    assert y.dtype == torch.bfloat16 and y.shape == (3, 9, 48)
    assert m(x[0, 0]).shape == (48,)
    with pytest.raises(ValueError, match="expects"):
        m(torch.randn(2, 63))


def test_int8_nbytes_and_repr(layer):
    weight, bias, _ = layer
    m = Int8Linear.from_float(weight, bias)
    assert m.nbytes() == 48 * 64 + 48 * 4 + 48 * 4  # int8 codes + per-channel scales + bias
    assert m.nbytes() - 48 * 4 < weight.numel() * 4 / 3.5
    text = repr(m)
    assert "in_features=64" in text and "per channel" in text and "per token" in text


@pytest.mark.parametrize("shape", [(5, 13, 7), (17, 16, 8), (1, 3, 2)])
def test_int_mm_cublas_padding_is_exact(shape):
    m, k, n = shape
    a = torch.randint(-127, 128, (m, k), dtype=torch.int8)
    b = torch.randint(-127, 128, (k, n), dtype=torch.int8)
    pa, pb = pad_for_cublas(a, b)
    assert not pa.shape[0] % 32 and not pa.shape[1] % 8 and not pb.shape[1] % 8
    assert pb.is_contiguous()
    expected = a.int() @ b.int()
    assert torch.equal(torch._int_mm(pa, pb)[:m, :n], expected)
    assert torch.equal(int_mm(a, b), expected)
    assert torch.equal(float_int_mm(a, b), expected)


def test_float_int_mm_is_exact_beyond_float32s_integers():
    # one K-chunk of extremes sums to 1024 · 128² = 2^24 (the last exact float32 integer); 3 chunks and a ragged
    # one give a sum that no single float32 matmul holds exactly
    k = 3 * EXACT_FLOAT_K + 5
    a = torch.full((3, k), -128, dtype=torch.int8)
    a[1] = 127
    b = torch.full((k, 2), -128, dtype=torch.int8)
    want = a.long() @ b.long()
    assert int(want.abs().max()) > 2**24
    assert torch.equal(float_int_mm(a, b).long(), want)
    gen = torch.Generator().manual_seed(0)
    a = torch.randint(-128, 128, (5, 2000), generator=gen, dtype=torch.int8)
    b = torch.randint(-128, 128, (9, 2000), generator=gen, dtype=torch.int8).t()  # a layer's (in, out) view
    assert torch.equal(float_int_mm(a, b), torch._int_mm(a, b.contiguous()))
    assert float_int_mm(a[:, :0], b[:0]).shape == (5, 9)


def test_padded_weight_is_cached_per_tensor_until_it_is_written():
    w = torch.ones(45, 60, dtype=torch.int8).t()  # (in, out) transposed view, as Int8Linear stores it
    x = torch.ones(3, 60, dtype=torch.int8)
    first, again = pad_for_cublas(x, w)[1], pad_for_cublas(x, w)[1]
    assert first is again and first.shape == (64, 48) and first.is_contiguous()
    w.add_(1)  # an in-place write bumps the version: the cached copy would be stale
    fresh = pad_for_cublas(x, w)[1]
    assert fresh is not first and int(fresh[0, 0]) == 2
    legal = torch.ones(64, 48, dtype=torch.int8)
    assert (
        pad_for_cublas(torch.ones(3, 64, dtype=torch.int8), legal)[1] is legal
    )  # legal, contiguous: no copy


@pytest.mark.slow
@pytest.mark.parametrize("weight_granularity", [PerAxis(0), PerTensor()], ids=["w_channel", "w_tensor"])
@pytest.mark.parametrize("act", [PerToken(), PerTensor()], ids=["per_token", "per_tensor"])
@pytest.mark.parametrize("out_quant", [False, True])
@pytest.mark.parametrize("with_bias", [True, False])
def test_int8_fused_compiled_equals_eager(layer, weight_granularity, act, out_quant, with_bias):
    """Every compiled configuration (2 weight × 2 activation granularities × output quantisation × bias)."""
    weight, bias, x = layer
    bias = bias if with_bias else None
    kw = dict(weight_granularity=weight_granularity, act=act, out_quant=out_quant)
    eager = Int8Linear.from_float(weight, bias, fused=False, **kw)
    fused = Int8Linear.from_float(weight, bias, fused=True, **kw)
    assert torch.equal(eager(x), fused(x))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("tokens", [3, 40])  # 3 rows exercises the M > 16 padding
def test_int8_cuda_matches_cpu(layer, tokens):
    weight, bias, _ = layer
    x = torch.randn(2, tokens, 64)
    m = Int8Linear.from_float(weight, bias, act=PerToken(), fused=False)
    y_cpu = m(x)
    y_gpu = m.to("cuda")(x.cuda()).cpu()
    assert rel_err(y_gpu, y_cpu) < 1e-6


# ------------------------------------------------------------------------------------------------- int4


def test_pack_int4_nibble_order():
    packed = pack_int4(torch.tensor([[1, 2, 15, 0, 7]], dtype=torch.uint8))
    assert packed.tolist() == [[0x21, 0x0F, 0x07]]  # element 2j in the low nibble, odd length padded
    assert unpack_int4(packed, 5).tolist() == [[1, 2, 15, 0, 7]]


@settings(max_examples=40, deadline=None)
@given(rows=st.integers(1, 5), cols=st.integers(1, 33), seed=st.integers(0, 2**16))
def test_pack_unpack_round_trip(rows, cols, seed):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randint(0, 16, (rows, cols), generator=gen, dtype=torch.uint8)
    packed = pack_int4(q)
    assert packed.dtype == torch.uint8 and packed.shape == (rows, (cols + 1) // 2)
    assert torch.equal(unpack_int4(packed, cols), q)


@pytest.mark.parametrize("group_size", [None, 32])
def test_int4_equals_fake(layer, group_size):
    weight, bias, x = layer
    granularity = PerAxis(0) if group_size is None else PerGroup(group_size)
    m = Int4Linear.from_float(weight, bias, group_size)
    assert torch.equal(m.dequantized_weight(), fake_quantize(weight, 4, granularity, symmetric=False))
    scheme = dataclasses.replace(SCHEMES.get("zeropoint-int4"), weight_granularity=granularity)
    fake = FakeQuantLinear(weight, bias, scheme)
    real = make_real_linear(weight, bias, scheme)
    assert isinstance(real, Int4Linear) and torch.equal(real(x), fake(x))


def test_int4_hadamard_equals_fake(layer):
    weight, bias, x = layer
    scheme = SCHEMES.get("hadamard-zeropoint-int4")
    rotation = HadamardRotation(64, seed=0)
    real = make_real_linear(weight, bias, scheme, rotation=rotation)
    assert rel_err(real(x), FakeQuantLinear(weight, bias, scheme, rotation=rotation)(x)) < 1e-6


@pytest.mark.parametrize("group_size", [None, 64, 128])
def test_int4_cpu_fast_path_equals_dequantise_path(group_size):
    torch.manual_seed(0)
    weight, bias = torch.randn(32, 256) * 0.05, torch.randn(32)
    x = torch.randn(2, 5, 256).to(torch.bfloat16)
    m = Int4Linear.from_float(weight, bias, group_size)
    assert m.kernel_group() is not None and m._fast_path_ok(x)
    fast = m(x)
    assert fast.dtype == torch.bfloat16 and m._kernel_cache is not None
    # the kernel computes (q − 8)·scale + zero with bf16 (scale, zero): rebuild exactly that weight in fp32
    _, pair, group = m._int4pack_weights()
    codes = unpack_int4(m.qweight, 256).float()
    scale, zero = (pair[..., i].float().T.repeat_interleave(group, dim=1) for i in (0, 1))
    kernel_weight = (codes - 8) * scale + zero
    ref = F.linear(x.float(), kernel_weight, bias)
    assert rel_err(fast.float(), ref) < 8e-3  # bf16 output rounding
    # and against the float32 dequantise path: scales rounded to bf16 add at most ~2⁻⁸ relative
    dequant = F.linear(x.float(), m.dequantized_weight(), bias)
    assert rel_err(fast.float(), dequant) < 2e-2


def test_int4_fast_path_skipped_when_shape_does_not_fit():
    weight = torch.randn(24, 64)  # out % 16 != 0
    m = Int4Linear.from_float(weight, None)
    x = torch.randn(3, 64).to(torch.bfloat16)
    assert m.kernel_group() is None and not m._fast_path_ok(x)
    assert rel_err(m(x).float(), F.linear(x.float(), m.dequantized_weight()).bfloat16().float()) < 1e-2


def test_int4_sqnr_floor(layer):
    weight, bias, x = layer
    ref = F.linear(x, weight, bias)
    assert sqnr_db(ref, Int4Linear.from_float(weight, bias)(x)) > 20
    assert sqnr_db(ref, Int4Linear.from_float(weight, bias, 32)(x)) > 22


@pytest.mark.parametrize(("in_features", "group_size"), [(128, None), (256, 128)])
def test_int4_bytes_at_most_a_seventh(in_features, group_size):
    weight = torch.randn(64, in_features)
    m = Int4Linear.from_float(weight, torch.zeros(64), group_size)
    groups = 1 if group_size is None else in_features // group_size
    assert m.weight_nbytes() == 64 * in_features // 2 + 64 * groups * (4 + 1)
    assert m.weight_nbytes() <= weight.numel() * 4 / 7
    assert m.nbytes() == m.weight_nbytes() + 64 * 4  # + bias
    assert "int4 zeropoint" in repr(m)


def test_int4_group_must_divide(layer):
    weight, bias, _ = layer
    with pytest.raises(UserError, match="group_size"):
        Int4Linear.from_float(weight, bias, 48)


# ---------------------------------------------------------------------------------------- dispatch, errors


def test_unsupported_schemes_are_user_errors(layer):
    weight, bias, _ = layer
    with pytest.raises(UserError, match=r"no real kernel.*fake"):
        make_real_linear(weight, bias, SCHEMES.get("absmax-fine-perchannel"))
    with pytest.raises(UserError, match="no real kernel"):
        make_real_linear(weight, bias, QuantScheme("w6a6", weight_bits=6, act_bits=6))
    with pytest.raises(UserError, match="input_scale"):
        make_real_linear(weight, bias, SCHEMES.get("smoothquant"))
    with pytest.raises(UserError, match="rotation"):
        make_real_linear(weight, bias, SCHEMES.get("hadamard-absmax-coarse"))
    with pytest.raises(UserError, match="rotation of size"):
        Int8Linear.from_float(weight, bias, rotation=HadamardRotation(32))


def test_missing_bitsandbytes_is_a_clear_error(layer, monkeypatch):
    weight, bias, _ = layer
    monkeypatch.setitem(sys.modules, "bitsandbytes", None)  # makes `import bitsandbytes` raise ImportError
    with pytest.raises(UserError, match=r"pip install 'qbench\[bnb\]'"):
        make_real_linear(weight, bias, SCHEMES.get("llm-int8"))
    assert available_backends()["bitsandbytes"] is False


def test_available_backends():
    backends = available_backends()
    assert all(isinstance(v, bool) for v in backends.values())
    assert backends["int8 _int_mm (cpu)"] is True
    assert backends["int8 _int_mm (cuda)"] is torch.cuda.is_available()


# ----------------------------------------------------------------------------------------- bitsandbytes


def test_llm_int8_equals_direct_linear8bitlt(layer):
    bnb = pytest.importorskip("bitsandbytes")
    weight, bias, x = layer
    ours = make_real_linear(weight, bias, SCHEMES.get("llm-int8"))
    direct = bnb.nn.Linear8bitLt(64, 48, has_fp16_weights=False, threshold=6.0)
    direct.load_state_dict({"weight": weight, "bias": bias})
    direct = direct.to("cpu").eval()  # .to(device) is where bitsandbytes quantises
    assert ours.layer.weight.dtype == torch.int8
    with torch.no_grad():  # one call per sequence: bitsandbytes picks outlier columns over a call's rows
        assert torch.equal(ours(x), torch.cat([direct(x[i : i + 1]) for i in range(x.shape[0])]))
    assert ours.nbytes() == 48 * 64 + 48 * 4 + 48 * 4  # int8 weight + SCB + bias
    assert "llm-int8" in repr(ours)
    ours.train()
    assert not ours.layer.training  # Linear8bitLt would silently run in float while training


def test_nf4_equals_direct_linear4bit():
    bnb = pytest.importorskip("bitsandbytes")
    torch.manual_seed(0)
    weight, bias, x = torch.randn(64, 128) * 0.1, torch.randn(64), torch.randn(2, 5, 128)
    ours = make_real_linear(weight, bias, SCHEMES.get("bnb-nf4"))
    direct = bnb.nn.Linear4bit(
        128, 64, compute_dtype=torch.float32, compress_statistics=False, quant_type="nf4"
    )
    direct.weight = bnb.nn.Params4bit(
        weight.clone(),
        requires_grad=False,
        quant_type="nf4",
        blocksize=64,
        compress_statistics=False,
        module=direct,
    )
    direct.bias = torch.nn.Parameter(bias.clone(), requires_grad=False)
    direct = direct.to("cpu").eval()
    with torch.inference_mode():
        assert torch.equal(ours(x), direct(x))
    assert sqnr_db(F.linear(x, weight, bias), ours(x)) > 15
    assert ours.nbytes() < weight.numel() * 4 / 5


def test_nf4_odd_out_features(layer):
    pytest.importorskip("bitsandbytes")
    weight, bias, x = layer  # 48 outputs: bitsandbytes' own CPU repacking would assert out % 32 == 0
    ours = make_real_linear(weight, bias, SCHEMES.get("bnb-nf4"))
    with torch.inference_mode():
        assert sqnr_db(F.linear(x, weight, bias), ours(x)) > 15


# An independent check of the bitsandbytes layers: plain F.linear on a weight dequantised from the formats'
# definitions (LLM.int8, Dettmers et al. 2022, §3: vector-wise int8 with fp outlier columns; NF4, QLoRA
# Dettmers et al. 2023, appendix E: the 16 NormalFloat values, absmax per block of 64).
NF4_VALUES = torch.tensor(
    [-1.0, -0.6961928009986877, -0.5250730514526367, -0.39491748809814453, -0.28444138169288635,
     -0.18477343022823334, -0.09105003625154495, 0.0, 0.07958029955625534, 0.16093020141124725,
     0.24611230194568634, 0.33791524171829224, 0.44070982933044434, 0.5626170039176941,
     0.7229568362236023, 1.0]
)  # fmt: skip


def _llm_int8_reference(x, weight, bias, threshold=6.0):
    """One sequence: columns with any |x| > threshold in float against the int8-dequantised weight, the rest as
    int8 × int8 with per-row absmax scales and exact integer accumulation."""
    w_scale = weight.abs().amax(1, keepdim=True)  # (out, 1)
    w_q = torch.round(weight / w_scale * 127).clamp(-127, 127)
    outlier = (x.abs() > threshold).any(0)  # (in,)
    x_in = x.masked_fill(outlier, 0.0)
    x_scale = x_in.abs().amax(1, keepdim=True).clamp_min(1e-12)
    x_q = torch.round(x_in / x_scale * 127).clamp(-127, 127)
    y = (x_q.double() @ w_q.double().T) * (x_scale.double() * w_scale.double().T) / (127 * 127)
    y = y + x[:, outlier].double() @ (w_q[:, outlier].double() * w_scale.double() / 127).T
    return (y + bias.double()).float()


@pytest.mark.parametrize("outliers", [False, True])
def test_llm_int8_equals_an_independent_reference(layer, outliers):
    pytest.importorskip("bitsandbytes")
    weight, bias, x = layer
    x = x.clone()
    if outliers:
        x[..., 5] = 9.0  # one input column above the 6.0 threshold
    ours = make_real_linear(weight, bias, SCHEMES.get("llm-int8"))
    with torch.no_grad():
        got = ours(x)
    expected = torch.cat([_llm_int8_reference(x[i], weight, bias)[None] for i in range(x.shape[0])])
    # bitsandbytes computes in half precision here (errors 1e-3 to 4e-3); a row scale taken before the outlier
    # columns are removed, or the outliers against the float weight, would be off by 5e-3 to 1.5e-2.
    assert rel_err(got, expected) < (5e-3 if outliers else 2e-3)
    assert sqnr_db(F.linear(x, weight, bias), got) > 30


def test_nf4_equals_f_linear_on_the_nf4_dequantised_weight():
    pytest.importorskip("bitsandbytes")
    torch.manual_seed(0)
    weight, bias, x = torch.randn(64, 128) * 0.1, torch.randn(64), torch.randn(2, 5, 128)
    ours = make_real_linear(weight, bias, SCHEMES.get("bnb-nf4"))
    blocks = weight.reshape(-1, 64)
    absmax = blocks.abs().amax(1, keepdim=True)
    nearest = (blocks / absmax).unsqueeze(-1).sub(NF4_VALUES).abs().argmin(-1)
    dequantised = (NF4_VALUES[nearest] * absmax).reshape_as(weight)
    with torch.inference_mode():
        got = ours(x)
    # bitsandbytes' CPU kernel on AVX512-BF16 CPUs computes in bf16 (input and absmax rounded to 8 significant
    # bits: errors of a few units of 2⁻⁹); elsewhere it dequantises to float32 and calls F.linear
    bound = 8e-3 if ours.compute_dtype == torch.bfloat16 else 1e-5
    assert rel_err(got, F.linear(x, dequantised, bias)) < bound


def test_nf4_record_names_the_compute_dtype_bitsandbytes_uses():
    bnb = pytest.importorskip("bitsandbytes")
    from bitsandbytes.functional import has_avx512bf16

    torch.manual_seed(0)
    for out_features in (64, 48):  # 48: not a multiple of 32, so bitsandbytes' bf16 repacking is switched off
        layer = make_real_linear(torch.randn(out_features, 128), None, SCHEMES.get("bnb-nf4"))
        bf16 = bool(has_avx512bf16()) and out_features % 32 == 0
        assert layer.compute_dtype == (torch.bfloat16 if bf16 else torch.float32)
        name = "bnb-nf4 (bf16 compute)" if bf16 else "bnb-nf4 (fp32 compute)"
        assert name in layer.kernel_name
        assert ("bf16 compute" if bf16 else "fp32 compute") in repr(layer)
        assert real_kernels(torch.nn.Sequential(layer)) == [layer.kernel_name]  # what records carry
        assert isinstance(layer.layer, bnb.nn.Linear4bit)
