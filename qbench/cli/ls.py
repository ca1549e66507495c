"""``qbench ls``: list presets, corpora, schemes, optimizers, recipes or results."""

from __future__ import annotations

import argparse
from collections.abc import Callable
from pathlib import Path

from rich.table import Table

from models.errors import UserError
from qbench.cli.base import print_wide

NAME = "ls"
HELP = "list presets, corpora, schemes, optimizers, recipes or results"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("what", help="presets | corpora | schemes | optimizers | recipes | results")
    p.add_argument(
        "--output-path", default="qbench_results", metavar="DIR", help="the results folder `ls results` reads"
    )


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
            if SCHEMES.get(name).method == "gguf":
                return "llama.cpp, both modes"
            kernel = real_kernel_for(SCHEMES.get(name))
            return kernel.layer if kernel else "[dim]fake only[/]"

        table = _registry_table("quantisation schemes", SCHEMES, columns={"real kernel": real})
        table.caption = f"every scheme but gguf:* takes overrides: {SYNTAX}"
        table.caption_justify = "left"
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

    root = Path(output_path)
    if not root.is_dir():  # a typo or a file must not list as "no results" with exit 0
        what = "is a file, not a results folder" if root.exists() else "does not exist"
        raise UserError(
            f"qbench ls results: {root} {what}; give the folder that qbench run/grid/sweep wrote with --output-path DIR"
        )
    table = Table(title=f"results in {output_path}/", title_justify="left")
    for column in ("model", "scheme", "mode", "perplexity", "vs fp", "status", "created (UTC)"):
        table.add_column(column)
    for r in read_records(root):
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


def run(args: argparse.Namespace) -> None:
    from models.errors import unknown_choice

    tables = _registries()
    if args.what not in tables:
        raise unknown_choice("listing", args.what, tables)
    print_wide(tables[args.what](args.output_path) if args.what == "results" else tables[args.what]())
