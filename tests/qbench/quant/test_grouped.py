"""Grouped weight-only int4/int3/int2: fake quantisation against a plain-torch reference written from
docs/metrics.md ("Quantisation schemes": Absmax and Zeropoint), bit packing, and real == fake."""

import pytest
import torch

from qbench.quant import quantize
from qbench.quant.fake import FakeQuantLinear
from qbench.quant.kernels import Int4Linear, LowBitLinear, make_real_linear, pack_bits, pack_int4, unpack_bits
from qbench.quant.schemes import get_scheme


def reference_rtn(w: torch.Tensor, bits: int, group: int, symmetric: bool) -> torch.Tensor:
    """metrics.md, written out per group with Python loops: no code shared with qbench.quant.

    Absmax: s = max|x| / (2^(b−1) − 1); x̂ = round(x / s) · s. Zeropoint: range [min(x,0), max(x,0)];
    s = (max − min) / (2^b − 1); z = round(−min / s); q = clamp(round(x / s) + z, 0, 2^b − 1); x̂ = s · (q − z).
    An all-zero group quantises to zeros.
    """
    out = torch.empty_like(w)
    for r in range(w.shape[0]):
        for start in range(0, w.shape[1], group):
            x = w[r, start : start + group].double()
            if symmetric:
                s = x.abs().max() / (2 ** (bits - 1) - 1)
                xq = torch.zeros_like(x) if s == 0 else torch.round(x / s) * s
            else:
                lo, hi = min(x.min(), torch.zeros(())), max(x.max(), torch.zeros(()))
                s = (hi - lo) / (2**bits - 1)
                if s == 0:
                    xq = torch.zeros_like(x)
                else:
                    z = torch.round(-lo / s)
                    q = torch.clamp(torch.round(x / s) + z, 0, 2**bits - 1)
                    xq = s * (q - z)
            out[r, start : start + group] = xq.to(w.dtype)
    return out


def weight(out: int = 8, inp: int = 256, seed: int = 0) -> torch.Tensor:
    w = torch.randn(out, inp, generator=torch.Generator().manual_seed(seed))
    w[0, :32] = 0.0  # an all-zero group
    w[1, 5] = 40.0  # an outlier: grouping confines its damage to one group
    w[2] = w[2].abs()  # an all-positive row: the zeropoint range still includes 0
    return w


GROUPED = [
    ("zeropoint-int4-g128", 4, 128, False),
    ("zeropoint-int4-g64", 4, 64, False),
    ("zeropoint-int4-g32", 4, 32, False),
    ("zeropoint-int3-g128", 3, 128, False),
    ("zeropoint-int2-g64", 2, 64, False),
    ("zeropoint-int4-g32:sym=true", 4, 32, True),
    ("zeropoint-int3-g128:sym=true", 3, 128, True),
    ("zeropoint-int2-g64:sym=true", 2, 64, True),
    ("zeropoint-int4:group=16,w=3", 3, 16, False),
]


@pytest.mark.parametrize("name, bits, group, symmetric", GROUPED)
def test_fake_grouped_weight_equals_the_spec_reference(name, bits, group, symmetric):
    w = weight()
    layer = FakeQuantLinear(w, None, get_scheme(name))
    ref = reference_rtn(w, bits, group, symmetric)
    # float32 vs the reference's float64 arithmetic: equal codes, scales equal to float32 rounding
    torch.testing.assert_close(layer.weight, ref, rtol=1e-6, atol=1e-6)
    assert torch.equal(layer.weight[0, :32], torch.zeros(32))


def test_groups_localise_an_outlier():
    w = weight()
    per_channel = FakeQuantLinear(w, None, get_scheme("zeropoint-int4")).weight
    grouped = FakeQuantLinear(w, None, get_scheme("zeropoint-int4-g32")).weight
    err = lambda q: (q[1] - w[1]).pow(2).sum()  # noqa: E731
    assert err(grouped) < err(per_channel) / 4


def test_group_longer_than_the_row_is_per_channel():
    w = weight(inp=64)
    g128 = FakeQuantLinear(w, None, get_scheme("zeropoint-int4-g128")).weight
    assert torch.equal(g128, FakeQuantLinear(w, None, get_scheme("zeropoint-int4")).weight)


