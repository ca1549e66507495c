"""The card's renderers: markdown, one self-contained HTML page, and the figures — all from the dict that
``qbench.studies.card.build_card`` made. They format and draw; they compute no number.

The HTML page has its styles inline and its figures as base64 PNGs, loads nothing from the network, needs no
JavaScript and prints. Every key number sits in an element with ``data-key`` (its path in card.json, dotted) and
``data-value`` (the value as JSON), so a test — or a reader — can check the page against card.json.
"""

from __future__ import annotations

import base64
import html as _html
import io
import json
import math
from collections.abc import Mapping
from typing import Any

from qbench.eval.evidence import tolerance_text
from qbench.eval.gguf import block_quantised

# ------------------------------------------------------------------------------------------------- formatting


PCT_CAP = 1e4  # beyond ±10,000 % a change only says "broken": three significant digits say how broken


def _signed(x: float) -> str:
    """``+1.23``, or ``+4.65e+23`` beyond ±10,000: the 24 digits of a collapsed model's change are noise that
    widens its table, not information."""
    return f"{x:+.2e}" if abs(x) >= PCT_CAP else f"{x:+.2f}"


def _pct(x: float | None) -> str:
    return "NaN" if x is None else f"{_signed(x)} %"


def _num(x: Any, spec: str = ".3g") -> str:
    if x is None:
        return "-"
    if isinstance(x, float) and not math.isfinite(x):
        return str(x)
    if isinstance(x, bool):
        return "yes" if x else "no"
    if isinstance(x, int | float):
        return format(x, spec) if abs(x) < 1e4 else f"{x:,.0f}"
    return str(x)


def _share(x: float | None) -> str:
    return "-" if x is None else f"{x:.1%}"


def _bytes(n: int | None) -> str:
    """Decimal units (kB = 10³, MB = 10⁶, GB = 10⁹ bytes), as the card's captions state."""
    if not n:
        return "-"
    value = float(n)
    for unit in ("B", "kB", "MB", "GB"):
        if value < 1000 or unit == "GB":
            return f"{value:.0f} {unit}" if unit == "B" else f"{value:.2f} {unit}"
        value /= 1000
    return str(n)


def _mb(n: int | None) -> str:
    """A size in MB (10⁶ bytes) for a column headed "(MB)", whatever its magnitude — ``_bytes`` picks its own unit,
    which a header cannot state. Two decimals from 1 MB up; three significant digits below (a tiny model's KV
    cache: 0.238, not 0.24)."""
    if not n:
        return "-"
    value = n / 1e6
    if value >= 1:
        return f"{value:,.2f}"
    return f"{value:.{2 - math.floor(math.log10(value))}f}"  # 0.180, not .3g's 0.18


def _mb_text(n: int | None) -> str:
    """``193.25 MB``: ``_mb`` with its unit, for a size in prose or in a column without one."""
    return "-" if not n else f"{_mb(n)} MB"


SIZE_UNIT = "MB = 10⁶ bytes"


def _status(row: Mapping[str, Any]) -> str:
    if row.get("status") == "ok":
        verdict = row.get("verdict") or ("within" if row.get("within_tolerance") else "beyond")
        return {"within": "✓", "beyond": "✗", "undecided": "? undecided"}[verdict]
    return row.get("status") or "-"


def _change_ci(row: Mapping[str, Any]) -> str:
    """``+0.97 % [+0.41, +1.53]``: the change with its 95 % interval (``qbench.eval.evidence``)."""
    if row.get("status") == "skipped":
        return "-"
    text = _pct(row.get("ppl_change_pct"))
    ci = row.get("ppl_change_ci95")
    text = (
        f"{text} [{_signed(ci[0])}, {_signed(ci[1])}]"
        if ci and row.get("ppl_change_pct") is not None
        else text
    )
    if row.get("resolved"):  # --resolve re-evaluated it: the row is the last evaluation, on more tokens
        text += f" @ {row['resolved'][-1]['tokens_scored']:,} tokens"
    return text


def _verdict_class(row: Mapping[str, Any]) -> str:
    return (
        "ok" if row.get("within_tolerance") else "undecided" if row.get("verdict") == "undecided" else "bad"
    )


def _float_reads(row: Mapping[str, Any]) -> str:
    reads = row.get("float_reads")
    return "-" if not reads else f"{reads['keys']:.0%} / {reads['values']:.0%}"


def _sink_text(outliers: Mapping[str, Any]) -> str:
    """``; uniform attention …: 0.0349 on key 0 → no sink (mean weight 1.0×, top-1 1.6× uniform)`` — the chance
    baseline of both shares on key 0 (models.stats) and the card's three-way reading (card.sink_verdict)."""
    chance = outliers.get("sink_chance")
    verdict = outliers.get("sink")
    if chance is None or verdict is None:
        return ""
    ratios = [
        f"{name} {r:.1f}×"
        for name, r in (
            ("mean weight", outliers.get("sink_vs_chance")),
            ("top-1", outliers.get("sink_top1_vs_chance")),
        )
        if r is not None
    ]
    heads = outliers.get("sink_heads_share")
    share = "< 1%" if heads and heads < 0.005 else f"{heads or 0:.0%}"
    why = {
        "sink": f"{share} of heads put more than 0.3 of their attention on key 0, Gu et al.'s sink"
        if heads
        else "a mean weight above 0.3 on key 0",
        "weak": "above twice uniform; no head puts more than 0.3 on key 0",
        "no sink": "within twice uniform",
    }.get(verdict)
    shown = f": {', '.join(ratios)} uniform" if ratios else ""
    return f"; uniform attention over the window would put {chance:.4f} on key 0 → {verdict}{shown}" + (
        f" ({why})" if why else ""
    )


