"""``qbench sweep``: perplexity change over bit widths per tensor axis and the KV cache; breaking points."""

from __future__ import annotations

import argparse
from pathlib import Path

from models.errors import UserError
from qbench.cli.args import (
    add_calibration_arguments,
    add_model_arguments,
    add_resolve_argument,
    add_tolerance_arguments,
    placement_from_args,
    seed_value,
)
from qbench.cli.base import SEED_HELP, add_output_argument, console
from qbench.cli.budgets import EVAL_TOKENS

NAME = "sweep"
HELP = "perplexity change over bit widths per tensor axis and the KV cache; breaking points"


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_model_arguments(p, tokens=EVAL_TOKENS, many=True)
    p.add_argument(
        "--family", action="append", help="scheme family to sweep (repeatable; default absmax-coarse)"
    )
    p.add_argument(
        "--axes",
        default="w,a,o,all,kv",
        help="comma list of w (weights), a (input activations), o (outputs), all (every tensor of the family), "
        "kv (the float model's KV cache)",
    )
    p.add_argument(
        "--bits",
        default="8-2",
        help="bit widths of every axis: a range 8-2 or a list 8,6,4 (the kv axis takes those of them that are "
        "KV-cache widths: 8, 6, 4, 3, 2, unless --kv-bits is given)",
    )
    p.add_argument(
        "--kv-bits",
        help="bit widths of the kv axis, a range or a list as --bits (default: those of --bits that are "
        "KV-cache widths)",
    )
    add_tolerance_arguments(p)
    add_resolve_argument(p)
    p.add_argument(
        "--kv-keep-first",
        type=int,
        action="append",
        help="also sweep the KV cache with the first K positions in float (repeatable)",
    )
    p.add_argument(
        "--kv-keep-sinks",
        type=int,
        action="append",
        help="also sweep the KV cache with the K most-attended positions in float (repeatable)",
    )
    p.add_argument(
        "--kv-scheme",
        "--kv-granularity",  # the former name
        dest="kv_granularity",
        action="append",
        metavar="NAME",
        help="the kv axis' KV-cache scheme, NAME[:key=value,…] as run's --kv-scheme; repeatable: one set of kv "
        "curves per scheme (default: kivi, with residual 32 on windows ≤ 128, per-token on windows ≤ 32)",
    )
    add_output_argument(p, "records, sweep.json/.md/.png", default="qbench_results/sweep", metavar="DIR")
    p.add_argument("--seed", type=seed_value, default=0, help=SEED_HELP)
    p.add_argument("--no-attention", action="store_true", help="skip attention statistics (faster)")
    add_calibration_arguments(p)


def sweep_config(args: argparse.Namespace):
    """``qbench sweep``'s options -> ``SweepConfig`` (bad axes, bits, families fail here, before any model loads)."""
    from qbench.cli.args import calibration_from_args, protocol_from_args, tolerance_from_args
    from qbench.eval.harness import expand_schemes
    from qbench.studies import sweep

    cfg = sweep.SweepConfig(
        models=args.ckpt,
        families=expand_schemes(args.family or [sweep.DEFAULT_FAMILY]),
        axes=sweep.parse_axes(args.axes),
        bits=sweep.parse_bits(args.bits),
        tolerance=tolerance_from_args(args),
        metric=args.metric,
        kv_keep_first=args.kv_keep_first or [],
        kv_keep_sinks=args.kv_keep_sinks or [],
        kv_bits=None if args.kv_bits is None else sweep.parse_bits(args.kv_bits),
        kv_granularity=args.kv_granularity,
        protocol=protocol_from_args(args),
        output_path=Path(args.output_path),
        seed=args.seed,
        dtype=args.dtype,
        device=args.device,
        attention=not args.no_attention,
        trust_remote_code=args.trust_remote_code,
        allow_unsafe_weights=args.allow_unsafe_weights,
        placement=placement_from_args(args),
        calibration=calibration_from_args(args),
    )
    from qbench.studies.resolve import resolve_cap

    cfg.resolve_tokens = resolve_cap(args.resolve, cfg.protocol.tokens)
    # the KV options shape the kv axis only: without it they would be silently ignored
    if "kv" not in cfg.axes:
        given = [
            flag
            for flag, value in (
                ("--kv-bits", args.kv_bits),
                ("--kv-scheme", args.kv_granularity),
                ("--kv-keep-first", args.kv_keep_first),
                ("--kv-keep-sinks", args.kv_keep_sinks),
            )
            if value is not None
        ]
        if given:
            raise UserError(
                f"{', '.join(given)}: only for the kv axis, which --axes {args.axes} leaves out (nothing would "
                f"use it); add kv to --axes (e.g. --axes {','.join([*cfg.axes, 'kv'])}) or drop {', '.join(given)}"
            )
    sweep.validate(cfg)
    return cfg


def run_sweep_with_progress(cfg, command: str) -> dict:
    """Run a sweep under a rich progress bar; each cell's evaluation time is shown as a ratio to the float one."""
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    from qbench.studies import sweep

    float_seconds: dict[str, float] = {}
    counts = {"reused": 0, "evaluated": 0, "seconds": 0.0}
    with Progress(
        TextColumn("sweep"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(), console=console
    ) as progress:
        task = progress.add_task("sweep", total=sweep.expected_records(cfg))

        def on_record(record: dict, reused: bool) -> None:
            name, m = record["model"]["name"], record["metrics"]
            if record["scheme"]["name"] == "fp" and record["mode"] == "float":
                float_seconds.setdefault(name, record.get("eval_seconds") or 0.0)
            elif reused:
                counts["reused"] += 1
            else:
                counts["evaluated"] += 1
                counts["seconds"] += record.get("eval_seconds") or 0.0
                base = float_seconds.get(name) or 0.0
                ratio = f"time ×{record['eval_seconds'] / base:.2f} of fp" if base else ""
                change = "NaN" if m["ppl_change_pct"] is None else f"{m['ppl_change_pct']:+.2f}%"
                progress.console.print(
                    f"  {name:<12} {record['scheme']['name']:<26} {change:>9}  [dim]{ratio}[/]",
                    highlight=False,
                    soft_wrap=True,
                )
            progress.advance(task)

        result = sweep.run_sweep(cfg, on_record=on_record, command=command)
    base = sum(float_seconds.values()) / max(len(float_seconds), 1)
    spent = (
        f" in ×{counts['seconds'] / base:.1f} the time of one float evaluation ({base:.2f} s)"
        if base and counts["evaluated"]
        else ""
    )
    console.print(f"{counts['evaluated']} cells evaluated{spent}, {counts['reused']} reused", highlight=False)
    return result


def run(args: argparse.Namespace) -> None:
    from qbench.studies import sweep

    cfg = sweep_config(args)
    console.print(
        f"[bold]qbench sweep[/] {len(cfg.models)} model(s) × {', '.join(cfg.families)} × axes "
        f"{','.join(cfg.axes)} × bits {','.join(map(str, cfg.bits))} → {cfg.output_path}/"
    )
    result = run_sweep_with_progress(cfg, args.command_line)
    console.print(sweep.sweep_table(result), highlight=False, soft_wrap=True)
    decisions = sweep.decisions_caption(result)
    if decisions:
        console.print(decisions, highlight=False, soft_wrap=True)
    console.print(f"wrote {cfg.output_path}/sweep.json, sweep.md, sweep.png")
