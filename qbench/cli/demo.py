"""``qbench demo``: train vanilla + paper tiny models, evaluate the paper's schemes (~12 min on 2 CPU cores)."""

from __future__ import annotations

import argparse
import time
from pathlib import Path
from typing import Any

from models.errors import UserError
from qbench.cli.args import add_seed_arguments
from qbench.cli.base import add_output_argument, console, print_wide
from qbench.cli.budgets import DEMO_LONG_STEPS, DEMO_STEPS, DEMO_TOKENS
from qbench.cli.evaluate import (
    print_record,
)
from qbench.eval.sampling import SAMPLES
from qbench.studies.runs import DEFAULT_DATA


def add_data_arguments(parser: argparse.ArgumentParser, runs: str) -> None:
    """``--data``, ``--sample`` and ``--sample-seed`` of the commands that train and then evaluate (``qbench demo``,
    ``qbench recipes``): one corpus for both (its train split trains, its validation split is scored), the windows
    spelled as every evaluating command spells them (``qbench.cli.args.add_model_arguments``); ``runs`` names
    what is trained."""
    parser.add_argument(
        "--data",
        default=DEFAULT_DATA,
        metavar="CORPUS",
        help=f"corpus {runs} are trained on (its train split) and evaluated on (its validation split): embedded | "
        "embedded-whole (its texts whole: the split of every result made before corpus pieces) | mix | c4 | a "
        "local path (qbench ls corpora)",
    )
    parser.add_argument(
        "--sample",
        choices=SAMPLES,
        help="which windows are scored (default: documents): documents = windows drawn across the split's "
        "documents, stratified by source, one per document while they last, the intervals clustered by document, "
        "and a window of at most the largest power of two <= --tokens/16, at least 128, so every budget scores "
        ">= 16 windows | first = consecutive windows from the start of the text (every record before sampling "
        "existed; --data embedded-whole --sample first reproduces those records) — docs/metrics.md",
    )
    parser.add_argument(
        "--sample-seed",
        type=int,
        default=0,
        help="seed of the documents sample (another seed scores other windows of the same text)",
    )


def data_from_args(args: argparse.Namespace) -> dict[str, Any]:
    """The config fields of :func:`add_data_arguments`' options, refused in one line before anything is trained:
    an unknown ``--data`` (the corpus registry's did-you-mean error) or a negative ``--sample-seed``."""
    from qbench.studies.runs import check_data

    if args.sample_seed < 0:
        raise UserError(f"--sample-seed must be ≥ 0, got {args.sample_seed}")
    check_data(args.data)
    return {"data": args.data, "sample": args.sample, "sample_seed": args.sample_seed}


NAME = "demo"
HELP = "train vanilla + paper tiny models, evaluate the paper's schemes, sweep, card (~12 min CPU)"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--long",
        action="store_true",
        help="Llama style, 4.1 M tokens per model, each trained to the end of its schedule (~40 min on 2 cores)",
    )
    p.add_argument(
        "--steps",
        type=int,
        help=f"training steps per model, 16 x 128 tokens each (default: {DEMO_STEPS}; --long {DEMO_LONG_STEPS})",
    )
    p.add_argument(
        "--tokens",
        type=int,
        default=DEMO_TOKENS,
        help="evaluation token budget per model (the demo's recipe)",
    )
    p.add_argument("--ckpt-root", help="checkpoint folder (default: ckpts/demo; --long: ckpts/demo-long)")
    add_output_argument(p, "results folder (default: results/demo; --long: results/demo-long)", metavar="DIR")
    add_seed_arguments(p, "both recipes (the card is of the first seed)")
    add_data_arguments(p, "both models")
    p.add_argument("--no-sweep", action="store_true", help="skip the bit-width sweep (8→2 bits, KV cache)")
    p.add_argument(
        "--no-card",
        action="store_true",
        help="skip the card of the two models (qbench card --budget quick on the demo's records)",
    )


def run(args: argparse.Namespace) -> None:
    from dataclasses import replace

    from qbench.eval.report import rich_table
    from qbench.studies import demo

    base = demo.LONG if args.long else demo.DemoConfig()
    steps = base.steps if args.steps is None else args.steps
    if steps < 1 or args.tokens < 2 or args.seeds < 1:
        raise UserError(
            f"--steps and --seeds must be ≥ 1 and --tokens ≥ 2, got {steps}, {args.seeds} and {args.tokens}"
        )
    data = data_from_args(args)  # before anything is trained
    cfg = replace(
        base,
        steps=steps,
        eval_tokens=args.tokens,
        ckpt_root=Path(args.ckpt_root or base.ckpt_root),
        output_path=Path(args.output_path or base.output_path),
        seed=args.seed,
        seeds=args.seeds,
        sweep_axes=() if args.no_sweep else base.sweep_axes,
        **data,
    )
    console.print(
        f"[bold]qbench demo[/]: train {', '.join(demo.RECIPES)} ({cfg.description}) in {cfg.ckpt_root}/, "
        f"evaluate the paper's schemes, write {cfg.output_path}/"
    )
    train_s = demo.train_both(cfg, console)
    start = time.perf_counter()
    records = demo.evaluate(cfg, on_record=print_record)
    eval_s = time.perf_counter() - start
    timings = {"train": train_s, "eval": eval_s}
    result = None
    if cfg.sweep_axes:
        from qbench.studies.sweep import sweep_table

        start = time.perf_counter()
        from qbench.cli.sweep import run_sweep_with_progress

        result = run_sweep_with_progress(demo.sweep_config(cfg), args.command_line)
        timings["sweep"] = time.perf_counter() - start
    card = None
    if not args.no_card:
        from qbench.cli.card import run_card_with_progress

        start = time.perf_counter()
        card = run_card_with_progress(demo.card_config(cfg, args.command_line))
        timings["card"] = time.perf_counter() - start
    table = demo.write_report(cfg, records, timings, args.command_line, result, card is not None)
    print_wide(rich_table(records, title="qbench demo"))
    if result is not None:
        console.print(sweep_table(result), highlight=False, soft_wrap=True)
    words = {"train": "training", "eval": "evaluation", "sweep": "bit-width sweep", "card": "card"}
    spent = ", ".join(f"{words[k]} {v:.0f} s" for k, v in timings.items())
    console.print(f"wrote {table} and plots beside it ({spent})")
