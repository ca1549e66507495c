"""KV-cache schemes: how a deployed cache quantises what it stores, and *when* (``--kv-scheme NAME[:key=value,…]``).

    KVConfig(2)                                   # kivi, G = 32, R = 128
    KVConfig(2, "kivi:group=32,residual=32")      # the overrides syntax of weight schemes
    KVConfig(4, "per-token:sym=false")            # llama.cpp q4_1
    KVConfig(8, "fp8-e4m3")                       # vLLM's FP8 cache, k_scale = v_scale = 1

Schemes (``KV_SCHEMES``; every one but ``window`` is causal: what a query at t reads depends on tokens ≤ t only):

- ``kivi`` (default) — KIVI (Liu et al. 2024, "KIVI: A Tuning-Free Asymmetric 2bit Quantization for KV Cache"),
  §3.1 eq. 1 quantiser and §3.3 / Algorithm 1 streaming. Keys per channel: the float residual X_Kr collects new
  keys; when it reaches R tokens it is quantised per channel in groups of G consecutive tokens (R a multiple of
  G) and appended to the quantised part. Values per token (in groups of G channels when G divides the head size,
  else the whole head): the R newest values stay float, older ones are quantised as they leave that window.
  Quantiser: asymmetric min/max round-to-nearest (eq. 1). Defaults G = 32, R = 128: the group size and residual
  length of the paper's experiments (§4 setup; R = 128 is also the released code's default), ``group=``,
  ``residual=`` override them. The cache a query at t reads is the one after token t was appended and a full
  residual flushed (Algorithm 1: append, flush, then attend): key j quantised iff j < R·⌊(t+1)/R⌋, value j iff
  j ≤ t − R. (The released code attends before flushing, i.e. j < R·⌊t/R⌋ — one query per R later.) KIVI's
  prefill attends over float keys; here every query, prompt or not, reads the cache as decoding would (so one
  pass over a window equals generating it token by token).
- ``per-token`` — llama.cpp's quantised KV cache (``--cache-type-k/v q8_0 | q4_0 | q4_1 | q5_0 | q5_1``):
  each cached vector is quantised once, when written, in blocks of ``block`` = 32 consecutive values of the
  token's row (all KV heads of one token, as llama.cpp stores the K/V tensors; a partial last block is its own
  block). Layouts (ggml-common.h / ggml-quants.c reference quantisers): block_q8_0 = one fp16 scale d + 32 int8,
  d = amax/127, q = round(x/d) (half away from zero), x̂ = q·d; block_q4_0 = fp16 d + 32 nibbles,
  d = m/−8 with m the block's value of largest magnitude, q = min(15, ⌊x/d + 8.5⌋), x̂ = (q − 8)·d;
  block_q4_1 = fp16 d, fp16 min + 32 nibbles, d = (max − min)/15, q = min(15, ⌊(x − min)/d + 0.5⌋),
  x̂ = q·d + min. ``sym=true`` (default) is q8_0 at 8 bits and the q{b}_0 formula (d = m/−2^(b−1)) otherwise
  (q5_0, q4_0; 6, 3 and 2 bits extend it); ``sym=false`` is q{b}_1. d and min are stored as fp16 (dequantised
  with the fp16 values), the division uses 1/d as llama.cpp does.
- ``fp8-e4m3``, ``fp8-e5m2`` — vLLM's FP8 KV cache (``kv_cache_dtype="fp8_e4m3" | "fp8_e5m2"``): one scale per
  layer for keys (k_scale) and one for values (v_scale), x̂ = s·fp8(clamp(x/s, ±max)), rounding as
  ``qbench.quant.formats`` (torch's float8 casts). ``scale=`` sets both scales; the default 1.0 is vLLM's when
  the checkpoint carries no calibrated k_scale/v_scale. Written once, per position: causal.
- ``window`` — the earlier qbench definition, kept as a documented *upper bound*, not a deployment: keys per
  channel (``key_axis=token``: per token) with one range over all positions of the scored window, values per token
  over the head. Not causal: a query at t reads keys whose range depends on keys after t.

Shared: ``keep_first=K`` keeps absolute positions 0 … K−1 in float and out of every statistic; ``keep_sinks=K``
keeps, per sequence and layer, the K positions that received the most attention in the float model's first pass
(Sun et al. 2024, "Massive Activations in Large Language Models", §2.2: the attention sink is not always
token 0) — see :func:`attach_sink_finder`. Kept positions are float in every version a query reads.

``rotate=true`` (every scheme; ``--kv-rotate``) is QuaRot's rotation of the cache (Ashkboos et al. 2024, §4
"KV cache" and Figure 4): keys are stored as k·Rᵀ and values as v·Rᵀ, R a Hadamard rotation of the head dimension
(:class:`~qbench.quant.fake.HadamardRotation` of order head_dim, seeded as QuaRot's rotation), so a channel whose
keys are all large (the outlier channels of the rotary embedding) is spread over every channel of the head
before the range is taken. QuaRot rotates the queries alike after RoPE (qRᵀ·(kRᵀ)ᵀ = q·kᵀ) and folds the values'
rotation into W_v and, reversed, into W_o; here the stored form is rotated back after dequantisation,
Q(k·Rᵀ)·R, which gives every query the same scores and outputs in exact arithmetic and needs no weight edit, so
it composes with any model and any weight scheme (``rotate=quarot`` or not). The rotation is part of what the
cache stores: the packed cache holds the rotated codes, fp8 ``scale=calib`` measures the rotated maxima.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from models.errors import UserError
from models.kvcache import CacheView
from models.registry import Registry
from qbench.quant.calibrate import stop_before_head
from qbench.quant.formats import round_to_element
from qbench.quant.hadamard import rotate_rows
from qbench.quant.kv_options import KV_SCHEME_SYNTAX
from qbench.quant.kvpack import FP8_ELEMENTS as PACK_FP8_ELEMENTS
from qbench.quant.kvpack import ggml_quantize_blocks, pack
from qbench.quant.overrides import parse_items
from qbench.quant.primitives import TINY, check_finite, true_div


@dataclass(frozen=True)
class KVScheme:
    """A registered KV-cache scheme: its override keys with their defaults, and whether it is causal."""

    name: str
    causal: bool
    defaults: dict[str, Any]
    suffix: str  # the label's scheme part: kv2, kv4-tok, kv8-e4m3, kv2-win
    keys_text: str
    values_text: str


KV_SCHEMES: Registry[KVScheme] = Registry("KV-cache scheme")
KV_SCHEMES.register(
    "kivi",
    KVScheme(
        "kivi", True, {"group": 32, "residual": 128}, "", "per channel, groups of G tokens", "per token"
    ),
    "KIVI streaming: keys per channel in groups of G once R are complete, values per token, R newest float",
    aliases=("kivi-stream",),
)
KV_SCHEMES.register(
    "per-token",
    KVScheme("per-token", True, {"block": 32, "sym": True}, "-tok", "per token, blocks", "per token, blocks"),
    "llama.cpp q8_0/q4_0/q4_1: every vector quantised when written, blocks of 32 along the token's row",
    aliases=("llama.cpp", "ggml"),
)
for _name, _dtype in (("fp8-e4m3", "e4m3"), ("fp8-e5m2", "e5m2")):
    KV_SCHEMES.register(
        _name,
        KVScheme(_name, True, {"scale": 1.0}, f"-{_dtype}", "per layer scale", "per layer scale"),
        f"vLLM FP8 {_dtype.upper()} cache: one scale per layer for keys and values (default 1.0)",
        aliases=("fp8",) if _dtype == "e4m3" else (),
    )
KV_SCHEMES.register(
    "window",
    KVScheme("window", False, {"key_axis": "channel"}, "-win", "per channel over the window", "per token"),
    "whole-window statistics (non-causal upper bound; qbench's earlier definition)",
    aliases=("whole-window",),
)
# Legacy ``granularity`` values (records written before the registry) meant whole-window statistics.
LEGACY_GRANULARITY = {"kivi": {"scheme": "window"}, "per-token": {"scheme": "window", "key_axis": "token"}}
FP8_ELEMENTS = PACK_FP8_ELEMENTS  # scheme name -> element format (shared with the packed cache)
CALIBRATED = "calib"  # fp8 scale=calib: per-layer k_scale/v_scale from calibrate_kv_scales
OPTION_FIELDS = ("group", "residual", "block", "sym", "scale", "key_axis")
SHARED_FIELDS = ("bits", "keep_first", "keep_sinks", "rotate")  # keys every scheme takes
SHARED_DEFAULTS = {"keep_first": 0, "keep_sinks": 0, "rotate": False}
ROTATION_SEED = 0  # the cache's head-dim Hadamard rotation: fixed, so a rotated cell is reproducible
SYNTAX = KV_SCHEME_SYNTAX


# --------------------------------------------------------------------------------------------- the config


def _positive(text: str) -> int:
    if text.isdigit() and int(text) >= 1:
        return int(text)
    raise ValueError("a positive integer")


def _count(text: str) -> int:
    if text.isdigit():
        return int(text)
    raise ValueError("an integer ≥ 0")


def _bool(text: str) -> bool:
    if text in ("true", "1", "yes", "on", "false", "0", "no", "off"):
        return text in ("true", "1", "yes", "on")
    raise ValueError("true or false")


def _scale(text: str) -> float | str:
    if text == CALIBRATED:
        return CALIBRATED
    try:
        value = float(text)
    except ValueError:
        raise ValueError(f"a positive number or {CALIBRATED}") from None
    if not (math.isfinite(value) and value > 0):
        raise ValueError(f"a positive number or {CALIBRATED}")
    return value


def _key_axis(text: str) -> str:
    if text in ("channel", "token"):
        return text
    raise ValueError("channel or token")


_PARSERS = {
    "bits": _positive,
    "keep_first": _count,
    "keep_sinks": _count,
    "rotate": _bool,
    "group": _positive,
    "residual": _positive,
    "block": _positive,
    "sym": _bool,
    "scale": _scale,
    "key_axis": _key_axis,
}


def parse_kv_scheme(text: str) -> dict[str, Any]:
    """``"kivi:group=64,bits=2"`` -> {"scheme": "kivi", "group": 64, "bits": 2}; one-line UserErrors."""
    name, sep, spec = text.partition(":")
    scheme = KV_SCHEMES.get(name.strip().lower())
    out: dict[str, Any] = {"scheme": scheme.name}
    if not sep:
        return out
    valid = [*SHARED_FIELDS, *scheme.defaults]
    if not spec.strip():
        raise UserError(f"KV-cache scheme {text!r}: nothing after ':'; give overrides as {SYNTAX}")
    parsers = {key: _PARSERS[key] for key in valid}
    items = parse_items(spec, parsers, f"KV-cache scheme {text!r}", scheme.name, f"keys: {', '.join(valid)}")
    return {**out, **{key: value for key, (_, value) in items.items()}}


def normalize_config(config: Any) -> None:
    """Validate ``config`` in place (frozen: object.__setattr__): resolve the scheme name (aliases, ``NAME:…``
    overrides), fill the scheme's defaults, refuse options of other schemes and impossible values."""
    from qbench.quant.kv_options import KV_BITS

    if not isinstance(config.scheme, str):
        raise UserError(f"KV-cache scheme must be a name, got {config.scheme!r}; {SYNTAX}")
    parsed = parse_kv_scheme(config.scheme)
    for key, value in parsed.items():
        given = getattr(config, key)
        default = SHARED_DEFAULTS.get(key)
        if key != "scheme" and given is not None and given != default and given != value:
            raise UserError(
                f"KV-cache scheme {config.scheme!r} sets {key}={value} but {key}={given} was also given"
            )
        object.__setattr__(config, key, value)
    scheme = KV_SCHEMES.get(config.scheme)
    for key in OPTION_FIELDS:
        value = getattr(config, key)
        if key not in scheme.defaults:
            if value is not None:
                raise UserError(
                    f"KV-cache scheme {scheme.name!r} takes no {key!r}; its keys: "
                    f"{', '.join([*SHARED_FIELDS, *scheme.defaults])}"
                )
            continue
        object.__setattr__(config, key, scheme.defaults[key] if value is None else value)
    bits = config.bits
    if scheme.name in FP8_ELEMENTS:
        if bits != 8:
            raise UserError(
                f"KV-cache scheme {scheme.name!r} stores 8 bits, not {bits!r}; give bits 8 or leave it out"
            )
    elif isinstance(bits, bool) or bits not in KV_BITS:
        raise UserError(
            f"KV-cache bits {bits!r} are not supported; choose from: {', '.join(map(str, KV_BITS))}"
        )
    for key in ("keep_first", "keep_sinks"):
        value = getattr(config, key)
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise UserError(
                f"KV-cache {key} {value!r} is not supported; choose an integer ≥ 0 (positions kept in float)"
            )
    if config.rotate is None:
        object.__setattr__(config, "rotate", False)
    if not isinstance(config.rotate, bool):
        raise UserError(f"KV-cache rotate {config.rotate!r} is not supported; choose true or false")
    for key in ("group", "residual", "block"):
        value = getattr(config, key)
        if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
            raise UserError(f"KV-cache {key} {value!r} is not supported; choose a positive integer")
    if scheme.name == "kivi" and config.residual % config.group:
        raise UserError(
            f"KV-cache kivi residual={config.residual} is not a multiple of group={config.group} "
            "(KIVI quantises a full residual in groups of G tokens)"
        )
    if (
        scheme.name in FP8_ELEMENTS
        and config.scale != CALIBRATED
        and not (
            isinstance(config.scale, float | int) and not isinstance(config.scale, bool) and config.scale > 0
        )
    ):
        raise UserError(f"KV-cache fp8 scale {config.scale!r} is not supported; choose a positive number")


