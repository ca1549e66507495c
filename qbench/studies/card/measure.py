""":func:`measure`: every cell, KV row, sweep, repair and speed record of each model, evaluated or reused;
:func:`run_card` builds the card from them and writes it (``write_card(build_card(measure(cfg)))``).

One model is measured in phases, in this order (the order of the cells on disk and of the progress bar):
the float record (:func:`_float`), the formats (:func:`_formats`), llama.cpp's file types and the mixed-precision
plan (:mod:`~.llama`), the KV rows (:func:`_kv`), the breaking points
(:func:`_sweep`), the repairs (:func:`_repairs`) and the map of the worst format (:func:`_avoid_map`), the speed
(:func:`_speed`)."""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from models.errors import UserError
from qbench.studies.card.build import build_card
from qbench.studies.card.config import (
    CardConfig,
    card_inputs,
    check_output,
    check_tokenizers,
    grid_spec,
    kv_configs,
    kv_problem,
    kv_widths,
    kv_window,
    local_tokenizers,
    planned_cells,
    planned_inputs,
    planned_kv_rows,
    skipped_kv_record,
    slug,
    sweep_config,
    validate,
)
from qbench.studies.card.decide import repair_targets, size_to_beat, worst_beyond
from qbench.studies.card.llama import llama_cpp_rows, mixed_plan
from qbench.studies.card.plan import KV_KEEP_SINKS
from qbench.studies.card.profile import layer_speed_record, profile_record, speed_record
from qbench.studies.card.result import ModelResult, Record, stored_paths, window_nll
from qbench.studies.card.sizes import quantised_source_bytes, repaired_bytes
from qbench.studies.card.write import write_card


@dataclass
class Progress:
    """What :func:`run_card` tells its caller: ``total(n)`` whenever the planned count of cells changes
    (:class:`CellCount` says why it does), ``cell(record, reused)`` after each."""

    total: Callable[[int], None] = lambda n: None
    cell: Callable[[dict[str, Any], bool], None] = lambda r, reused: None
    estimate: Callable[[int, float, str], None] = lambda n, seconds, model: None
    note: Callable[[str], None] = lambda line: None  # what the card could not measure, as it skips it


@dataclass
class CellCount:
    """The progress bar's total over all models. No phase knows it in advance: a model's planned cells are added
    when it loads, then corrected as its phases learn better (a longer KV window adds a float record, a short one
    merges KIVI's rows into the per-token ones, a model skips KV rows it cannot run, a sensitivity study knows its
    units when it starts and its repair one step at a time)."""

    progress: Progress
    n: int = 0

    def add(self, cells: int) -> None:
        self.n += cells
        self.progress.total(self.n)


@dataclass
class _Subject:
    """One model being measured, and what its phases share."""

    cfg: CardConfig
    model: str  # as the config names it: the key its loaded model goes under for the harness
    lm: Any  # ``qbench.eval.load.load_model``'s result
    count: CellCount
    resolved: dict[str, list[Record]] = field(default_factory=dict)  # final cell id -> --resolve's steps

    @property
    def progress(self) -> Progress:
        return self.count.progress


def run_card(cfg: CardConfig, progress: Progress | None = None) -> dict[str, Any]:
    """Evaluate (or reuse) every cell of the card for each model, then build it and write card.json/.md/.html."""
    start = time.perf_counter()
    per_model = measure(cfg, progress)
    card = build_card(per_model, settings=_settings(cfg, time.perf_counter() - start))
    # what only the models could tell (their window, the KV scheme it chose): the cells stay on disk either way
    check_output(cfg, card_inputs(json.loads(json.dumps(card))))
    write_card(card, Path(cfg.output_path))
    return card


def measure(cfg: CardConfig, progress: Progress | None = None) -> list[ModelResult]:
    """Each model's records, evaluated or reused, one model in memory at a time. The config, the output folder
    and the local tokenizers are checked first, before any model loads."""
    progress = progress or Progress()
    validate(cfg)
    check_output(cfg, planned_inputs(cfg))
    check_tokenizers(local_tokenizers(cfg.models))
    gap = _kv_scheme_gap(cfg)
    if gap:
        progress.note(gap)
    count = CellCount(progress)
    sources: dict[str, str] = {}  # model name -> its source: two of one name would share a records folder
    first: tuple[str, Any] | None = None  # (name, tokenizer) of the first model: every other must match it
    per_model = []
    for model in cfg.models:
        lm = _load(cfg, model, sources, first)
        first = first or (lm.name, lm.tokenizer)
        per_model.append(_measure_model(_Subject(cfg, model, lm, count)))
    _merge_sweeps(cfg, [m.sweep for m in per_model if m.sweep])
    return per_model


