""":func:`build_card`: a pure function from one :class:`~.result.ModelResult` per model to ``card.json``'s dict —
every number the renderers show, the verdict included. The rows come from :mod:`~.rows`, the repair from
:mod:`~.repair`; the verdict is :func:`~.decide.verdict` put in words by :func:`~.words.verdict_lines`, the side
by side :func:`~.compare.compare` with :func:`~.words.comparison_lines`. Only here do those typed results become
the dicts card.json holds."""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from qbench.eval.metric_registry import BY_KEY
from qbench.eval.sampling import DOCUMENTS, sample_name, sampled_summary
from qbench.studies.card.compare import FIELDS, ComparisonRow, compare, findings
from qbench.studies.card.decide import Avoid, sink_heads_share, sink_verdict, size_to_beat, verdict
from qbench.studies.card.plan import KV_MIN_WINDOW, LINEAR_TABLE_ROWS
from qbench.studies.card.repair import map_section, repair_section
from qbench.studies.card.result import ModelResult
from qbench.studies.card.rows import breaking_points, format_row, kv_section, llama_cpp_row, record_ref
from qbench.studies.card.schema import CARD_VERSION
from qbench.studies.card.sizes import kv_memory
from qbench.studies.card.words import (
    comparison_lines,
    decisions_line,
    llama_cpp_line,
    not_measured,
    verdict_lines,
)

