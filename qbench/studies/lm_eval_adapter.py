"""``qbench lm-eval``: a quantised model on lm-evaluation-harness tasks, in memory, with qbench's provenance.

    run_lm_eval(lm, "absmax-coarse", ["my_task"], include_path="tasks/", limit=20)

Steps: our own models are converted to transformers models first (``models.hf.to_hf_model``: same weights,
same function; a model whose switches have no transformers equivalent is refused with a clear error), *then*
quantised with ``qbench.quant.quantize`` — so the quantised copy is still a transformers model — and handed to
``lm_eval.models.huggingface.HFLM(pretrained=model, tokenizer=tokenizer)`` and ``lm_eval.simple_evaluate``.

- Offline use: built-in lm-eval tasks download their data from a hub. A folder of local task YAMLs
  (``include_path``; jsonl data, e.g. ``output_type: loglikelihood_rolling``) works with
  ``HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1``.
- lm-eval's perplexity tasks report *word* and *byte* perplexity (and bits per byte) — not the token-level
  perplexity of ``qbench run``; the two are not comparable across tokenizers or with each other.
- ``scheme="fp"`` (or None) evaluates the float model, the baseline to compare against.
- Standard errors: lm-eval bootstraps them for perplexity metrics, which is slow; ``bootstrap_iters=0`` (our
  default) skips them, lm-eval's own default is 100000.
"""

from __future__ import annotations

import json
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from torch import nn

from models.errors import UserError, did_you_mean
from qbench.eval.adapters import context_length, first_parameter, is_ours
from qbench.eval.harness import calibration_sample, check_modes, environment
from qbench.eval.load import LoadedModel
from qbench.eval.metrics import Protocol
from qbench.quant.calibrate import CalibrationData

FLOAT = ("fp", "float", "none")


def _import_lm_eval() -> Any:
    try:
        import lm_eval
        from lm_eval.models.huggingface import HFLM  # noqa: F401  (needs lm-eval's [hf] extra: accelerate)
    except ImportError as e:
        raise UserError(
            f"lm-eval is not installed ({e.name or e}); install it with: pip install 'lm-eval[hf]' "
            "(or pip install 'qbench[all]')"
        ) from None
    return lm_eval


def as_transformers(lm: LoadedModel) -> nn.Module:
    """The model as a transformers model: itself, or our model converted with the same weights and dtype."""
    if not is_ours(lm.model):
        return lm.model
    if getattr(lm.model, "hf_device_map", None):
        raise UserError(
            f"{lm.name}: a qbench checkpoint placed with --device-map cannot be converted for lm-eval (its "
            "offloaded weights are not in memory); export it with `qbench export` and place the transformers folder"
        )
    from models.hf import to_hf_model

    try:
        hf = to_hf_model(lm.model, lm.tokenizer)
    except UserError as e:
        raise UserError(f"lm-eval needs a transformers model, and {lm.name} has none: {e}") from None
    reference = first_parameter(lm.model)
    return hf.to(device=reference.device, dtype=reference.dtype)


def _calibration(
    lm: LoadedModel, model: nn.Module, corpus: str, scheme: Any, calibration: CalibrationData | None = None
) -> torch.Tensor:
    """Calibration windows (SmoothQuant, static scales, GPTQ, AWQ), as the harness takes them: the scheme's
    ``calib`` windows (or ``--calib-tokens``) of the corpus's *train* split or of ``--calib-data``, the model's
    context long (``harness.calibration_sample``)."""
    context = context_length(model)
    return calibration_sample(
        lm.tokenizer, Protocol(corpus=corpus), context, scheme, calibration, context
    ).ids


def _is_float(scheme: str | None) -> bool:
    return scheme is None or scheme.lower() in FLOAT


def check_request(scheme: str | None, mode: str) -> None:
    """Fail on a mistyped scheme or mode before anything slow (loading, task indexing) happens."""
    from qbench.quant import get_scheme

    check_modes([mode])
    if not _is_float(scheme):
        get_scheme(scheme)