def _kld(row: Mapping[str, Any]) -> str:
    return "-" if row.get("kld_mean") is None else f"{row['kld_mean']:.4f}"


def _top1(row: Mapping[str, Any]) -> str:
    return "-" if row.get("top1_agreement") is None else f"{100 * row['top1_agreement']:.1f} %"


def _ratio(x: float | None) -> str:
    return "-" if x is None else f"{x:.2f}×"


def _window_note(kv: Mapping[str, Any]) -> str:
    """Where the KV rows were read: ``windows of 1,024 tokens`` or the context-bound exception, said so."""
    w = kv.get("window") or {}
    if not w.get("window"):
        return ""
    text = f"KV rows read on windows of {w['window']:,} tokens"
    if w.get("short"):
        text += (
            f" (the model's whole context: shorter than the {w.get('minimum', 1024):,} tokens a deployed context "
            "would give; most reads may hit float positions — see the float-reads column)"
        )
    return text + "."


def _memory_note(kv: Mapping[str, Any]) -> str:
    memory = kv.get("memory")
    if not memory:
        return ""
    return (
        f" Cache ({SIZE_UNIT}): keys and values of every layer at the model's context of {memory['context']:,} "
        f"tokens, one sequence, as stored (codes with their scales; float positions in bf16); of bf16: its ratio to "
        f"the same cache in bf16 ({_mb_text(memory['bf16_bytes'])})."
    )


def _stat_scope(m: Mapping[str, Any]) -> str:
    """What the float statistics were computed on (the float record's first windows, not the token budget)."""
    p = m["protocol"]
    n, tokens = p.get("statistics_windows"), p.get("statistics_tokens")
    if not n:
        return ""
    return f"Computed on the first {n} scored window(s), {tokens:,} tokens (the formats: {p['tokens_scored']:,})."


def _first_label(m: Mapping[str, Any]) -> str:
    """κ at position 0: the start token when one opens every window (the same token in every window)."""
    return "κ start token" if m["protocol"].get("bos", True) else "κ first"


# ---------------------------------------------------------------------------------------------------- figures


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
                ax.text(c, r, f"{v:.2f}", ha="center", va="center", fontsize=size, color="w" if dark else "k")
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


def _breaking_point_figure(plt: Any, card: Mapping[str, Any], curves: list[tuple[str, Any]]) -> Any:
    """Perplexity change against bit width, a panel per axis (at most four a row), integer bit ticks; each panel's
    y axis fitted to its own data (``_fit_change_axis``); the legend below the panels, where it hides no point."""
    import textwrap

    from matplotlib.lines import Line2D

    axes_names = list(dict.fromkeys(f"{b['family']} {b['axis']}" for _, b in curves))
    per_row = min(4, len(axes_names))
    rows = math.ceil(len(axes_names) / per_row)
    width = min(FIGURE_WIDTH, 2.6 * per_row + 1.2)
    models = list(dict.fromkeys(name for name, _ in curves))
    on_ppl = (card.get("metric") or "ppl") == "ppl"  # the line is the tolerance only on this axis
    tolerance = card["tolerance_pct"] if on_ppl else None
    # Full names, wrapped rather than cut: the legend is the one place that says which line is which model.
    labels = [textwrap.fill(name, LEGEND_WRAP, break_on_hyphens=False) for name in models]
    handles = [Line2D([], [], marker="o", ms=4, color=f"C{k}") for k in range(len(models))]
    if tolerance is not None:
        labels.append(f"tolerance {tolerance:g} %")
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
        ys = [math.nan if v["ppl_change_pct"] is None else v["ppl_change_pct"] for v in b["curve"].values()]
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
        _fit_change_axis(ax, values.get(title, []), tolerance)
    for row in panels:
        row[0].set_ylabel("perplexity change")
    fig.legend(handles, labels, loc="outside lower center", ncols=columns, frameon=False)
    return fig


LEGEND_WRAP = 40  # characters a legend line: a long checkpoint path wraps instead of widening the figure
MAX_TICKS = 6  # a log panel's labelled ticks: SmolLM2's 24 decades labelled one by one piled up


def _fit_change_axis(ax: Any, values: list[float], tolerance: float | None) -> None:
    """A breaking-point panel's y axis fitted to its data. Linear while every change is within ten times the
    linear threshold (the tolerance's power of ten, else 1 %); log where they are positive and span more; symlog
    where they span more and reach zero or below. The limits: the data's range and the tolerance line, plus 5 % in
    the axis's own coordinates — matplotlib's symlog autoscale ran SmolLM2's +10²³ % curve down to −10²¹ % with
    no point below +1 %. At most ``MAX_TICKS`` ticks, powers of ten (and 0) on a log axis, labelled in %."""
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
    ax.yaxis.set_major_formatter(FuncFormatter(lambda v, _: _pct_tick(v)))


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


SUPERSCRIPT = str.maketrans("-0123456789", "⁻⁰¹²³⁴⁵⁶⁷⁸⁹")


def _pct_tick(v: float) -> str:
    """A change axis's tick label: ``0 %``, ``2.5 %``, ``1,000 %``; from ±10,000 % a power of ten, ``10⁶ %``
    (one glyph row, no mathtext)."""
    if v == 0:
        return "0 %"
    if abs(v) < PCT_CAP:
        return f"{v:,.6g} %"
    k = round(math.log10(abs(v)))
    sign = "−" if v < 0 else ""
    if math.isclose(abs(v), 10.0**k, rel_tol=1e-9):
        return f"{sign}10{str(k).translate(SUPERSCRIPT)} %"
    return f"{v:.2g} %"


