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

# ------------------------------------------------------------------------------------------------- formatting


def _pct(x: float | None) -> str:
    return "NaN" if x is None else f"{x:+.2f} %"


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
    text = f"{text} [{ci[0]:+.2f}, {ci[1]:+.2f}]" if ci and row.get("ppl_change_pct") is not None else text
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
    """``; uniform attention: 0.0349 → no sink`` (the chance baseline of the share on key 0, models.stats)."""
    chance = outliers.get("sink_chance")
    if chance is None or outliers.get("sink") is None:
        return ""
    ratio = outliers.get("sink_vs_chance")
    return f"; uniform attention over the window would put {chance:.4f} on key 0 → " + (
        f"sink ({ratio:.1f}× uniform)" if outliers["sink"] == "sink" else "no sink (at or below uniform)"
    )


def _kld(row: Mapping[str, Any]) -> str:
    return "-" if row.get("kld_mean") is None else f"{row['kld_mean']:.4f}"


def _top1(row: Mapping[str, Any]) -> str:
    return "-" if row.get("top1_agreement") is None else f"{100 * row['top1_agreement']:.1f} %"


# ---------------------------------------------------------------------------------------------------- figures


def _png(fig: Any) -> bytes:
    from qbench.studies.plots import _pyplot

    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=100, bbox_inches="tight", metadata={"Software": None})
    _pyplot().close(fig)
    return buf.getvalue()


