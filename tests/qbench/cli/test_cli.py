"""The CLI end to end, in-process through ``main(argv)`` (one subprocess checks the console script itself)."""

import json
import subprocess
import sys

import pytest

from qbench.cli import main

FAST = ["--tokens", "128", "--batch-size", "2"]


def run(argv, capsys):
    code = main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return code, out, err


def test_init_export_and_ls(tmp_path, capsys):
    code, out, _ = run(["init", "--preset", "tiny", "--attn", "softmax1", "--out", tmp_path / "c"], capsys)
    assert code == 0 and "softmax1" in out
    code, _, err = run(["init", "--preset", "tiny", "--out", tmp_path / "c"], capsys)
    assert code == 2 and "--overwrite" in err
    code, _, _ = run(["export", tmp_path / "c", tmp_path / "hf"], capsys)
    assert (
        code == 0
        and json.loads((tmp_path / "hf" / "config.json").read_text())["attn_implementation"] == "softmax1"
    )
    for what in ("presets", "corpora", "schemes", "optimizers"):
        code, out, _ = run(["ls", what], capsys)
        assert code == 0 and len(out.splitlines()) > 4, what
    code, out, _ = run(["ls", "schemes"], capsys)
    assert all(
        name in out for name in ("absmax-fine", "absmax-coarse", "zeropoint-int4", "llm-int8", "smoothquant")
    )


def test_run_grid_compare_on_our_checkpoint_and_a_transformers_folder(
    ckpt_dir, hf_gpt2_dir, tmp_path, capsys
):
    out_dir = tmp_path / "res"
    code, out, _ = run(
        ["run", "--ckpt", ckpt_dir, "--scheme", "absmax-coarse", "--output-path", out_dir, *FAST], capsys
    )
    assert code == 0 and "absmax-coarse" in out
    code, out, _ = run(
        [
            "grid",
            "--ckpt",
            ckpt_dir,
            "--ckpt",
            hf_gpt2_dir,
            "--scheme",
            "absmax-coarse",
            "--scheme",
            "zeropoint-int4",
            "--output-path",
            out_dir,
            *FAST,
        ],
        capsys,
    )
    assert code == 0 and "(reused)" in out  # the run's cells were not recomputed
    for fmt in ("md", "csv", "latex", "json"):
        code, out, _ = run(
            ["compare", ckpt_dir.name, hf_gpt2_dir.name, "--format", fmt, "--output-path", out_dir], capsys
        )
        assert code == 0 and "softmax1" in out and "gpt2-micro" in out, fmt  # LaTeX escapes the underscore
    table = json.loads(run(["compare", out_dir, "--format", "json"], capsys)[1])
    assert table["headers"][:4] == ["model", "fp", "absmax-coarse/fake", "zeropoint-int4/fake"]
    assert "windows of 32 tokens drawn across" in table["caption"]


def test_compare_evaluates_a_bare_checkpoint_name(ckpt_dir, tmp_path, monkeypatch, capsys):
    (tmp_path / "ckpts").mkdir()
    (tmp_path / "ckpts" / "ortho").symlink_to(ckpt_dir)
    monkeypatch.chdir(tmp_path)
    import functools

    from qbench.eval import harness
    from qbench.eval.metrics import Protocol

    # compare evaluates with the default protocol; a small budget keeps the test fast (and shows it was used).
    monkeypatch.setattr(
        harness, "GridSpec", functools.partial(harness.GridSpec, protocol=Protocol(tokens=64))
    )
    code, out, _ = run(["compare", "ortho", "--format", "md"], capsys)
    assert code == 0 and "ortho" in out and "zeropoint-int4/fake" in out
    records = [json.loads(p.read_text()) for p in (tmp_path / "qbench_results").rglob("*.json")]
    assert records and {r["protocol"]["tokens"] for r in records} == {64}