# --------------------------------------------------------------------------------------------------- markdown


def _md_cell(text: str) -> str:
    """A table cell's text with its ``|`` escaped: "max |act|" unescaped is three cells, and a header with more
    cells than the delimiter row is no table on GitHub."""
    return text.replace("|", "\\|")


def _md_table(headers: list[str], rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(map(_md_cell, headers)) + " |", "|" + "---|" * len(headers)]
    lines += ["| " + " | ".join(map(_md_cell, row)) + " |" for row in rows]
    return "\n".join(lines)


def _format_headers(m: Mapping[str, Any], limit: str) -> list[str]:
    return [
        "format",
        "quantised",
        "ppl",
        "change [95 % CI]",
        f"≤ {limit}",
        "KLD",
        "top-1",
        "size (MB)",
        "rest fp32 (MB)",
        "of bf16",
        "+ bf16 KV (MB)",
        "decode ×",
        "prefill ×",
        *(["model prefill ×"] if m["speed_measured"] else []),
    ]


def _ran(f: Mapping[str, Any]) -> bool:
    """Whether the model ran this format (a number, finite or not); unsupported, error and skipped rows did not."""
    return f.get("status") in ("ok", "nonfinite")


def _format_cells(f: Mapping[str, Any], m: Mapping[str, Any]) -> list[str]:
    """One format row as text (markdown; the HTML wraps its key numbers in data-key spans). A row the model could
    not run (unsupported, error, skipped) shows no perplexity and no kernel speed: only its nominal size."""
    ran = _ran(f)
    return [
        f"{f['label']} `{f['scheme']}`",
        f.get("quantised") or "-",
        _num(f["perplexity"], ".4f") if ran else "-",
        _change_ci(f) if ran else "-",
        _status(f),
        _kld(f),
        _top1(f),
        _mb(f["weight_bytes"]),
        _mb(f.get("weight_bytes_rest_float")),
        _share(f["bytes_vs_bf16"]),
        _mb(f.get("memory_bytes")),
        _ratio(f.get("decode_speedup")) + _excludes(f) if ran else "-",
        _ratio(f.get("prefill_speedup")) + _excludes(f) if ran else "-",
        *([_ratio(f["speedup"]) if ran else "-"] if m["speed_measured"] else []),
    ]


def _excludes(f: Mapping[str, Any]) -> str:
    """`` †`` on a kernel ratio that leaves work out (a rotated row: its online rotations; the caption says)."""
    return " †" if f.get("speed_excludes") and f.get("decode_speedup") is not None else ""


def _format_caption(m: Mapping[str, Any], limit: str) -> str:
    kernels = m.get("kernels") or {}
    speed = (
        f" decode × / prefill ×: the model's linear layers alone on its own shapes, real kernels ({kernels.get('native_isa') or 'torch'}) "
        f"against float32 F.linear, {kernels.get('threads', 1)} thread, {kernels.get('cpu')}: one row through "
        "enough copies of each layer that the weights come from memory as in a decode step, and "
        f"{kernels.get('prefill_tokens')} rows; - where the format has no real kernel here (fake quantisation "
        "only). Attention, norms and Python between the kernels are not in these ratios (`qbench speed` times "
        "generation); † a rotated row (QuaRot, Hadamard): the same kernels as its unrotated format, its online "
        "rotations not timed."
        if kernels
        else " Speed: no format of this card has a real kernel here."
    )
    memory = m["kv"].get("memory")
    plus_kv = (
        f" + bf16 KV: the size plus the KV cache in bf16 at the model's context ({memory['context']:,} tokens, "
        "one sequence)."
        if memory
        else ""
    )
    p = m.get("protocol") or {}
    n = p.get("windows")
    # the interval's clusters: with two windows it has one degree of freedom, and a reader should see why it is wide
    clusters = (
        f"paired over the {n} scored windows of {p['window']:,} tokens as clusters"
        + (f", t with {n - 1} degree(s) of freedom: wide" if n <= 3 else "")
        if isinstance(n, int) and n > 1 and p.get("window")
        else "paired, windows as clusters"
    )
    return (
        "Fake quantisation at each format's standard settings; quantised: what each row quantised (W: weights, "
        "A: the activations entering each linear, O: outputs) and how the weights were rounded (RTN: "
        f"round-to-nearest). Change: perplexity change with its 95 % interval ({clusters}); ✓ "
        f"within {limit} (the interval's upper end ≤ it), ✗ beyond (its lower end above), ? undecided (it "
        "straddles the tolerance: more tokens would decide). KLD: mean KL divergence from the float model per token "
        "(nats); top-1: tokens whose most likely next token is the float model's (llama.cpp's definitions, "
        "docs/metrics.md). Size: the model as deployed, MB = 10⁶ bytes: the quantised weights at their bits with "
        "their scales and zero points, every other tensor (embeddings, norms, an unquantised head) in bf16; rest "
        "fp32: the same with those tensors in float32; of bf16: the size's ratio to the whole model in bf16."
        + plus_kv
        + speed
        + (
            " model prefill ×: the whole model's real-kernel prefill of 512 tokens (full budget)."
            if m["speed_measured"]
            else ""
        )
    )


