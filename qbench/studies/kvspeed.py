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
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import Tensor, nn

from models.errors import UserError
from qbench.quant.kv import KVConfig, apply_kv
from qbench.studies.timing import time_interleaved


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


# ------------------------------------------------------------------------------------ qbench speed's KV section

KV_CONTEXTS = (1024, 4096)  # ``qbench speed --kv-contexts``: prefill lengths
KV_NEW_TOKENS = 16  # ``qbench speed --kv-new-tokens``: decode steps timed after the prefill
PREFILL_CHUNK = 512  # prefill in chunks: scores of 512 queries × 4k keys, not 4k × 4k (float values may
# differ from one pass in the last bits, as matmuls of another shape do; bytes and the work per step do not)
KV_DEFAULT_SCHEMES = (("kivi", (8, 4, 2)), ("per-token", (8, 4, 2)), ("fp8-e4m3", (8,)))


def default_kv_configs() -> list[KVConfig]:
    """What ``qbench speed`` measures without --kv-scheme/--kv-bits: every packed format of
    ``qbench.quant.kvpack`` at 8, 4 and 2 bits (KIVI, llama.cpp's per-token blocks) and vLLM's FP8 E4M3."""
    return [KVConfig(bits, scheme) for scheme, widths in KV_DEFAULT_SCHEMES for bits in widths]


def kv_configs(schemes: Sequence[str] | None, bits: Sequence[int] | None) -> list[KVConfig]:
    """Every ``--kv-scheme`` × ``--kv-bits`` (fp8 schemes: 8 bits whatever is given; a scheme's own ``bits=``
    wins); neither given: :func:`default_kv_configs`; bits alone: KIVI at those widths."""
    from qbench.quant.kvschemes import FP8_ELEMENTS, parse_kv_scheme

    if not schemes and not bits:
        return default_kv_configs()
    out: list[KVConfig] = []
    for text in schemes or ["kivi"]:
        parsed = parse_kv_scheme(text)
        if parsed["scheme"] in FP8_ELEMENTS or "bits" in parsed:
            widths = [parsed.get("bits", 8)]
        elif bits:
            widths = list(bits)
        else:
            widths = [8, 4, 2]
        for b in widths:
            config = KVConfig(b, text)
            if config not in out:
                out.append(config)
    return out


def _decode_from(model: nn.Module, cache: Any, token: Tensor, steps: int) -> tuple[Tensor, Any]:
    """``steps`` greedy decode steps from a prefilled ``cache`` (changed in place) and the next ``token``."""
    out = []
    with torch.inference_mode():
        for _ in range(steps):
            logits = model(token, cache)
            token = logits[:, -1:].argmax(-1)
            out.append(token)
    return torch.cat(out, dim=1), cache


def _cache_bytes(cache: Any, packed: bool) -> int:
    return cache.nbytes() if packed else _float_cache_bytes(cache)


