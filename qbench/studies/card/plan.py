"""The card's catalogue: the deployable formats, the KV rows and the budgets, each with its reason (standard
library only, so ``qbench card --help`` reads them without torch)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from models.errors import UserError, unknown_choice

PROFILE_VERSION = 3  # 2: linear_shapes (the nominal bytes of each format); 3: the KV cache geometry


DEFAULT_TOLERANCE = 1.0


LINEAR_TABLE_ROWS = 12  # linear layers in the card's table, by input crest factor (all are in card.json)


KV_KEEP_SINKS = 1  # sink protection in the KV rows: the most-attended position per layer kept float


@dataclass(frozen=True)
class Format:
    """One deployable format's row: a registered scheme (with overrides) at its standard settings."""

    label: str
    scheme: str
    note: str = ""


HADAMARD_W4A8 = "hadamard-absmax-coarse:w=4,o=none,agran=token,group=none"


# Labels say what each row quantises, as a deployment names it: W<bits>A<bits> when activations are quantised too
# (the MX and NVFP4 rows quantise both, block by block), "weight-only" when they stay float.
FORMATS: tuple[Format, ...] = (
    Format("W8A8 per-channel/per-token", "absmax-fine"),
    Format("W8A8 per-tensor", "absmax-moderate"),
    Format("W8A8 per-tensor + int8 outputs (coarse)", "absmax-coarse"),
    Format("int4 per-channel weight-only", "zeropoint-int4"),
    Format("int4 g128 weight-only", "zeropoint-int4-g128"),
    Format("W4A8 g32", "absmax-w4a8-g32"),
    Format("int3 g128 weight-only", "zeropoint-int3-g128"),
    Format("W8A8 FP8 E4M3 per-tensor", "fp8-e4m3"),
    Format("W8A8 FP8 E4M3 row-wise", "fp8-e4m3-rowwise"),
    Format("W8A8 MXFP8", "mxfp8"),
    Format("W6A6 MXFP6", "mxfp6"),
    Format("W4A4 MXFP4", "mxfp4"),
    # weight-only MXFP4 as gpt-oss ships its experts (activations in bf16): an override of the W4A4 scheme
    Format("W4 weight-only MXFP4", "mxfp4:a=none"),
    Format("W4A4 NVFP4", "nvfp4"),
    Format("W4 weight-only NVFP4", "nvfp4:a=none"),
    Format("LLM.int8", "llm-int8"),
    Format("NF4 weight-only", "bnb-nf4"),
    Format("SmoothQuant W8A8", "smoothquant"),
    Format(
        "Hadamard + W4A8",
        HADAMARD_W4A8,
        "no Hadamard W4A8 scheme is registered: hadamard-absmax-coarse overridden to int4 weights per channel, "
        "int8 activations per token, float outputs",
    ),
    # The post-training algorithm a practitioner tries first on the low-bit rows (qbench.quant.gptq): the same
    # grid and storage as the round-to-nearest row above it, the rounding (AWQ: and input scales) chosen on train
    # windows (qbench.quant.awq for AWQ).
    Format("int4 per-channel weight-only + GPTQ", "zeropoint-int4:algo=gptq"),
    Format("int4 g128 weight-only + GPTQ", "zeropoint-int4-g128:algo=gptq"),
    Format("W4A8 g32 + GPTQ", "absmax-w4a8-g32:algo=gptq"),
    Format("int3 g128 weight-only + GPTQ", "zeropoint-int3-g128:algo=gptq"),
    Format("int4 per-channel weight-only + AWQ", "zeropoint-int4:algo=awq"),
    Format("int4 g128 weight-only + AWQ", "zeropoint-int4-g128:algo=awq"),
    # QuaRot (qbench.quant.quarot): the residual stream rotated before round-to-nearest, for the 4-bit
    # activation formats where outliers hurt most; a model it cannot rotate (LayerNorm, GPT-2) records the refusal
    Format("W4A8 g32 + QuaRot", "absmax-w4a8-g32:rotate=quarot"),
    Format("W4A4 MXFP4 + QuaRot", "mxfp4:rotate=quarot"),
)


QUICK_FORMATS = (
    "absmax-fine",
    "absmax-moderate",
    "absmax-coarse",
    "zeropoint-int4",
    "zeropoint-int4-g128",
    "absmax-w4a8-g32",
    "fp8-e4m3",
    "mxfp4",
    "mxfp4:a=none",
    "nvfp4",
    "nvfp4:a=none",
)


