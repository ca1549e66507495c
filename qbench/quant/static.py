"""Static activation scales: calibrated once on token windows, then fixed — the pure math and the quantiser module.

Dynamic scales (the default) are recomputed from every sequence; a deployed int8 model usually fixes them in
advance instead (TensorRT's int8 calibration, SmoothQuant's O3 setting). For a scheme with ``static=True``:

- **Observation** (``calibrate.py``): the *float* model runs ``calib_windows`` windows of the corpus's train split;
  each target linear's transformed input x' = R(x / s) (see ``fake.py``) and its output are observed, keeping every
  channel's min and max over all calibration tokens.
- **Scale** (ours; the default of TensorRT's "max" calibrator and SmoothQuant's static path): the absmax of what was
  observed, with the primitives' formulas (``primitives.qparams_from_stats``): per tensor, lo = min over channels
  of the channel minima, hi = max of the maxima, s = max(max(hi, −lo) / qmax, TINY) when symmetric; per channel
  (``PerAxis(-1)``) the same per input channel. No percentile clipping: the scale covers every observed value.
- **Inference**: q = clamp(round(x / s) + z, qmin, qmax), x̂ = s · (q − z) (z = 0 when symmetric). Unlike a dynamic
  scale, values beyond the calibrated range now saturate — that is the point of measuring it.

Only per-tensor and per-channel scales can be static (a per-token scale would need the tokens in advance); the
override ``static=true`` therefore turns a per-token activation granularity into per-tensor (``overrides.py``).
A static scale is shared by every sequence, so results still do not depend on how windows are batched.
"""

from __future__ import annotations

import torch
from torch import Tensor

from models.errors import UserError
from qbench.quant.float32 import Float32Buffers
from qbench.quant.granularity import Granularity, PerTensor, is_static_granularity
from qbench.quant.primitives import QParams, check_input, non_finite_error, qparams_from_stats, qrange


def static_qparams(lo: Tensor, hi: Tensor, bits: int, granularity: Granularity, symmetric: bool) -> QParams:
    """QParams from per-channel observed (min, max), (C,) each: scale () per tensor or (C,) per channel."""
    if not is_static_granularity(granularity):
        raise UserError(f"static scales are per tensor or per channel, not {granularity.label}")
    if isinstance(granularity, PerTensor):
        lo, hi = lo.min(), hi.max()
    if not bool(torch.isfinite(hi.float() - lo.float()).all()):
        raise non_finite_error("static calibration")
    scale, zp = qparams_from_stats((lo, hi), bits, symmetric)
    return QParams(scale, None if zp is None else zp.to(torch.int32))


def fake_quantize_static(x: Tensor, qparams: QParams, bits: int, symmetric: bool) -> Tensor:
    """x̂ = s · (clamp(round(x / s) + z, qmin, qmax) − z) with fixed qparams broadcast over the last dim.

    Float32 arithmetic, result in ``x``'s dtype (as ``primitives.fake_quantize``). Pure.
    """
    check_input(x, "fake_quantize_static")
    qmin, qmax = qrange(bits, symmetric)
    y = x.float().div(qparams.scale).round_()
    if qparams.zero_point is None:
        return y.clamp_(qmin, qmax).mul_(qparams.scale).to(x.dtype)
    zp = qparams.zero_point.float()
    return y.add_(zp).clamp_(qmin, qmax).sub_(zp).mul_(qparams.scale).to(x.dtype)


class StaticQuantizer(Float32Buffers):
    """Fake-quantises a tensor with calibrated qparams (buffers, so they move with the model)."""

    _float32_buffers = ("scale",)

    def __init__(self, qparams: QParams, bits: int, symmetric: bool) -> None:
        super().__init__()
        self.bits, self.symmetric = bits, symmetric
        self.register_buffer("scale", qparams.scale.detach().float().clone())
        zp = qparams.zero_point
        self.register_buffer("zero_point", None if zp is None else zp.detach().to(torch.int32).clone())

    @property
    def qparams(self) -> QParams:
        return QParams(self.scale, self.zero_point)

    @property
    def per_tensor(self) -> bool:
        return self.scale.dim() == 0

    def forward(self, x: Tensor) -> Tensor:
        return fake_quantize_static(x, self.qparams, self.bits, self.symmetric)

    def extra_repr(self) -> str:
        kind = "per tensor" if self.per_tensor else f"per channel ({self.scale.numel()})"
        return f"static int{self.bits} {'absmax' if self.symmetric else 'zeropoint'} {kind}"
