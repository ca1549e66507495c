"""A probe of ``speed --from-json``, ``speed --new-tokens`` and ``recipes``' learning rates: each bad input
ends in one line naming the file or flag, the bad value and what is valid, exit status 2, nothing written."""

from __future__ import annotations

import json

import pytest

from qbench.studies import llamacpp
from tests.qbench.cli_probe import refused, run

# ------------------------------------------------------------------------------------ speed --from-json's files


def _llama_row(ratio: float | None = 0.9, timings: tuple[float, ...] = (1.2345, 1.3456), **changes) -> dict:
    """A llama.cpp generation record as ``llamacpp.annotate`` leaves it, with its repeat timings."""
    row = {
        "kind": "generate",
        "name": "llama.cpp Q8_0",
        "model": "m",
        "threads": 1,
        "cpu": "c",
        "prompt_tokens": 16,
        "new_tokens": 8,
        "llama_cpp_type": "Q8_0",
        "qbench_match": "absmax-fine:head=true [real]",
        "qbench_vs_llama_cpp": ratio,
        "ms_repeats": list(timings),
    }
    return row | changes


def _write(path, records) -> str:
    path.write_text(json.dumps({"records": records, "git_commit": "abc"}))
    return str(path)


@pytest.fixture
def good(tmp_path) -> str:
    return _write(tmp_path / "good.json", [_llama_row()])


@pytest.fixture
def other(tmp_path) -> str:
    """A second, independent run of the same comparison."""
    return _write(tmp_path / "other.json", [_llama_row(0.92, (2.1, 2.2))])


@pytest.mark.parametrize(
    "content, needles",
    [
        ({"records": [1, 2]}, ["record 1 is 1, not an object"]),
        ({"records": ["a", "b"]}, ['record 1 is "a", not an object']),
        ({"records": [_llama_row("0.9")]}, ["'llama.cpp Q8_0'", 'qbench_vs_llama_cpp "0.9", not a number']),
        ({"records": [_llama_row(True)]}, ["qbench_vs_llama_cpp true, not a number"]),
        ({"records": [_llama_row(-1.0)]}, ["qbench_vs_llama_cpp -1.0, not a ratio > 0"]),
        ({"records": [_llama_row(timings=("1",))]}, ['ms_repeats ["1"], not a list of numbers']),
        ({"records": [_llama_row(model=["m"])]}, ['model ["m"], not a single value']),
        ([1], ['no "records" at its top level']),
        ({"records": 3}, ["its records are not a list"]),
        (b"\xff\xfe\x00garbage", ["not UTF-8 text"]),
        (b"not json {", ["not JSON"]),
    ],
)
@pytest.mark.parametrize("pooled", [False, True], ids=["alone", "pooled"])
def test_from_json_refuses_a_malformed_file_naming_it(tmp_path, capsys, good, content, needles, pooled):
    bad = tmp_path / "bad.json"
    if isinstance(content, bytes):
        bad.write_bytes(content)
    else:
        bad.write_text(json.dumps(content))
    refused(["speed", "--from-json", *([good] if pooled else []), bad], capsys, str(bad), *needles)


def test_from_json_refuses_a_record_it_cannot_show(tmp_path, capsys):
    """A record of the right types but not a speed figure (a field the table needs is missing) fails in one line
    naming the file, where it raised a KeyError from inside the table."""
    bad = _write(tmp_path / "bare.json", [{"kind": "layer", "name": "x", "ms": 1.0}])
    refused(["speed", "--from-json", bad], capsys, bad, "is not a qbench speed --output-path file", "has no")


def test_from_json_refuses_a_copied_run(tmp_path, capsys, good, other):
    """A run copied under another name was pooled as a second run: 0.90 / 0.90, an interval of zero width and the
    verdict "met" from one measurement. Refused, both files named, also when the copy was edited since (its
    timings are still the first run's) or re-written with another layout."""
    copy = tmp_path / "copy.json"
    copy.write_text(json.dumps(json.loads((tmp_path / "good.json").read_text()), indent=4))
    refused(
        ["speed", "--from-json", good, other, copy, "--goal", "0.8"],
        capsys,
        f"--from-json {copy} is the same run as {good}",
        "identical records",
        "give each run once",
    )
    edited = _write(tmp_path / "edited.json", [_llama_row(0.95)])
    refused(
        ["speed", "--from-json", good, edited],
        capsys,
        f"{edited} is the same run as {good}",
        "identical repeat timings of 'llama.cpp Q8_0'",
    )
    code, out, _ = run(["speed", "--from-json", good, other, "--goal", "0.8"], capsys)
    assert code == 0 and "0.90 / 0.92" in out


