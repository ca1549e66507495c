"""KV caches for generation: the float :class:`KVCache`, and quantised ones that hold each position quantised once
its scheme says so, float before.

``Transformer.new_cache()`` returns a quantised one when the model's blocks carry a KV-cache scheme (``qbench.quant.kvschemes``,
attached by ``qbench.quant.kv.apply_kv``). Per layer the cache keeps one (B, nh, context, hs) buffer for keys and one
for values, as :class:`KVCache` does; when n tokens have been written, positions below the
scheme's ``keys_final(n)`` / ``values_final(n)`` hold their dequantised values (written over the float ones, so the
float is gone, as in a deployed cache) and the rest float. A chunk of T > 1 new tokens is read as each of its
queries would have read the cache after its own token: positions quantised during the chunk are still float for the
chunk's earlier queries, so the chunk's float values are kept aside for that one call (two versions, selected by
``attention_two_version``). Positions are absolute: ``keep_first`` and the sinks count from the first token.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import torch
from torch import Tensor

from models.config import ModelConfig


class KVCache:
    """Keys and values of the positions seen so far, for generation: ``model(ids, cache=cache)`` appends the new
    positions and attends over all of them, so each new token costs one position's work instead of the prefix's.

    One preallocated (B, n_head, context, head_dim) buffer per block and per key/value (no re-allocation as the
    sequence grows), created on first use with the dtype and device of the keys. ``pos`` counts the positions
    stored; the model advances it after each forward.
    """

    def __init__(self, config: ModelConfig) -> None:
        self.pos, self.context = 0, config.context
        self._k: list[Tensor | None] = [None] * config.n_layer
        self._v: list[Tensor | None] = [None] * config.n_layer

    def append(self, layer: int, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
        """Store (k, v) (B, nh, T, hs) at positions pos … pos + T − 1 of ``layer``; return its keys/values so far."""
        if self._k[layer] is None:
            B, nh, _, hs = k.shape
            self._k[layer] = k.new_empty(B, nh, self.context, hs)
            self._v[layer] = v.new_empty(B, nh, self.context, hs)
        end = self.pos + k.size(2)
        self._k[layer][:, :, self.pos : end] = k
        self._v[layer][:, :, self.pos : end] = v
        return self._k[layer][:, :, :end], self._v[layer][:, :, :end]

    def buffers(self, layer: int) -> tuple[Tensor, Tensor]:
        """``layer``'s whole (B, nh, context, hs) key and value buffers, for a decode engine that writes position
        ``pos`` itself and reads 0 … pos (``qbench.eval.decode``); they exist once a forward has appended."""
        k, v = self._k[layer], self._v[layer]
        if k is None or v is None:
            raise ValueError(
                f"layer {layer} of the KV cache holds nothing yet: run the prompt through the model first"
            )
        return k, v


class CacheView(NamedTuple):
    """What one layer's queries read: float and quantised versions of every cached position (B, nh, L, hs), and
    per query which one it reads (``key_quantised``/``value_quantised``: (B or 1, 1, T, L), True = quantised)."""

    k: Tensor
    k_hat: Tensor
    v: Tensor
    v_hat: Tensor
    key_quantised: Tensor
    value_quantised: Tensor
    # KIVI's float residual R when the masks are exactly KIVI's from position 0 (one pass over a window): lets
    # ``attention_two_version`` take its banded path; None for any other layout
    residual: int | None = None


class QuantizedKVCache(KVCache):
    """:class:`KVCache` whose stored keys/values are quantised by the scheme the attention layers carry."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__(config)
        self._k_done = [0] * config.n_layer  # leading positions stored quantised, per layer
        self._v_done = [0] * config.n_layer

    def append_read(self, layer: int, k: Tensor, v: Tensor, scheme: Any) -> Any:
        """Store (k, v) (B, nh, T, hs) at positions pos … pos + T − 1, quantise what became final, and return the
        ``CacheView`` the T queries read (float and stored versions with per-query selection masks)."""
        past, end = self.pos, self.pos + k.size(2)
        if not scheme.scheme.causal:  # window: one range over every position so far, recomputed (non-causal)
            k_all, v_all = self.append(layer, k, v)
            return scheme.read(k_all, v_all, past=past)
        k_all, v_all = self.append(layer, k, v)
        keep = scheme.keep_mask(k.size(0), end, k.device)
        k_float, v_float = k_all.clone(), v_all.clone()  # this chunk's queries before a flush read these
        nk, nv = scheme.keys_final(end), scheme.values_final(end)
        if nk > self._k_done[layer]:
            k_all[:, :, self._k_done[layer] : nk] = scheme.quantize_keys(k_all, self._k_done[layer], nk, keep)
            self._k_done[layer] = nk
        if nv > self._v_done[layer]:
            v_all[:, :, self._v_done[layer] : nv] = scheme.quantize_values(
                v_all, self._v_done[layer], nv, keep
            )
            self._v_done[layer] = nv
        mk, mv = scheme.masks(past, end, keep, k.device)
        return CacheView(k_float, k_all, v_float, v_all, mk, mv)

    def stored(self, layer: int) -> tuple[Tensor, Tensor]:
        """What layer ``layer`` holds now, (B, nh, pos, hs) each: quantised where final, float elsewhere."""
        return self._k[layer][:, :, : self.pos], self._v[layer][:, :, : self.pos]