def _kv_scheme_gap(cfg: CardConfig) -> str | None:
    """With ``--kv-scheme`` that stores fewer widths than the budget's KV rows (fp8: 8 bits), what goes unmeasured."""
    if cfg.kv_scheme is None:
        return None
    plan, widths = cfg.plan, kv_widths(cfg.plan, cfg.kv_scheme)
    left = [b for b in plan.kv_bits if b not in widths]
    if not left:
        return None
    return (
        f"KV rows at {'/'.join(map(str, widths))} bits only: --kv-scheme {cfg.kv_scheme} stores no other "
        f"width (the {plan.name} budget's {'/'.join(map(str, left))} bits not measured)"
    )


def _settings(cfg: CardConfig, seconds: float) -> dict[str, Any]:
    """The card's settings: what it measured (the budget's contents as the card's header states them) and how."""
    from dataclasses import replace

    # the llama.cpp rows and the plan as measured (none without llama-cpp-python, or as --mixed-plan said)
    plan = replace(cfg.plan, llama_cpp=cfg.llama_cpp, mixed_plan=cfg.mixed_plan)
    contents = plan.describe(cfg.tokens)
    if cfg.kv_scheme is not None:
        widths = kv_widths(plan, cfg.kv_scheme)
        contents += (
            f"; KV rows: --kv-scheme {cfg.kv_scheme} at {'/'.join(map(str, widths))} bits, plain and with "
            f"{KV_KEEP_SINKS} sink kept, instead of the budget's"
        )
        gap = _kv_scheme_gap(cfg)
        if gap:
            contents += f"; {gap}"
    return {
        "budget": plan.name,
        "budget_contents": contents,
        "tolerance_pct": cfg.tolerance,
        "metric": cfg.metric,
        "resolve_tokens": cfg.resolve_tokens,
        "command": cfg.command,
        "seed": cfg.seed,
        "output_path": str(cfg.output_path),
        "wall_seconds": round(seconds, 3),
        "device": cfg.device,
    }


def _load(cfg: CardConfig, model: str, sources: dict[str, str], first: tuple[str, Any] | None) -> Any:
    """``model`` loaded, refused when it shares its name with another or its tokenizer differs from ``first``'s."""
    from qbench.eval.load import load_model

    lm = load_model(
        model,
        dtype=cfg.dtype,
        device=cfg.device,
        trust_remote_code=cfg.trust_remote_code,
        allow_unsafe_weights=cfg.allow_unsafe_weights,
        placement=cfg.placement,
    )
    if sources.setdefault(lm.name, lm.source) != lm.source:
        raise UserError(
            f"two models are both named {lm.name!r} ({sources[lm.name]} and {lm.source}): their records would "
            f"share {Path(cfg.output_path) / lm.name}/; rename one folder"
        )
    # a GGUF's or a hub model's tokenizer is read only now (the folders' were compared before any work)
    check_tokenizers([*([first] if first else []), (lm.name, lm.tokenizer)])
    return lm


def _measure_model(m: _Subject) -> ModelResult:
    """One model's phases, in the order their cells are evaluated."""
    m.count.add(planned_cells(m.cfg))
    spec, evaluation, fp = _float(m)
    profile, _ = profile_record(evaluation, fp, m.cfg.device)
    formats, at_budget = _formats(m, spec, evaluation)
    llama_cpp = llama_cpp_rows(m, spec, evaluation)
    plan_made = mixed_plan(m, llama_cpp)
    kv = _kv(m)
    sweep = _sweep(m, [fp, *formats])
    source_bytes = quantised_source_bytes(fp)
    repairs = _repairs(m, fp, profile, formats, at_budget, source_bytes)
    avoid_map = _avoid_map(m, formats, at_budget, repairs)
    speed, layer_speed = _speed(m, fp, profile)
    out = Path(m.cfg.output_path)
    return ModelResult(
        fp=fp,
        profile=profile,
        formats=formats,
        kv=kv,
        sweep=sweep,
        repairs=repairs,
        avoid_map=avoid_map,
        speed=speed,
        layer_speed=layer_speed,
        source=m.lm.source,
        source_bytes=source_bytes,
        window_nll=window_nll(out, [fp, *formats, *llama_cpp]),
        resolved=m.resolved,
        paths=stored_paths(out, [fp, *formats, *llama_cpp, *(r for r in kv if "cell_id" in r)]),
        llama_cpp=llama_cpp,
        llama_cpp_skipped=m.cfg.llama_cpp_skipped,
        mixed_plan=plan_made,
    )


