"""The evaluation grid: models × schemes × modes → one JSON record per cell, resumable.

Layout under ``output_path`` (default ``qbench_results/``)::

    <model name>/fp.json                    the float baseline + outlier/attention statistics (once per model)
    <model name>/<scheme>__<mode>.json      one quantised cell

Every record is self-describing: model (path, config, provenance), scheme (full config), mode, backend,
protocol (corpus, split, tokens, window, stride, bos, batch size, tokenizer fingerprint), metrics, outliers of
the float model, environment (versions, git commit, device, threads), seed, timings, model bytes.
Records are written atomically; a re-run skips every cell whose record exists with the same protocol and
scheme, so an interrupted grid resumes where it stopped and nothing finished is recomputed.
"""

from __future__ import annotations

import json
import math
import platform
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from models.errors import UserError, unknown_choice
from models.io import atomic_write_json, git_commit, software_versions
from qbench.eval.adapters import context_length
from qbench.eval.load import LoadedModel, load_model
from qbench.eval.metrics import (
    Protocol,
    Windows,
    delimiter_ids,
    linear_ranges,
    make_windows,
    massive_activations,
    outlier_metrics,
    perplexity,
    protocol_record,
)
from qbench.quant.primitives import NonFiniteError

RECORD_VERSION = 1
MODES = ("fake", "real")
PAPER_SCHEMES = ("absmax-fine", "absmax-moderate", "absmax-coarse", "zeropoint-int4")
DEFAULT_OUTPUT = Path("qbench_results")


def expand_schemes(names: Iterable[str]) -> list[str]:
    """Scheme names with the groups ``paper`` (the paper's four) and ``all`` (every registered scheme)."""
    from qbench.quant.schemes import SCHEMES

    out: list[str] = []
    for name in names:
        group = list(SCHEMES) if name == "all" else list(PAPER_SCHEMES) if name == "paper" else None
        for scheme in group or [SCHEMES.canonical(name)]:
            if scheme not in out:
                out.append(scheme)
    return out


def check_modes(modes: Iterable[str]) -> list[str]:
    modes = list(modes)
    for mode in modes:
        if mode not in MODES:
            raise unknown_choice("mode", mode, MODES)
    return modes


