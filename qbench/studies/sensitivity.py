"""``qbench sensitivity``: where a model breaks under a scheme, and the smallest float repair, verified.

    result = sensitivity(spec, by="layer", tolerance=1.0)   # spec: a GridSpec of one model, one scheme, one mode
    write_sensitivity(result, out, command)                 # sensitivity.json, sensitivity.md, heatmap.png

1. Units (``by``): each linear layer the scheme quantises (``layer``), each decoder block (``block``: the pattern
   ``<block>.*``), or each module type (``type``: ``*.<name inside its block>``, e.g. ``*.mlp.down_proj``). A
   unit's name is an fnmatch pattern that ``qbench run --exclude`` accepts as it is.
2. Sensitivity (metrics.md, "Sensitivity"): the model with only that unit quantised -- every other layer the
   scheme quantises kept in float through ``exclude`` -- evaluated on the same windows as the float baseline;
   the damage is its perplexity change in %. One harness cell per unit (``run_grid``): the cells live in
   ``<out>/cells/<unit>/`` beside one float record ``<out>/cells/<model>/fp.json``, so an interrupted study
   resumes and finished units are reused.
3. Statistics beside each unit, of the float model (``qbench.eval.metrics.linear_ranges`` on the protocol's
   outlier windows): input crest factor max|x| / RMS(x), input raw kurtosis (across channels per token, mean
   over tokens), max |input|, weight crest factor; a unit of several layers takes its largest layer value. Then
   Spearman's rank correlation of each statistic with the damage: does it predict where quantisation hurts?
   With a quantised KV cache (``GridSpec.kv``) every cell has it, the units' changes include the cache's, and
   ``kv_only_ppl_change_pct`` is the cache's alone (every layer float).
   A unit in block b replays the float model's output of block b-1 instead of recomputing blocks 0..b-1
   (``qbench.eval.prefix``; the same perplexity to the last bit, found by comparison, never assumed).
4. Repair: from the fully quantised model, while its change exceeds ``tolerance`` %, keep the next most
   sensitive unit in float and evaluate again; once within, try dropping each kept unit, least sensitive first,
   keeping a drop when the measured change stays within (``minimise=False``: the shortest within prefix of
   the ranking, by bisection, and no drops). Every step is a measured cell, so the reported
   perplexity is the one ``qbench run --exclude <each name>`` gives on the same protocol.
"""

from __future__ import annotations

import fnmatch
import hashlib
import math
import re
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from models.errors import UserError, unknown_choice
from models.io import atomic_write_json, atomic_write_text
from qbench.eval.harness import (
    GridSpec,
    environment,
    kv_identity,
    refuse_nonfinite_weights,
    refuse_unscorable,
    run_grid,
)
from qbench.eval.load import LoadedModel, load_model
from qbench.eval.metric_registry import UNIT_STATISTICS
from qbench.eval.prefix import BlockPrefix
from qbench.eval.sampling import scored_text
from qbench.studies.sensitivity_options import BY
from qbench.studies.sweep import format_change

# unit statistic -> key of qbench.eval.metrics.linear_ranges' per-layer entry (the metric registry's list)
STATISTICS = UNIT_STATISTICS
# (phase, record, reused). Phases: "unit" -- exactly one call per unit, the number ``on_units`` announced; "kv" --
# the KV-only cell (with a quantised KV cache only); "repair" -- each distinct set the repair measures. Progress
# bars count them apart, so "units 4/4" means the units and nothing else.
PHASES = ("unit", "kv", "repair")
OnCell = Callable[[str, dict[str, Any], bool], None]


@dataclass(frozen=True)
class Unit:
    """What is quantised alone: ``name`` is an fnmatch pattern over layer names matching exactly ``layers``."""

    name: str
    layers: tuple[str, ...]
    block: int | None  # decoder block (heatmap row); None for a type unit or a layer outside the blocks
    kind: str | None  # module type, the name inside its block (heatmap column); None for a block unit


# ------------------------------------------------------------------------------------------------------ units


