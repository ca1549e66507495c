"""``--ckpt`` → (model, tokenizer, description): a qbench checkpoint, a transformers folder, or a hub name.

Resolution, in order:
1. a folder whose config.json says ``"format": "qbench.checkpoint"`` → ``models.load_checkpoint``;
2. a folder with a transformers config.json → ``AutoModelForCausalLM.from_pretrained(..., local_files_only=True)``;
3. a ``.gguf`` file, or a folder holding exactly one (and no config.json) → transformers' GGUF reader
   (``from_pretrained(folder, gguf_file=...)``, needs the ``gguf`` package: ``pip install 'qbench[gguf]'``),
   weights dequantised to float and the tokenizer built from the same file. A GGUF's weights already lie on a
   quantisation grid (Q8_0, Q4_K, ...), so the model block records the file's own tensor types;
4. a bare name NAME for which ``ckpts/NAME`` is one of the above → that folder (so ``qbench run --ckpt ortho``
   finds ``ckpts/ortho``);
5. otherwise a hub name ("org/model"), loaded only when a hub is reachable — offline it is a clear error.

Safety: ``trust_remote_code`` stays off unless asked; weights are read from safetensors only unless the user
passes ``allow_unsafe_weights`` (pickle-based ``.bin`` files can run code when unpickled).
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

from models.checkpoint import is_checkpoint, load_checkpoint
from models.errors import UserError, unknown_choice
from models.transformer import merge_projections
from qbench.eval.placement import Placement

CKPT_ROOT = Path("ckpts")
DTYPES = {
    "float32": torch.float32,
    "fp32": torch.float32,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
    "float16": torch.float16,
    "fp16": torch.float16,
}


@dataclass
class LoadedModel:
    model: nn.Module
    tokenizer: Any
    name: str  # short display name, used in result file names
    source: str  # what the user passed, resolved
    description: dict[str, Any] = field(default_factory=dict)


def check_device(device: str) -> torch.device:
    """``device`` as a torch.device that exists here, or a one-line error."""
    try:
        parsed = torch.device(device)
    except (RuntimeError, ValueError):
        raise UserError(f"unknown device {device!r}; use cpu, cuda or cuda:N") from None
    if parsed.type == "cuda" and not torch.cuda.is_available():
        raise UserError(f"device {device!r} asked for, but this torch has no CUDA device; use --device cpu")
    if parsed.type == "cuda" and (parsed.index or 0) >= torch.cuda.device_count():
        raise UserError(f"device {device!r} does not exist: {torch.cuda.device_count()} CUDA device(s) here")
    if parsed.type not in ("cpu", "cuda"):
        raise UserError(f"device {device!r} is not supported; use cpu, cuda or cuda:N")
    return parsed


def resolve_dtype(name: str, device: str) -> str:
    """``auto`` → bfloat16 on a GPU that computes in it (Ampere and later), float32 elsewhere: the CPU's float32
    is every record's baseline, and a GPU's bf16 halves the memory at a stated cost (docs/evaluating.md)."""
    if name != "auto":
        return name
    try:
        gpu = torch.device(device).type == "cuda" and torch.cuda.is_available()
    except (RuntimeError, ValueError):  # a misspelt device: check_device names it
        return "float32"
    return "bfloat16" if gpu and torch.cuda.is_bf16_supported() else "float32"


def parse_dtype(name: str) -> torch.dtype:
    if name not in DTYPES:
        raise unknown_choice("dtype", name, [*DTYPES, "auto"])
    return DTYPES[name]


def _is_transformers_folder(path: Path) -> bool:
    try:
        return "model_type" in json.loads((path / "config.json").read_text())
    except (OSError, ValueError):
        return False


def _gguf_in(path: Path) -> Path | None:
    """``path`` itself when it is a ``.gguf`` file; the one ``.gguf`` file of a folder without config.json."""
    if path.is_file():
        return path if path.suffix.lower() == ".gguf" else None
    if not path.is_dir() or (path / "config.json").exists():
        return None
    found = sorted(path.glob("*.gguf"))
    if len(found) > 1:
        names = ", ".join(f.name for f in found)
        raise UserError(f"{path} holds {len(found)} GGUF files ({names}); give the one to load as --ckpt")
    return found[0] if found else None


def resolve(spec: str) -> Path | str:
    """The folder (or ``.gguf`` file) a ``--ckpt`` value names, or the string itself when it can only be a hub
    name."""
    path = Path(spec)
    for candidate in (path, CKPT_ROOT / spec):
        if candidate.is_dir() and (is_checkpoint(candidate) or _is_transformers_folder(candidate)):
            return candidate
        gguf = _gguf_in(candidate)
        if gguf is not None:
            return gguf
    if path.exists():
        raise UserError(
            f'{spec!r} is neither a qbench checkpoint (config.json with "format": '
            '"qbench.checkpoint"), a transformers model folder (config.json with "model_type") nor a '
            ".gguf file (or a folder holding one)"
        )
    if "/" in spec and not spec.startswith((".", "/")) and spec.count("/") == 1:
        return spec  # looks like org/name on a hub
    raise UserError(
        f"model {spec!r} does not exist (looked for {path} and {CKPT_ROOT / spec}); give a qbench "
        "checkpoint folder, a transformers model folder, or a hub name like org/model"
    )


def _folder_name(path: Path) -> str:
    """The name results are filed under: ``--ckpt .`` or ``..`` means the folder itself (``Path('.').name`` is
    empty); made absolute without resolving links, so a symlinked ``ckpts/NAME`` keeps its own name."""
    return Path(os.path.abspath(path)).name


def load_model(
    spec: str,
    *,
    dtype: str = "float32",
    device: str = "cpu",
    trust_remote_code: bool = False,
    allow_unsafe_weights: bool = False,
    placement: Placement | None = None,
) -> LoadedModel:
    """Load what ``spec`` names (see the module docstring) in eval mode. ``dtype="auto"``: bfloat16 on a GPU,
    float32 on the CPU. ``placement``: a device map (``qbench.eval.placement``) instead of all on ``device``."""
    check_device(device)
    dtype = resolve_dtype(dtype, device)
    torch_dtype = parse_dtype(dtype)
    target = resolve(spec)
    placement = placement or Placement()
    if placement.active:
        return _load_placed(
            target, spec, torch_dtype, dtype, placement, trust_remote_code, allow_unsafe_weights
        )
    if isinstance(target, Path) and torch.device(device).type == "cpu":
        check_fits(target, torch_dtype, dtype)
    if isinstance(target, Path) and is_checkpoint(target):
        ckpt = load_checkpoint(target, device=device, dtype=torch_dtype)
        if ckpt.tokenizer is None:
            raise UserError(f"checkpoint {target} has no tokenizer files; re-save it with its tokenizer")
        # OSP's projections are a training-time device: evaluate (and quantise) the plain model they fold into.
        model = merge_projections(ckpt.model)
        description = {
            "kind": "qbench",
            "path": str(target),
            "config": ckpt.config.to_dict(),
            "fingerprint": ckpt.meta["weights"]["sha256"],
            "parameters": ckpt.model.num_parameters(),
            "dtype": dtype,
            "provenance": ckpt.provenance,
        }
        if model is not ckpt.model:
            description["merged_projections"] = [
                n for n in ("emb_proj", "head_proj") if getattr(ckpt.config, n)
            ]
        return LoadedModel(model, ckpt.tokenizer, _folder_name(target), str(target), description)
    if isinstance(target, Path) and target.is_file():
        from qbench.eval.gguf import load_gguf

        model, tokenizer, description = load_gguf(target, torch_dtype, dtype, device)
        description["fingerprint"] = _weights_fingerprint(target)
        return LoadedModel(model, tokenizer, target.stem, str(target), description)
    return _load_transformers(target, torch_dtype, dtype, device, trust_remote_code, allow_unsafe_weights)


# safetensors caps its own JSON header at 100 MB
HEADER_LIMIT = 100 * 2**20


def _weight_files(folder: Path) -> list[Path]:
    """The safetensors files a load reads: the shards a ``model.safetensors.index.json`` names, else
    ``model.safetensors`` (never a trainer's saved state, nor a second copy such as ``model.fp16.safetensors``)."""
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        try:
            shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        except (OSError, ValueError, KeyError, TypeError, AttributeError):
            return []
        return [folder / name for name in shards if (folder / name).is_file()]
    single = folder / "model.safetensors"
    return [single] if single.is_file() else []


def stored_parameters(target: Path) -> int | None:
    """Parameters of the weights ``target`` holds, from the files' headers alone (safetensors' JSON header, GGUF's
    tensor infos); None when they cannot be read that way (pickle-based weights)."""
    files = [target] if target.is_file() else _weight_files(target)
    gguf = _gguf_in(target) if target.is_dir() else None
    if gguf is not None and not files:
        files = [gguf]
    total = 0
    for path in files:
        if path.suffix.lower() == ".gguf":
            try:
                from gguf import GGUFReader
            except ImportError:
                return None
            try:
                total += sum(int(t.n_elements) for t in GGUFReader(str(path)).tensors)
            except Exception:  # a corrupt file: the load itself says so in one line
                return None
            continue
        try:
            with open(path, "rb") as f:
                size = int.from_bytes(f.read(8), "little")
                if size > HEADER_LIMIT:  # not a safetensors header: do not read a whole file as one
                    return None
                header = json.loads(f.read(size))
            for name, info in header.items():
                if name != "__metadata__":
                    n = 1
                    for d in info["shape"]:
                        n *= int(d)
                    total += n
        except (OSError, ValueError, MemoryError, KeyError, TypeError, AttributeError):
            return None  # a corrupt file: the load itself says so in one line
    return total or None


def check_fits(target: Path, torch_dtype: torch.dtype, dtype: str) -> None:
    """Refuse, before loading, a model whose weights at ``dtype`` exceed the memory this machine can still give —
    a clear error naming what to change instead of the kernel's OOM killer halfway through the load. A cell adds
    little to its model (``qbench.quant.apply``: the copy shares what it does not change), so the weights decide."""
    from qbench.eval.metrics import available_memory

    available = available_memory()
    params = stored_parameters(target)
    if available is None or params is None:
        return
    need = params * torch_dtype.itemsize
    if need <= available:
        return
    gib = 2**30
    smaller = (
        f"load it with --dtype bfloat16 (~{params * 2 / gib:.1f} GiB), or "
        if torch_dtype == torch.float32
        else ""
    )
    raise UserError(
        f"{target.name} holds {params / 1e9:.2f} B parameters: ~{need / gib:.1f} GiB of {dtype} weights, "
        f"{available / gib:.1f} GiB available here; {smaller}free memory or use a larger machine"
    )


def _weights_fingerprint(folder: Path) -> str:
    """sha256 over the weight files' names, sizes and modification times: cheap, and changes when they do.

    ``folder`` may also be one weights file (a ``.gguf``)."""
    import hashlib

    h = hashlib.sha256()
    files = [folder] if folder.is_file() else [*folder.glob("*.safetensors"), *folder.glob("*.bin")]
    for f in sorted(files):
        st = f.stat()
        h.update(f"{f.name}:{st.st_size}:{st.st_mtime_ns};".encode())
    return h.hexdigest()


def _load_placed(
    target: Path | str,
    spec: str,
    torch_dtype: torch.dtype,
    dtype: str,
    placement: Placement,
    trust_remote_code: bool,
    allow_unsafe_weights: bool,
) -> LoadedModel:
    """``target`` placed by accelerate's device map (``qbench.eval.placement``)."""
    from qbench.eval import placement as placing

    if isinstance(target, Path) and target.is_file():
        raise UserError(
            f"{target.name}: a GGUF file is dequantised whole into memory before it could be placed, so "
            "--device-map cannot help; convert it once to a safetensors folder (transformers: from_pretrained(folder, "
            "gguf_file=...).save_pretrained(out); docs/evaluating.md)"
        )
    if isinstance(target, Path) and is_checkpoint(target):
        from models.checkpoint import _load_tokenizer, read_meta

        meta = read_meta(target)
        model = placing.dispatch_checkpoint(target, meta, torch_dtype, placement)
        tokenizer = _load_tokenizer(target, model.config) if meta.get("tokenizer") else None
        if tokenizer is None:
            raise UserError(f"checkpoint {target} has no tokenizer files; re-save it with its tokenizer")
        description = {
            "kind": "qbench",
            "path": str(target),
            "config": model.config.to_dict(),
            "fingerprint": meta["weights"]["sha256"],
            "parameters": model.num_parameters(),
            "dtype": dtype,
            "provenance": meta.get("provenance", {}),
            "placement": placing.describe(model, placement),
        }
        return LoadedModel(model, tokenizer, _folder_name(target), str(target), description)
    loaded = _load_transformers(
        target, torch_dtype, dtype, "cpu", trust_remote_code, allow_unsafe_weights, placement
    )
    loaded.description["placement"] = placing.describe(loaded.model, placement)
    return loaded


def _load_transformers(
    target: Path | str,
    torch_dtype: torch.dtype,
    dtype: str,
    device: str,
    trust_remote_code: bool,
    allow_unsafe_weights: bool,
    placement: Placement | None = None,
) -> LoadedModel:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from models.hf import register_softmax1

    register_softmax1()  # exported softmax-1 folders name it; idempotent, and explicit beside qbench's import hook

    local = isinstance(target, Path)
    if local and not allow_unsafe_weights and not any(target.glob("*.safetensors")):
        raise UserError(
            f"{target} has no .safetensors weights; pickle-based weights can run code when loaded — "
            "pass --allow-unsafe-weights if you trust this folder"
        )
    kwargs = dict(
        local_files_only=local,
        trust_remote_code=trust_remote_code,
        dtype=torch_dtype,
        use_safetensors=None if allow_unsafe_weights else True,
    )
    if placement is not None and placement.active:
        from qbench.eval.placement import transformers_kwargs

        kwargs.update(transformers_kwargs(placement))
    try:
        model = AutoModelForCausalLM.from_pretrained(str(target), **kwargs)
        tokenizer = AutoTokenizer.from_pretrained(
            str(target), local_files_only=local, trust_remote_code=trust_remote_code
        )
    except (OSError, ValueError) as e:
        where = str(target) if local else f"hub model {target!r} (is a hub reachable? HF_HUB_OFFLINE set?)"
        raise UserError(f"cannot load {where}: {str(e).splitlines()[0]}") from None
    model = (model if placement is not None and placement.active else model.to(device)).eval()
    name = _folder_name(target) if local else str(target).replace("/", "--")
    n_params = sum(p.numel() for p in {id(p): p for p in model.parameters()}.values())
    description = {
        "kind": "transformers",
        "path": str(target),
        "model_type": model.config.model_type,
        "fingerprint": _weights_fingerprint(target) if local else getattr(model.config, "_commit_hash", None),
        "architecture": type(model).__name__,
        "parameters": n_params,
        "dtype": dtype,
        "attn_implementation": model.config._attn_implementation,
    }
    return LoadedModel(model, tokenizer, name, str(target), description)