def cpu_model() -> str:
    """The processor's marketing name (Linux /proc/cpuinfo), else what platform reports."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def environment(device: str) -> dict[str, Any]:
    return {
        "software": software_versions(),
        "git_commit": git_commit(),
        "device": device,
        "cuda": torch.cuda.get_device_name(0) if device.startswith("cuda") else None,
        "threads": torch.get_num_threads(),
        "platform": platform.platform(),
        "processor": cpu_model(),
    }


@dataclass
class GridSpec:
    models: list[str]
    schemes: list[str]
    modes: list[str] = field(default_factory=lambda: ["fake"])
    protocol: Protocol = field(default_factory=Protocol)
    output_path: Path = DEFAULT_OUTPUT
    seed: int = 0
    dtype: str = "float32"
    device: str = "cpu"
    exclude: tuple[str, ...] = ()
    attention: bool = True  # attention statistics need the O(T^2) reference path
    trust_remote_code: bool = False
    allow_unsafe_weights: bool = False
    quantize_lm_head: bool = False  # the schemes' documented default keeps the LM head in float

    def scheme(self, name: str) -> Any:
        """The registered scheme, with the LM head quantised too when asked (then named ``<scheme>+head``)."""
        from dataclasses import replace

        from qbench.quant import get_scheme

        scheme = get_scheme(name)
        if self.quantize_lm_head and not scheme.quantize_lm_head:
            scheme = replace(scheme, name=f"{scheme.name}+head", quantize_lm_head=True)
        return scheme

    def scheme_record(self, name: str) -> dict[str, Any]:
        """What a record says of its scheme: the full config plus the layers kept in float by ``exclude``."""
        return {**self.scheme(name).to_dict(), "exclude": list(self.exclude)}


def record_path(output_path: Path, model_name: str, scheme: str | None, mode: str | None) -> Path:
    return output_path / model_name / ("fp.json" if scheme is None else f"{scheme}__{mode}.json")


def _finite(x: float) -> float | None:
    return x if isinstance(x, float) and math.isfinite(x) else None


class ModelEvaluation:
    """One model of the grid: loaded lazily, its windows and float baseline computed once."""

    def __init__(self, spec: GridSpec, model_spec: str, lm: LoadedModel | None = None) -> None:
        """``lm``: the model already loaded from ``model_spec`` (else it is loaded on first use)."""
        self.spec, self.model_spec = spec, model_spec
        self._lm = lm
        self._windows: Windows | None = None
        self._fp: dict[str, Any] | None = None

    @property
    def lm(self) -> LoadedModel:
        if self._lm is None:
            self._lm = load_model(
                self.model_spec,
                dtype=self.spec.dtype,
                device=self.spec.device,
                trust_remote_code=self.spec.trust_remote_code,
                allow_unsafe_weights=self.spec.allow_unsafe_weights,
            )
        return self._lm

    @property
    def name(self) -> str:
        return self.lm.name

    @property
    def windows(self) -> Windows:
        if self._windows is None:
            self._windows = make_windows(self.lm.tokenizer, self.spec.protocol, context_length(self.lm.model))
        return self._windows

    def matches(self, record: dict[str, Any]) -> bool:
        """Whether ``record`` was made from these very weights under this protocol (then it can be reused)."""
        return record.get("protocol") == self.protocol_record() and record.get("model", {}).get(
            "fingerprint"
        ) == self.lm.description.get("fingerprint")

    def protocol_record(self) -> dict[str, Any]:
        record = protocol_record(self.spec.protocol, self.windows, self.lm.tokenizer, self.spec.dtype)
        return {**record, "attention_statistics": self.spec.attention}

    def fp_record(self) -> dict[str, Any]:
        """The float baseline (perplexity, outliers, massive activations), read from disk when already there."""
        if self._fp is not None:
            return self._fp
        path = record_path(self.spec.output_path, self.name, None, None)
        existing = _read_record(path)
        if existing and self.matches(existing) and "linear_ranges" in existing:  # older records lack them
            self._fp = existing
            return existing
        start = time.perf_counter()
        ppl = perplexity(self.lm.model, self.windows, self.spec.protocol.batch_size, self.spec.device)
        eval_seconds = time.perf_counter() - start
        outliers = outlier_metrics(
            self.lm.model,
            self.windows,
            self.spec.protocol.outlier_windows,
            attention=self.spec.attention,
            device=self.spec.device,
        )
        massive = massive_activations(
            self.lm.model,
            self.windows,
            self.spec.protocol.outlier_windows,
            device=self.spec.device,
            delimiter_ids=delimiter_ids(self.lm.tokenizer),
        )
        ranges = linear_ranges(
            self.lm.model, self.windows, self.spec.protocol.outlier_windows, device=self.spec.device
        )
        record = self._record(
            {"name": "fp", "description": f"unquantised ({self.spec.dtype})"},
            "float",
            "torch",
            ppl,
            ppl,
            outliers,
            massive,
            eval_seconds,
            time.perf_counter() - start,
            _model_bytes(self.lm.model),
            linear=ranges,
        )
        atomic_write_json(path, record)
        self._fp = record
        return record

    def _record(
        self,
        scheme: dict[str, Any],
        mode: str,
        backend: str,
        ppl: dict,
        fp_ppl: dict,
        outliers: dict,
        massive: dict | None,
        eval_seconds: float,
        wall: float,
        nbytes: int,
        status: str = "ok",
        error: str | None = None,
        linear: dict | None = None,
    ) -> dict[str, Any]:
        value, base = ppl["perplexity"], fp_ppl["perplexity"]
        ratio = value / base if math.isfinite(value) and math.isfinite(base) and base > 0 else float("nan")
        if status == "ok" and not math.isfinite(value):
            status, error = "nonfinite", f"perplexity is {value} (the quantised model produced NaN/inf)"
        return {
            "record_version": RECORD_VERSION,
            "model": {"name": self.name, **self.lm.description},
            "scheme": scheme,
            "mode": mode,
            "backend": backend,
            "protocol": self.protocol_record(),
            "metrics": {
                "perplexity": _finite(value),
                "fp_perplexity": _finite(base),
                "ppl_ratio": _finite(ratio),
                "ppl_change_pct": _finite((ratio - 1) * 100),
                "nll": _finite(ppl["nll"]),
                "tokens": ppl["tokens"],
            },
            "outliers": {k: v for k, v in outliers.items() if k != "per_layer"},
            "outliers_per_layer": outliers.get("per_layer"),
            "massive_activations": massive,
            "linear_ranges": linear,
            "status": status,
            "error": error,
            "env": environment(self.spec.device),
            "seed": self.spec.seed,
            "wall_seconds": round(wall, 3),
            "eval_seconds": round(eval_seconds, 3),
            "tokens_per_second": round(ppl["tokens"] / eval_seconds, 1) if eval_seconds > 0 else None,
            "model_bytes": nbytes,
            "created_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        }

    def quantised_record(self, scheme_name: str, mode: str) -> dict[str, Any]:
        """Quantise a copy of the model, evaluate it, and return the record (errors become records too)."""
        from qbench.quant import quantize

        fp = self.fp_record()
        scheme = self.spec.scheme(scheme_name)
        torch.manual_seed(self.spec.seed)
        start = time.perf_counter()
        nan = {"perplexity": float("nan"), "nll": float("nan"), "tokens": 0}
        fp_ppl = {"perplexity": fp["metrics"]["fp_perplexity"] or float("nan")}
        outliers = {**fp["outliers"], "per_layer": fp.get("outliers_per_layer")}
        try:
            qmodel = quantize(
                self.lm.model,
                scheme,
                mode=mode,
                exclude=self.spec.exclude,
                calibration=self._calibration() if _needs_calibration(scheme) else None,
            )
        except UserError as e:  # e.g. no real kernel for this scheme here: recorded, the grid goes on
            return self._record(
                self.spec.scheme_record(scheme_name),
                mode,
                "-",
                nan,
                fp_ppl,
                outliers,
                None,
                0.0,
                time.perf_counter() - start,
                0,
                status="unsupported",
                error=str(e),
            )
        eval_start = time.perf_counter()
        try:
            ppl = perplexity(qmodel, self.windows, self.spec.protocol.batch_size, self.spec.device)
        except NonFiniteError as e:  # NaN/inf reached a quantiser: the cell failed, the grid goes on
            return self._record(
                self.spec.scheme_record(scheme_name),
                mode,
                _backend(qmodel, mode),
                nan,
                fp_ppl,
                outliers,
                None,
                time.perf_counter() - eval_start,
                time.perf_counter() - start,
                _model_bytes(qmodel),
                status="nonfinite",
                error=str(e),
            )
        eval_seconds = time.perf_counter() - eval_start
        return self._record(
            self.spec.scheme_record(scheme_name),
            mode,
            _backend(qmodel, mode),
            ppl,
            fp_ppl,
            outliers,
            None,
            eval_seconds,
            time.perf_counter() - start,
            _model_bytes(qmodel),
        )

    def _calibration(self) -> torch.Tensor:
        """SmoothQuant's calibration windows: the first 8 windows of the *train* split (never the evaluated text)."""
        from dataclasses import replace

        train = replace(self.spec.protocol, split="train", tokens=8 * (self.windows.window - 1))
        return make_windows(self.lm.tokenizer, train, context_length(self.lm.model)).ids


