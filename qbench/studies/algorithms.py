"""``qbench algorithms``: the post-training algorithms a practitioner tries first, side by side on one grid.

For each model and each low-bit format (:data:`FORMATS`: int4 per channel, int4 g128, int3 g128, W4A8, W4A4) the
same weights are quantised with every algorithm of :data:`ALGORITHMS` — round-to-nearest, GPTQ
(``qbench.quant.gptq``), AWQ (``qbench.quant.awq``), an in-layer Hadamard rotation before round-to-nearest and
before GPTQ, and QuaRot's rotation of the residual stream (``qbench.quant.quarot``: norms folded, an online
Hadamard before o_proj and down_proj) before round-to-nearest and before GPTQ — and scored on the same tokens by the harness (records, per-token evidence, reuse as in ``qbench
grid``). The table (``table.md``, generated from ``algorithms.json``) gives per cell the perplexity change against
the float model with its 95 % interval, the mean KL divergence, and the time the quantisation took (the cell's wall
time minus its evaluation, calibration included); per format which algorithm is best, decided from *paired*
intervals on the same tokens (the per-token NLL of each algorithm against round-to-nearest's).

With several models, the first is the baseline (the model one already has, e.g. ``vanilla``) and each other model
(a training-time remedy) is compared with round-to-nearest against the baseline's best algorithm: *below* when its
interval lies wholly below the baseline's, *above* when wholly above, else *overlapping* (the models differ, so
these intervals are not paired). The models must share a tokenizer (the same token count is other text for another
vocabulary): a mix is refused before anything runs (:func:`check_inputs`), as ``qbench card`` refuses one.

Every input is checked before anything is written (:func:`check_inputs`), and the table states the calibration the
GPTQ/AWQ cells really took: the text, the tokens it holds, and the windows and tokens taken from it.

llama.cpp's own file types (``--llama-cpp``, default :data:`LLAMA_CPP_DEFAULT`: Q8_0 … Q2_K) are scored on the same
tokens as rows of their own (``gguf:<type>`` cells, ``qbench.quant.llamacpp``): each with its file's size and bits
per weight, its change and KL divergence, and its perplexity paired against the best algorithm at int4 g128 (the
format the k-quants compete with); the smallest type within :data:`LLAMA_CPP_TOLERANCE_PCT` of the float model is
named. Without llama-cpp-python the default rows are left out and the table says so; asked for by name, they are
refused in one line.

Two rotations, said apart in the table: "Hadamard" is the in-layer rotation of the ``hadamard-*`` schemes (each
linear's input and weight rows rotated inside the layer, the residual stream untouched); "QuaRot" rotates the
residual stream itself (``rotate=quarot``), for the pre-norm RMSNorm models it can fold (qbench's Llama-style
models, transformers' Llama, Mistral, Qwen2/3) — elsewhere its cells record the one-line refusal.
"""

from __future__ import annotations

import math
import os
import platform
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from models.errors import UserError, unknown_choice
from models.io import atomic_write_json, atomic_write_text
from qbench.eval.sampling import scored_text, window_documents

