"""``qbench score``'s options and printout."""

import argparse
import json

import pytest

from models.errors import UserError
from qbench.cli.score import add_arguments, run


def test_bad_scheme_is_a_did_you_mean_error(ckpt_dir, tmp_path):
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    args = parser.parse_args(
        ["--ckpt", str(ckpt_dir), "--scheme", "absmax-fin", "--output-path", str(tmp_path)]
    )
    with pytest.raises(UserError, match="did you mean 'absmax-fine'"):
        run(args)
    assert not any(tmp_path.iterdir())  # refused before anything ran


def test_command_prints_and_writes_the_score(ckpt_dir, tmp_path, capsys):
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    argv = ["--ckpt", str(ckpt_dir), "--tokens", "64", "--scheme", "int4", "--no-attention"]
    run(parser.parse_args([*argv, "--output-path", str(tmp_path), "--json", str(tmp_path / "s.json")]))
    written = json.loads((tmp_path / "s.json").read_text())
    assert list(written["schemes"]) == ["zeropoint-int4"]
    assert f"robustness {written['robustness']:.4f}" in capsys.readouterr().out
