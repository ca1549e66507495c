"""Command-line options shared by the commands that load a model and evaluate it on a protocol.

One definition of ``--ckpt``, the loading switches and the perplexity protocol's options, so every command
(``run``, ``grid``, ``inspect``, ``intervene``, ``score``, ``lm-eval``) spells them the same way.
"""

from __future__ import annotations

import argparse

from rich.console import Console

from models.errors import UserError
from qbench.eval.load import LoadedModel, load_model
from qbench.eval.metrics import Protocol

console = Console(soft_wrap=True)  # long result lines stay whole in pipes and logs


def add_load_arguments(parser: argparse.ArgumentParser, many: bool = False) -> None:
    """--ckpt (repeatable with ``many``) and how to load it."""
    parser.add_argument(
        "--ckpt",
        required=True,
        action="append" if many else "store",
        help="qbench checkpoint, transformers folder, ckpts/NAME, or hub name"
        + (" (repeatable)" if many else ""),
    )
    parser.add_argument("--dtype", default="float32", help="float32 | bfloat16 | float16")
    parser.add_argument("--device", default="cpu")
    parser.add_argument(
        "--trust-remote-code", action="store_true", help="allow a transformers model's own code"
    )
    parser.add_argument(
        "--allow-unsafe-weights",
        action="store_true",
        help="allow pickle-based .bin weights (trusted folders only)",
    )
    parser.add_argument("--batch-size", type=int, default=8)


def add_model_arguments(parser: argparse.ArgumentParser, tokens: int = 8192, many: bool = False) -> None:
    """:func:`add_load_arguments` plus the perplexity protocol's options (``qbench.eval.metrics.Protocol``)."""
    add_load_arguments(parser, many)
    parser.add_argument("--data", default="embedded", help="corpus: embedded | mix | c4 | a local path")
    parser.add_argument("--tokens", type=int, default=tokens, help=f"token budget (default {tokens})")
    parser.add_argument("--window", type=int, help="window length (default: the model's context)")
    parser.add_argument(
        "--bos",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="open every window with <|endoftext|> (default on)",
    )


def protocol_from_args(args: argparse.Namespace, outlier_windows: int = 8) -> Protocol:
    if args.tokens < 2:
        raise UserError(f"--tokens must be at least 2, got {args.tokens}")
    if args.batch_size < 1:
        raise UserError(f"--batch-size must be at least 1, got {args.batch_size}")
    return Protocol(
        corpus=args.data,
        tokens=args.tokens,
        window=args.window,
        bos=args.bos,
        batch_size=args.batch_size,
        outlier_windows=outlier_windows,
    )


def load_from_args(args: argparse.Namespace) -> LoadedModel:
    return load_model(
        args.ckpt,
        dtype=args.dtype,
        device=args.device,
        trust_remote_code=args.trust_remote_code,
        allow_unsafe_weights=args.allow_unsafe_weights,
    )
