"""``qbench env``: versions, devices and available real kernels."""

from __future__ import annotations

import argparse

from rich.table import Table

from qbench.cli.base import console

NAME = "env"
HELP = "versions, devices and available real kernels"


def add_arguments(p: argparse.ArgumentParser) -> None:
    del p  # no options


def run(args: argparse.Namespace) -> None:
    import torch

    from models.io import git_commit, software_versions

    table = Table(title="qbench environment", title_justify="left", show_header=False)
    for name, version in software_versions().items():
        table.add_row(name, version or "[dim]not installed[/]")
    table.add_row("git commit", git_commit() or "-")
    table.add_row("torch threads", str(torch.get_num_threads()))
    table.add_row("cuda", torch.cuda.get_device_name(0) if torch.cuda.is_available() else "[dim]none[/]")
    try:
        from qbench.quant.kernels import available_backends, kernel_paths
    except ImportError:
        available_backends = None
    if available_backends is not None:
        for backend, ok in available_backends().items():
            table.add_row(f"kernel {backend}", "[green]yes[/]" if ok else "[dim]no[/]")
        for what, path in kernel_paths().items():  # from the dispatch code itself (paths.choose)
            table.add_row(what, path)
    console.print(table)
