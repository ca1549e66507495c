import pytest
import torch

from models.stats import OutlierAccumulator, raw_kurtosis


def test_gaussian_has_raw_kurtosis_three():
    x = torch.randn(64, 20000, dtype=torch.float64)
    assert raw_kurtosis(x).mean().item() == pytest.approx(3.0, abs=0.02)


def test_planted_outlier_channel_matches_closed_form():
    # One channel at alpha, the rest 0: with C channels, mean = alpha/C and
    # kappa = ((C-1)^3 + 1) / (C-1) · 1/C ... computed exactly below from the moments of the two-point distribution.
    C, alpha = 256, 50.0
    x = torch.zeros(1, C, dtype=torch.float64)
    x[0, 7] = alpha
    p = 1 / C
    mu = alpha * p
    m2 = p * (alpha - mu) ** 2 + (1 - p) * mu**2
    m4 = p * (alpha - mu) ** 4 + (1 - p) * mu**4
    assert raw_kurtosis(x).item() == pytest.approx(m4 / m2**2, rel=1e-12)
    assert raw_kurtosis(x).item() == pytest.approx(C - 2 + 1 / (C - 1), rel=1e-9)  # the same, simplified


def test_accumulator_separates_first_token_and_is_batch_invariant():
    torch.manual_seed(0)
    h = torch.randn(4, 10, 64)
    h[:, 0, 3] = 500.0  # a massive activation on the first token only
    whole, split = OutlierAccumulator(), OutlierAccumulator()
    whole.add_hidden([h, h * 2])
    split.add_hidden([h[:2], h[:2] * 2])
    split.add_hidden([h[2:], h[2:] * 2])
    a, b = whole.summary(), split.summary()
    assert a == pytest.approx(b)
    assert a["kurtosis_first"] > 50 and a["kurtosis_other"] < 5
    assert a["max_abs"] == 1000.0 and a["max_abs_first"] == pytest.approx(750.0)


def test_attention_forced_onto_key_zero_gives_share_one():
    T = 6
    probs = torch.zeros(2, 3, T, T)
    probs[..., 0] = 1.0
    acc = OutlierAccumulator()
    acc.add_attention([probs, probs])
    s = acc.summary()
    assert s["first_token_top1_share"] == 1.0 and s["first_token_mass"] == 1.0
    uniform = torch.tril(torch.ones(T, T)) / torch.arange(1, T + 1)[:, None]
    acc = OutlierAccumulator()
    acc.add_attention([uniform.expand(1, 1, T, T)])
    # queries 1..5 put 1/(q+1) on key 0, tied with every other visible key: key 0 holds the largest weight.
    assert acc.summary()["first_token_mass"] == pytest.approx(sum(1 / (q + 1) for q in range(1, T)) / (T - 1))
    assert acc.summary()["first_token_top1_share"] == 1.0


def test_a_row_attending_nowhere_is_not_counted_as_key_zero():
    """softmax-1 rows can underflow to all zeros; argmax would call them key 0."""
    T = 5
    probs = torch.zeros(1, 2, T, T)
    probs[0, 0, :, 0] = 0.6  # head 0: key 0 wins on every query
    probs[0, 0, :, 1] = 0.3
    probs[0, 1, 1:3, 1] = 0.9  # head 1: queries 1-2 favour key 1; queries 3-4 attend nowhere (all zero)
    acc = OutlierAccumulator()
    acc.add_attention([probs])
    assert acc.summary()["first_token_top1_share"] == pytest.approx(4 / 8)


def test_uniform_attention_puts_the_harmonic_share_on_key_0():
    """The chance baseline is what OutlierAccumulator measures on uniform causal attention."""
    import math

    import pytest
    import torch

    from models.stats import OutlierAccumulator, uniform_first_key_share

    T = 128
    probs = torch.tril(torch.ones(T, T))
    probs = (probs / probs.sum(-1, keepdim=True)).expand(1, 2, T, T)
    acc = OutlierAccumulator()
    acc.add_attention([probs])
    harmonic = sum(1 / k for k in range(1, T + 1))
    assert math.isclose(uniform_first_key_share(T), (harmonic - 1) / (T - 1))
    assert math.isclose(acc.key0_mass / acc.n_queries, uniform_first_key_share(T), rel_tol=1e-6)
    assert round(uniform_first_key_share(T), 4) == 0.0349
    with pytest.raises(ValueError):
        uniform_first_key_share(1)
