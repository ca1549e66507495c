"""GGUF files (llama.cpp's format) as ``--ckpt``: loaded through transformers' GGUF reader, dequantised to float.

A GGUF's weights are usually already quantised (Q8_0, Q4_K, ...), so what qbench measures on it is a second
quantisation on top of the file's own: the model block of every record names the file's tensor types
(``gguf.tensor_types``: how many tensors of each type) and its declared ``file_type``. transformers reads only
the architectures it maps (llama, mistral, qwen2, gpt2, ...); any other gets a one-line error. The tokenizer is
built from the same file (``tokenizer.ggml.*``), so the text is tokenised as the model was trained.
Needs the ``gguf`` package (``pip install 'qbench[gguf]'``), imported only here.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from models.errors import UserError
from models.gguf_export import gguf_summary  # the header reader, beside the writer (quant uses it too)


def _import_gguf():
    try:
        import gguf
    except ImportError as e:
        raise UserError(
            f"reading a .gguf file needs the gguf package: pip install 'qbench[gguf]' ({e})"
        ) from None
    return gguf


# GGUF tensor types that hold float weights as they are; any other type is block-quantised (Q8_0, Q4_1, Q4_K…)
FLOAT_TYPES = frozenset({"F32", "F16", "BF16", "F64"})


def block_quantised(summary: Mapping[str, Any] | None) -> bool:
    """Whether a :func:`gguf_summary` names a block-quantised tensor: the file's weights already lie on a grid."""
    return any(t not in FLOAT_TYPES for t in ((summary or {}).get("tensor_types") or {}))


def _fixed_config(config: Any) -> Any:
    """transformers (5.x) reads a GPT-2 GGUF's ``context_length`` into ``n_ctx`` and ``feed_forward_length`` into
    an attribute of that name, while GPT2Config sizes the model from ``n_positions`` and ``n_inner``: any GPT-2
    GGUF whose context is not 1024 (or whose MLP is not 4× wide) fails to load. Carry both over."""
    if getattr(config, "model_type", None) == "gpt2":
        if getattr(config, "n_ctx", None):
            config.n_positions = config.n_ctx
        width = getattr(config, "feed_forward_length", None)
        if width and width != 4 * config.n_embd:
            config.n_inner = width
    return config


def load_gguf(
    path: Path, torch_dtype: torch.dtype, dtype: str, device: str
) -> tuple[torch.nn.Module, Any, dict[str, Any]]:
    """A ``.gguf`` file as (model dequantised to ``torch_dtype``, tokenizer from the file, description); the
    caller (``load.load_model``) adds the weights' fingerprint."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    summary = gguf_summary(path)
    arch = summary["architecture"]
    kwargs = {"gguf_file": path.name, "local_files_only": True}
    try:
        config = _fixed_config(AutoConfig.from_pretrained(str(path.parent), **kwargs))
        model = AutoModelForCausalLM.from_pretrained(
            str(path.parent), config=config, dtype=torch_dtype, **kwargs
        )
        tokenizer = AutoTokenizer.from_pretrained(str(path.parent), **kwargs)
    except (OSError, ValueError, KeyError, NotImplementedError, RuntimeError) as e:
        import transformers

        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise UserError(
            f"cannot load {path} (GGUF architecture {arch!r}) with transformers {transformers.__version__}: "
            f"{first[:300]}"
        ) from None
    model = model.to(device).eval()
    n_params = sum(p.numel() for p in {id(p): p for p in model.parameters()}.values())
    description = {
        "kind": "gguf",
        "path": str(path),
        "model_type": model.config.model_type,
        "architecture": type(model).__name__,
        "parameters": n_params,
        "dtype": dtype,
        "attn_implementation": model.config._attn_implementation,
        "gguf": summary,
    }
    return model, tokenizer, description
