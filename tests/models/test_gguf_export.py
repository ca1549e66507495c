"""The GGUF writer: read back by two independent readers (transformers' GGUF loader; llama.cpp where installed)
computing the model's own logits, its refusals, and its atomic write."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from models import build, preset_config
from models.errors import UserError
from models.gguf_export import _pairs_from_halves, write_gguf
from models.tokenizer import load_tokenizer

pytest.importorskip("gguf")


def tiny(family: str, **overrides):
    config = preset_config("tiny")
    if family == "llama":
        config = replace(config, family="llama", norm="rmsnorm", pos="rope", mlp="swiglu", bias=False)
    return build(replace(config, **overrides), seed=0).eval()


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer("bpe8192")


def logits(model, ids):
    with torch.no_grad():
        out = model(ids)
    out = getattr(out, "logits", out)
    return out[0] if isinstance(out, tuple) else out


def ids_for(model, n=12):
    vocab = model.config.vocab_size
    return torch.randint(0, vocab, (1, n), generator=torch.Generator().manual_seed(1))


def test_pairs_from_halves_is_the_rope_layout_change():
    # one head of width 4: rows (a0 a1 | b0 b1) rotate-half → consecutive pairs (a0 b0 a1 b1)
    w = torch.arange(8.0).reshape(4, 2)
    assert _pairs_from_halves(w, 1)[:, 0].tolist() == [0.0, 4.0, 2.0, 6.0]
    two_heads = torch.arange(8.0)[:, None]
    assert _pairs_from_halves(two_heads, 2)[:, 0].tolist() == [0, 2, 1, 3, 4, 6, 5, 7]


def test_llama_gguf_read_by_transformers_computes_the_same_logits(tmp_path, tokenizer):
    from qbench.eval.load import load_model

    model = tiny("llama")
    path = write_gguf(model, tmp_path / "m.gguf", tokenizer)
    loaded = load_model(str(path))  # transformers' reader undoes the pair layout: any mistake shows here
    ids = ids_for(model)
    torch.testing.assert_close(logits(loaded.model, ids), logits(model, ids), atol=1e-5, rtol=1e-5)
    text = "the cat sat on the mat"
    assert loaded.tokenizer(text).input_ids == tokenizer(text).input_ids


def test_gpt2_gguf_read_by_transformers_computes_the_same_logits(tmp_path, tokenizer):
    from transformers.activations import ACT2FN

    from models.hf import to_hf_model
    from qbench.eval.load import load_model

    model = tiny("gpt2", context=96)  # a context other than GPT-2's 1024: the reader's fix is exercised
    path = write_gguf(model, tmp_path / "m.gguf", tokenizer)
    loaded = load_model(str(path))
    # a GPT-2 GGUF means tanh-approximate GELU (llama.cpp's graph, transformers' reader): compare with ours
    # computed that way, then check that the exact-GELU model is only that approximation away
    reference = to_hf_model(model)
    for block in reference.transformer.h:
        block.mlp.act = ACT2FN["gelu_new"]
    ids = ids_for(model)
    got = logits(loaded.model, ids)
    torch.testing.assert_close(got, logits(reference, ids), atol=1e-5, rtol=1e-5)
    assert (got - logits(model, ids)).abs().max() < 5e-3


def test_metadata_and_tensors(tmp_path, tokenizer):
    import gguf

    model = tiny("llama", tie_embeddings=False)
    path = write_gguf(model, tmp_path / "m.gguf", tokenizer, name="tiny-llama")
    reader = gguf.GGUFReader(str(path))
    field = lambda key: reader.fields[key].contents()  # noqa: E731
    c = model.config
    assert field("general.architecture") == "llama" and field("general.name") == "tiny-llama"
    assert field("general.file_type") == gguf.LlamaFileType.ALL_F32
    assert field("llama.block_count") == c.n_layer and field("llama.attention.head_count_kv") == c.n_head
    assert field("llama.rope.freq_base") == pytest.approx(c.rope_theta)
    assert field("qbench.vocab") == "tokenizer" and field("tokenizer.ggml.pre") == "gpt-2"
    tokens = field("tokenizer.ggml.tokens")
    assert len(tokens) == c.vocab_size and tokens[tokenizer.eos_token_id] == tokenizer.eos_token
    names = {t.name for t in reader.tensors}
    assert "output.weight" in names and len(names) == 3 + 9 * c.n_layer  # untied head written
    assert {t.tensor_type for t in reader.tensors} == {gguf.GGMLQuantizationType.F32}


def test_refusals_are_one_line_and_leave_no_file(tmp_path, tokenizer):
    out = tmp_path / "m.gguf"
    with pytest.raises(UserError, match=r"softmax1 attention: llama\.cpp computes plain softmax"):
        write_gguf(tiny("gpt2", attn="softmax1"), out, tokenizer)
    with pytest.raises(UserError, match=r"no tokenizer.*byte-level BPE"):
        write_gguf(tiny("gpt2"), out, None)
    with pytest.raises(UserError, match="give a qbench or transformers model"):
        write_gguf(torch.nn.Linear(2, 2), out, tokenizer)
    assert list(tmp_path.iterdir()) == []


def test_placeholder_vocabulary_is_marked(tmp_path):
    import gguf

    path = write_gguf(tiny("gpt2"), tmp_path / "m.gguf", None, placeholder_vocab=True)
    reader = gguf.GGUFReader(str(path))
    assert reader.fields["qbench.vocab"].contents() == "placeholder"
    assert reader.fields["tokenizer.ggml.model"].contents() == "none"


# ----------------------------------------------------------------------------------------- llama.cpp itself


def _llama_cpp_logits(path, ids):
    import numpy as np

    llama_cpp = pytest.importorskip("llama_cpp")
    # float32 KV cache: llama.cpp's default float16 cache would add its own rounding to the comparison
    llm = llama_cpp.Llama(
        model_path=str(path),
        n_ctx=64,
        n_threads=1,
        logits_all=True,
        type_k=0,
        type_v=0,
        verbose=False,
    )
    try:
        llm.eval(ids[0].tolist())
        return torch.tensor(np.array(llm.scores[: ids.shape[1]]))
    finally:
        llm.close()


@pytest.mark.parametrize("family", ["llama", "gpt2"])
def test_llama_cpp_computes_the_models_logits(tmp_path, tokenizer, family):
    pytest.importorskip("llama_cpp")
    model = tiny(family)
    path = write_gguf(model, tmp_path / "m.gguf", tokenizer)
    ids = ids_for(model)
    got, want = _llama_cpp_logits(path, ids), logits(model, ids)[0]
    # llama: the same function (measured 1e-6 on `small`); gpt2: llama.cpp's tanh GELU (fp16 table) vs exact
    tol = 2e-5 if family == "llama" else 3e-3
    assert (got - want).abs().max() <= tol * max(1.0, want.abs().max().item())
