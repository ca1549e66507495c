"""A card's configuration: :class:`CardConfig`, its checks before any work (models, tokenizers, output folder), and
the one place a config becomes a grid, KV or sweep spec."""

from __future__ import annotations

import json
import os
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from models.errors import UserError
from qbench.studies.card.plan import BUDGETS, DEFAULT_TOLERANCE, KV_KEEP_SINKS, KV_MIN_WINDOW, Budget, budget


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
    sample: str | None = (
        None  # which windows (qbench.eval.sampling): None, the protocol's default (documents)
    )
    sample_seed: int = 0
    dtype: str = "float32"
    device: str = "cpu"
    trust_remote_code: bool = False
    allow_unsafe_weights: bool = False
    placement: Any = None  # qbench.eval.placement.Placement (None: all on ``device``)
    command: str | None = None
    # --resolve: re-evaluate undecided format and KV rows at doubling tokens up to this many (None: off)
    resolve_tokens: int | None = None
    overwrite: bool = False  # replace a card of other models or settings in output_path (their records stay)
    # where the calibrated rows (GPTQ, AWQ, fp8 scale=calib) take their windows: qbench.quant.calibrate's
    # CalibrationData (None, None: the train split of ``corpus``, each scheme's windows)
    calib_data: str | None = None
    calib_tokens: int | None = None
    calib_sample: str = "documents"  # --calib-sample: how the windows are drawn (documents | first)
    # llama.cpp's file types scored as rows of their own (gguf:<type> cells; --llama-cpp), and why the budget's
    # default ones were left out (llama-cpp-python not installed: said under "Not measured")
    llama_cpp: tuple[str, ...] = ()
    llama_cpp_skipped: str | None = None
    mixed_plan: bool = False  # qbench plan at the smallest passing llama.cpp type's size and 10 % below

    def calibration(self) -> Any:
        from qbench.quant.calibrate import CalibrationData

        tokens = self.calib_tokens if self.calib_tokens is not None else self.plan.calib_tokens
        return CalibrationData(self.calib_data, tokens, self.calib_sample)

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
            sample=self.sample,
            sample_seed=self.sample_seed,
        )


def _shared(cfg: CardConfig) -> dict[str, Any]:
    """What the card's grid and sweep specs both take from the config, so the two read the same protocol."""
    return {
        "protocol": cfg.protocol(),
        "output_path": Path(cfg.output_path),
        "seed": cfg.seed,
        "dtype": cfg.dtype,
        "device": cfg.device,
        "trust_remote_code": cfg.trust_remote_code,
        "allow_unsafe_weights": cfg.allow_unsafe_weights,
        "placement": cfg.placement,
    }


def grid_spec(cfg: CardConfig, model: str, schemes: list[str], kv: Any = None, **kw: Any) -> Any:
    from qbench.eval.harness import GridSpec

    return GridSpec(
        models=[model],
        schemes=schemes,
        modes=["fake"],
        **_shared(cfg),
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
        **_shared(cfg),
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


def tokenizer_name(tok: Any, fingerprint: str) -> str:
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
                f"{first} and {name} use different tokenizers ({first}: {tokenizer_name(tok0, fp0)}; {name}: "
                f"{tokenizer_name(tok, fp)}): the same token count is different text for each, so their rows "
                "would not compare; card them separately (one --ckpt per card)"
            )


def local_tokenizers(models: Sequence[str]) -> list[tuple[str, Any]]:
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
            out.append(f"{key.replace('pct', '')} {old.get(key)} (this one: {new.get(key)})")
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


def planned_kv_rows(cfg: CardConfig) -> int:
    """KV rows per model as planned: the budget's, or --kv-scheme's widths each plain and with sinks kept."""
    return len(cfg.plan.kv_rows) if cfg.kv_scheme is None else 2 * len(kv_widths(cfg.plan, cfg.kv_scheme))


def planned_cells(cfg: CardConfig) -> int:
    """Cells per model before the sensitivity study: the float record, the formats, the llama.cpp rows, the KV
    rows and the sweep's own cells (those not already formats)."""
    plan = cfg.plan
    n = 1 + len(plan.formats) + planned_kv_rows(cfg) + len(cfg.llama_cpp)
    if plan.sweep_families:
        from qbench.quant.schemes import get_scheme
        from qbench.studies.sweep import plan as sweep_plan

        cells, _ = sweep_plan(plan.sweep_families, plan.sweep_axes, plan.sweep_bits)
        formats = {get_scheme(s).name for s in plan.formats}
        n += len({get_scheme(c.scheme).name for c in cells} - formats)
    return n


def slug(name: str) -> str:
    return re.sub(r"[^\w.+-]+", "_", name)


def profile_path(out: Path, model_name: str) -> Path:
    return Path(out) / model_name / "profile.json"
