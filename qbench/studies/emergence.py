"""Emergence curves: the training probes of one or more runs (their ``metrics.jsonl``), as JSON, PNG and a table.

Every ``--probe-every`` steps the trainer records the outlier and attention statistics of a fixed probe batch
(``models.stats``); this module collects them so runs can be compared — when do outliers appear, and in which
recipe do they not. ``qbench emergence RUN [RUN ...] --out DIR`` writes ``emergence.json``, ``emergence.png``
and ``emergence.md`` (the last probe of each run, its training setup and the command that made the files).

The probes say when outliers appear; whether they *hurt quantisation* needs the models themselves. With
``--snapshots ROOT`` (``ROOT/<run name>/<any name>/`` checkpoints of each run at several steps, e.g. kept between
``--stop-at`` slices) every snapshot is evaluated in float and under the given schemes with the harness
(resumable, one JSON record per cell under ``DIR/quantisation/<run>/``), giving the *quantisation curve*:
perplexity change per scheme over training tokens (``quantisation-curve.json`` / ``.png``, a table section).
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

from models.errors import UserError
from models.io import atomic_write_json, atomic_write_text

PROBE_KEYS = ("kurtosis_first", "kurtosis_other", "max_abs", "first_token_top1_share")
# The float model's statistics shown beside the quantisation curve (headers in quantisation_table).
CURVE_STATISTICS = {
    "kurtosis_other": "κ other",
    "max_abs": "max abs act",
    "max_input_crest": "max input crest",
    "max_weight_crest": "max weight crest",
}
DAMAGE_PCT = 1.0  # a quantised perplexity this much above the float one counts as damage in the summary


def read_curves(runs: list[Path]) -> dict[str, list[dict[str, Any]]]:
    """{run name: [{step, tokens, val_loss?, probe statistics...}, ...]} from each run's metrics.jsonl."""
    curves = {}
    for run in runs:
        if Path(run).name in curves:
            raise UserError(
                f"two runs are both named {Path(run).name!r}: curves are keyed by folder name; "
                "compare them in separate `qbench emergence` calls or rename one folder"
            )
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
    setup = (
        f"{cfg['preset']}, {cfg['recipe']}, lr {cfg['lr']:g}, BOS {'on' if cfg.get('bos', True) else 'off'}"
    )
    switches = " ".join(f"{k}={v}" for k, v in (cfg.get("switches") or {}).items())  # --set, --norm, ...
    return f"{setup}, {switches}" if switches else setup


def write_emergence(
    runs: list[Path], out: Path, command: str, quantisation: dict[str, list[dict[str, Any]]] | None = None
) -> Path:
    """emergence.json / .png / .md for ``runs`` in ``out`` (plus quantisation-curve.json / .png and a section
    of the table when ``quantisation``, from :func:`quantisation_curve`, is given); returns the markdown file."""
    from tabulate import tabulate

    from qbench.studies.plots import emergence_plot

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
    if quantisation is not None:
        from qbench.studies.plots import quantisation_curve_plot

        atomic_write_json(out / "quantisation-curve.json", quantisation)
        png = out / "quantisation-curve.png"
        quantisation_curve_plot(quantisation, quantisation_keys(quantisation), png, DAMAGE_PCT)
        text += (
            "\n## Quantisation along training\n\nEach snapshot in float and quantised (perplexity change against "
            "its own float perplexity, same windows; κ other and max abs act from the float evaluation's "
            "outlier windows; crest = max |x| / RMS(x) of a linear layer's input or weight, worst layer, see "
            "`qbench.eval.metrics.linear_ranges`; records under `quantisation/`).\n\n"
            f"{quantisation_table(quantisation)}\n![quantisation curve](quantisation-curve.png)\n"
        )
    atomic_write_text(out / "emergence.md", text)
    return out / "emergence.md"


# ------------------------------------------------------------------------------------ quantisation curve


def snapshots_of(root: Path, run: str) -> dict[Path, dict[str, Any]]:
    """{checkpoint: its training summary} under ``root/run/``, in training order (by the recorded step)."""
    from models.checkpoint import is_checkpoint

    folder = Path(root) / run
    found = (
        {p: _training_summary(p) for p in sorted(folder.iterdir()) if is_checkpoint(p)}
        if folder.is_dir()
        else {}
    )
    if not found:
        raise UserError(f"no snapshots of run {run!r}: {folder} holds no checkpoint folders")
    return dict(sorted(found.items(), key=lambda item: item[1].get("step") or 0))


