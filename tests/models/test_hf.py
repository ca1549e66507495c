import json
import subprocess
import sys

import pytest
import torch

from models import UserError, build
from models.checkpoint import save_checkpoint
from models.hf import export_to_hf, to_hf_model
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