class PackedKVCache(KVCache):
    """A KV cache that holds what a deployment holds: positions the scheme has made final as packed codes with
    their scales (``qbench.quant.kvpack``), dequantised on every read; the rest (KIVI's residual keys and newest
    values) float. Reads equal :class:`QuantizedKVCache`'s bit for bit; ``nbytes()`` is the cache's size."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__(config)
        n = config.n_layer
        self._packed: list[list[Any]] = [[None] * n for _ in range(2)]  # keys, values: one growing range each
        self._float: list[list[Tensor | None]] = [[None] * n for _ in range(2)]  # positions done … pos − 1
        self._done = [[0] * n for _ in range(2)]

    def _grow(self, which: int, layer: int, x: Tensor, scheme: Any, end: int) -> tuple[Tensor, Tensor]:
        """Append x; pack what became final; (content before packing, content after), both dequantised."""
        held = self._float[which][layer]
        held = x if held is None else torch.cat([held, x], dim=2)
        packed = self._packed[which][layer]
        read = [] if packed is None else [packed.dequantize()]  # dequantised on read, every call
        before = torch.cat([*read, held], dim=2)
        done = self._done[which][layer]
        final = scheme.values_final(end) if which else scheme.keys_final(end)
        if final > done:
            chunk = scheme.pack(held[:, :, : final - done], values=bool(which), offset=done)
            read.append(chunk.dequantize())
            self._packed[which][layer] = chunk if packed is None else packed.extend(chunk)
            held, self._done[which][layer] = held[:, :, final - done :], final
        self._float[which][layer] = held
        return before, torch.cat([*read, held], dim=2)

    def append_read(self, layer: int, k: Tensor, v: Tensor, scheme: Any) -> CacheView:
        """As :meth:`QuantizedKVCache.append_read`, from packed storage."""
        past, end = self.pos, self.pos + k.size(2)
        if end > self.context:
            raise ValueError(f"sequence length {end} exceeds the model's context {self.context}")
        k_float, k_stored = self._grow(0, layer, k, scheme, end)
        v_float, v_stored = self._grow(1, layer, v, scheme, end)
        mk, mv = scheme.masks(past, end, None, k.device)
        return CacheView(k_float, k_stored, v_float, v_stored, mk, mv)

    def stored(self, layer: int) -> tuple[Tensor, Tensor]:
        """What layer ``layer`` holds now, dequantised, (B, nh, pos, hs) each."""
        out = []
        for which in (0, 1):
            packed, held = self._packed[which][layer], self._float[which][layer]
            out.append(torch.cat([*([] if packed is None else [packed.dequantize()]), held], dim=2))
        return out[0], out[1]

    def nbytes(self) -> int:
        """Bytes held: packed codes, scales and minima, plus the float positions."""
        total = sum(p.nbytes for which in (0, 1) for p in self._packed[which] if p is not None)
        return total + sum(
            t.numel() * t.element_size() for w in (0, 1) for t in self._float[w] if t is not None
        )
