"""``qbench export``: write a qbench checkpoint as a transformers model folder."""

from __future__ import annotations

import argparse
from pathlib import Path

from models.errors import UserError
from qbench.cli.base import add_output_argument, console, refuse_non_empty

NAME = "export"
HELP = "write a qbench checkpoint as a transformers model folder"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("ckpt", help="qbench checkpoint folder")
    p.add_argument("out", nargs="?", help="output folder (or give it as --output-path)")
    add_output_argument(p, "output folder", metavar="DIR")
    p.add_argument("--overwrite", action="store_true", help="write into a folder that is not empty")


def run(args: argparse.Namespace) -> None:
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
