"""The card's figures (PNG bytes from card.json): the outlier profile, the attention per head and the breaking points."""

from __future__ import annotations

import io
import math
from collections.abc import Mapping
from typing import Any

from qbench.studies.card.units import fixed, pct_tick


def _png(fig: Any) -> bytes:
    from qbench.studies.plots import _pyplot

    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=100, bbox_inches="tight", metadata={"Software": None})
    _pyplot().close(fig)
    return buf.getvalue()


FIGURE_WIDTH = 10.0  # inches at 100 dpi: 1,000 px, the page's width, so the figures show at 1× zoom


FONT = 10  # points: ≥ 13 px at 1×


def figures(card: Mapping[str, Any]) -> dict[str, bytes]:
    """{name: PNG bytes}: per model its outlier profile and attention-sink heatmap; one breaking-point figure.
    Axes labelled with units, integer ticks where the axis counts blocks or bits, colour scales fitted to the
    data; sized for the page's width so that nothing is scaled down."""
    from qbench.studies.plots import _pyplot

    plt = _pyplot()
    out: dict[str, bytes] = {}
    with plt.rc_context({"font.size": FONT, "axes.titlesize": FONT + 1, "legend.fontsize": FONT - 1}):
        for i, m in enumerate(card["models"]):
            out[f"outliers-{i}"] = _png(_outlier_figure(plt, m))
            out[f"attention-{i}"] = _png(_attention_figure(plt, m))
        curves = [(m["name"], b) for m in card["models"] for b in m["breaking_points"] if b["curve"]]
        if curves:
            out["breaking-points"] = _png(_breaking_point_figure(plt, card, curves))
    return out


def _outlier_figure(plt: Any, m: Mapping[str, Any]) -> Any:
    """Kurtosis and max |activation| per block (top), the linear layers with the worst input crest factor
    (bottom, the table's rows, named)."""
    from matplotlib.ticker import MaxNLocator

    layers = m["outliers"]["layers"]
    worst = m["outliers"]["linear_worst"]
    linear = sorted(
        (x for x in m["outliers"]["linear"] if x["name"] in worst and x["input_crest"] is not None),
        key=lambda x: -x["input_crest"],
    )
    fig = plt.figure(figsize=(FIGURE_WIDTH, 3.4 + 0.3 * max(len(linear), 3)))
    grid = fig.add_gridspec(2, 2, height_ratios=[3.2, 0.3 * max(len(linear), 3) + 0.6])
    kurt, act, crest = fig.add_subplot(grid[0, 0]), fig.add_subplot(grid[0, 1]), fig.add_subplot(grid[1, :])
    xs = [x["layer"] for x in layers]
    first = "start token" if m["protocol"].get("bos", True) else "first token"
    kurt.plot(xs, [x["kurtosis_first"] for x in layers], "o-", ms=3, label=f"{first} (position 0)")
    kurt.plot(xs, [x["kurtosis_other"] for x in layers], "s-", ms=3, label="other tokens")
    kurt.axhline(3, color="grey", ls=":", lw=1, label="Gaussian (3)")
    kurt.set(title="raw kurtosis of each block's output", xlabel="block", ylabel="kurtosis", yscale="log")
    kurt.legend()
    act.plot(xs, [x["max_abs"] for x in layers], "o-", ms=3, color="C3", label="max |activation|")
    massive = [x for x in layers if x["massive_count"]]
    if massive:
        act.plot(
            [x["layer"] for x in massive],
            [x["max_abs"] for x in massive],
            "x",
            ms=8,
            color="k",
            label="massive activations (Sun et al.)",
        )
    act.axhline(100, color="grey", ls=":", lw=1, label="100")
    act.set(title="largest |activation| of each block's output", xlabel="block", ylabel="|activation|")
    act.set_yscale("log")
    act.legend()
    for ax in (kurt, act):
        ax.xaxis.set_major_locator(MaxNLocator(nbins=10, integer=True))
    crest.barh(range(len(linear)), [x["input_crest"] for x in linear], color="C2")
    crest.set_yticks(range(len(linear)), [x["name"] for x in linear])
    crest.invert_yaxis()
    crest.set(
        title=f"linear layers with the largest input crest factor ({len(linear)} of {len(m['outliers']['linear'])})",
        xlabel="input crest factor max|x| / RMS(x) (×, log)",
        xscale="log",
    )
    crest.set_xlim(left=1)  # max|x|/RMS >= 1: the bars start at the smallest possible value
    for axis in (kurt.yaxis, act.yaxis, crest.xaxis):
        _readable_log_ticks(axis)
    fig.suptitle(f"{m['name']}: outlier profile", fontsize=FONT + 1)
    fig.tight_layout()
    return fig


