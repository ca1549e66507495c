"""The card's rows as card.json holds them: a row per format record (its change, verdict, sizes and speed), the KV
section (a row per KV record, each scheme once, a breaking point per curve) and the breaking points (the sweep's and
the KV curves'). Each row names the record it was read from."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from qbench.studies.card.config import KV_INPUTS
from qbench.studies.card.plan import (
    FORMAT_BY_SCHEME,
    FORMATS,
    KV_MIN_WINDOW,
    Format,
    canonical_scheme,
    rtn_scheme,
)
from qbench.studies.card.sizes import deployed_bytes, float_size
from qbench.studies.card.words import quantised_text


def record_ref(record: Mapping[str, Any], paths: Mapping[str, str] | None) -> str | None:
    """Where ``record`` is stored, relative to the output path (``run_card`` collects them)."""
    return (paths or {}).get(record.get("cell_id") or "")


def measured_change(record: Mapping[str, Any]) -> float | None:
    """A record's perplexity change in percent; None when it has no finite one (NaN/inf, unsupported, skipped)."""
    return record["metrics"]["ppl_change_pct"] if record.get("status") == "ok" else None


def format_row(
    record: Mapping[str, Any],
    fp: Mapping[str, Any],
    profile: Mapping[str, Any],
    tolerance: float,
    speed: Mapping[str, Any] | None,
    out: Mapping[str, str] | None,
    metric: str = "ppl",
    resolved: Mapping[str, Any] | None = None,
    layer_speed: Mapping[str, Any] | None = None,
    kv_bf16_bytes: int | None = None,
) -> dict[str, Any]:
    """A format record's row: what it quantised, its change and verdict on ``metric`` at ``tolerance``, its sizes
    as deployed, its speed (``speed``: the whole model's, ``layer_speed``: the linear layers' real kernels) and
    the record behind it."""
    from qbench.eval.evidence import row_fields

    nominal = deployed_bytes(record["scheme"], fp, profile)
    held = deployed_bytes(record["scheme"], fp, profile, rest_size=None)  # the rest as evaluated
    fp_bytes = fp.get("model_bytes") or 0
    bf16_model = fp_bytes * 2 // float_size(fp) if fp_bytes else None

    scheme = record["scheme"]
    name = scheme["name"]
    fmt = FORMAT_BY_SCHEME.get(name) or next(
        (f for f in FORMATS if canonical_scheme(f.scheme) == name), Format(name, name)
    )
    change = measured_change(record)
    speedup = _model_speedup(speed, name)
    kernels = ((layer_speed or {}).get("schemes") or {}).get(rtn_scheme(name)) or {}
    return {
        "label": fmt.label,
        "scheme": name,
        "scheme_label": scheme.get("label"),
        "quantised": quantised_text(scheme) if scheme.get("weight_bits") is not None else None,
        "note": fmt.note,
        "status": record.get("status"),
        "error": record.get("error"),
        "perplexity": record["metrics"]["perplexity"],
        "ppl_change_pct": change,
        **row_fields(record, tolerance, metric),
        **_resolved_fields(record, resolved),
        # as deployed: the quantised weights with their scales, every other tensor in bf16 (docs/card.md)
        "weight_bytes": nominal,
        "weight_bytes_rest_float": held,  # the same with the other tensors at the evaluated float width
        "bf16_model_bytes": bf16_model,
        "bytes_vs_bf16": nominal / bf16_model if nominal and bf16_model else None,
        # weights as deployed plus a bf16 KV cache at the model's context (kv_memory)
        "memory_bytes": nominal + kv_bf16_bytes if nominal and kv_bf16_bytes else None,
        "weight_bits": scheme.get("weight_bits"),
        "speedup": speedup,
        # the model's linear layers alone on its own shapes (qbench.studies.layerspeed), real kernels vs float32
        "decode_speedup": kernels.get("decode"),
        "prefill_speedup": kernels.get("prefill"),
        # a rotated row runs the plain format's kernels plus online rotations that layer_speed does not time
        "speed_excludes": "online rotations"
        if scheme.get("rotate") == "quarot" or scheme.get("method") == "hadamard"
        else None,
        "record": record_ref(record, out),
        "cell_id": record.get("cell_id"),
    }


