"""``quantize(model, scheme, mode) -> new model``: the one entry point (torchao's ``quantize_``, minus the in-place).

- The float model is never modified: the result is a deep copy in which each target linear is replaced. The copy
  is built with ``copy.deepcopy(model, memo)`` where the memo maps every target layer to its replacement and every
  other parameter and buffer to a tensor sharing its storage, so a cell costs its model once: the copy holds only
  what quantisation changed. A fake layer keeps the float weight it quantises by reference and fake-quantises it
  in each forward (``FakeQuantLinear``'s ``shared`` storage); one whose weight an algorithm or a transform changed
  holds integer codes and scales. Change a copy by replacing its tensors, never in place: an in-place write to a
  shared tensor reaches the float model (a cast of the copy is safe: its parameters are its own objects).
- A model placed by accelerate (``qbench.eval.placement``: ``device_map``) is copied without its hooks and the copy
  gets hooks of its own (``qbench.quant.offload``); where weights are offloaded, only schemes that quantise one
  layer as it is loaded apply (``offload.offload_problem``), anything else is a ``UserError``.
- Targets: every ``nn.Linear`` and transformers GPT-2 ``Conv1D`` (weight stored transposed, (in, out)), minus
  ``exclude`` (fnmatch patterns on module names; a pattern matching no linear layer is an error) and minus the
  LM head unless ``scheme.quantize_lm_head``. The LM head is a module named ``lm_head``, the model's
  ``get_output_embeddings()``, or a linear whose weight *is* an ``nn.Embedding``'s weight.
- Tied weights: ties among kept tensors survive the deep copy (the memo copies a shared tensor once). When the head
  is quantised, the copy's embedding keeps the float weight (only the head's copy is quantised), and the copy's
  ``config.tie_word_embeddings`` is set False so that transformers' ``tie_weights()`` cannot overwrite either
  side (our ``Transformer.tie_weights`` only ever re-ties a float ``nn.Linear`` head).
- ``mode="fake"``: :class:`~qbench.quant.fake.FakeQuantLinear`. ``mode="real"``, and the bitsandbytes methods
  (``llm-int8``, ``bnb-nf4``) in either mode: ``qbench.quant.kernels.make_real_linear(weight, bias, scheme,
  input_scale=, rotation=)`` with the same arguments as the fake layer; a scheme with no real kernel on the
  device raises ``UserError`` there (never a silent float run).
- SmoothQuant and static scales (``scheme.static``) need ``calibration``: token windows (B, T) run once through
  the float model with hooks on the targets (``calibrate.observe``). SmoothQuant uses each input channel's
  max |x| over all tokens: s_j = clamp(max|X_j|^α / clamp(max_i |W_ij|, 1e-5)^(1−α), 1e-5) (SmoothQuant's
  reference code); static scales the observed ranges of the transformed input and the output (``static.py``),
  passed to the layers as ``act_static=`` / ``out_static=``.
- Hadamard: one seeded :class:`~qbench.quant.fake.HadamardRotation` per layer input dimension.
- ``algo=gptq`` and ``algo=awq`` (``gptq.py``, ``awq.py``, run over the model by ``solve.py``): each layer's
  input statistics from the calibration windows — block by block through the already quantised blocks
  (``sequential.py``, the default) or from the float model (``sequential=false``) — then GPTQ's codes and grid
  (``weight_qparams``) or AWQ's input scale (``input_scale``, applied in the layer as SmoothQuant's) and clipped
  grid; fake and real layers round onto exactly those codes. ``held_out`` windows give the algorithm's layer error
  out of sample; the result carries what calibration found as ``qbench_calibration`` (for the record).
- A gated-attention export (``models.hf``: the gate packed into ``q_proj``'s extra heads, ``o_proj`` = [W_o, 0]) is
  first unpacked (``models.hf.unpack_gates``) so that every scale sees the queries, the gate and the output
  projection apart, as the checkpoint's layers are quantised: checkpoint and export agree under any scheme.
"""

from __future__ import annotations

import copy
import fnmatch
from collections.abc import Iterable

import torch
from torch import Tensor, nn

from models.errors import UserError, unknown_choice
from qbench.quant.calibrate import (
    Observed,
    check_calibration,
    observe,
    static_quantizers,
)
from qbench.quant.fake import FakeQuantLinear, HadamardRotation
from qbench.quant.linears import is_conv1d, is_linear, linear_weight  # noqa: F401  (this module's API too)
from qbench.quant.primitives import QParams
from qbench.quant.quarot import QUAROT_SEED
from qbench.quant.schemes import BNB_METHODS, QuantScheme, get_scheme

