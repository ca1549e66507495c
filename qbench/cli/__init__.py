"""The ``qbench`` command line: the parser, and ``main``. Each subcommand is a small function in a module of
this package (``setup``, ``evaluate``, ``studies``, and one per study with many options); registries supply
every list of names.

Errors a user can cause (:class:`models.errors.UserError`) print one line and exit 2 — never a traceback; Ctrl-C
prints one line and exits 130, also while the imports of start-up are still running.
"""

from __future__ import annotations

import argparse
import shlex
import sys
from collections.abc import Sequence

from qbench import _exit_if_cli_interrupted, _forget_interrupt

try:
    from models.errors import UserError
    from qbench.cli import evaluate, setup, studies  # noqa: F401  (importing them registers their commands)
    from qbench.cli.base import (
        COMMANDS,
        INTERRUPTED,
        _Parser,
        _Version,
        add_output_argument,
        err_console,
        os_error_line,
    )
except KeyboardInterrupt:  # the console script imports this module before main can catch anything
    _exit_if_cli_interrupted()
    raise

# ------------------------------------------------------------------------------------------------- parser


def build_parser() -> argparse.ArgumentParser:
    from models.config import CHOICES
    from qbench.cli import inspect, intervene, lm_eval, score, sensitivity
    from qbench.cli.args import add_kv_arguments, add_model_arguments
    from qbench.cli.budgets import DEMO_TOKENS, EVAL_TOKENS, PAPER_TOKENS, TIMING_TOKENS

    parser = _Parser(
        prog="qbench",
        description="Quantisation robustness of causal LMs: outliers, attention sinks, "
        "softmax-1 and OrthoAdam (Kaul et al., ICLR 2025).",
    )
    parser.add_argument("--version", action=_Version)
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=_Parser)
    seed_help = "torch seed set before each evaluation"

    p = sub.add_parser("init", help="write a randomly initialised checkpoint of a preset")
    p.add_argument("--preset", default="tiny", help="model preset (qbench ls presets)")
    add_output_argument(p, "checkpoint folder to write", "--out", required=True, metavar="DIR")
    p.add_argument("--seed", type=int, default=0, help="seed of the random initialisation")
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

    p = sub.add_parser("export", help="write a qbench checkpoint as a transformers model folder")
    p.add_argument("ckpt", help="qbench checkpoint folder")
    p.add_argument("out", nargs="?", help="output folder (or give it as --output-path)")
    add_output_argument(p, "output folder", metavar="DIR")
    p.add_argument("--overwrite", action="store_true", help="write into a folder that is not empty")

    p = sub.add_parser("ls", help="list presets, corpora, schemes, optimizers, recipes or results")
    p.add_argument("what", help="presets | corpora | schemes | optimizers | recipes | results")
    p.add_argument(
        "--output-path", default="qbench_results", metavar="DIR", help="the results folder `ls results` reads"
    )

    sub.add_parser("env", help="versions, devices and available real kernels")

    def eval_options(p: argparse.ArgumentParser, many: bool = False) -> None:
        add_model_arguments(p, tokens=EVAL_TOKENS, many=many)
        p.add_argument(
            "--scheme",
            action="append",
            help="scheme name (repeatable), 'paper' (the paper's four, "
            "default) or 'all' — see qbench ls schemes; 'fp' = float weights (with --kv-bits); "
            "overrides as NAME:key=value,… (e.g. absmax-coarse:w=4,a=4,o=4, zeropoint-int4:group=128)",
        )
        p.add_argument("--mode", action="append", help="fake (default) | real; repeatable")
        add_output_argument(p, "where result JSON goes", default="qbench_results", metavar="DIR")
        p.add_argument(
            "--exclude", action="append", help="fnmatch pattern of layer names to keep in float (repeatable)"
        )
        p.add_argument("--seed", type=int, default=0, help=seed_help)
        p.add_argument("--no-attention", action="store_true", help="skip attention statistics (faster)")
        p.add_argument(
            "--quantize-lm-head",
            action="store_true",
            help="quantise the LM head too (default: float, as in the paper); results named <scheme>+head",
        )
        add_kv_arguments(p)

    p = sub.add_parser("run", help="evaluate one model under one or more schemes")
    eval_options(p)

    p = sub.add_parser("grid", help="evaluate models × schemes (resumable: finished cells are reused)")
    eval_options(p, many=True)
    p.add_argument(
        "--nproc-per-node",
        type=int,
        default=1,
        help="share the cells among K local processes (torchrun; --device cuda: one GPU each)",
    )
    p.add_argument(
        "--allow-unsupported",
        action="store_true",
        help="exit 0 even when some cells cannot run here (e.g. real mode without a real kernel); "
        "they are recorded as unsupported and listed either way",
    )

    for name, module, text in (
        (
            "inspect",
            inspect,
            "outlier/attention metrics JSON + plots (attention map, activations, per layer)",
        ),
        ("intervene", intervene, "set massive activations to zero or their mean; perplexity change"),
        ("score", score, "a model's robustness in one number: outliers + perplexity change per paper scheme"),
        ("lm-eval", lm_eval, "run lm-evaluation-harness tasks on the quantised in-memory model"),
        (
            "sensitivity",
            sensitivity,
            "where a model breaks: each layer quantised alone, and a verified float repair",
        ),
    ):
        module.add_arguments(sub.add_parser(name, help=text))
        COMMANDS[name] = module.run

    p = sub.add_parser("compare", help="table of results: rows = models, columns = fp then schemes")
    p.add_argument(
        "names",
        nargs="+",
        help="a results folder, a model's name under --output-path, or a "
        "checkpoint ckpts/NAME (evaluated with the paper's schemes if it has no results yet)",
    )
    p.add_argument("--format", default="table", help="table | md | csv | latex | json")
    add_output_argument(
        p,
        "the results folder names are looked up in (and a bare checkpoint's new records are written to)",
        default="qbench_results",
        metavar="DIR",
    )
    p.add_argument(
        "--breaking-points",
        action="store_true",
        help="add each model's breaking points from the sweep.json files under the named folders",
    )
    p.add_argument("--sweep", action="append", help="add breaking points from this sweep.json (repeatable)")

    p = sub.add_parser(
        "speed", help="time/memory of each scheme × mode vs fp32 and peers (ratios, interleaved)"
    )
    p.add_argument("--threads", type=int, default=1, help="torch threads while timing")
    p.add_argument(
        "--in-features", type=int, default=1024, help="per-layer figures: the linear's input width"
    )
    p.add_argument(
        "--out-features", type=int, default=4096, help="per-layer figures: the linear's output width"
    )
    p.add_argument(
        "--tokens", type=int, default=TIMING_TOKENS, help="per-layer figures: tokens per timed forward"
    )
    p.add_argument(
        "--repeats", type=int, default=15, help="timed repeats per figure (medians and minima are compared)"
    )
    p.add_argument("--scheme", action="append", help="repeatable; default: every registered scheme")
    p.add_argument("--mode", action="append", help="fake | real (default both)")
    p.add_argument("--model", default="small", help="preset for the whole-model figure")
    p.add_argument("--no-model", action="store_true", help="skip the whole-model figures")
    p.add_argument(
        "--ckpt",
        help="whole-model figures for this checkpoint (qbench or transformers) instead of --model's preset",
    )
    p.add_argument("--model-tokens", type=int, default=TIMING_TOKENS, help="whole-model prefill tokens")
    p.add_argument("--new-tokens", type=int, default=128, help="whole-model generation: greedy tokens")
    p.add_argument("--no-generate", action="store_true", help="skip the whole-model generation figure")
    p.add_argument(
        "--generate-via",
        default="own",
        help="our models decode with their own KV cache (own) or exported to transformers (transformers)",
    )
    p.add_argument("--no-layer", action="store_true", help="skip the per-layer and bandwidth figures")
    p.add_argument(
        "--device", default="cpu", help="cpu | cuda | cuda:N (peers without a kernel there: noted)"
    )
    p.add_argument("--no-peers", action="store_true", help="skip torch.ao / bitsandbytes / torchao peers")
    add_output_argument(
        p,
        "also write the records to this JSON file ('-': to stdout only)",
        "--json",
        metavar="FILE",
    )
    p.add_argument(
        "--from-json",
        metavar="FILE",
        help="measure nothing: print the tables of a file written by --output-path",
    )
    p.add_argument("--format", default="simple", help="table format: simple | md (GitHub markdown)")

    p = sub.add_parser(
        "demo", help="train vanilla + paper tiny models, evaluate the paper's schemes (~15 min CPU)"
    )
    p.add_argument(
        "--long",
        action="store_true",
        help="the budget at which quantisation damage appears in the vanilla model (Llama style, ~50 min)",
    )
    p.add_argument(
        "--steps", type=int, help="training steps per model, 16 x 128 tokens each (default: 500; --long 2000)"
    )
    p.add_argument(
        "--tokens",
        type=int,
        default=DEMO_TOKENS,
        help="evaluation token budget per model (the demo's recipe)",
    )
    p.add_argument("--ckpt-root", help="checkpoint folder (default: ckpts/demo; --long: ckpts/demo-long)")
    add_output_argument(p, "results folder (default: results/demo; --long: results/demo-long)", metavar="DIR")
    p.add_argument("--seed", type=int, default=0, help="training and evaluation seed")
    p.add_argument("--no-sweep", action="store_true", help="skip the bit-width sweep (8→2 bits, KV cache)")

    p = sub.add_parser(
        "sweep", help="perplexity change over bit widths per tensor axis and the KV cache; breaking points"
    )
    add_model_arguments(p, tokens=EVAL_TOKENS, many=True)
    p.add_argument(
        "--family", action="append", help="scheme family to sweep (repeatable; default absmax-coarse)"
    )
    p.add_argument(
        "--axes",
        default="w,a,o,all,kv",
        help="comma list of w (weights), a (input activations), o (outputs), all (every tensor of the family), "
        "kv (the float model's KV cache)",
    )
    p.add_argument(
        "--bits",
        default="8-2",
        help="bit widths of every axis: a range 8-2 or a list 8,6,4 (the kv axis takes those of them that are "
        "KV-cache widths: 8, 6, 4, 3, 2, unless --kv-bits is given)",
    )
    p.add_argument(
        "--kv-bits",
        help="bit widths of the kv axis, a range or a list as --bits (default: those of --bits that are "
        "KV-cache widths)",
    )
    p.add_argument(
        "--tolerance", type=float, default=1.0, help="breaking-point tolerance, %% perplexity change"
    )
    p.add_argument(
        "--kv-keep-first",
        type=int,
        action="append",
        help="also sweep the KV cache with the first K positions in float (repeatable)",
    )
    p.add_argument("--kv-granularity", help="KV cache scales: kivi (default) | per-token")
    add_output_argument(p, "records, sweep.json/.md/.png", default="qbench_results/sweep", metavar="DIR")
    p.add_argument("--seed", type=int, default=0, help=seed_help)
    p.add_argument("--no-attention", action="store_true", help="skip attention statistics (faster)")

    p = sub.add_parser(
        "emergence", help="training-probe curves of runs (kurtosis, max |act|, sink) → JSON/PNG/md"
    )
    p.add_argument("runs", nargs="+", help="training run folders (with metrics.jsonl)")
    add_output_argument(p, "output folder", "--out", required=True, metavar="DIR")
    p.add_argument(
        "--snapshots",
        metavar="ROOT",
        help="also the quantisation curve: evaluate the checkpoints in ROOT/<run name>/*/ (resumable)",
    )
    p.add_argument("--scheme", action="append", help="with --snapshots: schemes (default: the paper's four)")
    p.add_argument("--mode", action="append", help="with --snapshots: fake (default) | real; repeatable")
    p.add_argument(
        "--tokens", type=int, default=EVAL_TOKENS, help="with --snapshots: evaluation tokens per snapshot"
    )
    p.add_argument("--no-attention", action="store_true", help="with --snapshots: skip attention statistics")

    p = sub.add_parser(
        "reproduce", help="the paper's Tables 2-3 (and 4): train the variants, evaluate, tabulate"
    )
    p.add_argument("--preset", required=True, help="model preset (qbench ls presets)")
    p.add_argument(
        "--recipes",
        nargs="+",
        help="training recipes (default: vanilla softmax1 orthoadam softmax1-orthoadam)",
    )
    p.add_argument("--ablations", action="store_true", help="also the Table-4 ablation recipes")
    budget = p.add_mutually_exclusive_group()
    budget.add_argument("--steps", type=int, help="training steps per model (default: the preset's)")
    budget.add_argument("--tokens", type=int, help="training tokens per model (default: the preset's)")
    p.add_argument("--data", default="embedded", help="corpus: embedded | mix | c4 | a local path")
    p.add_argument("--lr", type=float, help="peak learning rate (default: the trainer's)")
    p.add_argument("--seed", type=int, default=0, help="training and evaluation seed")
    p.add_argument(
        "--eval-tokens",
        type=int,
        default=PAPER_TOKENS,
        help="evaluation token budget per model (paper scale)",
    )
    p.add_argument("--mode", action="append", help="fake (default) | real")
    p.add_argument(
        "--nproc-per-node",
        type=int,
        default=1,
        help="train each model with torchrun on K devices, and share the evaluation cells among K ranks",
    )
    p.add_argument("--batch-size", type=int, help="training windows per step, all devices (default: 16)")
    p.add_argument("--compile", action="store_true", help="train through torch.compile (GPUs)")
    p.add_argument("--parallel", type=int, default=1, help="models trained at once (CPU: one thread each)")
    p.add_argument("--ckpt-root", help="checkpoint folder (default: ckpts/reproduce/<preset>)")
    add_output_argument(p, "results folder (default: results/reproduce/<preset>)", metavar="DIR")

    sub.add_parser(
        "train",
        help="train a checkpoint: same options as `python -m trainers` (qbench train -h)",
        add_help=False,
    )

    p = sub.add_parser("data", help="build offline corpora; tokenise C4 shards into token files")
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
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    try:
        return _main(list(sys.argv[1:] if argv is None else argv))
    except KeyboardInterrupt:  # anywhere: parsing, the lazy imports of a command, the work itself
        err_console.print(
            f"{INTERRUPTED}; everything written so far is kept", highlight=False, soft_wrap=True
        )
        _forget_interrupt()
        return 130


def _main(argv: list[str]) -> int:
    if argv[:1] == ["train"]:  # the trainer owns its options; one implementation, two entry points
        from trainers.__main__ import main as train_main

        return train_main(argv[1:])
    try:
        args = build_parser().parse_args(argv)
        args.command_line = shlex.join(["qbench", *argv])  # written beside results: how to make them again
        if args.command is None:
            build_parser().print_help()
            return 0
        return COMMANDS[args.command](args) or 0
    except UserError as e:
        err_console.print(f"[bold red]error:[/] {e}", highlight=False, soft_wrap=True)
        return 2
    except OSError as e:  # a path under a file, read-only or full disk: one line; atomic writes kept the rest
        err_console.print(f"[bold red]error:[/] {os_error_line(e)}", highlight=False, soft_wrap=True)
        return 2


if __name__ == "__main__":
    sys.exit(main())
