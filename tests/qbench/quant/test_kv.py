"""KV-cache quantisation (qbench.quant.kv): the quantiser against KIVI's definition, keep-first, the hook point
(post-RoPE keys), and our models vs their transformers exports reading the same quantised cache."""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from models import build
from models.errors import UserError
from models.hf import SOFTMAX1_EAGER, to_hf_model
from qbench.quant.kv import KVConfig, apply_kv, quantize_kv
from qbench.quant.primitives import NonFiniteError
from tests.qbench.conftest import micro_config, trained_like

# ------------------------------------------------------------------------------------------ the quantiser

WINDOW = {"kivi": "window", "per-token": "window:key_axis=token"}  # the whole-window statistics tested here
SMALL = "kivi:group=4,residual=8"  # KIVI with groups small enough to quantise a 32-token window


def kivi_reference(x: torch.Tensor, bits: int, per_channel: bool) -> torch.Tensor:
    """KIVI (Liu et al. 2024) §3.1 eq. 1, group by group: z = min X, s = (max X − min X)/(2^b − 1),
    X̂ = round((X − z)/s)·s + z. Keys per channel: a group is one channel's column over the positions of one
    (sequence, head); per token: one position's row over the head's channels. Loops, float32, no shared code."""
    B, H, T, D = x.shape
    out = torch.empty_like(x)
    levels = 2**bits - 1
    for b in range(B):
        for h in range(H):
            groups = (
                [(slice(None), d) for d in range(D)] if per_channel else [(t, slice(None)) for t in range(T)]
            )
            for index in groups:
                g = x[b, h][index]
                lo, hi = g.min(), g.max()
                s = (hi - lo) / levels
                q = torch.clamp(torch.round((g - lo) / s), 0, levels)
                out[b, h][index] = q * s + lo
    return out


@pytest.mark.parametrize("bits", [8, 6, 4, 3, 2])
@pytest.mark.parametrize("granularity", ["kivi", "per-token"])
def test_quantiser_equals_the_kivi_reference(bits, granularity):
    k, v = torch.randn(2, 3, 7, 8), torch.randn(2, 3, 7, 8) * 3 + 1
    kq, vq = quantize_kv(k, v, KVConfig(bits, WINDOW[granularity]))
    torch.testing.assert_close(
        kq, kivi_reference(k, bits, per_channel=granularity == "kivi"), rtol=0, atol=1e-6
    )
    torch.testing.assert_close(vq, kivi_reference(v, bits, per_channel=False), rtol=0, atol=1e-6)


def test_quantiser_uses_2_to_the_b_levels_per_group_within_half_a_step():
    k = torch.randn(1, 2, 50, 4)
    kq, _ = quantize_kv(k, k, KVConfig(3, "window"))
    step = (
        k.amax(-2, keepdim=True) - k.amin(-2, keepdim=True)
    ) / 7  # one step per channel (keys per channel)
    assert ((kq - k).abs() <= step / 2 + 1e-6).all()
    for h in range(2):
        for d in range(4):
            assert len(torch.unique(kq[0, h, :, d])) <= 8
    torch.testing.assert_close(
        kq.amin(-2), k.amin(-2)
    )  # the range ends are levels: min exactly, max to rounding
    torch.testing.assert_close(kq.amax(-2), k.amax(-2))


def test_constant_groups_come_back_exactly_and_nan_is_refused():
    k = torch.full((1, 1, 5, 4), 0.3)
    for scheme in ("window", SMALL):
        kq, vq = quantize_kv(k, k, KVConfig(2, scheme))
        assert torch.equal(kq, k) and torch.equal(vq, k)
    k[0, 0, 2, 1] = float("nan")
    for scheme in ("window", "kivi:group=1,residual=1", "per-token"):
        with pytest.raises(NonFiniteError):
            quantize_kv(k, k, KVConfig(2, scheme))


def test_keep_first_is_bit_exact_and_left_out_of_the_ranges():
    k, v = torch.randn(2, 2, 16, 8), torch.randn(2, 2, 16, 8)
    k[:, :, 0] += 40.0  # a sink-like first key: an outlier in every channel
    kq, vq = quantize_kv(k, v, KVConfig(2, "window", keep_first=1))
    assert torch.equal(kq[:, :, :1], k[:, :, :1]) and torch.equal(vq[:, :, :1], v[:, :, :1])
    # the ranges of positions ≥ 1 only
    rest_k, rest_v = quantize_kv(k[:, :, 1:], v[:, :, 1:], KVConfig(2, "window"))
    assert torch.equal(kq[:, :, 1:], rest_k) and torch.equal(vq[:, :, 1:], rest_v)
    with_sink, _ = quantize_kv(k, v, KVConfig(2, "window"))
    assert (with_sink - k)[:, :, 1:].abs().mean() > 5 * (kq - k)[:, :, 1:].abs().mean()
    short = torch.randn(1, 1, 3, 4)
    assert torch.equal(quantize_kv(short, short, KVConfig(2, "window", keep_first=3))[0], short)


