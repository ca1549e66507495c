"""Overridden and calibrated schemes in the grid: the record's scheme config rebuilds the same
scheme, calibration windows/seed/corpus are recorded, and a record is reused only for an equal config."""

import json

import pytest
import torch

from qbench.eval.harness import GridSpec, calibration_sample, record_path, run_grid
from qbench.eval.load import load_model
from qbench.eval.metrics import Protocol, make_windows
from qbench.quant.schemes import QuantScheme, get_scheme

SMALL = Protocol(tokens=32 * 4, batch_size=2, outlier_windows=2)
SCHEMES = ["absmax-coarse:w=4,a=4,o=4", "absmax-fine:static=true,calib=2,calib_seed=1"]


def grid(tmp_path, ckpt_dir, schemes=SCHEMES):
    return GridSpec(
        models=[str(ckpt_dir)],
        schemes=schemes,
        protocol=SMALL,
        output_path=tmp_path / "results",
        attention=False,
    )


def rebuilt(record_scheme: dict) -> QuantScheme:
    """The scheme a record describes: its config without the grid's extras (exclude, calibration)."""
    return QuantScheme.from_dict(
        {k: v for k, v in record_scheme.items() if k not in ("exclude", "calibration")}
    )


def test_records_rebuild_their_scheme_and_carry_the_calibration(tmp_path, ckpt_dir):
    fp, coarse4, static = run_grid(grid(tmp_path, ckpt_dir))
    for record, name in ((coarse4, SCHEMES[0]), (static, SCHEMES[1])):
        assert record["status"] == "ok", record["error"]
        assert rebuilt(record["scheme"]) == get_scheme(name)
        assert record["scheme"]["name"] == get_scheme(name).name
    assert coarse4["scheme"]["name"] == "absmax-coarse:a=4,o=4,w=4" and "calibration" not in coarse4["scheme"]
    assert coarse4["scheme"]["label"] == "W4A4-tensor+out"
    calibration = static["scheme"]["calibration"]
    assert static["scheme"]["static"] and {
        k: calibration[k] for k in ("corpus", "split", "windows", "seed")
    } == {
        "corpus": "embedded",
        "split": "train",
        "windows": 2,
        "seed": 1,
    }
    assert calibration["selection"].startswith("documents sample")
    assert static["scheme"]["calib_windows"] == 2 and static["scheme"]["calib_seed"] == 1
    # what the windows were: min(2048, context) = the micro model's 32 tokens, one more held out, their places
    taken = static["calibrated"]
    assert (taken["sample"], taken["window"], taken["windows"], taken["tokens"]) == ("documents", 32, 2, 64)
    assert taken["held_out_windows"] == 1 and len(taken["sampled"]["windows_at"]) == 2
    path = record_path(tmp_path / "results", fp["model"]["name"], coarse4["scheme"]["name"], "fake")
    assert path.name == "absmax-coarse@a=4,o=4,w=4__fake.json" and path.exists()


def test_reuse_needs_an_equal_config(tmp_path, ckpt_dir):
    spec = grid(tmp_path, ckpt_dir, SCHEMES[:1])
    run_grid(spec)
    seen = []
    run_grid(spec, on_record=lambda record, reused: seen.append(reused))
    assert seen == [True, True]  # the same config: reused
    path = next((tmp_path / "results").rglob("absmax-coarse@*__fake.json"))
    record = json.loads(path.read_text())
    record["scheme"]["out_bits"] = 8  # the same name, another config (older code, a hand edit)
    path.write_text(json.dumps(record))
    seen.clear()
    run_grid(spec, on_record=lambda record, reused: seen.append(reused))
    assert seen == [True, False]  # recomputed
    assert json.loads(path.read_text())["scheme"]["out_bits"] == 8  # the other cell's file is kept as it was
    beside = [p for p in path.parent.glob("absmax-coarse@*__fake.*.json")]
    assert len(beside) == 1 and json.loads(beside[0].read_text())["scheme"]["out_bits"] == 4


