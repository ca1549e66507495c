"""One model's sections, in page order: identity and protocol, the outlier profile, the linear layers' inputs,
the attention sink, the formats, the KV cache, the breaking points and where it breaks — each a :class:`Table`
the markdown and the HTML page both render."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from qbench.eval.gguf import block_quantised
from qbench.eval.sampling import sample_text
from qbench.eval.tolerance import (
    interval_text,
    metric_heading,
    number_text,
    row_interval,
    tolerance_text,
    value_text,
)
from qbench.studies.card.render.formats import format_table, llama_cpp_table, mixed_plan_table
from qbench.studies.card.render.kv import kv_table
from qbench.studies.card.render.table import Column, Figure, Record, Table, text_columns
from qbench.studies.card.units import fixed, mb_text, num, pct, share_text


def page_sections(card: Mapping[str, Any], i: int) -> list[Table[Any]]:
    """Model ``i``'s tables: the one source both renderers format."""
    m = card["models"][i]
    metric, tolerance = card.get("metric") or "ppl", card["tolerance_pct"]
    limit = tolerance_text(tolerance, metric)
    out: list[Table[Any]] = [
        identity_table(m),
        outlier_table(m, i),
        linear_table(m),
        attention_table(m, i),
        format_table(m, i, limit, metric, tolerance),
        *([llama_cpp_table(m, i, limit, metric, tolerance)] if m.get("llama_cpp") else []),
        *([mixed_plan_table(m, i)] if (m.get("mixed_plan") or {}).get("plans") else []),
        kv_table(m, i, limit, metric, tolerance),
        Table(
            "Breaking points",
            [
                Column("family", lambda b: b["family"]),
                Column("axis", lambda b: b["axis"]),
                Column("breaking point", lambda b: b["text"]),
                _curve_column(metric, tolerance),
            ],
            m["breaking_points"],
            f"Lowest width within {limit} there and at every wider width.",
        ),
    ]
    if m["sensitivity"]:
        out.append(sensitivity_table(m["sensitivity"], metric))
    return out


def _curve_text(b: Record) -> str:
    return "  ".join(f"{k}:{pct(v['ppl_change_pct'])}" for k, v in b["curve"].items())


def _curve_column(metric: str, tolerance: float) -> Column[Record]:
    """A breaking point's curve: each width's change; on kld or top1 the value of that metric the width's verdict
    read (``curve (bits:KLD (nats))``; "-" where a curve point holds none)."""
    if metric == "ppl":
        return Column("curve (bits:change)", _curve_text)

    def point(v: Record) -> str:
        value = row_interval(v, metric)[0]
        if value is None:
            return "NaN" if v.get("status") == "nonfinite" else "-"
        return number_text(value, metric, tolerance)

    def text(b: Record) -> str:
        return "  ".join(f"{k}:{point(v)}" for k, v in b["curve"].items())

    return Column(f"curve (bits:{metric_heading(metric)})", text)


def gate_text(gate: str | None) -> str:
    return f", {gate} output gate" if gate not in (None, "none") else ""


def identity_table(m: Mapping[str, Any]) -> Table[list[str]]:
    ident, p = m["identity"], m["protocol"]
    rows = [
        ["model", m["name"]],
        ["source", str(m["source"])],
        ["kind", num(ident.get("kind"))],
        ["parameters", num(ident.get("parameters"), ",")],
        [
            "layers × heads × width",
            f"{num(ident.get('layers'))} × {num(ident.get('heads'))} × {num(ident.get('d_model'))}",
        ],
        ["attention", num(ident.get("attention")) + gate_text(ident.get("gate"))],
        ["norm", f"{num(ident.get('norm'))} ({num(ident.get('norm_position'))})"],
        ["positions", num(ident.get("positions"))],
        ["tied LM head", num(ident.get("tied_head"))],
        ["sliding window", num(ident.get("sliding_window"))],
        ["context", num(ident.get("context"), ",")],
        ["corpus", f"{p['corpus']}/{p['split']}: " + (p.get("corpus_description") or "-")],
        ["tokens scored", f"{p['tokens_scored']:,} (budget {p['tokens']:,})"],
        ["window", f"{p['window']} ({p['windows']} windows)"],
        *([["windows from", sample_text(p).split(" drawn ", 1)[-1]]] if "sampled" in p else []),
        [
            "statistics on",
            f"{p['statistics_windows']} window(s), {p['statistics_tokens']:,} tokens"
            if p.get("statistics_windows")
            else "-",
        ],
        ["start token", p["start_token"]],
        ["dtype, seed", f"{p.get('dtype')}, {p.get('seed')}"],
        ["float perplexity", num(m["fp"]["perplexity"], ".4f")],
        ["fingerprint", str(ident.get("fingerprint"))[:16]],
    ]
    if ident.get("gguf"):
        rows.append(["GGUF tensors", _gguf_text(ident["gguf"])])
    return Table("Identity and protocol", text_columns(["what", "value"]), rows)