def llama_cpp_row(
    record: Mapping[str, Any], tolerance: float, out: Mapping[str, str] | None, metric: str = "ppl"
) -> dict[str, Any]:
    """A llama.cpp file type's row (a ``gguf:<type>`` record): its change and verdict on ``metric`` as a format's,
    its file as llama.cpp wrote it (bytes, bits per weight over the model's parameters, tensor types), the tokens
    per second of its evaluation through llama.cpp, and the record behind it."""
    from qbench.eval.evidence import row_fields

    art = record.get("artifact") or {}
    return {
        "type": (record["scheme"].get("params") or {}).get("type") or record["scheme"]["name"],
        "scheme": record["scheme"]["name"],
        "error": record.get("error"),
        "perplexity": record["metrics"]["perplexity"],
        "ppl_change_pct": measured_change(record),
        "status": record.get("status"),
        **row_fields(record, tolerance, metric),
        **_resolved_fields(record, None),
        "bytes": art.get("bytes"),
        "bits_per_weight": art.get("bits_per_weight"),
        "tensor_types": art.get("tensor_types"),
        "llama_cpp": art.get("llama_cpp"),
        "tokens_per_second": record.get("tokens_per_second"),
        "record": record_ref(record, out),
        "cell_id": record.get("cell_id"),
    }


def _model_speedup(speed: Mapping[str, Any] | None, scheme: str) -> float | None:
    """The whole model's speedup in ``scheme`` with its real kernels (the full budget's speed record), if measured."""
    if not speed:
        return None
    return next(
        (
            r.get("speedup")
            for r in speed.get("records", [])
            if r.get("kind") == "model"
            and r.get("scheme") is not None
            and canonical_scheme(r["scheme"]) == scheme
            and r.get("mode") == "real"
            and not r.get("error")
        ),
        None,
    )


def _resolved_fields(record: Mapping[str, Any], resolved: Mapping[str, Any] | None) -> dict[str, Any]:
    """A row's tokens and, when ``--resolve`` re-evaluated it, the steps (verdict per token budget) it took."""
    steps = (resolved or {}).get(record.get("cell_id") or "")
    return {"tokens_scored": (record.get("protocol") or {}).get("tokens_scored"), "resolved": steps or None}


KV_SCHEME_NAMES = {"kivi": "KIVI", "per-token": "per-token", "fp8-e4m3": "FP8 E4M3", "fp8-e5m2": "FP8 E5M2"}


def kv_axis(scheme: str, keep_sinks: int) -> str:
    """A KV curve's name in the breaking points: ``kv kivi``, ``kv kivi +1 sink``, ``kv per-token``."""
    return f"kv {scheme}" + (f" +{keep_sinks} sink{'s' if keep_sinks > 1 else ''}" if keep_sinks else "")


def kv_section(
    kv: Sequence[Mapping[str, Any]],
    tolerance: float,
    out: Mapping[str, str] | None,
    metric: str = "ppl",
    resolved: Mapping[str, Any] | None = None,
    window: Mapping[str, Any] | None = None,
    memory: Mapping[str, Any] | None = None,
) -> dict[str, Any]:
    """The KV section: one row per KV record (every scheme of the budget side by side), each scheme's description
    once, a breaking point per (scheme, sinks kept) curve of two or more widths, and the window the rows were read
    at (``window``: run_card's ``kv_window``). ``memory``: ``kv_memory``'s bytes per row label."""
    cache = (memory or {}).get("rows", {})
    rows = [_kv_row(r, tolerance, out, metric, resolved, cache) for r in kv]
    scored = next(((r.get("protocol") or {}).get("window") for r in kv if r.get("protocol")), None)
    w = dict(window or {})
    w.setdefault("window", scored)
    w["short"] = bool(w.get("window") and w["window"] < (w.get("minimum") or KV_MIN_WINDOW))
    return {
        "window": w,
        "memory": {k: v for k, v in (memory or {}).items() if k != "rows"} or None,
        "schemes": _kv_schemes(kv, rows),
        "rows": rows,
        "skipped": [
            {"label": (r.get("kv") or {}).get("label"), "reason": r.get("error")}
            for r in kv
            if r.get("status") == "skipped"
        ],
        "breaking_points": _kv_breaking_points([row for row in rows if row["status"] != "skipped"]),
    }


def _kv_row(
    r: Mapping[str, Any],
    tolerance: float,
    out: Mapping[str, str] | None,
    metric: str,
    resolved: Mapping[str, Any] | None,
    cache: Mapping[str, Any],
) -> dict[str, Any]:
    """One KV record's row: its scheme and width, the shares of reads served in float, its change and verdict,
    and the cache's bytes at the model's context (``cache``: per row label)."""
    from qbench.eval.evidence import row_fields
    from qbench.quant.kvschemes import float_read_share

    block = r.get("kv") or {}
    protocol_window = (r.get("protocol") or {}).get("window")
    return {
        "bits": block.get("bits"),
        "keep_sinks": block.get("keep_sinks", 0),
        "label": block.get("label"),
        "scheme": block.get("scheme"),
        "scheme_name": KV_SCHEME_NAMES.get(block.get("scheme"), block.get("scheme")),
        # shares of key / value reads served in float (kvschemes.float_read_share)
        "float_reads": float_read_share(block, protocol_window)
        if block.get("scheme") and protocol_window
        else None,
        "perplexity": r["metrics"]["perplexity"],
        "ppl_change_pct": measured_change(r),
        "status": r.get("status"),
        **row_fields(r, tolerance, metric),
        **_resolved_fields(r, resolved),
        "cache_bytes": cache.get(block.get("label")),
        "record": record_ref(r, out),
    }


