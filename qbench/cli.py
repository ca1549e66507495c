"""The ``qbench`` command line. Each subcommand is a small function; registries supply every list of names.

Errors a user can cause (:class:`models.errors.UserError`) print one line and exit 2 — never a traceback.
"""

from __future__ import annotations

import argparse
import sys
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

        return _registry_table(
            "presets", PRESETS, lambda n: f" [dim](tokenizer {PRESETS.get(n).tokenizer})[/]"
        )

    def corpora() -> Table:
        from trainers.data import CORPORA

        return _registry_table("corpora (or any local text file / folder path)", CORPORA)

    def schemes() -> Table:
        from qbench.quant.schemes import SCHEMES

        return _registry_table("quantisation schemes", SCHEMES)

    def optimizers() -> Table:
        from trainers.optim.registry import OPTIMIZERS

        return _registry_table("optimisers", OPTIMIZERS)

    return {"presets": presets, "corpora": corpora, "schemes": schemes, "optimizers": optimizers}


@command("ls")
def cmd_ls(args: argparse.Namespace) -> None:
    from models.errors import unknown_choice

    tables = _registries()
    if args.what not in tables:
        raise unknown_choice("listing", args.what, tables)
    console.print(tables[args.what]())


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


# ------------------------------------------------------------------------------------------------- parser


def build_parser() -> argparse.ArgumentParser:
    from models.config import CHOICES

    parser = _Parser(prog="qbench", description=__doc__.splitlines()[0])
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

    p = sub.add_parser("ls", help="list presets, corpora, schemes or optimisers")
    p.add_argument("what", help="presets | corpora | schemes | optimizers")

    sub.add_parser("env", help="versions, devices and available real kernels")

    p = sub.add_parser("data", help="build offline corpora")
    p.add_argument("action", help="fetch: build the ~100 MB offline mix into the cache")
    p.add_argument("--cache-dir", help="default: $QBENCH_CACHE or ~/.cache/qbench")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    try:
        args = build_parser().parse_args(argv)
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