def label(config: Any) -> str:
    """kv2, kv2-keep1, kv2-g32r32, kv4-tok, kv4-tok-asym, kv8-e4m3, kv2-win, kv2-win-tok, …-sinks1, …-rot."""
    scheme = KV_SCHEMES.get(config.scheme)
    parts = [f"kv{config.bits}{scheme.suffix}"]
    if scheme.name == "kivi" and (config.group, config.residual) != (32, 128):
        parts.append(f"g{config.group}r{config.residual}")
    if scheme.name == "per-token":
        parts += [] if config.sym else ["asym"]
        parts += [] if config.block == 32 else [f"b{config.block}"]
    if scheme.name in FP8_ELEMENTS and config.scale == CALIBRATED:
        parts.append("calib")
    elif scheme.name in FP8_ELEMENTS and config.scale != 1.0:
        parts.append(f"s{config.scale:g}")
    if scheme.name == "window" and config.key_axis == "token":
        parts.append("tok")
    if config.keep_first:
        parts.append(f"keep{config.keep_first}")
    if config.keep_sinks:
        parts.append(f"sinks{config.keep_sinks}")
    if config.rotate:
        parts.append("rot")
    return "-".join(parts)


def describe(config: Any) -> dict[str, Any]:
    """The full scheme (every field, the defaults filled in) plus what is quantised how — record identity."""
    scheme = KV_SCHEMES.get(config.scheme)
    fields = {key: getattr(config, key) for key in ("bits", "scheme", "keep_first", "keep_sinks")}
    fields.update({key: getattr(config, key) for key in scheme.defaults})
    if config.rotate:  # written only when on: every record from before the option keeps its identity
        fields["rotate"] = True
    keys_text = "per token over the head" if config.key_axis == "token" else scheme.keys_text
    rotated = ", rotated by a head-dim Hadamard (QuaRot §4)" if config.rotate else ""
    return {
        **fields,
        # Sinks chosen from the scored window's float pass see the whole window (attach_sink_finder).
        "causal": "yes" if scheme.causal and not config.keep_sinks else "no",
        "label": label(config),
        "keys": f"{keys_text}, after the rotary embedding where the model has one{rotated}",
        "values": f"{scheme.values_text}, after the projection{rotated}",
        "description": KV_SCHEMES.describe(scheme.name),
    }


