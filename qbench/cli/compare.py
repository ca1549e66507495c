"""``qbench compare``: table of results: rows = models, columns = fp then schemes."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from models.errors import UserError
from qbench.cli.base import add_output_argument, console, print_wide
from qbench.cli.evaluate import (
    print_record,
)

NAME = "compare"
HELP = "table of results: rows = models, columns = fp then schemes"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "names",
        nargs="+",
        help="a results folder, a model's name under --output-path, or a "
        "checkpoint ckpts/NAME (evaluated with the paper's schemes if it has no results yet)",
    )
    p.add_argument("--format", default="table", help="table | md | csv | latex | json")
    add_output_argument(
        p,
        "the results folder names are looked up in (and a bare checkpoint's new records are written to)",
        default="qbench_results",
        metavar="DIR",
    )
    p.add_argument(
        "--breaking-points",
        action="store_true",
        help="add each model's breaking points from the sweep.json files under the named folders (decided on "
        "--metric kld or top1, the cells show that metric's interval)",
    )
    p.add_argument("--sweep", action="append", help="add breaking points from this sweep.json (repeatable)")


def _records_for(name: str, output_path: Path) -> list[dict]:
    """Resolve a ``compare`` argument (rule in the ``compare`` help) to its records."""
    from qbench.eval.load import resolve
    from qbench.eval.report import read_records

    for folder in (Path(name), output_path / name):
        if folder.is_dir() and (records := read_records(folder)):
            return records
    try:
        resolve(name)
    except UserError:
        raise UserError(
            f"no results named {name!r}: not a results folder, not {output_path / name}, "
            f"and not a checkpoint (ckpts/{name}); run `qbench grid --ckpt {name}` first"
        ) from None
    from qbench.eval.harness import PAPER_SCHEMES, GridSpec, run_grid

    console.print(f"[dim]no results for {name!r} yet: evaluating it with the paper's schemes[/]")
    return run_grid(
        GridSpec(
            models=[name],
            schemes=list(PAPER_SCHEMES),
            output_path=output_path,
        ),
        on_record=print_record,
    )


def _breaking_point_columns(args: argparse.Namespace) -> tuple[dict[str, dict[str, str]], str]:
    """Breaking-point columns from ``--sweep`` files, else from the sweep.json files under the named folders, and
    the metric their verdicts were decided on (the one the table's cells then show: ppl when the sweeps differ)."""
    from qbench.eval.tolerance import DEFAULT_METRIC
    from qbench.studies.sweep import breaking_point_columns, read_sweep

    paths = [Path(p) for p in args.sweep or ()]
    if not paths:
        for name in args.names:
            for folder in (Path(name), Path(args.output_path) / name):
                if folder.is_dir():
                    paths += sorted(folder.rglob("sweep.json"))
                    break
    if not paths:
        raise UserError(
            f"--breaking-points: no sweep.json under {', '.join(args.names)}; run `qbench sweep` "
            "or name a sweep with --sweep PATH"
        )
    columns: dict[str, dict[str, str]] = {}
    metrics = set()
    for path in dict.fromkeys(paths):
        sweep = read_sweep(path)
        metrics.add(sweep.get("metric") or DEFAULT_METRIC)
        for model, cols in breaking_point_columns(sweep).items():
            columns.setdefault(model, {}).update(cols)
    return columns, metrics.pop() if len(metrics) == 1 else DEFAULT_METRIC


def run(args: argparse.Namespace) -> None:
    from qbench.eval.report import FORMATS, render, rich_table

    if args.format not in FORMATS:
        from models.errors import unknown_choice

        raise unknown_choice("format", args.format, FORMATS)
    records = [r for name in args.names for r in _records_for(name, Path(args.output_path))]
    extra, metric = _breaking_point_columns(args) if args.breaking_points or args.sweep else (None, "ppl")
    if args.format == "table":
        print_wide(rich_table(records, extra=extra, metric=metric))
    else:
        sys.stdout.write(render(records, args.format, extra=extra, metric=metric))
