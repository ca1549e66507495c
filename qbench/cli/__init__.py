"""The ``qbench`` command line: the parser, and ``main``. Each subcommand is one module of this package
(``COMMAND_MODULES``: its options and its ``run``); registries supply every list of names.

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
    from qbench.cli.base import (
        COMMANDS,
        INTERRUPTED,
        _Parser,
        _Version,
        console,
        err_console,
        os_error_line,
    )
except KeyboardInterrupt:  # the console script imports this module before main can catch anything
    _exit_if_cli_interrupted()
    raise

# ------------------------------------------------------------------------------------------------- parser


# Every command is one module of this package with ``NAME``, ``HELP``, ``add_arguments(parser)`` and
# ``run(args)`` (and optionally ``PARSER_OPTIONS`` for ``add_parser``); this list is their order in ``--help``.
# Adding a command: write its module and add it here. Modules import their studies inside ``run``, so building
# the parser (``qbench --help``) imports neither torch nor transformers.
COMMAND_MODULES = (
    "init",
    "export",
    "ls",
    "env",
    "run",
    "grid",
    "inspect",
    "intervene",
    "score",
    "lm_eval",
    "sensitivity",
    "compare",
    "speed",
    "demo",
    "sweep",
    "card",
    "emergence",
    "reproduce",
    "recipes",
    "algorithms",
    "plan",
    "train",
    "data",
)


def build_parser() -> argparse.ArgumentParser:
    """The ``qbench`` parser: the command modules' own options, collected."""
    import importlib

    parser = _Parser(
        prog="qbench",
        description="Quantisation robustness of causal LMs: outliers, attention sinks, "
        "softmax-1 and OrthoAdam (Kaul et al., ICLR 2025).",
    )
    parser.add_argument("--version", action=_Version)
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=_Parser)
    for module_name in COMMAND_MODULES:
        module = importlib.import_module(f"qbench.cli.{module_name}")
        options = getattr(module, "PARSER_OPTIONS", {})
        module.add_arguments(sub.add_parser(module.NAME, help=module.HELP, **options))
        COMMANDS.setdefault(module.NAME, module.run)  # setdefault: a test may have put its own there
    return parser


# Every command that loads a model prints its peak resident memory when it finishes; these only read or write
# files (and ``train`` reports its own)
MEMORY_QUIET = ("init", "ls", "env", "compare", "data")


def peak_memory_gib() -> float:
    """Peak resident set size of this process so far, GiB (``getrusage``: kilobytes on Linux, bytes on macOS)."""
    import resource

    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak / (2**30 if sys.platform == "darwin" else 2**20)


def main(argv: Sequence[str] | None = None) -> int:
    try:
        return _main(list(sys.argv[1:] if argv is None else argv))
    except KeyboardInterrupt:  # anywhere: parsing, the lazy imports of a command, the work itself
        err_console.print(
            f"{INTERRUPTED}; everything written so far is kept", highlight=False, soft_wrap=True
        )
        _forget_interrupt()
        return 130


def check_native_target() -> None:
    """A ``QBENCH_NATIVE_ISA`` target is checked (and built) before a command starts: inside a grid a kernel
    that cannot be built would only mark every quantised cell unsupported, one compile attempt per cell."""
    from qbench.quant.kernels.build import isa_target

    if isa_target() == "native":  # UserError for a misspelt target or one this CPU cannot run
        return
    from qbench.quant.kernels import native

    native.available()  # builds the library now: UserError if the compiler refuses the target


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
        check_native_target()
        loads = hasattr(args, "device") and not getattr(args, "from_json", None)  # a re-render loads nothing
        if getattr(args, "dtype", None) == "auto" and loads:
            from qbench.eval.load import resolve_dtype

            # a device map places the model on the GPUs when there are any, whatever --device says
            device = "cuda" if getattr(args, "device_map", None) else args.device
            args.dtype = resolve_dtype(args.dtype, device)  # records name the dtype that ran
        code = COMMANDS[args.command](args) or 0
        if args.command not in MEMORY_QUIET and code == 0:
            # beside what a command writes to stdout as data (`--output-path -`), the line goes to stderr
            out = err_console if getattr(args, "output_path", None) == "-" else console
            out.print(f"[dim]peak memory {peak_memory_gib():.2f} GiB (resident, this process)[/]")
        return code
    except UserError as e:
        err_console.print(f"[bold red]error:[/] {e}", highlight=False, soft_wrap=True)
        return 2
    except OSError as e:  # a path under a file, read-only or full disk: one line; atomic writes kept the rest
        err_console.print(f"[bold red]error:[/] {os_error_line(e)}", highlight=False, soft_wrap=True)
        return 2


if __name__ == "__main__":
    sys.exit(main())