# (label, the round-to-nearest scheme, the same grid after the in-layer Hadamard rotation)
FORMATS: tuple[tuple[str, str, str], ...] = (
    ("int4 per channel", "zeropoint-int4", "hadamard-zeropoint-int4"),
    ("int4 g128", "zeropoint-int4-g128", "hadamard-zeropoint-int4:group=128"),
    ("int3 g128", "zeropoint-int3-g128", "hadamard-zeropoint-int4:group=128,w=3"),
    ("W4A8 per channel/token", "absmax-w4a8", "hadamard-absmax-coarse:agran=token,group=none,o=none,w=4"),
    (
        "W4A4 per channel/token",
        "absmax-fine:a=4,w=4",
        "hadamard-absmax-coarse:a=4,agran=token,group=none,o=none,w=4",
    ),
)
ALGORITHMS = ("rtn", "gptq", "awq", "hadamard", "hadamard+gptq", "quarot", "quarot+gptq")
# llama.cpp's file types scored beside them: what a llama.cpp user downloads, from 8.5 to ~2.6 bits per weight
LLAMA_CPP_DEFAULT = ("Q8_0", "Q6_K", "Q5_K_M", "Q4_K_M", "Q4_0", "IQ4_NL", "Q3_K_M", "Q2_K")
LLAMA_CPP_TOLERANCE_PCT = 1.0  # "smallest llama.cpp type within 1 %" (the card's default tolerance)
LLAMA_CPP_AGAINST = 1  # FORMATS index the types are paired against: int4 g128
ALGORITHM_LABELS = {
    "rtn": "RTN",
    "gptq": "GPTQ",
    "awq": "AWQ",
    "hadamard": "Hadamard + RTN",
    "hadamard+gptq": "Hadamard + GPTQ",
    "quarot": "QuaRot + RTN",
    "quarot+gptq": "QuaRot + GPTQ",
}
FORMAT_LABELS = tuple(f[0] for f in FORMATS)
FORMAT_KEYS = {"int4": 0, "int4-g128": 1, "int3-g128": 2, "w4a8": 3, "w4a4": 4}  # --formats names


def _with(name: str, item: str) -> str:
    return f"{name}{',' if ':' in name else ':'}{item}"


def scheme_for(format_index: int, algo: str) -> str:
    """The canonical scheme name of one (format, algorithm) cell."""
    from qbench.quant.schemes import get_scheme

    if algo not in ALGORITHMS:
        raise unknown_choice("algorithm", algo, ALGORITHMS)
    _, rtn, rotated = FORMATS[format_index]
    name = {
        "rtn": rtn,
        "gptq": _with(rtn, "algo=gptq"),
        "awq": _with(rtn, "algo=awq"),
        "hadamard": rotated,
        "hadamard+gptq": _with(rotated, "algo=gptq"),
        "quarot": _with(rtn, "rotate=quarot"),
        "quarot+gptq": _with(rtn, "rotate=quarot,algo=gptq"),
    }[algo]
    return get_scheme(name).name


@dataclass(frozen=True)
class AlgorithmsConfig:
    models: tuple[str, ...]
    formats: tuple[str, ...] = tuple(FORMAT_KEYS)
    algorithms: tuple[str, ...] = ALGORITHMS
    output_path: Path = Path("results/algorithms")
    command: str = ""
    llama_cpp: tuple[str, ...] = ()  # llama.cpp file types scored as rows of their own (gguf:<type> cells)
    llama_cpp_skipped: str | None = None  # why the default llama.cpp rows were left out (said in the table)

    def format_indices(self) -> list[int]:
        return [FORMAT_KEYS[key] for key in _checked_list("--formats", self.formats, tuple(FORMAT_KEYS))]

    def check(self) -> None:
        self.format_indices()
        _checked_list("--algorithms", self.algorithms, ALGORITHMS)
        if self.llama_cpp:
            from qbench.quant.gguf_types import GGUF_TYPES

            _checked_list("--llama-cpp", self.llama_cpp, tuple(GGUF_TYPES))
        if "rtn" not in self.algorithms:
            raise UserError("--algorithms must include rtn: every other algorithm is compared with it")


def _checked_list(option: str, items: Sequence[str], choices: Sequence[str]) -> Sequence[str]:
    """``items`` when each is a known choice named once; an empty list or item (``--formats ,``) would run
    nothing (or less than asked) and exit 0, and a repeated name repeats rows: both are almost surely typos."""
    given = ",".join(items)
    if not any(items):
        raise UserError(f"{option} {given!r} names nothing; give a comma list of: {', '.join(choices)}")
    if not all(items):
        raise UserError(
            f"{option} {given!r} has an empty item (a doubled or trailing comma); choose from: {', '.join(choices)}"
        )
    for item in items:
        if item not in choices:
            raise unknown_choice(option, item, choices)
    repeated = next((item for i, item in enumerate(items) if item in items[:i]), None)
    if repeated is not None:
        raise UserError(f"{option} {given!r} names {repeated!r} twice; give each once")
    return items


