"""``python -m trainers``: train a model of a preset with a recipe into a checkpoint folder.

    python -m trainers --preset tiny --recipe softmax1-orthoadam --out ckpts/tiny_ortho
    python -m trainers --preset tiny --recipe paper --out ckpts/tiny_paper --steps 800 --stop-at 300
    python -m trainers --out ckpts/tiny_paper --resume            # continues with the saved configuration
    torchrun --standalone --nproc_per_node 2 -m trainers --preset tiny --recipe paper --out ckpts/ddp
    python -m trainers --list                                      # presets, recipes, optimisers, corpora

Explicit switches (``--attn``, ``--norm``, ``--pos``, ``--bias``, ``--optim``, ``--set n_layer=2``) override the
recipe. With ``--resume`` the saved configuration is the base and only the options given are applied (those
that change the trajectory are refused). Bad input prints one line ``error: ...`` and exits 2; a diverged run
(non-finite loss) exits 3 and keeps its last good checkpoint.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
from pathlib import Path
from typing import Any

from models.config import CHOICES, PRESETS
from models.errors import UserError
from trainers import state
from trainers.loop import DTYPES, TrainConfig, TrainingDiverged, train
from trainers.recipes import RECIPES

SWITCH_FLAGS = ("attn", "norm", "norm_position", "pos", "bias", "gate", "emb_proj", "head_proj")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m trainers",
        description="Train a qbench model (recipes: the paper's softmax-1 / OrthoAdam variants and ablations).",
        argument_default=argparse.SUPPRESS,  # only what is given reaches the config (resume merges onto saved)
    )
    p.add_argument("--out", type=Path, help="output folder: the checkpoint, trainer state and metrics.jsonl")
    p.add_argument("--preset", help=f"model preset: {', '.join(PRESETS)} (default tiny)")
    p.add_argument("--recipe", help=f"recipe: {', '.join(RECIPES)} (default vanilla)")
    _model_switches(p.add_argument_group("model switches (override the recipe)"))
    _schedule(p.add_argument_group("optimisation"))
    _data(p.add_argument_group("data"))
    _run(p.add_argument_group("run control"))
    return p


def _model_switches(g: argparse._ArgumentGroup) -> None:
    for name in ("attn", "norm", "norm_position", "pos", "gate"):
        g.add_argument(f"--{name.replace('_', '-')}", dest=name, help=f"one of {', '.join(CHOICES[name])}")
    g.add_argument("--bias", action=argparse.BooleanOptionalAction, help="biases in linear layers and norms")
    g.add_argument(
        "--emb-proj",
        dest="emb_proj",
        action=argparse.BooleanOptionalAction,
        help="OSP's learnable projection after the token embedding (merged away for evaluation)",
    )
    g.add_argument(
        "--head-proj",
        dest="head_proj",
        action=argparse.BooleanOptionalAction,
        help="OSP's learnable projection between the final norm and the LM head (merged away for evaluation)",
    )
    g.add_argument(
        "--set", action="append", metavar="FIELD=VALUE", help="any model config field, e.g. n_layer=2"
    )


def _schedule(g: argparse._ArgumentGroup) -> None:
    g.add_argument(
        "--optim", help="optimiser (overrides the recipe's): adamw, orthoadam, rmsprop, sgd, sgd-momentum"
    )
    g.add_argument("--lr", type=float, help="peak learning rate (default 4e-3)")
    g.add_argument("--min-lr-ratio", type=float, help="cosine floor as a fraction of --lr (default 0.1)")
    g.add_argument("--warmup", type=int, help="linear warmup steps (default steps // 20)")
    budget = g.add_mutually_exclusive_group()
    budget.add_argument("--steps", type=int, help="optimiser steps: the whole schedule (default 500)")
    budget.add_argument("--tokens", type=int, help="predicted tokens, rounded up to whole steps")
    g.add_argument("--batch-size", type=int, help="windows per optimiser step, all processes (default 16)")
    g.add_argument("--grad-accum", type=int, help="micro-batches per step and process (default 1)")
    g.add_argument("--clip", type=float, help="global gradient-norm clip, <= 0 for none (default 1.0)")
    g.add_argument("--weight-decay", type=float, help="default 0.1 (not on biases, norm gains)")
    g.add_argument("--betas", type=float, nargs=2, metavar=("B1", "B2"), help="default 0.9 0.95")
    g.add_argument("--seed", type=int, help="model init, data order and OrthoAdam rotations (default 0)")
    g.add_argument("--dtype", help=f"{', '.join(DTYPES)}: auto = bf16 autocast on CUDA, fp32 on CPU")
    g.add_argument("--device", help="auto (default), cpu, cuda, cuda:N")
    g.add_argument(
        "--compile",
        action=argparse.BooleanOptionalAction,
        help="train through torch.compile (faster on GPUs after a one-off compile; not bit-equal to eager)",
    )


def _data(g: argparse._ArgumentGroup) -> None:
    g.add_argument(
        "--data",
        help="corpus: embedded (default), mix, c4, a .txt/.jsonl file or folder, "
        "or a token-file folder from `qbench data prepare`",
    )
    g.add_argument("--context", type=int, help="window length = model context (default: the preset's)")
    g.add_argument(
        "--bos", action=argparse.BooleanOptionalAction, help="start every window with <|endoftext|>"
    )


def _run(g: argparse._ArgumentGroup) -> None:
    g.add_argument("--resume", action="store_true", help="continue the run in --out (fresh start if none)")
    g.add_argument("--overwrite", action="store_true", help="delete a previous run in --out first")
    g.add_argument("--stop-at", type=int, metavar="K", help="end after step K with a checkpoint (resumable)")
    for name, default in (("eval", 100), ("probe", 100), ("ckpt", 500)):
        g.add_argument(f"--{name}-every", type=int, help=f"steps between {name}s (default {default})")
    g.add_argument("--eval-tokens", type=int, help="validation tokens per evaluation (default 16384)")
    g.add_argument("--probe-batch", type=int, help="windows in the fixed probe batch (default 8)")
    g.add_argument(
        "--progress", action=argparse.BooleanOptionalAction, help="progress bar (default: on a TTY)"
    )
    g.add_argument("--json", action="store_true", help="print the summary as JSON on stdout")
    g.add_argument("--list", action="store_true", help="list presets, recipes, optimisers, corpora and exit")


def parse_value(text: str) -> Any:
    """``--set`` values: JSON where it parses (2, 0.5, true), else the string itself."""
    try:
        return json.loads(text)
    except ValueError:
        return text


def model_overrides(args: dict[str, Any]) -> dict[str, Any]:
    """The model switches given on the command line (``--attn`` ... and ``--set FIELD=VALUE``)."""
    switches = {k: args[k] for k in SWITCH_FLAGS if k in args}
    for item in args.get("set", []):
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise UserError(f"--set expects FIELD=VALUE, got {item!r}")
        switches[key.strip()] = parse_value(value.strip())
    return switches


def config_from_args(args: dict[str, Any], base: dict[str, Any] | None = None) -> TrainConfig:
    """A TrainConfig from the given options on top of ``base`` (a saved config when resuming)."""
    merged = dict(base or {})
    fields = {f.name for f in dataclasses.fields(TrainConfig)}
    merged.update({k: v for k, v in args.items() if k in fields and k not in SWITCH_FLAGS})
    if "steps" in args:
        merged["tokens"] = None
    if "tokens" in args:
        merged["steps"] = None
    if "betas" in args:
        merged["betas"] = tuple(args["betas"])
    merged["switches"] = {**merged.get("switches", {}), **model_overrides(args)}
    return TrainConfig.from_dict(merged)


def saved_config(out: Path) -> dict[str, Any] | None:
    """The configuration of the run in ``out`` (finishing an interrupted checkpoint write first), or None."""
    if os.environ.get("RANK", "0") == "0":  # under torchrun only rank 0 may touch the folder
        state.recover(out)
    return state.read_state(out, verify=False)["config"] if state.has_state(out) else None


def list_choices() -> str:
    from trainers.data import CORPORA
    from trainers.optim.registry import OPTIMIZERS

    lines = []
    for title, reg in (
        ("presets", PRESETS),
        ("recipes", RECIPES),
        ("optimizers", OPTIMIZERS),
        ("corpora", CORPORA),
    ):
        lines.append(f"{title}:")
        lines += [f"  {name:<20} {reg.describe(name)}" for name in reg]
    return "\n".join(lines)


def report(summary: dict[str, Any], as_json: bool) -> None:
    if as_json:
        print(json.dumps(summary))
        return
    val = f", val loss {summary['val_loss']:.4f}" if summary.get("val_loss") is not None else ""
    loss = f", loss {summary['train_loss']:.4f}" if summary.get("train_loss") is not None else ""
    status = "done" if summary["complete"] else "stopped (resume with --resume)"
    speed = ""
    if summary.get("tokens_per_s"):
        mfu = "n/a" if summary.get("mfu") is None else f"{100 * summary['mfu']:.1f} %"
        speed = f", {summary['tokens_per_s']:,.0f} tokens/s, MFU {mfu}"
    print(
        f"{status}: step {summary['step']}/{summary['total_steps']}, {summary['tokens']:,} tokens{loss}{val}, "
        f"{summary['wall_s']:.1f} s{speed} -> {summary['out_dir']}",
        file=sys.stderr,
    )


def run(args: dict[str, Any]) -> dict[str, Any]:
    if "out" not in args:
        raise UserError("--out is required (the folder for the checkpoint, trainer state and metrics)")
    out = args["out"]
    base = saved_config(out) if args.get("resume") else None
    cfg = config_from_args(args, base)
    return train(
        cfg,
        out,
        resume=args.get("resume", False),
        stop_at=args.get("stop_at"),
        overwrite=args.get("overwrite", False),
        progress=args.get("progress"),
    )


def main(argv: list[str] | None = None) -> int:
    """The CLI; returns the exit status (0 ok, 2 bad input, 3 diverged, 130 interrupted)."""
    args = vars(build_parser().parse_args(argv))
    try:
        if args.get("list"):
            print(list_choices())
            return 0
        summary = run(args)
    except TrainingDiverged as e:
        print(f"error: {e}", file=sys.stderr)
        return 3
    except UserError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("interrupted: the last checkpoint is kept; continue with --resume", file=sys.stderr)
        return 130
    if os.environ.get("RANK", "0") == "0":
        report(summary, args.get("json", False))
    return 0


if __name__ == "__main__":
    sys.exit(main())
