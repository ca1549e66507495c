"""Quantised copies of a model whose weights accelerate offloads (``device_map=`` with ``max_memory``).

A model loaded with a device map (``qbench.eval.placement``) carries accelerate's ``AlignDevicesHook`` on its
modules: an offloaded module's tensors are ``meta`` between calls, and the hook loads them from its
``weights_map`` (the CPU state dict, or the safetensors file / offload folder on disk) for the duration of one
forward. The quantised copy must run the same way, or quantising would bring every weight into memory — the
thing offloading exists to avoid.

So :func:`qbench.quant.apply.quantize` copies such a model without its hooks (:func:`copy_memo`, :func:`strip`)
and gives the copy hooks of its own (:func:`rehook`) that mirror the float model's (same execution device,
same placement) but read through :class:`QuantizedWeights`: a quantised layer's shared float weight
(``FakeQuantLinear.weight_source``) is the float model's offloaded ``weight`` under another name (transposed for
GPT-2's ``Conv1D``), every other offloaded tensor keeps its name, and what quantisation created (scales,
quantisers' buffers) is held in memory. One layer's float weight is resident at a time, as in the float model.

Only what can be quantised from one offloaded layer at a time without changing its weight is supported:
round-to-nearest fake quantisation in any format, with dynamic or no activation scales
(:func:`offload_problem`). A scheme that transforms or solves for the weights (Hadamard, SmoothQuant, QuaRot,
GPTQ, AWQ, searched clipping), static scales, real kernels and llama.cpp's file types are refused with a clear
error rather than silently materialising the model.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Any

import torch
from torch import Tensor, nn

from models.errors import UserError

SOURCE = "weight_source"  # FakeQuantLinear's name for the float weight it quantises in every forward


def hooks(model: nn.Module) -> dict[str, Any]:
    """``{module name: accelerate hook}`` of every module of ``model`` that carries one ({} for a plain model)."""
    return {name: m._hf_hook for name, m in model.named_modules() if getattr(m, "_hf_hook", None) is not None}


def _align_hooks(hook: Any) -> list[Any]:
    inner = getattr(hook, "hooks", None)  # accelerate's SequentialHook
    return list(inner) if inner is not None else [hook]


def is_offloaded(model: nn.Module) -> bool:
    """Whether some of ``model``'s weights live outside it (meta tensors loaded by a hook for each call)."""
    return any(getattr(h, "offload", False) for hook in hooks(model).values() for h in _align_hooks(hook))


def execution_device(model: nn.Module) -> torch.device:
    """Where ``model`` takes its inputs: the execution device of accelerate's top hook for a placed model (its
    parameters may be ``meta``), else the first parameter's device (the CPU for a model without any)."""
    for h in _align_hooks(getattr(model, "_hf_hook", None)):
        if getattr(h, "execution_device", None) is not None:
            return torch.device(h.execution_device)
    device = next((p.device for p in model.parameters() if not p.is_meta), None)
    return device if device is not None else torch.device("cpu")


def parameter_values(model: nn.Module) -> Iterator[tuple[str, Tensor]]:
    """``model.named_parameters()`` with an offloaded parameter's value read from where it lives, one at a time."""
    for name, p in model.named_parameters():
        yield name, offloaded_tensor(model, name) if p.is_meta else p


def offloaded_tensor(model: nn.Module, name: str) -> Tensor:
    """The value of ``model``'s tensor ``name`` (``"transformer.h.0.attn.c_attn.weight"``), read from the weights
    map of the hook that offloads it when it is ``meta`` between calls (statistics that read a weight outside a
    forward pass); the tensor itself otherwise."""
    module_name, _, leaf = name.rpartition(".")
    tensor = getattr(model.get_submodule(module_name), leaf)
    if not tensor.is_meta:
        return tensor
    parts = name.split(".")
    for cut in range(len(parts) - 1, -1, -1):  # the deepest module whose hook holds the tensor
        module = model.get_submodule(".".join(parts[:cut]))
        for h in _align_hooks(getattr(module, "_hf_hook", None)):
            weights = getattr(h, "weights_map", None)
            key = ".".join(parts[cut:])
            if getattr(h, "offload", False) and weights is not None and _has(weights, key):
                return weights[key]
    raise UserError(f"tensor {name!r} is on the meta device and no accelerate hook holds its value")