def _kv_cells(r: Mapping[str, Any], memory: Mapping[str, Any] | None) -> list[str]:
    bf16 = (memory or {}).get("bf16_bytes")
    share = r["cache_bytes"] / bf16 if r.get("cache_bytes") and bf16 else None
    return [
        r.get("scheme_name") or str(r.get("scheme")),
        str(r["bits"]),
        str(r["keep_sinks"]),
        r["label"] or "-",
        _num(r["perplexity"], ".4f"),
        _change_ci(r),
        _status(r),
        _kld(r),
        _top1(r),
        _float_reads(r),
        _mb(r.get("cache_bytes")),
        _share(share),
    ]


KV_HEADERS = [
    "scheme",
    "bits",
    "sinks kept",
    "label",
    "ppl",
    "change [95 % CI]",
    "≤ {limit}",
    "KLD",
    "top-1",
    "float reads K / V",
    "cache (MB)",
    "of bf16 cache",
]


def _sections(
    card: Mapping[str, Any], m: Mapping[str, Any]
) -> list[tuple[str, list[str], list[list[str]], str]]:
    """(title, headers, rows, caption) of one model's tables: the one source both renderers format."""
    limit = tolerance_text(card["tolerance_pct"], card.get("metric") or "ppl")
    ident, p = m["identity"], m["protocol"]
    identity = [
        ["model", m["name"]],
        ["source", str(m["source"])],
        ["kind", _num(ident.get("kind"))],
        ["parameters", _num(ident.get("parameters"), ",")],
        [
            "layers × heads × width",
            f"{_num(ident.get('layers'))} × {_num(ident.get('heads'))} × {_num(ident.get('d_model'))}",
        ],
        ["attention", _num(ident.get("attention")) + _gate(ident.get("gate"))],
        ["norm", f"{_num(ident.get('norm'))} ({_num(ident.get('norm_position'))})"],
        ["positions", _num(ident.get("positions"))],
        ["tied LM head", _num(ident.get("tied_head"))],
        ["sliding window", _num(ident.get("sliding_window"))],
        ["context", _num(ident.get("context"), ",")],
        ["corpus", f"{p['corpus']}/{p['split']}: " + (p.get("corpus_description") or "-")],
        ["tokens scored", f"{p['tokens_scored']:,} (budget {p['tokens']:,})"],
        ["window", f"{p['window']} ({p['windows']} windows)"],
        [
            "statistics on",
            f"{p['statistics_windows']} window(s), {p['statistics_tokens']:,} tokens"
            if p.get("statistics_windows")
            else "-",
        ],
        ["start token", p["start_token"]],
        ["dtype, seed", f"{p.get('dtype')}, {p.get('seed')}"],
        ["float perplexity", _num(m["fp"]["perplexity"], ".4f")],
        ["fingerprint", str(ident.get("fingerprint"))[:16]],
    ]
    if ident.get("gguf"):
        counts = ident["gguf"].get("tensor_types") or {}
        types = ", ".join(f"{k} {v}" for k, v in counts.items())
        note = "every cell quantises these dequantised weights again"
        if block_quantised(ident["gguf"]):
            # Measured on SmolLM2's Q4_1 file: every linear weight has ≤ 16 distinct values per 32-weight block.
            # Round-to-nearest in that basis with aligned groups nearly reproduces the grid; a rotation cannot.
            note += (
                "; the block-quantised tensors' values already lie on their GGUF grid (Q4_1: at most 16 values"
                " per block of 32 weights), which flatters formats whose groups align with those blocks and"
                " penalises rotations (Hadamard, QuaRot): judge rotations on a float source"
            )
        identity.append(["GGUF tensors", f"{types} ({note})"])
    o = m["outliers"]["summary"]
    first = _first_label(m)
    outlier_rows = [
        [
            str(x["layer"]),
            _num(x["kurtosis_first"]),
            _num(x["kurtosis_other"]),
            _num(x["max_abs"]),
            str(x["massive_count"]),
            ", ".join(map(str, x["massive_channels"][:8])) or "-",
            ", ".join(_site(s) for s in x["massive_sites"][:4]) or "-",
        ]
        for x in m["outliers"]["layers"]
    ]
    linear_rows = [
        [
            f"`{x['name']}`",
            _num(x["input_crest"]),
            _num(x["input_kurtosis"]),
            _num(x["input_absmax"]),
            _num(x["weight_crest"]),
        ]
        for x in m["outliers"]["linear"]
        if x["name"] in m["outliers"]["linear_worst"]
    ]
    att = m["attention"]
    heads = max((len(r) for r in att["top1_share"]), default=0)
    attention_rows = [
        [
            str(layer),
            *(
                f"{t:.2f} / {w:.2f}"
                for t, w in zip(att["top1_share"][layer], att["mass"][layer], strict=True)
            ),
        ]
        for layer in range(len(att["top1_share"]))
    ]
    notes = " ".join(f"{f['label']}: {f['note']}." for f in m["formats"] if f["note"])
    resolved = any(f.get("resolved") for f in m["formats"]) or any(r.get("resolved") for r in m["kv"]["rows"])
    memory = m["kv"].get("memory")
    bp_rows = [
        [
            b["family"],
            b["axis"],
            b["text"],
            "  ".join(f"{k}:{_pct(v['ppl_change_pct'])}" for k, v in b["curve"].items()),
        ]
        for b in m["breaking_points"]
    ]
    start = (
        f"{first}: position 0, the start token that opens every window — the same token each time, so one "
        "token's statistics, not an average over tokens; κ other: positions ≥ 1"
        if p.get("bos", True)
        else "κ first: position 0; κ other: positions ≥ 1"
    )
    out = [
        ("Identity and protocol", ["what", "value"], identity, ""),
        (
            "Outlier profile per layer",
            ["block", first, "κ other", "max |act|", "massive", "channels", "sites (window/position:token)"],
            outlier_rows,
            f"Raw kurtosis across channels of each block's output ({start}). Summary: {first} "
            f"{_num(o['kurtosis_first'])}, κ other {_num(o['kurtosis_other'])}, max |act| {_num(o['max_abs'])}, "
            f"massive activations {_num(o['massive_total'])} (Sun et al.: |x| > 100 and > 1000 × the layer's "
            f"median), worst linear input crest {_num(o['max_input_crest'])}. {_stat_scope(m)}",
        ),
        (
            "Linear layers' inputs",
            ["layer", "input crest", "input κ", "max |input|", "weight crest"],
            linear_rows,
            f"The {len(linear_rows)} linear layers with the largest input crest factor (all of them in card.json); "
            "every token of the window counted, the start token included. " + _stat_scope(m),
        ),
        (
            "Attention sink per layer and head",
            ["layer", *(f"head {h}" for h in range(heads))],
            attention_rows,
            f"Each cell: first-token top-1 share / mean weight on key 0, over queries q ≥ 1. All heads: top-1 share "
            f"{_share(o['first_token_top1_share'])}, mean weight {_num(o['first_token_mass'])}"
            + _sink_text(m["outliers"])
            + f". {_stat_scope(m)}",
        ),
        (
            "Deployable formats",
            _format_headers(m, limit),
            [_format_cells(f, m) for f in m["formats"]],
            _format_caption(m, limit)
            + (
                " @ N tokens: undecided at the card's tokens, re-evaluated at doubling tokens by --resolve "
                "(card.json's `resolved` lists each step)."
                if resolved
                else ""
            )
            + (f" {notes}" if notes else ""),
        ),
        (
            "KV cache",
            [h.format(limit=limit) for h in KV_HEADERS],
            [_kv_cells(r, memory) for r in m["kv"]["rows"]],
            _kv_caption(m["kv"]),
        ),
        (
            "Breaking points",
            ["family", "axis", "breaking point", "curve (bits:change)"],
            bp_rows,
            f"Lowest width within {limit} there and at every wider width.",
        ),
    ]
    s = m["sensitivity"]
    if s:
        unit_rows = [
            [
                f"`{u['name']}`",
                _pct(u["ppl_change_pct"]),
                _num(u["input_crest"]),
                _num(u["input_kurtosis"]),
                _num(u["max_abs"]),
                _num(u["weight_crest"]),
            ]
            for u in s["top"]
        ]
        r = s["repair"]
        size = f", {_mb_text(r['weight_bytes'])}" if r.get("weight_bytes") else ""
        out.append(
            (
                f"Where it breaks: `{s['scheme']}` by {s['by']}",
                ["unit", "change alone", "input crest", "input κ", "max |input|", "weight crest"],
                unit_rows,
                f"Each unit quantised alone, the rest float; the {len(unit_rows)} most damaging of {s['units']}. "
                f"Repair: keep {r['count']} unit(s) in float ({_share(r['weight_share_float'])} of the quantised "
                f"weights): {_pct(r['quantised_ppl_change_pct'])} → {_pct(r['ppl_change_pct'])} (perplexity "
                f"{_num(r['ppl'], '.4f')}){size}"
                + (
                    f"; {'pays: smaller than' if r.get('pays') else 'does not pay: not smaller than'} "
                    f"{r['beat']['what']} ({_mb_text(r['beat']['bytes'])})"
                    if (r.get("beat") or {}).get("bytes") and r["reached"]
                    else ""
                )
                + ". The command is in the verdict's commands.",
            )
        )
    return out


