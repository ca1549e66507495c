"""llama.cpp's file types as evaluated cells (``--scheme gguf:q4_k_m``): quantised and scored by llama.cpp on the
harness's windows, paired with qbench's float cell like every other cell."""

from __future__ import annotations

import json

import pytest
import torch

from models.errors import UserError
from qbench.eval.harness import GridSpec, expand_schemes, run_grid
from qbench.eval.metrics import Protocol
from qbench.quant.gguf_types import GGUF_TYPES
from qbench.quant.schemes import GGUF_SCHEMES, SCHEMES, get_scheme
from tests.qbench.conftest import micro_config, trained_like

SMALL = Protocol(tokens=32 * 8, batch_size=4, outlier_windows=2)


# ------------------------------------------------------------------------------------------ the registry


def test_the_types_are_llama_cpps_own_numbers():
    llama_cpp = pytest.importorskip("llama_cpp")
    for name, t in GGUF_TYPES.items():
        prefix = "LLAMA_FTYPE_ALL_" if name == "F32" else "LLAMA_FTYPE_MOSTLY_"
        assert getattr(llama_cpp, prefix + name) == t.ftype, name


def test_gguf_schemes_are_named_by_type_and_take_no_overrides():
    scheme = get_scheme("gguf:Q4_K_M")
    assert scheme.name == "gguf:q4_k_m" and scheme.method == "gguf" and scheme.param("type") == "Q4_K_M"
    assert scheme.label == "llama.cpp-Q4_K_M" and scheme.weight_bits == 4 and not scheme.weight_symmetric
    assert get_scheme(scheme.to_dict()) == scheme
    for bad, message in [
        ("gguf:q4_km", r"unknown llama.cpp file type 'Q4_KM' \(did you mean 'Q4_K_M'\?\)"),
        ("gguf:q4_0:head=true", "take no overrides"),
        ("gguf:q4_0,w=3", "take no overrides"),
    ]:
        with pytest.raises(UserError, match=message) as e:
            get_scheme(bad)
        assert "\n" not in str(e.value)
    assert expand_schemes(["gguf"]) == list(GGUF_SCHEMES) and len(GGUF_SCHEMES) == len(GGUF_TYPES)
    assert not set(expand_schemes(["all"])) & set(GGUF_SCHEMES)  # 'all' needs no llama.cpp
    assert set(GGUF_SCHEMES) <= set(SCHEMES)


# ------------------------------------------------------------------------------------------ as cells


@pytest.fixture(scope="module")
def llama_ckpt(tmp_path_factory, tokenizer):
    pytest.importorskip("gguf")
    from models.checkpoint import save_checkpoint

    path = tmp_path_factory.mktemp("gguf-cells") / "micro-llama"
    save_checkpoint(path, trained_like(micro_config("llama")), tokenizer, provenance={"training": None})
    return path


def _grid(tmp_path, model, schemes, **kw):
    spec = GridSpec(
        models=[str(model)],
        schemes=list(schemes),
        modes=["fake"],
        protocol=SMALL,
        output_path=tmp_path / "results",
        attention=False,
        **kw,
    )
    return {r["scheme"]["name"]: r for r in run_grid(spec)}


def _tokens(tmp_path, model, record):
    from qbench.eval.evidence import read

    name = model.name
    path = next((tmp_path / "results" / name).glob(record["scheme"]["name"].replace(":", "@") + "__*.json"))
    return read(path, record)


def test_the_float32_file_through_llama_cpp_is_qbenchs_float_cell(tmp_path, llama_ckpt):
    """The consistency check: gguf:f32 differs from qbench's float cell only by llama.cpp's float32 kernels
    (measured on this micro Llama: perplexity 4e-9 relative, KLD 8e-17 nats; asserted 1e-4 and 1e-6)."""
    pytest.importorskip("llama_cpp")
    records = _grid(tmp_path, llama_ckpt, ["gguf:f32"])
    fp, cell = records["fp"], records["gguf:f32"]
    assert cell["status"] == "ok" and cell["mode"] == "real"  # llama.cpp's kernels: never labelled fake
    assert cell["metrics"]["perplexity"] == pytest.approx(fp["metrics"]["perplexity"], rel=1e-4)
    assert cell["metrics"]["kld_mean"] < 1e-6 and cell["metrics"]["top1_agreement"] > 0.99
    assert cell["backend"].startswith("llama.cpp (llama-cpp-python")
    art = cell["artifact"]
    assert art["format"] == "gguf" and art["file_type"] == "ALL_F32" and set(art["tensor_types"]) == {"F32"}
    assert len(art["sha256"]) == 64 and art["bits_per_weight"] == pytest.approx(32, rel=0.01)
    assert not list(tmp_path.glob("**/*.gguf"))  # the files lived in a temporary folder, now removed


