"""What every ``qbench`` command module shares: the consoles, the command registry and one-line errors."""

from __future__ import annotations

import argparse
from collections.abc import Callable

from rich.console import Console

from models.errors import UserError

console = Console()
err_console = Console(stderr=True)
COMMANDS: dict[str, Callable[[argparse.Namespace], int | None]] = {}


class _Parser(argparse.ArgumentParser):
    """argparse with one-line errors (no usage dump), exit code 2."""

    def error(self, message: str) -> None:  # type: ignore[override]
        raise UserError(f"{self.prog}: {message}")


def command(name: str) -> Callable:
    def register(fn: Callable[[argparse.Namespace], int | None]) -> Callable:
        COMMANDS[name] = fn
        return fn

    return register


def os_error_line(e: OSError) -> str:
    """An OSError as one line naming the path: what the CLI prints instead of a traceback (issue 13.6)."""
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