def layer_places(model: Any, layers: Sequence[str]) -> dict[str, tuple[int | None, str]]:
    """{layer: (decoder block index or None, its name inside the block, else its full name)}."""
    from qbench.eval.adapters import decoder_layers

    index = {id(m): i for i, m in enumerate(decoder_layers(model))}
    prefixes = {name: index[id(m)] for name, m in model.named_modules() if id(m) in index}
    places: dict[str, tuple[int | None, str]] = {}
    for layer in layers:
        owner = next((p for p in prefixes if layer.startswith(p + ".")), None)
        places[layer] = (prefixes[owner], layer[len(owner) + 1 :]) if owner else (None, layer)
    return places


def units_of(model: Any, targets: Sequence[str], by: str = "layer") -> list[Unit]:
    """The units of ``targets`` (the layers the scheme quantises, in model order) for ``by``."""
    if by not in BY:
        raise unknown_choice("--by", by, BY)
    places = layer_places(model, targets)
    if by == "layer":
        return [Unit(t, (t,), *places[t]) for t in targets]
    units: dict[str, Unit] = {}
    for t in targets:
        block, kind = places[t]
        if block is None:  # outside the blocks (an LM head quantised with --quantize-lm-head): its own unit
            pattern, place = t, (None, t)
        elif by == "block":
            pattern, place = t[: -len(kind) - 1] + ".*", (block, None)
        else:
            pattern, place = "*." + kind, (None, kind)
        if pattern not in units:
            units[pattern] = Unit(pattern, tuple(fnmatch.filter(targets, pattern)), *place)
    return list(units.values())


def unit_statistics(unit: Unit, per_layer: dict[str, dict[str, Any]]) -> dict[str, float | None]:
    """The float model's statistics of a unit: the largest value among its layers (None where unmeasured)."""
    out: dict[str, float | None] = {}
    for stat, key in STATISTICS.items():
        values = [
            per_layer[layer][key] for layer in unit.layers if per_layer.get(layer, {}).get(key) is not None
        ]
        out[stat] = max(values) if values else None
    return out


# ------------------------------------------------------------------------------------------- rank correlation


def ranks(values: Sequence[float]) -> list[float]:
    """1-based ranks, ties sharing the mean of the ranks they span (as Spearman's coefficient needs)."""
    order = sorted(range(len(values)), key=lambda i: values[i])
    out = [0.0] * len(values)
    start = 0
    while start < len(order):
        end = start
        while end + 1 < len(order) and values[order[end + 1]] == values[order[start]]:
            end += 1
        for k in range(start, end + 1):
            out[order[k]] = (start + end) / 2 + 1
        start = end + 1
    return out


def spearman(x: Sequence[float], y: Sequence[float]) -> float | None:
    """Spearman's rho: Pearson's correlation of the average ranks. None for fewer than 3 pairs or a constant side
    (the coefficient is undefined there, and a number would suggest evidence that does not exist)."""
    if len(x) != len(y):
        raise ValueError(f"spearman needs pairs: {len(x)} vs {len(y)} values")
    if len(x) < 3:
        return None
    rx, ry = ranks(x), ranks(y)
    mx, my = sum(rx) / len(rx), sum(ry) / len(ry)
    sxy = sum((a - mx) * (b - my) for a, b in zip(rx, ry, strict=True))
    sxx, syy = sum((a - mx) ** 2 for a in rx), sum((b - my) ** 2 for b in ry)
    return None if sxx == 0 or syy == 0 else sxy / math.sqrt(sxx * syy)


def correlations(units: Sequence[dict[str, Any]]) -> dict[str, float | None]:
    """{statistic: Spearman's rho with the damage} over the units where both are known (NaN cells rank worst)."""
    out = {}
    for stat in STATISTICS:
        pairs = [(u[stat], damage(u)) for u in units if u.get(stat) is not None]
        out[stat] = spearman([p[0] for p in pairs], [p[1] for p in pairs])
    return out