def test_llama_cpps_q8_0_agrees_with_qbenchs_int8_blocks_of_32(tmp_path, llama_ckpt):
    """Q8_0 (int8 symmetric blocks of 32, fp16 scales; activations in 8-bit blocks of 32, the head quantised)
    beside qbench's fake int8 blocks of 32 with the head quantised: the same arithmetic up to the scales' fp16
    rounding and the activation grouping (qbench per token), so their changes agree within their intervals."""
    pytest.importorskip("llama_cpp")
    records = _grid(tmp_path, llama_ckpt, ["gguf:q8_0", "gguf:q4_0", "absmax-fine:group=32,head=true"])
    q8, ours, q4 = records["gguf:q8_0"], records["absmax-fine:group=32,head=true"], records["gguf:q4_0"]
    lo8, hi8 = q8["metrics"]["ppl_change_ci95"]
    lo, hi = ours["metrics"]["ppl_change_ci95"]
    assert lo8 <= hi and lo <= hi8  # the two intervals overlap
    assert abs(q8["metrics"]["ppl_change_pct"]) < 1.0 and q8["metrics"]["kld_mean"] < 1e-3
    assert q8["artifact"]["tensor_types"].get("Q8_0", 0) > 0
    assert q4["metrics"]["kld_mean"] > q8["metrics"]["kld_mean"]  # four bits cost more than eight
    assert q4["artifact"]["bytes"] < q8["artifact"]["bytes"]
    data = _tokens(tmp_path, llama_ckpt, q8)
    assert data is not None and data["nll"].shape == _tokens(tmp_path, llama_ckpt, ours)["nll"].shape


def test_every_offered_type_quantises_and_scores(tmp_path, hf_llama_dir):
    """Every type of the registry on a transformers Llama folder: llama.cpp writes it (rows of 32 fall back from
    the k-quants' 256 to legacy types, as the record's tensor types show) and scores it."""
    pytest.importorskip("llama_cpp")
    pytest.importorskip("gguf")
    records = _grid(tmp_path, hf_llama_dir, list(GGUF_SCHEMES))
    sizes = {}
    for name in GGUF_SCHEMES:
        r = records[name]
        assert r["status"] == "ok", (name, r["error"])
        assert torch.isfinite(torch.tensor(r["metrics"]["perplexity"])), name
        sizes[name] = r["artifact"]["bytes"]
    assert sizes["gguf:f32"] > sizes["gguf:f16"] > sizes["gguf:q8_0"] > sizes["gguf:q4_0"]


def test_what_llama_cpp_cannot_run_or_express_is_refused_in_one_line(tmp_path, ckpt_dir, llama_ckpt):
    pytest.importorskip("llama_cpp")
    pytest.importorskip("gguf")
    softmax1 = _grid(tmp_path / "a", ckpt_dir, ["gguf:q4_0"])["gguf:q4_0"]  # softmax-1: no llama.cpp graph
    assert softmax1["status"] == "unsupported" and "\n" not in softmax1["error"]
    from qbench.quant.kv import KVConfig

    kv = _grid(tmp_path / "b", llama_ckpt, ["gguf:q4_0"], kv=KVConfig(4, "per-token"))
    cell = kv["gguf:q4_0+kv4-tok"]
    assert cell["status"] == "unsupported" and "--kv-bits does not apply" in cell["error"]
    excluded = _grid(tmp_path / "c", llama_ckpt, ["gguf:q4_0"], exclude=("*mlp*",))["gguf:q4_0"]
    assert excluded["status"] == "unsupported" and "--exclude does not apply" in excluded["error"]


def test_the_command_line_scores_a_type_and_the_record_says_what_ran(tmp_path, llama_ckpt):
    pytest.importorskip("llama_cpp")
    import subprocess
    import sys

    out = tmp_path / "cli"
    cmd = [sys.executable, "-m", "qbench", "run", "--ckpt", str(llama_ckpt), "--scheme", "gguf:q4_k_m"]
    cmd += ["--tokens", "256", "--no-attention", "--output-path", str(out)]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    record = json.loads(next(out.glob("*/gguf@q4_k_m__real.json")).read_text())
    assert (
        record["scheme"]["params"] == {"type": "Q4_K_M"}
        and record["artifact"]["file_type"] == "MOSTLY_Q4_K_M"
    )
    assert "gguf:q4_k_m" in done.stdout


