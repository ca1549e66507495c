"""Quantisation schemes: frozen, JSON-serialisable values, registered by name (``SCHEMES``).

A scheme says what is quantised and how; ``apply.quantize(model, scheme)`` does it. Which tensors share a scale is
a granularity value inside the scheme (``granularity.py``), never a code path.

Conventions every scheme shares (and every result records, since ``to_dict()`` is written into it):

- Only linear layers (attention and MLP projections) are quantised; embeddings, norms and softmax stay float.
- The LM head stays float unless ``quantize_lm_head=True``: it is often tied to the input embedding, and the paper
  quantises only attention and MLP linears. ``dataclasses.replace(scheme, quantize_lm_head=True)`` switches it on.
- Activations (a linear's input) and outputs are quantised dynamically, and no scale is shared across the
  sequences of a batch: a per-tensor activation scale is computed per sequence (per batch element over (T, C)),
  so results do not depend on how evaluation windows are batched (``granularity.per_sequence``).
- ``absmax-fine``: the paper writes "per-channel" for activations; the standard reading — and our default — is
  per token (one scale per row, as in LLM.int8's vector-wise and SmoothQuant's per-token). The literal reading,
  one scale per input channel (per sequence), is ``absmax-fine-perchannel`` (fake mode only: a scale along the
  reduction dimension cannot be factored out of an integer matmul).
- ``smoothquant``: α = 0.5 smoothing calibrated on token windows, then int8 absmax with per-tensor weights and
  dynamic per-tensor (per-sequence) activations — the SmoothQuant paper's "O2" setting (its O1 uses per-token
  activations, O3 static per-tensor scales). The smoothing factor is applied inside each layer (``fake.py``).
- ``hadamard-*``: a seeded randomised Hadamard rotation of each linear's input and weight rows (QuaRot-style,
  without fusing the rotation into the residual stream), then round-to-nearest with the named scheme.
- ``llm-int8`` and ``bnb-nf4`` have no fake emulation: both modes run bitsandbytes' own layers.
- ``gguf:<type>`` (``gguf:q4_k_m``, ``gguf:q8_0``, … ``qbench.quant.gguf_types``): llama.cpp's own file types,
  quantised and run by llama.cpp in either mode (``qbench.quant.llamacpp``); their bit and block fields state the
  type's nominal arithmetic (8-bit activation blocks: the CPU's ``vec_dot_type``), the file's tensor types are in
  each record's ``artifact``. They take no overrides; ``--scheme gguf`` names them all.
- ``gguf:<f32|f16|bf16>:<key>=<type>,…`` (``gguf:f16:ffn_down=q6_k,attn_q=q4_0``): a mixed file — the named
  tensors (a kind in every block, ``blk.N``, ``blk.N.<kind>``, ``token_embd``, ``output``) in the named ggml
  types, written by llama.cpp's own per-tensor quantiser, every other tensor in the float base; run by llama.cpp
  (``qbench plan`` writes its plans this way).
- ``zeropoint-int{4,3,2}-g{128,64,32}``: grouped weight-only round-to-nearest, one scale and zero point per g input
  channels of each output channel; a group at least as long as a layer's row is one group per row (per channel),
  a group that does not divide it is an error (``QuantScheme.weight_granularity_for``).
- Any scheme takes overrides, ``NAME:key=value,…`` (``overrides.py``): ``get_scheme("absmax-coarse:w=4,a=4,o=4")``.
- ``static=True``: activation and output scales calibrated once on ``calib_windows`` train windows
  (``static.py``, ``calibrate.py``) instead of per sequence.
- ``format`` (default ``"int"``): the number format of quantised weights and activations. ``fp8-e4m3[-rowwise]``,
  ``fp8-e5m2[-rowwise]``, ``mxfp8``, ``mxfp6``, ``mxfp4``, ``nvfp4`` (NVIDIA's recipe) and
  ``nvfp4-torchao`` (torchao's block scales, floored at 2^−6) use float formats (``formats.py``: the
  exact definitions and spec sections), fake mode only; MX/NVFP4 blocks are the scheme's ``PerGroup`` (32 / 16)
  along the input dimension of both the weight and the activation, as in torchao's MX and NVFP4 recipes.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

from models.errors import UserError, unknown_choice
from models.registry import Registry
from qbench.quant.format_specs import FORMATS, INT, check_bits, get_format
from qbench.quant.gguf_types import GGUF_PREFIX, GGUF_TYPES, check_type, scheme_name
from qbench.quant.granularity import (
    Granularity,
    PerAxis,
    PerGroup,
    PerTensor,
    PerToken,
    granularity_from_dict,
    is_static_granularity,
    unit,
)
from qbench.quant.overrides import _ALGO_PARAMS, ALGOS, algo_defaults, apply_overrides  # noqa: F401

METHODS = ("rtn", "llm-int8", "bnb-nf4", "smoothquant", "hadamard", "gguf")
BNB_METHODS = ("llm-int8", "bnb-nf4")  # run by bitsandbytes in either mode: no fake emulation
_METHOD_PARAMS = {
    "rtn": {},
    "llm-int8": {"threshold": 6.0},
    "bnb-nf4": {"blocksize": 64},
    "smoothquant": {"alpha": 0.5},
    "hadamard": {"seed": 0},
    "gguf": {"type": "F32"},  # llama.cpp's file type (qbench.quant.gguf_types)
}
# stated only where given, so records written before they existed keep their identity: a mixed GGUF's tensor
# types (``gguf:f16:ffn_down=q6_k``, :func:`mixed_gguf_scheme`)
_OPTIONAL_PARAMS = {"gguf": {"tensors"}}
_PER_CHANNEL, _PER_TOKEN, _PER_TENSOR = PerAxis(0), PerToken(), PerTensor()  # immutable defaults


def check_static(scheme: Any) -> None:
    """Validate a scheme's static/calibration fields (``static.py`` defines static scales); torch-free, as every
    check run when a scheme is built, so listing schemes imports no framework."""
    name = scheme.name
    if not isinstance(scheme.static, bool):
        raise UserError(f"scheme {name!r}: static must be true or false, got {scheme.static!r}")
    n = scheme.calib_windows
    if n is not None and (isinstance(n, bool) or not isinstance(n, int) or n < 1):
        raise UserError(f"scheme {name!r}: calib_windows must be a positive integer, got {n!r}")
    seed = scheme.calib_seed
    if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int) or seed < 0):
        raise UserError(f"scheme {name!r}: calib_seed must be a non-negative integer or none, got {seed!r}")
    if not scheme.static:
        return
    if scheme.method in ("llm-int8", "bnb-nf4"):
        raise UserError(
            f"scheme {name!r}: {scheme.method} quantises activations itself; static=true does not apply"
        )
    if scheme.act_bits is None and scheme.out_bits is None:
        raise UserError(f"scheme {name!r}: static=true needs quantised activations or outputs (a=… or o=…)")
    for role, bits, granularity in (
        ("activation", scheme.act_bits, scheme.act_granularity),
        ("output", scheme.out_bits, scheme.out_granularity),
    ):
        if bits is not None and not is_static_granularity(granularity):
            raise UserError(
                f"scheme {name!r}: static {role} scales are per tensor or per channel, not {granularity.label}"
            )


@dataclass(frozen=True)
class QuantScheme:
    """What to quantise and how. ``*_bits=None`` leaves that tensor in float.

    Weights are (out, in); ``weight_granularity=PerAxis(0)`` is one scale per output channel. Activation and
    output granularities are applied per sequence (module docstring). ``params`` holds the method's settings
    (SmoothQuant ``alpha``, LLM.int8 ``threshold``, Hadamard ``seed``, NF4 ``blocksize``); missing ones take the
    method's defaults.
    """

    name: str
    description: str = ""
    method: str = "rtn"
    weight_bits: int | None = 8
    weight_symmetric: bool = True
    weight_granularity: Granularity = _PER_CHANNEL
    act_bits: int | None = None
    act_symmetric: bool = True
    act_granularity: Granularity = _PER_TOKEN
    out_bits: int | None = None
    out_symmetric: bool = True
    out_granularity: Granularity = _PER_TENSOR
    params: dict[str, Any] = field(default_factory=dict)
    quantize_lm_head: bool = False
    static: bool = False  # activation/output scales calibrated once (``static.py``) instead of per sequence
    # calibration windows of the train split; None: the default of what calibrates (:data:`CALIB_WINDOWS`)
    calib_windows: int | None = None
    calib_seed: int | None = None  # None: the first calib_windows windows; an int: a seeded sample of them
    format: str = INT  # number format of quantised weights/activations: "int" or a ``formats.FORMATS`` name
    algo: str = "rtn"  # how weights are rounded: ``ALGOS``; gptq calibrates on calib_windows train windows
    algo_params: dict[str, Any] = field(default_factory=dict)  # the algorithm's settings (``_ALGO_PARAMS``)
    # a transform of the whole float model before quantising: "quarot" (qbench.quant.quarot: norms folded, the
    # residual stream rotated, an online Hadamard before o_proj and down_proj); "none" quantises the model as is
    rotate: str = "none"
    # QuaRot's clipping (qbench.quant.clip): the dynamic activation range scaled by act_clip, and the weight range
    # searched (weight_clip "mse"); None: the default, QuaRot's own for rotate=quarot (0.9 and mse on integer
    # grids), none otherwise (:attr:`act_clip_ratio`, :attr:`weight_clip_rule`)
    act_clip: float | None = None
    weight_clip: str | None = None

    def __post_init__(self) -> None:
        if self.method not in METHODS:
            raise unknown_choice("quantisation method", self.method, METHODS)
        for bits in (self.weight_bits, self.act_bits, self.out_bits):
            if bits is not None:
                check_bits(bits)
        check_static(self)
        _check_format(self)
        known = set(_METHOD_PARAMS[self.method]) | _OPTIONAL_PARAMS.get(self.method, set())
        unknown = set(self.params) - known
        if unknown:
            raise UserError(
                f"scheme {self.name!r}: unknown {self.method} parameter(s) {sorted(unknown)}; "
                f"known: {sorted(known) or 'none'}"
            )
        object.__setattr__(self, "params", {**_METHOD_PARAMS[self.method], **self.params})
        _check_algo(self)
        object.__setattr__(self, "algo_params", {**_ALGO_PARAMS[self.algo], **self.algo_params})
        if self.calib_windows == CALIB_WINDOWS.get(self.algo):  # the default, stated: the same scheme
            object.__setattr__(self, "calib_windows", None)
        _check_rotate(self)
        _check_clip(self)
        if self.act_clip is not None and self.act_clip == self._default_act_clip():
            object.__setattr__(self, "act_clip", None)
        if self.weight_clip is not None and self.weight_clip == self._default_weight_clip():
            object.__setattr__(self, "weight_clip", None)

    def _default_act_clip(self) -> float:
        quarot = (
            self.rotate == "quarot" and self.format == INT and self.act_bits is not None and not self.static
        )
        return QUAROT_ACT_CLIP if quarot else 1.0

    def _default_weight_clip(self) -> str:
        quarot = self.rotate == "quarot" and self.format == INT and self.weight_bits is not None
        return "mse" if quarot and self.algo in ("rtn", "gptq") else "none"

    @property
    def act_clip_ratio(self) -> float:
        """The dynamic activation range's scale factor (``qbench.quant.clip``): 1 is no clipping."""
        return self.act_clip if self.act_clip is not None else self._default_act_clip()

    @property
    def weight_clip_rule(self) -> str:
        """How the weight range is chosen: "none" (min/max) or "mse" (``clip.mse_weight_qparams``)."""
        return self.weight_clip if self.weight_clip is not None else self._default_weight_clip()

    def __hash__(self) -> int:  # params is a dict; hash its items so schemes can key caches
        return hash(
            (
                self.name,
                self.method,
                tuple(sorted(self.params.items())),
                self.algo,
                tuple(sorted(self.algo_params.items())),
                self.rotate,
                self.act_clip,
                self.weight_clip,
                self.label,
            )
        )

    def param(self, key: str) -> Any:
        return self.params[key]

    @property
    def label(self) -> str:
        """A short label for tables, e.g. ``W8A8-tensor+out``, ``W8A8-channel/token``, ``W4-channel-zp``."""
        if self.format != INT:
            return _format_label(self)
        if self.method == "gguf":  # llama.cpp's own name says what the file holds (a mix, not one grid)
            mixed = "-mix" if self.params.get("tensors") else ""
            return f"llama.cpp-{self.param('type')}{mixed}"
        weights = self.weight_bits is not None
        bits = (f"W{self.weight_bits}" if weights else "") + (f"A{self.act_bits}" if self.act_bits else "")
        if self.method in BNB_METHODS:
            return f"{bits}-{self.method}"
        grans = [_word(self.weight_granularity, "weight")] if weights else []
        if self.act_bits and _word(self.act_granularity, "act") not in grans:
            grans.append(_word(self.act_granularity, "act"))
        label = "-".join(p for p in (bits or "float", "/".join(grans)) if p)
        label += "" if self.weight_symmetric or not weights else "-zp"
        label += f"+out{self.out_bits if self.out_bits != self.act_bits else ''}" if self.out_bits else ""
        if self.method == "smoothquant":
            label += f"-smooth{self.param('alpha'):g}"
        return (
            label
            + ("-hadamard" if self.method == "hadamard" else "")
            + ("" if self.rotate == "none" else f"-{self.rotate}")
            + ("" if self.algo == "rtn" else f"-{self.algo}")
            + ("-static" if self.static else "")
            + ("+head" if self.quantize_lm_head else "")
        )

    def weight_granularity_for(self, in_features: int) -> Granularity:
        """The weight granularity for a layer with ``in_features`` inputs: a group at least as long as the row is
        one group per row (= per output channel). A group that does not divide the row (Llama's 688-wide MLP
        with g = 128) leaves a shorter last group with its own scale (``fake.fake_quantize_weight``)."""
        g = self.weight_granularity
        if isinstance(g, PerGroup) and g.group_size >= in_features:
            return _PER_CHANNEL
        return g

    @property
    def calib_count(self) -> int:
        """Calibration windows: ``calib_windows``, else :data:`CALIB_WINDOWS` for the algorithm (GPTQ and AWQ: 128,
        as their reference code draws; SmoothQuant and static scales: 8)."""
        if self.calib_windows is not None:
            return self.calib_windows
        return CALIB_WINDOWS.get(self.algo, CALIB_WINDOWS["rtn"])

    def to_dict(self) -> dict[str, Any]:
        d = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        d["calib_windows"] = self.calib_count  # the count in force, as every record before the default moved
        del (
            d["act_clip"],
            d["weight_clip"],
        )  # stated only where they clip: earlier records keep their identity
        if self.act_clip_ratio != 1.0:
            d["act_clip"] = self.act_clip_ratio
        if self.weight_clip_rule != "none":
            d["weight_clip"] = self.weight_clip_rule
        for key in ("weight_granularity", "act_granularity", "out_granularity"):
            d[key] = d[key].to_dict()
        d["params"] = dict(self.params)
        if self.algo == "rtn":  # today's rounding: records written before algorithms existed stay identical
            del d["algo"], d["algo_params"]
        else:
            d["algo_params"] = dict(self.algo_params)
        if self.rotate == "none":  # likewise: records from before rotations keep their identity
            del d["rotate"]
        d["label"] = self.label  # informative only; from_dict ignores it
        if (
            self.algo == "gptq"
            and isinstance(self.weight_granularity, PerGroup)
            and not self.algo_params["act_order"]
        ):
            # GPTQ's group grid changed to the reference code's rule (qbench.quant.gptq): a grouped GPTQ record made
            # under the earlier rule has no such field, so it is recomputed, not reused. Derived; from_dict ignores it.
            d["algo_recipe"] = GPTQ_GROUP_RULE
        if self.format != INT and FORMATS[self.format].recipe:
            # The block-scale rule, in every record: nvfp4's changed (the E4M3 floor dropped, NVIDIA's recipe), so a
            # record made under the old rule has none and is recomputed, not reused. Derived; from_dict ignores it.
            d["format_recipe"] = FORMATS[self.format].recipe
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> QuantScheme:
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = set(d) - names - {"label", "format_recipe", "algo_recipe"}
        if unknown:
            raise UserError(f"unknown quantisation scheme field(s) {sorted(unknown)}; known: {sorted(names)}")
        kwargs = {k: v for k, v in d.items() if k in names}
        for key in ("weight_granularity", "act_granularity", "out_granularity"):
            if isinstance(kwargs.get(key), dict):
                kwargs[key] = granularity_from_dict(kwargs[key])
        return cls(**kwargs)