def _kv_breaking_points(measured: Sequence[Mapping[str, Any]]) -> dict[str, dict[str, Any]]:
    """A breaking point per (scheme, sinks kept) curve of the measured KV rows; one width is a row, not a curve."""
    from qbench.studies.sweep import breaking_point_range

    points = {}
    for scheme, keep in dict.fromkeys((row["scheme"], row["keep_sinks"]) for row in measured):
        curve = {
            row["bits"]: row["verdict"]
            for row in measured
            if (row["scheme"], row["keep_sinks"]) == (scheme, keep)
        }
        if len(curve) < 2:
            continue
        certain, possible = breaking_point_range(curve)
        points[kv_axis(scheme, keep)] = {
            "bits": certain,
            "possible_bits": possible,
            "lowest_swept": min(curve),
        }
    return points


def _kv_schemes(kv: Sequence[Mapping[str, Any]], rows: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """Each KV scheme once, described by its rows without sinks kept (the scheme itself)."""
    schemes = []
    for scheme in dict.fromkeys(row["scheme"] for row in rows):
        blocks = [(r.get("kv") or {}) for r in kv if (r.get("kv") or {}).get("scheme") == scheme]
        plain = next((b for b in blocks if not b.get("keep_sinks")), blocks[0])
        schemes.append(
            {
                "scheme": scheme,
                "name": KV_SCHEME_NAMES.get(scheme, scheme),
                "options": {k: plain.get(k) for k in KV_INPUTS if plain.get(k) is not None},
                # causal = statistics of the tokens seen so far
                "causal": plain.get("causal") == "yes",
                "keys": plain.get("keys"),
                "values": plain.get("values"),
            }
        )
    return schemes


def breaking_points(
    sweep: Mapping[str, Any] | None, model: str, kv: Mapping[str, Any], metric: str = "ppl"
) -> list[dict[str, Any]]:
    """``model``'s breaking points with their curves: the sweep's (``run_sweep``'s result, None where the budget
    sweeps nothing), then the KV section's (``kv``). Decided on ``metric`` kld or top1, each curve point also holds
    its ``decision`` (the value and interval its verdict read, what the card shows of it)."""
    from qbench.studies.sweep import format_breaking_point

    def decided(row: Mapping[str, Any]) -> dict[str, Any]:
        return {} if metric == "ppl" else {"decision": row.get("decision")}

    out = []
    if sweep:
        curves: dict[tuple[str, str], dict[int, Any]] = {}
        for c in sweep["cells"]:
            if c["model"] == model:
                curves.setdefault((c["family"], c["axis"]), {})[c["bits"]] = {
                    "ppl_change_pct": c["ppl_change_pct"] if c["status"] == "ok" else None,
                    "ppl_ratio": c["ppl_ratio"] if c["status"] == "ok" else None,
                    "status": c["status"],
                    "verdict": c.get("verdict"),
                    "ppl_change_ci95": c.get("ppl_change_ci95"),
                    **decided(c),
                }
        for p in sweep["breaking_points"]:
            if p["model"] == model:
                curve = curves.get((p["family"], p["axis"]), {})
                out.append(
                    {
                        "family": p["family"],
                        "axis": p["axis"],
                        "bits": p["bits"],
                        "text": format_breaking_point(p),
                        "curve": {str(b): curve[b] for b in sorted(curve, reverse=True)},
                    }
                )
    for axis, p in kv["breaking_points"].items():
        entry = {
            "bits": p["bits"],
            "possible_bits": p.get("possible_bits"),
            "lowest_swept": p["lowest_swept"],
        }
        text = format_breaking_point(entry) if p["lowest_swept"] is not None else "-"
        curve = {
            str(row["bits"]): {
                "ppl_change_pct": row["ppl_change_pct"],
                "status": row["status"],
                **decided(row),
            }
            for row in kv["rows"]
            if kv_axis(row["scheme"], row["keep_sinks"]) == axis and row["status"] != "skipped"
        }
        out.append({"family": "fp", "axis": axis, "bits": p["bits"], "text": text, "curve": curve})
    return out
