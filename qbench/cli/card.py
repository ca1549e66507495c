"""``qbench card --ckpt X [--ckpt Y …] [--budget quick|standard|full]``: one page per model, from the grid's records;
``qbench card --from-json DIR`` renders a written card's pages again from its card.json alone.

The study is the package :mod:`qbench.studies.card` (plan, config, measure, build), the pages :mod:`qbench.studies.card.render`.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from qbench.cli.args import (
    add_calibration_arguments,
    add_model_arguments,
    add_resolve_argument,
    add_tolerance_arguments,
    console,
    placement_from_args,
    seed_value,
    tolerance_from_args,
)
from qbench.cli.base import SEED_HELP, add_output_argument

NAME = "card"
HELP = "one page per model: outliers, attention sink, deployable formats, breaking points, KV cache, verdict"


# What a card costs on 2 CPU cores, float32 (docs/card.md, "Memory and time": measured for the 124 M model's quick
# and standard cards and the 1.4 B model's float evaluation, the rest estimated from them)
COSTS = (
    "Cost on 2 CPU cores, float32: a 124 M-parameter model quick ~12 min / 1.9 GiB, standard ~40 min / 3.3 GiB, "
    "full ~3 h; a 1.4 B model quick ~1.5 h / 6.2 GiB (3.9 GiB with --dtype bfloat16), standard ~5 h, full ~1 day "
    "(estimated); on one GPU minutes (docs/card.md)"
)


def budget_help() -> str:
    """What each budget measures, from the budgets themselves (``qbench.studies.card`` imports no torch)."""
    from qbench.studies.card.plan import BUDGETS, FORMATS, KV_KEEP_SINKS, KV_MIN_WINDOW

    labels = {f.scheme: f.label for f in FORMATS}
    quick = BUDGETS["quick"]
    return (
        "; ".join(b.describe() for b in BUDGETS.values())
        + f". Quick's formats: {', '.join(labels[s] for s in quick.formats)}; standard and full: all "
        f"{len(FORMATS)} ({', '.join(f.label for f in FORMATS)}). KV rows on windows of at least "
        f"{KV_MIN_WINDOW:,} tokens (the model's context when shorter); --kv-scheme replaces them by one scheme at "
        f"the budget's widths, plain and with --kv-keep-sinks {KV_KEEP_SINKS}. {COSTS}"
    )


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_model_arguments(p, tokens=None, many=True, protocol=False)  # the card's own protocol
    ckpt = next(a for a in p._actions if a.dest == "ckpt")
    ckpt.required = False  # --from-json re-renders a card without one
    ckpt.help += "; required unless --from-json"
    tokens = next(a for a in p._actions if a.dest == "tokens")
    tokens.help = "token budget: stream tokens scored (default: the budget's)"
    p.add_argument("--budget", default="quick", choices=("quick", "standard", "full"), help=budget_help())
    add_tolerance_arguments(
        p, "what a format may cost (verdict, recommendation, breaking points, repair target):"
    )
    add_resolve_argument(p, "the budget's tokens")
    p.add_argument(
        "--kv-scheme",
        help="one KV-cache scheme for every KV row, NAME[:key=value,…] as run's --kv-scheme (default: the "
        "budget's rows: KIVI as deployed — residual 32 on windows ≤ 128, per-token blocks on windows ≤ 32 — "
        "per-token blocks and FP8 E4M3 side by side)",
    )
    add_output_argument(
        p, "card.md/.json/.html and the records they are built from", default="qbench_card", metavar="DIR"
    )
    p.add_argument(
        "--overwrite",
        action="store_true",
        help="replace a card of other models or settings in --output-path (the records it was built from stay)",
    )
    p.add_argument("--seed", type=seed_value, default=0, help=SEED_HELP)
    add_calibration_arguments(p)
    p.add_argument(
        "--llama-cpp",
        default="default",
        metavar="TYPES",
        help="comma list of llama.cpp file types scored as rows of their own on the card's windows (quantised and "
        "run by llama.cpp; pip install 'qbench[llama-cpp]'), none, or default = the budget's (standard, full: "
        "Q8_0,Q6_K,Q5_K_M,Q4_K_M,Q4_0,IQ4_NL,Q3_K_M,Q2_K when llama-cpp-python is installed, else none and the "
        "card says so; quick: none) (default: default)",
    )
    p.add_argument(
        "--mixed-plan",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="qbench plan on the card: a mixed-precision llama.cpp file at the size of the smallest llama.cpp type "
        "within the tolerance and 10 %% below it, measured against its promise and that type (one cell per tensor "
        "kind and candidate type, ~45 on a Llama-style model; needs the --llama-cpp rows) (default: the budget's: "
        "full on, quick and standard off)",
    )
    p.add_argument(
        "--from-json",
        metavar="DIR_OR_CARD_JSON",
        help="re-render card.md, card.html and the figures of a card already written, from its card.json alone "
        "(its folder or the file): no model loaded, no cell evaluated; card.json is rewritten at this qbench's "
        "card version (upgraded, nothing else in it changed); no other option applies (default: none — the card "
        "is measured from --ckpt)",
    )


def config(args: argparse.Namespace):
    from qbench.studies.card.config import CardConfig, validate

    cfg = CardConfig(
        models=list(args.ckpt),
        budget=args.budget,
        output_path=Path(args.output_path),
        tokens=args.tokens,
        window=args.window,
        corpus=args.data,
        split=args.split,
        bos=args.bos,
        sample=args.sample,
        sample_seed=args.sample_seed,
        batch_size=args.batch_size,
        tolerance=tolerance_from_args(args),
        metric=args.metric,
        kv_scheme=args.kv_scheme,
        seed=args.seed,
        dtype=args.dtype,
        device=args.device,
        trust_remote_code=args.trust_remote_code,
        allow_unsafe_weights=args.allow_unsafe_weights,
        placement=placement_from_args(args),
        command=getattr(args, "command_line", None),
        overwrite=args.overwrite,
        calib_data=args.calib_data,
        calib_tokens=args.calib_tokens,
        calib_sample=args.calib_sample,
    )
    from dataclasses import replace

    from qbench.cli.args import llama_cpp_types

    types, skipped = llama_cpp_types(args.llama_cpp, cfg.plan.llama_cpp)
    from models.errors import UserError

    mixed = cfg.plan.mixed_plan if args.mixed_plan is None else args.mixed_plan
    if args.mixed_plan and not types:
        raise UserError(
            "--mixed-plan plans at the size of a llama.cpp file type the card measured: give --llama-cpp types "
            + (f"({skipped})" if skipped else "(it is none)")
        )
    cfg = replace(cfg, llama_cpp=types, llama_cpp_skipped=skipped, mixed_plan=mixed and bool(types))

    from qbench.studies.resolve import resolve_cap

    cfg = replace(cfg, resolve_tokens=resolve_cap(args.resolve, args.tokens or cfg.plan.tokens))
    validate(cfg)
    return cfg


def run_card_with_progress(cfg) -> dict:
    """``run_card`` with one progress bar over all cells and the cost line per model (``qbench demo`` uses it)."""
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    from qbench.studies import card as study

    console.print(
        f"[bold]qbench card[/] {len(cfg.models)} model(s), budget {cfg.plan.describe()}"
        f"{f' (scoring {cfg.tokens:,} tokens: --tokens)' if cfg.tokens else ''} → {cfg.output_path}/",
        highlight=False,
    )
    counts = {"evaluated": 0, "reused": 0}
    with Progress(
        TextColumn("card"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(), console=console
    ) as bar:
        task = bar.add_task("card", total=None)

        def on_estimate(n: int, seconds: float, model: str) -> None:
            from qbench.eval.reference import CELL_COST

            bar.console.print(
                f"  {model}: {n} cells before the sensitivity study (which adds one per unit and per repair "
                f"step); one float evaluation took {seconds:.2f} s and a cell ~{CELL_COST}× that (its "
                f"comparison with the float logits), so ~{n * seconds * CELL_COST / 60:.1f} min of evaluation "
                "for the cells not yet on disk, plus quantising each (cells on disk cost nothing)",
                highlight=False,
                soft_wrap=True,
            )

        def on_cell(record: dict, reused: bool) -> None:
            counts["reused" if reused else "evaluated"] += 1
            bar.advance(task)

        notes: list[str] = []

        def on_note(line: str) -> None:
            notes.append(line)
            bar.console.print(f"  {line}", highlight=False, soft_wrap=True)

        progress = study.Progress(
            total=lambda n: bar.update(task, total=n), cell=on_cell, estimate=on_estimate, note=on_note
        )
        card = study.run_card(cfg, progress)
    console.print(f"{counts['evaluated']} cells evaluated, {counts['reused']} reused", highlight=False)
    for m in card["models"]:
        console.print(f"[bold]{m['name']}[/]", highlight=False)
        for line in m["verdict"]["lines"]:
            console.print(f"  {line}", highlight=False, soft_wrap=True)
    for line in notes:  # again after the progress bar: what the card does not show
        console.print(f"[yellow]not measured[/] {line}", highlight=False, soft_wrap=True)
    console.print(f"wrote {cfg.output_path / 'card.md'}, card.json, card.html")
    return card


def _options_given(args: argparse.Namespace) -> list[str]:
    """The options of ``qbench card`` other than --from-json that ``args`` holds at a value other than their
    default: a re-render reads card.json alone, so any of them would be silently ignored."""
    parser = argparse.ArgumentParser(add_help=False)
    add_arguments(parser)
    return [
        a.option_strings[0]
        for a in parser._actions
        if a.option_strings and a.dest != "from_json" and getattr(args, a.dest, a.default) != a.default
    ]


def rerender(args: argparse.Namespace) -> None:
    """``--from-json``: the card's pages again from its card.json, nothing else given."""
    from models.errors import UserError
    from qbench.studies.card.schema import CARD_VERSION
    from qbench.studies.card.write import rerender as rerender_card

    given = _options_given(args)
    if given:
        raise UserError(
            f"--from-json re-renders a written card from its card.json alone: {', '.join(given)} cannot apply to "
            "it; give --from-json alone (or --ckpt without it to measure a card)"
        )
    paths = rerender_card(args.from_json)
    figures = [p.name for k, p in paths.items() if k not in ("json", "md", "html")]
    console.print(
        f"re-rendered {paths['md']}, card.html and {len(figures)} figure(s) from card.json (card version "
        f"{CARD_VERSION}); no model loaded, no cell evaluated",
        highlight=False,
        soft_wrap=True,
    )


def run(args: argparse.Namespace) -> None:
    from models.errors import UserError

    if getattr(args, "from_json", None) is not None:
        rerender(args)
        return
    if not args.ckpt:
        raise UserError(
            "qbench card needs --ckpt (a model to measure, repeatable) or --from-json (a written card to "
            "re-render)"
        )
    if args.batch_size < 1:
        raise UserError(f"--batch-size must be at least 1, got {args.batch_size}")
    run_card_with_progress(config(args))
