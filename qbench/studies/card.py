"""``qbench card``: one page per model — outliers, attention sink, deployable formats, breaking points, KV cache,
where it breaks and the repair, and a verdict — built from the harness's records.

    result = run_card(CardConfig(models=["ckpts/vanilla"], budget="quick", output_path=Path("card")))
    # -> card/card.json, card/card.md, card/card.html (+ the records under card/<model>/)

Two halves:

1. **Running** (:func:`run_card`): every number is a harness cell (``qbench.eval.harness.run_grid``) written under
   ``output_path`` in the grid's layout, so ``qbench run --output-path DIR`` with the same protocol reuses the
   card's cells and the card reuses theirs; an interrupted card resumes and a re-run evaluates nothing. The
   breaking points are ``qbench sweep``'s (``run_sweep``, records in the same folder), the repair is
   ``qbench sensitivity``'s (cells under ``DIR/sensitivity/<model>/<scheme>/cells``, where
   ``qbench sensitivity --output-path`` that folder finds them). What no record held — the attention sink per
   head, where the massive activations sit, the architecture — is one more record per model,
   ``DIR/<model>/profile.json``, keyed by the float record's identity. The real kernels' speed (``full``
   budget) is ``DIR/<model>/speed.json`` (``qbench.studies.speed.run_speed``).
2. **Building** (:func:`build_card`): a pure function from those records to the card's dict — every number the
   renderers (``qbench.studies.card_render``) show, the verdict included; the renderers compute nothing.
"""

from __future__ import annotations

import json
import math
import os
import re
import shlex
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from models.errors import UserError, unknown_choice
from qbench.eval.metric_registry import BY_KEY

CARD_VERSION = 1
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


def _kv_rows(kivi: tuple[int, ...], kivi_sinks: tuple[int, ...], per_token: tuple[int, ...]) -> tuple:
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


def _budgets() -> dict[str, Budget]:
    everything = tuple(f.scheme for f in FORMATS)
    return {
        "quick": Budget(
            "quick",
            QUICK_TOKENS,
            QUICK_FORMATS,
            _kv_rows((4, 2), (2,), (4,)),
            repair_minimise=False,
        ),
        "standard": Budget(
            "standard",
            STANDARD_TOKENS,
            everything,
            _kv_rows((8, 4, 3, 2), (4, 2), (4, 2)),
            ("absmax-coarse",),
            ("w", "a", "o", "all"),
            (8, 6, 4, 3, 2),
            repair_candidates=2,
        ),
        "full": Budget(
            "full",
            FULL_TOKENS,
            everything,
            _kv_rows((8, 4, 3, 2), (8, 4, 3, 2), (8, 4, 3, 2)),
            ("absmax-coarse", "absmax-fine"),
            ("w", "a", "o", "all"),
            (8, 7, 6, 5, 4, 3, 2),
            sensitivity_by="layer",
            speed=True,
            repair_candidates=3,
        ),
    }


BUDGETS = _budgets()
FORMAT_BY_SCHEME = {f.scheme: f for f in FORMATS}


def budget(name: str) -> Budget:
    if name not in BUDGETS:
        raise unknown_choice("--budget", name, list(BUDGETS))
    return BUDGETS[name]


# ------------------------------------------------------------------------------------------------ running


@dataclass
class CardConfig:
    models: list[str]
    budget: str = "quick"
    output_path: Path = Path("qbench_card")
    tokens: int | None = None  # None: the budget's
    window: int | None = None
    corpus: str = "embedded"
    split: str | None = None
    bos: bool = True
    batch_size: int = 8
    tolerance: float = DEFAULT_TOLERANCE  # in the unit of ``metric`` (qbench.eval.evidence.METRICS)
    metric: str = "ppl"  # what the tolerance applies to: ppl | kld | top1
    kv_scheme: str | None = None  # None: the sweep's default_kv_scheme(window)
    seed: int = 0
    dtype: str = "float32"
    device: str = "cpu"
    trust_remote_code: bool = False
    allow_unsafe_weights: bool = False
    command: str | None = None
    # --resolve: re-evaluate undecided format and KV rows at doubling tokens up to this many (None: off)
    resolve_tokens: int | None = None
    overwrite: bool = False  # replace a card of other models or settings in output_path (their records stay)
    # where the calibrated rows (GPTQ, AWQ, fp8 scale=calib) take their windows: qbench.quant.calibrate's
    # CalibrationData (None, None: the train split of ``corpus``, each scheme's windows)
    calib_data: str | None = None
    calib_tokens: int | None = None

    def calibration(self) -> Any:
        from qbench.quant.calibrate import CalibrationData

        return CalibrationData(self.calib_data, self.calib_tokens)

    @property
    def plan(self) -> Budget:
        return budget(self.budget)

    def protocol(self) -> Any:
        from qbench.eval.metrics import Protocol

        return Protocol(
            corpus=self.corpus,
            split=self.split,
            tokens=self.tokens or self.plan.tokens,
            window=self.window,
            bos=self.bos,
            batch_size=self.batch_size,
        )


@dataclass
class Progress:
    """What :func:`run_card` tells its caller: ``total(n)`` when the count of cells grows (the sensitivity's
    units and repair are known only when they start), ``cell(record, reused)`` after each."""

    total: Callable[[int], None] = lambda n: None
    cell: Callable[[dict[str, Any], bool], None] = lambda r, reused: None
    estimate: Callable[[int, float, str], None] = lambda n, seconds, model: None
    note: Callable[[str], None] = lambda line: None  # what the card could not measure, as it skips it


def _spec(cfg: CardConfig, model: str, schemes: list[str], kv: Any = None, **kw: Any) -> Any:
    from qbench.eval.harness import GridSpec

    return GridSpec(
        models=[model],
        schemes=schemes,
        modes=["fake"],
        protocol=cfg.protocol(),
        output_path=Path(cfg.output_path),
        seed=cfg.seed,
        dtype=cfg.dtype,
        device=cfg.device,
        trust_remote_code=cfg.trust_remote_code,
        allow_unsafe_weights=cfg.allow_unsafe_weights,
        kv=kv,
        calibration=cfg.calibration(),
        **kw,
    )


def kv_configs(cfg: CardConfig, window: int) -> list[Any]:
    """The KV rows at the KV window ``window``: the budget's rows (``"kivi"`` as deployed at that window), or with
    ``--kv-scheme`` that scheme at every budget width it stores, plain and with ``KV_KEEP_SINKS`` sinks kept. One
    row per label (on windows of 32 tokens or fewer the default KIVI is per-token blocks too)."""
    from qbench.quant.kv import KVConfig
    from qbench.studies.sweep import default_kv_scheme

    if cfg.kv_scheme is None:
        configs = [
            KVConfig(r.bits, default_kv_scheme(window) if r.scheme == "kivi" else r.scheme, 0, r.keep_sinks)
            for r in cfg.plan.kv_rows
        ]
    else:
        widths = kv_widths(cfg.plan, cfg.kv_scheme)
        configs = [KVConfig(b, cfg.kv_scheme, 0, k) for b in widths for k in (0, KV_KEEP_SINKS)]
    return list({c.label: c for c in configs}.values())


def kv_window(model: Any, window: int) -> int:
    """The KV rows' window: the evaluation window when it is at least :data:`KV_MIN_WINDOW` tokens, else that many
    or the model's whole context when it is shorter (the card says so)."""
    from qbench.eval.adapters import context_length

    return window if window >= KV_MIN_WINDOW else max(window, min(context_length(model), KV_MIN_WINDOW))


def _scheme_widths(scheme: str) -> tuple[int, ...]:
    """The KV-cache widths ``scheme`` stores (fp8: 8 only; a scheme that sets ``bits=``: that one); a scheme that
    takes none (a bad option) raises its own one-line error."""
    from qbench.quant.kv import KVConfig
    from qbench.quant.kv_options import KV_BITS

    widths, first = [], None
    for b in KV_BITS:
        try:
            KVConfig(b, scheme)
        except UserError as e:
            first = first or e
        else:
            widths.append(b)
    if not widths and first is not None:
        raise first
    return tuple(widths)


def kv_widths(plan: Budget, scheme: str) -> tuple[int, ...]:
    """The budget's KV widths that ``scheme`` stores; a one-line error naming the budget when it stores none."""
    takes = _scheme_widths(scheme)
    widths = tuple(b for b in plan.kv_bits if b in takes)
    if not widths:
        others = [b.name for b in BUDGETS.values() if set(b.kv_bits) & set(takes)]
        bits = "/".join(map(str, takes))
        raise UserError(
            f"--kv-scheme {scheme} stores {bits} bits only, but the {plan.name} budget's KV rows are at "
            f"{'/'.join(map(str, plan.kv_bits))} bits: give a KV scheme that stores those (kivi, per-token or "
            "window)"
            + (
                f", or use --budget {' or '.join(others)}, whose KV rows include {bits} bits"
                if others
                else ""
            )
        )
    return widths


def kv_problem(lm: Any, config: Any) -> str | None:
    """Why ``lm`` cannot score the KV row ``config`` here, or None. The remedy attentions of transformers exports
    (clipped, softpick, sink-logit) take only the stored version of the cache (``qbench.quant.kvschemes``): KIVI
    reads two versions (a written position in float and quantised), and the sink finder's float pass reads the
    attention probabilities through that two-version path too; the other schemes, without sinks, read one."""
    if (config.scheme != "kivi" and not config.keep_sinks) or lm.description.get("kind") != "transformers":
        return None
    from models.hf import HF_ATTENTION_KINDS, REMEDY_IMPLEMENTATIONS, ungated
    from qbench.quant.kv import KV_PREFIX

    hf = getattr(lm.model, "config", None)
    _, impl = ungated(str(getattr(hf, "_attn_implementation", None) or "sdpa"))
    impl = impl.removeprefix(KV_PREFIX)
    if impl not in REMEDY_IMPLEMENTATIONS:
        return None
    kind = HF_ATTENTION_KINDS.get(impl, impl)
    if config.scheme == "kivi":
        return (
            f"the kivi KV scheme reads two versions of the cache, which the {kind} attention of this "
            "transformers export does not take; --kv-scheme per-token measures the rows without sinks kept, a "
            "card of the qbench checkpoint itself all of them"
        )
    return (
        f"keeping sinks reads the float attention through two versions of the cache, which the {kind} "
        "attention of this transformers export does not take; a card of the qbench checkpoint itself measures "
        "these rows"
    )


def skipped_kv_record(config: Any, why: str) -> dict[str, Any]:
    """A KV row the card could not measure: no cell, no file; the card says so where its number would be."""
    return {
        "kv": config.to_dict(),
        "status": "skipped",
        "error": why,
        "metrics": {"perplexity": None, "ppl_change_pct": None},
    }


def sweep_config(cfg: CardConfig, model: str) -> Any:
    from qbench.studies.sweep import SweepConfig

    plan = cfg.plan
    return SweepConfig(
        models=[model],
        families=list(plan.sweep_families),
        axes=list(plan.sweep_axes),
        bits=list(plan.sweep_bits),
        tolerance=cfg.tolerance,
        metric=cfg.metric,
        protocol=cfg.protocol(),
        output_path=Path(cfg.output_path),
        seed=cfg.seed,
        dtype=cfg.dtype,
        device=cfg.device,
        trust_remote_code=cfg.trust_remote_code,
        allow_unsafe_weights=cfg.allow_unsafe_weights,
        calibration=cfg.calibration(),
    )


def calibrates(cfg: CardConfig) -> bool:
    """Whether any row of the card reads calibration windows (a format or a KV cache with calibrated scales)."""
    from qbench.eval.harness import kv_calibrated
    from qbench.quant.calibrate import needs_calibration
    from qbench.quant.schemes import get_scheme

    if any(needs_calibration(get_scheme(s)) for s in cfg.plan.formats):
        return True
    return any(kv_calibrated(kv) for kv in kv_configs(cfg, KV_MIN_WINDOW))


def validate(cfg: CardConfig) -> None:
    """Refuse bad options before a model loads."""
    from qbench.quant.schemes import get_scheme

    plan = cfg.plan
    from qbench.eval.evidence import check_metric, check_tolerance

    check_tolerance(cfg.tolerance, check_metric(cfg.metric))
    if cfg.tokens is not None and cfg.tokens < 2:
        raise UserError(f"--tokens must be at least 2, got {cfg.tokens}")
    for scheme in plan.formats:
        get_scheme(scheme)
    if cfg.kv_scheme is not None:
        kv_widths(plan, cfg.kv_scheme)
    cfg.calibration()  # a bad --calib-data or --calib-tokens: its one-line error before a model loads
    if (cfg.calib_data is not None or cfg.calib_tokens is not None) and not calibrates(cfg):
        given = "--calib-data" if cfg.calib_data is not None else "--calib-tokens"
        raise UserError(
            f"{given}: budget {cfg.budget!r} calibrates nothing (no GPTQ, AWQ, SmoothQuant, static-scale or "
            "calibrated-FP8 rows), so it would change no number; drop it, or use --budget standard or full"
        )
    check_distinct(cfg.models)
    if plan.sweep_families:
        from qbench.studies import sweep

        sweep.validate(sweep_config(cfg, cfg.models[0]))


def _resolved(spec: str) -> tuple[Path | str, str]:
    """(what ``--ckpt spec`` loads, its identity: the real path of a local model, else the hub name)."""
    from qbench.eval.load import resolve

    target = resolve(spec)
    return target, os.path.realpath(target) if isinstance(target, Path) else str(target)