def damage(entry: dict[str, Any]) -> float:
    """A cell's perplexity change in % for ranking: a model that produced NaN/inf is the worst damage."""
    change = entry.get("ppl_change_pct")
    return math.inf if entry.get("status") == "nonfinite" or change is None else change


# ------------------------------------------------------------------------------------------------ the study


@dataclass
class _Study:
    spec: GridSpec  # one model, one scheme, one mode; output_path = <out>/cells
    lm: LoadedModel
    targets: list[str]
    on_cell: OnCell | None = None
    prefix: BlockPrefix | None = None  # the float model's block outputs, replayed (qbench.eval.prefix)
    quantised: dict[str, Any] | None = None  # the fully quantised cell, when the caller measured it already

    def cell(self, key: str, exclude: Sequence[str], phase: str) -> dict[str, Any]:
        """The record of the model quantised except ``exclude``, in ``cells/<key>/`` (reused when finished)."""
        spec = replace(
            self.spec,
            exclude=tuple(exclude),
            output_path=self.spec.output_path / key,
            # the float record: the caller's (a card's, shared with its other cells) or the cells folder's
            baseline_path=self.spec.baseline_path or self.spec.output_path,
            allow_empty=True,  # the KV-only cell and a repair that keeps every unit quantise no layer, by design
        )
        seen: list[bool] = []
        records = run_grid(
            spec, lambda r, reused: seen.append(reused), loaded={spec.models[0]: self.lm}, prefix=self.prefix
        )
        record = records[-1]
        if record.get("status") == "unsupported":
            raise UserError(f"scheme {record['scheme']['name']!r} cannot run here: {record['error']}")
        if self.on_cell:
            self.on_cell(phase, record, seen[-1])
        return record

    def unit_cell(self, unit: Unit) -> dict[str, Any]:
        others = [t for t in self.targets if t not in unit.layers]
        return self.cell("unit-" + _slug(unit.name), others, "unit")

    def kept_cell(self, kept: Sequence[str]) -> dict[str, Any]:
        """The model quantised except the units ``kept`` (their patterns, as ``--exclude`` takes them)."""
        if not kept:
            if self.quantised is not None:  # the caller's own cell of this scheme on this protocol
                if self.on_cell:
                    self.on_cell("repair", self.quantised, True)
                return self.quantised
            return self.cell("all", (), "repair")
        digest = hashlib.sha256("\n".join(kept).encode()).hexdigest()[:12]
        return self.cell(f"repair-{len(kept)}-{digest}", kept, "repair")


def _slug(name: str) -> str:
    return re.sub(r"[^A-Za-z0-9._-]+", "_", name).strip("_") or "unit"


def _entry(unit: Unit, record: dict[str, Any], stats: dict[str, float | None]) -> dict[str, Any]:
    m = record["metrics"]
    return {
        "name": unit.name,
        "layers": list(unit.layers),
        "block": unit.block,
        "kind": unit.kind,
        "ppl": m["perplexity"],
        "ppl_change_pct": m["ppl_change_pct"],
        "status": record["status"],
        **stats,
        "seconds": record.get("wall_seconds"),
    }


def _within(record: dict[str, Any], tolerance: float, metric: str = "ppl") -> bool:
    """*Within* the tolerance of ``metric``: the 95 % interval's upper end ≤ it (``qbench.eval.evidence.decide``),
    so a repair is reached only when the measurement shows it, never on a point estimate that happens to fall
    below."""
    from qbench.eval.evidence import decide

    return decide(record, tolerance, metric).within


