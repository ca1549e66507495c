""":func:`run_card`: every cell, KV row, sweep, repair and speed record of each model, evaluated or reused, then
built and written (``write(build(measure(cfg)))``)."""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
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
    skipped_kv_record,
    slug,
    sweep_config,
    validate,
)
from qbench.studies.card.decide import repair_targets, size_to_beat, worst_beyond
from qbench.studies.card.plan import KV_KEEP_SINKS
from qbench.studies.card.profile import layer_speed_record, profile_record, speed_record
from qbench.studies.card.result import ModelResult
from qbench.studies.card.sizes import quantised_source_bytes, repaired_bytes
from qbench.studies.card.write import write_card


@dataclass
class Progress:
    """What :func:`run_card` tells its caller: ``total(n)`` when the count of cells grows (the sensitivity's
    units and repair are known only when they start), ``cell(record, reused)`` after each."""

    total: Callable[[int], None] = lambda n: None
    cell: Callable[[dict[str, Any], bool], None] = lambda r, reused: None
    estimate: Callable[[int, float, str], None] = lambda n, seconds, model: None
    note: Callable[[str], None] = lambda line: None  # what the card could not measure, as it skips it


def run_card(cfg: CardConfig, progress: Progress | None = None) -> dict[str, Any]:
    """Evaluate (or reuse) every cell of the card for each model, then build it and write card.json/.md/.html."""
    from dataclasses import replace

    from qbench.eval.adapters import default_window
    from qbench.eval.harness import (
        ModelEvaluation,
        cell_record,
        refuse_nonfinite_weights,
        refuse_unscorable,
        run_grid,
    )
    from qbench.eval.load import load_model

    progress = progress or Progress()
    validate(cfg)
    check_output(cfg, planned_inputs(cfg))
    check_tokenizers(local_tokenizers(cfg.models))
    plan = cfg.plan
    start = time.perf_counter()
    tokenizers: list[tuple[str, Any]] = []
    contents = plan.describe(cfg.tokens)
    if cfg.kv_scheme is not None:
        widths = kv_widths(plan, cfg.kv_scheme)
        contents += (
            f"; KV rows: --kv-scheme {cfg.kv_scheme} at {'/'.join(map(str, widths))} bits, plain and with "
            f"{KV_KEEP_SINKS} sink kept, instead of the budget's"
        )
        left = [b for b in plan.kv_bits if b not in widths]
        if left:  # fp8: the budget's 8-bit rows only
            line = (
                f"KV rows at {'/'.join(map(str, widths))} bits only: --kv-scheme {cfg.kv_scheme} stores no other "
                f"width (the {plan.name} budget's {'/'.join(map(str, left))} bits not measured)"
            )
            contents += f"; {line}"
            progress.note(line)
    per_model: list[ModelResult] = []
    count = {"n": 0}  # cells announced to the progress bar, over all models
    names: dict[str, str] = {}
    for model in cfg.models:
        lm = load_model(
            model,
            dtype=cfg.dtype,
            device=cfg.device,
            trust_remote_code=cfg.trust_remote_code,
            allow_unsafe_weights=cfg.allow_unsafe_weights,
        )
        if names.setdefault(lm.name, lm.source) != lm.source:
            raise UserError(
                f"two models are both named {lm.name!r} ({names[lm.name]} and {lm.source}): their records would "
                f"share {Path(cfg.output_path) / lm.name}/; rename one folder"
            )
        # a GGUF's or a hub model's tokenizer is read only now (the folders' were compared before any work)
        check_tokenizers([*tokenizers[:1], (lm.name, lm.tokenizer)])
        tokenizers = tokenizers or [(lm.name, lm.tokenizer)]
        count["n"] += planned_cells(cfg)
        progress.total(count["n"])
        spec = grid_spec(cfg, model, list(plan.formats))
        evaluation = ModelEvaluation(spec, model, lm=lm)
        evaluation.check()
        refuse_nonfinite_weights(lm.name, lm.model, "a card")
        fp = evaluation.fp_record()
        refuse_unscorable(lm.name, fp, "a card")
        progress.cell(fp, evaluation.fp_reused)
        progress.estimate(planned_cells(cfg), fp.get("eval_seconds") or 0.0, lm.name)
        profile, _ = profile_record(evaluation, fp, cfg.device)
        formats = []
        resolved: dict[str, list[dict[str, Any]]] = {}  # the final record's cell id -> --resolve's steps
        # scheme name -> its record on the card's own tokens: the repair reuses that one, since a row --resolve
        # re-evaluated on more tokens no longer shares the sensitivity study's protocol
        at_budget: dict[str, dict[str, Any]] = {}
        for scheme in plan.formats:
            record, reused = cell_record(spec, evaluation, scheme, "fake")
            progress.cell(record, reused)
            at_budget[record["scheme"]["name"]] = record
            formats.append(
                _resolve_row(
                    cfg,
                    record,
                    resolved,
                    lambda t, s=scheme, m=model, x=lm: _format_at(cfg, m, x, s, t, progress),
                )
            )
        window = default_window(lm.model, cfg.window)
        kv = []
        kv_win = kv_window(lm.model, window)
        # the KV rows' own protocol when their window is longer than the evaluation's (one more float record)
        kv_cfg = cfg if kv_win == window else replace(cfg, window=kv_win)
        if kv_win != window:
            count["n"] += 1
            progress.total(count["n"])
        configs = kv_configs(cfg, kv_win)
        planned_kv = len(plan.kv_rows) if cfg.kv_scheme is None else 2 * len(kv_widths(plan, cfg.kv_scheme))
        if len(configs) != planned_kv:  # a window of ≤ 32 tokens: KIVI's rows are the per-token ones
            count["n"] -= planned_kv - len(configs)
            progress.total(count["n"])
        problems = {c.label: kv_problem(lm, c) for c in configs}
        skipped: dict[str, list[str]] = {}
        for label, why in problems.items():
            if why:
                skipped.setdefault(why, []).append(label)
        if skipped:
            count["n"] -= sum(map(len, skipped.values()))
            progress.total(count["n"])
        for why, labels in skipped.items():
            progress.note(f"{lm.name}: KV rows {', '.join(labels)} skipped: {why}")
        for config in configs:
            if problems[config.label]:
                kv.append(skipped_kv_record(config, problems[config.label]))
                continue
            kv_spec = grid_spec(kv_cfg, model, ["fp"], kv=config)
            seen: list[bool] = []
            records = run_grid(kv_spec, lambda r, reused, seen=seen: seen.append(reused), loaded={model: lm})
            if kv_win != window and not any("cell_id" in r for r in kv):  # the KV window's float record, once
                progress.cell(records[0], seen[0])
            progress.cell(records[-1], seen[-1])
            kv.append(
                _resolve_row(
                    kv_cfg,
                    records[-1],
                    resolved,
                    lambda t, c=config, m=model, x=lm, k=kv_cfg: _kv_at(k, m, x, c, t, progress),
                )
            )
        sweep = None
        if plan.sweep_families:
            from qbench.studies.sweep import run_sweep

            on_sweep = _new_cells_only(progress, {r["cell_id"] for r in [fp, *formats]})
            sweep = run_sweep(
                sweep_config(cfg, model), on_record=on_sweep, command=cfg.command, loaded={model: lm}
            )
        # the repair: each candidate in turn until one pays (within, and smaller than what already passes)
        repairs = []
        source_bytes = quantised_source_bytes(fp)
        limit, _ = size_to_beat(formats, fp, profile, cfg.tolerance, cfg.metric, source_bytes)
        for target in repair_targets(formats, fp, profile, cfg.tolerance, cfg.metric, source_bytes)[
            : plan.repair_candidates
        ]:
            record = at_budget[target["scheme"]["name"]]
            study = _sensitivity(cfg, lm, record, progress, count)
            repairs.append(study)
            size = repaired_bytes(record, study, fp, profile)
            if study["repair"]["reached"] and size is not None and (limit is None or size < limit):
                break
        # where the most damaged format's damage comes from: a map by type (no repair), the layers "avoid" names
        avoid_map = None
        worst = worst_beyond(formats, cfg.tolerance, cfg.metric)
        if worst is not None:
            name = worst["scheme"]["name"]
            tried = next((r for r in repairs if r["scheme"]["name"] == name and r["by"] == "type"), None)
            avoid_map = tried or _sensitivity(cfg, lm, at_budget[name], progress, count, repair=False)
        speed = speed_record(cfg, lm, fp, plan.formats)
        layers_speed = layer_speed_record(cfg, lm, fp, profile, plan.formats)
        per_model.append(
            ModelResult(
                fp=fp,
                profile=profile,
                formats=formats,
                kv=kv,
                sweep=sweep,
                repairs=repairs,
                avoid_map=avoid_map,
                speed=speed,
                layer_speed=layers_speed,
                source=lm.source,
                source_bytes=source_bytes,
                window_nll=_window_nll(Path(cfg.output_path), [fp, *formats]),
                resolved=resolved,
                paths=_stored_paths(
                    Path(cfg.output_path), [fp, *formats, *(r for r in kv if "cell_id" in r)]
                ),
            )
        )
    sweeps = [m.sweep for m in per_model if m.sweep]
    # one run_sweep per model (one model in memory at a time); DIR/sweep.json then holds them all
    if len(sweeps) > 1:
        from qbench.studies.sweep import write_outputs

        merged = {
            **sweeps[-1],
            "models": {k: v for s in sweeps for k, v in s["models"].items()},
            "cells": [c for s in sweeps for c in s["cells"]],
            "breaking_points": [p for s in sweeps for p in s["breaking_points"]],
        }
        write_outputs(merged, Path(cfg.output_path))
    card = build_card(
        per_model,
        settings={
            "budget": plan.name,
            "budget_contents": contents,
            "tolerance_pct": cfg.tolerance,
            "metric": cfg.metric,
            "resolve_tokens": cfg.resolve_tokens,
            "command": cfg.command,
            "seed": cfg.seed,
            "output_path": str(cfg.output_path),
            "wall_seconds": round(time.perf_counter() - start, 3),
            "device": cfg.device,
        },
    )
    # what only the models could tell (their window, the KV scheme it chose): the cells stay on disk either way
    check_output(cfg, card_inputs(json.loads(json.dumps(card))))
    write_card(card, Path(cfg.output_path))
    return card


