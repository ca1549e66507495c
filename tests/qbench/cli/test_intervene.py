"""``qbench intervene``'s options: a bad --set is refused before anything is loaded."""

import argparse

import pytest

from models.errors import UserError
from qbench.cli.intervene import add_arguments, run


def test_bad_mode_is_refused_before_the_model_is_looked_for():
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    args = parser.parse_args(["--ckpt", "does-not-exist", "--set", "median"])
    with pytest.raises(UserError, match=r"'median'.*zero"):
        run(args)