def _gguf_text(gguf: Mapping[str, Any]) -> str:
    """The GGUF file's tensor types, and why its dequantised weights are not a float source."""
    types = ", ".join(f"{k} {v}" for k, v in (gguf.get("tensor_types") or {}).items())
    note = "every cell quantises these dequantised weights again"
    if block_quantised(gguf):
        # Measured on SmolLM2's Q4_1 file: every linear weight has ≤ 16 distinct values per 32-weight block.
        # Round-to-nearest in that basis with aligned groups nearly reproduces the grid; a rotation cannot.
        note += (
            "; the block-quantised tensors' values already lie on their GGUF grid (Q4_1: at most 16 values"
            " per block of 32 weights), which flatters formats whose groups align with those blocks and"
            " penalises rotations (Hadamard, QuaRot): judge rotations on a float source"
        )
    return f"{types} ({note})"


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


def _site(s: Mapping[str, Any]) -> str:
    """A massive activation's site: the window it was found in (records' window order), position and token."""
    where = f"{s['window']}/{s['position']}" if s.get("window") is not None else str(s["position"])
    return f"{where}:{s['token']!r}"


def outlier_table(m: Mapping[str, Any], i: int) -> Table[Record]:
    o, first = m["outliers"]["summary"], _first_label(m)
    start = (
        f"{first}: position 0, the start token that opens every window — the same token each time, so one "
        "token's statistics, not an average over tokens; κ other: positions ≥ 1"
        if m["protocol"].get("bos", True)
        else "κ first: position 0; κ other: positions ≥ 1"
    )
    columns: list[Column[Record]] = [
        Column("block", lambda x: str(x["layer"])),
        Column(first, lambda x: num(x["kurtosis_first"])),
        Column("κ other", lambda x: num(x["kurtosis_other"])),
        Column("max |act|", lambda x: num(x["max_abs"])),
        Column("massive", lambda x: str(x["massive_count"])),
        Column("channels", lambda x: ", ".join(map(str, x["massive_channels"][:8])) or "-"),
        Column(
            "sites (window/position:token)", lambda x: ", ".join(map(_site, x["massive_sites"][:4])) or "-"
        ),
    ]
    caption = (
        f"Raw kurtosis across channels of each block's output ({start}). Summary: {first} "
        f"{num(o['kurtosis_first'])}, κ other {num(o['kurtosis_other'])}, max |act| {num(o['max_abs'])}, "
        f"massive activations {num(o['massive_total'])} (Sun et al.: |x| > 100 and > 1000 × the layer's "
        f"median), worst linear input crest {num(o['max_input_crest'])}. {_stat_scope(m)}"
    )
    figure = Figure(f"outliers-{i}", "outlier profile", f"{m['name']}: outlier profile per layer")
    return Table("Outlier profile per layer", columns, m["outliers"]["layers"], caption, figure=figure)


