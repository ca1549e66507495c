"""The real kernels' speed on a model's own linear shapes: what the card shows in every budget, in seconds.

For each distinct (out, in) shape of the model's quantised linear layers, float32 ``F.linear`` and each scheme's
real layer (``qbench.quant.apply.quantize(..., "real")``) are timed interleaved (``qbench.studies.timing``), one
thread, at two row counts:

- **decode**, one row: a decode step reads every weight once from memory, so a layer timed again and again on
  the same weights (which then sit in cache) would look faster than it is in a model. Each shape is therefore
  built as enough copies that their float32 weights span twice the last-level cache, and one timed call runs
  every copy on the same row, in turn: the copies evict each other as a model's layers do.
- **prefill**, ``prefill_tokens`` rows on one copy (compute-bound: the weights' residence matters little).

A scheme's ratio is the model's: Σ_shapes n·t_fp32 / Σ_shapes n·t_scheme, with n the shape's count of layers
and t the median time per layer — the speed-up of the step's linear layers alone (attention, norms and Python
between the kernels are not in it; ``qbench speed`` times whole-model generation). Schemes without a real kernel
here (fake-only formats: FP8, MX, NVFP4) get ``None`` and the reason.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
from torch import Tensor, nn

DECODE_REPEATS = 15
PREFILL_REPEATS = 5
PREFILL_TOKENS = 128
MAX_COPIES = 64  # a tiny layer would need thousands of copies to span the cache; its time is small anyway


def _copies(out_features: int, in_features: int) -> int:
    from qbench.quant.kernels.paths import last_level_cache_bytes

    weight = 4 * out_features * in_features
    return max(1, min(MAX_COPIES, math.ceil(2 * last_level_cache_bytes() / weight)))


def _each(model: nn.Module, x: Tensor) -> Callable[[], Any]:
    """Every layer of ``model`` (a Sequential of copies) on the same input, one after another."""
    layers = list(model)

    def run() -> Any:
        with torch.inference_mode():
            for layer in layers:
                layer(x)

    return run


def layer_speed(
    shapes: Mapping[str, Sequence[int]],
    schemes: Sequence[str],
    prefill_tokens: int = PREFILL_TOKENS,
    threads: int = 1,
    device: str = "cpu",
    seed: int = 0,
) -> dict[str, Any]:
    """Decode and prefill speed-ups of each of ``schemes`` (real mode) over float32 on ``shapes`` ({layer name:
    [out_features, in_features]}, the layers a scheme quantises), as the module docstring describes. Returns
    ``{"schemes": {scheme: {"decode", "prefill", "error"}}, "shapes": [...], "records": [...], ...}``; every
    record carries the CPU, threads, torch and git commit (``qbench.studies.speed``'s common fields)."""
    from qbench.studies.speed import Candidate, _measure, _scheme_candidates, measured_where

    counts = Counter((int(o), int(i)) for o, i in shapes.values())
    common = measured_where(threads, device, seed)
    records: list[dict[str, Any]] = []
    totals: dict[str, dict[str | None, float]] = {"decode": {}, "prefill": {}}
    errors: dict[str, str] = {}
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            for (out_features, in_features), n in counts.items():
                for phase, rows in (("decode", 1), ("prefill", prefill_tokens)):
                    copies = _copies(out_features, in_features) if phase == "decode" else 1
                    layers = nn.Sequential(
                        *(nn.Linear(in_features, out_features).eval() for _ in range(copies))
                    ).to(device)
                    x = torch.randn(rows, in_features, device=device)
                    fp32 = Candidate("card-layer", "fp32 (F.linear)", _each(layers, x), backend="torch")
                    quantised = _scheme_candidates(
                        "card-layer", layers, x, schemes, ("real",), calibration=x[None], runner=_each
                    )
                    candidates = [fp32, *quantised]
                    repeats = DECODE_REPEATS if phase == "decode" else PREFILL_REPEATS
                    shape_common = {
                        **common,
                        "phase": phase,
                        "shape": [in_features, out_features],
                        "rows": rows,
                        "copies": copies,
                        "layers": n,
                        "repeats": repeats,
                    }
                    for record in _measure(candidates, repeats, fp32.name, shape_common):
                        records.append(record)
                        scheme = record["scheme"]
                        if record["ms"] is None:
                            errors.setdefault(scheme, record.get("error") or "did not run")
                            continue
                        per_layer = record["ms"] / copies
                        totals[phase][scheme] = totals[phase].get(scheme, 0.0) + n * per_layer
                    del layers, candidates, quantised
    finally:
        torch.set_num_threads(previous)
    out: dict[str, dict[str, Any]] = {}
    for scheme in schemes:
        error = errors.get(scheme)
        ratios = {
            phase: None
            if error or scheme not in totals[phase] or None not in totals[phase]
            else totals[phase][None] / totals[phase][scheme]
            for phase in ("decode", "prefill")
        }
        out[scheme] = {**ratios, "error": error}
    return {
        "what": "the model's linear layers alone, real kernels vs float32 F.linear, one sequence: decode one row "
        "through copies spanning twice the last-level cache (weights from memory), prefill "
        f"{prefill_tokens} rows; ratio of summed median times over the model's layers "
        "(qbench.studies.layerspeed)",
        "prefill_tokens": prefill_tokens,
        "fp32_ms": {phase: totals[phase].get(None) for phase in totals},
        "shapes": [{"out_in": list(k), "layers": n} for k, n in counts.items()],
        "schemes": out,
        "records": records,
        **common,
    }
