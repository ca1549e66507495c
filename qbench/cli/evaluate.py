"""What ``qbench run``, ``grid`` and ``compare`` share: their options, the grid spec from them, progress lines."""

from __future__ import annotations

import argparse
from pathlib import Path

from qbench.cli.args import (
    add_calibration_arguments,
    add_kv_arguments,
    add_model_arguments,
    placement_from_args,
    seed_value,
)
from qbench.cli.base import SEED_HELP, add_output_argument, console, print_wide
from qbench.cli.budgets import EVAL_TOKENS


def add_eval_arguments(p: argparse.ArgumentParser, many: bool = False) -> None:
    """The options of ``run`` and ``grid``: the model and protocol, schemes, modes, outputs, KV cache."""
    add_model_arguments(p, tokens=EVAL_TOKENS, many=many)
    p.add_argument(
        "--scheme",
        action="append",
        help="scheme name (repeatable), 'paper' (the paper's four, "
        "default), 'all' (every scheme but llama.cpp's) or 'gguf' (llama.cpp's file types: gguf:q8_0 … "
        "gguf:q2_k, quantised and scored by llama.cpp) — see qbench ls schemes; 'fp' = float weights (with --kv-bits); "
        "overrides as NAME:key=value,… (e.g. absmax-coarse:w=4,a=4,o=4, zeropoint-int4:group=128)",
    )
    p.add_argument("--mode", action="append", help="fake (default) | real; repeatable")
    add_output_argument(p, "where result JSON goes", default="qbench_results", metavar="DIR")
    p.add_argument(
        "--exclude", action="append", help="fnmatch pattern of layer names to keep in float (repeatable)"
    )
    p.add_argument("--seed", type=seed_value, default=0, help=SEED_HELP)
    p.add_argument("--no-attention", action="store_true", help="skip attention statistics (faster)")
    p.add_argument(
        "--quantize-lm-head",
        action="store_true",
        help="quantise the LM head too (default: float, as in the paper); results named <scheme>+head",
    )
    add_kv_arguments(p)
    add_calibration_arguments(p)


def grid_spec(args: argparse.Namespace, models: list[str]):
    from qbench.cli.args import calibration_from_args, kv_from_args, protocol_from_args
    from qbench.eval.harness import GridSpec, check_modes, expand_schemes

    protocol = protocol_from_args(args)
    kv = kv_from_args(args)  # with a KV cache the default adds fp+kvN: the cache's effect alone
    return GridSpec(
        models=models,
        schemes=expand_schemes(args.scheme or (["paper"] if kv is None else ["fp", "paper"])),
        modes=check_modes(args.mode or ["fake"]),
        protocol=protocol,
        output_path=Path(args.output_path),
        seed=args.seed,
        dtype=args.dtype,
        device=args.device,
        exclude=tuple(args.exclude or ()),
        attention=not args.no_attention,
        quantize_lm_head=args.quantize_lm_head,
        trust_remote_code=args.trust_remote_code,
        allow_unsafe_weights=args.allow_unsafe_weights,
        placement=placement_from_args(args),
        kv=kv,
        calibration=calibration_from_args(args),
    )


def print_record(record: dict, reused: bool) -> None:
    m = record["metrics"]
    scheme = record["scheme"]["name"]
    ppl = "NaN" if m["perplexity"] is None else f"{m['perplexity']:.3f}"
    change = "" if scheme == "fp" or m["ppl_change_pct"] is None else f" ({m['ppl_change_pct']:+.2f}%)"
    note = " [dim](reused)[/]" if reused else f" [dim]{record['wall_seconds']:.1f}s[/]"
    if record.get("status") not in (None, "ok"):
        note += f" [yellow]{record['status']}: {record['error']}[/]"
    console.print(
        f"  {record['model']['name']:<20} {scheme:<24} {record['mode']:<5} ppl {ppl}{change}{note}",
        highlight=False,
    )


def run_and_show(spec) -> list[dict]:
    from qbench.eval.harness import run_grid
    from qbench.eval.report import rich_table

    console.print(
        f"[bold]qbench[/] {len(spec.models)} model(s) × {len(spec.schemes)} scheme(s) × "
        f"{len(spec.modes)} mode(s) → {spec.output_path}/"
    )
    records = run_grid(spec, on_record=print_record)
    print_wide(rich_table(records))
    return records


def check_unsupported(records: list[dict], allow: bool) -> int | None:
    """List the grid's unsupported cells; exit status 1 unless ``--allow-unsupported``."""
    unsupported = [r for r in records if r.get("status") == "unsupported"]
    if not unsupported:
        return None
    console.print(f"[yellow]{len(unsupported)} cell(s) cannot run here and were recorded as unsupported:[/]")
    for r in unsupported:
        console.print(
            f"  {r['model']['name']} {r['scheme']['name']}/{r['mode']}: {r['error']}", highlight=False
        )
    if allow:
        return None
    console.print("[yellow]exit status 1: pass --allow-unsupported to accept them[/]")
    return 1
