import itertools

import pytest
import torch

from models import UserError, build, family_config, observe, preset_config
from models.config import PRESETS, ModelConfig

from .conftest import micro

_GPT2_COMBINATIONS = list(
    itertools.product(
        ("softmax", "softmax1", "sink"),
        ("layernorm", "rmsnorm", "rmsnorm_single"),
        ("pre", "post"),
        ("learned", "rope", "none"),
        (True, False),
    )
)[::5]  # every 5th of the 108: all values of every switch appear, in varied company


@pytest.mark.parametrize(
    "family,attn,norm,norm_position,pos,bias",
    [
        *(("gpt2", *combo) for combo in _GPT2_COMBINATIONS),
        ("llama", "softmax1", "rmsnorm", "pre", "rope", False),
    ],
)
def test_every_switch_combination_builds_and_is_causal(family, attn, norm, norm_position, pos, bias):
    model = build(
        micro(family, attn=attn, norm=norm, norm_position=norm_position, pos=pos, bias=bias), seed=0
    )
    x = torch.randint(0, 97, (2, 24))
    logits = model(x)
    assert logits.shape == (2, 24, 97) and torch.isfinite(logits).all()
    x2 = x.clone()
    x2[:, 12:] = (x2[:, 12:] + 1) % 97
    torch.testing.assert_close(model(x2)[:, :12], logits[:, :12])  # the future cannot change the past


def test_switches_change_the_architecture():
    names = lambda cfg: set(dict(build(cfg).named_parameters()))  # noqa: E731
    assert not any("bias" in n for n in names(micro(bias=False)) if "sink" not in n)
    assert any("sink_k" in n for n in names(micro(attn="sink")))
    assert "transformer.wpe.weight" not in names(micro(pos="rope"))
    assert "transformer.ln_f.weight" not in names(micro(norm_position="post"))
    single = build(micro(norm="rmsnorm_single"))
    assert single.transformer.h[0].ln_1.weight.shape == (1,)
    llama = names(micro("llama"))
    assert {"transformer.h.0.attn.q_proj.weight", "transformer.h.0.mlp.gate_proj.weight"} <= llama


def test_tied_embeddings_share_storage():
    model = build(micro())
    assert model.lm_head.weight is model.transformer.wte.weight
    untied = build(micro(tie_embeddings=False))
    assert untied.lm_head.weight is not untied.transformer.wte.weight


def test_build_with_seed_is_reproducible_and_leaves_global_rng_alone():
    state = torch.random.get_rng_state()
    a, b = build(micro(), seed=3), build(micro(), seed=3)
    assert torch.equal(torch.random.get_rng_state(), state)
    assert all(torch.equal(p, q) for p, q in zip(a.parameters(), b.parameters(), strict=True))


def test_observe_records_block_outputs_and_attention_and_costs_nothing_when_off():
    model = build(micro(attn="softmax1"), seed=0)
    x = torch.randint(0, 97, (2, 24))
    plain = model(x)
    with observe(model, attention=True) as obs:
        observed = model(x)
    torch.testing.assert_close(observed, plain, atol=1e-5, rtol=1e-5)
    assert len(obs.hidden) == 2 and obs.hidden[0].shape == (2, 24, 32)
    assert len(obs.attention) == 2 and obs.attention[0].shape == (2, 4, 24, 24)
    assert (obs.attention[0].sum(-1) < 1).all()
    # After the context: no hooks left, fast path restored.
    assert all(not b._forward_hooks and b.attn.probs_hook is None for b in model.transformer.h)


def test_observed_hidden_state_is_block_output_not_final_norm():
    model = build(micro(), seed=0)
    x = torch.randint(0, 97, (1, 24))
    with observe(model) as obs:
        logits = model(x)
    torch.testing.assert_close(model.lm_head(model.transformer.ln_f(obs.hidden[-1])), logits)


def test_presets_are_registered_and_validated():
    assert {"tiny", "small", "gpt2-60m", "gpt2-130m", "gpt2-350m", "gpt2-1.4b", "llama2-130m"} <= set(PRESETS)
    assert 1e6 < build(preset_config("tiny")).num_parameters(embedding=False) < 4e6
    assert 8e6 < build(preset_config("small")).num_parameters(embedding=False) < 20e6
    with pytest.raises(UserError, match="did you mean 'tiny'"):
        preset_config("tiyn")
    with pytest.raises(UserError, match="softmax1"):
        preset_config("tiny", attn="softmax-one")
    with pytest.raises(UserError, match="divisible"):
        family_config("gpt2", d_model=30, n_head=4)
    with pytest.raises(UserError, match="unknown model config field"):
        ModelConfig().replace(layers=3)


def test_config_json_round_trip():
    cfg = preset_config("llama2-130m", attn="softmax1")
    assert ModelConfig.from_dict(cfg.to_dict()) == cfg


def test_context_overflow_is_an_error():
    with pytest.raises(ValueError, match="context"):
        build(micro())(torch.zeros(1, 25, dtype=torch.long))


@pytest.mark.parametrize("single_gain", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", [(1, 1, 576), (3, 37, 32), (2, 128, 768), (5, 1000)])
def test_rmsnorm_equals_its_formula_bit_for_bit(shape, dtype, single_gain):
    """RMSNorm runs on F.rms_norm for speed; what it must compute is the written-out formula, computed in float32
    and cast back (Llama's): x / sqrt(mean(x^2) + eps) * gain — exactly, so no stored result moves."""
    from models.transformer import RMSNorm

    torch.manual_seed(sum(shape))
    norm = RMSNorm(shape[-1], 1e-5, single_gain=single_gain).to(dtype)
    with torch.no_grad():
        norm.weight.copy_(torch.randn_like(norm.weight))
    x = (torch.randn(*shape) * 3).to(dtype)
    x32 = x.float()
    want = norm.weight * (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + 1e-5)).to(dtype)
    assert torch.equal(norm(x), want)


@pytest.mark.parametrize("kv", [None, 2])
def test_fused_projections_compute_the_same_function_on_a_copy(kv):
    from models.transformer import fuse_projections

    model = build(micro("llama", n_kv_head=kv, bias=True), seed=3).eval()
    fused = fuse_projections(model)
    attn, mlp = fused.transformer.h[0].attn, fused.transformer.h[0].mlp
    assert attn.qkv_proj.out_features == 32 + 2 * (kv or 4) * 8 and mlp.gate_up_proj.out_features == 2 * 64
    assert not hasattr(attn, "q_proj") and hasattr(model.transformer.h[0].attn, "q_proj")  # the original kept
    x = torch.randint(0, 97, (2, 24))
    with torch.inference_mode():
        assert torch.allclose(fused(x), model(x), rtol=0, atol=1e-5)
        cache = fused.new_cache()
        fused(x[:1, :20], cache)
        assert torch.allclose(fused(x[:1, 20:21], cache)[0, -1], model(x[:1])[0, 20], rtol=0, atol=1e-5)
    gpt2 = build(micro("gpt2"), seed=3)
    assert fuse_projections(gpt2).state_dict().keys() == gpt2.state_dict().keys()  # c_attn is fused already
