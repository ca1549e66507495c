"""The ``qbench`` command line. Each subcommand is a small function; registries supply every list of names.

Errors a user can cause (:class:`models.errors.UserError`) print one line and exit 2 — never a traceback.
"""

from __future__ import annotations

import argparse
import shlex
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path

from rich.console import Console
from rich.table import Table

from models.errors import UserError

console = Console()
err_console = Console(stderr=True)
COMMANDS: dict[str, Callable[[argparse.Namespace], int | None]] = {}


class _Parser(argparse.ArgumentParser):
    """argparse with one-line errors (no usage dump), exit code 2."""

    def error(self, message: str) -> None:  # type: ignore[override]
        raise UserError(f"{self.prog}: {message}")


def command(name: str) -> Callable:
    def register(fn: Callable[[argparse.Namespace], int | None]) -> Callable:
        COMMANDS[name] = fn
        return fn

    return register


# --------------------------------------------------------------------------------------------------- init


@command("init")
def cmd_init(args: argparse.Namespace) -> None:
    from models import build, get_preset, preset_config
    from models.checkpoint import is_checkpoint, save_checkpoint
    from models.tokenizer import load_tokenizer

    out = Path(args.out)
    if is_checkpoint(out) and not args.overwrite:
        raise UserError(f"{out} already holds a checkpoint; pass --overwrite to replace it")
    preset = get_preset(args.preset)
    config = preset_config(
        args.preset,
        attn=args.attn,
        norm=args.norm,
        norm_position=args.norm_position,
        pos=args.pos,
        bias=args.bias,
    )
    tokenizer = load_tokenizer(args.tokenizer or preset.tokenizer)
    model = build(config, seed=args.seed)
    save_checkpoint(
        out,
        model,
        tokenizer,
        provenance={
            "created_by": "qbench init",
            "preset": args.preset,
            "seed": args.seed,
            "training": None,
        },
    )
    console.print(
        f"wrote randomly initialised [bold]{args.preset}[/] checkpoint ({config.attn}, {config.norm}, "
        f"{model.num_parameters():,} parameters) to {out}"
    )


# ------------------------------------------------------------------------------------------------- export


@command("export")
def cmd_export(args: argparse.Namespace) -> None:
    from models.hf import export_to_hf

    out = export_to_hf(args.ckpt, args.out)
    console.print(
        f"wrote a transformers model folder to {out} "
        "(load it with AutoModelForCausalLM.from_pretrained after `import qbench`)"
    )


# ----------------------------------------------------------------------------------------------------- ls


def _registry_table(title: str, registry, extra: Callable[[str], str] | None = None) -> Table:
    table = Table(title=title, title_justify="left")
    table.add_column("name", style="bold")
    table.add_column("aliases")
    table.add_column("description")
    for name in registry:
        aliases = ", ".join(registry.aliases_of(name))
        table.add_row(name, aliases, registry.describe(name) + (extra(name) if extra else ""))
    return table


def _registries() -> dict[str, Callable[[], Table]]:
    def presets() -> Table:
        from models import PRESETS
        from models.transformer import count_parameters

        def detail(name: str) -> str:
            total, non_embedding = count_parameters(PRESETS.get(name).config)
            return (
                f" [dim]— {total / 1e6:,.1f} M parameters ({non_embedding / 1e6:,.1f} M non-embedding), "
                f"tokenizer {PRESETS.get(name).tokenizer}[/]"
            )

        return _registry_table("presets", PRESETS, detail)

    def corpora() -> Table:
        from trainers.data import CORPORA

        return _registry_table("corpora (or any local text file / folder path)", CORPORA)

    def schemes() -> Table:
        from qbench.quant.schemes import SCHEMES

        return _registry_table("quantisation schemes", SCHEMES)

    def optimizers() -> Table:
        from trainers.optim.registry import OPTIMIZERS

        return _registry_table("optimisers", OPTIMIZERS)

    def recipes() -> Table:
        from trainers.recipes import RECIPES

        return _registry_table("training recipes", RECIPES)

    return {
        "presets": presets,
        "corpora": corpora,
        "schemes": schemes,
        "optimizers": optimizers,
        "recipes": recipes,
        "results": _results_table,
    }


