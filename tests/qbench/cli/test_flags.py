"""Every subcommand's parser, walked: one spelling per shared option, a help text with its default for every option,
one named token budget per kind of work, and single-value options that refuse a second value."""

from __future__ import annotations

import argparse
import dataclasses

import pytest

from qbench.cli import build_parser, main
from qbench.cli.budgets import BUDGETS, DEMO_TOKENS, EVAL_TOKENS, PAPER_TOKENS, TIMING_TOKENS, UNIT_TOKENS

# the commands that write files (env, ls and compare only read; train is the trainer's own parser)
WRITERS = {
    "init",
    "export",
    "run",
    "grid",
    "inspect",
    "intervene",
    "score",
    "lm-eval",
    "sensitivity",
    "speed",
    "demo",
    "sweep",
    "card",
    "emergence",
    "reproduce",
    "recipes",
    "algorithms",
    "plan",
    "data",
}
TOKEN_DEFAULTS = {  # command -> (option dest, its budget)
    "run": ("tokens", EVAL_TOKENS),
    "grid": ("tokens", EVAL_TOKENS),
    "score": ("tokens", EVAL_TOKENS),
    "sweep": ("tokens", EVAL_TOKENS),
    "inspect": ("tokens", EVAL_TOKENS),
    "intervene": ("tokens", EVAL_TOKENS),
    "emergence": ("tokens", EVAL_TOKENS),
    "sensitivity": ("tokens", UNIT_TOKENS),
    "demo": ("tokens", DEMO_TOKENS),
    "reproduce": ("eval_tokens", PAPER_TOKENS),
    "recipes": ("tokens", DEMO_TOKENS),
    "algorithms": ("tokens", EVAL_TOKENS),
    "plan": ("tokens", EVAL_TOKENS),
    "speed": ("tokens", TIMING_TOKENS),
}
BUDGET_DESTS = {"tokens", "eval_tokens", "model_tokens"}


@pytest.fixture(scope="module")
def commands() -> dict[str, argparse.ArgumentParser]:
    parser = build_parser()
    (sub,) = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    return {name: p for name, p in sub.choices.items() if name != "train"}


def options(parser: argparse.ArgumentParser) -> dict[str, argparse.Action]:
    return {s: a for a in parser._actions for s in a.option_strings}


def test_the_walk_sees_every_command(commands):
    assert WRITERS | {"env", "ls", "compare"} == set(commands)


def test_every_writer_has_output_path_and_the_old_spellings_are_its_aliases(commands):
    for name, parser in commands.items():
        opts = options(parser)
        if name in WRITERS:
            assert opts.get("--output-path") is not None and opts["--output-path"].dest == "output_path", name
        for old in ("--out", "--json"):
            if old not in opts or (name, old) == ("score", "--json"):
                # score's --output-path is the records folder, as in run (the two share cells); its --json is a
                # second output, the score itself
                continue
            assert opts[old] is opts["--output-path"], f"{name} {old} is not an alias of --output-path"


def test_the_kv_width_is_spelled_kv_bits(commands):
    for name, parser in commands.items():
        bit_options = {s for s in options(parser) if "bits" in s}
        # sweep's --bits lists the widths of every axis it sweeps, the KV cache's included
        assert bit_options <= ({"--kv-bits", "--bits"} if name == "sweep" else {"--kv-bits"}), name
    for name in ("run", "grid", "score", "sensitivity", "sweep"):
        assert "--kv-bits" in options(commands[name]), name


def test_every_option_has_a_help_that_shows_its_default(commands):
    for name, parser in commands.items():
        formatter = parser._get_formatter()
        for action in parser._actions:
            if isinstance(action, argparse._HelpAction):
                continue
            shown = formatter._expand_help(action) if action.help else ""
            assert shown.strip(), f"{name} {action.option_strings or action.dest}: no help"
            if not action.option_strings or action.default in (None, False, argparse.SUPPRESS):
                continue
            default = (
                action.option_strings[0 if action.default else 1] if action.nargs == 0 else action.default
            )
            assert f"(default: {default})" in shown, f"{name} {action.option_strings[0]}: {shown!r}"


