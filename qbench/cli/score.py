"""``qbench score``: the options, the printout and ``--breaking-points``; the study is :mod:`qbench.studies.score`."""

from __future__ import annotations

import argparse
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING

from models.errors import UserError
from models.io import atomic_write_json
from qbench.cli.args import (
    add_calibration_arguments,
    add_kv_arguments,
    add_model_arguments,
    add_tolerance_arguments,
    calibration_from_args,
    console,
    kv_from_args,
    load_from_args,
    placement_from_args,
    protocol_from_args,
)
from qbench.cli.base import add_output_argument

if TYPE_CHECKING:  # the study imports torch: only `qbench score` itself loads it
    from qbench.eval.metrics import Protocol
    from qbench.quant.kv import KVConfig
    from qbench.studies.sweep import SweepConfig


NAME = "score"
HELP = "a model's robustness in one number: outliers + perplexity change per paper scheme"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_model_arguments(parser)
    parser.add_argument(
        "--scheme",
        action="append",
        help="scheme name (repeatable), 'paper' (the paper's four, default) or 'all' — see qbench ls schemes",
    )
    # --output-path is the records folder, as in run and grid, so score and run reuse each other's cells; the
    # score itself is a second, optional output: --json
    add_output_argument(
        parser, "where the harness records go (as in qbench run)", default="qbench_results", metavar="DIR"
    )
    parser.add_argument("--exclude", action="append", help="fnmatch pattern of layer names to keep in float")
    parser.add_argument("--no-attention", action="store_true", help="skip attention statistics (faster)")
    parser.add_argument(
        "--json", metavar="FILE", help="also write the score to this JSON file (default: not written)"
    )
    add_kv_arguments(parser)
    add_calibration_arguments(parser)
    parser.add_argument(
        "--breaking-points",
        action="store_true",
        help="also sweep absmax-coarse over 8→2 bits (axes --sweep-axes) and report the breaking points",
    )
    parser.add_argument("--sweep-axes", default="all,kv", help="the axes swept for --breaking-points")
    add_tolerance_arguments(parser)
    parser.add_argument(
        "--sweep",
        metavar="PATH",
        help="report the breaking points of this model from an existing sweep.json (or its folder)",
    )


def _fmt(x: float | None, spec: str = ".3f") -> str:
    return "—" if x is None else format(x, spec)


def run(args: argparse.Namespace) -> None:
    from qbench.eval.harness import expand_schemes
    from qbench.studies.score import DEFINITION, score
    from qbench.studies.sweep import describe_breaking_points, read_sweep, run_sweep

    schemes = expand_schemes(args.scheme or ["paper"])  # a typo fails before the model loads
    protocol = protocol_from_args(args)
    kv = kv_from_args(args)
    calibration = calibration_from_args(args)
    existing_sweep = read_sweep(args.sweep) if args.sweep else None
    _check_tolerance_used(args, existing_sweep)
    sweep_cfg = _sweep_config(args, protocol, kv) if args.breaking_points and not args.sweep else None
    lm = load_from_args(args)
    result = score(
        lm,
        protocol,
        schemes,
        output_path=args.output_path,
        device=args.device,
        exclude=args.exclude or (),
        attention=not args.no_attention,
        kv=kv,
        calibration=calibration,
    )
    console.print(f"[bold]{lm.name}[/]  fp perplexity {_fmt(result['fp_perplexity'])}", highlight=False)
    for name, entry in result["schemes"].items():
        note = "" if entry["status"] == "ok" else f"  [yellow]{entry['status']}: {entry['error']}[/]"
        console.print(
            f"  {name:<24} ppl {_fmt(entry['perplexity'])}  ×{_fmt(entry['ppl_ratio'], '.4f')}{note}",
            highlight=False,
        )
    o = result["outliers"]
    console.print(
        f"  kurtosis first/other {_fmt(o.get('kurtosis_first'), '.2f')} / {_fmt(o.get('kurtosis_other'), '.2f')}"
        f", max |act| {_fmt(o.get('max_abs'), '.1f')}, massive activations {result['massive_activations']['total']}",
        highlight=False,
    )
    console.print(
        f"[bold]robustness {_fmt(result['robustness'], '.4f')}[/] [dim]({DEFINITION}; 1 = no damage)[/]",
        highlight=False,
    )
    if sweep_cfg is not None or existing_sweep is not None:
        if existing_sweep is None:
            sweep_cfg = replace(sweep_cfg, models=[lm.source])
            existing_sweep = run_sweep(
                sweep_cfg, command=getattr(args, "command_line", None), loaded={lm.source: lm}
            )
        points = [p for p in existing_sweep["breaking_points"] if p["model"] == lm.name]
        if not points:
            raise UserError(f"the sweep {args.sweep} has no model named {lm.name!r}")
        result["breaking_points"] = points
        console.print(f"[bold]breaking points[/] {describe_breaking_points(points)}", highlight=False)
    if args.json:
        atomic_write_json(Path(args.json), result)
        console.print(f"wrote {args.json}")