# Calibration windows by rounding algorithm when a scheme names none (``calib=``): GPTQ's and AWQ's reference code
# and llm-compressor draw 128 segments (of 2,048 tokens: qbench.eval.harness.CALIB_WINDOW); SmoothQuant and static
# scales keep the 8 they always took.
CALIB_WINDOWS = {"rtn": 8, "gptq": 128, "awq": 128}

ROTATIONS = ("none", "quarot")
# How GPTQ chooses a group's grid (qbench.quant.gptq), in every grouped GPTQ record
GPTQ_GROUP_RULE = "group grid from the weights at the start of its lazy block (IST-DASLab gptq.py)"


def _check_rotate(s: QuantScheme) -> None:
    """``rotate=quarot`` rotates the float model before an integer or MX/NV round-to-nearest or GPTQ rounding;
    the methods that transform each layer their own way (Hadamard, SmoothQuant) or quantise in bitsandbytes, and
    AWQ's in-layer scales, do not compose with it."""
    if s.rotate not in ROTATIONS:
        raise unknown_choice("model rotation (rotate)", s.rotate, ROTATIONS)
    if s.rotate == "none":
        return
    if s.method != "rtn":
        raise UserError(
            f"scheme {s.name!r}: rotate={s.rotate} applies to the plain round-to-nearest schemes, not to method "
            f"{s.method!r} (it transforms the layers its own way)"
        )
    if s.algo == "awq":
        raise UserError(f"scheme {s.name!r}: rotate={s.rotate} composes with algo=rtn or gptq, not awq")