def _tokens(cfg: CardConfig) -> int:
    return cfg.tokens or cfg.plan.tokens


def _resolve_row(
    cfg: CardConfig,
    record: dict[str, Any],
    resolved: dict[str, list[dict[str, Any]]],
    evaluate: Callable[[int], dict[str, Any]],
) -> dict[str, Any]:
    """``record``, or with ``--resolve`` and an undecided verdict the same cell re-evaluated at doubling tokens
    until decided or at the cap (``qbench.studies.resolve``); its steps go to ``resolved`` by cell id."""
    if not cfg.resolve_tokens or record.get("status") != "ok":
        return record
    from qbench.studies.resolve import resolve

    final, steps = resolve(record, evaluate, _tokens(cfg), cfg.resolve_tokens, cfg.tolerance, cfg.metric)
    if steps:
        resolved[final["cell_id"]] = steps
    return final


def _format_at(cfg: CardConfig, model: str, lm: Any, scheme: str, tokens: int, progress: Progress) -> dict:
    """A format's cell on ``tokens`` tokens (its float baseline of that protocol first)."""
    from dataclasses import replace

    from qbench.eval.harness import ModelEvaluation, cell_record

    bigger = replace(cfg, tokens=tokens)
    spec = grid_spec(bigger, model, [scheme])
    evaluation = ModelEvaluation(spec, model, lm=lm)
    evaluation.check()
    evaluation.fp_record()
    record, reused = cell_record(spec, evaluation, scheme, "fake")
    progress.cell(record, reused)
    return record


