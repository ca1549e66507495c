"""Hostile or unusual inputs to ``qbench algorithms``, GPTQ/AWQ and the Python API's calibration: each a
one-line refusal naming the bad value, before anything is written — or, for non-finite weights, a recorded
non-finite cell — never a traceback, and the table's calibration sentence names what was really used."""

from __future__ import annotations

import json

import pytest
import torch

import qbench
from models.checkpoint import save_checkpoint
from models.errors import UserError
from models.tokenizer import load_tokenizer
from qbench.quant.primitives import NonFiniteError
from tests.qbench.cli_probe import refused, run
from tests.qbench.conftest import micro_config, trained_like

FAST = ["--tokens", "64", "--batch-size", "4"]
GPTQ_ONLY = ["--formats", "int4", "--algorithms", "rtn,gptq"]
BIG_SEED = "99999999999999999999"


def _save(path, model, tokenizer):
    save_checkpoint(path, model, tokenizer, provenance={"training": None})
    return path


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """Micro Llama checkpoints: plain, one NaN weight, one 1e38 weight (its down_proj inputs overflow), and one
    with GPT-2's tokenizer."""
    root, tok = tmp_path_factory.mktemp("probe-algorithms"), load_tokenizer("bpe8192")
    out = {"ok": _save(root / "ok", trained_like(micro_config("llama")), tok)}
    for name, value in (("nan", float("nan")), ("huge", 1e38)):
        model = trained_like(micro_config("llama"))
        with torch.no_grad():
            model.transformer.h[0].mlp.up_proj.weight[3, 3] = value
        out[name] = _save(root / name, model, tok)
    gpt2 = trained_like(micro_config("llama").replace(vocab_size=50257))
    out["gpt2tok"] = _save(root / "gpt2tok", gpt2, load_tokenizer("gpt2"))
    return out


# ------------------------------------------------------------------------------------------- 1. --seed overflow


@pytest.mark.parametrize("seed", [BIG_SEED, str(2**64), "-1"])
def test_algorithms_refuses_a_seed_torch_cannot_take(models, tmp_path, capsys, seed):
    out = tmp_path / "a"
    argv = ["algorithms", "--ckpt", models["ok"], *GPTQ_ONLY, "--seed", seed, "--output-path", out, *FAST]
    refused(
        argv,
        capsys,
        "--seed",
        seed,
        "outside the range torch.manual_seed accepts",
        "0 to 18446744073709551615",
    )
    assert not out.exists()


@pytest.mark.parametrize("command", ["run", "grid", "sweep", "sensitivity", "card", "init", "reproduce"])
def test_every_command_refuses_the_seed_before_any_work(models, tmp_path, command, capsys):
    out = tmp_path / "r"
    argv = [command, "--ckpt", models["ok"], "--seed", BIG_SEED, "--output-path", out, *FAST]
    refused(argv, capsys, f"--seed: {BIG_SEED} is outside", "0 to ")
    assert not out.exists()


def test_the_largest_seed_torch_takes_is_accepted():
    from qbench.cli.args import SEED_RANGE, seed_value

    assert seed_value(str(SEED_RANGE[1])) == 2**64 - 1
    torch.manual_seed(SEED_RANGE[1])  # the range is torch's own: its top end works


# ----------------------------------------------------------------------- 2. GPTQ / AWQ on NaN and huge weights


@pytest.mark.parametrize("which", ["nan", "huge"])
def test_algorithms_records_gptq_on_nonfinite_inputs_as_nonfinite(models, tmp_path, capsys, which):
    out = tmp_path / "a"
    argv = ["algorithms", "--ckpt", models[which], "--formats", "int4", "--algorithms", "rtn,gptq,awq"]
    code, _, err = run([*argv, "--output-path", out, *FAST], capsys)
    assert code in (0, None) and "Traceback" not in err, err
    row = json.loads((out / "algorithms.json").read_text())["rows"][0]
    for algo in ("gptq", "awq"):
        assert row["cells"][algo]["status"] == "nonfinite", row["cells"][algo]
        assert "layer 'transformer.h.0.mlp.down_proj'" in row["cells"][algo]["error"]


def test_run_records_gptq_on_an_overflowing_model_as_nonfinite(models, tmp_path, capsys):
    out = tmp_path / "r"
    argv = ["run", "--ckpt", models["huge"], "--scheme", "zeropoint-int4:algo=gptq", "--no-attention"]
    code, _, err = run([*argv, "--output-path", out, *FAST], capsys)
    assert code in (0, None) and "Traceback" not in err, err
    (record,) = [
        json.loads(p.read_text()) for p in (out / "huge").glob("zeropoint-int4@algo=gptq__fake*.json")
    ]
    assert record["status"] == "nonfinite" and "transformer.h.0.mlp.down_proj" in record["error"]


