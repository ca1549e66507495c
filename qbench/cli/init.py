"""``qbench init``: write a randomly initialised checkpoint of a preset."""

from __future__ import annotations

import argparse
from pathlib import Path

from models.config import CHOICES
from models.errors import UserError
from qbench.cli.args import seed_value
from qbench.cli.base import add_output_argument, console, refuse_non_empty

NAME = "init"
HELP = "write a randomly initialised checkpoint of a preset"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--preset", default="tiny", help="model preset (qbench ls presets)")
    add_output_argument(p, "checkpoint folder to write", "--out", required=True, metavar="DIR")
    p.add_argument("--seed", type=seed_value, default=0, help="seed of the random initialisation")
    p.add_argument("--tokenizer", help="tokenizer name or folder (default: the preset's)")
    for switch in ("attn", "norm", "norm_position", "pos"):
        p.add_argument(
            f"--{switch.replace('_', '-')}",
            dest=switch,
            help=" | ".join(CHOICES[switch]) + " (default: the preset's)",
        )
    p.add_argument(
        "--bias",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="biases in linears/norms (default: the preset's)",
    )
    p.add_argument("--overwrite", action="store_true", help="write into a folder that is not empty")


def run(args: argparse.Namespace) -> None:
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
    if len(tokenizer) > config.vocab_size:  # refused before anything is written (save_checkpoint checks too)
        raise UserError(
            f"--tokenizer {args.tokenizer or preset.tokenizer} has {len(tokenizer)} tokens but preset "
            f"{args.preset!r} has vocab_size {config.vocab_size}; use the preset's tokenizer "
            f"({preset.tokenizer}) or a preset built for this one"
        )
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