def quantised_transformers(
    lm: LoadedModel,
    scheme: str | None,
    mode: str = "fake",
    calibration_corpus: str = "embedded",
    calibration: CalibrationData | None = None,
) -> tuple[nn.Module, dict]:
    """(the transformers model quantised with ``scheme`` — or float for fp/None —, the scheme's record)."""
    from qbench.quant import get_scheme, quantize
    from qbench.quant.calibrate import needs_calibration

    check_modes([mode])
    if _is_float(scheme):
        return as_transformers(lm), {"name": "fp", "description": "unquantised"}
    config = get_scheme(scheme)  # a typo fails here, before the conversion
    if is_ours(lm.model) and lm.model.config.gate != "none":
        raise UserError(
            f"cannot score {lm.name} under {scheme!r} with lm-eval: its transformers form carries the attention "
            "gate inside q_proj and a doubled o_proj (models.hf), so per-tensor scales and rotations would see "
            "other tensors than qbench's own evaluation; lm-eval its float model, or use qbench run for the "
            "quantised figures"
        )
    model = as_transformers(lm)
    calibrated = needs_calibration(config)
    source = calibration or CalibrationData()
    windows = _calibration(lm, model, calibration_corpus, config, source) if calibrated else None
    record = config.to_dict()
    if calibrated:
        record["calibration"] = {
            **source.describe(calibration_corpus, config.calib_count, config.calib_seed),
            "windows": len(windows),
            "seed": config.calib_seed,
        }
    return quantize(model, config, mode=mode, calibration=windows), record


def _task_manager(tasks: Sequence[str], include_path: str | Path | None) -> Any:
    """lm-eval's task index holding ``tasks``; unknown task names are a UserError.

    When ``include_path`` holds every task, lm-eval's built-in tasks (thousands of YAMLs, seconds to index)
    are not indexed at all.
    """
    from lm_eval.tasks import TaskManager

    if include_path is not None:
        if not Path(include_path).is_dir():
            raise UserError(f"--include-path {str(include_path)!r} is not a folder of lm-eval task YAMLs")
        local = TaskManager(include_path=str(include_path), include_defaults=False)
        if all(local.match_tasks([task]) for task in tasks):
            return local
    manager = TaskManager(include_path=str(include_path) if include_path else None)
    for task in tasks:
        if not manager.match_tasks([task]):
            raise UserError(
                f"unknown lm-eval task {task!r}{did_you_mean(task, manager.all_tasks)}; list them with "
                "`lm-eval ls tasks`, or pass --include-path with a folder holding its YAML"
            )
    return manager


def _jsonable(obj: Any) -> Any:
    """lm-eval's dicts hold callables and numpy values here and there: keep what JSON can hold, str the rest."""
    return json.loads(json.dumps(obj, default=lambda o: o.item() if hasattr(o, "item") else str(o)))


def run_lm_eval(
    lm: LoadedModel,
    scheme: str | None,
    tasks: Sequence[str] | str,
    include_path: str | Path | None = None,
    limit: int | float | None = None,
    mode: str = "fake",
    batch_size: int = 1,
    bootstrap_iters: int = 0,
    calibration_corpus: str = "embedded",
    calibration: CalibrationData | None = None,
) -> dict[str, Any]:
    """Evaluate ``lm`` quantised with ``scheme`` on lm-eval ``tasks``; lm-eval's results plus qbench provenance.

    Returns ``results`` (per task, lm-eval's metric names, e.g. ``"word_perplexity,none"``), ``versions``,
    ``n-samples``, ``higher_is_better``, and ``qbench``: the scheme's full config, mode, the model description
    (and whether it was converted from a qbench checkpoint), tasks, limit, environment and timing.
    """
    tasks = [tasks] if isinstance(tasks, str) else list(tasks)
    if not tasks:
        raise UserError("give at least one lm-eval task (--tasks)")
    check_request(scheme, mode)
    lm_eval = _import_lm_eval()
    from lm_eval.models.huggingface import HFLM

    start = time.perf_counter()
    manager = _task_manager(tasks, include_path)
    model, scheme_record = quantised_transformers(lm, scheme, mode, calibration_corpus, calibration)
    wrapped = HFLM(pretrained=model, tokenizer=lm.tokenizer, batch_size=batch_size)
    out = lm_eval.simple_evaluate(
        model=wrapped,
        tasks=tasks,
        limit=limit,
        task_manager=manager,
        log_samples=False,
        bootstrap_iters=bootstrap_iters,
    )
    keep = ("results", "versions", "n-shot", "n-samples", "higher_is_better")
    return {
        **_jsonable({k: out.get(k) for k in keep}),
        "qbench": {
            "scheme": scheme_record,
            "mode": mode if scheme_record["name"] != "fp" else "float",
            "model": {"name": lm.name, **lm.description, "converted_to_transformers": is_ours(lm.model)},
            "tasks": tasks,
            "include_path": None if include_path is None else str(include_path),
            "limit": limit,
            "batch_size": batch_size,
            "perplexity_note": "lm-eval reports word/byte perplexity, not qbench's token-level perplexity",
            "env": environment(str(first_parameter(model).device)),
            "wall_seconds": round(time.perf_counter() - start, 3),
            "created_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        },
    }