WEIGHT_CLIPS = ("none", "mse")
QUAROT_ACT_CLIP = 0.9  # QuaRot's activation clip ratio in its runs (a_clip_ratio; qbench.quant.clip)


def _check_clip(s: QuantScheme) -> None:
    """``aclip`` clips dynamic integer activations; ``wclip=mse`` searches integer weight grids rounded to nearest
    or by GPTQ (AWQ searches its own clipping; bitsandbytes and the float formats fix their own ranges)."""
    where = f"scheme {s.name!r}"
    if s.act_clip is not None:
        if isinstance(s.act_clip, bool) or not isinstance(s.act_clip, int | float) or not 0 < s.act_clip <= 1:
            raise UserError(f"{where}: aclip must be a number in (0, 1], got {s.act_clip!r}")
        if s.act_clip != 1 and (s.act_bits is None or s.static or s.format != INT or s.method in BNB_METHODS):
            raise UserError(
                f"{where}: aclip={s.act_clip:g} clips dynamic integer activations; this scheme has "
                + ("none (a=none)" if s.act_bits is None else "static or non-integer ones")
            )
    if s.weight_clip is not None:
        if s.weight_clip not in WEIGHT_CLIPS:
            raise unknown_choice("weight clipping (wclip)", s.weight_clip, WEIGHT_CLIPS)
        if s.weight_clip == "mse" and (
            s.weight_bits is None or s.format != INT or s.method in BNB_METHODS or s.algo == "awq"
        ):
            raise UserError(
                f"{where}: wclip=mse searches integer weight grids rounded to nearest or by GPTQ; not with "
                + ("algo=awq (its own clipping search)" if s.algo == "awq" else "this scheme's weights")
            )