# ---------------------------------------------------------------------------------------------- quantisers


def minmax_quantize(
    x: Tensor, bits: int, dim: int | tuple[int, ...], exclude: Tensor | None = None
) -> Tensor:
    """KIVI eq. 1 over ``dim`` (asymmetric min/max round-to-nearest, ``kv.fake_quantize_minmax``) with the
    positions where ``exclude`` is True (broadcast to x) left out of the statistics; a slice with nothing left
    gets the range [0, 0]. float32 arithmetic, the result in x's dtype."""
    xf = x.float()
    if exclude is None:
        lo, hi = xf.amin(dim, keepdim=True), xf.amax(dim, keepdim=True)
    else:
        lo = xf.masked_fill(exclude, math.inf).amin(dim, keepdim=True)
        hi = xf.masked_fill(exclude, -math.inf).amax(dim, keepdim=True)
        empty = lo > hi
        lo, hi = lo.masked_fill(empty, 0.0), hi.masked_fill(empty, 0.0)
    check_finite((lo, hi), "KV-cache quantisation")
    qmax = 2**bits - 1
    scale = true_div(hi - lo, qmax).clamp_min(TINY)
    q = (xf - lo).div_(scale).round_().clamp_(0, qmax)
    return q.mul_(scale).add_(lo).to(x.dtype)