def _has(weights: Any, key: str) -> bool:
    """``key in weights`` without reading the tensor (accelerate's ``PrefixedDataset`` is a Mapping whose
    membership test loads it)."""
    base = getattr(weights, "dataset", None)
    if base is not None and not isinstance(weights, QuantizedWeights):
        full = f"{weights.prefix}{key}"
        return full in (getattr(base, "state_dict", None) or {}) or full in (
            getattr(base, "index", None) or {}
        )
    return key in weights


def _source(weights: Any, key: str) -> tuple:
    """Where ``weights[key]`` comes from: a quantised copy's own tensor, or the float model's entry — (file, tensor)
    for a safetensors file, the state dict tensor's storage, or the offload folder's key."""
    if isinstance(weights, QuantizedWeights):
        if key in weights.own:
            return ("own", weights.own[key].untyped_storage().data_ptr())
        return _source(weights.base, weights.renamed[key][0])
    base, key = getattr(weights, "dataset", weights), f"{getattr(weights, 'prefix', '')}{key}"
    info = getattr(base, "index", {}).get(key)
    if info and info.get("safetensors_file"):
        return ("file", info["safetensors_file"], info.get("weight_name", key))
    state = getattr(base, "state_dict", None) or {}
    if key in state:
        return ("cpu", state[key].untyped_storage().data_ptr())
    return ("disk", getattr(base, "save_folder", None), key)


def source_key(module: nn.Module, name: str) -> tuple | None:
    """What an offloaded tensor ``module.<name>`` is read from (:func:`_source`), so two modules offloading one tied
    tensor — or a quantised copy's layer and the float layer it reads — count it once; None without a hook."""
    for h in _align_hooks(getattr(module, "_hf_hook", None)):
        weights = getattr(h, "weights_map", None)
        if getattr(h, "offload", False) and weights is not None and _has(weights, name):
            return _source(weights, name)
    return None


def offload_problem(scheme: Any, mode: str) -> str | None:
    """Why ``scheme`` cannot quantise an offloaded model (see the module docstring), or None."""
    reasons = [
        (mode != "fake", f"mode={mode!r} (real kernels pack every weight)"),
        (scheme.method != "rtn", f"method {scheme.method!r} changes or repacks the weights"),
        (scheme.algo != "rtn", f"algo={scheme.algo} solves for new weights"),
        (scheme.rotate != "none", f"rotate={scheme.rotate} rotates the weights"),
        (scheme.weight_clip_rule == "mse", "a searched weight clip reads every weight first"),
        (scheme.static, "static scales"),
    ]
    for bad, why in reasons:
        if bad:
            return (
                f"scheme {scheme.name!r} cannot quantise a model whose weights are offloaded ({why}); offloaded "
                "models take round-to-nearest fake schemes with dynamic activation scales — give --max-memory "
                "room for the whole model, or drop --device-map"
            )
    return None


def copy_memo(model: nn.Module) -> dict[int, Any]:
    """Deep-copy memo entries that keep accelerate's hooks (and the weights they reach) out of the copy."""
    return {id(hook): None for hook in hooks(model).values()}


def strip(copy: nn.Module, names: Mapping[str, Any]) -> None:
    """Remove what the deep copy brought of the float model's hooks (the wrapped ``forward``, ``_old_forward``
    and the ``_hf_hook`` slot the memo left as None) from the copy's modules ``names``."""
    for name in names:
        module = copy.get_submodule(name)
        for attr in ("_hf_hook", "_old_forward", "forward"):
            module.__dict__.pop(attr, None)