MODES = ("fake", "real")


def _output_embeddings(model: nn.Module) -> nn.Module | None:
    getter = getattr(model, "get_output_embeddings", None)
    try:
        return getter() if callable(getter) else None
    except (NotImplementedError, AttributeError):
        return None


def lm_head_names(model: nn.Module) -> set[str]:
    """Names of linear layers that act as the LM head (see the module docstring)."""
    head = _output_embeddings(model)
    tied = {id(m.weight) for m in model.modules() if isinstance(m, nn.Embedding)}
    names = set()
    for name, m in model.named_modules():
        if is_linear(m) and (name.rsplit(".", 1)[-1] == "lm_head" or m is head or id(m.weight) in tied):
            names.add(name)
    return names


def select_layers(
    model: nn.Module, scheme: QuantScheme, exclude: Iterable[str] = (), allow_empty: bool = False
) -> dict[str, nn.Module]:
    """The linear layers ``quantize`` would replace, by name.

    Every ``exclude`` pattern must match a layer the scheme would quantise (an LM head the scheme leaves in float
    does not count: excluding it changes nothing), and something must be left to quantise unless
    ``allow_empty`` (a study's deliberate all-float cell) — either would be a quantisation that did not apply."""
    exclude = (exclude,) if isinstance(exclude, str) else tuple(exclude)
    linears = {name: m for name, m in model.named_modules() if is_linear(m)}
    heads = set() if scheme.quantize_lm_head else lm_head_names(model)
    targets = [name for name in linears if name not in heads]
    aliases = _unpacked_aliases(model, targets)
    for pattern in exclude:
        if not any(fnmatch.fnmatchcase(alias, pattern) for name in targets for alias in aliases[name]):
            shown = ", ".join(targets[:6]) + (", …" if len(targets) > 6 else "")
            kept = (
                " (the LM head stays float under this scheme anyway)"
                if fnmatch.filter(heads, pattern)
                else ""
            )
            raise UserError(
                f"exclude pattern {pattern!r} matches no layer the scheme quantises{kept}; "
                f"those layers: {shown or 'none'}"
            )
    layers = {
        name: linears[name]
        for name in targets
        if not any(fnmatch.fnmatchcase(alias, p) for alias in aliases[name] for p in exclude)
    }
    if exclude and not layers and not allow_empty:
        raise UserError(
            f"--exclude {' '.join(exclude)} keeps every layer of scheme {scheme.name!r} in float: nothing would be "
            "quantised (the float model is the 'fp' record)"
        )
    return layers


def _unpacked_aliases(model: nn.Module, names: Iterable[str]) -> dict[str, tuple[str, ...]]:
    """The names an ``exclude`` pattern may match for each layer: its own, and for a part of a gated export's
    unpacked ``q_proj`` / ``o_proj`` (``models.hf.unpack_gates``) the packed layer's name too, so that
    ``exclude=["*.q_proj"]`` means the same before and after unpacking."""
    unpacked = {name for name, m in model.named_modules() if getattr(m, "qbench_unpacked", False)}
    out = {}
    for name in names:
        parent = name.rsplit(".", 1)[0]
        out[name] = (name, parent) if parent in unpacked else (name,)
    return out


def smoothquant_from_observed(
    layers: dict[str, nn.Module], observed: dict[str, Observed], alpha: float
) -> dict[str, Tensor]:
    """Per-layer SmoothQuant input scales s (in,) from each layer's observed per-channel max |x|."""
    scales = {}
    for name, module in layers.items():
        if name not in observed:
            raise UserError(f"smoothquant: layer {name!r} never ran during calibration; exclude it")
        # (in,): each input channel's max |W| over the output channels
        w_max = linear_weight(module)[0].abs().amax(0).float().clamp_min(1e-5)
        scales[name] = (observed[name].in_absmax.pow(alpha) / w_max.pow(1 - alpha)).clamp_min(1e-5)
    return scales


def smoothquant_scales(
    model: nn.Module, layers: dict[str, nn.Module], calibration: Tensor | None, alpha: float
) -> dict[str, Tensor]:
    """Per-layer SmoothQuant input scales s (in,), from calibration windows run through the float model."""
    observed = observe(model, layers, check_calibration(calibration, "smoothquant"))
    return smoothquant_from_observed(layers, observed, alpha)