def _attention_figure(plt: Any, m: Mapping[str, Any]) -> Any:
    """The sink per layer and head: top-1 share and mean weight on key 0, each on a colour scale from 0 to its
    own maximum (a fixed 0–1 scale shows 0.00–0.18 as one colour), the uniform-attention level marked on the
    weight's colour bar; the numbers printed in the cells when they fit."""
    att = m["attention"]
    n_layers = len(att["top1_share"])
    heads = max((len(r) for r in att["top1_share"]), default=0)
    fig, axes = plt.subplots(1, 2, figsize=(FIGURE_WIDTH, 0.28 * max(n_layers, 6) + 1.8))
    chance = m["outliers"].get("sink_chance")
    for ax, key, title, unit in (
        (axes[0], "top1_share", "first-token top-1 share", "share of queries (q ≥ 1)"),
        (axes[1], "mass", "mean attention weight on key 0", "mean weight (q ≥ 1)"),
    ):
        grid = att[key]
        top = max((v for row in grid for v in row), default=0.0)
        image = ax.imshow(grid, vmin=0, vmax=top if top > 0 else 1.0, cmap="viridis", aspect="auto")
        ax.set(title=title, xlabel="head", ylabel="layer")
        ax.set_xticks(range(heads))
        ax.set_yticks(range(n_layers) if n_layers <= 16 else range(0, n_layers, max(1, n_layers // 10)))
        bar = fig.colorbar(image, ax=ax, fraction=0.046)
        bar.set_label(unit)
        if key == "mass" and chance is not None:
            ax.set_title(f"{title} (uniform: {chance:.3g})")
            if chance <= (top or 1.0):  # the uniform level, as a line on the colour scale
                bar.ax.axhline(chance, color="w", lw=2)
    fig.suptitle(f"{m['name']}: attention sink per layer and head", fontsize=FONT + 1)
    fig.tight_layout()
    # The cells' numbers once the cells have their laid-out size: as large as a cell holds, none where a cell
    # cannot hold a legible one (gpt2's 12 × 12 cells printed theirs at 7 pt, ~7 px at 1×).
    # Past 16 layers or 12 heads the map is read by its colours: its hundreds of numbers are the table above it.
    for ax, key in ((axes[0], "top1_share"), (axes[1], "mass")):
        size = _cell_font(fig, ax, heads, n_layers) if n_layers <= 16 and heads <= 12 else None
        if size is None:
            continue
        top = max((v for row in att[key] for v in row), default=0.0)
        for r, row in enumerate(att[key]):
            for c, v in enumerate(row):
                dark = v < 0.6 * (top or 1.0)
                ax.text(
                    c, r, fixed(v, 2), ha="center", va="center", fontsize=size, color="w" if dark else "k"
                )
    return fig


MIN_FONT = 9.0  # points: the smallest text a figure prints (12.5 px at 1×)


def _cell_font(fig: Any, ax: Any, columns: int, rows: int) -> float | None:
    """The font size for a heat map's per-cell number ("0.25"): the largest a cell holds, at most ``FONT``;
    None where that is under ``MIN_FONT``. Four glyphs are about 2.4 em wide; a margin either side."""
    if not columns or not rows:
        return None
    width_in, height_in = fig.get_size_inches()
    box = ax.get_position()  # figure fractions, as laid out
    cell_w = box.width * width_in * 72 / columns
    cell_h = box.height * height_in * 72 / rows
    size = min(float(FONT), cell_w / 2.8, cell_h / 1.6)
    return size if size >= MIN_FONT else None


def curve_metric(card: Mapping[str, Any], curves: list[tuple[str, Any]] | None = None) -> str:
    """The metric the breaking-point figure draws of ``curves`` (default: every model's): the card's, or ppl for a
    card on kld or top1 from before its curve points held their decision (its perplexity changes, without the
    tolerance line)."""
    metric = card.get("metric") or "ppl"
    if metric == "ppl":
        return metric
    if curves is None:
        curves = [(m["name"], b) for m in card["models"] for b in m["breaking_points"]]
    return metric if all("decision" in v for _, b in curves for v in b["curve"].values()) else "ppl"


def _breaking_point_figure(plt: Any, card: Mapping[str, Any], curves: list[tuple[str, Any]]) -> Any:
    """Perplexity change against bit width, a panel per axis (at most four a row), integer bit ticks; each panel's
    y axis fitted to its own data (``_fit_change_axis``); the legend below the panels, where it hides no point. A
    card decided on kld or top1 draws that metric's values (each curve point's decision) and the tolerance in its
    unit."""
    import textwrap

    from matplotlib.lines import Line2D

    from qbench.eval.tolerance import metric_axis_label, row_interval, tolerance_text

    axes_names = list(dict.fromkeys(f"{b['family']} {b['axis']}" for _, b in curves))
    per_row = min(4, len(axes_names))
    rows = math.ceil(len(axes_names) / per_row)
    width = min(FIGURE_WIDTH, 2.6 * per_row + 1.2)
    models = list(dict.fromkeys(name for name, _ in curves))
    metric = card.get("metric") or "ppl"
    on_ppl = metric == "ppl"
    shown = curve_metric(card, curves)
    tolerance = (
        card["tolerance_pct"] if shown == metric else None
    )  # the line: on the axis of the card's metric
    # Full names, wrapped rather than cut: the legend is the one place that says which line is which model.
    labels = [textwrap.fill(name, LEGEND_WRAP, break_on_hyphens=False) for name in models]
    handles = [Line2D([], [], marker="o", ms=4, color=f"C{k}") for k in range(len(models))]
    if tolerance is not None:
        labels.append(
            f"tolerance {tolerance:g} %" if on_ppl else f"tolerance {tolerance_text(tolerance, metric)}"
        )
        handles.append(Line2D([], [], color="grey", ls=":", lw=1))
    longest = max(len(line) for label in labels for line in label.splitlines())
    # ~0.075 in a character at the legend's 9 pt, plus the marker and the gap between columns
    columns = max(1, min(len(labels), int(width / (0.075 * longest + 0.7))))
    legend_lines = sum(
        max(label.count("\n") + 1 for label in labels[k : k + columns])
        for k in range(0, len(labels), columns)
    )
    fig, panels = plt.subplots(
        rows,
        per_row,
        figsize=(width, 3.0 * rows + 0.3 + 0.2 * legend_lines),
        squeeze=False,
        layout="constrained",  # it makes room for an "outside" figure legend; tight_layout ignores one
    )
    flat = [ax for row in panels for ax in row]
    panel = dict(zip(axes_names, flat, strict=False))
    for ax in flat[len(axes_names) :]:
        ax.set_visible(False)
    widths: dict[str, set[int]] = {}
    values: dict[str, list[float]] = {}
    for name, b in curves:
        key = f"{b['family']} {b['axis']}"
        bits = [int(k) for k in b["curve"]]
        widths.setdefault(key, set()).update(bits)
        points = [row_interval(v, shown)[0] for v in b["curve"].values()]
        ys = [math.nan if y is None else y for y in points]
        values.setdefault(key, []).extend(y for y in ys if math.isfinite(y))
        panel[key].plot(bits, ys, "o-", ms=4, color=f"C{models.index(name)}")
    for key, bits in widths.items():
        panel[key].set_xticks(sorted(bits))  # whole bits only: the widths measured
    for title, ax in panel.items():
        if tolerance is not None:
            ax.axhline(tolerance, color="grey", ls=":", lw=1)
        ax.set_title(title)
        ax.set_xlabel("bits")
        ax.invert_xaxis()
        _fit_change_axis(ax, values.get(title, []), tolerance, shown)
    for row in panels:
        row[0].set_ylabel("perplexity change" if shown == "ppl" else metric_axis_label(shown))
    fig.legend(handles, labels, loc="outside lower center", ncols=columns, frameon=False)
    return fig


LEGEND_WRAP = 40  # characters a legend line: a long checkpoint path wraps instead of widening the figure


MAX_TICKS = 6  # a log panel's labelled ticks: SmolLM2's 24 decades labelled one by one piled up


def _fit_change_axis(ax: Any, values: list[float], tolerance: float | None, metric: str = "ppl") -> None:
    """A breaking-point panel's y axis fitted to its data. Linear while every change is within ten times the
    linear threshold (the tolerance's power of ten, else 1 %); log where they are positive and span more; symlog
    where they span more and reach zero or below. The limits: the data's range and the tolerance line, plus 5 % in
    the axis's own coordinates — matplotlib's symlog autoscale ran SmolLM2's +10²³ % curve down to −10²¹ % with
    no point below +1 %. At most ``MAX_TICKS`` ticks, powers of ten (and 0) on a log axis, labelled in % (a KLD
    axis in plain numbers: its unit is the axis label's)."""
    from matplotlib.ticker import FixedLocator, FuncFormatter, MaxNLocator, NullLocator

    points = [*values, *([tolerance] if tolerance is not None else [])] or [0.0, 1.0]
    lo, hi = min(points), max(points)
    linthresh = 10.0 ** math.floor(math.log10(tolerance)) if tolerance and tolerance > 0 else 1.0
    if max(abs(lo), abs(hi)) <= 10 * linthresh or (lo > 0 and hi < 10 * lo):  # no decades to compress
        scale = "linear"
        ax.set_yscale("linear")
    elif lo > 0:
        scale = "log"
        ax.set_yscale("log")
    else:
        scale = "symlog"
        ax.set_yscale("symlog", linthresh=linthresh)
    if hi == lo:  # one value: room around it
        lo, hi = (
            (lo / 2, hi * 2)
            if scale == "log"
            else (lo - max(abs(lo), linthresh), hi + max(abs(hi), linthresh))
        )
    forward = ax.yaxis.get_transform()
    t_lo, t_hi = _through(forward, lo), _through(forward, hi)
    pad = 0.05 * (t_hi - t_lo)
    back = forward.inverted()
    ax.set_ylim(_through(back, t_lo - pad), _through(back, t_hi + pad))
    ticks = [] if scale == "linear" else _decade_ticks(lo, hi, linthresh if scale == "symlog" else None)
    # Symlog's ±threshold and 0 sit a decade apart at most: where the data span many decades, their labels overlap.
    # Keep 0, then the largest magnitudes, each a tenth of the axis from those kept.
    kept: list[float] = []
    for tick in sorted(ticks, key=lambda v: (v != 0, -abs(v))):
        if all(abs(_through(forward, tick) - _through(forward, k)) >= 0.1 * (t_hi - t_lo) for k in kept):
            kept.append(tick)
    ticks = sorted(kept)
    ax.yaxis.set_major_locator(FixedLocator(ticks) if len(ticks) >= 2 else MaxNLocator(nbins=5))
    if scale != "linear":
        ax.yaxis.set_minor_locator(NullLocator())  # unlabelled minor ticks in every decade: noise, not scale
    if metric == "kld":
        ax.yaxis.set_major_formatter(FuncFormatter(lambda v, _: pct_tick(v).removesuffix(" %")))
    else:
        ax.yaxis.set_major_formatter(FuncFormatter(lambda v, _: pct_tick(v)))


def _through(transform: Any, v: float) -> float:
    """One value through a scale's one-dimensional transform (or its inverse)."""
    return float(transform.transform([v])[0])


def _decade_ticks(lo: float, hi: float, linthresh: float | None) -> list[float]:
    """Ticks of a log (``linthresh`` None) or symlog axis over [lo, hi]: 0 where a symlog axis holds it, then ± the
    powers of ten in range, every n-th decade so that at most ``MAX_TICKS`` remain — except on a side of zero with
    two decades or fewer, which keeps both (SmolLM2's −30 % under +10¹¹ % would otherwise have no tick); 1-2-5 steps
    where the range holds fewer than two powers of ten."""
    ticks: list[float] = []
    for mantissas in ((1.0,), (1.0, 2.0, 5.0)):
        sides: list[list[tuple[int, float]]] = []  # (decade, tick) per side of zero
        for sign, bottom, top in ((1, lo, hi), (-1, -hi, -lo)):
            bottom = max(bottom, linthresh or 0.0)
            if top <= 0 or top < bottom:
                continue  # nothing on this side of zero (beyond the linear region)
            decades = range(math.floor(math.log10(bottom)), math.ceil(math.log10(top)) + 1)
            sides.append(
                [
                    (k, sign * m * 10.0**k)
                    for k in decades
                    for m in mantissas
                    if bottom * (1 - 1e-9) <= m * 10.0**k <= top
                ]
            )
        for stride in range(1, 1000):
            ticks = [0.0] if linthresh is not None and lo <= 0 <= hi else []
            for side in sides:
                few = len({k for k, _ in side}) <= 2
                ticks += [v for k, v in side if few or k % stride == 0]
            if len(ticks) <= MAX_TICKS:
                break
        if len(ticks) >= 2:
            break
    return sorted(ticks)


def _readable_log_ticks(axis: Any) -> None:
    """Plain-number ticks on a log axis that never overlap: matplotlib labels minor ticks (2×10¹, 3×10¹, …) when
    an axis spans under about a decade, and they collide. Within a decade, a few linear steps; otherwise 1-2-5."""
    from matplotlib.ticker import FuncFormatter, LogLocator, MaxNLocator, NullFormatter

    lo, hi = axis.get_view_interval()
    lo, hi = min(lo, hi), max(lo, hi)
    if lo > 0 and hi / lo < 10:
        axis.set_major_locator(MaxNLocator(nbins=4))
    else:
        axis.set_major_locator(LogLocator(base=10, subs=(1.0, 2.0, 5.0)))
    axis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:g}"))
    axis.set_minor_formatter(NullFormatter())
