""":func:`build_card`: a pure function from one :class:`~.result.ModelResult` per model to ``card.json``'s dict —
every number the renderers show, the verdict included."""

from __future__ import annotations

import math
import shlex
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from qbench.eval.metric_registry import BY_KEY
from qbench.studies.card.config import KV_INPUTS
from qbench.studies.card.decide import (
    below_others_float,
    better_to_ship,
    clearly_least,
    least_of,
    more_robust_change,
    sink_heads_share,
    sink_verdict,
    size_to_beat,
)
from qbench.studies.card.plan import (
    FORMAT_BY_SCHEME,
    FORMATS,
    KV_MIN_WINDOW,
    LINEAR_TABLE_ROWS,
    Format,
    canonical_scheme,
    rtn_scheme,
)
from qbench.studies.card.result import ModelResult
from qbench.studies.card.schema import CARD_VERSION
from qbench.studies.card.sizes import deployed_bytes, float_size, kv_memory, repaired_bytes
from qbench.studies.card.words import change_text, comparison_lines, not_measured, quantised_text, verdict_of


def _metric_info(key: str) -> dict[str, str]:
    m = BY_KEY[key]
    return {"label": m.label, "definition": m.definition, "unit": m.unit, "better": m.better}


def _record_ref(record: Mapping[str, Any], paths: Mapping[str, str] | None) -> str | None:
    """Where ``record`` is stored, relative to the output path (``run_card`` collects them)."""
    return (paths or {}).get(record.get("cell_id") or "")


def _format_row(
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
    change = change_text(record)
    speedup = None
    if speed:
        speedup = next(
            (
                r.get("speedup")
                for r in speed.get("records", [])
                if r.get("kind") == "model"
                and r.get("scheme") is not None
                and canonical_scheme(r["scheme"]) == name
                and r.get("mode") == "real"
                and not r.get("error")
            ),
            None,
        )
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
        "record": _record_ref(record, out),
        "cell_id": record.get("cell_id"),
    }


def _resolved_fields(record: Mapping[str, Any], resolved: Mapping[str, Any] | None) -> dict[str, Any]:
    """A row's tokens and, when ``--resolve`` re-evaluated it, the steps (verdict per token budget) it took."""
    steps = (resolved or {}).get(record.get("cell_id") or "")
    return {"tokens_scored": (record.get("protocol") or {}).get("tokens_scored"), "resolved": steps or None}


KV_SCHEME_NAMES = {"kivi": "KIVI", "per-token": "per-token", "fp8-e4m3": "FP8 E4M3", "fp8-e5m2": "FP8 E5M2"}


def _kv_axis(scheme: str, keep_sinks: int) -> str:
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
    from qbench.eval.evidence import row_fields
    from qbench.quant.kvschemes import float_read_share
    from qbench.studies.sweep import breaking_point_range

    rows = []
    for r in kv:
        block = r.get("kv") or {}
        change = change_text(r)
        protocol_window = (r.get("protocol") or {}).get("window")
        reads = float_read_share(block, protocol_window) if block.get("scheme") and protocol_window else None
        rows.append(
            {
                "bits": block.get("bits"),
                "keep_sinks": block.get("keep_sinks", 0),
                "label": block.get("label"),
                "scheme": block.get("scheme"),
                "scheme_name": KV_SCHEME_NAMES.get(block.get("scheme"), block.get("scheme")),
                "float_reads": reads,  # shares of key / value reads served in float (kvschemes.float_read_share)
                "perplexity": r["metrics"]["perplexity"],
                "ppl_change_pct": change,
                "status": r.get("status"),
                **row_fields(r, tolerance, metric),
                **_resolved_fields(r, resolved),
                "cache_bytes": (memory or {}).get("rows", {}).get(block.get("label")),
                "record": _record_ref(r, out),
            }
        )
    measured = [row for row in rows if row["status"] != "skipped"]
    points = {}
    for scheme, keep in dict.fromkeys((row["scheme"], row["keep_sinks"]) for row in measured):
        curve = {
            row["bits"]: row["verdict"]
            for row in measured
            if (row["scheme"], row["keep_sinks"]) == (scheme, keep)
        }
        if len(curve) < 2:  # one width is a row, not a curve
            continue
        certain, possible = breaking_point_range(curve)
        points[_kv_axis(scheme, keep)] = {
            "bits": certain,
            "possible_bits": possible,
            "lowest_swept": min(curve),
        }
    schemes = []
    for scheme in dict.fromkeys(row["scheme"] for row in rows):
        blocks = [(r.get("kv") or {}) for r in kv if (r.get("kv") or {}).get("scheme") == scheme]
        plain = next((b for b in blocks if not b.get("keep_sinks")), blocks[0])
        schemes.append(
            {
                "scheme": scheme,
                "name": KV_SCHEME_NAMES.get(scheme, scheme),
                "options": {k: plain.get(k) for k in KV_INPUTS if plain.get(k) is not None},
                # the scheme itself (its rows without sinks kept): causal = statistics of the tokens seen so far
                "causal": plain.get("causal") == "yes",
                "keys": plain.get("keys"),
                "values": plain.get("values"),
            }
        )
    skipped = [
        {"label": (r.get("kv") or {}).get("label"), "reason": r.get("error")}
        for r in kv
        if r.get("status") == "skipped"
    ]
    scored = next(((r.get("protocol") or {}).get("window") for r in kv if r.get("protocol")), None)
    w = dict(window or {})
    w.setdefault("window", scored)
    w["short"] = bool(w.get("window") and w["window"] < (w.get("minimum") or KV_MIN_WINDOW))
    return {
        "window": w,
        "memory": {k: v for k, v in (memory or {}).items() if k != "rows"} or None,
        "schemes": schemes,
        "rows": rows,
        "skipped": skipped,
        "breaking_points": points,
    }