@dataclass(frozen=True)
class KVRow:
    """One KV-cache row of a budget: ``scheme`` a KV scheme name (``"kivi"``: KIVI as deployed at the card's KV
    window, ``qbench.studies.sweep.default_kv_scheme``), its ``bits``, and ``keep_sinks`` positions kept float."""

    scheme: str
    bits: int
    keep_sinks: int = 0


def budget_kv_rows(kivi: tuple[int, ...], kivi_sinks: tuple[int, ...], per_token: tuple[int, ...]) -> tuple:
    """KIVI (keys per channel, values per token: the scheme of the KIVI paper and Hugging Face's quantised
    cache), llama.cpp-style per-token blocks (``-ctk q4_0``) and FP8 E4M3 (vLLM's ``kv_cache_dtype=fp8``): the
    three ways a KV cache is deployed today, side by side."""
    return (
        *(KVRow("kivi", b) for b in kivi),
        *(KVRow("kivi", b, KV_KEEP_SINKS) for b in kivi_sinks),
        *(KVRow("per-token", b) for b in per_token),
        KVRow("fp8-e4m3", 8),
    )


# A KV row is read at a deployed context: windows of at least this many tokens (the model's context when shorter).
# On short windows most reads hit KIVI's float residual and the row measures the residual, not the quantiser.
KV_MIN_WINDOW = 1024


@dataclass(frozen=True)
class Budget:
    """What a card measures; ``--help`` and docs/card.md state these."""

    name: str
    tokens: int
    formats: tuple[str, ...]  # scheme names of FORMATS, in FORMATS' order
    kv_rows: tuple[KVRow, ...]
    sweep_families: tuple[str, ...] = ()
    sweep_axes: tuple[str, ...] = ()
    sweep_bits: tuple[int, ...] = ()
    sensitivity_by: str = "type"
    speed: bool = False
    # the repair's backward pass (dropping each kept unit that is not needed); quick stops after the forward pass
    repair_minimise: bool = True
    # formats a repair is tried on, in turn, until one pays (within and smaller than what already passes)
    repair_candidates: int = 1
    # calibration tokens of the GPTQ/AWQ rows (``--calib-tokens`` overrides); None: each scheme's own (128 windows
    # of min(2048, context) tokens). Sized for the budget's time: sequential GPTQ on 32,768 tokens took 4.6 min on
    # a 135M model on 2 cores, the default's 262,144 eight times as long (results/algorithms/calibration/)
    calib_tokens: int | None = None
    # llama.cpp's file types scored as rows of their own when llama-cpp-python is installed (``--llama-cpp``)
    llama_cpp: tuple[str, ...] = ()
    # ``qbench plan`` at the smallest passing llama.cpp type's size and 10 % below (``--mixed-plan``): one cell
    # per tensor kind and candidate type, ~45 on a Llama-style model, so the full budget only by default
    mixed_plan: bool = False

    @property
    def kv_bits(self) -> tuple[int, ...]:
        """Every KV width the budget's rows use, widest first."""
        return tuple(sorted({r.bits for r in self.kv_rows}, reverse=True))

    def describe(self, tokens: int | None = None) -> str:
        """The budget in words; ``tokens``: what the card scored when ``--tokens`` overrode the budget's own."""
        scored = (
            f"{self.tokens:,} tokens"
            if tokens in (None, self.tokens)
            else f"{tokens:,} tokens (--tokens; the budget's own: {self.tokens:,})"
        )
        sweep = (
            f"sweep {'+'.join(self.sweep_families)} axes {','.join(self.sweep_axes)} at bits "
            f"{','.join(map(str, self.sweep_bits))}"
            if self.sweep_families
            else "no sweep"
        )
        tries = (
            f"up to {self.repair_candidates} formats in turn" if self.repair_candidates > 1 else "one format"
        )
        return (
            f"{self.name}: {scored}, {len(self.formats)} formats, KV cache {describe_kv_rows(self.kv_rows)}, "
            f"{sweep}, sensitivity by {self.sensitivity_by} of {tries} over tolerance that a repair could pay "
            "for"
            + ("" if self.repair_minimise else " (repair not minimised)")
            + " and of the most damaged format"
            + ", per-layer kernel speed"
            + (" and whole-model real-kernel speed" if self.speed else "")
            + (f", llama.cpp's {', '.join(self.llama_cpp)}" if self.llama_cpp else "")
            + (" and a mixed-precision plan at the smallest passing one's size" if self.mixed_plan else "")
            + (
                ""
                if not any(":algo=" in f for f in self.formats)
                else f", GPTQ/AWQ calibrated on {self.calib_tokens:,} tokens"
                if self.calib_tokens
                else ", GPTQ/AWQ calibrated on 128 windows of min(2048, context) tokens"
            )
        )