def _results_table(output_path: str = "qbench_results") -> Table:
    from qbench.eval.report import read_records

    table = Table(title=f"results in {output_path}/", title_justify="left")
    for column in ("model", "scheme", "mode", "perplexity", "vs fp", "status", "created (UTC)"):
        table.add_column(column)
    root = Path(output_path)
    for r in read_records(root) if root.is_dir() else []:
        m = r["metrics"]
        table.add_row(
            r["model"]["name"],
            r["scheme"]["name"],
            r["mode"],
            "-" if m["perplexity"] is None else f"{m['perplexity']:.3f}",
            ""
            if m["ppl_change_pct"] is None or r["scheme"]["name"] == "fp"
            else f"{m['ppl_change_pct']:+.2f}%",
            r.get("status", "ok"),
            r.get("created_utc", ""),
        )
    return table


@command("ls")
def cmd_ls(args: argparse.Namespace) -> None:
    from models.errors import unknown_choice

    tables = _registries()
    if args.what not in tables:
        raise unknown_choice("listing", args.what, tables)
    print_wide(tables[args.what](args.output_path) if args.what == "results" else tables[args.what]())


# ---------------------------------------------------------------------------------------------------- env


@command("env")
def cmd_env(args: argparse.Namespace) -> None:
    import torch

    from models.io import git_commit, software_versions

    table = Table(title="qbench environment", title_justify="left", show_header=False)
    for name, version in software_versions().items():
        table.add_row(name, version or "[dim]not installed[/]")
    table.add_row("git commit", git_commit() or "-")
    table.add_row("torch threads", str(torch.get_num_threads()))
    table.add_row("cuda", torch.cuda.get_device_name(0) if torch.cuda.is_available() else "[dim]none[/]")
    try:
        from qbench.quant.kernels import available_backends
    except ImportError:
        available_backends = None
    if available_backends is not None:
        for backend, ok in available_backends().items():
            table.add_row(f"kernel {backend}", "[green]yes[/]" if ok else "[dim]no[/]")
    console.print(table)


# --------------------------------------------------------------------------------------------------- data


@command("data")
def cmd_data(args: argparse.Namespace) -> None:
    from trainers import data

    if args.action == "fetch":
        path = data.fetch_mix(cache_dir=args.cache_dir)
        console.print(f"built the offline mix in {path}")
    else:
        raise UserError(f"unknown data action {args.action!r}; choose from: fetch")


# ---------------------------------------------------------------------------------------- run / grid / compare


def _grid_spec(args: argparse.Namespace, models: list[str]):
    from qbench.cli.args import protocol_from_args
    from qbench.eval.harness import GridSpec, check_modes, expand_schemes

    protocol = protocol_from_args(args)
    return GridSpec(
        models=models,
        schemes=expand_schemes(args.scheme or ["paper"]),
        modes=check_modes(args.mode or ["fake"]),
        protocol=protocol,
        output_path=Path(args.output_path),
        seed=args.seed,
        dtype=args.dtype,
        device=args.device,
        exclude=tuple(args.exclude or ()),
        attention=not args.no_attention,
        quantize_lm_head=args.quantize_lm_head,
        trust_remote_code=args.trust_remote_code,
        allow_unsafe_weights=args.allow_unsafe_weights,
    )


def _print_record(record: dict, reused: bool) -> None:
    m = record["metrics"]
    scheme = record["scheme"]["name"]
    ppl = "NaN" if m["perplexity"] is None else f"{m['perplexity']:.3f}"
    change = "" if scheme == "fp" or m["ppl_change_pct"] is None else f" ({m['ppl_change_pct']:+.2f}%)"
    note = " [dim](reused)[/]" if reused else f" [dim]{record['wall_seconds']:.1f}s[/]"
    if record.get("status") not in (None, "ok"):
        note += f" [yellow]{record['status']}: {record['error']}[/]"
    console.print(
        f"  {record['model']['name']:<20} {scheme:<24} {record['mode']:<5} ppl {ppl}{change}{note}",
        highlight=False,
    )


def print_wide(renderable) -> None:
    """Tables are wide; a pipe or file gets them uncropped (a terminal keeps its own width)."""
    if console.is_terminal:
        console.print(renderable)
    else:
        Console(width=240).print(renderable)


