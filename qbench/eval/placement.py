"""Models larger than a device or than memory: accelerate's device maps (``--device-map``, ``--max-memory``,
``--offload-folder``).

``--device-map auto`` hands placement to accelerate, the engine transformers users already load big models with:
``infer_auto_device_map`` fills the devices in order (GPUs, then the CPU) up to ``--max-memory`` and puts what is
left on disk; ``balanced`` spreads the layers evenly over the GPUs (``balanced_low_0`` leaves GPU 0 room for the
logits); ``sequential`` fills GPU 0 first. A module placed on the CPU while the model runs on a GPU, or on disk,
is *offloaded*: its weights are loaded for each call of that module and dropped after it, so the model never has
to fit anywhere — only one layer at a time (and the quantised copy runs the same way: ``qbench.quant.offload``).

- A transformers folder goes through ``from_pretrained(device_map=, max_memory=, offload_folder=)``; weights
  offloaded to disk are read straight from the folder's safetensors files, nothing is copied.
- A qbench checkpoint is built on the meta device, placed by ``infer_auto_device_map`` (a block is never split)
  and dispatched with ``dispatch_model``: the tensors kept on a device are read one at a time, those on disk are
  read from the checkpoint's own safetensors file at each call (indexed, never copied).
- A GGUF file is refused: transformers dequantises the whole file into memory before any placement.

The numbers do not depend on the placement (the same arithmetic, one layer at a time; tested on CPU with a cap
that forces offload); what it costs is time: every offloaded weight is read once per forward pass.
"""

from __future__ import annotations

import atexit
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from models.errors import UserError, unknown_choice

DEVICE_MAPS = ("auto", "balanced", "balanced_low_0", "sequential")
if TYPE_CHECKING:  # the CLI reads DEVICE_MAPS before anything imports torch
    import torch

NO_SPLIT = ["Block"]  # a qbench block runs on one device: its residual stream never crosses mid-block


@dataclass(frozen=True)
class Placement:
    """Where a model's weights go: ``device_map`` (one of :data:`DEVICE_MAPS`, or None: all on ``--device``),
    ``max_memory`` ({device: size} as accelerate takes it: ``{0: "70GiB", "cpu": "4GiB"}``), ``offload_folder``
    (None: a temporary folder removed at exit)."""

    device_map: str | None = None
    max_memory: tuple[tuple[str, str], ...] = ()
    offload_folder: str | None = None

    def __post_init__(self) -> None:
        if self.device_map is not None and self.device_map not in DEVICE_MAPS:
            raise unknown_choice("--device-map", self.device_map, DEVICE_MAPS)
        if self.max_memory and self.device_map is None:
            raise UserError("--max-memory caps what --device-map places; give --device-map auto with it")
        if self.offload_folder and self.device_map is None:
            raise UserError(
                "--offload-folder holds what --device-map offloads; give --device-map auto with it"
            )

    @property
    def active(self) -> bool:
        return self.device_map is not None

    def memory(self) -> dict[int | str, str] | None:
        """``max_memory`` keyed as accelerate wants it (GPU indices as ints)."""
        if not self.max_memory:
            return None
        return {int(k) if k.isdigit() else k: v for k, v in self.max_memory}

    def folder(self) -> str:
        if self.offload_folder:
            Path(self.offload_folder).mkdir(parents=True, exist_ok=True)
            return self.offload_folder
        folder = tempfile.mkdtemp(prefix="qbench-offload-")
        atexit.register(shutil.rmtree, folder, ignore_errors=True)
        return folder

    def to_dict(self) -> dict[str, Any]:
        return {
            "device_map": self.device_map,
            "max_memory": dict(self.max_memory),
            "offload_folder": self.offload_folder,
        }


def parse_max_memory(values: list[str] | None) -> tuple[tuple[str, str], ...]:
    """``["0=70GiB", "cpu=4GiB"]`` → ``(("0", "70GiB"), ("cpu", "4GiB"))``; ``cuda:1`` is GPU 1. One-line errors."""
    from accelerate.utils import convert_file_size_to_int

    out: dict[str, str] = {}
    for value in values or []:
        device, sep, size = value.partition("=")
        device = device.strip().removeprefix("cuda:")
        if not sep or not size.strip():
            raise UserError(f"--max-memory {value!r}: give DEVICE=SIZE, e.g. cpu=4GiB or 0=70GiB")
        if not (device.isdigit() or device in ("cpu", "mps")):
            raise UserError(
                f"--max-memory {value!r}: unknown device {device!r}; use cpu, a GPU index (0, 1, …)"
            )
        try:
            if convert_file_size_to_int(size.strip()) <= 0:
                raise ValueError
        except (ValueError, TypeError):
            raise UserError(
                f"--max-memory {value!r}: {size.strip()!r} is not a size; write it like 4GiB, 500MB or 70GB"
            ) from None
        if device in out:
            raise UserError(f"--max-memory gives device {device!r} twice")
        out[device] = size.strip()
    return tuple(out.items())


