"""``qbench sensitivity --ckpt X --scheme S``: the options, a progress bar, and the summary printed after the study.

The study itself is :mod:`qbench.studies.sensitivity`. Default budget: ``--tokens 512`` with windows of at most
512 tokens, i.e. one window of 511 scored tokens for a long-context model -- sized so that a 30-layer,
135 M-parameter model with 7 linears per block (210 units, SmolLM-135M's shape) takes about 10 minutes on 2 CPU
cores. Measured here (AMD EPYC, shared with other jobs): one unit cell of that shape at 511 tokens costs 0.6 s
(the model copy) + 3.7 s (evaluation) of CPU time on one thread; the 4-layer demo shape at 2,032 tokens 0.04 +
0.73 s. Extrapolated to 2 idle cores (evaluation ~1.8x faster on two threads, the copy not): ~2.9 s per cell with
the bookkeeping, x ~215 cells (210 units + the repair) + the float statistics ~ 11 min. Not confirmed on an idle
machine: on this one, at load average 4, two threads took 1.4 + 9.2 s of wall time per cell (~37 min for 210).
Raise ``--tokens`` for a steadier map when there is time (the cost grows linearly).
"""

from __future__ import annotations

import argparse
import re
from pathlib import Path

from models.errors import UserError
from qbench.cli.args import (
    add_calibration_arguments,
    add_kv_arguments,
    add_model_arguments,
    add_tolerance_arguments,
    calibration_from_args,
    console,
    kv_from_args,
    load_from_args,
    placement_from_args,
    protocol_from_args,
    seed_value,
    tolerance_from_args,
)
from qbench.cli.base import add_output_argument
from qbench.cli.budgets import UNIT_TOKENS

DEFAULT_TOKENS = UNIT_TOKENS  # the per-unit studies' budget; sized in the module docstring
DEFAULT_WINDOW = 512  # at most: a model with a shorter context uses its own
DEFAULT_OUTPUT = Path("qbench_sensitivity")


NAME = "sensitivity"
HELP = "where a model breaks: each layer quantised alone, and a verified float repair"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from qbench.studies.sensitivity_options import BY

    add_model_arguments(parser, tokens=DEFAULT_TOKENS)
    window = next(a for a in parser._actions if a.dest == "window")
    window.help = f"window length (default: the model's context, at most {DEFAULT_WINDOW})"
    parser.add_argument(
        "--scheme", required=True, help="one scheme (qbench ls schemes), overrides NAME:k=v too"
    )
    parser.add_argument("--mode", default="fake", help="fake | real")
    parser.add_argument("--by", default="layer", help=f"unit quantised alone: {' | '.join(BY)}")
    add_tolerance_arguments(parser, "repair target:")
    parser.add_argument(
        "--no-minimise",
        action="store_true",
        help="stop the repair once within the tolerance, without trying to drop each kept unit (default: "
        "minimise; the quick card does not)",
    )
    parser.add_argument("--top", type=int, default=10, help="units in the printed and markdown table")
    add_output_argument(
        parser, "output folder (default: qbench_sensitivity/<model>/<scheme>)", "--out", metavar="DIR"
    )
    parser.add_argument("--seed", type=seed_value, default=0, help="torch seed set before each evaluation")
    parser.add_argument(
        "--quantize-lm-head", action="store_true", help="the LM head is a unit too (default: float)"
    )
    add_kv_arguments(parser)
    add_calibration_arguments(parser)


def _spec(args: argparse.Namespace, lm, out: Path):
    from qbench.eval.adapters import context_length
    from qbench.eval.harness import GridSpec, check_modes

    if args.window is None:
        args.window = min(DEFAULT_WINDOW, context_length(lm.model))
    return GridSpec(
        models=[args.ckpt],
        schemes=[args.scheme],
        modes=check_modes([args.mode]),
        protocol=protocol_from_args(args),
        output_path=out / "cells",
        seed=args.seed,
        dtype=args.dtype,
        device=args.device,
        attention=False,  # the map needs no attention statistics; they cost an O(T^2) reference pass
        quantize_lm_head=args.quantize_lm_head,
        trust_remote_code=args.trust_remote_code,
        allow_unsafe_weights=args.allow_unsafe_weights,
        placement=placement_from_args(args),
        kv=kv_from_args(args),
        calibration=calibration_from_args(args),
    )


def run(args: argparse.Namespace) -> None:
    from qbench.quant import get_scheme
    from qbench.studies.sensitivity import BY, write_sensitivity

    scheme = get_scheme(args.scheme)  # typos fail before the model loads
    kv_from_args(args)
    if args.by not in BY:
        from models.errors import unknown_choice

        raise unknown_choice("--by", args.by, BY)
    if args.top < 1:
        raise UserError(f"--top must be at least 1, got {args.top}")
    lm = load_from_args(args)
    out = (
        Path(args.output_path)
        if args.output_path
        else DEFAULT_OUTPUT / lm.name / re.sub(r"[^\w.+-]+", "_", scheme.name)
    )
    spec = _spec(args, lm, out)
    result = _with_progress(spec, args, lm)
    paths = write_sensitivity(result, out, args.command_line, top=args.top)
    _print_summary(result, args.top)
    console.print(f"wrote {paths['json']}, {paths['markdown'].name}, {paths['heatmap'].name}")


def _with_progress(spec, args: argparse.Namespace, lm) -> dict:
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    from qbench.studies.sensitivity import sensitivity

    with Progress(
        TextColumn("{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        console=console,
    ) as progress:
        # one bar per phase, so "units n/n" counts the units alone; the repair's length is known only as it runs
        tasks = {
            "unit": progress.add_task("units", total=None),
            "kv": progress.add_task("KV cache alone", total=1, visible=False),
            "repair": progress.add_task("repair", total=None, visible=False),
        }
        units = tasks["unit"]

        def on_cell(phase: str, record: dict, reused: bool) -> None:
            progress.update(tasks[phase], advance=1, visible=True)

        return sensitivity(
            spec,
            by=args.by,
            tolerance=tolerance_from_args(args),
            metric=args.metric,
            on_cell=on_cell,
            on_units=lambda n: progress.update(units, total=n),
            lm=lm,
            minimise=not args.no_minimise,
        )


def _print_summary(result: dict, top: int) -> None:
    from qbench.eval.evidence import tolerance_text
    from qbench.studies.sensitivity import repair_texts, top_table

    r, t = result["repair"], result["timing"]
    console.print(top_table(result, top), highlight=False)
    corr = ", ".join(f"{s} {'-' if v is None else f'{v:+.2f}'}" for s, v in result["correlation"].items())
    console.print(f"Spearman with the damage: {corr}", highlight=False)
    kept = " ".join(f"--exclude '{n}'" for n in r["exclude"]) or "nothing"
    before, after = repair_texts(r)  # on kld or top1: that metric's values, then the changes
    console.print(
        f"repair (≤ {tolerance_text(r['tolerance_pct'], r.get('metric', 'ppl'))}): all quantised {before} → "
        f"keep {r['count']} unit(s) in float ({r['weight_share_float']:.1%} of the weights): {kept} → measured "
        f"{after}" + ("" if r["reached"] else " [yellow](tolerance not reached)[/]"),
        highlight=False,
    )
    per_unit = "-" if t["seconds_per_unit"] is None else f"{t['seconds_per_unit']:.2f} s"
    console.print(f"[dim]{t['units']} units, {per_unit} per unit cell, {t['wall_seconds']:.0f} s in all[/]")