def _kv_at(cfg: CardConfig, model: str, lm: Any, config: Any, tokens: int, progress: Progress) -> dict:
    """A KV row's cell on ``tokens`` tokens."""
    from dataclasses import replace

    from qbench.eval.harness import run_grid

    seen: list[bool] = []
    spec = grid_spec(replace(cfg, tokens=tokens), model, ["fp"], kv=config)
    records = run_grid(spec, lambda r, reused: seen.append(reused), loaded={model: lm})
    progress.cell(records[-1], seen[-1])
    return records[-1]


def _window_nll(out: Path, records: Sequence[dict[str, Any]]) -> dict[str, list[float]]:
    """{cell_id: mean NLL of each window} from the records' per-token sidecars (``qbench.eval.evidence``): what
    the side-by-side comparison pairs across models on the same windows. Records without a sidecar are left out."""
    from qbench.eval.evidence import read
    from qbench.eval.harness import stored_path

    found = {}
    for r in records:
        if r.get("status") != "ok" or not r.get("cell_id"):
            continue
        tensors = read(stored_path(out, r), r)
        if tensors is not None and "nll" in tensors:
            found[r["cell_id"]] = [round(v, 9) for v in tensors["nll"].double().mean(dim=1).tolist()]
    return found


def _stored_paths(out: Path, records: Sequence[dict[str, Any]]) -> dict[str, str]:
    """{cell_id: the record's file relative to ``out``}: the card names the record behind each row."""
    from qbench.eval.harness import stored_path

    return {r["cell_id"]: str(stored_path(out, r).relative_to(out)) for r in records}