def _float(m: _Subject) -> tuple[Any, Any, Record]:
    """The formats' grid spec, the model's evaluation and its float record: refused before any format is
    quantised when the weights or the float model's scores are not finite."""
    from qbench.eval.harness import ModelEvaluation, refuse_nonfinite_weights, refuse_unscorable

    spec = grid_spec(m.cfg, m.model, list(m.cfg.plan.formats))
    evaluation = ModelEvaluation(spec, m.model, lm=m.lm)
    evaluation.check()
    refuse_nonfinite_weights(m.lm.name, m.lm.model, "a card")
    fp = evaluation.fp_record()
    refuse_unscorable(m.lm.name, fp, "a card")
    m.progress.cell(fp, evaluation.fp_reused)
    m.progress.estimate(planned_cells(m.cfg), fp.get("eval_seconds") or 0.0, m.lm.name)
    return spec, evaluation, fp


def _formats(m: _Subject, spec: Any, evaluation: Any) -> tuple[list[Record], dict[str, Record]]:
    """One row per format (after --resolve: the deciding record), and each scheme's record on the card's own
    tokens: the repair starts from that one, since a row --resolve re-evaluated on more tokens no longer shares
    the sensitivity study's protocol."""
    from qbench.eval.harness import cell_record

    formats, at_budget = [], {}
    for scheme in m.cfg.plan.formats:
        record, reused = cell_record(spec, evaluation, scheme, "fake")
        m.progress.cell(record, reused)
        at_budget[record["scheme"]["name"]] = record
        formats.append(_resolve_row(m.cfg, record, m.resolved, lambda t, w, s=scheme: _format_at(m, s, t, w)))
    return formats, at_budget


@dataclass
class _KVPlan:
    cfg: CardConfig  # the KV rows' protocol: the card's at the KV window
    configs: list[Any]  # ``qbench.quant.kv.KVConfig``, one per row label
    problems: dict[str, str | None]  # row label -> why this model cannot run it (None: it can)
    own_float: bool  # the KV window differs from the evaluation's: its float record is one more cell


def _kv_plan(m: _Subject) -> _KVPlan:
    """The model's KV rows at its KV window; the count corrected from the budget's rows to these, each skipped
    row noted as it is skipped."""
    from dataclasses import replace

    from qbench.eval.adapters import default_window
    from qbench.eval.sampling import DOCUMENTS, MIN_WINDOWS

    cfg, lm = m.cfg, m.lm
    protocol = cfg.protocol()
    window = default_window(lm.model, protocol.window, protocol.tokens, protocol.sample)
    kv_win = kv_window(lm.model, window)
    if kv_win != window:
        m.count.add(1)
    configs = kv_configs(cfg, kv_win)
    planned = planned_kv_rows(cfg)
    if len(configs) != planned:  # a window of ≤ 32 tokens: KIVI's rows are the per-token ones
        m.count.add(len(configs) - planned)
    problems = {c.label: kv_problem(lm, c) for c in configs}
    skipped: dict[str, list[str]] = {}
    for label, why in problems.items():
        if why:
            skipped.setdefault(why, []).append(label)
    if skipped:
        m.count.add(-sum(map(len, skipped.values())))
    for why, labels in skipped.items():
        m.progress.note(f"{lm.name}: KV rows {', '.join(labels)} skipped: {why}")
    kv_cfg = cfg
    if kv_win != window:
        # a KV error grows with the context: the rows keep a long window, and score as many windows of it as every
        # budget scores (qbench.eval.sampling.MIN_WINDOWS) under the documents sample
        tokens = _tokens(cfg)
        if protocol.sample == DOCUMENTS:
            tokens = max(tokens, MIN_WINDOWS * kv_win)
        kv_cfg = replace(cfg, window=kv_win, tokens=tokens)
    return _KVPlan(kv_cfg, configs, problems, kv_win != window)


