import json

import pytest
import torch

from models import UserError, build
from models.checkpoint import is_checkpoint, load_checkpoint, save_checkpoint
from models.tokenizer import load_tokenizer

from .conftest import micro


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer("bpe8192")


def small_vocab_config(**switches):
    return micro(**switches).replace(vocab_size=8192)


@pytest.mark.parametrize("switches", [{}, {"attn": "sink", "tie_embeddings": False}, {"pos": "rope"}])
def test_round_trip_is_bit_exact_and_keeps_ties(tmp_path, tokenizer, switches):
    model = build(small_vocab_config(**switches), seed=1)
    with torch.no_grad():  # non-default values everywhere, so a dropped tensor would show
        for p in model.parameters():
            p.add_(torch.randn_like(p))
    save_checkpoint(tmp_path, model, tokenizer, provenance={"training": {"steps": 3}})
    ckpt = load_checkpoint(tmp_path)
    a, b = model.state_dict(), ckpt.model.state_dict()
    assert a.keys() == b.keys()
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert (ckpt.model.lm_head.weight is ckpt.model.transformer.wte.weight) == model.config.tie_embeddings
    x = torch.randint(0, 8192, (1, 24))
    assert torch.equal(model.eval()(x), ckpt.model(x))
    assert ckpt.config == model.config
    assert ckpt.provenance["training"] == {"steps": 3} and "git_commit" in ckpt.provenance
    assert ckpt.tokenizer("Hello world")["input_ids"] == tokenizer("Hello world")["input_ids"]


def test_checkpoint_folder_contents_are_safetensors_and_json(tmp_path, tokenizer):
    save_checkpoint(tmp_path, build(small_vocab_config()), tokenizer)
    names = {p.name for p in tmp_path.iterdir()}
    assert {"config.json", "model.safetensors", "tokenizer.json"} <= names
    assert not any(n.endswith((".pt", ".bin", ".pkl", ".tmp")) for n in names)
    meta = json.loads((tmp_path / "config.json").read_text())
    assert meta["format"] == "qbench.checkpoint" and meta["tokenizer"]["vocab_size"] == len(tokenizer)
    assert is_checkpoint(tmp_path) and not is_checkpoint(tmp_path / "nope")


def test_missing_and_corrupt_files_are_named(tmp_path, tokenizer):
    save_checkpoint(tmp_path, build(small_vocab_config()), tokenizer)
    weights = tmp_path / "model.safetensors"
    data = weights.read_bytes()
    weights.write_bytes(data[:-10] + b"0123456789")
    with pytest.raises(UserError, match=r"model\.safetensors is corrupt"):
        load_checkpoint(tmp_path)
    weights.unlink()
    with pytest.raises(UserError, match=r"model\.safetensors is missing"):
        load_checkpoint(tmp_path)
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(UserError, match=r"config\.json is corrupt"):
        load_checkpoint(tmp_path)
    with pytest.raises(UserError, match="does not exist"):
        load_checkpoint(tmp_path / "absent")


def test_tokenizer_larger_than_vocabulary_is_refused(tmp_path, tokenizer):
    with pytest.raises(UserError, match="vocab_size is 97"):
        save_checkpoint(tmp_path, build(micro()), tokenizer)


def test_cuda_fp32_matmul_names_tf32_wherever_it_comes_from(monkeypatch):
    import torch

    from models.io import cuda_fp32_matmul

    for var in ("TORCH_ALLOW_TF32_CUBLAS_OVERRIDE", "NVIDIA_TF32_OVERRIDE"):
        monkeypatch.delenv(var, raising=False)
    assert cuda_fp32_matmul() == "ieee"  # torch's default
    matmul, before = torch.backends.cuda.matmul, torch.backends.cuda.matmul.fp32_precision
    try:
        matmul.fp32_precision = "tf32"  # torch's own switch (not an attribute monkeypatch can restore)
        assert cuda_fp32_matmul() == "tf32"
    finally:
        matmul.fp32_precision = before
    assert cuda_fp32_matmul() == "ieee"
    monkeypatch.setenv(
        "TORCH_ALLOW_TF32_CUBLAS_OVERRIDE", "1"
    )  # NVIDIA's containers: torch's flag is overridden
    assert cuda_fp32_matmul() == "tf32"
    monkeypatch.setenv("NVIDIA_TF32_OVERRIDE", "0")  # cuBLAS itself refuses TF32
    assert cuda_fp32_matmul() == "ieee"


@pytest.mark.parametrize("switches", [{}, {"pos": "rope", "tie_embeddings": False}])
def test_a_dtype_cast_while_reading_equals_a_cast_after_loading(tmp_path, tokenizer, switches):
    """Loading in bfloat16 casts each tensor as it is read (peak: the bf16 model and one float32 tensor); the model
    is the float32 load cast, tensor for tensor, ties kept."""
    model = build(small_vocab_config(**switches), seed=2)
    save_checkpoint(tmp_path, model, tokenizer, provenance={"training": None})
    direct = load_checkpoint(tmp_path, dtype=torch.bfloat16).model
    cast = load_checkpoint(tmp_path).model.to(torch.bfloat16)
    a, b = direct.state_dict(), cast.state_dict()
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) and a[k].dtype == b[k].dtype for k in a)
    assert (direct.lm_head.weight is direct.transformer.wte.weight) == model.config.tie_embeddings