def schemes(cfg: AlgorithmsConfig) -> list[str]:
    from qbench.quant.gguf_types import scheme_name

    return [scheme_for(i, a) for i in cfg.format_indices() for a in cfg.algorithms] + [
        scheme_name(t) for t in cfg.llama_cpp
    ]


def check_inputs(cfg: AlgorithmsConfig, spec: Any) -> tuple[dict[str, Any], dict[str, Any]]:
    """Refuse every bad input before anything is written (one line each), so a refused command leaves no output
    folder behind: the lists, the output path, each model (it loads, is given once, has a name of its own, passes
    the grid's own checks), one tokenizer for all of them, and calibration text that holds a window for each.

    Returns (the models to hand to ``run_grid``: the one model of a one-model run, so it is loaded once; with
    several, each is loaded again in turn rather than all held at once) and the calibration each model's
    calibrated cells really take (:func:`_calibration_taken`, by model name; {} when no algorithm calibrates)."""
    from qbench.eval.harness import ModelEvaluation
    from qbench.quant.calibrate import needs_calibration

    cfg.check()
    out = Path(cfg.output_path)
    if out.exists() and not out.is_dir():
        raise UserError(
            f"--output-path {out} is an existing file; give a folder for the records and the table"
        )
    calibrated = [spec.scheme(n) for n in spec.schemes if needs_calibration(spec.scheme(n))]
    if not calibrated and (spec.calibration.data is not None or spec.calibration.tokens is not None):
        raise UserError(
            f"--calib-data / --calib-tokens are given, but none of --algorithms {','.join(cfg.algorithms)} "
            "calibrates (gptq, awq, hadamard+gptq and quarot+gptq do); leave them out or add one of those"
        )
    loaded: dict[str, Any] = {}
    sources: dict[str, str] = {}  # model name -> the --ckpt that named it
    seen: dict[str, str] = {}  # real path (or hub name) -> the --ckpt that named it
    tokenizers: list[tuple[str, Any]] = []
    calibration: dict[str, Any] = {}
    for model in spec.models:
        evaluation = ModelEvaluation(spec, model)
        lm = evaluation.lm
        key = os.path.realpath(lm.source) if os.path.exists(lm.source) else lm.source
        if key in seen:
            raise UserError(
                f"--ckpt {seen[key]} and --ckpt {model} name the same model ({key}); give each model once"
            )
        if lm.name in sources:
            raise UserError(
                f"--ckpt {sources[lm.name]} and --ckpt {model} are both named {lm.name!r}: their results would "
                f"share {Path(spec.output_path) / lm.name}/; rename one folder or run them separately"
            )
        seen[key], sources[lm.name] = model, model
        tokenizers.append((lm.name, lm.tokenizer))
        _check_tokenizers(tokenizers)
        evaluation.check()
        if calibrated:
            calibration[lm.name] = _calibration_taken(spec, lm, evaluation.windows.window, calibrated)
        if len(spec.models) == 1:
            loaded[model] = lm
    return loaded, calibration


def _check_tokenizers(named: Sequence[tuple[str, Any]]) -> None:
    """Models of one run share a tokenizer: the same token count is other text for another vocabulary, so the
    remedies' relations (each model's change against the first's) would compare numbers made on different text.
    Refused, as ``qbench card`` refuses such a mix (its ``check_tokenizers``), rather than marked: every row of the
    table would otherwise need two readings."""
    from models.tokenizer import tokenizer_fingerprint

    (first, tok0), (name, tok) = named[0], named[-1]
    fp0, fp = tokenizer_fingerprint(tok0), tokenizer_fingerprint(tok)
    if fp != fp0:
        from qbench.studies.card.config import tokenizer_name

        raise UserError(
            f"{first} and {name} use different tokenizers ({first}: {tokenizer_name(tok0, fp0)}; {name}: "
            f"{tokenizer_name(tok, fp)}): the same token count is different text for each, so their cells would "
            "not compare; run them in separate qbench algorithms runs"
        )


