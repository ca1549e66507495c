"""``qbench speed``: time/memory of each scheme × mode vs fp32 and peers (ratios, interleaved)."""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from models.errors import UserError
from qbench.cli.base import add_output_argument, console, err_console
from qbench.cli.budgets import TIMING_TOKENS
from qbench.quant.kv_options import KV_SCHEME_SYNTAX

# qbench.studies.kvspeed's defaults (that module imports torch; the parser must not)
KV_CONTEXTS = (1024, 4096)
KV_NEW_TOKENS = 16

NAME = "speed"
HELP = "time/memory of each scheme × mode vs fp32 and peers (ratios, interleaved)"


def add_arguments(p: argparse.ArgumentParser) -> None:
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
        help="whole-model generation on qbench's graph and KV cache, decode steps through qbench's decode runtime "
        "where it serves the model (own; a transformers Llama-family model is converted, its logits checked), "
        "the same with every step the model's torch forward (eager), or on transformers' (transformers: ours "
        "exported; default own)",
    )
    p.add_argument(
        "--llama-cpp",
        action="store_true",
        help="whole-model generation: also time the same model in llama.cpp at matched bits (needs "
        "pip install 'qbench[llama-cpp]'; a checkpoint is written as GGUF and quantised by llama.cpp, a .gguf "
        "runs as given)",
    )
    p.add_argument(
        "--llama-cpp-type",
        action="append",
        metavar="TYPE",
        help="with --llama-cpp: a llama.cpp file type (repeatable; default F32, BF16, Q8_0, Q4_0, Q4_1, Q4_K_M)",
    )
    p.add_argument("--no-layer", action="store_true", help="skip the per-layer and bandwidth figures")
    p.add_argument(
        "--no-kv", action="store_true", help="skip the KV-cache figures (packed vs float cache in generation)"
    )
    p.add_argument(
        "--kv-contexts",
        type=int,
        nargs="+",
        default=list(KV_CONTEXTS),
        metavar="N",
        help="KV-cache figures: prefill lengths (tokens already in the cache when decoding is timed; a preset "
        "is rebuilt with a context that holds them)",
    )
    p.add_argument(
        "--kv-new-tokens",
        type=int,
        default=KV_NEW_TOKENS,
        help="KV-cache figures: greedy decode steps timed after each prefill (few, to bound a 4k context on "
        "gpt2-130m: one prefill per cache and context, then this many steps × repeats (at most 3))",
    )
    p.add_argument(
        "--kv-scheme",
        action="append",
        metavar="NAME[:k=v,…]",
        help=f"KV-cache figures: a packed cache scheme (repeatable; {KV_SCHEME_SYNTAX} as run's --kv-scheme; "
        "default: kivi and per-token at 8, 4, 2 bits and fp8-e4m3)",
    )
    p.add_argument(
        "--kv-bits",
        type=int,
        action="append",
        help="KV-cache figures: widths of each --kv-scheme that is not fp8 (repeatable; default 8, 4, 2)",
    )
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
        nargs="+",
        help="measure nothing: print the tables of a file written by --output-path; several files (runs of the "
        "same --llama-cpp comparison): each llama.cpp type's ratio across them, with its 95%% interval",
    )
    p.add_argument(
        "--goal",
        type=_ratio,
        metavar="RATIO",
        help="with --from-json: the verdict met / not met / undecided of qbench ≥ RATIO × llama.cpp's tokens/s, "
        "from the interval across the files' runs (one run: undecided) (default: none)",
    )
    p.add_argument("--format", default="simple", help="table format: simple | md (GitHub markdown)")


# The per-layer figures hold about this many copies of the fp32 weight at once (the weight, a scheme's quantised
# copy, the bandwidth figure's clone, a peer's): the memory a shape needs is refused when it is not available.
WEIGHT_COPIES = 4


def _available_memory() -> int | None:
    from qbench.eval.metrics import available_memory  # lazily: torch is not needed to parse the flags

    return available_memory()


def check_layer_shape(
    in_features: int, out_features: int, tokens: int, layer: bool = True
) -> tuple[int, int]:
    """``(in_features, out_features)`` of the per-layer figures, refused in one line when a size is not positive
    or the layer would not fit in the memory available (before torch allocates it)."""
    for flag, value in (("--in-features", in_features), ("--out-features", out_features)):
        if value < 1:
            raise UserError(f"{flag} must be a positive number of features (the linear's width), got {value}")
    if layer:
        need = 4 * (
            WEIGHT_COPIES * in_features * out_features + max(tokens, 0) * (in_features + out_features)
        )
        available = _available_memory()
        if available is not None and need > available:
            raise UserError(
                f"--in-features {in_features} × --out-features {out_features}: the per-layer figures need "
                f"~{need / 2**30:,.1f} GiB (the fp32 weight is {4 * in_features * out_features / 2**30:,.1f} GiB), "
                f"and {available / 2**30:,.1f} GiB is available; choose smaller widths or pass --no-layer"
            )
    return in_features, out_features


