"""The deployable-formats table, and the cells every measured row shares (a format, a KV row, the summary's
recommended format): its verdict, its change with the interval, its KLD and top-1."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from qbench.eval.tolerance import METRICS, interval_text, metric_heading, row_interval
from qbench.studies.card.render.table import Column, Record, Table
from qbench.studies.card.units import fixed, mb, num, pct, percent, ratio, share_text


def status_text(row: Record) -> str:
    """``✓`` within the tolerance, ``✗`` beyond, ``? undecided``; a row that did not run says why (its status)."""
    if row.get("status") == "ok":
        verdict = row.get("verdict") or ("within" if row.get("within_tolerance") else "beyond")
        return {"within": "✓", "beyond": "✗", "undecided": "? undecided"}[verdict]
    return row.get("status") or "-"


def verdict_class(row: Record) -> str:
    """The HTML class that colours a verdict cell."""
    return (
        "ok" if row.get("within_tolerance") else "undecided" if row.get("verdict") == "undecided" else "bad"
    )


def change_ci(row: Record, metric: str = "ppl", tolerance: float | None = None) -> str:
    """``+0.97 % [+0.41, +1.53]``: the change with its 95 % interval (``qbench.eval.evidence``) — on ``metric`` kld
    or top1 that metric's value and interval, the ones the verdict read, in a column headed by its name:
    ``0.0123 nats [0.0101, 0.0145]``, ``1.23 % [0.80, 1.66]`` (``qbench.eval.tolerance.interval_text``)."""
    if row.get("status") == "skipped":
        return "-"
    value, ci = row_interval(row, metric)
    text = interval_text(value, ci, metric, tolerance, named=False)
    if row.get("resolved"):  # --resolve re-evaluated it: the row is the last evaluation, on more tokens
        text += f" @ {row['resolved'][-1]['tokens_scored']:,} tokens"
    return text


def perplexity(row: Record) -> str:
    return num(row["perplexity"], ".4f")


def kld(row: Record) -> str:
    return fixed(row.get("kld_mean"), 4)


def top1(row: Record) -> str:
    return percent(row.get("top1_agreement"))


def ran(f: Record) -> bool:
    """Whether the model ran this format (a number, finite or not); unsupported, error and skipped rows did not."""
    return f.get("status") in ("ok", "nonfinite")


def _if_ran(text: Callable[[Record], str]) -> Callable[[Record], str]:
    """A cell only a format that ran has: a row the model could not run shows no perplexity and no kernel speed."""
    return lambda f: text(f) if ran(f) else "-"


def _excludes(f: Record) -> str:
    """`` †`` on a kernel ratio that leaves work out (a rotated row: its online rotations; the caption says)."""
    return " †" if f.get("speed_excludes") and f.get("decode_speedup") is not None else ""


def deciding_columns(
    limit: str, metric: str = "ppl", tolerance: float | None = None, when: Callable[[Record], bool] = ran
) -> list[Column[Record]]:
    """The columns a verdict is read from, shared by the format and KV tables: the change with its 95 % interval
    and the verdict. On kld or top1 the change alone, then that metric's interval (in its unit: what the verdict
    read), then the verdict; ``when``: whether a row has the numbers (else "-"). The HTML keys the change and
    the deciding value."""

    def shown(text: Callable[[Record], str]) -> Callable[[Record], str]:
        return lambda f: text(f) if when(f) else "-"

    verdict = Column(f"≤ {limit}", status_text, css=verdict_class)
    if metric == "ppl":
        return [Column("change [95 % CI]", shown(change_ci), key="ppl_change_pct", keyed=when), verdict]
    return [
        Column("change", shown(lambda f: pct(f.get("ppl_change_pct"))), key="ppl_change_pct", keyed=when),
        Column(
            f"{metric_heading(metric)} [95 % CI]",
            shown(lambda f: change_ci(f, metric, tolerance)),
            key="decision.value",
            keyed=lambda f: when(f) and bool(f.get("decision")),
        ),
        verdict,
    ]


def format_columns(
    m: Mapping[str, Any], limit: str, metric: str = "ppl", tolerance: float | None = None
) -> list[Column[Record]]:
    """One model's format columns; its nominal size shows whatever the row's status. The perplexity, the change
    (on kld or top1 also that metric's value) and the size are the verdict's inputs: the HTML keys them."""
    columns: list[Column[Record]] = [
        Column("format", lambda f: f"{f['label']} `{f['scheme']}`"),
        Column("quantised", lambda f: f.get("quantised") or "-"),
        Column("ppl", _if_ran(perplexity), key="perplexity", keyed=ran),
        *deciding_columns(limit, metric, tolerance),
        *([] if metric == "kld" else [Column("KLD", kld)]),  # on kld the deciding column shows it
        Column("top-1", top1),
        Column("size (MB)", lambda f: mb(f["weight_bytes"]), key="weight_bytes"),
        Column("rest fp32 (MB)", lambda f: mb(f.get("weight_bytes_rest_float"))),
        Column("of bf16", lambda f: share_text(f["bytes_vs_bf16"])),
        Column("+ bf16 KV (MB)", lambda f: mb(f.get("memory_bytes"))),
        Column("decode ×", _if_ran(lambda f: ratio(f.get("decode_speedup")) + _excludes(f))),
        Column("prefill ×", _if_ran(lambda f: ratio(f.get("prefill_speedup")) + _excludes(f))),
    ]
    if m["speed_measured"]:  # the whole model's prefill: the full budget only
        columns.append(Column("model prefill ×", _if_ran(lambda f: ratio(f["speedup"]))))
    return columns


def format_table(
    m: Mapping[str, Any], i: int, limit: str, metric: str = "ppl", tolerance: float | None = None
) -> Table[Record]:
    resolved = any(f.get("resolved") for f in m["formats"]) or any(r.get("resolved") for r in m["kv"]["rows"])
    notes = " ".join(f"{f['label']}: {f['note']}." for f in m["formats"] if f["note"])
    caption = (
        _format_caption(m, limit, metric)
        + (
            " @ N tokens: undecided at the card's tokens, re-evaluated at doubling tokens by --resolve "
            "(card.json's `resolved` lists each step)." + _resolve_rule(m)
            if resolved
            else ""
        )
        + (f" {notes}" if notes else "")
    )
    return Table(
        "Deployable formats",
        format_columns(m, limit, metric, tolerance),
        m["formats"],
        caption,
        path=f"models.{i}.formats",
    )


def llama_cpp_table(
    m: Mapping[str, Any], i: int, limit: str, metric: str = "ppl", tolerance: float | None = None
) -> Table[Record]:
    """llama.cpp's own file types, quantised and scored by llama.cpp on the same windows as the formats above."""
    rows = m["llama_cpp"]
    version = next((r.get("llama_cpp") for r in rows if r.get("llama_cpp")), None)
    columns: list[Column[Record]] = [
        Column("type", lambda r: f"{r['type']} `{r['scheme']}`"),
        Column("ppl", _if_ran(perplexity), key="perplexity", keyed=ran),
        *deciding_columns(limit, metric, tolerance),
        *([] if metric == "kld" else [Column("KLD", kld)]),
        Column("top-1", top1),
        Column("file (MB)", lambda r: mb(r.get("bytes")), key="bytes", keyed=lambda r: bool(r.get("bytes"))),
        Column("bits/weight", lambda r: fixed(r.get("bits_per_weight"), 2)),
        Column("tokens/s", _if_ran(lambda r: num(r.get("tokens_per_second"), ".0f"))),
    ]
    caption = (
        "The float model written as a GGUF, quantised by llama.cpp's own quantiser to each file type (llama.cpp "
        "picks each tensor's type: the record's `artifact.tensor_types`) and run by llama.cpp"
        + (f" ({version})" if version else "")
        + " on the same windows, paired with the float model like every format above. File: the GGUF's bytes "
        "(token ids only, no vocabulary); bits/weight: file bits over the model's parameters, as llama.cpp's "
        "quantize tool counts; tokens/s: the cell's evaluation through llama.cpp (float32 KV cache)."
    )
    return Table("llama.cpp's file types", columns, rows, caption, path=f"models.{i}.llama_cpp")


def mixed_plan_table(m: Mapping[str, Any], i: int) -> Table[Record]:
    """``qbench plan`` at the smallest passing llama.cpp type's size and 10 % below: promised against measured."""
    section = m["mixed_plan"]

    def types(p: Record) -> str:
        return ", ".join(f"{k} {v}" for k, v in (p.get("plan") or {}).items()) or (p.get("error") or "-")

    def against(p: Record) -> str:
        if not p.get("nearest"):
            return "-"
        ci = p.get("vs_nearest_ci95")
        interval = f" [{ci[0]:+.2f}, {ci[1]:+.2f}] %" if ci else ""
        return f"{p['nearest']}: {p.get('vs_nearest') or '-'}{interval}"

    columns: list[Column[Record]] = [
        Column("budget", lambda p: f"{p['budget']} ({mb(p['budget_bytes'])} MB)"),
        Column("types", types),
        Column("file (MB)", lambda p: mb(p.get("bytes")), key="bytes", keyed=lambda p: bool(p.get("bytes"))),
        Column("KLD promised", lambda p: num(p.get("promised_kld"), ".4g")),
        Column(
            "KLD measured",
            lambda p: num(p.get("kld_mean"), ".4g"),
            key="kld_mean",
            keyed=lambda p: p.get("kld_mean") is not None,
        ),
        Column(
            "change [95 % CI]",
            lambda p: (
                interval_text(p.get("ppl_change_pct"), p.get("ppl_change_ci95"), "ppl", None, named=False)
                if p.get("ppl_change_pct") is not None
                else "-"
            ),
        ),
        Column("top-1", top1),
        Column("vs the uniform type at or above its size", against),
    ]
    caption = (
        "`qbench plan` (docs/schemes.md): each kind of tensor's damage per ggml type measured alone through "
        "llama.cpp, the least summed damage that fits the budget (the promise), then the plan itself measured; "
        "paired per token against the nearest llama.cpp file type at or above its size (the plan's perplexity "
        f"over the type's − 1). Its cells are the card's records; plan.json, its table and the GGUFs: "
        f"`{section.get('output')}`."
    )
    return Table(
        "Mixed-precision plan", columns, section["plans"], caption, path=f"models.{i}.mixed_plan.plans"
    )


def _resolve_rule(m: Mapping[str, Any]) -> str:
    """The rule --resolve's looks were decided by, from the rows' steps (nothing for a card from before the rule,
    whose steps hold no alpha: its page reads as it did)."""
    from qbench.studies.resolve import rule_text

    rows = [*m["formats"], *m["kv"]["rows"]]
    rule = rule_text([s for r in rows for s in r.get("resolved") or []])
    if not rule:
        return ""
    return (
        f" {rule[0].upper()}{rule[1:]}; the interval shown is the 95 % one, the verdict the last look's (card.json's "
        "steps hold each look's `sequential`: its alpha and interval)."
    )


def _speed_caption(m: Mapping[str, Any]) -> str:
    kernels = m.get("kernels")
    if not kernels:
        return " Speed: no format of this card has a real kernel here."
    return (
        f" decode × / prefill ×: the model's linear layers alone on its own shapes, real kernels ({kernels.get('native_isa') or 'torch'}) "
        f"against float32 F.linear, {kernels.get('threads', 1)} thread, {kernels.get('cpu')}: one row through "
        "enough copies of each layer that the weights come from memory as in a decode step, and "
        f"{kernels.get('prefill_tokens')} rows; - where the format has no real kernel here (fake quantisation "
        "only). Attention, norms and Python between the kernels are not in these ratios (`qbench speed` times "
        "generation); † a rotated row (QuaRot, Hadamard): the same kernels as its unrotated format, its online "
        "rotations not timed."
    )


def _clusters(p: Mapping[str, Any]) -> str:
    """The interval's clusters: with two windows it has one degree of freedom, and a reader should see why it
    is wide."""
    n = p.get("windows")
    sampled = p.get("sampled") or {}
    if sampled.get("documents"):  # the documents sample: its documents are the clusters
        g = sampled["documents"]
        return (
            f"paired over {n} windows of {p['window']:,} tokens from {g} documents, the documents as clusters"
            + (f", t with {g - 1} degree(s) of freedom: wide" if g <= 3 else "")
        )
    if not (isinstance(n, int) and n > 1 and p.get("window")):
        return "paired, windows as clusters"
    return f"paired over the {n} scored windows of {p['window']:,} tokens as clusters" + (
        f", t with {n - 1} degree(s) of freedom: wide" if n <= 3 else ""
    )


def verdict_caption(m: Mapping[str, Any], limit: str, metric: str = "ppl") -> str:
    """What the change and the verdict columns show (:func:`deciding_columns`)."""
    rule = (
        f"✓ within {limit} (the interval's upper end ≤ it), ✗ beyond (its lower end above), ? undecided (it "
        "straddles the tolerance: more tokens would decide)"
    )
    clusters = _clusters(m.get("protocol") or {})
    if metric == "ppl":
        return f"Change: perplexity change with its 95 % interval ({clusters}); {rule}."
    name, unit, _ = METRICS[metric]
    return (
        f"Change: perplexity change. {metric_heading(metric)} [95 % CI]: the verdict's metric, the {name} "
        f"({unit}), with its 95 % interval ({clusters}); {rule}."
    )


def _format_caption(m: Mapping[str, Any], limit: str, metric: str = "ppl") -> str:
    memory = m["kv"].get("memory")
    plus_kv = (
        f" + bf16 KV: the size plus the KV cache in bf16 at the model's context ({memory['context']:,} tokens, "
        "one sequence)."
        if memory
        else ""
    )
    return (
        "Fake quantisation at each format's standard settings; quantised: what each row quantised (W: weights, "
        "A: the activations entering each linear, O: outputs) and how the weights were rounded (RTN: "
        f"round-to-nearest). {verdict_caption(m, limit, metric)} KLD: mean KL divergence from the float model per "
        "token (nats); top-1: tokens whose most likely next token is the float model's (llama.cpp's definitions, "
        "docs/metrics.md). Size: the model as deployed, MB = 10⁶ bytes: the quantised weights at their bits with "
        "their scales and zero points, every other tensor (embeddings, norms, an unquantised head) in bf16; rest "
        "fp32: the same with those tensors in float32; of bf16: the size's ratio to the whole model in bf16."
        + plus_kv
        + _speed_caption(m)
        + (
            " model prefill ×: the whole model's real-kernel prefill of 512 tokens (full budget)."
            if m["speed_measured"]
            else ""
        )
    )