def test_quantiser_keeps_the_dtype_and_never_writes_its_input():
    k = torch.randn(1, 2, 6, 8, dtype=torch.bfloat16)
    before = k.clone()
    kq, vq = quantize_kv(k, k, KVConfig(4, keep_first=2))
    assert kq.dtype == vq.dtype == torch.bfloat16 and torch.equal(k, before)


# --------------------------------------------------------------------------------------------- the config


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(bits=5), "choose from: 8, 6, 4, 3, 2"),
        (dict(bits=16), "choose from: 8, 6, 4, 3, 2"),
        (dict(bits=True), "choose from"),
        (dict(bits=4, scheme="per-tokn"), "did you mean 'per-token'"),
        (dict(bits=4, keep_first=-1), "integer ≥ 0"),
        (dict(bits=4, keep_first=1.5), "integer ≥ 0"),
    ],
)
def test_bad_configs_are_one_line_errors(kwargs, message):
    with pytest.raises(UserError) as e:
        KVConfig(**kwargs)
    assert message in str(e.value) and "\n" not in str(e.value)


def test_labels_and_round_trip():
    assert [c.label for c in (KVConfig(2), KVConfig(2, keep_first=1), KVConfig(4, "per-token"))] == [
        "kv2",
        "kv2-keep1",
        "kv4-tok",
    ]
    config = KVConfig(3, "per-token", keep_first=4)
    assert KVConfig.from_dict(config.to_dict()) == config
    with pytest.raises(UserError, match="unknown KV-cache config field"):
        KVConfig.from_dict({"bits": 4, "groups": 32})
    with pytest.raises(dataclasses_frozen_error()):
        config.bits = 8


def dataclasses_frozen_error():
    import dataclasses

    return dataclasses.FrozenInstanceError


# ------------------------------------------------------------------------------------------------ models


class Recorder:
    """A kv transform that records what it is given and changes nothing."""

    def __init__(self) -> None:
        self.calls: list[tuple[torch.Tensor, torch.Tensor]] = []

    def __call__(self, k, v):
        self.calls.append((k.detach().clone(), v.detach().clone()))
        return k, v


