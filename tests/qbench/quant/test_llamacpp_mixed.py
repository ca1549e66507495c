"""Mixed llama.cpp files (``gguf:f16:ffn_down=q6_k,…``): each named tensor in its own ggml type, written by
llama.cpp's own per-tensor quantiser, scored by llama.cpp like any cell."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from models.errors import UserError
from qbench.quant.gguf_types import TENSOR_TYPES, key_matches, parse_tensor_spec, tensor_type_bits
from qbench.quant.schemes import get_scheme
from tests.qbench.quant.test_llamacpp_cells import _grid  # the same small grid as the type cells


def test_the_tensor_types_are_ggmls_own_numbers_and_sizes():
    gguf = pytest.importorskip("gguf")
    for name, t in TENSOR_TYPES.items():
        q = gguf.GGMLQuantizationType[name]
        assert int(q) == t.ggml and gguf.GGML_QUANT_SIZES[q] == (t.block, t.block_bytes), name
    assert (
        tensor_type_bits("Q4_K") == 4.5 and tensor_type_bits("Q8_0") == 8.5 and tensor_type_bits("F16") == 16
    )


def test_keys_name_kinds_blocks_single_tensors_and_the_embeddings():
    name = "blk.3.ffn_down.weight"
    assert (
        key_matches("ffn_down", name) and key_matches("blk.3", name) and key_matches("blk.3.ffn_down", name)
    )
    assert not key_matches("blk.30", name) and not key_matches("blk.3.ffn_up", name)
    assert not key_matches("ffn_up", name) and not key_matches("blk.1", "blk.10.attn_q.weight")
    assert key_matches("token_embd", "token_embd.weight") and key_matches("output", "output.weight")
    assert not key_matches("output", "output_norm.weight")
    assert parse_tensor_spec("ffn_down=Q6_K, attn_q=q4_0") == (("attn_q", "Q4_0"), ("ffn_down", "Q6_K"))


def test_a_mixed_scheme_is_canonical_and_its_mistakes_are_one_line():
    a = get_scheme("gguf:F16:ffn_down=Q6_K,attn_q=q4_0")
    b = get_scheme("gguf:f16:attn_q=Q4_0,ffn_down=q6_k")
    assert a == b and a.name == "gguf:f16:attn_q=q4_0,ffn_down=q6_k" and a.label == "llama.cpp-F16-mix"
    assert a.params == {"type": "F16", "tensors": {"attn_q": "Q4_0", "ffn_down": "Q6_K"}}
    assert get_scheme(a.to_dict()) == a
    assert get_scheme("gguf:q4_k_m").params == {"type": "Q4_K_M"}  # plain types keep their identity
    assert get_scheme("gguf:f32:token_embd=q8_0").quantize_lm_head  # tied: the embedding is the head
    for bad, message in [
        ("gguf:q4_0:ffn_down=q6_k", "take no overrides.*float base"),
        ("gguf:f16:ffn_dwn=q6_k", r"unknown tensor key 'ffn_dwn' \(did you mean 'ffn_down'\?\)"),
        ("gguf:f16:ffn_down=q4_k_m", r"unknown llama.cpp tensor type 'Q4_K_M' \(did you mean 'Q4_K'\?\)"),
        ("gguf:f16:ffn_down", "write key=type pairs"),
        ("gguf:f16:blk.x=q4_0", "blk.N"),
        ("gguf:f16:ffn_down=q4_0,ffn_down=q8_0", "twice"),
    ]:
        with pytest.raises(UserError, match=message) as e:
            get_scheme(bad)
        assert "\n" not in str(e.value)


@pytest.fixture(scope="module")
def wide_llama():
    """A Llama whose rows take the k-quants (256 wide), its MLP input 512."""
    from models import build
    from models.config import family_config

    cfg = family_config("llama", n_layer=2, n_head=4, d_model=256, d_ff=512, context=64, vocab_size=8192)
    model = build(cfg, seed=0).eval()
    with torch.no_grad():
        model.transformer.wte.weight[:, 5] += 3.0
    return model


@pytest.fixture(scope="module")
def wide_ckpt(tmp_path_factory, wide_llama, tokenizer):
    from models.checkpoint import save_checkpoint

    path = tmp_path_factory.mktemp("mixed") / "wide-llama"
    save_checkpoint(path, wide_llama, tokenizer, provenance={"training": None})
    return path


@pytest.mark.parametrize("file_type", ["Q4_K_S", "Q2_K", "Q8_0", "IQ4_NL"])
def test_each_tensor_is_written_as_llama_model_quantize_writes_it(tmp_path, wide_llama, file_type):
    """qbench's per-tensor quantiser is llama.cpp's own: the bytes of every quantised tensor of a file
    ``llama_model_quantize`` wrote equal ``quantize_tensor`` of the same float tensor, type by type."""
    gguf = pytest.importorskip("gguf")
    pytest.importorskip("llama_cpp")
    from models.gguf_export import write_gguf
    from qbench.quant.llamacpp import quantize_gguf, quantize_tensor

    f32 = write_gguf(wide_llama, tmp_path / "f32.gguf", None, placeholder_vocab=True)
    q = quantize_gguf(f32, tmp_path / "q.gguf", file_type, 2)
    floats = {t.name: np.array(t.data) for t in gguf.GGUFReader(str(f32)).tensors}
    seen = set()
    for t in gguf.GGUFReader(str(q)).tensors:
        if t.tensor_type.name == "F32":
            continue
        mine = quantize_tensor(torch.from_numpy(floats[t.name]), t.tensor_type.name, t.name)
        assert np.array_equal(np.array(t.data).reshape(mine.shape), mine), (t.name, t.tensor_type.name)
        seen.add(t.tensor_type.name)
    assert seen  # the file held quantised tensors


@pytest.mark.parametrize("type_name", ["Q8_0", "Q5_0", "Q5_1", "Q4_0", "Q4_1"])
def test_legacy_types_equal_gguf_pys_numpy_reference(type_name):
    """gguf-py's quantisers are an independent implementation of ggml's reference (numpy, from ggml-quants.c)."""
    gguf = pytest.importorskip("gguf")
    pytest.importorskip("llama_cpp")
    from qbench.quant.llamacpp import quantize_tensor

    w = torch.randn(48, 256, generator=torch.Generator().manual_seed(1))
    w[3, 7] = 40.0  # an outlier inside one block
    ref = gguf.quants.quantize(w.numpy(), gguf.GGMLQuantizationType[type_name])
    assert np.array_equal(quantize_tensor(w, type_name), ref)


@pytest.mark.parametrize("type_name", ["Q6_K", "Q5_K", "Q4_K", "Q3_K", "Q2_K", "IQ4_NL", "IQ4_XS"])
def test_k_quants_read_back_by_gguf_py_are_the_weights_to_their_precision(type_name):
    """The k-quants have no reference quantiser outside ggml; gguf-py's dequantiser reads them back, and the error
    falls with the bits (RMS relative to the weights' RMS below 2^-(bits-1.5))."""
    gguf = pytest.importorskip("gguf")
    pytest.importorskip("llama_cpp")
    from qbench.quant.llamacpp import quantize_tensor

    w = torch.randn(32, 512, generator=torch.Generator().manual_seed(2))
    data = quantize_tensor(w, type_name)
    back = gguf.quants.dequantize(data, gguf.GGMLQuantizationType[type_name]).reshape(w.shape)
    rel = float(np.sqrt(((back - w.numpy()) ** 2).mean()) / np.sqrt((w.numpy() ** 2).mean()))
    bits = tensor_type_bits(type_name)
    assert rel < 2.0 ** -(bits - 2.5), (type_name, rel)
    assert data.nbytes == 32 * 512 * bits / 8


def test_rows_that_are_not_whole_blocks_are_refused_naming_what_fits():
    pytest.importorskip("llama_cpp")
    from qbench.quant.llamacpp import quantize_tensor

    with pytest.raises(
        UserError, match=r"blk.0.attn_q.weight: rows of 576 .* 256 \(Q4_K\); types that fit:.*Q8_0"
    ):
        quantize_tensor(torch.zeros(4, 576), "Q4_K", "blk.0.attn_q.weight")


def test_a_mixed_cell_is_what_its_file_holds(tmp_path, wide_ckpt):
    """All tensors named F32 is the float32 file itself (the same perplexity as gguf:f32, bit for bit); one kind
    in Q4_K leaves every other tensor float and the record lists the types written; a key that names no tensor
    is an error, not a float file labelled as quantised."""
    pytest.importorskip("llama_cpp")
    pytest.importorskip("gguf")
    records = _grid(
        tmp_path,
        wide_ckpt,
        [
            "gguf:f32",
            "gguf:f32:ffn_down=f32",
            "gguf:f32:ffn_down=q4_k",
            "gguf:f16:blk.1=q8_0",
            "gguf:f32:attn_qkv=q8_0",
        ],
    )
    f32, same = records["gguf:f32"], records["gguf:f32:ffn_down=f32"]
    assert same["status"] == "ok" and same["metrics"]["perplexity"] == f32["metrics"]["perplexity"]
    down = records["gguf:f32:ffn_down=q4_k"]
    assert down["artifact"]["tensor_types"] == {"F32": f32["artifact"]["tensor_types"]["F32"] - 2, "Q4_K": 2}
    assert down["artifact"]["file_type"] == "GUESSED" and down["metrics"]["kld_mean"] > 0
    blk = records["gguf:f16:blk.1=q8_0"]["artifact"]["tensor_types"]
    assert blk["Q8_0"] == 7 and blk["F16"] == 7 + 2  # block 0's seven linears and the embedding and head
    bad = records["gguf:f32:attn_qkv=q8_0"]
    assert bad["status"] == "unsupported" and "attn_qkv names no tensor" in bad["error"]


def test_a_long_scheme_names_a_record_file_the_file_system_takes():
    """A plan by block names every block: its record file keeps a readable head and a hash of the whole name, so
    it stays under 255 bytes with its mode, identity and sidecar suffixes, and two plans never share a file."""
    from pathlib import Path

    from qbench.eval.harness import record_path

    a = "gguf:f32:" + ",".join(f"blk.{i}=q4_k" for i in range(40))
    b = a.replace("blk.39=q4_k", "blk.39=q8_0")
    pa, pb = record_path(Path("out"), "m", a, "real"), record_path(Path("out"), "m", b, "real")
    assert pa != pb and pa == record_path(Path("out"), "m", a, "real")
    longest = f"{pa.stem}.{'0' * 16}.tokens.safetensors"  # an identity beside it, and its sidecar
    assert len(longest.encode()) < 255 and pa.name.startswith("gguf@f32@blk.0=q4_k")
    short = "gguf:f32:ffn_down=q8_0"
    assert record_path(Path("out"), "m", short, "real").name == "gguf@f32@ffn_down=q8_0__real.json"


def test_a_file_with_float_linears_beside_quantised_ones_is_a_mix(tmp_path, wide_llama):
    """Its file type says GUESSED (a mix), not MOSTLY_Q8_0, when some linears stay float32."""
    gguf = pytest.importorskip("gguf")
    pytest.importorskip("llama_cpp")
    from models.gguf_export import write_gguf
    from qbench.quant.llamacpp import mixed_quantizer

    quantize, _ = mixed_quantizer({"ffn_down": "Q8_0"}, "F32")
    path = write_gguf(wide_llama, tmp_path / "m.gguf", None, placeholder_vocab=True, quantize=quantize)
    field = gguf.GGUFReader(str(path)).fields["general.file_type"]
    assert int(field.parts[-1][0]) == int(gguf.LlamaFileType.GUESSED)
    quantize, _ = mixed_quantizer(
        {k: "Q8_0" for k in ("attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down")},
        "F32",
    )
    path = write_gguf(wide_llama, tmp_path / "all.gguf", None, placeholder_vocab=True, quantize=quantize)
    field = gguf.GGUFReader(str(path)).fields["general.file_type"]
    assert int(field.parts[-1][0]) == int(
        gguf.LlamaFileType.MOSTLY_Q8_0
    )  # every linear Q8_0, embeddings float