def _calibration_taken(spec: Any, lm: Any, window: int, calibrated: Sequence[Any]) -> dict[str, Any]:
    """What the calibrated cells of one model really calibrate on, from the harness's own
    ``calibration_sample``: the text (``--calib-data`` or the scored corpus's train split), the tokens it holds
    and the windows and tokens taken (text holding no window was refused by the grid's own check)."""
    from qbench.eval.adapters import context_length
    from qbench.eval.harness import calibration_sample, calibration_text_tokens, calibration_window

    cal, protocol = spec.calibration, spec.protocol
    context = context_length(lm.model, protocol.window)
    corpus, split, held = calibration_text_tokens(spec, lm.tokenizer, window, context)
    length = calibration_window(cal, window, context)
    taken = []
    for key in dict.fromkeys((s.calib_count, s.calib_seed) for s in calibrated):
        scheme = next(s for s in calibrated if (s.calib_count, s.calib_seed) == key)
        sample = calibration_sample(lm.tokenizer, protocol, window, scheme, cal, context)
        taken.append(
            {
                "windows_requested": cal.windows(scheme.calib_count, length),
                "windows": int(sample.ids.shape[0]),
                "window": int(sample.ids.shape[1]),
                "tokens": int(sample.ids.numel()),
                "held_out_windows": sample.record["held_out_windows"],
                "sample": cal.sample,
                "seed": scheme.calib_seed,
                "schemes": [s.name for s in calibrated if (s.calib_count, s.calib_seed) == key],
            }
        )
    return {
        "corpus": corpus,
        "split": split,
        "given": cal.data is not None,
        "tokens_held": held,
        "taken": taken,
    }


def token_nll(output_path: Path, record: Mapping[str, Any]) -> Any:
    from qbench.eval.evidence import read

    path = output_path / record["model"]["name"] / "record.json"  # the sidecar lies beside the record
    data = read(path, record)
    return None if data is None else data["nll"]


def paired_change_ci(a: Any, b: Any, clusters: list[str] | None = None) -> list[float] | None:
    """95 % interval (percent) of ppl(a) / ppl(b) − 1 on the same tokens: their documents (``clusters``), else the
    windows, as clusters."""
    if a is None or b is None or a.shape != b.shape:
        return None
    from qbench.eval.evidence import paired_metrics

    return paired_metrics(a, b, clusters)["ppl_change_ci95"]


def cell_summary(record: Mapping[str, Any]) -> dict[str, Any]:
    m = record.get("metrics") or {}
    ok = record.get("status") == "ok"
    quant_s = None
    if record.get("wall_seconds") is not None and record.get("eval_seconds") is not None:
        quant_s = max(float(record["wall_seconds"]) - float(record["eval_seconds"]), 0.0)
    return {
        "scheme": record["scheme"]["name"],
        "status": record.get("status"),
        "error": record.get("error"),
        "ppl": m.get("perplexity") if ok else None,
        "ppl_change_pct": m.get("ppl_change_pct") if ok else None,
        "ppl_change_ci95": m.get("ppl_change_ci95") if ok else None,
        "kld_mean": m.get("kld_mean") if ok else None,
        "top1_agreement": m.get("top1_agreement") if ok else None,
        "quantize_seconds": quant_s,
        "eval_seconds": record.get("eval_seconds"),
    }