def repair(
    study: _Study,
    ranked: Sequence[dict[str, Any]],
    tolerance: float,
    metric: str = "ppl",
    minimise: bool = True,
) -> dict[str, Any]:
    """Greedy forward by measured sensitivity, then a backward pass; every set is evaluated (module docstring).
    ``minimise=False`` replaces both by a bisection for the shortest within prefix of the ranking
    (:func:`_shortest_prefix`, log2(units) cells): the set is measured within the tolerance, but a unit it keeps
    may not be needed (``minimised`` in the result says which).

    Each distinct set is measured once: the backward pass's first trial (dropping the unit added last) is the
    forward pass's previous set, already measured and known to fail, so it is looked up, not evaluated or
    counted again. ``steps`` lists the distinct sets measured, in order.
    """
    measured: dict[frozenset[str], dict[str, Any]] = {}
    steps: list[dict[str, Any]] = []

    def measure(kept: list[str]) -> dict[str, Any]:
        key = frozenset(kept)
        if key not in measured:
            measured[key] = study.kept_cell(kept)
            steps.append(_step(kept, measured[key]))
        return measured[key]

    kept: list[str] = []
    current = full = measure(kept)
    names = [unit["name"] for unit in ranked]
    if not minimise and names and not _within(full, tolerance, metric):
        kept, current = _shortest_prefix(names, measure, tolerance, metric)
    for name in names if minimise else ():
        if _within(current, tolerance, metric):
            break
        kept = [*kept, name]
        current = measure(kept)
    if minimise and _within(current, tolerance, metric) and len(kept) > 1:
        for name in reversed(list(kept)):  # least sensitive first
            trial = [k for k in kept if k != name]
            record = measure(trial)
            if _within(record, tolerance, metric):
                kept, current = trial, record
    m = current["metrics"]
    return {
        "tolerance_pct": tolerance,
        "metric": metric,
        "reached": _within(current, tolerance, metric),
        "minimised": minimise,
        "exclude": kept,
        "count": len(kept),
        "ppl": m["perplexity"],
        "ppl_change_pct": m["ppl_change_pct"],
        # the repaired cell's evidence (absent from records without per-token sidecars)
        "ppl_change_ci95": m.get("ppl_change_ci95"),
        "kld_mean": m.get("kld_mean"),
        "top1_agreement": m.get("top1_agreement"),
        "weight_share_float": _weight_share(study, kept),
        "quantised_ppl": full["metrics"]["perplexity"],
        "quantised_ppl_change_pct": full["metrics"]["ppl_change_pct"],
        **_decisions(current, full, tolerance, metric),
        "steps": steps,
    }


def _decisions(
    repaired: dict[str, Any], quantised: dict[str, Any], tolerance: float, metric: str
) -> dict[str, Any]:
    """On kld or top1, the repaired and the fully quantised cell's decisions (that metric's value and interval:
    what the reports show beside the perplexity changes); nothing on ppl, whose changes the repair holds."""
    if metric == "ppl":
        return {}
    from qbench.eval.evidence import decide

    return {
        "decision": decide(repaired, tolerance, metric).to_dict(),
        "quantised_decision": decide(quantised, tolerance, metric).to_dict(),
    }


def _shortest_prefix(
    names: Sequence[str],
    measure: Callable[[list[str]], dict[str, Any]],
    tolerance: float,
    metric: str,
) -> tuple[list[str], dict[str, Any]]:
    """(the shortest prefix of ``names`` measured within the tolerance, its record), by bisection over the
    prefix length: log2(n) cells where adding units one at a time takes up to n. The empty prefix is known to
    fail; the whole list (everything the study can keep in float) is measured only when no shorter one is
    within. Bisection assumes keeping one more unit in float never makes the model worse: where that does not
    hold the prefix found may not be the shortest, and it is still a measured cell."""
    lo, hi = 0, len(names)  # the prefix of length lo fails; the answer is in (lo, hi]
    found: dict[str, Any] | None = None
    while hi - lo > 1:
        mid = (lo + hi) // 2
        record = measure(list(names[:mid]))
        if _within(record, tolerance, metric):
            hi, found = mid, record
        else:
            lo = mid
    if found is None:
        found = measure(list(names[:hi]))
    return list(names[:hi]), found


def _step(kept: Sequence[str], record: dict[str, Any]) -> dict[str, Any]:
    m = record["metrics"]
    return {"exclude": list(kept), "ppl": m["perplexity"], "ppl_change_pct": m["ppl_change_pct"]}