def _check_transform_applies(s: QuantScheme) -> QuantScheme:
    """A model-wide rotation or a method's per-layer transform exists to make quantisation kinder; with nothing
    quantised (w, a and o all none) the cell would be the float model labelled with a transform that never ran."""
    if s.weight_bits is not None or s.act_bits is not None or s.out_bits is not None or s.method == "gguf":
        return s  # a gguf:f32 cell runs llama.cpp's float kernels: what it measures is that path
    applied = [f"rotate={s.rotate}"] if s.rotate != "none" else []
    applied += [f"method={s.method}"] if s.method != "rtn" else []
    if applied:
        raise UserError(
            f"scheme {s.name!r}: {' and '.join(applied)} would not apply, since w=none, a=none and o=none "
            "quantise nothing; give w=, a= or o= (the float model is the 'fp' scheme)"
        )
    return s


def _check_algo(s: QuantScheme) -> None:
    """GPTQ rounds integer weights of any width and granularity qbench's grids have; the bitsandbytes layers
    quantise themselves and the float formats have no GPTQ grid here, so both are refused in one line."""
    if s.algo not in ALGOS:
        raise unknown_choice("weight rounding algorithm (algo)", s.algo, ALGOS)
    unknown = set(s.algo_params) - set(_ALGO_PARAMS[s.algo])
    if unknown:
        known = sorted(_ALGO_PARAMS[s.algo])
        owner = next((a for a in ("gptq", "awq") if set(unknown) <= set(_ALGO_PARAMS[a])), None)
        hint = f"; they are {owner} settings: add algo={owner}" if owner and owner != s.algo else ""
        raise UserError(
            f"scheme {s.name!r}: unknown {s.algo} parameter(s) {sorted(unknown)}; known: {known or 'none'}{hint}"
        )
    if s.algo == "rtn":
        return
    where = f"scheme {s.name!r} (algo={s.algo})"
    if s.method in BNB_METHODS:
        raise UserError(f"{where}: {s.method} runs bitsandbytes' own rounding; use an integer qbench scheme")
    if s.format != INT:
        raise UserError(
            f"{where}: {s.algo} rounds onto integer grids; format {s.format!r} is round-to-nearest only"
        )
    if s.algo == "awq" and s.method != "rtn":
        raise UserError(
            f"{where}: AWQ sets each layer's input scale itself; it does not combine with {s.method}"
        )
    if s.weight_bits is None:
        raise UserError(f"{where}: the weights stay float; {s.algo} has nothing to round")
    g = s.weight_granularity
    if not (isinstance(g, PerGroup | PerTensor) or (isinstance(g, PerAxis) and g.axis in (0, -2))):
        raise UserError(f"{where}: weights per channel, per tensor or per group, not {g.label}")
    params = {**_ALGO_PARAMS[s.algo], **s.algo_params}
    if s.algo == "awq":
        grid, clip = params["grid"], params["clip"]
        if isinstance(grid, bool) or not isinstance(grid, int) or grid < 2:
            raise UserError(f"{where}: grid must be an integer ≥ 2 (points of the α search), got {grid!r}")
        if not isinstance(clip, bool):
            raise UserError(f"{where}: clip must be true or false, got {clip!r}")
        return
    damp, block, act_order = params["damp"], params["block"], params["act_order"]
    if isinstance(damp, bool) or not isinstance(damp, int | float) or not 0 < damp <= 1:
        raise UserError(f"{where}: damp must be a number in (0, 1] (a fraction of mean diag H), got {damp!r}")
    if isinstance(block, bool) or not isinstance(block, int) or block < 1:
        raise UserError(f"{where}: block must be a positive integer (columns per lazy update), got {block!r}")
    if not isinstance(act_order, bool):
        raise UserError(f"{where}: act_order must be true or false, got {act_order!r}")


