import math

import pytest
import torch

from models.attention import attention_fast, attention_reference, softmax1


def test_softmax1_matches_definition_and_is_stable():
    x = torch.randn(5, 7, dtype=torch.float64)
    expected = x.exp() / (1 + x.exp().sum(-1, keepdim=True))
    torch.testing.assert_close(softmax1(x), expected)
    big = torch.tensor([[1000.0, 999.0, -1000.0]])  # naive exp overflows
    out = softmax1(big)
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out.sum(), torch.tensor(1.0), atol=1e-6, rtol=0)


def test_softmax1_rows_sum_below_one_and_masked_entries_are_zero():
    x = torch.randn(3, 6)
    x[:, 4:] = float("-inf")
    p = softmax1(x)
    assert (p.sum(-1) < 1).all()
    assert (p[:, 4:] == 0).all()
    assert softmax1(torch.full((1, 4), -50.0)).sum() < 1e-20  # all logits very negative: attend nowhere


def test_softmax1_equals_softmax_with_extra_zero_logit():
    x = torch.randn(4, 9, dtype=torch.float64)
    with_zero = torch.softmax(torch.cat([torch.zeros(4, 1, dtype=torch.float64), x], -1), -1)[:, 1:]
    torch.testing.assert_close(softmax1(x), with_zero)


@pytest.mark.parametrize("kind", ["softmax", "softmax1", "sink"])
def test_fast_and_reference_paths_agree_under_causal_mask(kind):
    B, nh, T, hs = 2, 3, 11, 8
    q, k, v = (torch.randn(B, nh, T, hs) * 2 for _ in range(3))
    sink_k, sink_v = torch.randn(nh, hs), torch.randn(nh, hs)
    fast = attention_fast(q, k, v, kind, sink_k, sink_v)
    ref, probs = attention_reference(q, k, v, kind, sink_k, sink_v)
    assert (fast - ref).abs().max() <= 1e-5
    assert probs.shape == (B, nh, T, T)
    assert (probs.triu(1) == 0).all(), "a query attended to a future key"
    _, probs64 = attention_reference(
        q.double(), k.double(), v.double(), kind, sink_k.double(), sink_v.double()
    )
    row_sums = probs64.sum(-1)  # float64: in float32 a row of 0.9999999 rounds to 1
    if kind == "softmax":
        torch.testing.assert_close(row_sums, torch.ones_like(row_sums))
    else:
        assert (row_sums < 1).all()


def test_reference_softmax1_matches_manual_formula():
    q, k, v = (torch.randn(1, 1, 4, 2, dtype=torch.float64) for _ in range(3))
    scores = (q @ k.transpose(-2, -1)) / math.sqrt(2)
    scores = scores.masked_fill(~torch.ones(4, 4, dtype=torch.bool).tril(), float("-inf"))
    expected = scores.exp() / (1 + scores.exp().sum(-1, keepdim=True))
    _, probs = attention_reference(q, k, v, "softmax1")
    torch.testing.assert_close(probs, expected)


def test_softmax1_is_not_ordinary_softmax():
    q, k, v = (torch.randn(1, 2, 5, 4) for _ in range(3))
    assert (attention_fast(q, k, v, "softmax") - attention_fast(q, k, v, "softmax1")).abs().max() > 1e-3