def build(
    cfg: AlgorithmsConfig,
    records: Sequence[Mapping[str, Any]],
    output_path: Path,
    calibration: Mapping[str, Any] | None = None,
) -> dict[str, Any]:
    """The comparison (algorithms.json's content) from the grid's records; ``calibration``: what each model's
    calibrated cells took (:func:`check_inputs`), stated as it is."""
    by_key = {(r["model"]["name"], r["scheme"]["name"]): r for r in records}
    fps = [r for r in records if r["scheme"]["name"] == "fp"]
    models = list(dict.fromkeys(r["model"]["name"] for r in fps))
    rows = []
    for model in models:
        for i in cfg.format_indices():
            cells, nll = {}, {}
            fp = by_key.get((model, "fp"))
            clusters = window_documents(fp["protocol"]) if fp else None
            for algo in cfg.algorithms:
                record = by_key.get((model, scheme_for(i, algo)))
                if record is None:
                    continue
                cells[algo] = cell_summary(record)
                nll[algo] = token_nll(output_path, record) if record.get("status") == "ok" else None
            for algo, cell in cells.items():  # paired against round-to-nearest on the same tokens
                cell["vs_rtn_ci95"] = (
                    None if algo == "rtn" else paired_change_ci(nll.get(algo), nll.get("rtn"), clusters)
                )
                ci = cell["vs_rtn_ci95"]
                cell["vs_rtn"] = (
                    None if ci is None else ("better" if ci[1] < 0 else "worse" if ci[0] > 0 else "undecided")
                )
            ranked = sorted(
                (a for a, c in cells.items() if c["ppl_change_pct"] is not None),
                key=lambda a: cells[a]["ppl_change_pct"],
            )
            best = ranked[0] if ranked else None
            tie = []
            if best is not None:
                for other in ranked[1:]:
                    ci = paired_change_ci(nll.get(best), nll.get(other), clusters)
                    if ci is None or ci[1] >= 0:  # not decidedly better than this one
                        tie.append(other)
            rows.append(
                {
                    "model": model,
                    "format": FORMATS[i][0],
                    "cells": cells,
                    "best": best,
                    "best_tied_with": tie,
                }
            )
    remedies = _remedies(rows, models)
    llama_rows = _llama_cpp_rows(cfg, by_key, models, rows, output_path)
    fp0 = fps[0] if fps else {}
    return {
        "command": cfg.command,
        "models": models,
        "formats": [FORMATS[i][0] for i in cfg.format_indices()],
        "algorithms": list(cfg.algorithms),
        "schemes": {
            FORMATS[i][0]: {a: scheme_for(i, a) for a in cfg.algorithms} for i in cfg.format_indices()
        },
        "fp_perplexity": {r["model"]["name"]: (r.get("metrics") or {}).get("perplexity") for r in fps},
        "protocol": fp0.get("protocol"),
        "env": fp0.get("env"),
        "machine": machine_line(),
        "seed": fp0.get("seed"),
        "calibration": dict(calibration or {}),
        "rows": rows,
        "remedies": remedies,
        "llama_cpp": {"types": list(cfg.llama_cpp), "skipped": cfg.llama_cpp_skipped, "rows": llama_rows},
    }


def _llama_cpp_rows(
    cfg: AlgorithmsConfig,
    by_key: Mapping[tuple[str, str], Mapping[str, Any]],
    models: list[str],
    rows: list[dict[str, Any]],
    output_path: Path,
) -> list[dict[str, Any]]:
    """One row per (model, llama.cpp type): the cell, its file (bytes, bits per weight, tensor types), tokens/s of
    its evaluation, and its perplexity paired against the best algorithm at int4 g128 on the same tokens."""
    from qbench.quant.gguf_types import scheme_name

    out = []
    against_label = FORMATS[LLAMA_CPP_AGAINST][0]
    for model in models:
        fp = by_key.get((model, "fp"))
        clusters = window_documents(fp["protocol"]) if fp else None
        base_row = next((r for r in rows if r["model"] == model and r["format"] == against_label), None)
        best = None if base_row is None or base_row["best"] is None else base_row["best"]
        best_record = None if best is None else by_key.get((model, scheme_for(LLAMA_CPP_AGAINST, best)))
        best_nll = token_nll(output_path, best_record) if best_record else None
        for t in cfg.llama_cpp:
            record = by_key.get((model, scheme_name(t)))
            if record is None:
                continue
            cell = cell_summary(record)
            art = record.get("artifact") or {}
            ok = record.get("status") == "ok"
            ci = (
                paired_change_ci(token_nll(output_path, record), best_nll, clusters)
                if ok and best_nll is not None
                else None
            )
            out.append(
                {
                    "model": model,
                    "type": t,
                    "cell": cell,
                    "bytes": art.get("bytes"),
                    "bits_per_weight": art.get("bits_per_weight"),
                    "tensor_types": art.get("tensor_types"),
                    "tokens_per_second": record.get("tokens_per_second"),
                    "against": None if best is None else f"{ALGORITHM_LABELS[best]} at {against_label}",
                    "vs_against_ci95": ci,
                    "vs_against": None
                    if ci is None
                    else ("better" if ci[1] < 0 else "worse" if ci[0] > 0 else "undecided"),
                }
            )
    return out