# ------------------------------------------------------------------------ a scheme written as llama.cpp blocks


@pytest.mark.parametrize(
    "scheme, type_name",
    [("absmax-fine:group=32", "Q8_0"), ("absmax-w4a8-g32", "Q4_0"), ("zeropoint-w4a8-g32:head=true", "Q4_1")],
)
def test_export_writes_qbenchs_codes_as_llama_cpp_blocks(tmp_path, llama_ckpt, scheme, type_name):
    """The exported blocks, read back by gguf-py's own dequantiser (an independent reading of ggml's layouts),
    are qbench's fake-quantised weights up to the fp16 rounding of the scales; llama.cpp scores the file within
    0.1 % of qbench's fake perplexity of the scheme (measured on this micro Llama: 2e-7 to 2.4e-5 relative;
    llama.cpp also quantises the activations to 8-bit blocks of 32 where qbench's schemes take per-token or float
    ones)."""
    gguf = pytest.importorskip("gguf")
    pytest.importorskip("llama_cpp")
    from gguf.quants import dequantize

    from models.checkpoint import load_checkpoint
    from qbench.eval.metrics import make_windows, perplexity
    from qbench.quant import quantize
    from qbench.quant.llamacpp import LlamaCppLM
    from qbench.quant.primitives import choose_qparams, fake_quantize

    out = tmp_path / "m.gguf"
    code = _cli(["export", str(llama_ckpt), str(out), "--format", "gguf", "--scheme", scheme])
    assert code in (0, None)
    s = get_scheme(scheme)
    ckpt = load_checkpoint(llama_ckpt)
    reader = gguf.GGUFReader(str(out))
    tensors = {t.name: t for t in reader.tensors}
    down = tensors["blk.1.ffn_down.weight"]
    assert down.tensor_type.name == type_name
    w = ckpt.model.transformer.h[1].mlp.down_proj.weight.detach()
    expected = fake_quantize(w, s.weight_bits, s.weight_granularity, s.weight_symmetric)
    got = torch.from_numpy(dequantize(down.data, down.tensor_type)).reshape(w.shape)
    # the fp16 rounding of the block's scale (and of Q4_1's minimum −s·z): 2^-11 relative, 2^-24 absolute below
    # fp16's normal range, times codes of at most 2^bits
    scale = choose_qparams(w, s.weight_bits, s.weight_granularity, s.weight_symmetric).scale
    bound = (scale.repeat_interleave(32, dim=1) * 2**-10 + 2**-23) * 2**s.weight_bits
    assert ((got - expected).abs() <= bound).all() and (got - expected).abs().max() > 0  # fp16, not float32
    assert tensors["token_embd.weight"].tensor_type.name == "F32"
    head = tensors.get("output.weight")  # absent when tied and float: llama.cpp reads token_embd
    assert (head is not None and head.tensor_type.name == type_name) == s.quantize_lm_head

    windows = make_windows(ckpt.tokenizer, SMALL, 32)
    fake = perplexity(quantize(ckpt.model, scheme), windows)["perplexity"]
    llama = LlamaCppLM(out, ckpt.model.config, 1, None, {})
    try:
        ours = perplexity(llama, windows)["perplexity"]
    finally:
        llama.close()
    assert ours == pytest.approx(fake, rel=1e-3)


def _cli(argv):
    from qbench.cli import main

    return main(argv)


def test_export_refuses_a_scheme_no_llama_cpp_type_holds_naming_the_nearest(tmp_path, llama_ckpt, capsys):
    from qbench.quant.llamacpp import export_type

    for scheme, nearest in [
        ("zeropoint-int4-g128", "zeropoint-w4a8-g32"),
        ("absmax-fine", "absmax-fine:group=32"),
        ("zeropoint-int4-g32:algo=gptq", "zeropoint-w4a8-g32"),
        ("mxfp4", "absmax-w4a8-g32"),
    ]:
        with pytest.raises(UserError, match=f"the nearest is .*--scheme {nearest}") as e:
            export_type(get_scheme(scheme))
        assert "\n" not in str(e.value)
    assert export_type(get_scheme("zeropoint-int4-g32")) == "Q4_1"  # weight-only: the same weight blocks
    assert _cli(["export", str(llama_ckpt), str(tmp_path / "hf"), "--scheme", "absmax-w4a8-g32"]) == 2
    assert "with --format gguf" in capsys.readouterr().err
