"""``qbench sweep``: robustness curves over bit widths, and the *breaking point* of each curve.

At the paper's 8-bit settings small models barely move; lowering the bits until they do is what tells two models
apart. A *curve* is one model under one scheme family with one *axis* swept over bit widths (default 8 → 2):

- ``w`` / ``a`` / ``o``: only the family's weights / input activations / outputs at b bits (the scheme override
  ``FAMILY:w=b``), everything else at the family's own bits — which tensor the model is sensitive in;
- ``all``: every tensor the family quantises at b bits (``FAMILY:w=b,a=b,o=b``; a tensor the family leaves in
  float stays float);
- ``kv``: the float model with a b-bit KV cache (``--kv-bits b``, family ``fp``); for every ``keep_first`` K > 0 a
  second curve ``kv-keepK`` keeps cache positions 0..K−1 in float (sink protection, as IntactKV / KVQuant /
  PrefixQuant do), and for every ``keep_sinks`` K > 0 a curve ``kv-sinksK`` keeps the K most-attended positions
  of the float model's first pass in float (the sink need not be token 0). Bit widths the KV cache does not offer
  are left out of its curves (the fp8 schemes offer 8 only). With several KV-cache schemes every scheme gets its
  own curves, named ``kv-keep1 (per-token)``: one sweep measures kivi against llama.cpp-style blocks, FP8 and the
  whole-window bound.

Every cell is one record of the evaluation grid (:func:`qbench.eval.harness.run_grid`) under
``output_path/<model>/``, so the grid's reuse rules hold: a re-run, or a sweep interrupted half way, evaluates only
what is missing. A cell whose overrides equal the family's own bits *is* the family (``absmax-coarse:w=8`` is
``absmax-coarse``), so the curves of one family share their widest cell.

**Breaking point** (docs/metrics.md): the lowest bit width b whose verdict is *within* the tolerance at b *and
at every wider width swept* (``qbench.eval.evidence.decide``: the cell's 95 % interval ends at most at the
tolerance; a cell ``--resolve`` re-evaluated, its last look's interval: ``qbench.studies.resolve``), so one lucky
noisy cell below a failing one cannot lower it; ``None`` ("none") when the widest width is not within. Walking on
through *undecided* cells (intervals straddling the tolerance) gives ``possible_bits``, shown as ``6 (4?)``. A cell
that produced NaN/inf, or could not run, is beyond. The tables show each change ± the half-width of its interval
with the verdict's mark — on ``--metric kld`` or ``top1`` that metric's value and interval instead, in its unit (the
one the verdict read: ``qbench.eval.tolerance``); a sweep.json from before intervals shows its point changes with
the decimals that decide them (:func:`format_change`) and decides nothing it cannot. ``decisions`` counts the verdicts (each record once)
and the false *within* calls they could make were every cell exactly at the tolerance (:func:`decisions_caption`).

Outputs beside the records: ``sweep.json`` (every cell with its perplexity, change and record path, the breaking
points with the tolerance, each model's float perplexity, protocol, versions and commit), ``sweep.md`` (generated
from that JSON) and ``sweep.png`` (perplexity ratio vs bits, log scale, one line per model and family/axis; on kld
or top1 that metric's values, the tolerance line in its unit).
"""

from __future__ import annotations

import json
import math
import os
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from models.errors import UserError, unknown_choice
from models.io import atomic_write_json, atomic_write_text
from qbench.eval.evidence import (
    BEYOND,
    DEFAULT_METRIC,
    UNDECIDED,
    WITHIN,
    format_interval,
    row_fields,
    tolerance_text,
)
from qbench.eval.harness import FLOAT_SCHEME as FLOAT_FAMILY  # the KV curves: only the cache quantised
from qbench.eval.metrics import Protocol
from qbench.eval.sampling import DOCUMENTS, sample_name, scored_text
from qbench.eval.tolerance import decision_count, decisions_block, decisions_text, row_interval
from qbench.studies.resolve import rule_text

SWEEP_VERSION = 1
AXES = ("w", "a", "o", "all", "kv")
DEFAULT_AXES = AXES
# The paper's absmax family at its coarsest: weights, inputs and outputs each with one scale per tensor.
DEFAULT_FAMILY = "absmax-coarse"
DEFAULT_BITS = (8, 7, 6, 5, 4, 3, 2)
DEFAULT_TOLERANCE = 1.0  # percent
_TENSOR_FIELDS = {"w": "weight_bits", "a": "act_bits", "o": "out_bits"}


# ------------------------------------------------------------------------------------------------ the plan


@dataclass(frozen=True)
class Curve:
    """One line of the sweep: a family with one axis varied (``kv`` / ``kv-keepK`` for the cache)."""

    family: str
    axis: str
    keep_first: int = 0
    keep_sinks: int = 0
    kv_scheme: str | None = None  # the KV-cache scheme of a kv curve (None: the sweep's default)

    @property
    def label(self) -> str:
        return f"{self.family} {self.axis}"


