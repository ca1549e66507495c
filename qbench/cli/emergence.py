"""``qbench emergence``: training-probe curves of runs (kurtosis, max |act|, sink) → JSON/PNG/md."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from models.errors import UserError
from qbench.cli.base import add_output_argument
from qbench.cli.budgets import EVAL_TOKENS
from qbench.cli.evaluate import (
    print_record,
)

NAME = "emergence"
HELP = "training-probe curves of runs (kurtosis, max |act|, sink) → JSON/PNG/md"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("runs", nargs="+", help="training run folders (with metrics.jsonl)")
    add_output_argument(p, "output folder", "--out", required=True, metavar="DIR")
    p.add_argument(
        "--snapshots",
        metavar="ROOT",
        help="also the quantisation curve: evaluate the checkpoints in ROOT/<run name>/*/ (resumable)",
    )
    p.add_argument("--scheme", action="append", help="with --snapshots: schemes (default: the paper's four)")
    p.add_argument("--mode", action="append", help="with --snapshots: fake (default) | real; repeatable")
    p.add_argument(
        "--tokens", type=int, default=EVAL_TOKENS, help="with --snapshots: evaluation tokens per snapshot"
    )
    p.add_argument("--no-attention", action="store_true", help="with --snapshots: skip attention statistics")


def run(args: argparse.Namespace) -> None:
    from qbench.studies.emergence import quantisation_curve, read_curves, write_emergence

    runs, out = [Path(r) for r in args.runs], Path(args.output_path)
    read_curves(runs)  # missing or same-named run folders fail here, before any snapshot is evaluated
    quantisation = None
    if args.snapshots:
        from qbench.eval.harness import GridSpec, check_modes, expand_schemes
        from qbench.eval.metrics import Protocol

        if args.tokens < 2:
            raise UserError(f"--tokens must be at least 2, got {args.tokens}")
        spec = GridSpec(
            models=[],
            schemes=expand_schemes(args.scheme or ["paper"]),
            modes=check_modes(args.mode or ["fake"]),
            protocol=Protocol(tokens=args.tokens),
            output_path=out / "quantisation",
            attention=not args.no_attention,
        )
        quantisation = quantisation_curve([r.name for r in runs], Path(args.snapshots), spec, print_record)
    path = write_emergence(runs, out, args.command_line, quantisation)
    sys.stdout.write(path.read_text())
