"""``qbench grid``: evaluate models × schemes (resumable: finished cells are reused)."""

from __future__ import annotations

import argparse
import shlex

from models.errors import UserError
from qbench.cli.base import print_wide
from qbench.cli.evaluate import (
    add_eval_arguments,
    check_unsupported,
    grid_spec,
    print_record,
    run_and_show,
)

NAME = "grid"
HELP = "evaluate models × schemes (resumable: finished cells are reused)"


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_eval_arguments(p, many=True)
    p.add_argument(
        "--nproc-per-node",
        type=int,
        default=1,
        help="share the cells among K local processes (torchrun; --device cuda: one GPU each)",
    )
    p.add_argument(
        "--allow-unsupported",
        action="store_true",
        help="exit 0 even when some cells cannot run here (e.g. real mode without a real kernel); "
        "they are recorded as unsupported and listed either way",
    )


def run(args: argparse.Namespace) -> int | None:
    from qbench.eval import ranks

    rank, world_size, _ = ranks.world()
    if args.nproc_per_node < 1:
        raise UserError(f"--nproc-per-node must be at least 1, got {args.nproc_per_node}")
    if args.nproc_per_node > 1 and getattr(args, "device_map", None):
        raise UserError(
            "--nproc-per-node gives each rank one device; --device-map spreads one model over them all — use one"
        )
    if args.nproc_per_node > 1 and world_size == 1:  # relaunch this very command under torchrun
        return ranks.launch(shlex.split(args.command_line)[1:], args.nproc_per_node)
    spec = grid_spec(args, args.ckpt)
    allow = getattr(args, "allow_unsupported", False)
    if world_size == 1:
        return check_unsupported(run_and_show(spec), allow)
    records = ranks.run_grid_ranks(spec, on_record=print_record if rank == 0 else None)
    if records is not None:
        from qbench.eval.report import rich_table

        print_wide(rich_table(records))
        return check_unsupported(records, allow)
    return None