def hand_rotary(k: torch.Tensor, theta: float) -> torch.Tensor:
    """Llama's rotary embedding written out per channel pair (i, i + hs/2): angle t·θ^(−2i/hs)."""
    T, hs = k.shape[-2], k.shape[-1]
    out = torch.empty_like(k)
    for i in range(hs // 2):
        angle = torch.arange(T, dtype=torch.float64) * theta ** (-2 * i / hs)
        cos, sin = angle.cos().to(k.dtype), angle.sin().to(k.dtype)
        a, b = k[..., i], k[..., i + hs // 2]
        out[..., i], out[..., i + hs // 2] = a * cos - b * sin, b * cos + a * sin
    return out


def test_hook_receives_post_rope_keys_in_ours_and_in_transformers():
    model = trained_like(micro_config("llama"))
    ids = torch.randint(0, 8192, (2, 12))
    recorder = Recorder()
    model.transformer.h[0].attn.kv_transform = recorder
    with torch.no_grad():
        hooked = model(ids)
        model.transformer.h[0].attn.kv_transform = None
        assert torch.equal(hooked, model(ids))  # an identity transform changes nothing
        attn, cfg = model.transformer.h[0].attn, model.config
        h = model.transformer.h[0].ln_1(model.transformer.wte(ids))
        heads = lambda t: t.view(2, 12, cfg.n_head, cfg.head_dim).transpose(1, 2)  # noqa: E731
        k_expected, v_expected = hand_rotary(heads(attn.k_proj(h)), cfg.rope_theta), heads(attn.v_proj(h))
    k, v = recorder.calls[0]
    torch.testing.assert_close(k, k_expected, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(v, v_expected)
    assert not torch.allclose(k, heads(attn.k_proj(h)), atol=1e-3)  # the rotation did happen

    hf = apply_kv(to_hf_model(model), KVConfig(8))
    hf_recorder = Recorder()
    hf.model.layers[0].self_attn.qbench_kv = hf_recorder
    with torch.no_grad():
        hf(input_ids=ids, use_cache=False)
    torch.testing.assert_close(hf_recorder.calls[0][0], k_expected, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(hf_recorder.calls[0][1], v_expected, rtol=1e-5, atol=1e-5)


def nll(logits: torch.Tensor, ids: torch.Tensor) -> float:
    out = logits[:, :-1].float()
    return F.cross_entropy(out.reshape(-1, out.size(-1)), ids[:, 1:].reshape(-1)).item()


def hf_logits(model, ids):
    return model(input_ids=ids, attention_mask=torch.ones_like(ids), use_cache=False).logits


@pytest.mark.parametrize(
    "family, attn, eager",
    [
        ("gpt2", "softmax", False),
        ("gpt2", "softmax", True),
        ("llama", "softmax1", False),
        ("llama", "softmax1", True),
    ],
)
@pytest.mark.parametrize(
    "config", [KVConfig(2, SMALL), KVConfig(3, "window", keep_first=1), KVConfig(4, "per-token")], ids=str
)
def test_ours_and_the_transformers_export_agree_with_a_quantised_cache(family, attn, eager, config):
    model = trained_like(micro_config(family, attn=attn))
    hf = to_hf_model(model)
    if eager:
        hf.set_attn_implementation(SOFTMAX1_EAGER if attn == "softmax1" else "eager")
    ids = torch.randint(0, 8192, (3, 32))
    with torch.no_grad():
        ours, theirs = apply_kv(model, config)(ids), hf_logits(apply_kv(hf, config), ids)
        float_logits = model(ids)
    assert (ours - float_logits).abs().max() > 1e-4  # the cache was quantised ...
    assert math.exp(nll(ours, ids)) == pytest.approx(math.exp(nll(theirs, ids)), rel=1e-5)  # ... the same way
    torch.testing.assert_close(ours, theirs, rtol=1e-4, atol=1e-4)


def test_grouped_query_attention_quantises_the_stored_kv_heads():
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    hf = LlamaForCausalLM(
        LlamaConfig(
            vocab_size=64,
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=1,
            num_attention_heads=4,
            num_key_value_heads=2,
        )
    ).eval()
    hf.config._attn_implementation = "sdpa"
    kv = apply_kv(hf, KVConfig(2))
    recorder = Recorder()
    kv.model.layers[0].self_attn.qbench_kv = recorder
    ids = torch.randint(0, 64, (1, 10))
    with torch.no_grad():
        kv(input_ids=ids, use_cache=False)
    assert recorder.calls[0][0].shape == (1, 2, 10, 8)  # before repeat_kv: two stored heads, not four


def kl(p_logits: torch.Tensor, q_logits: torch.Tensor) -> float:
    """Mean KL(p || q) of the next-token distributions, in nats."""
    p, q = p_logits.log_softmax(-1), q_logits.log_softmax(-1)
    return (p.exp() * (p - q)).sum(-1).mean().item()


@pytest.mark.parametrize("family", ["gpt2", "llama"])
def test_8_bit_cache_changes_little_and_2_bit_a_lot(family):
    # init_std 0.2: attention patterns far from uniform, so the cache matters (std 0.02 models barely attend)
    model = build(micro_config(family, init_std=0.2), seed=0).eval()
    ids = torch.randint(0, 8192, (4, 32))
    with torch.no_grad():
        base = model(ids)
        logits = {b: apply_kv(model, KVConfig(b, SMALL))(ids) for b in (8, 6, 4, 3, 2)}
    divergence = [kl(base, logits[b]) for b in (8, 6, 4, 3, 2)]
    assert divergence == sorted(divergence)  # fewer bits, more damage
    # KIVI keeps the 8 newest values and the newest keys float, so 2 bits hurt less than a whole-window cache
    assert divergence[0] < 1e-4 and divergence[-1] > 0.005
    assert abs(math.exp(nll(logits[8], ids) - nll(base, ids)) - 1) < 1e-3  # 8 bits: perplexity within 0.1 %


def test_the_float_model_is_never_modified():
    model = trained_like(micro_config("llama"))
    hf = to_hf_model(model)
    ids = torch.randint(0, 8192, (1, 16))
    with torch.no_grad():
        before, hf_before = model(ids), hf_logits(hf, ids)
        state = {k: v.clone() for k, v in model.state_dict().items()}
        kv_model, kv_hf = apply_kv(model, KVConfig(2)), apply_kv(hf, KVConfig(2))
        kv_model(ids), hf_logits(kv_hf, ids)
        assert torch.equal(model(ids), before) and torch.equal(hf_logits(hf, ids), hf_before)
    assert all(torch.equal(state[k], v) for k, v in model.state_dict().items())
    assert all(block.attn.kv_transform is None for block in model.transformer.h)
    assert hf.config._attn_implementation == "sdpa" and kv_hf.config._attn_implementation == "qbench_kv+sdpa"
    assert getattr(model, "qbench_kv", None) is None and kv_model.qbench_kv["label"] == "kv2"
    with pytest.raises(UserError, match="already quantised"):
        apply_kv(kv_model, KVConfig(4))
    with pytest.raises(UserError, match="needs a KVConfig"):
        apply_kv(model, "kv2")


def test_combines_with_a_weight_and_activation_scheme():
    from qbench.quant import quantize

    model = trained_like(micro_config("gpt2"))
    ids = torch.randint(0, 8192, (2, 32))
    with torch.no_grad():
        weights_only = quantize(model, "absmax-fine")(ids)
        both = apply_kv(quantize(model, "absmax-fine"), KVConfig(2, SMALL))(ids)
        either_order = quantize(apply_kv(model, KVConfig(2, SMALL)), "absmax-fine")(ids)
    assert (both - weights_only).abs().max() > 1e-4
    torch.testing.assert_close(both, either_order, rtol=0, atol=0)


class ToyAttention(nn.Module):
    """Attention computed in the module itself (no transformers registry), its cache passed positionally."""

    def __init__(self, uses_cache: bool = True) -> None:
        super().__init__()
        self.qkv, self.uses_cache = nn.Linear(8, 24), uses_cache

    def forward(self, x: torch.Tensor, layer_past=None) -> torch.Tensor:
        q, k, v = (t[:, None] for t in self.qkv(x).chunk(3, -1))  # (B, 1 head, T, 8)
        if self.uses_cache and layer_past is not None:
            k, v = layer_past.update(k, v, 0)
        return F.scaled_dot_product_attention(q, k, v, is_causal=True)[:, 0]


class ToyLM(nn.Module):
    def __init__(self, uses_cache: bool = True) -> None:
        super().__init__()
        self.config = SimpleNamespace(_attn_implementation="eager")
        self.embed, self.layers = (
            nn.Embedding(16, 8),
            nn.ModuleList([ToyAttention(uses_cache) for _ in range(2)]),
        )

    def forward(self, input_ids, attention_mask=None, use_cache=False):
        x = self.embed(input_ids)
        for layer in self.layers:
            x = x + layer(x, None)  # the cache argument positionally, as older model files do
        return SimpleNamespace(logits=x)


def test_attention_outside_the_registry_reads_the_cache_it_updates_even_when_passed_positionally():
    torch.manual_seed(0)
    model = ToyLM()
    ids = torch.randint(0, 16, (2, 10))
    with torch.no_grad():
        kv = apply_kv(model, KVConfig(2, "per-token"))  # one version for all queries: kivi is refused here
        assert kv.config._attn_implementation == "eager"  # not renamed: its code path stays the model's own
        assert all(layer.qbench_kv.calls == 1 for layer in kv.layers)  # the probe ran every layer
        assert (kv(ids).logits - model(ids).logits).abs().max() > 1e-3


def test_attention_that_never_reaches_the_quantiser_is_refused_in_one_line():
    with pytest.raises(UserError, match=r"did not run in 2 of 2 attention modules of ToyLM") as e:
        apply_kv(ToyLM(uses_cache=False), KVConfig(2, "per-token"))
    assert "\n" not in str(e.value)
    with pytest.raises(UserError, match=r"ToyLM under kv2: ToyAttention computes attention itself"):
        apply_kv(ToyLM(), KVConfig(2))
    with pytest.raises(UserError, match=r"sinks of ToyLM in float"):
        apply_kv(ToyLM(), KVConfig(2, "per-token", keep_sinks=1))


@pytest.mark.parametrize("scheme, bits", [("per-token", 4), ("fp8-e4m3", 8)])
def test_grouped_query_cache_quantises_and_stores_the_key_value_heads(scheme, bits):
    """A grouped-query model's quantised KV cache holds its n_kv_head heads (a 24-wide head: per-token blocks of
    32 cross heads, so quantising repeated heads would be another computation), equal to its transformers twin
    (which quantises before repeat_kv) and, decoding, to the one-pass window."""
    from models.config import family_config
    from models.hf import to_hf_model
    from models.transformer import build
    from qbench.quant.kv import KVConfig, apply_kv

    config = family_config(
        "llama", n_layer=2, n_head=4, n_kv_head=2, d_model=96, d_ff=64, context=64, vocab_size=64
    )
    model = build(config, seed=1).eval()
    kv = KVConfig(bits, scheme)
    ours, theirs = apply_kv(model, kv), apply_kv(to_hf_model(model).eval(), kv)
    ids = torch.randint(0, 64, (1, 40), generator=torch.Generator().manual_seed(0))
    with torch.inference_mode():
        window = ours(ids)
        assert (window - theirs(ids).logits).abs().max() <= 1e-5
        assert (window - model(ids)).abs().max() > 1e-4  # the cache is quantised at all
        cache = ours.new_cache()
        ours(ids[:, :32], cache)
        steps = [ours(ids[:, i : i + 1], cache)[0, -1] for i in range(32, 40)]
    assert cache._k[0].shape[1] == 2 and cache._v[0].shape[1] == 2
    assert all((s - window[0, 32 + i]).abs().max() <= 1e-4 for i, s in enumerate(steps))
