"""``qbench run``: evaluate one model under one or more schemes."""

from __future__ import annotations

import argparse

from models.errors import UserError
from qbench.cli.evaluate import (
    add_eval_arguments,
    grid_spec,
    run_and_show,
)

NAME = "run"
HELP = "evaluate one model under one or more schemes"


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_eval_arguments(p)


def run(args: argparse.Namespace) -> None:
    from qbench.eval.harness import unsupported_cells

    spec = grid_spec(args, [args.ckpt])
    unsupported = unsupported_cells(spec)
    if unsupported:  # refused before the model is even loaded
        _, mode, why = unsupported[0]
        raise UserError(f"--mode {mode}: {why}")
    run_and_show(spec)
