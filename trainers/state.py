"""Training state beside a checkpoint, without pickle, and checkpoint writes that a crash cannot tear.

The output folder of a run is itself a checkpoint (``models.checkpoint``: config.json, model.safetensors,
tokenizer files) plus:

    trainer_state.safetensors  the optimiser's tensors, named "<parameter name>/<state key>"
                               (e.g. "transformer.h.0.attn.c_attn.weight/exp_avg")
    trainer_state.json         step, tokens, wall time, sampler position (seed, next step), learning rate,
                               the metrics log's byte offset at this step, the TrainConfig, the optimiser's
                               class, parameter names in optimiser order, param_groups (hyperparameters) and
                               non-tensor state (e.g. OrthoAdam's integer step), and the sha256 of
                               model.safetensors and trainer_state.safetensors
    metrics.jsonl              the training log (written live by the loop; truncated to the offset on resume)

No RNG state is stored: the model has no dropout, the data order is a function of (seed, step)
(``trainers.batches``) and OrthoAdam re-derives its rotations from its seed.

Atomicity across files: a checkpoint is first written completely into ``<out>/.next/``, ``trainer_state.json``
last (atomically) — its presence marks the folder complete. The files are then moved into ``<out>`` with
``os.replace``, ``trainer_state.json`` last. :func:`recover` runs before any read: a complete ``.next`` is
rolled forward (finishing the moves a crash interrupted), an incomplete one is deleted (the previous
checkpoint in ``<out>`` was not touched yet). So ``<out>`` always ends up holding one whole checkpoint.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file
from torch import Tensor, nn

from models.checkpoint import CONFIG_FILE, WEIGHTS_FILE, save_checkpoint
from models.errors import UserError
from models.io import atomic_path, atomic_write_json, sha256_file

STATE_JSON = "trainer_state.json"
STATE_TENSORS = "trainer_state.safetensors"
METRICS_FILE = "metrics.jsonl"
STAGING = ".next"
FORMAT = "qbench.trainer_state"
FORMAT_VERSION = 1


# ------------------------------------------------------------------------------------------------------------
# Optimiser state <-> (tensors, JSON)


def param_names(model: nn.Module, optimizer: torch.optim.Optimizer) -> list[str]:
    """The model's name for each parameter, in the optimiser's order (torch's state_dict numbering)."""
    names = {id(p): n for n, p in model.named_parameters()}  # a tied weight: its first name
    return [names[id(p)] for group in optimizer.param_groups for p in group["params"]]


def flatten_optimizer(
    optimizer: torch.optim.Optimizer, names: list[str]
) -> tuple[dict[str, Tensor], dict[str, Any]]:
    """``optimizer.state_dict()`` as named CPU tensors plus a JSON-able dict of everything else."""
    sd = optimizer.state_dict()
    tensors: dict[str, Tensor] = {}
    scalars: dict[str, dict[str, Any]] = {}
    for index, state in sd["state"].items():
        for key, value in state.items():
            if isinstance(value, Tensor):
                tensors[f"{names[index]}/{key}"] = value.detach().cpu().contiguous()
            else:
                scalars.setdefault(names[index], {})[key] = value
    groups = []
    for group in sd["param_groups"]:
        for key, value in group.items():
            if isinstance(value, Tensor):  # e.g. a tensor lr (capturable): not supported, say so
                raise TypeError(f"optimizer param_group {key!r} is a tensor; cannot store it as JSON")
        groups.append(dict(group))
    meta = {"class": type(optimizer).__name__, "params": names, "param_groups": groups, "scalars": scalars}
    return tensors, meta


def unflatten_optimizer(
    optimizer: torch.optim.Optimizer, names: list[str], tensors: dict[str, Tensor], meta: dict[str, Any]
) -> None:
    """Load what :func:`flatten_optimizer` produced into ``optimizer`` (built over the same parameters)."""
    if meta["class"] != type(optimizer).__name__:
        raise UserError(
            f"trainer state holds a {meta['class']} but the run builds a {type(optimizer).__name__}"
        )
    if meta["params"] != names:
        raise UserError("trainer state's parameter names/order differ from the model's: not the same model")
    state: dict[int, dict[str, Any]] = {}
    for index, name in enumerate(names):
        entry = dict(meta["scalars"].get(name, {}))
        prefix = f"{name}/"
        entry.update({k[len(prefix) :]: t for k, t in tensors.items() if k.startswith(prefix)})
        if entry:
            state[index] = entry
    groups = [{k: tuple(v) if k == "betas" else v for k, v in g.items()} for g in meta["param_groups"]]
    optimizer.load_state_dict({"state": state, "param_groups": groups})


# ------------------------------------------------------------------------------------------------------------
# Writing and reading a checkpoint folder


def write_checkpoint(
    out: Path,
    model: nn.Module,
    tokenizer: Any,
    provenance: dict[str, Any],
    optimizer: torch.optim.Optimizer,
    names: list[str],
    state: dict[str, Any],
) -> None:
    """Write model + tokenizer + trainer state into ``out/.next`` then move it into ``out`` (module docstring)."""
    staging = out / STAGING
    shutil.rmtree(staging, ignore_errors=True)
    save_checkpoint(staging, model, tokenizer, provenance)
    tensors, optim_meta = flatten_optimizer(optimizer, names)
    with atomic_path(staging / STATE_TENSORS) as tmp:
        save_file(tensors, str(tmp), metadata={"format": FORMAT})
    record = {
        "format": FORMAT,
        "format_version": FORMAT_VERSION,
        **state,
        "optimizer": optim_meta,
        "sha256": {name: sha256_file(staging / name) for name in (WEIGHTS_FILE, STATE_TENSORS)},
    }
    atomic_write_json(staging / STATE_JSON, record)  # from here on the staging folder is complete
    recover(out)


def recover(out: Path) -> bool:
    """Finish or discard an interrupted checkpoint write in ``out``; True when one was rolled forward."""
    staging = out / STAGING
    if not staging.is_dir():
        return False
    if not (staging / STATE_JSON).is_file():
        shutil.rmtree(staging)  # incomplete: nothing of it reached `out` yet
        return False
    files = sorted(p for p in staging.iterdir() if not p.name.startswith("."))
    for path in sorted(files, key=lambda p: p.name == STATE_JSON):  # trainer_state.json last
        os.replace(path, out / path.name)
    shutil.rmtree(staging)
    _fsync_dir(out)
    return True


def _fsync_dir(path: Path) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def has_state(out: Path) -> bool:
    """True when ``out`` holds a trainer state (a resumable run)."""
    return (out / STATE_JSON).is_file()


def read_state(out: Path, verify: bool = True) -> dict[str, Any]:
    """The parsed trainer_state.json, checked against the files it vouches for; UserError when corrupt."""
    path = out / STATE_JSON
    try:
        record = json.loads(path.read_text())
    except OSError as e:
        raise UserError(f"cannot read {path}: {e}") from None
    except ValueError as e:
        raise UserError(f"{path} is corrupt (not valid JSON: {e})") from None
    if not isinstance(record, dict) or record.get("format") != FORMAT:
        raise UserError(f'{path} is not a qbench trainer state (no "format": "{FORMAT}")')
    if record.get("format_version", 0) > FORMAT_VERSION:
        raise UserError(f"{path} has format_version {record['format_version']}; upgrade qbench to read it")
    if verify:
        for name, digest in record["sha256"].items():
            if not (out / name).is_file():
                raise UserError(f"{out / name} is missing (named by {STATE_JSON})")
            if sha256_file(out / name) != digest:
                raise UserError(
                    f"{out / name} is corrupt or from another step: its sha256 differs from {path}'s"
                )
    if not (out / CONFIG_FILE).is_file():
        raise UserError(f"{out / CONFIG_FILE} is missing: {out} is not a complete checkpoint")
    return record


def read_optimizer_tensors(out: Path) -> dict[str, Tensor]:
    path = out / STATE_TENSORS
    try:
        return load_file(str(path))
    except Exception as e:  # safetensors raises its own error types for truncated or garbled files
        raise UserError(f"{path} is corrupt ({type(e).__name__}: {e})") from None


def clear_run(out: Path) -> None:
    """Delete a previous run's checkpoint, trainer state and metrics from ``out`` (for --overwrite)."""
    shutil.rmtree(out / STAGING, ignore_errors=True)
    for name in (STATE_JSON, STATE_TENSORS, CONFIG_FILE, WEIGHTS_FILE, METRICS_FILE):
        (out / name).unlink(missing_ok=True)