def _new_cells_only(progress: Progress, seen: set[str]) -> Callable[[dict[str, Any], bool], None]:
    """The sweep's ``on_record``: its float record and the cells that are also formats were counted already."""

    def on_record(record: dict[str, Any], reused: bool) -> None:
        if record["cell_id"] not in seen:
            seen.add(record["cell_id"])
            progress.cell(record, reused)

    return on_record


def _sensitivity(
    cfg: CardConfig,
    lm: Any,
    target: dict[str, Any],
    progress: Progress,
    count: dict[str, int],
    repair: bool = True,
) -> dict:
    """``qbench sensitivity``'s map and repair of ``target``'s scheme (by the budget's unit), in
    ``DIR/sensitivity/<model>/<scheme>/`` with its cells under ``cells/``. The repair starts from ``target``,
    the card's own record of that format on its own tokens (not evaluated again); the quick budget's repair is not
    minimised. ``repair=False``: the map alone, by type (which kinds of layer a format's damage comes from: what
    "avoid" names), its cells in the same folder (a later repair of that format reuses them when the unit
    matches)."""
    from qbench.studies.sensitivity import sensitivity, write_sensitivity

    scheme = target["scheme"]["name"]

    out = Path(cfg.output_path) / "sensitivity" / lm.name / slug(scheme)
    # the card's own float record (same protocol and statistics): the study does not evaluate the float model again
    spec = grid_spec(cfg, lm.source, [scheme], baseline_path=Path(cfg.output_path))
    spec.output_path = out / "cells"
    repairs = {"seen": 0}

    def on_units(n: int) -> None:
        count["n"] += n + int(
            repair
        )  # the units, and the repair's first set (the rest are known one at a time)
        progress.total(count["n"])

    def on_cell(phase: str, record: dict[str, Any], reused: bool) -> None:
        if phase == "repair":
            repairs["seen"] += 1
            if repairs["seen"] > 1:
                count["n"] += 1
                progress.total(count["n"])
        progress.cell(record, reused)

    result = sensitivity(
        spec,
        by=cfg.plan.sensitivity_by if repair else "type",
        tolerance=cfg.tolerance,
        metric=cfg.metric,
        on_cell=on_cell,
        on_units=on_units,
        lm=lm,
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
