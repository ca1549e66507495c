"""Emergence curves: the training probes of one or more runs (their ``metrics.jsonl``), as JSON, PNG and a table.

Every ``--probe-every`` steps the trainer records the outlier and attention statistics of a fixed probe batch
(``models.stats``); this module collects them so runs can be compared — when do outliers appear, and in which
recipe do they not. ``qbench emergence RUN [RUN ...] --out DIR`` writes ``emergence.json``, ``emergence.png``
and ``emergence.md`` (the last probe of each run, its training setup and the command that made the files).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from models.errors import UserError
from models.io import atomic_write_json, atomic_write_text

PROBE_KEYS = ("kurtosis_first", "kurtosis_other", "max_abs", "first_token_top1_share")


def read_curves(runs: list[Path]) -> dict[str, list[dict[str, Any]]]:
    """{run name: [{step, tokens, val_loss?, probe statistics...}, ...]} from each run's metrics.jsonl."""
    curves = {}
    for run in runs:
        path = Path(run) / "metrics.jsonl"
        if not path.is_file():
            raise UserError(f"{path} is missing: {run} is not a training run folder")
        rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
        curves[Path(run).name] = [
            {
                "step": r["step"],
                "tokens": r["tokens"],
                **r["probe"],
                **({"val_loss": r["val_loss"]} if "val_loss" in r else {}),
            }
            for r in rows
            if "probe" in r
        ]
    return curves


def _setup(run: Path) -> str:
    try:
        cfg = json.loads((run / "trainer_state.json").read_text())["config"]
    except (OSError, ValueError, KeyError):
        return "-"
    return (
        f"{cfg['preset']}, {cfg['recipe']}, lr {cfg['lr']:g}, BOS {'on' if cfg.get('bos', True) else 'off'}"
    )


def write_emergence(runs: list[Path], out: Path, command: str) -> Path:
    """emergence.json / .png / .md for ``runs`` in ``out``; returns the markdown file."""
    import math

    from tabulate import tabulate

    from qbench.plots import emergence_plot

    curves = read_curves(runs)
    atomic_write_json(out / "emergence.json", curves)
    emergence_plot(curves, out / "emergence.png")
    rows = []
    for run in runs:
        last = curves[Path(run).name][-1] if curves[Path(run).name] else {}
        losses = [r["val_loss"] for r in curves[Path(run).name] if "val_loss" in r]
        rows.append(
            [
                Path(run).name,
                _setup(Path(run)),
                f"{last.get('tokens', 0) / 1e6:.2f} M",
                f"{math.exp(losses[-1]):.1f}" if losses else "-",
                *(f"{last[k]:.3g}" if k in last else "-" for k in PROBE_KEYS),
            ]
        )
    headers = ["run", "setup", "tokens", "val PPL", "κ first", "κ other", "max abs act", "first-token top-1"]
    text = (
        f"Made by `{command}`.\n\n{tabulate(rows, headers, tablefmt='github')}\n\n"
        "Last probe of each run (fixed probe batch of validation windows; definitions in models/stats.py); "
        "val PPL = exp(validation loss) at the last evaluation.\n\n![emergence](emergence.png)\n"
    )
    atomic_write_text(out / "emergence.md", text)
    return out / "emergence.md"