def _breaking_points(
    sweep: Mapping[str, Any] | None, model: str, kv: Mapping[str, Any]
) -> list[dict[str, Any]]:
    from qbench.studies.sweep import format_breaking_point

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
            str(row["bits"]): {"ppl_change_pct": row["ppl_change_pct"], "status": row["status"]}
            for row in kv["rows"]
            if _kv_axis(row["scheme"], row["keep_sinks"]) == axis and row["status"] != "skipped"
        }
        out.append({"family": "fp", "axis": axis, "bits": p["bits"], "text": text, "curve": curve})
    return out


def _head_mass(profile: Mapping[str, Any]) -> Any:
    return (profile.get("attention_per_head") or {}).get("mass")


def _outlier_profile(fp: Mapping[str, Any], profile: Mapping[str, Any]) -> dict[str, Any]:
    massive = fp.get("massive_activations") or {}
    sites = {s["layer"]: s for s in profile.get("massive_sites") or []}
    per_layer = fp.get("outliers_per_layer") or {}
    layers = []
    for i, _ in enumerate(per_layer.get("max_abs") or []):
        m = next((x for x in massive.get("layers", []) if x["layer"] == i), {})
        s = sites.get(i, {})
        layers.append(
            {
                "layer": i,
                "kurtosis_first": per_layer["kurtosis_first"][i],
                "kurtosis_other": per_layer["kurtosis_other"][i],
                "max_abs": per_layer["max_abs"][i],
                "max_abs_first": per_layer["max_abs_first"][i],
                "max_abs_other": per_layer["max_abs_other"][i],
                "massive_count": m.get("count", 0),
                "massive_channels": m.get("channels", []),
                "massive_positions": s.get("positions", []),
                "massive_position_kinds": m.get("positions", {}),
                "massive_sites": s.get("sites", []),
                "median_abs": m.get("median"),
                "top": m.get("top", []),
            }
        )
    linear = [
        {
            "name": name,
            "lm_head": v["lm_head"],
            "input_crest": v.get("input_crest"),
            "input_kurtosis": v.get("input_kurtosis"),
            "input_absmax": v.get("input_absmax"),
            "input_int8_sqnr_db": v.get("input_int8_sqnr_db"),
            "weight_crest": v.get("weight_crest"),
        }
        for name, v in ((fp.get("linear_ranges") or {}).get("per_layer") or {}).items()
    ]
    o = fp["outliers"]
    ranked = sorted((x for x in linear if x["input_crest"] is not None), key=lambda x: -x["input_crest"])
    from models.stats import uniform_first_key_share

    window = (fp.get("protocol") or {}).get("window")
    chance = uniform_first_key_share(window) if window and window > 1 else None
    mass, top1 = o.get("first_token_mass"), o.get("first_token_top1_share")
    return {
        # uniform causal attention's share on key 0 (models.stats): the chance level of both the mean weight and
        # the top-1 share; see sink_verdict for the three readings
        "sink_chance": chance,
        "sink": sink_verdict(mass, top1, chance, heads := sink_heads_share(_head_mass(profile))),
        "sink_heads_share": heads,
        "sink_vs_chance": mass / chance if chance and mass is not None else None,
        "sink_top1_vs_chance": top1 / chance if chance and top1 is not None else None,
        "summary": {
            "kurtosis_first": o.get("kurtosis_first"),
            "kurtosis_other": o.get("kurtosis_other"),
            "max_abs": o.get("max_abs"),
            "first_token_top1_share": o.get("first_token_top1_share"),
            "first_token_mass": o.get("first_token_mass"),
            "massive_total": massive.get("total"),
            "max_input_crest": (fp.get("linear_ranges") or {}).get("max_input_crest"),
            "max_weight_crest": (fp.get("linear_ranges") or {}).get("max_weight_crest"),
        },
        "massive_threshold": massive.get("threshold"),
        "windows": o.get("windows"),
        "layers": layers,
        "linear": linear,
        "linear_worst": [
            x["name"] for x in ranked[:LINEAR_TABLE_ROWS]
        ],  # the tables' rows; the figure has all
    }