def _per_token_rows(x: Tensor, bits: int, block: int, symmetric: bool) -> Tensor:
    """(B, H, n, D) -> each token's row (all H heads, llama.cpp's layout) quantised in blocks of ``block``."""
    B, H, n, D = x.shape
    rows = x.transpose(1, 2).reshape(B, n, H * D)
    full = (H * D) // block * block
    parts = []
    if full:
        blocks = rows[..., :full].reshape(B, n, full // block, block)
        parts.append(ggml_quantize_blocks(blocks, bits, symmetric).reshape(B, n, full))
    if full < H * D:
        parts.append(ggml_quantize_blocks(rows[..., full:], bits, symmetric))
    out = torch.cat(parts, -1) if len(parts) > 1 else parts[0]
    return out.reshape(B, n, H, D).transpose(1, 2).to(x.dtype)


def rotate_cache(x: Tensor, inverse: bool = False) -> Tensor:
    """``rotate=true``'s transform of cached vectors x (…, head_dim), in float32: x·Rᵀ (what the cache stores) or,
    ``inverse``, x·R (back to the model's basis), R = ``HadamardRotation(head_dim, ROTATION_SEED)``
    (``hadamard.rotate_rows``: row by row, so the fake and the packed cache read back the same bits)."""
    return rotate_rows(x, ROTATION_SEED, inverse)


class KVSchemeQuantizer:
    """The quantiser attached to each attention layer for one :class:`~qbench.quant.kv.KVConfig`.

    ``keys_final(n)``/``values_final(n)``: how many leading positions the cache holds quantised once n tokens
    are written (kept positions aside); ``quantize_keys``/``quantize_values``: the quantised form of positions
    [start, stop) — depending only on those positions (and kept ones), so a cache filled chunk by chunk holds
    exactly what one pass computes; ``read``: the one-pass view of a window. ``sinks``: (B, K) absolute
    positions kept in float for the sequences now being run (set by :func:`attach_sink_finder`).
    """

    streaming = (
        True  # marks the (k, v, past) -> CacheView protocol for CausalSelfAttention and the kv wrapper
    )

    def __init__(self, config: Any) -> None:
        self.config = config
        self.scheme = KV_SCHEMES.get(config.scheme)
        self.sinks: Tensor | None = None
        self.observing = False  # the sink finder's float pre-pass: read float, record attention received
        self.calibrating = False  # calibrate_kv_scales' float passes: read float, record |k|, |v| maxima
        self.amax: list[float] = [0.0, 0.0]  # keys, values, over the calibration passes
        self.kv_scales: tuple[float, float] | None = None  # fp8 scale=calib: (k_scale, v_scale)
        self.calls = 0  # how often it ran: the probe after attaching checks every layer's quantiser ran
        self.probing = False  # the attach probe's forward: counts the call, reads float (scales may be unset)
        self.received: Tensor | None = None  # (B, L) attention received, summed over heads and queries

    rotation_seed = ROTATION_SEED  # rotate=true: the seed of the head-dim rotation (kvpack stores it)

    def __repr__(self) -> str:
        return f"KVSchemeQuantizer({self.config.label})"

    def computation_key(self) -> tuple[Any, ...]:
        """What decides this quantiser's output (its config and calibrated scales), not its counters or the
        state of the pass now running: two quantisers with equal keys quantise alike (``qbench.eval.prefix``)."""
        return (self.config, self.kv_scales)

    @property
    def reads_one_version(self) -> bool:
        """True when no query ever reads a written position in float unless it is kept (every scheme but
        KIVI): attention can run over the stored version alone. False while observing (float, probabilities)."""
        return self.scheme.name != "kivi" and not (self.observing or self.calibrating or self.probing)

    # positions ---------------------------------------------------------------------------------------------
    def _final(self, n: Tensor, values: bool) -> Tensor:
        name = self.scheme.name
        if name == "kivi":
            R = self.config.residual
            return (n - R).clamp_min(0) if values else torch.div(n, R, rounding_mode="floor") * R
        return n  # per-token and fp8 quantise when written; window: every position, one range

    def keys_final(self, n: int) -> int:
        return int(self._final(torch.tensor(n), values=False))

    def values_final(self, n: int) -> int:
        return int(self._final(torch.tensor(n), values=True))

    def keep_mask(self, batch: int, length: int, device: torch.device, offset: int = 0) -> Tensor | None:
        """(B, L) True at kept positions (keep_first, the sinks; absolute positions offset … offset + L − 1),
        None when nothing is kept."""
        keep = None
        positions = torch.arange(offset, offset + length, device=device)
        if self.config.keep_first:
            keep = (positions < self.config.keep_first).expand(batch, length).clone()
        if self.config.keep_sinks and self.sinks is not None and not self.observing:
            mask = (positions[None, :, None] == self.sinks.to(device)[:, None, :]).any(-1)  # (B, L)
            keep = mask if keep is None else keep | mask
        return keep

    def masks(
        self, past: int, length: int, keep: Tensor | None, device: torch.device, offset: int = 0
    ) -> tuple[Tensor, Tensor]:
        """(B or 1, 1, T, L) bools: query past + i reads key/value j quantised (the cache after it was written);
        ``offset``: the absolute position of index 0 (a cache that dropped earlier positions)."""
        t1 = torch.arange(offset + past + 1, offset + length + 1, device=device)[:, None]
        j = torch.arange(offset, offset + length, device=device)[None, :]
        mk = (j < self._final(t1, values=False))[None, None]
        mv = (j < self._final(t1, values=True))[None, None]
        if keep is not None:
            mk, mv = mk & ~keep[:, None, None, :], mv & ~keep[:, None, None, :]
        return mk, mv

    # quantisers --------------------------------------------------------------------------------------------
    def _quantize(
        self, x: Tensor, start: int, stop: int, keep: Tensor | None, values: bool, offset: int = 0
    ) -> Tensor:
        """The quantised form of indices [start, stop) of x (B, H, L, D) (absolute positions offset + index);
        kept positions come back float."""
        c, name = self.config, self.scheme.name
        source = part = x[:, :, start:stop]
        kept = None if keep is None else keep[:, None, start:stop, None]  # (B, 1, n, 1)
        if stop <= start:
            return part
        if c.rotate:  # quantise what QuaRot's cache stores, k·Rᵀ, and read it back in the model's basis
            part = rotate_cache(part)
        if name == "kivi" and not values:
            B, H, n, D = part.shape
            G = c.group
            # Groups are G absolute positions; stop is a multiple of R (hence of G) and so is start unless the
            # cache dropped the start of a group (a sliding window): pad that group with excluded rows.
            lead = (offset + start) % G
            ex = torch.zeros(B, 1, n, 1, dtype=torch.bool, device=x.device) if kept is None else kept
            if lead:
                part = torch.cat([part.new_zeros(B, H, lead, D), part], dim=2)
                ex = torch.cat([ex.new_ones(B, 1, lead, 1), ex], dim=2)
            m = (lead + n) // G
            out = minmax_quantize(part.reshape(B, H, m, G, D), c.bits, -2, ex.reshape(B, 1, m, G, 1))
            out, part = out.reshape(B, H, m * G, D)[:, :, lead:], part[:, :, lead:]
        elif name == "kivi":
            B, H, n, D = part.shape
            G = c.group if D % c.group == 0 else D
            out = minmax_quantize(part.reshape(B, H, n, D // G, G), c.bits, -1).reshape(B, H, n, D)
        elif name == "per-token":
            out = _per_token_rows(part, c.bits, c.block, c.sym)
        elif name in FP8_ELEMENTS:
            s = self._fp8_scale(values)
            out = (round_to_element(part.float() / s, FP8_ELEMENTS[name]) * s).to(x.dtype)
        else:  # window
            per_channel = not values and c.key_axis == "channel"
            out = minmax_quantize(part, c.bits, -2 if per_channel else -1, kept if per_channel else None)
        if c.rotate:
            out = rotate_cache(out, inverse=True)
        out = out.to(x.dtype)
        return out if kept is None else torch.where(kept, source, out)

    def _fp8_scale(self, values: bool) -> float:
        """The layer's k_scale or v_scale: the configured number, or the calibrated pair (``scale=calib``)."""
        if self.config.scale != CALIBRATED:
            return float(self.config.scale)
        if self.kv_scales is None:
            raise UserError(
                f"KV-cache scheme {self.config.scheme}:scale=calib needs calibrate_kv_scales(model, batches) "
                "before it runs (or give scale=<number>)"
            )
        return self.kv_scales[values]

    def quantize_keys(
        self, k: Tensor, start: int, stop: int, keep: Tensor | None = None, offset: int = 0
    ) -> Tensor:
        return self._quantize(k, start, stop, keep, False, offset)

    def quantize_values(
        self, v: Tensor, start: int, stop: int, keep: Tensor | None = None, offset: int = 0
    ) -> Tensor:
        return self._quantize(v, start, stop, keep, True, offset)

    def pack(self, x: Tensor, values: bool, offset: int = 0) -> Any:
        """The packed storage (``qbench.quant.kvpack.Packed``) of final positions x (B, H, n, D) from ``offset``."""
        return pack(self, x, values, offset)

    def stored(
        self, k: Tensor, v: Tensor, keep: Tensor | None = None, offset: int = 0
    ) -> tuple[Tensor, Tensor]:
        """What the cache holds once all of k, v (B, H, L, D) are written: the final positions quantised."""
        L = k.size(2)
        nk = max(self.keys_final(offset + L) - offset, 0)
        nv = max(self.values_final(offset + L) - offset, 0)
        k_hat = torch.cat([self.quantize_keys(k, 0, nk, keep, offset), k[:, :, nk:]], dim=2)
        v_hat = torch.cat([self.quantize_values(v, 0, nv, keep, offset), v[:, :, nv:]], dim=2)
        return k_hat, v_hat

    def __call__(self, key: Tensor, value: Tensor) -> tuple[Tensor, Tensor]:
        """One version for every query (attention modules that take a stand-in cache, ``kv._QuantisingCache``):
        what the cache holds after all of key, value (B, H, L, D) were written — exact when no query ever reads a
        written position in float (every scheme but KIVI), so KIVI is refused here."""
        self.calls += 1
        if self.probing:
            return key, value
        if self.scheme.name == "kivi":
            raise UserError(
                f"KV-cache scheme {self.config.label} needs each query's own view of the cache, which an "
                "attention module that computes attention itself cannot take; use per-token, fp8-e4m3, "
                "fp8-e5m2 or window for this model"
            )
        return self.stored(key, value, self.keep_mask(key.size(0), key.size(2), key.device))

    def read(self, k: Tensor, v: Tensor, past: int = 0, offset: int = 0) -> CacheView:
        """The view of queries at indices past … L − 1 over float keys/values (B, H, L, D) whose index 0 is
        absolute position ``offset`` (0 unless the cache dropped positions, as sliding-window caches do)."""
        self.calls += 1
        B, L = k.size(0), k.size(2)
        if self.calibrating:  # the maxima of what the cache stores (rotated under rotate=true)
            ks, vs = (rotate_cache(k), rotate_cache(v)) if self.config.rotate else (k, v)
            self.amax = [max(self.amax[0], float(ks.abs().max())), max(self.amax[1], float(vs.abs().max()))]
        if self.observing or self.calibrating or self.probing:
            none = torch.zeros(1, 1, L - past, L, dtype=torch.bool, device=k.device)
            return CacheView(k, k, v, v, none, none)
        keep = self.keep_mask(B, L, k.device, offset)
        k_hat, v_hat = self.stored(k, v, keep, offset)
        banded = self.scheme.name == "kivi" and past == 0 and offset == 0
        return CacheView(
            k, k_hat, v, v_hat, *self.masks(past, L, keep, k.device, offset),
            residual=self.config.residual if banded else None,
        )  # fmt: skip

    def observe(self, probs: Tensor) -> None:
        """During the sink finder's float pass: add up the attention each position receives (B, L)."""
        if self.observing:
            self.add_received(probs.detach().float().sum(dim=(1, 2)))

    def add_received(self, got: Tensor) -> None:
        """During the sink finder's float pass: add (B, L) attention received, summed over heads and queries."""
        if self.observing:
            if got.dim() == 1:
                got = got[None]
            self.received = got if self.received is None else self.received + got


# ------------------------------------------------------------------------------------------ transformers


def hf_attention(
    quantizer: KVSchemeQuantizer,
    module: torch.nn.Module,
    query: Tensor,
    key: Tensor,
    value: Tensor,
    attention_mask: Tensor | None,
    scaling: float | None = None,
    softmax_one: bool = False,
    base: Any = None,
    base_name: str = "",
    **kwargs: Any,
) -> tuple[Tensor, Tensor | None]:
    """A transformers attention function's job, done explicitly over the two-version cache: ``key``/``value``
    (B, kv heads, L, D) are every cached position (past ones included), ``query`` the last T; GQA repeats the
    quantised heads; ``attention_mask`` boolean (True = attend) or additive float, sliding windows included,
    None = causal; ``scaling`` as given (1/√D when None); softmax-1 when the wrapped implementation is it.
    Schemes that never read a written position in float (all but KIVI) hand the stored keys/values to ``base``,
    the wrapped implementation, instead.

    transformers' caches hold float keys/values, so each call re-quantises them (the same values: a quantised
    position depends only on its own group). Limitation: a sliding-window cache (Mistral) drops old positions;
    decoding through it, a KIVI key group whose start was dropped is re-quantised from its remaining members,
    which differs slightly from the one-pass scoring (exact for the per-token and fp8 schemes)."""
    from models.attention import attention_received, attention_two_version, causal_mask

    for unsupported in ("softcap", "s_aux", "sinks"):
        if kwargs.get(unsupported) is not None:
            raise UserError(
                f"KV-cache scheme {quantizer.config.scheme!r} cannot run attention with {unsupported} "
                f"({type(module).__name__}); use --kv-scheme window"
            )
    T, L = query.size(2), key.size(2)
    # Sliding-window caches keep only the newest positions: the queries' absolute positions place the keys.
    position_ids = kwargs.get("position_ids")
    last = None if position_ids is None else int(position_ids.reshape(-1, position_ids.size(-1))[:, -1].max())
    offset = 0 if last is None else last + 1 - L
    view = quantizer.read(key, value, past=L - T, offset=max(offset, 0))
    one_version = (
        quantizer.reads_one_version or quantizer.probing or quantizer.calibrating
    )  # (the last two: float)
    if one_version and base is not None:  # the stored version alone, on the wrapped kernel
        return base(module, query, view.k_hat, view.v_hat, attention_mask, scaling=scaling, **kwargs)
    from models.hf import REMEDY_IMPLEMENTATIONS

    if base_name in REMEDY_IMPLEMENTATIONS:
        raise UserError(
            f"KV-cache scheme {quantizer.config.label} reads two versions of the cache, which the {base_name!r} "
            "attention of transformers models does not take here; use --kv-scheme per-token, fp8-e4m3, "
            "fp8-e5m2 or window (or the qbench checkpoint itself)"
        )
    k, k_hat, v, v_hat = view.k, view.k_hat, view.v, view.v_hat
    if key.size(1) != query.size(1):
        n_rep = query.size(1) // key.size(1)
        k, k_hat, v, v_hat = (t.repeat_interleave(n_rep, dim=1) for t in (k, k_hat, v, v_hat))
    mask = None if attention_mask is None else attention_mask[..., :L]
    if quantizer.observing and "eager" not in base_name and T == L and causal_mask(mask, T):
        # the sink finder's float pass: the attention received, without materialising the probabilities
        fast = attention_received(query, k, v, "softmax1" if softmax_one else "softmax", scale=scaling)
        if fast is not None:
            quantizer.add_received(fast[1])
            return fast[0].transpose(1, 2).contiguous(), None
    if mask is None and T == 1:
        mask = torch.ones(1, 1, 1, L, dtype=torch.bool, device=query.device)
    out, probs = attention_two_version(
        query,
        k,
        k_hat,
        v,
        v_hat,
        view.key_quantised,
        view.value_quantised,
        "softmax1" if softmax_one else "softmax",
        past=L - T,
        mask=mask,
        scale=scaling,
        residual=view.residual,
        # eager implementations hand back their weights (output_attentions); the others never return any
        need_probs=quantizer.observing or "eager" in base_name,
    )
    quantizer.observe(probs)
    return out.transpose(1, 2).contiguous(), None if probs is None else probs.to(query.dtype)


# ----------------------------------------------------------------------------------------------- sinks


def kv_quantizers(model: torch.nn.Module) -> list[KVSchemeQuantizer]:
    """Every attached quantiser of ``model``, in module order (ours: ``kv_transform``; transformers: ``qbench_kv``)."""
    found = []
    for module in model.modules():
        for attr in ("kv_transform", "qbench_kv"):
            quantizer = getattr(module, attr, None)
            if isinstance(quantizer, KVSchemeQuantizer):
                found.append(quantizer)
    return found


def _first_pass(args: tuple, kwargs: dict[str, Any]) -> bool:
    """No cache yet (or an empty one): the pass whose float attention chooses the sinks."""
    cache = args[1] if len(args) > 1 else kwargs.get("cache", kwargs.get("past_key_values"))
    if cache is None:
        return True
    if hasattr(cache, "get_seq_length"):
        return int(cache.get_seq_length()) == 0
    return getattr(cache, "pos", 0) == 0


def attach_sink_finder(model: torch.nn.Module) -> None:
    """Keep the sinks in float (``keep_sinks=K``): before a first pass (no cache, or an empty one), run the
    model once with float reads, add up per layer and sequence the attention each position receives (over
    heads and queries), and keep each layer's K most-attended positions in float from then on (Sun et al. 2024,
    "Massive Activations in Large Language Models", §2.2: the sink is not always token 0). In one-pass
    scoring that first pass is the window itself, so the choice sees the whole window (``causal: no``); in
    generation it is the prompt's prefill, as a deployment would choose. Costs one extra float forward."""
    quantizers = kv_quantizers(model)
    running = [False]

    def choose_sinks(module: torch.nn.Module, args: tuple, kwargs: dict[str, Any]) -> None:
        if running[0] or any(q.probing for q in quantizers) or not _first_pass(args, kwargs):
            return  # (the attach probe only checks that every layer's quantiser runs)
        running[0] = True
        try:
            for q in quantizers:
                q.observing, q.received, q.sinks = True, None, None
            float_kwargs = {
                k: v for k, v in kwargs.items() if k not in ("cache", "past_key_values", "use_cache")
            }
            if "input_ids" in kwargs or "inputs_embeds" in kwargs or not hasattr(module, "new_cache"):
                float_kwargs["use_cache"] = False  # transformers: leave the caller's cache alone
            with torch.no_grad():
                module(*args[:1], **float_kwargs)
            for q in quantizers:
                if q.received is None:
                    raise RuntimeError(f"{q!r} saw no attention in the float pass; cannot choose sinks")
                k = min(q.config.keep_sinks, q.received.size(-1))
                q.sinks = q.received.topk(k, dim=-1).indices  # (B, K) absolute positions
        finally:
            for q in quantizers:
                q.observing, q.received = False, None
            running[0] = False

    model.register_forward_pre_hook(choose_sinks, with_kwargs=True)


# ----------------------------------------------------------------------------------------- fp8 calibration


def calibrate_kv_scales(model: torch.nn.Module, batches: Any) -> dict[int, tuple[float, float]]:
    """Calibrated FP8 cache scales (``fp8-e4m3:scale=calib``), as vLLM reads k_scale/v_scale from a checkpoint
    calibrated by llm-compressor: per layer, k_scale = max|k| / max_normal and v_scale = max|v| / max_normal over
    float passes of ``batches`` (token-id tensors; the model reads a float cache meanwhile), floored at TINY.
    Fixed before scoring, so the scheme stays causal. Returns {layer index: (k_scale, v_scale)}."""
    quantizers = [q for q in kv_quantizers(model) if q.scheme.name in FP8_ELEMENTS]
    if not quantizers or any(q.config.scale != CALIBRATED for q in quantizers):
        raise UserError(
            "calibrate_kv_scales needs a model whose KV cache runs fp8-e4m3/fp8-e5m2 with scale=calib"
        )
    for q in quantizers:
        q.calibrating, q.amax = True, [0.0, 0.0]
    try:
        with torch.no_grad(), stop_before_head(model, ()) as run:  # the scales need K and V, never the logits
            for ids in batches:
                if hasattr(model, "new_cache"):
                    run(ids)
                else:
                    run(input_ids=ids, use_cache=False)
    finally:
        for q in quantizers:
            q.calibrating = False
    scales = {}
    for layer, q in enumerate(quantizers):
        top = FP8_ELEMENTS[q.scheme.name].max_normal
        q.kv_scales = (max(q.amax[0] / top, TINY), max(q.amax[1] / top, TINY))
        scales[layer] = q.kv_scales
    return scales


def float_read_share(block: dict, window: int) -> dict[str, float] | None:
    """The share of a window's (query, key) reads that hit a *float* key and a float value under a KV cache
    (``block``: ``KVConfig.to_dict()``), every query t reading positions j ≤ t as decoding would: KIVI's float
    residual (key j float iff j ≥ R·⌊(t+1)/R⌋, value j iff j > t − R; module docstring) and the first
    ``keep_first`` positions. A cell whose reads are mostly float measures the residual, not the quantiser (128-token
    windows with R = 32: 24 % of key and 44 % of value reads). ``keep_sinks`` positions are chosen per pass and
    not counted (up to K more per query). A scheme without a float residual (per-token, fp8, window) reads float
    only at the kept-first positions."""
    import torch

    t = torch.arange(window).unsqueeze(1)  # query
    j = torch.arange(window).unsqueeze(0)  # key
    visible = j <= t
    first = j < int(block.get("keep_first") or 0)
    if block.get("scheme") == "kivi":
        r = int(block["residual"])
        keys = first | (j >= r * ((t + 1) // r))
        values = first | (j > t - r)
    else:
        keys = values = first
    reads = visible.sum().item()
    return {
        "keys": (keys & visible).sum().item() / reads,
        "values": (values & visible).sum().item() / reads,
    }


def cache_bytes(config: Any, kv_heads: int, head_dim: int, context: int, float_bytes: int = 2) -> int:
    """Bytes one attention layer's KV cache holds after ``context`` tokens of one sequence, as deployed: the
    positions the scheme has made final in their packed form (:func:`pack`: codes, scales, minima), the rest —
    KIVI's float residual, kept first positions and sinks — at ``float_bytes`` per value (fp16/bf16). A kept
    position is counted both ways (an upper bound by its codes: one token of the context per kept position).
    The per-token scheme packs rows of ``kv_heads × head_dim`` values in whole blocks; FP8 stores one byte a value
    whatever its scale (the layer's scale itself not counted). Bytes as ``qbench.quant.kvpack`` stores them."""
    from dataclasses import replace

    packed_config = replace(config, keep_first=0, keep_sinks=0)
    if config.scheme in PACK_FP8_ELEMENTS:
        packed_config = replace(packed_config, scale=1.0)  # bytes do not depend on the scale
    quantizer = KVSchemeQuantizer(packed_config)
    x = torch.randn(1, kv_heads, context, head_dim, generator=torch.Generator().manual_seed(0))
    total = 0
    for values, final in ((False, quantizer.keys_final(context)), (True, quantizer.values_final(context))):
        if final:
            total += pack(quantizer, x[:, :, :final], values).nbytes
        total += (context - final) * kv_heads * head_dim * float_bytes
    kept = config.keep_first + config.keep_sinks
    return total + 2 * min(kept, context) * kv_heads * head_dim * float_bytes