class QuantizedWeights(Mapping):
    """The weights map of a quantised copy's hook: ``own`` tensors (created by quantisation, held in memory) and
    the float model's offloaded ones, ``renamed[key] = (float key, transposed)``."""

    def __init__(self, base: Mapping, renamed: dict[str, tuple[str, bool]], own: dict[str, Tensor]) -> None:
        self.base, self.renamed, self.own = base, renamed, own

    def __getitem__(self, key: str) -> Tensor:
        if key in self.own:
            return self.own[key]
        source, transposed = self.renamed[key]
        value = self.base[source]
        return value.t() if transposed else value

    def __contains__(self, key: object) -> bool:  # without loading the tensor, as Mapping's default would
        return key in self.own or key in self.renamed

    def __iter__(self) -> Iterator[str]:
        yield from self.own
        yield from self.renamed

    def __len__(self) -> int:
        return len(self.own) + len(self.renamed)


def _persistent_tensors(module: nn.Module, recurse: bool) -> Iterator[tuple[str, Tensor]]:
    """The tensors a hook moves: parameters and persistent buffers (accelerate's ``named_module_tensors`` with
    ``remove_non_persistent=True``)."""
    yield from module.named_parameters(recurse=recurse)
    for prefix, sub in module.named_modules() if recurse else [("", module)]:
        for name, buf in sub._buffers.items():
            if buf is not None and name not in sub._non_persistent_buffers_set:
                yield (f"{prefix}.{name}" if prefix else name), buf


def rehook(model: nn.Module, copy: nn.Module, replaced: Mapping[str, nn.Module]) -> None:
    """Give the quantised ``copy`` hooks mirroring ``model``'s (module docstring). ``replaced``: the float layers
    the copy replaced, by name (a GPT-2 ``Conv1D`` stores its weight transposed)."""
    from accelerate.hooks import AlignDevicesHook, add_hook_to_module

    from qbench.quant.fake import FakeQuantLinear
    from qbench.quant.linears import is_conv1d

    for name, hook in hooks(model).items():
        aligned = _align_hooks(hook)
        if not all(type(h) is AlignDevicesHook for h in aligned):
            kinds = ", ".join(sorted({type(h).__name__ for h in aligned}))
            raise UserError(
                f"module {name or 'model'!r} carries accelerate hooks qbench cannot mirror: {kinds}"
            )
        target = copy.get_submodule(name)
        for h in aligned:
            weights_map, offload_buffers = h.weights_map, h.offload_buffers
            if h.offload:
                renamed, own = {}, {}
                for rel, tensor in _persistent_tensors(target, h.place_submodules):
                    owner, _, leaf = rel.rpartition(".")
                    full_owner = f"{name}.{owner}".strip(".") if owner else name
                    if full_owner in replaced and leaf == SOURCE:
                        float_key = f"{owner}.weight" if owner else "weight"
                        renamed[rel] = (float_key, is_conv1d(replaced[full_owner]))
                        offload_buffers = True  # the shared weight is a buffer of the quantised layer
                    elif tensor.is_meta:
                        renamed[rel] = (rel, False)
                    else:
                        own[rel] = tensor
                weights_map = QuantizedWeights(h.weights_map, renamed, own)
                for m in target.modules():
                    if isinstance(m, FakeQuantLinear):
                        m.keep_decoded = False  # a kept Ŵ per layer would hold the whole model
            add_hook_to_module(
                target,
                AlignDevicesHook(
                    execution_device=h.execution_device,
                    offload=h.offload,
                    io_same_device=h.io_same_device,
                    weights_map=weights_map,
                    offload_buffers=offload_buffers,
                    place_submodules=h.place_submodules,
                    skip_keys=h.skip_keys,
                    tied_params_map=h.tied_params_map,
                ),
                append=True,
            )