def check_distinct(models: Sequence[str]) -> None:
    """One card per model: ``--ckpt sm --ckpt ./sm`` (or a link to it) is a model beside itself."""
    seen: dict[str, str] = {}
    for spec in models:
        _, key = _resolved(spec)
        if key in seen:
            same = (
                f"--ckpt {spec} is given twice"
                if seen[key] == spec
                else f"--ckpt {seen[key]} and --ckpt {spec} name the same model"
            )
            raise UserError(
                f"{same} ({key}): a card sets different models side by side, not a model beside itself; "
                "give each model once"
            )
        seen[key] = spec


def _tokenizer_name(tok: Any, fingerprint: str) -> str:
    """A registered tokenizer's name when ``tok`` is one (bpe8192, gpt2), else its folder; with its size."""
    from models.tokenizer import TOKENIZERS, load_tokenizer, tokenizer_fingerprint

    name = None
    for registered in TOKENIZERS:
        try:
            if tokenizer_fingerprint(load_tokenizer(registered)) == fingerprint:
                name = registered
                break
        except (UserError, OSError, ValueError):
            continue
    name = name or str(getattr(tok, "name_or_path", None) or "?")
    return f"{name}, {len(tok):,} tokens"


def check_tokenizers(named: Sequence[tuple[str, Any]]) -> None:
    """Models side by side must share a tokenizer: the same token count of text is other text for another
    vocabulary, so their perplexities and changes would not compare. ``named``: (model, tokenizer) pairs."""
    from models.tokenizer import tokenizer_fingerprint

    if len(named) < 2:
        return
    (first, tok0), fp0 = named[0], tokenizer_fingerprint(named[0][1])
    for name, tok in named[1:]:
        fp = tokenizer_fingerprint(tok)
        if fp != fp0:
            raise UserError(
                f"{first} and {name} use different tokenizers ({first}: {_tokenizer_name(tok0, fp0)}; {name}: "
                f"{_tokenizer_name(tok, fp)}): the same token count is different text for each, so their rows "
                "would not compare; card them separately (one --ckpt per card)"
            )


def _local_tokenizers(models: Sequence[str]) -> list[tuple[str, Any]]:
    """(``--ckpt``, tokenizer) of each model whose folder holds tokenizer.json, read without loading the model
    (GGUF files and hub names are checked once loaded)."""
    from models.tokenizer import load_tokenizer

    out = []
    for spec in models:
        target, _ = _resolved(spec)
        if isinstance(target, Path) and target.is_dir() and (target / "tokenizer.json").is_file():
            out.append((spec, load_tokenizer(target)))
    return out


# What a card is of: a card.json in the output folder with other values here is another card.
CARD_INPUTS = ("models", "budget", "tolerance_pct", "metric", "seed", "protocol", "kv")
PROTOCOL_INPUTS = ("corpus", "split", "tokens", "window", "bos", "dtype")
KV_INPUTS = ("scheme", "keep_first", "group", "residual", "block", "sym", "scale", "key_axis")


def card_inputs(card: Mapping[str, Any]) -> dict[str, Any]:
    """What a card (card.json) is of: its models and their sources, budget, tolerance, seed, each model's
    protocol and KV scheme."""
    models = [m for m in card.get("models") or [] if isinstance(m, Mapping)]
    return {
        "models": [(m.get("name"), m.get("source")) for m in models],
        "budget": card.get("budget"),
        "tolerance_pct": card.get("tolerance_pct"),
        "metric": card.get("metric") or "ppl",  # cards before --metric decided on perplexity
        "seed": card.get("seed"),
        "protocol": [{k: (m.get("protocol") or {}).get(k) for k in PROTOCOL_INPUTS} for m in models],
        # the KV rows by label (a label names every option that is not the scheme's default)
        "kv": [
            {"rows": sorted(r.get("label") or "" for r in (m.get("kv") or {}).get("rows") or [])}
            for m in models
        ],
    }


def planned_inputs(cfg: CardConfig) -> dict[str, Any]:
    """:func:`card_inputs` of the card ``cfg`` will make, as far as it is known before a model loads (None: not
    yet known — the window and KV scheme a model's context decides)."""
    from qbench.eval.load import _folder_name

    protocol = cfg.protocol()
    models = []
    for spec in cfg.models:
        target, _ = _resolved(spec)
        name = (
            (target.stem if target.is_file() else _folder_name(target))
            if isinstance(target, Path)
            else str(target).replace("/", "--")
        )
        models.append((name, str(target)))
    return {
        "models": models,
        "budget": cfg.plan.name,
        "tolerance_pct": cfg.tolerance,
        "metric": cfg.metric,
        "seed": cfg.seed,
        "protocol": [
            {
                "corpus": protocol.corpus,
                "split": protocol.split,
                "tokens": protocol.tokens,
                "window": cfg.window,
                "bos": protocol.bos,
                "dtype": cfg.dtype,
            }
            for _ in models
        ],
        "kv": None,
    }


def _same_source(a: Any, b: Any) -> bool:
    """Two records' ``source`` name the same model: equal, or the same existing path (a card made from another
    folder names its models relative to that one: not comparable from here, so not a difference)."""
    if a == b or a is None or b is None:
        return True
    a, b = str(a), str(b)
    if os.path.exists(a) and os.path.exists(b):
        return os.path.realpath(a) == os.path.realpath(b)
    return True


def _models_text(models: Sequence[Any]) -> str:
    return ", ".join(
        f"{name} ({source})" if source and source != name else str(name) for name, source in models
    )


def _differences(old: Mapping[str, Any], new: Mapping[str, Any]) -> list[str]:
    """What differs between two :func:`card_inputs` (None in ``new``: not known yet, not compared); other models
    are the one difference named when they differ."""
    old_models, new_models = old.get("models") or [], new.get("models") or []
    if [n for n, _ in old_models] != [n for n, _ in new_models] or not all(
        _same_source(a, b) for (_, a), (_, b) in zip(old_models, new_models, strict=True)
    ):
        return [f"the card of {_models_text(old_models) or '-'}, not of {_models_text(new_models)}"]
    out = []
    for key in ("budget", "tolerance_pct", "metric", "seed"):
        if new.get(key) is not None and old.get(key) != new.get(key):
            out.append(f"{key.replace('_pct', '')} {old.get(key)} (this one: {new.get(key)})")
    for group in ("protocol", "kv"):
        for o, n in zip(old.get(group) or [], new.get(group) or [], strict=False):
            for key, value in (n or {}).items():
                if value is not None and (o or {}).get(key) != value:
                    out.append(f"{group} {key} {(o or {}).get(key)} (this one: {value})")
    return list(dict.fromkeys(out))


def check_output(cfg: CardConfig, new: Mapping[str, Any]) -> None:
    """Refuse to write over a card of other models or settings in ``cfg.output_path`` (``--overwrite`` lets it):
    card.json would be replaced and the earlier card lost. ``new``: :func:`card_inputs` of the card to write
    (or :func:`planned_inputs`, before any work)."""
    path = Path(cfg.output_path) / "card.json"
    if cfg.overwrite or not path.exists():
        return
    advice = (
        "give another --output-path, or pass --overwrite to replace it (the records it was built from stay)"
    )
    try:
        old = json.loads(path.read_text())
    except (OSError, ValueError):
        old = None
    if not (isinstance(old, dict) and "card_version" in old and isinstance(old.get("models"), list)):
        raise UserError(f"{path} exists and is not a qbench card; {advice}")
    inputs = card_inputs(old)
    differences = _differences(inputs, new)
    if not differences:
        return
    what = (
        differences[0]
        if differences[0].startswith("the card of")
        else f"a card of {_models_text(inputs['models'])} with other settings: {'; '.join(differences)}"
    )
    raise UserError(f"{cfg.output_path} holds {what}; writing this card would replace it: {advice}")


def planned_cells(cfg: CardConfig) -> int:
    """Cells per model before the sensitivity study: the float record, the formats, the KV rows and the sweep's
    own cells (those not already formats)."""
    plan = cfg.plan
    kv = len(plan.kv_rows) if cfg.kv_scheme is None else 2 * len(kv_widths(plan, cfg.kv_scheme))
    n = 1 + len(plan.formats) + kv
    if plan.sweep_families:
        from qbench.quant.schemes import get_scheme
        from qbench.studies.sweep import plan as sweep_plan

        cells, _ = sweep_plan(plan.sweep_families, plan.sweep_axes, plan.sweep_bits)
        formats = {get_scheme(s).name for s in plan.formats}
        n += len({get_scheme(c.scheme).name for c in cells} - formats)
    return n


def _slug(name: str) -> str:
    return re.sub(r"[^\w.+-]+", "_", name)


def profile_path(out: Path, model_name: str) -> Path:
    return Path(out) / model_name / "profile.json"