def figures(card: Mapping[str, Any]) -> dict[str, bytes]:
    """{name: PNG bytes}: per model its outlier profile and attention-sink heatmap; one breaking-point figure."""
    from qbench.studies.plots import _pyplot

    plt = _pyplot()
    out: dict[str, bytes] = {}
    for i, m in enumerate(card["models"]):
        layers = m["outliers"]["layers"]
        linear = [x for x in m["outliers"]["linear"] if x["input_crest"] is not None]
        fig, axes = plt.subplots(1, 3, figsize=(13, 3.4))
        xs = [x["layer"] for x in layers]
        axes[0].plot(xs, [x["kurtosis_first"] for x in layers], "o-", label="first token")
        axes[0].plot(xs, [x["kurtosis_other"] for x in layers], "s-", label="other tokens")
        axes[0].axhline(3, color="grey", ls=":", lw=1)
        axes[0].set(title="raw kurtosis per block output (Gaussian: 3)", xlabel="block", yscale="log")
        axes[0].legend(fontsize=8)
        axes[1].plot(xs, [x["max_abs"] for x in layers], "o-", color="C3", label="max |activation|")
        axes[1].axhline(100, color="grey", ls=":", lw=1)
        for x in layers:
            if x["massive_count"]:
                axes[1].annotate(f"{x['massive_count']} massive", (x["layer"], x["max_abs"]), fontsize=7)
        axes[1].set(title="max |activation| (dotted: 100)", xlabel="block", yscale="log")
        for ax in axes[:2]:
            ax.set_xticks(xs)
        axes[2].barh(range(len(linear)), [x["input_crest"] for x in linear], color="C2")
        if len(linear) <= 40:
            axes[2].set_yticks(range(len(linear)), [x["name"] for x in linear], fontsize=6)
        else:  # too many to name: the worst few are named beside their bars
            for k, x in enumerate(linear):
                if x["name"] in m["outliers"]["linear_worst"][:3]:
                    axes[2].annotate(x["name"], (x["input_crest"], k), fontsize=6)
            axes[2].set_ylabel("linear layer (model order)")
        axes[2].invert_yaxis()
        axes[2].set(title="linear input crest factor max|x|/RMS", xscale="log")
        axes[2].set_xlim(left=1)  # max|x|/RMS >= 1: the bars start at the smallest possible value
        for axis in (axes[0].yaxis, axes[1].yaxis, axes[2].xaxis):
            _readable_log_ticks(axis)
        fig.suptitle(f"{m['name']}: outlier profile", fontsize=10)
        fig.tight_layout()
        out[f"outliers-{i}"] = _png(fig)

        att = m["attention"]
        fig, axes = plt.subplots(1, 2, figsize=(9, 0.35 * max(len(att["top1_share"]), 4) + 1.5))
        for ax, key, title in (
            (axes[0], "top1_share", "first-token top-1 share"),
            (axes[1], "mass", "mean weight on key 0"),
        ):
            grid = att[key]
            image = ax.imshow(grid, vmin=0, vmax=1, cmap="viridis", aspect="auto")
            ax.set(title=title, xlabel="head", ylabel="layer")
            ax.set_xticks(range(max((len(r) for r in grid), default=0)))
            ax.set_yticks(range(len(grid)))
            for r, row in enumerate(grid):
                for c, v in enumerate(row):
                    ax.text(
                        c, r, f"{v:.2f}", ha="center", va="center", fontsize=6, color="w" if v < 0.6 else "k"
                    )
            fig.colorbar(image, ax=ax, fraction=0.046)
        fig.suptitle(f"{m['name']}: attention sink per layer and head", fontsize=10)
        fig.tight_layout()
        out[f"attention-{i}"] = _png(fig)

    curves = [(m["name"], b) for m in card["models"] for b in m["breaking_points"] if b["curve"]]
    if curves:
        axes_names = list(dict.fromkeys(f"{b['family']} {b['axis']}" for _, b in curves))
        fig, panels = plt.subplots(
            1, len(axes_names), figsize=(3.2 * len(axes_names) + 1, 3.2), squeeze=False
        )
        panel = dict(zip(axes_names, panels[0], strict=True))
        models = list(dict.fromkeys(name for name, _ in curves))
        for name, b in curves:
            bits = [int(k) for k in b["curve"]]
            ys = [v["ppl_change_pct"] for v in b["curve"].values()]
            ax = panel[f"{b['family']} {b['axis']}"]
            ax.plot(
                bits,
                [math.nan if y is None else y for y in ys],
                "o-",
                ms=3,
                color=f"C{models.index(name)}",
                label=name,
            )
        on_ppl = (card.get("metric") or "ppl") == "ppl"  # the line is the tolerance only on this axis
        for title, ax in panel.items():
            if on_ppl:
                ax.axhline(card["tolerance_pct"], color="grey", ls=":", lw=1)
            ax.set_title(title, fontsize=9)
            ax.set_xlabel("bits")
            ax.set_yscale("symlog", linthresh=1)
            ax.invert_xaxis()
        panels[0][0].set_ylabel(
            f"perplexity change % (dotted: {card['tolerance_pct']:g} %)" if on_ppl else "perplexity change %"
        )
        panels[0][0].legend(fontsize=7)
        fig.tight_layout()
        out["breaking-points"] = _png(fig)
    return out


# --------------------------------------------------------------------------------------------------- markdown


