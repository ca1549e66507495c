"""The evaluation grid: models × schemes × modes → one JSON record per cell, resumable.

Layout under ``output_path`` (default ``qbench_results/``)::

    <model name>/fp.json                    the float baseline + outlier/attention statistics (once per model)
    <model name>/fp.tokens.safetensors      its per-token evidence (every record has one: ``qbench.eval.evidence``)
    <model name>/<scheme>__<mode>.json      one quantised cell
    <model name>/<scheme>+kv4__<mode>.json  the same with the KV cache quantised (``GridSpec.kv``, a ``kv`` block);
                                            scheme ``fp`` = float weights, only the cache (``fp+kv4__fake.json``)

Every record is self-describing: model (path, config, provenance), scheme (full config), mode, backend,
protocol (corpus, split, tokens, window, stride, bos, batch size, tokenizer fingerprint), metrics (perplexity,
bits per byte; a quantised cell adds its 95 % interval, KL divergence and top-1 agreement against the float
model on the same tokens, from the per-token evidence it names with its hash), outliers of the float model, environment (versions, git commit, device, threads), seed, timings, model bytes.
Records are written atomically; a re-run skips every cell whose record exists with the same protocol,
scheme and KV-cache config, so an interrupted grid resumes where it stopped and nothing finished is recomputed.
"""

from __future__ import annotations

import hashlib
import json
import math
import platform
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import torch

from models.errors import UserError, unknown_choice
from models.io import (
    atomic_write_bytes,
    atomic_write_json,
    cpu_model,
    cuda_fp32_matmul,
    git_commit,
    software_versions,
)
from qbench.eval.adapters import context_length
from qbench.eval.evidence import bits_per_byte, sidecar_path
from qbench.eval.evidence import encode as encode_evidence
from qbench.eval.evidence import read as read_evidence
from qbench.eval.load import LoadedModel, load_model
from qbench.eval.metrics import (
    Protocol,
    Windows,
    delimiter_ids,
    joined_hidden,
    linear_ranges,
    make_windows,
    massive_activations,
    outlier_metrics,
    output_width,
    perplexity,
    protocol_record,
    sampled_record,
    scoring_rows,
)
from qbench.eval.prefix import BlockPrefix, ReplayMismatch
from qbench.eval.reference import ReferenceLogits, reference_store
from qbench.eval.sampling import FIRST
from qbench.quant.apply import MODES
from qbench.quant.calibrate import CalibrationData
from qbench.quant.gguf_types import GGUF_PREFIX
from qbench.quant.kv import KVConfig
from qbench.quant.primitives import NonFiniteError
from qbench.quant.schemes import PAPER_SCHEMES

RECORD_VERSION = 1
# The evaluation code's version: bump it whenever a definition changes the numbers a record holds (a metric, a
# quantiser, the protocol), so records written by older code are recomputed rather than reused.
# 2: first-token top-1 share no longer counts rows attending nowhere (argmax ties) as key 0.
# 3: per-token NLL summed in float64 (a float32 batch sum could hide a small effect); record identity.
# 4: per-token evidence (sidecar), KL divergence and top-1 agreement, paired intervals, bits per byte.
EVAL_VERSION = 4
DEFAULT_OUTPUT = Path("qbench_results")
FLOAT_SCHEME = "fp"  # as a grid scheme: weights and activations left float (with ``GridSpec.kv``: ``fp+kv2``)


def expand_schemes(names: Iterable[str]) -> list[str]:
    """Scheme names with the groups ``paper`` (the paper's four), ``all`` (every registered scheme but llama.cpp's
    file types, which need llama-cpp-python) and ``gguf`` (llama.cpp's file types: gguf:f32 … gguf:q2_k).

    A name with overrides (``absmax-coarse:w=4,a=4,o=4``) becomes its canonical form (``overrides.py``).
    """
    from qbench.quant.schemes import GGUF_SCHEMES, SCHEMES, get_scheme

    out: list[str] = []
    for name in names:
        if name == "all":
            group = [s for s in SCHEMES if s not in GGUF_SCHEMES]
        elif name == "paper":
            group = list(PAPER_SCHEMES)
        elif name == "gguf":
            group = list(GGUF_SCHEMES)
        elif name == FLOAT_SCHEME:  # float weights: a cell of its own only with a quantised KV cache
            group = [FLOAT_SCHEME]
        else:
            group = [get_scheme(name).name if ":" in name else SCHEMES.canonical(name)]
        for scheme in group:
            if scheme not in out:
                out.append(scheme)
    return out


def check_modes(modes: Iterable[str]) -> list[str]:
    modes = list(modes)
    for mode in modes:
        if mode not in MODES:
            raise unknown_choice("mode", mode, MODES)
    return modes