def test_gptq_quantize_refuses_nonfinite_inputs_and_a_failed_cholesky_in_one_line():
    from qbench.quant.gptq import gptq_quantize
    from qbench.quant.granularity import PerAxis

    x = torch.randn(64, 16)
    h, w = 2 * x.T @ x / 64, torch.randn(8, 16)
    bad_w = w.clone()
    bad_w[1, 2] = float("nan")
    with pytest.raises(NonFiniteError, match=r"GPTQ of layer 'blk\.q': the weight holds NaN or inf"):
        gptq_quantize(bad_w, h, 4, PerAxis(0), False, name="blk.q")
    bad_h = h.clone()
    bad_h[0, 0] = float("inf")
    with pytest.raises(NonFiniteError, match="its input Hessian holds NaN or inf"):
        gptq_quantize(w, bad_h, 4, PerAxis(0), False, name="blk.q")
    with pytest.raises(UserError, match=r"'blk.q'.*not positive definite even damped by 1 of its mean"):
        gptq_quantize(w, -torch.eye(16), 4, PerAxis(0), False, name="blk.q")
    with pytest.raises(NonFiniteError, match="overflows float32"):
        gptq_quantize(w, torch.full((16, 16), 3e38), 4, PerAxis(0), False)


def test_awq_scale_search_refuses_nan_errors():
    from qbench.quant.awq import search_scale
    from qbench.quant.granularity import PerAxis

    h = torch.full((16, 16), float("nan"))
    with pytest.raises(NonFiniteError, match="AWQ scale search"):
        search_scale([torch.randn(8, 16)], h, torch.ones(16), 4, PerAxis(0), False)


# --------------------------------------------------------------------------- 3. the API's calibration ids


@pytest.fixture(scope="module")
def micro():
    return trained_like(micro_config("llama"))


@pytest.mark.parametrize(
    ("calibration", "needle"),
    [
        (torch.full((2, 8), 9000), "token id 9000, outside the vocabulary (the model's vocabulary has 8192"),
        (torch.full((2, 8), -3), "token id -3, outside the vocabulary"),
        (torch.rand(2, 8), "2-d integer tensor of token ids (windows x tokens), got a float32 tensor"),
        (torch.randint(0, 8192, (16,)), "got shape (16,); one window: ids.unsqueeze(0)"),
        (torch.zeros(0, 8, dtype=torch.long), "holding at least one token, got shape (0, 8)"),
        ([[1, 2, 3]], "got list [[1, 2, 3]]"),
    ],
)
def test_quantize_refuses_bad_calibration_ids_in_one_line(micro, calibration, needle):
    with pytest.raises(UserError) as info:
        qbench.quantize(micro, "zeropoint-int4:algo=gptq", calibration=calibration)
    assert needle in str(info.value) and "\n" not in str(info.value)


def test_quantize_takes_int32_calibration_ids(micro):
    q = qbench.quantize(micro, "zeropoint-int4:algo=gptq", calibration=torch.randint(0, 8192, (2, 8)).int())
    assert q.qbench_scheme["algo"] == "gptq"


# --------------------------------------------------------------------------- 4. evaluate(calib_tokens=...)


@pytest.mark.parametrize(
    ("value", "shown"), [("8", "str '8'"), (8.5, "float 8.5"), (0, "int 0"), (True, "bool")]
)
def test_evaluate_names_calib_tokens(models, value, shown):
    with pytest.raises(UserError, match=f"calib_tokens must be a positive integer .*got {shown}"):
        qbench.evaluate(models["ok"], "zeropoint-int4:algo=gptq", tokens=64, calib_tokens=value)


# ------------------------------------------------------------------------ 5. the calibration the table states


def test_the_table_names_the_calibration_file_and_the_windows_taken(models, tmp_path, capsys):
    text = tmp_path / "calib.txt"
    text.write_text(" ".join(f"word{i} and more" for i in range(40)))  # a few 32-token windows, fewer than 8
    out = tmp_path / "a"
    argv = ["algorithms", "--ckpt", models["ok"], *GPTQ_ONLY, "--calib-data", text]
    code, _, err = run([*argv, "--output-path", out, *FAST], capsys)
    assert code in (0, None), err
    result = json.loads((out / "algorithms.json").read_text())
    cal = result["calibration"]["ok"]
    (taken,) = cal["taken"]
    assert cal["corpus"] == str(text) and cal["split"] == "all"
    assert 1 <= taken["windows"] < taken["windows_requested"] == 128  # GPTQ's default: 128 windows
    assert (
        taken["tokens"] == taken["windows"] * taken["window"] == taken["windows"] * 32
    )  # min(2048, context)
    table = (out / "table.md").read_text()
    drawn = f"a sample across documents (seed 0) of {taken['windows']} windows of 32 tokens ({taken['tokens']} tokens)"
    assert f"{drawn} of {text}" in table
    assert f"which holds {cal['tokens_held']} tokens (128 windows asked for" in table
    assert "train split" not in table


def test_without_a_calibrated_algorithm_the_table_says_so(models, tmp_path, capsys):
    out = tmp_path / "a"
    argv = ["algorithms", "--ckpt", models["ok"], "--formats", "int4", "--algorithms", "rtn"]
    code, _, err = run([*argv, "--output-path", out, *FAST], capsys)
    assert code in (0, None), err
    assert "Calibration: none (no algorithm of this run calibrates)." in (out / "table.md").read_text()