@dataclass(frozen=True)
class Cell:
    curve: Curve
    bits: int
    scheme: str  # what the grid evaluates: a scheme name with overrides
    kv_bits: int | None = None  # the KV cache's bits (kv curves only)


def parse_axes(text: str | Iterable[str]) -> list[str]:
    """``"w,a,all"`` (or a list of such strings) -> ["w", "a", "all"], checked against :data:`AXES`."""
    parts = [text] if isinstance(text, str) else list(text)
    axes: list[str] = []
    for part in parts:
        for axis in (a.strip() for a in part.split(",")):
            if axis not in AXES:
                raise unknown_choice("sweep axis", axis, AXES)
            if axis not in axes:
                axes.append(axis)
    if not axes:
        raise UserError(f"no sweep axis given; choose from: {', '.join(AXES)}")
    return axes


def parse_bits(text: str | Iterable[int]) -> list[int]:
    """``"8,6,4"`` or ``"8-2"`` (or integers) -> widest first, each 2..8."""
    values: list[int] = []
    items = text.split(",") if isinstance(text, str) else list(text)
    for item in items:
        try:
            if isinstance(item, str) and "-" in item.strip()[1:]:
                hi, lo = (int(x) for x in item.split("-"))
                values += range(max(hi, lo), min(hi, lo) - 1, -1)
            else:
                values.append(int(item))
        except ValueError:
            raise UserError(f"bad bit width {item!r}: give integers 2..8 like 8,6,4 or a range 8-2") from None
    for b in values:
        if not 2 <= b <= 8:
            raise UserError(f"bit width {b} is out of range; choose integers from 2 to 8")
    if not values:
        raise UserError("no bit widths given (e.g. --bits 8-2)")
    return sorted(set(values), reverse=True)


def _with_overrides(family: str, overrides: Mapping[str, int]) -> str:
    """``absmax-coarse`` + {w: 4} -> ``absmax-coarse:w=4``. A family that already has overrides keeps them, except
    that a key being swept *replaces* the family's own value (``absmax-coarse:w=4,group=32`` + {w: 8} ->
    ``absmax-coarse:w=8,group=32``): the swept axis is the one setting the curve varies, and a scheme name
    may not give a key twice."""
    if not overrides:
        return family
    base, sep, spec = family.partition(":")
    items: dict[str, str] = {}
    for item in spec.split(",") if sep else ():
        key, _, value = (part.strip() for part in item.partition("="))
        items[key.lower()] = value  # overrides.py reads keys case-insensitively, so W=4 and w=8 clash too
    items.update({k: str(v) for k, v in overrides.items()})
    return f"{base.strip()}:{','.join(f'{k}={v}' for k, v in items.items())}"


def family_bits(family: str) -> dict[str, int | None]:
    """{w, a, o: bits or None} of a registered family (None: that tensor stays float)."""
    from qbench.quant.schemes import get_scheme

    scheme = get_scheme(family)
    return {axis: getattr(scheme, name) for axis, name in _TENSOR_FIELDS.items()}


def kv_bit_choices() -> tuple[int, ...]:
    """The bit widths the KV cache offers (``qbench.quant.kv``)."""
    from qbench.quant import kv

    return tuple(kv.KV_BITS)


def plan(
    families: Sequence[str],
    axes: Sequence[str],
    bits: Sequence[int],
    keep_first: Sequence[int] = (),
    kv_bits: Sequence[int] | None = None,
    kv_schemes: Sequence[str | None] = (None,),
    keep_sinks: Sequence[int] = (),
) -> tuple[list[Cell], list[str]]:
    """Every cell of the sweep, and a note for each (family, axis) that does not apply (a tensor left float)."""
    cells: list[Cell] = []
    skipped: list[str] = []
    for family in families:
        own = family_bits(family)
        for axis in (a for a in axes if a != "kv"):
            tensors = [t for t in _TENSOR_FIELDS if own[t] is not None] if axis == "all" else [axis]
            if not tensors or own[tensors[0]] is None:
                skipped.append(f"{family} {axis}: {family} keeps that tensor in float")
                continue
            for b in bits:
                changed = {t: b for t in tensors if own[t] != b}
                cells.append(Cell(Curve(family, axis), b, _with_overrides(family, changed)))
    if "kv" in axes:
        choices = kv_bit_choices()
        if kv_bits is not None:
            bad = [b for b in kv_bits if b not in choices]
            if bad:
                raise UserError(f"--kv-bits {bad[0]} is not a KV-cache width; choose from {list(choices)}")
        kv_bits = [b for b in bits if b in choices] if kv_bits is None else list(kv_bits)
        if not kv_bits:
            skipped.append(f"kv: none of bits {list(bits)} is a KV-cache width ({list(choices)})")
        for flag, values in (("--kv-keep-first", keep_first), ("--kv-keep-sinks", keep_sinks)):
            if any(k < 0 for k in values):
                raise UserError(f"{flag} must be ≥ 0, got {min(values)}")
        protections = [(0, 0)] + [(k, 0) for k in dict.fromkeys(keep_first) if k > 0]
        protections += [(0, k) for k in dict.fromkeys(keep_sinks) if k > 0]
        schemes = list(dict.fromkeys(kv_schemes)) or [None]
        for scheme in schemes:
            widths = kv_bits
            if scheme is not None and _fixed_kv_bits(scheme):
                widths = [b for b in kv_bits if b == 8]
                if not widths:
                    skipped.append(f"kv ({scheme}): stores 8 bits only, and 8 is not swept")
            for first, sinks in protections:
                axis = "kv" + (f"-keep{first}" if first else f"-sinks{sinks}" if sinks else "")
                axis += f" ({scheme})" if len(schemes) > 1 else ""
                curve = Curve(FLOAT_FAMILY, axis, first, sinks, scheme)
                cells += [Cell(curve, b, FLOAT_FAMILY, kv_bits=b) for b in widths]
    return cells, skipped