def _kv(m: _Subject) -> list[Record]:
    """One record per KV row (after --resolve: the deciding one), or a skipped row's reason."""
    from qbench.eval.harness import run_grid

    plan = _kv_plan(m)
    kv: list[Record] = []
    for config in plan.configs:
        why = plan.problems[config.label]
        if why:
            kv.append(skipped_kv_record(config, why))
            continue
        seen: list[bool] = []
        spec = grid_spec(plan.cfg, m.model, ["fp"], kv=config)
        records = run_grid(spec, lambda r, reused, seen=seen: seen.append(reused), loaded={m.model: m.lm})
        # the KV window's float record comes with the first row evaluated; the later rows reuse it uncounted
        if plan.own_float and not any("cell_id" in r for r in kv):
            m.progress.cell(records[0], seen[0])
        m.progress.cell(records[-1], seen[-1])
        kv.append(
            _resolve_row(
                plan.cfg, records[-1], m.resolved, lambda t, w, c=config: _kv_at(plan.cfg, m, c, t, w)
            )
        )
    return kv


def _sweep(m: _Subject, counted: Sequence[Record]) -> Record | None:
    """``qbench sweep``'s breaking points (the budget's families), or None where it sweeps none; ``counted``: the
    records the progress bar has already seen (the float one, the formats the sweep shares)."""
    if not m.cfg.plan.sweep_families:
        return None
    from qbench.studies.sweep import run_sweep

    on_sweep = _new_cells_only(m.progress, {r["cell_id"] for r in counted})
    return run_sweep(
        sweep_config(m.cfg, m.model), on_record=on_sweep, command=m.cfg.command, loaded={m.model: m.lm}
    )


def _merge_sweeps(cfg: CardConfig, sweeps: Sequence[Record]) -> None:
    """One run_sweep per model (one model in memory at a time) each wrote DIR/sweep.json: it then holds them all."""
    if len(sweeps) <= 1:
        return
    from qbench.studies.sweep import write_outputs

    merged = {
        **sweeps[-1],
        "models": {k: v for s in sweeps for k, v in s["models"].items()},
        "cells": [c for s in sweeps for c in s["cells"]],
        "breaking_points": [p for s in sweeps for p in s["breaking_points"]],
    }
    write_outputs(merged, Path(cfg.output_path))


def _repairs(
    m: _Subject,
    fp: Record,
    profile: Record,
    formats: Sequence[Record],
    at_budget: dict[str, Record],
    source_bytes: int | None,
) -> list[Record]:
    """The sensitivity studies tried in turn, up to the budget's candidates: each costs a study, so the first that
    pays (within, and smaller than what already passes) ends the search."""
    cfg = m.cfg
    limit, _ = size_to_beat(formats, fp, profile, cfg.tolerance, cfg.metric, source_bytes)
    targets = repair_targets(formats, fp, profile, cfg.tolerance, cfg.metric, source_bytes)
    repairs = []
    for target in targets[: cfg.plan.repair_candidates]:
        record = at_budget[target["scheme"]["name"]]
        study = _sensitivity(m, record)
        repairs.append(study)
        size = repaired_bytes(record, study, fp, profile)
        if study["repair"]["reached"] and size is not None and (limit is None or size < limit):
            break
    return repairs


def _avoid_map(
    m: _Subject, formats: Sequence[Record], at_budget: dict[str, Record], repairs: Sequence[Record]
) -> Record | None:
    """Where the most damaged format's damage comes from: a map by type (no repair), the kinds of layer "avoid"
    names; a repair of that format by type already is one."""
    worst = worst_beyond(formats, m.cfg.tolerance, m.cfg.metric)
    if worst is None:
        return None
    name = worst["scheme"]["name"]
    tried = next((r for r in repairs if r["scheme"]["name"] == name and r["by"] == "type"), None)
    return tried or _sensitivity(m, at_budget[name], repair=False)


def _speed(m: _Subject, fp: Record, profile: Record) -> tuple[list[Record] | Record | None, Record | None]:
    """The real kernels' timings: the whole model's (``speed.json``, full budget) and per layer."""
    formats = m.cfg.plan.formats
    return (
        speed_record(m.cfg, m.lm, fp, formats),
        layer_speed_record(m.cfg, m.lm, fp, profile, formats),
    )


def _tokens(cfg: CardConfig) -> int:
    return cfg.tokens or cfg.plan.tokens