def test_token_defaults_are_the_named_budgets(commands):
    for name, parser in commands.items():
        for action in parser._actions:
            if action.dest in BUDGET_DESTS and action.default is not None:
                assert action.default in BUDGETS.values(), (name, action.dest, action.default)
    for name, (dest, budget) in TOKEN_DEFAULTS.items():
        assert commands[name].get_default(dest) == budget, name


def test_the_budgets_are_the_ones_the_studies_use():
    from qbench.eval.metrics import Protocol
    from qbench.studies.demo import DemoConfig
    from qbench.studies.reproduce import ReproduceConfig

    assert Protocol().tokens == EVAL_TOKENS
    assert DemoConfig().eval_tokens == DEMO_TOKENS
    from qbench.cli.budgets import DEMO_LONG_STEPS, DEMO_STEPS
    from qbench.studies.demo import LONG
    from qbench.studies.recipes import RecipesConfig

    assert DemoConfig().steps == RecipesConfig().steps == DEMO_STEPS  # the panel trains at the demo's budget
    assert LONG.steps == DEMO_LONG_STEPS
    (field,) = [f for f in dataclasses.fields(ReproduceConfig) if f.name == "eval_tokens"]
    assert field.default == PAPER_TOKENS


def test_version(capsys):
    import qbench

    with pytest.raises(SystemExit) as exit_:
        main(["--version"])
    assert exit_.value.code == 0
    out = capsys.readouterr().out
    assert out.startswith(f"qbench {qbench.__version__}") and len(out.splitlines()) == 1


@pytest.mark.parametrize(
    "argv, dest, value",
    [
        (["init", "--out", "d"], "output_path", "d"),
        (["emergence", "r", "--out", "d"], "output_path", "d"),
        (["data", "prepare", "--out", "d"], "output_path", "d"),
        (["inspect", "--ckpt", "c", "--out", "d"], "output_path", "d"),
        (["sensitivity", "--ckpt", "c", "--scheme", "s", "--out", "d"], "output_path", "d"),
        (["speed", "--json", "f"], "output_path", "f"),
        (["intervene", "--ckpt", "c", "--json", "f"], "output_path", "f"),
        (["lm-eval", "--ckpt", "c", "--tasks", "t", "--json", "f"], "output_path", "f"),
        (["score", "--ckpt", "c", "--json", "f"], "json", "f"),
        (["export", "c", "d"], "out", "d"),
        (["grid", "--ckpt", "a", "--ckpt", "b"], "ckpt", ["a", "b"]),  # grid takes many models
        (["run", "--ckpt", "a", "--ckpt", "a"], "ckpt", "a"),  # the same value twice loses nothing
    ],
)
def test_old_spellings_and_repeatable_options_still_parse(argv, dest, value):
    assert getattr(build_parser().parse_args(argv), dest) == value


def test_the_bookkeeping_of_repeated_options_stays_out_of_the_namespace():
    args = build_parser().parse_args(["run", "--ckpt", "a", "--tokens", "8"])
    assert not [k for k in vars(args) if k.startswith("_")]


@pytest.mark.parametrize(
    "argv, flag, first, second",
    [
        (["sensitivity", "--ckpt", "c", "--scheme", "A", "--scheme", "B"], "--scheme", "'A'", "'B'"),
        (["run", "--ckpt", "a", "--ckpt", "b"], "--ckpt", "'a'", "'b'"),
        (["run", "--ckpt", "a", "--tokens", "64", "--tokens", "128"], "--tokens", "64", "128"),
        (["init", "--out", "x", "--output-path", "y"], "--output-path", "'x'", "'y'"),
        (
            ["lm-eval", "--ckpt", "c", "--tasks", "t", "--scheme", "fp", "--scheme", "int4"],
            "--scheme",
            "fp",
            "int4",
        ),
    ],
)
def test_a_single_value_option_given_twice_is_a_one_line_error(argv, flag, first, second, capsys):
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "Traceback" not in err
    assert flag in err and first in err and second in err and "given twice" in err