def _fixed_kv_bits(scheme: str) -> bool:
    """Whether a KV-cache scheme stores 8 bits only (the FP8 caches)."""
    from qbench.quant.kvschemes import FP8_ELEMENTS, parse_kv_scheme

    return parse_kv_scheme(scheme)["scheme"] in FP8_ELEMENTS


# -------------------------------------------------------------------------------------------- breaking point


# A change equal to the tolerance passes, but (ppl / fp − 1) · 100 carries float rounding: an exact +1 % comes out
# as 1.0000000000000009. The slack, relative to the tolerance (absolute below a tolerance of 1 %, so that a
# tolerance of 0 still accepts an unchanged perplexity), is far above that rounding (~1e-14 %) and far below any
# difference a table or a person could mean.
from qbench.eval.evidence import TOLERANCE_REL_EPS  # noqa: E402  (one slack for every verdict)


def within_tolerance(change_pct: float | None, tolerance: float) -> bool:
    """Whether a perplexity change (percent; None = NaN/inf or not run) is within ``tolerance`` percent: change ≤
    tolerance, up to :data:`TOLERANCE_REL_EPS` relative, so a cell at exactly +tolerance passes. A lower perplexity
    is noise, not damage, so any negative change passes. The one definition the sweep and ``qbench sensitivity``
    share."""
    if change_pct is None or not math.isfinite(change_pct):
        return False
    return change_pct <= tolerance + TOLERANCE_REL_EPS * max(abs(tolerance), 1.0)


def breaking_point(verdicts: Mapping[int, str]) -> int | None:
    """The lowest bit width *within* the tolerance at that width and at every wider one; None if the widest is
    not within. ``verdicts``: {bits: "within" | "beyond" | "undecided"} (``qbench.eval.evidence.decide``). Walks
    from the widest width down and stops at the first cell not within, so a lucky cell below a failing one never
    lowers the result."""
    lowest = None
    for b in sorted(verdicts, reverse=True):
        if verdicts[b] != WITHIN:
            break
        lowest = b
    return lowest


def breaking_point_range(verdicts: Mapping[int, str]) -> tuple[int | None, int | None]:
    """(certain, possible): :func:`breaking_point`, and the lowest width reached walking down through cells
    within *or undecided*. They differ when undecided cells sit below the certain point: the breaking point is
    then somewhere between (more tokens would say where)."""
    possible = None
    for b in sorted(verdicts, reverse=True):
        if verdicts[b] == BEYOND:
            break
        possible = b
    return breaking_point(verdicts), possible


def breaking_points(
    cells: Iterable[Mapping[str, Any]], tolerance: float, metric: str = DEFAULT_METRIC
) -> list[dict[str, Any]]:
    """One entry per (model, family, axis) of ``sweep.json``'s cells, in first-seen order."""
    curves: dict[tuple[str, str, str], dict[int, str]] = {}
    for c in cells:
        curves.setdefault((c["model"], c["family"], c["axis"]), {})[c["bits"]] = _verdict_of(c, tolerance)
    out = []
    for (model, family, axis), verdicts in curves.items():
        certain, possible = breaking_point_range(verdicts)
        out.append(
            {
                "model": model,
                "family": family,
                "axis": axis,
                "bits": certain,
                "possible_bits": possible,
                "decided": certain == possible,
                "undecided_bits": sorted(b for b, v in verdicts.items() if v == UNDECIDED),
                "widest": max(verdicts),
                "lowest_swept": min(verdicts),
                "tolerance_pct": tolerance,
                "metric": metric,
            }
        )
    return out


def _verdict_of(cell: Mapping[str, Any], tolerance: float) -> str:
    """A sweep cell's verdict; a cell of a sweep.json written before verdicts has no interval: undecided unless
    it failed (NaN, unsupported)."""
    if cell.get("verdict"):
        return cell["verdict"]
    return UNDECIDED if cell["status"] == "ok" else BEYOND


def format_breaking_point(entry: Mapping[str, Any]) -> str:
    """``4``, ``none`` (the widest is not within), ``≤2`` (within down to the lowest width swept), or with
    undecided cells below ``6 (4?)``: certainly 6, possibly as low as 4."""
    bits, possible = entry["bits"], entry.get("possible_bits", entry["bits"])
    text = "none" if bits is None else f"≤{bits}" if bits == entry["lowest_swept"] else str(bits)
    if possible is not None and possible != bits:
        text += f" ({'≤' if possible == entry['lowest_swept'] else ''}{possible}?)"
    return text