def test_from_json_refuses_a_file_that_adds_no_run(tmp_path, capsys, good, other):
    """A file without llama.cpp rows, or whose llama.cpp rows have no ratio, was pooled silently: the table read
    as if every file counted. Refused, named."""
    layer_only = _write(tmp_path / "layer.json", [{"kind": "layer", "name": "x", "ms_repeats": [9.9]}])
    refused(
        ["speed", "--from-json", good, layer_only],
        capsys,
        f"--from-json {layer_only} adds no run",
        "no llama.cpp rows",
        "drop it",
    )
    failed = _write(tmp_path / "failed.json", [_llama_row(None, (4.1,))])
    refused(
        ["speed", "--from-json", good, other, failed],
        capsys,
        f"{failed} adds no run",
        "no qbench / llama.cpp ratio",
    )


def test_from_json_table_says_which_runs_gave_each_comparison(tmp_path, capsys, good, other):
    """A run of another comparison (two threads) is its own row: the runs column and the list under the table say
    which file gave which ratio."""
    threads2 = _write(tmp_path / "t2.json", [_llama_row(0.7, (5.1,), threads=2)])
    code, out, _ = run(["speed", "--from-json", good, other, threads2, "--format", "md"], capsys)
    assert code == 0, out
    lines = out.splitlines()
    (pooled,) = [line for line in lines if "0.90 / 0.92" in line]
    (alone,) = [line for line in lines if "| 0.70" in line]
    assert "| 1, 2 " in pooled and "| 3 " in alone
    assert f"Runs: 1 = {good}, 2 = {other}, 3 = {threads2}." in out


def test_across_runs_numbers_the_runs_each_ratio_comes_from():
    runs = [[_llama_row(0.9)], [_llama_row(None, (3.0,))], [_llama_row(0.8, (4.0,))]]
    (row,) = llamacpp.across_runs(runs)
    assert row["ratios"] == [0.9, 0.8] and row["run_numbers"] == [1, 3]
    assert llamacpp.same_run(runs[0], [_llama_row(0.5)]) == "identical repeat timings of 'llama.cpp Q8_0'"
    assert llamacpp.same_run(runs[0], runs[2]) is None
    assert llamacpp.ratios_of(runs[1]) == 0 and llamacpp.ratios_of(runs[2]) == 1


# ------------------------------------------------------------------------ speed --new-tokens beyond the context

SPEED = ["speed", "--no-kv", "--no-peers", "--repeats", 1, "--scheme", "absmax-fine", "--mode", "real"]
SPEED += ["--in-features", 8, "--out-features", 8, "--tokens", 1, "--model-tokens", 8]


@pytest.fixture
def no_timing(monkeypatch):
    """Any timing fails the test: the refusal must come first."""
    from qbench.studies import speed

    def timed(*_, **__):
        raise AssertionError("timed before the refusal")

    monkeypatch.setattr(speed, "time_interleaved", timed)


def test_speed_refuses_new_tokens_beyond_a_presets_context(tmp_path, capsys, no_timing, monkeypatch):
    """Was exit 0 with "ValueError: sequence length 129 exceeds the model's context…" in every generation row."""
    from qbench.studies import speed

    monkeypatch.setattr(speed, "_load_model", lambda *_: pytest.fail("built before the refusal"))
    out = tmp_path / "speed.json"
    refused(
        [*SPEED, "--model", "tiny", "--new-tokens", 300, "--json", out],
        capsys,
        "--new-tokens 300",
        "tiny's context of 128 tokens",
        "16-token prompt",
        "the largest valid --new-tokens is 113",
        "--no-generate",
    )
    assert not out.exists()