def _real_linear(weight: Tensor, bias: Tensor | None, scheme: QuantScheme, **transforms: object) -> nn.Module:
    # imported on the first real layer, not with this module: the kernels bring the C-library loader and every
    # real layer, which fake mode and the CLI's start-up never need
    from qbench.quant.kernels.dispatch import make_real_linear

    return make_real_linear(weight, bias, scheme, **transforms)


def _rotations(
    layers: dict[str, nn.Module], scheme: QuantScheme, online: Iterable[str] | None = None
) -> dict[str, nn.Module]:
    """Hadamard: one seeded rotation per input size, shared by the layers of that size (same signs, stored once).
    ``rotate=quarot``: the same for the layers ``online`` names (o_proj, down_proj: ``qbench.quant.quarot``)."""
    if scheme.method != "hadamard" and scheme.rotate == "none":
        return {}
    if scheme.method != "hadamard":
        names = set(online or ())
        layers = {n: m for n, m in layers.items() if n in names}
    by_dim: dict[int, nn.Module] = {}
    out = {}
    for name, module in layers.items():
        weight = linear_weight(module)[0]
        dim = weight.shape[1]
        if dim not in by_dim:
            seed = int(scheme.param("seed")) if scheme.method == "hadamard" else QUAROT_SEED
            by_dim[dim] = HadamardRotation(dim, seed=seed).to(weight.device)
        out[name] = by_dim[dim]
    return out


def _replacement(
    module: nn.Module,
    scheme: QuantScheme,
    mode: str,
    input_scale: Tensor | None,
    rotation: nn.Module | None,
    static: tuple[nn.Module | None, nn.Module | None] = (None, None),
    solved: tuple[Tensor, QParams | None] | None = None,
) -> nn.Module:
    weight, bias = linear_weight(module)
    own = weight
    extra = {"act_static": static[0], "out_static": static[1]} if scheme.static else {}
    if solved is not None:  # an algorithm's weight and grid (GPTQ): the layer rounds onto exactly its codes
        weight, extra["weight_qparams"] = solved[0].to(weight.dtype), solved[1]
    if mode == "real" and scheme.act_clip_ratio != 1.0:  # the kernels choose activation scales from max |x|
        raise UserError(
            f"scheme {scheme.name!r}: no real kernel clips activations (aclip={scheme.act_clip_ratio:g}); run it "
            "with mode='fake'"
        )
    if mode == "real" or scheme.method in BNB_METHODS:
        return _real_linear(weight, bias, scheme, input_scale=input_scale, rotation=rotation, **extra)
    # the float model's own weight (not an algorithm's new one) is kept by reference and fake-quantised in each
    # forward, so a fake cell adds no weight memory (module docstring)
    shared = weight.data_ptr() == own.data_ptr() and weight.stride() == own.stride()
    return FakeQuantLinear(
        weight, bias, scheme, input_scale=input_scale, rotation=rotation, share_weight=shared, **extra
    )


def _calibrate(
    model: nn.Module,
    layers: dict[str, nn.Module],
    scheme: QuantScheme,
    calibration: Tensor | None,
    rotations: dict,
) -> dict[str, Observed]:
    """One calibration pass for SmoothQuant and/or static scales (``calibrate.py``); {} when neither is needed."""
    if not (scheme.method == "smoothquant" or scheme.static):  # GPTQ's Hessians: gptq_layers
        return {}
    why = "smoothquant" if scheme.method == "smoothquant" else f"scheme {scheme.name!r} (static scales)"
    observed = observe(
        model,
        layers,
        check_calibration(calibration, why),
        rotations if scheme.static else None,
        outputs=scheme.static and scheme.out_bits is not None,
    )
    missing = sorted(set(layers) - set(observed))
    if missing:
        raise UserError(f"{why}: layer {missing[0]!r} never ran during calibration; exclude it")
    return observed


def _shared_tensors(model: nn.Module) -> dict[int, Tensor]:
    """A deep-copy memo entry for every parameter and buffer of ``model``: the copy shares their storage (evaluation
    never writes weights), a tied pair stays tied, and each parameter is a new ``Parameter`` object so that a cast
    of the copy (``.to(torch.bfloat16)`` sets ``param.data``) cannot reach the float model. Replaced layers are in
    the memo themselves, so the copy never reaches their tensors through them."""
    memo: dict[int, Tensor] = {
        id(p): nn.Parameter(p.detach(), requires_grad=p.requires_grad) for p in model.parameters()
    }
    memo.update({id(b): b for b in model.buffers()})
    return memo


