"""Generation through a packed KV cache against the float cache: cache bytes and tokens/s.

    from qbench.studies.kvspeed import kv_cache_speed
    records = kv_cache_speed(model, [KVConfig(4, "per-token"), KVConfig(2)], new_tokens=128)

For our own models (``models.Transformer``): greedy decoding of ``new_tokens`` tokens after a ``prompt_tokens``
prompt, batch 1, once with the float :class:`models.KVCache` and once per KV scheme with
:class:`models.kvcache.PackedKVCache` (codes and scales, dequantised on every read — ``qbench.quant.kvpack``).
Timing as ``qbench speed`` does it (``time_interleaved``: round-robin repeats, best and median); bytes are the
cache's contents after the last token (the float cache: keys and values of every position at the model's dtype).
The packed cache dequantises its whole content in Python/torch each step: the tokens/s measure that cost, not a
fused kernel's.
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor, nn

from models.errors import UserError
from qbench.quant.kv import KVConfig, apply_kv
from qbench.studies.speed import time_interleaved


def _decode(model: nn.Module, prompt: Tensor, new_tokens: int, packed: bool) -> tuple[Tensor, Any]:
    """Greedy tokens (1, new_tokens) and the cache they were generated with."""
    cache = model.new_cache(packed=packed) if packed else model.new_cache()
    out = []
    with torch.inference_mode():
        logits = model(prompt, cache)
        for i in range(new_tokens):
            token = logits[:, -1:].argmax(-1)
            out.append(token)
            if i + 1 < new_tokens:
                logits = model(token, cache)
    return torch.cat(out, dim=1), cache


def _float_cache_bytes(cache: Any) -> int:
    return sum(
        t[:, :, : cache.pos].numel() * t.element_size() for t in (*cache._k, *cache._v) if t is not None
    )


def kv_cache_speed(
    model: nn.Module,
    configs: Sequence[KVConfig],
    new_tokens: int = 128,
    prompt_tokens: int = 16,
    repeats: int = 3,
    seed: int = 0,
) -> list[dict[str, Any]]:
    """One record per cache (``float`` first, then each config): ``cache``, ``kv`` (the config's record),
    ``cache_bytes``, ``bytes_vs_float``, ``tokens_per_s`` (best), ``ms_median``, ``tokens_equal_float``."""
    from models.transformer import Transformer

    if not isinstance(model, Transformer):
        raise UserError("the packed KV cache runs in qbench's own models (models.Transformer) only")
    if prompt_tokens + new_tokens > model.config.context:
        raise UserError(
            f"prompt_tokens + new_tokens = {prompt_tokens + new_tokens} exceeds the context {model.config.context}"
        )
    device = next(model.parameters()).device
    prompt = torch.randint(
        0, model.config.vocab_size, (1, prompt_tokens), generator=torch.Generator().manual_seed(seed)
    ).to(device)
    models = [(None, model, False)] + [(c, apply_kv(model, c), True) for c in configs]
    runs = [_decode(m, prompt, new_tokens, packed) for _, m, packed in models]  # warm-up, tokens, caches
    times = time_interleaved(
        [lambda m=m, p=p: _decode(m, prompt, new_tokens, p) for _, m, p in models], repeats
    )
    float_bytes = _float_cache_bytes(runs[0][1])
    records = []
    for (config, _, packed), (tokens, cache), seconds in zip(models, runs, times):
        nbytes = cache.nbytes() if packed else float_bytes
        records.append(
            {
                "cache": "float" if config is None else config.label,
                "kv": None if config is None else config.to_dict(),
                "cache_bytes": nbytes,
                "bytes_vs_float": nbytes / float_bytes,
                "tokens_per_s": new_tokens / min(seconds),
                "ms_median": statistics.median(seconds) * 1e3,
                "tokens_equal_float": bool(torch.equal(tokens, runs[0][0])),
                "new_tokens": new_tokens,
                "prompt_tokens": prompt_tokens,
                "repeats": repeats,
            }
        )
    return records