def architecture(lm: Any) -> dict[str, Any]:
    """What kind of transformer it is: attention kind, norm, positions, tied head, sliding window, sizes."""
    model = lm.model
    config = (lm.description.get("config") or {}) if lm.description.get("kind") == "qbench" else None
    names = {type(m).__name__ for m in model.modules()}
    modules = dict(model.named_modules())
    out: dict[str, Any] = {"parameters": lm.description.get("parameters")}
    if config:
        out.update(
            family=config.get("family"),
            attention=config.get("attn"),
            gate=config.get("gate", "none"),
            norm=config.get("norm"),
            norm_position=config.get("norm_position"),
            positions=config.get("pos"),
            tied_head=bool(config.get("tie_embeddings")),
            sliding_window=None,
            layers=config.get("n_layer"),
            heads=config.get("n_head"),
            kv_heads=config.get("n_kv_head") or config.get("n_head"),  # grouped-query attention: fewer
            head_dim=config["d_model"] // config["n_head"] if config.get("n_head") else None,
            d_model=config.get("d_model"),
            context=config.get("context"),
        )
        return out
    hf = getattr(model, "config", None)
    norm = (
        "rmsnorm"
        if any("RMSNorm" in n for n in names)
        else "layernorm"
        if any("LayerNorm" in n for n in names)
        else None
    )
    rope = any("Rotary" in n for n in names) or hasattr(hf, "rope_theta")
    learned = any(k.endswith(("wpe", "position_embeddings", "embed_positions")) for k in modules)
    head = getattr(model, "get_output_embeddings", lambda: None)()
    emb = getattr(model, "get_input_embeddings", lambda: None)()
    tied = head is not None and emb is not None and head.weight is emb.weight
    from models.hf import HF_ATTENTION_KINDS, ungated
    from qbench.quant.kv import KV_PREFIX

    gated, impl = ungated(str(getattr(hf, "_attn_implementation", None) or "sdpa"))
    impl = impl.removeprefix(KV_PREFIX)  # a quantised cache sits inside the gate, around the attention
    out.update(
        family=getattr(hf, "model_type", None),
        attention=HF_ATTENTION_KINDS.get(impl, "softmax"),
        gate=getattr(hf, "qbench_gate", "none") if gated else "none",
        norm=norm,
        norm_position=None,
        positions="rope" if rope else "learned" if learned else None,
        tied_head=bool(tied),
        sliding_window=getattr(hf, "sliding_window", None)
        if getattr(hf, "use_sliding_window", True)
        else None,
        layers=getattr(hf, "num_hidden_layers", None),
        heads=getattr(hf, "qbench_gate_heads", None) if gated else getattr(hf, "num_attention_heads", None),
        d_model=getattr(hf, "hidden_size", None),
        context=getattr(hf, "max_position_embeddings", None),
    )
    heads = getattr(hf, "num_attention_heads", None) or getattr(hf, "n_head", None)
    width = getattr(hf, "hidden_size", None) or getattr(hf, "n_embd", None)
    out.update(  # the attention cache's geometry (grouped-query models store fewer key/value heads)
        kv_heads=getattr(hf, "num_key_value_heads", None) or heads,
        head_dim=getattr(hf, "head_dim", None) or (width // heads if heads and width else None),
    )
    return out


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


def profile_record(evaluation: Any, fp: dict[str, Any], device: str) -> tuple[dict[str, Any], bool]:
    """The per-head attention sink, the massive activations' sites and the architecture of the float model, on the
    float record's outlier windows: read from ``<model>/profile.json`` when it was made for this float record
    (its ``cell_id``), else computed and written atomically. Returns (record, reused)."""
    from models.io import atomic_write_json
    from qbench.eval.harness import environment
    from qbench.eval.metrics import attention_sink_and_massive_sites

    path = profile_path(evaluation.spec.output_path, evaluation.name)
    try:
        existing = json.loads(path.read_text())
    except (OSError, ValueError):
        existing = None
    if (
        isinstance(existing, dict)
        and existing.get("fp_cell_id") == fp["cell_id"]
        and existing.get("profile_version") == PROFILE_VERSION
    ):
        return existing, True
    lm, windows = evaluation.lm, evaluation.windows
    n = evaluation.spec.protocol.outlier_windows
    start = time.perf_counter()
    record = {
        "profile_version": PROFILE_VERSION,
        "fp_cell_id": fp["cell_id"],
        "model": fp["model"],
        "protocol": fp["protocol"],
        "architecture": architecture(lm),
        **dict(
            zip(
                ("attention_per_head", "massive_sites"),
                attention_sink_and_massive_sites(lm.model, windows, lm.tokenizer, n, device=device),
                strict=True,
            )
        ),
        "linear_shapes": linear_shapes(lm.model),
        "env": environment(device),
        "wall_seconds": 0.0,
        "created_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }
    record["wall_seconds"] = round(time.perf_counter() - start, 3)
    atomic_write_json(path, record)
    return record, False


def speed_record(
    cfg: CardConfig, lm: Any, fp: dict[str, Any], schemes: Sequence[str]
) -> dict[str, Any] | None:
    """The real kernels' whole-model prefill speed-up against float32 (``full`` budget): read from
    ``<model>/speed.json`` when it exists for these weights, else measured with ``run_speed`` (``full`` only)."""
    from models.io import atomic_write_json
    from qbench.quant.apply import real_kernel_problem
    from qbench.quant.schemes import get_scheme

    path = Path(cfg.output_path) / lm.name / "speed.json"
    try:
        existing = json.loads(path.read_text())
        if existing.get("fingerprint") == fp["model"].get("fingerprint"):
            return existing
    except (OSError, ValueError, AttributeError):
        pass
    if not cfg.plan.speed:
        return None
    from qbench.eval.harness import environment
    from qbench.studies.speed import run_speed

    real = [s for s in schemes if real_kernel_problem(get_scheme(s)) is None]
    error = None
    try:
        records = run_speed(
            schemes=real,
            modes=("real",),
            peers=False,
            layer=False,
            generate=False,
            kv=False,  # the card shows prefill speed-ups only: KV-cache generation would be timed and dropped
            ckpt=lm.source,
            model=None,
            model_tokens=512,
            repeats=5,
            device=cfg.device,
        )
    except (UserError, RuntimeError, ValueError) as e:  # a model the speed study cannot load: no speed-ups
        records, error = [], f"{type(e).__name__}: {e}"
    record = {
        "fingerprint": fp["model"].get("fingerprint"),
        "error": error,
        "what": "whole-model prefill of 512 tokens, real kernels vs float32 (qbench.studies.speed.run_speed)",
        "records": records,
        "env": environment(cfg.device),
        "created_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }
    atomic_write_json(path, record)
    return record


LAYER_SPEED_VERSION = 1


def _rtn_scheme(scheme: str) -> str:
    """The round-to-nearest scheme with the same storage as ``scheme`` (GPTQ and AWQ choose other codes on the
    same grid, QuaRot rotates the float model first: the same kernels run them, QuaRot's two online rotations
    aside): ``zeropoint-int4:algo=gptq`` -> ``zeropoint-int4``."""
    base, _, spec = scheme.partition(":")
    items = [i for i in spec.split(",") if i and not i.startswith(("algo=", "rotate="))]
    return base + (":" + ",".join(items) if items else "")


def layer_speed_record(
    cfg: CardConfig, lm: Any, fp: Mapping[str, Any], profile: Mapping[str, Any], schemes: Sequence[str]
) -> dict[str, Any] | None:
    """The real kernels' decode and prefill speed-ups on the model's own linear shapes (every budget; a few
    seconds: ``qbench.studies.layerspeed``), read from ``<model>/layer_speed.json`` when it was measured on this
    CPU for these shapes and schemes, else measured and written atomically. None when no format has a real
    kernel."""
    from models.io import atomic_write_json
    from qbench.quant.apply import real_kernel_problem
    from qbench.quant.schemes import get_scheme
    from qbench.studies.layerspeed import layer_speed
    from qbench.studies.speed import cpu_name

    real = list(dict.fromkeys(_rtn_scheme(s) for s in schemes))
    real = [s for s in real if real_kernel_problem(get_scheme(s)) is None]
    if not real:
        return None
    heads = {
        n for n, v in ((fp.get("linear_ranges") or {}).get("per_layer") or {}).items() if v.get("lm_head")
    }
    shapes = {n: v for n, v in (profile.get("linear_shapes") or {}).items() if n not in heads}
    if not shapes:
        return None
    key = {
        "version": LAYER_SPEED_VERSION,
        "cpu": cpu_name(),
        "device": cfg.device,
        "shapes": sorted(map(list, {tuple(v) for v in shapes.values()})),
        "schemes": real,
    }
    path = Path(cfg.output_path) / lm.name / "layer_speed.json"
    try:
        existing = json.loads(path.read_text())
        if existing.get("key") == key:
            return existing
    except (OSError, ValueError, AttributeError):
        pass
    record = {"key": key, **layer_speed(shapes, real, device=cfg.device, seed=cfg.seed)}
    atomic_write_json(path, record)
    return record


def run_card(cfg: CardConfig, progress: Progress | None = None) -> dict[str, Any]:
    """Evaluate (or reuse) every cell of the card for each model, then build it and write card.json/.md/.html."""
    from dataclasses import replace

    from qbench.eval.adapters import default_window
    from qbench.eval.harness import (
        ModelEvaluation,
        cell_record,
        refuse_nonfinite_weights,
        refuse_unscorable,
        run_grid,
    )
    from qbench.eval.load import load_model

    progress = progress or Progress()
    validate(cfg)
    check_output(cfg, planned_inputs(cfg))
    check_tokenizers(_local_tokenizers(cfg.models))
    plan = cfg.plan
    start = time.perf_counter()
    tokenizers: list[tuple[str, Any]] = []
    contents = plan.describe(cfg.tokens)
    if cfg.kv_scheme is not None:
        widths = kv_widths(plan, cfg.kv_scheme)
        contents += (
            f"; KV rows: --kv-scheme {cfg.kv_scheme} at {'/'.join(map(str, widths))} bits, plain and with "
            f"{KV_KEEP_SINKS} sink kept, instead of the budget's"
        )
        left = [b for b in plan.kv_bits if b not in widths]
        if left:  # fp8: the budget's 8-bit rows only
            line = (
                f"KV rows at {'/'.join(map(str, widths))} bits only: --kv-scheme {cfg.kv_scheme} stores no other "
                f"width (the {plan.name} budget's {'/'.join(map(str, left))} bits not measured)"
            )
            contents += f"; {line}"
            progress.note(line)
    per_model: list[dict[str, Any]] = []
    count = {"n": 0}  # cells announced to the progress bar, over all models
    names: dict[str, str] = {}
    for model in cfg.models:
        lm = load_model(
            model,
            dtype=cfg.dtype,
            device=cfg.device,
            trust_remote_code=cfg.trust_remote_code,
            allow_unsafe_weights=cfg.allow_unsafe_weights,
        )
        if names.setdefault(lm.name, lm.source) != lm.source:
            raise UserError(
                f"two models are both named {lm.name!r} ({names[lm.name]} and {lm.source}): their records would "
                f"share {Path(cfg.output_path) / lm.name}/; rename one folder"
            )
        # a GGUF's or a hub model's tokenizer is read only now (the folders' were compared before any work)
        check_tokenizers([*tokenizers[:1], (lm.name, lm.tokenizer)])
        tokenizers = tokenizers or [(lm.name, lm.tokenizer)]
        count["n"] += planned_cells(cfg)
        progress.total(count["n"])
        spec = _spec(cfg, model, list(plan.formats))
        evaluation = ModelEvaluation(spec, model, lm=lm)
        evaluation.check()
        refuse_nonfinite_weights(lm.name, lm.model, "a card")
        fp = evaluation.fp_record()
        refuse_unscorable(lm.name, fp, "a card")
        progress.cell(fp, evaluation.fp_reused)
        progress.estimate(planned_cells(cfg), fp.get("eval_seconds") or 0.0, lm.name)
        profile, _ = profile_record(evaluation, fp, cfg.device)
        formats = []
        resolved: dict[str, list[dict[str, Any]]] = {}  # the final record's cell id -> --resolve's steps
        # scheme name -> its record on the card's own tokens: the repair reuses that one, since a row --resolve
        # re-evaluated on more tokens no longer shares the sensitivity study's protocol
        at_budget: dict[str, dict[str, Any]] = {}
        for scheme in plan.formats:
            record, reused = cell_record(spec, evaluation, scheme, "fake")
            progress.cell(record, reused)
            at_budget[record["scheme"]["name"]] = record
            formats.append(
                _resolve_row(
                    cfg,
                    record,
                    resolved,
                    lambda t, s=scheme, m=model, x=lm: _format_at(cfg, m, x, s, t, progress),
                )
            )
        window = default_window(lm.model, cfg.window)
        kv = []
        kv_win = kv_window(lm.model, window)
        # the KV rows' own protocol when their window is longer than the evaluation's (one more float record)
        kv_cfg = cfg if kv_win == window else replace(cfg, window=kv_win)
        if kv_win != window:
            count["n"] += 1
            progress.total(count["n"])
        configs = kv_configs(cfg, kv_win)
        planned_kv = len(plan.kv_rows) if cfg.kv_scheme is None else 2 * len(kv_widths(plan, cfg.kv_scheme))
        if len(configs) != planned_kv:  # a window of ≤ 32 tokens: KIVI's rows are the per-token ones
            count["n"] -= planned_kv - len(configs)
            progress.total(count["n"])
        problems = {c.label: kv_problem(lm, c) for c in configs}
        skipped: dict[str, list[str]] = {}
        for label, why in problems.items():
            if why:
                skipped.setdefault(why, []).append(label)
        if skipped:
            count["n"] -= sum(map(len, skipped.values()))
            progress.total(count["n"])
        for why, labels in skipped.items():
            progress.note(f"{lm.name}: KV rows {', '.join(labels)} skipped: {why}")
        for config in configs:
            if problems[config.label]:
                kv.append(skipped_kv_record(config, problems[config.label]))
                continue
            kv_spec = _spec(kv_cfg, model, ["fp"], kv=config)
            seen: list[bool] = []
            records = run_grid(kv_spec, lambda r, reused, seen=seen: seen.append(reused), loaded={model: lm})
            if kv_win != window and not any("cell_id" in r for r in kv):  # the KV window's float record, once
                progress.cell(records[0], seen[0])
            progress.cell(records[-1], seen[-1])
            kv.append(
                _resolve_row(
                    kv_cfg,
                    records[-1],
                    resolved,
                    lambda t, c=config, m=model, x=lm, k=kv_cfg: _kv_at(k, m, x, c, t, progress),
                )
            )
        sweep = None
        if plan.sweep_families:
            from qbench.studies.sweep import run_sweep

            on_sweep = _new_cells_only(progress, {r["cell_id"] for r in [fp, *formats]})
            sweep = run_sweep(
                sweep_config(cfg, model), on_record=on_sweep, command=cfg.command, loaded={model: lm}
            )
        # the repair: each candidate in turn until one pays (within, and smaller than what already passes)
        repairs = []
        source_bytes = _quantised_source_bytes(fp)
        limit, _ = size_to_beat(formats, fp, profile, cfg.tolerance, cfg.metric, source_bytes)
        for target in repair_targets(formats, fp, profile, cfg.tolerance, cfg.metric, source_bytes)[
            : plan.repair_candidates
        ]:
            record = at_budget[target["scheme"]["name"]]
            study = _sensitivity(cfg, lm, record, progress, count)
            repairs.append(study)
            size = repaired_bytes(record, study, fp, profile)
            if study["repair"]["reached"] and size is not None and (limit is None or size < limit):
                break
        # where the most damaged format's damage comes from: a map by type (no repair), the layers "avoid" names
        avoid_map = None
        worst = _worst_beyond(formats, cfg.tolerance, cfg.metric)
        if worst is not None:
            name = worst["scheme"]["name"]
            tried = next((r for r in repairs if r["scheme"]["name"] == name and r["by"] == "type"), None)
            avoid_map = tried or _sensitivity(cfg, lm, at_budget[name], progress, count, repair=False)
        speed = speed_record(cfg, lm, fp, plan.formats)
        layers_speed = layer_speed_record(cfg, lm, fp, profile, plan.formats)
        per_model.append(
            {
                "fp": fp,
                "profile": profile,
                "formats": formats,
                "kv": kv,
                "sweep": sweep,
                "repairs": repairs,
                "avoid_map": avoid_map,
                "speed": speed,
                "layer_speed": layers_speed,
                "source": lm.source,
                "source_bytes": source_bytes,
                "window_nll": _window_nll(Path(cfg.output_path), [fp, *formats]),
                "resolved": resolved,
                "paths": _stored_paths(
                    Path(cfg.output_path), [fp, *formats, *(r for r in kv if "cell_id" in r)]
                ),
            }
        )
    sweeps = [m["sweep"] for m in per_model if m["sweep"]]
    # one run_sweep per model (one model in memory at a time); DIR/sweep.json then holds them all
    if len(sweeps) > 1:
        from qbench.studies.sweep import write_outputs

        merged = {
            **sweeps[-1],
            "models": {k: v for s in sweeps for k, v in s["models"].items()},
            "cells": [c for s in sweeps for c in s["cells"]],
            "breaking_points": [p for s in sweeps for p in s["breaking_points"]],
        }
        write_outputs(merged, Path(cfg.output_path))
    card = build_card(
        per_model,
        settings={
            "budget": plan.name,
            "budget_contents": contents,
            "tolerance_pct": cfg.tolerance,
            "metric": cfg.metric,
            "resolve_tokens": cfg.resolve_tokens,
            "command": cfg.command,
            "seed": cfg.seed,
            "output_path": str(cfg.output_path),
            "wall_seconds": round(time.perf_counter() - start, 3),
            "device": cfg.device,
        },
    )
    # what only the models could tell (their window, the KV scheme it chose): the cells stay on disk either way
    check_output(cfg, card_inputs(json.loads(json.dumps(card))))
    write_card(card, Path(cfg.output_path))
    return card


def _tokens(cfg: CardConfig) -> int:
    return cfg.tokens or cfg.plan.tokens


def _resolve_row(
    cfg: CardConfig,
    record: dict[str, Any],
    resolved: dict[str, list[dict[str, Any]]],
    evaluate: Callable[[int], dict[str, Any]],
) -> dict[str, Any]:
    """``record``, or with ``--resolve`` and an undecided verdict the same cell re-evaluated at doubling tokens
    until decided or at the cap (``qbench.studies.resolve``); its steps go to ``resolved`` by cell id."""
    if not cfg.resolve_tokens or record.get("status") != "ok":
        return record
    from qbench.studies.resolve import resolve

    final, steps = resolve(record, evaluate, _tokens(cfg), cfg.resolve_tokens, cfg.tolerance, cfg.metric)
    if steps:
        resolved[final["cell_id"]] = steps
    return final


def _format_at(cfg: CardConfig, model: str, lm: Any, scheme: str, tokens: int, progress: Progress) -> dict:
    """A format's cell on ``tokens`` tokens (its float baseline of that protocol first)."""
    from dataclasses import replace

    from qbench.eval.harness import ModelEvaluation, cell_record

    bigger = replace(cfg, tokens=tokens)
    spec = _spec(bigger, model, [scheme])
    evaluation = ModelEvaluation(spec, model, lm=lm)
    evaluation.check()
    evaluation.fp_record()
    record, reused = cell_record(spec, evaluation, scheme, "fake")
    progress.cell(record, reused)
    return record


def _kv_at(cfg: CardConfig, model: str, lm: Any, config: Any, tokens: int, progress: Progress) -> dict:
    """A KV row's cell on ``tokens`` tokens."""
    from dataclasses import replace

    from qbench.eval.harness import run_grid

    seen: list[bool] = []
    spec = _spec(replace(cfg, tokens=tokens), model, ["fp"], kv=config)
    records = run_grid(spec, lambda r, reused: seen.append(reused), loaded={model: lm})
    progress.cell(records[-1], seen[-1])
    return records[-1]


def _window_nll(out: Path, records: Sequence[dict[str, Any]]) -> dict[str, list[float]]:
    """{cell_id: mean NLL of each window} from the records' per-token sidecars (``qbench.eval.evidence``): what
    the side-by-side comparison pairs across models on the same windows. Records without a sidecar are left out."""
    from qbench.eval.evidence import read
    from qbench.eval.harness import stored_path

    found = {}
    for r in records:
        if r.get("status") != "ok" or not r.get("cell_id"):
            continue
        tensors = read(stored_path(out, r), r)
        if tensors is not None and "nll" in tensors:
            found[r["cell_id"]] = [round(v, 9) for v in tensors["nll"].double().mean(dim=1).tolist()]
    return found


def _stored_paths(out: Path, records: Sequence[dict[str, Any]]) -> dict[str, str]:
    """{cell_id: the record's file relative to ``out``}: the card names the record behind each row."""
    from qbench.eval.harness import stored_path

    return {r["cell_id"]: str(stored_path(out, r).relative_to(out)) for r in records}


def _new_cells_only(progress: Progress, seen: set[str]) -> Callable[[dict[str, Any], bool], None]:
    """The sweep's ``on_record``: its float record and the cells that are also formats were counted already."""

    def on_record(record: dict[str, Any], reused: bool) -> None:
        if record["cell_id"] not in seen:
            seen.add(record["cell_id"])
            progress.cell(record, reused)

    return on_record


def _sensitivity(
    cfg: CardConfig,
    lm: Any,
    target: dict[str, Any],
    progress: Progress,
    count: dict[str, int],
    repair: bool = True,
) -> dict:
    """``qbench sensitivity``'s map and repair of ``target``'s scheme (by the budget's unit), in
    ``DIR/sensitivity/<model>/<scheme>/`` with its cells under ``cells/``. The repair starts from ``target``,
    the card's own record of that format on its own tokens (not evaluated again); the quick budget's repair is not
    minimised. ``repair=False``: the map alone, by type (which kinds of layer a format's damage comes from: what
    "avoid" names), its cells in the same folder (a later repair of that format reuses them when the unit
    matches)."""
    from qbench.studies.sensitivity import sensitivity, write_sensitivity

    scheme = target["scheme"]["name"]

    out = Path(cfg.output_path) / "sensitivity" / lm.name / _slug(scheme)
    # the card's own float record (same protocol and statistics): the study does not evaluate the float model again
    spec = _spec(cfg, lm.source, [scheme], baseline_path=Path(cfg.output_path))
    spec.output_path = out / "cells"
    repairs = {"seen": 0}

    def on_units(n: int) -> None:
        count["n"] += n + int(
            repair
        )  # the units, and the repair's first set (the rest are known one at a time)
        progress.total(count["n"])

    def on_cell(phase: str, record: dict[str, Any], reused: bool) -> None:
        if phase == "repair":
            repairs["seen"] += 1
            if repairs["seen"] > 1:
                count["n"] += 1
                progress.total(count["n"])
        progress.cell(record, reused)

    result = sensitivity(
        spec,
        by=cfg.plan.sensitivity_by if repair else "type",
        tolerance=cfg.tolerance,
        metric=cfg.metric,
        on_cell=on_cell,
        on_units=on_units,
        lm=lm,
        minimise=cfg.plan.repair_minimise,
        quantised=target,
        repair_units=repair,
    )
    # written for the map alone too: its sensitivity.json marks the folder as a study's, which compare and
    # read_records leave out (its cells keep most layers in float) — unless a repair's report is already there
    # (the full budget repairs by layer and maps by type in the same folder): that one is the richer
    if repair or not (out / "sensitivity.json").exists():
        write_sensitivity(result, out, cfg.command or "qbench card")
    return {**result, "output": str(out)}


def _deployed_bytes(
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
        _float_size(fp),
        rest_size=rest_size,
    )


def _quantised_source_bytes(fp: Mapping[str, Any]) -> int | None:
    """The size of the source file when its weights are already block-quantised (a GGUF of Q8_0, Q4_1, Q4_K…
    tensors): the card's reference is that file, so a repaired format must beat it too. None for float sources."""
    from qbench.eval.gguf import block_quantised

    model = fp.get("model") or {}
    path = Path(str(model.get("path") or ""))
    return path.stat().st_size if block_quantised(model.get("gguf")) and path.is_file() else None


# Gu et al. 2024 ("When Attention Sink Emerges in Language Models", ICLR 2025) count a head as a sink when its mean
# attention weight on the first token exceeds ε = 0.3 (their Sink_ε: the share of such heads).
SINK_EPSILON = 0.3
# "No sink" up to this many times uniform attention's share: a randomly initialised gpt2-130m measures 1.0×, the
# sink-free demo models 0.7-1.6× (mean weight and top-1 share); a strict "above uniform" called the random one a sink.
SINK_CHANCE_MARGIN = 2.0


def sink_heads_share(head_mass: Sequence[Sequence[float]] | None) -> float | None:
    """Gu et al.'s Sink_ε: the share of (layer, head) pairs whose mean weight on key 0 exceeds :data:`SINK_EPSILON`
    (None without per-head weights)."""
    flat = [v for row in head_mass or () for v in row if v is not None]
    return sum(v > SINK_EPSILON for v in flat) / len(flat) if flat else None


def sink_verdict(
    mass: float | None, top1: float | None, chance: float | None, heads_share: float | None = None
) -> str | None:
    """``"sink"`` when some head puts more than :data:`SINK_EPSILON` of its attention on key 0 (``heads_share`` >
    0: Gu et al.'s criterion; without per-head weights, the mean weight over all heads reaching it); ``"no sink"``
    when both the mean weight and the top-1 share stay within :data:`SINK_CHANCE_MARGIN` × uniform causal
    attention's (``chance``); otherwise ``"weak"``: clearly above chance, no head a sink."""
    if chance is None or mass is None:
        return None
    if (heads_share or 0) > 0 or mass > SINK_EPSILON:
        return "sink"
    limit = SINK_CHANCE_MARGIN * chance
    if mass <= limit and (top1 is None or top1 <= limit):
        return "no sink"
    return "weak"


def _float_size(fp: Mapping[str, Any]) -> int:
    """Bytes per element of the evaluated float model."""
    return 2 if ((fp.get("protocol") or {}).get("dtype") or "float32") in ("bfloat16", "float16") else 4


def repair_targets(
    formats: Sequence[Mapping[str, Any]],
    fp: Mapping[str, Any],
    profile: Mapping[str, Any],
    tolerance: float,
    metric: str = "ppl",
    source_bytes: int | None = None,
) -> list[Mapping[str, Any]]:
    """The formats a repair could pay for, in the order the card tries them: the formats decidedly beyond the
    tolerance that are smaller (deployed bytes) than what must be beaten (:func:`size_to_beat`), smallest first. A repair keeps layers in float, so it
    only adds bytes: a format not already smaller than the smallest passing one (or, with none, than the model in
    bf16 or a smaller block-quantised source file) could never pay, and the smallest candidate is the repair
    that would save the most if it reaches the tolerance."""
    from qbench.eval.evidence import BEYOND, decide

    limit, _ = size_to_beat(formats, fp, profile, tolerance, metric, source_bytes)
    sized = [(r, _deployed_bytes(r["scheme"], fp, profile)) for r in formats if r.get("status") == "ok"]
    # decidedly beyond only: an undecided format may pass as it is (more tokens decide it: --resolve), and a
    # repair of a format that already lowers perplexity could only keep everything in float
    failing = [
        (b, i, r)
        for i, (r, b) in enumerate(sized)
        if b and decide(r, tolerance, metric).verdict == BEYOND and (limit is None or b < limit)
    ]
    return [x[2] for x in sorted(failing, key=lambda x: x[:2])]


def repaired_bytes(
    target: Mapping[str, Any], study: Mapping[str, Any], fp: Mapping[str, Any], profile: Mapping[str, Any]
) -> int | None:
    """The deployed size of ``target``'s format with the repair's units kept in float."""
    repair = study.get("repair") or {}
    scheme = {
        **target["scheme"],
        "exclude": [*(target["scheme"].get("exclude") or []), *repair.get("exclude", [])],
    }
    return _deployed_bytes(scheme, fp, profile)


def size_to_beat(
    formats: Sequence[Mapping[str, Any]],
    fp: Mapping[str, Any],
    profile: Mapping[str, Any],
    tolerance: float,
    metric: str = "ppl",
    source_bytes: int | None = None,
) -> tuple[int | None, str]:
    """(bytes, what) a repaired format must be smaller than to pay: the smallest of the formats within the
    tolerance, the whole model in bf16 (what a deployment falls back to; its own damage not measured here) and,
    for a source file whose weights are already block-quantised (a Q4_1 GGUF: ``source_bytes``), that file — it is
    the card's reference, so it has no damage of its own to beat."""
    options = [
        (b, f"`{r['scheme']['name']}`, which passes as it is")
        for r in formats
        if r.get("status") == "ok"
        and _within(r, tolerance, metric)
        and (b := _deployed_bytes(r["scheme"], fp, profile))
    ]
    fp_bytes = fp.get("model_bytes") or 0
    if fp_bytes:
        options.append((fp_bytes * 2 // _float_size(fp), "the model in bf16"))
    if source_bytes:
        options.append(
            (source_bytes, "the source file itself, already block-quantised (the card's reference)")
        )
    if not options:
        return None, "the model in bf16"
    return min(options, key=lambda o: o[0])


def _worst_beyond(
    formats: Sequence[Mapping[str, Any]], tolerance: float, metric: str = "ppl"
) -> Mapping[str, Any] | None:
    """The format record decidedly beyond the tolerance with the largest perplexity change (NaN/inf first)."""
    from qbench.eval.evidence import BEYOND, decide

    beyond = [
        r
        for r in formats
        if r.get("status") == "nonfinite"
        or (r.get("status") == "ok" and decide(r, tolerance, metric).verdict == BEYOND)
    ]
    if not beyond:
        return None
    return max(beyond, key=lambda r: math.inf if r.get("status") != "ok" else r["metrics"]["ppl_change_pct"])


def _within(record: Mapping[str, Any], tolerance: float, metric: str = "ppl") -> bool:
    """Whether a record is *within* the tolerance of ``metric``: its 95 % interval's upper end ≤ tolerance
    (undecided is not)."""
    from qbench.eval.evidence import decide

    return decide(record, tolerance, metric).within


# ----------------------------------------------------------------------------------------------- building


def _metric_info(key: str) -> dict[str, str]:
    m = BY_KEY[key]
    return {"label": m.label, "definition": m.definition, "unit": m.unit, "better": m.better}


_FORMAT_NAMES = {"int": "int", "fp8-e4m3": "FP8 E4M3", "mxfp8": "MXFP8", "mxfp6": "MXFP6", "mxfp4": "MXFP4"}


def _granularity(g: Mapping[str, Any] | None) -> str:
    kind = (g or {}).get("kind")
    if kind == "per_group":
        return f"g{g['group_size']}"
    return {"per_tensor": "per tensor", "per_axis": "per channel", "per_token": "per token"}.get(
        kind, str(kind)
    )


def quantised_text(scheme: Mapping[str, Any]) -> str:
    """What a format row quantised, in words a deployment uses: ``W4 MXFP4 g32 + A4 MXFP4 g32 (dynamic); RTN``.
    A rotation comes first (QuaRot's of the model, or an online Hadamard of each linear's input: the row's kernel
    speed does not include it); then weights and, where quantised, the activations entering each linear
    (dynamic: scales from each sequence's own values; static: calibrated once) and the outputs; then how the
    weights were rounded: RTN (round-to-nearest) or GPTQ (with its calibration windows)."""
    fmt = str(scheme.get("format") or "int")
    method, params = scheme.get("method"), scheme.get("params") or {}
    name = "NF4" if method == "bnb-nf4" else _FORMAT_NAMES.get(fmt, fmt.upper())

    def part(letter: str, bits: Any, g: Any) -> str:
        return f"{letter}{bits} {name} {_granularity(g)}"

    text = part("W", scheme.get("weight_bits"), scheme.get("weight_granularity"))
    if scheme.get("weight_symmetric") is False:
        text += " asymmetric"
    if method == "smoothquant":
        text = f"SmoothQuant α {params.get('alpha')} (calibrated), then {text}"
    elif method == "llm-int8":
        text += f", fp16 outlier columns above {params.get('threshold')}"
    elif method == "hadamard":  # an online random Hadamard rotation of each linear's input, then the grid
        text = f"Hadamard-rotated inputs (online, seed {params.get('seed', 0)}), then {text}"
    if scheme.get("rotate") == "quarot":  # the residual stream rotated into the weights before rounding
        text = f"QuaRot-rotated model (offline, plus 2 online rotations), then {text}"
    if scheme.get("act_bits") is None:
        text += ", weight-only"
    else:
        scales = "static scales" if scheme.get("static") else "dynamic scales"
        text += f" + {part('A', scheme.get('act_bits'), scheme.get('act_granularity'))} ({scales})"
    if scheme.get("out_bits") is not None:
        text += f" + O{scheme['out_bits']} {_granularity(scheme.get('out_granularity'))}"
    calibration = scheme.get("calibration") or {}
    split = calibration.get("split", "train")
    if "requested_tokens" in calibration:  # --calib-tokens: the windows follow from the window length
        windows = f"{calibration['requested_tokens']:,} calibration tokens"
    else:
        n = calibration.get("windows", scheme.get("calib_windows"))
        windows = f"{n} windows" if split == "all" else f"{n} {split} windows"
    if split == "all":  # --calib-data: a user's own file or folder, all of it
        windows += f" of {Path(str(calibration.get('corpus'))).name}"
    params = scheme.get("algo_params") or {}
    if scheme.get("algo") == "gptq":
        return text + f"; GPTQ ({windows}, damp {params.get('damp')})"
    if scheme.get("algo") == "awq":
        clip = ", clipping searched" if params.get("clip") else ""
        return text + f"; AWQ ({windows}, α grid {params.get('grid')}{clip})"
    return text + "; RTN"


def _change(record: Mapping[str, Any]) -> float | None:
    return record["metrics"]["ppl_change_pct"] if record.get("status") == "ok" else None


def _record_ref(record: Mapping[str, Any], paths: Mapping[str, str] | None) -> str | None:
    """Where ``record`` is stored, relative to the output path (``run_card`` collects them)."""
    return (paths or {}).get(record.get("cell_id") or "")


def _format_row(
    record: Mapping[str, Any],
    fp: Mapping[str, Any],
    profile: Mapping[str, Any],
    tolerance: float,
    speed: Mapping[str, Any] | None,
    out: Mapping[str, str] | None,
    metric: str = "ppl",
    resolved: Mapping[str, Any] | None = None,
    layer_speed: Mapping[str, Any] | None = None,
    kv_bf16_bytes: int | None = None,
) -> dict[str, Any]:
    from qbench.eval.evidence import row_fields

    nominal = _deployed_bytes(record["scheme"], fp, profile)
    held = _deployed_bytes(record["scheme"], fp, profile, rest_size=None)  # the rest as evaluated
    fp_bytes = fp.get("model_bytes") or 0
    bf16_model = fp_bytes * 2 // _float_size(fp) if fp_bytes else None

    scheme = record["scheme"]
    name = scheme["name"]
    fmt = FORMAT_BY_SCHEME.get(name) or next(
        (f for f in FORMATS if _canonical(f.scheme) == name), Format(name, name)
    )
    change = _change(record)
    speedup = None
    if speed:
        speedup = next(
            (
                r.get("speedup")
                for r in speed.get("records", [])
                if r.get("kind") == "model"
                and r.get("scheme") is not None
                and _canonical(r["scheme"]) == name
                and r.get("mode") == "real"
                and not r.get("error")
            ),
            None,
        )
    kernels = ((layer_speed or {}).get("schemes") or {}).get(_rtn_scheme(name)) or {}
    return {
        "label": fmt.label,
        "scheme": name,
        "scheme_label": scheme.get("label"),
        "quantised": quantised_text(scheme) if scheme.get("weight_bits") is not None else None,
        "note": fmt.note,
        "status": record.get("status"),
        "error": record.get("error"),
        "perplexity": record["metrics"]["perplexity"],
        "ppl_change_pct": change,
        **row_fields(record, tolerance, metric),
        **_resolved_fields(record, resolved),
        # as deployed: the quantised weights with their scales, every other tensor in bf16 (docs/card.md)
        "weight_bytes": nominal,
        "weight_bytes_rest_float": held,  # the same with the other tensors at the evaluated float width
        "bf16_model_bytes": bf16_model,
        "bytes_vs_bf16": nominal / bf16_model if nominal and bf16_model else None,
        # weights as deployed plus a bf16 KV cache at the model's context (kv_memory)
        "memory_bytes": nominal + kv_bf16_bytes if nominal and kv_bf16_bytes else None,
        "weight_bits": scheme.get("weight_bits"),
        "speedup": speedup,
        # the model's linear layers alone on its own shapes (qbench.studies.layerspeed), real kernels vs float32
        "decode_speedup": kernels.get("decode"),
        "prefill_speedup": kernels.get("prefill"),
        # a rotated row runs the plain format's kernels plus online rotations that layer_speed does not time
        "speed_excludes": "online rotations"
        if scheme.get("rotate") == "quarot" or scheme.get("method") == "hadamard"
        else None,
        "record": _record_ref(record, out),
        "cell_id": record.get("cell_id"),
    }


def _canonical(name: str) -> str:
    try:
        from qbench.quant.schemes import get_scheme

        return get_scheme(name).name
    except UserError:
        return name


def _resolved_fields(record: Mapping[str, Any], resolved: Mapping[str, Any] | None) -> dict[str, Any]:
    """A row's tokens and, when ``--resolve`` re-evaluated it, the steps (verdict per token budget) it took."""
    steps = (resolved or {}).get(record.get("cell_id") or "")
    return {"tokens_scored": (record.get("protocol") or {}).get("tokens_scored"), "resolved": steps or None}


KV_SCHEME_NAMES = {"kivi": "KIVI", "per-token": "per-token", "fp8-e4m3": "FP8 E4M3", "fp8-e5m2": "FP8 E5M2"}


def _kv_axis(scheme: str, keep_sinks: int) -> str:
    """A KV curve's name in the breaking points: ``kv kivi``, ``kv kivi +1 sink``, ``kv per-token``."""
    return f"kv {scheme}" + (f" +{keep_sinks} sink{'s' if keep_sinks > 1 else ''}" if keep_sinks else "")


def _kv_rows(
    kv: Sequence[Mapping[str, Any]],
    tolerance: float,
    out: Mapping[str, str] | None,
    metric: str = "ppl",
    resolved: Mapping[str, Any] | None = None,
    window: Mapping[str, Any] | None = None,
    memory: Mapping[str, Any] | None = None,
) -> dict[str, Any]:
    """The KV section: one row per KV record (every scheme of the budget side by side), each scheme's description
    once, a breaking point per (scheme, sinks kept) curve of two or more widths, and the window the rows were read
    at (``window``: run_card's ``kv_window``). ``memory``: ``kv_memory``'s bytes per row label."""
    from qbench.eval.evidence import row_fields
    from qbench.quant.kvschemes import float_read_share
    from qbench.studies.sweep import breaking_point_range

    rows = []
    for r in kv:
        block = r.get("kv") or {}
        change = _change(r)
        protocol_window = (r.get("protocol") or {}).get("window")
        reads = float_read_share(block, protocol_window) if block.get("scheme") and protocol_window else None
        rows.append(
            {
                "bits": block.get("bits"),
                "keep_sinks": block.get("keep_sinks", 0),
                "label": block.get("label"),
                "scheme": block.get("scheme"),
                "scheme_name": KV_SCHEME_NAMES.get(block.get("scheme"), block.get("scheme")),
                "float_reads": reads,  # shares of key / value reads served in float (kvschemes.float_read_share)
                "perplexity": r["metrics"]["perplexity"],
                "ppl_change_pct": change,
                "status": r.get("status"),
                **row_fields(r, tolerance, metric),
                **_resolved_fields(r, resolved),
                "cache_bytes": (memory or {}).get("rows", {}).get(block.get("label")),
                "record": _record_ref(r, out),
            }
        )
    measured = [row for row in rows if row["status"] != "skipped"]
    points = {}
    for scheme, keep in dict.fromkeys((row["scheme"], row["keep_sinks"]) for row in measured):
        curve = {
            row["bits"]: row["verdict"]
            for row in measured
            if (row["scheme"], row["keep_sinks"]) == (scheme, keep)
        }
        if len(curve) < 2:  # one width is a row, not a curve
            continue
        certain, possible = breaking_point_range(curve)
        points[_kv_axis(scheme, keep)] = {
            "bits": certain,
            "possible_bits": possible,
            "lowest_swept": min(curve),
        }
    schemes = []
    for scheme in dict.fromkeys(row["scheme"] for row in rows):
        blocks = [(r.get("kv") or {}) for r in kv if (r.get("kv") or {}).get("scheme") == scheme]
        plain = next((b for b in blocks if not b.get("keep_sinks")), blocks[0])
        schemes.append(
            {
                "scheme": scheme,
                "name": KV_SCHEME_NAMES.get(scheme, scheme),
                "options": {k: plain.get(k) for k in KV_INPUTS if plain.get(k) is not None},
                # the scheme itself (its rows without sinks kept): causal = statistics of the tokens seen so far
                "causal": plain.get("causal") == "yes",
                "keys": plain.get("keys"),
                "values": plain.get("values"),
            }
        )
    skipped = [
        {"label": (r.get("kv") or {}).get("label"), "reason": r.get("error")}
        for r in kv
        if r.get("status") == "skipped"
    ]
    scored = next(((r.get("protocol") or {}).get("window") for r in kv if r.get("protocol")), None)
    w = dict(window or {})
    w.setdefault("window", scored)
    w["short"] = bool(w.get("window") and w["window"] < (w.get("minimum") or KV_MIN_WINDOW))
    return {
        "window": w,
        "memory": {k: v for k, v in (memory or {}).items() if k != "rows"} or None,
        "schemes": schemes,
        "rows": rows,
        "skipped": skipped,
        "breaking_points": points,
    }


def _breaking_points(
    sweep: Mapping[str, Any] | None, model: str, kv: Mapping[str, Any]
) -> list[dict[str, Any]]:
    from qbench.studies.sweep import format_breaking_point

    out = []
    if sweep:
        curves: dict[tuple[str, str], dict[int, Any]] = {}
        for c in sweep["cells"]:
            if c["model"] == model:
                curves.setdefault((c["family"], c["axis"]), {})[c["bits"]] = {
                    "ppl_change_pct": c["ppl_change_pct"] if c["status"] == "ok" else None,
                    "ppl_ratio": c["ppl_ratio"] if c["status"] == "ok" else None,
                    "status": c["status"],
                    "verdict": c.get("verdict"),
                    "ppl_change_ci95": c.get("ppl_change_ci95"),
                }
        for p in sweep["breaking_points"]:
            if p["model"] == model:
                curve = curves.get((p["family"], p["axis"]), {})
                out.append(
                    {
                        "family": p["family"],
                        "axis": p["axis"],
                        "bits": p["bits"],
                        "text": format_breaking_point(p),
                        "curve": {str(b): curve[b] for b in sorted(curve, reverse=True)},
                    }
                )
    for axis, p in kv["breaking_points"].items():
        entry = {
            "bits": p["bits"],
            "possible_bits": p.get("possible_bits"),
            "lowest_swept": p["lowest_swept"],
        }
        text = format_breaking_point(entry) if p["lowest_swept"] is not None else "-"
        curve = {
            str(row["bits"]): {"ppl_change_pct": row["ppl_change_pct"], "status": row["status"]}
            for row in kv["rows"]
            if _kv_axis(row["scheme"], row["keep_sinks"]) == axis and row["status"] != "skipped"
        }
        out.append({"family": "fp", "axis": axis, "bits": p["bits"], "text": text, "curve": curve})
    return out


def _head_mass(profile: Mapping[str, Any]) -> Any:
    return (profile.get("attention_per_head") or {}).get("mass")


def _outlier_profile(fp: Mapping[str, Any], profile: Mapping[str, Any]) -> dict[str, Any]:
    massive = fp.get("massive_activations") or {}
    sites = {s["layer"]: s for s in profile.get("massive_sites") or []}
    per_layer = fp.get("outliers_per_layer") or {}
    layers = []
    for i, _ in enumerate(per_layer.get("max_abs") or []):
        m = next((x for x in massive.get("layers", []) if x["layer"] == i), {})
        s = sites.get(i, {})
        layers.append(
            {
                "layer": i,
                "kurtosis_first": per_layer["kurtosis_first"][i],
                "kurtosis_other": per_layer["kurtosis_other"][i],
                "max_abs": per_layer["max_abs"][i],
                "max_abs_first": per_layer["max_abs_first"][i],
                "max_abs_other": per_layer["max_abs_other"][i],
                "massive_count": m.get("count", 0),
                "massive_channels": m.get("channels", []),
                "massive_positions": s.get("positions", []),
                "massive_position_kinds": m.get("positions", {}),
                "massive_sites": s.get("sites", []),
                "median_abs": m.get("median"),
                "top": m.get("top", []),
            }
        )
    linear = [
        {
            "name": name,
            "lm_head": v["lm_head"],
            "input_crest": v.get("input_crest"),
            "input_kurtosis": v.get("input_kurtosis"),
            "input_absmax": v.get("input_absmax"),
            "input_int8_sqnr_db": v.get("input_int8_sqnr_db"),
            "weight_crest": v.get("weight_crest"),
        }
        for name, v in ((fp.get("linear_ranges") or {}).get("per_layer") or {}).items()
    ]
    o = fp["outliers"]
    ranked = sorted((x for x in linear if x["input_crest"] is not None), key=lambda x: -x["input_crest"])
    from models.stats import uniform_first_key_share

    window = (fp.get("protocol") or {}).get("window")
    chance = uniform_first_key_share(window) if window and window > 1 else None
    mass, top1 = o.get("first_token_mass"), o.get("first_token_top1_share")
    return {
        # uniform causal attention's share on key 0 (models.stats): the chance level of both the mean weight and
        # the top-1 share; see sink_verdict for the three readings
        "sink_chance": chance,
        "sink": sink_verdict(mass, top1, chance, heads := sink_heads_share(_head_mass(profile))),
        "sink_heads_share": heads,
        "sink_vs_chance": mass / chance if chance and mass is not None else None,
        "sink_top1_vs_chance": top1 / chance if chance and top1 is not None else None,
        "summary": {
            "kurtosis_first": o.get("kurtosis_first"),
            "kurtosis_other": o.get("kurtosis_other"),
            "max_abs": o.get("max_abs"),
            "first_token_top1_share": o.get("first_token_top1_share"),
            "first_token_mass": o.get("first_token_mass"),
            "massive_total": massive.get("total"),
            "max_input_crest": (fp.get("linear_ranges") or {}).get("max_input_crest"),
            "max_weight_crest": (fp.get("linear_ranges") or {}).get("max_weight_crest"),
        },
        "massive_threshold": massive.get("threshold"),
        "windows": o.get("windows"),
        "layers": layers,
        "linear": linear,
        "linear_worst": [
            x["name"] for x in ranked[:LINEAR_TABLE_ROWS]
        ],  # the tables' rows; the figure has all
    }


def _repair_section(
    entry: Mapping[str, Any],
    fp: Mapping[str, Any],
    profile: Mapping[str, Any],
    settings: Mapping[str, Any],
    tolerance: float,
    metric: str,
) -> dict[str, Any] | None:
    """The repair the card shows: of the studies tried in turn (``entry["repairs"]``; a card before the
    candidates held one, ``entry["sensitivity"]``), the first that pays — within the tolerance and smaller than
    what must be beaten (:func:`size_to_beat`) — else the first tried; with every try's outcome and the size to
    beat."""
    studies = list(entry.get("repairs") or ([entry["sensitivity"]] if entry.get("sensitivity") else []))
    if not studies:
        return None
    limit, what = size_to_beat(entry["formats"], fp, profile, tolerance, metric, entry.get("source_bytes"))
    tries = []
    for study in studies:
        target = next((r for r in entry["formats"] if r["scheme"]["name"] == study["scheme"]["name"]), None)
        size = repaired_bytes(target, study, fp, profile) if target is not None else None
        r = study["repair"]
        tries.append(
            {
                "scheme": study["scheme"]["name"],
                "reached": r["reached"],
                "count": r["count"],
                "quantised_ppl_change_pct": r["quantised_ppl_change_pct"],
                "ppl_change_pct": r["ppl_change_pct"],
                "weight_bytes": size,
                "pays": bool(r["reached"] and size is not None and (limit is None or size < limit)),
            }
        )
    chosen = next((i for i, t in enumerate(tries) if t["pays"]), 0)
    sens = _sensitivity_section(studies[chosen], fp, entry["source"], settings)
    sens["repair"]["weight_bytes"] = tries[chosen]["weight_bytes"]
    bf16 = (fp.get("model_bytes") or 0) * 2 // _float_size(fp)
    size = tries[chosen]["weight_bytes"]
    sens["repair"]["bytes_vs_bf16"] = size / bf16 if size and bf16 else None
    sens["repair"]["pays"] = tries[chosen]["pays"]
    sens["repair"]["beat"] = {"bytes": limit, "what": what}
    sens["tries"] = tries
    return sens


def _map_section(study: Mapping[str, Any] | None, k: int = 3) -> dict[str, Any] | None:
    """The avoid map: which units carry a failing format's damage, the ``k`` worst with their change alone."""
    if not study:
        return None
    return {
        "scheme": study["scheme"]["name"],
        "by": study["by"],
        "output": study.get("output"),
        "top": [{"name": u["name"], "ppl_change_pct": u.get("ppl_change_pct")} for u in study["units"][:k]],
        "units": len(study["units"]),
    }


def _sensitivity_section(
    sens: Mapping[str, Any] | None,
    fp: Mapping[str, Any],
    source: str,
    settings: Mapping[str, Any],
    k: int = 5,
) -> dict[str, Any] | None:
    if not sens:
        return None
    r = sens["repair"]
    p = fp["protocol"]
    scheme = sens["scheme"]["name"]
    q = shlex.quote
    options = [
        f"--ckpt {q(str(source))}",
        f"--scheme {q(scheme)}",
        *(f"--exclude {q(n)}" for n in r["exclude"]),
        f"--data {q(p['corpus'])}",
        *([f"--split {p['split']}"] if p.get("split") != "validation" else []),
        f"--tokens {p['tokens']}",
        f"--window {p['window']}",
        *([] if p.get("bos", True) else ["--no-bos"]),
        *([f"--batch-size {p['batch_size']}"] if p.get("batch_size", 8) != 8 else []),
        *([f"--dtype {p['dtype']}"] if (p.get("dtype") or "float32") != "float32" else []),
        f"--seed {settings.get('seed', 0)}",
        f"--output-path {q(str(settings.get('output_path')))}",
    ]
    command = "qbench run " + " ".join(options)
    return {
        "scheme": scheme,
        "by": sens["by"],
        "output": sens.get("output"),
        "top": [
            {
                key: u.get(key)
                for key in (
                    "name",
                    "ppl",
                    "ppl_change_pct",
                    "status",
                    "input_crest",
                    "input_kurtosis",
                    "max_abs",
                    "weight_crest",
                )
            }
            for u in sens["units"][:k]
        ],
        "units": len(sens["units"]),
        "correlation": sens["correlation"],
        "repair": {
            "reached": r["reached"],
            "minimised": r.get("minimised", True),  # studies before the option always minimised
            "exclude": r["exclude"],
            "count": r["count"],
            "weight_share_float": r["weight_share_float"],
            "quantised_ppl_change_pct": r["quantised_ppl_change_pct"],
            "ppl": r["ppl"],
            "ppl_change_pct": r["ppl_change_pct"],
            "ppl_change_ci95": r.get("ppl_change_ci95"),
            "kld_mean": r.get("kld_mean"),
            "top1_agreement": r.get("top1_agreement"),
            "tolerance_pct": r["tolerance_pct"],
        },
        "command": command,
    }


def _failure_text(f: Mapping[str, Any]) -> str:
    """A row's measured failure: ``+98.20 % [+36.83, +187.09], KLD 0.699, top-1 56.4 %`` (NaN/inf when it had no
    finite perplexity)."""
    if f.get("ppl_change_pct") is None:
        return "NaN/inf perplexity"
    text = _pct(f["ppl_change_pct"])
    ci = f.get("ppl_change_ci95")
    if ci:
        text += f" [{ci[0]:+.2f}, {ci[1]:+.2f}]"
    if f.get("kld_mean") is not None:
        text += f", KLD {f['kld_mean']:.3g}"
    if f.get("top1_agreement") is not None:
        text += f", top-1 {100 * f['top1_agreement']:.1f} %"
    return text


def _verdict(
    formats: Sequence[Mapping[str, Any]],
    outliers: Mapping[str, Any],
    fp: Mapping[str, Any],
    sens: Mapping[str, Any] | None,
    tolerance: float,
    metric: str = "ppl",
    avoid_map: Mapping[str, Any] | None = None,
    beat: tuple[int | None, str] | None = None,
) -> dict[str, Any]:
    """Generated from the rows, short lines: the smallest format within tolerance (fewest model bytes; ties:
    smaller change), the formats still undecided (one line), every format to avoid (decidedly beyond, worst first,
    one line), then the worst one's and every mapped one's measured failure with — where a sensitivity map of it
    was measured — the units its damage comes from, what the post-training algorithms rescued, and the measured
    repair with whether it pays (or, with ``beat`` = :func:`size_to_beat`'s answer, why none was tried). Commands
    go to ``commands``, not into the lines."""
    ok = [f for f in formats if f["within_tolerance"] and f["weight_bytes"]]
    smallest = min(ok, key=lambda f: (f["weight_bytes"], f["ppl_change_pct"])) if ok else None
    # measured and decidedly beyond (or NaN/inf): a row the model could not run (unsupported, error) is no failure
    beyond = [
        f
        for f in formats
        if (f["status"] == "ok" and f.get("verdict") == "beyond") or f["status"] == "nonfinite"
    ]
    beyond.sort(key=lambda f: -(math.inf if f["ppl_change_pct"] is None else f["ppl_change_pct"]))
    maps = {m["scheme"]: m for m in (avoid_map, sens) if m}
    avoid = []
    for f in beyond:
        mapped = maps.get(f["scheme"])
        avoid.append(
            {
                "label": f["label"],
                "scheme": f["scheme"],
                "ppl_change_pct": f["ppl_change_pct"],
                "ppl_change_ci95": f.get("ppl_change_ci95"),
                "kld_mean": f.get("kld_mean"),
                "top1_agreement": f.get("top1_agreement"),
                "status": f["status"],
                # the units the sensitivity map blames, worst first, each quantised alone: only those that cost
                # something (a unit that lowers perplexity alone carries none of the damage)
                "blamed": [
                    {"name": u["name"], "ppl_change_pct": u["ppl_change_pct"]}
                    for u in mapped["top"]
                    # a unit that alone makes the perplexity NaN/inf (change None) is the worst of all
                    if u.get("ppl_change_pct") is None or u["ppl_change_pct"] > 0
                ][:3]
                if mapped
                else None,
                "blamed_by": mapped and mapped["by"],
            }
        )
    repair = None
    if sens:
        repair = {"scheme": sens["scheme"], **sens["repair"], "command": sens["command"]}
        if "pays" not in repair:  # a section built before the size to beat was computed for it
            beaten = smallest is None or (
                repair.get("weight_bytes") is not None and repair["weight_bytes"] < smallest["weight_bytes"]
            )
            repair["pays"] = bool(repair["reached"] and beaten)
    from qbench.eval.evidence import tolerance_text

    limit = tolerance_text(tolerance, metric)
    lines = []
    if smallest:
        lines.append(
            f"Recommended: {smallest['label']} (`{smallest['scheme']}`), {_failure_text(smallest)}, "
            f"{_bytes(smallest['weight_bytes'])}"
            + (f" ({smallest['bytes_vs_bf16']:.1%} of the bf16 model)" if smallest["bytes_vs_bf16"] else "")
            + f": the smallest format within {limit}."
        )
    else:
        lines.append(
            f"Recommended: none — no format measured stays within {limit} (its 95 % interval's upper end)."
        )
    undecided = [f for f in formats if f["status"] == "ok" and f.get("verdict") == "undecided"]
    if undecided:
        parts = []
        for f in undecided:
            ci = f.get("ppl_change_ci95")
            parts.append(
                f"{f['label']} {_pct(f['ppl_change_pct'])}"
                + (f" [{ci[0]:+.2f}, {ci[1]:+.2f}]" if ci and f["ppl_change_pct"] is not None else "")
                + (
                    f" (~{f['tokens_to_decide']:,} tokens would decide it 4 times in 5)"
                    if f.get("tokens_to_decide")
                    else ""
                )
            )
        lines.append(f"Undecided (the interval straddles {limit}): " + "; ".join(parts) + ".")
    if avoid:
        listed = ", ".join(
            f"{a['label']} {'NaN/inf' if a['ppl_change_pct'] is None else _pct(a['ppl_change_pct'])}"
            for a in avoid
        )
        lines.append(f"Avoid (decidedly beyond {limit}), worst first: {listed}.")
    for i, a in enumerate(avoid):
        if i > 0 and not a["blamed"]:
            continue  # the list above and the format table carry its evidence
        text = f"{'Worst' if i == 0 else 'Avoided'}: {a['label']} (`{a['scheme']}`), {_failure_text(a)}"
        if a["blamed"]:
            units = ", ".join(f"`{u['name']}` {_pct(u['ppl_change_pct'])}" for u in a["blamed"])
            text += f"; its damage comes most from {units} (each quantised alone, sensitivity map by {a['blamed_by']})"
        elif a["blamed"] is not None:  # mapped, but no unit alone costs anything
            text += f"; no single unit quantised alone costs more than float (sensitivity map by {a['blamed_by']})"
        lines.append(text + ".")
    if not avoid and not undecided:
        lines.append(f"Every format measured stays within {limit}.")
    lines += _algorithm_lines(formats, limit)
    commands = []
    if repair:
        state = "within" if repair["reached"] else "still NOT within"
        size = f", {_bytes(repair.get('weight_bytes'))}" if repair.get("weight_bytes") else ""
        beat = repair.get("beat") or {}
        if repair["pays"]:
            worth = f"; smaller than {beat['what']} ({_bytes(beat['bytes'])})" if beat.get("bytes") else ""
        elif repair["reached"]:
            what = beat.get("what") or (f"{smallest['label']}, which passes as it is" if smallest else "")
            worth = f"; not smaller than {what}: that is the better choice" if what else ""
        else:
            worth = ""
        ci = repair.get("ppl_change_ci95")
        evidence = (f" [{ci[0]:+.2f}, {ci[1]:+.2f}]" if ci else "") + (
            f", KLD {repair['kld_mean']:.3g}" if repair.get("kld_mean") is not None else ""
        )
        ratio = f" ({repair['bytes_vs_bf16']:.1%} of the bf16 model)" if repair.get("bytes_vs_bf16") else ""
        lines.append(
            f"Repair of `{repair['scheme']}`: keep {repair['count']} unit(s) in float "
            f"({repair['weight_share_float']:.1%} of the quantised weights): "
            f"{_pct(repair['quantised_ppl_change_pct'])} → {_pct(repair['ppl_change_pct'])}{evidence}{size}{ratio} "
            f"({state} {limit}{worth}"
            + ("" if repair.get("minimised", True) else "; not minimised (standard minimises)")
            + ")."
        )
        for t in (sens or {}).get("tries") or []:
            if t["scheme"] == repair["scheme"]:
                continue
            outcome = (
                "did not reach the tolerance"
                if not t["reached"]
                else f"reached it at {_bytes(t['weight_bytes'])}, not smaller than {beat.get('what', 'what passes')}"
            )
            lines.append(f"Repair also tried on `{t['scheme']}`: {outcome}.")
        commands.append({"what": f"the repair of `{repair['scheme']}`", "command": repair["command"]})
    elif (
        beat
        and beat[0]
        and (sized := [f for f in beyond if f["status"] == "ok" and f.get("weight_bytes")])
        and all(f["weight_bytes"] >= beat[0] for f in sized)
    ):  # what repair_targets found: no candidate smaller than the size to beat (else it was not asked for)
        lines.append(
            f"No repair tried: no format decidedly beyond {limit} is smaller than {beat[1]}: "
            f"{_bytes(beat[0])}; keeping layers in float only adds bytes."
        )
    return {
        "recommended": None
        if smallest is None
        else {k: smallest[k] for k in ("label", "scheme", "ppl_change_pct", "weight_bytes", "bytes_vs_bf16")},
        "avoid": avoid,
        "undecided": [f["label"] for f in undecided],
        "beyond": [f["label"] for f in beyond],
        "repair": repair,
        "lines": lines,
        "commands": commands,
    }


def _algorithm_lines(formats: Sequence[Mapping[str, Any]], limit: str) -> list[str]:
    """Per post-training algorithm row (GPTQ, AWQ, QuaRot) whose round-to-nearest row was measured too: whether the
    algorithm rescues a format that round-to-nearest fails (its verdict turns from beyond to within), or what it
    changed."""
    by_scheme = {f["scheme"]: f for f in formats}
    lines = []
    for f in formats:
        algo = _algo_of(f["scheme"])
        if algo is None:
            continue
        rtn = by_scheme.get(_rtn_scheme(f["scheme"]))
        if rtn is None or f["status"] != "ok" or rtn["status"] != "ok":
            continue
        change = f"{_pct(rtn['ppl_change_pct'])} → {_pct(f['ppl_change_pct'])}"
        if rtn.get("verdict") == "beyond" and f.get("verdict") == "within":
            lines.append(
                f"{algo} rescues {rtn['label']}: {change}, within {limit} where round-to-nearest is not."
            )
        elif rtn.get("verdict") == "beyond":
            state = "undecided" if f.get("verdict") == "undecided" else "still beyond"
            lines.append(f"{algo} does not rescue {rtn['label']}: {change} ({state} {limit}).")
    return lines


_ALGO_NAMES = {"gptq": "GPTQ", "awq": "AWQ", "quarot": "QuaRot"}


def _algo_of(scheme: str) -> str | None:
    """The post-training algorithms a scheme name asks for (``…:algo=gptq``, ``…:rotate=quarot``, both: ``QuaRot +
    GPTQ``), None for plain round-to-nearest."""
    items = scheme.partition(":")[2].split(",")
    found = [
        i.split("=", 1)[1]
        for i in items
        if (i.startswith("rotate=") and i != "rotate=none") or (i.startswith("algo=") and i != "algo=rtn")
    ]
    found.sort(key=lambda a: a != "quarot")  # the rotation first: it happens before the rounding
    return " + ".join(_ALGO_NAMES.get(a, a.upper()) for a in found) or None


def _not_measured(
    formats: Sequence[Mapping[str, Any]],
    kv: Mapping[str, Any],
    speed: bool,
    protocol: Mapping[str, Any],
    settings: Mapping[str, Any],
) -> list[str]:
    """What this card did not measure, from what it did: a person shipping the model needs the gaps as much as
    the numbers."""
    measured = {f["scheme"] for f in formats}
    missing = [f.label for f in FORMATS if f.scheme not in measured and _canonical(f.scheme) not in measured]
    algos = [f["label"] for f in formats if _algo_of(f["scheme"])]
    lines = [
        (
            f"Algorithms: GPTQ, AWQ or QuaRot in the rows that say so ({', '.join(algos)}); every other format is "
            "round-to-nearest"
            if algos
            else "Algorithms: every format is round-to-nearest at its standard settings (`--budget standard` adds "
            "GPTQ, AWQ and QuaRot rows)"
        )
        + " — no SmoothQuant α search or learned rotation (SpinQuant) was applied (each would change these rows). "
        "Activation scales are dynamic (each sequence's own) in every row that quantises activations"
        + (
            ""
            if any(f.get("quantised") and "static scales" in f["quantised"] for f in formats)
            else "; static (calibrated once) scales, what an int8 serving engine may use, were not measured "
            "(`--scheme absmax-coarse:static=true`)"
        )
        + ".",
        f"Tasks: next-token quality on {protocol.get('corpus')}/{protocol.get('split')} only "
        f"({protocol.get('tokens_scored'):,} tokens, window {protocol.get('window')}); no downstream task "
        "(`qbench lm-eval` runs lm-evaluation-harness tasks on a quantised model).",
    ]
    if missing:
        lines.append(
            f"Formats not in the {settings.get('budget')} budget: {', '.join(missing)} (`--budget standard`)."
        )
    fake_only = [f["label"] for f in formats if f.get("decode_speedup") is None and f.get("weight_bits")]
    lines.append(
        "Speed: the linear layers' real kernels on this model's shapes only (decode × / prefill ×)"
        + (
            "; whole-model prefill in the rows' model prefill ×"
            if speed
            else "; no whole-model prefill or generation (`--budget full`, or `qbench speed --ckpt …`)"
        )
        + (f"; no real kernel here (fake quantisation only): {', '.join(fake_only)}" if fake_only else "")
        + ". Memory: the rows' nominal sizes and a KV cache at the model's context; peak memory of an inference "
        "run not measured."
    )
    refused = [f for f in formats if f.get("status") not in ("ok", "nonfinite")]
    if refused:
        reasons: dict[str, list[str]] = {}
        for f in refused:
            reasons.setdefault(str(f.get("error") or f.get("status")), []).append(f["label"])
        lines.append(
            "Formats this model cannot take: "
            + "; ".join(f"{', '.join(labels)} ({why})" for why, labels in reasons.items())
            + "."
        )
    skipped = [str(r.get("label")) for r in kv.get("rows", []) if r.get("status") == "skipped"]
    if skipped:
        lines.append(f"KV rows skipped: {', '.join(skipped)} (the KV caption says why).")
    lines.append(
        "Hardware: fake quantisation computes in float on this machine; real kernels and other devices round "
        "differently (speed and the real-kernel rows say where they were measured)."
    )
    return lines


def _pct(x: float | None) -> str:
    return "NaN" if x is None else f"{x:+.2f} %"


def _bytes(n: int | None) -> str:
    from qbench.studies.card_render import _bytes as decimal

    return decimal(n)


def _kv_configs_of(records: Sequence[Mapping[str, Any]]) -> list[Any]:
    """The KV configs the KV rows' records were made with (their ``kv`` blocks)."""
    from qbench.quant.kv import KVConfig

    return [KVConfig.from_dict(r["kv"]) for r in records if r.get("kv")]


def _corpus_description(corpus: str, split: str | None) -> str:
    """What the scored text is: a registered corpus's description and the split, or a user's own file/folder."""
    from trainers.data import CORPORA

    if corpus in CORPORA or any(corpus in CORPORA.aliases_of(n) for n in CORPORA):
        name = CORPORA.canonical(corpus)
        held = {"validation": "the held-out validation split", "train": "the training split"}.get(
            str(split), f"split {split}"
        )
        return (
            f"{name}: {CORPORA.describe(name)}; {held} (qbench's models train on the other split; a model "
            "pretrained elsewhere may have seen these public texts)"
        )
    return f"a user's text, {Path(str(corpus)).name} (split {split})"


def build_card(per_model: Sequence[Mapping[str, Any]], settings: Mapping[str, Any]) -> dict[str, Any]:
    """The card: a pure function of the records (see the module docstring); ``per_model`` entries hold ``fp``,
    ``profile``, ``formats``, ``kv`` (records), ``sweep`` (``run_sweep``'s result or None), ``sensitivity``
    (the study's result or None), ``speed`` (the speed record or None) and ``source`` (what ``--ckpt`` named)."""
    from qbench.eval.harness import environment

    tolerance = settings["tolerance_pct"]
    metric = settings.get("metric") or "ppl"
    models = []
    for entry in per_model:
        fp, profile = entry["fp"], entry["profile"]
        out = entry.get("paths")
        p = fp["protocol"]
        resolved = entry.get("resolved") or {}
        kv = _kv_rows(
            entry["kv"],
            tolerance,
            out,
            metric,
            resolved,
            {"context": profile["architecture"].get("context"), "minimum": KV_MIN_WINDOW},
            kv_memory(profile["architecture"], _kv_configs_of(entry["kv"])),
        )
        formats = [
            _format_row(
                r,
                fp,
                profile,
                tolerance,
                entry.get("speed"),
                out,
                metric,
                resolved,
                entry.get("layer_speed"),
                (kv["memory"] or {}).get("bf16_bytes"),
            )
            for r in entry["formats"]
        ]
        outliers = _outlier_profile(fp, profile)
        sens = _repair_section(entry, fp, profile, settings, tolerance, metric)
        avoid_map = _map_section(entry.get("avoid_map"))
        models.append(
            {
                "name": fp["model"]["name"],
                "source": entry["source"],
                "identity": {
                    "kind": fp["model"].get("kind"),
                    "path": fp["model"].get("path"),
                    "fingerprint": fp["model"].get("fingerprint"),
                    "dtype": fp["model"].get("dtype"),
                    # a GGUF's weights already lie on its grid (Q8_0, Q4_K…): each cell quantises them again
                    "gguf": fp["model"].get("gguf"),
                    **profile["architecture"],
                },
                "protocol": {
                    "corpus": p["corpus"],
                    "split": p["split"],
                    "tokens": p["tokens"],
                    "tokens_scored": p["tokens_scored"],
                    "window": p["window"],
                    "windows": p["windows"],
                    "start_token": "<|endoftext|> (BOS) opens every window"
                    if p["bos"]
                    else "none (--no-bos)",
                    "bos": p["bos"],
                    "tokenizer_fingerprint": p.get("tokenizer_fingerprint"),
                    "dtype": p.get("dtype"),
                    "outlier_windows": p.get("outlier_windows"),
                    "seed": settings.get("seed"),
                    "corpus_description": _corpus_description(p["corpus"], p.get("split")),
                    # what the outlier, linear-input and attention statistics were computed on (the float
                    # record's first windows, at most outlier_windows): not the formats' whole token budget
                    "statistics_windows": fp["outliers"].get("windows"),
                    "statistics_tokens": (fp["outliers"].get("windows") or 0) * p["window"] or None,
                },
                "fp": {
                    "perplexity": fp["metrics"]["perplexity"],
                    "model_bytes": fp.get("model_bytes"),
                    "eval_seconds": fp.get("eval_seconds"),
                    "record": _record_ref(fp, out),
                    "cell_id": fp.get("cell_id"),
                },
                "env": fp.get("env"),
                "outliers": outliers,
                "attention": profile["attention_per_head"],
                "formats": formats,
                "kv": kv,
                "breaking_points": _breaking_points(entry.get("sweep"), fp["model"]["name"], kv),
                "sensitivity": sens,
                "speed_measured": bool(entry.get("speed")),
                "avoid_map": avoid_map,
                # per-window mean NLL of the float record and each format (the comparison's paired intervals)
                "window_nll": entry.get("window_nll") or {},
                "kernels": {k: v for k, v in (entry.get("layer_speed") or {}).items() if k != "records"}
                or None,
                "verdict": _verdict(
                    formats,
                    outliers,
                    fp,
                    sens,
                    tolerance,
                    metric,
                    avoid_map,
                    size_to_beat(entry["formats"], fp, profile, tolerance, metric, entry.get("source_bytes")),
                ),
                "not_measured": _not_measured(formats, kv, bool(entry.get("speed")), p, settings),
            }
        )
    card = {
        "card_version": CARD_VERSION,
        **settings,
        "metrics": {
            key: _metric_info(key)
            for key in (
                "perplexity",
                "ppl_change_pct",
                "kurtosis_first",
                "kurtosis_other",
                "max_abs",
                "first_token_top1_share",
                "first_token_mass",
                "input_crest",
                "input_kurtosis",
                "input_absmax",
                "weight_crest",
            )
        },
        "models": models,
        "comparison": (comparison := _comparison(models) if len(models) > 1 else None),
        "comparison_lines": _comparison_lines(comparison) if comparison else [],
        # the code that built this card (each model's "env" is its float record's: what measured it); a card
        # re-rendered from cached records names the commit that rendered it here
        "env": environment(settings.get("device", "cpu")),
        "created_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }
    return card


def _least(values: Mapping[str, float]) -> str | None:
    """The one model with the smallest value; None on a tie."""
    best = min(values.values(), default=None)
    winners = [k for k, v in values.items() if v == best]
    return winners[0] if len(winners) == 1 else None


def _more_robust_change(found: Mapping[str, Mapping[str, Any] | None]) -> str | None:
    """The model a row (a format, a KV setting) hurts *decidedly* least, on the card's ``--metric``: None when
    every model is within the tolerance (nothing to choose); else the one model whose 95 % interval lies wholly
    below every other model's (a decrease counts as no damage: intervals are clamped at 0; a failed or missing
    cell is the worst); None when the intervals overlap — the measurement cannot tell the models apart, and a
    point estimate would pick one by noise."""
    from qbench.eval.evidence import WITHIN

    if all(r is not None and r.get("verdict") == WITHIN for r in found.values()):
        return None

    def bounds(row: Mapping[str, Any] | None) -> tuple[float, float]:
        decision = (row or {}).get("decision") or {}
        value, ci = decision.get("value"), decision.get("ci95")
        if row is None or row.get("status") != "ok" or value is None:
            return math.inf, math.inf
        low, high = ci if ci else (-math.inf, math.inf)  # no interval: it could be anywhere
        return max(low, 0.0), max(high, 0.0)

    spans = {name: bounds(row) for name, row in found.items()}
    best = min(spans, key=lambda n: spans[n][1])
    if all(spans[best][1] < spans[other][0] for other in spans if other != best):
        return best
    return None


def _decidedly_below(a: Sequence[float] | None, b: Sequence[float] | None) -> bool | None:
    """Whether per-window mean NLLs ``a`` lie decidedly below ``b`` on the same windows: the 95 % interval of the
    paired differences (windows as clusters, ``qbench.eval.evidence.cluster_interval``) wholly below 0. None when
    the two were not measured on the same windows or give no interval (one window)."""
    import torch

    from qbench.eval.evidence import cluster_interval

    if not a or not b or len(a) != len(b):
        return None
    interval = cluster_interval(torch.tensor(a, dtype=torch.float64) - torch.tensor(b, dtype=torch.float64))
    return None if interval is None else interval[2] < 0


def _below_others_float(
    quantised: Mapping[str, float | None],
    floats: Mapping[str, float | None],
    windows: Mapping[str, tuple[Sequence[float] | None, Sequence[float] | None]] | None = None,
) -> dict[str, list[str]]:
    """Absolute quality beside relative damage: {model: the other models whose *float* perplexity is decidedly
    above this model's quantised one} — a more damaged model can still be the better one to ship. Decided on the
    same windows (same tokenizer, same tokens: the card refuses models whose tokenizers differ) by the paired
    interval of ``windows`` ({model: (quantised per-window NLL, float per-window NLL)}); without them (records
    before per-token evidence), by the point values."""
    out = {}
    for name, q in quantised.items():
        if q is None:
            continue
        if windows is None:  # no per-window evidence: the point values, as cards before it said
            others = [o for o, f in floats.items() if o != name and f is not None and q < f]
        else:
            others = [
                o
                for o in floats
                if o != name and o in windows and _decidedly_below(windows[name][0], windows[o][1])
            ]
        if others:
            out[name] = others
    return out


def _better_to_ship(
    windows: Mapping[str, tuple[Sequence[float] | None, Sequence[float] | None]],
) -> str | None:
    """The one model whose quantised per-window NLL lies decidedly below every other model's quantised one (paired
    over the same windows): the better model to ship in that format, whatever either lost to quantisation."""
    for name, (q, _) in windows.items():
        others = [o for o in windows if o != name]
        if others and all(_decidedly_below(q, windows[o][0]) for o in others):
            return name
    return None


def _comparison_lines(rows: Sequence[Mapping[str, Any]]) -> list[str]:
    """The side-by-side verdict in words, from relative damage and absolute quality together, a line per finding
    (formats with the same finding grouped): which model is decidedly better to ship in which formats, where the
    model that loses less to quantisation is still the worse one to ship, and which quantised model stays below
    another's float perplexity."""
    lines = []
    formats = [c for c in rows if c["section"] == "formats"]
    for c in rows:
        if c["section"] == "float" and c.get("better_to_ship"):
            lines.append(f"In float, {c['better_to_ship']} has the decidedly lower perplexity.")

    def grouped(kind: str, found: dict[str, list[str]]) -> None:
        for name, labels in found.items():
            where = (
                f"every format measured ({len(labels)})"
                if len(labels) == len(formats)
                else f"{len(labels)} of {len(formats)} formats: {', '.join(labels)}"
            )
            lines.append(f"{name} {kind} in {where}.")

    ship: dict[str, list[str]] = {}
    below: dict[str, list[str]] = {}
    for c in formats:
        robust, best = c.get("more_robust"), c.get("better_to_ship")
        if best:
            ship.setdefault(best, []).append(c["row"])
        if robust and best and robust != best:
            lines.append(
                f"{c['row']}: {robust} loses less to quantisation, but {best} quantised is still decidedly better "
                f"(ppl {c['perplexity'][best]:.2f} vs {c['perplexity'][robust]:.2f})."
            )
        for name, others in (c.get("below_others_float") or {}).items():
            if name != best:
                below.setdefault(
                    f"{name} quantised is decidedly below {', '.join(others)} in float", []
                ).append(c["row"])
    grouped("is decidedly better to ship", ship)
    for text, labels in below.items():
        lines.append(f"{text}: {', '.join(labels)}.")
    return lines


def _comparison(models: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """The same rows side by side. ``more_robust``: for a format or KV row the model with the decidedly smaller
    damage (:func:`_more_robust_change`), for a breaking point the lower one (``none`` is the worst), for a float
    statistic whose registry direction is ``lower`` the lower value; None when nothing tells them apart."""
    rows = []

    def row(
        section: str, label: str, scheme: str | None, values: dict, more_robust: str | None, **extra: Any
    ) -> None:
        rows.append(
            {
                "section": section,
                "row": label,
                "scheme": scheme,
                "values": values,
                "more_robust": more_robust,
                **extra,
            }
        )

    floats = {m["name"]: m["fp"]["perplexity"] for m in models}
    float_windows = {
        m["name"]: ((m.get("window_nll") or {}).get(m["fp"].get("cell_id") or ""), None) for m in models
    }
    row(
        "float",
        "float perplexity",
        None,
        floats,
        None,
        better_to_ship=_better_to_ship(float_windows) if all(q for q, _ in float_windows.values()) else None,
    )

    for scheme in dict.fromkeys(f["scheme"] for m in models for f in m["formats"]):
        found = {m["name"]: next((f for f in m["formats"] if f["scheme"] == scheme), None) for m in models}
        values = {k: None if f is None else f["ppl_change_pct"] for k, f in found.items()}
        label = next(f["label"] for f in found.values() if f is not None)
        quantised = {k: None if f is None else f["perplexity"] for k, f in found.items()}
        per_window = {
            m["name"]: (
                (m.get("window_nll") or {}).get((found[m["name"]] or {}).get("cell_id") or ""),
                (m.get("window_nll") or {}).get(m["fp"].get("cell_id") or ""),
            )
            for m in models
        }
        evidence = per_window if all(q and f for q, f in per_window.values()) else None
        row(
            "formats",
            label,
            scheme,
            values,
            _more_robust_change(found),
            perplexity=quantised,
            below_others_float=_below_others_float(quantised, floats, evidence),
            better_to_ship=_better_to_ship(evidence) if evidence else None,
        )

    def kv_key(r: Mapping[str, Any]) -> tuple[Any, ...]:
        return r["scheme"], r["bits"], r["keep_sinks"]

    for key in dict.fromkeys(kv_key(r) for m in models for r in m["kv"]["rows"]):
        found = {m["name"]: next((r for r in m["kv"]["rows"] if kv_key(r) == key), None) for m in models}
        _, bits, keep = key
        skipped = any(r is not None and r["status"] == "skipped" for r in found.values())
        values = {
            k: "skipped"
            if r is not None and r["status"] == "skipped"
            else None
            if r is None
            else r["ppl_change_pct"]
            for k, r in found.items()
        }
        name = next(r["scheme_name"] for r in found.values() if r is not None)
        label = f"KV {name} {bits} bit" + (f", {keep} sink(s) kept" if keep else "")
        # quantised perplexity beside each change (at the KV section's window, against the float model there)
        quantised = {
            k: None if r is None or r["status"] == "skipped" else r.get("perplexity")
            for k, r in found.items()
        }
        # a row one model could not measure names no more robust model
        row(
            "kv",
            label,
            None,
            values,
            None if skipped else _more_robust_change(found),
            perplexity=quantised,
            missing=[k for k, r in found.items() if r is None],  # not in that model's budget: "-", not NaN
        )
    for family, axis in dict.fromkeys((b["family"], b["axis"]) for m in models for b in m["breaking_points"]):
        found = {
            m["name"]: next(
                (x for x in m["breaking_points"] if (x["family"], x["axis"]) == (family, axis)), None
            )
            for m in models
        }
        bits = {k: math.inf if b is None or b["bits"] is None else b["bits"] for k, b in found.items()}
        values = {k: None if b is None else b["text"] for k, b in found.items()}
        row("breaking points", f"break {family} {axis}", None, values, _least(bits))
    start = all(m["protocol"].get("bos", True) for m in models)
    for key in ("kurtosis_first", "kurtosis_other", "max_abs", "first_token_top1_share"):
        values = {m["name"]: m["outliers"]["summary"].get(key) for m in models}
        known = {k: v for k, v in values.items() if v is not None}
        lower = BY_KEY[key].better == "lower" and len(known) == len(values)
        label = "κ start token" if key == "kurtosis_first" and start else BY_KEY[key].label
        row("outliers", label, None, values, _clearly_least(known) if lower else None)
    return rows


STATISTIC_FACTOR = (
    2.0  # a float statistic carries no interval: only a model at most half the others' is named
)


def _clearly_least(values: Mapping[str, float]) -> str | None:
    """The model whose statistic is at most 1/:data:`STATISTIC_FACTOR` of every other's (outlier statistics
    carry no interval here, so small differences name nobody); None otherwise."""
    best = _least(values)
    if best is None:
        return None
    others = [v for k, v in values.items() if k != best]
    return best if all(values[best] * STATISTIC_FACTOR <= v for v in others) else None


# ------------------------------------------------------------------------------------------------- writing


FIGURE_FILE = re.compile(r"card-(outliers-\d+|attention-\d+|breaking-points)\.png")


def write_card(card: Mapping[str, Any], out: Path) -> dict[str, Path]:
    """card.json, card.md and card.html (figures inline; PNG copies beside for card.md), each atomically; then
    the figure files of an earlier card that this page no longer shows are removed (none is left stale)."""
    from models.io import atomic_write_bytes, atomic_write_json, atomic_write_text
    from qbench.studies import card_render

    out = Path(out)
    figures = card_render.figures(card)
    paths = {"json": out / "card.json", "md": out / "card.md", "html": out / "card.html"}
    files = {n: f"card-{n}.png" for n in figures}
    for name, png in figures.items():
        atomic_write_bytes(out / files[name], png)
    atomic_write_json(paths["json"], card)
    atomic_write_text(paths["md"], card_render.markdown(card, files))
    atomic_write_text(paths["html"], card_render.html(card, figures))
    for stale in out.glob("card-*.png"):
        if FIGURE_FILE.fullmatch(stale.name) and stale.name not in files.values():
            stale.unlink(missing_ok=True)
    return paths


def read_card(path: str | Path) -> dict[str, Any]:
    path = Path(path)
    return json.loads((path / "card.json" if path.is_dir() else path).read_text())


__all__ = [
    "BUDGETS",
    "FORMATS",
    "Budget",
    "CardConfig",
    "Progress",
    "build_card",
    "run_card",
    "write_card",
]
