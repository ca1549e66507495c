import json
import subprocess
import sys

import pytest
import torch

from models import UserError, build
from models.checkpoint import save_checkpoint
from models.hf import export_to_hf, from_hf_model, hf_config_to_ours, to_hf_model
from models.tokenizer import load_tokenizer

from .conftest import micro


def _perturbed(config):
    model = build(config, seed=2)
    with torch.no_grad():  # norms and biases away from their init so a wrong mapping shows
        for name, p in model.named_parameters():
            if "ln" in name or name.endswith("bias") or "wpe" in name:
                p.add_(0.1 * torch.randn_like(p))
    return model.eval()


@pytest.mark.parametrize(
    "config",
    [
        micro("gpt2", attn="softmax1"),
        micro("gpt2", attn="softmax", bias=False, pos="none", tie_embeddings=False),
        micro("llama", attn="softmax1", norm="rmsnorm_single"),
        micro("llama", attn="softmax", bias=True, tie_embeddings=True),
    ],
    ids=["gpt2-softmax1", "gpt2-nobias-nopos", "llama-softmax1-rmsS", "llama-bias-tied"],
)
def test_transformers_model_reproduces_our_logits(config):
    model = _perturbed(config)
    hf = to_hf_model(model)
    x = torch.randint(0, config.vocab_size, (2, config.context))
    assert (hf(x).logits - model(x)).abs().max() <= 1e-4


def test_softmax1_in_transformers_stays_causal_and_differs_from_softmax():
    model = _perturbed(micro("llama", attn="softmax1"))
    hf = to_hf_model(model)
    x = torch.randint(0, 97, (1, 24))
    y = x.clone()
    y[:, 12:] = (y[:, 12:] + 1) % 97
    torch.testing.assert_close(hf(x).logits[:, :12], hf(y).logits[:, :12])
    plain = to_hf_model(build(micro("llama", attn="softmax"), seed=0))
    plain.load_state_dict(hf.state_dict())
    assert (plain(x).logits - hf(x).logits).abs().max() > 1e-3


@pytest.mark.parametrize("switch", [{"attn": "sink"}, {"norm_position": "post"}, {"norm": "rmsnorm"}])
def test_inexpressible_switches_are_a_clear_error(switch):
    with pytest.raises(UserError, match="cannot export to GPT2LMHeadModel"):
        to_hf_model(build(micro("gpt2", **switch)))


def test_exported_folder_loads_offline_in_a_fresh_process(tmp_path):
    config = micro("gpt2", attn="softmax1").replace(vocab_size=8192)
    model = _perturbed(config)
    save_checkpoint(tmp_path / "ckpt", model, load_tokenizer("bpe8192"))
    out = export_to_hf(tmp_path / "ckpt", tmp_path / "hf")
    assert json.loads((out / "config.json").read_text())["attn_implementation"] == "softmax1"
    x = torch.randint(0, 8192, (1, 24))
    torch.save({"x": x, "logits": model(x)}, tmp_path / "io.pt")
    script = f"""
import torch, qbench
from transformers import AutoModelForCausalLM, AutoTokenizer
io = torch.load({str(tmp_path / "io.pt")!r}, weights_only=True)
hf = AutoModelForCausalLM.from_pretrained({str(out)!r})
assert hf.config._attn_implementation == "softmax1", hf.config._attn_implementation
assert (hf(io["x"]).logits - io["logits"]).abs().max() <= 1e-4
assert AutoTokenizer.from_pretrained({str(out)!r})("Hello world")["input_ids"]
print("ok")
"""
    result = subprocess.run(
        [sys.executable, "-c", script],
        capture_output=True,
        text=True,
        env={"HF_HUB_OFFLINE": "1", "PATH": ""},
        timeout=120,
    )
    assert result.stdout.strip().endswith("ok"), result.stderr[-2000:]


def test_softmax1_attention_functions_handle_grouped_query_attention():
    from models.hf import softmax1_attention, softmax1_eager_attention

    module = torch.nn.Module().eval()
    q = torch.randn(1, 4, 5, 8)
    k, v = torch.randn(1, 2, 5, 8), torch.randn(1, 2, 5, 8)
    mask = torch.zeros(1, 1, 5, 5).masked_fill(~torch.ones(5, 5, dtype=torch.bool).tril(), float("-inf"))
    k4, v4 = k.repeat_interleave(2, dim=1), v.repeat_interleave(2, dim=1)
    fast, _ = softmax1_attention(module, q, k, v, mask)
    eager, probs = softmax1_eager_attention(module, q, k, v, mask)
    torch.testing.assert_close(fast, softmax1_attention(module, q, k4, v4, mask)[0])
    torch.testing.assert_close(fast, eager, atol=1e-5, rtol=1e-5)
    assert (probs.sum(-1) < 1).all()


