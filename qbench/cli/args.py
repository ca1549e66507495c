"""Command-line options shared by the commands that load a model and evaluate it on a protocol.

One definition of ``--ckpt``, the loading switches and the perplexity protocol's options, so every command
(``run``, ``grid``, ``inspect``, ``intervene``, ``score``, ``lm-eval``) spells them the same way.
"""

from __future__ import annotations

import argparse
from typing import TYPE_CHECKING, Any

from rich.console import Console

from models.errors import UserError
from qbench.cli.budgets import EVAL_TOKENS
from qbench.eval.llamacpp_protocol import PROTOCOLS, QBENCH
from qbench.eval.placement import DEVICE_MAPS
from qbench.eval.sampling import SAMPLES
from qbench.quant.kv_options import KV_BITS, KV_SCHEME_NAMES, KV_SCHEME_SYNTAX

# the loader, the protocol and the KV cache import torch: only the commands that use them import them
if TYPE_CHECKING:
    from qbench.eval.load import LoadedModel
    from qbench.eval.metrics import Protocol
    from qbench.quant.kv import KVConfig

console = Console(soft_wrap=True)  # long result lines stay whole in pipes and logs

# torch.manual_seed overflows above 2**64 - 1; negatives are refused too, as numpy's SeedSequence (training's
# data order) and the Python API refuse them
SEED_RANGE = (0, 2**64 - 1)


def seed_value(text: str) -> int:
    """The argparse ``type`` of ``--seed``: refused while parsing, before any command loads or writes anything."""
    try:
        seed = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"invalid seed {text!r}; give an integer from {SEED_RANGE[0]} to {SEED_RANGE[1]}"
        ) from None
    lo, hi = SEED_RANGE
    if not lo <= seed <= hi:
        raise argparse.ArgumentTypeError(
            f"{seed} is outside the range torch.manual_seed accepts; give an integer from {lo} to {hi}"
        )
    return seed


def add_load_arguments(parser: argparse.ArgumentParser, many: bool = False) -> None:
    """--ckpt (repeatable with ``many``) and how to load it."""
    parser.add_argument(
        "--ckpt",
        required=True,
        action="append" if many else "store",
        help="qbench checkpoint, transformers folder, ckpts/NAME, or hub name"
        + (" (repeatable)" if many else ""),
    )
    parser.add_argument(
        "--dtype",
        default="auto",
        help="auto | float32 | bfloat16 | float16; auto = bfloat16 on a GPU that computes in it, float32 on the "
        "CPU (default: auto)",
    )
    parser.add_argument("--device", default="cpu", help="cpu | cuda | cuda:N (default: cpu)")
    parser.add_argument(
        "--device-map",
        choices=DEVICE_MAPS,
        help="place the model with accelerate instead of all on --device (default: off): auto fills the GPUs, "
        "then the CPU, up to --max-memory, and offloads the rest to disk, one layer loaded per call; "
        "balanced / balanced_low_0 / sequential as in transformers — docs/evaluating.md",
    )
    parser.add_argument(
        "--max-memory",
        action="append",
        metavar="DEVICE=SIZE",
        help="with --device-map: what each device may hold, e.g. --max-memory cpu=4GiB --max-memory 0=70GiB "
        "(repeatable; default: what accelerate finds free)",
    )
    parser.add_argument(
        "--offload-folder",
        help="with --device-map: where offloaded weights that need a copy are written (default: a temporary "
        "folder removed at exit; safetensors weights are read in place and need none)",
    )
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
    parser: argparse.ArgumentParser, tokens: int = EVAL_TOKENS, many: bool = False, protocol: bool = True
) -> None:
    """:func:`add_load_arguments` plus the perplexity protocol's options (``qbench.eval.metrics.Protocol``);
    ``tokens`` is one of the budgets of :mod:`qbench.cli.budgets`. ``protocol``: offer ``--protocol`` (False for
    a command that builds its own protocol and would ignore it)."""
    add_load_arguments(parser, many)
    parser.add_argument("--data", default="embedded", help="corpus: embedded | mix | c4 | a local path")
    parser.add_argument(
        "--split",
        choices=("validation", "train", "all"),
        help="which documents of --data (default: validation of a registered corpus, all of a file or folder)",
    )
    parser.add_argument(
        "--tokens",
        type=int,
        default=tokens,
        help="token budget: stream tokens scored"
        + (" (under --protocol llama.cpp: covered by the chunks)" if protocol else ""),
    )
    parser.add_argument(
        "--window",
        type=int,
        help="window length (default: the model's context, at most 2,048 as in lm-eval, and under --sample "
        "documents at most the largest power of two <= --tokens/16, at least 128"
        + ("; 512 under --protocol llama.cpp)" if protocol else ")"),
    )
    parser.add_argument(
        "--bos",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="open every window with <|endoftext|>",
    )
    parser.add_argument(
        "--sample",
        choices=SAMPLES,
        help="which windows are scored (default: documents; first under --protocol llama.cpp): documents = "
        "windows drawn across the split's documents, stratified by source, one per document while they last, "
        "the intervals clustered by document, and a default --window of at most --tokens/16 so every budget "
        "scores >= 16 windows | first = consecutive windows from the start of the text (every record before "
        "sampling existed; --data embedded-whole --sample first reproduces those records) — docs/metrics.md",
    )
    parser.add_argument(
        "--sample-seed",
        type=int,
        default=0,
        help="seed of the documents sample (another seed scores other windows of the same text)",
    )
    if protocol:
        parser.add_argument(
            "--protocol",
            choices=PROTOCOLS,
            default=QBENCH,
            help="which positions are scored: qbench (default, the protocol of every earlier record: "
            "non-overlapping windows, every position scored) | llama.cpp (llama-perplexity's: consecutive "
            "chunks of --window tokens, default 512, BOS replacing each chunk's first token, only positions "
            "window/2 … window-2 scored; --tokens then counts the stream tokens the chunks cover) — "
            "docs/metrics.md",
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
        protocol=getattr(args, "protocol", None) or QBENCH,
        sample=args.sample,
        sample_seed=args.sample_seed,
    )