def _resolve_row(
    cfg: CardConfig,
    record: dict[str, Any],
    resolved: dict[str, list[dict[str, Any]]],
    evaluate: Callable[[int, int], dict[str, Any]],
) -> dict[str, Any]:
    """``record``, or with ``--resolve`` and an undecided verdict the same cell re-evaluated at doubling tokens
    until decided or at the cap (``qbench.studies.resolve``); its steps go to ``resolved`` by cell id. Every look
    keeps the first one's window (``evaluate(tokens, window)``): the default window grows with the budget
    (``qbench.eval.sampling.default_window``), and more tokens must mean more windows, not longer ones."""
    if not cfg.resolve_tokens or record.get("status") != "ok":
        return record
    from qbench.studies.resolve import resolve

    window = int(record["protocol"]["window"])
    final, steps = resolve(
        record, lambda t: evaluate(t, window), _tokens(cfg), cfg.resolve_tokens, cfg.tolerance, cfg.metric
    )
    if steps:
        resolved[final["cell_id"]] = steps
    return final


def _format_at(m: _Subject, scheme: str, tokens: int, window: int) -> Record:
    """A format's cell on ``tokens`` tokens of ``window``-token windows (its float baseline of that protocol
    first)."""
    from dataclasses import replace

    from qbench.eval.harness import ModelEvaluation, cell_record

    spec = grid_spec(replace(m.cfg, tokens=tokens, window=window), m.model, [scheme])
    evaluation = ModelEvaluation(spec, m.model, lm=m.lm)
    evaluation.check()
    evaluation.fp_record()
    record, reused = cell_record(spec, evaluation, scheme, "fake")
    m.progress.cell(record, reused)
    return record


def _kv_at(cfg: CardConfig, m: _Subject, config: Any, tokens: int, window: int) -> Record:
    """A KV row's cell on ``tokens`` tokens of ``window``-token windows (``cfg``: the KV rows' protocol)."""
    from dataclasses import replace

    from qbench.eval.harness import run_grid

    seen: list[bool] = []
    spec = grid_spec(replace(cfg, tokens=tokens, window=window), m.model, ["fp"], kv=config)
    records = run_grid(spec, lambda r, reused: seen.append(reused), loaded={m.model: m.lm})
    m.progress.cell(records[-1], seen[-1])
    return records[-1]


def _new_cells_only(progress: Progress, seen: set[str]) -> Callable[[dict[str, Any], bool], None]:
    """The sweep's ``on_record``: its float record and the cells that are also formats were counted already."""

    def on_record(record: dict[str, Any], reused: bool) -> None:
        if record["cell_id"] not in seen:
            seen.add(record["cell_id"])
            progress.cell(record, reused)

    return on_record


def _sensitivity(m: _Subject, target: Record, repair: bool = True) -> Record:
    """``qbench sensitivity``'s map and repair of ``target``'s scheme (by the budget's unit), in
    ``DIR/sensitivity/<model>/<scheme>/`` with its cells under ``cells/``. The repair starts from ``target``,
    the card's own record of that format on its own tokens (not evaluated again); the quick budget's repair is not
    minimised. ``repair=False``: the map alone, by type (which kinds of layer a format's damage comes from: what
    "avoid" names), its cells in the same folder (a later repair of that format reuses them when the unit
    matches)."""
    from qbench.studies.sensitivity import sensitivity, write_sensitivity

    cfg, scheme = m.cfg, target["scheme"]["name"]
    out = Path(cfg.output_path) / "sensitivity" / m.lm.name / slug(scheme)
    # the card's own float record (same protocol and statistics): the study does not evaluate the float model again
    spec = grid_spec(cfg, m.lm.source, [scheme], baseline_path=Path(cfg.output_path))
    spec.output_path = out / "cells"
    steps = 0

    def on_units(n: int) -> None:
        m.count.add(n + int(repair))  # the repair's first set is known with the units, the rest one at a time

    def on_cell(phase: str, record: dict[str, Any], reused: bool) -> None:
        nonlocal steps
        if phase == "repair":
            steps += 1
            if steps > 1:
                m.count.add(1)
        m.progress.cell(record, reused)

    result = sensitivity(
        spec,
        by=cfg.plan.sensitivity_by if repair else "type",
        tolerance=cfg.tolerance,
        metric=cfg.metric,
        on_cell=on_cell,
        on_units=on_units,
        lm=m.lm,
        minimise=cfg.plan.repair_minimise,
        quantised=target,
        repair_units=repair,
    )
    # written for the map alone too: its sensitivity.json marks the folder as a study's, which compare and
    # read_records leave out (its cells keep most layers in float) — unless a repair's report is already there
    # (the full budget repairs by layer and maps by type in the same folder): that one is the richer
    if repair or not (out / "sensitivity.json").exists():
        write_sensitivity(result, out, cfg.command or "qbench card")
    return {**result, "output": str(out)}