# ------------------------------------------------------------------------------------------------- running


@dataclass
class SweepConfig:
    models: list[str]
    families: list[str] = field(default_factory=lambda: [DEFAULT_FAMILY])
    axes: list[str] = field(default_factory=lambda: list(DEFAULT_AXES))
    bits: list[int] = field(default_factory=lambda: list(DEFAULT_BITS))
    tolerance: float = DEFAULT_TOLERANCE  # in the unit of ``metric`` (evidence.METRICS)
    metric: str = DEFAULT_METRIC  # what the tolerance applies to: ppl | kld | top1
    kv_keep_first: list[int] = field(default_factory=list)
    kv_bits: list[int] | None = None  # the kv axis' widths; None: those of ``bits`` that are KV-cache widths
    # the kv axis' KV-cache scheme(s), NAME[:key=value,…]; None: default_kv_scheme(window); a list: one set of
    # curves per scheme
    kv_granularity: str | list[str] | None = None
    kv_keep_sinks: list[int] = field(default_factory=list)

    @property
    def kv_schemes(self) -> list[str | None]:
        g = self.kv_granularity
        return [None] if not g else [g] if isinstance(g, str) else list(g)

    protocol: Protocol = field(default_factory=Protocol)
    output_path: Path = Path("qbench_results/sweep")
    seed: int = 0
    # --resolve: re-evaluate undecided cells at doubling tokens up to this many (qbench.studies.resolve); None: off
    resolve_tokens: int | None = None
    dtype: str = "float32"
    device: str = "cpu"
    attention: bool = True
    trust_remote_code: bool = False
    allow_unsafe_weights: bool = False
    placement: Any = None  # qbench.eval.placement.Placement (None: all on ``device``)
    baseline_path: Path | None = None  # where the float records live if not output_path (shared with a grid)
    # where calibrated schemes and an fp8 scale=calib KV cache take their windows (qbench.quant.calibrate;
    # None: the default, the train split of the protocol's corpus)
    calibration: Any = None


def _scheme_key(scheme: Mapping[str, Any]) -> str:
    return json.dumps(scheme, sort_keys=True, default=str)


def _load(cfg: SweepConfig, model: str) -> Any:
    from qbench.eval.load import load_model

    return load_model(
        model,
        dtype=cfg.dtype,
        device=cfg.device,
        trust_remote_code=cfg.trust_remote_code,
        allow_unsafe_weights=cfg.allow_unsafe_weights,
        placement=cfg.placement,
    )


def _grid_spec(cfg: SweepConfig, models: list[str], schemes: list[str], kv: Any = None) -> Any:
    from qbench.eval.harness import GridSpec

    return GridSpec(
        models=models,
        schemes=schemes,
        modes=["fake"],
        protocol=cfg.protocol,
        output_path=Path(cfg.output_path),
        seed=cfg.seed,
        dtype=cfg.dtype,
        device=cfg.device,
        attention=cfg.attention,
        trust_remote_code=cfg.trust_remote_code,
        allow_unsafe_weights=cfg.allow_unsafe_weights,
        placement=cfg.placement,
        baseline_path=cfg.baseline_path,
        kv=kv,
        **({} if cfg.calibration is None else {"calibration": cfg.calibration}),
    )


_ANY_WINDOW = (
    1 << 30
)  # before a model is loaded: the window is unknown, and only the scheme's syntax is checked


def default_kv_scheme(window: int) -> str:
    """The kv axis' scheme when none is given: KIVI as deployed (G = 32, R = 128), but with R = 32 on windows of
    128 tokens or fewer, where R = 128 would keep the whole window in float (nothing to measure), and per-token
    blocks on windows of 32 or fewer. The choice is written into every record's ``kv`` block and label."""
    if window > 128:
        return "kivi"
    return "kivi:group=32,residual=32" if window > 32 else "per-token"


def _kv_config(cfg: SweepConfig, cell: Cell, window: int) -> Any:
    from qbench.quant.kv import KVConfig

    scheme = cell.curve.kv_scheme or default_kv_scheme(window)
    return KVConfig(cell.kv_bits, scheme, keep_first=cell.curve.keep_first, keep_sinks=cell.curve.keep_sinks)


def _groups(cfg: SweepConfig, cells: list[Cell], window: int) -> list[tuple[Any, list[Cell]]]:
    """Cells grouped into grid runs: the linear-layer cells in one, the KV cells one run per cache setting."""
    groups: dict[str, tuple[Any, list[Cell]]] = {}
    for cell in cells:
        kv = _kv_config(cfg, cell, window) if cell.kv_bits is not None else None
        key = "" if kv is None else _scheme_key(kv.to_dict())
        groups.setdefault(key, (kv, []))[1].append(cell)
    return list(groups.values())