def linear_table(m: Mapping[str, Any]) -> Table[Record]:
    worst = m["outliers"]["linear_worst"]
    rows = [x for x in m["outliers"]["linear"] if x["name"] in worst]
    columns: list[Column[Record]] = [
        Column("layer", lambda x: f"`{x['name']}`"),
        Column("input crest", lambda x: num(x["input_crest"])),
        Column("input κ", lambda x: num(x["input_kurtosis"])),
        Column("max |input|", lambda x: num(x["input_absmax"])),
        Column("weight crest", lambda x: num(x["weight_crest"])),
    ]
    caption = (
        f"The {len(rows)} linear layers with the largest input crest factor (all of them in card.json); "
        "every token of the window counted, the start token included. " + _stat_scope(m)
    )
    return Table("Linear layers' inputs", columns, rows, caption)


def attention_table(m: Mapping[str, Any], i: int) -> Table[int]:
    """A row per layer, a column per head: first-token top-1 share / mean weight on key 0."""
    att, o = m["attention"], m["outliers"]["summary"]
    share, mass = att["top1_share"], att["mass"]
    heads = max((len(r) for r in share), default=0)

    def cell(layer: int, h: int) -> str:
        # layers may differ in head count (OpenELM-style models): a layer without head h shows "-"
        if h >= len(share[layer]):
            return "-"
        return f"{fixed(share[layer][h], 2)} / {fixed(mass[layer][h], 2)}"

    def head(h: int) -> Column[int]:
        return Column(f"head {h}", lambda layer: cell(layer, h))

    caption = (
        f"Each cell: first-token top-1 share / mean weight on key 0, over queries q ≥ 1. All heads: top-1 share "
        f"{share_text(o['first_token_top1_share'])}, mean weight {num(o['first_token_mass'])}"
        + _sink_text(m["outliers"])
        + f". {_stat_scope(m)}"
    )
    figure = Figure(f"attention-{i}", "attention sink", f"{m['name']}: attention sink per layer and head")
    columns: list[Column[int]] = [Column("layer", str), *(head(h) for h in range(heads))]
    return Table("Attention sink per layer and head", columns, range(len(share)), caption, figure=figure)


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
    share = "< 1%" if heads and heads < 0.005 else share_text(heads or 0, 0)
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


def sensitivity_table(s: Mapping[str, Any], metric: str = "ppl") -> Table[Record]:
    """Where it breaks: each unit quantised alone, and the repair that keeps the worst in float (on a card decided
    on kld or top1, that metric's values before and after first, where the repair holds them)."""
    columns: list[Column[Record]] = [
        Column("unit", lambda u: f"`{u['name']}`"),
        Column("change alone", lambda u: pct(u["ppl_change_pct"])),
        Column("input crest", lambda u: num(u["input_crest"])),
        Column("input κ", lambda u: num(u["input_kurtosis"])),
        Column("max |input|", lambda u: num(u["max_abs"])),
        Column("weight crest", lambda u: num(u["weight_crest"])),
    ]
    r = s["repair"]
    size = f", {mb_text(r['weight_bytes'])}" if r.get("weight_bytes") else ""
    pays = (
        f"; {'pays: smaller than' if r.get('pays') else 'does not pay: not smaller than'} "
        f"{r['beat']['what']} ({mb_text(r['beat']['bytes'])})"
        if (r.get("beat") or {}).get("bytes") and r["reached"]
        else ""
    )
    change = f"{pct(r['quantised_ppl_change_pct'])} → {pct(r['ppl_change_pct'])} (perplexity {num(r['ppl'], '.4f')})"
    if metric != "ppl" and r.get("decision"):
        tolerance = r["tolerance_pct"]
        before = value_text(
            row_interval({"decision": r.get("quantised_decision")}, metric)[0], metric, tolerance
        )
        after = interval_text(*row_interval(r, metric), metric, tolerance)
        change = f"{before} → {after} (perplexity change {change})"
    caption = (
        f"Each unit quantised alone, the rest float; the {len(s['top'])} most damaging of {s['units']}. "
        f"Repair: keep {r['count']} unit(s) in float ({share_text(r['weight_share_float'])} of the quantised "
        f"weights): {change}{size}{pays}. The command is in the verdict's commands."
    )
    return Table(f"Where it breaks: `{s['scheme']}` by {s['by']}", columns, s["top"], caption)