KV_OPTION_KEYS = ("group", "residual", "block", "sym", "scale", "key_axis")


def _kv_scheme_text(scheme: Mapping[str, Any]) -> str:
    """One KV scheme as it ran: its options, what it quantises how, and whether it is causal."""
    options = scheme.get("options") or {}
    given = ",".join(f"{k}={options[k]}" for k in KV_OPTION_KEYS if options.get(k) is not None)
    name = f"{scheme.get('scheme')}:{given}" if given else str(scheme.get("scheme"))
    text = f"`{name}`"
    if scheme.get("keys") and scheme.get("values"):
        text += f" (keys {scheme['keys']}; values {scheme['values']})"
    if scheme.get("causal") and str(scheme.get("scheme")).startswith("fp8"):
        text += (
            ": causal, each cached position is cast to FP8 with one fixed scale per layer, nothing of the other "
            "tokens (a query at position t reads a cache built from tokens ≤ t only), as a deployed cache is"
        )
    elif scheme.get("causal"):
        text += (
            ": causal, each cached position is quantised with statistics of the tokens seen so far (a query at "
            "position t reads a cache built from tokens ≤ t only), as a deployed cache is"
        )
    else:
        text += (
            ": not causal, the statistics span every position of the scored window, later tokens included (an "
            "upper bound, not a deployment)"
        )
    return text


