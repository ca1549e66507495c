"""``qbench export``: write a qbench checkpoint as a transformers model folder or a GGUF file (llama.cpp)."""

from __future__ import annotations

import argparse
from pathlib import Path

from models.errors import UserError, unknown_choice
from qbench.cli.base import add_output_argument, console, refuse_non_empty

NAME = "export"
HELP = "write a qbench checkpoint as a transformers model folder or a GGUF file"
FORMATS = ("hf", "gguf")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("ckpt", help="qbench checkpoint folder")
    p.add_argument(
        "out", nargs="?", help="output folder, or .gguf file with --format gguf (or --output-path)"
    )
    add_output_argument(p, "output folder (--format hf) or file (--format gguf)", metavar="PATH")
    p.add_argument(
        "--format",
        default="hf",
        help="hf: a transformers folder (default); gguf: one float32 GGUF for llama.cpp (GPT-2 and Llama "
        "families with plain softmax attention; needs pip install 'qbench[gguf]')",
    )
    p.add_argument(
        "--overwrite", action="store_true", help="write into a folder that is not empty / over a file"
    )


def run(args: argparse.Namespace) -> None:
    if args.format not in FORMATS:
        raise unknown_choice("export format", args.format, FORMATS)
    if args.out and args.output_path and Path(args.out) != Path(args.output_path):
        raise UserError(
            f"qbench export: two output paths ({args.out} and --output-path {args.output_path}); give one"
        )
    target = args.output_path or args.out
    if not target:
        raise UserError("qbench export: give the output path (qbench export CKPT OUT, or --output-path OUT)")
    if args.format == "gguf":
        _export_gguf(args.ckpt, Path(target), args.overwrite)
        return
    from models.hf import export_to_hf

    refuse_non_empty("export", Path(target), args.overwrite)
    out = export_to_hf(args.ckpt, target)
    console.print(
        f"wrote a transformers model folder to {out} "
        "(load it with AutoModelForCausalLM.from_pretrained after `import qbench`)"
    )


def _export_gguf(ckpt: str, out: Path, overwrite: bool) -> None:
    from models.checkpoint import load_checkpoint
    from models.gguf_export import write_gguf

    if out.suffix != ".gguf":
        raise UserError(f"qbench export --format gguf: {out} must be a file ending in .gguf")
    if out.is_dir():
        raise UserError(f"qbench export --format gguf: {out} is a folder; give a .gguf file path")
    if out.exists() and not overwrite:
        raise UserError(f"qbench export: {out} exists; pass --overwrite to replace it")
    if not out.parent.is_dir():
        raise UserError(f"qbench export: the folder {out.parent} does not exist")
    checkpoint = load_checkpoint(ckpt)
    path = write_gguf(checkpoint.model, out, checkpoint.tokenizer, name=Path(ckpt).name)
    size = path.stat().st_size / 2**20
    console.print(
        f"wrote {path} ({size:,.1f} MiB, float32; quantise it with llama.cpp's llama-quantize, or run it with "
        "qbench --ckpt / llama.cpp)"
    )