def _run_and_show(spec) -> list[dict]:
    from qbench.eval.harness import run_grid
    from qbench.eval.report import rich_table

    console.print(
        f"[bold]qbench[/] {len(spec.models)} model(s) × {len(spec.schemes)} scheme(s) × "
        f"{len(spec.modes)} mode(s) → {spec.output_path}/"
    )
    records = run_grid(spec, on_record=_print_record)
    print_wide(rich_table(records))
    return records


@command("run")
def cmd_run(args: argparse.Namespace) -> None:
    _run_and_show(_grid_spec(args, [args.ckpt]))


@command("grid")
def cmd_grid(args: argparse.Namespace) -> None:
    _run_and_show(_grid_spec(args, args.ckpt))


def _records_for(name: str, output_path: Path) -> list[dict]:
    """Resolve a ``compare`` argument (rule in the ``compare`` help) to its records."""
    from qbench.eval.load import resolve
    from qbench.eval.report import read_records

    for folder in (Path(name), output_path / name):
        if folder.is_dir() and (records := read_records(folder)):
            return records
    try:
        resolve(name)
    except UserError:
        raise UserError(
            f"no results named {name!r}: not a results folder, not {output_path / name}, "
            f"and not a checkpoint (ckpts/{name}); run `qbench grid --ckpt {name}` first"
        ) from None
    from qbench.eval.harness import GridSpec, run_grid

    console.print(f"[dim]no results for {name!r} yet: evaluating it with the paper's schemes[/]")
    return run_grid(
        GridSpec(
            models=[name],
            schemes=["absmax-fine", "absmax-moderate", "absmax-coarse", "zeropoint-int4"],
            output_path=output_path,
        ),
        on_record=_print_record,
    )


@command("compare")
def cmd_compare(args: argparse.Namespace) -> None:
    from qbench.eval.report import FORMATS, render, rich_table

    if args.format not in FORMATS:
        from models.errors import unknown_choice

        raise unknown_choice("format", args.format, FORMATS)
    records = [r for name in args.names for r in _records_for(name, Path(args.output_path))]
    if args.format == "table":
        print_wide(rich_table(records))
    else:
        sys.stdout.write(render(records, args.format))


# -------------------------------------------------------------------------------------------------- speed


@command("speed")
def cmd_speed(args: argparse.Namespace) -> None:
    import json
    import os

    from models.io import atomic_write_json, git_commit, software_versions
    from qbench.eval.harness import check_modes, expand_schemes
    from qbench.studies.speed import MALLOC_ENV, format_speed_table, run_speed

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
    )
    if args.json:
        payload = {"records": records, "software": software_versions(), "git_commit": git_commit()}
        if args.json == "-":
            sys.stdout.write(json.dumps(payload, indent=2) + "\n")
            return
        atomic_write_json(args.json, payload)
        console.print(f"wrote {args.json}")
    sys.stdout.write(format_speed_table(records) + "\n")  # plain text: never re-wrapped to the terminal width


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
    )
    console.print(
        f"[bold]qbench demo[/]: train {', '.join(demo.RECIPES)} ({cfg.description}) in {cfg.ckpt_root}/, "
        f"evaluate the paper's schemes, write {cfg.output_path}/"
    )
    train_s = demo.train_both(cfg, console)
    start = time.perf_counter()
    records = demo.evaluate(cfg, on_record=_print_record)
    eval_s = time.perf_counter() - start
    table = demo.write_report(cfg, records, {"train": train_s, "eval": eval_s}, args.command_line)
    print_wide(rich_table(records, title="qbench demo"))
    console.print(f"wrote {table} and plots beside it (training {train_s:.0f} s, evaluation {eval_s:.0f} s)")


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

    runs, out = [Path(r) for r in args.runs], Path(args.out)
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


# ------------------------------------------------------------------------------------------------- parser


