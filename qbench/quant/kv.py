"""KV-cache quantisation (fake): what a cache stores is quantised, every query reads it back dequantised.

    from qbench.quant.kv import KVConfig, apply_kv
    kv_model = apply_kv(model, KVConfig(bits=2, keep_first=1))   # a copy; ``model`` is untouched

Definition (docs/metrics.md, "KV-cache quantisation"; KIVI, Liu et al. 2024, §3.1 eq. 1 and §3.2–3.3):

- What: per layer and (KV) head, the keys *after* the rotary embedding (where the model has one) and the values
  after their projection — exactly the tensors a KV cache would hold. Every query position attends over the
  dequantised keys and values. The extra always-visible key of softmax-1 (zeros) and the learned sink's key/value
  are parameters, not cache entries, and stay float.
- Schemes (``KVConfig.scheme``, ``--kv-scheme NAME[:key=value,…]``; ``qbench.quant.kvschemes`` has the
  registry, each scheme's source and its exact definition): ``kivi`` (default; KIVI §3 streaming: keys per
  channel in groups of G tokens once a residual of R is complete, values per token with the R newest float),
  ``per-token`` (llama.cpp q8_0/q4_0/q4_1 blocks of 32), ``fp8-e4m3``/``fp8-e5m2`` (vLLM's per-layer scales)
  and ``window`` (the earlier whole-window statistics, a non-causal upper bound). The quantiser of the integer
  schemes other than per-token is KIVI eq. 1 (``fake_quantize_minmax``).
- When: every query at t reads the cache as it stood after token t was written (``read`` gives, per query,
  which positions it reads quantised; ``models.attention.attention_two_version`` computes both score matrices
  and selects by position), so one pass over a window equals generating it token by token through
  ``models.kvcache.QuantizedKVCache`` and no scheme but ``window`` reads a later token.
- ``keep_first=K`` leaves absolute positions 0..K−1 in float (bit-exact) and out of every statistic — sink
  protection as in IntactKV, KVQuant's attention-sink handling and PrefixQuant; ``keep_sinks=K`` keeps each
  layer's K most-attended positions of a float first pass (``kvschemes.attach_sink_finder``).
- Never across sequences of a batch: results do not depend on how windows are batched.

Where the cache is intercepted:

- Our models expose a neutral hook (``CausalSelfAttention.kv_transform``, called on (k, v) after RoPE); a KV
  scheme's quantiser (``kvschemes.KVSchemeQuantizer``, marked ``streaming``) is instead asked for each query's
  view of the whole cache (``read``).
- Transformers models whose attention goes through transformers' ``AttentionInterface`` (GPT-2, Llama,
  Mistral, Qwen2/3, Gemma 3, Phi-3, OPT, GPT-NeoX, GPT-J, ...) get their registered attention function wrapped
  (``qbench_kv+<implementation>``), so eager, sdpa, ``softmax1`` and ``softmax1_eager`` all read quantised
  keys/values: the (key, value) the function receives is what the model's cache stores (after RoPE, before
  GQA's repeat). The wrapper computes each query's view explicitly (``kvschemes.hf_attention``; schemes that
  never read a written position in float hand the stored keys/values to the wrapped implementation).
- Transformers models whose attention module computes attention itself (Bloom, MPT, GPT-Neo, XGLM; Falcon
  before transformers 5.25, which moved it onto the interface) keep their implementation name — renaming it
  would change their code path: such a Falcon tests
  ``_attn_implementation == "sdpa"`` and, failing it, adds an sdpa-style boolean mask to eager scores and sees
  future tokens. Instead each attention module is handed a stand-in cache (``_QuantisingCache``) as its cache
  argument; the module calls ``cache.update(key, value, layer)`` with exactly what a cache stores and attends
  over what it returns. Falcon: keys after RoPE (rotary variants) or as projected (ALiBi variants); Falcon-40B's
  layout broadcasts each k/v group to its query heads before the update, so every copy is quantised alike,
  as its own cache would hold them; Bloom and MPT (ALiBi, bias added to the scores): keys and values as
  projected; GPT-Neo (learned absolute positions) and XGLM (sinusoidal positions added to the embeddings):
  as projected. A real cache passed in (generation) is updated first and read back quantised. The module reads
  one version of the cache for all its queries, which is exact for per-token, fp8 and window; KIVI (whose
  queries read different versions) is refused there in one line.

No silent no-op: after attaching, a probe forward of a few tokens checks that the quantiser ran in every
decoder layer; otherwise ``attach_kv`` refuses the model in one line.
"""

