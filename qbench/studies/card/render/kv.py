"""The KV-cache table: float weights, the cache quantised scheme by scheme, and a caption that says how each
scheme took its statistics, the window the rows were read on, the cache's size and the rows not measured."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from qbench.studies.card.render.formats import deciding_columns, kld, perplexity, top1
from qbench.studies.card.render.table import Column, Record, Table
from qbench.studies.card.units import SIZE_UNIT, mb, mb_text, share_text


def _float_reads(row: Record) -> str:
    reads = row.get("float_reads")
    return "-" if not reads else f"{share_text(reads['keys'], 0)} / {share_text(reads['values'], 0)}"


def _always(row: Record) -> bool:
    return True


def kv_columns(
    memory: Mapping[str, Any] | None, limit: str, metric: str = "ppl", tolerance: float | None = None
) -> list[Column[Record]]:
    """The KV rows' columns; ``memory`` (the bf16 cache at the model's context) is what "of bf16 cache" divides
    by. The perplexity and the change (on kld or top1 also that metric's value: ``deciding_columns``) are the
    verdict's inputs: the HTML keys them."""
    bf16 = (memory or {}).get("bf16_bytes")

    def of_bf16(r: Record) -> str:
        return share_text(r["cache_bytes"] / bf16 if r.get("cache_bytes") and bf16 else None)

    return [
        Column("scheme", lambda r: r.get("scheme_name") or str(r.get("scheme"))),
        Column("bits", lambda r: str(r["bits"])),
        Column("sinks kept", lambda r: str(r["keep_sinks"])),
        Column("label", lambda r: r["label"] or "-"),
        Column("ppl", perplexity, key="perplexity"),
        *deciding_columns(limit, metric, tolerance, when=_always),
        *([] if metric == "kld" else [Column("KLD", kld)]),  # on kld the deciding column shows it
        Column("top-1", top1),
        Column("float reads K / V", _float_reads),
        Column("cache (MB)", lambda r: mb(r.get("cache_bytes"))),
        Column("of bf16 cache", of_bf16),
    ]


def kv_table(
    m: Mapping[str, Any], i: int, limit: str, metric: str = "ppl", tolerance: float | None = None
) -> Table[Record]:
    kv = m["kv"]
    return Table(
        "KV cache",
        kv_columns(kv.get("memory"), limit, metric, tolerance),
        kv["rows"],
        kv_caption(kv),
        path=f"models.{i}.kv.rows",
    )


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


def kv_caption(kv: Mapping[str, Any]) -> str:
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