def _check_not_quantized(model: nn.Module) -> None:
    previous = getattr(model, "qbench_scheme", None)
    if previous is not None or any(isinstance(m, FakeQuantLinear) for m in model.modules()):
        raise UserError(
            f"the model is already quantised ({(previous or {}).get('name', 'fake-quant layers')}); "
            "quantise the float model instead of stacking quantisations"
        )


def quantize(
    model: nn.Module,
    scheme: str | QuantScheme | dict,
    mode: str = "fake",
    exclude: Iterable[str] = (),
    calibration: Tensor | None = None,
    allow_empty: bool = False,
    held_out: Tensor | None = None,
) -> nn.Module:
    """A quantised deep copy of ``model`` (see the module docstring); ``model`` itself is not modified.
    ``allow_empty``: accept an ``exclude`` that keeps every layer in float (a study's all-float cell)."""
    scheme = get_scheme(scheme)
    if mode not in MODES:
        raise unknown_choice("quantisation mode", mode, MODES)
    if mode == "real" and scheme.format != "int":  # formats.py emulates; never fall back to int kernels
        raise UserError(
            f"scheme {scheme.name!r}: no real kernel for format {scheme.format!r}; run it with mode='fake'"
        )
    _check_not_quantized(model)
    from qbench.quant import offload

    offloaded = offload.is_offloaded(model)
    if offloaded and offload.offload_problem(scheme, mode):
        raise UserError(offload.offload_problem(scheme, mode))
    if scheme.method == "gguf":  # llama.cpp quantises and runs its own file type (qbench.quant.llamacpp)
        from qbench.quant.llamacpp import quantize_llama_cpp

        if calibration is not None:
            raise UserError(f"scheme {scheme.name!r}: llama.cpp's file types take no calibration")
        return quantize_llama_cpp(model, scheme.param("type"), tuple(exclude), scheme.params.get("tensors"))
    from models.hf import unpack_gates

    model = unpack_gates(model)  # a gated export: q_proj / o_proj quantised as the checkpoint's layers are
    online: list[str] = []
    if scheme.rotate == "quarot":  # the float model rotated first (the same function), then quantised
        from qbench.quant.quarot import rotate

        model, online = rotate(model)
    layers = select_layers(model, scheme, exclude, allow_empty)
    rotations = _rotations(layers, scheme, online)
    observed = _calibrate(model, layers, scheme, calibration, rotations)
    scales = {}
    if scheme.method == "smoothquant":
        scales = smoothquant_from_observed(layers, observed, float(scheme.param("alpha")))
    solved, report = {}, None
    if scheme.algo in ("gptq", "awq"):
        from qbench.quant.solve import solve_layers

        def static_for(name: str) -> tuple[nn.Module | None, nn.Module | None]:
            return (
                static_quantizers(scheme, observed[name], scales.get(name)) if scheme.static else (None, None)
            )

        def build(name: str, module: nn.Module, scale: Tensor | None, entry: tuple) -> nn.Module:
            # sequential calibration propagates through the fake layer: the reference arithmetic of every mode
            return _replacement(module, scheme, "fake", scale, rotations.get(name), static_for(name), entry)

        solution = solve_layers(model, layers, scheme, calibration, held_out, scales, rotations, build)
        scales, solved, report = solution.scales, solution.weights, solution.report
    elif scheme.weight_clip_rule == "mse":  # round-to-nearest onto searched ranges (QuaRot's w_clip: clip.py)
        from qbench.quant.solve import clipped_grids

        solved = clipped_grids(layers, scheme, scales, rotations)
    memo = {}
    for name, module in layers.items():
        static = (
            static_quantizers(scheme, observed[name], scales.get(name)) if scheme.static else (None, None)
        )
        memo[id(module)] = _replacement(
            module, scheme, mode, scales.get(name), rotations.get(name), static, solved.get(name)
        )
    memo.update(_shared_tensors(model))
    hooked = offload.hooks(model)  # accelerate's (a device map): the copy gets hooks of its own
    memo.update(offload.copy_memo(model))
    quantized = copy.deepcopy(model, memo)
    if hooked:
        offload.strip(quantized, hooked)
        offload.rehook(model, quantized, layers)
    if scheme.quantize_lm_head and lm_head_names(model) & set(layers):
        config = getattr(quantized, "config", None)
        if config is not None and getattr(config, "tie_word_embeddings", False):
            config.tie_word_embeddings = False
    quantized.qbench_scheme = scheme.to_dict()
    if report is not None:  # what the algorithm's calibration found (qbench.quant.solve), for the record
        quantized.qbench_calibration = report
    return quantized


