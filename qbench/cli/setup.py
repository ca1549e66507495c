"""``qbench init | export | ls | env | data``: checkpoints, registries, the environment, corpora."""

from __future__ import annotations

import argparse
from collections.abc import Callable
from pathlib import Path

from rich.table import Table

from models.errors import UserError
from qbench.cli.base import command, console, err_console, print_wide

# --------------------------------------------------------------------------------------------------- init


@command("init")
def cmd_init(args: argparse.Namespace) -> None:
    from models import build, get_preset, preset_config
    from models.checkpoint import save_checkpoint
    from models.tokenizer import load_tokenizer

    out = Path(args.output_path)
    refuse_non_empty("init", out, args.overwrite)
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


def refuse_non_empty(command: str, out: Path, overwrite: bool) -> None:
    """A command that writes a model folder never mixes its files into someone else's without ``--overwrite``: a
    checkpoint written over another, or a model exported over its own source, would be silently mixed or lost."""
    if out.exists() and not out.is_dir():
        raise UserError(f"qbench {command}: {out} is an existing file; give a folder to write the model into")
    if out.is_dir() and not overwrite and any(out.iterdir()):
        raise UserError(f"qbench {command}: {out} is not empty; pass --overwrite to write into it anyway")


@command("export")
def cmd_export(args: argparse.Namespace) -> None:
    from models.hf import export_to_hf

    if args.out and args.output_path and Path(args.out) != Path(args.output_path):
        raise UserError(
            f"qbench export: two output folders ({args.out} and --output-path {args.output_path}); give one"
        )
    target = args.output_path or args.out
    if not target:
        raise UserError(
            "qbench export: give the output folder (qbench export CKPT OUT, or --output-path OUT)"
        )
    refuse_non_empty("export", Path(target), args.overwrite)
    out = export_to_hf(args.ckpt, target)
    console.print(
        f"wrote a transformers model folder to {out} "
        "(load it with AutoModelForCausalLM.from_pretrained after `import qbench`)"
    )


# ----------------------------------------------------------------------------------------------------- ls


def _registry_table(
    title: str,
    registry,
    extra: Callable[[str], str] | None = None,
    columns: dict[str, Callable[[str], str]] | None = None,
) -> Table:
    """A registry as a table: name, aliases, description (+ ``extra``), then one column per ``columns`` entry."""
    columns = columns or {}
    table = Table(title=title, title_justify="left")
    table.add_column("name", style="bold")
    table.add_column("aliases")
    table.add_column("description")
    for header in columns:
        table.add_column(header)
    for name in registry:
        aliases = ", ".join(registry.aliases_of(name))
        cells = [cell(name) for cell in columns.values()]
        table.add_row(name, aliases, registry.describe(name) + (extra(name) if extra else ""), *cells)
    return table


def _registries() -> dict[str, Callable[[], Table]]:
    def presets() -> Table:
        from models import PRESETS
        from models.sizes import parameter_counts  # arithmetic: building the models would import torch

        def detail(name: str) -> str:
            total, non_embedding = parameter_counts(PRESETS.get(name).config)
            return (
                f" [dim]— {total / 1e6:,.1f} M parameters ({non_embedding / 1e6:,.1f} M non-embedding), "
                f"tokenizer {PRESETS.get(name).tokenizer}[/]"
            )

        return _registry_table("presets", PRESETS, detail)

    def corpora() -> Table:
        from trainers.data import CORPORA

        return _registry_table("corpora (or any local text file / folder path)", CORPORA)

    def schemes() -> Table:
        from qbench.quant.kernels import real_kernel_for
        from qbench.quant.overrides import SYNTAX
        from qbench.quant.schemes import SCHEMES

        def real(name: str) -> str:  # from the dispatch registry itself
            kernel = real_kernel_for(SCHEMES.get(name))
            return kernel.layer if kernel else "[dim]fake only[/]"

        table = _registry_table("quantisation schemes", SCHEMES, columns={"real kernel": real})
        table.caption, table.caption_justify = f"every scheme takes overrides: {SYNTAX}", "left"
        return table

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
        from qbench.quant.kernels import available_backends, kernel_paths
    except ImportError:
        available_backends = None
    if available_backends is not None:
        for backend, ok in available_backends().items():
            table.add_row(f"kernel {backend}", "[green]yes[/]" if ok else "[dim]no[/]")
        for what, path in kernel_paths().items():  # from the dispatch code itself (paths.choose)
            table.add_row(what, path)
    console.print(table)


# --------------------------------------------------------------------------------------------------- data


@command("data")
def cmd_data(args: argparse.Namespace) -> None:
    from trainers import data

    if args.action == "fetch":
        path = data.fetch_mix(cache_dir=args.cache_dir)
        console.print(f"built the offline mix in {path}")
    elif args.action == "prepare":
        _data_prepare(args)
    else:
        raise UserError(f"unknown data action {args.action!r}; choose from: fetch, prepare")


def _data_prepare(args: argparse.Namespace) -> None:
    """``qbench data prepare c4 --tokens N``: token files for paper-length runs (trainers.tokenfiles)."""
    from trainers.tokenfiles import prepare

    if args.source is None or args.tokens is None:
        raise UserError(
            "usage: qbench data prepare c4 --tokens N [--output-path DIR] [--workers K] [--from DIR]"
        )
    result = prepare(
        args.source,
        args.tokens,
        args.output_path,
        tokenizer=args.tokenizer,
        workers=args.workers,
        local=getattr(args, "from"),
        cache_dir=args.cache_dir,
        log=lambda msg: err_console.print(msg, highlight=False),
    )
    m = result.manifest
    console.print(
        f"{result.folder}: {m['train']['tokens']:,} training tokens in {len(m['train']['shards'])} shard(s) "
        f"({len(result.tokenized)} file(s) tokenised now), {m['validation']['tokens']:,} validation tokens; "
        f"train with --data {result.folder}",
        highlight=False,
    )