@pytest.mark.parametrize("folder", ["ckpt_dir", "hf_gpt2_dir"])
def test_speed_refuses_new_tokens_beyond_a_checkpoints_context(folder, request, tmp_path, capsys, no_timing):
    """A checkpoint's context is known once loaded: refused then, before the per-layer figures are timed."""
    out = tmp_path / "speed.json"
    ckpt = request.getfixturevalue(folder)
    refused(
        [*SPEED, "--ckpt", ckpt, "--new-tokens", 20, "--json", out],
        capsys,
        "--new-tokens 20",
        "context of 32 tokens",
        "the largest valid --new-tokens is 17",
    )
    assert not out.exists()


def test_generation_fits_up_to_the_last_position():
    """The last new token is never fed back: prompt + new tokens − 1 positions, the context exactly at the limit."""
    from models.errors import UserError
    from qbench.studies.speed import PROMPT_TOKENS, check_generation_fits

    check_generation_fits("m", 128, 128 - PROMPT_TOKENS + 1)
    with pytest.raises(UserError, match="largest valid --new-tokens is 113"):
        check_generation_fits("m", 128, 114)
    with pytest.raises(UserError, match="no --new-tokens fits: pass --no-generate"):
        check_generation_fits("m", 8, 1)


# ------------------------------------------------------------------------------------------ recipes' learning rates

RECIPES = ["recipes", "--estimate", "--recipes", "vanilla"]


@pytest.mark.parametrize(
    "flags, needle",
    [
        (["--lr", "inf"], "--lr inf"),
        (["--lr", "nan"], "--lr nan"),
        (["--lr=-0.001"], "--lr -0.001"),
        (["--lr", "0"], "--lr 0"),
        (["--lr-sweep", "0.001", "inf"], "--lr-sweep inf"),
    ],
)
def test_recipes_refuses_a_learning_rate_that_is_not_finite_and_positive(flags, needle, tmp_path, capsys):
    root = tmp_path / "ckpts"
    refused([*RECIPES, "--ckpt-root", root, *flags], capsys, needle, "a finite number > 0")
    assert not root.exists()


@pytest.mark.parametrize(
    "chosen, shown",
    [
        (float("inf"), "Infinity"),
        (True, "true"),
        (False, "false"),
        (-0.001, "-0.001"),
        (0, "0"),
        ("0.001", '"0.001"'),
        (float("nan"), "NaN"),
    ],
)
def test_recipes_refuses_a_bad_learning_rate_in_lr_from(chosen, shown, tmp_path, capsys):
    """Infinity and true were trained at; -0.001 said "chose no learning rate for vanilla (it has: vanilla)"."""
    sweep = tmp_path / "lr_sweep.json"
    sweep.write_text(json.dumps({"recipes": {"vanilla": {"chosen": chosen}, "paper": {"chosen": 0.002}}}))
    root = tmp_path / "ckpts"
    refused(
        [*RECIPES, "--ckpt-root", root, "--lr-from", sweep],
        capsys,
        f"--lr-from {sweep}: the learning rate chosen for vanilla is {shown}",
        "a finite number > 0",
    )
    assert not root.exists()


def test_recipes_lr_from_still_names_a_recipe_the_sweep_did_not_choose_for(tmp_path, capsys):
    sweep = tmp_path / "lr_sweep.json"
    sweep.write_text(json.dumps({"recipes": {"vanilla": {"chosen": None}, "paper": {"chosen": 0.002}}}))
    refused(
        [*RECIPES, "--ckpt-root", tmp_path / "c", "--lr-from", sweep],
        capsys,
        "chose no learning rate for vanilla (it has: paper)",
    )


def test_speed_json_on_stdout_stays_json_with_the_peak_memory_line_on_stderr(capsys):
    from qbench.cli import main

    args = ["speed", "--model", "tiny", "--no-layer", "--no-kv", "--no-generate", "--scheme", "absmax-fine"]
    assert main([*args, "--repeats", "1", "--model-tokens", "8", "--output-path", "-"]) == 0
    out, err = capsys.readouterr()
    payload = json.loads(out)  # nothing but the records on stdout
    assert any(r["name"] == "absmax-fine [real]" for r in payload["records"])
    assert "peak memory" in err