def _needs_calibration(scheme: Any) -> bool:
    return getattr(scheme, "method", "") == "smoothquant"


def _backend(model: torch.nn.Module, mode: str) -> str:
    from qbench.quant.apply import real_kernels

    if mode == "fake":
        return "fake-quant (torch.library ops)"
    return ", ".join(real_kernels(model)) or "torch"


def _model_bytes(model: torch.nn.Module) -> int:
    from qbench.quant import model_bytes

    return model_bytes(model)


def _read_record(path: Path) -> dict[str, Any] | None:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None  # missing or torn: recompute


def cells(spec: GridSpec) -> list[tuple[str, str]]:
    return [(scheme, mode) for scheme in spec.schemes for mode in spec.modes]


def run_grid(spec: GridSpec, on_record: Callable[[dict[str, Any], bool], None] | None = None) -> list[dict]:
    """Evaluate every (model, scheme, mode) cell not already on disk; returns all records (fp ones first).

    ``on_record(record, reused)`` is called after each cell, for progress display.
    """

    records: list[dict] = []
    sources: dict[str, str] = {}
    for model_spec in spec.models:
        evaluation = ModelEvaluation(spec, model_spec)
        if sources.setdefault(evaluation.name, evaluation.lm.source) != evaluation.lm.source:
            raise UserError(
                f"two models are both named {evaluation.name!r} ({sources[evaluation.name]} and "
                f"{evaluation.lm.source}): their results would share {spec.output_path / evaluation.name}/; "
                "rename one folder or evaluate them with different --output-path"
            )
        records.append(evaluation.fp_record())
        if on_record:
            on_record(records[-1], False)
        for scheme, mode in cells(spec):
            path = record_path(spec.output_path, evaluation.name, spec.scheme(scheme).name, mode)
            existing = _read_record(path)
            reusable = (
                existing is not None
                and evaluation.matches(existing)
                and existing.get("scheme") == spec.scheme_record(scheme)
                and existing.get("status") != "unsupported"
            )
            record = existing if reusable else evaluation.quantised_record(scheme, mode)
            if not reusable:
                atomic_write_json(path, record)
            records.append(record)
            if on_record:
                on_record(record, reusable)
    return records
