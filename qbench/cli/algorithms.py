"""``qbench algorithms``: round-to-nearest, GPTQ, AWQ and Hadamard rotations side by side per low-bit format."""

from __future__ import annotations

import argparse
from pathlib import Path

from qbench.cli.args import add_calibration_arguments, add_model_arguments, llama_cpp_types, seed_value
from qbench.cli.base import SEED_HELP, add_output_argument, console
from qbench.cli.budgets import EVAL_TOKENS

NAME = "algorithms"
HELP = (
    "post-training algorithms (RTN, GPTQ, AWQ, Hadamard, QuaRot) side by side per low-bit format; one table"
)

FORMAT_CHOICES = "int4, int4-g128, int3-g128, w4a8, w4a4"
ALGORITHM_CHOICES = "rtn, gptq, awq, hadamard, hadamard+gptq, quarot, quarot+gptq"


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_model_arguments(p, tokens=EVAL_TOKENS, many=True)
    p.add_argument(
        "--formats",
        default=FORMAT_CHOICES.replace(" ", ""),
        help="comma list of low-bit formats: int4 (per channel), int4-g128, int3-g128, w4a8 (per channel / per "
        "token), w4a4",
    )
    p.add_argument(
        "--algorithms",
        default=ALGORITHM_CHOICES.replace(" ", ""),
        help="comma list of algorithms, rtn required (the others are compared with it); GPTQ and AWQ "
        "calibrate sequentially on windows sampled across the train split or --calib-data (128 of min(2048, "
        "context) tokens unless --calib-tokens says otherwise; QuaRot clips as its paper: aclip=0.9, wclip=mse)",
    )
    p.add_argument(
        "--llama-cpp",
        default="default",
        metavar="TYPES",
        help="comma list of llama.cpp file types scored as rows of their own on the same tokens (quantised and "
        "run by llama.cpp; needs pip install 'qbench[llama-cpp]'), none, or default = Q8_0,Q6_K,Q5_K_M,Q4_K_M,"
        "Q4_0,IQ4_NL,Q3_K_M,Q2_K when llama-cpp-python is installed, else none and the table says so "
        "(default: default)",
    )
    add_calibration_arguments(p)
    add_output_argument(
        p, "the records, algorithms.json and table.md", default="results/algorithms", metavar="DIR"
    )
    p.add_argument("--seed", type=seed_value, default=0, help=SEED_HELP)
    p.add_argument(
        "--attention", action="store_true", help="also record attention statistics (slower; default: off)"
    )


def run(args: argparse.Namespace) -> int | None:
    from dataclasses import replace

    from qbench.cli.evaluate import grid_spec, print_record
    from qbench.studies.algorithms import LLAMA_CPP_DEFAULT, AlgorithmsConfig, run_algorithms

    types, skipped = llama_cpp_types(args.llama_cpp, LLAMA_CPP_DEFAULT)
    cfg = AlgorithmsConfig(
        models=tuple(args.ckpt),
        # empty items kept: AlgorithmsConfig.check refuses them rather than running less than was typed
        formats=tuple(f.strip() for f in args.formats.split(",")),
        algorithms=tuple(a.strip() for a in args.algorithms.split(",")),
        output_path=Path(args.output_path),
        command=getattr(args, "command_line", ""),
        llama_cpp=types,
        llama_cpp_skipped=skipped,
    )
    cfg.check()
    # the grid's own options, as `qbench grid` builds them (float model, protocol, seed, loading)
    args.scheme, args.mode, args.exclude, args.quantize_lm_head = None, None, None, False
    args.no_attention, args.kv_bits, args.kv_scheme = not args.attention, None, None
    args.kv_keep_first, args.kv_keep_sinks = None, None

    def spec_for(schemes: list[str]):
        return replace(grid_spec(args, list(args.ckpt)), schemes=schemes)

    result = run_algorithms(cfg, spec_for, on_record=print_record)
    console.print(f"table: {cfg.output_path / 'table.md'} ({result['wall_seconds']:.0f} s)")
    return None
