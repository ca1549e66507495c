"""``qbench recipes``: train a panel of training-time remedy recipes at one budget, evaluate each into one table;
the study is :mod:`qbench.studies.recipes`."""

from __future__ import annotations

import argparse
from pathlib import Path

from models.errors import UserError
from qbench.cli.args import add_seed_arguments
from qbench.cli.base import add_output_argument, console
from qbench.cli.budgets import DEMO_LONG_STEPS, DEMO_STEPS, DEMO_TOKENS
from qbench.cli.demo import add_data_arguments, data_from_args

# torch-free: the parser stays light
from qbench.studies.recipes import DEFAULT_RECIPES, LR_RULE, LR_SWEEP, valid_lr

NAME = "recipes"
HELP = (
    "train remedy recipes (Muon, OSP, clipped softmax, gates, softpick, sink logit) at one budget; one table"
)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--long",
        action="store_true",
        help="qbench demo --long's budget for every recipe (Llama style, 2000 steps, the schedule ending with the run)",
    )
    parser.add_argument("--preset", default="tiny", help="model preset (qbench ls presets)")
    parser.add_argument(
        "--recipes",
        nargs="+",
        default=list(DEFAULT_RECIPES),
        help="training recipes of the panel (qbench ls recipes)",
    )
    parser.add_argument(
        "--steps",
        type=int,
        help=f"optimiser steps of every run (default: {DEMO_STEPS}, the demo's; --long {DEMO_LONG_STEPS})",
    )
    parser.add_argument(
        "--lr",
        type=float,
        default=4e-3,
        help="peak learning rate of every run (with --lr-sweep or --lr-from: the runs' naming base, a run at "
        "another lr is named <recipe>-lr<lr>)",
    )
    parser.add_argument(
        "--lr-sweep",
        nargs="*",
        type=float,
        metavar="LR",
        help="train every recipe at each of these peak learning rates (alone: "
        f"{' '.join(f'{x:g}' for x in LR_SWEEP)}) and keep, per recipe, the one with the lowest final validation "
        "loss; the other seeds train at it (lr_sweep.json, table.md)",
    )
    parser.add_argument(
        "--lr-from",
        metavar="FILE",
        help="train each recipe at the peak learning rate an earlier sweep chose: its lr_sweep.json (e.g. "
        "results/recipes/lr_sweep.json for the --long panel; a sweep at --long's budget would cost three panels)",
    )
    add_seed_arguments(parser, "every recipe")
    add_data_arguments(parser, "every recipe's runs")
    parser.add_argument(
        "--tokens", type=int, default=DEMO_TOKENS, help="evaluation token budget per model (the demo's)"
    )
    parser.add_argument(
        "--mode", action="append", choices=("fake", "real"), help="fake (default) | real; repeatable"
    )
    parser.add_argument("--parallel", type=int, default=2, help="runs trained at once (one thread each)")
    parser.add_argument(
        "--ckpt-root", help="checkpoint folder (default: ckpts/recipes; --long: ckpts/recipes-long)"
    )
    add_output_argument(
        parser, "results folder (default: results/recipes; --long: results/recipes-long)", metavar="DIR"
    )
    parser.add_argument(
        "--no-sweep", action="store_true", help="skip the bit-width sweep (8→2 bits, KV cache)"
    )
    parser.add_argument(
        "--no-algorithms",
        action="store_true",
        help="skip the post-training algorithms (RTN, GPTQ, AWQ, Hadamard, QuaRot at int4, W4A8 and W4A4) on the "
        "first seed's models, the first recipe's as the baseline",
    )
    parser.add_argument(
        "--estimate", action="store_true", help="print the cost estimate and stop (nothing is trained)"
    )
    parser.add_argument(
        "--train-arg",
        action="append",
        default=[],
        help="a trainer option for every run, e.g. --train-arg=--set --train-arg=n_layer=2 (repeatable)",
    )


def run(args: argparse.Namespace) -> None:
    from qbench.cli.evaluate import print_record
    from qbench.studies.recipes import (
        RecipesConfig,
        check_ckpt_root,
        check_train_args,
        describe_estimate,
        estimate,
        long_config,
        run_panel,
        time_steps,
    )

    base = long_config() if args.long else RecipesConfig()
    steps = base.steps if args.steps is None else args.steps
    lrs = () if args.lr_sweep is None else tuple(args.lr_sweep or LR_SWEEP)
    for flag, values in (("--lr", [args.lr]), ("--lr-sweep", lrs)):
        bad = [x for x in values if not valid_lr(x)]
        if bad:
            raise UserError(f"{flag} {bad[0]:g}: {LR_RULE}")
    if args.lr_from is not None and args.lr_sweep is not None:
        raise UserError(
            "give one of --lr-sweep (choose the lr here) and --lr-from (an earlier sweep's choice)"
        )
    if steps < 1 or args.tokens < 2 or args.parallel < 1 or args.seeds < 1:
        raise UserError(
            f"--steps, --parallel and --seeds must be ≥ 1 and --tokens ≥ 2, got {steps}, {args.parallel}, "
            f"{args.seeds}, {args.tokens}"
        )
    cfg = RecipesConfig(
        **{
            **base.__dict__,
            "preset": args.preset,
            "recipes": tuple(args.recipes),
            "steps": steps,
            "lr": args.lr,
            "seed": args.seed,
            "seeds": args.seeds,
            "ckpt_root": Path(args.ckpt_root) if args.ckpt_root else base.ckpt_root,
            "output_path": Path(args.output_path) if args.output_path else base.output_path,
            "eval_tokens": args.tokens,
            "modes": tuple(args.mode or ("fake",)),
            "parallel": args.parallel,
            "extra_args": (*base.extra_args, *args.train_arg),
            "sweep_axes": () if args.no_sweep else base.sweep_axes,
            "lrs": lrs,
            "algorithms": not args.no_algorithms,
            **data_from_args(args),  # an unknown --data: refused before anything is timed or trained
        }
    )
    if args.lr_from is not None:
        from dataclasses import replace

        from qbench.studies.recipes import read_lr_choice

        cfg = replace(cfg, chosen_lr=read_lr_choice(Path(args.lr_from), cfg.recipes), lr_source=args.lr_from)
    check_train_args(cfg, args.train_arg)  # one line each, before anything is timed or trained
    check_ckpt_root(cfg)
    if args.estimate:
        console.print(describe_estimate(estimate(cfg, time_steps(cfg))), highlight=False)
        return
    from qbench.cli.sweep import run_sweep_with_progress

    command = getattr(args, "command_line", "qbench recipes")
    table = run_panel(cfg, console, command, on_record=print_record, sweep_runner=run_sweep_with_progress)
    console.print(f"wrote {table}")
