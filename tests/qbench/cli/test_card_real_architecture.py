"""The whole quick card, repair included, on a real architecture in its own transformers folder — the path a user's
SmolLM2 folder takes — scored on the user's own text without a start token.

The model is transformers' own ``LlamaForCausalLM`` built from a config as SmolLM2's (grouped-query attention,
tied embeddings, RoPE, SwiGLU, RMSNorm), two layers wide enough to be quick, with an outlier planted in block 1's
``down_proj`` input so formats fail and the repair has work. The logits budget is cut so that, as with SmolLM2's
49,152-token vocabulary, a scored batch holds fewer windows than ``--batch-size`` — the case that stopped the
repair of a real model with "batch 0 is not the batch whose hidden states were stored".
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest
import torch

from qbench.cli import main


@pytest.fixture(scope="module")
def llama_folder(tmp_path_factory, tokenizer) -> Path:
    from transformers import LlamaConfig, LlamaForCausalLM

    eot = tokenizer.convert_tokens_to_ids("<|endoftext|>")
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,  # grouped-query attention, as SmolLM2's 9 query / 3 key-value heads
        max_position_embeddings=128,
        tie_word_embeddings=True,
        bos_token_id=eot,
        eos_token_id=eot,
    )
    torch.manual_seed(0)
    model = LlamaForCausalLM(config).eval()
    with torch.no_grad():  # the same function, an outlier channel into down_proj (tests/qbench/conftest.py)
        mlp = model.model.layers[1].mlp
        mlp.up_proj.weight[7] *= 1000.0
        mlp.down_proj.weight[:, 7] /= 1000.0
        mlp.down_proj.weight *= 20.0
        model.model.embed_tokens.weight *= 20.0  # tied: the head too, so the loss depends on the blocks
    path = tmp_path_factory.mktemp("real-arch") / "tiny-llama"
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def user_text(tmp_path_factory) -> Path:
    """Text of the user's own: the project's docs, documents split at blank lines."""
    root = Path(__file__).resolve().parents[3]
    text = "\n\n".join(p.read_text(encoding="utf-8") for p in sorted((root / "docs").glob("*.md")))
    path = tmp_path_factory.mktemp("text") / "mine.txt"
    path.write_text(text, encoding="utf-8")
    return path


def test_the_quick_card_with_its_repair_finishes_on_a_transformers_folder(
    llama_folder, user_text, tmp_path, monkeypatch, capsys
):
    from qbench.eval import metrics

    monkeypatch.setattr(
        metrics, "LOGITS_BUDGET", 1
    )  # one window a pass: SmolLM2's batches, not --batch-size's
    out = tmp_path / "card"
    argv = ["card", "--ckpt", str(llama_folder), "--budget", "quick", "--data", str(user_text), "--no-bos"]
    start = time.perf_counter()
    code = main([*argv, "--tokens", "1024", "--output-path", str(out)])
    seconds = time.perf_counter() - start
    text = capsys.readouterr()
    assert code == 0, text.err
    card = json.loads((out / "card.json").read_text())
    (model,) = card["models"]
    assert model["protocol"]["bos"] is False and Path(model["protocol"]["corpus"]).name == "mine.txt"
    repair = model["sensitivity"]["repair"]
    assert (
        repair["count"] >= 1 and repair["reached"] and repair["ppl_change_ci95"][1] <= 1.0
    )  # measured within
    assert "Repair of" in (out / "card.md").read_text()
    assert "peak memory" in text.out
    records = [json.loads(p.read_text()) for p in out.rglob("*__fake.json")]
    assert records and not any("replay_fallback" in r for r in records)
    assert seconds < 300, f"the quick card of a two-layer model took {seconds:.0f} s"