# The registry's metrics card.json describes (its renderers' column headers and definitions).
CARD_METRICS = (
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


def build_card(per_model: Sequence[ModelResult], settings: Mapping[str, Any]) -> dict[str, Any]:
    """The card: a pure function of the records (see the module docstring); ``per_model`` entries hold ``fp``,
    ``profile``, ``formats``, ``kv`` (records), ``sweep`` (``run_sweep``'s result or None), ``sensitivity``
    (the study's result or None), ``speed`` (the speed record or None) and ``source`` (what ``--ckpt`` named)."""
    from qbench.eval.harness import environment

    models = [_model_section(entry, settings) for entry in per_model]
    comparison = compare(models) if len(models) > 1 else None
    return {
        "card_version": CARD_VERSION,
        **settings,
        "metrics": {key: _metric_info(key) for key in CARD_METRICS},
        "models": models,
        "comparison": None if comparison is None else [_comparison_entry(r) for r in comparison],
        "comparison_lines": comparison_lines(findings(comparison)) if comparison else [],
        # the code that built this card (each model's "env" is its float record's: what measured it); a card
        # re-rendered from cached records names the commit that rendered it here
        "env": environment(settings.get("device", "cpu")),
        "created_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }


def _model_section(entry: ModelResult, settings: Mapping[str, Any]) -> dict[str, Any]:
    """One model's section: its identity and protocol, the float record, outliers and attention, a row per format
    and KV setting, the breaking points, the repair and the avoid map, the verdict and what was not measured."""
    tolerance = settings["tolerance_pct"]
    metric = settings.get("metric") or "ppl"
    fp, profile, out = entry.fp, entry.profile, entry.paths
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
    kv_bf16_bytes = (kv["memory"] or {}).get("bf16_bytes")
    formats = [
        format_row(
            r, fp, profile, tolerance, entry.speed, out, metric, resolved, entry.layer_speed, kv_bf16_bytes
        )
        for r in entry.formats
    ]
    sens = repair_section(entry, fp, profile, settings, tolerance, metric)
    avoid_map = map_section(entry.avoid_map)
    beat = size_to_beat(entry.formats, fp, profile, tolerance, metric, entry.source_bytes)
    llama_cpp = [llama_cpp_row(r, tolerance, out, metric) for r in entry.llama_cpp]
    decisions = _decisions([*formats, *llama_cpp], kv, entry.sweep, fp["model"]["name"])
    verdict = verdict_section(formats, sens, tolerance, metric, avoid_map, beat, decisions)
    if llama_cpp:  # the files people download, on the same tokens: the smallest that passes
        verdict["lines"].append(llama_cpp_line(llama_cpp, tolerance, metric))
    unmeasured = not_measured(formats, kv, bool(entry.speed), fp["protocol"], settings)
    if entry.llama_cpp_skipped:
        unmeasured.append(f"llama.cpp's file types: {entry.llama_cpp_skipped}")
    section = {
        "name": fp["model"]["name"],
        "source": entry.source,
        "identity": _identity(fp["model"], profile["architecture"]),
        "protocol": _protocol(fp, settings),
        "fp": {
            "perplexity": fp["metrics"]["perplexity"],
            "model_bytes": fp.get("model_bytes"),
            "eval_seconds": fp.get("eval_seconds"),
            "record": record_ref(fp, out),
            "cell_id": fp.get("cell_id"),
        },
        "env": fp.get("env"),
        "outliers": _outlier_profile(fp, profile),
        "attention": profile["attention_per_head"],
        "formats": formats,
        "kv": kv,
        "breaking_points": breaking_points(entry.sweep, fp["model"]["name"], kv, metric),
        "sensitivity": sens,
        "speed_measured": bool(entry.speed),
        "avoid_map": avoid_map,
        # per-window mean NLL of the float record and each format (the comparison's paired intervals)
        "window_nll": entry.window_nll or {},
        "kernels": {k: v for k, v in (entry.layer_speed or {}).items() if k != "records"} or None,
        "verdict": verdict,
        "decisions": decisions,
        "not_measured": unmeasured,
    }
    if llama_cpp:  # cards without llama.cpp rows keep their shape
        section["llama_cpp"] = llama_cpp
    if entry.mixed_plan is not None:
        section["mixed_plan"] = mixed_plan_section(entry.mixed_plan)
        verdict["lines"].append(mixed_plan_line(section["mixed_plan"]))
    return section


def mixed_plan_section(plan: Mapping[str, Any]) -> dict[str, Any]:
    """The card's view of ``qbench plan``'s result: per budget the plan, what it promised and what it measured,
    and its paired verdict against the nearest uniform type at or above its size."""
    if "skipped" in plan:
        return {"skipped": plan["skipped"], "output": None, "plans": []}
    rows = []
    for p in plan["plans"]:
        cell = p.get("cell") or {}
        nearest = next((v for v in p.get("vs") or [] if v["type"] == p.get("nearest_at_or_above")), None)
        rows.append(
            {
                "budget": p["budget"],
                "budget_bytes": p["budget_bytes"],
                "error": p.get("error"),
                "plan": p.get("plan"),
                "promised_kld": p.get("promised_kld"),
                "promised_bytes": p.get("promised_bytes"),
                "kld_mean": cell.get("kld_mean"),
                "ppl_change_pct": cell.get("ppl_change_pct"),
                "ppl_change_ci95": cell.get("ppl_change_ci95"),
                "top1_agreement": cell.get("top1_agreement"),
                "bytes": cell.get("bytes"),
                "nearest": None if nearest is None else nearest["type"],
                "vs_nearest": None if nearest is None else nearest["verdict"],
                "vs_nearest_ci95": None if nearest is None else nearest["ppl_ratio_ci95"],
                "gguf": (p.get("gguf") or {}).get("file"),
            }
        )
    return {"skipped": None, "output": plan.get("output"), "plans": rows}


def mixed_plan_line(section: Mapping[str, Any]) -> str:
    """The verdict's line on the plan: measured against promised, and against the uniform type it competes with."""
    if section["skipped"]:
        return f"Mixed-precision plan: not made ({section['skipped']})."
    parts = []
    for p in section["plans"]:
        if p["error"] or p["kld_mean"] is None:
            parts.append(f"at {p['budget']}: {p['error'] or 'not measured'}")
            continue
        vs = f"; against {p['nearest']}: {p['vs_nearest'] or '–'}" if p["nearest"] else ""
        parts.append(
            f"at {p['budget']} ({p['bytes'] / 1e6:,.2f} MB) KLD {p['kld_mean']:.4g} (promised "
            f"{p['promised_kld']:.4g}), {p['ppl_change_pct']:+.2f} %{vs}"
        )
    return "Mixed-precision plan (qbench plan): " + "; ".join(parts) + "."


def _decisions(
    formats: Sequence[Mapping[str, Any]],
    kv: Mapping[str, Any],
    sweep: Mapping[str, Any] | None,
    model: str,
) -> dict[str, Any]:
    """card.json's ``decisions`` of one model: its verdicts against the tolerance — format rows, KV rows and the
    cells of its sweep's breaking points, each record once (the sweep's widest cell is often a format row too) —
    and the false *within* calls they could make (``qbench.eval.tolerance.decisions_block``)."""
    from qbench.eval.tolerance import decision_count, decisions_block

    cells = [c for c in (sweep or {}).get("cells", []) if c.get("model") == model]
    return decisions_block(decision_count([*formats, *kv["rows"], *cells]))


def _identity(model: Mapping[str, Any], architecture: Mapping[str, Any]) -> dict[str, Any]:
    """What the model is: its kind, path, fingerprint and dtype, and the profile's architecture."""
    return {
        "kind": model.get("kind"),
        "path": model.get("path"),
        "fingerprint": model.get("fingerprint"),
        "dtype": model.get("dtype"),
        # a GGUF's weights already lie on its grid (Q8_0, Q4_K…): each cell quantises them again
        "gguf": model.get("gguf"),
        **architecture,
    }


def _protocol(fp: Mapping[str, Any], settings: Mapping[str, Any]) -> dict[str, Any]:
    """How every number of the model was measured: the float record's protocol (corpus, tokens, windows, start
    token, tokenizer, dtype), the seed, and what the statistics were computed on."""
    p = fp["protocol"]
    return {
        "corpus": p["corpus"],
        "split": p["split"],
        "tokens": p["tokens"],
        "tokens_scored": p["tokens_scored"],
        "window": p["window"],
        "windows": p["windows"],
        "start_token": "<|endoftext|> (BOS) opens every window" if p["bos"] else "none (--no-bos)",
        "bos": p["bos"],
        "tokenizer_fingerprint": p.get("tokenizer_fingerprint"),
        "dtype": p.get("dtype"),
        "outlier_windows": p.get("outlier_windows"),
        "seed": settings.get("seed"),
        "corpus_description": _corpus_description(p["corpus"], p.get("split")),
        # what the outlier, linear-input and attention statistics were computed on (the float record's first
        # windows, at most outlier_windows): not the formats' whole token budget
        "statistics_windows": fp["outliers"].get("windows"),
        "statistics_tokens": (fp["outliers"].get("windows") or 0) * p["window"] or None,
        **({"sampled": sampled_summary(p)} if sample_name(p) == DOCUMENTS else {}),
    }


def verdict_section(
    formats: Sequence[Mapping[str, Any]],
    sens: Mapping[str, Any] | None,
    tolerance: float,
    metric: str = "ppl",
    avoid_map: Mapping[str, Any] | None = None,
    beat: tuple[int | None, str] | None = None,
    decisions: Mapping[str, Any] | None = None,
) -> dict[str, Any]:
    """card.json's ``verdict`` of a model's format rows: :func:`~.decide.verdict` (``sens``: the repair section,
    ``avoid_map``: the map of the worst format, ``beat``: :func:`~.decide.size_to_beat`'s answer) with its lines
    and commands (:func:`~.words.verdict_lines`); the last line says how many verdicts the model's section made
    (``decisions``: :func:`_decisions`) and the false *within* calls they could make."""
    v = verdict(formats, sens, avoid_map, beat)
    lines, commands = verdict_lines(v, tolerance, metric)
    counted = decisions_line(decisions, tolerance, metric)
    if counted:
        lines.append(counted)
    recommended = v.recommended
    return {
        "recommended": None
        if recommended is None
        else {
            k: recommended[k] for k in ("label", "scheme", "ppl_change_pct", "weight_bytes", "bytes_vs_bf16")
        },
        "avoid": [_avoid_entry(a) for a in v.avoid],
        "undecided": [f["label"] for f in v.undecided],
        "beyond": [f["label"] for f in v.beyond],
        "repair": None if sens is None or v.repair is None else _repair_entry(sens),
        "lines": lines,
        "commands": commands,
    }


def _avoid_entry(a: Avoid) -> dict[str, Any]:
    """A format to avoid as card.json holds it: its measured failure and the units its map blames."""
    f = a.row
    return {
        "label": f["label"],
        "scheme": f["scheme"],
        "ppl_change_pct": f["ppl_change_pct"],
        "ppl_change_ci95": f.get("ppl_change_ci95"),
        "kld_mean": f.get("kld_mean"),
        "top1_agreement": f.get("top1_agreement"),
        "status": f["status"],
        "blamed": None
        if a.blamed is None
        else [{"name": u.name, "ppl_change_pct": u.ppl_change_pct} for u in a.blamed],
        "blamed_by": a.blamed_by,
    }


def _repair_entry(sens: Mapping[str, Any]) -> dict[str, Any]:
    """The verdict's repair as card.json holds it: the repair section's own fields as they are."""
    return {"scheme": sens["scheme"], **sens["repair"], "command": sens["command"]}


def _comparison_entry(row: ComparisonRow) -> dict[str, Any]:
    """A side-by-side row as card.json holds it: the fields every row has, then its section's (:data:`FIELDS`)."""
    return {
        "section": row.section,
        "row": row.row,
        "scheme": row.scheme,
        "values": row.values,
        "more_robust": row.more_robust,
        **{name: getattr(row, name) for name in FIELDS[row.section]},
        **({} if row.decision is None else {"decision": row.decision}),  # a card on kld or top1
    }


def _metric_info(key: str) -> dict[str, str]:
    m = BY_KEY[key]
    return {"label": m.label, "definition": m.definition, "unit": m.unit, "better": m.better}


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
