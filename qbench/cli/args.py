"""Command-line options shared by the commands that load a model and evaluate it on a protocol.

One definition of ``--ckpt``, the loading switches and the perplexity protocol's options, so every command
(``run``, ``grid``, ``inspect``, ``intervene``, ``score``, ``lm-eval``) spells them the same way.
"""

from __future__ import annotations

import argparse
from typing import TYPE_CHECKING

from rich.console import Console

from models.errors import UserError
from qbench.cli.budgets import EVAL_TOKENS
from qbench.quant.kv_options import GRANULARITIES, KV_BITS

# the loader, the protocol and the KV cache import torch: only the commands that use them import them
if TYPE_CHECKING:
    from qbench.eval.load import LoadedModel
    from qbench.eval.metrics import Protocol
    from qbench.quant.kv import KVConfig

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
    parser.add_argument("--device", default="cpu", help="cpu | cuda | cuda:N")
    parser.add_argument(
        "--trust-remote-code", action="store_true", help="allow a transformers model's own code"
    )
    parser.add_argument(
        "--allow-unsafe-weights",
        action="store_true",
        help="allow pickle-based .bin weights (trusted folders only)",
    )
    parser.add_argument("--batch-size", type=int, default=8, help="windows per forward pass")


def add_model_arguments(
    parser: argparse.ArgumentParser, tokens: int = EVAL_TOKENS, many: bool = False
) -> None:
    """:func:`add_load_arguments` plus the perplexity protocol's options (``qbench.eval.metrics.Protocol``);
    ``tokens`` is one of the budgets of :mod:`qbench.cli.budgets`."""
    add_load_arguments(parser, many)
    parser.add_argument("--data", default="embedded", help="corpus: embedded | mix | c4 | a local path")
    parser.add_argument(
        "--split",
        choices=("validation", "train", "all"),
        help="which documents of --data (default: validation of a registered corpus, all of a file or folder)",
    )
    parser.add_argument("--tokens", type=int, default=tokens, help="token budget: stream tokens scored")
    parser.add_argument("--window", type=int, help="window length (default: the model's context)")
    parser.add_argument(
        "--bos",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="open every window with <|endoftext|>",
    )


def protocol_from_args(args: argparse.Namespace, outlier_windows: int = 8) -> Protocol:
    from qbench.eval.metrics import Protocol

    if args.tokens < 2:
        raise UserError(f"--tokens must be at least 2, got {args.tokens}")
    if args.batch_size < 1:
        raise UserError(f"--batch-size must be at least 1, got {args.batch_size}")
    return Protocol(
        corpus=args.data,
        split=getattr(args, "split", None),
        tokens=args.tokens,
        window=args.window,
        bos=args.bos,
        batch_size=args.batch_size,
        outlier_windows=outlier_windows,
    )


def load_from_args(args: argparse.Namespace) -> LoadedModel:
    from qbench.eval.load import load_model

    return load_model(
        args.ckpt,
        dtype=args.dtype,
        device=args.device,
        trust_remote_code=args.trust_remote_code,
        allow_unsafe_weights=args.allow_unsafe_weights,
    )


def add_kv_arguments(parser: argparse.ArgumentParser) -> None:
    """--kv-bits, --kv-granularity, --kv-keep-first: KV-cache quantisation on top of every scheme
    (``qbench.quant.kv``; results named ``<scheme>+kv4``, and ``--scheme fp`` gives the float model's ``fp+kv4``)."""
    bits = " | ".join(map(str, KV_BITS))
    parser.add_argument(
        "--kv-bits",
        type=int,
        help=f"quantise the KV cache (keys after RoPE, values) to {bits} bits (default: a float cache)",
    )
    parser.add_argument(
        "--kv-granularity",
        help=f"{' | '.join(GRANULARITIES)}: kivi (default) = keys per channel over the scored window and "
        "values per token; per-token = both per token",
    )
    parser.add_argument(
        "--kv-keep-first",
        type=int,
        help="keep cache positions 0..K-1 in float and out of the ranges (sink protection; default: 0)",
    )


def kv_from_args(args: argparse.Namespace) -> KVConfig | None:
    """The KV-cache config the options ask for; None without --kv-bits (the other two options then refuse)."""
    granularity, keep_first = getattr(args, "kv_granularity", None), getattr(args, "kv_keep_first", None)
    if getattr(args, "kv_bits", None) is None:
        if granularity is not None or keep_first is not None:
            raise UserError("--kv-granularity and --kv-keep-first need --kv-bits (the KV cache's bit width)")
        return None
    from qbench.quant.kv import KVConfig

    return KVConfig(args.kv_bits, granularity or "kivi", keep_first or 0)