def smallest_within(
    rows: Sequence[Mapping[str, Any]], model: str, tolerance: float
) -> Mapping[str, Any] | None:
    """The smallest file among ``model``'s llama.cpp rows whose change's 95 % interval lies below ``tolerance`` %
    (the card's pass rule); None when none does."""
    passing = [
        r
        for r in rows
        if r["model"] == model
        and r["bytes"]
        and r["cell"]["ppl_change_ci95"] is not None
        and r["cell"]["ppl_change_ci95"][1] < tolerance
    ]
    return min(passing, key=lambda r: r["bytes"], default=None)


def _remedies(rows: list[dict[str, Any]], models: list[str]) -> list[dict[str, Any]]:
    """Each other model's round-to-nearest against the first model's best algorithm, per format."""
    if len(models) < 2:
        return []
    base = {r["format"]: r for r in rows if r["model"] == models[0]}
    out = []
    for r in rows:
        if r["model"] == models[0] or r["format"] not in base or base[r["format"]]["best"] is None:
            continue
        b = base[r["format"]]
        best = b["cells"][b["best"]]
        mine = r["cells"].get("rtn")
        if mine is None or mine["ppl_change_ci95"] is None or best["ppl_change_ci95"] is None:
            relation = "not measured"
        elif mine["ppl_change_ci95"][1] < best["ppl_change_ci95"][0]:
            relation = "below"
        elif mine["ppl_change_ci95"][0] > best["ppl_change_ci95"][1]:
            relation = "above"
        else:
            relation = "overlapping"
        out.append(
            {
                "model": r["model"],
                "format": r["format"],
                "rtn_ppl_change_pct": None if mine is None else mine["ppl_change_pct"],
                "baseline": models[0],
                "baseline_best": b["best"],
                "baseline_best_ppl_change_pct": best["ppl_change_pct"],
                "relation": relation,
            }
        )
    return out


def machine_line() -> str:
    """The processor and the instruction-set flags that decide kernel paths (lscpu's model name and flags)."""
    model, flags = platform.processor() or platform.machine(), set()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name") and model in ("", platform.machine(), platform.processor()):
                model = line.split(":", 1)[1].strip()
            if line.startswith("flags"):
                flags = set(line.split(":", 1)[1].split())
                break
    except OSError:
        pass
    shown = [f for f in ("avx2", "fma", "avx512f", "avx512_vnni", "avx512_bf16", "amx_tile") if f in flags]
    return f"{model}; flags {', '.join(shown) or 'none of avx2/avx512/amx'}"


def _fmt_pct(x: float | None) -> str:
    return "-" if x is None or not math.isfinite(x) else f"{x:+.2f} %"


def _cell_text(cell: Mapping[str, Any] | None) -> str:
    if cell is None:
        return "not run"
    if cell["status"] != "ok":
        return str(cell["status"])
    ci = cell["ppl_change_ci95"]
    half = "" if ci is None else f" ±{(ci[1] - ci[0]) / 2:.2f}"
    text = f"{_fmt_pct(cell['ppl_change_pct'])}{half}"
    if cell["kld_mean"] is not None:
        text += f"; KLD {cell['kld_mean']:.3f}"
    secs = cell["quantize_seconds"]
    if secs is not None:
        text += f"; {secs:.0f} s"
    if cell.get("vs_rtn") and cell["vs_rtn"] != "undecided":
        text += f" ({cell['vs_rtn']})"
    return text