def _check_tolerance_used(args: argparse.Namespace, sweep: dict | None) -> None:
    """--metric and --tolerance decide breaking points only; the score itself has no tolerance. Given without
    --breaking-points, or unlike the tolerance a --sweep file was decided with, they would be ignored silently."""
    given = [f"--{k} {v:g}" if isinstance(v, float) else f"--{k} {v}" for k, v in _tolerance_flags(args)]
    if not given:
        return
    if not args.breaking_points and sweep is None:
        raise UserError(
            f"{' '.join(given)} decides breaking points only (the score has no tolerance): add --breaking-points "
            "or --sweep PATH, or drop it"
        )
    if sweep is not None:
        from qbench.cli.args import tolerance_from_args
        from qbench.eval.evidence import DEFAULT_METRIC

        have = (sweep.get("metric", DEFAULT_METRIC), sweep["tolerance_pct"])
        if (args.metric, tolerance_from_args(args)) != have:
            raise UserError(
                f"{' '.join(given)}: the sweep {args.sweep} decided its breaking points with --metric {have[0]} "
                f"--tolerance {have[1]:g}; give those, or run the sweep again with --breaking-points"
            )


def _tolerance_flags(args: argparse.Namespace) -> list[tuple[str, object]]:
    flags: list[tuple[str, object]] = [("metric", args.metric)] if args.metric != "ppl" else []
    return flags + ([("tolerance", args.tolerance)] if args.tolerance is not None else [])


def _kv_scheme_text(kv: KVConfig) -> str:
    """``kv``'s scheme with its options and no bit width (the sweep chooses the widths; keep_first and keep_sinks
    go to the sweep's own curves): ``per-token:block=32,sym=true``."""
    from qbench.quant.kvschemes import KV_SCHEMES

    options = []
    for key in KV_SCHEMES.get(kv.scheme).defaults:
        value = getattr(kv, key)
        options.append(f"{key}={str(value).lower() if isinstance(value, bool) else value}")
    if kv.rotate:  # the sweep's curves store what this cache stores
        options.append("rotate=true")
    return f"{kv.scheme}:{','.join(options)}" if options else kv.scheme


def _sweep_config(args: argparse.Namespace, protocol: Protocol, kv: KVConfig | None = None) -> SweepConfig:
    """``--breaking-points``: absmax-coarse over 8→2 bits on ``--sweep-axes``, records under OUTPUT/sweep/
    (the float baseline shared with the score's own records). The kv axis uses the given KV scheme (its options,
    not its bit width, which the sweep varies) and sweeps the given --kv-keep-first / --kv-keep-sinks too."""
    from qbench.cli.args import tolerance_from_args
    from qbench.studies.sweep import SweepConfig, parse_axes, validate

    scheme_given = getattr(args, "kv_scheme", None) or getattr(args, "kv_granularity", None)
    cfg = SweepConfig(
        models=[args.ckpt],
        axes=parse_axes(args.sweep_axes),
        kv_granularity=_kv_scheme_text(kv) if kv is not None and scheme_given else None,
        kv_keep_first=[kv.keep_first] if kv is not None and kv.keep_first else [],
        kv_keep_sinks=[kv.keep_sinks] if kv is not None and kv.keep_sinks else [],
        tolerance=tolerance_from_args(args),
        metric=args.metric,
        protocol=protocol,
        output_path=Path(args.output_path) / "sweep",
        baseline_path=Path(args.output_path),
        device=args.device,
        dtype=args.dtype,
        attention=not args.no_attention,
        trust_remote_code=args.trust_remote_code,
        allow_unsafe_weights=args.allow_unsafe_weights,
        placement=placement_from_args(args),
    )
    validate(cfg)
    return cfg