def _kv_caption(kv: Mapping[str, Any]) -> str:
    """What the KV rows measured, scheme by scheme: a causal scheme quantises each position with statistics of the
    tokens seen so far (as a deployed cache), ``window`` with statistics of the whole scored window; the window
    they were read on, the cache's size, the rows not measured."""
    schemes = kv.get("schemes") or []
    text = (
        "Float weights, the KV cache quantised with " + "; ".join(_kv_scheme_text(x) for x in schemes) + "."
    )
    window = _window_note(kv)
    if window:
        text += " " + window
    text += (
        " Sinks kept = the most-attended positions per layer kept in float (--kv-keep-sinks), chosen from the "
        "float pass over the whole window (so those rows are not causal). Float reads K / V: the share of the "
        "window's (query, key) reads served by a float key / value — KIVI's residual and kept-first positions, "
        "sinks not counted; a row with a large share measures the residual more than the quantiser."
    )
    text += _memory_note(kv)
    if not kv.get("memory") and any(r.get("cache_bytes") for r in kv.get("rows") or []):
        text += f" Cache: {SIZE_UNIT}."  # the column's unit, which the memory note states where there is one
    reasons: dict[str, list[str]] = {}
    for skipped in kv.get("skipped") or []:
        reasons.setdefault(str(skipped["reason"]), []).append(str(skipped["label"]))
    for reason, labels in reasons.items():
        text += f" Not measured ({', '.join(labels)}): {reason}."
    return text


def _summary_rows(card: Mapping[str, Any]) -> list[dict[str, str]]:
    """The page's first table: per model its recommended format, size, change and verdict, what to avoid and
    whether a repair pays."""
    rows = []
    for m in card["models"]:
        v = m["verdict"]
        rec = v["recommended"]
        found = next((f for f in m["formats"] if rec and f["scheme"] == rec["scheme"]), None)
        avoid = v.get("avoid") or []
        repair = v.get("repair")
        rows.append(
            {
                "model": m["name"],
                "float ppl": _num(m["fp"]["perplexity"], ".4g"),
                "recommended": f"{rec['label']} `{rec['scheme']}`" if rec else "none within the tolerance",
                "size": (
                    f"{_mb_text(rec['weight_bytes'])} ({_share(rec['bytes_vs_bf16'])} of bf16)"
                    if rec
                    else "-"
                ),
                "change [95 % CI]": _change_ci(found) if found else "-",
                "verdict": _status(found) if found else f"{len(v.get('undecided') or [])} undecided",
                "avoid": (
                    f"{len(avoid)}: worst {avoid[0]['label']} ({_pct(avoid[0]['ppl_change_pct'])})"
                    if avoid
                    else "-"
                ),
                "repair": (
                    "-"
                    if not repair
                    else f"`{repair['scheme']}` {_pct(repair['ppl_change_pct'])}, {_mb_text(repair.get('weight_bytes'))}"
                    + (" (pays)" if repair.get("pays") else " (does not pay)")
                ),
            }
        )
    return rows


def _commands(card: Mapping[str, Any]) -> list[tuple[str, str]]:
    """(what, command) pairs: the card's own command and each model's verdict commands."""
    out = []
    if card.get("command"):
        out.append(("this card", card["command"]))
    for m in card["models"]:
        for c in m["verdict"].get("commands") or []:
            out.append((f"{m['name']}: {c['what']}", c["command"]))
    return out


def markdown(card: Mapping[str, Any], figure_files: Mapping[str, str]) -> str:
    parts = [f"# qbench card: {', '.join(m['name'] for m in card['models'])}", ""]
    summary = _summary_rows(card)
    parts += ["## Summary", ""]
    if summary:
        headers = list(summary[0])
        parts += [_md_table(headers, [[r[h] for h in headers] for r in summary]), ""]
    parts += [
        f"Budget {card['budget_contents']}; tolerance "
        f"{tolerance_text(card['tolerance_pct'], card.get('metric') or 'ppl')}. Sizes: {SIZE_UNIT}.",
        "",
    ]
    if card.get("comparison_lines"):
        parts += ["**Side by side**", "", *(f"- {line}" for line in card["comparison_lines"]), ""]
    commands = _commands(card)
    if commands:
        parts += ["<details><summary>Commands</summary>", ""]
        parts += [f"- {what}: `{command}`" for what, command in commands]
        parts += ["", "</details>", ""]
    for i, m in enumerate(card["models"]):
        parts += [
            f"## {m['name']}",
            "",
            "**Verdict**",
            "",
            *(f"- {line}" for line in m["verdict"]["lines"]),
            "",
        ]
        for title, headers, rows, caption in _sections(card, m):
            parts += [f"### {title}", "", _md_table(headers, rows), ""]
            if caption:
                parts += [caption, ""]
            if title.startswith("Outlier") and f"outliers-{i}" in figure_files:
                parts += [f"![outlier profile]({figure_files[f'outliers-{i}']})", ""]
            if title.startswith("Attention") and f"attention-{i}" in figure_files:
                parts += [f"![attention sink]({figure_files[f'attention-{i}']})", ""]
        if m.get("not_measured"):
            parts += ["### Not measured", "", *(f"- {line}" for line in m["not_measured"]), ""]
    if "breaking-points" in figure_files:
        parts += [
            "## Breaking-point curves",
            "",
            f"![breaking points]({figure_files['breaking-points']})",
            "",
        ]
    if card.get("comparison"):
        names = [m["name"] for m in card["models"]]
        rows = [
            [c["section"], c["row"], *(_cell(c, n) for n in names), c["more_robust"] or "-", _ship(c)]
            for c in card["comparison"]
        ]
        parts += [
            "## Side by side",
            "",
            _md_table(["section", "row", *names, "more robust", "better to ship"], rows),
            "",
            COMPARISON_CAPTION,
            "",
        ]
    parts += [
        "## Definitions",
        "",
        _md_table(["metric", "unit", "better", "definition"], _definition_rows(card)),
        "",
    ]
    parts += [
        f"Definitions in full: docs/metrics.md. Versions and commit: card.json (`env`). Created {card['created_utc']}.",
        "",
    ]
    return "\n".join(parts)