def calibration_text(result: Mapping[str, Any]) -> str:
    """The calibration sentence of table.md: the text each model's calibrated cells took, and how much of it."""
    if "calibration" not in result:  # an algorithms.json from before the calibration was recorded
        return "Calibration: not recorded."
    if not result["calibration"]:
        return "Calibration: none (no algorithm of this run calibrates)."
    said: dict[str, list[str]] = {}
    for model, cal in result["calibration"].items():
        # a user's file or folder: all of it is calibration text, so it is named alone
        whole = cal["given"] and cal["split"] == "all"
        source = cal["corpus"] if whole else f"the {cal['split']} split of {cal['corpus']}"
        for t in cal["taken"]:
            if t.get("sample", "first") == "documents":  # an algorithms.json before the sample: first windows
                picked = f"a sample across documents (seed {t['seed'] or 0}) of"
            else:
                picked = "the first" if t["seed"] is None else f"a seeded sample (seed {t['seed']}) of"
            windows = f"{t['windows']} window{'s' if t['windows'] != 1 else ''}"
            text = (
                f"{picked} {windows} of {t['window']} tokens ({t['tokens']:,} tokens) of {source}, which holds "
                f"{cal['tokens_held']:,} tokens"
            )
            if t.get("held_out_windows"):
                text += f"; {t['held_out_windows']} more held out for the layer error out of sample"
            if t["windows"] < t["windows_requested"]:
                text += f" ({t['windows_requested']} windows asked for; the text holds fewer)"
            said.setdefault(text, []).append(model)
    head = "Calibration (cells with GPTQ or AWQ):"
    if len(said) == 1:
        return f"{head} {next(iter(said))}."
    return f"{head} " + "; ".join(f"{', '.join(models)}: {text}" for text, models in said.items()) + "."


def render(result: Mapping[str, Any]) -> str:
    """table.md from algorithms.json's content."""
    algos = result["algorithms"]
    protocol = result.get("protocol") or {}
    env = result.get("env") or {}
    sw = env.get("software") or {}
    lines = [
        "# Post-training algorithms side by side",
        "",
        f"Command: `{result['command']}`",
        "",
        f"Machine: {result['machine']}, {env.get('threads')} threads; torch {sw.get('torch')}, transformers "
        f"{sw.get('transformers')}; git {env.get('git_commit')}; seed {result.get('seed')}.",
        "",
        f"Protocol: token-level perplexity on {protocol.get('corpus')}/{protocol.get('split')}, "
        f"{scored_text(protocol)}, "
        f"{protocol.get('dtype')}. Each cell: perplexity change against the float model ± the half-width of its 95 % "
        "interval (paired; documents, or windows, as clusters); mean KL divergence from the float model (nats); seconds to "
        "quantise (the cell's wall time minus its evaluation: calibration forward, Hessians and solves; a grid "
        "computes the Hessians once per model, so the first GPTQ/AWQ cell carries them); (better) / (worse): the "
        "paired 95 % interval of its perplexity against round-to-nearest's on the same tokens lies wholly below / "
        f"above zero. {calibration_text(result)} Hadamard: the in-layer rotation of the "
        "`hadamard-*` schemes (the residual stream untouched); QuaRot: the residual stream rotated with the norms "
        "folded and an online Hadamard before o_proj and down_proj (`rotate=quarot`; refused on models it cannot "
        "fold: LayerNorm, GPT-2 style).",
        "",
    ]
    header = "| model | format | " + " | ".join(ALGORITHM_LABELS[a] for a in algos) + " | best |"
    lines += [header, "|" + "---|" * (len(algos) + 3)]
    for row in result["rows"]:
        best = "-" if row["best"] is None else ALGORITHM_LABELS[row["best"]]
        if row["best_tied_with"]:
            best += " (tied with " + ", ".join(ALGORITHM_LABELS[a] for a in row["best_tied_with"]) + ")"
        cells = " | ".join(_cell_text(row["cells"].get(a)) for a in algos)
        lines.append(f"| {row['model']} | {row['format']} | {cells} | {best} |")
    fp = result.get("fp_perplexity") or {}
    lines += ["", "Float perplexity: " + ", ".join(f"{m} {p:.3f}" for m, p in fp.items() if p) + "."]
    lines += _llama_cpp_lines(result)
    if result.get("remedies"):
        base = result["models"][0]
        lines += [
            "",
            f"## Training-time remedies with round-to-nearest against {base}'s best post-training algorithm",
            "",
            "| model | format | its RTN change | "
            + f"{base}'s best | relation (95 % intervals; different models, not paired) |",
            "|---|---|---|---|---|",
        ]
        for r in result["remedies"]:
            lines.append(
                f"| {r['model']} | {r['format']} | {_fmt_pct(r['rtn_ppl_change_pct'])} | "
                f"{ALGORITHM_LABELS[r['baseline_best']]} {_fmt_pct(r['baseline_best_ppl_change_pct'])} | "
                f"{r['relation']} |"
            )
    return "\n".join(lines) + "\n"


