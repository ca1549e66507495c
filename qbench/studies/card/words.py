"""Every sentence the card says: the verdict's lines, what was not measured, the quantised text and the comparison's
lines — from rows and decisions already made (:class:`~.decide.Verdict`, :class:`~.compare.Findings`); nothing
here decides. No torch either: a card's words can be written from card.json's rows alone."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from qbench.eval.sampling import scored_text
from qbench.eval.tolerance import (
    decisions_text,
    ends_text,
    interval_text,
    row_interval,
    tolerance_text,
    value_text,
)
from qbench.studies.card.compare import Findings
from qbench.studies.card.decide import Avoid, Repair, Rescue, Verdict
from qbench.studies.card.plan import FORMATS, canonical_scheme
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
    if scheme.get("weight_clip") == "mse":  # QuaRot's weight range search (qbench.quant.clip)
        text += ", range searched"
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
        if scheme.get("act_clip"):  # QuaRot's activation clip ratio
            scales += f" clipped at {scheme['act_clip']:g} of the range"
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
    # block by block through the quantised blocks (the default since it existed; earlier records: float inputs)
    sequential = ", sequential" if params.get("sequential") else ""
    if scheme.get("algo") == "gptq":
        return text + f"; GPTQ ({windows}, damp {params.get('damp')}{sequential})"
    if scheme.get("algo") == "awq":
        clip = ", clipping searched" if params.get("clip") else ""
        return text + f"; AWQ ({windows}, α grid {params.get('grid')}{clip}{sequential})"
    return text + "; RTN"


def change_text(record: Mapping[str, Any]) -> float | None:
    return record["metrics"]["ppl_change_pct"] if record.get("status") == "ok" else None


class _Words:
    """How the lines say a row's evidence: on ``metric`` (its ``tolerance``) the value and interval the verdict
    read (``qbench.eval.tolerance``), in its unit; on ppl the change as the card always said it."""

    def __init__(self, tolerance: float, metric: str = "ppl") -> None:
        self.tolerance, self.metric = tolerance, metric
        self.limit = tolerance_text(tolerance, metric)

    def value(self, f: Mapping[str, Any]) -> str:
        """A row's deciding value alone: ``+0.97 %``, ``KLD 0.0123 nats``, ``NaN`` (no finite number)."""
        if self.metric == "ppl":
            return pct(f.get("ppl_change_pct"))
        return value_text(row_interval(f, self.metric)[0], self.metric, self.tolerance)

    def interval(self, f: Mapping[str, Any]) -> str:
        """A row's deciding value with its interval: ``+0.97 % [+0.41, +1.53]`` (an interval's ends in full, as the
        lines always wrote them), ``KLD 0.0123 nats [0.0101, 0.0145]``."""
        value, ci = row_interval(f, self.metric)
        if self.metric != "ppl":
            return interval_text(value, ci, self.metric, self.tolerance)
        return pct(value) + (f" {ends_text(ci, cap=False)}" if ci and value is not None else "")

    def failure(self, f: Mapping[str, Any]) -> str:
        """A row's measured failure: ``+98.20 % [+36.83, +187.09], KLD 0.699, top-1 56.4 %`` (NaN/inf when it had
        no finite perplexity); on kld or top1 that metric's value and interval first, ``KLD 0.6990 nats [0.5012,
        0.8968], perplexity +98.20 %, top-1 56.4 %``."""
        if f.get("ppl_change_pct") is None:
            return "NaN/inf perplexity"
        if self.metric == "ppl":
            text = self.interval(f)
        else:
            text = f"{self.interval(f)}, perplexity {pct(f['ppl_change_pct'])}"
        if f.get("kld_mean") is not None and self.metric != "kld":
            text += f", KLD {f['kld_mean']:.3g}"
        if f.get("top1_agreement") is not None:
            text += f", top-1 {100 * f['top1_agreement']:.1f} %"
        return text


def verdict_lines(
    verdict: Verdict, tolerance: float, metric: str = "ppl"
) -> tuple[list[str], list[dict[str, str]]]:
    """The verdict in short lines: the recommended format, the formats still undecided (one line), every format to
    avoid (one line, worst first), then the worst one's and every mapped one's measured failure with the units its
    damage comes from, what the post-training algorithms rescued, and the repair with whether it pays (or why none
    was tried). Commands go to the second list (card.json's ``commands``), not into the lines."""
    say = _Words(tolerance, metric)
    limit = say.limit
    lines = [_recommended_line(verdict.recommended, say)]
    if verdict.undecided:
        lines.append(_undecided_line(verdict.undecided, say))
    lines += _avoid_lines(verdict.avoid, say)
    if not verdict.avoid and not verdict.undecided:
        lines.append(f"Every format measured stays within {limit}.")
    lines += [_rescue_line(r, say) for r in verdict.rescues]
    commands = []
    if verdict.repair:
        lines += _repair_lines(verdict.repair, verdict.recommended, say)
        commands.append(
            {"what": f"the repair of `{verdict.repair.scheme}`", "command": verdict.repair.command}
        )
    elif verdict.no_repair:
        lines.append(
            f"No repair tried: no format decidedly beyond {limit} is smaller than {verdict.no_repair.what}: "
            f"{decimal_bytes(verdict.no_repair.bytes)}; keeping layers in float only adds bytes."
        )
    return lines, commands