# ------------------------------------------------------------------------- grouped-query attention, import


@pytest.mark.parametrize("tie", [True, False])
def test_grouped_query_attention_exports_and_imports_with_equal_logits(tie):
    """n_kv_head = 2 of 4 heads: transformers' repeat_kv grouping (query head h reads key/value head h // 2) is
    ours; the exported model gives our logits, and importing it back gives a model equal to the first."""
    config = micro("llama", n_kv_head=2, tie_embeddings=tie, bias=not tie)
    model = _perturbed(config)
    assert model.transformer.h[0].attn.k_proj.weight.shape == (16, 32)  # 2 heads of 8
    x = torch.randint(0, config.vocab_size, (2, config.context))
    hf = to_hf_model(model)
    assert hf.config.num_key_value_heads == 2
    with torch.no_grad():
        assert (hf(x).logits - model(x)).abs().max() <= 1e-4
    back = from_hf_model(hf, check=x)
    assert back.config == config
    for name, t in model.state_dict().items():
        assert torch.equal(back.state_dict()[name], t), name
    assert (back.lm_head.weight is back.transformer.wte.weight) == tie


@pytest.mark.parametrize("attn", ["softmax1", "sink-logit", "clipped"])
def test_grouped_query_attention_with_the_remedies_matches_transformers(attn):
    """The remedies' paths repeat the grouped heads (ours) or read them through repeat_kv (the exported
    attention functions): the same function, prefill and decode."""
    config = micro("llama", n_kv_head=2, attn=attn)
    model = _perturbed(config)
    x = torch.randint(0, config.vocab_size, (1, config.context))
    with torch.no_grad():
        assert (to_hf_model(model)(x).logits - model(x)).abs().max() <= 1e-4
    with torch.inference_mode():
        cache = model.new_cache()
        model(x[:, :10], cache)
        step = model(x[:, 10:11], cache)
        assert (step[0, -1] - model(x)[0, 10]).abs().max() <= 1e-5


def test_grouped_cache_holds_the_key_value_heads_and_decodes_as_the_full_forward():
    config = micro("llama", n_kv_head=1)
    model = _perturbed(config)
    x = torch.randint(0, config.vocab_size, (1, 12))
    with torch.inference_mode():
        full = model(x)
        cache = model.new_cache()
        model(x[:, :8], cache)
        steps = [model(x[:, i : i + 1], cache) for i in range(8, 12)]
    assert cache._k[0].shape[1] == 1  # one key/value head stored, repeated to the four query heads on read
    assert all((s[0, -1] - full[0, 8 + i]).abs().max() <= 1e-5 for i, s in enumerate(steps))


def test_grouping_errors_are_one_line():
    with pytest.raises(UserError, match="n_kv_head=3 must be a positive integer dividing n_head=4"):
        micro("llama", n_kv_head=3)
    with pytest.raises(UserError, match="needs the llama family"):
        micro("gpt2", n_kv_head=2)
    assert "n_kv_head" not in micro("llama").to_dict()  # configs without grouping serialise as before
    assert micro("llama", n_kv_head=2).to_dict()["n_kv_head"] == 2
    with pytest.raises(UserError, match="output gate with grouped-query attention"):
        to_hf_model(build(micro("llama", n_kv_head=2, gate="headwise")))


def test_import_refuses_what_has_no_equivalent():
    from transformers import GPT2Config, LlamaConfig

    with pytest.raises(UserError, match="only LlamaForCausalLM models convert"):
        hf_config_to_ours(GPT2Config())
    scaled = LlamaConfig(num_hidden_layers=1, rope_scaling={"rope_type": "linear", "factor": 2.0})
    with pytest.raises(UserError, match="scaled RoPE"):
        hf_config_to_ours(scaled)
    with pytest.raises(UserError, match="hidden_act 'gelu'"):
        hf_config_to_ours(LlamaConfig(num_hidden_layers=1, hidden_act="gelu"))
    # an exported softmax-1 (or other remedy) Llama: its attention function has no plain-softmax equivalent
    exported = to_hf_model(build(micro("llama", attn="softmax1")))
    with pytest.raises(UserError, match="attention implementation 'softmax1'"):
        from_hf_model(exported)