def _repair_section(
    entry: ModelResult,
    fp: Mapping[str, Any],
    profile: Mapping[str, Any],
    settings: Mapping[str, Any],
    tolerance: float,
    metric: str,
) -> dict[str, Any] | None:
    """The repair the card shows: of the studies tried in turn (``entry.repairs``; a card before the
    candidates held one, ``entry.sensitivity``), the first that pays — within the tolerance and smaller than
    what must be beaten (:func:`size_to_beat`) — else the first tried; with every try's outcome and the size to
    beat."""
    studies = list(entry.repairs or ([entry.sensitivity] if entry.sensitivity else []))
    if not studies:
        return None
    limit, what = size_to_beat(entry.formats, fp, profile, tolerance, metric, entry.source_bytes)
    tries = []
    for study in studies:
        target = next((r for r in entry.formats if r["scheme"]["name"] == study["scheme"]["name"]), None)
        size = repaired_bytes(target, study, fp, profile) if target is not None else None
        r = study["repair"]
        tries.append(
            {
                "scheme": study["scheme"]["name"],
                "reached": r["reached"],
                "count": r["count"],
                "quantised_ppl_change_pct": r["quantised_ppl_change_pct"],
                "ppl_change_pct": r["ppl_change_pct"],
                "weight_bytes": size,
                "pays": bool(r["reached"] and size is not None and (limit is None or size < limit)),
            }
        )
    chosen = next((i for i, t in enumerate(tries) if t["pays"]), 0)
    sens = _sensitivity_section(studies[chosen], fp, entry.source, settings)
    sens["repair"]["weight_bytes"] = tries[chosen]["weight_bytes"]
    bf16 = (fp.get("model_bytes") or 0) * 2 // float_size(fp)
    size = tries[chosen]["weight_bytes"]
    sens["repair"]["bytes_vs_bf16"] = size / bf16 if size and bf16 else None
    sens["repair"]["pays"] = tries[chosen]["pays"]
    sens["repair"]["beat"] = {"bytes": limit, "what": what}
    sens["tries"] = tries
    return sens


def _map_section(study: Mapping[str, Any] | None, k: int = 3) -> dict[str, Any] | None:
    """The avoid map: which units carry a failing format's damage, the ``k`` worst with their change alone."""
    if not study:
        return None
    return {
        "scheme": study["scheme"]["name"],
        "by": study["by"],
        "output": study.get("output"),
        "top": [{"name": u["name"], "ppl_change_pct": u.get("ppl_change_pct")} for u in study["units"][:k]],
        "units": len(study["units"]),
    }


