"""``qbench plan``: a mixed-precision llama.cpp file under a size budget, from measured per-unit damage."""

from __future__ import annotations

import argparse
from pathlib import Path

from qbench.cli.args import add_model_arguments, seed_value
from qbench.cli.base import SEED_HELP, add_output_argument, console
from qbench.cli.budgets import EVAL_TOKENS

NAME = "plan"
HELP = "a mixed-precision llama.cpp file under a size budget: per-unit damage measured, the plan solved and measured"

# literals here (the CLI stays fast to import): qbench.studies.plan.PLAN_TYPES / AGAINST, a test keeps them equal
TYPES_DEFAULT = "F16,Q8_0,Q6_K,Q5_K,Q5_0,Q4_K,IQ4_NL,Q4_0,Q3_K,Q2_K"
AGAINST_DEFAULT = "Q8_0,Q6_K,Q5_K_M,Q4_K_M,Q4_0,Q3_K_M,Q2_K"


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_model_arguments(p, tokens=EVAL_TOKENS, protocol=False)
    p.add_argument(
        "--budget",
        required=True,
        help="comma list of file-size budgets, each a plan: bits per weight (4.5: file bits over the model's "
        "parameters, as llama.cpp's quantize tool counts), a size (95MB, 90MiB), a llama.cpp file type (q4_k_m: "
        "the size of this model's file of that type, measured) or a fraction of one (0.9*q4_k_m) (required)",
    )
    p.add_argument(
        "--by",
        choices=("type", "block"),
        default="type",
        help="units that take one type: type = each kind of tensor across the blocks (attn_q … ffn_down; GPT-2: "
        "attn_qkv …) plus token_embd (also the head when tied), output (untied) and GPT-2's position_embd; block = each block blk.N plus those two (one damage cell per unit and type: "
        "about 30 s each for a 135M model on 2 cores, so block costs ~4× type) (default: type)",
    )
    p.add_argument(
        "--types",
        default=TYPES_DEFAULT,
        help="comma list of candidate ggml tensor types, each kept for a unit only where its rows are whole "
        f"blocks (k-quants: 256) (default: {TYPES_DEFAULT})",
    )
    p.add_argument(
        "--against",
        default=AGAINST_DEFAULT,
        help="comma list of llama.cpp's uniform file types measured on the same tokens and paired with each plan "
        f"(a type a --budget names is added) (default: {AGAINST_DEFAULT})",
    )
    p.add_argument(
        "--write-gguf",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="write each plan as plan-<budget>.gguf (the model's tokenizer included) beside plan.json",
    )
    add_output_argument(
        p, "the records, plan.json, table.md and the plans' GGUF files", default="results/plan", metavar="DIR"
    )
    p.add_argument("--seed", type=seed_value, default=0, help=SEED_HELP)


def _items(text: str) -> tuple[str, ...]:
    return tuple(t.strip() for t in text.split(",")) if text.strip() else ()


def run(args: argparse.Namespace) -> int | None:
    from dataclasses import replace

    from qbench.cli.evaluate import grid_spec, print_record
    from qbench.studies.plan import PlanConfig, run_plan

    cfg = PlanConfig(
        model=args.ckpt,
        budgets=_items(args.budget),
        by=args.by,
        types=tuple(t.upper() for t in _items(args.types)),
        against=tuple(t.upper() for t in _items(args.against)),
        output_path=Path(args.output_path),
        write_gguf=args.write_gguf,
        command=getattr(args, "command_line", ""),
    )
    cfg.check()  # every list and budget refused in one line before a model loads
    args.scheme, args.mode, args.exclude, args.quantize_lm_head = None, None, None, False
    args.no_attention, args.kv_bits, args.kv_scheme, args.kv_rotate = True, None, None, False
    args.kv_keep_first, args.kv_keep_sinks = None, None
    args.calib_data, args.calib_tokens, args.calib_sample = None, None, None
    args.protocol = "qbench"

    def spec_for(schemes: list[str]):
        return replace(grid_spec(args, [args.ckpt]), schemes=schemes)

    result = run_plan(cfg, spec_for, on_record=print_record)
    for p in result.plans:
        if p.get("error"):
            console.print(f"budget {p['budget']}: {p['error']}")
            continue
        c = p.get("cell") or {}
        measured = (
            "not measured"
            if c.get("kld_mean") is None
            else f"KLD {c['kld_mean']:.4g}, {c['ppl_change_pct']:+.2f} %"
        )
        console.print(
            f"budget {p['budget']}: promised KLD {p['promised_kld']:.4g} at {p['promised_bytes'] / 1e6:,.2f} MB; "
            f"measured {measured}"
        )
    console.print(f"table: {cfg.output_path / 'table.md'} ({result.wall_seconds:.0f} s)")
    return None
