"""``qbench speed | demo | sweep | reproduce | emergence``: the studies that run on top of the grid."""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from models.errors import UserError
from qbench.cli.base import command, console, err_console, print_wide
from qbench.cli.evaluate import _print_record

# -------------------------------------------------------------------------------------------------- speed


@command("speed")
def cmd_speed(args: argparse.Namespace) -> None:
    import json
    import os

    from models.io import atomic_write_json, git_commit, software_versions
    from qbench.eval.harness import check_modes, expand_schemes
    from qbench.studies.speed import MALLOC_ENV, format_speed_table, run_speed

    tablefmt = {"simple": "simple", "md": "github"}.get(args.format)
    if tablefmt is None:
        raise UserError(f"unknown table format {args.format!r}; choose simple or md")
    if args.from_json:
        path = Path(args.from_json)
        if not path.is_file():
            raise UserError(f"no speed records at {path} (write them with qbench speed --output-path {path})")
        try:
            payload = json.loads(path.read_text())
            records = payload["records"]
        except (json.JSONDecodeError, KeyError, TypeError) as err:
            raise UserError(f"{path} is not a qbench speed --output-path file ({err})") from None
        sys.stdout.write(format_speed_table(records, tablefmt) + "\n")
        return
    shape = (args.in_features, args.out_features)
    schemes = expand_schemes(args.scheme) if args.scheme else None
    if not all(v in os.environ for v in MALLOC_ENV):
        err_console.print(
            "[dim]tip: MALLOC_MMAP_MAX_=0 MALLOC_TRIM_THRESHOLD_=100000000000 qbench speed ... "
            "removes page-fault noise from the timings (see qbench/speed.py)[/]"
        )
    records = run_speed(
        shape=shape,
        tokens=args.tokens,
        threads=args.threads,
        repeats=args.repeats,
        schemes=schemes,
        modes=check_modes(args.mode or ["fake", "real"]),
        peers=not args.no_peers,
        model=None if args.no_model else args.model,
        ckpt=None if args.no_model else args.ckpt,
        model_tokens=args.model_tokens,
        new_tokens=args.new_tokens,
        generate=not args.no_generate,
        generate_via=args.generate_via,
        layer=not args.no_layer,
        device=args.device,
    )
    if args.output_path:
        payload = {"records": records, "software": software_versions(), "git_commit": git_commit()}
        if args.output_path == "-":
            sys.stdout.write(json.dumps(payload, indent=2) + "\n")
            return
        atomic_write_json(args.output_path, payload)
        console.print(f"wrote {args.output_path}")
    sys.stdout.write(format_speed_table(records, tablefmt) + "\n")  # plain text: never re-wrapped


# --------------------------------------------------------------------------------------------------- demo


@command("demo")
def cmd_demo(args: argparse.Namespace) -> None:
    from dataclasses import replace

    from qbench.eval.report import rich_table
    from qbench.studies import demo

    base = demo.LONG if args.long else demo.DemoConfig()
    steps = base.steps if args.steps is None else args.steps
    if steps < 1 or args.tokens < 2:
        raise UserError(f"--steps must be ≥ 1 and --tokens ≥ 2, got {steps} and {args.tokens}")
    if base.schedule_steps and steps > base.schedule_steps:
        raise UserError(f"--steps {steps} exceeds the long demo's {base.schedule_steps}-step schedule")
    cfg = replace(
        base,
        steps=steps,
        eval_tokens=args.tokens,
        ckpt_root=Path(args.ckpt_root or base.ckpt_root),
        output_path=Path(args.output_path or base.output_path),
        seed=args.seed,
        sweep_axes=() if args.no_sweep else base.sweep_axes,
    )
    console.print(
        f"[bold]qbench demo[/]: train {', '.join(demo.RECIPES)} ({cfg.description}) in {cfg.ckpt_root}/, "
        f"evaluate the paper's schemes, write {cfg.output_path}/"
    )
    train_s = demo.train_both(cfg, console)
    start = time.perf_counter()
    records = demo.evaluate(cfg, on_record=_print_record)
    eval_s = time.perf_counter() - start
    timings = {"train": train_s, "eval": eval_s}
    result = None
    if cfg.sweep_axes:
        from qbench.studies.sweep import sweep_table

        start = time.perf_counter()
        result = run_sweep_with_progress(demo.sweep_config(cfg), args.command_line)
        timings["sweep"] = time.perf_counter() - start
    table = demo.write_report(cfg, records, timings, args.command_line, result)
    print_wide(rich_table(records, title="qbench demo"))
    if result is not None:
        console.print(sweep_table(result), highlight=False, soft_wrap=True)
    words = {"train": "training", "eval": "evaluation", "sweep": "bit-width sweep"}
    spent = ", ".join(f"{words[k]} {v:.0f} s" for k, v in timings.items())
    console.print(f"wrote {table} and plots beside it ({spent})")


# -------------------------------------------------------------------------------------------------- sweep


def sweep_config(args: argparse.Namespace):
    """``qbench sweep``'s options -> ``SweepConfig`` (bad axes, bits, families fail here, before any model loads)."""
    from qbench.cli.args import protocol_from_args
    from qbench.eval.harness import expand_schemes
    from qbench.studies import sweep

    cfg = sweep.SweepConfig(
        models=args.ckpt,
        families=expand_schemes(args.family or [sweep.DEFAULT_FAMILY]),
        axes=sweep.parse_axes(args.axes),
        bits=sweep.parse_bits(args.bits),
        tolerance=args.tolerance,
        kv_keep_first=args.kv_keep_first or [],
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


@command("sweep")
def cmd_sweep(args: argparse.Namespace) -> None:
    from qbench.studies import sweep

    cfg = sweep_config(args)
    console.print(
        f"[bold]qbench sweep[/] {len(cfg.models)} model(s) × {', '.join(cfg.families)} × axes "
        f"{','.join(cfg.axes)} × bits {','.join(map(str, cfg.bits))} → {cfg.output_path}/"
    )
    result = run_sweep_with_progress(cfg, args.command_line)
    console.print(sweep.sweep_table(result), highlight=False, soft_wrap=True)
    console.print(f"wrote {cfg.output_path}/sweep.json, sweep.md, sweep.png")


@command("reproduce")
def cmd_reproduce(args: argparse.Namespace) -> None:
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
    records = reproduce.evaluate(cfg, on_record=_print_record)
    for path in reproduce.write_tables(cfg, records, args.command_line):
        console.print(f"[bold]{path}[/]")
        console.print(path.read_text(), highlight=False)


@command("emergence")
def cmd_emergence(args: argparse.Namespace) -> None:
    from qbench.studies.emergence import quantisation_curve, read_curves, write_emergence

    runs, out = [Path(r) for r in args.runs], Path(args.output_path)
    read_curves(runs)  # missing or same-named run folders fail here, before any snapshot is evaluated
    quantisation = None
    if args.snapshots:
        from qbench.eval.harness import GridSpec, check_modes, expand_schemes
        from qbench.eval.metrics import Protocol

        if args.tokens < 2:
            raise UserError(f"--tokens must be at least 2, got {args.tokens}")
        spec = GridSpec(
            models=[],
            schemes=expand_schemes(args.scheme or ["paper"]),
            modes=check_modes(args.mode or ["fake"]),
            protocol=Protocol(tokens=args.tokens),
            output_path=out / "quantisation",
            attention=not args.no_attention,
        )
        quantisation = quantisation_curve([r.name for r in runs], Path(args.snapshots), spec, _print_record)
    path = write_emergence(runs, out, args.command_line, quantisation)
    sys.stdout.write(path.read_text())
