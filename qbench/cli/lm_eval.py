"""``qbench lm-eval``: the options and the printout; the adapter is :mod:`qbench.studies.lm_eval_adapter`."""

from __future__ import annotations

import argparse
from pathlib import Path

from models.io import atomic_write_json
from qbench.cli.args import (
    add_calibration_arguments,
    add_load_arguments,
    calibration_from_args,
    console,
    load_from_args,
)
from qbench.cli.base import add_output_argument

NAME = "lm-eval"
HELP = "run lm-evaluation-harness tasks on the quantised in-memory model"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_load_arguments(parser)
    parser.add_argument("--scheme", default="fp", help="scheme name (qbench ls schemes) or fp (float)")
    parser.add_argument("--mode", default="fake", help="fake | real")
    parser.add_argument("--tasks", required=True, help="comma-separated lm-eval task names")
    parser.add_argument("--include-path", help="folder of local task YAMLs (offline use; default: none)")
    parser.add_argument(
        "--limit", type=float, help="documents per task (a fraction if < 1; default: every document)"
    )
    parser.add_argument(
        "--data",
        default="embedded",
        help="corpus whose train split calibrates a calibrated scheme (smoothquant, static, GPTQ, AWQ) when "
        "--calib-data is not given (default: embedded)",
    )
    add_calibration_arguments(parser)
    parser.add_argument("--bootstrap-iters", type=int, default=0, help="stderr bootstrap (0: none, fast)")
    add_output_argument(parser, "also write the result to this JSON file", "--json", metavar="FILE")


def run(args: argparse.Namespace) -> None:
    from qbench.studies.lm_eval_adapter import check_request, run_lm_eval

    check_request(args.scheme, args.mode)  # a typo fails before the model loads
    calibration = calibration_from_args(args)
    tasks = [t.strip() for t in args.tasks.split(",") if t.strip()]
    limit = int(args.limit) if args.limit is not None and args.limit >= 1 else args.limit
    lm = load_from_args(args)
    result = run_lm_eval(
        lm,
        args.scheme,
        tasks,
        include_path=args.include_path,
        limit=limit,
        mode=args.mode,
        batch_size=args.batch_size,
        bootstrap_iters=args.bootstrap_iters,
        calibration_corpus=args.data,
        calibration=calibration,
    )
    console.print(f"[bold]{lm.name}[/] {result['qbench']['scheme']['name']} ({result['qbench']['mode']})")
    for task, metrics in result["results"].items():
        shown = ", ".join(
            f"{name.split(',')[0]} {value:.4g}"
            for name, value in metrics.items()
            if isinstance(value, int | float) and "stderr" not in name
        )
        console.print(f"  {task}: {shown}", highlight=False)
    if args.output_path:
        atomic_write_json(Path(args.output_path), result)
        console.print(f"wrote {args.output_path}")