@pytest.mark.parametrize(
    "argv,message",
    [
        (["run", "--ckpt", "CKPT", "--scheme", "absmax-corse"], "did you mean 'absmax-coarse'"),
        (["run", "--ckpt", "CKPT", "--mode", "rael"], "did you mean 'real'"),
        (["run", "--ckpt", "CKPT", "--data", "embeded"], "did you mean 'embedded'"),
        (["run", "--ckpt", "/nonexistent/model"], "does not exist"),
        (["compare", "CKPT", "--format", "xlsx"], "unknown format"),
        (["init", "--preset", "tiyn", "--out", "x"], "did you mean 'tiny'"),
        (["ls", "shemes"], "did you mean 'schemes'"),
        (["run"], "--ckpt"),
        (["run", "--ckpt", "CKPT", "--window", "1"], "--window must be at least 2"),
        (["run", "--ckpt", "CKPT", "--device", "gpu"], "unknown device"),
        (["speed", "--llama-cpp-type", "Q8_0"], "--llama-cpp-type needs --llama-cpp"),
        (["speed", "--llama-cpp", "--llama-cpp-type", "Q4_K_S"], "did you mean 'Q4_K_M'"),
        (["speed", "--llama-cpp", "--no-generate"], "drop --no-model / --no-generate"),
    ],
)
def test_bad_input_is_one_line_and_exit_2(argv, message, ckpt_dir, tmp_path, capsys):
    argv = [str(ckpt_dir) if a == "CKPT" else a for a in argv] + ["--output-path", str(tmp_path)] * (
        argv[0] in ("run", "compare")
    )
    code, _, err = run(argv, capsys)
    assert code == 2
    assert message in err and "Traceback" not in err
    assert len(err.strip().splitlines()) <= 2  # one message (rich may wrap a long line once)


