"""LLM.int8 cells do not depend on --batch-size: bitsandbytes picks outlier columns per call."""

from __future__ import annotations

import pytest
import torch

from qbench.eval.metrics import Protocol, make_windows, perplexity
from qbench.quant import quantize
from qbench.quant.kernels.bnb import bnb_available, bnb_int8_linear
from tests.qbench.conftest import micro_config, trained_like

pytestmark = pytest.mark.skipif(not bnb_available(), reason="bitsandbytes is not installed")


def test_a_sequences_outlier_does_not_change_its_neighbours():
    torch.manual_seed(0)
    layer = bnb_int8_linear(torch.randn(16, 64) * 0.1, threshold=6.0)
    x = torch.randn(3, 5, 64)
    x[0, 2, 7] = 9.0  # an outlier column in sequence 0 only
    together = layer(x)
    for i in range(3):
        assert torch.equal(together[i : i + 1], layer(x[i : i + 1])), i


def test_llm_int8_windows_score_the_same_alone_and_in_a_batch_of_3(tokenizer):
    """One rare token with a large embedding channel makes an outlier column in window 0 only."""
    from qbench.eval.adapters import logits

    windows = make_windows(tokenizer, Protocol(tokens=32 * 6, window=32), context=32)
    ids = windows.ids
    rare = next(int(t) for t in ids[0, 1:] if (ids == t).sum() == 1)
    model = trained_like(micro_config())
    with torch.no_grad():  # after ln_1 (gain 2) the rare token's channel 9 is ~11 > the 6.0 threshold
        model.transformer.wte.weight[rare, 9] = 60.0
        model.transformer.h[0].ln_1.weight[9] = 2.0
    qmodel = quantize(model, "llm-int8", mode="real")
    with torch.no_grad():
        batched = logits(qmodel, ids[:3])
        alone = torch.cat([logits(qmodel, ids[i : i + 1]) for i in range(3)])
    assert torch.equal(
        batched, alone
    )  # before: windows 1-2 moved by up to 0.007 with window 0's outlier column
    one, three = (perplexity(qmodel, windows, batch_size=b)["perplexity"] for b in (1, 3))
    assert one == pytest.approx(three, rel=1e-6)  # only the order of summing the NLL differs