def _word(granularity: Granularity, role: str) -> str:
    """A scheme label's word for a granularity: :func:`~qbench.quant.granularity.unit`, except that a per-tensor
    activation reads "tensor" (labels name the setting the paper names; the scale is still per sequence)."""
    return "tensor" if isinstance(granularity, PerTensor) else unit(granularity, role)


def _check_format(s: QuantScheme) -> None:
    """A floating-point ``format`` (``formats.py``) fixes the element width, is symmetric, leaves outputs float,
    has dynamic scales, and for MX/NVFP4 needs its block as the granularity (``PerGroup``, along the input)."""
    if s.format == INT:
        return
    fmt = get_format(s.format)
    where = f"scheme {s.name!r} (format {s.format})"
    if s.method in BNB_METHODS:
        raise UserError(f"{where}: {s.method} runs bitsandbytes' own layers; its format must be {INT!r}")
    for role, bits in (("weight", s.weight_bits), ("activation", s.act_bits)):
        if bits not in (None, fmt.bits):
            raise UserError(
                f"{where}: {role} bits must be {fmt.bits} (its element width) or none, got {bits}"
            )
    if s.out_bits is not None:
        raise UserError(f"{where}: the linear's output stays float; out bits must be none, got {s.out_bits}")
    if s.static or not (s.weight_symmetric and s.act_symmetric):
        raise UserError(
            f"{where}: float formats are symmetric with dynamic scales (no static, no zero point)"
        )
    for role, g in (("weight", s.weight_granularity), ("activation", s.act_granularity)):
        if fmt.scaling != "fp8" and not isinstance(g, PerGroup):
            raise UserError(
                f"{where}: the {role} granularity must be a block along the input dimension "
                f"(a group, {fmt.block_size} in the spec), got {g.label}"
            )