COMPARISON_CAPTION = (
    "More robust: the model whose change is decidedly smaller (its 95 % interval wholly below the others'); for "
    "a breaking point the lower one; for an outlier statistic (no interval) the one at most half the others'. "
    "Better to ship: the model whose quantised perplexity is decidedly lower than every other model's quantised "
    "one — paired over the same windows, whatever each lost to quantisation; each cell also names the models whose "
    "*float* perplexity it is decidedly below. KV rows give the quantised perplexity at the KV section's window "
    "(its change against the float model at that window). - : the measurement does not tell them apart."
)


def _ship(c: Mapping[str, Any]) -> str:
    """The comparison's absolute verdict: decided for format and float rows only."""
    return (c.get("better_to_ship") or "-") if c["section"] in ("float", "formats") else ""


def _cell(c: Mapping[str, Any], name: str) -> str:
    v = c["values"].get(name)
    if isinstance(v, str) and c["section"] == "kv":  # a row that model could not measure: "skipped"
        return v
    if c["section"] == "kv" and name in c.get("missing", ()):  # a row that model's card did not run
        return "-"
    if c["section"] == "float":
        return "-" if v is None else f"ppl {v:.2f}"
    if c["section"] == "formats" and (c.get("perplexity") or {}).get(name) is not None:
        text = f"{_pct(v)} (ppl {c['perplexity'][name]:.2f})"  # relative damage and absolute quality
        below = (c.get("below_others_float") or {}).get(name)
        return text + (f", below {', '.join(below)} in float" if below else "")
    if c["section"] == "kv" and (c.get("perplexity") or {}).get(name) is not None:
        return f"{_pct(v)} (ppl {c['perplexity'][name]:.2f})"  # at the KV window (its own float baseline)
    if c["section"] in ("formats", "kv"):
        return _pct(v)
    if c["section"] == "breaking points":
        return "-" if v is None else str(v)
    if c["row"] == "1st-token top-1":
        return _share(v)
    return _num(v)


def _site(s: Mapping[str, Any]) -> str:
    """A massive activation's site: the window it was found in (records' window order), position and token."""
    where = f"{s['window']}/{s['position']}" if s.get("window") is not None else str(s["position"])
    return f"{where}:{s['token']!r}"


def _definition_rows(card: Mapping[str, Any]) -> list[list[str]]:
    return [
        [f"`{k}` ({v['label']})", v["unit"] or "–", v["better"], v["definition"]]
        for k, v in card["metrics"].items()
    ]


# ------------------------------------------------------------------------------------------------------- html

_CSS = """
body{font:14px/1.45 system-ui,-apple-system,Segoe UI,Helvetica,Arial,sans-serif;margin:2em auto;max-width:72em;
color:#1b1b1b;padding:0 1em}
h1{font-size:1.6em}h2{border-bottom:2px solid #ccc;margin-top:2em}h3{margin-top:1.5em}
table{border-collapse:collapse;margin:.5em 0;font-size:.9em}td,th{border:1px solid #ccc;padding:2px 6px;
text-align:left;vertical-align:top}th{background:#f2f2f2}code{font-size:.95em}
.ok{color:#176b2c}.bad{color:#a11}.undecided{color:#946200}
.verdict{background:#f6f8e8;border-left:4px solid #8a3;padding:.3em 1em}.verdict li{margin:.2em 0}
#summary table{font-size:1em}details{margin:.5em 0}summary{cursor:pointer;color:#345}
details code{word-break:break-all}
figure{margin:1em 0}figure img{max-width:100%}figcaption{font-size:.85em;color:#555}
@media print{body{margin:0;max-width:none;font-size:11px}h2{page-break-before:always}h2:first-of-type{
page-break-before:auto}figure,table{page-break-inside:avoid}details>*{display:block}}
"""


def _e(text: Any) -> str:
    return _html.escape(str(text))


def _code(text: str) -> str:
    """Markdown's `code` spans as <code>, the rest escaped."""
    pieces = str(text).split("`")
    return "".join(f"<code>{_e(p)}</code>" if i % 2 else _e(p) for i, p in enumerate(pieces))


def _v(key: str, value: Any, text: str) -> str:
    """A key number: its card.json path and exact value beside the shown text."""
    return f'<span data-key="{_e(key)}" data-value="{_e(json.dumps(value))}">{_e(text)}</span>'


def _html_table(headers: list[str], rows: list[list[str]], raw: bool = False) -> str:
    head = "".join(f"<th>{_e(h)}</th>" for h in headers)
    body = "".join(
        "<tr>" + "".join(f"<td>{c if raw else _code(c)}</td>" for c in row) + "</tr>" for row in rows
    )
    return f"<table><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>"


def _figure(name: str, png: bytes | None, caption: str) -> str:
    if png is None:
        return ""
    data = base64.b64encode(png).decode()
    return (
        f'<figure id="fig-{_e(name)}"><img alt="{_e(caption)}" src="data:image/png;base64,{data}">'
        f"<figcaption>{_e(caption)}</figcaption></figure>"
    )


