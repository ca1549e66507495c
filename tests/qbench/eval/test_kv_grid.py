"""KV-cache quantisation through the harness, the report and the CLI: records, names, reuse, one-line errors."""

from __future__ import annotations

import json

import pytest

from qbench.cli import main
from qbench.eval.harness import GridSpec, run_grid
from qbench.eval.metrics import Protocol
from qbench.eval.report import comparison
from qbench.quant.kv import KVConfig

SMALL = Protocol(tokens=32 * 4, batch_size=2, outlier_windows=2)


def grid(tmp_path, model, schemes, kv=None, modes=("fake",)):
    return GridSpec(
        models=[str(model)],
        schemes=list(schemes),
        modes=list(modes),
        protocol=SMALL,
        output_path=tmp_path / "results",
        attention=False,
        kv=kv,
    )


@pytest.mark.parametrize("fixture", ["ckpt_dir", "hf_llama_dir"])
def test_records_carry_the_kv_block_and_names_show_it(fixture, request, tmp_path):
    model = request.getfixturevalue(fixture)
    kv = KVConfig(2, "kivi:group=4,residual=8", keep_first=1)  # groups small enough for the windows
    records = run_grid(grid(tmp_path, model, ["fp", "absmax-fine"], kv, modes=("fake", "real")))
    assert [(r["scheme"]["name"], r["mode"]) for r in records] == [
        ("fp", "float"),
        ("fp+kv2-g4r8-keep1", "fake"),  # the cache alone: once, whatever the modes
        ("absmax-fine+kv2-g4r8-keep1", "fake"),
        ("absmax-fine+kv2-g4r8-keep1", "real"),
    ]
    assert records[0]["kv"] is None
    for r in records[1:]:
        assert r["status"] == "ok", r["error"]
        assert KVConfig.from_dict(r["kv"]) == kv and r["kv"]["label"] == "kv2-g4r8-keep1"
        assert r["metrics"]["perplexity"] != records[0]["metrics"]["perplexity"]
    assert records[1]["scheme"]["weight_bits"] is None and records[2]["scheme"]["weight_bits"] == 8
    files = sorted(p.name for p in (tmp_path / "results").rglob("*.json"))
    assert files == [
        "absmax-fine+kv2-g4r8-keep1__fake.json",
        "absmax-fine+kv2-g4r8-keep1__real.json",
        "fp+kv2-g4r8-keep1__fake.json",
        "fp.json",
    ]
    plain = run_grid(grid(tmp_path, model, ["absmax-fine"]))[1]  # same scheme without KV: its own record
    assert plain["kv"] is None and plain["scheme"]["name"] == "absmax-fine"
    headers, _, caption = comparison([*records, plain])
    assert headers[1:6] == [
        "fp",
        "fp+kv2-g4r8-keep1/fake",
        "absmax-fine/fake",
        "absmax-fine+kv2-g4r8-keep1/fake",
        "absmax-fine+kv2-g4r8-keep1/real",
    ]
    # each cache described from its record (the label, then the scheme's own description)
    assert "KV cache (+kv2-g4r8-keep1: KIVI streaming" in caption
    assert "-keepK: positions < K kept in float" in caption


def test_the_reuse_key_includes_the_kv_block(ckpt_dir, tmp_path):
    spec = grid(tmp_path, ckpt_dir, ["fp"], KVConfig(4, "per-token"))
    first = run_grid(spec)[1]
    seen = []
    run_grid(spec, on_record=lambda r, reused: seen.append(reused))
    assert seen == [True, True]
    path = tmp_path / "results" / ckpt_dir.name / f"{spec.scheme('fp').name}__fake.json"
    record = json.loads(path.read_text())
    record["kv"]["scheme"] = "window"  # a record made under another cache setting
    path.write_text(json.dumps(record))
    seen.clear()
    again = run_grid(spec, on_record=lambda r, reused: seen.append(reused))[1]
    assert seen == [True, False] and again["kv"] == first["kv"]


def test_fp_scheme_alone_is_the_float_baseline(ckpt_dir, tmp_path, capsys):
    records = run_grid(grid(tmp_path, ckpt_dir, ["fp"]))
    assert [r["scheme"]["name"] for r in records] == ["fp"]  # the baseline, no second cell
    out = str(tmp_path / "cli")
    assert main(["run", "--ckpt", str(ckpt_dir), "--scheme", "fp", *FAST, "--output-path", out]) == 0
    assert "fp" in capsys.readouterr().out
    assert list((tmp_path / "cli" / ckpt_dir.name).glob("*.json"))


FAST = ["--tokens", "128", "--batch-size", "2", "--no-attention"]


def test_cli_run_and_score_with_a_quantised_cache(ckpt_dir, tmp_path, capsys):
    out_path = str(tmp_path / "r")
    argv = ["run", "--ckpt", str(ckpt_dir), "--scheme", "fp", "--kv-bits", "4", "--kv-keep-first", "1"]
    small = ["--kv-scheme", "kivi:group=8,residual=8"]  # the default residual (128) covers a 32-token window
    assert main([*argv, *small, *FAST, "--output-path", out_path]) == 0
    assert "fp+kv4-g8r8-keep1" in capsys.readouterr().out
    assert main([*argv, *FAST, "--output-path", out_path]) == 2  # ... and is refused, not measured as float
    assert "nothing would be quantised" in capsys.readouterr().err
    argv = ["score", "--ckpt", str(ckpt_dir), "--scheme", "absmax-fine", "--kv-bits", "8"]
    assert main([*argv, *FAST, "--output-path", out_path, "--kv-granularity", "per-token"]) == 0
    assert "absmax-fine+kv8-tok" in capsys.readouterr().out
    assert (tmp_path / "r" / ckpt_dir.name / "absmax-fine+kv8-tok__fake.json").is_file()