def describe_kv_rows(rows: Sequence[KVRow]) -> str:
    """``KIVI at 4/2 bits (2 also with 1 sink kept), per-token at 4, FP8 E4M3`` (widths in the rows' order)."""
    names = {"kivi": "KIVI", "per-token": "per-token", "fp8-e4m3": "FP8 E4M3"}
    parts = []
    for scheme in dict.fromkeys(r.scheme for r in rows):
        plain = [r.bits for r in rows if r.scheme == scheme and not r.keep_sinks]
        sinks = [r for r in rows if r.scheme == scheme and r.keep_sinks]
        name = names.get(scheme, scheme)
        text = (
            name
            if scheme.startswith("fp8") and plain == [8]
            else f"{name} at {'/'.join(map(str, plain))} bits"
        )
        if sinks:
            kept = sinks[0].keep_sinks
            text += f" ({'/'.join(str(r.bits) for r in sinks)} also with {kept} sink{'s' if kept > 1 else ''} kept)"
        parts.append(text)
    return ", ".join(parts)


# Tokens per budget: quick and standard their own (qbench.cli.budgets.CARD_QUICK_TOKENS, CARD_STANDARD_TOKENS:
# sized for a 135 M model on 2 CPU cores, 10 and 30 minutes), full the evaluation budget (EVAL_TOKENS), so full
# cards share cells with run/grid/sweep at their defaults. Literals
# here (studies do not import the CLI); tests/qbench/studies/test_card.py keeps them equal.
QUICK_TOKENS, STANDARD_TOKENS, FULL_TOKENS = 4096, 8192, 32768
# the algorithm rows' calibration at the standard budget: 8 windows of 2,048 tokens, about 2.5 min per row on a 135M
# model on 2 cores (sequential GPTQ on 32,768 tokens took 4.6 min: results/algorithms/calibration/README.md)
STANDARD_CALIB_TOKENS = 16384
# llama.cpp's file types on the standard and full cards: what people download, largest first (the quick card
# leaves them out: --llama-cpp default adds none there)
LLAMA_CPP_TYPES = ("Q8_0", "Q6_K", "Q5_K_M", "Q4_K_M", "Q4_0", "IQ4_NL", "Q3_K_M", "Q2_K")


def _budgets() -> dict[str, Budget]:
    everything = tuple(f.scheme for f in FORMATS)
    return {
        "quick": Budget(
            "quick",
            QUICK_TOKENS,
            QUICK_FORMATS,
            budget_kv_rows((4, 2), (2,), (4,)),
            repair_minimise=False,
        ),
        "standard": Budget(
            "standard",
            STANDARD_TOKENS,
            everything,
            budget_kv_rows((8, 4, 3, 2), (4, 2), (4, 2)),
            ("absmax-coarse",),
            ("w", "a", "o", "all"),
            (8, 6, 4, 3, 2),
            repair_candidates=2,
            calib_tokens=STANDARD_CALIB_TOKENS,
            llama_cpp=LLAMA_CPP_TYPES,
        ),
        "full": Budget(
            "full",
            FULL_TOKENS,
            everything,
            budget_kv_rows((8, 4, 3, 2), (8, 4, 3, 2), (8, 4, 3, 2)),
            ("absmax-coarse", "absmax-fine"),
            ("w", "a", "o", "all"),
            (8, 7, 6, 5, 4, 3, 2),
            sensitivity_by="layer",
            speed=True,
            repair_candidates=3,
            llama_cpp=LLAMA_CPP_TYPES,
            mixed_plan=True,
        ),
    }


BUDGETS = _budgets()


FORMAT_BY_SCHEME = {f.scheme: f for f in FORMATS}


def budget(name: str) -> Budget:
    if name not in BUDGETS:
        raise unknown_choice("--budget", name, list(BUDGETS))
    return BUDGETS[name]


def canonical_scheme(name: str) -> str:
    try:
        from qbench.quant.schemes import get_scheme

        return get_scheme(name).name
    except UserError:
        return name


def rtn_scheme(scheme: str) -> str:
    """The round-to-nearest scheme with the same storage as ``scheme`` (GPTQ and AWQ choose other codes on the
    same grid, QuaRot rotates the float model first: the same kernels run them, QuaRot's two online rotations
    aside): ``zeropoint-int4:algo=gptq`` -> ``zeropoint-int4``."""
    base, _, spec = scheme.partition(":")
    items = [i for i in spec.split(",") if i and not i.startswith(("algo=", "rotate="))]
    return base + (":" + ",".join(items) if items else "")