def placement_from_args(args: argparse.Namespace) -> Any:
    """``--device-map``, ``--max-memory`` and ``--offload-folder`` as a ``qbench.eval.placement.Placement`` (None
    when no device map is asked for, so nothing of accelerate is imported)."""
    device_map = getattr(args, "device_map", None)
    if device_map is None:
        if getattr(args, "max_memory", None) or getattr(args, "offload_folder", None):
            flag = "--max-memory" if args.max_memory else "--offload-folder"
            raise UserError(f"{flag} needs --device-map (e.g. --device-map auto)")
        return None
    from qbench.eval.placement import Placement, parse_max_memory

    return Placement(device_map, parse_max_memory(args.max_memory), args.offload_folder)


def load_from_args(args: argparse.Namespace) -> LoadedModel:
    from qbench.eval.load import load_model

    return load_model(
        args.ckpt,
        dtype=args.dtype,
        device=args.device,
        trust_remote_code=args.trust_remote_code,
        allow_unsafe_weights=args.allow_unsafe_weights,
        placement=placement_from_args(args),
    )


def add_kv_arguments(parser: argparse.ArgumentParser) -> None:
    """--kv-bits, --kv-scheme, --kv-keep-first, --kv-keep-sinks, --kv-rotate: KV-cache quantisation on top of every scheme
    (``qbench.quant.kv``, ``qbench.quant.kvschemes``; results named ``<scheme>+kv4``, and ``--scheme fp`` gives
    the float model's ``fp+kv4``). --kv-granularity is the former name of --kv-scheme."""
    bits = " | ".join(map(str, KV_BITS))
    parser.add_argument(
        "--kv-bits",
        type=int,
        help=f"quantise the KV cache (keys after RoPE, values) to {bits} bits (8 for the fp8 schemes; "
        "default: a float cache)",
    )
    parser.add_argument(
        "--kv-scheme",
        help=f"{' | '.join(KV_SCHEME_NAMES)} (default kivi), with overrides as {KV_SCHEME_SYNTAX}; "
        "see qbench.quant.kvschemes",
    )
    parser.add_argument("--kv-granularity", help=argparse.SUPPRESS)  # the former name of --kv-scheme
    parser.add_argument(
        "--kv-keep-first",
        type=int,
        help="keep cache positions 0..K-1 in float and out of the ranges (sink protection; default: 0)",
    )
    parser.add_argument(
        "--kv-keep-sinks",
        type=int,
        help="keep the K positions that receive the most attention in the float model's first pass in float",
    )
    parser.add_argument(
        "--kv-rotate",
        action="store_true",
        help="rotate what the cache stores by a head-dim Hadamard before quantising it, as QuaRot's KV cache "
        "(keys after RoPE and values; the same as rotate=true in --kv-scheme; default: off)",
    )


