"""Checkpoints: a folder, no pickle anywhere.

    ckpt/
      config.json        {"format": "qbench.checkpoint", "model": ModelConfig, "tokenizer": {...},
                          "weights": {"file", "sha256", "dtype"}, "provenance": {...}}
      model.safetensors  the weights (a tied LM head is stored once, as the token embedding)
      tokenizer.json ... the tokenizer, loadable with transformers.AutoTokenizer

Training state (optimiser moments, RNG, data position, step) lives in separate files of the same folder,
written by ``trainers``; loading a model never needs them.

Writes are atomic per file, and ``config.json`` goes last carrying the sha256 of the weights, so a folder
torn by a crash is detected on load instead of silently mixing two versions.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from models.config import ModelConfig
from models.errors import UserError
from models.io import atomic_path, atomic_write_json, git_commit, sha256_file, software_versions
from models.transformer import Transformer

FORMAT = "qbench.checkpoint"
FORMAT_VERSION = 1
CONFIG_FILE = "config.json"
WEIGHTS_FILE = "model.safetensors"


@dataclass
class Checkpoint:
    model: Transformer
    config: ModelConfig
    tokenizer: Any | None  # a transformers PreTrainedTokenizerFast
    path: Path
    meta: dict[str, Any] = field(default_factory=dict)  # the whole config.json

    @property
    def provenance(self) -> dict[str, Any]:
        return self.meta.get("provenance", {})


def default_provenance() -> dict[str, Any]:
    return {
        "created_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "git_commit": git_commit(),
        "software": software_versions(),
    }


def _tokenizer_record(tokenizer: Any, config: ModelConfig) -> dict[str, Any]:
    from models.tokenizer import tokenizer_fingerprint

    check_tokenizer_fits(tokenizer, config)
    return {
        "name": getattr(tokenizer, "name_or_path", None),
        "vocab_size": len(tokenizer),
        "fingerprint": tokenizer_fingerprint(tokenizer),
    }


def check_tokenizer_fits(tokenizer: Any, config: ModelConfig) -> None:
    """A tokenizer fits when every id it can produce has an embedding row (the model may have spare rows)."""
    if len(tokenizer) > config.vocab_size:
        raise UserError(
            f"tokenizer has {len(tokenizer)} tokens but the model's vocab_size is {config.vocab_size}; "
            "use the tokenizer the model was built for (its preset names it)"
        )


def _weights_to_save(model: Transformer) -> dict[str, torch.Tensor]:
    state = model.state_dict()
    if model.config.tie_embeddings:
        state.pop("lm_head.weight")  # the same tensor as transformer.wte.weight; safetensors stores it once
    return {name: t.detach().contiguous().cpu() for name, t in state.items()}


def save_checkpoint(
    path: str | Path,
    model: Transformer,
    tokenizer: Any | None = None,
    provenance: dict[str, Any] | None = None,
) -> Path:
    """Write ``model`` (and its tokenizer) as a checkpoint folder; returns the folder.

    Everything that can refuse (a tokenizer that does not fit) is checked before the first byte is written, and
    each file is written to a temporary name in the same folder and renamed into place (``os.replace``)."""
    path = Path(path)
    config = model.config
    tokenizer_record = _tokenizer_record(tokenizer, config) if tokenizer is not None else None
    weights = _weights_to_save(model)
    path.mkdir(parents=True, exist_ok=True)
    with atomic_path(path / WEIGHTS_FILE) as tmp:
        save_file(weights, str(tmp), metadata={"format": "pt"})
    meta = {
        "format": FORMAT,
        "format_version": FORMAT_VERSION,
        "model": config.to_dict(),
        "tokenizer": tokenizer_record,
        "weights": {
            "file": WEIGHTS_FILE,
            "sha256": sha256_file(path / WEIGHTS_FILE),
            "dtype": str(next(iter(weights.values())).dtype).removeprefix("torch."),
        },
        "provenance": {**default_provenance(), **(provenance or {})},
    }
    if tokenizer is not None:
        tokenizer.save_pretrained(str(path))
    atomic_write_json(path / CONFIG_FILE, meta)  # last: it vouches for the files above
    return path


def is_checkpoint(path: str | Path) -> bool:
    """True when ``path`` is a folder whose config.json says it is a qbench checkpoint."""
    config = Path(path) / CONFIG_FILE
    try:
        return json.loads(config.read_text()).get("format") == FORMAT
    except (OSError, ValueError, AttributeError):
        return False


def read_meta(path: str | Path) -> dict[str, Any]:
    """The parsed config.json of a checkpoint folder, with clear errors for a missing or corrupt file."""
    path = Path(path)
    if not path.is_dir():
        raise UserError(f"checkpoint folder {str(path)!r} does not exist")
    config_file = path / CONFIG_FILE
    if not config_file.is_file():
        raise UserError(f"{config_file} is missing: {str(path)!r} is not a checkpoint folder")
    try:
        meta = json.loads(config_file.read_text())
    except ValueError as e:
        raise UserError(f"{config_file} is corrupt (not valid JSON: {e})") from None
    if not isinstance(meta, dict) or meta.get("format") != FORMAT:
        raise UserError(f'{config_file} is not a qbench checkpoint config (no "format": "{FORMAT}")')
    if meta.get("format_version", 0) > FORMAT_VERSION:
        raise UserError(
            f"{config_file} has format_version {meta['format_version']}; this qbench reads "
            f"up to {FORMAT_VERSION} — upgrade qbench"
        )
    return meta


def _read_weights(
    path: Path, meta: dict[str, Any], verify: bool, dtype: torch.dtype | None = None
) -> dict[str, torch.Tensor]:
    """The saved tensors; with ``dtype``, each floating one cast as it is read, so that loading a float32
    checkpoint in bfloat16 holds the bfloat16 model and one float32 tensor, never the whole float32 state (nor the
    whole file's mapped pages)."""
    weights_file = path / meta["weights"]["file"]
    if not weights_file.is_file():
        raise UserError(f"{weights_file} is missing")
    if verify and sha256_file(weights_file) != meta["weights"]["sha256"]:
        raise UserError(f"{weights_file} is corrupt: its sha256 does not match the one in {CONFIG_FILE}")
    try:
        if dtype is None:
            return load_file(str(weights_file))
        with safe_open(str(weights_file), framework="pt") as f:
            names = list(f.keys())
        state = {}
        for name in names:
            # one tensor per opening: the file is memory-mapped, and every page read stays resident (and counted
            # in the process's peak) until the mapping closes
            with safe_open(str(weights_file), framework="pt") as f:
                t = f.get_tensor(name)
            state[name] = t.to(dtype) if t.is_floating_point() else t
        return state
    except Exception as e:  # safetensors raises its own error types for truncated/garbled files
        raise UserError(f"{weights_file} is corrupt ({type(e).__name__}: {e})") from None


def load_checkpoint(
    path: str | Path,
    device: str | torch.device = "cpu",
    dtype: torch.dtype | None = None,
    tokenizer: bool = True,
    verify: bool = True,
) -> Checkpoint:
    """Load a checkpoint folder. The weights come back bit-exactly as saved (unless ``dtype`` casts them)."""
    path = Path(path)
    meta = read_meta(path)
    config = ModelConfig.from_dict(meta["model"])
    state = _read_weights(path, meta, verify, dtype)
    if config.tie_embeddings:
        state["lm_head.weight"] = state["transformer.wte.weight"]
    with torch.device("meta"):  # no wasted random init; load_state_dict(assign=True) brings the real tensors
        model = Transformer(config)
    try:
        model.load_state_dict(state, strict=True, assign=True)
    except RuntimeError as e:
        raise UserError(f"{path / meta['weights']['file']} does not match config.json: {e}") from None
    model.tie_weights()
    if config.pos == "rope":
        model.make_rope_tables()
    model = model.to(device=device, dtype=dtype) if dtype is not None else model.to(device)
    tok = _load_tokenizer(path, config) if tokenizer and meta.get("tokenizer") else None
    return Checkpoint(model=model.eval(), config=config, tokenizer=tok, path=path, meta=meta)


def _load_tokenizer(path: Path, config: ModelConfig) -> Any:
    from models.tokenizer import load_tokenizer

    if not (path / "tokenizer.json").is_file():
        raise UserError(
            f"{path / 'tokenizer.json'} is missing (config.json says the checkpoint has a tokenizer)"
        )
    tok = load_tokenizer(str(path))
    check_tokenizer_fits(tok, config)
    return tok