def _format_label(s: QuantScheme) -> str:
    """``MXFP4``, ``NVFP4``, ``FP8-e4m3-tensor``, ``FP8-e4m3-channel/token``; ``-g16`` for a block size other than
    the spec's, ``-wonly``/``-aonly`` when activations/weights stay float."""
    fmt = FORMATS[s.format]
    roles = {"weight": s.weight_granularity} if s.weight_bits else {}
    roles.update({"act": s.act_granularity} if s.act_bits else {})
    if fmt.scaling == "fp8":
        words = dict.fromkeys(_word(g, role) for role, g in roles.items())
    else:
        words = dict.fromkeys(f"g{g.group_size}" for g in roles.values() if g.group_size != fmt.block_size)
    only = {"weight": "wonly", "act": "aonly"}[next(iter(roles))] if len(roles) == 1 else ""
    label = "-".join(p for p in (fmt.label, "/".join(words), only if roles else "float") if p)
    if s.method == "smoothquant":
        label += f"-smooth{s.param('alpha'):g}"
    return (
        label
        + ("-hadamard" if s.method == "hadamard" else "")
        + ("" if s.rotate == "none" else f"-{s.rotate}")
        + ("+head" if s.quantize_lm_head else "")
    )


SCHEMES: Registry[QuantScheme] = Registry("quantisation scheme")


def _register(scheme: QuantScheme, aliases: tuple[str, ...] = ()) -> QuantScheme:
    return SCHEMES.register(scheme.name, scheme, scheme.description, aliases)


_INT8_FINE = dict(weight_bits=8, weight_granularity=PerAxis(0), act_bits=8, act_granularity=PerToken())
_INT8_TENSOR = dict(weight_bits=8, weight_granularity=PerTensor(), act_bits=8, act_granularity=PerTensor())
_INT8_COARSE = dict(_INT8_TENSOR, out_bits=8, out_granularity=PerTensor())
_INT4_ZP = dict(weight_bits=4, weight_symmetric=False, weight_granularity=PerAxis(0), act_bits=None)

_register(
    QuantScheme(
        "absmax-fine", "int8 absmax: W per output channel, A per token (default reading)", **_INT8_FINE
    ),
    aliases=("fine",),
)
_register(
    QuantScheme(
        "absmax-fine-perchannel",
        "int8 absmax: W per output channel, A per input channel "
        "(the paper's literal 'per-channel'; fake mode only)",
        **dict(_INT8_FINE, act_granularity=PerAxis(-1)),
    )
)
_register(
    QuantScheme("absmax-moderate", "int8 absmax: W per tensor, A per tensor (per sequence)", **_INT8_TENSOR),
    aliases=("moderate",),
)
_register(
    QuantScheme(
        "absmax-coarse", "int8 absmax: W, A (per sequence) and the linear's output per tensor", **_INT8_COARSE
    ),
    aliases=("coarse",),
)
_register(
    QuantScheme(
        "zeropoint-int4",
        "int4 zeropoint (asymmetric) weights per output channel, float activations",
        **_INT4_ZP,
    ),
    aliases=("int4",),
)
# Grouped weight-only round-to-nearest (GPTQ/AWQ-style storage, without their error correction): one scale and zero
# point per `g` consecutive input channels of each output channel. `NAME:sym=true` gives the absmax variant.
for _bits, _group in ((4, 128), (4, 64), (4, 32), (3, 128), (2, 64)):
    _register(
        QuantScheme(
            f"zeropoint-int{_bits}-g{_group}",
            f"int{_bits} zeropoint (asymmetric) weights per group of {_group} input channels, float activations",
            **dict(_INT4_ZP, weight_bits=_bits, weight_granularity=PerGroup(_group)),
        ),
        aliases=(f"int{_bits}-g{_group}",),
    )
