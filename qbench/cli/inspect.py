"""``qbench inspect``: the options and the printout; the study is :mod:`qbench.studies.inspection`."""

from __future__ import annotations

import argparse
from pathlib import Path

from models.errors import UserError
from qbench.cli.args import add_model_arguments, console, load_from_args, protocol_from_args
from qbench.cli.base import add_output_argument

NAME = "inspect"
HELP = "outlier/attention metrics JSON + plots (attention map, activations, per layer)"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_model_arguments(parser)
    parser.add_argument("--windows", type=int, default=8, help="windows the statistics are computed on")
    add_output_argument(
        parser, "output folder (default: qbench_inspect/<model name>)", "--out", metavar="DIR"
    )


def run(args: argparse.Namespace) -> None:
    from qbench.studies.inspection import inspect_model

    if args.windows < 1:
        raise UserError(f"--windows must be at least 1, got {args.windows}")
    protocol = protocol_from_args(args, outlier_windows=args.windows)
    lm = load_from_args(args)
    out = Path(args.output_path) if args.output_path else Path("qbench_inspect") / lm.name
    result = inspect_model(lm, protocol, out, n_windows=args.windows, device=args.device)
    o, m = result["outliers"], result["massive_activations"]
    console.print(f"[bold]{lm.name}[/] ({o['windows']} windows of {result['protocol']['window']} tokens)")
    console.print(
        f"  kurtosis first/other/max {o['kurtosis_first']:.2f} / {o['kurtosis_other']:.2f} / "
        f"{o['kurtosis_max']:.2f}   max |act| {o['max_abs']:.1f} (block {result['peak_layer']})",
        highlight=False,
    )
    console.print(
        f"  first-token attention: top-1 share {o.get('first_token_top1_share', float('nan')):.3f}, "
        f"mean weight {o.get('first_token_mass', float('nan')):.3f}   massive activations: {m['total']}",
        highlight=False,
    )
    console.print(
        f"wrote {out / 'metrics.json'} and {', '.join(Path(p).name for p in result['plots'].values())}"
    )