def kv_from_args(args: argparse.Namespace) -> KVConfig | None:
    """The KV-cache config the options ask for; None without --kv-bits or --kv-scheme (the keep options then
    refuse). An fp8 scheme needs no --kv-bits (8); ``bits=`` inside --kv-scheme works too."""
    from qbench.quant.kvschemes import parse_kv_scheme

    scheme = getattr(args, "kv_scheme", None)
    legacy = getattr(args, "kv_granularity", None)
    if scheme is not None and legacy is not None:
        raise UserError("give --kv-scheme only (--kv-granularity is its former name)")
    scheme = scheme if scheme is not None else legacy
    keep_first, keep_sinks = getattr(args, "kv_keep_first", None), getattr(args, "kv_keep_sinks", None)
    rotate = bool(getattr(args, "kv_rotate", False))
    bits = getattr(args, "kv_bits", None)
    if bits is None and scheme is not None:
        parsed = parse_kv_scheme(scheme)
        bits = parsed.get("bits", 8 if parsed["scheme"].startswith("fp8") else None)
        if bits is None:
            raise UserError(
                f"--kv-scheme {scheme} needs --kv-bits (the KV cache's bit width: {' | '.join(map(str, KV_BITS))})"
            )
    if bits is None:
        if keep_first is not None or keep_sinks is not None or rotate:
            raise UserError("--kv-keep-first, --kv-keep-sinks and --kv-rotate need --kv-bits or --kv-scheme")
        return None
    from qbench.quant.kv import KVConfig

    # fp8 scale=calib: the harness calibrates k_scale/v_scale per layer on train windows (GridSpec.kv_record)
    # rotate=None lets a --kv-scheme that says rotate=… decide; --kv-rotate asks for it (a clash is refused)
    return KVConfig(bits, scheme or "kivi", keep_first or 0, keep_sinks or 0, rotate=True if rotate else None)


# What the default calibration costs, measured (results/algorithms/README.md): said in every --help that offers it.
CALIBRATION_COST = (
    "Cost on SmolLM2-135M, 2 CPU cores: sequential GPTQ or AWQ on 32,768 tokens took 4.6-5.1 min per cell; the "
    "default 128 windows of 2,048 tokens are 8x that (about 37 min, extrapolated); --calib-tokens 16384 about 2.5 min"
)


def add_calibration_arguments(parser: argparse.ArgumentParser) -> None:
    """--calib-data and --calib-tokens: where calibrated schemes (GPTQ, AWQ, SmoothQuant, static scales) and an
    fp8 ``scale=calib`` KV cache take their windows (``qbench.quant.calibrate.CalibrationData``)."""
    parser.add_argument(
        "--calib-data",
        metavar="CORPUS",
        help="calibration text: a registered corpus (its train split) or a local file or folder (all of it) "
        "(default: the train split of --data, kept apart from the scored validation split)",
    )
    parser.add_argument(
        "--calib-tokens",
        type=int,
        metavar="N",
        help="calibration tokens, rounded up to whole calibration windows (default: each scheme's calib= "
        "windows: 128 for GPTQ and AWQ, 8 for SmoothQuant and static scales; windows of min(2048, context) "
        "tokens under --calib-sample documents, of --window under first). "
        f"{CALIBRATION_COST}",
    )
    parser.add_argument(
        "--calib-sample",
        choices=("documents", "first"),
        default="documents",
        help="how calibration windows are drawn: 'documents' across the calibration text's documents, stratified "
        "by source, seeded by the scheme's calib_seed (one more window per 8 held out to measure the layer error "
        "out of sample); 'first' the first windows of --window tokens, as qbench calibrated before "
        "(default: documents)",
    )


