"""The card's sections as tables and captions, from card.json alone, shared by the markdown and the HTML page."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from qbench.eval.evidence import tolerance_text
from qbench.eval.gguf import block_quantised
from qbench.studies.card.render.figures import gate_text
from qbench.studies.card.units import SIZE_UNIT, mb, mb_text, num, pct, share_text, signed


def status_text(row: Mapping[str, Any]) -> str:
    if row.get("status") == "ok":
        verdict = row.get("verdict") or ("within" if row.get("within_tolerance") else "beyond")
        return {"within": "✓", "beyond": "✗", "undecided": "? undecided"}[verdict]
    return row.get("status") or "-"


def change_ci(row: Mapping[str, Any]) -> str:
    """``+0.97 % [+0.41, +1.53]``: the change with its 95 % interval (``qbench.eval.evidence``)."""
    if row.get("status") == "skipped":
        return "-"
    text = pct(row.get("ppl_change_pct"))
    ci = row.get("ppl_change_ci95")
    text = (
        f"{text} [{signed(ci[0])}, {signed(ci[1])}]" if ci and row.get("ppl_change_pct") is not None else text
    )
    if row.get("resolved"):  # --resolve re-evaluated it: the row is the last evaluation, on more tokens
        text += f" @ {row['resolved'][-1]['tokens_scored']:,} tokens"
    return text


def verdict_class(row: Mapping[str, Any]) -> str:
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
        f"the same cache in bf16 ({mb_text(memory['bf16_bytes'])})."
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


def ran_text(f: Mapping[str, Any]) -> bool:
    """Whether the model ran this format (a number, finite or not); unsupported, error and skipped rows did not."""
    return f.get("status") in ("ok", "nonfinite")


def format_cells(f: Mapping[str, Any], m: Mapping[str, Any]) -> list[str]:
    """One format row as text (markdown; the HTML wraps its key numbers in data-key spans). A row the model could
    not run (unsupported, error, skipped) shows no perplexity and no kernel speed: only its nominal size."""
    ran = ran_text(f)
    return [
        f"{f['label']} `{f['scheme']}`",
        f.get("quantised") or "-",
        num(f["perplexity"], ".4f") if ran else "-",
        change_ci(f) if ran else "-",
        status_text(f),
        _kld(f),
        _top1(f),
        mb(f["weight_bytes"]),
        mb(f.get("weight_bytes_rest_float")),
        share_text(f["bytes_vs_bf16"]),
        mb(f.get("memory_bytes")),
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


def kv_cells(r: Mapping[str, Any], memory: Mapping[str, Any] | None) -> list[str]:
    bf16 = (memory or {}).get("bf16_bytes")
    share = r["cache_bytes"] / bf16 if r.get("cache_bytes") and bf16 else None
    return [
        r.get("scheme_name") or str(r.get("scheme")),
        str(r["bits"]),
        str(r["keep_sinks"]),
        r["label"] or "-",
        num(r["perplexity"], ".4f"),
        change_ci(r),
        status_text(r),
        _kld(r),
        _top1(r),
        _float_reads(r),
        mb(r.get("cache_bytes")),
        share_text(share),
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


def page_sections(
    card: Mapping[str, Any], m: Mapping[str, Any]
) -> list[tuple[str, list[str], list[list[str]], str]]:
    """(title, headers, rows, caption) of one model's tables: the one source both renderers format."""
    limit = tolerance_text(card["tolerance_pct"], card.get("metric") or "ppl")
    ident, p = m["identity"], m["protocol"]
    identity = [
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
            num(x["kurtosis_first"]),
            num(x["kurtosis_other"]),
            num(x["max_abs"]),
            str(x["massive_count"]),
            ", ".join(map(str, x["massive_channels"][:8])) or "-",
            ", ".join(_site(s) for s in x["massive_sites"][:4]) or "-",
        ]
        for x in m["outliers"]["layers"]
    ]
    linear_rows = [
        [
            f"`{x['name']}`",
            num(x["input_crest"]),
            num(x["input_kurtosis"]),
            num(x["input_absmax"]),
            num(x["weight_crest"]),
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
            "  ".join(f"{k}:{pct(v['ppl_change_pct'])}" for k, v in b["curve"].items()),
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
            f"{num(o['kurtosis_first'])}, κ other {num(o['kurtosis_other'])}, max |act| {num(o['max_abs'])}, "
            f"massive activations {num(o['massive_total'])} (Sun et al.: |x| > 100 and > 1000 × the layer's "
            f"median), worst linear input crest {num(o['max_input_crest'])}. {_stat_scope(m)}",
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
            f"{share_text(o['first_token_top1_share'])}, mean weight {num(o['first_token_mass'])}"
            + _sink_text(m["outliers"])
            + f". {_stat_scope(m)}",
        ),
        (
            "Deployable formats",
            _format_headers(m, limit),
            [format_cells(f, m) for f in m["formats"]],
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
            [kv_cells(r, memory) for r in m["kv"]["rows"]],
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
                pct(u["ppl_change_pct"]),
                num(u["input_crest"]),
                num(u["input_kurtosis"]),
                num(u["max_abs"]),
                num(u["weight_crest"]),
            ]
            for u in s["top"]
        ]
        r = s["repair"]
        size = f", {mb_text(r['weight_bytes'])}" if r.get("weight_bytes") else ""
        out.append(
            (
                f"Where it breaks: `{s['scheme']}` by {s['by']}",
                ["unit", "change alone", "input crest", "input κ", "max |input|", "weight crest"],
                unit_rows,
                f"Each unit quantised alone, the rest float; the {len(unit_rows)} most damaging of {s['units']}. "
                f"Repair: keep {r['count']} unit(s) in float ({share_text(r['weight_share_float'])} of the quantised "
                f"weights): {pct(r['quantised_ppl_change_pct'])} → {pct(r['ppl_change_pct'])} (perplexity "
                f"{num(r['ppl'], '.4f')}){size}"
                + (
                    f"; {'pays: smaller than' if r.get('pays') else 'does not pay: not smaller than'} "
                    f"{r['beat']['what']} ({mb_text(r['beat']['bytes'])})"
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


def summary_rows(card: Mapping[str, Any]) -> list[dict[str, str]]:
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
                "float ppl": num(m["fp"]["perplexity"], ".4g"),
                "recommended": f"{rec['label']} `{rec['scheme']}`" if rec else "none within the tolerance",
                "size": (
                    f"{mb_text(rec['weight_bytes'])} ({share_text(rec['bytes_vs_bf16'])} of bf16)"
                    if rec
                    else "-"
                ),
                "change [95 % CI]": change_ci(found) if found else "-",
                "verdict": status_text(found) if found else f"{len(v.get('undecided') or [])} undecided",
                "avoid": (
                    f"{len(avoid)}: worst {avoid[0]['label']} ({pct(avoid[0]['ppl_change_pct'])})"
                    if avoid
                    else "-"
                ),
                "repair": (
                    "-"
                    if not repair
                    else f"`{repair['scheme']}` {pct(repair['ppl_change_pct'])}, {mb_text(repair.get('weight_bytes'))}"
                    + (" (pays)" if repair.get("pays") else " (does not pay)")
                ),
            }
        )
    return rows


def command_rows(card: Mapping[str, Any]) -> list[tuple[str, str]]:
    """(what, command) pairs: the card's own command and each model's verdict commands."""
    out = []
    if card.get("command"):
        out.append(("this card", card["command"]))
    for m in card["models"]:
        for c in m["verdict"].get("commands") or []:
            out.append((f"{m['name']}: {c['what']}", c["command"]))
    return out


COMPARISON_CAPTION = (
    "More robust: the model whose change is decidedly smaller (its 95 % interval wholly below the others'); for "
    "a breaking point the lower one; for an outlier statistic (no interval) the one at most half the others'. "
    "Better to ship: the model whose quantised perplexity is decidedly lower than every other model's quantised "
    "one — paired over the same windows, whatever each lost to quantisation; each cell also names the models whose "
    "*float* perplexity it is decidedly below. KV rows give the quantised perplexity at the KV section's window "
    "(its change against the float model at that window). - : the measurement does not tell them apart."
)


def ship_text(c: Mapping[str, Any]) -> str:
    """The comparison's absolute verdict: decided for format and float rows only."""
    return (c.get("better_to_ship") or "-") if c["section"] in ("float", "formats") else ""


def comparison_cell(c: Mapping[str, Any], name: str) -> str:
    v = c["values"].get(name)
    if isinstance(v, str) and c["section"] == "kv":  # a row that model could not measure: "skipped"
        return v
    if c["section"] == "kv" and name in c.get("missing", ()):  # a row that model's card did not run
        return "-"
    if c["section"] == "float":
        return "-" if v is None else f"ppl {v:.2f}"
    if c["section"] == "formats" and (c.get("perplexity") or {}).get(name) is not None:
        text = f"{pct(v)} (ppl {c['perplexity'][name]:.2f})"  # relative damage and absolute quality
        below = (c.get("below_others_float") or {}).get(name)
        return text + (f", below {', '.join(below)} in float" if below else "")
    if c["section"] == "kv" and (c.get("perplexity") or {}).get(name) is not None:
        return f"{pct(v)} (ppl {c['perplexity'][name]:.2f})"  # at the KV window (its own float baseline)
    if c["section"] in ("formats", "kv"):
        return pct(v)
    if c["section"] == "breaking points":
        return "-" if v is None else str(v)
    if c["row"] == "1st-token top-1":
        return share_text(v)
    return num(v)


def _site(s: Mapping[str, Any]) -> str:
    """A massive activation's site: the window it was found in (records' window order), position and token."""
    where = f"{s['window']}/{s['position']}" if s.get("window") is not None else str(s["position"])
    return f"{where}:{s['token']!r}"


def definition_rows(card: Mapping[str, Any]) -> list[list[str]]:
    return [
        [f"`{k}` ({v['label']})", v["unit"] or "–", v["better"], v["definition"]]
        for k, v in card["metrics"].items()
    ]