def _against_words(verdict: str, against: str) -> str:
    return f"undecided against {against}" if verdict == "undecided" else f"{verdict} than {against}"


def _llama_cpp_lines(result: Mapping[str, Any]) -> list[str]:
    """table.md's llama.cpp section: each type's file and cell beside the best algorithm at int4 g128."""
    section = result.get("llama_cpp") or {}
    if section.get("skipped"):
        return ["", f"llama.cpp's file types: not scored ({section['skipped']})."]
    if not section.get("rows"):
        return []
    lines = [
        "",
        "## llama.cpp's file types on the same tokens",
        "",
        "Each type written by llama.cpp's own quantiser from the float model and scored by llama.cpp (`gguf:<type>` "
        "cells): the file's size and bits per weight (file bits over the float model's parameters), its change ± "
        "the half-width of the 95 % interval, KL divergence and top-1 agreement with the float model, tokens/s of "
        "its evaluation (llama.cpp's forward passes and the comparison with the float logits: not a speed "
        "figure, which `qbench speed --llama-cpp` gives), and its perplexity paired against the best algorithm at "
        "int4 g128 (better / worse: that paired interval wholly below / above zero). A type is a mix: the tensor "
        "types llama.cpp wrote are in each record's `artifact`.",
        "",
        "| model | type | MB | bits/weight | change | KLD | top-1 | tokens/s | vs |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in section["rows"]:
        c = r["cell"]
        mb = "-" if not r["bytes"] else f"{r['bytes'] / 1e6:,.1f}"
        bpw = "-" if r["bits_per_weight"] is None else f"{r['bits_per_weight']:.2f}"
        kld = "-" if c["kld_mean"] is None else f"{c['kld_mean']:.4f}"
        top1 = "-" if c["top1_agreement"] is None else f"{100 * c['top1_agreement']:.1f} %"
        change = _cell_text({**c, "quantize_seconds": None, "kld_mean": None, "vs_rtn": None})
        vs = "-" if r["vs_against"] is None else _against_words(r["vs_against"], r["against"])
        tps = "-" if r["tokens_per_second"] is None else f"{r['tokens_per_second']:,.0f}"
        lines.append(
            f"| {r['model']} | {r['type']} | {mb} | {bpw} | {change} | {kld} | {top1} | {tps} | {vs} |"
        )
    for model in dict.fromkeys(r["model"] for r in section["rows"]):
        small = smallest_within(section["rows"], model, LLAMA_CPP_TOLERANCE_PCT)
        said = "none" if small is None else f"{small['type']} ({small['bytes'] / 1e6:,.1f} MB)"
        lines.append(
            f"\n{model}: smallest llama.cpp type within {LLAMA_CPP_TOLERANCE_PCT:g} % of float: {said}."
        )
    return lines


def run_algorithms(cfg: AlgorithmsConfig, spec_for: Any, on_record: Any = None) -> dict[str, Any]:
    """Evaluate the grid (``spec_for(schemes)`` -> the harness's GridSpec of these models), then write
    ``algorithms.json`` and ``table.md`` under ``cfg.output_path``."""
    from qbench.eval.harness import run_grid

    start = time.perf_counter()
    cfg.check()
    spec = spec_for(schemes(cfg))
    loaded, calibration = check_inputs(cfg, spec)
    records = run_grid(spec, on_record=on_record, loaded=loaded)
    result = build(cfg, records, Path(spec.output_path), calibration)
    result["wall_seconds"] = time.perf_counter() - start
    out = Path(cfg.output_path)
    out.mkdir(parents=True, exist_ok=True)
    atomic_write_json(out / "algorithms.json", result)
    atomic_write_text(out / "table.md", render(result))
    return result