def calibration_from_args(args: argparse.Namespace):
    """The ``CalibrationData`` the options ask for (the default: the train split, each scheme's windows)."""
    from qbench.quant.calibrate import CalibrationData

    return CalibrationData(
        getattr(args, "calib_data", None),
        getattr(args, "calib_tokens", None),
        getattr(args, "calib_sample", None) or "documents",
    )


def add_tolerance_arguments(parser: argparse.ArgumentParser, what: str = "breaking-point") -> None:
    """``--tolerance`` and ``--metric``, as every command deciding against a tolerance states them."""
    parser.add_argument(
        "--tolerance",
        type=float,
        default=None,
        help=f"{what} tolerance in the --metric's unit (default: ppl 1 %%, kld 0.01 nats, top1 1 %%); a cell "
        "is within when its 95 %% interval's upper end is at most this",
    )
    parser.add_argument(
        "--metric",
        choices=("ppl", "kld", "top1"),
        default="ppl",
        help="what the tolerance applies to: ppl (perplexity change, %%), kld (mean KL divergence from the "
        "float model, nats) or top1 (%% of tokens whose most likely next token changed) (default: ppl)",
    )


def tolerance_from_args(args: argparse.Namespace) -> float:
    """The ``--tolerance`` given, or the ``--metric``'s default (``qbench.eval.evidence.METRICS``)."""
    from qbench.eval.evidence import default_tolerance

    return default_tolerance(args.metric) if args.tolerance is None else args.tolerance


def add_seed_arguments(parser: argparse.ArgumentParser, runs: str) -> None:
    """``--seed`` and ``--seeds`` of the commands that train (``qbench demo``, ``qbench recipes``); ``runs``
    names what is trained once per seed and what the tables add."""
    parser.add_argument(
        "--seed", type=seed_value, default=0, help="training and evaluation seed (default: 0)"
    )
    parser.add_argument(
        "--seeds",
        type=int,
        default=1,
        help=f"train {runs} with this many seeds (--seed, --seed+1, …); mean ± sd, and which rankings and "
        "breaking points flip between seeds (default: 1)",
    )


def add_resolve_argument(parser: argparse.ArgumentParser, budget: str = "--tokens") -> None:
    """``--resolve [MAX_TOKENS]`` (``qbench.studies.resolve``), as every command with verdicts states it."""
    parser.add_argument(
        "--resolve",
        nargs="?",
        type=int,
        const=-1,
        default=None,
        metavar="MAX_TOKENS",
        help="re-evaluate undecided cells (95 %% interval straddling the tolerance) at twice the tokens, again "
        f"while undecided, up to MAX_TOKENS (given alone: 4 × {budget}); off unless given",
    )


def llama_cpp_types(text: str, default: tuple[str, ...]) -> tuple[tuple[str, ...], str | None]:
    """``--llama-cpp``: (the llama.cpp file types to score, why the default ones are left out). ``default``
    scores ``default`` when llama-cpp-python imports, else none (the output says why); ``none`` none; a comma
    list names them (checked, upper-cased) and needs llama-cpp-python (refused in one line without it)."""
    from qbench.quant.gguf_types import GGUF_TYPES

    if text.strip().lower() == "none":
        return (), None
    is_default = text.strip().lower() == "default"
    types = default if is_default else tuple(t.strip().upper() for t in text.split(","))
    for t in types:
        if t not in GGUF_TYPES:
            from models.errors import unknown_choice

            raise unknown_choice("--llama-cpp type", t, GGUF_TYPES)
    if not types:
        return (), None
    try:
        from qbench.quant.llamacpp import require_llama_cpp

        require_llama_cpp()
    except UserError as err:  # how to install it
        if is_default:
            return (), "llama-cpp-python is not installed: pip install 'qbench[llama-cpp]'"
        raise err
    return types, None
