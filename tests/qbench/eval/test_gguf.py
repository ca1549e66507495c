"""GGUF files as --ckpt: a tiny Llama GGUF written here with the ``gguf`` package, Q8_0 linear weights."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from models import UserError
from qbench.eval.load import load_model
from tests.qbench.conftest import micro_config, trained_like

gguf = pytest.importorskip("gguf")

TEXT = "The state of the union is strong; the Senate and the House, 1790-2026."


def _permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp's q/k row order (convert_hf_to_gguf.py ``LlamaModel.permute``); transformers undoes it on load."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def write_llama_gguf(path, model, tokenizer, arch: str = "llama") -> dict[str, np.ndarray]:
    """Write ``model`` (a transformers Llama) as llama.cpp does: matrices Q8_0, the rest F32, GPT-2-style BPE.

    Returns the float weights transformers should read back: dequantize(quantize(W)) per HF name.
    """
    cfg = model.config
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_context_length(cfg.max_position_embeddings)
    writer.add_embedding_length(cfg.hidden_size)
    writer.add_block_count(cfg.num_hidden_layers)
    writer.add_feed_forward_length(cfg.intermediate_size)
    writer.add_head_count(cfg.num_attention_heads)
    writer.add_head_count_kv(cfg.num_key_value_heads)
    writer.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    writer.add_rope_freq_base(float(cfg.rope_parameters["rope_theta"]))
    writer.add_file_type(gguf.LlamaFileType.MOSTLY_Q8_0)
    tokens = [t for t, _ in sorted(tokenizer.get_vocab().items(), key=lambda kv: kv[1])]
    writer.add_tokenizer_model("gpt2")
    writer.add_token_list(tokens)
    merges = (
        tokenizer.backend_tokenizer.model.get_merges()
        if hasattr(tokenizer.backend_tokenizer.model, "get_merges")
        else None
    )
    if merges is None:
        import json

        merges = json.loads(tokenizer.backend_tokenizer.to_str())["model"]["merges"]
    writer.add_token_merges([m if isinstance(m, str) else " ".join(m) for m in merges])
    special = set(tokenizer.all_special_tokens)
    writer.add_token_types(
        [gguf.TokenType.CONTROL if t in special else gguf.TokenType.NORMAL for t in tokens]
    )
    writer.add_bos_token_id(tokenizer.convert_tokens_to_ids("<|endoftext|>"))
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.LLAMA, cfg.num_hidden_layers)
    expected = {}
    for hf_name, tensor in model.state_dict().items():
        base, suffix = hf_name.rsplit(".", 1)
        w = tensor.float().numpy()
        if "q_proj" in hf_name or "k_proj" in hf_name:
            w = _permute(w, cfg.num_attention_heads)
        if w.ndim == 2 and "embed_tokens" not in hf_name:
            q = gguf.quants.quantize(w, gguf.GGMLQuantizationType.Q8_0)
            writer.add_tensor(
                f"{names.get_name(base)}.{suffix}",
                q,
                raw_shape=q.shape,
                raw_dtype=gguf.GGMLQuantizationType.Q8_0,
            )
            w = gguf.quants.dequantize(q, gguf.GGMLQuantizationType.Q8_0)
        else:
            writer.add_tensor(f"{names.get_name(base)}.{suffix}", w)
        if "q_proj" in hf_name or "k_proj" in hf_name:  # the inverse permutation, written independently
            n = cfg.num_attention_heads
            w = w.reshape(n, w.shape[0] // n // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)
        expected[hf_name] = w
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return expected


@pytest.fixture(scope="module")
def gguf_file(tmp_path_factory, tokenizer):
    from models.hf import to_hf_model

    model = to_hf_model(trained_like(micro_config("llama")), tokenizer).eval()
    path = tmp_path_factory.mktemp("gguf") / "micro-llama-q8_0.gguf"
    expected = write_llama_gguf(path, model, tokenizer)
    return path, expected, model


def test_a_gguf_file_loads_dequantised_with_its_own_tokenizer(gguf_file, tokenizer):
    path, expected, _ = gguf_file
    lm = load_model(str(path))
    assert lm.description["kind"] == "gguf" and lm.description["model_type"] == "llama"
    summary = lm.description["gguf"]
    matrices = sum(1 for name, w in expected.items() if w.ndim == 2 and "embed_tokens" not in name)
    assert summary["tensor_types"] == {"F32": len(expected) - matrices, "Q8_0": matrices}
    assert summary["file_type"] == "MOSTLY_Q8_0" and summary["architecture"] == "llama"
    state = lm.model.state_dict()
    for name, w in expected.items():  # the file's Q8_0 grid, dequantised exactly (q/k un-permuted)
        assert torch.equal(state[name], torch.from_numpy(np.ascontiguousarray(w))), name
    assert lm.tokenizer(TEXT)["input_ids"] == tokenizer(TEXT)["input_ids"]
    assert load_model(str(path.parent)).description["fingerprint"] == lm.description["fingerprint"]  # folder


def test_gguf_cells_evaluate_and_record_the_files_types(gguf_file, tmp_path):
    from qbench.eval.harness import GridSpec, run_grid
    from qbench.eval.metrics import Protocol

    path, _, _ = gguf_file
    spec = GridSpec(
        models=[str(path)],
        schemes=["absmax-fine"],
        protocol=Protocol(tokens=300, batch_size=4, outlier_windows=1),
        output_path=tmp_path,
        attention=False,
    )
    _, cell = run_grid(spec)
    assert cell["status"] == "ok" and cell["model"]["gguf"]["tensor_types"]["Q8_0"] > 0
    assert cell["metrics"]["perplexity"] > 1


def test_an_architecture_transformers_cannot_read_is_one_line(tmp_path, tokenizer):
    from models.hf import to_hf_model

    model = to_hf_model(trained_like(micro_config("llama")), tokenizer).eval()
    path = tmp_path / "odd.gguf"
    write_llama_gguf(path, model, tokenizer, arch="qbench-unknown")
    with pytest.raises(UserError, match="GGUF architecture 'qbench-unknown'") as err:
        load_model(str(path))
    assert "\n" not in str(err.value)


def test_a_folder_with_two_ggufs_asks_which(tmp_path):
    (tmp_path / "a.gguf").write_bytes(b"")
    (tmp_path / "b.gguf").write_bytes(b"")
    with pytest.raises(UserError, match="holds 2 GGUF files"):
        load_model(str(tmp_path))


def test_a_card_of_a_gguf_file(gguf_file, tmp_path, monkeypatch):
    from dataclasses import replace

    from qbench.studies import card

    small = replace(card.BUDGETS["quick"], formats=("absmax-fine",), kv_rows=(card.KVRow("kivi", 2),))
    monkeypatch.setitem(card.BUDGETS, "quick", small)
    path, _, _ = gguf_file
    result = card.run_card(
        card.CardConfig(models=[str(path)], output_path=tmp_path, tokens=64, tolerance=50.0)
    )
    (model,) = result["models"]
    assert model["identity"]["kind"] == "gguf" and model["identity"]["gguf"]["tensor_types"]["Q8_0"] > 0
    assert model["identity"]["positions"] == "rope" and model["formats"][0]["status"] == "ok"
    text = (tmp_path / "card.md").read_text()
    assert "GGUF tensors" in text and "penalises rotations" in text  # Q8_0 blocks: the grid caveat is stated
