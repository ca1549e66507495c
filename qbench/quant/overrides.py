"""Scheme overrides: ``NAME:key=value[,key=value…]`` turns any registered scheme into a variant of it.

``get_scheme("absmax-coarse:w=4,a=4,o=4")`` is absmax-coarse with 4-bit weights, activations and outputs. The
result is an ordinary frozen ``QuantScheme`` whose ``name`` is canonical — the base name, then the overrides
that changed something, sorted by key (``absmax-coarse:a=4,o=4,w=4``) — so the same variant always gets the same
name, its records the same file, and ``get_scheme(scheme.name)`` rebuilds it. Overrides that change nothing
vanish (``absmax-coarse:w=8`` *is* ``absmax-coarse``). ``label`` stays the short table name (``W4A4-tensor+out``).

Keys (:data:`KEYS`): ``w``/``a``/``o`` bits of weights, input activations, outputs (2–8, or ``none`` = float);
``group`` weight group size (an integer such as 32/64/128, ``none`` = per output channel, ``tensor`` = one
scale per tensor); ``sym`` symmetric (absmax) or asymmetric (zeropoint) weights; ``agran`` activation
granularity (token, tensor, channel); ``static`` calibrated activation/output scales (``static.py``; a per-token
activation granularity becomes per tensor, since a static scale cannot follow tokens — give ``agran=channel``
for per channel); ``calib``/``calib_seed`` the calibration windows and their sampling seed; ``head`` also
quantise the LM head; plus the base method's own parameters (``alpha`` for smoothquant, ``seed`` for hadamard,
``threshold`` for llm-int8, ``blocksize`` for bnb-nf4); ``algo`` how the weights are rounded (``rtn``, the
default, ``gptq`` or ``awq``), GPTQ's settings ``damp`` (0.01), ``block`` (128), ``act_order`` (false), AWQ's
``grid`` (20) and ``clip`` (true), and both algorithms' ``sequential`` (true: each block calibrated on the outputs of
the quantised blocks before it; false: on the float model's inputs). The bitsandbytes schemes take only ``head`` and their
own parameters: their layers fix everything else.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from typing import Any

from models.errors import UserError, did_you_mean
from qbench.quant.granularity import Granularity, PerAxis, PerGroup, PerTensor, PerToken

TRUE, FALSE = ("true", "1", "yes", "on"), ("false", "0", "no", "off")
_AGRAN = {"token": PerToken(), "tensor": PerTensor(), "channel": PerAxis(-1)}


def _bits(text: str) -> int | None:
    if text == "none":
        return None
    if text.isdigit() and 2 <= int(text) <= 8:
        return int(text)
    raise ValueError("an integer 2–8 or none")


def _bool(text: str) -> bool:
    if text in TRUE or text in FALSE:
        return text in TRUE
    raise ValueError("true or false")


def _group(text: str) -> Granularity:
    if text in ("none", "channel"):
        return PerAxis(0)
    if text == "tensor":
        return PerTensor()
    if text.isdigit() and int(text) >= 1:
        return PerGroup(int(text))
    raise ValueError("a positive integer (e.g. 32, 64, 128), none (per output channel) or tensor")


def _agran(text: str) -> Granularity:
    if text in _AGRAN:
        return _AGRAN[text]
    raise ValueError("token, tensor or channel")


# How the weights are rounded onto the scheme's grid: round-to-nearest (every format's default), GPTQ's
# Hessian-based error correction (``gptq.py``) or AWQ's activation-aware scales and clipping (``awq.py``), with
# that algorithm's settings (``algo_params``).
ALGOS = ("rtn", "gptq", "awq")
_ALGO_PARAMS: dict[str, dict[str, Any]] = {
    "rtn": {},
    # sequential: each block calibrated on the quantised blocks' outputs (qbench.quant.sequential), as GPTQModel
    # and llm-compressor run both algorithms; false: every layer on the float model's inputs
    "gptq": {"damp": 0.01, "block": 128, "act_order": False, "sequential": True},
    "awq": {"grid": 20, "clip": True, "sequential": True},
}


def algo_defaults(algo: str) -> dict[str, Any]:
    """The settings ``algo`` takes when none are given (unknown names give {}: the scheme check names them)."""
    return dict(_ALGO_PARAMS.get(algo, {}))


def _rotate(text: str) -> str:
    if text not in ("none", "quarot"):
        raise ValueError("none or quarot")
    return text


def _weight_clip(text: str) -> str:
    if text not in ("none", "mse"):
        raise ValueError("none or mse")
    return text


def _algo(text: str) -> str:
    if text in ALGOS:
        return text
    raise ValueError(" or ".join(ALGOS) + did_you_mean(text, ALGOS))


def _fraction(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise ValueError("a number in (0, 1]") from None
    if not (math.isfinite(value) and 0 < value <= 1):
        raise ValueError("a number in (0, 1]")
    return value


def _grid(text: str) -> int:
    if text.isdigit() and int(text) >= 2:
        return int(text)
    raise ValueError("an integer ≥ 2")


def _count(text: str) -> int:
    if text.isdigit() and int(text) >= 1:
        return int(text)
    raise ValueError("a positive integer")


# torch.Generator.manual_seed takes 64-bit seeds; larger ones end in a traceback deep inside torch.
SEED_LIMIT = 2**63


def _seed_value(text: str) -> int:
    if text.isdigit() and int(text) < SEED_LIMIT:
        return int(text)
    raise ValueError(f"an integer from 0 to 2**63 − 1 ({SEED_LIMIT - 1})")


def _seed(text: str) -> int | None:
    if text == "none":
        return None
    try:
        return _seed_value(text)
    except ValueError:
        raise ValueError(
            f"an integer from 0 to 2**63 − 1 ({SEED_LIMIT - 1}) or none (the first windows)"
        ) from None


# key -> (QuantScheme field, parser, the valid range in words)
KEYS: dict[str, tuple[str, Callable[[str], Any], str]] = {
    "w": ("weight_bits", _bits, "2-8|none"),
    "a": ("act_bits", _bits, "2-8|none"),
    "o": ("out_bits", _bits, "2-8|none"),
    "group": ("weight_granularity", _group, "int|none|tensor"),
    "sym": ("weight_symmetric", _bool, "true|false"),
    "agran": ("act_granularity", _agran, "token|tensor|channel"),
    "static": ("static", _bool, "true|false"),
    "calib": ("calib_windows", _count, "int>=1"),
    "calib_seed": ("calib_seed", _seed, "int|none"),
    "head": ("quantize_lm_head", _bool, "true|false"),
    "algo": ("algo", _algo, "rtn|gptq|awq"),
    "rotate": ("rotate", _rotate, "none|quarot"),
    # GPTQ's settings (gptq.py): dampening as a fraction of mean diag H, columns per lazy update, act order
    "damp": ("algo_params.damp", _fraction, "0<x<=1"),
    "block": ("algo_params.block", _count, "int>=1"),
    "act_order": ("algo_params.act_order", _bool, "true|false"),
    # AWQ's settings (awq.py): points of the α search (and of the clipping search), whether to search clipping
    "grid": ("algo_params.grid", _grid, "int>=2"),
    "clip": ("algo_params.clip", _bool, "true|false"),
    # QuaRot's clipping (qbench.quant.clip): the activation range ratio, the weight range search
    "aclip": ("act_clip", _fraction, "0<x<=1"),
    "wclip": ("weight_clip", _weight_clip, "none|mse"),
    # both algorithms: block-by-block calibration on the quantised blocks' outputs, or the float model's inputs
    "sequential": ("algo_params.sequential", _bool, "true|false"),
}
BNB_KEYS = ("head",)  # what the bitsandbytes schemes accept besides their own parameters
SYNTAX = (
    "NAME:key=value[,key=value…], e.g. absmax-coarse:w=4,a=4,o=4 or zeropoint-int4:group=128. Keys: "
    + ", ".join(f"{k} ({v[2]})" for k, v in KEYS.items())
    + "; and the method's own parameters (smoothquant alpha, hadamard seed)"
)


# Method parameters with a bounded range: SmoothQuant's migration strength α ∈ [0, 1] (Xiao et al. 2023, §4.2).
PARAM_RANGES: dict[str, tuple[float, float]] = {"alpha": (0.0, 1.0)}


def _param_parser(name: str, default: Any) -> Callable[[str], Any]:
    kind = type(default)
    if name == "seed" and kind is int:
        return _seed_value
    low, high = PARAM_RANGES.get(name, (0, math.inf))

    def parse(text: str) -> Any:
        try:
            value = kind(text)
        except ValueError:
            raise ValueError(f"a {'number' if kind is float else 'integer'}") from None
        if not (math.isfinite(value) and low <= value <= high):  # nan and inf fail every comparison here
            bound = f"from {low:g} to {high:g}" if math.isfinite(high) else "non-negative and finite"
            raise ValueError(f"a number {bound}")
        return value

    return parse


def _valid_keys(base: Any) -> dict[str, tuple[str, Callable[[str], Any], str]]:
    """The keys ``base`` accepts: :data:`KEYS` (only ``head`` for bitsandbytes) plus its method parameters."""
    keys = {k: v for k, v in KEYS.items() if base.method not in ("llm-int8", "bnb-nf4") or k in BNB_KEYS}
    for param, default in base.params.items():
        keys[param] = (f"params.{param}", _param_parser(param, default), type(default).__name__)
    return keys


def parse_items(
    spec: str,
    parsers: dict[str, Callable[[str], Any]],
    where: str,
    owner: str,
    keys_text: str,
    noun: str = "key",
    item_word: str = "",
) -> dict[str, tuple[str, Any]]:
    """``"a=1,b=2"`` -> {key: (value text as given, parsed value)}: the ``key=value,…`` syntax every override list
    shares (weight schemes here, KV-cache schemes in ``kvschemes``), with its one-line UserErrors."""
    out: dict[str, tuple[str, Any]] = {}
    for item in spec.split(","):
        key, sep, text = (part.strip().lower() for part in item.partition("="))
        if not sep or not key or not text:
            raise UserError(f"{where}: {item_word}{item.strip()!r} is not key=value; {keys_text}")
        if key not in parsers:
            raise UserError(
                f"{where}: unknown {noun} {key!r}{did_you_mean(key, parsers)} for {owner}; {keys_text}"
            )
        if key in out:
            raise UserError(f"{where}: {noun} {key!r} is given twice")
        try:
            out[key] = (text, parsers[key](text))
        except ValueError as e:
            raise UserError(f"{where}: {key}={text!r} is not valid; {key} takes {e}") from None
    return out


# KV-cache options a user may write into a weight scheme (QuaRot's kv_rotate): where they belong instead
KV_KEYS = {
    "kv_rotate": "--kv-rotate (or rotate=true in --kv-scheme) with --kv-bits",
    "kv_bits": "--kv-bits",
    "kv": "--kv-bits and --kv-scheme",
}


def parse_overrides(spec: str, base: Any, full: str) -> dict[str, tuple[str, Any]]:
    """``"w=4,a=4"`` -> {key: (value text as given, parsed value)}; a one-line UserError on any bad item."""
    keys = _valid_keys(base)
    valid = ", ".join(f"{k} ({v[2]})" for k, v in keys.items())
    parsers = {k: v[1] for k, v in keys.items()}
    where, keys_text = f"scheme {full!r}", f"valid keys: {valid}"
    for item in spec.split(","):
        key = item.partition("=")[0].strip().lower()
        if key in KV_KEYS:  # the cache is configured apart from the weights: say where, not only "unknown"
            raise UserError(
                f"{where}: {key} is a KV-cache option, not a weight scheme's; give {KV_KEYS[key]}"
            )
    return parse_items(spec, parsers, where, base.name, keys_text, "override key", "override ")


def _updates(base: Any, parsed: dict[str, tuple[str, Any]]) -> dict[str, dict[str, Any]]:
    """Per key, the fields it sets (static=true on a per-token activation also sets per-tensor, see docstring)."""
    updates: dict[str, dict[str, Any]] = {}
    algo = parsed.get("algo", ("", base.algo))[1]
    # the algorithm's settings start from its defaults when algo= changes it, else from the base's
    algo_params = base.algo_params if algo == base.algo else algo_defaults(algo)
    for key, (_, value) in parsed.items():
        field = _valid_keys(base)[key][0]
        if field.startswith("params."):
            updates[key] = {"params": {**base.params, field.split(".", 1)[1]: value}}
        elif field.startswith("algo_params."):
            updates[key] = {"algo_params": {**algo_params, field.split(".", 1)[1]: value}}
        elif key == "algo":
            updates[key] = {"algo": value, "algo_params": {}}  # merged with the settings given beside it
        else:
            updates[key] = {field: value}
    static_on = parsed.get("static", ("", False))[1]
    if static_on and "agran" not in parsed and isinstance(base.act_granularity, PerToken):
        updates["static"]["act_granularity"] = PerTensor()
    return updates


def _canonical_value(text: str, value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if value is None:
        return "none"
    if isinstance(value, PerAxis) and value.axis == 0:
        return "none"
    if isinstance(value, PerGroup):
        return str(value.group_size)
    if isinstance(value, float):
        return f"{value:g}"
    return str(value) if isinstance(value, int) else text


def apply_overrides(base: Any, spec: str, full: str | None = None) -> Any:
    """``base`` (a QuantScheme) with the overrides in ``spec`` applied; ``base`` itself when nothing changes."""
    full = full or f"{base.name}:{spec}"
    if not spec.strip():
        raise UserError(f"scheme {full!r}: nothing after ':'; give overrides as {SYNTAX}")
    parsed = parse_overrides(spec, base, full)
    updates = _updates(base, parsed)
    algo = parsed.get("algo", ("", base.algo))[1]
    start = {**algo_defaults(algo), **(base.algo_params if algo == base.algo else {})}

    def differs(key: str, f: str, v: Any) -> bool:
        if f == "algo_params":  # one setting: changed when it differs from the algorithm's (base's) value
            name = _valid_keys(base)[key][0].split(".", 1)[1] if key != "algo" else None
            return name is not None and start.get(name) != v[name]
        return getattr(base, f) != v

    changed = {
        key: fields for key, fields in updates.items() if any(differs(key, f, v) for f, v in fields.items())
    }
    if not changed:
        return base
    merged: dict[str, Any] = {}
    for key in parsed:  # in the order given; params updates merge
        for f, v in changed.get(key, {}).items():
            merged[f] = {**merged.get(f, {}), **v} if f in ("params", "algo_params") else v
    if "params" in merged:
        merged["params"] = {**base.params, **merged["params"]}
    items = sorted(f"{k}={_canonical_value(parsed[k][0], parsed[k][1])}" for k in changed)
    name = f"{base.name}:{','.join(items)}"
    description = f"{base.description} — overridden: {', '.join(items)}"
    return dataclasses.replace(base, name=name, description=description, **merged)