@pytest.mark.parametrize(
    "name, bits, symmetric", [("zeropoint-int4-g32", 4, False), ("int3-g128:sym=true", 3, True)]
)
def test_a_ragged_last_group_has_its_own_scale(name, bits, symmetric):
    group = get_scheme(name).weight_granularity.group_size
    w = weight(inp=group * 2 + 24)  # like Llama's 688-wide MLP input with g = 128: a last group of 24
    layer = FakeQuantLinear(w, None, get_scheme(name))
    torch.testing.assert_close(layer.weight, reference_rtn(w, bits, group, symmetric), rtol=1e-6, atol=1e-6)
    real = make_real_linear(w, None, get_scheme(name))
    assert isinstance(real, LowBitLinear) and torch.equal(real.dequantized_weight(), layer.weight)


@pytest.mark.parametrize("bits", [2, 3, 4])
@pytest.mark.parametrize("n", [1, 7, 8, 13, 64])
def test_pack_unpack_round_trip(bits, n):
    codes = torch.randint(0, 2**bits, (3, n), generator=torch.Generator().manual_seed(n), dtype=torch.uint8)
    packed = pack_bits(codes, bits)
    codes_per_unit, bytes_per_unit = {2: (4, 1), 3: (8, 3), 4: (2, 1)}[bits]
    assert packed.dtype == torch.uint8 and packed.shape[-1] == -(-n // codes_per_unit) * bytes_per_unit
    assert torch.equal(unpack_bits(packed, bits, n), codes)


def test_packing_layout():
    # int4: pack_int4's layout (low nibble first); int2: code i at bits 2i; int3: 8 codes in a 24-bit word
    codes = torch.tensor([[1, 2, 3, 0, 7, 5, 6, 4]], dtype=torch.uint8)
    assert torch.equal(pack_bits(codes, 4), pack_int4(codes))
    assert pack_bits(torch.tensor([[1, 2, 3, 0]]), 2).tolist() == [[1 | 2 << 2 | 3 << 4]]
    word = sum(int(c) << (3 * i) for i, c in enumerate(codes[0]))
    assert pack_bits(codes, 3).tolist() == [[word & 255, word >> 8 & 255, word >> 16]]
    with pytest.raises(ValueError, match=r"\[0, 3\]"):
        pack_bits(torch.tensor([[4]]), 2)


@pytest.mark.parametrize("name, bits, group, symmetric", GROUPED)
def test_real_equals_fake(name, bits, group, symmetric):
    w, b = weight(), torch.randn(8)
    scheme = get_scheme(name)
    fake = FakeQuantLinear(w, b, scheme)
    real = make_real_linear(w, b, scheme)
    assert isinstance(real, Int4Linear if bits == 4 and not symmetric else LowBitLinear)
    assert torch.equal(real.dequantized_weight(), fake.weight)  # bit for bit
    x = torch.randn(2, 5, 256, generator=torch.Generator().manual_seed(1))
    torch.testing.assert_close(real(x), fake(x), rtol=1e-5, atol=1e-5)
    groups = 8 * 256 // group
    expected = 8 * 256 * bits // 8 + groups * 4 + (0 if symmetric else groups) + 8 * 4  # codes, s, z, bias
    assert real.nbytes() == expected


def test_real_int2_model_matches_fake_and_keeps_the_float_model(hf_llama_dir):
    transformers = pytest.importorskip("transformers")
    model = transformers.AutoModelForCausalLM.from_pretrained(hf_llama_dir).eval()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    ids = torch.randint(0, 8192, (2, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        fake = quantize(model, "zeropoint-int2-g64:group=16")(ids).logits
        real = quantize(model, "zeropoint-int2-g64:group=16", mode="real")(ids).logits
    torch.testing.assert_close(real, fake, rtol=1e-4, atol=1e-4)
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("name", ["zeropoint-int2-g64", "zeropoint-int3-g128", "zeropoint-int4-g32:sym=true"])
def test_packed_layer_builds_and_runs_on_cuda(name):
    # packing builds its shift vectors on the codes' device (a CPU arange met CUDA codes in qbench speed)
    w, b = weight().cuda(), torch.randn(8).cuda()
    real = make_real_linear(w, b, get_scheme(name))
    cpu = make_real_linear(w.cpu(), b.cpu(), get_scheme(name))
    assert torch.equal(real.dequantized_weight().cpu(), cpu.dequantized_weight())
    x = torch.randn(2, 5, 256, generator=torch.Generator().manual_seed(1))
    torch.testing.assert_close(real(x.cuda()).cpu(), cpu(x), rtol=1e-5, atol=1e-5)