# ------------------------------------------------------------------ 6. refusals write nothing, 7. the lists


@pytest.mark.parametrize(
    ("args", "needles"),
    [
        ([*GPTQ_ONLY, "--calib-data", "nothere.txt"], ["unknown corpus 'nothere.txt'"]),
        ([*GPTQ_ONLY, "--ckpt", "nothere-model"], ["model 'nothere-model' does not exist"]),
        (["--formats", "int5"], ["unknown --formats 'int5'", "did you mean 'int4'"]),
        (["--algorithms", "rtn,gtpq"], ["unknown --algorithms 'gtpq'", "did you mean 'gptq'"]),
        (["--formats", ","], ["--formats ','", "names nothing", "int4"]),
        (["--algorithms", ","], ["--algorithms ','", "names nothing"]),
        (["--formats", "int4,,w4a8"], ["--formats 'int4,,w4a8' has an empty item"]),
        (["--formats", "int4,int4"], ["--formats 'int4,int4' names 'int4' twice"]),
        (["--algorithms", "rtn,rtn"], ["--algorithms 'rtn,rtn' names 'rtn' twice"]),
        (["--algorithms", "rtn", "--calib-tokens", "64"], ["none of --algorithms rtn calibrates"]),
    ],
)
def test_refused_algorithms_leave_no_output_folder(models, tmp_path, capsys, args, needles):
    out = tmp_path / "a"
    argv = ["algorithms", "--ckpt", models["ok"], *args, "--output-path", out, *FAST]
    refused(argv, capsys, *needles)
    assert not out.exists()


def test_the_same_model_twice_is_refused_before_anything_is_written(models, tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(models["ok"].parent)
    out = tmp_path / "a"
    argv = ["algorithms", "--ckpt", "ok", "--ckpt", "./ok", *GPTQ_ONLY, "--output-path", out, *FAST]
    refused(argv, capsys, "--ckpt ok and --ckpt ./ok name the same model", "give each model once")
    assert not out.exists()


# ------------------------------------------------------------------------- 8. calibration text under a window


@pytest.mark.parametrize(
    ("content", "needles"),
    [
        (b"", ["holds 0 tokens", "one calibration window takes 32"]),
        (b"hello world", ["holds 5 tokens", "one calibration window takes 32"]),
        (b"\x00\x01\x02binary" * 50, ["is a binary file", "no tokens", "one calibration window takes 32"]),
    ],
)
def test_calibration_text_shorter_than_a_window_is_refused(models, tmp_path, capsys, content, needles):
    text = tmp_path / "calib.txt"
    text.write_bytes(content)
    out = tmp_path / "a"
    argv = [
        "algorithms",
        "--ckpt",
        models["ok"],
        *GPTQ_ONLY,
        "--calib-data",
        text,
        "--output-path",
        out,
        *FAST,
    ]
    refused(argv, capsys, f"--calib-data '{text}'", *needles)
    assert not out.exists()


# --------------------------------------------------------------------------------- 9. a mix of tokenizers


def test_models_with_different_tokenizers_are_refused(models, tmp_path, capsys):
    out = tmp_path / "a"
    argv = ["algorithms", "--ckpt", models["ok"], "--ckpt", models["gpt2tok"], "--formats", "int4"]
    refused(
        [*argv, "--algorithms", "rtn", "--output-path", out, *FAST],
        capsys,
        "ok and gpt2tok use different tokenizers",
        "bpe8192, 8,192 tokens",
        "gpt2, 50,257 tokens",
    )
    assert not out.exists()


def test_gptq_raises_the_damping_tenfold_until_the_hessian_factorises():
    """As GPTQModel and llm-compressor do: a Hessian that damp=0.01 leaves indefinite (eigenvalues 2.05 and
    −0.05, mean diagonal 1) factorises at 0.1; one that 1.0 cannot save (−2 + 1 < 0) is a one-line error."""
    from qbench.quant.gptq import gptq_quantize
    from qbench.quant.granularity import PerAxis

    w = torch.tensor([[0.3, -0.7], [1.1, 0.2]])
    result = gptq_quantize(w, torch.tensor([[1.0, 1.05], [1.05, 1.0]]), 4, PerAxis(0), False, name="l")
    assert result.damp == pytest.approx(0.1) and torch.isfinite(result.weight).all()
    ok = gptq_quantize(w, torch.tensor([[1.0, 0.5], [0.5, 1.0]]), 4, PerAxis(0), False)
    assert ok.damp == pytest.approx(0.01)  # the first damping that works is the one used
    with pytest.raises(UserError, match=r"layer 'l'.*even damped by 1 of its mean diagonal.*from damp=0.01"):
        gptq_quantize(w, torch.tensor([[1.0, 3.0], [3.0, 1.0]]), 4, PerAxis(0), False, name="l")