from __future__ import annotations

import copy
import inspect
import sys
from collections.abc import Callable
from dataclasses import dataclass, fields
from typing import Any

import torch
from torch import Tensor, nn

from models.errors import UserError
from models.hf import base_attention, register_gated, ungated
from qbench.quant.kv_options import GRANULARITIES, KV_BITS  # noqa: F401 - GRANULARITIES: the former names
from qbench.quant.kvschemes import KVSchemeQuantizer as KVQuantizer  # the quantiser attached per layer
from qbench.quant.primitives import TINY, check_finite, true_div

# Informative to_dict keys; from_dict ignores them.
_INFO_KEYS = ("label", "keys", "values", "range", "statistics", "causal", "description", "calibration")
KV_PREFIX = "qbench_kv+"  # transformers attention implementations registered by this module


@dataclass(frozen=True)
class KVConfig:
    """How the KV cache is quantised: ``bits`` (8, 6, 4, 3, 2; 8 for fp8), ``scheme`` (a ``kvschemes.KV_SCHEMES``
    name, optionally ``NAME:key=value,…``: kivi (default), per-token, fp8-e4m3, fp8-e5m2, window), ``keep_first``
    (leading absolute positions kept in float), ``keep_sinks`` (the most-attended positions kept in float),
    ``rotate`` (QuaRot's head-dim Hadamard rotation of what the cache stores) and the scheme's own options (``None`` = its default): kivi ``group``/``residual``, per-token ``block``/``sym``,
    fp8 ``scale``, window ``key_axis``. See ``qbench.quant.kvschemes``."""

    bits: int
    scheme: str = "kivi"
    keep_first: int = 0
    keep_sinks: int = 0
    group: int | None = None
    residual: int | None = None
    block: int | None = None
    sym: bool | None = None
    scale: float | str | None = None
    key_axis: str | None = None
    rotate: bool | None = None  # None: as the scheme text says (false when it says nothing)

    def __post_init__(self) -> None:
        from qbench.quant.kvschemes import normalize_config

        normalize_config(self)  # resolves NAME:overrides and aliases, fills defaults; one-line UserErrors

    @property
    def causal(self) -> bool:
        from qbench.quant.kvschemes import KV_SCHEMES

        return KV_SCHEMES.get(self.scheme).causal and not self.keep_sinks  # sinks: chosen over the window

    @property
    def label(self) -> str:
        """Short name for tables: ``kv2``, ``kv2-keep1``, ``kv4-tok``, ``kv8-e4m3``, ``kv2-win``."""
        from qbench.quant.kvschemes import label

        return label(self)

    def to_dict(self) -> dict[str, Any]:
        """Every field (defaults filled in), causal yes/no and what is quantised how: written into every record."""
        from qbench.quant.kvschemes import describe

        return describe(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> KVConfig:
        from qbench.quant.kvschemes import LEGACY_GRANULARITY

        known = [f.name for f in fields(cls)]
        d = dict(d)
        if "granularity" in d and "scheme" not in d:  # records from before the scheme registry
            d.update(LEGACY_GRANULARITY.get(d.pop("granularity"), {"scheme": "?"}))
        unknown = set(d) - set(known) - set(_INFO_KEYS)
        if unknown:
            raise UserError(f"unknown KV-cache config field(s) {sorted(unknown)}; known: {list(known)}")
        return cls(**{k: d[k] for k in known if k in d})


# ----------------------------------------------------------------------------------------------- quantiser


def fake_quantize_minmax(x: Tensor, bits: int, dim: int) -> Tensor:
    """KIVI eq. 1 over ``dim`` (one (z, s) per slice along the other dims): x̂ = round((x − min)/s)·s + min."""
    xf = x.float()
    lo, hi = xf.amin(dim, keepdim=True), xf.amax(dim, keepdim=True)
    check_finite((lo, hi), "KV-cache quantisation")
    qmax = 2**bits - 1
    scale = true_div(hi - lo, qmax).clamp_min(TINY)
    q = (xf - lo).div_(scale).round_().clamp_(0, qmax)
    return q.mul_(scale).add_(lo).to(x.dtype)


def quantize_kv(key: Tensor, value: Tensor, config: KVConfig) -> tuple[Tensor, Tensor]:
    """The (key, value) a cache quantised under ``config`` holds once the whole window (B, H, T, D) is written:
    final positions dequantised, the rest (KIVI's float residuals, kept positions) float."""
    from qbench.quant.kvschemes import KVSchemeQuantizer

    quantizer = KVSchemeQuantizer(config)
    return quantizer.stored(key, value, quantizer.keep_mask(key.size(0), key.size(2), key.device))


# ------------------------------------------------------------------------------------------------ models


def apply_kv(model: nn.Module, config: KVConfig) -> nn.Module:
    """A copy of ``model`` (ours or transformers) whose KV cache is quantised under ``config``.

    ``model`` is not modified. The copy shares the float weights with it (KV quantisation changes activations
    only, and evaluation never writes weights), so it costs almost no memory.
    """
    from qbench.quant import offload

    _check_config(config)
    _check_not_kv(model)
    shared = {id(t): t for t in (*model.parameters(), *model.buffers())}
    hooked = offload.hooks(model)  # a model placed by accelerate: the copy gets hooks of its own
    shared.update(offload.copy_memo(model))
    kv_copy = copy.deepcopy(model, shared)
    if hooked:
        offload.strip(kv_copy, hooked)
        offload.rehook(model, kv_copy, {})
    return attach_kv(kv_copy, config)


def attach_kv(model: nn.Module, config: KVConfig) -> nn.Module:
    """Quantise the KV cache of ``model`` *in place* — only for a copy you own (e.g. ``quantize``'s result).

    A probe forward of a few tokens then checks that the quantiser ran in every decoder layer; a model where it
    cannot be attached everywhere is refused with a :class:`UserError`."""
    from models.transformer import Transformer

    _check_config(config)
    _check_not_kv(model)
    if isinstance(model, Transformer):
        for block in model.transformer.h:
            block.attn.kv_transform = KVQuantizer(config)
    else:
        _attach_transformers(model, config)
    if config.keep_sinks:  # a float pass before each first pass chooses the positions kept in float
        from qbench.quant.kvschemes import attach_sink_finder

        attach_sink_finder(model)
    model.qbench_kv = config.to_dict()
    _probe(model)
    return model


def kv_quantizers(model: nn.Module) -> dict[str, KVQuantizer]:
    """The KV quantisers attached to ``model``, by the name of the attention module holding each."""
    from models.transformer import Transformer

    if isinstance(model, Transformer):
        return {
            f"transformer.h.{i}.attn": block.attn.kv_transform
            for i, block in enumerate(model.transformer.h)
            if isinstance(block.attn.kv_transform, KVQuantizer)
        }
    return {
        name: m.qbench_kv
        for name, m in model.named_modules()
        if isinstance(getattr(m, "qbench_kv", None), KVQuantizer)
    }


PROBE_TOKENS = 4  # a probe forward is this long: enough for every layer to run, cheap on any model


def probe_ids(model: nn.Module) -> Tensor:
    """(1, PROBE_TOKENS) token ids 0, 1, ... on the model's device, for probe forwards."""
    from qbench.quant.offload import execution_device

    return torch.arange(PROBE_TOKENS, device=execution_device(model))[None]


@torch.no_grad()
def _probe(model: nn.Module) -> None:
    """Run a short forward and refuse the model unless the quantiser of every attention module it was attached
    to (one per decoder layer) ran."""
    from models.transformer import Transformer

    quantizers = kv_quantizers(model)
    before = {name: q.calls for name, q in quantizers.items()}
    ids = probe_ids(model)
    for q in quantizers.values():
        q.probing = True  # count the call, read float: a calibrated scheme has no scales yet
    try:
        if isinstance(model, Transformer):
            model(ids)
        else:
            model(input_ids=ids, attention_mask=torch.ones_like(ids), use_cache=False)
    finally:
        for q in quantizers.values():
            q.probing = False
    missed = [name for name, q in quantizers.items() if q.calls == before[name]]
    if missed:
        raise UserError(
            f"KV-cache quantisation did not run in {len(missed)} of {len(quantizers)} attention modules of "
            f"{type(model).__name__} ({', '.join(missed[:3])}{', …' if len(missed) > 3 else ''}): supported "
            "are qbench models and transformers models whose attention goes through transformers' attention "
            "functions or updates a Cache per layer"
        )


def _check_config(config: Any) -> None:
    if not isinstance(config, KVConfig):
        raise UserError(f"KV-cache quantisation needs a KVConfig, got {type(config).__name__}")


def _check_not_kv(model: nn.Module) -> None:
    if getattr(model, "qbench_kv", None) is not None:
        raise UserError(
            f"the model's KV cache is already quantised ({model.qbench_kv['label']}); "
            "start from the float model instead of stacking KV quantisations"
        )


def _attach_transformers(model: nn.Module, config: KVConfig) -> None:
    """Give each attention module its quantiser and route its keys/values through it (module docstring)."""
    hf_config = getattr(model, "config", None)
    base = getattr(hf_config, "_attn_implementation", None)
    if base is None:
        raise UserError(
            f"cannot quantise the KV cache of {type(model).__name__}: not a transformers model with an "
            "attention implementation (config._attn_implementation)"
        )
    named = [m for m in model.modules() if type(m).__name__.endswith("Attention")]
    ids = {id(m) for m in named}
    # The innermost ones: GPT-Neo's GPTNeoAttention only dispatches to its GPTNeoSelfAttention.
    modules = [m for m in named if not any(c is not m and id(c) in ids for c in m.modules())]
    if not modules:
        raise UserError(
            f"cannot find the attention modules of {type(model).__name__} to quantise its KV cache"
        )
    registry = [m for m in modules if _uses_attention_registry(m)]
    for module in modules:
        module.qbench_kv = KVQuantizer(config)
        if module not in registry:
            if config.keep_sinks:  # the sink finder reads attention probabilities this route never sees
                raise UserError(
                    f"cannot keep the sinks of {type(model).__name__} in float: {type(module).__name__} computes "
                    "attention itself; use --kv-keep-first"
                )
            if config.scheme == "kivi":  # one stand-in cache read serves all queries: one version only
                raise UserError(
                    f"cannot quantise the KV cache of {type(model).__name__} under {config.label}: "
                    f"{type(module).__name__} computes attention itself and reads one version of the cache for "
                    "every query, while KIVI's queries read different ones; use --kv-scheme per-token, "
                    "fp8-e4m3, fp8-e5m2 or window"
                )
            _hook_cache_argument(module, model)
    if registry:
        hf_config._attn_implementation = register_kv_attention(base)  # the copy's own config (deep-copied)


def _uses_attention_registry(module: nn.Module) -> bool:
    """Whether ``module``'s model file dispatches attention through transformers' ``ALL_ATTENTION_FUNCTIONS``."""
    return "ALL_ATTENTION_FUNCTIONS" in vars(sys.modules[type(module).__module__])


CACHE_ARGUMENTS = ("layer_past", "cache", "past_key_values", "past_key_value")


class _QuantisingCache:
    """Stands in for the cache argument of an attention module that computes attention itself: its
    ``update(key, value, layer)`` — called with exactly what a cache stores — returns the dequantised keys and
    values the module then attends over. A real cache (generation), if any, is updated first and then read
    back quantised, as the registry wrapper does; without one it behaves as no cache (no past positions)."""

    def __init__(self, module: nn.Module, inner: Any) -> None:
        self._module, self._inner = module, inner

    def update(self, key: Tensor, value: Tensor, *args: Any, **kwargs: Any) -> tuple[Tensor, Tensor]:
        if self._inner is not None:
            key, value = self._inner.update(key, value, *args, **kwargs)
        return _quantizer_of(self._module, "cache.update")(key, value)

    def get_seq_length(self, *args: Any, **kwargs: Any) -> int:
        return 0 if self._inner is None else self._inner.get_seq_length(*args, **kwargs)

    def __getattr__(self, name: str) -> Any:
        inner = self.__dict__.get("_inner")
        if inner is None:
            raise AttributeError(name)
        return getattr(inner, name)


def _quantizer_of(module: nn.Module, where: str) -> Callable:
    quantizer = getattr(module, "qbench_kv", None)
    if quantizer is None:  # never silently run a float cache where a quantised one was asked for
        raise RuntimeError(f"{type(module).__name__} has no KV quantiser but runs {where}")
    return quantizer


def _hook_cache_argument(module: nn.Module, model: nn.Module) -> None:
    """A forward pre-hook that hands ``module`` a :class:`_QuantisingCache` as its cache argument."""
    params = [p for p in inspect.signature(type(module).forward).parameters if p != "self"]
    name = next((p for p in CACHE_ARGUMENTS if p in params), None)
    if name is None:
        raise UserError(
            f"cannot quantise the KV cache of {type(model).__name__}: {type(module).__name__} neither goes "
            "through transformers' attention functions nor takes a cache argument"
        )
    index = params.index(name)

    def hand_cache(mod: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        if len(args) > index:
            args = (*args[:index], _QuantisingCache(mod, args[index]), *args[index + 1 :])
        else:
            inner = kwargs.pop(name, None)
            if inner is None and name == "cache":  # deprecated spelling some callers may still use
                inner = kwargs.pop("past_key_values", None)
            kwargs[name] = _QuantisingCache(mod, inner)
        return args, kwargs

    module.register_forward_pre_hook(hand_cache, with_kwargs=True)


def _kv_attention(base: str) -> Callable:
    def attention(module: nn.Module, query: Tensor, key: Tensor, value: Tensor, *args: Any, **kwargs: Any):
        quantizer = _quantizer_of(module, KV_PREFIX + base)
        if getattr(quantizer, "streaming", False):  # each query reads the cache as it was after its token
            from models.hf import SOFTMAX1, SOFTMAX1_EAGER
            from qbench.quant.kvschemes import hf_attention

            return hf_attention(
                quantizer,
                module,
                query,
                key,
                value,
                *args,
                softmax_one=base in (SOFTMAX1, SOFTMAX1_EAGER),
                base_name=base,
                base=base_attention(base, module),
                **kwargs,
            )
        key, value = quantizer(key, value)  # (B, kv heads, T, D): as stored, before GQA's repeat
        return base_attention(base, module)(module, query, key, value, *args, **kwargs)

    attention.__doc__ = f"{base} attention reading a quantised KV cache (qbench.quant.kv)."
    return attention


def register_kv_attention(base: str) -> str:
    """Register ``qbench_kv+<base>`` (attention and mask functions) with transformers; returns the name."""
    from transformers import AttentionInterface
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, AttentionMaskInterface

    if base.startswith(KV_PREFIX):
        raise UserError("the model's KV cache is already quantised; start from the float model")
    gated, inner = ungated(base)
    if gated:  # the gate stays outermost: the quantised cache sees the ordinary query heads
        return register_gated(register_kv_attention(inner))
    name = KV_PREFIX + base
    if base != "eager":
        from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

        if base not in ALL_ATTENTION_FUNCTIONS:
            raise UserError(f"attention implementation {base!r} is not registered with transformers")
    AttentionInterface.register(name, _kv_attention(base))
    if base in ALL_MASK_ATTENTION_FUNCTIONS._global_mapping:  # same masks as the wrapped implementation
        AttentionMaskInterface.register(name, ALL_MASK_ATTENTION_FUNCTIONS._global_mapping[base])
    return name
