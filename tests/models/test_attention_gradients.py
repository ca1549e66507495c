"""Gradients of every attention path: gradcheck in float64, fast == reference backward, the learned sink trains."""

from __future__ import annotations

import pytest
import torch

import models
from models.attention import attention_extra_key, attention_fast, attention_reference

from .conftest import micro


def _qkv(seed: int = 0, B: int = 1, nh: int = 2, T: int = 5, hs: int = 4, dtype=torch.float64):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(B, nh, T, hs, generator=g, dtype=dtype, requires_grad=True) for _ in range(3)]


def _sink(nh: int = 2, hs: int = 4, dtype=torch.float64):
    g = torch.Generator().manual_seed(7)
    return [torch.randn(nh, hs, generator=g, dtype=dtype, requires_grad=True) for _ in range(2)]


@pytest.mark.parametrize("path", ["fast", "extra-key", "reference"])
@pytest.mark.parametrize("kind", ["softmax", "softmax1", "sink"])
def test_gradcheck_float64(kind, path):
    q, k, v = _qkv()
    sink = _sink() if kind == "sink" else [None, None]
    fn = {
        "fast": attention_fast,
        "extra-key": attention_extra_key,
        "reference": lambda *a: attention_reference(*a)[0],
    }[path]
    inputs = (q, k, v, *(s for s in sink if s is not None))

    def f(*args):
        q, k, v, *rest = args
        return fn(q, k, v, kind, *(rest or [None, None]))

    assert torch.autograd.gradcheck(f, inputs, eps=1e-6, atol=1e-6)


@pytest.mark.parametrize("kind", ["softmax", "softmax1", "sink"])
def test_fast_backward_equals_reference_backward(kind):
    """Same loss, same inputs: the fused path's gradients (q, k, v and the sink's key/value) equal the
    explicit path's, in float32 at the sizes a model uses."""
    grads = {}
    for path in ("fast", "reference"):
        q, k, v = _qkv(seed=1, B=2, nh=3, T=17, hs=8, dtype=torch.float32)
        sink = _sink(3, 8, torch.float32) if kind == "sink" else [None, None]
        if path == "fast":
            y = attention_fast(q, k, v, kind, *sink)
        else:
            y = attention_reference(q, k, v, kind, *sink)[0]
        (y * torch.linspace(-1, 1, y.numel()).view_as(y)).sum().backward()
        grads[path] = [t.grad for t in (q, k, v, *sink) if t is not None]
    for fast, ref in zip(grads["fast"], grads["reference"], strict=True):
        torch.testing.assert_close(fast, ref, rtol=1e-4, atol=1e-5)


def test_a_short_training_run_moves_the_learned_sink():
    """attn='sink': the per-head key and value start at zero and are learned (they get gradient and change),
    and the loss falls."""
    torch.manual_seed(0)
    model = models.build(micro("llama", attn="sink"), seed=0)
    attn = model.transformer.h[0].attn
    start_k, start_v = attn.sink_k.detach().clone(), attn.sink_v.detach().clone()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    ids = torch.randint(0, 97, (4, 24), generator=torch.Generator().manual_seed(0))
    losses = []
    for _ in range(20):
        logits = model(ids[:, :-1])
        loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.size(-1)), ids[:, 1:].reshape(-1))
        opt.zero_grad()
        loss.backward()
        assert attn.sink_k.grad is not None and attn.sink_k.grad.abs().sum() > 0
        opt.step()
        losses.append(loss.item())
    assert (attn.sink_k - start_k).abs().max() > 1e-3 and (attn.sink_v - start_v).abs().max() > 1e-3
    assert losses[-1] < losses[0] - 0.5
