"""``qbench inspect`` on a transformers folder: metrics.json and the figures, and a bad --windows."""

import argparse
import json

import pytest

from models.errors import UserError
from qbench.cli.inspect import add_arguments, run


def _args(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    return parser.parse_args(list(argv))


def test_command_on_a_transformers_folder(hf_llama_dir, tmp_path, capsys):
    run(_args("--ckpt", str(hf_llama_dir), "--tokens", "64", "--windows", "2", "--out", str(tmp_path)))
    assert json.loads((tmp_path / "metrics.json").read_text())["model"]["kind"] == "transformers"
    assert (tmp_path / "layers.png").exists()
    with pytest.raises(UserError, match="--windows"):
        run(_args("--ckpt", str(hf_llama_dir), "--windows", "0", "--out", str(tmp_path)))
