"""The card's llama.cpp phases, run by :mod:`~.measure` after the formats: llama.cpp's own file types as rows
(:func:`llama_cpp_rows`, ``--llama-cpp``) and ``qbench plan`` at the smallest passing type's size
(:func:`mixed_plan`, ``--mixed-plan``). ``m`` is the measure phase's subject (config, model, progress)."""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from models.errors import UserError
from qbench.studies.card.config import grid_spec, slug
from qbench.studies.card.result import Record


def llama_cpp_rows(m: Any, spec: Any, evaluation: Any) -> list[Record]:
    """One record per llama.cpp file type (``--llama-cpp``): the float model written as a GGUF, quantised and
    scored by llama.cpp on the card's own windows (``qbench.quant.llamacpp``); a model llama.cpp has no graph for
    records the one-line reason."""
    from qbench.eval.harness import cell_record
    from qbench.quant.gguf_types import scheme_name

    rows = []
    for type_name in m.cfg.llama_cpp:
        record, reused = cell_record(spec, evaluation, scheme_name(type_name), "real")
        m.progress.cell(record, reused)
        rows.append(record)
    return rows


def mixed_plan(m: Any, llama_cpp: Sequence[Record]) -> Record | None:
    """``qbench plan`` (``--mixed-plan``) at the size of the smallest llama.cpp type decidedly within the tolerance
    and 10 % below it, its cells beside the card's (the type cells reused), plan.json and the GGUFs under
    ``plan/``; ``{"skipped": why}`` when no type passes."""
    if not m.cfg.mixed_plan or not llama_cpp:
        return None
    from dataclasses import replace

    from qbench.eval.evidence import row_fields
    from qbench.studies.plan import PlanConfig, run_plan

    cfg = m.cfg
    passing = [
        r
        for r in llama_cpp
        if r.get("status") == "ok"
        and (r.get("artifact") or {}).get("bytes")
        and row_fields(r, cfg.tolerance, cfg.metric)["verdict"] == "within"
    ]
    if not passing:
        return {"skipped": "no llama.cpp type is decidedly within the tolerance: no size to plan at"}
    best = min(passing, key=lambda r: r["artifact"]["bytes"])["scheme"]["params"]["type"].lower()
    plan_cfg = PlanConfig(
        model=m.model,
        budgets=(best, f"0.9*{best}"),
        against=tuple(cfg.llama_cpp),
        output_path=Path(cfg.output_path) / "plan" / slug(m.lm.name),
        command=cfg.command or "",
    )
    seen = {r["cell_id"] for r in llama_cpp}

    def on_record(record: dict[str, Any], reused: bool) -> None:  # the plan's cells, counted as they come
        if record.get("mode") != "float" and record["cell_id"] not in seen:
            seen.add(record["cell_id"])
            m.count.add(1)
            m.progress.cell(record, reused)

    def spec_for(schemes: list[str]) -> Any:
        return replace(grid_spec(cfg, m.model, []), schemes=schemes)

    try:
        run_plan(plan_cfg, spec_for, on_record=on_record, lm=m.lm)
    except UserError as err:  # no unit measured, no type fits …: the card goes on and says why
        m.progress.note(f"{m.lm.name}: no mixed-precision plan: {err}")
        return {"skipped": str(err)}
    return {
        **json.loads((plan_cfg.output_path / "plan.json").read_text()),
        "output": str(plan_cfg.output_path),
    }
