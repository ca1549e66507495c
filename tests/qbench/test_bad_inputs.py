"""Bad input gets one line naming the value and the valid choices — never a traceback, never a meaningless
result recorded as if it were one."""

from __future__ import annotations

import json
import re

import pytest
import torch

from models.checkpoint import save_checkpoint
from models.errors import UserError
from qbench.cli import main
from qbench.quant import get_scheme
from tests.qbench.conftest import micro_config, to_hf_model, trained_like


@pytest.mark.parametrize(
    ("name", "message"),
    [
        ("hadamard-absmax-coarse:seed=99999999999999999999", "seed takes an integer from 0 to 2\\*\\*63"),
        ("smoothquant:calib_seed=99999999999999999999", "calib_seed takes an integer from 0 to 2\\*\\*63"),
        ("smoothquant:alpha=nan", "alpha takes a number from 0 to 1"),
        ("smoothquant:alpha=inf", "alpha takes a number from 0 to 1"),
        ("smoothquant:alpha=1.5", "alpha takes a number from 0 to 1"),
    ],
)
def test_out_of_range_overrides_are_refused(name, message):
    with pytest.raises(UserError, match=message):
        get_scheme(name)


def test_the_largest_seed_is_accepted_and_used():
    scheme = get_scheme(f"hadamard-absmax-coarse:seed={2**63 - 1}")
    assert scheme.param("seed") == 2**63 - 1
    torch.Generator().manual_seed(scheme.param("seed"))  # what the rotation does with it


@pytest.mark.parametrize(
    ("content", "message"),
    [
        ("some text, in UTF-16\n\n".encode("utf-16"), "UTF-16 \\(little-endian\\) text, not UTF-8"),
        (bytes(range(256)) * 4, "binary file"),
        ("café au lait\n".encode("latin-1"), "not UTF-8 text \\(byte 3"),
    ],
    ids=["utf16", "binary", "latin1"],
)
def test_a_data_file_that_is_not_utf8_text_is_refused(ckpt_dir, tmp_path, capsys, content, message):
    data = tmp_path / "corpus.txt"
    data.write_bytes(content)
    out = tmp_path / "results"
    code = main(
        ["run", "--ckpt", str(ckpt_dir), "--data", str(data), "--tokens", "64", "--output-path", str(out)]
    )
    err = capsys.readouterr().err
    assert code == 2 and "Traceback" not in err
    assert len(err.strip().splitlines()) == 1
    assert re.search(message, err), err


def test_a_utf8_file_with_a_bom_is_read(tmp_path):
    from trainers.data import read_utf8_text

    path = tmp_path / "bom.txt"
    path.write_bytes("\ufeffhello".encode())
    assert read_utf8_text(path) == "hello"


@pytest.mark.parametrize("kind", ["checkpoint-nan", "transformers-inf"])
def test_nonfinite_weights_give_nonfinite_records(tokenizer, tmp_path, capsys, kind):
    model = trained_like(micro_config("gpt2" if kind == "checkpoint-nan" else "llama"))
    with torch.no_grad():
        layer = model.transformer.h[0].mlp
        (layer.c_fc if kind == "checkpoint-nan" else layer.down_proj).weight[0, 0] = (
            float("nan") if kind == "checkpoint-nan" else float("inf")
        )
    target = tmp_path / "model"
    if kind == "checkpoint-nan":
        save_checkpoint(target, model, tokenizer, provenance={"training": None})
    else:
        to_hf_model(model, tokenizer).save_pretrained(target)
        tokenizer.save_pretrained(target)
    out = tmp_path / "results"
    argv = ["run", "--ckpt", str(target), "--scheme", "absmax-fine", "--tokens", "64", "--batch-size", "2"]
    code = main([*argv, "--no-attention", "--output-path", str(out)])
    err = capsys.readouterr().err
    assert code == 0 and "Traceback" not in err
    records = [json.loads(p.read_text()) for p in out.rglob("*.json")]
    assert sorted(r["status"] for r in records) == ["nonfinite", "nonfinite"]
    assert all("the float weights hold 1 NaN/inf value(s)" in r["error"] for r in records)


def test_a_corrupt_gguf_file_is_a_one_line_error(tmp_path, capsys):
    pytest.importorskip("gguf")
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"GGUF" + (3).to_bytes(4, "little") + b"garbage" * 10)
    code = main(["run", "--ckpt", str(bad), "--output-path", str(tmp_path / "r")])
    err = capsys.readouterr().err
    assert code == 2 and "is not a readable GGUF file (corrupt or truncated" in err
    assert len(err.strip().splitlines()) == 1