@pytest.mark.parametrize(
    "extra, message",
    [
        (["--kv-bits", "5"], "choose from: 8, 6, 4, 3, 2"),
        (["--kv-bits", "two"], "--kv-bits"),
        (["--kv-bits", "4", "--kv-granularity", "per-tokn"], "did you mean 'per-token'"),
        (["--kv-bits", "4", "--kv-keep-first", "-1"], "integer ≥ 0"),
        (["--kv-keep-first", "1"], "need --kv-bits"),
    ],
)
def test_bad_kv_options_are_one_line_errors(extra, message, ckpt_dir, tmp_path, capsys):
    code = main(["run", "--ckpt", str(ckpt_dir), *extra, *FAST, "--output-path", str(tmp_path)])
    err = capsys.readouterr().err
    assert code == 2 and message in err and "Traceback" not in err
    assert len(err.strip().splitlines()) <= 2  # one message (rich may wrap a long line once)


# ------------------------------------------------------------------------------------ fp8 scale=calib


def _reference_scales(model, ids, top):
    """Plain torch: the float model's own KV cache (models.KVCache) over each calibration batch, max |k|, |v|."""
    import torch

    from qbench.quant.calibrate import calibration_batches

    amax = [[0.0, 0.0] for _ in range(model.config.n_layer)]
    with torch.no_grad():
        for batch in calibration_batches(ids):
            cache = model.new_cache()
            model(batch, cache)
            for layer in range(model.config.n_layer):
                k, v = (t[:, :, : batch.size(1)] for t in (cache._k[layer], cache._v[layer]))
                amax[layer] = [
                    max(amax[layer][0], float(k.abs().max())),
                    max(amax[layer][1], float(v.abs().max())),
                ]
    return [a[0] / top for a in amax], [a[1] / top for a in amax]


@pytest.mark.parametrize("name, top", [("fp8-e4m3", 448.0), ("fp8-e5m2", 57344.0)])
def test_calibrated_fp8_cache_scales_are_amax_over_the_train_windows(ckpt_dir, tmp_path, name, top):
    from qbench.eval.harness import KV_CALIB_WINDOWS, ModelEvaluation, kv_calibration_windows

    kv = KVConfig(8, f"{name}:scale=calib")
    spec = grid(tmp_path, ckpt_dir, ["fp"], kv)
    records = run_grid(spec)
    rec = records[1]
    assert rec["status"] == "ok", rec["error"]
    assert rec["scheme"]["name"] == f"fp+{kv.label}"
    calibration = rec["kv"]["calibration"]
    evaluation = ModelEvaluation(spec, str(ckpt_dir))
    ids = kv_calibration_windows(evaluation.lm.tokenizer, SMALL, evaluation.windows.window)
    assert ids.shape == (KV_CALIB_WINDOWS, evaluation.windows.window)
    assert calibration["tokens"] == ids.numel() and calibration["split"] == "train"
    k_ref, v_ref = _reference_scales(evaluation.lm.model, ids, top)
    assert calibration["k_scale"] == pytest.approx(k_ref, rel=1e-6)
    assert calibration["v_scale"] == pytest.approx(v_ref, rel=1e-6)
    assert rec["metrics"]["perplexity"] is not None
    # another cell than scale=1.0, and reused as the same cell on a second run
    fixed = run_grid(grid(tmp_path, ckpt_dir, ["fp"], KVConfig(8, name)))[1]
    assert fixed["cell_id"] != rec["cell_id"] and "calibration" not in fixed["kv"]
    assert fixed["metrics"]["perplexity"] != rec["metrics"]["perplexity"]
    again = run_grid(grid(tmp_path, ckpt_dir, ["fp"], kv))[1]
    assert again == rec  # read back from disk, not recomputed
    assert KVConfig.from_dict(rec["kv"]) == kv


def test_calibrated_fp8_cache_from_the_command_line(ckpt_dir, tmp_path, capsys):
    out = tmp_path / "cli"
    argv = ["run", "--ckpt", ckpt_dir, "--scheme", "absmax-fine", "--kv-scheme", "fp8-e4m3:scale=calib"]
    argv += ["--tokens", "128", "--batch-size", "2", "--no-attention", "--output-path", out]
    assert main([str(a) for a in argv]) == 0
    (path,) = out.rglob("absmax-fine+kv8-e4m3-calib__fake.json")
    kv = json.loads(path.read_text())["kv"]
    assert kv["scale"] == "calib" and kv["label"] == "kv8-e4m3-calib"
    assert len(kv["calibration"]["k_scale"]) == len(kv["calibration"]["v_scale"]) > 0
    assert all(s > 0 for s in kv["calibration"]["k_scale"]) and kv["calibration"]["corpus"] == "embedded"
    capsys.readouterr()
    assert main(["run", "--ckpt", str(ckpt_dir), "--kv-scheme", "fp8-e4m3:scale=foo"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "scale" in err and "calib" in err and "foo" in err, err
