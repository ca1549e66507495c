"""The repair and the avoid map as card.json holds them, from the sensitivity studies' results: of the repairs
tried in turn, the one shown (the first that pays) with every try's outcome and the size it had to beat, the
command that evaluates it again, and which units carry the worst format's damage."""

from __future__ import annotations

import shlex
from collections.abc import Mapping, Sequence
from typing import Any

from qbench.eval.sampling import FIRST, sample_name
from qbench.studies.card.decide import size_to_beat
from qbench.studies.card.result import ModelResult
from qbench.studies.card.sizes import float_size, repaired_bytes


def repair_section(
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


def map_section(study: Mapping[str, Any] | None, k: int = 3) -> dict[str, Any] | None:
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
    sens: Mapping[str, Any], fp: Mapping[str, Any], source: str, settings: Mapping[str, Any], k: int = 5
) -> dict[str, Any]:
    """One sensitivity study as the card shows it: the ``k`` most sensitive units with their statistics, how
    those statistics correlate with the damage, the repair it found and the command that evaluates it."""
    r = sens["repair"]
    scheme = sens["scheme"]["name"]
    command = _repair_command(scheme, r["exclude"], fp["protocol"], source, settings)
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
            # on kld or top1: the repaired and the fully quantised cell's decisions on that metric
            **{k: r[k] for k in ("decision", "quantised_decision") if k in r},
        },
        "command": command,
    }


def _repair_command(
    scheme: str, exclude: Sequence[str], p: Mapping[str, Any], source: str, settings: Mapping[str, Any]
) -> str:
    """``qbench run`` of the repaired format on the card's protocol (``p``: the float record's), each option only
    where it differs from the default, so a reader can evaluate the repair again."""
    q = shlex.quote
    options = [
        f"--ckpt {q(str(source))}",
        f"--scheme {q(scheme)}",
        *(f"--exclude {q(n)}" for n in exclude),
        f"--data {q(p['corpus'])}",
        *([f"--split {p['split']}"] if p.get("split") != "validation" else []),
        f"--tokens {p['tokens']}",
        f"--window {p['window']}",
        *([] if p.get("bos", True) else ["--no-bos"]),
        # the documents sample is the default; a record without "sample" read the first windows
        *(["--sample first"] if sample_name(p) == FIRST and p.get("protocol") != "llama.cpp" else []),
        *([f"--sample-seed {p['sample_seed']}"] if p.get("sample_seed") else []),
        *([f"--batch-size {p['batch_size']}"] if p.get("batch_size", 8) != 8 else []),
        *([f"--dtype {p['dtype']}"] if (p.get("dtype") or "float32") != "float32" else []),
        f"--seed {settings.get('seed', 0)}",
        f"--output-path {q(str(settings.get('output_path')))}",
    ]
    return "qbench run " + " ".join(options)
