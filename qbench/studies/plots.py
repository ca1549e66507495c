"""Figures of ``qbench inspect``: pure functions from arrays to PNG files (matplotlib, Agg, imported lazily).

- :func:`plot_attention`: the attention map of one window averaged over layers and heads (the paper's Figure 1),
  keys on x, queries on y, log colour scale so that both the sink column and the ordinary weights show.
- :func:`plot_activations`: |activation| over tokens × channels of one block output (Sun et al.'s Figure 1),
  as a 3-D view of the first tokens next to a heatmap of the whole window.
- :func:`plot_layer_curves`: per-layer kurtosis and max |activation|, first token vs the others.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from models.io import atomic_path

FLOOR = 1e-4  # attention weights below this share one colour: log scales need a positive minimum
SURFACE_TOKENS = 48  # tokens in the 3-D view: Sun et al. show a sentence; a full window is unreadable in 3-D
HEATMAP_CELLS = 256  # per axis: more cells than pixels would be dropped when drawn (see max_pool)


def _pyplot() -> Any:
    import matplotlib

    matplotlib.use("Agg")  # files only: never open a window, work without a display
    import matplotlib.pyplot as plt

    return plt


def _save(fig: Any, path: Path) -> Path:
    with atomic_path(path) as tmp:
        fig.savefig(tmp, format="png", dpi=120, bbox_inches="tight")
    _pyplot().close(fig)
    return path


def plot_attention(attention: np.ndarray, path: str | Path, title: str) -> Path:
    """(T, T) mean attention (query, key) -> PNG. Masked (future) cells are left blank."""
    from matplotlib.colors import LogNorm

    plt = _pyplot()
    T = attention.shape[0]
    future = np.triu(np.ones((T, T), dtype=bool), k=1)
    shown = np.ma.masked_array(np.clip(attention, FLOOR, 1.0), mask=future)
    fig, ax = plt.subplots(figsize=(6.4, 5.4))
    image = ax.imshow(shown, norm=LogNorm(vmin=FLOOR, vmax=1.0), cmap="viridis", interpolation="nearest")
    ax.set_xlabel("key position")
    ax.set_ylabel("query position")
    ax.set_title(title, fontsize=10)
    share = float(attention[1:, 0].mean()) if T > 1 else float("nan")
    ax.text(  # in the blank (future) triangle, where it hides nothing
        0.97,
        0.97,
        f"mean weight on key 0\n(queries ≥ 1): {share:.3f}",
        transform=ax.transAxes,
        ha="right",
        va="top",
        fontsize=9,
    )
    fig.colorbar(image, ax=ax, label="attention weight (log scale)")
    return _save(fig, Path(path))


def _top_cells(magnitude: np.ndarray, k: int = 3, share: float = 0.2) -> list[tuple[int, int, float]]:
    """(token, channel, value) of the largest entry in each of the k channels with the largest entries, keeping
    those ≥ share × the largest: one label per massive channel, not three labels on one spike train."""
    per_channel = magnitude.max(axis=0)  # (C,)
    channels = np.argsort(per_channel)[::-1][:k]
    cells = [(int(magnitude[:, c].argmax()), int(c), float(per_channel[c])) for c in channels]
    return [cell for cell in cells if cell[2] >= share * cells[0][2]]


def max_pool(x: np.ndarray, rows: int, cols: int) -> np.ndarray:
    """Block maxima of a 2-D array so it has at most rows × cols cells.

    A heatmap with more cells than pixels drops most of them when drawn; pooling with the maximum keeps every
    spike visible, which is the point of the figure.
    """
    fr, fc = -(-x.shape[0] // rows), -(-x.shape[1] // cols)  # ceil division: block height and width
    padded = np.pad(x, ((0, -x.shape[0] % fr), (0, -x.shape[1] % fc)), constant_values=-np.inf)
    return padded.reshape(padded.shape[0] // fr, fr, padded.shape[1] // fc, fc).max(axis=(1, 3))


def plot_activations(
    magnitude: np.ndarray, path: str | Path, title: str, token_labels: Sequence[str] | None = None
) -> Path:
    """(T, C) |activation| of one block output -> PNG: a 3-D view of the first tokens and a full heatmap."""
    from matplotlib.colors import LogNorm

    plt = _pyplot()
    T, C = magnitude.shape
    fig = plt.figure(figsize=(13, 5))
    ax3d = fig.add_subplot(1, 2, 1, projection="3d")
    n = min(T, SURFACE_TOKENS)
    channels = np.arange(C)
    for t in range(n):  # one line per token along the channels: spikes stand out as in Sun et al.
        ax3d.plot(np.full(C, t), channels, magnitude[t], lw=0.6, color=plt.cm.viridis(t / max(n - 1, 1)))
    ax3d.set_xlabel("token")
    ax3d.set_ylabel("channel")
    ax3d.set_zlabel("|activation|")
    ax3d.set_title(f"first {n} tokens", fontsize=9)
    ax3d.view_init(elev=25, azim=-60)
    for t, c, v in _top_cells(magnitude[:n]):
        ax3d.text(t, c, v, f" t{t} c{c}: {v:.3g}", fontsize=7, color="crimson")
    ax = fig.add_subplot(1, 2, 2)
    floor = max(float(np.median(magnitude)) / 10, 1e-6)
    pooled = max_pool(magnitude, HEATMAP_CELLS, HEATMAP_CELLS)
    image = ax.imshow(
        np.clip(pooled, floor, None).T,
        aspect="auto",
        origin="lower",
        extent=(-0.5, T - 0.5, -0.5, C - 0.5),
        norm=LogNorm(vmin=floor, vmax=max(float(magnitude.max()), floor * 10)),
        cmap="magma",
        interpolation="nearest",
    )
    ax.set_xlabel("token position")
    ax.set_ylabel("channel")
    pooled_note = "" if pooled.shape == magnitude.shape else " (block maxima)"
    ax.set_title(f"all {T} tokens × {C} channels{pooled_note}", fontsize=9)
    if token_labels is not None and T <= 48:
        # escaped ("\\n"), so that a newline token does not break its label
        labels = [repr(s.strip(" ") or s)[1:-1][:10] for s in token_labels]
        ax.set_xticks(range(T), labels, rotation=90, fontsize=6)
    fig.colorbar(image, ax=ax, label="|activation| (log scale)")
    fig.suptitle(title, fontsize=10)
    return _save(fig, Path(path))


def plot_layer_curves(per_layer: dict[str, list[float]], path: str | Path, title: str) -> Path:
    """Per-layer curves of ``OutlierAccumulator.per_layer()`` -> PNG: kurtosis and max |activation|."""
    plt = _pyplot()
    from matplotlib.ticker import FuncFormatter

    layers = np.arange(len(per_layer["kurtosis_first"]))
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4))
    left.plot(layers, per_layer["kurtosis_first"], "o-", label="first token")
    left.plot(layers, per_layer["kurtosis_other"], "s-", label="other tokens (mean)")
    left.axhline(3.0, color="grey", ls=":", lw=1, label="Gaussian (3)")
    left.set_ylabel("raw kurtosis over channels")
    right.plot(layers, per_layer["max_abs_first"], "o-", label="first token")
    right.plot(layers, per_layer["max_abs_other"], "s-", label="other tokens (mean of per-token max)")
    right.plot(layers, per_layer["max_abs"], "^--", label="largest anywhere")
    right.set_ylabel("max |activation| over channels")
    for ax in (left, right):
        ax.set_yscale("log")
        ax.yaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:g}"))
        ax.yaxis.set_minor_formatter(FuncFormatter(lambda v, _: ""))
        ax.set_xlabel("layer (block output)")
        ax.set_xticks(layers)
        ax.grid(alpha=0.3, which="both")
        ax.legend(fontsize=8)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    return _save(fig, Path(path))


def _log_axes(axes: Sequence[Any]) -> None:
    """Log y axes with plain-number labels at 1, 2 and 5 of each decade (a short range still gets labels)."""
    from matplotlib.ticker import FuncFormatter

    def label(v: float, _pos: int) -> str:
        return f"{v:g}" if f"{v:.0e}"[0] in "125" else ""

    for ax in axes:
        ax.set_yscale("log")
        ax.yaxis.set_major_formatter(FuncFormatter(label))
        ax.yaxis.set_minor_formatter(FuncFormatter(label))
        ax.grid(alpha=0.3, which="both")
        ax.legend(fontsize=8)


def emergence_plot(curves: dict[str, list[dict[str, float]]], path: str | Path) -> Path:
    """The training probes of several runs over tokens seen: raw kurtosis (tokens after the first) and the
    largest |activation| — where outliers emerge in one run and stay away in another."""
    plt = _pyplot()
    fig, (left, mid, right) = plt.subplots(1, 3, figsize=(15, 4))
    for name, rows in curves.items():
        tokens = [r["tokens"] / 1e6 for r in rows]
        left.plot(tokens, [r["kurtosis_other"] for r in rows], "-", label=name)
        mid.plot(tokens, [r["max_abs"] for r in rows], "-", label=name)
        right.plot(tokens, [r.get("first_token_top1_share", float("nan")) for r in rows], "-", label=name)
    left.axhline(3.0, color="grey", ls=":", lw=1, label="Gaussian (3)")
    left.set_ylabel("raw kurtosis over channels (tokens ≥ 1, mean over layers)")
    mid.set_ylabel("max |activation| (block outputs)")
    right.set_ylabel("share of queries ≥ 1 with top-1 key = token 0")
    _log_axes((left, mid))
    right.grid(alpha=0.3)
    right.legend(fontsize=8)
    for ax in (left, mid, right):
        ax.set_xlabel("training tokens (millions)")
    fig.suptitle("emergence of outlier activations and the attention sink during training", fontsize=10)
    fig.tight_layout()
    return _save(fig, Path(path))


def quantisation_curve_plot(
    curves: dict[str, list[dict[str, Any]]], keys: Sequence[str], path: str | Path, damage_pct: float = 1.0
) -> Path:
    """Float perplexity and each scheme's perplexity change (the columns ``keys`` of the rows) over training
    tokens, one line style per run: whether the outliers that emerge in a run also start to hurt its quantised
    model."""
    plt = _pyplot()
    fig, (left, right) = plt.subplots(1, 2, figsize=(12, 4))
    styles = ["-", "--", ":", "-."]
    for i, (run, rows) in enumerate(curves.items()):
        style = styles[i % len(styles)]
        rows = [r for r in rows if r.get("tokens") is not None]  # a snapshot without training provenance
        tokens = [r["tokens"] / 1e6 for r in rows]
        left.plot(tokens, [r.get("fp_perplexity") or float("nan") for r in rows], style, color="k", label=run)
        for j, key in enumerate(keys):
            changes = [float("nan") if r.get(key) is None else r[key] for r in rows]
            right.plot(tokens, changes, style, marker="o", ms=3, color=f"C{j}", label=f"{run}: {key}")
    right.axhline(damage_pct, color="grey", ls=":", lw=1, label=f"{damage_pct:g} % (damage)")
    right.axhline(0.0, color="grey", lw=0.5)
    left.set_ylabel("float perplexity")
    right.set_ylabel("quantised perplexity change (%)")
    for ax in (left, right):
        ax.set_xlabel("training tokens (millions)")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    fig.suptitle("quantisation damage along training", fontsize=10)
    fig.tight_layout()
    return _save(fig, Path(path))


def compare_layers_plot(per_model: dict[str, dict[str, list[float]]], path: str | Path) -> Path:
    """Per-layer kurtosis (tokens after the first) and max |activation| of several models, overlaid."""
    plt = _pyplot()
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4))
    for i, (name, per_layer) in enumerate(per_model.items()):
        colour = f"C{i}"
        layers = np.arange(len(per_layer["kurtosis_other"]))
        left.plot(layers, per_layer["kurtosis_other"], "o-", color=colour, label=f"{name}: other tokens")
        left.plot(layers, per_layer["kurtosis_first"], "x:", color=colour, label=f"{name}: first token")
        right.plot(layers, per_layer["max_abs"], "o-", color=colour, label=name)
    left.axhline(3.0, color="grey", ls=":", lw=1, label="Gaussian (3)")
    left.set_ylabel("raw kurtosis over channels (log)")
    right.set_ylabel("max |activation| (largest anywhere)")
    right.set_ylim(bottom=0)
    for ax in (left, right):
        ax.set_xlabel("layer (block output)")
        ax.xaxis.get_major_locator().set_params(integer=True)
    _log_axes((left,))
    right.grid(alpha=0.3)
    right.legend(fontsize=8)
    fig.suptitle("outlier statistics per layer (evaluation windows)", fontsize=10)
    fig.tight_layout()
    return _save(fig, Path(path))


def sweep_plot(sweep: dict[str, Any], curves: dict[tuple[str, str, str], Any], path: str | Path) -> Path:
    """``qbench sweep``'s curves: quantised / float perplexity over bit widths (widest left), log y, one panel per
    axis, one line per model and family (colour = model, style = family); a cell that produced NaN/inf is drawn
    as an ✕ at the top of its panel, the tolerance as a dotted line. A sweep decided on ``--metric kld`` or
    ``top1`` draws that metric's values instead — what each verdict read (``qbench.eval.tolerance.row_interval``) —
    with the tolerance a dotted line at its value, in the metric's unit, on a symmetric-log axis linear up to the
    tolerance (values of an 8-bit and a 2-bit cell lie decades apart, and a share can be 0).
    ``curves``: ``sweep.curves_of(sweep)`` (passed in, so that this module imports no study)."""
    from matplotlib.ticker import FuncFormatter

    from qbench.eval.tolerance import (
        DEFAULT_METRIC,
        decimals,
        metric_axis_label,
        row_interval,
        tolerance_text,
    )

    metric, tolerance = sweep.get("metric", DEFAULT_METRIC), sweep["tolerance_pct"]
    by_ppl = metric == DEFAULT_METRIC

    def value(cell: dict[str, Any]) -> float:
        if cell["status"] != "ok":
            return float("nan")
        v = cell.get("ppl_ratio") if by_ppl else row_interval(cell, metric)[0]
        return float("nan") if v is None else v

    line = 1 + tolerance / 100 if by_ppl else tolerance
    plt = _pyplot()
    axes = list(dict.fromkeys(axis for _, _, axis in curves))
    models = list(dict.fromkeys(model for model, _, _ in curves))
    families = list(dict.fromkeys(family for _, family, _ in curves))
    styles = ["-", "--", ":", "-."]
    fig, panels = plt.subplots(1, len(axes), figsize=(3.6 * len(axes) + 1, 3.8), sharey=True, squeeze=False)
    panel = dict(zip(axes, panels[0], strict=True))
    top = max([*(v for c in sweep["cells"] if np.isfinite(v := value(c)) and (v or not by_ppl)), line]) * 1.5
    for (model, family, axis), cells in curves.items():
        bits = sorted(cells, reverse=True)
        colour, style = f"C{models.index(model)}", styles[families.index(family) % len(styles)]
        ax = panel[axis]
        ys = [value(cells[b]) for b in bits]
        ax.plot(bits, ys, style, marker="o", ms=3, color=colour, label=f"{model} {family}")
        broken = [b for b in bits if cells[b]["status"] == "nonfinite"]
        ax.plot(broken, [top] * len(broken), "x", color=colour, ms=7)
    for axis, ax in panel.items():
        ax.axhline(line, color="grey", ls=":", lw=1)
        ax.set_title(f"axis {axis}", fontsize=9)
        ax.set_xlabel("bits")
        ax.invert_xaxis()
        ax.xaxis.get_major_locator().set_params(integer=True)
        if not by_ppl:
            ax.set_yscale("symlog", linthresh=tolerance if tolerance > 0 else 10.0 ** -decimals(metric))
            ax.yaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:g}"))
            ax.grid(alpha=0.3, which="both")
            ax.legend(fontsize=8)
    if by_ppl:
        panels[0][0].set_ylabel(f"quantised / float perplexity (log; dotted: +{tolerance:g} %)")
        _log_axes(panels[0])
        fig.suptitle("perplexity vs bit width (qbench sweep)", fontsize=10)
    else:
        label = metric_axis_label(metric)
        panels[0][0].set_ylabel(f"{label} (symlog; dotted: {tolerance_text(tolerance, metric)})")
        fig.suptitle(f"{label} vs bit width (qbench sweep)", fontsize=10)
    fig.tight_layout()
    return _save(fig, Path(path))


def sensitivity_heatmap(
    grid: Sequence[Sequence[float]], rows: Sequence[str], cols: Sequence[str], path: str | Path, title: str
) -> Path:
    """``qbench sensitivity``'s map: perplexity change in % per (block, module type), each cell written in it.

    Symmetric log colours around 0 (linear within ±0.05 %): one broken layer must not wash out the rest, and an
    improvement (negative) reads as blue. A cell whose model produced NaN/inf (+inf) is black, a missing one blank.
    """
    from matplotlib.colors import SymLogNorm

    plt = _pyplot()
    values = np.asarray(grid, dtype=float)  # (blocks, types)
    finite = values[np.isfinite(values)]
    vmax = max(float(np.abs(finite).max()) if finite.size else 1.0, 0.1)
    cmap = plt.get_cmap("RdBu_r").with_extremes(bad="white")
    fig, ax = plt.subplots(figsize=(1.3 * len(cols) + 2.5, 0.32 * len(rows) + 1.8))
    norm = SymLogNorm(linthresh=0.05, vmin=-vmax, vmax=vmax)
    image = ax.imshow(
        np.ma.masked_invalid(values), cmap=cmap, norm=norm, aspect="auto", interpolation="nearest"
    )
    for (r, c), v in np.ndenumerate(values):
        if np.isposinf(v):
            ax.add_patch(plt.Rectangle((c - 0.5, r - 0.5), 1, 1, color="black"))
            ax.text(c, r, "NaN", ha="center", va="center", fontsize=7, color="white")
        elif np.isfinite(v):
            dark = abs(norm(v) - 0.5) > 0.3
            ax.text(
                c, r, f"{v:+.2f}", ha="center", va="center", fontsize=7, color="white" if dark else "black"
            )
    ax.set_xticks(range(len(cols)), cols, rotation=30, ha="right", fontsize=8)
    ax.set_yticks(range(len(rows)), rows, fontsize=8)
    ticks = [0.0, *(sign * t for t in (0.1, 1, 10, 100, 1000) if t <= vmax for sign in (-1, 1))]
    bar = fig.colorbar(image, ax=ax, label="perplexity change (%)", ticks=sorted(ticks))
    bar.ax.set_yticklabels([f"{t:+g}" if t else "0" for t in sorted(ticks)])
    ax.set_title(title, fontsize=9)
    fig.tight_layout()
    return _save(fig, Path(path))