def _unique_schemes(group: Sequence[Cell]) -> list[str]:
    """The group's schemes, each once by its canonical name: ``absmax-coarse:w=8`` (a family with ``w=4`` swept
    back to 8 bits) and ``absmax-coarse`` are one scheme, one record, one evaluation."""
    from qbench.quant.schemes import get_scheme

    seen: dict[str, str] = {}
    for c in group:
        seen.setdefault(c.scheme if c.scheme == FLOAT_FAMILY else get_scheme(c.scheme).name, c.scheme)
    return list(seen.values())


def _plan(cfg: SweepConfig) -> tuple[list[Cell], list[str]]:
    return plan(
        cfg.families, cfg.axes, cfg.bits, cfg.kv_keep_first, cfg.kv_bits, cfg.kv_schemes, cfg.kv_keep_sinks
    )


def validate(cfg: SweepConfig) -> list[Cell]:
    """The plan, with every scheme built once so a bad family or override fails before a model loads."""
    from qbench.eval.evidence import check_metric, check_tolerance
    from qbench.quant.schemes import get_scheme

    check_tolerance(cfg.tolerance, check_metric(cfg.metric))
    cells, _ = _plan(cfg)
    if not cells:
        raise UserError(
            f"nothing to sweep: {'; '.join(plan(cfg.families, cfg.axes, cfg.bits, (), cfg.kv_bits, cfg.kv_schemes)[1])}"
        )
    for cell in cells:
        if cell.kv_bits is None:
            get_scheme(cell.scheme)
        else:
            _kv_config(cfg, cell, cfg.protocol.window or _ANY_WINDOW)  # the user's scheme, checked now
    return cells


