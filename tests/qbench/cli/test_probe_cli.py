"""Hostile or unusual command lines of the newer surface (KV keep options, score's breaking points, sweep's KV
flags, ``ls results``, ``recipes``, ``speed``'s layer shape): each ends in one line naming the bad value and
what to do, with exit status 2 — never a traceback, never exit 0 when nothing (or something else) was done."""

from __future__ import annotations

import argparse
import shutil

import pytest

from tests.qbench.cli_probe import refused, run

FAST = ["--tokens", "64", "--no-attention"]


# ------------------------------------------------------------------ --kv-keep-sinks covering the whole window


def test_run_refuses_keep_sinks_that_keep_every_position(ckpt_dir, tmp_path, capsys):
    out = tmp_path / "r"
    argv = ["run", "--ckpt", ckpt_dir, "--scheme", "fp", "--kv-bits", "2", "--kv-scheme", "per-token"]
    refused(
        [*argv, "--kv-keep-sinks", "1000", "--output-path", out, *FAST],
        capsys,
        "--kv-keep-sinks 1000",
        "every position of the 32-token window",
        "below 32",
    )
    assert not [p for p in out.rglob("*.json") if "sinks1000" in p.name]  # no record labelled as quantised


@pytest.mark.parametrize("axes", ["kv", "w,kv"])
def test_sweep_refuses_keep_sinks_that_keep_every_position(ckpt_dir, tmp_path, capsys, axes):
    """Refused before any cell runs: the KV groups come after the weight cells and after other KV widths, so a
    check made as each group starts let the sweep evaluate (and write) those first."""
    argv = ["sweep", "--ckpt", ckpt_dir, "--axes", axes, "--bits", "4,2", "--kv-scheme", "per-token"]
    out = tmp_path / "s"
    refused([*argv, "--kv-keep-sinks", "1000", "--output-path", out, *FAST], capsys, "--kv-keep-sinks 1000")
    assert not (out / "sweep.json").exists()
    assert not list(out.rglob("*.json"))  # no cell at all: not the float baseline, not the weight cells


# ------------------------------------------------------------------------ score --breaking-points' KV options


def _score_sweep(argv: list[str]):
    from qbench.cli.args import kv_from_args, protocol_from_args
    from qbench.cli.score import _sweep_config, add_arguments

    parser = argparse.ArgumentParser()
    add_arguments(parser)
    args = parser.parse_args(["--ckpt", "x", "--breaking-points", "--sweep-axes", "kv", *argv])
    return _sweep_config(args, protocol_from_args(args), kv_from_args(args))


def test_score_breaking_points_sweep_the_given_kv_scheme_and_keep_first():
    from qbench.studies.sweep import _kv_config, _plan

    cfg = _score_sweep(["--kv-bits", "4", "--kv-scheme", "per-token", "--kv-keep-first", "1"])
    cells, _ = _plan(cfg)
    labels = {_kv_config(cfg, c, 256).label for c in cells}
    assert "kv4-tok-keep1" in labels and "kv2-tok-keep1" in labels
    assert all("-tok" in label for label in labels)  # the given scheme, never kivi
    # the scheme's own options carry over, its bit width (which the sweep varies) does not
    cfg = _score_sweep(["--kv-scheme", "kivi:group=16,residual=32,bits=2", "--kv-keep-sinks", "2"])
    labels = {_kv_config(cfg, c, 256).label for c in _plan(cfg)[0]}
    assert {"kv8-g16r32", "kv8-g16r32-sinks2", "kv2-g16r32-sinks2"} <= labels
    # no --kv-scheme: the sweep's own default scheme, with the keep-first curve
    cfg = _score_sweep(["--kv-bits", "4", "--kv-keep-first", "1"])
    assert cfg.kv_schemes == [None] and cfg.kv_keep_first == [1]


# --------------------------------------------------------------------------- sweep's KV flags without the kv axis


@pytest.mark.parametrize(
    "flags, named",
    [
        (["--kv-bits", "4"], "--kv-bits"),
        (["--kv-keep-first", "1"], "--kv-keep-first"),
        (["--kv-scheme", "per-token"], "--kv-scheme"),
    ],
)
def test_sweep_refuses_kv_flags_without_the_kv_axis(flags, named, tmp_path, capsys):
    argv = ["sweep", "--ckpt", tmp_path / "never-loaded", "--axes", "w", *flags]
    refused([*argv, "--output-path", tmp_path / "s"], capsys, named, "--axes w,kv")
    assert not (tmp_path / "s").exists()