def kv_generation_records(
    model: nn.Module,
    name: str,
    configs: Sequence[KVConfig],
    contexts: Sequence[int] = KV_CONTEXTS,
    new_tokens: int = KV_NEW_TOKENS,
    repeats: int = 3,
    seed: int = 0,
    common: dict[str, Any] | None = None,
) -> list[dict[str, Any]]:
    """``qbench speed``'s KV-cache section: per context c, a random c-token prompt is prefilled once per cache
    (float, then the packed cache of each config: ``models.kvcache.PackedKVCache``), and ``new_tokens`` greedy
    decode steps are timed from a copy of the prefilled cache — interleaved, ``repeats`` times — so tokens/s is
    generation with a c-token cache, prefill excluded (``prefill_ms``: the prefill, in chunks of PREFILL_CHUNK tokens).

    One record per (context, cache), ``kind="kv"``: ``cache`` (float or the config's label), ``kv`` (the config's
    record), ``context``, ``new_tokens``, ``cache_bytes`` (after the last step), ``float_bytes``,
    ``bytes_vs_float``, ``ms``/``ms_min`` (the decode steps: median, best), ``tokens_per_s`` (best),
    ``tokens_per_s_median``, ``speedup``/``speedup_best`` (float's time / this one's: > 1 is faster),
    ``tokens_equal_float``, ``error`` (why a cache did not run) and ``common``'s fields."""
    import copy

    from models.transformer import Transformer

    common = {**(common or {}), "model": name, "kind": "kv", "seed": seed, "repeats": repeats}
    device = next(model.parameters()).device
    limit = getattr(getattr(model, "config", None), "context", None)
    records: list[dict[str, Any]] = []
    for context in contexts:
        base = {
            **common,
            "context": context,
            "new_tokens": new_tokens,
            "float_dtype": str(_dtype(model)).removeprefix("torch."),
            "model_context": limit,
        }
        caches: list[dict[str, Any]] = [{"config": None, "model": model, "packed": False}]
        caches += [{"config": c} for c in configs]
        error = None
        if not isinstance(model, Transformer):
            error = "the packed KV cache runs in qbench's own models (models.Transformer) only"
        elif context + new_tokens > limit:
            error = f"context {context} + {new_tokens} new tokens exceeds the model's context {limit}"
        if error is None:
            ids = torch.randint(
                0, model.config.vocab_size, (1, context), generator=torch.Generator().manual_seed(seed)
            ).to(device)
            for c in caches:
                try:
                    if c["config"] is not None:
                        c["model"], c["packed"] = apply_kv(model, c["config"]), True
                        c["calibration"] = _calibrate(c["model"], c["config"], ids)
                    m, packed = c["model"], c["packed"]
                    cache = m.new_cache(packed=True) if packed else m.new_cache()
                    start = time.perf_counter()
                    with torch.inference_mode():
                        for chunk in ids.split(
                            PREFILL_CHUNK, dim=1
                        ):  # bounded memory; same positions and formats
                            logits = m(chunk, cache)
                    c["prefill_ms"] = (time.perf_counter() - start) * 1e3
                    c["cache"], c["token"] = cache, logits[:, -1:].argmax(-1)
                    c["tokens"], last = _decode_from(
                        m, copy.deepcopy(cache), c["token"], new_tokens
                    )  # warm-up
                    c["bytes"] = _cache_bytes(last, packed)
                except (UserError, RuntimeError, NotImplementedError, ValueError) as err:
                    c["error"] = f"{type(err).__name__}: {err}".splitlines()[0][:200]
            live = [c for c in caches if "error" not in c]

            def step(c: dict[str, Any]) -> Callable[[], float]:
                def run() -> float:
                    cache = copy.deepcopy(c["cache"])  # not timed: the prefilled cache, fresh each repeat
                    start = time.perf_counter()
                    _decode_from(c["model"], cache, c["token"], new_tokens)
                    if device.type == "cuda":  # CUDA runs asynchronously: time to completion
                        torch.cuda.synchronize(device)
                    return time.perf_counter() - start

                return run

            times = _time_with_setup([step(c) for c in live], repeats)
            for c, ts in zip(live, times):
                c["times"] = ts
        else:
            for c in caches:
                c["error"] = error
        ref = caches[0]
        for c in caches:
            config, ts = c["config"], c.get("times")
            rec = {
                **base,
                "cache": "float" if config is None else config.label,
                "kv": None if config is None else {**config.to_dict(), **c.get("calibration", {})},
                "cache_bytes": c.get("bytes"),
                "float_bytes": ref.get("bytes"),
                "bytes_vs_float": c["bytes"] / ref["bytes"] if c.get("bytes") and ref.get("bytes") else None,
                "prefill_ms": c.get("prefill_ms"),
                "ms": statistics.median(ts) * 1e3 if ts else None,
                "ms_min": min(ts) * 1e3 if ts else None,
                "tokens_per_s": new_tokens / min(ts) if ts else None,
                "tokens_per_s_median": new_tokens / statistics.median(ts) if ts else None,
                "speedup": statistics.median(ref["times"]) / statistics.median(ts)
                if ts and ref.get("times")
                else None,
                "speedup_best": min(ref["times"]) / min(ts) if ts and ref.get("times") else None,
                "tokens_equal_float": bool(torch.equal(c["tokens"], ref["tokens"]))
                if "tokens" in c and "tokens" in ref
                else None,
                "error": c.get("error"),
            }
            records.append(rec)
    return records


def _calibrate(model: nn.Module, config: KVConfig, ids: Tensor) -> dict[str, Any]:
    """fp8 ``scale=calib``: scales from the timed prompt itself (speed does not depend on their values; the
    record says so); {} for any other cache."""
    from qbench.quant.kvschemes import CALIBRATED, calibrate_kv_scales

    if config.scale != CALIBRATED:
        return {}
    scales = calibrate_kv_scales(model, [ids])
    layers = sorted(scales)
    return {
        "calibration": {
            "corpus": "the timed prompt (random token ids)",
            "tokens": int(ids.numel()),
            "k_scale": [scales[i][0] for i in layers],
            "v_scale": [scales[i][1] for i in layers],
        }
    }


def _dtype(model: nn.Module) -> torch.dtype:
    return next(model.parameters()).dtype


def _time_with_setup(fns: Sequence[Callable[[], float]], repeats: int) -> list[list[float]]:
    """As ``time_interleaved`` (round-robin), but each function times itself and returns its seconds, so its
    set-up (a copy of the prefilled cache) stays out of the figure."""
    times: list[list[float]] = [[] for _ in fns]
    for _ in range(repeats):
        for fn, out in zip(fns, times):
            out.append(fn())
    return times