def decisions_line(decisions: Mapping[str, Any] | None, tolerance: float, metric: str = "ppl") -> str | None:
    """How many verdicts a model's section made and the false *within* calls they could make were every row
    exactly at the tolerance (``decisions``: ``qbench.eval.tolerance.decisions_block``); None with fewer than
    two."""
    if not decisions or decisions["count"] < 2:
        return None
    what = "format and KV rows and the breaking points' cells, each record once"
    return "Decisions: " + decisions_text(decisions, tolerance, metric, what)


def _recommended_line(row: Mapping[str, Any] | None, say: _Words) -> str:
    limit = say.limit
    if row is None:
        return f"Recommended: none — no format measured stays within {limit} (its 95 % interval's upper end)."
    return (
        f"Recommended: {row['label']} (`{row['scheme']}`), {say.failure(row)}, "
        f"{decimal_bytes(row['weight_bytes'])}"
        + (f" ({row['bytes_vs_bf16']:.1%} of the bf16 model)" if row["bytes_vs_bf16"] else "")
        + f": the smallest format within {limit}."
    )


def _undecided_line(rows: Sequence[Mapping[str, Any]], say: _Words) -> str:
    """One line for every undecided format: its change (on kld or top1 that metric's value), interval and the
    tokens that would decide it."""
    limit = say.limit
    parts = []
    for f in rows:
        parts.append(
            f"{f['label']} {say.interval(f)}"
            + (
                f" (~{f['tokens_to_decide']:,} tokens would decide it 4 times in 5)"
                if f.get("tokens_to_decide")
                else ""
            )
        )
    return f"Undecided (the interval straddles {limit}): " + "; ".join(parts) + "."


def _avoid_lines(avoid: Sequence[Avoid], say: _Words) -> list[str]:
    """One line listing every format to avoid, then the worst one's and every mapped one's failure with the
    units its map blames (the list and the format table carry an unmapped one's evidence)."""
    if not avoid:
        return []
    limit = say.limit
    listed = ", ".join(
        f"{a.row['label']} {'NaN/inf' if a.row['ppl_change_pct'] is None else say.value(a.row)}"
        for a in avoid
    )
    lines = [f"Avoid (decidedly beyond {limit}), worst first: {listed}."]
    for i, a in enumerate(avoid):
        if i > 0 and not a.blamed:
            continue
        text = f"{'Worst' if i == 0 else 'Avoided'}: {a.row['label']} (`{a.row['scheme']}`), {say.failure(a.row)}"
        if a.blamed:
            units = ", ".join(f"`{u.name}` {pct(u.ppl_change_pct)}" for u in a.blamed)
            text += f"; its damage comes most from {units} (each quantised alone, sensitivity map by {a.blamed_by})"
        elif a.blamed is not None:  # mapped, but no unit alone costs anything
            text += (
                f"; no single unit quantised alone costs more than float (sensitivity map by {a.blamed_by})"
            )
        lines.append(text + ".")
    return lines


def _rescue_line(r: Rescue, say: _Words) -> str:
    """Whether a post-training algorithm rescues a format that round-to-nearest fails, or what it changed (on kld
    or top1: that metric's values, the algorithm's with its interval)."""
    algo, limit = _algo_of(r.row["scheme"]), say.limit
    change = (
        f"{pct(r.rtn['ppl_change_pct'])} → {pct(r.row['ppl_change_pct'])}"
        if say.metric == "ppl"
        else f"{say.value(r.rtn)} → {say.interval(r.row)}"
    )
    if r.rescued:
        return f"{algo} rescues {r.rtn['label']}: {change}, within {limit} where round-to-nearest is not."
    state = "undecided" if r.row.get("verdict") == "undecided" else "still beyond"
    return f"{algo} does not rescue {r.rtn['label']}: {change} ({state} {limit})."


