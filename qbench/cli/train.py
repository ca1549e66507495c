"""``qbench train``: train a checkpoint: same options as `python -m trainers` (qbench train -h)."""

from __future__ import annotations

import argparse

NAME = "train"
HELP = "train a checkpoint: same options as `python -m trainers` (qbench train -h)"
PARSER_OPTIONS = {"add_help": False}


def add_arguments(p: argparse.ArgumentParser) -> None:
    del p  # no options


def run(args: argparse.Namespace) -> int:
    from trainers.__main__ import main as train_main

    return train_main([])