def test_calibration_windows_come_from_the_train_split(ckpt_dir):
    from qbench.eval.harness import calibration_sample
    from qbench.quant.calibrate import CalibrationData

    lm = load_model(str(ckpt_dir))
    validation = make_windows(lm.tokenizer, SMALL, 32).ids
    # the default: windows of min(2048, context) drawn across the train split's documents, 1 in 9 held out
    scheme = get_scheme("absmax-fine:static=true,calib=16")
    drawn = calibration_sample(lm.tokenizer, SMALL, 16, scheme, context=32)
    assert drawn.ids.shape == (16, 32) and drawn.held_out.shape == (
        2,
        32,
    )  # the context, not the 16 evaluated
    places = drawn.record["sampled"]["windows_at"]
    assert drawn.record["sampled"]["documents"] == 16 and len({p["source"] for p in places}) == 3
    assert not any(
        torch.equal(h, w) for h in drawn.held_out for w in drawn.ids
    )  # held out: never calibrated on
    both = torch.cat([drawn.ids, drawn.held_out])
    assert not any(torch.equal(w, v) for w in both for v in validation)  # never the evaluated text
    reseeded = calibration_sample(
        lm.tokenizer, SMALL, 16, get_scheme("absmax-fine:static=true,calib=16,calib_seed=5"), context=32
    )
    assert not torch.equal(reseeded.ids, drawn.ids)
    # --calib-sample first: the train split's first windows of the evaluation's length, as records before
    first_only = CalibrationData(sample="first")
    first = calibration_sample(
        lm.tokenizer, SMALL, 32, get_scheme("absmax-fine:static=true,calib=3"), first_only
    ).ids
    train = make_windows(
        lm.tokenizer, Protocol(split="train", tokens=3 * 32, window=32, sample="first"), 32
    ).ids
    assert torch.equal(first, train)
    sampled = calibration_sample(
        lm.tokenizer, SMALL, 32, get_scheme("absmax-fine:static=true,calib=3,calib_seed=0"), first_only
    ).ids
    assert sampled.shape == (3, 32) and not torch.equal(sampled, first)
    assert not any(torch.equal(w, v) for w in sampled for v in validation)


def test_cli_takes_overrides_and_explains_them(tmp_path, ckpt_dir, capsys):
    from qbench.cli import main

    argv = ["run", "--ckpt", str(ckpt_dir), "--tokens", "128", "--batch-size", "2", "--no-attention"]
    assert main([*argv, "--scheme", "absmax-coarse:w=4,a=4,o=4", "--output-path", str(tmp_path)]) == 0
    assert next(tmp_path.rglob("absmax-coarse@a=4,o=4,w=4__fake.json"))
    assert main([*argv, "--scheme", "absmax-coarse:w=44", "--output-path", str(tmp_path)]) == 2
    assert "w takes an integer 2–8 or none" in capsys.readouterr().err
    assert main(["ls", "schemes"]) == 0
    assert "NAME:key=value" in capsys.readouterr().out.replace("\n", " ")


def test_algorithm_records_say_what_their_statistics_are_of(tmp_path, ckpt_dir):
    spec = grid(tmp_path, ckpt_dir, ["zeropoint-int4:algo=gptq", "zeropoint-int4:algo=awq"])
    gptq, awq = (spec.scheme_record(s) for s in spec.schemes)
    assert gptq["algo"] == "gptq" and gptq["algo_params"] == {
        "damp": 0.01,
        "block": 128,
        "act_order": False,
        "sequential": True,
    }
    assert gptq["calibration"]["hessian"].startswith(
        "each block's inputs from the quantised blocks before it"
    )
    assert awq["calibration"]["statistics"].startswith("each block's inputs from the quantised blocks")
    assert rebuilt(gptq) == get_scheme("zeropoint-int4:algo=gptq")
    flat = spec.scheme_record("zeropoint-int4:algo=gptq,sequential=false")
    assert flat["calibration"]["hessian"].startswith("float model's inputs") and flat["calib_windows"] == 128