def test_console_script_exit_code_and_no_traceback(tmp_path):
    result = subprocess.run(
        [sys.executable, "-m", "qbench", "run", "--ckpt", str(tmp_path / "missing")],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 2 and "error:" in result.stderr and "Traceback" not in result.stderr


def test_inspect_score_and_intervene_through_the_cli(hf_llama_dir, ckpt_dir, tmp_path, capsys):
    code, out, _ = run(
        ["inspect", "--ckpt", ckpt_dir, "--tokens", "64", "--windows", "2", "--out", tmp_path / "insp"],
        capsys,
    )
    assert code == 0
    assert {p.name for p in (tmp_path / "insp").glob("*.png")} == {
        "attention.png",
        "activations.png",
        "layers.png",
    }
    code, out, _ = run(
        [
            "score",
            "--ckpt",
            hf_llama_dir,
            "--tokens",
            "64",
            "--output-path",
            tmp_path / "r",
            "--json",
            tmp_path / "score.json",
        ],
        capsys,
    )
    assert code == 0 and "robustness" in out
    assert 0 < json.loads((tmp_path / "score.json").read_text())["robustness"] < 2
    code, out, _ = run(["intervene", "--ckpt", ckpt_dir, "--set", "mean", "--tokens", "64"], capsys)
    assert code == 0
    code, _, err = run(["intervene", "--ckpt", ckpt_dir, "--set", "nan"], capsys)
    assert code == 2 and "zero" in err


def test_speed_measures_the_kv_cache_and_skips_it_on_request(tmp_path, capsys):
    records = tmp_path / "kv.json"
    argv = [
        "speed",
        "--no-layer",
        "--no-generate",
        "--scheme",
        "absmax-fine",
        "--mode",
        "fake",
        "--repeats",
        1,
    ]
    argv += ["--model", "tiny", "--model-tokens", 8, "--kv-contexts", 8, 140, "--kv-new-tokens", 2]
    argv += [
        "--kv-scheme",
        "per-token",
        "--kv-bits",
        4,
        "--kv-scheme",
        "fp8-e4m3:scale=calib",
        "--json",
        records,
    ]
    code, out, _ = run([*argv, "--format", "md"], capsys)
    assert code == 0 and "KV cache, generation: tiny, prefill 140 tokens" in out and "| kv8-e4m3-calib" in out
    kv = [r for r in json.loads(records.read_text())["records"] if r["kind"] == "kv"]
    assert [(r["context"], r["cache"]) for r in kv] == [
        (c, n) for c in (8, 140) for n in ("float", "kv4-tok", "kv8-e4m3-calib")
    ]
    assert all(r["error"] is None and r["tokens_per_s"] > 0 for r in kv), kv
    assert len(kv[2]["kv"]["calibration"]["k_scale"]) == 4  # tiny: 4 layers
    code, out, _ = run([*argv, "--no-kv"], capsys)
    assert code == 0 and "KV cache" not in out
    assert not [r for r in json.loads(records.read_text())["records"] if r["kind"] == "kv"]
    code, _, err = run(["speed", "--kv-scheme", "fp8-e4m3:scale=foo"], capsys)
    assert code == 2 and len(err.strip().splitlines()) == 1 and "positive number or calib" in err


def test_speed_writes_json_and_renders_it_again(tmp_path, capsys):
    records = tmp_path / "speed.json"
    argv = ["speed", "--in-features", 64, "--out-features", 32, "--tokens", 1, "--repeats", 1, "--no-peers"]
    argv += ["--scheme", "absmax-w4a8", "--mode", "real", "--no-model", "--json", records]
    code, out, _ = run(argv, capsys)
    assert code == 0 and "absmax-w4a8 [real]" in out and "Int4A8Linear" in out
    code, again, _ = run(["speed", "--from-json", records, "--format", "md"], capsys)
    assert code == 0 and "| absmax-w4a8 [real]" in again and "per layer: 64→32, 1 tokens" in again
    assert json.loads(records.read_text())["git_commit"]
    for rec in json.loads(records.read_text())["records"]:  # each repeat's time is kept, not only the summary
        if rec["kind"] == "layer" and rec.get("ms") is not None:
            assert len(rec["ms_repeats"]) == 1 and rec["ms_repeats"][0] == pytest.approx(rec["ms_min"])
    code, _, err = run(["speed", "--from-json", tmp_path / "missing.json"], capsys)
    assert code == 2 and "no speed records at" in err
    # several runs: the across-runs section needs llama.cpp rows, and --goal a positive ratio
    code, _, err = run(["speed", "--from-json", records, "--goal", "0.8"], capsys)
    assert code == 2 and "no llama.cpp rows in" in err
    code, _, err = run(["speed", "--from-json", records, records], capsys)
    assert code == 2 and f"names {records} twice" in err
    code, _, err = run(["speed", "--no-model", "--goal", "0.8"], capsys)
    assert code == 2 and "--goal decides from runs already written" in err
    code, _, err = run(["speed", "--from-json", records, "--goal", "-1"], capsys)
    assert code == 2 and "--goal: a positive ratio such as 0.8 is needed, got '-1'" in err
    row = {"kind": "generate", "name": "llama.cpp Q8_0", "model": "m", "threads": 1, "cpu": "c"}
    row |= {"prompt_tokens": 16, "new_tokens": 8, "llama_cpp_type": "Q8_0", "qbench_vs_llama_cpp": 0.9}
    llama = {
        **json.loads(records.read_text()),
        "records": [row | {"qbench_match": "absmax-fine:head=true [real]"}],
    }
    one, two = tmp_path / "r1.json", tmp_path / "r2.json"
    one.write_text(json.dumps(llama))
    llama["records"][0]["qbench_vs_llama_cpp"] = 0.92
    two.write_text(json.dumps(llama))
    code, out, _ = run(["speed", "--from-json", one, two, "--goal", "0.8", "--format", "md"], capsys)
    assert code == 0 and "| 0.90 / 0.92" in out and "verdict against 0.8×" in out
    code, _, err = run(["speed", "--from-json", records, "--format", "html"], capsys)
    assert code == 2 and "unknown table format 'html'" in err