def build_parser() -> argparse.ArgumentParser:
    from models.config import CHOICES
    from qbench.cli.args import add_model_arguments
    from qbench.eval.metrics import Protocol
    from qbench.studies import inspection, intervene, lm_eval_adapter, score

    parser = _Parser(
        prog="qbench",
        description="Quantisation robustness of causal LMs: outliers, attention sinks, "
        "softmax-1 and OrthoAdam (Kaul et al., ICLR 2025).",
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=_Parser)

    p = sub.add_parser("init", help="write a randomly initialised checkpoint of a preset")
    p.add_argument("--preset", default="tiny", help="model preset (qbench ls presets)")
    p.add_argument("--out", required=True, help="checkpoint folder to write")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--tokenizer", help="tokenizer name or folder (default: the preset's)")
    for switch in ("attn", "norm", "norm_position", "pos"):
        p.add_argument(f"--{switch.replace('_', '-')}", dest=switch, help=" | ".join(CHOICES[switch]))
    p.add_argument(
        "--bias", action=argparse.BooleanOptionalAction, default=None, help="biases in linears/norms"
    )
    p.add_argument("--overwrite", action="store_true", help="replace a checkpoint already in --out")

    p = sub.add_parser("export", help="write a qbench checkpoint as a transformers model folder")
    p.add_argument("ckpt", help="qbench checkpoint folder")
    p.add_argument("out", help="output folder")

    p = sub.add_parser("ls", help="list presets, corpora, schemes, optimizers, recipes or results")
    p.add_argument("what", help="presets | corpora | schemes | optimizers | recipes | results")
    p.add_argument("--output-path", default="qbench_results", help="for `ls results`")

    sub.add_parser("env", help="versions, devices and available real kernels")

    def eval_options(p: argparse.ArgumentParser, many: bool = False) -> None:
        add_model_arguments(p, tokens=Protocol.tokens, many=many)
        p.add_argument(
            "--scheme",
            action="append",
            help="scheme name (repeatable), 'paper' (the paper's four, "
            "default) or 'all' — see qbench ls schemes",
        )
        p.add_argument("--mode", action="append", help="fake (default) | real; repeatable")
        p.add_argument("--output-path", default="qbench_results", help="where result JSON goes")
        p.add_argument("--exclude", action="append", help="fnmatch pattern of layer names to keep in float")
        p.add_argument("--seed", type=int, default=0)
        p.add_argument("--no-attention", action="store_true", help="skip attention statistics (faster)")
        p.add_argument(
            "--quantize-lm-head",
            action="store_true",
            help="quantise the LM head too (default: float, as in the paper); results named <scheme>+head",
        )

    p = sub.add_parser("run", help="evaluate one model under one or more schemes")
    eval_options(p)

    p = sub.add_parser("grid", help="evaluate models × schemes (resumable: finished cells are reused)")
    eval_options(p, many=True)

    for name, module, text in (
        (
            "inspect",
            inspection,
            "outlier/attention metrics JSON + plots (attention map, activations, per layer)",
        ),
        ("intervene", intervene, "set massive activations to zero or their mean; perplexity change"),
        ("score", score, "a model's robustness in one number: outliers + perplexity change per paper scheme"),
        ("lm-eval", lm_eval_adapter, "run lm-evaluation-harness tasks on the quantised in-memory model"),
    ):
        module.add_arguments(sub.add_parser(name, help=text))
        COMMANDS[name] = module.run

    p = sub.add_parser("compare", help="table of results: rows = models, columns = fp then schemes")
    p.add_argument(
        "names",
        nargs="+",
        help="a results folder, a model's name under --output-path, or a "
        "checkpoint ckpts/NAME (evaluated with the paper's schemes if it has no results yet)",
    )
    p.add_argument("--format", default="table", help="table | md | csv | latex | json")
    p.add_argument("--output-path", default="qbench_results")

    p = sub.add_parser(
        "speed", help="time/memory of each scheme × mode vs fp32 and peers (ratios, interleaved)"
    )
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--in-features", type=int, default=1024)
    p.add_argument("--out-features", type=int, default=4096)
    p.add_argument("--tokens", type=int, default=512)
    p.add_argument("--repeats", type=int, default=15)
    p.add_argument("--scheme", action="append", help="repeatable; default: every registered scheme")
    p.add_argument("--mode", action="append", help="fake | real (default both)")
    p.add_argument("--model", default="small", help="preset for the whole-model figure")
    p.add_argument("--no-model", action="store_true", help="skip the whole-model figure")
    p.add_argument("--no-peers", action="store_true", help="skip torch.ao / bitsandbytes / torchao peers")
    p.add_argument("--json", help="also write the records to this file ('-' for stdout only)")

    p = sub.add_parser(
        "demo", help="train vanilla + paper tiny models, evaluate the paper's schemes (~15 min CPU)"
    )
    p.add_argument(
        "--long",
        action="store_true",
        help="the budget at which quantisation damage appears in the vanilla model (Llama style, ~50 min)",
    )
    p.add_argument(
        "--steps", type=int, help="training steps per model, 16 x 128 tokens each (default 500; --long 2000)"
    )
    p.add_argument("--tokens", type=int, default=16384, help="evaluation token budget per model")
    p.add_argument("--ckpt-root", help="default ckpts/demo (--long: ckpts/demo-long)")
    p.add_argument("--output-path", help="default results/demo (--long: results/demo-long)")
    p.add_argument("--seed", type=int, default=0)

    p = sub.add_parser(
        "emergence", help="training-probe curves of runs (kurtosis, max |act|, sink) → JSON/PNG/md"
    )
    p.add_argument("runs", nargs="+", help="training run folders (with metrics.jsonl)")
    p.add_argument("--out", required=True, help="output folder")
    p.add_argument(
        "--snapshots",
        metavar="ROOT",
        help="also the quantisation curve: evaluate the checkpoints in ROOT/<run name>/*/ (resumable)",
    )
    p.add_argument("--scheme", action="append", help="with --snapshots: schemes (default: the paper's four)")
    p.add_argument("--mode", action="append", help="with --snapshots: fake (default) | real; repeatable")
    p.add_argument(
        "--tokens", type=int, default=32768, help="with --snapshots: evaluation tokens per snapshot"
    )
    p.add_argument("--no-attention", action="store_true", help="with --snapshots: skip attention statistics")

    p = sub.add_parser(
        "reproduce", help="the paper's Tables 2-3 (and 4): train the variants, evaluate, tabulate"
    )
    p.add_argument("--preset", required=True, help="model preset (qbench ls presets)")
    p.add_argument("--recipes", nargs="+", help="default: vanilla softmax1 orthoadam softmax1-orthoadam")
    p.add_argument("--ablations", action="store_true", help="also the Table-4 ablation recipes")
    budget = p.add_mutually_exclusive_group()
    budget.add_argument("--steps", type=int, help="training steps per model")
    budget.add_argument("--tokens", type=int, help="training tokens per model")
    p.add_argument("--data", default="embedded", help="corpus: embedded | mix | c4 | a local path")
    p.add_argument("--lr", type=float, help="peak learning rate (default: the trainer's)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--eval-tokens", type=int, default=262144, help="evaluation token budget per model")
    p.add_argument("--mode", action="append", help="fake (default) | real")
    p.add_argument(
        "--nproc-per-node", type=int, default=1, help="train each model with torchrun on K devices"
    )
    p.add_argument("--parallel", type=int, default=1, help="models trained at once (CPU: one thread each)")
    p.add_argument("--ckpt-root", help="default ckpts/reproduce/<preset>")
    p.add_argument("--output-path", help="default results/reproduce/<preset>")

    sub.add_parser(
        "train",
        help="train a checkpoint: same options as `python -m trainers` (qbench train -h)",
        add_help=False,
    )

    p = sub.add_parser("data", help="build offline corpora")
    p.add_argument("action", help="fetch: build the ~100 MB offline mix into the cache")
    p.add_argument("--cache-dir", help="default: $QBENCH_CACHE or ~/.cache/qbench")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["train"]:  # the trainer owns its options; one implementation, two entry points
        from trainers.__main__ import main as train_main

        return train_main(argv[1:])
    try:
        args = build_parser().parse_args(argv)
        args.command_line = shlex.join(["qbench", *argv])  # written beside results: how to make them again
        if args.command is None:
            build_parser().print_help()
            return 0
        return COMMANDS[args.command](args) or 0
    except UserError as e:
        err_console.print(f"[bold red]error:[/] {e}", highlight=False, soft_wrap=True)
        return 2
    except KeyboardInterrupt:
        err_console.print("[yellow]interrupted[/]; everything written so far is kept")
        return 130


if __name__ == "__main__":
    sys.exit(main())