del _bits, _group
_register(
    QuantScheme(
        "llm-int8",
        "LLM.int8 (bitsandbytes Linear8bitLt): int8 vector-wise, fp16 outlier columns above threshold 6.0",
        method="llm-int8",
        weight_bits=8,
        act_bits=8,
    ),
    aliases=("llm.int8", "bnb-int8"),
)
_register(
    QuantScheme(
        "bnb-nf4",
        "bitsandbytes NF4 weights (4-bit normal-float codebook, absmax per block of 64), float activations",
        method="bnb-nf4",
        weight_bits=4,
        weight_granularity=PerGroup(64),
    ),
    aliases=("nf4",),
)
_register(
    QuantScheme(
        "smoothquant",
        "SmoothQuant: migrate activation scale into weights (alpha 0.5, calibrated), "
        "then int8 absmax W and A per tensor",
        method="smoothquant",
        **_INT8_TENSOR,
    )
)
_register(
    QuantScheme(
        "hadamard-absmax-coarse",
        "random Hadamard rotation of each linear's input (QuaRot-style), then absmax-coarse",
        method="hadamard",
        **_INT8_COARSE,
    )
)
_register(
    QuantScheme(
        "hadamard-zeropoint-int4",
        "random Hadamard rotation of each linear's input (QuaRot-style), then zeropoint-int4",
        method="hadamard",
        **_INT4_ZP,
    )
)

# W4A8: int4 absmax weights × int8 per-token activations in integer arithmetic — how int4 models are deployed on
# CPUs (llama.cpp's Q4 weight blocks × Q8 activations); the real kernel is kernels/w4a8.py. The same as
# `absmax-fine:w=4` (and `:group=32`), registered so that grids, `qbench speed` and `qbench ls` list them.
_register(
    QuantScheme(
        "absmax-w4a8",
        "int4 absmax weights per output channel, int8 absmax activations per token (integer dot products)",
        **dict(_INT8_FINE, weight_bits=4),
    ),
    aliases=("w4a8",),
)
_register(
    QuantScheme(
        "absmax-w4a8-g32",
        "int4 absmax weights per group of 32 input channels (llama.cpp Q4_0-style blocks), int8 activations "
        "per token",
        **dict(_INT8_FINE, weight_bits=4, weight_granularity=PerGroup(32)),
    ),
    aliases=("w4a8-g32",),
)
# Zero-point W4A8: llama.cpp's Q4_1 arithmetic (codes u in [0, 15], one scale and zero point per block of 32,
# ŵ = s · (u − z); int8 activations), the matched-bits counterpart of Q4_1 in `qbench speed --llama-cpp`.
_register(
    QuantScheme(
        "zeropoint-w4a8",
        "int4 zeropoint (asymmetric) weights per output channel, int8 absmax activations per token "
        "(integer dot products)",
        **dict(_INT8_FINE, weight_bits=4, weight_symmetric=False),
    ),
    aliases=("w4a8-zp",),
)
_register(
    QuantScheme(
        "zeropoint-w4a8-g32",
        "int4 zeropoint weights per group of 32 input channels (llama.cpp Q4_1-style blocks), int8 activations "
        "per token",
        **dict(_INT8_FINE, weight_bits=4, weight_symmetric=False, weight_granularity=PerGroup(32)),
    ),
    aliases=("w4a8-zp-g32",),
)

# Floating-point formats, fake mode only (formats.py holds the exact definitions and the spec sections).
for _fmt in ("fp8-e4m3", "fp8-e5m2"):
    _register(
        QuantScheme(
            _fmt,
            f"{FORMATS[_fmt].description}: W and A per tensor (A per sequence); fake mode only",
            format=_fmt,
            **dict(_INT8_TENSOR),
        )
    )
    _register(
        QuantScheme(
            f"{_fmt}-rowwise",
            f"{FORMATS[_fmt].description}: W per output channel, A per token; fake mode only",
            format=_fmt,
            **dict(_INT8_FINE),
        )
    )
for _fmt in ("mxfp8", "mxfp6", "mxfp4", "nvfp4", "nvfp4-torchao"):
    _block = PerGroup(FORMATS[_fmt].block_size)
    _register(
        QuantScheme(
            _fmt,
            f"{FORMATS[_fmt].description}, W and A blocked along the input dim; fake mode only",
            format=_fmt,
            weight_bits=FORMATS[_fmt].bits,
            weight_granularity=_block,
            act_bits=FORMATS[_fmt].bits,
            act_granularity=_block,
        )
    )
