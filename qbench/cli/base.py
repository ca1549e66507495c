"""What every ``qbench`` command module shares: the consoles, the command registry, the parser class and one-line
errors."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from rich.console import Console

from models.errors import UserError

console = Console()
err_console = Console(stderr=True)
COMMANDS: dict[str, Callable[[argparse.Namespace], int | None]] = {}

INTERRUPTED = "qbench: interrupted"
SEED_HELP = "torch seed set before each evaluation"
# the namespace slot of _StoreOnce's bookkeeping; _Parser.parse_known_args removes it again
_GIVEN = "_qbench_given"


class _HelpFormatter(argparse.HelpFormatter):
    """Every option that has a default shows it, so ``--help`` never leaves a user guessing (a help text that already
    formats ``%(default)s`` is left alone)."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        if isinstance(action, argparse.BooleanOptionalAction) and isinstance(action.default, bool):
            # name the spelling in effect: "(default: True)", which Python 3.10 appends itself, says less
            shown = action.option_strings[0 if action.default else 1]
            return f"{text.removesuffix(' (default: %(default)s)')} (default: {shown})"
        if (
            action.option_strings
            and action.nargs != 0  # switches: off unless given
            and action.default not in (None, argparse.SUPPRESS)
            and "%(default)" not in text
            and "(default:" not in text  # stated in words already
        ):
            text += " (default: %(default)s)"
        return text


class _StoreOnce(argparse._StoreAction):
    """A single-value option given twice with different values is an error naming both: argparse would keep the
    last and silently drop the first (``sensitivity --scheme A --scheme B`` measured only B)."""

    def __call__(
        self,
        parser: argparse.ArgumentParser,
        namespace: argparse.Namespace,
        values: Any,
        option_string: str | None = None,
    ) -> None:
        given: dict[str, Any] = namespace.__dict__.setdefault(_GIVEN, {})
        if self.option_strings and self.dest in given and given[self.dest] != values:
            raise argparse.ArgumentError(
                self,
                f"given twice ({given[self.dest]!r} and {values!r}) but only one value is used; give it once",
            )
        given[self.dest] = values
        super().__call__(parser, namespace, values, option_string)


class _Parser(argparse.ArgumentParser):
    """argparse with one-line errors (no usage dump, exit code 2), defaults shown in every help, and single-value
    options that refuse a second, different value."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs.setdefault("formatter_class", _HelpFormatter)
        super().__init__(*args, **kwargs)
        # argument groups share this registry, so every plain ``add_argument`` of this parser stores once
        self.register("action", None, _StoreOnce)
        self.register("action", "store", _StoreOnce)

    def parse_known_args(self, args=None, namespace=None):  # type: ignore[override]
        parsed, extras = super().parse_known_args(args, namespace)
        parsed.__dict__.pop(_GIVEN, None)
        return parsed, extras

    def error(self, message: str) -> None:  # type: ignore[override]
        raise UserError(f"{self.prog}: {message}")


class _Version(argparse.Action):
    """``qbench --version``: the package version and, from a git checkout, its commit; worked out only when asked,
    so building the parser runs no git."""

    def __init__(self, option_strings: list[str], dest: str = argparse.SUPPRESS, **kwargs: Any) -> None:
        kwargs.setdefault("help", "print the version (and git commit of a source checkout) and exit")
        super().__init__(option_strings, dest, default=argparse.SUPPRESS, nargs=0, **kwargs)

    def __call__(self, parser: argparse.ArgumentParser, namespace, values, option_string=None) -> None:
        sys.stdout.write(version_line() + "\n")
        parser.exit()


def version_line() -> str:
    from models.io import git_commit
    from qbench import __version__

    commit = git_commit()
    if commit is None:
        return f"qbench {__version__}"
    sha, dirty = commit.removesuffix("-dirty"), commit.endswith("-dirty")
    return f"qbench {__version__} (git {sha[:12]}{'-dirty' if dirty else ''})"


def add_output_argument(
    parser: argparse.ArgumentParser,
    text: str,
    *aliases: str,
    default: str | None = None,
    required: bool = False,
    metavar: str = "PATH",
) -> None:
    """``--output-path``: where a command writes, spelled as lm-eval spells it in every command; ``aliases`` are
    the command's older spellings (``--out``, ``--json``), kept working on the same option."""
    parser.add_argument(
        "--output-path",
        *aliases,
        dest="output_path",
        default=default,
        required=required,
        metavar=metavar,
        help=text,  # the usage line lists the aliases beside it
    )


def os_error_line(e: OSError) -> str:
    """An OSError as one line naming the path: what the CLI prints instead of a traceback."""
    path = e.filename if e.filename is not None else "?"
    if e.filename2 is not None:
        path = f"{path} -> {e.filename2}"
    reason = e.strerror or str(e) or type(e).__name__
    return f"{path}: {reason} (files written before this error are unchanged)"


def print_wide(renderable) -> None:
    """Tables are wide; a pipe or file gets them uncropped (a terminal keeps its own width)."""
    if console.is_terminal:
        console.print(renderable)
    else:
        Console(width=240).print(renderable)


def refuse_non_empty(command: str, out: Path, overwrite: bool) -> None:
    """A command that writes a model folder never mixes its files into someone else's without ``--overwrite``: a
    checkpoint written over another, or a model exported over its own source, would be silently mixed or lost."""
    if out.exists() and not out.is_dir():
        raise UserError(f"qbench {command}: {out} is an existing file; give a folder to write the model into")
    if out.is_dir() and not overwrite and any(out.iterdir()):
        raise UserError(f"qbench {command}: {out} is not empty; pass --overwrite to write into it anyway")