def _sensitivity_section(
    sens: Mapping[str, Any] | None,
    fp: Mapping[str, Any],
    source: str,
    settings: Mapping[str, Any],
    k: int = 5,
) -> dict[str, Any] | None:
    if not sens:
        return None
    r = sens["repair"]
    p = fp["protocol"]
    scheme = sens["scheme"]["name"]
    q = shlex.quote
    options = [
        f"--ckpt {q(str(source))}",
        f"--scheme {q(scheme)}",
        *(f"--exclude {q(n)}" for n in r["exclude"]),
        f"--data {q(p['corpus'])}",
        *([f"--split {p['split']}"] if p.get("split") != "validation" else []),
        f"--tokens {p['tokens']}",
        f"--window {p['window']}",
        *([] if p.get("bos", True) else ["--no-bos"]),
        *([f"--batch-size {p['batch_size']}"] if p.get("batch_size", 8) != 8 else []),
        *([f"--dtype {p['dtype']}"] if (p.get("dtype") or "float32") != "float32" else []),
        f"--seed {settings.get('seed', 0)}",
        f"--output-path {q(str(settings.get('output_path')))}",
    ]
    command = "qbench run " + " ".join(options)
    return {
        "scheme": scheme,
        "by": sens["by"],
        "output": sens.get("output"),
        "top": [
            {
                key: u.get(key)
                for key in (
                    "name",
                    "ppl",
                    "ppl_change_pct",
                    "status",
                    "input_crest",
                    "input_kurtosis",
                    "max_abs",
                    "weight_crest",
                )
            }
            for u in sens["units"][:k]
        ],
        "units": len(sens["units"]),
        "correlation": sens["correlation"],
        "repair": {
            "reached": r["reached"],
            "minimised": r.get("minimised", True),  # studies before the option always minimised
            "exclude": r["exclude"],
            "count": r["count"],
            "weight_share_float": r["weight_share_float"],
            "quantised_ppl_change_pct": r["quantised_ppl_change_pct"],
            "ppl": r["ppl"],
            "ppl_change_pct": r["ppl_change_pct"],
            "ppl_change_ci95": r.get("ppl_change_ci95"),
            "kld_mean": r.get("kld_mean"),
            "top1_agreement": r.get("top1_agreement"),
            "tolerance_pct": r["tolerance_pct"],
        },
        "command": command,
    }


def _kv_configs_of(records: Sequence[Mapping[str, Any]]) -> list[Any]:
    """The KV configs the KV rows' records were made with (their ``kv`` blocks)."""
    from qbench.quant.kv import KVConfig

    return [KVConfig.from_dict(r["kv"]) for r in records if r.get("kv")]


def _corpus_description(corpus: str, split: str | None) -> str:
    """What the scored text is: a registered corpus's description and the split, or a user's own file/folder."""
    from trainers.data import CORPORA

    if corpus in CORPORA or any(corpus in CORPORA.aliases_of(n) for n in CORPORA):
        name = CORPORA.canonical(corpus)
        held = {"validation": "the held-out validation split", "train": "the training split"}.get(
            str(split), f"split {split}"
        )
        return (
            f"{name}: {CORPORA.describe(name)}; {held} (qbench's models train on the other split; a model "
            "pretrained elsewhere may have seen these public texts)"
        )
    return f"a user's text, {Path(str(corpus)).name} (split {split})"