def _memory_for(placement: Placement, model: torch.nn.Module, dtype: torch.dtype) -> dict | None:
    from accelerate.utils import get_balanced_memory

    memory = placement.memory()
    if placement.device_map in ("balanced", "balanced_low_0"):
        memory = get_balanced_memory(
            model,
            max_memory=memory,
            no_split_module_classes=NO_SPLIT,
            dtype=dtype,
            low_zero=placement.device_map == "balanced_low_0",
        )
    return memory


def dispatch_checkpoint(path: Path, meta: dict[str, Any], dtype: torch.dtype, placement: Placement) -> Any:
    """A qbench checkpoint's model placed by ``placement`` (module docstring), its weights verified first."""
    import torch
    from accelerate import dispatch_model, infer_auto_device_map

    from models.checkpoint import WEIGHTS_FILE
    from models.config import ModelConfig
    from models.io import sha256_file
    from models.transformer import Transformer

    config = ModelConfig.from_dict(meta["model"])
    if config.emb_proj or config.head_proj:
        raise UserError(
            f"{path}: OSP's projections are folded into the weights when loading, which needs the whole model in "
            "memory; --device-map takes checkpoints without them"
        )
    weights = path / meta["weights"].get("file", WEIGHTS_FILE)
    if sha256_file(weights) != meta["weights"]["sha256"]:
        raise UserError(
            f"{weights} does not match the sha256 in {path / 'config.json'} (a torn or edited file)"
        )
    with torch.device("meta"):
        model = Transformer(config)
    model.tie_weights()
    if config.pos == "rope":
        model.make_rope_tables("cpu")  # non-persistent root buffers: accelerate moves them to the main device
    device_map = infer_auto_device_map(
        model, max_memory=_memory_for(placement, model, dtype), no_split_module_classes=NO_SPLIT, dtype=dtype
    )
    from safetensors import SafetensorError

    try:
        index = _place_weights(model, weights, device_map, dtype, config.tie_embeddings)
        model = dispatch_model(model, device_map, offload_index=index or None)
    except (RuntimeError, ValueError, KeyError, SafetensorError) as e:
        first = str(e).splitlines()[0] if str(e) else type(e).__name__
        raise UserError(f"cannot place {path} with --device-map {placement.device_map}: {first}") from None
    model.hf_device_map = device_map
    return model.eval()


def _device_of(name: str, device_map: dict[str, Any]) -> Any:
    """The device ``device_map`` gives the tensor ``name`` (its longest module prefix)."""
    best, device = -1, None
    for prefix, where in device_map.items():
        if (prefix == "" or name == prefix or name.startswith(prefix + ".")) and len(prefix) > best:
            best, device = len(prefix), where
    return device


def _place_weights(
    model: torch.nn.Module, weights: Path, device_map: dict[str, Any], dtype: torch.dtype, tied: bool
) -> dict[str, dict[str, str]]:
    """Load the tensors ``device_map`` keeps on a device into the meta-built ``model``, one at a time; return the
    offload index of those it sends to disk, read straight from the checkpoint's own file when needed (as
    transformers does for safetensors: nothing is copied). A tied head is stored once, as the token embedding."""
    from accelerate.utils import set_module_tensor_to_device
    from safetensors import safe_open

    index: dict[str, dict[str, str]] = {}
    dtype_name = str(dtype).removeprefix("torch.")
    with safe_open(str(weights), framework="pt") as f:
        stored_shapes = {key: f.get_slice(key).get_shape() for key in f.keys()}  # noqa: SIM118 (not a dict)
    for name, param in model.named_parameters(remove_duplicate=False):
        stored = "transformer.wte.weight" if tied and name == "lm_head.weight" else name
        if list(stored_shapes.get(stored, [])) != list(param.shape):
            found = stored_shapes.get(stored)
            raise ValueError(
                f"{stored} is {'missing' if found is None else list(found)}, the model needs "
                f"{list(param.shape)}: the weights do not match config.json"
            )
        device = _device_of(name, device_map)
        if device == "disk":
            index[name] = {"safetensors_file": str(weights), "weight_name": stored, "dtype": dtype_name}
            continue
        # one mapping per tensor (as models.checkpoint reads): the file's pages are not all kept resident
        with safe_open(str(weights), framework="pt") as f:
            value = f.get_tensor(stored)
        set_module_tensor_to_device(model, name, device, value=value, dtype=dtype)
    if tied and "lm_head.weight" not in index and "transformer.wte.weight" not in index:
        model.tie_weights()  # both on devices: one tensor again
    return index


def transformers_kwargs(placement: Placement) -> dict[str, Any]:
    """``from_pretrained``'s placement arguments."""
    return {
        "device_map": placement.device_map,
        "max_memory": placement.memory(),
        "offload_folder": placement.folder(),
    }


def describe(model: torch.nn.Module, placement: Placement) -> dict[str, Any]:
    """For the model block of a record: the placement asked for and where the modules went (device → count)."""
    where: dict[str, int] = {}
    for device in (getattr(model, "hf_device_map", None) or {}).values():
        where[str(device)] = where.get(str(device), 0) + 1
    return {**placement.to_dict(), "placed": where}
