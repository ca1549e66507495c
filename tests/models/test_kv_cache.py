"""The KV cache: decoding position by position (and in chunks) gives the logits of one full forward pass, for
every attention normalisation, position scheme and norm placement; greedy generation equals argmax over full
passes; the context limit counts cached positions."""

import pytest
import torch

from models import build
from models.attention import attention_reference
from models.transformer import KVCache

from .conftest import micro

CASES = [
    ("gpt2", dict(attn="softmax")),
    ("gpt2", dict(attn="softmax1")),
    ("gpt2", dict(attn="sink")),
    ("gpt2", dict(attn="softmax1", pos="rope", norm_position="post")),
    ("llama", dict(attn="softmax1")),
    ("llama", dict(attn="softmax")),
]


def _model(family, switches):
    model = build(micro(family, **switches), seed=3).eval()
    if switches.get("attn") == "sink":  # a non-zero learned sink, so it has something to contribute
        with torch.no_grad():
            for block in model.transformer.h:
                block.attn.sink_k.normal_()
                block.attn.sink_v.normal_()
    return model


@pytest.mark.parametrize(("family", "switches"), CASES)
@pytest.mark.parametrize(
    "chunks", [(5, 1, 1, 1, 1, 1, 1, 1, 1, 1), (4, 3, 1, 6, 2)], ids=["decode", "chunks"]
)
def test_cached_logits_equal_one_full_pass(family, switches, chunks):
    model = _model(family, switches)
    ids = torch.randint(0, 97, (2, sum(chunks)), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        full = model(ids)
        cache, start, parts = KVCache(model.config), 0, []
        for size in chunks:
            parts.append(model(ids[:, start : start + size], cache))
            start += size
    assert cache.pos == ids.size(1)
    torch.testing.assert_close(torch.cat(parts, dim=1), full, rtol=1e-5, atol=1e-5)


def test_one_query_over_the_cache_is_the_last_row_of_causal_attention():
    """attention_with_past for a single query equals the explicit reference's last row (softmax-1's +1 too)."""
    from models.attention import attention_with_past

    q, k, v = (torch.randn(1, 2, 6, 8, generator=torch.Generator().manual_seed(i)) for i in range(3))
    expected, _ = attention_reference(q, k, v, "softmax1")
    got = attention_with_past(q[:, :, -1:], k, v, past=5, kind="softmax1")
    torch.testing.assert_close(got, expected[:, :, -1:], rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize(("family", "switches"), CASES[:2] + CASES[4:5])
def test_generate_equals_argmax_over_full_passes(family, switches):
    model = _model(family, switches)
    prompt = torch.randint(0, 97, (1, 4), generator=torch.Generator().manual_seed(1))
    got = model.generate(prompt, 8)
    ids = prompt
    with torch.no_grad():
        for _ in range(8):
            ids = torch.cat([ids, model(ids)[:, -1:].argmax(-1)], dim=1)
    assert torch.equal(got, ids[:, 4:])


def test_cached_positions_count_against_the_context():
    model = _model("gpt2", dict(attn="softmax"))
    cache = KVCache(model.config)
    with torch.no_grad():
        model(torch.zeros(1, model.config.context - 1, dtype=torch.long), cache)
        model(torch.zeros(1, 1, dtype=torch.long), cache)
        with pytest.raises(ValueError, match="sequence length 25 exceeds the model's context 24"):
            model(torch.zeros(1, 1, dtype=torch.long), cache)