def _key_rows(m: Mapping[str, Any], i: int) -> dict[str, list[list[str]]]:
    """The tables whose numbers carry data-key: formats and KV (the verdict's inputs)."""
    formats = []
    for j, f in enumerate(m["formats"]):
        cells = [_code(c) for c in _format_cells(f, m)]
        if _ran(f):  # a row not run keeps its "-"
            cells[2] = _v(f"models.{i}.formats.{j}.perplexity", f["perplexity"], _num(f["perplexity"], ".4f"))
            cells[3] = _v(f"models.{i}.formats.{j}.ppl_change_pct", f["ppl_change_pct"], _change_ci(f))
        cells[4] = f'<span class="{_verdict_class(f)}">{_e(_status(f))}</span>'
        cells[7] = _v(f"models.{i}.formats.{j}.weight_bytes", f["weight_bytes"], _mb(f["weight_bytes"]))
        formats.append(cells)
    memory = m["kv"].get("memory")
    kv = []
    for j, r in enumerate(m["kv"]["rows"]):
        cells = [_code(c) for c in _kv_cells(r, memory)]
        cells[4] = _v(f"models.{i}.kv.rows.{j}.perplexity", r["perplexity"], _num(r["perplexity"], ".4f"))
        cells[5] = _v(f"models.{i}.kv.rows.{j}.ppl_change_pct", r["ppl_change_pct"], _change_ci(r))
        cells[6] = f'<span class="{_verdict_class(r)}">{_e(_status(r))}</span>'
        kv.append(cells)
    return {"Deployable formats": formats, "KV cache": kv}


def html(card: Mapping[str, Any], figs: Mapping[str, bytes]) -> str:
    names = ", ".join(m["name"] for m in card["models"])
    body = [f"<h1>qbench card: {_e(names)}</h1>"]
    summary = _summary_rows(card)
    tolerance = _v(
        "tolerance_pct",
        card["tolerance_pct"],
        tolerance_text(card["tolerance_pct"], card.get("metric") or "ppl"),
    )
    body.append('<section id="summary"><h2>Summary</h2>')
    if summary:
        headers = list(summary[0])
        rows = []
        for i, r in enumerate(summary):
            cells = [_code(r[h]) for h in headers]
            rec = card["models"][i]["verdict"]["recommended"]
            if rec:
                cells[2] += _v(f"models.{i}.verdict.recommended.scheme", rec["scheme"], "")
            rows.append(cells)
        body.append(_html_table(headers, rows, raw=True))
    body.append(
        f"<p>Budget {_e(card['budget_contents'])}; tolerance {tolerance}. Sizes: {_e(SIZE_UNIT)}.</p>"
    )
    if card.get("comparison_lines"):
        body.append(
            "<p><strong>Side by side</strong></p><ul>"
            + "".join(f"<li>{_code(line)}</li>" for line in card["comparison_lines"])
            + "</ul>"
        )
    commands = _commands(card)
    if commands:
        body.append(
            "<details><summary>Commands</summary><ul>"
            + "".join(f"<li>{_e(what)}: <code>{_e(command)}</code></li>" for what, command in commands)
            + "</ul></details>"
        )
    body.append("</section>")
    for i, m in enumerate(card["models"]):
        body.append(f'<h2 id="model-{i}">{_e(m["name"])}</h2>')
        body.append(
            '<div class="verdict"><strong>Verdict</strong><ul>'
            + "".join(f"<li>{_code(line)}</li>" for line in m["verdict"]["lines"])
            + "</ul></div>"
        )
        body.append(
            "<p>Float perplexity "
            + _v(f"models.{i}.fp.perplexity", m["fp"]["perplexity"], _num(m["fp"]["perplexity"], ".4f"))
            + "</p>"
        )
        keyed = _key_rows(m, i)
        for title, headers, rows, caption in _sections(card, m):
            body.append(f"<h3>{_code(title)}</h3>")
            if title in keyed:
                body.append(_html_table(headers, keyed[title], raw=True))
            else:
                body.append(_html_table(headers, rows))
            if caption:
                body.append(f"<p>{_code(caption)}</p>")
            if title.startswith("Outlier"):
                body.append(
                    _figure(
                        f"outliers-{i}", figs.get(f"outliers-{i}"), f"{m['name']}: outlier profile per layer"
                    )
                )
            if title.startswith("Attention"):
                body.append(
                    _figure(
                        f"attention-{i}",
                        figs.get(f"attention-{i}"),
                        f"{m['name']}: attention sink per layer and head",
                    )
                )
        if m.get("not_measured"):
            body.append("<h3>Not measured</h3>")
            body.append("<ul>" + "".join(f"<li>{_code(line)}</li>" for line in m["not_measured"]) + "</ul>")
    if "breaking-points" in figs:
        body.append("<h2>Breaking-point curves</h2>")
        body.append(
            _figure("breaking-points", figs["breaking-points"], "perplexity change against bit width")
        )
    if card.get("comparison"):
        names_list = [m["name"] for m in card["models"]]
        rows = [
            [c["section"], c["row"], *(_cell(c, n) for n in names_list), c["more_robust"] or "-", _ship(c)]
            for c in card["comparison"]
        ]
        body.append("<h2>Side by side</h2>")
        body.append(_html_table(["section", "row", *names_list, "more robust", "better to ship"], rows))
        body.append(f"<p>{_code(COMPARISON_CAPTION)}</p>")
    body.append("<h2>Definitions</h2>")
    body.append(_html_table(["metric", "unit", "better", "definition"], _definition_rows(card)))
    body.append(
        f"<p>Definitions in full: docs/metrics.md in the qbench repository. Versions, commit and seed: card.json. Created {_e(card['created_utc'])}.</p>"
    )
    return (
        '<!DOCTYPE html>\n<html lang="en"><head><meta charset="utf-8"><title>qbench card: '
        f"{_e(names)}</title><style>{_CSS}</style></head><body>\n" + "\n".join(body) + "\n</body></html>\n"
    )


def _gate(gate: str | None) -> str:
    return f", {gate} output gate" if gate not in (None, "none") else ""


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