def build_card(per_model: Sequence[ModelResult], settings: Mapping[str, Any]) -> dict[str, Any]:
    """The card: a pure function of the records (see the module docstring); ``per_model`` entries hold ``fp``,
    ``profile``, ``formats``, ``kv`` (records), ``sweep`` (``run_sweep``'s result or None), ``sensitivity``
    (the study's result or None), ``speed`` (the speed record or None) and ``source`` (what ``--ckpt`` named)."""
    from qbench.eval.harness import environment

    tolerance = settings["tolerance_pct"]
    metric = settings.get("metric") or "ppl"
    models = []
    for entry in per_model:
        fp, profile = entry.fp, entry.profile
        out = entry.paths
        p = fp["protocol"]
        resolved = entry.resolved or {}
        kv = kv_section(
            entry.kv,
            tolerance,
            out,
            metric,
            resolved,
            {"context": profile["architecture"].get("context"), "minimum": KV_MIN_WINDOW},
            kv_memory(profile["architecture"], _kv_configs_of(entry.kv)),
        )
        formats = [
            _format_row(
                r,
                fp,
                profile,
                tolerance,
                entry.speed,
                out,
                metric,
                resolved,
                entry.layer_speed,
                (kv["memory"] or {}).get("bf16_bytes"),
            )
            for r in entry.formats
        ]
        outliers = _outlier_profile(fp, profile)
        sens = _repair_section(entry, fp, profile, settings, tolerance, metric)
        avoid_map = _map_section(entry.avoid_map)
        models.append(
            {
                "name": fp["model"]["name"],
                "source": entry.source,
                "identity": {
                    "kind": fp["model"].get("kind"),
                    "path": fp["model"].get("path"),
                    "fingerprint": fp["model"].get("fingerprint"),
                    "dtype": fp["model"].get("dtype"),
                    # a GGUF's weights already lie on its grid (Q8_0, Q4_K…): each cell quantises them again
                    "gguf": fp["model"].get("gguf"),
                    **profile["architecture"],
                },
                "protocol": {
                    "corpus": p["corpus"],
                    "split": p["split"],
                    "tokens": p["tokens"],
                    "tokens_scored": p["tokens_scored"],
                    "window": p["window"],
                    "windows": p["windows"],
                    "start_token": "<|endoftext|> (BOS) opens every window"
                    if p["bos"]
                    else "none (--no-bos)",
                    "bos": p["bos"],
                    "tokenizer_fingerprint": p.get("tokenizer_fingerprint"),
                    "dtype": p.get("dtype"),
                    "outlier_windows": p.get("outlier_windows"),
                    "seed": settings.get("seed"),
                    "corpus_description": _corpus_description(p["corpus"], p.get("split")),
                    # what the outlier, linear-input and attention statistics were computed on (the float
                    # record's first windows, at most outlier_windows): not the formats' whole token budget
                    "statistics_windows": fp["outliers"].get("windows"),
                    "statistics_tokens": (fp["outliers"].get("windows") or 0) * p["window"] or None,
                },
                "fp": {
                    "perplexity": fp["metrics"]["perplexity"],
                    "model_bytes": fp.get("model_bytes"),
                    "eval_seconds": fp.get("eval_seconds"),
                    "record": _record_ref(fp, out),
                    "cell_id": fp.get("cell_id"),
                },
                "env": fp.get("env"),
                "outliers": outliers,
                "attention": profile["attention_per_head"],
                "formats": formats,
                "kv": kv,
                "breaking_points": _breaking_points(entry.sweep, fp["model"]["name"], kv),
                "sensitivity": sens,
                "speed_measured": bool(entry.speed),
                "avoid_map": avoid_map,
                # per-window mean NLL of the float record and each format (the comparison's paired intervals)
                "window_nll": entry.window_nll or {},
                "kernels": {k: v for k, v in (entry.layer_speed or {}).items() if k != "records"} or None,
                "verdict": verdict_of(
                    formats,
                    outliers,
                    fp,
                    sens,
                    tolerance,
                    metric,
                    avoid_map,
                    size_to_beat(entry.formats, fp, profile, tolerance, metric, entry.source_bytes),
                ),
                "not_measured": not_measured(formats, kv, bool(entry.speed), p, settings),
            }
        )
    card = {
        "card_version": CARD_VERSION,
        **settings,
        "metrics": {
            key: _metric_info(key)
            for key in (
                "perplexity",
                "ppl_change_pct",
                "kurtosis_first",
                "kurtosis_other",
                "max_abs",
                "first_token_top1_share",
                "first_token_mass",
                "input_crest",
                "input_kurtosis",
                "input_absmax",
                "weight_crest",
            )
        },
        "models": models,
        "comparison": (comparison := _comparison(models) if len(models) > 1 else None),
        "comparison_lines": comparison_lines(comparison) if comparison else [],
        # the code that built this card (each model's "env" is its float record's: what measured it); a card
        # re-rendered from cached records names the commit that rendered it here
        "env": environment(settings.get("device", "cpu")),
        "created_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }
    return card


def _comparison(models: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """The same rows side by side. ``more_robust``: for a format or KV row the model with the decidedly smaller
    damage (:func:`more_robust_change`), for a breaking point the lower one (``none`` is the worst), for a float
    statistic whose registry direction is ``lower`` the lower value; None when nothing tells them apart."""
    rows = []

    def row(
        section: str, label: str, scheme: str | None, values: dict, more_robust: str | None, **extra: Any
    ) -> None:
        rows.append(
            {
                "section": section,
                "row": label,
                "scheme": scheme,
                "values": values,
                "more_robust": more_robust,
                **extra,
            }
        )

    floats = {m["name"]: m["fp"]["perplexity"] for m in models}
    float_windows = {
        m["name"]: ((m.get("window_nll") or {}).get(m["fp"].get("cell_id") or ""), None) for m in models
    }
    row(
        "float",
        "float perplexity",
        None,
        floats,
        None,
        better_to_ship=better_to_ship(float_windows) if all(q for q, _ in float_windows.values()) else None,
    )

    for scheme in dict.fromkeys(f["scheme"] for m in models for f in m["formats"]):
        found = {m["name"]: next((f for f in m["formats"] if f["scheme"] == scheme), None) for m in models}
        values = {k: None if f is None else f["ppl_change_pct"] for k, f in found.items()}
        label = next(f["label"] for f in found.values() if f is not None)
        quantised = {k: None if f is None else f["perplexity"] for k, f in found.items()}
        per_window = {
            m["name"]: (
                (m.get("window_nll") or {}).get((found[m["name"]] or {}).get("cell_id") or ""),
                (m.get("window_nll") or {}).get(m["fp"].get("cell_id") or ""),
            )
            for m in models
        }
        evidence = per_window if all(q and f for q, f in per_window.values()) else None
        row(
            "formats",
            label,
            scheme,
            values,
            more_robust_change(found),
            perplexity=quantised,
            below_others_float=below_others_float(quantised, floats, evidence),
            better_to_ship=better_to_ship(evidence) if evidence else None,
        )

    def kv_key(r: Mapping[str, Any]) -> tuple[Any, ...]:
        return r["scheme"], r["bits"], r["keep_sinks"]

    for key in dict.fromkeys(kv_key(r) for m in models for r in m["kv"]["rows"]):
        found = {m["name"]: next((r for r in m["kv"]["rows"] if kv_key(r) == key), None) for m in models}
        _, bits, keep = key
        skipped = any(r is not None and r["status"] == "skipped" for r in found.values())
        values = {
            k: "skipped"
            if r is not None and r["status"] == "skipped"
            else None
            if r is None
            else r["ppl_change_pct"]
            for k, r in found.items()
        }
        name = next(r["scheme_name"] for r in found.values() if r is not None)
        label = f"KV {name} {bits} bit" + (f", {keep} sink(s) kept" if keep else "")
        # quantised perplexity beside each change (at the KV section's window, against the float model there)
        quantised = {
            k: None if r is None or r["status"] == "skipped" else r.get("perplexity")
            for k, r in found.items()
        }
        # a row one model could not measure names no more robust model
        row(
            "kv",
            label,
            None,
            values,
            None if skipped else more_robust_change(found),
            perplexity=quantised,
            missing=[k for k, r in found.items() if r is None],  # not in that model's budget: "-", not NaN
        )
    for family, axis in dict.fromkeys((b["family"], b["axis"]) for m in models for b in m["breaking_points"]):
        found = {
            m["name"]: next(
                (x for x in m["breaking_points"] if (x["family"], x["axis"]) == (family, axis)), None
            )
            for m in models
        }
        bits = {k: math.inf if b is None or b["bits"] is None else b["bits"] for k, b in found.items()}
        values = {k: None if b is None else b["text"] for k, b in found.items()}
        row("breaking points", f"break {family} {axis}", None, values, least_of(bits))
    start = all(m["protocol"].get("bos", True) for m in models)
    for key in ("kurtosis_first", "kurtosis_other", "max_abs", "first_token_top1_share"):
        values = {m["name"]: m["outliers"]["summary"].get(key) for m in models}
        known = {k: v for k, v in values.items() if v is not None}
        lower = BY_KEY[key].better == "lower" and len(known) == len(values)
        label = "κ start token" if key == "kurtosis_first" and start else BY_KEY[key].label
        row("outliers", label, None, values, clearly_least(known) if lower else None)
    return rows