def _ratio(text: str) -> float:
    """--goal: a positive ratio (0.8: qbench at least 0.8 × llama.cpp's tokens/s)."""
    try:
        value = float(text)
    except ValueError:
        value = float("nan")
    if not value > 0 or value == float("inf"):
        raise argparse.ArgumentTypeError(f"a positive ratio such as 0.8 is needed, got {text!r}")
    return value


# the fields the tables and the across-runs interval compute with: a hand-edited "0.9" would fail there, mid-table
_NUMBER_FIELDS = (
    "ms",
    "ms_min",
    "speedup",
    "speedup_best",
    "weight_bytes",
    "bytes_vs_fp32",
    "gb_per_s",
    "vs_copy",
    "tokens_per_s",
    "linear_share",
    "qbench_vs_llama_cpp",
    "cache_bytes",
    "bytes_vs_float",
)
# what decides which runs are one comparison: compared and hashed, so never a list or an object
_KEY_FIELDS = ("kind", "name", "model", "threads", "cpu", "native_isa", "prompt_tokens", "new_tokens")
_KEY_FIELDS += ("llama_cpp_type", "qbench_match")


def _is_number(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _read_records(path: Path) -> list[dict]:
    """The records of a ``qbench speed --output-path`` file, or a one-line error naming the file and the fault."""
    import json
    import math

    if not path.is_file():
        raise UserError(f"no speed records at {path} (write them with qbench speed --output-path {path})")
    not_ours = f"{path} is not a qbench speed --output-path file"
    try:
        data = json.loads(path.read_bytes().decode("utf-8"))
    except UnicodeDecodeError as err:
        raise UserError(f"{not_ours} (not UTF-8 text: {err.reason} at byte {err.start})") from None
    except json.JSONDecodeError as err:
        raise UserError(f"{not_ours} (not JSON: {err})") from None
    if not isinstance(data, dict) or "records" not in data:
        raise UserError(f'{not_ours} (no "records" at its top level)')
    records = data["records"]
    if not isinstance(records, list):
        raise UserError(f"{not_ours} (its records are not a list)")
    for i, rec in enumerate(records, 1):
        if not isinstance(rec, dict):
            raise UserError(f"{not_ours} (record {i} is {json.dumps(rec)[:40]}, not an object)")
        what = (
            f"{path}: record {i} ({rec.get('name')!r})"
            if isinstance(rec.get("name"), str)
            else f"{path}: record {i}"
        )
        for field in _NUMBER_FIELDS:
            if rec.get(field) is not None and not _is_number(rec[field]):
                raise UserError(f"{what} has {field} {json.dumps(rec[field])[:40]}, not a number")
        ratio = rec.get("qbench_vs_llama_cpp")  # annotate writes a quotient of two speeds, or None
        if ratio is not None and not (math.isfinite(ratio) and ratio > 0):
            raise UserError(f"{what} has qbench_vs_llama_cpp {json.dumps(ratio)}, not a ratio > 0")
        repeats = rec.get("ms_repeats")
        if repeats is not None and not (isinstance(repeats, list) and all(map(_is_number, repeats))):
            raise UserError(f"{what} has ms_repeats {json.dumps(repeats)[:40]}, not a list of numbers")
        for field in _KEY_FIELDS:
            if isinstance(rec.get(field), (list, dict)):
                raise UserError(f"{what} has {field} {json.dumps(rec[field])[:40]}, not a single value")
    return records


def _speed_table(path: Path, records: list[dict], tablefmt: str) -> str:
    """The tables of one file: a record that holds no qbench speed figure (a field missing, another shape) fails in
    one line naming the file, as a file that is not JSON does."""
    from qbench.studies.speed import format_speed_table

    try:
        return format_speed_table(records, tablefmt)
    except KeyError as err:
        raise UserError(
            f"{path} is not a qbench speed --output-path file (a record has no {err} field)"
        ) from None
    except (TypeError, ValueError, IndexError, AttributeError) as err:
        raise UserError(
            f"{path} is not a qbench speed --output-path file (a record cannot be shown: {err})"
        ) from None


def _check_pooled(paths: list[Path], runs: list[list[dict]]) -> None:
    """Several runs pool into one interval only when each is its own run and gives a ratio: a copied file would
    narrow the interval as a second run, and a file giving nothing would look counted (refused, named)."""
    from qbench.studies.llamacpp import llama_row, ratios_of, same_run

    for i, (path, records) in enumerate(zip(paths, runs)):
        for earlier, before in zip(paths[:i], runs[:i]):
            why = same_run(before, records)
            if why is not None:
                raise UserError(
                    f"--from-json {path} is the same run as {earlier} ({why}): a copy pooled as a second run "
                    "narrows the interval; give each run once"
                )
    if len(paths) < 2:
        return
    for path, records in zip(paths, runs):
        if ratios_of(records):
            continue
        has_rows = any(map(llama_row, records))
        what = (
            "its llama.cpp rows have no qbench / llama.cpp ratio (failed, or no matched qbench row)"
            if has_rows
            else "it has no llama.cpp rows (written by qbench speed --llama-cpp)"
        )
        raise UserError(f"--from-json {path} adds no run to the comparison: {what}; drop it from --from-json")


def run(args: argparse.Namespace) -> None:
    import json

    from models.io import atomic_write_json, git_commit, software_versions
    from qbench.eval.harness import check_modes, expand_schemes
    from qbench.studies.speed import MALLOC_ENV, format_speed_table, run_speed

    tablefmt = {"simple": "simple", "md": "github"}.get(args.format)
    if tablefmt is None:
        raise UserError(f"unknown table format {args.format!r}; choose simple or md")
    if args.goal is not None and not args.from_json:
        raise UserError(
            "--goal decides from runs already written: give them with --from-json RUN1.json RUN2.json …"
        )
    if args.from_json:
        paths = [Path(f) for f in args.from_json]
        resolved = [p.resolve() for p in paths]
        for i, p in enumerate(paths):  # one run counted twice would narrow the interval it does not have
            if resolved[i] in resolved[:i]:
                raise UserError(f"--from-json names {p} twice: each run once")
        runs = [_read_records(p) for p in paths]
        table = None
        if len(runs) > 1 or args.goal is not None:  # decided before anything is written
            from qbench.studies.llamacpp import across_runs, across_runs_table

            _check_pooled(paths, runs)
            rows = across_runs(runs, args.goal)
            if not rows:
                raise UserError(
                    "no llama.cpp rows in " + ", ".join(args.from_json) + " (written by --llama-cpp)"
                )
            table = across_runs_table(rows, tablefmt, names=args.from_json if len(runs) > 1 else None)
        if len(runs) == 1:
            text = _speed_table(paths[0], runs[0], tablefmt)
            sys.stdout.write(text + "\n" + ("\n" if table else ""))
        if table:
            sys.stdout.write(table + "\n")
        return
    shape = check_layer_shape(args.in_features, args.out_features, args.tokens, layer=not args.no_layer)
    kv_configs = None
    if not args.no_kv:
        from qbench.studies.kvspeed import kv_configs as parse_kv_configs

        kv_configs = parse_kv_configs(args.kv_scheme, args.kv_bits)
    schemes = expand_schemes(args.scheme) if args.scheme else None
    gguf = [s for s in schemes or () if s.startswith("gguf:")]
    if gguf:
        raise UserError(
            f"{', '.join(gguf)}: llama.cpp's file types are timed by llama.cpp beside qbench's rows, not as "
            "qbench layers; give --llama-cpp (and --llama-cpp-type TYPE)"
        )
    llama_cpp_types: list[str] = []
    if args.llama_cpp_type and not args.llama_cpp:
        raise UserError("--llama-cpp-type needs --llama-cpp")
    if args.llama_cpp:
        from qbench.studies.llamacpp import check_types, require_llama_cpp

        if args.no_model or args.no_generate:
            raise UserError("--llama-cpp times whole-model generation: drop --no-model / --no-generate")
        llama_cpp_types = check_types(args.llama_cpp_type)
        require_llama_cpp()
    if not all(v in os.environ for v in MALLOC_ENV):
        err_console.print(
            "[dim]tip: MALLOC_MMAP_MAX_=0 MALLOC_TRIM_THRESHOLD_=100000000000 qbench speed ... "
            "removes page-fault noise from the timings (see qbench/studies/speed.py)[/]"
        )
    records = run_speed(
        shape=shape,
        tokens=args.tokens,
        threads=args.threads,
        repeats=args.repeats,
        schemes=schemes,
        modes=check_modes(args.mode or ["fake", "real"]),
        peers=not args.no_peers,
        model=None if args.no_model else args.model,
        ckpt=None if args.no_model else args.ckpt,
        model_tokens=args.model_tokens,
        new_tokens=args.new_tokens,
        generate=not args.no_generate,
        generate_via=args.generate_via,
        layer=not args.no_layer,
        device=args.device,
        kv=not args.no_kv,
        kv_configs=kv_configs,
        kv_contexts=args.kv_contexts,
        kv_new_tokens=args.kv_new_tokens,
        llama_cpp_types=llama_cpp_types,
    )
    if args.output_path:
        payload = {"records": records, "software": software_versions(), "git_commit": git_commit()}
        if args.output_path == "-":
            sys.stdout.write(json.dumps(payload, indent=2) + "\n")
            return
        atomic_write_json(args.output_path, payload)
        console.print(f"wrote {args.output_path}")
    sys.stdout.write(format_speed_table(records, tablefmt) + "\n")  # plain text: never re-wrapped
