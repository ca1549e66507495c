"""QuaRot's clipping (``qbench.quant.clip``): the activation clip ratio against a per-token reference written from
QuaRot's quantiser description, the weight clipping search against a brute-force loop over the same ratios, the
scheme keys (QuaRot's defaults, overrides, refusals), and GPTQ taking the searched grid."""

from __future__ import annotations

import pytest
import torch

from models.errors import UserError
from qbench.quant import get_scheme
from qbench.quant.apply import real_kernel_problem
from qbench.quant.clip import clipped_fake_quantize, mse_weight_qparams
from qbench.quant.gptq import gptq_quantize
from qbench.quant.granularity import PerAxis, PerGroup, PerToken
from qbench.quant.primitives import fake_quantize

GEN = torch.Generator().manual_seed(0)


def reference_token_clip(x, bits, symmetric, ratio):
    """Per token (row): range [min(x, 0), max(x, 0)] times the ratio; symmetric scale max|range| / (2^(b−1) − 1),
    asymmetric (hi − lo) / (2^b − 1) with a rounded zero point; values beyond saturate."""
    out = torch.empty_like(x)
    for i, row in enumerate(x.double()):
        lo, hi = min(row.min().item(), 0.0) * ratio, max(row.max().item(), 0.0) * ratio
        if symmetric:
            qmax = 2 ** (bits - 1) - 1
            s = max(max(-lo, hi) / qmax, 1e-12)
            out[i] = (
                torch.round(row.float() / torch.tensor(s, dtype=torch.float32)).clamp(-qmax, qmax) * s
            ).float()
        else:
            qmax = 2**bits - 1
            s = max((hi - lo) / qmax, 1e-12)
            s32 = torch.tensor(s, dtype=torch.float32)
            z = torch.round(torch.tensor(-lo, dtype=torch.float32) / s32)
            out[i] = ((torch.round(row.float() / s32) + z).clamp(0, qmax) - z) * s32
    return out


@pytest.mark.parametrize("symmetric", [True, False])
def test_activation_clip_matches_the_per_token_reference(symmetric):
    x = torch.randn(6, 64, generator=GEN) * torch.linspace(0.1, 4.0, 64)
    got = clipped_fake_quantize(x, 4, PerToken(), symmetric, 0.9)
    torch.testing.assert_close(got, reference_token_clip(x, 4, symmetric, 0.9), rtol=1e-5, atol=1e-6)
    # ratio 1 is the plain quantiser; a ratio below 1 saturates the largest values
    torch.testing.assert_close(
        clipped_fake_quantize(x, 4, PerToken(), symmetric, 1.0), fake_quantize(x, 4, PerToken(), symmetric)
    )
    assert (got.abs().amax(1) < x.abs().amax(1)).all()


def brute_force(w, bits, symmetric, grid=100, shrink=0.8, norm=2.4):
    """Per row: every r = 1 − i/grid, the one with the smallest Σ|Q(w) − w|^norm (first wins ties)."""
    best = []
    for row in w:
        errors = []
        for i in range(int(shrink * grid)):
            r = 1 - i / grid
            y = clipped_fake_quantize(row[None], bits, PerAxis(0), symmetric, r)[0]
            errors.append(((y - row).abs() ** norm).sum().item())
        best.append(min(range(len(errors)), key=lambda i: (errors[i], i)))
    return best


@pytest.mark.parametrize("symmetric", [True, False])
def test_weight_clip_search_picks_the_brute_force_ratio(symmetric):
    w = torch.randn(8, 96, generator=GEN)
    w[:, 0] *= 6  # an outlier column: clipping pays
    qp = mse_weight_qparams(w, 4, PerAxis(0), symmetric)
    for row, i in enumerate(brute_force(w, 4, symmetric)):
        r = 1 - i / 100
        lo, hi = min(w[row].min().item(), 0) * r, max(w[row].max().item(), 0) * r
        want = max(-lo, hi) / 7 if symmetric else (hi - lo) / 15
        assert qp.scale[row, 0].item() == pytest.approx(want, rel=1e-5), row
    plain = fake_quantize(w, 4, PerAxis(0), symmetric)
    from qbench.quant.fake import fake_quantize_weight

    searched = fake_quantize_weight(w, 4, PerAxis(0), symmetric, qp)
    assert ((searched - w).abs() ** 2.4).sum() < ((plain - w).abs() ** 2.4).sum()


def test_groups_are_searched_one_by_one():
    w = torch.randn(4, 64, generator=GEN)
    qp = mse_weight_qparams(w, 3, PerGroup(32), False)
    assert qp.scale.shape == (4, 2) and qp.zero_point.shape == (4, 2)
    one = mse_weight_qparams(w[:, 32:], 3, PerAxis(0), False)
    torch.testing.assert_close(qp.scale[:, 1:], one.scale)


def test_quarot_schemes_clip_as_quarot_runs_and_the_keys_override():
    s = get_scheme("absmax-fine:w=4,a=4,rotate=quarot")
    assert (s.act_clip_ratio, s.weight_clip_rule) == (0.9, "mse")
    d = s.to_dict()
    assert d["act_clip"] == 0.9 and d["weight_clip"] == "mse"
    off = get_scheme("absmax-fine:w=4,a=4,rotate=quarot,aclip=1,wclip=none")
    assert (off.act_clip_ratio, off.weight_clip_rule) == (1.0, "none") and "act_clip" not in off.to_dict()
    plain = get_scheme("absmax-fine").to_dict()  # schemes without clipping keep their records' identity
    assert "act_clip" not in plain and "weight_clip" not in plain
    assert get_scheme("mxfp4:rotate=quarot").weight_clip_rule == "none"  # float formats fix their own ranges
    assert get_scheme("zeropoint-int4:wclip=mse").weight_clip_rule == "mse"  # RTN alone may search too
    for bad, match in (
        ("zeropoint-int4:aclip=0.9", "clips dynamic integer activations"),
        ("zeropoint-int4:algo=awq,wclip=mse", "not with algo=awq"),
        ("absmax-fine:a=4,aclip=1.5", "aclip"),
        ("absmax-fine:wclip=max", "wclip"),
    ):
        with pytest.raises(UserError, match=match):
            get_scheme(bad)
    assert "no real kernel clips activations" in real_kernel_problem("absmax-fine:a=8,aclip=0.9")


def test_gptq_takes_the_searched_grid_per_channel():
    w = torch.randn(16, 64, generator=GEN)
    w[:, 3] *= 8
    x = torch.randn(400, 64, generator=GEN)
    h = 2 * x.T @ x / len(x)
    result = gptq_quantize(w, h, 4, PerAxis(0), False, weight_clip="mse")
    searched = mse_weight_qparams(w, 4, PerAxis(0), False)
    torch.testing.assert_close(result.qparams.scale, searched.scale)
    plain = gptq_quantize(w, h, 4, PerAxis(0), False)
    assert not torch.equal(plain.qparams.scale, searched.scale)


def test_the_card_says_what_was_clipped():
    from qbench.studies.card.words import quantised_text

    text = quantised_text(get_scheme("absmax-fine:w=4,a=4,rotate=quarot").to_dict())
    assert (
        "W4 int per channel, range searched" in text
        and "(dynamic scales clipped at 0.9 of the range)" in text
    )
