"""``qbench data``: build offline corpora; tokenise C4 shards into token files."""

from __future__ import annotations

import argparse

from models.errors import UserError
from qbench.cli.base import add_output_argument, console, err_console

NAME = "data"
HELP = "build offline corpora; tokenise C4 shards into token files"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "action",
        help="fetch: build the ~100 MB offline mix into the cache; prepare: tokenise C4 training shards "
        "into memory-mapped token files (needs the hub, or --from a local mirror)",
    )
    p.add_argument("source", nargs="?", help="prepare: the corpus (c4)")
    p.add_argument("--tokens", type=int, help="prepare: training tokens wanted (shards are taken in order)")
    add_output_argument(
        p, "prepare: output folder (default: <cache>/tokenfiles/c4-<tokenizer>)", "--out", metavar="DIR"
    )
    p.add_argument("--tokenizer", default="gpt2", help="prepare: tokenizer (the paper presets')")
    p.add_argument("--workers", type=int, default=1, help="prepare: shards tokenised at once (processes)")
    p.add_argument(
        "--from", metavar="DIR", help="prepare: a local folder with allenai/c4's en/*.json.gz files"
    )
    p.add_argument("--cache-dir", help="cache folder (default: $QBENCH_CACHE or ~/.cache/qbench)")


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


def run(args: argparse.Namespace) -> None:
    from trainers import data

    if args.action == "fetch":
        path = data.fetch_mix(cache_dir=args.cache_dir)
        console.print(f"built the offline mix in {path}")
    elif args.action == "prepare":
        _data_prepare(args)
    else:
        raise UserError(f"unknown data action {args.action!r}; choose from: fetch, prepare")