def test_calib_data_and_calib_tokens_choose_the_windows_and_are_recorded(tmp_path, ckpt_dir):
    from dataclasses import replace

    import pytest

    from models.errors import UserError
    from qbench.quant.calibrate import CalibrationData

    own = tmp_path / "calib.txt"  # a user's own calibration text, not the scored corpus
    own.write_text(
        "\n\n".join(f"Paragraph {i}: the quick brown fox jumps over the lazy dog." for i in range(60))
    )
    lm = load_model(str(ckpt_dir))
    scheme = get_scheme("absmax-fine:static=true,calib=3")
    data = CalibrationData(str(own), tokens=70, sample="first")  # rounded up to 3 windows of 32
    assert data.split() == "all" and data.windows(3, 32) == 3
    assert CalibrationData("embedded").split() == "train" and CalibrationData(tokens=64).windows(8, 32) == 2
    windows = calibration_sample(lm.tokenizer, SMALL, 32, scheme, data).ids
    expected = make_windows(
        lm.tokenizer, Protocol(corpus=str(own), split="all", tokens=3 * 32, window=32, sample="first"), 32
    )
    assert torch.equal(windows, expected.ids)
    default = calibration_sample(lm.tokenizer, SMALL, 32, scheme).ids
    assert not torch.equal(windows, default)  # not the train split of the scored corpus

    spec = replace(grid(tmp_path, ckpt_dir, ["absmax-fine:static=true,calib=3"]), calibration=data)
    _, cell = run_grid(spec)
    assert cell["status"] == "ok", cell["error"]
    assert cell["scheme"]["calibration"] == {
        "corpus": str(own),
        "split": "all",
        "requested_tokens": 70,
        "seed": None,
        "selection": "first windows",
    }
    seen = []
    run_grid(grid(tmp_path, ckpt_dir, spec.schemes), on_record=lambda r, reused: seen.append(reused))
    assert seen == [True, False]  # the default calibration is another cell: not reused for it

    for bad, message in (
        (0, "--calib-tokens must be a positive"),
        (True, "--calib-tokens must be a positive"),
    ):
        with pytest.raises(UserError, match=message):
            CalibrationData(tokens=bad)
    with pytest.raises(UserError, match="did you mean 'embedded'"):
        CalibrationData("embeded")
    scored = replace(spec, protocol=replace(SMALL, corpus=str(own)), calibration=CalibrationData(str(own)))
    from qbench.eval.harness import ModelEvaluation

    with pytest.raises(UserError, match="is the scored corpus itself"):
        ModelEvaluation(scored, str(ckpt_dir), lm=lm).check()


def test_calib_options_on_the_command_line(tmp_path, ckpt_dir, capsys):
    from qbench.cli import main

    own = tmp_path / "calib.txt"
    own.write_text("\n\n".join(f"Line {i} of calibration text for the static scales." for i in range(80)))
    argv = ["run", "--ckpt", str(ckpt_dir), "--tokens", "128", "--batch-size", "2", "--no-attention"]
    argv += ["--scheme", "absmax-fine:static=true", "--output-path", str(tmp_path / "out")]
    assert main([*argv, "--calib-data", str(own), "--calib-tokens", "64"]) == 0
    record = json.loads(next((tmp_path / "out").rglob("absmax-fine@static=true__fake.json")).read_text())
    assert record["scheme"]["calibration"]["corpus"] == str(own)
    assert record["scheme"]["calibration"]["requested_tokens"] == 64
    assert main([*argv, "--calib-tokens", "-5"]) == 2
    err = capsys.readouterr().err
    assert "--calib-tokens must be a positive number of tokens, got -5" in err and "Traceback" not in err
    for command in ("run", "grid", "algorithms", "sensitivity", "score", "card", "lm-eval"):
        with pytest.raises(SystemExit):
            main([command, "--help"])
        assert "--calib-data" in capsys.readouterr().out, command


def test_calib_sample_on_the_command_line_and_the_cards_budgets(tmp_path, ckpt_dir, capsys):
    from qbench.cli import main
    from qbench.studies.card.config import CardConfig

    argv = ["run", "--ckpt", str(ckpt_dir), "--tokens", "128", "--batch-size", "2", "--no-attention"]
    argv += ["--scheme", "absmax-fine:static=true", "--output-path", str(tmp_path / "out")]
    assert main([*argv, "--calib-sample", "first"]) == 0
    record = json.loads(next((tmp_path / "out").rglob("absmax-fine@static=true__fake.json")).read_text())
    assert record["scheme"]["calibration"]["selection"] == "first windows"
    assert record["calibrated"]["sample"] == "first" and "sampled" not in record["calibrated"]
    assert main([*argv, "--calib-sample", "frist"]) == 2
    err = capsys.readouterr().err
    assert "frist" in err and "documents" in err and "Traceback" not in err
    # the card: standard calibrates its algorithm rows on 16,384 tokens, full on the schemes' own 128 windows
    assert CardConfig(["m"], budget="standard").calibration().tokens == 16384
    assert CardConfig(["m"], budget="full").calibration().tokens is None
    given = CardConfig(["m"], budget="standard", calib_tokens=4096, calib_sample="first").calibration()
    assert (given.tokens, given.sample) == (4096, "first")