def real_kernel_problem(scheme: str | QuantScheme | dict) -> str | None:
    """Why ``scheme`` cannot run with ``mode="real"`` here, or None when it can — asked before any evaluation,
    so a cell with no real kernel is refused (or recorded as unsupported) at once.

    The answer comes from building one small real layer the way :func:`quantize` would (unit input scales for
    SmoothQuant, the scheme's Hadamard rotation, static quantisers from a unit range), so it is the dispatch's
    own verdict and cannot drift from it."""
    scheme = get_scheme(scheme)
    if scheme.method == "gguf":  # llama.cpp's kernels in either mode: there when llama-cpp-python is
        from qbench.quant.llamacpp import require_llama_cpp

        try:
            require_llama_cpp()
        except UserError as err:
            return str(err)
        return None
    if scheme.format != "int":
        return f"scheme {scheme.name!r}: no real kernel for format {scheme.format!r}; run it with mode='fake'"
    d_in, d_out = 256, 32
    layer = nn.Linear(d_in, d_out)
    scale = torch.ones(d_in) if scheme.method == "smoothquant" else None
    rotation = _rotations({"probe": layer}, scheme, ["probe"]).get("probe")
    static = (None, None)
    if scheme.static:
        ones = torch.ones(d_in)
        observed = Observed(-ones, ones, -ones, ones, -torch.ones(d_out), torch.ones(d_out))
        static = static_quantizers(scheme, observed, scale)
    try:
        _replacement(layer, scheme, "real", scale, rotation, static)
    except UserError as err:
        return str(err)
    return None


def _attached_tensors(obj: object, depth: int = 2) -> Iterable[Tensor]:
    """Tensors hanging off a parameter outside its own storage (bitsandbytes' ``SCB``, ``quant_state.absmax``)."""
    for value in getattr(obj, "__dict__", {}).values():
        if isinstance(value, Tensor):
            yield value
        elif depth > 0 and hasattr(value, "__dict__") and not isinstance(value, nn.Module | type):
            yield from _attached_tensors(value, depth - 1)


def _own_tensors(module: nn.Module) -> list[Tensor]:
    """A module's own parameters and buffers, tensors attached to its parameters (bitsandbytes' ``SCB``,
    ``quant_state``), and torch.ao's packed int8 weights (which are neither parameters nor buffers)."""
    own = [*module.parameters(recurse=False), *module.buffers(recurse=False)]
    own += [a for p in module.parameters(recurse=False) for a in _attached_tensors(p)]
    packed = getattr(module, "_packed_params", None)
    if packed is not None and hasattr(packed, "_weight_bias"):
        own += [t for t in packed._weight_bias() if isinstance(t, Tensor)]
    return own


def model_bytes(model: nn.Module, _seen: set[int] | None = None) -> int:
    """Bytes the model really holds, each storage once (tied tensors count once); a tensor a device map
    offloads (``meta`` between calls) counts at its size, wherever it lives, so the figure is the placement's
    invariant.

    A module with an ``nbytes()`` method (the real kernels' packed layers, whose caches are not buffers)
    reports itself and everything below it; elsewhere a module's own tensors count, then its children's.
    """
    seen = set() if _seen is None else _seen
    if callable(getattr(model, "nbytes", None)):
        return int(model.nbytes())
    total = 0
    for name, t in [*model._parameters.items(), *model._buffers.items()]:
        if t is not None and t.is_meta:  # offloaded by a device map: held elsewhere, counted at its size once
            from qbench.quant.offload import source_key

            key = source_key(model, name) or ("meta", id(t))
            if key not in seen:
                seen.add(key)
                total += t.numel() * t.element_size()
    for t in _own_tensors(model):
        if t.is_meta:
            continue
        key = t.data_ptr() if t.is_quantized else t.untyped_storage().data_ptr()
        if key not in seen:
            seen.add(key)
            total += t.numel() * t.element_size() if t.is_quantized else t.untyped_storage().nbytes()
    return total + sum(model_bytes(child, seen) for child in model.children())


def real_kernels(model: nn.Module) -> list[str]:
    """Names of the real-kernel module types in ``model`` (those reporting their storage with ``nbytes()``); a
    layer whose numbers depend on more than its type names that too (``kernel_name``: bitsandbytes' compute dtype)."""
    return sorted(
        {
            getattr(m, "kernel_name", type(m).__name__)
            for m in model.modules()
            if callable(getattr(m, "nbytes", None))
        }
    )