def _weight_share(study: _Study, kept: Sequence[str]) -> float:
    """Share of the quantised layers' weight elements that the patterns ``kept`` leave in float."""
    from qbench.quant.apply import linear_weight

    modules = dict(study.lm.model.named_modules())
    sizes = {t: linear_weight(modules[t])[0].numel() for t in study.targets}
    kept_layers = {t for t in study.targets if any(fnmatch.fnmatchcase(t, p) for p in kept)}
    return sum(sizes[t] for t in kept_layers) / sum(sizes.values())


def _per_layer_statistics(study: _Study, fp: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """The float record's per-layer linear ranges; recomputed when the record predates a statistic."""
    per_layer = (fp.get("linear_ranges") or {}).get("per_layer") or {}
    if all(key in v for v in per_layer.values() for key in STATISTICS.values()) and per_layer:
        return per_layer
    from qbench.eval.adapters import context_length
    from qbench.eval.metrics import linear_ranges, make_windows

    protocol = study.spec.protocol
    windows = make_windows(study.lm.tokenizer, protocol, context_length(study.lm.model, protocol.window))
    return linear_ranges(study.lm.model, windows, protocol.outlier_windows, device=study.spec.device)[
        "per_layer"
    ]


def sensitivity(
    spec: GridSpec,
    by: str = "layer",
    tolerance: float = 1.0,
    metric: str = "ppl",
    on_cell: OnCell | None = None,
    on_units: Callable[[int], None] | None = None,
    lm: LoadedModel | None = None,
    replay: bool = True,
    minimise: bool = True,
    quantised: dict[str, Any] | None = None,
    repair_units: bool = True,
) -> dict[str, Any]:
    """The sensitivity map and the verified repair of ``spec``'s one model under its one scheme and mode
    (``repair_units=False``: the map alone, ``"repair": None``).

    ``spec.output_path`` is the cells folder. ``on_units(n)`` is told the number of units before the first cell
    is evaluated (for a progress bar); ``on_cell(phase, record, reused)`` after each cell, with the phases of
    :data:`PHASES`: exactly n "unit" calls, then one "kv" call with a quantised KV cache, then one "repair" call
    per distinct set the repair measures (``timing.cells`` states all three counts).

    ``replay``: a cell whose first changed decoder block is b starts from the float model's stored output of
    block b-1 (``qbench.eval.prefix``: the same perplexity, blocks 0..b-1 not recomputed); off, every cell runs
    the whole model (for measuring what the replay saves).

    ``minimise``: the repair's backward pass (try dropping each kept unit); off, the forward pass only.
    ``quantised``: the record of the fully quantised model on the same protocol (a card measured it among its
    formats): the repair starts from it instead of evaluating it again; refused when its scheme or protocol
    differs from the study's.
    """
    from qbench.quant.apply import select_layers

    if by not in BY:
        raise unknown_choice("--by", by, BY)
    if len(spec.models) != 1 or len(spec.schemes) != 1 or len(spec.modes) != 1:
        raise ValueError("sensitivity takes a GridSpec of one model, one scheme and one mode")
    from qbench.eval.evidence import check_metric, check_tolerance

    check_tolerance(tolerance, check_metric(metric))
    start = time.perf_counter()
    scheme = spec.scheme(spec.schemes[0])
    lm = lm or load_model(
        spec.models[0],
        dtype=spec.dtype,
        device=spec.device,
        trust_remote_code=spec.trust_remote_code,
        allow_unsafe_weights=spec.allow_unsafe_weights,
        placement=spec.placement,
    )
    study = _Study(
        spec, lm, list(select_layers(lm.model, scheme)), on_cell, _prefix(spec, lm) if replay else None
    )
    units = units_of(lm.model, study.targets, by)
    if not units:
        raise UserError(f"scheme {scheme.name!r} quantises no layer of {lm.name}: nothing to map")
    refuse_nonfinite_weights(lm.name, lm.model, "a sensitivity map")
    if on_units:
        on_units(len(units))
    records = [study.unit_cell(unit) for unit in units]  # the first one also writes the float record
    kv_only = study.cell("kv-only", study.targets, "kv") if spec.kv is not None else None
    fp = _read_fp(spec, lm)
    refuse_unscorable(lm.name, fp, "a sensitivity map")
    if quantised is not None:
        same = (
            quantised.get("scheme") == spec.scheme_record(spec.schemes[0])
            and quantised.get("model") == fp["model"]
            and quantised.get("seed") == spec.seed
            and quantised.get("protocol") == fp["protocol"]
            and kv_identity(quantised.get("kv")) == spec.kv_record()
            and quantised.get("mode") == spec.modes[0]
        )
        if not same:
            raise ValueError(
                "sensitivity(quantised=...) must be the study's scheme, mode, KV cache and protocol"
            )
        study.quantised = quantised
    per_layer = _per_layer_statistics(study, fp)
    entries = [_entry(u, r, unit_statistics(u, per_layer)) for u, r in zip(units, records, strict=True)]
    ranked = sorted(entries, key=lambda e: -damage(e))  # stable: model order among equal damage
    if study.prefix is not None:
        study.prefix.release()  # the repair quantises many units at once: its sets start in block 0 or close
    units_wall = time.perf_counter() - start
    cell_seconds = [e["seconds"] for e in entries if e["seconds"] is not None]
    return {
        "model": fp["model"],
        "scheme": scheme.to_dict(),
        "mode": spec.modes[0],
        "by": by,
        "protocol": fp["protocol"],
        "fp_perplexity": fp["metrics"]["perplexity"],
        "kv": spec.kv.to_dict() if spec.kv is not None else None,
        # with a quantised KV cache every cell has it: its damage alone (no layer quantised) for comparison
        "kv_only_ppl_change_pct": kv_only["metrics"]["ppl_change_pct"] if kv_only else None,
        "units": ranked,
        "kinds": list(
            dict.fromkeys(u.kind for u in units if u.kind is not None)
        ),  # model order: heatmap columns
        "correlation": correlations(ranked),
        "correlation_definition": "Spearman's rho (average ranks for ties) of each float-model statistic with "
        "the unit's perplexity change; None with < 3 units or a constant side",
        "repair": (fixed := repair(study, ranked, tolerance, metric, minimise) if repair_units else None),
        "timing": {
            "units": len(units),
            # every cell this study measures, by phase: the units, the KV-only cell, the repair's distinct sets
            "cells": {
                "units": len(units),
                "kv": int(kv_only is not None),
                "repair": len(fixed["steps"]) if fixed else 0,
            },
            "seconds_per_unit": sum(cell_seconds) / len(cell_seconds) if cell_seconds else None,
            "units_wall_seconds": round(units_wall, 3),
            "wall_seconds": round(time.perf_counter() - start, 3),
            # cells this call evaluated that replayed the float prefix, and the decoder blocks they skipped
            "replay": dict(study.prefix.stats) if study.prefix is not None else None,
            "note": "seconds_per_unit: mean over the unit cells of quantise + evaluate, as measured when each "
            "cell was made; the wall times are this call's (reused cells cost almost nothing)",
        },
        "env": environment(spec.device),
        "seed": spec.seed,
        "created_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }


def _prefix(spec: GridSpec, lm: LoadedModel) -> BlockPrefix | None:
    """The reference the unit cells replay: the float model, with the study's KV cache when it has one (built
    when first needed, after the float record). None for an fp8 cache with calibrated scales (each cell calibrates
    its own) and for a cache that keeps its sinks in float (the sink finder runs a float pass of its own)."""
    from qbench.eval.harness import kv_calibrated

    if spec.kv is None:
        return BlockPrefix(lm.model)
    if kv_calibrated(spec.kv) or spec.kv.keep_sinks:
        return None
    from qbench.quant.kv import apply_kv

    kv = spec.kv
    return BlockPrefix(lambda: apply_kv(lm.model, kv))


def _read_fp(spec: GridSpec, lm: LoadedModel) -> dict[str, Any]:
    """The float record the first unit cell wrote, read back from its file (never recomputed)."""
    import json

    from qbench.eval.harness import ModelEvaluation

    return json.loads(ModelEvaluation(spec, lm.source, lm=lm).fp_path().read_text())


# ----------------------------------------------------------------------------------------------- the outputs


def _fmt(x: float | None, spec: str = ".3g") -> str:
    return "-" if x is None else format(x, spec)


def change_text(x: float | None, tolerance: float | None = None) -> str:
    """A perplexity change for people: '+1.230 %', or 'NaN' for a model that produced NaN/inf; given the
    tolerance, with the decimals that show which side of it the change is on (``sweep.format_change``)."""
    if x is None:
        return "NaN"
    return f"{x:+.3f} %" if tolerance is None else format_change(x, tolerance)


def top_table(result: dict[str, Any], k: int = 10) -> str:
    """The ``k`` most damaging units as a markdown table, with the statistics beside them."""
    from tabulate import tabulate

    rows = [
        [
            i + 1,
            f"`{u['name']}`",
            _fmt(u["ppl"], ".3f"),
            change_text(u["ppl_change_pct"]),
            *(_fmt(u[s]) for s in STATISTICS),
        ]
        for i, u in enumerate(result["units"][:k])
    ]
    headers = ["#", "unit", "ppl", "change", "input crest", "input κ", "max abs input", "weight crest"]
    return tabulate(rows, headers, tablefmt="github")


def heatmap_grid(result: dict[str, Any]) -> tuple[list[str], list[str], list[list[float]]]:
    """(row labels, column labels, perplexity change per cell; NaN where there is no unit) for the heatmap:
    rows = decoder blocks, columns = module types (one column for ``--by block``, one row for ``--by type``)."""
    units = [u for u in result["units"] if u["block"] is not None or u["kind"] is not None]
    blocks = sorted({u["block"] for u in units if u["block"] is not None})
    kinds = result.get("kinds") or list(dict.fromkeys(u["kind"] for u in units if u["kind"] is not None))
    rows = [f"block {b}" for b in blocks] or ["all blocks"]
    cols = kinds or ["whole block"]
    grid = [[math.nan] * len(cols) for _ in rows]
    for u in units:
        r = blocks.index(u["block"]) if u["block"] is not None else 0
        c = kinds.index(u["kind"]) if u["kind"] is not None else 0
        change = u["ppl_change_pct"]
        grid[r][c] = math.inf if u["status"] == "nonfinite" else math.nan if change is None else change
    return rows, cols, grid


def write_sensitivity(result: dict[str, Any], out: Path, command: str, top: int = 10) -> dict[str, Path]:
    """sensitivity.json, sensitivity.md (top-k table, correlations, repair) and heatmap.png in ``out``."""
    from qbench.studies.plots import sensitivity_heatmap

    out = Path(out)
    result = {**result, "command": command}
    atomic_write_json(out / "sensitivity.json", result)
    rows, cols, grid = heatmap_grid(result)
    title = (
        f"{result['model']['name']} under {result['scheme']['name']} ({result['mode']}): perplexity change "
        "with only that unit quantised"
    )
    heatmap = sensitivity_heatmap(grid, rows, cols, out / "heatmap.png", title)
    atomic_write_text(out / "sensitivity.md", report(result, top))
    return {"json": out / "sensitivity.json", "markdown": out / "sensitivity.md", "heatmap": heatmap}


def report(result: dict[str, Any], top: int = 10) -> str:
    """The markdown summary: command, protocol, top-k units, correlations, the repair."""
    p, r, t = result["protocol"], result["repair"], result["timing"]
    corr = "\n".join(f"| {s} | {_fmt(v, '+.2f')} |" for s, v in result["correlation"].items())
    if r is None:  # the map alone (a card's "avoid" map): no repair was asked for
        return (
            _report_head(result, top, p, corr)
            + "## Repair\n\nNot asked for (the map alone).\n\n"
            + (_time_text(result, t))
        )
    excl = " ".join(f"--exclude '{name}'" for name in r["exclude"]) or "(nothing)"
    verdict = "within" if r["reached"] else "NOT within"
    minimised = (
        ""
        if r.get("minimised", True)
        else "; not minimised: the shortest within prefix of the ranking, found by bisection; no kept unit "
        "was tried for removal"
    )
    from qbench.eval.evidence import tolerance_text

    metric = r.get("metric", "ppl")  # repairs before --metric were on perplexity
    ppl_tolerance = r["tolerance_pct"] if metric == "ppl" else None  # the decimals that show the side of it
    before, after = repair_texts(r, ppl_tolerance)
    return (
        _report_head(result, top, p, corr)
        + f"## Repair (tolerance {tolerance_text(r['tolerance_pct'], metric)})\n\nAll units quantised: "
        f"{before}. Kept in float ({r['count']} units, "
        f"{r['weight_share_float']:.1%} of the quantised weights): {excl} → measured "
        f"{after} ({verdict} tolerance; {len(r['steps'])} "
        f"distinct sets evaluated{minimised}).\n\n" + _time_text(result, t)
    )


def repair_texts(r: dict[str, Any], ppl_tolerance: float | None = None) -> tuple[str, str]:
    """(all units quantised, repaired) as a repair's reports say them: the perplexity changes; on kld or top1 first
    that metric's value (the repaired one with its interval, in its unit: what the verdict read), then the
    change."""
    from qbench.eval.tolerance import interval_text, row_interval, value_text

    before = change_text(r["quantised_ppl_change_pct"], ppl_tolerance)
    after = change_text(r["ppl_change_pct"], ppl_tolerance)
    metric, tolerance = r.get("metric", "ppl"), r["tolerance_pct"]
    if metric == "ppl" or "decision" not in r:
        return before, after
    quantised = row_interval({"decision": r.get("quantised_decision")}, metric)[0]
    repaired = interval_text(*row_interval(r, metric), metric, tolerance)
    return (
        f"{value_text(quantised, metric, tolerance)} (perplexity {before})",
        f"{repaired} (perplexity {after})",
    )


def _report_head(result: dict[str, Any], top: int, p: dict[str, Any], corr: str) -> str:
    return (
        f"# Sensitivity of {result['model']['name']} to {result['scheme']['name']} ({result['mode']}), "
        f"by {result['by']}\n\nMade by `{result.get('command', '')}`.\n\n"
        f"Float perplexity {result['fp_perplexity']:.3f} on {p['corpus']}/{p['split']}, {scored_text(p)}; "
        "every unit quantised alone, on the same windows. Statistics: the float "
        f"model's linear-layer input (crest max|x|/RMS, raw kurtosis across channels per token, max |x|) and weight "
        f"crest, largest over the unit's layers.\n\n## Top {min(top, len(result['units']))} of "
        f"{len(result['units'])} units\n\n{top_table(result, top)}\n\n![heatmap](heatmap.png)\n\n"
        f"## Does a statistic predict the damage? (Spearman's rho over all units)\n\n| statistic | rho |\n|---|---|\n"
        f"{corr}\n\n"
    )


def _time_text(result: dict[str, Any], t: dict[str, Any]) -> str:
    return (
        f"Time: {t['units']} units, {_fmt(t['seconds_per_unit'], '.2f')} s per unit cell "
        f"(quantise + evaluate; {result['env'].get('processor')}, {result['env'].get('threads')} threads)."
        f"{_cells_text(t)}\n"
    )


def _cells_text(timing: dict[str, Any]) -> str:
    """' Cells measured: 14 units + 1 KV-only + 3 repair = 18.' (empty for a result from before the count)."""
    cells = timing.get("cells")
    if not cells:
        return ""
    kv = f" + {cells['kv']} KV-only" if cells["kv"] else ""
    replay = timing.get("replay") or {}
    replayed = (
        f" {replay['replayed']} of them started from the float model's stored block outputs "
        f"({replay['blocks_skipped']} decoder blocks not recomputed)."
        if replay.get("replayed")
        else ""
    )
    return f" Cells measured: {cells['units']} units{kv} + {cells['repair']} repair = {sum(cells.values())}.{replayed}"
