"""softmax-1 on a fused kernel (o1 = o · sigmoid(lse)): values and gradients against the explicit reference."""

from __future__ import annotations

import pytest
import torch

import models.attention as attention
from models.attention import attention_extra_key, attention_fast, attention_reference
from models.flash_softmax1 import Softmax1Attention, kernel_for, softmax1_flash


def _qkv(dtype, shape=(2, 3, 9, 8), scale=1.0, device="cpu"):
    g = torch.Generator().manual_seed(0)
    return [
        (torch.randn(*shape, generator=g, dtype=torch.float64) * scale).to(dtype).to(device).requires_grad_()
        for _ in range(3)
    ]


def test_identity_output_is_softmax_output_times_sigmoid_lse():
    """The identity itself, in plain torch: Σ e^s v / (1 + Σ e^s) = softmax output · sigmoid(logsumexp)."""
    q, k, v = _qkv(torch.float64)
    scores = (q @ k.transpose(-2, -1)) / q.size(-1) ** 0.5
    scores = scores.masked_fill(~torch.ones(9, 9, dtype=torch.bool).tril(), float("-inf"))
    lse = scores.logsumexp(-1, keepdim=True)
    manual = (scores.exp() @ v) / (1 + scores.exp().sum(-1, keepdim=True))
    assert torch.allclose(torch.softmax(scores, -1) @ v * torch.sigmoid(lse), manual, atol=1e-14)


def test_cpu_kernel_is_chosen_for_float_cpu_tensors():
    assert kernel_for(torch.zeros(1, dtype=torch.float32)) == "cpu-flash"
    assert kernel_for(torch.zeros(1, dtype=torch.int64)) is None


def test_gradcheck_float64():
    q, k, v = _qkv(torch.float64, shape=(1, 2, 5, 4))
    assert torch.autograd.gradcheck(lambda a, b, c: Softmax1Attention.apply(a, b, c, "cpu-flash"), (q, k, v))


@pytest.mark.parametrize("dtype,tol", [(torch.float64, 1e-12), (torch.float32, 2e-6)])
@pytest.mark.parametrize("scale", [1.0, 6.0])  # 6: large logits, sigmoid(lse) → 1 (softmax-like) rows
def test_values_and_gradients_match_reference(dtype, tol, scale):
    q, k, v = _qkv(dtype, scale=scale)
    fast = softmax1_flash(q, k, v)
    ref, _ = attention_reference(q, k, v, "softmax1")
    assert (fast - ref).abs().max() < tol * scale
    g = torch.randn_like(ref)
    for a, b in zip(torch.autograd.grad(fast, (q, k, v), g), torch.autograd.grad(ref, (q, k, v), g)):
        assert (a - b).abs().max() < 10 * tol * scale**2


def test_lse_gradient_is_needed():
    """Autograd through the kernel alone treats lse as a constant: q/k gradients come out wrong (why the
    custom Function exists)."""
    q, k, v = _qkv(torch.float64)
    out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, True)
    naive = out * torch.sigmoid(lse).unsqueeze(-1)
    ref, _ = attention_reference(q, k, v, "softmax1")
    g = torch.randn_like(ref)
    dq_naive = torch.autograd.grad(naive, q, g)[0]
    dq_ref = torch.autograd.grad(ref, q, g)[0]
    assert (dq_naive - dq_ref).abs().max() > 1e-3


def test_attention_fast_uses_it_and_the_switch_falls_back(monkeypatch):
    q, k, v = _qkv(torch.float32)
    fallback = attention_extra_key(q, k, v, "softmax1")
    fast = attention_fast(q, k, v, "softmax1")
    assert fast.grad_fn is not None and "Softmax1Attention" in type(fast.grad_fn).__name__
    assert (fast - fallback).abs().max() < 2e-6
    monkeypatch.setattr(attention, "SOFTMAX1_FLASH", False)
    assert "Softmax1Attention" not in type(attention_fast(q, k, v, "softmax1").grad_fn).__name__


def test_model_trains_the_same_on_both_paths(monkeypatch):
    """A micro softmax-1 model: loss and every parameter gradient agree between the two paths."""
    from models import build, preset_config

    cfg = preset_config("tiny", attn="softmax1", n_layer=2, d_model=64, n_head=2, d_ff=128, context=16)
    model = build(cfg, seed=0)
    x = torch.randint(0, cfg.vocab_size, (2, 16), generator=torch.Generator().manual_seed(1))

    def grads() -> tuple[float, list[torch.Tensor]]:
        model.zero_grad()
        loss = torch.nn.functional.cross_entropy(model(x).flatten(0, 1), x.flatten())
        loss.backward()
        return loss.item(), [p.grad.clone() for p in model.parameters()]

    loss_fast, g_fast = grads()
    monkeypatch.setattr(attention, "SOFTMAX1_FLASH", False)
    loss_ref, g_ref = grads()
    assert loss_fast == pytest.approx(loss_ref, rel=1e-6)
    for a, b in zip(g_fast, g_ref):
        assert torch.allclose(a, b, rtol=1e-4, atol=1e-6)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cuda_kernels_match_reference(dtype):
    """CUDA: flash (bf16) / memory-efficient (fp32) kernel vs the float64 reference on the same inputs."""
    q, k, v = _qkv(dtype, shape=(2, 4, 128, 64), device="cuda")
    fast = softmax1_flash(q, k, v)
    assert fast is not None
    q64, k64, v64 = (t.detach().double().requires_grad_() for t in (q, k, v))
    ref, _ = attention_reference(q64, k64, v64, "softmax1")
    tol = 2e-2 if dtype == torch.bfloat16 else 1e-4
    assert (fast.double() - ref).abs().max() < tol
    g = torch.randn_like(ref)
    for a, b in zip(
        torch.autograd.grad(fast, (q, k, v), g.to(dtype)), torch.autograd.grad(ref, (q64, k64, v64), g)
    ):
        assert (a.double() - b).abs().max() < 10 * tol