def _training_summary(ckpt: Path) -> dict[str, Any]:
    """The trainer's summary (step, tokens, ...) written into a checkpoint's provenance; {} if there is none."""
    from models.checkpoint import read_meta

    training = read_meta(ckpt).get("provenance", {}).get("training") or {}
    return training.get("summary") or {}


def quantisation_curve(
    runs: list[str],
    snapshot_root: Path,
    spec: Any,
    on_record: Any = None,
) -> dict[str, list[dict[str, Any]]]:
    """{run: [{step, tokens, fp_perplexity, <scheme>: perplexity change %, ...}, ...]} over each run's snapshots.

    ``spec`` is a ``qbench.eval.harness.GridSpec`` naming the schemes, modes and protocol; its ``models`` and
    ``output_path`` are replaced per run (records go to ``spec.output_path/<run>/<snapshot>/``), so a re-run
    reuses every finished cell. Every snapshot of every run is scored on the same windows.
    """
    from dataclasses import replace

    from qbench.eval.harness import run_grid

    curves: dict[str, list[dict[str, Any]]] = {}
    for run in runs:
        snaps = snapshots_of(snapshot_root, run)
        records = run_grid(
            replace(spec, models=[str(s) for s in snaps], output_path=Path(spec.output_path) / run), on_record
        )
        by_snapshot = {
            snap.name: {"snapshot": snap.name, "step": summary.get("step"), "tokens": summary.get("tokens")}
            for snap, summary in snaps.items()
        }
        for record in records:
            row = by_snapshot[record["model"]["name"]]
            metrics, scheme = record["metrics"], record["scheme"]["name"]
            if scheme == "fp":
                row["fp_perplexity"] = metrics["perplexity"]
                row["kurtosis_other"] = record["outliers"].get("kurtosis_other")
                row["max_abs"] = record["outliers"].get("max_abs")
                ranges = record.get("linear_ranges") or {}
                row["max_input_crest"] = ranges.get("max_input_crest")
                row["max_weight_crest"] = ranges.get("max_weight_crest")
            else:
                key = scheme if len(spec.modes) == 1 else f"{scheme}__{record['mode']}"
                row[key] = metrics["ppl_change_pct"]
                if record.get("status") == "nonfinite":  # NaN/inf perplexity: the worst damage, not a gap
                    row.setdefault("nonfinite", []).append(key)
        curves[run] = list(by_snapshot.values())
    return curves


def quantisation_keys(curves: dict[str, list[dict[str, Any]]]) -> list[str]:
    """The scheme columns of a quantisation curve, in the order they were evaluated."""
    fixed = {"snapshot", "step", "tokens", "fp_perplexity", "nonfinite", *CURVE_STATISTICS}
    keys: list[str] = []
    for rows in curves.values():
        for row in rows:
            keys += [k for k in row if k not in fixed and k not in keys]
    return keys


def first_damage(rows: list[dict[str, Any]], keys: list[str], threshold: float = DAMAGE_PCT) -> str:
    """'<scheme> +x.xx % at N M tokens' for the first snapshot where a scheme's change reaches ``threshold``."""
    for row in rows:
        for key in keys:
            change = math.inf if key in row.get("nonfinite", ()) else row.get(key)
            if change is not None and change >= threshold:
                where = f"{row['tokens'] / 1e6:.2f} M tokens" if row.get("tokens") else row["snapshot"]
                return f"{key} {change:+.2f} % at {where}"
    return f"none ≥ {threshold:g} %"


def _change_cell(row: dict[str, Any], key: str) -> str:
    if key in row.get("nonfinite", ()):
        return "nonfinite"
    return f"{row[key]:+.2f} %" if row.get(key) is not None else "n/a"


def quantisation_table(curves: dict[str, list[dict[str, Any]]]) -> str:
    """The curve as a markdown table: one row per snapshot, perplexity change per scheme."""
    from tabulate import tabulate

    keys = quantisation_keys(curves)
    rows = []
    for run, snaps in curves.items():
        for row in snaps:
            rows.append(
                [
                    run,
                    f"{row['tokens'] / 1e6:.2f} M" if row.get("tokens") is not None else "-",
                    f"{row['fp_perplexity']:.2f}" if row.get("fp_perplexity") is not None else "-",
                    *(f"{row[k]:.3g}" if row.get(k) is not None else "-" for k in CURVE_STATISTICS),
                    *(_change_cell(row, k) for k in keys),
                ]
            )
    headers = ["run", "tokens", "fp PPL", *CURVE_STATISTICS.values(), *keys]
    summary = "\n".join(
        f"- {run}: first damage: {first_damage(rows_, keys)}" for run, rows_ in curves.items()
    )
    return f"{tabulate(rows, headers, tablefmt='github')}\n\n{summary}\n"
