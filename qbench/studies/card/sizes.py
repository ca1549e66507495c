"""Bytes, and nothing else: a format's deployed weight bytes, a repaired model's, a block-quantised source's, and
the KV cache's memory at the model's context."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from models.errors import UserError


def kv_memory(architecture: Mapping[str, Any], configs: Sequence[Any]) -> dict[str, Any] | None:
    """The KV cache's bytes at the model's whole context (``architecture``: the profile's), one sequence: in bf16,
    and for each of ``configs`` (KV rows) as deployed (``qbench.quant.kvschemes.cache_bytes``: packed codes with
    their scales, float residual and kept positions in bf16). None when the cache's geometry is unknown."""
    from qbench.quant.kvschemes import cache_bytes

    a = architecture
    layers, kv_heads, head_dim, context = (a.get(k) for k in ("layers", "kv_heads", "head_dim", "context"))
    if not (layers and kv_heads and head_dim and context):
        return None
    rows = {}
    for c in configs:
        try:
            rows[c.label] = layers * cache_bytes(c, kv_heads, head_dim, context)
        except (UserError, ValueError):  # a scheme with no packed form (the window scheme): no figure
            rows[c.label] = None
    return {
        "context": context,
        "batch": 1,
        "bf16_bytes": 2 * layers * kv_heads * head_dim * context * 2,
        "rows": rows,
        "what": "keys and values of every layer at the model's context, one sequence; packed as "
        "qbench.quant.kvpack stores them (codes, scales and minima; positions still float in bf16)",
    }


def linear_shapes(model: Any) -> dict[str, list[int]]:
    """{layer: [out_features, in_features]} of every linear layer (the LM head included)."""
    from qbench.quant.apply import is_linear, linear_weight

    return {
        name: list(linear_weight(module)[0].shape)
        for name, module in model.named_modules()
        if is_linear(module)
    }


def _scale_bytes(scheme: Mapping[str, Any]) -> tuple[float, float]:
    """(bytes per scale block, bytes per tensor) a format stores beside its codes: an E8M0 byte per MX block, an
    E4M3 byte per NVFP4 block plus one float32 per tensor, a float32 otherwise; an asymmetric grid adds a zero
    point of the weights' own width per block."""
    fmt = scheme.get("format") or "int"
    per_block = 1.0 if fmt.startswith("mxfp") or fmt.startswith("nvfp4") else 4.0
    per_tensor = 4.0 if fmt.startswith("nvfp4") else 0.0
    if not scheme.get("weight_symmetric", True):
        per_block += (scheme.get("weight_bits") or 8) / 8
    return per_block, per_tensor


def weight_bytes(
    scheme: Mapping[str, Any],
    shapes: Mapping[str, Sequence[int]],
    heads: set[str],
    fp_bytes: int,
    float_size: int,
    rest_size: int | None = None,
) -> int | None:
    """The model's nominal storage in a format: each quantised layer's weights at ``weight_bits`` plus its scales
    (:func:`_scale_bytes`; per tensor, per output channel or per group of the weight granularity), every other
    tensor at ``rest_size`` bytes per element (None: as the float model holds it, ``float_size``; 2: bf16, as a
    deployment keeps embeddings, norms and the unquantised head). ``fp_bytes`` is the float model's size, every
    element at ``float_size``. Nominal: what the format stores, not what fake quantisation holds in memory (float
    tensors) nor a kernel's padding."""
    import fnmatch

    bits = scheme.get("weight_bits")
    if bits is None or not shapes or not fp_bytes:
        return None
    exclude = scheme.get("exclude") or []
    head = bool(scheme.get("quantize_lm_head"))
    granularity = scheme.get("weight_granularity") or {}
    per_block, per_tensor = _scale_bytes(scheme)
    rest = float_size if rest_size is None else rest_size
    total = float(fp_bytes) * rest / float_size
    for name, (rows, cols) in shapes.items():
        if (name in heads and not head) or any(fnmatch.fnmatchcase(name, p) for p in exclude):
            continue
        kind = granularity.get("kind")
        if kind == "per_tensor":
            blocks = 1
        elif kind == "per_group":
            blocks = rows * math.ceil(cols / granularity["group_size"])
        else:
            blocks = rows
        total += rows * cols * (bits / 8 - rest) + blocks * per_block + per_tensor
    return round(total)


def deployed_bytes(
    scheme: Mapping[str, Any],
    fp: Mapping[str, Any],
    profile: Mapping[str, Any],
    rest_size: int | None = 2,
) -> int | None:
    """:func:`weight_bytes` of the float record's model: every tensor not quantised in bf16 (``rest_size`` 2, as
    the card's rows state it) or at the evaluated float width (None)."""
    heads = {
        n for n, v in ((fp.get("linear_ranges") or {}).get("per_layer") or {}).items() if v.get("lm_head")
    }
    return weight_bytes(
        scheme,
        profile.get("linear_shapes") or {},
        heads,
        fp.get("model_bytes") or 0,
        float_size(fp),
        rest_size=rest_size,
    )


def quantised_source_bytes(fp: Mapping[str, Any]) -> int | None:
    """The size of the source file when its weights are already block-quantised (a GGUF of Q8_0, Q4_1, Q4_K…
    tensors): the card's reference is that file, so a repaired format must beat it too. None for float sources."""
    # imported here, not above: qbench.eval.gguf imports torch, and words (through decide) must not
    from qbench.eval.gguf import block_quantised

    model = fp.get("model") or {}
    path = Path(str(model.get("path") or ""))
    return path.stat().st_size if block_quantised(model.get("gguf")) and path.is_file() else None


def float_size(fp: Mapping[str, Any]) -> int:
    """Bytes per element of the evaluated float model."""
    return 2 if ((fp.get("protocol") or {}).get("dtype") or "float32") in ("bfloat16", "float16") else 4


def repaired_bytes(
    target: Mapping[str, Any], study: Mapping[str, Any], fp: Mapping[str, Any], profile: Mapping[str, Any]
) -> int | None:
    """The deployed size of ``target``'s format with the repair's units kept in float."""
    repair = study.get("repair") or {}
    scheme = {
        **target["scheme"],
        "exclude": [*(target["scheme"].get("exclude") or []), *repair.get("exclude", [])],
    }
    return deployed_bytes(scheme, fp, profile)
