"""``qbench intervene``: the options and the printout; the study is :mod:`qbench.studies.intervene`."""

from __future__ import annotations

import argparse
from pathlib import Path

from models.errors import UserError
from models.io import atomic_write_json
from qbench.cli.args import add_model_arguments, console, load_from_args, protocol_from_args
from qbench.cli.base import add_output_argument

NAME = "intervene"
HELP = "set massive activations to zero or their mean; perplexity change"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_model_arguments(parser)
    parser.add_argument(
        "--set", dest="set_to", default="zero", help="zero | mean: what the massive activations become"
    )
    parser.add_argument("--windows", type=int, default=8, help="windows searched for massive activations")
    add_output_argument(parser, "also write the result to this JSON file", "--json", metavar="FILE")


def run(args: argparse.Namespace) -> None:
    from qbench.studies.intervene import check_mode, intervene

    check_mode(args.set_to)  # before loading anything: a typo should cost nothing
    if args.windows < 1:
        raise UserError(f"--windows must be at least 1, got {args.windows}")
    protocol = protocol_from_args(args, outlier_windows=args.windows)
    lm = load_from_args(args)
    result = intervene(lm, protocol, mode=args.set_to, n_windows=args.windows, device=args.device)
    for site in result["sites"]:
        console.print(
            f"  layer {site['layer']:>3} channel {site['channel']:>5}: {site['count']} massive values, "
            f"mean {site['mean']:.1f} (threshold {site['threshold']:.1f})",
            highlight=False,
        )
    change = "" if result["ppl_change_pct"] is None else f" ({result['ppl_change_pct']:+.2f}%)"
    console.print(
        f"[bold]{lm.name}[/] --set {args.set_to}: perplexity {result['perplexity']:.3f} → "
        f"{result['intervened_perplexity']:.3f}{change} on {result['tokens']} tokens",
        highlight=False,
    )
    console.print(f"[dim]{result['note']}[/]")
    if args.output_path:
        atomic_write_json(Path(args.output_path), result)
        console.print(f"wrote {args.output_path}")