del _fmt, _block

# llama.cpp's file types, run by llama.cpp (qbench.quant.llamacpp): gguf:q4_k_m, gguf:q8_0, …
for _name, _t in GGUF_TYPES.items():
    _register(
        QuantScheme(
            scheme_name(_name),
            f"llama.cpp {_name}: {_t.description}; quantised and run by llama.cpp",
            method="gguf",
            weight_bits=_t.bits,
            weight_symmetric=not _t.minimum,
            weight_granularity=PerGroup(_t.block) if _t.block else _PER_CHANNEL,
            act_bits=8 if _t.act_block else None,
            act_granularity=PerGroup(_t.act_block) if _t.act_block else _PER_TOKEN,
            params={"type": _name},
            quantize_lm_head=_t.bits is not None,  # llama.cpp quantises the head too (its type in the record)
        )
    )
del _name, _t
GGUF_SCHEMES = tuple(scheme_name(t) for t in GGUF_TYPES)

PAPER_SCHEMES = ("absmax-fine", "absmax-moderate", "absmax-coarse", "zeropoint-int4")


def mixed_gguf_scheme(base: str, spec: str) -> QuantScheme:
    """``gguf:<base>:<key>=<type>,…``: a GGUF whose named tensors take their own ggml types (llama.cpp's
    per-tensor quantiser) and every other tensor the float ``base`` (F32, F16 or BF16); the name is canonical
    (keys sorted, lower case), so one mix is one cell whatever order it was written in."""
    from qbench.quant.gguf_types import FLOAT_BASES, parse_tensor_spec

    base_name = base.strip().upper()
    if base_name not in FLOAT_BASES:
        raise UserError(
            f"scheme gguf:{base}:{spec}: llama.cpp's file types take no overrides (they choose each tensor's "
            f"type); a mixed file names a float base ({', '.join(FLOAT_BASES)}) and its tensors' types: "
            "gguf:f16:ffn_down=q6_k,attn_v=q8_0"
        )
    from qbench.quant.overrides import KEYS

    keys = [item.partition("=")[0].strip() for item in spec.split(",")]
    if any(k in KEYS for k in keys):  # a scheme override (head=true, w=4 …), not a tensor
        raise UserError(
            f"scheme gguf:{base}:{spec}: llama.cpp's file types take no overrides ({', '.join(k for k in keys if k in KEYS)}); "
            "a mixed file names tensors and their types: gguf:f16:output=q8_0,ffn_down=q6_k"
        )
    tensors = parse_tensor_spec(spec)
    name = f"{GGUF_PREFIX}{base_name.lower()}:" + ",".join(f"{k}={t.lower()}" for k, t in tensors)
    return QuantScheme(
        name,
        f"a llama.cpp file: {', '.join(f'{k} {t}' for k, t in tensors)}, every other tensor {base_name}; "
        "quantised per tensor and run by llama.cpp",
        method="gguf",
        weight_bits=None,  # one grid per tensor: the record's artifact lists them
        params={"type": base_name, "tensors": {k: t for k, t in tensors}},
        quantize_lm_head=any(k in ("output", "token_embd") for k, _ in tensors),
    )


def get_scheme(scheme: str | QuantScheme | dict[str, Any]) -> QuantScheme:
    """A registered name or alias, optionally with overrides (``"absmax-coarse:w=4,a=4,o=4"``, see
    ``overrides.py``), a ``QuantScheme``, or its ``to_dict()`` form -> ``QuantScheme``."""
    if isinstance(scheme, QuantScheme):
        return scheme
    # a scheme someone names or reads from a file is checked to apply; a QuantScheme built in code may be a
    # layer-level probe (a float layer with a Hadamard rotation equals the float layer)
    if isinstance(scheme, dict):
        return _check_transform_applies(QuantScheme.from_dict(scheme))
    if isinstance(scheme, str) and scheme.strip().lower().startswith(GGUF_PREFIX):
        rest = scheme.strip()[len(GGUF_PREFIX) :]
        base, sep, spec = rest.partition(":")
        if sep:  # a mixed file: named tensors in their own types, the rest in a float base
            return mixed_gguf_scheme(base, spec)
        if any(c in rest for c in ":,="):
            raise UserError(
                f"scheme {scheme!r}: llama.cpp's file types take no overrides (llama.cpp chooses each tensor's "
                f"type); choose one of {', '.join(GGUF_SCHEMES)}"
            )
        return SCHEMES.get(scheme_name(check_type(rest)))
    if isinstance(scheme, str):
        base, sep, spec = scheme.partition(":")
        if not sep:
            return SCHEMES.get(scheme)
        return _check_transform_applies(apply_overrides(SCHEMES.get(base.strip()), spec, scheme))
    raise UserError(
        f"a quantisation scheme must be a name, a QuantScheme or a dict, got {type(scheme).__name__}"
    )
