"""``qbench reproduce``: the paper's Tables 2-3 (and 4): train the variants, evaluate, tabulate."""

from __future__ import annotations

import argparse
from pathlib import Path

from qbench.cli.args import seed_value
from qbench.cli.base import add_output_argument, console
from qbench.cli.budgets import PAPER_TOKENS
from qbench.cli.evaluate import (
    print_record,
)

NAME = "reproduce"
HELP = "the paper's Tables 2-3 (and 4): train the variants, evaluate, tabulate"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--preset", required=True, help="model preset (qbench ls presets)")
    p.add_argument(
        "--recipes",
        nargs="+",
        help="training recipes (default: vanilla softmax1 orthoadam softmax1-orthoadam)",
    )
    p.add_argument("--ablations", action="store_true", help="also the Table-4 ablation recipes")
    budget = p.add_mutually_exclusive_group()
    budget.add_argument("--steps", type=int, help="training steps per model (default: the preset's)")
    budget.add_argument("--tokens", type=int, help="training tokens per model (default: the preset's)")
    p.add_argument("--data", default="embedded", help="corpus: embedded | mix | c4 | a local path")
    p.add_argument("--lr", type=float, help="peak learning rate (default: the trainer's)")
    p.add_argument("--seed", type=seed_value, default=0, help="training and evaluation seed")
    p.add_argument(
        "--eval-tokens",
        type=int,
        default=PAPER_TOKENS,
        help="evaluation token budget per model (paper scale)",
    )
    p.add_argument("--mode", action="append", help="fake (default) | real")
    p.add_argument(
        "--nproc-per-node",
        type=int,
        default=1,
        help="train each model with torchrun on K devices, and share the evaluation cells among K ranks",
    )
    p.add_argument("--batch-size", type=int, help="training windows per step, all devices (default: 16)")
    p.add_argument("--compile", action="store_true", help="train through torch.compile (GPUs)")
    p.add_argument("--parallel", type=int, default=1, help="models trained at once (CPU: one thread each)")
    p.add_argument("--ckpt-root", help="checkpoint folder (default: ckpts/reproduce/<preset>)")
    add_output_argument(p, "results folder (default: results/reproduce/<preset>)", metavar="DIR")


def run(args: argparse.Namespace) -> None:
    from models import get_preset
    from qbench.eval.harness import check_modes
    from qbench.studies import reproduce
    from qbench.studies.runs import train_runs

    get_preset(args.preset)  # a did-you-mean error before anything starts
    recipes = list(args.recipes or reproduce.TABLE2_RECIPES) + (
        list(reproduce.ABLATION_RECIPES) if args.ablations else []
    )
    cfg = reproduce.ReproduceConfig(
        preset=args.preset,
        recipes=reproduce.check_recipes(list(dict.fromkeys(recipes))),
        steps=args.steps,
        tokens=args.tokens,
        data=args.data,
        lr=args.lr,
        seed=args.seed,
        ckpt_root=Path(args.ckpt_root) if args.ckpt_root else None,
        output_path=Path(args.output_path) if args.output_path else None,
        eval_tokens=args.eval_tokens,
        modes=tuple(check_modes(args.mode or ["fake"])),
        nproc_per_node=args.nproc_per_node,
        batch_size=args.batch_size,
        compile=args.compile,
    )
    console.print(
        f"[bold]qbench reproduce[/] {cfg.preset}: {', '.join(cfg.recipes)} → {cfg.ckpts}/, {cfg.results}/"
    )
    threads = 1 if args.parallel > 1 else None  # side-by-side CPU runs: one thread each
    train_runs(
        reproduce.runs(cfg),
        console,
        parallel=args.parallel,
        threads=threads,
        nproc_per_node=cfg.nproc_per_node,
    )
    records = reproduce.evaluate(cfg, on_record=print_record)
    for path in reproduce.write_tables(cfg, records, args.command_line):
        console.print(f"[bold]{path}[/]")
        console.print(path.read_text(), highlight=False)