def run_sweep(
    cfg: SweepConfig,
    on_record: Callable[[dict[str, Any], bool], None] | None = None,
    command: str | None = None,
    loaded: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """Evaluate every cell not already on disk (:func:`run_grid`), write sweep.json/.md/.png, return the sweep.

    ``loaded``: models already in memory by their entry in ``cfg.models`` (loaded once for all grid runs).
    """
    from qbench.eval.harness import check_kv_window, run_grid

    cells = validate(cfg)
    _, skipped = _plan(cfg)
    start = time.perf_counter()
    fps: dict[str, dict[str, Any]] = {}
    rows: list[dict[str, Any]] = []
    sources: dict[str, str] = {}
    for model in cfg.models:  # one model in memory at a time, loaded once for all its grid runs
        lm = (loaded or {}).get(model) or _load(cfg, model)
        if sources.setdefault(lm.name, lm.source) != lm.source:
            raise UserError(
                f"two models are both named {lm.name!r} ({sources[lm.name]} and {lm.source}): their records "
                f"would share {Path(cfg.output_path) / lm.name}/; rename one folder"
            )
        from qbench.eval.adapters import default_window

        window = default_window(lm.model, cfg.protocol.window, cfg.protocol.tokens, cfg.protocol.sample)
        groups = _groups(cfg, cells, window)
        for kv, _ in groups:  # every KV group refused up front, not after the groups before it ran
            check_kv_window(kv, window)
        for kv, group in groups:
            spec = _grid_spec(cfg, [model], _unique_schemes(group), kv)
            records = run_grid(spec, on_record=on_record, loaded={model: lm})
            fps.setdefault(lm.name, records[0])  # run_grid's float baseline comes first
            index = {_scheme_key(r["scheme"]): r for r in records[1:]}
            for cell in group:
                record = index[_scheme_key(spec.scheme_record(cell.scheme))]
                if cfg.resolve_tokens:
                    rows.append(_resolved_row(cfg, cell, record, fps[lm.name], model, lm, kv, on_record))
                else:
                    rows.append(_row(cfg, cell, record, fps[lm.name]))
    sweep = _summary(cfg, rows, fps, skipped, command, time.perf_counter() - start)
    write_outputs(sweep, Path(cfg.output_path))
    return sweep


def _resolved_row(
    cfg: SweepConfig,
    cell: Cell,
    record: dict[str, Any],
    fp: dict[str, Any],
    model: str,
    lm: Any,
    kv: Any,
    on_record: Callable[[dict[str, Any], bool], None] | None,
) -> dict[str, Any]:
    """The cell's row after ``--resolve``: re-evaluated at doubling tokens while undecided (its own grid of the
    larger protocol: the float baseline and the cell, reused on a rerun), with the steps it took."""
    from dataclasses import replace

    from qbench.eval.harness import run_grid
    from qbench.studies.resolve import resolve

    baseline = [fp]  # the float record of the last protocol evaluated

    window = int(
        record["protocol"]["window"]
    )  # every look keeps the first one's window: more windows, not longer

    def evaluate(tokens: int) -> dict[str, Any]:
        bigger = replace(cfg, protocol=replace(cfg.protocol, tokens=tokens, window=window))
        records = run_grid(
            _grid_spec(bigger, [model], [cell.scheme], kv), on_record=on_record, loaded={model: lm}
        )
        baseline[0] = records[0]
        return records[-1]

    final, steps = resolve(
        record, evaluate, cfg.protocol.tokens, cfg.resolve_tokens or 0, cfg.tolerance, cfg.metric
    )
    row = _row(cfg, cell, final, baseline[0])
    if steps:
        row["resolved"] = steps
    return row


def _row(cfg: SweepConfig, cell: Cell, record: dict[str, Any], fp: dict[str, Any]) -> dict[str, Any]:
    from qbench.eval.harness import stored_path

    m = record["metrics"]
    path = stored_path(Path(cfg.output_path), record)
    kv_name = getattr(record.get("kv"), "get", lambda _k: None)("label")
    fp_seconds = fp.get("eval_seconds") or 0.0
    return {
        "model": record["model"]["name"],
        "family": cell.curve.family,
        "axis": cell.curve.axis,
        "bits": cell.bits,
        "scheme": record["scheme"]["name"],
        "scheme_label": record["scheme"].get("label"),
        "kv": record.get("kv"),
        "kv_label": kv_name,
        "perplexity": m["perplexity"],
        "fp_perplexity": m["fp_perplexity"],
        "ppl_ratio": m["ppl_ratio"],
        "ppl_change_pct": m["ppl_change_pct"],
        "status": record.get("status", "ok"),
        **row_fields(record, cfg.tolerance, cfg.metric),
        "eval_seconds": record.get("eval_seconds"),
        "eval_vs_float": round(record["eval_seconds"] / fp_seconds, 3)
        if fp_seconds and record.get("eval_seconds")
        else None,
        "record": _relative(path, cfg.output_path),
    }


def _relative(path: Path, out: Path) -> str:
    """A record's path as ``sweep.json`` names it: relative to the sweep folder (``../x/fp.json`` for a shared
    float baseline), so the folder can be moved or committed as a whole."""
    return os.path.relpath(path, out)


def _summary(
    cfg: SweepConfig,
    rows: list[dict[str, Any]],
    fps: dict[str, dict[str, Any]],
    skipped: list[str],
    command: str | None,
    wall: float,
) -> dict[str, Any]:
    from qbench.eval.harness import environment, stored_path

    return {
        "sweep_version": SWEEP_VERSION,
        "command": command,
        "tolerance_pct": cfg.tolerance,
        "metric": cfg.metric,
        "resolve_tokens": cfg.resolve_tokens,
        "breaking_point_definition": (
            f"lowest bit width whose {cfg.metric} verdict is within the tolerance (the 95 % interval's upper end "
            "≤ tolerance) at that width and at every wider width swept; none if the widest is not within; "
            "possible_bits: the same walking through undecided cells (the interval straddles the tolerance)"
            + (
                "; a cell --resolve re-evaluated is decided at its last look, each look at a one-sided "
                "0.025 / the planned looks (qbench.studies.resolve)"
                if cfg.resolve_tokens
                else ""
            )
        ),
        "families": list(cfg.families),
        "axes": list(cfg.axes),
        "bits": list(cfg.bits),
        "kv_keep_first": list(cfg.kv_keep_first),
        "kv_keep_sinks": list(cfg.kv_keep_sinks),
        "models": {
            name: {
                "model": fp["model"],
                "fp_perplexity": fp["metrics"]["fp_perplexity"],
                "fp_eval_seconds": fp.get("eval_seconds"),
                "protocol": fp["protocol"],
                "record": _relative(
                    stored_path(Path(cfg.baseline_path or cfg.output_path), fp), cfg.output_path
                ),
            }
            for name, fp in fps.items()
        },
        "cells": rows,
        "breaking_points": breaking_points(rows, cfg.tolerance, cfg.metric),
        # how many verdicts the sweep made and the false *within* calls they could make (:func:`decisions_caption`)
        "decisions": decisions_block(decision_count(rows)),
        "skipped": skipped,
        "env": environment(cfg.device),  # this run's; every record also carries the one it was made with
        "wall_seconds": round(wall, 3),
        "created_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }


# ------------------------------------------------------------------------------------------------- outputs


_NEAR_TOLERANCE = 0.01  # percentage points: closer than this, 2 decimals could not tell +1.00 % from +1.004 %
_MAX_DECIMALS = 9


def format_change(change_pct: float, tolerance: float | None = None) -> str:
    """A perplexity change for a table: ``+0.42 %``, with as many more decimals as needed to see which side of
    ``tolerance`` it is on. Within 0.01 points of the tolerance at least 3 decimals (``+0.996 %``, ``+1.000 %``,
    ``+1.004 %``), and more while the rounded text would pass or fail differently from the value itself
    (``+1.0004 %`` fails a 1 % tolerance, so it is never shown as ``+1.000 %``)."""
    if not math.isfinite(change_pct):
        return "NaN"
    if tolerance is None:
        return f"{change_pct:+.2f} %"
    decimals = 3 if abs(change_pct - tolerance) < _NEAR_TOLERANCE else 2
    verdict = within_tolerance(change_pct, tolerance)
    text = f"{change_pct:+.{decimals}f}"
    while within_tolerance(float(text), tolerance) != verdict and decimals < _MAX_DECIMALS:
        decimals += 1
        text = f"{change_pct:+.{decimals}f}"
    return f"{text} %"


def _change(
    cell: Mapping[str, Any] | None, tolerance: float | None = None, metric: str = DEFAULT_METRIC
) -> str:
    """A cell of the table: the interval its verdict was decided on (``metric``'s: the perplexity change, KLD in
    nats, or the share of tokens whose top-1 token changed) with the verdict's mark."""
    if cell is None:
        return "-"
    if cell["status"] == "nonfinite":
        return "NaN"
    if cell["status"] != "ok" or cell["ppl_change_pct"] is None:
        return "n/a"
    if "verdict" not in cell:  # a sweep.json from before intervals (and before --metric)
        return format_change(cell["ppl_change_pct"], tolerance)
    value, ci = row_interval(cell, metric)
    text = format_interval(value, ci, cell["verdict"], metric, tolerance)
    if cell.get("resolved"):  # re-evaluated on more tokens (--resolve): say on how many
        text += f" @{_short_tokens(cell['resolved'][-1]['tokens_scored'])}"
    return text


def _short_tokens(n: int | None) -> str:
    """``16k`` for 16,384 tokens (a table cell's width), the exact count below 1,024."""
    if not n:
        return "?"
    return f"{n // 1024}k" if n >= 1024 and n % 1024 == 0 else f"{n:,}"


def curves_of(sweep: Mapping[str, Any]) -> dict[tuple[str, str, str], dict[int, dict[str, Any]]]:
    """{(model, family, axis): {bits: cell}} in the sweep's order."""
    curves: dict[tuple[str, str, str], dict[int, dict[str, Any]]] = {}
    for c in sweep["cells"]:
        curves.setdefault((c["model"], c["family"], c["axis"]), {})[c["bits"]] = c
    return curves


def sweep_table(sweep: Mapping[str, Any]) -> str:
    """The sweep as a markdown table (rows = model × family × axis, columns = bits, then the breaking point)."""
    from tabulate import tabulate

    tol, metric = sweep["tolerance_pct"], sweep.get("metric", DEFAULT_METRIC)
    bits = sweep["bits"]
    points = {(p["model"], p["family"], p["axis"]): p for p in sweep["breaking_points"]}
    rows = [
        [
            model,
            family,
            axis,
            *(_change(cells.get(b), tol, metric) for b in bits),
            format_breaking_point(points[key]),
        ]
        for key, cells in curves_of(sweep).items()
        for model, family, axis in [key]
    ]
    goal = f"≤ {tolerance_text(tol, metric)}"
    headers = ["model", "family", "axis", *(f"{b} bit" for b in bits), f"breaking point ({goal})"]
    return tabulate(rows, headers, tablefmt="github", disable_numparse=True)


# What a sweep table's cells show on each --metric: the caption's first words, and what "each ... is shown ±" names.
_SHOWN = {
    "ppl": ("Perplexity change vs float", "change"),
    "kld": ("Mean KL divergence from the float model per token in nats, the verdicts' metric", "KLD"),
    "top1": (
        "Share of tokens whose most likely next token differs from the float model's, in %, the verdicts' metric",
        "share",
    ),
}


def sweep_caption(sweep: Mapping[str, Any]) -> str:
    """What the table measured: protocol, tolerance, axes, float perplexities and the time per cell."""
    models = sweep["models"]
    p = next(iter(models.values()))["protocol"]
    fps = ", ".join(f"{name} {m['fp_perplexity']:.2f}" for name, m in models.items())
    ratios = sorted(c["eval_vs_float"] for c in sweep["cells"] if c.get("eval_vs_float"))
    timing = (
        f" One cell's evaluation took ×{ratios[len(ratios) // 2]:.2f} of the float evaluation (median)."
        if ratios
        else ""
    )
    metric = sweep.get("metric", DEFAULT_METRIC)
    shown, what = _SHOWN[metric]
    tolerance = (
        f"{sweep['tolerance_pct']:g}"
        if metric == DEFAULT_METRIC
        else tolerance_text(sweep["tolerance_pct"], metric)
    )
    text = (
        f"{shown} (fp perplexity: {fps}) on {p['corpus']}/{p['split']}, "
        f"{scored_text(p)}, fake quantisation. Axis w / a / o: only the "
        "family's weights / input activations / outputs at that width, the rest at the family's own bits; "
        "all: every tensor the family quantises; kv: the float model with a quantised KV cache (kv-keepK: "
        "positions < K kept in float; kv-sinksK: the K most-attended positions of the float pass kept in float; "
        f"(name): the KV-cache scheme). Each {what} is shown ± the half-width of its 95 % interval (paired, "
        f"{'documents' if sample_name(p) == DOCUMENTS else 'windows'} as clusters): ✗ beyond the tolerance (the interval's lower end above it), ? undecided (the interval "
        f"straddles it). Breaking point ({metric}, tolerance "
        f"{tolerance}): the lowest width within the tolerance there and at every wider width; "
        "≤b: within down to the lowest width swept; none: the widest is not within; (b?): undecided cells "
        f"below, so the breaking point may be as low as b.{timing}"
    )
    resolved = [c for c in sweep["cells"] if c.get("resolved")]
    if resolved:
        decided = sum(c["verdict"] != UNDECIDED for c in resolved)
        text += (
            f" --resolve: {len(resolved)} undecided cell(s) re-evaluated at doubling tokens up to "
            f"{sweep['resolve_tokens']:,}; {decided} decided (the row shows the last evaluation: `resolved` in "
            "sweep.json lists each step)."
        )
        rule = rule_text([s for c in resolved for s in c["resolved"]])
        if rule:  # a sweep from before the rule decided every look at 95 %
            text += (
                f" {rule[0].upper()}{rule[1:]}; ± shows the 95 % interval, the mark the verdict of the cell's last "
                "look."
            )
    decisions = decisions_caption(sweep)
    if decisions:
        text += f" {decisions}"
    if sweep.get("skipped"):
        text += f" Not swept: {'; '.join(sweep['skipped'])}."
    return text


def decisions_caption(sweep: Mapping[str, Any]) -> str:
    """How many verdicts the sweep made and the false *within* calls they could make were every cell exactly at the
    tolerance (sweep.json's ``decisions``: ``qbench.eval.tolerance.decisions_block``); empty for a sweep.json
    from before it was counted, or with fewer than two verdicts."""
    block = sweep.get("decisions")
    if not block or block["count"] < 2:
        return ""
    metric = sweep.get("metric", DEFAULT_METRIC)
    return "Decisions: " + decisions_text(block, sweep["tolerance_pct"], metric, "cells, each record once")


def write_outputs(sweep: dict[str, Any], out: Path) -> dict[str, Path]:
    """sweep.json, sweep.md (from that JSON) and sweep.png in ``out``."""
    from qbench.studies.plots import sweep_plot

    paths = {"json": out / "sweep.json", "md": out / "sweep.md", "png": out / "sweep.png"}
    if "decisions" in sweep:  # counted again: sweeps merged into one (a card's, one per model) hold them all
        sweep["decisions"] = decisions_block(decision_count(sweep["cells"]))
    atomic_write_json(paths["json"], sweep)
    command = f"Made by `{sweep['command']}`.\n\n" if sweep.get("command") else ""
    atomic_write_text(
        paths["md"],
        f"# qbench sweep\n\n{command}{sweep_table(sweep)}\n\n{sweep_caption(sweep)}\n\n![sweep](sweep.png)\n",
    )
    sweep_plot(sweep, curves_of(sweep), paths["png"])  # curves passed in: plots imports no study
    return paths


def read_sweep(path: str | Path) -> dict[str, Any]:
    """A ``sweep.json`` (or the folder holding one)."""
    path = Path(path)
    if path.is_dir():
        path = path / "sweep.json"
    try:
        sweep = json.loads(path.read_text())
    except OSError:
        raise UserError(f"no sweep at {path}: run `qbench sweep` first") from None
    except ValueError:
        raise UserError(f"{path} is not valid JSON (a torn or hand-edited sweep file?)") from None
    if not isinstance(sweep, dict) or "breaking_points" not in sweep:
        raise UserError(f"{path} is not a qbench sweep (no breaking_points)")
    return sweep


def breaking_point_columns(sweep: Mapping[str, Any]) -> dict[str, dict[str, str]]:
    """{model: {"break <family> <axis>": "4" | "none" | "≤2"}} — extra columns for ``qbench compare``."""
    columns: dict[str, dict[str, str]] = {}
    for p in sweep["breaking_points"]:
        header = (
            f"break {p['family']} {p['axis']} (≤ {tolerance_text(p['tolerance_pct'], _metric(p, sweep))})"
        )
        columns.setdefault(p["model"], {})[header] = format_breaking_point(p)
    return columns


def expected_records(cfg: SweepConfig) -> int:
    """How many records the sweep's grid runs pass to ``on_record`` (float baselines included): a progress total."""
    return sum(
        len(cfg.models) * (1 + len(_unique_schemes(group)))
        for _, group in _groups(cfg, validate(cfg), cfg.protocol.window or _ANY_WINDOW)
    )


def describe_breaking_points(points: Iterable[Mapping[str, Any]]) -> str:
    """``absmax-coarse all: 6, fp kv: 4 (change ≤ 1 %)`` — one line for a model's breaking points."""
    points = list(points)
    if not points:
        return "no breaking points"
    text = ", ".join(f"{p['family']} {p['axis']}: {format_breaking_point(p)}" for p in points)
    return f"{text} bits (≤ {tolerance_text(points[0]['tolerance_pct'], _metric(points[0], {}))})"


def _metric(point: Mapping[str, Any], sweep: Mapping[str, Any]) -> str:
    """A breaking point's metric (records from before metrics were recorded per point: the sweep's, else ppl)."""
    return point.get("metric") or sweep.get("metric") or DEFAULT_METRIC