def _md_table(headers: list[str], rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(headers) + " |", "|" + "---|" * len(headers)]
    lines += ["| " + " | ".join(c.replace("|", "\\|") for c in row) + " |" for row in rows]
    return "\n".join(lines)


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
        ["corpus", f"{p['corpus']}/{p['split']}"],
        ["tokens scored", f"{p['tokens_scored']:,} (budget {p['tokens']:,})"],
        ["window", f"{p['window']} ({p['windows']} windows)"],
        ["start token", p["start_token"]],
        ["dtype, seed", f"{p.get('dtype')}, {p.get('seed')}"],
        ["float perplexity", _num(m["fp"]["perplexity"], ".4f")],
        ["fingerprint", str(ident.get("fingerprint"))[:16]],
    ]
    if ident.get("gguf"):
        types = ", ".join(f"{k} {v}" for k, v in (ident["gguf"].get("tensor_types") or {}).items())
        identity.append(["GGUF tensors", f"{types} (every cell quantises these dequantised weights again)"])
    o = m["outliers"]["summary"]
    outlier_rows = [
        [
            str(x["layer"]),
            _num(x["kurtosis_first"]),
            _num(x["kurtosis_other"]),
            _num(x["max_abs"]),
            str(x["massive_count"]),
            ", ".join(map(str, x["massive_channels"][:8])) or "-",
            ", ".join(f"{s['position']}:{s['token']!r}" for s in x["massive_sites"][:4]) or "-",
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
    speed = m["speed_measured"]
    format_rows = [
        [
            f["label"],
            f"`{f['scheme']}`",
            f.get("quantised") or "-",
            _num(f["perplexity"], ".4f"),
            _change_ci(f),
            _status(f),
            _kld(f),
            _top1(f),
            _bytes(f["weight_bytes"]),
            _share(f["bytes_vs_bf16"]),
            *([_num(f["speedup"], ".2f") + ("×" if f["speedup"] else "")] if speed else []),
        ]
        for f in m["formats"]
    ]
    notes = " ".join(f"{f['label']}: {f['note']}." for f in m["formats"] if f["note"])
    kv_rows = [
        [
            str(r["bits"]),
            str(r["keep_sinks"]),
            r["label"] or "-",
            _num(r["perplexity"], ".4f"),
            _change_ci(r),
            _status(r),
            _kld(r),
            _top1(r),
            _float_reads(r),
        ]
        for r in m["kv"]["rows"]
    ]
    bp_rows = [
        [
            b["family"],
            b["axis"],
            b["text"],
            "  ".join(f"{k}:{_pct(v['ppl_change_pct'])}" for k, v in b["curve"].items()),
        ]
        for b in m["breaking_points"]
    ]
    out = [
        ("Identity and protocol", ["what", "value"], identity, ""),
        (
            "Outlier profile per layer",
            ["block", "κ first", "κ other", "max |act|", "massive", "channels", "sites (position:token)"],
            outlier_rows,
            f"Summary: κ first {_num(o['kurtosis_first'])}, κ other {_num(o['kurtosis_other'])}, max |act| "
            f"{_num(o['max_abs'])}, massive activations {_num(o['massive_total'])} (Sun et al.: |x| > 100 and > 1000 × "
            f"the layer's median), worst linear input crest {_num(o['max_input_crest'])}.",
        ),
        (
            "Linear layers' inputs",
            ["layer", "input crest", "input κ", "max |input|", "weight crest"],
            linear_rows,
            "",
        ),
        (
            "Attention sink per layer and head",
            ["layer", *(f"head {h}" for h in range(heads))],
            attention_rows,
            f"Each cell: first-token top-1 share / mean weight on key 0, over queries q ≥ 1. All heads: top-1 share "
            f"{_share(o['first_token_top1_share'])}, mean weight {_num(o['first_token_mass'])}"
            + _sink_text(m["outliers"])
            + ".",
        ),
        (
            "Deployable formats",
            [
                "format",
                "scheme",
                "quantised",
                "ppl",
                "change [95 % CI]",
                f"≤ {limit}",
                "KLD",
                "top-1",
                "size (MB)",
                "of bf16",
                *(["speed-up"] if speed else []),
            ],
            format_rows,
            "Fake quantisation at each format's standard settings. Change: perplexity change with its 95 % "
            f"interval (paired, windows as clusters); ✓ within {limit} (the 95 % interval's upper end ≤ it), ✗ beyond "
            "(its lower end above), ? undecided (it straddles the tolerance: more tokens would decide). KLD: mean "
            "KL divergence from the float model per token (nats); top-1: tokens whose most likely next token is "
            "the float model's (llama.cpp's definitions, docs/metrics.md). Size: the model's nominal storage as deployed, "
            "in MB = 10⁶ bytes: the quantised weights at their bits with their scales and zero points, every other "
            "tensor (embeddings, norms, an unquantised head) in bf16; of bf16: its ratio to the whole model in bf16 "
            "(card.json also holds the size with the other tensors in the evaluated float width, "
            "`weight_bytes_rest_float`)."
            + ("" if speed else " Speed: measured in the full budget only.")
            + (
                " @ N tokens: undecided at the card's tokens, re-evaluated at doubling tokens by --resolve "
                "(card.json's `resolved` lists each step)."
                if any(f.get("resolved") for f in m["formats"])
                or any(r.get("resolved") for r in m["kv"]["rows"])
                else ""
            )
            + (f" {notes}" if notes else ""),
        ),
        (
            "KV cache",
            [
                "bits",
                "sinks kept",
                "label",
                "ppl",
                "change [95 % CI]",
                f"≤ {limit}",
                "KLD",
                "top-1",
                "float reads K / V",
            ],
            kv_rows,
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
        out.append(
            (
                f"Where it breaks: `{s['scheme']}` by {s['by']}",
                ["unit", "change alone", "input crest", "input κ", "max |input|", "weight crest"],
                unit_rows,
                f"Repair: keep {r['count']} unit(s) in float ({_share(r['weight_share_float'])} of the quantised weights): "
                f"{_pct(r['quantised_ppl_change_pct'])} → {_pct(r['ppl_change_pct'])} (perplexity {_num(r['ppl'], '.4f')}). "
                f"Apply: `{s['command']}`",
            )
        )
    return out


KV_OPTION_KEYS = ("group", "residual", "block", "sym", "scale", "key_axis")


def _kv_caption(kv: Mapping[str, Any]) -> str:
    """What the KV rows measured, as the scheme does it: a causal scheme quantises each position with statistics
    of the tokens seen so far (as a deployed cache), ``window`` with statistics of the whole scored window."""
    options = kv.get("options") or {}
    given = ",".join(f"{k}={options[k]}" for k in KV_OPTION_KEYS if options.get(k) is not None)
    scheme = f"{kv.get('scheme')}:{given}" if given else str(kv.get("scheme"))
    text = f"Float weights, KV cache quantised with `{scheme}`"
    if kv.get("keys") and kv.get("values"):
        text += f" (keys {kv['keys']}; values {kv['values']})"
    if kv.get("causal") is True and str(kv.get("scheme")).startswith("fp8"):
        text += (
            ". Causal: each cached position is cast to FP8 with one fixed scale per layer, nothing of the other "
            "tokens (a query at position t reads a cache built from tokens ≤ t only), as a deployed cache is"
        )
    elif kv.get("causal") is True:
        text += (
            ". Causal: each cached position is quantised with statistics of the tokens seen so far (a query at "
            "position t reads a cache built from tokens ≤ t only), as a deployed cache is"
        )
    elif kv.get("causal") is False:
        text += (
            ". Not causal: the statistics span every position of the scored window, later tokens included (an "
            "upper bound, not a deployment)"
        )
    text += (
        ". Sinks kept = the most-attended positions per layer kept in float (--kv-keep-sinks), chosen from the "
        "float pass over the whole window (so those rows are not causal). Float reads K / V: the share of the "
        "window's (query, key) reads served by a float key / value — KIVI's residual and kept-first positions, "
        "sinks not counted; a row with a large share measures the residual more than the quantiser."
    )
    reasons: dict[str, list[str]] = {}
    for skipped in kv.get("skipped") or []:
        reasons.setdefault(str(skipped["reason"]), []).append(str(skipped["label"]))
    for reason, labels in reasons.items():
        text += f" Not measured ({', '.join(labels)}): {reason}."
    return text


def markdown(card: Mapping[str, Any], figure_files: Mapping[str, str]) -> str:
    parts = [f"# qbench card: {', '.join(m['name'] for m in card['models'])}", ""]
    if card.get("command"):
        parts += [f"Made by `{card['command']}` (budget {card['budget_contents']}).", ""]
    for i, m in enumerate(card["models"]):
        parts += [f"## {m['name']}", "", "**Verdict.** " + " ".join(m["verdict"]["lines"]), ""]
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
            [c["section"], c["row"], *(_cell(c, n) for n in names), c["more_robust"] or "-"]
            for c in card["comparison"]
        ]
        parts += ["## Side by side", "", _md_table(["section", "row", *names, "more robust"], rows), ""]
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


def _cell(c: Mapping[str, Any], name: str) -> str:
    v = c["values"].get(name)
    if isinstance(v, str) and c["section"] == "kv":  # a row that model could not measure: "skipped"
        return v
    if c["section"] == "formats" and (c.get("perplexity") or {}).get(name) is not None:
        text = f"{_pct(v)} (ppl {c['perplexity'][name]:.2f})"  # relative damage and absolute quality
        below = (c.get("below_others_float") or {}).get(name)
        return text + (f", below {', '.join(below)} in float" if below else "")
    if c["section"] in ("formats", "kv"):
        return _pct(v)
    if c["section"] == "breaking points":
        return "-" if v is None else str(v)
    if c["row"] == "1st-token top-1":
        return _share(v)
    return _num(v)


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
.ok{color:#176b2c}.bad{color:#a11}.undecided{color:#946200}.verdict{background:#f6f8e8;border-left:4px solid #8a3;padding:.5em 1em}
figure{margin:1em 0}figure img{max-width:100%}figcaption{font-size:.85em;color:#555}
@media print{body{margin:0;max-width:none;font-size:11px}h2{page-break-before:always}h2:first-of-type{
page-break-before:auto}figure,table{page-break-inside:avoid}}
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
    speed = m["speed_measured"]
    formats = [
        [
            _e(f["label"]),
            f"<code>{_e(f['scheme'])}</code>",
            _e(f.get("quantised") or "-"),
            _v(f"models.{i}.formats.{j}.perplexity", f["perplexity"], _num(f["perplexity"], ".4f")),
            _v(f"models.{i}.formats.{j}.ppl_change_pct", f["ppl_change_pct"], _change_ci(f)),
            f'<span class="{_verdict_class(f)}">{_e(_status(f))}</span>',
            _e(_kld(f)),
            _e(_top1(f)),
            _v(f"models.{i}.formats.{j}.weight_bytes", f["weight_bytes"], _bytes(f["weight_bytes"])),
            _e(_share(f["bytes_vs_bf16"])),
            *([_e(_num(f["speedup"], ".2f"))] if speed else []),
        ]
        for j, f in enumerate(m["formats"])
    ]
    kv = [
        [
            _e(r["bits"]),
            _e(r["keep_sinks"]),
            _e(r["label"] or "-"),
            _v(f"models.{i}.kv.rows.{j}.perplexity", r["perplexity"], _num(r["perplexity"], ".4f")),
            _v(
                f"models.{i}.kv.rows.{j}.ppl_change_pct",
                r["ppl_change_pct"],
                _change_ci(r),
            ),
            f'<span class="{_verdict_class(r)}">{_e(_status(r))}</span>',
            _e(_kld(r)),
            _e(_top1(r)),
            _e(_float_reads(r)),
        ]
        for j, r in enumerate(m["kv"]["rows"])
    ]
    return {"Deployable formats": formats, "KV cache": kv}


def html(card: Mapping[str, Any], figs: Mapping[str, bytes]) -> str:
    names = ", ".join(m["name"] for m in card["models"])
    body = [f"<h1>qbench card: {_e(names)}</h1>"]
    if card.get("command"):
        tolerance = _v(
            "tolerance_pct",
            card["tolerance_pct"],
            tolerance_text(card["tolerance_pct"], card.get("metric") or "ppl"),
        )
        body.append(
            f"<p>Made by <code>{_e(card['command'])}</code>; budget {_e(card['budget_contents'])}; "
            f"tolerance {tolerance}.</p>"
        )
    for i, m in enumerate(card["models"]):
        body.append(f'<h2 id="model-{i}">{_e(m["name"])}</h2>')
        rec = m["verdict"]["recommended"]
        body.append(
            '<div class="verdict"><strong>Verdict.</strong> '
            + " ".join(_code(line) for line in m["verdict"]["lines"])
            + (" " + _v(f"models.{i}.verdict.recommended.scheme", rec["scheme"], "") if rec else "")
            + "</div>"
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
            [c["section"], c["row"], *(_cell(c, n) for n in names_list), c["more_robust"] or "-"]
            for c in card["comparison"]
        ]
        body.append("<h2>Side by side</h2>")
        body.append(_html_table(["section", "row", *names_list, "more robust"], rows))
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
