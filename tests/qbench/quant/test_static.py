"""Static (calibrated) activation scales: hand-computed absmax on a micro model, saturation,
one calibration pass shared with SmoothQuant, and real int8 == fake."""

import pytest
import torch
from torch import nn

from models.errors import UserError
from qbench.quant import quantize
from qbench.quant.calibrate import observe, select_windows
from qbench.quant.fake import FakeQuantLinear
from qbench.quant.granularity import PerTensor
from qbench.quant.kernels import Int8Linear, make_real_linear
from qbench.quant.schemes import get_scheme
from qbench.quant.static import StaticQuantizer, static_qparams


class Micro(nn.Module):
    """ids -> proj(emb(ids)): one linear whose input and output are easy to compute by hand."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.emb = nn.Embedding(16, 8)
        self.proj = nn.Linear(8, 6)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.proj(self.emb(ids))


CALIB = torch.tensor([[1, 2, 3, 4], [5, 6, 7, 1]])


def test_static_scales_equal_the_hand_computed_absmax():
    model = Micro()
    q = quantize(model, "absmax-coarse:static=true", calibration=CALIB)
    with torch.no_grad():
        x = model.emb(CALIB)
        y = model.proj(x)
    layer = q.proj
    assert isinstance(layer, FakeQuantLinear) and layer.act_static.per_tensor
    assert layer.act_static.scale == x.abs().max() / 127  # per tensor: absmax of every observed value
    assert layer.out_static.scale == y.abs().max() / 127
    per_channel = quantize(model, "absmax-coarse:static=true,agran=channel", calibration=CALIB).proj
    assert torch.equal(per_channel.act_static.scale, x.abs().amax((0, 1)) / 127)


def test_static_scales_saturate_and_do_not_follow_the_input():
    model = Micro()
    q = quantize(model, "absmax-moderate:static=true", calibration=CALIB)
    s = q.proj.act_static.scale
    x = torch.randn(3, 5, 8) * 100 * s  # mostly far beyond the calibrated range
    xq = q.proj.act_static(x)
    assert torch.equal(xq, torch.clamp(torch.round(x / s), -127, 127) * s)
    assert xq.abs().max() == 127 * s
    dynamic = quantize(model, "absmax-moderate").proj
    with torch.no_grad():  # dynamic scales follow the input, so they do not saturate
        assert not torch.allclose(q.proj(x), dynamic(x))


def test_asymmetric_static_qparams():
    lo, hi = torch.tensor([-1.0, 0.5]), torch.tensor([3.0, 2.0])
    qp = static_qparams(lo, hi, 8, PerTensor(), symmetric=False)
    assert qp.scale == pytest.approx(4.0 / 255) and int(qp.zero_point) == round(1.0 / (4.0 / 255))
    quantizer = StaticQuantizer(qp, 8, symmetric=False)
    x = torch.tensor([-5.0, -1.0, 0.0, 3.0, 9.0])
    out = quantizer(x)
    assert out[0] == out[1] and out[4] == out[3]  # saturates at both calibrated ends
    assert out[2] == 0.0  # zero is exact in zeropoint quantisation


def test_the_float_model_comes_back_untouched_and_calibration_is_required():
    model = Micro().train()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    quantize(model, "absmax-fine:static=true", calibration=CALIB)
    assert model.training and all(torch.equal(v, before[k]) for k, v in model.state_dict().items())
    assert not any(m._forward_pre_hooks or m._forward_hooks for m in model.modules())
    with pytest.raises(UserError, match=r"static scales.*needs calibration"):
        quantize(model, "absmax-fine:static=true")
    with pytest.raises(UserError, match="build it with quantize"):
        FakeQuantLinear(torch.randn(6, 8), None, get_scheme("absmax-fine:static=true"))


def test_one_observation_serves_smoothquant_and_static():
    model = Micro()
    observed = observe(model, {"proj": model.proj}, CALIB, outputs=True)["proj"]
    with torch.no_grad():
        x = model.emb(CALIB).reshape(-1, 8)
        y = model.proj(x)
    assert torch.equal(observed.in_absmax, x.abs().amax(0))  # SmoothQuant's statistic
    assert torch.equal(observed.out_hi, y.amax(0)) and torch.equal(observed.out_lo, y.amin(0))
    # smoothquant + static: the static scale is that of x / s, derived exactly from the per-channel ranges
    q = quantize(model, "smoothquant:static=true", calibration=CALIB).proj
    assert torch.allclose(q.act_static.scale, (x / q.input_scale).abs().max() / 127, rtol=1e-6)


def test_select_windows():
    ids = torch.arange(40).reshape(10, 4)
    assert torch.equal(select_windows(ids, 3, None), ids[:3])
    sample = select_windows(ids, 3, 1)
    assert len(sample) == 3 and torch.equal(sample, select_windows(ids, 3, 1))  # seeded: reproducible
    assert not torch.equal(sample, ids[:3]) and not torch.equal(sample, select_windows(ids, 3, 2))
    assert torch.equal(sample[:, 0].sort().values, sample[:, 0])  # original order kept


@pytest.mark.parametrize(
    "name", ["absmax-moderate:static=true", "absmax-fine:static=true", "absmax-coarse:static=true"]
)
def test_real_int8_static_equals_fake(name):
    torch.manual_seed(0)
    w, b = torch.randn(32, 64), torch.randn(32)
    scheme = get_scheme(name)
    x_cal = torch.randn(4, 16, 64)
    act = StaticQuantizer(
        static_qparams(x_cal.amin((0, 1)), x_cal.amax((0, 1)), 8, PerTensor(), True), 8, True
    )
    y_cal = x_cal @ w.T + b
    out = None
    if scheme.out_bits:
        out = StaticQuantizer(
            static_qparams(y_cal.amin((0, 1)), y_cal.amax((0, 1)), 8, PerTensor(), True), 8, True
        )
    fake = FakeQuantLinear(w, b, scheme, act_static=act, out_static=out)
    real = make_real_linear(w, b, scheme, act_static=act, out_static=out)
    assert isinstance(real, Int8Linear) and real.static_act_scale is not None
    x = torch.randn(3, 16, 64) * 1.5  # some values beyond the calibrated range: both saturate alike
    with torch.no_grad():
        yf, yr = fake(x), real(x)
    if out is None:
        torch.testing.assert_close(yr, yf, rtol=1e-5, atol=1e-4)
    else:  # an output code may flip where float rounding meets a rounding boundary: at most one step, rarely
        step = float(out.scale)
        assert (yr - yf).abs().max() <= step * 1.001
        assert ((yr - yf).abs() > 1e-4).float().mean() < 0.01


def test_real_static_per_channel_has_no_int8_kernel():
    scheme = get_scheme("absmax-fine:static=true,agran=channel")
    qp = static_qparams(-torch.ones(8), torch.ones(8), 8, scheme.act_granularity, True)
    with pytest.raises(UserError, match="no real kernel"):
        make_real_linear(torch.randn(4, 8), None, scheme, act_static=StaticQuantizer(qp, 8, True))


def test_real_static_model_matches_fake(hf_gpt2_dir):
    transformers = pytest.importorskip("transformers")
    model = transformers.AutoModelForCausalLM.from_pretrained(hf_gpt2_dir).eval()  # Conv1D layers
    ids = torch.randint(0, 8192, (2, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        fake = quantize(model, "absmax-moderate:static=true", calibration=ids)(ids).logits
        real = quantize(model, "absmax-moderate:static=true", mode="real", calibration=ids)(ids).logits
    torch.testing.assert_close(real, fake, rtol=1e-3, atol=1e-3)
