"""Every sentence the card says: the verdict's lines, what was not measured, the quantised text and the comparison's
lines — from rows and decisions already made."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from qbench.eval.evidence import tolerance_text
from qbench.studies.card.plan import FORMATS, canonical_scheme, rtn_scheme
from qbench.studies.card.units import decimal_bytes, pct

_FORMAT_NAMES = {"int": "int", "fp8-e4m3": "FP8 E4M3", "mxfp8": "MXFP8", "mxfp6": "MXFP6", "mxfp4": "MXFP4"}


def _granularity(g: Mapping[str, Any] | None) -> str:
    kind = (g or {}).get("kind")
    if kind == "per_group":
        return f"g{g['group_size']}"
    return {"per_tensor": "per tensor", "per_axis": "per channel", "per_token": "per token"}.get(
        kind, str(kind)
    )


def quantised_text(scheme: Mapping[str, Any]) -> str:
    """What a format row quantised, in words a deployment uses: ``W4 MXFP4 g32 + A4 MXFP4 g32 (dynamic); RTN``.
    A rotation comes first (QuaRot's of the model, or an online Hadamard of each linear's input: the row's kernel
    speed does not include it); then weights and, where quantised, the activations entering each linear
    (dynamic: scales from each sequence's own values; static: calibrated once) and the outputs; then how the
    weights were rounded: RTN (round-to-nearest) or GPTQ (with its calibration windows)."""
    fmt = str(scheme.get("format") or "int")
    method, params = scheme.get("method"), scheme.get("params") or {}
    name = "NF4" if method == "bnb-nf4" else _FORMAT_NAMES.get(fmt, fmt.upper())

    def part(letter: str, bits: Any, g: Any) -> str:
        return f"{letter}{bits} {name} {_granularity(g)}"

    text = part("W", scheme.get("weight_bits"), scheme.get("weight_granularity"))
    if scheme.get("weight_symmetric") is False:
        text += " asymmetric"
    if method == "smoothquant":
        text = f"SmoothQuant α {params.get('alpha')} (calibrated), then {text}"
    elif method == "llm-int8":
        text += f", fp16 outlier columns above {params.get('threshold')}"
    elif method == "hadamard":  # an online random Hadamard rotation of each linear's input, then the grid
        text = f"Hadamard-rotated inputs (online, seed {params.get('seed', 0)}), then {text}"
    if scheme.get("rotate") == "quarot":  # the residual stream rotated into the weights before rounding
        text = f"QuaRot-rotated model (offline, plus 2 online rotations), then {text}"
    if scheme.get("act_bits") is None:
        text += ", weight-only"
    else:
        scales = "static scales" if scheme.get("static") else "dynamic scales"
        text += f" + {part('A', scheme.get('act_bits'), scheme.get('act_granularity'))} ({scales})"
    if scheme.get("out_bits") is not None:
        text += f" + O{scheme['out_bits']} {_granularity(scheme.get('out_granularity'))}"
    calibration = scheme.get("calibration") or {}
    split = calibration.get("split", "train")
    if "requested_tokens" in calibration:  # --calib-tokens: the windows follow from the window length
        windows = f"{calibration['requested_tokens']:,} calibration tokens"
    else:
        n = calibration.get("windows", scheme.get("calib_windows"))
        windows = f"{n} windows" if split == "all" else f"{n} {split} windows"
    if split == "all":  # --calib-data: a user's own file or folder, all of it
        windows += f" of {Path(str(calibration.get('corpus'))).name}"
    params = scheme.get("algo_params") or {}
    if scheme.get("algo") == "gptq":
        return text + f"; GPTQ ({windows}, damp {params.get('damp')})"
    if scheme.get("algo") == "awq":
        clip = ", clipping searched" if params.get("clip") else ""
        return text + f"; AWQ ({windows}, α grid {params.get('grid')}{clip})"
    return text + "; RTN"


def change_text(record: Mapping[str, Any]) -> float | None:
    return record["metrics"]["ppl_change_pct"] if record.get("status") == "ok" else None


def _failure_text(f: Mapping[str, Any]) -> str:
    """A row's measured failure: ``+98.20 % [+36.83, +187.09], KLD 0.699, top-1 56.4 %`` (NaN/inf when it had no
    finite perplexity)."""
    if f.get("ppl_change_pct") is None:
        return "NaN/inf perplexity"
    text = pct(f["ppl_change_pct"])
    ci = f.get("ppl_change_ci95")
    if ci:
        text += f" [{ci[0]:+.2f}, {ci[1]:+.2f}]"
    if f.get("kld_mean") is not None:
        text += f", KLD {f['kld_mean']:.3g}"
    if f.get("top1_agreement") is not None:
        text += f", top-1 {100 * f['top1_agreement']:.1f} %"
    return text


def verdict_of(
    formats: Sequence[Mapping[str, Any]],
    outliers: Mapping[str, Any],
    fp: Mapping[str, Any],
    sens: Mapping[str, Any] | None,
    tolerance: float,
    metric: str = "ppl",
    avoid_map: Mapping[str, Any] | None = None,
    beat: tuple[int | None, str] | None = None,
) -> dict[str, Any]:
    """Generated from the rows, short lines: the smallest format within tolerance (fewest model bytes; ties:
    smaller change), the formats still undecided (one line), every format to avoid (decidedly beyond, worst first,
    one line), then the worst one's and every mapped one's measured failure with — where a sensitivity map of it
    was measured — the units its damage comes from, what the post-training algorithms rescued, and the measured
    repair with whether it pays (or, with ``beat`` = :func:`size_to_beat`'s answer, why none was tried). Commands
    go to ``commands``, not into the lines."""
    ok = [f for f in formats if f["within_tolerance"] and f["weight_bytes"]]
    smallest = min(ok, key=lambda f: (f["weight_bytes"], f["ppl_change_pct"])) if ok else None
    # measured and decidedly beyond (or NaN/inf): a row the model could not run (unsupported, error) is no failure
    beyond = [
        f
        for f in formats
        if (f["status"] == "ok" and f.get("verdict") == "beyond") or f["status"] == "nonfinite"
    ]
    beyond.sort(key=lambda f: -(math.inf if f["ppl_change_pct"] is None else f["ppl_change_pct"]))
    maps = {m["scheme"]: m for m in (avoid_map, sens) if m}
    avoid = []
    for f in beyond:
        mapped = maps.get(f["scheme"])
        avoid.append(
            {
                "label": f["label"],
                "scheme": f["scheme"],
                "ppl_change_pct": f["ppl_change_pct"],
                "ppl_change_ci95": f.get("ppl_change_ci95"),
                "kld_mean": f.get("kld_mean"),
                "top1_agreement": f.get("top1_agreement"),
                "status": f["status"],
                # the units the sensitivity map blames, worst first, each quantised alone: only those that cost
                # something (a unit that lowers perplexity alone carries none of the damage)
                "blamed": [
                    {"name": u["name"], "ppl_change_pct": u["ppl_change_pct"]}
                    for u in mapped["top"]
                    # a unit that alone makes the perplexity NaN/inf (change None) is the worst of all
                    if u.get("ppl_change_pct") is None or u["ppl_change_pct"] > 0
                ][:3]
                if mapped
                else None,
                "blamed_by": mapped and mapped["by"],
            }
        )
    repair = None
    if sens:
        repair = {"scheme": sens["scheme"], **sens["repair"], "command": sens["command"]}
        if "pays" not in repair:  # a section built before the size to beat was computed for it
            beaten = smallest is None or (
                repair.get("weight_bytes") is not None and repair["weight_bytes"] < smallest["weight_bytes"]
            )
            repair["pays"] = bool(repair["reached"] and beaten)

    limit = tolerance_text(tolerance, metric)
    lines = []
    if smallest:
        lines.append(
            f"Recommended: {smallest['label']} (`{smallest['scheme']}`), {_failure_text(smallest)}, "
            f"{decimal_bytes(smallest['weight_bytes'])}"
            + (f" ({smallest['bytes_vs_bf16']:.1%} of the bf16 model)" if smallest["bytes_vs_bf16"] else "")
            + f": the smallest format within {limit}."
        )
    else:
        lines.append(
            f"Recommended: none — no format measured stays within {limit} (its 95 % interval's upper end)."
        )
    undecided = [f for f in formats if f["status"] == "ok" and f.get("verdict") == "undecided"]
    if undecided:
        parts = []
        for f in undecided:
            ci = f.get("ppl_change_ci95")
            parts.append(
                f"{f['label']} {pct(f['ppl_change_pct'])}"
                + (f" [{ci[0]:+.2f}, {ci[1]:+.2f}]" if ci and f["ppl_change_pct"] is not None else "")
                + (
                    f" (~{f['tokens_to_decide']:,} tokens would decide it 4 times in 5)"
                    if f.get("tokens_to_decide")
                    else ""
                )
            )
        lines.append(f"Undecided (the interval straddles {limit}): " + "; ".join(parts) + ".")
    if avoid:
        listed = ", ".join(
            f"{a['label']} {'NaN/inf' if a['ppl_change_pct'] is None else pct(a['ppl_change_pct'])}"
            for a in avoid
        )
        lines.append(f"Avoid (decidedly beyond {limit}), worst first: {listed}.")
    for i, a in enumerate(avoid):
        if i > 0 and not a["blamed"]:
            continue  # the list above and the format table carry its evidence
        text = f"{'Worst' if i == 0 else 'Avoided'}: {a['label']} (`{a['scheme']}`), {_failure_text(a)}"
        if a["blamed"]:
            units = ", ".join(f"`{u['name']}` {pct(u['ppl_change_pct'])}" for u in a["blamed"])
            text += f"; its damage comes most from {units} (each quantised alone, sensitivity map by {a['blamed_by']})"
        elif a["blamed"] is not None:  # mapped, but no unit alone costs anything
            text += f"; no single unit quantised alone costs more than float (sensitivity map by {a['blamed_by']})"
        lines.append(text + ".")
    if not avoid and not undecided:
        lines.append(f"Every format measured stays within {limit}.")
    lines += _algorithm_lines(formats, limit)
    commands = []
    if repair:
        state = "within" if repair["reached"] else "still NOT within"
        size = f", {decimal_bytes(repair.get('weight_bytes'))}" if repair.get("weight_bytes") else ""
        beat = repair.get("beat") or {}
        if repair["pays"]:
            worth = (
                f"; smaller than {beat['what']} ({decimal_bytes(beat['bytes'])})" if beat.get("bytes") else ""
            )
        elif repair["reached"]:
            what = beat.get("what") or (f"{smallest['label']}, which passes as it is" if smallest else "")
            worth = f"; not smaller than {what}: that is the better choice" if what else ""
        else:
            worth = ""
        ci = repair.get("ppl_change_ci95")
        evidence = (f" [{ci[0]:+.2f}, {ci[1]:+.2f}]" if ci else "") + (
            f", KLD {repair['kld_mean']:.3g}" if repair.get("kld_mean") is not None else ""
        )
        ratio = f" ({repair['bytes_vs_bf16']:.1%} of the bf16 model)" if repair.get("bytes_vs_bf16") else ""
        lines.append(
            f"Repair of `{repair['scheme']}`: keep {repair['count']} unit(s) in float "
            f"({repair['weight_share_float']:.1%} of the quantised weights): "
            f"{pct(repair['quantised_ppl_change_pct'])} → {pct(repair['ppl_change_pct'])}{evidence}{size}{ratio} "
            f"({state} {limit}{worth}"
            + ("" if repair.get("minimised", True) else "; not minimised (standard minimises)")
            + ")."
        )
        for t in (sens or {}).get("tries") or []:
            if t["scheme"] == repair["scheme"]:
                continue
            outcome = (
                "did not reach the tolerance"
                if not t["reached"]
                else f"reached it at {decimal_bytes(t['weight_bytes'])}, not smaller than {beat.get('what', 'what passes')}"
            )
            lines.append(f"Repair also tried on `{t['scheme']}`: {outcome}.")
        commands.append({"what": f"the repair of `{repair['scheme']}`", "command": repair["command"]})
    elif (
        beat
        and beat[0]
        and (sized := [f for f in beyond if f["status"] == "ok" and f.get("weight_bytes")])
        and all(f["weight_bytes"] >= beat[0] for f in sized)
    ):  # what repair_targets found: no candidate smaller than the size to beat (else it was not asked for)
        lines.append(
            f"No repair tried: no format decidedly beyond {limit} is smaller than {beat[1]}: "
            f"{decimal_bytes(beat[0])}; keeping layers in float only adds bytes."
        )
    return {
        "recommended": None
        if smallest is None
        else {k: smallest[k] for k in ("label", "scheme", "ppl_change_pct", "weight_bytes", "bytes_vs_bf16")},
        "avoid": avoid,
        "undecided": [f["label"] for f in undecided],
        "beyond": [f["label"] for f in beyond],
        "repair": repair,
        "lines": lines,
        "commands": commands,
    }


def _algorithm_lines(formats: Sequence[Mapping[str, Any]], limit: str) -> list[str]:
    """Per post-training algorithm row (GPTQ, AWQ, QuaRot) whose round-to-nearest row was measured too: whether the
    algorithm rescues a format that round-to-nearest fails (its verdict turns from beyond to within), or what it
    changed."""
    by_scheme = {f["scheme"]: f for f in formats}
    lines = []
    for f in formats:
        algo = _algo_of(f["scheme"])
        if algo is None:
            continue
        rtn = by_scheme.get(rtn_scheme(f["scheme"]))
        if rtn is None or f["status"] != "ok" or rtn["status"] != "ok":
            continue
        change = f"{pct(rtn['ppl_change_pct'])} → {pct(f['ppl_change_pct'])}"
        if rtn.get("verdict") == "beyond" and f.get("verdict") == "within":
            lines.append(
                f"{algo} rescues {rtn['label']}: {change}, within {limit} where round-to-nearest is not."
            )
        elif rtn.get("verdict") == "beyond":
            state = "undecided" if f.get("verdict") == "undecided" else "still beyond"
            lines.append(f"{algo} does not rescue {rtn['label']}: {change} ({state} {limit}).")
    return lines


_ALGO_NAMES = {"gptq": "GPTQ", "awq": "AWQ", "quarot": "QuaRot"}


def _algo_of(scheme: str) -> str | None:
    """The post-training algorithms a scheme name asks for (``…:algo=gptq``, ``…:rotate=quarot``, both: ``QuaRot +
    GPTQ``), None for plain round-to-nearest."""
    items = scheme.partition(":")[2].split(",")
    found = [
        i.split("=", 1)[1]
        for i in items
        if (i.startswith("rotate=") and i != "rotate=none") or (i.startswith("algo=") and i != "algo=rtn")
    ]
    found.sort(key=lambda a: a != "quarot")  # the rotation first: it happens before the rounding
    return " + ".join(_ALGO_NAMES.get(a, a.upper()) for a in found) or None


def not_measured(
    formats: Sequence[Mapping[str, Any]],
    kv: Mapping[str, Any],
    speed: bool,
    protocol: Mapping[str, Any],
    settings: Mapping[str, Any],
) -> list[str]:
    """What this card did not measure, from what it did: a person shipping the model needs the gaps as much as
    the numbers."""
    measured = {f["scheme"] for f in formats}
    missing = [
        f.label for f in FORMATS if f.scheme not in measured and canonical_scheme(f.scheme) not in measured
    ]
    algos = [f["label"] for f in formats if _algo_of(f["scheme"])]
    lines = [
        (
            f"Algorithms: GPTQ, AWQ or QuaRot in the rows that say so ({', '.join(algos)}); every other format is "
            "round-to-nearest"
            if algos
            else "Algorithms: every format is round-to-nearest at its standard settings (`--budget standard` adds "
            "GPTQ, AWQ and QuaRot rows)"
        )
        + " — no SmoothQuant α search or learned rotation (SpinQuant) was applied (each would change these rows). "
        "Activation scales are dynamic (each sequence's own) in every row that quantises activations"
        + (
            ""
            if any(f.get("quantised") and "static scales" in f["quantised"] for f in formats)
            else "; static (calibrated once) scales, what an int8 serving engine may use, were not measured "
            "(`--scheme absmax-coarse:static=true`)"
        )
        + ".",
        f"Tasks: next-token quality on {protocol.get('corpus')}/{protocol.get('split')} only "
        f"({protocol.get('tokens_scored'):,} tokens, window {protocol.get('window')}); no downstream task "
        "(`qbench lm-eval` runs lm-evaluation-harness tasks on a quantised model).",
    ]
    if missing:
        lines.append(
            f"Formats not in the {settings.get('budget')} budget: {', '.join(missing)} (`--budget standard`)."
        )
    fake_only = [f["label"] for f in formats if f.get("decode_speedup") is None and f.get("weight_bits")]
    lines.append(
        "Speed: the linear layers' real kernels on this model's shapes only (decode × / prefill ×)"
        + (
            "; whole-model prefill in the rows' model prefill ×"
            if speed
            else "; no whole-model prefill or generation (`--budget full`, or `qbench speed --ckpt …`)"
        )
        + (f"; no real kernel here (fake quantisation only): {', '.join(fake_only)}" if fake_only else "")
        + ". Memory: the rows' nominal sizes and a KV cache at the model's context; peak memory of an inference "
        "run not measured."
    )
    refused = [f for f in formats if f.get("status") not in ("ok", "nonfinite")]
    if refused:
        reasons: dict[str, list[str]] = {}
        for f in refused:
            reasons.setdefault(str(f.get("error") or f.get("status")), []).append(f["label"])
        lines.append(
            "Formats this model cannot take: "
            + "; ".join(f"{', '.join(labels)} ({why})" for why, labels in reasons.items())
            + "."
        )
    skipped = [str(r.get("label")) for r in kv.get("rows", []) if r.get("status") == "skipped"]
    if skipped:
        lines.append(f"KV rows skipped: {', '.join(skipped)} (the KV caption says why).")
    lines.append(
        "Hardware: fake quantisation computes in float on this machine; real kernels and other devices round "
        "differently (speed and the real-kernel rows say where they were measured)."
    )
    return lines


def comparison_lines(rows: Sequence[Mapping[str, Any]]) -> list[str]:
    """The side-by-side verdict in words, from relative damage and absolute quality together, a line per finding
    (formats with the same finding grouped): which model is decidedly better to ship in which formats, where the
    model that loses less to quantisation is still the worse one to ship, and which quantised model stays below
    another's float perplexity."""
    lines = []
    formats = [c for c in rows if c["section"] == "formats"]
    for c in rows:
        if c["section"] == "float" and c.get("better_to_ship"):
            lines.append(f"In float, {c['better_to_ship']} has the decidedly lower perplexity.")

    def grouped(kind: str, found: dict[str, list[str]]) -> None:
        for name, labels in found.items():
            where = (
                f"every format measured ({len(labels)})"
                if len(labels) == len(formats)
                else f"{len(labels)} of {len(formats)} formats: {', '.join(labels)}"
            )
            lines.append(f"{name} {kind} in {where}.")

    ship: dict[str, list[str]] = {}
    below: dict[str, list[str]] = {}
    for c in formats:
        robust, best = c.get("more_robust"), c.get("better_to_ship")
        if best:
            ship.setdefault(best, []).append(c["row"])
        if robust and best and robust != best:
            lines.append(
                f"{c['row']}: {robust} loses less to quantisation, but {best} quantised is still decidedly better "
                f"(ppl {c['perplexity'][best]:.2f} vs {c['perplexity'][robust]:.2f})."
            )
        for name, others in (c.get("below_others_float") or {}).items():
            if name != best:
                below.setdefault(
                    f"{name} quantised is decidedly below {', '.join(others)} in float", []
                ).append(c["row"])
    grouped("is decidedly better to ship", ship)
    for text, labels in below.items():
        lines.append(f"{text}: {', '.join(labels)}.")
    return lines