def _repair_lines(repair: Repair, recommended: Mapping[str, Any] | None, say: _Words) -> list[str]:
    """The repair shown: what it keeps in float, the change before and after with its evidence and size (on kld or
    top1 that metric's values first, where the repair holds them), and whether it pays; then every other format
    a repair was tried on."""
    limit = say.limit
    state = "within" if repair.reached else "still NOT within"
    size = f", {decimal_bytes(repair.weight_bytes)}" if repair.weight_bytes else ""
    if repair.pays:
        worth = (
            f"; smaller than {repair.beat_what} ({decimal_bytes(repair.beat_bytes)})"
            if repair.beat_bytes
            else ""
        )
    elif repair.reached:
        what = repair.beat_what or (f"{recommended['label']}, which passes as it is" if recommended else "")
        worth = f"; not smaller than {what}: that is the better choice" if what else ""
    else:
        worth = ""
    ci = repair.ppl_change_ci95
    evidence = (f" [{ci[0]:+.2f}, {ci[1]:+.2f}]" if ci else "") + (
        f", KLD {repair.kld_mean:.3g}" if repair.kld_mean is not None else ""
    )
    change = f"{pct(repair.quantised_ppl_change_pct)} → {pct(repair.ppl_change_pct)}{evidence}"
    if say.metric != "ppl" and repair.decision is not None:  # the metric's values, as the repair decided
        before = say.value({"decision": repair.quantised_decision})
        after = say.interval({"decision": repair.decision})
        change = f"{before} → {after} (perplexity {pct(repair.quantised_ppl_change_pct)} → {pct(repair.ppl_change_pct)})"
    ratio = f" ({repair.bytes_vs_bf16:.1%} of the bf16 model)" if repair.bytes_vs_bf16 else ""
    lines = [
        f"Repair of `{repair.scheme}`: keep {repair.count} unit(s) in float "
        f"({repair.weight_share_float:.1%} of the quantised weights): "
        f"{change}{size}{ratio} "
        f"({state} {limit}{worth}"
        + ("" if repair.minimised else "; not minimised (standard minimises)")
        + ")."
    ]
    beaten = repair.beat_what or "what passes"
    for t in repair.others:
        outcome = (
            f"reached it at {decimal_bytes(t.weight_bytes)}, not smaller than {beaten}"
            if t.reached
            else "did not reach the tolerance"
        )
        lines.append(f"Repair also tried on `{t.scheme}`: {outcome}.")
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


def llama_cpp_line(rows: Sequence[Mapping[str, Any]], tolerance: float, metric: str = "ppl") -> str:
    """The verdict's llama.cpp line: the smallest file type decidedly within the tolerance, and the smaller types
    the card could not decide — or that none passes."""
    limit = tolerance_text(tolerance, metric)

    def said(r: Mapping[str, Any]) -> str:
        value, ci = row_interval(r, metric)
        return f"{r['type']} ({decimal_bytes(r['bytes'])}, {interval_text(value, ci, metric, tolerance)})"

    ran = [r for r in rows if r.get("status") == "ok" and r.get("bytes")]
    passing = [r for r in ran if r.get("verdict") == "within"]
    best = min(passing, key=lambda r: r["bytes"], default=None)
    if best is None:
        undecided = [r["type"] for r in ran if r.get("verdict") == "undecided"]
        tail = f"; undecided: {', '.join(undecided)}" if undecided else ""
        return f"llama.cpp: none of {len(rows)} file types measured is decidedly within {limit}{tail}."
    smaller = [r["type"] for r in ran if r["bytes"] < best["bytes"] and r.get("verdict") == "undecided"]
    tail = f"; smaller and undecided: {', '.join(smaller)}" if smaller else ""
    return f"llama.cpp: the smallest file type within {limit} is {said(best)}{tail}."


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
        f"({_scored(protocol)}); no downstream task "
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


def comparison_lines(found: Findings) -> list[str]:
    """The side-by-side verdict in words (:func:`~.compare.findings`), from relative damage and absolute quality
    together, a line per finding: which model is decidedly better in float, where the model that loses less to
    quantisation is still the worse one to ship, which model is decidedly better to ship in which formats, and
    which quantised model stays below another's float perplexity."""
    lines = [f"In float, {name} has the decidedly lower perplexity." for name in found.better_in_float]
    lines += [
        f"{t.row}: {t.robust} loses less to quantisation, but {t.better} quantised is still decidedly better "
        f"(ppl {t.perplexity_better:.2f} vs {t.perplexity_robust:.2f})."
        for t in found.trade_offs
    ]
    for s in found.better_to_ship:
        where = (
            f"every format measured ({len(s.rows)})"
            if len(s.rows) == found.formats
            else f"{len(s.rows)} of {found.formats} formats: {', '.join(s.rows)}"
        )
        lines.append(f"{s.model} is decidedly better to ship in {where}.")
    lines += [
        f"{b.model} quantised is decidedly below {', '.join(b.others)} in float: {', '.join(b.rows)}."
        for b in found.below_float
    ]
    return lines


def _scored(protocol: Mapping[str, Any]) -> str:
    """The tokens scored and their windows; a card of the first windows (made before sampling) as it always read."""
    if "sampled" in protocol:
        return scored_text(protocol)
    return f"{protocol.get('tokens_scored'):,} tokens, window {protocol.get('window')}"
