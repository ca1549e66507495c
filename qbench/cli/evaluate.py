"""``qbench run | grid | compare``: evaluate the grid and show its records."""

from __future__ import annotations

import argparse
import shlex
import sys
from pathlib import Path

from models.errors import UserError
from qbench.cli.base import command, console, print_wide

# ---------------------------------------------------------------------------------------- run / grid / compare


def _grid_spec(args: argparse.Namespace, models: list[str]):
    from qbench.cli.args import kv_from_args, protocol_from_args
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
        kv=kv,
    )


def _print_record(record: dict, reused: bool) -> None:
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


def _run_and_show(spec) -> list[dict]:
    from qbench.eval.harness import run_grid
    from qbench.eval.report import rich_table

    console.print(
        f"[bold]qbench[/] {len(spec.models)} model(s) × {len(spec.schemes)} scheme(s) × "
        f"{len(spec.modes)} mode(s) → {spec.output_path}/"
    )
    records = run_grid(spec, on_record=_print_record)
    print_wide(rich_table(records))
    return records


@command("run")
def cmd_run(args: argparse.Namespace) -> None:
    from qbench.eval.harness import unsupported_cells

    spec = _grid_spec(args, [args.ckpt])
    unsupported = unsupported_cells(spec)
    if unsupported:  # refused before the model is even loaded
        _, mode, why = unsupported[0]
        raise UserError(f"--mode {mode}: {why}")
    _run_and_show(spec)


def _check_unsupported(records: list[dict], allow: bool) -> int | None:
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


@command("grid")
def cmd_grid(args: argparse.Namespace) -> int | None:
    from qbench.eval import ranks

    rank, world_size, _ = ranks.world()
    if args.nproc_per_node < 1:
        raise UserError(f"--nproc-per-node must be at least 1, got {args.nproc_per_node}")
    if args.nproc_per_node > 1 and world_size == 1:  # relaunch this very command under torchrun
        return ranks.launch(shlex.split(args.command_line)[1:], args.nproc_per_node)
    spec = _grid_spec(args, args.ckpt)
    allow = getattr(args, "allow_unsupported", False)
    if world_size == 1:
        return _check_unsupported(_run_and_show(spec), allow)
    records = ranks.run_grid_ranks(spec, on_record=_print_record if rank == 0 else None)
    if records is not None:
        from qbench.eval.report import rich_table

        print_wide(rich_table(records))
        return _check_unsupported(records, allow)
    return None


def _records_for(name: str, output_path: Path) -> list[dict]:
    """Resolve a ``compare`` argument (rule in the ``compare`` help) to its records."""
    from qbench.eval.load import resolve
    from qbench.eval.report import read_records

    for folder in (Path(name), output_path / name):
        if folder.is_dir() and (records := read_records(folder)):
            return records
    try:
        resolve(name)
    except UserError:
        raise UserError(
            f"no results named {name!r}: not a results folder, not {output_path / name}, "
            f"and not a checkpoint (ckpts/{name}); run `qbench grid --ckpt {name}` first"
        ) from None
    from qbench.eval.harness import PAPER_SCHEMES, GridSpec, run_grid

    console.print(f"[dim]no results for {name!r} yet: evaluating it with the paper's schemes[/]")
    return run_grid(
        GridSpec(
            models=[name],
            schemes=list(PAPER_SCHEMES),
            output_path=output_path,
        ),
        on_record=_print_record,
    )


@command("compare")
def cmd_compare(args: argparse.Namespace) -> None:
    from qbench.eval.report import FORMATS, render, rich_table

    if args.format not in FORMATS:
        from models.errors import unknown_choice

        raise unknown_choice("format", args.format, FORMATS)
    records = [r for name in args.names for r in _records_for(name, Path(args.output_path))]
    extra = _breaking_point_columns(args) if args.breaking_points or args.sweep else None
    if args.format == "table":
        print_wide(rich_table(records, extra=extra))
    else:
        sys.stdout.write(render(records, args.format, extra=extra))


def _breaking_point_columns(args: argparse.Namespace) -> dict[str, dict[str, str]]:
    """Breaking-point columns from ``--sweep`` files, else from the sweep.json files under the named folders."""
    from qbench.studies.sweep import breaking_point_columns, read_sweep

    paths = [Path(p) for p in args.sweep or ()]
    if not paths:
        for name in args.names:
            for folder in (Path(name), Path(args.output_path) / name):
                if folder.is_dir():
                    paths += sorted(folder.rglob("sweep.json"))
                    break
    if not paths:
        raise UserError(
            f"--breaking-points: no sweep.json under {', '.join(args.names)}; run `qbench sweep` "
            "or name a sweep with --sweep PATH"
        )
    columns: dict[str, dict[str, str]] = {}
    for path in dict.fromkeys(paths):
        for model, cols in breaking_point_columns(read_sweep(path)).items():
            columns.setdefault(model, {}).update(cols)
    return columns