def environment(device: str) -> dict[str, Any]:
    return {
        "software": software_versions(),
        "git_commit": git_commit(),
        "device": device,
        "cuda": torch.cuda.get_device_name(0) if device.startswith("cuda") else None,
        "cuda_fp32_matmul": cuda_fp32_matmul() if device.startswith("cuda") else None,
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
    placement: Any = None  # qbench.eval.placement.Placement: a device map instead of all on ``device``
    quantize_lm_head: bool = False  # the schemes' documented default keeps the LM head in float
    baseline_path: Path | None = None  # where fp.json lives, when not output_path (sensitivity's many cells)
    kv: KVConfig | None = None  # KV-cache quantisation on top of every cell's scheme (None: float cache)
    allow_empty: bool = (
        False  # an exclude list may keep every layer float (sensitivity's KV-only, repair cells)
    )
    # where calibrated schemes and an fp8 scale=calib cache take their windows (--calib-data, --calib-tokens)
    calibration: CalibrationData = field(default_factory=CalibrationData)

    def scheme(self, name: str) -> Any:
        """The registered scheme, with the LM head quantised too when asked (then named ``<scheme>+head``) and
        ``+<kv label>`` appended when the KV cache is quantised (``absmax-fine+kv4``; ``fp`` -> ``fp+kv2``)."""
        from dataclasses import replace

        from qbench.quant import get_scheme

        scheme = float_scheme() if name == FLOAT_SCHEME else get_scheme(name)
        if self.quantize_lm_head and not scheme.quantize_lm_head and name != FLOAT_SCHEME:
            scheme = replace(scheme, name=f"{scheme.name}+head", quantize_lm_head=True)
        if self.kv is not None:
            scheme = replace(scheme, name=f"{scheme.name}+{self.kv.label}")
        return scheme

    def kv_record(self) -> dict[str, Any] | None:
        """The ``kv`` block of this grid's quantised records (None: the KV cache stays float). An fp8 cache with
        ``scale=calib`` adds its calibration protocol (``calibration``: corpus, train split, windows); each
        record then adds the scales it calibrated and the tokens they saw (:data:`KV_CALIBRATION_MEASURED`)."""
        if self.kv is None:
            return None
        record = self.kv.to_dict()
        if kv_calibrated(self.kv):
            record["calibration"] = {
                **self.calibration.describe(self.protocol.corpus, KV_CALIB_WINDOWS),
                "selection": "first windows",
                "statistic": "per layer: max |k| / max_normal, max |v| / max_normal",
            }
        return record

    def scheme_record(self, name: str) -> dict[str, Any]:
        """What a record says of its scheme: the full config plus the layers kept in float by ``exclude``, and for
        a calibrated scheme (SmoothQuant, static scales) where its calibration windows came from."""
        from qbench.quant.calibrate import needs_calibration

        scheme = self.scheme(name)
        record = {**scheme.to_dict(), "exclude": list(self.exclude)}
        if needs_calibration(scheme):
            record["calibration"] = {
                **self.calibration.describe(self.protocol.corpus, scheme.calib_count, scheme.calib_seed),
                "seed": scheme.calib_seed,
            }
            sequential = bool(scheme.algo_params.get("sequential"))
            inputs = (
                "each block's inputs from the quantised blocks before it"
                if sequential
                else "float model's inputs"
            )
            if scheme.algo == "gptq":  # what the Hessians are of (qbench.quant.gptq, qbench.quant.solve)
                record["calibration"]["hessian"] = f"{inputs}, (2/n) sum x x^T per layer"
            elif scheme.algo == "awq":  # what the scale and clipping searches read (qbench.quant.awq)
                record["calibration"]["statistics"] = (
                    f"{inputs}: mean |x| per channel and (2/n) sum x x^T per layer"
                )
        return record


@dataclass
class CellResult:
    """What one evaluation produced, before it becomes a record (:meth:`ModelEvaluation.record`)."""

    scheme: dict[str, Any]  # the scheme record (full config, excludes, calibration)
    mode: str  # "float" | "fake" | "real"
    backend: str  # what computed it ("torch", the real kernels' names, "-" when nothing ran)
    ppl: dict[str, Any]  # perplexity(): perplexity, nll, tokens
    fp_perplexity: float  # the float model's perplexity on the same windows
    outliers: dict[str, Any]  # the float model's outlier statistics (with "per_layer")
    wall_seconds: float = 0.0  # quantising + evaluating
    eval_seconds: float = 0.0  # evaluating alone
    model_bytes: int = 0
    status: str = "ok"  # ok | nonfinite | unsupported
    error: str | None = None
    massive: dict[str, Any] | None = None  # float record only
    linear: dict[str, Any] | None = None  # float record only
    # fp8 scale=calib: what calibration found (KV_CALIBRATION_MEASURED)
    kv_calibration: dict[str, Any] | None = None
    # a calibrated scheme: the windows it took and what its algorithm found (layer error in and out of sample)
    calibrated: dict[str, Any] | None = None
    # decoder blocks whose float output was replayed rather than recomputed (qbench.eval.prefix); 0: none
    replayed_blocks: int = 0
    # why a replay was abandoned for the plain evaluation (qbench.eval.prefix.ReplayMismatch); None: it was not
    replay_fallback: str | None = None
    # a file the cell ran (llama.cpp's GGUF of a gguf:* scheme): bytes, bits per weight, sha256, tensor types
    artifact: dict[str, Any] | None = None


def evidence_metrics(
    per_token: dict[str, torch.Tensor] | None,
    fp_tokens: dict[str, torch.Tensor] | None,
    clusters: list[str] | None = None,
) -> dict[str, Any]:
    """The metrics a quantised cell's per-token evidence gives against the float cell's (``qbench.eval.evidence``):
    the paired interval, ln ratio, Δp, KL divergence and top-1 agreement; empty without evidence. ``clusters``:
    the document of each window (windows of one document are one cluster of the intervals); None: each window."""
    from qbench.eval import evidence

    if not per_token or not fp_tokens or "kld" not in per_token:
        return {}
    return {
        **evidence.paired_metrics(per_token["nll"], fp_tokens["nll"], clusters),
        **evidence.distribution_metrics(per_token["kld"], per_token["top1"], clusters),
    }


NAN_PPL = {"perplexity": float("nan"), "nll": float("nan"), "tokens": 0, "per_token": None}


def record_path(output_path: Path, model_name: str, scheme: str | None, mode: str | None) -> Path:
    """``<model>/fp.json`` or ``<model>/<scheme>__<mode>.json``; an override name's ':' becomes '@' in the file.

    This is a cell's *plain* name. When that file already holds another cell (same names, but other weights,
    protocol, excludes, KV cache…), the cell is stored beside it under its identity (:func:`stored_path`)."""
    stem = None if scheme is None else scheme.replace(":", "@")
    if stem is not None and len(stem.encode()) > MAX_STEM:
        # a long name (a mixed GGUF plan names every tensor kind or block): its head and a hash of the whole, so
        # the file (and its sidecar, and an identity beside it) stays within the file system's 255 bytes
        digest = hashlib.sha256(stem.encode()).hexdigest()[:16]
        stem = f"{stem.encode()[: MAX_STEM - 17].decode(errors='ignore')}~{digest}"
    return output_path / model_name / ("fp.json" if stem is None else f"{stem}__{mode}.json")


MAX_STEM = 120  # bytes of a record file's scheme part; the rest of the 255 is its mode, identity and suffixes


KV_CALIB_WINDOWS = 8  # fp8 scale=calib: train windows, as many as a calibrated weight scheme's default
# what calibrating a cell found (not what defines it: kept out of its identity)
KV_CALIBRATION_MEASURED = ("tokens", "k_scale", "v_scale")


def kv_calibrated(kv: Any) -> bool:
    """Whether a KV config's fp8 scales are calibrated on train windows (``scale=calib``)."""
    from qbench.quant.kvschemes import CALIBRATED

    return kv is not None and kv.scale == CALIBRATED


def kv_identity(kv: dict[str, Any] | None) -> dict[str, Any] | None:
    """A record's ``kv`` block without what calibration measured (the scales follow from the model and the
    calibration protocol, which the block keeps): what identifies the cell and decides its reuse."""
    if not kv or "calibration" not in kv:
        return kv
    calibration = {k: v for k, v in kv["calibration"].items() if k not in KV_CALIBRATION_MEASURED}
    return {**kv, "calibration": calibration}


def cell_identity(record: dict[str, Any]) -> str:
    """A short hash of everything that changes a record's number: the model's weights (their fingerprint, else
    the path they were loaded from), the full scheme config with its excludes, the mode, the KV-cache config,
    the requested protocol (corpus, split, tokens, window, BOS, batch size…, dtype) and the seed (not for a float
    record: nothing in it is seeded). Computed from the
    record's own fields, so records written before the hash existed get one too. Not in it: the evaluation
    code's version (a record of older code is the same cell, recomputed in place)."""
    from qbench.eval.metrics import Protocol

    model = record.get("model") or {}
    protocol = record.get("protocol") or {}
    float_record = record.get("mode") == "float"
    requested = {k: protocol.get(k) for k in (*Protocol.__dataclass_fields__, "dtype")}
    # keys added after records existed, absent from those records (the default protocol's carry no "protocol"
    # key): left out when absent, so older records' identities stay what they were
    for key in ("protocol", "sample", "sample_seed"):
        if requested.get(key) is None:
            del requested[key]
    if float_record:
        requested["attention_statistics"] = protocol.get("attention_statistics")
    key = {
        "model": model.get("fingerprint") or model.get("path") or model.get("name"),
        "scheme": record.get("scheme"),
        "mode": record.get("mode"),
        "kv": kv_identity(record.get("kv")),
        "protocol": requested,
        "seed": None if float_record else record.get("seed"),  # nothing seeded in a float evaluation
    }
    return hashlib.sha256(json.dumps(key, sort_keys=True, default=str).encode()).hexdigest()[:10]


def stored_path(output_path: Path, record: dict[str, Any]) -> Path:
    """Where ``record`` is stored under ``output_path``: its plain name (:func:`record_path`) unless that file
    holds another cell — then ``<plain stem>.<identity>.json`` beside it. So two different cells never share
    a file, and the same cell always finds its file again."""
    scheme = None if record["mode"] == "float" else record["scheme"]["name"]
    return _path_for(
        record_path(output_path, record["model"]["name"], scheme, record["mode"]), cell_identity(record)
    )


def _path_for(plain: Path, identity: str) -> Path:
    beside = plain.with_name(f"{plain.stem}.{identity}.json")
    if beside.exists():  # the cell went beside an earlier plain file once: it stays there
        return beside
    try:
        existing = json.loads(plain.read_text())
    except OSError:
        return plain  # missing
    except ValueError:  # torn (a writer without the atomic rename): nothing to keep, recompute in place
        return plain
    if not (isinstance(existing, dict) and "record_version" in existing):
        return beside  # another file's JSON: kept as it is
    return plain if cell_identity(existing) == identity else beside


def float_scheme() -> Any:
    """The ``fp`` grid scheme: nothing is quantised (no layer replaced), so only ``GridSpec.kv`` acts."""
    from qbench.quant.schemes import QuantScheme

    return QuantScheme(FLOAT_SCHEME, "weights and activations in float", weight_bits=None)


def nonfinite_weights(model: torch.nn.Module) -> str | None:
    """``"the float weights hold N NaN/inf value(s) (first in NAME)"``, or None when every parameter is finite."""
    from qbench.quant.offload import parameter_values

    bad = [(name, int((~p.isfinite()).sum())) for name, p in parameter_values(model)]
    bad = [(name, n) for name, n in bad if n]
    if not bad:
        return None
    return f"the float weights hold {sum(n for _, n in bad)} NaN/inf value(s) (first in {bad[0][0]})"


def refuse_nonfinite_weights(name: str, model: torch.nn.Module, study: str) -> None:
    """A study that compares cells with the float model stops before its first cell when a weight is NaN or
    inf: every number it would measure is NaN."""
    bad = nonfinite_weights(model)
    if bad:
        raise UserError(f"{name}: {bad}; {study} compares every cell with the float model's perplexity")


def refuse_unscorable(name: str, fp: dict[str, Any], study: str) -> None:
    """A study that compares cells with the float model stops, in one line, when that model has no finite
    perplexity (NaN weights, an overflow in float16): every comparison would be NaN."""
    if fp.get("status") != "ok":
        raise UserError(
            f"{name}: the float model cannot be scored ({fp.get('error') or fp.get('status')}); {study} compares "
            "every cell with it, so nothing would be measured"
        )


def is_float_scheme(scheme: Any) -> bool:
    """Nothing is quantised: the float model itself is scored (gguf:f32 is not: llama.cpp runs it)."""
    float_bits = scheme.weight_bits is None and scheme.act_bits is None and scheme.out_bits is None
    return float_bits and getattr(scheme, "method", "rtn") != "gguf"


def _finite(x: float) -> float | None:
    return x if isinstance(x, float) and math.isfinite(x) else None


def check_kv_window(kv: Any, window: int) -> None:
    """Refuse (one line) a KV cache whose kept positions or float residual cover the whole ``window``: nothing
    would be quantised, yet the record would be labelled with the scheme. Called before anything is evaluated —
    by every grid, and by a sweep for all its KV groups at once (else a bad group refuses after the others ran)."""
    if kv is None:
        return
    if kv.keep_first >= window:
        raise UserError(
            f"--kv-keep-first {kv.keep_first} keeps every position of the {window}-token window in float "
            f"(nothing would be quantised); choose a value below {window}"
        )
    if kv.keep_sinks >= window:
        raise UserError(
            f"--kv-keep-sinks {kv.keep_sinks} keeps every position of the {window}-token window in float "
            f"(nothing would be quantised); choose a value below {window}"
        )
    if kv.scheme == "kivi" and kv.residual >= window:
        raise UserError(
            f"KV scheme kivi keeps its {kv.residual} newest positions in float, and the window has {window}: "
            f"nothing would be quantised; choose --kv-scheme kivi:residual=N with N below {window}"
        )


class ModelEvaluation:
    """One model of the grid: loaded lazily, its windows and float baseline computed once."""

    def __init__(
        self,
        spec: GridSpec,
        model_spec: str,
        lm: LoadedModel | None = None,
        prefix: BlockPrefix | None = None,
    ) -> None:
        """``lm``: the model already loaded from ``model_spec`` (else it is loaded on first use). ``prefix``: the
        float model's block outputs to replay in front of the first block a cell changes (per-unit studies)."""
        self.spec, self.model_spec = spec, model_spec
        self._lm = lm
        self.prefix = prefix
        self._windows: Windows | None = None
        self._fp: dict[str, Any] | None = None
        self._fp_tokens: dict[str, torch.Tensor] | None = None  # the float cell's per-token evidence
        self._evidence: dict[str, bytes] = {}  # sidecars of records made but not yet written, by cell id
        self._protocol: dict[str, Any] | None = None
        self._reference: ReferenceLogits | None = None
        self._reference_known = False  # reference() looked up (its None means: recompute beside each cell)
        self.fp_reused = False  # whether fp_record() came from disk

    @property
    def lm(self) -> LoadedModel:
        if self._lm is None:
            self._lm = load_model(
                self.model_spec,
                dtype=self.spec.dtype,
                device=self.spec.device,
                trust_remote_code=self.spec.trust_remote_code,
                allow_unsafe_weights=self.spec.allow_unsafe_weights,
                placement=self.spec.placement,
            )
        return self._lm

    @property
    def name(self) -> str:
        return self.lm.name

    @property
    def windows(self) -> Windows:
        if self._windows is None:
            self._windows = make_windows(
                self.lm.tokenizer,
                self.spec.protocol,
                context_length(self.lm.model, self.spec.protocol.window),
            )
        return self._windows

    def matches(self, record: dict[str, Any]) -> bool:
        """Whether ``record`` was made from these very weights, under this protocol, by this evaluation code
        (then it can be reused). Unknown weights (no fingerprint: a hub model whose commit is unknown) never
        match, not even another unknown."""
        fingerprint = self.lm.description.get("fingerprint")
        return (
            fingerprint is not None
            and record.get("model", {}).get("fingerprint") == fingerprint
            and record.get("eval_version") == EVAL_VERSION
            and record.get("protocol") == self.protocol_record()
        )

    def _nonfinite_weights(self) -> str:
        """``"; the float weights hold N NaN/inf values (first in NAME)"`` when they do, else ``""``."""
        found = nonfinite_weights(self.lm.model)
        return f"; {found}" if found else ""

    def check(self) -> None:
        """Refuse bad input before anything is evaluated (one line each): an ``exclude`` pattern that matches no
        layer the scheme would quantise, a calibrated scheme or KV cache whose calibration split the scored split
        contains, and a KV cache whose kept positions or float residual cover the window."""
        from qbench.quant.apply import select_layers

        protocol, calibration = self.spec.protocol, self.spec.calibration
        calibrated = False
        for name in self.spec.schemes:
            if name != FLOAT_SCHEME:
                scheme = self.spec.scheme(name)
                select_layers(self.lm.model, scheme, self.spec.exclude, self.spec.allow_empty)
                if _needs_calibration(scheme):
                    calibration.check_disjoint(protocol.corpus, protocol.split, f"scheme {name}")
                    calibrated = True
        kv = self.spec.kv
        if kv_calibrated(kv):
            calibration.check_disjoint(protocol.corpus, protocol.split, f"KV scheme {kv.label}")
        if calibrated:  # text holding no window: refused now, not recorded as unsupported cells later
            calibration_text_tokens(
                self.spec,
                self.lm.tokenizer,
                self.windows.window,
                context_length(self.lm.model, self.spec.protocol.window),
            )
        check_kv_window(kv, self.windows.window)

    def identity(self, scheme_name: str | None, mode: str) -> str:
        """:func:`cell_identity` of a cell before it is evaluated (``scheme_name`` None: the float record)."""
        skeleton = {
            "model": {"name": self.name, **self.lm.description},
            "scheme": self._fp_scheme() if scheme_name is None else self.spec.scheme_record(scheme_name),
            "mode": "float" if scheme_name is None else mode,
            "kv": None if scheme_name is None else self.spec.kv_record(),
            "protocol": self.protocol_record(),
            "seed": self.spec.seed,
        }
        return cell_identity(skeleton)

    def fp_path(self) -> Path:
        """Where this model's float record is (or goes) for this protocol."""
        plain = record_path(self.spec.baseline_path or self.spec.output_path, self.name, None, None)
        return _path_for(plain, self.identity(None, "float"))

    def cell_path(self, scheme_name: str, mode: str) -> Path:
        """Where a quantised cell's record is (or goes) under ``spec.output_path``."""
        plain = record_path(self.spec.output_path, self.name, self.spec.scheme(scheme_name).name, mode)
        return _path_for(plain, self.identity(scheme_name, mode))

    def _fp_scheme(self) -> dict[str, Any]:
        return {"name": "fp", "description": f"unquantised ({self.spec.dtype})"}

    def protocol_record(self) -> dict[str, Any]:
        """The protocol as run, computed once: every cell's identity, reuse check and record read it (it hashes
        the tokenizer)."""
        if self._protocol is None:
            record = protocol_record(self.spec.protocol, self.windows, self.lm.tokenizer, self.spec.dtype)
            self._protocol = {**record, "attention_statistics": self.spec.attention}
        return dict(self._protocol)

    def fp_record(self) -> dict[str, Any]:
        """The float baseline (perplexity, outliers, massive activations), read from disk when already there."""
        if self._fp is not None:
            return self._fp
        path = self.fp_path()
        existing = _read_record(path)
        if existing and self.matches(existing) and "linear_ranges" in existing:  # older records lack them
            tokens = read_evidence(path, existing)
            if tokens is not None:  # its per-token NLL pairs with every cell's
                self._fp, self._fp_tokens, self.fp_reused = existing, tokens, True
                return existing
        start = time.perf_counter()
        ppl = perplexity(
            self.lm.model,
            self.windows,
            self.spec.protocol.batch_size,
            self.spec.device,
            keep=self.reference(),  # the cells compare with these logits: computed once, here
        )
        eval_seconds = time.perf_counter() - start
        hidden: list[list[torch.Tensor]] = []  # the outlier pass's block outputs: no second pass for massive
        outliers = outlier_metrics(
            self.lm.model,
            self.windows,
            self.spec.protocol.outlier_windows,
            attention=self.spec.attention,
            device=self.spec.device,
            hidden=hidden,
        )
        massive = massive_activations(
            self.lm.model,
            self.windows,
            self.spec.protocol.outlier_windows,
            device=self.spec.device,
            delimiter_ids=delimiter_ids(self.lm.tokenizer),
            hidden=joined_hidden(hidden),
        )
        del hidden
        ranges = linear_ranges(
            self.lm.model, self.windows, self.spec.protocol.outlier_windows, device=self.spec.device
        )
        record = self.record(
            CellResult(
                self._fp_scheme(),
                "float",
                "torch",
                ppl,
                fp_perplexity=ppl["perplexity"],
                outliers=outliers,
                wall_seconds=time.perf_counter() - start,
                eval_seconds=eval_seconds,
                model_bytes=_model_bytes(self.lm.model),
                massive=massive,
                linear=ranges,
            )
        )
        self.write(path, record)
        self._fp, self._fp_tokens = record, ppl["per_token"]
        return record

    def reference(self) -> ReferenceLogits | None:
        """The float model's logits on these windows, kept once for every cell of this model in this process
        (``qbench.eval.reference``); None where they are recomputed beside each cell instead."""
        if not self._reference_known:
            width = output_width(self.lm.model)
            self._reference = reference_store(self.lm.model, self.windows.ids, width, self.spec.device)
            self._reference_known = True
        return self._reference

    def write(self, path: Path, record: dict[str, Any]) -> None:
        """Write ``record`` to ``path`` and its per-token evidence (held since :meth:`record`) beside it, the
        sidecar first, each atomically: a record on disk always names a complete sidecar of that hash."""
        data = self._evidence.pop(record["cell_id"], None)
        if data is not None and record.get("evidence"):
            side = sidecar_path(path)
            atomic_write_bytes(side, data)
            record["evidence"]["file"] = side.name
        atomic_write_json(path, record)

    def record(self, r: CellResult) -> dict[str, Any]:
        """The JSON record of one evaluation: self-describing (module docstring), with its identity."""
        ppl, mode, status, error = r.ppl, r.mode, r.status, r.error
        value, base = ppl["perplexity"], r.fp_perplexity
        ratio = value / base if math.isfinite(value) and math.isfinite(base) and base > 0 else float("nan")
        if status == "ok" and not math.isfinite(value):
            which = "float" if mode == "float" else "quantised"
            status = "nonfinite"
            error = f"perplexity is {value} (the {which} model produced NaN/inf){self._nonfinite_weights()}"
        record = {
            "record_version": RECORD_VERSION,
            "eval_version": EVAL_VERSION,
            "cell_id": None,  # filled below from the record's own fields
            "model": {"name": self.name, **self.lm.description},
            "scheme": r.scheme,
            "kv": self._kv_block(r) if mode != "float" else None,
            "mode": mode,
            "backend": r.backend,
            "protocol": self.protocol_record(),
            "metrics": {
                "perplexity": _finite(value),
                "fp_perplexity": _finite(base),
                "ppl_ratio": _finite(ratio),
                "ppl_change_pct": _finite((ratio - 1) * 100),
                "nll": _finite(ppl["nll"]),
                "tokens": ppl["tokens"],
                "bits_per_byte": bits_per_byte(ppl["nll"] * ppl["tokens"], self.windows.scored_bytes)
                if ppl["tokens"]
                else None,
                **(
                    evidence_metrics(ppl.get("per_token"), self._fp_tokens, self.windows.clusters)
                    if status == "ok" and mode != "float"
                    else {}
                ),
            },
            "evidence": None,
            "outliers": {k: v for k, v in r.outliers.items() if k != "per_layer"},
            "outliers_per_layer": r.outliers.get("per_layer"),
            "massive_activations": r.massive,
            "linear_ranges": r.linear,
            "status": status,
            "error": error,
            "env": environment(self.spec.device),
            "seed": self.spec.seed,
            "wall_seconds": round(r.wall_seconds, 3),
            "eval_seconds": round(r.eval_seconds, 3),
            "tokens_per_second": round(ppl["tokens"] / r.eval_seconds, 1) if r.eval_seconds > 0 else None,
            "model_bytes": r.model_bytes,
            **({"calibrated": r.calibrated} if r.calibrated else {}),
            **({"artifact": r.artifact} if r.artifact else {}),
            # how the number was computed, not what it is: the same perplexity either way (qbench.eval.prefix)
            "replayed_blocks": r.replayed_blocks,
            **({"replay_fallback": r.replay_fallback} if r.replay_fallback else {}),
            "created_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        }
        record["cell_id"] = cell_identity(record)
        if status == "ok" and ppl.get("per_token"):
            data, record["evidence"] = encode_evidence(ppl["per_token"])
            self._evidence[record["cell_id"]] = data
        return record

    def quantised_record(self, scheme_name: str, mode: str) -> dict[str, Any]:
        """Quantise a copy of the model, evaluate it, and return the record (errors become records too)."""
        from qbench.quant import quantize

        fp = self.fp_record()
        scheme = self.spec.scheme(scheme_name)
        torch.manual_seed(self.spec.seed)
        start = time.perf_counter()
        base = CellResult(
            self.spec.scheme_record(scheme_name),
            mode,
            "-",
            NAN_PPL,
            fp_perplexity=fp["metrics"]["fp_perplexity"] or float("nan"),
            outliers={**fp["outliers"], "per_layer": fp.get("outliers_per_layer")},
        )
        try:
            sample = (
                self._calibration(scheme)
                if _needs_calibration(scheme) and not is_float_scheme(scheme)
                else None
            )
            qmodel = (
                self.lm.model
                if is_float_scheme(scheme)
                else quantize(
                    self.lm.model,
                    scheme,
                    mode=mode,
                    exclude=self.spec.exclude,
                    calibration=None if sample is None else sample.ids,
                    allow_empty=self.spec.allow_empty,
                    held_out=None if sample is None else sample.held_out,
                )
            )
            if sample is not None:
                base = replace(
                    base, calibrated={**sample.record, **getattr(qmodel, "qbench_calibration", {})}
                )
            base = replace(base, artifact=getattr(qmodel, "qbench_artifact", None))
            qmodel = self._with_kv(qmodel)
            base = replace(base, kv_calibration=self._calibrate_kv(qmodel))
        except (UserError, NonFiniteError) as e:  # no real kernel here / NaN or inf weights: recorded, go on
            nonfinite = isinstance(e, NonFiniteError)
            return self.record(
                replace(
                    base,
                    wall_seconds=time.perf_counter() - start,
                    status="nonfinite" if nonfinite else "unsupported",
                    error=f"{e}{self._nonfinite_weights()}" if nonfinite else str(e),
                )
            )
        eval_start = time.perf_counter()
        replayed = self.prefix.first_changed_block(qmodel) if self.prefix is not None else 0
        reference = self.reference() or self.lm.model
        try:
            ppl, replayed, fallback = self._scored(qmodel, replayed, reference)
        except NonFiniteError as e:  # NaN/inf reached a quantiser: the cell failed, the grid goes on
            return self.record(
                replace(
                    base,
                    backend=_backend(qmodel, mode),
                    wall_seconds=time.perf_counter() - start,
                    eval_seconds=time.perf_counter() - eval_start,
                    model_bytes=_model_bytes(qmodel),
                    status="nonfinite",
                    error=f"{e}{self._nonfinite_weights()}",
                )
            )
        eval_seconds = time.perf_counter() - eval_start
        return self.record(
            replace(
                base,
                backend=_backend(qmodel, mode),
                ppl=ppl,
                wall_seconds=time.perf_counter() - start,
                eval_seconds=eval_seconds,
                model_bytes=_model_bytes(qmodel),
                replayed_blocks=replayed,
                replay_fallback=fallback,
            )
        )

    def _scored(
        self, qmodel: torch.nn.Module, replayed: int, reference: Any
    ) -> tuple[dict[str, Any], int, str | None]:
        """(perplexity() of ``qmodel``, blocks replayed, why a replay was abandoned): blocks 0 .. replayed-1 start
        from the float model's stored outputs; a replay that meets other batches than it stored runs the whole
        copy instead — never a number from the wrong hidden states — and says why."""
        batch_size, device = self.spec.protocol.batch_size, self.spec.device
        fallback = None
        if replayed:
            # the batches perplexity() makes: fewer windows than --batch-size when two sets of logits exceed its
            # budget (a large vocabulary)
            rows = scoring_rows(qmodel, batch_size, self.windows.window, reference)
            try:
                with self.prefix.replay(qmodel, replayed, self.windows.ids, rows, device):
                    return (
                        perplexity(qmodel, self.windows, batch_size, device, reference=reference),
                        replayed,
                        None,
                    )
            except ReplayMismatch as e:
                fallback = str(e)
        return perplexity(qmodel, self.windows, batch_size, device, reference=reference), 0, fallback

    def _with_kv(self, model: torch.nn.Module) -> torch.nn.Module:
        """``model`` with the grid's KV-cache quantisation: a copy of the float model, or ``quantize``'s own copy
        changed in place (``qbench.quant.kv``)."""
        from qbench.quant.kv import apply_kv, attach_kv

        if self.spec.kv is None:
            return model
        if getattr(model, "qbench_artifact", None) is not None:
            raise UserError(
                "llama.cpp's file types (gguf:*) run with llama.cpp's own float32 KV cache; --kv-bits does not "
                "apply to them (score them without it)"
            )
        return apply_kv(model, self.spec.kv) if model is self.lm.model else attach_kv(model, self.spec.kv)

    def _kv_block(self, r: CellResult) -> dict[str, Any] | None:
        record = self.spec.kv_record()
        if record is not None and r.kv_calibration is not None:
            record["calibration"] = {**record["calibration"], **r.kv_calibration}
        return record

    def _calibrate_kv(self, model: torch.nn.Module) -> dict[str, Any] | None:
        """fp8 ``scale=calib``: per-layer k_scale / v_scale of ``model`` (weights as the cell quantises them, a
        float cache meanwhile) over ``KV_CALIB_WINDOWS`` train windows of the evaluation's length, batched as
        calibrated weight schemes are (``calibrate.calibration_batches``); None for any other cache."""
        from qbench.quant.calibrate import calibration_batches
        from qbench.quant.kvschemes import calibrate_kv_scales

        if not kv_calibrated(self.spec.kv):
            return None
        ids = kv_calibration_windows(
            self.lm.tokenizer, self.spec.protocol, self.windows.window, self.spec.calibration
        )
        from qbench.quant.offload import execution_device

        device = execution_device(model)
        scales = calibrate_kv_scales(model, calibration_batches(ids.to(device)))
        layers = sorted(scales)
        return {
            "tokens": int(ids.numel()),
            "k_scale": [scales[i][0] for i in layers],
            "v_scale": [scales[i][1] for i in layers],
        }

    def _calibration(self, scheme: Any) -> CalibrationSample:
        """A calibrated scheme's windows of the *train* split (never the evaluated text) and its held-out windows
        (:func:`calibration_sample`)."""
        return calibration_sample(
            self.lm.tokenizer,
            self.spec.protocol,
            self.windows.window,
            scheme,
            self.spec.calibration,
            context=context_length(self.lm.model, self.spec.protocol.window),
        )


def calibration_text_tokens(
    spec: GridSpec, tokenizer: Any, window: int, context: int | None = None
) -> tuple[str, str, int]:
    """(corpus, split, tokens it holds) of the text calibrated schemes cut their windows from, or a one-line error
    under the option that named it when that text holds no window (empty, binary, too short): calibration would
    run on nothing and the cell would be recorded as unsupported, with exit status 0."""
    from trainers.batches import window_span
    from trainers.data import token_stream

    cal, protocol = spec.calibration, spec.protocol
    window = calibration_window(cal, window, context)  # the calibration windows' length, not the evaluation's
    corpus, split = str(cal.corpus(protocol.corpus)), cal.split()
    named = f"--calib-data {corpus!r}" if cal.data is not None else f"the {split} split of {corpus!r}"
    span = window_span(window, protocol.bos)
    need = f"one calibration window takes {span} (windows of {window} tokens)"
    path = Path(corpus)
    if cal.data is not None and path.is_file():
        with path.open("rb") as f:
            binary = b"\x00" in f.read(65536)
        if binary:
            raise UserError(
                f"{named} is a binary file (it holds NUL bytes), not text: it holds no tokens, and {need}; give a "
                "UTF-8 text file"
            )
    try:
        held = len(token_stream(corpus, split, tokenizer))
    except UserError as e:
        if f"has no {split} documents" not in str(e):  # unreadable text: its own reason, under our option
            raise UserError(f"{named}: {str(e).replace('--data ', '', 1)}") from None
        held = 0
    if held < span:
        shorter = (
            "a smaller --window"
            if cal.sample == FIRST
            else "--calib-sample first, whose windows are --window long"
        )
        raise UserError(f"{named} holds {held} tokens, and {need}; give more text (or {shorter})")
    return corpus, split, held


# Calibration windows under the documents sample are min(CALIB_WINDOW, context) tokens long — the reference code's
# and llm-compressor's 2,048-token segments — whatever the evaluation's window; the first windows keep its length.
CALIB_WINDOW = 2048
# Held-out windows: one per HELD_OUT_EVERY calibration windows (at least one), drawn with them from the same text and
# never calibrated on: the algorithm's layer error on them says how its solve generalises (qbench.quant.solve).
HELD_OUT_EVERY = 8


@dataclass(frozen=True)
class CalibrationSample:
    """The windows a calibrated scheme takes (``ids``, (N, W)), the held-out windows of the same text (None when
    the text holds no more), and what the record says of them (``record``: sample, window, tokens, places)."""

    ids: torch.Tensor
    held_out: torch.Tensor | None
    record: dict[str, Any]


def calibration_window(calibration: CalibrationData, window: int, context: int | None) -> int:
    """Tokens per calibration window: min(:data:`CALIB_WINDOW`, context) for the documents sample, the
    evaluation's ``window`` for the first windows (as every calibration before the sample)."""
    if calibration.sample == FIRST:
        return window
    return min(CALIB_WINDOW, context or window)


def calibration_sample(
    tokenizer: Any,
    protocol: Protocol,
    window: int,
    scheme: Any,
    calibration: CalibrationData | None = None,
    context: int | None = None,
) -> CalibrationSample:
    """The windows a calibrated scheme uses, cut from ``calibration``'s text (default: the train split of the
    scored corpus). N is the scheme's ``calib`` count or ``--calib-tokens`` rounded up to whole windows; H =
    ⌈N / HELD_OUT_EVERY⌉ more are held out. Two rules (``--calib-sample``):

    - ``documents`` (the default): N + H windows of :func:`calibration_window` tokens drawn across the text's
      documents, stratified by source (``trainers.batches.document_windows``, seeded by ``calib_seed``, 0 when
      none) — as GPTQ's and AWQ's reference code draw random segments of a broad corpus; every H-th window of the
      draw (so every source) is held out.
    - ``first``: the first N windows of the evaluation's length (``calib_seed``: a seeded sample of N from the
      first ``POOL_FACTOR``·N), the next H held out — every record before the documents sample.

    Fewer windows when the text holds fewer (the held-out ones give way first). One definition for the harness,
    ``qbench algorithms`` and lm-eval."""
    from qbench.quant.calibrate import POOL_FACTOR, select_windows

    calibration = calibration or CalibrationData()
    length = calibration_window(calibration, window, context)
    wanted = calibration.windows(scheme.calib_count, length)
    held = -(-wanted // HELD_OUT_EVERY)
    documents = calibration.sample != FIRST
    pool = wanted + held if documents or scheme.calib_seed is None else wanted * POOL_FACTOR + held
    source = replace(
        protocol,
        corpus=calibration.corpus(protocol.corpus),
        split=calibration.split(),
        tokens=pool * length,
        window=length,
        sample=calibration.sample,
        sample_seed=(scheme.calib_seed or 0) if documents else 0,
        protocol="qbench",  # calibration text is cut into plain windows under either scoring protocol
    )
    cut = make_windows(tokenizer, source, length)
    ids = cut.ids
    n = len(ids)
    if documents:
        h = min(held, max(0, n - wanted)) if n > wanted else n // (HELD_OUT_EVERY + 1)
        picked = {min(n - 1, int((j + 0.5) * n / h)) for j in range(h)} if h else set()
        keep = [i for i in range(n) if i not in picked]
        held_ids = sorted(picked)
        place = sampled_record(replace(cut, sampled=[cut.sampled[i] for i in keep])) if cut.sampled else None
    else:
        h = min(held, max(0, n - wanted))
        chosen = select_windows(ids[: n - h] if h else ids, wanted, scheme.calib_seed)
        keep = None
        held_ids = list(range(n - h, n))
        place = None
    calib = ids[keep] if keep is not None else chosen
    record: dict[str, Any] = {
        "sample": calibration.sample,
        "window": length,
        "windows": len(calib),
        "tokens": int(calib.numel()),
        "held_out_windows": len(held_ids),
    }
    if place is not None:
        record["sampled"] = place
    return CalibrationSample(calib, ids[held_ids] if held_ids else None, record)


def kv_calibration_windows(
    tokenizer: Any, protocol: Protocol, window: int, calibration: CalibrationData | None = None
) -> torch.Tensor:
    """The windows an fp8 ``scale=calib`` cache is calibrated on: the first ``KV_CALIB_WINDOWS`` windows (or
    ``--calib-tokens``' worth) of :func:`calibration_sample`'s text, ``window`` tokens each."""
    from types import SimpleNamespace

    calibration = replace(calibration or CalibrationData(), sample=FIRST)  # as fp8 caches always calibrated
    scheme = SimpleNamespace(calib_count=KV_CALIB_WINDOWS, calib_seed=None)
    return calibration_sample(tokenizer, protocol, window, scheme, calibration).ids


def _needs_calibration(scheme: Any) -> bool:
    from qbench.quant.calibrate import needs_calibration

    return needs_calibration(scheme)


def _backend(model: torch.nn.Module, mode: str) -> str:
    from qbench.quant.apply import real_kernels

    artifact = getattr(model, "qbench_artifact", None)
    if artifact is not None:  # a gguf:* cell: llama.cpp's kernels in either mode
        return f"llama.cpp ({artifact['llama_cpp']}; {artifact['file_type']})"

    if mode == "fake":
        fmt = (getattr(model, "qbench_scheme", None) or {}).get("format", "int")
        return "fake-quant (torch.library ops)" if fmt == "int" else f"fake-quant ({fmt}, plain torch)"
    return ", ".join(real_kernels(model)) or "torch"


def _model_bytes(model: torch.nn.Module) -> int:
    from qbench.quant import model_bytes

    return model_bytes(model)


def _read_record(path: Path) -> dict[str, Any] | None:
    """The record at ``path``, or None when it is missing, torn or not a record (then recompute)."""
    try:
        record = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return record if isinstance(record, dict) and "record_version" in record else None


def unsupported_cells(spec: GridSpec) -> list[tuple[str, str, str]]:
    """(scheme, mode, why) of the cells that cannot run here: real mode without a real kernel. Static, so a
    command can refuse them before loading anything (``qbench run``) or list them (``qbench grid``)."""
    from qbench.quant.apply import real_kernel_problem

    out = []
    for scheme, mode in cells(spec):
        if mode == "real":
            problem = real_kernel_problem(spec.scheme(scheme))
            if problem is not None:
                out.append((scheme, mode, problem))
    return out


def cells(spec: GridSpec) -> list[tuple[str, str]]:
    """(scheme, mode) pairs; the ``fp`` scheme (float weights + quantised KV cache) once, in fake mode, and each
    llama.cpp file type (gguf:*) once, in real mode.

    ``fp`` without a quantised KV cache is the float baseline itself, which every grid evaluates (or reuses)
    first: it adds no cell, so ``qbench run --scheme fp`` is the way to get the float perplexity alone."""
    return [
        (scheme, mode)
        for scheme in spec.schemes
        if not (scheme == FLOAT_SCHEME and spec.kv is None)
        for mode in _modes(spec, scheme)
    ]


def _modes(spec: GridSpec, scheme: str) -> list[str]:
    """The modes ``scheme`` is evaluated in: ``fp`` once, fake; llama.cpp's file types (gguf:*) once, real —
    llama.cpp's kernels are the only way they run, so no record of them says fake."""
    if scheme == FLOAT_SCHEME:
        return ["fake"]
    if scheme.lower().startswith(GGUF_PREFIX):
        return ["real"]
    return list(spec.modes)


def run_grid(
    spec: GridSpec,
    on_record: Callable[[dict[str, Any], bool], None] | None = None,
    loaded: dict[str, LoadedModel] | None = None,
    prefix: BlockPrefix | None = None,
) -> list[dict]:
    """Evaluate every (model, scheme, mode) cell not already on disk; returns all records (fp ones first).

    ``on_record(record, reused)`` is called after each cell, for progress display. ``loaded``: models already
    in memory, by their entry in ``spec.models`` (callers that run many small grids on one model load it once).
    ``prefix``: for a grid of one model, the float block outputs its cells replay (``qbench.eval.prefix``).
    """
    if prefix is not None and len(spec.models) != 1:
        raise ValueError(
            "a replayed prefix belongs to one model: run_grid(prefix=...) takes a grid of one model"
        )

    records: list[dict] = []
    sources: dict[str, str] = {}
    for model_spec in spec.models:
        evaluation = ModelEvaluation(spec, model_spec, lm=(loaded or {}).get(model_spec), prefix=prefix)
        if sources.setdefault(evaluation.name, evaluation.lm.source) != evaluation.lm.source:
            raise UserError(
                f"two models are both named {evaluation.name!r} ({sources[evaluation.name]} and "
                f"{evaluation.lm.source}): their results would share {spec.output_path / evaluation.name}/; "
                "rename one folder or evaluate them with different --output-path"
            )
        evaluation.check()
        records.append(evaluation.fp_record())
        if on_record:
            on_record(records[-1], evaluation.fp_reused)
        for scheme, mode in cells(spec):
            record, reusable = cell_record(spec, evaluation, scheme, mode)
            records.append(record)
            if on_record:
                on_record(record, reusable)
    return records


def cell_record(spec: GridSpec, evaluation: ModelEvaluation, scheme: str, mode: str) -> tuple[dict, bool]:
    """One quantised cell: its record from disk when reusable, else evaluated and written atomically.
    Returns (record, reused). ``qbench.eval.ranks`` calls it for the cells of one rank."""
    path = evaluation.cell_path(scheme, mode)
    existing = _read_record(path)
    same_cell = (
        existing is not None
        and evaluation.matches(existing)
        and existing.get("scheme") == spec.scheme_record(scheme)
        and kv_identity(existing.get("kv")) == spec.kv_record()
    )
    # an unsupported cell is tried again every run (a kernel, library or device may have appeared since)
    reusable = same_cell and existing.get("status") != "unsupported"
    if reusable and existing.get("status") == "ok" and read_evidence(path, existing) is None:
        reusable = False  # its per-token evidence is missing or altered: the cell is redone, not trusted
    record = existing if reusable else evaluation.quantised_record(scheme, mode)
    if not reusable:
        if (
            same_cell
            and record.get("status") == existing.get("status") == "unsupported"
            and (record.get("error") == existing.get("error"))
        ):
            # refused again for the same reason: the record on disk stays as it was, its env (versions, commit)
            # that of the run that first wrote it
            return existing, False
        evaluation.write(path, record)
    return record, reusable