# --------------------------------------------------------------------------------------------------- ls results


def test_ls_results_refuses_a_missing_folder_and_a_file(tmp_path, capsys):
    refused(
        ["ls", "results", "--output-path", tmp_path / "nope"], capsys, "nope does not exist", "--output-path"
    )
    (tmp_path / "f.json").write_text("{}")
    refused(["ls", "results", "--output-path", tmp_path / "f.json"], capsys, "f.json is a file")
    code, out, _ = run(["ls", "results", "--output-path", tmp_path], capsys)
    assert code == 0 and "results in" in out


# ------------------------------------------------------------------------------------------------------ recipes


RECIPES = ["recipes", "--estimate", "--recipes", "vanilla"]


def test_recipes_refuses_a_file_as_ckpt_root(tmp_path, capsys):
    (tmp_path / "afile").write_text("x")
    refused([*RECIPES, "--ckpt-root", tmp_path / "afile"], capsys, "--ckpt-root", "afile is a file")


def test_recipes_refuses_a_bad_trainer_argument_in_one_line(tmp_path, capsys):
    argv = [*RECIPES, "--ckpt-root", tmp_path / "c"]
    refused([*argv, "--train-arg=--bogus"], capsys, "--bogus", "python -m trainers --help")
    refused([*argv, "--train-arg=--lr", "--train-arg=x"], capsys, "'x'")
    refused([*argv, "--train-arg=--help"], capsys, "--help")


def test_recipes_refuses_trainer_arguments_the_panel_sets(tmp_path, capsys):
    argv = [*RECIPES, "--ckpt-root", tmp_path / "c"]
    refused(
        [*argv, "--train-arg=--preset", "--train-arg=small"],
        capsys,
        "--preset small",
        "qbench recipes --preset small",
    )
    refused([*argv, "--train-arg=--pres=small"], capsys, "--preset small")  # argparse's abbreviations too
    refused([*argv, "--train-arg=--resume"], capsys, "--resume")
    # what makes a recipe the recipe, and the panel's style: a vanilla row trained with softmax-1 is no vanilla row
    refused([*argv, "--train-arg=--attn=softmax1"], capsys, "--attn softmax1", "--recipes")
    refused([*argv, "--train-arg=--optim", "--train-arg=muon"], capsys, "--optim muon", "optimiser")
    refused([*argv, "--train-arg=--no-bias"], capsys, "--train-arg --no-bias sets", "style")
    refused([*argv, "--train-arg=--pos=rope"], capsys, "--pos rope", "style")
    refused([*argv, "--train-arg=--head-proj"], capsys, "--head-proj", "OSP's projections")
    refused([*argv, "--train-arg=--set", "--train-arg=pos=rope"], capsys, "--set pos=rope", "style")
    refused([*argv, "--train-arg=--set", "--train-arg=attn=softmax1"], capsys, "--set attn=softmax1")


def test_recipes_refuses_a_ckpt_root_holding_an_init_checkpoint(ckpt_dir, tmp_path, capsys):
    refused([*RECIPES, "--ckpt-root", ckpt_dir], capsys, "is a model checkpoint itself")
    shutil.copytree(ckpt_dir, tmp_path / "root" / "vanilla")
    refused(
        [*RECIPES, "--ckpt-root", tmp_path / "root"],
        capsys,
        "vanilla holds a model checkpoint without trainer state",
        "neither resume it nor overwrite it",
    )


# ------------------------------------------------------------------------------------------ speed's layer shape


@pytest.mark.parametrize(
    "flags, needle",
    [
        (["--in-features", "0"], "--in-features must be a positive number of features"),
        (["--in-features", "-4"], "got -4"),
        (["--out-features", "0"], "--out-features must be a positive number of features"),
        (["--in-features", "10000000000"], "GiB is available"),
    ],
)
def test_speed_refuses_impossible_layer_shapes(flags, needle, capsys):
    argv = [
        "speed",
        "--no-model",
        "--no-kv",
        "--no-peers",
        "--repeats",
        "1",
        "--tokens",
        "4",
        "--scheme",
        "int4",
    ]
    refused([*argv, *flags], capsys, needle)
