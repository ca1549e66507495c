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
    p.add_argument(
        "--kld-printout",
        action="store_true",
        help="after the table, print each quantised cell's statistics as llama-perplexity --kl-divergence prints "
        "them (Mean PPL(Q), KLD percentiles, Δp, same top p), from its per-token evidence and the float "
        "record's; cells already on disk are read back, not recomputed. With --protocol llama.cpp the same "
        "positions llama.cpp scores",
    )


def run(args: argparse.Namespace) -> None:
    from qbench.eval.harness import unsupported_cells

    spec = grid_spec(args, [args.ckpt])
    unsupported = unsupported_cells(spec)
    if unsupported:  # refused before the model is even loaded
        _, mode, why = unsupported[0]
        raise UserError(f"--mode {mode}: {why}")
    records = run_and_show(spec)
    if args.kld_printout:
        print_kld_printouts(records, spec)


def print_kld_printouts(records: list[dict], spec) -> None:
    """``--kld-printout``: llama.cpp's ``--kl-divergence`` block of every quantised cell of ``records``."""
    from rich.markup import escape

    from qbench.cli.base import console
    from qbench.eval.llamacpp_protocol import describe, render_kld_printout
    from qbench.studies.llamacpp import record_printouts

    for record, stats in record_printouts(records, spec.output_path, spec.baseline_path):
        console.print(f"\n[bold]{escape(describe(record))}[/]", highlight=False, soft_wrap=True)
        text = stats if isinstance(stats, str) else render_kld_printout(stats)
        console.print(text, highlight=False, markup=False)
