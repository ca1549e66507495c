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
    p.add_argument(
        "ckpt",
        help="qbench checkpoint folder (--format hf); with --format gguf any model --ckpt loads (a transformers "
        "folder of the GPT-2 or Llama family, a GGUF, a hub name)",
    )
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
        "--scheme",
        help="with --format gguf: write the weights quantised by this qbench scheme in the llama.cpp type with its "
        "arithmetic — int8 absmax blocks of 32 as Q8_0 (absmax-fine:group=32), int4 absmax blocks of 32 as Q4_0 "
        "(absmax-w4a8-g32), int4 zero-point blocks of 32 as Q4_1 (zeropoint-w4a8-g32); the scales stored fp16; "
        "another scheme is refused naming the nearest (default: none, float32)",
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
        _export_gguf(args.ckpt, Path(target), args.overwrite, args.scheme)
        return
    if args.scheme:
        raise UserError("qbench export --scheme writes llama.cpp's block types: give it with --format gguf")
    from models.hf import export_to_hf

    refuse_non_empty("export", Path(target), args.overwrite)
    out = export_to_hf(args.ckpt, target)
    console.print(
        f"wrote a transformers model folder to {out} "
        "(load it with AutoModelForCausalLM.from_pretrained after `import qbench`)"
    )


def _export_gguf(ckpt: str, out: Path, overwrite: bool, scheme_name: str | None = None) -> None:
    from models.gguf_export import write_gguf

    if out.suffix != ".gguf":
        raise UserError(f"qbench export --format gguf: {out} must be a file ending in .gguf")
    if out.is_dir():
        raise UserError(f"qbench export --format gguf: {out} is a folder; give a .gguf file path")
    if out.exists() and not overwrite:
        raise UserError(f"qbench export: {out} exists; pass --overwrite to replace it")
    if not out.parent.is_dir():
        raise UserError(f"qbench export: the folder {out.parent} does not exist")
    scheme = None
    if scheme_name:
        from qbench.quant import get_scheme
        from qbench.quant.llamacpp import export_type

        scheme = get_scheme(scheme_name)
        export_type(scheme)  # refused before the checkpoint loads
    from qbench.eval.load import load_model

    loaded = load_model(ckpt)  # a qbench checkpoint, a transformers folder, a GGUF or a hub name, as --ckpt
    quantize, head = None, False
    if scheme is not None:
        from qbench.quant.llamacpp import pack_blocks

        head = scheme.quantize_lm_head
        floats = {"token_embd.weight", "position_embd.weight"} | (set() if head else {"output.weight"})

        def quantize(
            name, tensor
        ):  # the linears qbench quantises: every 2-D tensor but embeddings (and head)
            return None if name in floats else pack_blocks(tensor, scheme)

    path = write_gguf(
        loaded.model, out, loaded.tokenizer, name=loaded.name, quantize=quantize, separate_head=head
    )
    size = path.stat().st_size / 2**20
    if scheme is None:
        console.print(
            f"wrote {path} ({size:,.1f} MiB, float32; quantise it with llama.cpp's llama-quantize, or run it with "
            "qbench --ckpt / llama.cpp)"
        )
    else:
        console.print(
            f"wrote {path} ({size:,.1f} MiB: {scheme.name}'s weights as llama.cpp {export_type(scheme)}, scales "
            "fp16; embeddings float32; score it with qbench run --ckpt, run it with llama.cpp)"
        )
